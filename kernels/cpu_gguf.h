// GGUF weights multiplied as stored (cpu_gguf.cpp): the blocks of a GGUF tensor, memory-mapped, read in place.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>

#include "gguf_grids.h"

namespace edgellm {

void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
int max_threads();

// f(i0, i1) over [0, n) in runs of `run` items that every thread takes from a shared counter until none are left,
// rather than a fixed share each: the vCPUs of a shared host run at uneven speeds, and with fixed halves one waits
// at the end of every product (~5% of each thread's time in the prompt GEMM, 2 threads).  ~8 runs a thread keep the
// tail short and the atomics few.
template <class F>
inline void parallel_runs(int64_t n, const F& f) {
  const int64_t nt = std::max(1, max_threads()), run = std::max<int64_t>(1, n / (8 * nt));
  std::atomic<int64_t> next{0};
  parallel_run(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(run, std::memory_order_relaxed)) < n;) f(i0, std::min(n, i0 + run));
  });
}

// GGML type ids (gguf.GGMLQuantizationType) of the types multiplied natively.
enum GgufType { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8,
                GGUF_Q2_K = 10, GGUF_Q3_K = 11, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14,
                GGUF_IQ2_XXS = 16, GGUF_IQ3_XXS = 18, GGUF_IQ4_NL = 20, GGUF_IQ3_S = 21, GGUF_IQ4_XS = 23 };

// A type id plus GGUF_X8: that K-quant's, IQ4_XS's, Q5_0's or Q5_1's rows repacked 8 at a time (cpu_gguf_x8.cpp),
// N a multiple of 8.
constexpr int GGUF_X8 = 1000;
// A type id plus GGUF_R8: that 32-value type's rows with each run of 8 blocks regrouped (Q5_0, Q5_1; cpu_gguf.cpp
// "r8"): the same bytes per row, any N and K % 32 == 0, a row's last (K / 32) % 8 blocks as stored.
constexpr int GGUF_R8 = 2000;
inline bool gguf_is_x8(int type) { return type > GGUF_X8 && type < GGUF_R8; }
// A grid i-quant's type id (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S) plus GGUF_L4: its blocks recoded at load
// (gguf_grid_to_l4) as IQ4_XS blocks whose 4-bit codes index that type's 16 signed levels (gguf_grids.h GGUF_L4_*)
// instead of IQ4_NL's: d as stored and per 32 values the odd multiplier m (2 s + 1) as IQ4_XS's 6-bit scale m + 32;
// the kernels take (d m) 2^-p (p = 3, 2, 0, 3: gguf.quants' (d (0.5 + s)) / 4, / 2, d (1 + 2 s); IQ1_S's d (2 s + 1)
// times a level 8 (g +- 1/8)), the same rounding, so the values are gguf.quants' bit for bit.  4.25 bits a weight
// where the grids take 1.56-3.44, multiplied by the IQ4_XS kernels (one table lookup a value where a grid entry takes
// a load and a sign lookup per 8 or 4).
// (Below the x8 ids, so an L4 type has an x8 layout of its own: its id + GGUF_X8.)
constexpr int GGUF_L4 = 100;
inline bool gguf_is_l4(int type) { return type > GGUF_L4 && type < GGUF_X8; }
constexpr int GGUF_IQ2_XXS_L4 = GGUF_L4 + 16, GGUF_IQ3_XXS_L4 = GGUF_L4 + 18, GGUF_IQ3_S_L4 = GGUF_L4 + 21,
              GGUF_IQ1_S_L4 = GGUF_L4 + 19;
// IQ2_XS / IQ2_S / IQ1_M plus GGUF_L4 ("L4 per 16"): the same recoding under their scales' grain, one per 16 values,
// which IQ4_XS's layout cannot hold: d fp16 | m int8[16] (the multiplier 2 s + 1 of each 16 values) | qs[128] as
// IQ4_XS's (sub-block j: qs[16 j ..], low nibbles values 0..15, high 16..31), codes indexing IQ2_XXS's levels (the
// IQ2 grids hold the same values 8, 25, 43; IQ1_M: IQ1_S's, 8 (g +- 1/8)); w = ((d / 8) m) level, gguf.quants'
// (d (0.5 + s)) / 4 times the grid value (IQ1_M: (d m) (g +- 1/8)) bit for bit.  146 bytes per 256 values (4.56 bits a
// weight where the files take 2.31 / 2.56 / 1.75).  The kernels look the codes up as level + 64, unsigned, the 64 off
// the int sums: Q6_K's "per16" paths in cpu_gguf.cpp, IQ4_XS's x8 decode with a multiplier per 16 values.
constexpr int GGUF_IQ2_XS_L4 = GGUF_L4 + 17, GGUF_IQ2_S_L4 = GGUF_L4 + 22, GGUF_IQ1_M_L4 = GGUF_L4 + 29;
constexpr bool gguf_l4_16(int type) {
  return type == GGUF_IQ2_XS_L4 || type == GGUF_IQ2_S_L4 || type == GGUF_IQ1_M_L4;
}
constexpr int64_t GGUF_L4_16_BYTES = 146;  // per 256 values (the IQ4_XS-shaped L4 blocks: 136)
constexpr int64_t GGUF_L4_BYTES = 136;     // IQ4_XS's block
// An L4 type's block bytes (256 values), here so that the early repack library (early_repack.cpp), built without
// cpu_gguf.cpp, has it.
constexpr int64_t gguf_l4_block_bytes(int l4_type) { return gguf_l4_16(l4_type) ? GGUF_L4_16_BYTES : GGUF_L4_BYTES; }
// The GGML types that have an L4 form (IQ2_XS, IQ2_S, IQ1_M: the per-16 one)
constexpr bool gguf_l4_base(int type) {
  return type == 16 || type == 18 || type == 21 || type == 19 || type == 17 || type == 22 || type == 29;
}
// An L4 type's power of two on d m (1 for IQ4_XS), and the 16 int8 levels its 4-bit codes index (IQ4_NL's for IQ4_XS)
template <int TYPE>
constexpr float gguf_l4_scale() {
  return TYPE == GGUF_IQ2_XXS_L4 || TYPE == GGUF_IQ1_S_L4 || gguf_l4_16(TYPE) ? 0.125f
       : TYPE == GGUF_IQ3_XXS_L4 ? 0.25f : 1.0f;
}
template <int TYPE>
constexpr const int8_t* gguf_levels_of();

// IQ4_NL / IQ4_XS: the int8 level of each 4-bit code (ggml-common.h kvalues_iq4nl)
alignas(16) inline constexpr int8_t GGUF_IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                           1, 13, 25, 38, 53, 69, 89, 113};
template <int TYPE>
constexpr const int8_t* gguf_levels_of() {
  return TYPE == GGUF_IQ2_XXS_L4 || TYPE == GGUF_IQ2_XS_L4 || TYPE == GGUF_IQ2_S_L4 ? GGUF_L4_IQ2XXS
       : TYPE == GGUF_IQ3_XXS_L4 ? GGUF_L4_IQ3XXS : TYPE == GGUF_IQ3_S_L4 ? GGUF_L4_IQ3S
       : TYPE == GGUF_IQ1_S_L4 || TYPE == GGUF_IQ1_M_L4 ? GGUF_L4_IQ1S : GGUF_IQ4_LEVELS;
}

// An L4 type's levels plus 64, as u8 (|level| <= 62: unsigned codes <= 126, which maddubs takes without saturating a
// pair sum; the 64 comes off through the activations' sums). The L4-per-16 types' codes on the per16 paths, and the
// x8 decode's for the others (no sign transfer).
template <int TYPE>
struct GgufLevelsU8 {
  alignas(16) uint8_t u[16] = {};
  constexpr GgufLevelsU8() {
    for (int i = 0; i < 16; ++i) u[i] = (uint8_t)(gguf_levels_of<TYPE>()[i] + 64);
  }
};
template <int TYPE>
inline constexpr GgufLevelsU8<TYPE> GGUF_LEVELS_U8{};

// IQ4_XS block b's 6-bit scale of sub-block j (nibble j of bytes 4..7, bits 2j, 2j+1 of the u16 at 2 as bits 4-5),
// minus 32
inline int gguf_iq4xs_scale(const uint8_t* b, int j) {
  const int h = (b[2] | (b[3] << 8)) >> (2 * j) & 3;
  return ((b[4 + j / 2] >> (4 * (j & 1))) & 15 | h << 4) - 32;
}

// The grid i-quants (IQ2_XXS, IQ3_XXS, IQ3_S; gguf_grids.h has their codebooks): sub-block j (32 values) of block
// b as signed int8 codes w = +-g (the grid values with their sign bits), returning its fp32 scale, so that
// gguf.quants' value is scale * w exactly (it rounds db * g, and the sign is exact).
//   IQ2_XXS d, qs u32[16]: the pair (a0, a1) = qs[2j ..]: byte l of a0 indexes 8 values, signs GGUF_KSIGNS[(a1 >> 7l)
//           & 127], scale d (0.5 + a1 >> 28) / 4
//   IQ3_XXS d, qs[64], aux u32[8]: qs[8j + i] indexes 4 values, signs GGUF_KSIGNS[(aux_j >> 7l) & 127] for each 8,
//           scale d (0.5 + aux_j >> 28) / 2
//   IQ3_S   d, qs[64], qh[8], signs[32], scales[4]: entry qs[8j + i] | ((qh[j] >> i) & 1) << 8 (4 values), the sign
//           bits signs[4j ..], scale d (1 + 2 s_j), s_j nibble j of the scales
inline uint32_t gguf_ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint32_t gguf_ksigns32(uint32_t a) {  // the 4 sign bytes of 4 x 7 sign bits
  return GGUF_KSIGNS[a & 127] | (uint32_t)GGUF_KSIGNS[(a >> 7) & 127] << 8 |
         (uint32_t)GGUF_KSIGNS[(a >> 14) & 127] << 16 | (uint32_t)GGUF_KSIGNS[(a >> 21) & 127] << 24;
}

// the grid entries' values with sign bit v of `signs` applied to value v (32 values from 8 bytes a value-group)
inline void gguf_signed_values(const uint8_t* values, uint32_t signs, int8_t w[32]) {
  for (int v = 0; v < 32; ++v) w[v] = (int8_t)((signs >> v) & 1 ? -(int)values[v] : (int)values[v]);
}

template <int TYPE>
inline float gguf_grid_sub(const uint8_t* b, int j, float d, int8_t w[32]) {
  uint8_t values[32];
  if (TYPE == GGUF_IQ2_XXS) {
    const uint32_t a0 = gguf_ld32(b + 2 + 8 * j), a1 = gguf_ld32(b + 6 + 8 * j);
    for (int l = 0; l < 4; ++l) std::memcpy(values + 8 * l, &GGUF_IQ2XXS_GRID[(a0 >> 8 * l) & 255], 8);
    gguf_signed_values(values, gguf_ksigns32(a1), w);
    return d * (0.5f + (float)(a1 >> 28)) * 0.25f;
  }
  if (TYPE == GGUF_IQ3_XXS) {
    const uint32_t aux = gguf_ld32(b + 66 + 4 * j);
    for (int i = 0; i < 8; ++i) std::memcpy(values + 4 * i, &GGUF_IQ3XXS_GRID[b[2 + 8 * j + i]], 4);
    gguf_signed_values(values, gguf_ksigns32(aux), w);
    return d * (0.5f + (float)(aux >> 28)) * 0.5f;
  }
  const uint8_t qh = b[66 + j];  // IQ3_S
  for (int i = 0; i < 8; ++i) std::memcpy(values + 4 * i, &GGUF_IQ3S_GRID[b[2 + 8 * j + i] | ((qh >> i) & 1) << 8], 4);
  gguf_signed_values(values, gguf_ld32(b + 74 + 4 * j), w);
  return d * (float)(1 + 2 * ((b[106 + j / 2] >> 4 * (j & 1)) & 15));
}

// The 16 scales of a Q3_K super-block (its 12 packed bytes: 6 bits each, the low nibbles of scales 0..7 / 8..15 in
// bytes 0..7's low / high nibbles, the top 2 bits in bytes 8..11 at bits 2 (i / 4)), minus 32, as ggml's
// dequantize_row_q3_K unpacks them.
inline void gguf_q3k_scales(const uint8_t* packed, int8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  const uint32_t k2 = 0x0f0f0f0f, k1 = 0x03030303, hi = u[2];
  u[2] = ((u[0] >> 4) & k2) | (((hi >> 4) & k1) << 4);
  u[3] = ((u[1] >> 4) & k2) | (((hi >> 6) & k1) << 4);
  u[0] = (u[0] & k2) | ((hi & k1) << 4);
  u[1] = (u[1] & k2) | (((hi >> 2) & k1) << 4);
  uint8_t raw[16];
  std::memcpy(raw, u, 16);
  for (int i = 0; i < 16; ++i) out[i] = (int8_t)(raw[i] - 32);
}

bool gguf_supported(int type);
int64_t gguf_block_values(int type);  // 32 or 256 (0: unsupported type)
int64_t gguf_block_bytes(int type);
// (an x8 type: its bytes per row, one eighth of an 8-row group's)
inline int64_t gguf_row_bytes(int type, int64_t K) { return K / gguf_block_values(type) * gguf_block_bytes(type); }

// The activations of one input, quantized once and shared by every part of a fused linear: per row m and 32-block
// b of x [M, K], int8 q = round_half_even(x * 127 / amax), d = amax / 127, s = d * sum(q) (the weights' mins /
// offsets meet it), and the int sums of q per 16 values (Q6_K's -32 offset, per 16-value scale).  K % 32 == 0.
// The arrays live in a per-thread buffer: valid until the same thread quantizes again.
struct GgufActs {
  int64_t M = 0, K = 0, nb = 0;
  const int8_t* q = nullptr;     // [M, K]
  const float* d = nullptr;      // [M, nb]
  const float* s = nullptr;      // [M, nb]
  const int32_t* sum32 = nullptr;  // [M, nb]
  const int16_t* sum16 = nullptr;  // [M, 2 * nb]
  // from sum16, for the Q2_K / Q3_K x8 kernels (broadcast loads where they would convert per weight group):
  const float* d_sum16 = nullptr;  // [M, 2 * nb] d * sum16 (Q2_K's mins meet it)
  const int32_t* q3k_off = nullptr;  // [M, 2 * nb] -4 * sum16 as the low int16 of a dword (Q3_K's offset)
  // AVX2 builds: q again, blocks paired as cpu_kernels.cpp's int4 kernel reads them (the 64 bytes of blocks 2p,
  // 2p + 1 = [2p: x0..15 | 2p+1: x0..15 | 2p: x16..31 | 2p+1: x16..31]), so that one 32-byte load of Q4_0 / Q4_1
  // codes serves two blocks; null elsewhere
  const int8_t* q2 = nullptr;    // [M, K]
};
// paired = false: without q2 (only the row kernels read it; the prompt GEMMs do not). Rows split over threads.
GgufActs gguf_quantize_acts(const float* x, int64_t M, int64_t K, bool paired = true);

// y[m * ldy + col(n)] = sum_k x[m, k] W[n, k] for the N rows of one GGUF tensor (rows contiguous, gguf_row_bytes
// each), col(n) = out_index ? out_index[n] : n.  A row's result is bit-identical whatever M is.  Rows split over
// threads.
void gguf_gemm(const GgufActs& acts, const uint8_t* blocks, int type, int64_t N, int64_t K, float* y, int64_t ldy,
               const int32_t* out_index);

// The same product for prompt chunks (tens to hundreds of rows of x): an int8 panel GEMM (cpu_gguf.cpp, "prompt
// GEMM") that decodes each weight value once per call.  The same integer sums and fp32 scales as gguf_gemm, summed
// in another order: equal to fp32 rounding, not bit for bit (decode and verification stay on gguf_gemm).
void gguf_gemm_prompt(const GgufActs& acts, const uint8_t* blocks, int type, int64_t N, int64_t K, float* y,
                      int64_t ldy, const int32_t* out_index);
// Our int8 / int4 weights (quant/groups.py): codes int8 [N, K] or uint8 [N, K / 2] in GGUF Q4 block order, fp16
// scales (int4 asymmetric: and mins) [N, K / group], group % 32 == 0.  The same layout as Q8_0 / Q4_0 / Q4_1 blocks
// but with the scales apart.
struct QuantWeights {
  const uint8_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* mins = nullptr;  // null: symmetric (int4: code - 8)
  int bits = 4;
  int64_t group = 32;
};
// y[m * ldy + n] = x @ W^T through the prompt GEMM (W as Q8_0 / Q4_0 / Q4_1 with the scales read from their own
// arrays): the prefill of edgellm's own quantized weights, equal to the int8 / int4 kernels to fp32 rounding.
void quant_gemm_prompt(const GgufActs& acts, const QuantWeights& w, int64_t N, float* y, int64_t ldy);
// The same on AMX tiles in bf16 (gguf_gemm_amx's kernel), x as bf16 rows [Mp, K]; does nothing where not available.
void quant_gemm_amx(const uint16_t* xb, int64_t M, int64_t K, const QuantWeights& w, int64_t N, float* y, int64_t ldy);
// True where the prompt GEMM is vectorized (AVX2, AVX-512 VNNI); elsewhere it is a portable reference version.
bool gguf_prompt_gemm_fast();
// True where gguf_gemm_amx runs: an AVX-512 VNNI build on Linux x86-64, a CPU with AMX-BF16 and AVX512-BF16, and the
// kernel granting this process the tile state.
bool gguf_amx_available();
// The prompt GEMM's product in bf16 on AMX tiles: y[m * ldy + col(n)] = x @ W^T with x given as bf16 rows xb [Mp, K]
// (Mp: M rounded up to 16, rows past M zeros); fp32 sums.  Does nothing where not available.
void gguf_gemm_amx(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* blocks, int type, int64_t N, float* y,
                   int64_t ldy, const int32_t* out_index);

// W [N, K] fp32, bit-identical to gguf.quants.dequantize.
void gguf_dequantize_rows(const uint8_t* blocks, int type, int64_t N, int64_t K, float* out);
// The same values rounded to bf16 (round to nearest even, as torch's .to(bfloat16)): out uint16 [N, K].
void gguf_dequantize_rows_bf16(const uint8_t* blocks, int type, int64_t N, int64_t K, uint16_t* out);

// The grid-codebook and ternary types without a product kernel (cpu_gguf_grid.cpp: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
// IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0). `grid`: gguf.quants' grid of the type as int8 [entries, 8 or 4] (none for
// TQ), `ksigns`: its 128 sign bytes (IQ2_XXS, IQ2_XS, IQ3_XXS).
struct GridTables {
  const int8_t* grid = nullptr;
  const uint8_t* ksigns = nullptr;
};
// Rows of IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S blocks -> the same rows as GGUF_L4 blocks (136 bytes per 256 values),
// IQ2_XS / IQ2_S / IQ1_M rows as L4-per-16 blocks (146), the values bit for bit; false for another type or missing
// tables. `tables`: IQ1_S's, IQ1_M's, IQ2_S's grid, IQ2_XS's grid and sign bytes (the others' codebooks are
// gguf_grids.h's).
bool gguf_grid_to_l4(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables, uint8_t* out);
// The same rows straight into the L4 type's x8 layout (N % 8 == 0; no whole-tensor L4 copy on the way).
bool gguf_grid_to_l4_x8(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables, uint8_t* x8);
// TQ1_0 / TQ2_0 blocks -> Q2_K blocks (84 bytes each) of the same values bit for bit: codes digit + 1 in Q2_K's
// order, each 16 values' scale and min 1, d and dmin the block's d (3 d is exact in fp32 for an fp16 d); false for
// another type.
bool gguf_ternary_to_q2_k(const uint8_t* blocks, int type, int64_t nblocks, uint8_t* out);
// IQ1_S / IQ1_M blocks -> Q6_K blocks (210 bytes each) of the same values bit for bit: codes 8 (g +- 1/8) + 32, each
// 16 values' int8 scale 2 s + 1, d / 8 as Q6_K's d (tables.grid: the type's grid). False for another type, or where a
// block's d / 8 is not an fp16 (below 2^-11 or so; `out` then holds nothing usable).
bool gguf_iq1_to_q6_k(const uint8_t* blocks, int type, int64_t nblocks, const GridTables& tables, uint8_t* out);
// Bytes of a row of K values of such a type (0: not one of them, or K % 256 != 0).
int64_t gguf_grid_row_bytes(int type, int64_t K);
// Rows of such blocks -> fp32 [N, K] (`out`; gguf.quants.dequantize's values) and / or Q8_0 blocks [N, K / 32 x 34
// bytes] (`q8_0`; gguf.quants.quantize's rounding of those values); either may be null.
void gguf_grid_rows(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables, float* out,
                    uint8_t* q8_0);

// The x8 layout (cpu_gguf_x8.cpp): whether this build multiplies it for a base type (the K-quants Q2_K .. Q6_K, Q5_0,
// Q5_1 with the AVX2 kernels), its bytes per unit of 8 rows x the type's block (256 values, Q5_0 / Q5_1: 32; 0: no x8
// layout), the conversions either way (N % 8 == 0, K a multiple of the block; bit for bit), and the product, as
// gguf_gemm (rows' results bit-identical whatever M).
bool gguf_x8_supported(int base_type);
int64_t gguf_x8_bytes(int base_type);
void gguf_repack_x8(const uint8_t* raw, int base_type, int64_t N, int64_t K, uint8_t* x8);
void gguf_unrepack_x8(const uint8_t* x8, int base_type, int64_t N, int64_t K, uint8_t* raw);
// One group of 8 x8 rows back to their stored blocks, on the calling thread (raw: 8 stored rows).
void gguf_unrepack_x8_group(const uint8_t* x8, int base_type, int64_t K, uint8_t* raw);
void gguf_gemm_x8(const GgufActs& acts, const uint8_t* x8, int base_type, int64_t N, float* y, int64_t ldy,
                  const int32_t* out_index);
// The r8 layout: whether this build multiplies it for a base type (Q5_0, Q5_1 with the AVX2 kernels), and the
// conversion either way (bit for bit; rows independent).
bool gguf_r8_supported(int base_type);
void gguf_convert_r8(const uint8_t* src, int base_type, int64_t N, int64_t K, uint8_t* dst, bool to_r8);
// One x8 unit (8 rows x 256 values; Q5_0 / Q5_1: x 32, one sub-block) as the prompt GEMM's panels hold it (AVX2
// builds): the u8 codes of sub-block j, 4-value group g, rows 0..7 (32 bytes) at codes + (8 j + g) * cstride; the fp32
// scales d sc of sub-block j (Q6_K / Q3_K / Q2_K: of 16-value sub-block t; Q5_0 / Q5_1: d) at ws + j (t) * wstride,
// and -(dmin m) at wm + j (Q2_K: t) * wstride (Q4_K / Q5_K / Q2_K; Q5_1: m).
void gguf_x8_panel_sb(const uint8_t* sb, int base_type, uint8_t* codes, int64_t cstride, float* ws, float* wm,
                      int64_t wstride);

}  // namespace edgellm
