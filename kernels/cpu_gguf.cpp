// GGUF blocks multiplied in place, bit for bit as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (blocks of 32 values)
// and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S (super-blocks of 256; the grid i-quants' layouts
// in cpu_gguf.h, and their L4 recoding, which the loader uses on the CPU), y = x @ W^T for small M (decode, verification), and W
// dequantized to fp32 exactly as gguf.quants.dequantize does (embedding rows, the big-prefill GEMM).
//
// Block layouts (ggml-common.h; gguf/quants.py has the numpy reference):
//   Q4_0  d fp16, qs[16]             w = d (q - 8)        q = qs[l] & 15 (value l), qs[l] >> 4 (value l + 16)
//   Q4_1  d, m fp16, qs[16]          w = d q + m
//   Q5_0  d, qh u32, qs[16]          w = d (q - 16)       q = nibble | bit l of qh << 4
//   Q5_1  d, m, qh, qs[16]           w = d q + m
//   Q8_0  d, qs int8[32]             w = d q
//   IQ4_NL d, qs[16]                 w = d kv[q]          q: nibbles as Q4_0's; kv: the 16 non-uniform int8 levels
//   IQ4_XS d fp16, scales_h u16, scales_l[4], qs[128]: sub-block j (32 values) has the nibbles of qs[16 j ..] as
//         Q4_0's and the 6-bit scale ls_j = (scales_l[j/2] >> 4 (j&1)) & 15 | ((scales_h >> 2j) & 3) << 4;
//         w = (d (ls_j - 32)) kv[q].  Both IQ4 types' codes kv[q] are signed int8: they take Q8_0's paths
//   Q4_K  d, dmin fp16, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]: sub-block j (32 values) = the
//         low (j even) / high (j odd) nibbles of qs[32 (j/2) ..]; w = (d sc_j) q - (dmin m_j)
//   Q5_K  as Q4_K, plus qh[32]: bit j of qh[l] is bit 4 of sub-block j's value l
//   Q6_K  ql[128], qh[64], scales int8[16], d fp16: value 128h + 32j + l = (ql[64h + 32 (j&1) + l] >> 4 (j>>1)
//         & 15) | ((qh[32h + l] >> 2j) & 3) << 4, minus 32; w = (d sc_(v/16)) q
//   Q3_K  hmask[32], qs[64], scales[12] (16 x 6-bit, minus 32), d fp16: sub-block j = 4n + i (32 values) has value
//         l = (qs[32n + l] >> 2i) & 3 | (bit j of hmask[l]) << 2, minus 4; w = (d sc_(v/16)) q.  Q6_K's shape with
//         3-bit codes: both take the "per16" paths (int scale per 16 values, offset off the integer sums)
//   Q2_K  scales[16] (4-bit scale | 4-bit min << 4, per 16 values), qs[64], d, dmin fp16: sub-block j = 4n + i has
//         value l = (qs[32n + l] >> 2i) & 3; w = (d sc_(v/16)) q - (dmin m_(v/16)).  Also "per16", with a min per 16
//         values ("min16"): d_x dmin sum(m sum(q_x)) comes off as one more integer sum per sub-block
//
// The product (llama.cpp's approach, as cpu_kernels.cpp's int4/int8 kernels): every 32 values of x are rounded to
// int8 with one fp32 scale d_x = max|x| / 127 (GgufActs, computed once per input and shared by the parts of a
// fused linear), the weight codes meet them in exact integer dot products, and each 32-value sub-block's int32
// sum is scaled in fp32: acc += isum * (w_scale * d_x) (+ w_min * d_x sum(q_x)).  Per-32 activation scales
// rather than llama.cpp's Q8_K (one scale per 256): the same activation blocks then serve the 32-block types and
// the K-quants alike, and round x no coarser than the existing int kernels do (2^-8 of each 32 values' largest,
// not of each 256's).  The cost is one fp32 FMA per 32 values and row (the AVX2 kernel does 8 at once per
// super-block), which the memory-bound decode does not see: benchmarks/gguf_kernels_cpu.py.
//
// Offsets: Q4_0 / Q5_0's -8 / -16 and Q6_K / Q3_K's -32 / -4 come off the integer sums exactly (8 sum(q_x) per
// block; 32 (4) sum(sc q_x) over each 16 values), so the unsigned codes go straight into maddubs / vpdpbusd.
//
// Bit-identity across M: every (weight row, activation row) pair runs the same integer and float operations in
// the same order whatever the number of activation rows (a tile of T rows only shares the weights' decoding),
// so the rows of a T-token verification pass equal T one-token passes bit for bit.  The AVX-512 VNNI build uses
// vpdpbusd where AVX2 uses maddubs + madd: the same integer sums (nothing saturates: |pair sum| <= 2 * 63 * 127),
// hence the same bits.
#include "cpu_gguf.h"
#include "amx_tiles.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "gguf_low_k_codes.h"
#include "half.h"
#include "simd_transpose.h"

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__) && (defined(_MSC_VER) || (defined(__FMA__) && defined(__F16C__)))
#define EDGELLM_G_AVX2 1
#include <immintrin.h>
#if defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include "dpbusd256.h"
#ifdef EDGELLM_DPBUSD256  // AVX-512 VNNI, or AVX-VNNI on an AVX2 machine: the ymm paths' integer dots
#define EDGELLM_G_VNNI 1
#endif
#elif !defined(EDGELLM_FORCE_SCALAR) && (defined(__aarch64__) || defined(_M_ARM64))
#define EDGELLM_G_NEON 1
#include <arm_neon.h>
#endif

namespace edgellm {

namespace {

constexpr int64_t QK = 32;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// A product that the compiler may not fuse with the following add (gguf.quants rounds twice).
inline float no_contract(float v) {
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+x"(v));
#endif
  return v;
}

inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);  // into L2 (T1): see cpu_gguf_x8.cpp prefetch_sb
#else
  (void)p;
#endif
}

// The stream of rows is prefetched this far ahead (as cpu_kernels.cpp measured for its rows: the hardware
// prefetcher stops at each 4 KiB page).
constexpr int64_t PREFETCH_BYTES = 4096;

// ------------------------------------------------------------------------------------------------ formats
template <int TYPE> struct Fmt;
template <> struct Fmt<GGUF_Q4_0> { static constexpr int64_t QV = 32, BYTES = 18; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_Q4_1> { static constexpr int64_t QV = 32, BYTES = 20; static constexpr bool MIN = true; };
template <> struct Fmt<GGUF_Q5_0> { static constexpr int64_t QV = 32, BYTES = 22; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_Q5_1> { static constexpr int64_t QV = 32, BYTES = 24; static constexpr bool MIN = true; };
template <> struct Fmt<GGUF_Q8_0> { static constexpr int64_t QV = 32, BYTES = 34; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_Q4_K> { static constexpr int64_t QV = 256, BYTES = 144; static constexpr bool MIN = true; };
template <> struct Fmt<GGUF_Q5_K> { static constexpr int64_t QV = 256, BYTES = 176; static constexpr bool MIN = true; };
template <> struct Fmt<GGUF_Q6_K> { static constexpr int64_t QV = 256, BYTES = 210; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_Q3_K> { static constexpr int64_t QV = 256, BYTES = 110; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_Q2_K> { static constexpr int64_t QV = 256, BYTES = 84; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ4_NL> { static constexpr int64_t QV = 32, BYTES = 18; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ4_XS> { static constexpr int64_t QV = 256, BYTES = 136; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ2_XXS> { static constexpr int64_t QV = 256, BYTES = 66; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ3_XXS> { static constexpr int64_t QV = 256, BYTES = 98; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ3_S> { static constexpr int64_t QV = 256, BYTES = 110; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ2_XXS_L4> : Fmt<GGUF_IQ4_XS> {};  // (cpu_gguf.h GGUF_L4: IQ4_XS blocks, the type's levels)
template <> struct Fmt<GGUF_IQ3_XXS_L4> : Fmt<GGUF_IQ4_XS> {};
template <> struct Fmt<GGUF_IQ3_S_L4> : Fmt<GGUF_IQ4_XS> {};
template <> struct Fmt<GGUF_IQ1_S_L4> : Fmt<GGUF_IQ4_XS> {};
template <> struct Fmt<GGUF_IQ2_XS_L4> { static constexpr int64_t QV = 256, BYTES = GGUF_L4_16_BYTES; static constexpr bool MIN = false; };
template <> struct Fmt<GGUF_IQ2_S_L4> : Fmt<GGUF_IQ2_XS_L4> {};
template <> struct Fmt<GGUF_IQ1_M_L4> : Fmt<GGUF_IQ2_XS_L4> {};

// Q6_K, Q3_K, Q2_K, the L4-per-16 types: an int scale per 16 values and one fp16 d per super-block; the codes'
// offset (32 / 4 / none / 64) as a shift.  Q2_K: and a min per 16 values (fp16 dmin times a 4-bit m).
constexpr bool per16(int type) {
  return type == GGUF_Q6_K || type == GGUF_Q3_K || type == GGUF_Q2_K || gguf_l4_16(type);
}
// The L4 types of IQ4_XS's shape (cpu_gguf.h GGUF_L4; the L4-per-16 ones take the per16 paths)
constexpr bool is_l4(int type) { return type > GGUF_L4 && type < GGUF_X8 && !gguf_l4_16(type); }
constexpr bool grid_iquant(int type) { return type == GGUF_IQ2_XXS || type == GGUF_IQ3_XXS || type == GGUF_IQ3_S; }
// Types whose codes are signed int8 (Q8_0's, the IQ4 types' looked-up levels): dot products by sign transfer
// (|w| against x with w's sign) where the others' unsigned codes go straight into maddubs
constexpr bool signed_codes(int type) {
  return type == GGUF_Q8_0 || type == GGUF_IQ4_NL || type == GGUF_IQ4_XS || grid_iquant(type) || is_l4(type);
}
constexpr bool min16(int type) { return type == GGUF_Q2_K; }
constexpr int per16_off_shift(int type) {
  return type == GGUF_Q6_K ? 5 : type == GGUF_Q3_K ? 2 : gguf_l4_16(type) ? 6 : -1;
}

// r8 (gguf_convert_r8): each run of 8 blocks of a Q5_0 / Q5_1 row regrouped into one chunk of the same bytes: the 8
// fp16 d's (Q5_1: then the 8 m's), 32 bytes of fifth bits (bit j of byte l: lane l of the chunk's code vector j, as
// decode_chunk builds them), then the low nibbles of blocks 2k and 2k + 1 side by side (16 + 16 bytes, k = 0..3) as
// the paired Q4_0 / Q4_1 decode reads them.  Stored, a block's fifth bits take a broadcast, a shuffle, an and, a
// compare and an and to reach its codes; regrouped, a shift, an and and an or, and the nibbles of two blocks one
// load.  A row's blocks after its last full chunk stay as stored.
constexpr int GGUF_Q5_0_R8 = GGUF_R8 + GGUF_Q5_0, GGUF_Q5_1_R8 = GGUF_R8 + GGUF_Q5_1;
template <> struct Fmt<GGUF_Q5_0_R8> : Fmt<GGUF_Q5_0> {};
template <> struct Fmt<GGUF_Q5_1_R8> : Fmt<GGUF_Q5_1> {};
constexpr bool is_r8(int type) { return type > GGUF_R8; }
constexpr int stored_of(int type) { return is_r8(type) ? type - GGUF_R8 : type; }  // the layout a block is in as stored

// The 6-bit scales and mins of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4), as bytes: out[0..7] the
// scales, out[8..15] the mins.
inline void kquant_scales(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_lo = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_lo;
  u[0] &= k1;
  std::memcpy(out, u, 16);
}

// The 16 scales of a per16 super-block as int8 (Q3_K's: gguf_q3k_scales), and its d (L4 per 16: d / 8).
template <int TYPE>
inline void per16_scales(const uint8_t* b, int8_t out[16]) {
  if (TYPE == GGUF_Q6_K || gguf_l4_16(TYPE)) {
    std::memcpy(out, b + (TYPE == GGUF_Q6_K ? 192 : 2), 16);
  } else if (TYPE == GGUF_Q2_K) {
    for (int i = 0; i < 16; ++i) out[i] = (int8_t)(b[i] & 15);
  } else {
    gguf_q3k_scales(b + 96, out);
  }
}

template <int TYPE>
inline float per16_d(const uint8_t* b) {
  if (gguf_l4_16(TYPE)) return f16(b) * 0.125f;  // (exact)
  return f16(b + (TYPE == GGUF_Q6_K ? 208 : TYPE == GGUF_Q3_K ? 108 : 80));
}

// A Q2_K super-block as gguf.quants dequantizes it: per 16 values (d sc) q - (dmin m), each product rounded on its
// own.  Sub-blocks of 16 in the order (half n, shift j, part h) of llama.cpp's dequantize_row_q2_K: the codes of
// value l are bits 2j of qs[32 n + 16 h + l].
inline void dequant_q2_k(const uint8_t* b, float* y) {
  const uint8_t* qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int n = 0; n < 2; ++n)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const uint8_t sc = b[8 * n + 2 * j + h];
        const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = no_contract(dl * (float)((qs[32 * n + 16 * h + l] >> (2 * j)) & 3)) - ml;
      }
}

// Sub-block j (32 values) of block b, portably: the codes as int8 (offsets already taken off for Q4_0 / Q5_0 /
// Q6_K / Q3_K), the fp32 scale (times the int sum), the min (times d_x sum(q_x); 0 where none) and, for the per16
// types, the two int scales of its 16-value halves in sc2[0..1] (Q2_K: fm = dmin, and the two mins in sc2[2..3]).
template <int TYPE>
inline void decode_sub(const uint8_t* b, int j, int8_t w[32], float* fs, float* fm, int sc2[4]) {
  *fm = 0.0f;
  if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q4_1) {
    const uint8_t* qs = b + (TYPE == GGUF_Q4_0 ? 2 : 4);
    const int off = TYPE == GGUF_Q4_0 ? 8 : 0;
    for (int l = 0; l < 16; ++l) {
      w[l] = (int8_t)((qs[l] & 15) - off);
      w[l + 16] = (int8_t)((qs[l] >> 4) - off);
    }
    *fs = f16(b);
    if (TYPE == GGUF_Q4_1) *fm = f16(b + 2);
  } else if (TYPE == GGUF_Q5_0 || TYPE == GGUF_Q5_1) {
    const int o = TYPE == GGUF_Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + o, 4);
    const uint8_t* qs = b + o + 4;
    const int off = TYPE == GGUF_Q5_0 ? 16 : 0;
    for (int l = 0; l < 16; ++l) {
      w[l] = (int8_t)(((qs[l] & 15) | (((qh >> l) & 1) << 4)) - off);
      w[l + 16] = (int8_t)(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - off);
    }
    *fs = f16(b);
    if (TYPE == GGUF_Q5_1) *fm = f16(b + 2);
  } else if (TYPE == GGUF_Q8_0) {
    std::memcpy(w, b + 2, 32);
    *fs = f16(b);
  } else if (TYPE == GGUF_IQ4_NL || TYPE == GGUF_IQ4_XS || is_l4(TYPE) || gguf_l4_16(TYPE)) {
    // the 16 codes of qs as their levels (L4 per 16: after d and its 16 multipliers)
    const uint8_t* qs = TYPE == GGUF_IQ4_NL ? b + 2 : b + (gguf_l4_16(TYPE) ? 18 : 8) + 16 * j;
    const int8_t* levels = gguf_levels_of<TYPE>();
    for (int l = 0; l < 16; ++l) {
      w[l] = levels[qs[l] & 15];
      w[l + 16] = levels[qs[l] >> 4];
    }
    if (gguf_l4_16(TYPE)) {
      sc2[0] = (int8_t)b[2 + 2 * j];
      sc2[1] = (int8_t)b[3 + 2 * j];
      *fs = per16_d<TYPE>(b);
    } else {
      *fs = TYPE == GGUF_IQ4_NL ? f16(b) : f16(b) * (float)gguf_iq4xs_scale(b, j);
      if (gguf_l4_scale<TYPE>() != 1.0f) *fs *= gguf_l4_scale<TYPE>();
    }
  } else if (grid_iquant(TYPE)) {
    *fs = gguf_grid_sub<TYPE>(b, j, f16(b), w);
  } else if (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
    uint8_t sm[16];
    kquant_scales(b + 4, sm);
    const uint8_t* qs = b + (TYPE == GGUF_Q4_K ? 16 : 48) + 32 * (j / 2);
    const int shift = (j & 1) * 4;
    for (int l = 0; l < 32; ++l) {
      int q = (qs[l] >> shift) & 15;
      if (TYPE == GGUF_Q5_K) q |= ((b[16 + l] >> j) & 1) << 4;
      w[l] = (int8_t)q;
    }
    *fs = f16(b) * (float)sm[j];
    *fm = -(f16(b + 2) * (float)sm[8 + j]);
  } else if (TYPE == GGUF_Q3_K) {
    const uint8_t* qs = b + 32 + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)((((qs[l] >> shift) & 3) | (((b[l] >> j) & 1) << 2)) - 4);
    int8_t sc[16];
    per16_scales<GGUF_Q3_K>(b, sc);
    sc2[0] = sc[2 * j];
    sc2[1] = sc[2 * j + 1];
    *fs = f16(b + 108);
  } else if (TYPE == GGUF_Q2_K) {
    const uint8_t* qs = b + 16 + 32 * (j / 4);
    const int shift = 2 * (j % 4);
    for (int l = 0; l < 32; ++l) w[l] = (int8_t)((qs[l] >> shift) & 3);
    sc2[0] = b[2 * j] & 15;
    sc2[1] = b[2 * j + 1] & 15;
    sc2[2] = b[2 * j] >> 4;
    sc2[3] = b[2 * j + 1] >> 4;
    *fs = f16(b + 80);
    *fm = f16(b + 82);
  } else {  // Q6_K
    const int h = j / 4, jj = j % 4;
    const uint8_t* ql = b + 64 * h + 32 * (jj & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int shift = (jj >> 1) * 4;
    for (int l = 0; l < 32; ++l)
      w[l] = (int8_t)((((ql[l] >> shift) & 15) | (((qh[l] >> (2 * jj)) & 3) << 4)) - 32);
    sc2[0] = (int8_t)b[192 + 2 * j];
    sc2[1] = (int8_t)b[192 + 2 * j + 1];
    *fs = f16(b + 208);
  }
}

// ------------------------------------------------------------------------------------------------ activations
// Quantize one block of 32 floats into q[0..31]; returns d, stores sum(q) and its two 16-value halves.
inline float quantize_block32(const float* x, int8_t* q, int32_t* sum, int16_t* s16) {
#ifdef EDGELLM_G_AVX2
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24);
  const __m256 sgn = _mm256_set1_ps(-0.0f);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sgn, v0), _mm256_andnot_ps(sgn, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sgn, v2), _mm256_andnot_ps(sgn, v3)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
  const __m256i lo = _mm256_add_epi32(i0, i1), hi = _mm256_add_epi32(i2, i3);
  // [lo lanes 0-3 + 4-7 | hi lanes 0-3 + 4-7] then two horizontal steps: [sum lo, sum hi] in lanes 0 and 1
  __m128i s = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)),
                             _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
  s = _mm_hadd_epi32(s, s);
  const int32_t a = _mm_cvtsi128_si32(s), c = _mm_extract_epi32(s, 1);
  s16[0] = (int16_t)a;
  s16[1] = (int16_t)c;
  *sum = a + c;
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, p);
  return amax / 127.0f;
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t h[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    const int v = (int)std::nearbyint(x[i] * id);
    q[i] = (int8_t)v;
    h[i / 16] += v;
  }
  s16[0] = (int16_t)h[0];
  s16[1] = (int16_t)h[1];
  *sum = h[0] + h[1];
  return amax / 127.0f;
#endif
}

uint8_t* acts_buffer(size_t bytes) {
  static thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

// ------------------------------------------------------------------------------------------------ portable
// One weight row against activation rows m0 .. m0+T-1 (T <= 16), sub-block by sub-block: decode the codes once,
// one integer dot per activation row, one fp32 FMA (+ one for the min) per 32 values.
inline int32_t dot32(const int8_t* w, const int8_t* x) {
#if defined(EDGELLM_G_NEON)
  int32x4_t acc = vdupq_n_s32(0);
  for (int h = 0; h < 2; ++h) {
    const int8x16_t a = vld1q_s8(w + 16 * h), b = vld1q_s8(x + 16 * h);
#if defined(__ARM_FEATURE_DOTPROD)
    acc = vdotq_s32(acc, a, b);
#else
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));  // |w x| <= 128 * 127: two fit int16
    p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));
    acc = vpadalq_s16(acc, p);
#endif
  }
  return vaddvq_s32(acc);
#else
  int32_t s = 0;
  for (int l = 0; l < 32; ++l) s += (int32_t)w[l] * x[l];
  return s;
#endif
}

inline int32_t dot16(const int8_t* w, const int8_t* x) {  // (the per16 types' codes: |w| <= 43)
#if defined(EDGELLM_G_NEON)
  const int8x16_t a = vld1q_s8(w), b = vld1q_s8(x);
#if defined(__ARM_FEATURE_DOTPROD)
  return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), a, b));
#else
  const int16x8_t p = vmlal_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), vget_high_s8(a), vget_high_s8(b));
  return vaddlvq_s16(p);  // two products a lane: |.| <= 2 * 43 * 128
#endif
#else
  int32_t s = 0;
  for (int l = 0; l < 16; ++l) s += (int32_t)w[l] * x[l];
  return s;
#endif
}

template <int TYPE>
void row_portable(const GgufActs& a, int64_t m0, int64_t T, const uint8_t* row, float* y, int64_t ldy, int64_t col) {
  using F = Fmt<TYPE>;
  const int64_t K = a.K, nblk = K / F::QV;
  constexpr int SUBS = (int)(F::QV / QK);
  float acc[16];
  for (int64_t t = 0; t < T; ++t) acc[t] = 0.0f;
  alignas(16) int8_t w[32];
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const uint8_t* b = row + bi * F::BYTES;
    for (int j = 0; j < SUBS; ++j) {
      float fs, fm;
      int sc2[4] = {0, 0, 0, 0};
      decode_sub<TYPE>(b, j, w, &fs, &fm, sc2);
      const int64_t blk = bi * SUBS + j;  // 32-value block of x
      for (int64_t t = 0; t < T; ++t) {
        const int64_t m = m0 + t;
        const int8_t* xq = a.q + m * K + blk * QK;
        const int32_t isum =
            per16(TYPE) ? sc2[0] * dot16(w, xq) + sc2[1] * dot16(w + 16, xq + 16) : dot32(w, xq);
        acc[t] += (float)isum * (fs * a.d[m * a.nb + blk]);
        if (F::MIN) acc[t] += fm * a.s[m * a.nb + blk];
        if (min16(TYPE)) {
          const int16_t* s16 = a.sum16 + 2 * (m * a.nb + blk);
          acc[t] -= (float)(sc2[2] * s16[0] + sc2[3] * s16[1]) * (fm * a.d[m * a.nb + blk]);
        }
      }
    }
  }
  for (int64_t t = 0; t < T; ++t) y[(m0 + t) * ldy + col] = acc[t];
}

#ifdef EDGELLM_G_AVX2
// ================================================================================================ AVX2 / VNNI
// A super-block of 256 values (or 8 blocks of 32) at a time: the 8 sub-blocks' codes as u8 vectors in x's order,
// one integer dot per sub-block and activation row, the 8 sums reduced into one int32 vector (lane j = sub-block
// j), then one convert and one FMA with [w_scale_j * d_x_j] for all 8 (and one for the mins).

inline __m256i dot_u8s8(__m256i u, __m256i x) {  // int32 lanes, 4 products each (exact)
  return dot4_u8s8(_mm256_setzero_si256(), u, x);
}

// lane j = the sum of p[j]'s 8 lanes
inline __m256i reduce8(const __m256i p[8]) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);  // [lows 0-3 | highs 0-3]
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The same for int16 pair sums (maddubs of codes <= 31): two levels of hadd_epi16 stay in int16 (8 products,
// |.| <= 8 * 31 * 127 = 31496), then madd with ones widens to int32 (16 products) before the last level.  Four
// fewer instructions per 8 sub-blocks than widening each one first, and the same integers.
inline __m256i reduce8_i16(const __m256i p[8]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i h01 = _mm256_hadd_epi16(p[0], p[1]), h23 = _mm256_hadd_epi16(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi16(p[4], p[5]), h67 = _mm256_hadd_epi16(p[6], p[7]);
  const __m256i a = _mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), ones);  // [lows 0-3 | highs 0-3], int32
  const __m256i b = _mm256_madd_epi16(_mm256_hadd_epi16(h45, h67), ones);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> values 0..15 (low nibbles) | 16..31 (high)
  // one broadcast load, the upper copy shifted by 4 (bits crossing bytes are masked off)
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qs));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The first 4 bytes of 8 blocks (d, or d | m << 16) as one vector of dwords (dword loads inserted from memory:
// fewer instructions than assembling fp16 in general registers, and no store-forwarding stall)
inline int32_t ld32(const uint8_t* p) { return (int32_t)gguf_ld32(p); }

inline __m256i heads8(const uint8_t* p, int64_t stride) {
  __m128i a = _mm_cvtsi32_si128(ld32(p)), b = _mm_cvtsi32_si128(ld32(p + 4 * stride));
  a = _mm_insert_epi32(a, ld32(p + stride), 1);
  b = _mm_insert_epi32(b, ld32(p + 5 * stride), 1);
  a = _mm_insert_epi32(a, ld32(p + 2 * stride), 2);
  b = _mm_insert_epi32(b, ld32(p + 6 * stride), 2);
  a = _mm_insert_epi32(a, ld32(p + 3 * stride), 3);
  b = _mm_insert_epi32(b, ld32(p + 7 * stride), 3);
  return _mm256_set_m128i(b, a);
}

// fp16 halves of 8 dwords as fp32: the low (high = false) or high halves
template <bool HIGH>
inline __m256 halves_of(__m256i dw) {
  const __m256i pick = HIGH ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                               2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                            : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dw, pick), 0x08);  // qwords 0, 2 -> low lane
  return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

inline __m256i bits32(const uint8_t* qh) {  // 32 bits -> byte l = 0x10 where bit l is set
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

// IQ4 codes 0..15 -> their int8 levels (one in-lane table lookup)
template <int TYPE = GGUF_IQ4_XS>
inline __m256i iq4_levels(__m256i codes) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)gguf_levels_of<TYPE>())), codes);
}

// The codes of 32-value block b of a 32-block type as u8 in x's order (Q8_0, IQ4_NL: int8 codes / levels).
template <int TYPE>
inline __m256i codes32(const uint8_t* b) {
  if constexpr (is_r8(TYPE)) return codes32<stored_of(TYPE)>(b);  // a row's tail blocks
  if (TYPE == GGUF_Q4_0) return nibbles32(b + 2);
  if (TYPE == GGUF_Q4_1) return nibbles32(b + 4);
  if (TYPE == GGUF_Q5_0) return _mm256_or_si256(nibbles32(b + 6), bits32(b + 2));
  if (TYPE == GGUF_Q5_1) return _mm256_or_si256(nibbles32(b + 8), bits32(b + 4));
  if (TYPE == GGUF_IQ4_NL) return iq4_levels(nibbles32(b + 2));
  return _mm256_loadu_si256((const __m256i*)(b + 2));  // Q8_0
}

// The grid i-quants' sign bits as bytes for _mm256_sign_epi8: bytes[i] holds +1 or -1 (0x01 / 0xFF) for each of
// the 8 bits of i (bit v: byte v); KSIGN_BYTES for the 7-bit indices into GGUF_KSIGNS (IQ2_XXS, IQ3_XXS).
struct SignBytes {
  long long bytes[256] = {};
  constexpr explicit SignBytes(bool ksigns) {
    for (int i = 0; i < (ksigns ? 128 : 256); ++i) {
      const unsigned bits = ksigns ? GGUF_KSIGNS[i] : (unsigned)i;
      unsigned long long v = 0;
      for (int k = 0; k < 8; ++k) v |= (unsigned long long)((bits >> k) & 1 ? 0xFF : 0x01) << (8 * k);
      bytes[i] = (long long)v;
    }
  }
};
inline constexpr SignBytes SIGN_BYTES{false}, KSIGN_BYTES{true};

// One decoded super-block (or chunk of 8 blocks): codes, per-sub-block scales and mins, Q6_K's int16 scales.
struct Chunk {
  __m256i u[8];
  __m256 fs, fm;
  __m256i sc16[8];  // per16 types: [sc_2j x8 | sc_2j+1 x8]; grid i-quants: sub-block j's signs, +-1 bytes
  __m256i scall;    // per16 types: the 16 scales as int16
  __m256i mall;     // Q2_K: the 16 mins as int16 (fm: -dmin)
};

// u[2k] / u[2k+1] = the low / high nibbles of qs[32 k .. 32 k + 32), k = 0..3, and where qhp is given, bit 2k / 2k+1
// of each of its 32 bytes as their bit 4 (16-bit shifts: the bits crossing bytes miss bit 4).  Q4_K / Q5_K, r8.
inline void nibble_codes(const uint8_t* qs, const uint8_t* qhp, Chunk& ch) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
  const __m256i qh = qhp ? _mm256_loadu_si256((const __m256i*)qhp) : _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * k));
    ch.u[2 * k] = _mm256_and_si256(v, m4);
    ch.u[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (qhp) {
      const int i0 = 2 * k, i1 = 2 * k + 1;
      const __m256i h0 = i0 < 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - i0)) : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(i0 - 4));
      const __m256i h1 = i1 < 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - i1)) : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(i1 - 4));
      ch.u[i0] = _mm256_or_si256(ch.u[i0], _mm256_and_si256(h0, b4));
      ch.u[i1] = _mm256_or_si256(ch.u[i1], _mm256_and_si256(h1, b4));
    }
  }
}

// per16_scales<GGUF_Q3_K> in SSE: the low nibbles of bytes 0..7 then their high nibbles, or'd with bits 2k, 2k+1 of
// bytes 8..11 (dword k of a broadcast shifted by 2k: what crosses bytes is masked off) as bits 4-5, minus 32.
inline __m128i q3k_scales(const uint8_t* b) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_loadl_epi64((const __m128i*)(b + 96));
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4));
  const __m128i h = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(ld32(b + 104)), _mm_setr_epi32(0, 2, 4, 6)),
                                  _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(h, 4)), _mm_set1_epi8(32));
}

template <int TYPE>
inline void decode_chunk(const uint8_t* row, int64_t c, Chunk& ch) {
  using F = Fmt<TYPE>;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (is_r8(TYPE)) {  // as Q4_0 / Q4_1 below, with the fifth bits as Q5_K's
    const uint8_t* c0 = row + c * 8 * F::BYTES;
    ch.fs = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c0));
    if (F::MIN) ch.fm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c0 + 16)));
    const uint8_t* hp = c0 + (F::MIN ? 32 : 16);
    nibble_codes(hp + 32, hp, ch);
    return;
  }
  if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q4_1) {  // u[2k] / u[2k+1]: low / high nibbles of blocks 2k | 2k+1
    const uint8_t* b0 = row + c * 8 * F::BYTES;
    constexpr int64_t QS = TYPE == GGUF_Q4_0 ? 2 : 4;
    for (int k = 0; k < 4; ++k) {
      const uint8_t* b = b0 + 2 * k * F::BYTES + QS;
      const __m256i v = _mm256_loadu2_m128i((const __m128i*)(b + F::BYTES), (const __m128i*)b);
      ch.u[2 * k] = _mm256_and_si256(v, m4);
      ch.u[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    const __m256i heads = heads8(b0, F::BYTES);
    ch.fs = halves_of<false>(heads);
    if (F::MIN) ch.fm = halves_of<true>(heads);
    return;
  }
  if (F::QV == 32) {
    const uint8_t* b0 = row + c * 8 * F::BYTES;
    for (int j = 0; j < 8; ++j) ch.u[j] = codes32<TYPE>(b0 + j * F::BYTES);
    const __m256i heads = heads8(b0, F::BYTES);
    ch.fs = halves_of<false>(heads);
    if (F::MIN) ch.fm = halves_of<true>(heads);
    return;
  }
  const uint8_t* b = row + c * F::BYTES;
  if (TYPE == GGUF_IQ4_XS || is_l4(TYPE)) {  // ls_j - 32 in dword j: nibble j of bytes 4..7, bits 2j, 2j+1 of the u16 at 2 (4-5)
    const __m256i lo_at = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i hi_at = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);  // (d is the dword's low half)
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(ld32(b + 4)), lo_at), _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(ld32(b)), hi_at), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    ch.fs = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(ls));  // d (ls - 32), rounded as gguf.quants
    if (gguf_l4_scale<TYPE>() != 1.0f) ch.fs = _mm256_mul_ps(ch.fs, _mm256_set1_ps(gguf_l4_scale<TYPE>()));
    ch.fm = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) ch.u[j] = iq4_levels<TYPE>(nibbles32(b + 8 + 16 * j));
    return;
  }
  if constexpr (grid_iquant(TYPE)) {  // u: the grid values (unsigned), sc16: their signs as +-1 bytes
    const __m256 d = _mm256_set1_ps(f16(b));
    ch.fm = _mm256_setzero_ps();
    if (TYPE == GGUF_IQ3_S) {  // scale d (1 + 2 s_j): s_j nibble j of bytes 106..109
      const __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(ld32(b + 106)),
                                                           _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                         _mm256_set1_epi32(15));
      ch.fs = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1))));
      const __m256i bit = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
      for (int j = 0; j < 8; ++j) {
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[66 + j]), bit), one);
        const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * j))),
                                            _mm256_slli_epi32(hi, 8));
        ch.u[j] = _mm256_i32gather_epi32((const int*)GGUF_IQ3S_GRID, idx, 4);
        ch.sc16[j] = _mm256_i32gather_epi64(SIGN_BYTES.bytes, _mm_cvtepu8_epi32(_mm_cvtsi32_si128(ld32(b + 74 + 4 * j))), 8);
      }
      return;
    }
    // IQ2_XXS / IQ3_XXS: per sub-block a u32 of 4 x 7 sign bits and the 4-bit scale at its top
    alignas(32) uint32_t aux[8];
    for (int j = 0; j < 8; ++j) aux[j] = gguf_ld32(TYPE == GGUF_IQ2_XXS ? b + 6 + 8 * j : b + 66 + 4 * j);
    const __m256 s = _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_load_si256((const __m256i*)aux), 28));
    ch.fs = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(_mm256_set1_ps(0.5f), s)),
                          _mm256_set1_ps(TYPE == GGUF_IQ2_XXS ? 0.25f : 0.5f));
    for (int j = 0; j < 8; ++j) {
      if (TYPE == GGUF_IQ2_XXS)
        ch.u[j] = _mm256_i32gather_epi64((const long long*)GGUF_IQ2XXS_GRID,
                                         _mm_cvtepu8_epi32(_mm_cvtsi32_si128(ld32(b + 2 + 8 * j))), 8);
      else
        ch.u[j] = _mm256_i32gather_epi32((const int*)GGUF_IQ3XXS_GRID,
                                         _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * j))), 4);
      // the 4 sign indices (bits 0, 7, 14, 21) in 4 int32 lanes, their +-1 bytes by one gather
      const __m128i si = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)aux[j]), _mm_setr_epi32(0, 7, 14, 21)),
                                       _mm_set1_epi32(127));
      ch.sc16[j] = _mm256_i32gather_epi64(KSIGN_BYTES.bytes, si, 8);
    }
    return;
  }
  if (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
    alignas(16) uint8_t sm[16];
    kquant_scales(b + 4, sm);
    const __m128i s8 = _mm_load_si128((const __m128i*)sm);
    ch.fs = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s8)));
    // -(dmin m_j): the kernels add fm * d_x sum(q_x)
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(s8, 8))));
    ch.fm = _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f));
    nibble_codes(b + (TYPE == GGUF_Q4_K ? 16 : 48), TYPE == GGUF_Q5_K ? b + 16 : nullptr, ch);
    return;
  }
  // Q6_K, Q3_K, Q2_K
  ch.fs = _mm256_set1_ps(per16_d<TYPE>(b));
  __m128i sc;
  if (TYPE == GGUF_Q2_K) {
    const __m128i s = _mm_loadu_si128((const __m128i*)b), m4s = _mm_set1_epi8(0x0F);
    sc = _mm_and_si128(s, m4s);
    ch.mall = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), m4s));
    ch.fm = _mm256_set1_ps(-f16(b + 82));
  } else {
    sc = TYPE == GGUF_Q6_K ? _mm_loadu_si128((const __m128i*)(b + 192))
       : gguf_l4_16(TYPE) ? _mm_loadu_si128((const __m128i*)(b + 2)) : q3k_scales(b);
  }
  ch.scall = _mm256_cvtepi8_epi16(sc);
  const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int j = 0; j < 8; ++j)
    ch.sc16[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_add_epi8(pick, _mm_set1_epi8((char)(2 * j)))));
  if (TYPE == GGUF_Q2_K) {
    codes_q2k(_mm256_loadu_si256((const __m256i*)(b + 16)), ch.u);
    codes_q2k(_mm256_loadu_si256((const __m256i*)(b + 48)), ch.u + 4);
    return;
  }
  if (TYPE == GGUF_Q3_K) {
    const __m256i hm = _mm256_loadu_si256((const __m256i*)b);
    codes_q3k<0>(hm, _mm256_loadu_si256((const __m256i*)(b + 32)), ch.u);
    codes_q3k<1>(hm, _mm256_loadu_si256((const __m256i*)(b + 64)), ch.u + 4);
    return;
  }
  if (gguf_l4_16(TYPE)) {  // level + 64 of each code (one in-lane lookup)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)GGUF_LEVELS_U8<TYPE>.u));
    for (int j = 0; j < 8; ++j) ch.u[j] = _mm256_shuffle_epi8(table, nibbles32(b + 18 + 16 * j));
    return;
  }
  const __m256i m3 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
    // bits 2jj, 2jj+1 of each qh byte to bits 4, 5 (16-bit shifts: what crosses bytes misses bits 4-5)
    ch.u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m3));
    ch.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m3));
    ch.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m3));
    ch.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                      _mm256_and_si256(_mm256_srli_epi16(qh, 2), m3));
  }
}

// Sub-block j's codes as the other paths take them (the grid i-quants' values with their signs applied).
template <int TYPE>
inline __m256i chunk_codes(const Chunk& ch, int j) {
  return grid_iquant(TYPE) ? _mm256_sign_epi8(ch.u[j], ch.sc16[j]) : ch.u[j];
}

// The 8 sub-block integer sums of one chunk against activation row m (offsets taken off).
template <int TYPE>
inline __m256i chunk_isums(const Chunk& ch, const GgufActs& a, int64_t m, int64_t c) {
  if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q4_1 || is_r8(TYPE)) {  // cpu_kernels.cpp's int4 reduction over paired blocks
    const int8_t* xp = a.q2 + m * a.K + c * 256;
    __m256i s4[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i x0 = _mm256_load_si256((const __m256i*)(xp + 64 * k));
      const __m256i x1 = _mm256_load_si256((const __m256i*)(xp + 64 * k + 32));
#ifdef EDGELLM_G_VNNI  // int32 lanes [blk 2k: 4 sums of 8 products | blk 2k+1: 4]
      s4[k] = EDGELLM_DPBUSD256(EDGELLM_DPBUSD256(_mm256_setzero_si256(), ch.u[2 * k], x0), ch.u[2 * k + 1], x1);
#else  // int16 lanes of 4 products (|.| <= 4 * 15 * 127)
      s4[k] = _mm256_add_epi16(_mm256_maddubs_epi16(ch.u[2 * k], x0), _mm256_maddubs_epi16(ch.u[2 * k + 1], x1));
#endif
    }
#ifdef EDGELLM_G_VNNI
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s4[0], s4[1]), _mm256_hadd_epi32(s4[2], s4[3]));
#else  // two levels in int16 (16 products, |.| <= 30480), widened by madd: [blk 0, 2, 4, 6 | 1, 3, 5, 7]
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i h;
    if (is_r8(TYPE))  // 5-bit codes: one level in int16 (8 products, |.| <= 8 * 31 * 127), the second in int32
      h = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(s4[0], s4[1]), ones),
                            _mm256_madd_epi16(_mm256_hadd_epi16(s4[2], s4[3]), ones));
    else
      h = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(s4[0], s4[1]), _mm256_hadd_epi16(s4[2], s4[3])), ones);
#endif
    h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q5_0_R8)
      h = _mm256_sub_epi32(h, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a.sum32 + m * a.nb + c * 8)),
                                                TYPE == GGUF_Q4_0 ? 3 : 4));
    return h;
  }
  const int8_t* xq = a.q + m * a.K + c * 256;
  __m256i p[8];
  for (int j = 0; j < 8; ++j) {
    const __m256i x = _mm256_load_si256((const __m256i*)(xq + 32 * j));
    if (grid_iquant(TYPE)) {  // |w| = the grid values, w's signs onto x
      p[j] = dot_u8s8(ch.u[j], _mm256_sign_epi8(x, ch.sc16[j]));
    } else if (signed_codes(TYPE)) {
      p[j] = dot_u8s8(_mm256_sign_epi8(ch.u[j], ch.u[j]), _mm256_sign_epi8(x, ch.u[j]));
    } else if (per16(TYPE)) {  // per-16 int scales: madd with [sc_a x8 | sc_b x8]
      p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ch.u[j], x), ch.sc16[j]);
    } else {
#ifdef EDGELLM_G_VNNI
      p[j] = dot_u8s8(ch.u[j], x);
#else
      p[j] = _mm256_maddubs_epi16(ch.u[j], x);  // codes <= 31: int16 pair sums, widened in reduce8_i16
#endif
    }
  }
#ifdef EDGELLM_G_VNNI
  __m256i isum = reduce8(p);
#else
  __m256i isum = signed_codes(TYPE) || per16(TYPE) ? reduce8(p) : reduce8_i16(p);
#endif
  const int64_t o = m * a.nb + c * 8;
  if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q5_0)
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a.sum32 + o)),
                                                    TYPE == GGUF_Q4_0 ? 3 : 4));
  if (per16(TYPE) && per16_off_shift(TYPE) > 0) {  // 32 (Q3_K: 4) sum(sc q_x) per 16 values, paired per sub-block by madd
    const __m256i s16 = _mm256_loadu_si256((const __m256i*)(a.sum16 + 2 * o));
    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(ch.scall, s16), per16_off_shift(TYPE)));
  }
  return isum;
}

template <int TYPE, int T>
void row_avx2(const GgufActs& a, int64_t m0, const uint8_t* row, float* y, int64_t ldy, int64_t col) {
  using F = Fmt<TYPE>;
  const int64_t nb = a.nb, nchunk = nb / 8;
  __m256 acc[T];
  float tail[T];
  for (int t = 0; t < T; ++t) { acc[t] = _mm256_setzero_ps(); tail[t] = 0.0f; }
  Chunk ch;
  for (int64_t c = 0; c < nchunk; ++c) {
    decode_chunk<TYPE>(row, c, ch);
    for (int t = 0; t < T; ++t) {
      const int64_t m = m0 + t, o = m * nb + c * 8;
      const __m256i isum = chunk_isums<TYPE>(ch, a, m, c);
      const __m256 dx = _mm256_loadu_ps(a.d + o);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ch.fs, dx), acc[t]);
      if (F::MIN) acc[t] = _mm256_fmadd_ps(ch.fm, _mm256_loadu_ps(a.s + o), acc[t]);
      if (min16(TYPE)) {  // sum(m sum(q_x)) per sub-block, its two 16-value halves paired by madd, times -dmin d_x
        const __m256i ms = _mm256_madd_epi16(ch.mall, _mm256_loadu_si256((const __m256i*)(a.sum16 + 2 * o)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(ch.fm, dx), acc[t]);
      }
    }
  }
  if (F::QV == 32) {  // blocks after the last full chunk of 8 (K % 256 != 0), one at a time
    for (int64_t bi = nchunk * 8; bi < nb; ++bi) {
      const uint8_t* b = row + bi * F::BYTES;
      const __m256i u = codes32<TYPE>(b);
      const float dw = f16(b), mw = F::MIN ? f16(b + 2) : 0.0f;
      for (int t = 0; t < T; ++t) {
        const int64_t m = m0 + t, o = m * nb + bi;
        const __m256i x = _mm256_load_si256((const __m256i*)(a.q + m * a.K + bi * QK));
        int32_t isum = signed_codes(TYPE) ? hsum_i32(dot_u8s8(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u)))
                                         : hsum_i32(dot_u8s8(u, x));
        if (TYPE == GGUF_Q4_0) isum -= 8 * a.sum32[o];
        if (stored_of(TYPE) == GGUF_Q5_0) isum -= 16 * a.sum32[o];
        tail[t] += (float)isum * (dw * a.d[o]);
        if (F::MIN) tail[t] += mw * a.s[o];
      }
    }
  }
  for (int t = 0; t < T; ++t) y[(m0 + t) * ldy + col] = hsum_ps(acc[t]) + tail[t];
}
#endif  // EDGELLM_G_AVX2

// Activation rows per pass over a weight row: the rows after the first tile re-read it from L1, not memory.
constexpr int64_t TILE = 4;

template <int TYPE>
void rows_range(const GgufActs& a, const uint8_t* blocks, int64_t n0, int64_t n1, float* y, int64_t ldy,
                const int32_t* out_index) {
  const int64_t rb = a.K / Fmt<TYPE>::QV * Fmt<TYPE>::BYTES;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * rb;
    if (n + 1 < n1)
      for (int64_t o = 0; o < rb; o += 64) prefetch(row + PREFETCH_BYTES + o);
    const int64_t col = out_index ? out_index[n] : n;
#ifdef EDGELLM_G_AVX2
    int64_t m = 0;
    for (; m + TILE <= a.M; m += TILE) row_avx2<TYPE, TILE>(a, m, row, y, ldy, col);
    switch (a.M - m) {
      case 3: row_avx2<TYPE, 3>(a, m, row, y, ldy, col); break;
      case 2: row_avx2<TYPE, 2>(a, m, row, y, ldy, col); break;
      case 1: row_avx2<TYPE, 1>(a, m, row, y, ldy, col); break;
      default: break;
    }
#else
    for (int64_t m = 0; m < a.M; m += 16) row_portable<TYPE>(a, m, std::min<int64_t>(16, a.M - m), row, y, ldy, col);
#endif
  }
}

// ------------------------------------------------------------------------------------------------ dequantize
// gguf.quants' float operations, in its order: (q - off) * d | d * q + m | (d sc) * q - (dmin m) | (d sc) * q,
// each product rounded on its own (no FMA).
#ifdef EDGELLM_G_AVX2
// 8 codes (u8, or int8 for Q8_0) -> fp32 with gguf.quants' operations: (q - off) * d, d * q + m, d * q - dm.
template <int TYPE>
inline __m256 dequant8(__m128i q8, __m256 d, __m256 m) {
  const __m256 q = _mm256_cvtepi32_ps(signed_codes(TYPE) ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8));
  if (TYPE == GGUF_Q4_0) return _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.0f)), d);
  if (TYPE == GGUF_Q5_0) return _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(16.0f)), d);
  if (TYPE == GGUF_Q6_K) return _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(32.0f)));
  if (TYPE == GGUF_Q3_K) return _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(4.0f)));
  if (gguf_l4_16(TYPE)) return _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(64.0f)));
  if (signed_codes(TYPE)) return _mm256_mul_ps(q, d);
  __m256 p = _mm256_mul_ps(d, q);
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+x"(p));  // two roundings, as numpy: no FMA
#endif
  return TYPE == GGUF_Q4_1 || TYPE == GGUF_Q5_1 ? _mm256_add_ps(p, m) : _mm256_sub_ps(p, m);
}

// 32 values of sub-block (or block) j from its u8 codes in x's order [0..15 | 16..31].
template <int TYPE>
inline void dequant32(__m256i u, __m256 d0, __m256 d1, __m256 m, float* o) {
  const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
  _mm256_storeu_ps(o, dequant8<TYPE>(lo, d0, m));
  _mm256_storeu_ps(o + 8, dequant8<TYPE>(_mm_srli_si128(lo, 8), d0, m));
  _mm256_storeu_ps(o + 16, dequant8<TYPE>(hi, d1, m));
  _mm256_storeu_ps(o + 24, dequant8<TYPE>(_mm_srli_si128(hi, 8), d1, m));
}

// The full chunks of a row through the kernels' decoding (decode_chunk); returns the values written.
template <int TYPE>
int64_t dequant_chunks(const uint8_t* row, int64_t K, float* out) {
  using F = Fmt<TYPE>;
  alignas(32) float fs[8], fm[8];
  Chunk ch;
  const int64_t nchunk = K / 256;
  for (int64_t c = 0; c < nchunk; ++c) {
    decode_chunk<TYPE>(row, c, ch);
    _mm256_store_ps(fs, ch.fs);
    if (F::MIN) _mm256_store_ps(fm, TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K ? _mm256_xor_ps(ch.fm, _mm256_set1_ps(-0.0f)) : ch.fm);
    float* o = out + c * 256;
    for (int j = 0; j < 8; ++j) {
      __m256i u = chunk_codes<TYPE>(ch, j);
      if (TYPE == GGUF_Q4_0 || TYPE == GGUF_Q4_1 || is_r8(TYPE)) {  // paired: u[2k] = values 0..15 of blocks 2k | 2k+1
        const __m256i a = ch.u[j & ~1], b = ch.u[j | 1];
        u = (j & 1) ? _mm256_permute2x128_si256(a, b, 0x31) : _mm256_permute2x128_si256(a, b, 0x20);
      }
      __m256 d0 = _mm256_set1_ps(fs[j]), d1 = d0;
      if (per16(TYPE)) {
        int8_t sc[16];
        per16_scales<TYPE>(row + c * F::BYTES, sc);
        d0 = _mm256_set1_ps(fs[j] * (float)sc[2 * j]);
        d1 = _mm256_set1_ps(fs[j] * (float)sc[2 * j + 1]);
      }
      dequant32<stored_of(TYPE)>(u, d0, d1, _mm256_set1_ps(F::MIN ? fm[j] : 0.0f), o + 32 * j);
    }
  }
  return nchunk * 256;
}
#endif

template <int TYPE>
void dequant_row(const uint8_t* row, int64_t K, float* out) {
  using F = Fmt<TYPE>;
  constexpr int SUBS = (int)(F::QV / QK);
  if constexpr (TYPE == GGUF_Q2_K) {  // (the embedding rows of a Q2_K table; products by the kernels above)
    for (int64_t bi = 0; bi < K / 256; ++bi) dequant_q2_k(row + bi * F::BYTES, out + bi * 256);
    return;
  }
  alignas(16) int8_t w[32];
  int64_t done = 0;
#ifdef EDGELLM_G_AVX2
  done = dequant_chunks<TYPE>(row, K, out);
#endif
  for (int64_t bi = done / F::QV; bi < K / F::QV; ++bi) {
    const uint8_t* b = row + bi * F::BYTES;
    for (int j = 0; j < SUBS; ++j) {
      float fs, fm;
      int sc2[4];
      decode_sub<stored_of(TYPE)>(b, j, w, &fs, &fm, sc2);
      float* o = out + (bi * SUBS + j) * QK;
      if (per16(TYPE)) {
        const float d0 = fs * (float)sc2[0], d1 = fs * (float)sc2[1];
        for (int l = 0; l < 16; ++l) o[l] = d0 * (float)w[l];
        for (int l = 16; l < 32; ++l) o[l] = d1 * (float)w[l];
      } else if (TYPE == GGUF_Q4_K || TYPE == GGUF_Q5_K) {
        const float dm = -fm;  // dmin * m_j, rounded once
#ifdef EDGELLM_G_AVX2
        const __m256 vd = _mm256_set1_ps(fs), vm = _mm256_set1_ps(dm);
        for (int l = 0; l < 32; l += 8) {
          __m256 p = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + l)))));
          __asm__("" : "+x"(p));
          _mm256_storeu_ps(o + l, _mm256_sub_ps(p, vm));
        }
#else
        for (int l = 0; l < 32; ++l) o[l] = no_contract(fs * (float)w[l]) - dm;
#endif
      } else if (F::MIN) {  // Q4_1, Q5_1
#ifdef EDGELLM_G_AVX2
        const __m256 vd = _mm256_set1_ps(fs), vm = _mm256_set1_ps(fm);
        for (int l = 0; l < 32; l += 8) {
          __m256 p = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + l)))));
          __asm__("" : "+x"(p));
          _mm256_storeu_ps(o + l, _mm256_add_ps(p, vm));
        }
#else
        for (int l = 0; l < 32; ++l) o[l] = no_contract(fs * (float)w[l]) + fm;
#endif
      } else {
        for (int l = 0; l < 32; ++l) o[l] = fs * (float)w[l];
      }
    }
  }
}

template <template <int> class Op, class... Args>
void dispatch(int type, Args&&... args) {
  switch (type) {
    case GGUF_Q4_0: Op<GGUF_Q4_0>::run(args...); break;
    case GGUF_Q4_1: Op<GGUF_Q4_1>::run(args...); break;
    case GGUF_Q5_0: Op<GGUF_Q5_0>::run(args...); break;
    case GGUF_Q5_1: Op<GGUF_Q5_1>::run(args...); break;
    case GGUF_Q8_0: Op<GGUF_Q8_0>::run(args...); break;
    case GGUF_Q4_K: Op<GGUF_Q4_K>::run(args...); break;
    case GGUF_Q5_K: Op<GGUF_Q5_K>::run(args...); break;
    case GGUF_Q6_K: Op<GGUF_Q6_K>::run(args...); break;
    case GGUF_Q3_K: Op<GGUF_Q3_K>::run(args...); break;
    case GGUF_Q2_K: Op<GGUF_Q2_K>::run(args...); break;
    case GGUF_IQ4_NL: Op<GGUF_IQ4_NL>::run(args...); break;
    case GGUF_IQ4_XS: Op<GGUF_IQ4_XS>::run(args...); break;
    case GGUF_IQ2_XXS: Op<GGUF_IQ2_XXS>::run(args...); break;
    case GGUF_IQ3_XXS: Op<GGUF_IQ3_XXS>::run(args...); break;
    case GGUF_IQ3_S: Op<GGUF_IQ3_S>::run(args...); break;
    case GGUF_IQ2_XXS_L4: Op<GGUF_IQ2_XXS_L4>::run(args...); break;
    case GGUF_IQ3_XXS_L4: Op<GGUF_IQ3_XXS_L4>::run(args...); break;
    case GGUF_IQ3_S_L4: Op<GGUF_IQ3_S_L4>::run(args...); break;
    case GGUF_IQ1_S_L4: Op<GGUF_IQ1_S_L4>::run(args...); break;
    case GGUF_IQ2_XS_L4: Op<GGUF_IQ2_XS_L4>::run(args...); break;
    case GGUF_IQ2_S_L4: Op<GGUF_IQ2_S_L4>::run(args...); break;
    case GGUF_IQ1_M_L4: Op<GGUF_IQ1_M_L4>::run(args...); break;
#ifdef EDGELLM_G_AVX2
    case GGUF_Q5_0_R8: Op<GGUF_Q5_0_R8>::run(args...); break;
    case GGUF_Q5_1_R8: Op<GGUF_Q5_1_R8>::run(args...); break;
#endif
    default: break;
  }
}

// The same for the types with an x8 layout (base_type: the type the x8 part was repacked from).
template <template <int> class Op, class... Args>
void dispatch_x8(int base_type, Args&&... args) {
  switch (base_type) {
    case GGUF_Q4_K: Op<GGUF_Q4_K>::run(args...); break;
    case GGUF_Q5_K: Op<GGUF_Q5_K>::run(args...); break;
    case GGUF_Q6_K: Op<GGUF_Q6_K>::run(args...); break;
    case GGUF_Q3_K: Op<GGUF_Q3_K>::run(args...); break;
    case GGUF_Q2_K: Op<GGUF_Q2_K>::run(args...); break;
    case GGUF_Q5_0: Op<GGUF_Q5_0>::run(args...); break;
    case GGUF_Q5_1: Op<GGUF_Q5_1>::run(args...); break;
    case GGUF_IQ4_XS: Op<GGUF_IQ4_XS>::run(args...); break;
    case GGUF_IQ4_NL: Op<GGUF_IQ4_NL>::run(args...); break;
    case GGUF_IQ2_XXS_L4: Op<GGUF_IQ2_XXS_L4>::run(args...); break;
    case GGUF_IQ3_XXS_L4: Op<GGUF_IQ3_XXS_L4>::run(args...); break;
    case GGUF_IQ3_S_L4: Op<GGUF_IQ3_S_L4>::run(args...); break;
    case GGUF_IQ1_S_L4: Op<GGUF_IQ1_S_L4>::run(args...); break;
    case GGUF_IQ2_XS_L4: Op<GGUF_IQ2_XS_L4>::run(args...); break;
    case GGUF_IQ2_S_L4: Op<GGUF_IQ2_S_L4>::run(args...); break;
    case GGUF_IQ1_M_L4: Op<GGUF_IQ1_M_L4>::run(args...); break;
    default: break;
  }
}

template <int TYPE> struct GemmOp {
  static void run(const GgufActs& a, const uint8_t* blocks, int64_t N, float* y, int64_t ldy, const int32_t* idx) {
    // each thread's share above ~32K weights x activation rows: below that, waking threads costs more
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, a.K * std::min<int64_t>(a.M, 4)));
    parallel_run(0, N, grain, [&](int64_t n0, int64_t n1) { rows_range<TYPE>(a, blocks, n0, n1, y, ldy, idx); });
  }
};

template <int TYPE> struct DequantOp {
  static void run(const uint8_t* blocks, int64_t N, int64_t K, float* out) {
    const int64_t rb = K / Fmt<TYPE>::QV * Fmt<TYPE>::BYTES;
    parallel_run(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequant_row<TYPE>(blocks + n * rb, K, out + n * K);
    });
  }
};

// The same rows rounded to bf16 (round to nearest even), through an fp32 row that stays in cache: half the bytes
// written of an fp32 dequantization and no second pass to convert it.
// x8 parts (x8_row_bytes: the x8 layout's bytes per row, else 0): each group of 8 rows back to its stored blocks in a
// thread's buffer first.
template <int TYPE> struct DequantBf16Op {
  static void run(const uint8_t* blocks, int64_t N, int64_t K, uint16_t* out, int64_t x8_row_bytes) {
    const int64_t rb = K / Fmt<TYPE>::QV * Fmt<TYPE>::BYTES;
    const bool x8 = x8_row_bytes > 0;
    const int64_t unit = x8 ? 8 : 1, stride = x8 ? 8 * x8_row_bytes : rb;
    parallel_run(0, N / unit, std::max<int64_t>(1, 65536 / unit / std::max<int64_t>(K, 1)), [&](int64_t u0, int64_t u1) {
      std::vector<float> row((size_t)K);
      std::vector<uint8_t> stored(x8 ? (size_t)(8 * rb) : 0);
      for (int64_t u = u0; u < u1; ++u) {
        const uint8_t* src = blocks + u * stride;
        if (x8) {
          gguf_unrepack_x8_group(src, TYPE, K, stored.data());
          src = stored.data();
        }
        for (int64_t r = 0; r < unit; ++r) {
          dequant_row<TYPE>(src + r * rb, K, row.data());
          uint16_t* o = out + (u * unit + r) * K;
          for (int64_t k = 0; k < K; ++k) o[k] = float_to_bf16(row[k]);
        }
      }
    });
  }
};

// ================================================================================================ prompt GEMM
// y = x @ W^T for prompt chunks (tens to hundreds of activation rows), the same product as the row kernels above
// (x rounded to int8 per 32 values by gguf_quantize_acts, exact integer dots per sub-block, fp32 scaling per
// sub-block) but organized as a GEMM, so that each weight value is decoded once per call rather than once per 4
// activation rows, and no horizontal reduction is needed:
//   - panels of NR weight rows (16 with AVX-512 VNNI zmm, 8 with AVX2 ymm) over a block of kc values of K are
//     unpacked into a cache-resident buffer: the codes as bytes interleaved [k/4][NR][4] (one vector load = 4
//     consecutive values of each of the NR rows), per 32-value sub-block the fp32 scales [NR] (d * sc; Q6_K: per
//     16 values) and mins [NR];
//   - x is repacked per block of MR activation rows (8 / 4): [K/4][MR][4] bytes, d_x, d_x sum(q_x) and the
//     offsets' integer sums [.][MR];
//   - the microkernel runs MR x NR outputs: per 4 values one weight load and MR vpdpbusd (AVX2: maddubs + madd)
//     against the activation's 4 bytes broadcast, then per sub-block and row one convert and one FMA with
//     (w_scale [NR] * d_x) (+ one FMA of w_min [NR] * d_x sum(q_x)).  The offsets (Q4_0 -8, Q5_0 -16, Q6_K -32
//     per 16 values, Q8_0's signed codes as u8 + 128 on VNNI) start the int32 accumulator at -off * sum(q_x).
// Loops: per thread a range of panels (output columns); per block of kc values of K (kc sized so that the
// repacked x block stays in L2) each panel is unpacked once and runs against every activation row; the block's
// partial products are stored (first block) or added into y.  Where out_index is given the stored rows are
// taken in the order of their output columns, so a panel writes (mostly) contiguous columns.
// The float summation order differs from the row kernels': results agree to fp32 rounding, not bit for bit (the
// decode / verification passes stay on the row kernels).  Builds without AVX2 run a portable version of the same
// math (for correctness; gguf_prompt_gemm_fast() says false there).

#if defined(EDGELLM_G_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define EDGELLM_P_ZMM 1
constexpr int P_NR = 16, P_MR = 8;
#else
constexpr int P_NR = 8, P_MR = 4;
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define PROMPT_UNROLL _Pragma("GCC unroll 16")  // else GCC may turn a zeroing loop of vector accumulators into a
                                                // memset, and then keep the accumulators in memory
#define PROMPT_NO_UNROLL _Pragma("GCC unroll 1")
#else
#define PROMPT_UNROLL
#define PROMPT_NO_UNROLL
#endif

// Q8_0's signed codes in the vector builds: as u8 + 128 with an offset through the activations' sums where vpdpbusd
// multiplies (AVX-512 VNNI: int32 sums, no saturation); on AVX2 the panel holds |w| and a mask of the negative codes
// (u8 up to 255 against int8 could saturate maddubs' int16 pair sums), and maddubs multiplies |w| by x with its bits
// flipped where w < 0: |w| (~x) = |w| (-x - 1) = w x - |w|, so the sum over a sub-block is w.x minus the panel's
// per-column constant sum(|w| : w < 0), which starts the accumulator.  A flip (vpxor) runs on any of the four vector
// pipes where vpsignb |w| x sign(x, w) took a multiplier pipe's slot (Zen 3: maddubs, madd, sign and abs share two
// pipes).  No pair sum saturates: |w| <= 127 against x <= 127, and w = -128 only against ~x in [-128, 126].
#if defined(EDGELLM_P_ZMM)
constexpr bool P_Q8_U8 = true;
#else
constexpr bool P_Q8_U8 = false;
#endif

// The offset taken off each unsigned code in the vector builds, through the activations' int sums.
template <int TYPE>
constexpr int prompt_off() {
#ifdef EDGELLM_G_AVX2
  return TYPE == GGUF_Q4_0 ? 8 : TYPE == GGUF_Q5_0 ? 16 : TYPE == GGUF_Q6_K ? 32 : TYPE == GGUF_Q3_K ? 4
       : gguf_l4_16(TYPE) ? 64 : (signed_codes(TYPE) && P_Q8_U8) ? 128 : 0;
#else
  return 0;  // the portable panel holds the codes as int8 with the offsets already taken off
#endif
}

// x for the microkernels, per block of P_MR rows (rows past M are zeros).
struct PromptActs {
  int64_t M = 0, Mp = 0, K = 0, nb = 0, nsub = 0;  // nsub: offset sums per row (nb; per16 types: 2 nb)
  const int8_t* q = nullptr;     // [Mp / MR][K / 4][MR][4]
  const float* d = nullptr;      // [Mp / MR][nb][MR]
  const float* s = nullptr;      // [Mp / MR][nb][MR]  d * sum(q)
  const int32_t* off = nullptr;  // [Mp / MR][nsub][MR]  -OFF * sum(q) per 32 (per16: per 16) values; null if no offset
  const float* s16 = nullptr;    // Q2_K: [Mp / MR][nsub][MR]  sum(q) per 16 values, as floats (its mins meet them)
};

uint8_t* prompt_acts_buffer(size_t bytes) {
  static thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}


template <int TYPE>
PromptActs prompt_acts(const GgufActs& a) {
  constexpr int OFF = prompt_off<TYPE>();
  constexpr int MR = P_MR;
  PromptActs p;
  p.M = a.M;
  p.K = a.K;
  p.nb = a.nb;
  p.Mp = (a.M + MR - 1) / MR * MR;
  p.nsub = per16(TYPE) ? 2 * a.nb : a.nb;
  const int64_t nmb = p.Mp / MR, K = a.K, nb = a.nb, nsub = p.nsub, M = a.M;
  constexpr bool SUMS = OFF || min16(TYPE);  // 4 bytes per row and nsub: the offsets, or Q2_K's 16-value sums
  const size_t qbytes = (size_t)(p.Mp * K), fl = (size_t)(p.Mp * nb), ob = SUMS ? (size_t)(p.Mp * nsub) : 0;
  uint8_t* base = prompt_acts_buffer(qbytes + 8 * fl + 4 * ob + 128);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + qbytes);
  float* s = d + fl;
  int32_t* off = OFF ? reinterpret_cast<int32_t*>(s + fl) : nullptr;
  float* s16 = min16(TYPE) ? s + fl : nullptr;
  parallel_run(0, nmb, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb) {
      int8_t* qd = q + mb * MR * K;
      for (int i = 0; i < MR; ++i) {
        const int64_t m = mb * MR + i;
        if (m < M) {
          const int8_t* src = a.q + m * K;
#ifdef EDGELLM_G_AVX2
          if (MR == 8 && i == 0 && mb * MR + MR <= M) {  // a full block of 8 rows: 8 x 8 dword transposes
            for (int64_t g = 0; g < K / 4; g += 8) {
              __m256i v[8];
              for (int r = 0; r < 8; ++r) v[r] = _mm256_load_si256((const __m256i*)(src + r * K + 4 * g));
              transpose8x8_epi32(v);
              for (int j = 0; j < 8; ++j) _mm256_store_si256((__m256i*)(qd + (g + j) * MR * 4), v[j]);
            }
          }
          if (!(MR == 8 && mb * MR + MR <= M))
#endif
          for (int64_t g = 0; g < K / 4; ++g) std::memcpy(qd + (g * MR + i) * 4, src + 4 * g, 4);
          for (int64_t b = 0; b < nb; ++b) {
            d[(mb * nb + b) * MR + i] = a.d[m * nb + b];
            s[(mb * nb + b) * MR + i] = a.s[m * nb + b];
          }
          if (min16(TYPE)) {
            for (int64_t b = 0; b < nsub; ++b) s16[(mb * nsub + b) * MR + i] = (float)a.sum16[m * nsub + b];
          } else if (OFF) {
            for (int64_t b = 0; b < nsub; ++b)
              off[(mb * nsub + b) * MR + i] = -OFF * (per16(TYPE) ? (int32_t)a.sum16[m * nsub + b] : a.sum32[m * nb + b]);
          }
        } else {
          for (int64_t g = 0; g < K / 4; ++g) std::memset(qd + (g * MR + i) * 4, 0, 4);
          for (int64_t b = 0; b < nb; ++b) d[(mb * nb + b) * MR + i] = s[(mb * nb + b) * MR + i] = 0.0f;
          for (int64_t b = 0; b < (SUMS ? nsub : 0); ++b) {
            if (OFF) off[(mb * nsub + b) * MR + i] = 0;
            if (min16(TYPE)) s16[(mb * nsub + b) * MR + i] = 0.0f;
          }
        }
      }
    }
  });
  p.q = q;
  p.d = d;
  p.s = s;
  p.off = off;
  p.s16 = s16;
  return p;
}

// One unpacked panel: P_NR weight rows over kc values of K.
struct Panel {
  uint8_t* codes = nullptr;  // [kc / 4][NR][4] (vector builds: u8 codes; portable: int8 with offsets taken off)
  uint8_t* negs = nullptr;   // AVX2 Q8_0: [kc / 4][NR][4] 0xff where the code is negative (codes then hold |w|)
  int32_t* negsum = nullptr; // AVX2 Q8_0: [kc / 32][NR] sum of |w| over the sub-block's negative codes
  float* ws = nullptr;       // [kc / 32][NR] scale per sub-block (per16 types: [kc / 16][NR], d * sc per 16 values)
  float* wm = nullptr;       // [kc / 32][NR] min per sub-block (types with mins; Q4_K / Q5_K: -(dmin m); Q2_K:
                             // [kc / 16][NR], -(dmin m) per 16 values)
};

Panel panel_buffer(int64_t kc) {
  static thread_local std::vector<uint8_t> buf;
  const size_t codes = (size_t)(kc * P_NR), fl = (size_t)(kc / 16 * P_NR) * 8 + (size_t)(kc / 32 * P_NR) * 4;
  if (buf.size() < 2 * codes + fl + 128) buf.resize(2 * codes + fl + 128);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  Panel P;
  P.codes = base;
  P.negs = base + codes;
  P.ws = reinterpret_cast<float*>(base + 2 * codes);
  P.wm = P.ws + kc / 16 * P_NR;
  P.negsum = reinterpret_cast<int32_t*>(P.wm + kc / 16 * P_NR);
  return P;
}

#ifdef EDGELLM_G_AVX2
// The codes of sub-blocks [s0, s0 + nsub) of NR rows (tmp[r]: row r's 256 values from sub-block s0) into the panel's
// [k / 4][NR][4] order: 8 x 8 dword transposes.
inline void store_panel_codes(const uint8_t (*tmp)[256], int nsub, int64_t s0, const Panel& P) {
  constexpr int NR = P_NR;
  for (int j = 0; j < nsub; ++j)
    for (int r0 = 0; r0 < NR; r0 += 8) {
      __m256i v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_load_si256((const __m256i*)(tmp[r0 + i] + 32 * j));
      transpose8x8_epi32(v);
      uint8_t* dst = P.codes + ((s0 + j) * 8) * NR * 4 + r0 * 4;
      for (int g = 0; g < 8; ++g) _mm256_store_si256((__m256i*)(dst + g * NR * 4), v[g]);
    }
}

// AVX2 Q8_0: the signed codes of sub-blocks [s0, s0 + nsub), as stored by store_panel_codes, into |w|, the mask of
// negative codes and the per-column sum of |w| over them (see P_Q8_U8).
#if defined(EDGELLM_P_ZMM)
inline void split_panel_signs(int, int64_t, const Panel&) {}  // (AVX-512 VNNI builds keep Q8_0 as u8 + 128)
#else
inline void split_panel_signs(int nsub, int64_t s0, const Panel& P) {
  static_assert(P_NR == 8, "one ymm of codes holds 4 values of each of the 8 rows");
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t sb = s0; sb < s0 + nsub; ++sb) {
    __m256i neg = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      uint8_t* at = P.codes + (sb * 8 + g) * 32;
      const __m256i w = _mm256_load_si256((const __m256i*)at);
      const __m256i m = _mm256_cmpgt_epi8(_mm256_setzero_si256(), w), a = _mm256_abs_epi8(w);
      _mm256_store_si256((__m256i*)at, a);
      _mm256_store_si256((__m256i*)(P.negs + (sb * 8 + g) * 32), m);
      // the 4 bytes of each row: |w| <= 128 each, so u8 x 1 pair sums then int32 sums are exact
      neg = _mm256_add_epi32(neg, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(a, m), ones8), ones16));
    }
    _mm256_store_si256((__m256i*)(P.negsum + sb * 8), neg);
  }
}
#endif

// The signed codes (Q8_0's, the IQ4 levels) of sub-blocks [s0, s0 + nsub), stored as int8 by store_panel_codes, into
// the form the micro-kernel takes: u8 + 128 where vpdpbusd multiplies (AVX-512 VNNI), else |w| with the signs apart.
inline void signed_panel_codes(int nsub, int64_t s0, const Panel& P) {
  if (!P_Q8_U8) {
    split_panel_signs(nsub, s0, P);
    return;
  }
  uint8_t* c = P.codes + s0 * 8 * P_NR * 4;
  for (int64_t o = 0; o < nsub * 8 * P_NR * 4; o += 32)
    _mm256_store_si256((__m256i*)(c + o), _mm256_xor_si256(_mm256_load_si256((const __m256i*)(c + o)),
                                                            _mm256_set1_epi8((char)0x80)));
}

// Unpack rows[0 .. nvalid) (stored row numbers; the rest of the panel's NR rows are zeros) over [k0, k0 + kc).
// r8 types: full chunks through decode_chunk (codes back in each block's order), a row's tail blocks as stored.
template <int TYPE>
void build_panel(const uint8_t* blocks, int64_t rb, const int32_t* rows, int nvalid, int64_t k0, int64_t kc,
                 const Panel& P) {
  using F = Fmt<TYPE>;
  constexpr int NR = P_NR;
  const int64_t nchunk = is_r8(TYPE) ? rb / F::BYTES / 8 : 0;  // r8: full chunks per row
  alignas(32) uint8_t tmp[NR][256];
  alignas(32) float fs[8], fm[8];
  for (int64_t u0 = 0; u0 < kc; u0 += 256) {
    const int nsub = (int)std::min<int64_t>(8, (kc - u0) / 32);
    const int64_t s0 = u0 / 32;
    for (int r = 0; r < NR; ++r) {
      if (r >= nvalid) {
        std::memset(tmp[r], 0, 256);
        for (int j = 0; j < nsub; ++j) {
          P.ws[(s0 + j) * NR + r] = 0.0f;
          if (per16(TYPE)) P.ws[(2 * (s0 + j) + 1) * NR + r] = P.ws[2 * (s0 + j) * NR + r] = 0.0f;
          if (min16(TYPE)) P.wm[(2 * (s0 + j) + 1) * NR + r] = P.wm[2 * (s0 + j) * NR + r] = 0.0f;
          if (F::MIN) P.wm[(s0 + j) * NR + r] = 0.0f;
        }
        continue;
      }
      const uint8_t* row = blocks + (int64_t)rows[r] * rb;
      {  // the row's next 256 values, wanted again after the other NR - 1 rows: fetched meanwhile (the hardware
         // prefetcher does not follow NR interleaved streams; without it Q6_K's panels took 3x longer)
        const int64_t next = (k0 + u0 + 256) / F::QV * F::BYTES;
        const int64_t len = 256 / F::QV * F::BYTES;
        if (next + len <= rb)
          for (int64_t o = 0; o < len + 63; o += 64) prefetch(row + next + std::min(o, len - 1));
      }
      if (F::QV == 256) {
        Chunk ch;
        const int64_t c = (k0 + u0) / 256;
        decode_chunk<TYPE>(row, c, ch);
        for (int j = 0; j < 8; ++j) _mm256_store_si256((__m256i*)(tmp[r] + 32 * j), chunk_codes<TYPE>(ch, j));
        if (per16(TYPE)) {
          const uint8_t* b = row + c * F::BYTES;
          const float d = per16_d<TYPE>(b);
          int8_t sc[16];
          per16_scales<TYPE>(b, sc);
          for (int h = 0; h < 16; ++h) P.ws[(2 * s0 + h) * NR + r] = d * (float)sc[h];
          if (min16(TYPE)) {
            const float dmin = f16(b + 82);
            for (int h = 0; h < 16; ++h) P.wm[(2 * s0 + h) * NR + r] = -(dmin * (float)(b[h] >> 4));
          }
        } else {
          _mm256_store_ps(fs, ch.fs);
          _mm256_store_ps(fm, ch.fm);
          for (int j = 0; j < 8; ++j) {
            P.ws[(s0 + j) * NR + r] = fs[j];
            P.wm[(s0 + j) * NR + r] = fm[j];
          }
        }
      } else if (is_r8(TYPE) && (k0 + u0) / 256 < nchunk) {  // k0, u0: multiples of 256 (kc: whole chunks or K)
        Chunk ch;
        decode_chunk<TYPE>(row, (k0 + u0) / 256, ch);
        for (int j = 0; j < 8; j += 2) {
          _mm256_store_si256((__m256i*)(tmp[r] + 32 * j), _mm256_permute2x128_si256(ch.u[j], ch.u[j + 1], 0x20));
          _mm256_store_si256((__m256i*)(tmp[r] + 32 * j + 32), _mm256_permute2x128_si256(ch.u[j], ch.u[j + 1], 0x31));
        }
        _mm256_store_ps(fs, ch.fs);
        if (F::MIN) _mm256_store_ps(fm, ch.fm);
        for (int j = 0; j < 8; ++j) {
          P.ws[(s0 + j) * NR + r] = fs[j];
          if (F::MIN) P.wm[(s0 + j) * NR + r] = fm[j];
        }
      } else {
        for (int j = 0; j < nsub; ++j) {
          const uint8_t* b = row + ((k0 + u0) / 32 + j) * F::BYTES;
          _mm256_store_si256((__m256i*)(tmp[r] + 32 * j), codes32<TYPE>(b));
          P.ws[(s0 + j) * NR + r] = f16(b);
          if (F::MIN) P.wm[(s0 + j) * NR + r] = f16(b + 2);
        }
      }
    }
    store_panel_codes(tmp, nsub, s0, P);
    if (signed_codes(TYPE)) signed_panel_codes(nsub, s0, P);
  }
}

// Our int8 / int4 weights (cpu_gguf.h QuantWeights) as a panel: int4 symmetric as Q4_0's codes, asymmetric as
// Q4_1's, int8 as Q8_0's; the fp16 scales (and mins) of a group serve each of its 32-value sub-blocks.
template <int TYPE>
void build_panel_quant(const QuantWeights& w, int64_t K, int64_t n0, int nvalid, int64_t k0, int64_t kc,
                       const Panel& P) {
  constexpr int NR = P_NR;
  const int64_t ng = K / w.group, per = w.group / 32, cb = TYPE == GGUF_Q8_0 ? K : K / 2;
  alignas(32) uint8_t tmp[NR][256];
  for (int64_t u0 = 0; u0 < kc; u0 += 256) {
    const int nsub = (int)std::min<int64_t>(8, (kc - u0) / 32);
    const int64_t s0 = u0 / 32;
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      for (int j = 0; j < nsub; ++j) {
        const int64_t g32 = (k0 + u0) / 32 + j, gi = n * ng + g32 / per;
        __m256i u = _mm256_setzero_si256();
        float sc = 0.0f, mn = 0.0f;
        if (r < nvalid) {
          const uint8_t* c = w.codes + n * cb;
          u = TYPE == GGUF_Q8_0 ? _mm256_loadu_si256((const __m256i*)(c + 32 * g32)) : nibbles32(c + 16 * g32);
          sc = f16(reinterpret_cast<const uint8_t*>(w.scales + gi));
          if (TYPE == GGUF_Q4_1) mn = f16(reinterpret_cast<const uint8_t*>(w.mins + gi));
        }
        _mm256_store_si256((__m256i*)(tmp[r] + 32 * j), u);
        P.ws[(s0 + j) * NR + r] = sc;
        if (TYPE == GGUF_Q4_1) P.wm[(s0 + j) * NR + r] = mn;
      }
    }
    store_panel_codes(tmp, nsub, s0, P);
    if (signed_codes(TYPE)) signed_panel_codes(nsub, s0, P);
  }
}
#else
template <int TYPE>
void build_panel(const uint8_t* blocks, int64_t rb, const int32_t* rows, int nvalid, int64_t k0, int64_t kc,
                 const Panel& P) {
  using F = Fmt<TYPE>;
  constexpr int NR = P_NR;
  constexpr int SUBS = (int)(F::QV / QK);
  alignas(16) int8_t w[32];
  for (int64_t sb = 0; sb < kc / 32; ++sb) {
    const int64_t g32 = (k0 / 32) + sb;  // global 32-value sub-block
    for (int r = 0; r < NR; ++r) {
      float fs = 0.0f, fm = 0.0f;
      int sc2[4] = {0, 0, 0, 0};
      if (r < nvalid) {
        const uint8_t* b = blocks + (int64_t)rows[r] * rb + (g32 / SUBS) * F::BYTES;
        decode_sub<TYPE>(b, (int)(g32 % SUBS), w, &fs, &fm, sc2);
      } else {
        std::memset(w, 0, 32);
      }
      for (int l = 0; l < 32; ++l) P.codes[((sb * 8 + l / 4) * NR + r) * 4 + (l & 3)] = (uint8_t)w[l];
      if (per16(TYPE)) {
        P.ws[(2 * sb) * NR + r] = fs * (float)sc2[0];
        P.ws[(2 * sb + 1) * NR + r] = fs * (float)sc2[1];
        if (min16(TYPE)) {
          P.wm[(2 * sb) * NR + r] = -(fm * (float)sc2[2]);
          P.wm[(2 * sb + 1) * NR + r] = -(fm * (float)sc2[3]);
        }
      } else {
        P.ws[sb * NR + r] = fs;
        if (F::MIN) P.wm[sb * NR + r] = fm;
      }
    }
  }
}

template <int TYPE>
void build_panel_quant(const QuantWeights& w, int64_t K, int64_t n0, int nvalid, int64_t k0, int64_t kc,
                       const Panel& P) {
  constexpr int NR = P_NR;
  const int64_t ng = K / w.group, per = w.group / 32, cb = TYPE == GGUF_Q8_0 ? K : K / 2;
  for (int64_t sb = 0; sb < kc / 32; ++sb) {
    const int64_t g32 = k0 / 32 + sb;
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r, gi = n * ng + g32 / per;
      int8_t v[32] = {};
      if (r < nvalid) {
        const uint8_t* c = w.codes + n * cb;
        for (int l = 0; l < 32; ++l)
          v[l] = TYPE == GGUF_Q8_0 ? (int8_t)c[32 * g32 + l]
                                   : (int8_t)(((c[16 * g32 + l % 16] >> (l < 16 ? 0 : 4)) & 15) - (TYPE == GGUF_Q4_0 ? 8 : 0));
      }
      for (int l = 0; l < 32; ++l) P.codes[((sb * 8 + l / 4) * NR + r) * 4 + (l & 3)] = (uint8_t)v[l];
      P.ws[sb * NR + r] = r < nvalid ? f16(reinterpret_cast<const uint8_t*>(w.scales + gi)) : 0.0f;
      if (TYPE == GGUF_Q4_1) P.wm[sb * NR + r] = r < nvalid ? f16(reinterpret_cast<const uint8_t*>(w.mins + gi)) : 0.0f;
    }
  }
}
#endif

// out[RT][NR] = the panel's rows against activation rows [mb MR, mb MR + RT) over [k0, k0 + kc) (RT <= MR: the
// last block of rows runs only as many as it needs, of 2 / 4 / 8; the layout's stride stays MR).
#if defined(EDGELLM_P_ZMM)
template <int TYPE, int RT>
void prompt_micro(const Panel& P, const PromptActs& A, int64_t mb, int64_t k0, int64_t kc, float* out) {
  using F = Fmt<TYPE>;
  constexpr int MR = P_MR, OFF = prompt_off<TYPE>();
  const uint8_t* wc = P.codes;
  const int8_t* xq = A.q + (mb * A.K + k0) * MR;
  const float* dx = A.d + (mb * A.nb + k0 / 32) * MR;
  const float* sx = A.s + (mb * A.nb + k0 / 32) * MR;
  const int32_t* off = OFF ? A.off + (mb * A.nsub + k0 / 32 * (per16(TYPE) ? 2 : 1)) * MR : nullptr;
  const float* s16 = min16(TYPE) ? A.s16 + (mb * A.nsub + k0 / 32 * 2) * MR : nullptr;
  __m512 acc[MR];
  PROMPT_UNROLL for (int i = 0; i < RT; ++i) acc[i] = _mm512_setzero_ps();  // unrolled: kept in registers, not a memset
  const int64_t nsb = kc / 32;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    if (per16(TYPE)) {
      __m512 t[MR];
      for (int h = 0; h < 2; ++h) {
        __m512i ia[MR];
        for (int i = 0; i < RT; ++i) ia[i] = OFF ? _mm512_set1_epi32(off[(2 * sb + h) * MR + i]) : _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g) {
          const __m512i w = _mm512_load_si512((const void*)wc);
          const uint8_t* x4 = reinterpret_cast<const uint8_t*>(xq);
          for (int i = 0; i < RT; ++i) ia[i] = _mm512_dpbusd_epi32(ia[i], w, _mm512_set1_epi32(ld32(x4 + 4 * i)));
          wc += 64;
          xq += 4 * MR;
        }
        const __m512 sc = _mm512_load_ps(P.ws + (2 * sb + h) * 16);
        for (int i = 0; i < RT; ++i)
          t[i] = h == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(ia[i]), sc) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), sc, t[i]);
        if (min16(TYPE)) {  // -(dmin m) [NR] * sum(q_x) over these 16 values
          const __m512 mn = _mm512_load_ps(P.wm + (2 * sb + h) * 16);
          for (int i = 0; i < RT; ++i) t[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s16[(2 * sb + h) * MR + i]), t[i]);
        }
      }
      for (int i = 0; i < RT; ++i) acc[i] = _mm512_fmadd_ps(t[i], _mm512_set1_ps(dx[sb * MR + i]), acc[i]);
    } else {
      __m512i ia[MR];
      for (int i = 0; i < RT; ++i) ia[i] = OFF ? _mm512_set1_epi32(off[sb * MR + i]) : _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_load_si512((const void*)wc);
        const uint8_t* x4 = reinterpret_cast<const uint8_t*>(xq);
        for (int i = 0; i < RT; ++i) ia[i] = _mm512_dpbusd_epi32(ia[i], w, _mm512_set1_epi32(ld32(x4 + 4 * i)));
        wc += 64;
        xq += 4 * MR;
      }
      const __m512 sc = _mm512_load_ps(P.ws + sb * 16);
      for (int i = 0; i < RT; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), _mm512_mul_ps(sc, _mm512_set1_ps(dx[sb * MR + i])), acc[i]);
      if (F::MIN) {
        const __m512 mn = _mm512_load_ps(P.wm + sb * 16);
        for (int i = 0; i < RT; ++i) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[sb * MR + i]), acc[i]);
      }
    }
  }
  PROMPT_UNROLL for (int i = 0; i < RT; ++i) _mm512_store_ps(out + i * 16, acc[i]);
}
#elif defined(EDGELLM_G_AVX2)
#ifdef EDGELLM_G_VNNI
// ia[i] += the int sums of G groups of codes w[g] against activation row i of the block at x0, by vpdpbusd
template <int RT, int G>
inline void dpbusd_groups(const __m256i* w, const uint8_t* x0, __m256i* ia) {
  constexpr int MR = P_MR;
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < RT; ++i) ia[i] = EDGELLM_DPBUSD256(ia[i], w[g], _mm256_set1_epi32(ld32(x0 + 4 * (g * MR + i))));
}
#endif

// ia[i] += the int sums of 4 groups (16 values of each panel row) of codes <= 31 at wc against activation row i of
// the block at xq, the 4 groups' maddubs pair sums added in int16 first (8 products: |.| <= 8 * 31 * 127 = 31496).
template <int RT>
inline void dot_4groups(const uint8_t* wc, const int8_t* xq, __m256i* ia) {
  constexpr int MR = P_MR;
  const __m256i w0 = _mm256_load_si256((const __m256i*)wc), w1 = _mm256_load_si256((const __m256i*)(wc + 32));
  const __m256i w2 = _mm256_load_si256((const __m256i*)(wc + 64)), w3 = _mm256_load_si256((const __m256i*)(wc + 96));
  const uint8_t* x0 = reinterpret_cast<const uint8_t*>(xq);
#ifdef EDGELLM_G_VNNI  // (AVX-VNNI: the AVX-512 builds run the zmm micro-kernel)
  const __m256i w[4] = {w0, w1, w2, w3};
  dpbusd_groups<RT, 4>(w, x0, ia);
  return;
#endif
  for (int i = 0; i < RT; ++i) {
    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(ld32(x0 + 4 * i))),
                                         _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ld32(x0 + 4 * (MR + i)))));
    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(w2, _mm256_set1_epi32(ld32(x0 + 4 * (2 * MR + i)))),
                                         _mm256_maddubs_epi16(w3, _mm256_set1_epi32(ld32(x0 + 4 * (3 * MR + i)))));
    ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(_mm256_add_epi16(p01, p23), _mm256_set1_epi16(1)));
  }
}

// A value the compiler takes as changed here: keeps a chain of adds in the order written.  Left to itself GCC
// reassociates dot_8groups' sums into trees, computes all 32 products of a sub-block first and spills them to the
// stack; kept in order they stay in registers (Q4_K prompt GEMM 1.04x, benchmarks/gguf_kernel_ab.py --prompt --isa
// avx2 --m 512 --threads 1 on the 3B-shaped file).
inline __m256i in_order(__m256i v) {
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+x"(v));
#endif
  return v;
}

// ia[i] += the int sums of a whole sub-block (8 groups, 32 values of each panel row) of 4-bit codes (<= 15) at wc
// against activation row i: the 8 groups' pair sums added in int16 (16 products: |.| <= 16 * 15 * 127 = 30480), one
// widening madd per row where 4-group steps take two and an int32 add.
template <int RT>
inline void dot_8groups(const uint8_t* wc, const int8_t* xq, __m256i* ia) {
  constexpr int MR = P_MR;
  const uint8_t* x0 = reinterpret_cast<const uint8_t*>(xq);
#ifdef EDGELLM_G_VNNI
  __m256i w[8];
  for (int g = 0; g < 8; ++g) w[g] = _mm256_load_si256((const __m256i*)(wc + 32 * g));
  dpbusd_groups<RT, 8>(w, x0, ia);
  return;
#endif
  __m256i p[MR];
  {
    const __m256i w = _mm256_load_si256((const __m256i*)wc);
    for (int i = 0; i < RT; ++i) p[i] = _mm256_maddubs_epi16(w, _mm256_set1_epi32(ld32(x0 + 4 * i)));
  }
  for (int g = 1; g < 8; ++g) {
    const __m256i w = _mm256_load_si256((const __m256i*)(wc + 32 * g));
    for (int i = 0; i < RT; ++i)
      p[i] = in_order(_mm256_add_epi16(p[i], _mm256_maddubs_epi16(w, _mm256_set1_epi32(ld32(x0 + 4 * (g * MR + i))))));
  }
  for (int i = 0; i < RT; ++i) ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(p[i], _mm256_set1_epi16(1)));
}

// 4-bit codes: the types whose panel holds codes <= 15 (dot_8groups)
constexpr bool codes4(int type) { return type == GGUF_Q4_0 || type == GGUF_Q4_1 || type == GGUF_Q4_K; }

template <int TYPE, int RT>
void prompt_micro(const Panel& P, const PromptActs& A, int64_t mb, int64_t k0, int64_t kc, float* out) {
  using F = Fmt<TYPE>;
  constexpr int MR = P_MR, OFF = prompt_off<TYPE>();
  const uint8_t* wc = P.codes;
  const int8_t* xq = A.q + (mb * A.K + k0) * MR;
  const float* dx = A.d + (mb * A.nb + k0 / 32) * MR;
  const float* sx = A.s + (mb * A.nb + k0 / 32) * MR;
  const int32_t* off = OFF ? A.off + (mb * A.nsub + k0 / 32 * (per16(TYPE) ? 2 : 1)) * MR : nullptr;
  const float* s16 = min16(TYPE) ? A.s16 + (mb * A.nsub + k0 / 32 * 2) * MR : nullptr;
  __m256 acc[MR];
  PROMPT_UNROLL for (int i = 0; i < RT; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t nsb = kc / 32;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    if (per16(TYPE)) {
      __m256 t[MR];
      for (int h = 0; h < 2; ++h) {
        __m256i ia[MR];
        for (int i = 0; i < RT; ++i) ia[i] = OFF ? _mm256_set1_epi32(off[(2 * sb + h) * MR + i]) : _mm256_setzero_si256();
        if (TYPE == GGUF_Q6_K) {
          for (int g = 0; g < 4; g += 2) {  // two groups' pair sums added in int16 (4 products, |.| <= 4 * 63 * 127)
            const __m256i w0 = _mm256_load_si256((const __m256i*)wc), w1 = _mm256_load_si256((const __m256i*)(wc + 32));
            const uint8_t* x0 = reinterpret_cast<const uint8_t*>(xq);
#ifdef EDGELLM_G_VNNI
            const __m256i w[2] = {w0, w1};
            dpbusd_groups<RT, 2>(w, x0, ia);
#else
            const uint8_t* x1 = x0 + 4 * MR;
            for (int i = 0; i < RT; ++i) {
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(ld32(x0 + 4 * i))),
                                                 _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ld32(x1 + 4 * i))));
              ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
#endif
            wc += 64;
            xq += 8 * MR;
          }
        } else if (gguf_l4_16(TYPE)) {  // codes <= 107: each group's pair sums widened on their own (2 * 107 * 127)
          for (int g = 0; g < 4; ++g) {
            const __m256i w = _mm256_load_si256((const __m256i*)wc);
            const uint8_t* x0 = reinterpret_cast<const uint8_t*>(xq);
            for (int i = 0; i < RT; ++i)
              ia[i] = dot4_u8s8(ia[i], w, _mm256_set1_epi32(ld32(x0 + 4 * i)));
            wc += 32;
            xq += 4 * MR;
          }
        } else {  // Q3_K / Q2_K: the four groups' pair sums in int16 (8 products of codes <= 7)
          dot_4groups<RT>(wc, xq, ia);
          wc += 128;
          xq += 16 * MR;
        }
        const __m256 sc = _mm256_load_ps(P.ws + (2 * sb + h) * 8);
        for (int i = 0; i < RT; ++i)
          t[i] = h == 0 ? _mm256_mul_ps(_mm256_cvtepi32_ps(ia[i]), sc) : _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), sc, t[i]);
        if (min16(TYPE)) {  // -(dmin m) [NR] * sum(q_x) over these 16 values
          const __m256 mn = _mm256_load_ps(P.wm + (2 * sb + h) * 8);
          for (int i = 0; i < RT; ++i) t[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(s16[(2 * sb + h) * MR + i]), t[i]);
        }
      }
      for (int i = 0; i < RT; ++i) acc[i] = _mm256_fmadd_ps(t[i], _mm256_set1_ps(dx[sb * MR + i]), acc[i]);
    } else {
      __m256i ia[MR];
      for (int i = 0; i < RT; ++i) ia[i] = OFF ? _mm256_set1_epi32(off[sb * MR + i]) : _mm256_setzero_si256();
      if (signed_codes(TYPE)) {  // |w| against x flipped where w < 0, from sum(|w| : w < 0) (see P_Q8_U8)
        const __m256i neg = _mm256_load_si256((const __m256i*)(P.negsum + sb * 8));
        for (int i = 0; i < RT; ++i) ia[i] = neg;
        const uint8_t* wn = P.negs + (wc - P.codes);
        PROMPT_NO_UNROLL for (int g = 0; g < 8; ++g) {  // unrolled, GCC sums the 8 groups' products as a tree
                                                         // and spills them
          const __m256i aw = _mm256_load_si256((const __m256i*)wc), m = _mm256_load_si256((const __m256i*)wn);
          const uint8_t* x0 = reinterpret_cast<const uint8_t*>(xq);
          for (int i = 0; i < RT; ++i) {
            const __m256i fx = _mm256_xor_si256(_mm256_set1_epi32(ld32(x0 + 4 * i)), m);
            ia[i] = dot4_u8s8(ia[i], aw, fx);
          }
          wc += 32;
          wn += 32;
          xq += 4 * MR;
        }
      } else if (codes4(TYPE)) {
        dot_8groups<RT>(wc, xq, ia);
        wc += 256;
        xq += 32 * MR;
      } else {
        for (int g = 0; g < 8; g += 4) {
          dot_4groups<RT>(wc, xq, ia);
          wc += 128;
          xq += 16 * MR;
        }
      }
      const __m256 sc = _mm256_load_ps(P.ws + sb * 8);
      for (int i = 0; i < RT; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_mul_ps(sc, _mm256_set1_ps(dx[sb * MR + i])), acc[i]);
      if (F::MIN) {
        const __m256 mn = _mm256_load_ps(P.wm + sb * 8);
        for (int i = 0; i < RT; ++i) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[sb * MR + i]), acc[i]);
      }
    }
  }
  PROMPT_UNROLL for (int i = 0; i < RT; ++i) _mm256_store_ps(out + i * 8, acc[i]);
}
#else
template <int TYPE, int RT>
void prompt_micro(const Panel& P, const PromptActs& A, int64_t mb, int64_t k0, int64_t kc, float* out) {
  using F = Fmt<TYPE>;
  constexpr int MR = P_MR, NR = P_NR;
  const int8_t* wc = reinterpret_cast<const int8_t*>(P.codes);
  const int8_t* xq = A.q + (mb * A.K + k0) * MR;
  const float* dx = A.d + (mb * A.nb + k0 / 32) * MR;
  const float* sx = A.s + (mb * A.nb + k0 / 32) * MR;
  float acc[MR][NR] = {};
  for (int64_t sb = 0; sb < kc / 32; ++sb) {
    constexpr int HALVES = per16(TYPE) ? 2 : 1;
    float t[MR][NR] = {};
    for (int h = 0; h < HALVES; ++h) {
      int32_t ia[MR][NR] = {};
      for (int g = 0; g < 8 / HALVES; ++g) {
        for (int i = 0; i < RT; ++i)
          for (int n = 0; n < NR; ++n)
            for (int l = 0; l < 4; ++l) ia[i][n] += (int32_t)wc[n * 4 + l] * xq[i * 4 + l];
        wc += NR * 4;
        xq += MR * 4;
      }
      const float* sc = P.ws + (HALVES * sb + h) * NR;
      for (int i = 0; i < RT; ++i)
        for (int n = 0; n < NR; ++n) t[i][n] += (float)ia[i][n] * sc[n];
      if (min16(TYPE)) {
        const float* s16 = A.s16 + (mb * A.nsub + k0 / 16 + 2 * sb + h) * MR;
        for (int i = 0; i < RT; ++i)
          for (int n = 0; n < NR; ++n) t[i][n] += P.wm[(2 * sb + h) * NR + n] * s16[i];
      }
    }
    for (int i = 0; i < RT; ++i)
      for (int n = 0; n < NR; ++n) {
        acc[i][n] += t[i][n] * dx[sb * MR + i];
        if (F::MIN) acc[i][n] += P.wm[sb * NR + n] * sx[sb * MR + i];
      }
  }
  for (int i = 0; i < RT; ++i)
    for (int n = 0; n < NR; ++n) out[i * NR + n] = acc[i][n];
}
#endif

// Store (first block of K) or add one MR x NR tile into y.
inline void prompt_write(const float* out, float* y, int64_t ldy, int64_t m0, int64_t M, const int32_t* cols,
                         int nvalid, bool contiguous, bool first) {
  for (int i = 0; i < P_MR && m0 + i < M; ++i) {
    float* yr = y + (m0 + i) * ldy;
    const float* o = out + i * P_NR;
    if (contiguous) {
      yr += cols[0];
      if (first)
        for (int n = 0; n < P_NR; ++n) yr[n] = o[n];
      else
        for (int n = 0; n < P_NR; ++n) yr[n] += o[n];
    } else {
      for (int n = 0; n < nvalid; ++n) yr[cols[n]] = first ? o[n] : yr[cols[n]] + o[n];
    }
  }
}

#ifdef EDGELLM_G_AVX2
// The same panel from x8 groups (cpu_gguf_x8.cpp): rows n0 .. n0 + nvalid (whole groups, in stored order).
template <int TYPE>
void build_panel_x8(const uint8_t* x8, int64_t n0, int nvalid, int64_t K, int64_t k0, int64_t kc, const Panel& P) {
  constexpr int NR = P_NR;
  constexpr int64_t QV = Fmt<TYPE>::QV, SUB = QV / 32;       // values per x8 unit (256; Q5_0 / Q5_1: 32), sub-blocks
  constexpr int64_t NWS = per16(TYPE) ? 2 * SUB : SUB;  // scales per unit (Q6_K / Q3_K: one per 16 values)
  const int64_t xb = gguf_x8_bytes(TYPE), gbytes = K / QV * xb;
  for (int64_t u0 = 0; u0 < kc; u0 += QV) {
    const int64_t s = (k0 + u0) / QV, sl = u0 / QV;  // the unit, and its place in the panel
    for (int gi = 0; gi < NR / 8; ++gi) {
      uint8_t* codes = P.codes + sl * SUB * 8 * NR * 4 + gi * 32;
      float* ws = P.ws + NWS * sl * NR + gi * 8;
      constexpr int64_t NWM = min16(TYPE) ? NWS : Fmt<TYPE>::MIN ? SUB : 0;  // mins per unit (Q2_K: per 16 values)
      float* wm = P.wm + NWM * sl * NR + gi * 8;
      if (8 * gi >= nvalid) {  // past the part's last group: zeros
        for (int jg = 0; jg < 8 * SUB; ++jg) std::memset(codes + jg * NR * 4, 0, 32);
        for (int t = 0; t < NWS; ++t) std::memset(ws + t * NR, 0, 32);
        for (int t = 0; t < NWM; ++t) std::memset(wm + t * NR, 0, 32);
        continue;
      }
      gguf_x8_panel_sb(x8 + (n0 / 8 + gi) * gbytes + s * xb, TYPE, codes, NR * 4, ws, wm, NR);
    }
    if (signed_codes(TYPE)) signed_panel_codes((int)SUB, sl * SUB, P);  // (IQ4_XS)
  }
}
#endif

// Where a panel's rows come from: GGUF blocks as stored (taken in the order `rows` gives), x8 groups, or our int8 /
// int4 layout.  build(): the panel of rows [n0, n0 + nvalid) over [k0, k0 + kc); and the next panel's
// first values, while this one runs (prefetch_next).
template <int TYPE> struct StoredRows {
  const uint8_t* blocks;
  int64_t rb;
  const int32_t* rows;
  void build(int64_t n0, int nvalid, int64_t k0, int64_t kc, const Panel& P) const {
    build_panel<TYPE>(blocks, rb, rows + n0, nvalid, k0, kc, P);
  }
  void prefetch_next(int64_t n0, int64_t N, int64_t k0) const {
    using F = Fmt<TYPE>;
    const int64_t len = 256 / F::QV * F::BYTES, at = k0 / F::QV * F::BYTES;
    for (int64_t r = n0; r < std::min<int64_t>(N, n0 + P_NR); ++r)
      for (int64_t o = 0; o < len + 63; o += 64) prefetch(blocks + (int64_t)rows[r] * rb + at + std::min(o, len - 1));
  }
};

#ifdef EDGELLM_G_AVX2
template <int TYPE> struct R8Rows : StoredRows<TYPE> {  // TYPE: the stored type (Q5_0, Q5_1)
  void build(int64_t n0, int nvalid, int64_t k0, int64_t kc, const Panel& P) const {
    build_panel<GGUF_R8 + TYPE>(this->blocks, this->rb, this->rows + n0, nvalid, k0, kc, P);
  }
};

template <int TYPE> struct X8Rows {
  const uint8_t* x8;
  int64_t K;
  void build(int64_t n0, int nvalid, int64_t k0, int64_t kc, const Panel& P) const {
    build_panel_x8<TYPE>(x8, n0, nvalid, K, k0, kc, P);
  }
  void prefetch_next(int64_t, int64_t, int64_t) const {}
};
#endif

template <int TYPE> struct QuantRows {
  QuantWeights w;
  int64_t K;
  void build(int64_t n0, int nvalid, int64_t k0, int64_t kc, const Panel& P) const {
    build_panel_quant<TYPE>(w, K, n0, nvalid, k0, kc, P);
  }
  void prefetch_next(int64_t, int64_t, int64_t) const {}
};

template <int TYPE, class Rows>
void prompt_range(const PromptActs& A, const Rows& src, int64_t N, const int32_t* cols, int64_t p0, int64_t p1,
                  int64_t k0, int64_t kn, float* y, int64_t ldy) {
  constexpr int NR = P_NR;
  const int64_t nmb = A.Mp / P_MR;
  const Panel P = panel_buffer(kn);
  alignas(64) float out[P_MR * P_NR];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * NR;
    const int nvalid = (int)std::min<int64_t>(NR, N - n0);
    src.build(n0, nvalid, k0, kn, P);
    if (p + 1 < p1) src.prefetch_next(n0 + NR, N, k0);
    // every column in turn, not only the first and last: an x8 part's columns keep their stored rows' order, and
    // a permutation within the panel (0, 2, 1, 3, ...) has the same ends as a run
    bool contiguous = nvalid == NR;
    for (int i = 1; contiguous && i < NR; ++i) contiguous = cols[n0 + i] == cols[n0] + i;
    for (int64_t mb = 0; mb < nmb; ++mb) {
      const int64_t left = A.M - mb * P_MR;
      if (left > P_MR / 2)
        prompt_micro<TYPE, P_MR>(P, A, mb, k0, kn, out);
      else if (left > P_MR / 4)
        prompt_micro<TYPE, P_MR / 2>(P, A, mb, k0, kn, out);
      else
        prompt_micro<TYPE, P_MR / 4>(P, A, mb, k0, kn, out);
      prompt_write(out, y, ldy, mb * P_MR, A.M, cols + n0, nvalid, contiguous, k0 == 0);
    }
  }
}

// y[:, cols[n]] = x @ row n^T for the N rows `src` gives.  Per block of K, the threads take runs of panels
// (parallel_runs); blocks of K run one after another (each adds into y).
template <int TYPE, class Rows>
void prompt_gemm(const GgufActs& a, const Rows& src, int64_t N, const int32_t* cols, float* y, int64_t ldy) {
  const PromptActs A = prompt_acts<TYPE>(a);
  // a block of K as long as the repacked x block (Mp x kc bytes) stays within ~2 MiB, whole super-blocks: at
  // M = 512 on Zen 4 (1 MiB L2) 1 to 4 MiB measured alike, 512 KiB 5-10% slower and 256 KiB 20% (more passes
  // adding into y)
  const int64_t kc = std::min<int64_t>(a.K, std::max<int64_t>(256, ((int64_t(2) << 20) / std::max<int64_t>(A.Mp, 1)) / 256 * 256));
  const int64_t npanel = (N + P_NR - 1) / P_NR;
  for (int64_t k0 = 0; k0 < a.K; k0 += kc) {
    const int64_t kn = std::min(kc, a.K - k0);
    parallel_runs(npanel, [&](int64_t p0, int64_t p1) {
      prompt_range<TYPE>(A, src, N, cols, p0, p1, k0, kn, y, ldy);
    });
  }
}

// ================================================================================================ AMX prefill
// The same product on AMX tiles (Intel Xeon since Sapphire Rapids), in bf16: per panel of 16 weight rows the panel
// unpacked as above (codes, scales, mins) is turned into bf16 weights d * sc * (q - off) + min in the layout
// TDPBF16PS takes for B ([k / 2][16 columns][2 values], 64 bytes a row: one 16-row tile per 32 values of K), kept in
// L1/L2, and multiplied against x as bf16 rows (A tiles of 16 rows x 32 values, read in place), up to 4 C tiles of
// 16 x 16 fp32 sums at a time (64 activation rows).  Each weight is dequantized once per call and never written to
// memory; the sums stay fp32 across K.  x and W are rounded to bf16 (relative 2^-9 each), finer than the prompt GEMM's
// int8 rounding of x (up to 1/254 of a block's largest value): KL to the fp model 20x smaller on SmolLM2.
#if defined(EDGELLM_P_ZMM) && defined(EDGELLM_AMX)
#define EDGELLM_P_AMX 1
#ifndef EDGELLM_AMX_KC_BYTES
#define EDGELLM_AMX_KC_BYTES (1 << 21)
#endif
#define AMX_TARGET EDGELLM_AMX_TARGET
using amx::bf16_pairs;

// The panel P (kc values of K) as bf16 B tiles at bt: [kc / 32][16 rows][64 bytes].
template <int TYPE>
AMX_TARGET void panel_to_bf16(const Panel& P, int64_t kc, uint8_t* bt) {
  using F = Fmt<TYPE>;
  constexpr int OFF = prompt_off<TYPE>();
  const __m512i lowbyte = _mm512_set1_epi32(0xff);
  const __m512 off = _mm512_set1_ps((float)OFF);
  for (int64_t sb = 0; sb < kc / 32; ++sb)
    for (int g = 0; g < 8; ++g) {  // values 4g .. 4g + 3 of the sub-block
      const __m512i c = _mm512_load_si512((const void*)(P.codes + (sb * 8 + g) * 64));
      const int64_t si = per16(TYPE) ? 2 * sb + g / 4 : sb, mi = min16(TYPE) ? 2 * sb + g / 4 : sb;
      const __m512 ws = _mm512_load_ps(P.ws + si * 16);
      const bool mins = per16(TYPE) ? min16(TYPE) : F::MIN;
      const __m512 wm = mins ? _mm512_load_ps(P.wm + mi * 16) : _mm512_setzero_ps();
      __m512 w[4];
      for (int j = 0; j < 4; ++j) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(c, 8 * j), lowbyte));
        if (OFF) v = _mm512_sub_ps(v, off);
        w[j] = _mm512_fmadd_ps(v, ws, wm);
      }
      _mm512_store_si512((void*)(bt + (sb * 16 + 2 * g) * 64), bf16_pairs(w[0], w[1]));
      _mm512_store_si512((void*)(bt + (sb * 16 + 2 * g + 1) * 64), bf16_pairs(w[2], w[3]));
    }
}

// c[16 TM][16 TN] (row stride 16 TN) = x rows [0, 16 TM) at xb (stride ldx values) against the TN panels' B tiles at
// bt[0], bt[1], over nsteps x 32 values of K.  Tiles: C 0-3 (C[i][j] = tile 2 i + j), A 4-5, B 6-7.
template <int TM, int TN>
AMX_TARGET void amx_micro(const uint16_t* xb, int64_t ldx, const uint8_t* const* bt, int64_t nsteps, float* c) {
  _tile_zero(0);
  if (TN > 1) _tile_zero(1);
  if (TM > 1) _tile_zero(2);
  if (TM > 1 && TN > 1) _tile_zero(3);
  const int64_t stride = ldx * 2;
  const uint16_t* x1 = xb + 16 * ldx;
  for (int64_t s = 0; s < nsteps; ++s) {
    _tile_loadd(6, bt[0] + s * 1024, 64);
    if (TN > 1) _tile_loadd(7, bt[1] + s * 1024, 64);
    _tile_loadd(4, xb + s * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (TN > 1) _tile_dpbf16ps(1, 4, 7);
    if (TM > 1) {
      _tile_loadd(5, x1 + s * 32, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (TN > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = 64 * TN;  // bytes
  _tile_stored(0, c, ldc);
  if (TN > 1) _tile_stored(1, c + 16, ldc);
  if (TM > 1) _tile_stored(2, c + 16 * 16 * TN, ldc);
  if (TM > 1 && TN > 1) _tile_stored(3, c + 16 * 16 * TN + 16, ldc);
}

// Panels [p0, p1) of 16 columns, two at a time, against x's rows; xb: the K block's bf16 rows [Mp, ldx].
template <int TYPE, class Rows>
AMX_TARGET void amx_range(const uint16_t* xb, int64_t ldx, int64_t M, int64_t Mp, const Rows& src, int64_t N,
                          const int32_t* cols, int64_t p0, int64_t p1, int64_t k0, int64_t kn, float* y, int64_t ldy) {
  constexpr int NR = P_NR;
  static_assert(NR == 16, "a B tile holds 16 columns");
  const Panel P = panel_buffer(kn);
  static thread_local std::vector<uint8_t> bbuf;
  const size_t bbytes = (size_t)(kn * 32);  // one panel's B tiles: kn / 32 tiles of 1 KiB
  if (bbuf.size() < 2 * bbytes + 64) bbuf.resize(2 * bbytes + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  uint8_t* const bt[2] = {base, base + bbytes};
  alignas(64) float c[32 * 32];
  alignas(64) float out[P_MR * NR];
  amx::configure(8);
  for (int64_t p = p0; p < p1; p += 2) {
    const int np = (int)std::min<int64_t>(2, p1 - p);
    int nvalid[2] = {0, 0};
    bool contiguous[2] = {false, false};
    for (int j = 0; j < np; ++j) {
      const int64_t n0 = (p + j) * NR;
      nvalid[j] = (int)std::min<int64_t>(NR, N - n0);
      src.build(n0, nvalid[j], k0, kn, P);
      panel_to_bf16<TYPE>(P, kn, bt[j]);
      contiguous[j] = nvalid[j] == NR;
      for (int i = 1; contiguous[j] && i < NR; ++i) contiguous[j] = cols[n0 + i] == cols[n0] + i;
    }
    if (p + 2 < p1) src.prefetch_next((p + 2) * NR, N, k0);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const bool two_m = Mp - m0 >= 32;
      const uint16_t* xm = xb + m0 * ldx;
      if (two_m && np == 2) amx_micro<2, 2>(xm, ldx, bt, kn / 32, c);
      else if (two_m) amx_micro<2, 1>(xm, ldx, bt, kn / 32, c);
      else if (np == 2) amx_micro<1, 2>(xm, ldx, bt, kn / 32, c);
      else amx_micro<1, 1>(xm, ldx, bt, kn / 32, c);
      const int64_t ldc = 16 * np;
      for (int j = 0; j < np; ++j)
        for (int64_t r = 0; r < (two_m ? 32 : 16) && m0 + r < M; r += P_MR) {
          for (int i = 0; i < P_MR; ++i) std::memcpy(out + i * NR, c + 16 * j + (r + i) * ldc, NR * 4);
          prompt_write(out, y, ldy, m0 + r, M, cols + (p + j) * NR, nvalid[j], contiguous[j], k0 == 0);
        }
    }
  }
  _tile_release();
}

// y[:, cols[n]] = x @ row n^T, x as bf16 rows [Mp, K] (Mp: M rounded up to 16, the rows past M zeros).  Per block of
// K (kc values, x's block within ~EDGELLM_AMX_KC_BYTES, whole super-blocks) x's block is copied into rows of kc + 32
// values (a row stride off the powers of two, which would map a tile's 16 rows onto the same cache sets).
template <int TYPE, class Rows>
void amx_gemm(const uint16_t* xb, int64_t M, int64_t K, const Rows& src, int64_t N, const int32_t* cols, float* y,
              int64_t ldy) {
  const int64_t Mp = (M + 15) / 16 * 16;
  const int64_t kc = std::min<int64_t>(K, std::max<int64_t>(256, ((int64_t)EDGELLM_AMX_KC_BYTES / 2 / Mp) / 256 * 256));
  const int64_t npanel = (N + P_NR - 1) / P_NR, ldx = kc + 32;
  std::vector<uint16_t> blk((size_t)(Mp * ldx + 32));
  uint16_t* xk = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(blk.data()) + 63) & ~uintptr_t(63));
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kn = std::min(kc, K - k0);
    parallel_run(0, Mp, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) std::memcpy(xk + r * ldx, xb + r * K + k0, (size_t)kn * 2);
    });
    // runs of an even number of panels, so that pairs stay pairs
    const int64_t npair = (npanel + 1) / 2;
    parallel_runs(npair, [&](int64_t q0, int64_t q1) {
      amx_range<TYPE>(xk, ldx, M, Mp, src, N, cols, 2 * q0, std::min(npanel, 2 * q1), k0, kn, y, ldy);
    });
  }
}
#endif

// The rows of a GGUF part in the order of their output columns, handed to `gemm(rows builder, N, cols)`: the prompt
// GEMM, or (AMX builds) its bf16 AMX version.
template <int TYPE, bool X8 = false> struct PartRows {
  template <class Gemm>
  static void run(const uint8_t* blocks, int64_t K, int64_t N, const int32_t* idx, const Gemm& gemm) {
    // the stored rows in the order of their output columns (ascending), so panels write runs of columns (x8 parts:
    // in stored order, their groups being the panels' rows)
    std::vector<int32_t> rows((size_t)N), cols((size_t)N);
    if (idx && X8) {
      for (int64_t n = 0; n < N; ++n) rows[(size_t)n] = (int32_t)n, cols[(size_t)n] = idx[n];
    } else if (idx) {
      std::vector<int64_t> key((size_t)N);
      for (int64_t n = 0; n < N; ++n) key[(size_t)n] = ((int64_t)idx[n] << 32) | n;
      std::sort(key.begin(), key.end());
      for (int64_t n = 0; n < N; ++n) {
        rows[(size_t)n] = (int32_t)(key[(size_t)n] & 0xffffffff);
        cols[(size_t)n] = (int32_t)(key[(size_t)n] >> 32);
      }
    } else {
      for (int64_t n = 0; n < N; ++n) rows[(size_t)n] = cols[(size_t)n] = (int32_t)n;
    }
    const int64_t rb = K / Fmt<TYPE>::QV * Fmt<TYPE>::BYTES;
#ifdef EDGELLM_G_AVX2
    if constexpr (is_r8(TYPE)) {
      gemm(std::integral_constant<int, stored_of(TYPE)>{}, R8Rows<stored_of(TYPE)>{{blocks, rb, rows.data()}}, cols.data());
      return;
    } else if (X8) {
      gemm(std::integral_constant<int, TYPE>{}, X8Rows<TYPE>{blocks, K}, cols.data());
      return;
    }
#endif
    if constexpr (!is_r8(TYPE)) gemm(std::integral_constant<int, TYPE>{}, StoredRows<TYPE>{blocks, rb, rows.data()}, cols.data());
  }
};

template <int TYPE, bool X8 = false> struct PromptOp {
  static void run(const GgufActs& a, const uint8_t* blocks, int64_t N, float* y, int64_t ldy, const int32_t* idx) {
    PartRows<TYPE, X8>::run(blocks, a.K, N, idx, [&](auto t, const auto& src, const int32_t* cols) {
      prompt_gemm<decltype(t)::value>(a, src, N, cols, y, ldy);
    });
  }
};

template <int TYPE> struct PromptX8Op {
  static void run(const GgufActs& a, const uint8_t* x8, int64_t N, float* y, int64_t ldy, const int32_t* idx) {
    PromptOp<TYPE, true>::run(a, x8, N, y, ldy, idx);
  }
};

#ifdef EDGELLM_P_AMX
template <int TYPE, bool X8 = false> struct AmxOp {
  static void run(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* blocks, int64_t N, float* y, int64_t ldy,
                  const int32_t* idx) {
    PartRows<TYPE, X8>::run(blocks, K, N, idx, [&](auto t, const auto& src, const int32_t* cols) {
      amx_gemm<decltype(t)::value>(xb, M, K, src, N, cols, y, ldy);
    });
  }
};

template <int TYPE> struct AmxX8Op {
  static void run(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* x8, int64_t N, float* y, int64_t ldy,
                  const int32_t* idx) {
    AmxOp<TYPE, true>::run(xb, M, K, x8, N, y, ldy, idx);
  }
};
#endif

template <int TYPE>
void prompt_quant(const GgufActs& a, const QuantWeights& w, int64_t N, float* y, int64_t ldy) {
  std::vector<int32_t> cols((size_t)N);
  for (int64_t n = 0; n < N; ++n) cols[(size_t)n] = (int32_t)n;
  prompt_gemm<TYPE>(a, QuantRows<TYPE>{w, a.K}, N, cols.data(), y, ldy);
}
// ================================================================================================ end prompt GEMM

}  // namespace

bool gguf_supported(int type) { return gguf_block_values(type) != 0; }

int64_t gguf_block_values(int type) {
  if (type > GGUF_R8) return gguf_r8_supported(type - GGUF_R8) ? 32 : 0;
  if (type > GGUF_X8) return gguf_x8_supported(type - GGUF_X8) ? gguf_block_values(type - GGUF_X8) : 0;
  if (type > GGUF_L4) return gguf_l4_base(type - GGUF_L4) ? 256 : 0;
  switch (type) {
    case GGUF_Q4_0: case GGUF_Q4_1: case GGUF_Q5_0: case GGUF_Q5_1: case GGUF_Q8_0: case GGUF_IQ4_NL: return 32;
    case GGUF_Q2_K: case GGUF_Q3_K: case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K: case GGUF_IQ4_XS:
    case GGUF_IQ2_XXS: case GGUF_IQ3_XXS: case GGUF_IQ3_S: return 256;
    default: return 0;
  }
}

int64_t gguf_block_bytes(int type) {
  if (type > GGUF_R8) return gguf_r8_supported(type - GGUF_R8) ? gguf_block_bytes(type - GGUF_R8) : 0;
  if (type > GGUF_X8) return gguf_x8_supported(type - GGUF_X8) ? gguf_x8_bytes(type - GGUF_X8) / 8 : 0;
  static_assert(Fmt<GGUF_IQ4_XS>::BYTES == GGUF_L4_BYTES, "an L4 block is an IQ4_XS block");
  if (type > GGUF_L4) return gguf_l4_base(type - GGUF_L4) ? gguf_l4_block_bytes(type) : 0;
  switch (type) {
    case GGUF_Q4_0: return Fmt<GGUF_Q4_0>::BYTES;
    case GGUF_Q4_1: return Fmt<GGUF_Q4_1>::BYTES;
    case GGUF_Q5_0: return Fmt<GGUF_Q5_0>::BYTES;
    case GGUF_Q5_1: return Fmt<GGUF_Q5_1>::BYTES;
    case GGUF_Q8_0: return Fmt<GGUF_Q8_0>::BYTES;
    case GGUF_Q4_K: return Fmt<GGUF_Q4_K>::BYTES;
    case GGUF_Q5_K: return Fmt<GGUF_Q5_K>::BYTES;
    case GGUF_Q6_K: return Fmt<GGUF_Q6_K>::BYTES;
    case GGUF_Q3_K: return Fmt<GGUF_Q3_K>::BYTES;
    case GGUF_Q2_K: return Fmt<GGUF_Q2_K>::BYTES;
    case GGUF_IQ4_NL: return Fmt<GGUF_IQ4_NL>::BYTES;
    case GGUF_IQ4_XS: return Fmt<GGUF_IQ4_XS>::BYTES;
    case GGUF_IQ2_XXS: return Fmt<GGUF_IQ2_XXS>::BYTES;
    case GGUF_IQ3_XXS: return Fmt<GGUF_IQ3_XXS>::BYTES;
    case GGUF_IQ3_S: return Fmt<GGUF_IQ3_S>::BYTES;
    default: return 0;
  }
}

bool gguf_r8_supported(int base_type) {
#ifdef EDGELLM_G_AVX2
  return base_type == GGUF_Q5_0 || base_type == GGUF_Q5_1;
#else
  (void)base_type;
  return false;  // the portable and NEON kernels read the stored layout
#endif
}

// One chunk either way: 8 stored blocks (bs bytes each: d, [m,] qh, qs) <-> the r8 chunk (see Fmt<GGUF_Q5_0_R8>).
template <bool TO_R8>
void convert_r8_chunk(uint8_t* blk, uint8_t* chunk, int64_t bs, bool has_min) {
  const int64_t hoff = has_min ? 4 : 2;        // qh within a block (qs after it)
  uint8_t* h = chunk + (has_min ? 32 : 16);    // the chunk's fifth bits, then its nibbles
  uint8_t* qs = h + 32;
  uint32_t qh[8] = {};
  for (int j = 0; j < 8; ++j) {
    uint8_t* b = blk + j * bs;
    uint8_t* q = qs + 32 * (j / 2) + 16 * (j % 2);
    if (TO_R8) {
      std::memcpy(chunk + 2 * j, b, 2);
      if (has_min) std::memcpy(chunk + 16 + 2 * j, b + 2, 2);
      std::memcpy(&qh[j], b + hoff, 4);
      std::memcpy(q, b + hoff + 4, 16);
    } else {
      std::memcpy(b, chunk + 2 * j, 2);
      if (has_min) std::memcpy(b + 2, chunk + 16 + 2 * j, 2);
      std::memcpy(b + hoff + 4, q, 16);
    }
  }
  // code vector v = 2k + e, lane l: block 2k + (l >= 16), value (l & 15) + 16 e
#ifdef EDGELLM_G_AVX2
  if (TO_R8) {  // each block's 32 bits as bytes (bits32: 0x10 where set), lanes picked per vector, packed by bit
    __m256i hv = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i a = bits32(reinterpret_cast<const uint8_t*>(&qh[2 * k]));
      const __m256i b = bits32(reinterpret_cast<const uint8_t*>(&qh[2 * k + 1]));
      const __m256i lo = _mm256_srli_epi16(_mm256_permute2x128_si256(a, b, 0x20), 4);  // 0x10 -> 1 (bytes stay apart)
      const __m256i hi = _mm256_srli_epi16(_mm256_permute2x128_si256(a, b, 0x31), 4);
      hv = _mm256_or_si256(hv, _mm256_or_si256(_mm256_sll_epi16(lo, _mm_cvtsi32_si128(2 * k)),
                                               _mm256_sll_epi16(hi, _mm_cvtsi32_si128(2 * k + 1))));
    }
    _mm256_storeu_si256((__m256i*)h, hv);
    return;
  }
#endif
  for (int l = 0; l < 32; ++l) {
    uint8_t byte = TO_R8 ? 0 : h[l];
    for (int v = 0; v < 8; ++v) {
      const int blkno = (v & ~1) + (l >= 16), bit = (l & 15) + 16 * (v & 1);
      if (TO_R8) byte = (uint8_t)(byte | (((qh[blkno] >> bit) & 1u) << v));
      else qh[blkno] |= (uint32_t)((byte >> v) & 1) << bit;
    }
    if (TO_R8) h[l] = byte;
  }
  if (!TO_R8)
    for (int j = 0; j < 8; ++j) std::memcpy(blk + j * bs + hoff, &qh[j], 4);
}

void gguf_convert_r8(const uint8_t* src, int base_type, int64_t N, int64_t K, uint8_t* dst, bool to_r8) {
  const int64_t bs = gguf_block_bytes(base_type), rb = K / 32 * bs, nchunk = K / 256;
  const bool has_min = base_type == GGUF_Q5_1;
  parallel_run(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(rb, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint8_t* in = const_cast<uint8_t*>(src + n * rb);  // only read (convert_r8_chunk writes its other side)
      uint8_t* out = dst + n * rb;
      for (int64_t c = 0; c < nchunk; ++c) {
        if (to_r8) convert_r8_chunk<true>(in + c * 8 * bs, out + c * 8 * bs, bs, has_min);
        else convert_r8_chunk<false>(out + c * 8 * bs, in + c * 8 * bs, bs, has_min);
      }
      std::memcpy(out + nchunk * 8 * bs, in + nchunk * 8 * bs, (size_t)(rb - nchunk * 8 * bs));  // the tail as stored
    }
  });
}

GgufActs gguf_quantize_acts(const float* x, int64_t M, int64_t K, bool paired) {
  GgufActs a;
  a.M = M;
  a.K = K;
  a.nb = K / QK;
  const size_t per = (size_t)(M * a.nb);
  // q [M, K] (K % 32 == 0: every row 32-byte aligned), then d, s, sum32 (4 bytes each), sum16 (2 x 2 bytes),
  // d_sum16, q3k_off (2 x 4 bytes each)
  uint8_t* base = acts_buffer(per * 96 + 64);
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + per * 32);
  float* s = d + per;
  int32_t* s32 = reinterpret_cast<int32_t*>(s + per);
  int16_t* s16 = reinterpret_cast<int16_t*>(s32 + per);
  float* ds16 = reinterpret_cast<float*>(s16 + 2 * per);
  int32_t* off3 = reinterpret_cast<int32_t*>(ds16 + 2 * per);
#ifdef EDGELLM_G_AVX2
  int8_t* q2 = paired ? reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(off3 + 2 * per) + 63) & ~uintptr_t(63))
                      : nullptr;
#else
  (void)paired;
#endif
  // rows split over threads, ~32k values a task (a prompt chunk's x: 1-4M values; a decode step's: one task)
  parallel_run(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < a.nb; ++b) {
        const int64_t o = m * a.nb + b;
        d[o] = quantize_block32(x + m * K + b * QK, q + m * K + b * QK, &s32[o], &s16[2 * o]);
        s[o] = d[o] * (float)s32[o];
        for (int h = 0; h < 2; ++h) {
          ds16[2 * o + h] = d[o] * (float)s16[2 * o + h];
          off3[2 * o + h] = (int32_t)(uint16_t)(-4 * s16[2 * o + h]);
        }
      }
#ifdef EDGELLM_G_AVX2
    if (q2)
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < a.nb; ++b) {
          int8_t* dst = q2 + m * K + (b >> 1) * 64 + (b & 1) * 16;
          std::memcpy(dst, q + m * K + b * QK, 16);
          std::memcpy(dst + 32, q + m * K + b * QK + 16, 16);
        }
#endif
  });
#ifdef EDGELLM_G_AVX2
  a.q2 = q2;
#endif
  a.q = q;
  a.d = d;
  a.s = s;
  a.sum32 = s32;
  a.sum16 = s16;
  a.d_sum16 = ds16;
  a.q3k_off = off3;
  return a;
}

void gguf_gemm(const GgufActs& acts, const uint8_t* blocks, int type, int64_t N, int64_t K, float* y, int64_t ldy,
               const int32_t* out_index) {
  if (N <= 0 || acts.M <= 0 || K != acts.K || !gguf_supported(type) || K % gguf_block_values(type) != 0) return;
  if (gguf_is_x8(type)) {
    if (N % 8 == 0) gguf_gemm_x8(acts, blocks, type - GGUF_X8, N, y, ldy, out_index);
    return;
  }
  dispatch<GemmOp>(type, acts, blocks, N, y, ldy, out_index);
}

void gguf_dequantize_rows(const uint8_t* blocks, int type, int64_t N, int64_t K, float* out) {
  if (N <= 0 || !gguf_supported(type) || K % gguf_block_values(type) != 0) return;
  if (gguf_is_x8(type)) {  // back to the stored layout, then as stored (a fallback path: exports, other devices)
    if (N % 8 != 0) return;
    std::vector<uint8_t> raw((size_t)gguf_row_bytes(type - GGUF_X8, K) * (size_t)N);
    gguf_unrepack_x8(blocks, type - GGUF_X8, N, K, raw.data());
    dispatch<DequantOp>(type - GGUF_X8, raw.data(), N, K, out);
    return;
  }
  dispatch<DequantOp>(type, blocks, N, K, out);
}

void gguf_dequantize_rows_bf16(const uint8_t* blocks, int type, int64_t N, int64_t K, uint16_t* out) {
  if (N <= 0 || !gguf_supported(type) || K % gguf_block_values(type) != 0) return;
  if (gguf_is_x8(type)) {
    if (N % 8 == 0) dispatch<DequantBf16Op>(type - GGUF_X8, blocks, N, K, out, gguf_row_bytes(type, K));
    return;
  }
  dispatch<DequantBf16Op>(type, blocks, N, K, out, (int64_t)0);
}

// ------------------------------------------------------------------------------------------------ prompt GEMM
void gguf_gemm_prompt(const GgufActs& acts, const uint8_t* blocks, int type, int64_t N, int64_t K, float* y,
                      int64_t ldy, const int32_t* out_index) {
  if (N <= 0 || acts.M <= 0 || K != acts.K || !gguf_supported(type) || K % gguf_block_values(type) != 0) return;
  if (gguf_is_x8(type)) {
    if (N % 8 != 0) return;
    // x8 parts: panels built from the x8 groups (at M = 17 .. 512 as fast as from the stored blocks, and 1-2x the
    // x8 row kernel: Q4_K 230-280 GOP/s against 160-230, Q6_K 100-230 against 90-110, one thread)
    dispatch_x8<PromptX8Op>(type - GGUF_X8, acts, blocks, N, y, ldy, out_index);
    return;
  }
  dispatch<PromptOp>(type, acts, blocks, N, y, ldy, out_index);
}

bool gguf_amx_available() {
#ifdef EDGELLM_P_AMX
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !(a1 & (1u << 5))) return false;  // AVX512_BF16
    // Linux hands out the tile data state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 = granted
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

void gguf_gemm_amx(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* blocks, int type, int64_t N, float* y,
                   int64_t ldy, const int32_t* out_index) {
#ifdef EDGELLM_P_AMX
  if (N <= 0 || M <= 0 || !gguf_amx_available() || !gguf_supported(type) || K % gguf_block_values(type) != 0) return;
  if (gguf_is_x8(type)) {
    if (N % 8 != 0) return;
    dispatch_x8<AmxX8Op>(type - GGUF_X8, xb, M, K, blocks, N, y, ldy, out_index);
    return;
  }
  dispatch<AmxOp>(type, xb, M, K, blocks, N, y, ldy, out_index);
#else
  (void)xb, (void)M, (void)K, (void)blocks, (void)type, (void)N, (void)y, (void)ldy, (void)out_index;
#endif
}

void quant_gemm_prompt(const GgufActs& acts, const QuantWeights& w, int64_t N, float* y, int64_t ldy) {
  if (N <= 0 || acts.M <= 0 || w.group <= 0 || w.group % 32 || acts.K % w.group) return;
  if (w.bits == 8) prompt_quant<GGUF_Q8_0>(acts, w, N, y, ldy);
  else if (w.bits == 4 && w.mins) prompt_quant<GGUF_Q4_1>(acts, w, N, y, ldy);
  else if (w.bits == 4) prompt_quant<GGUF_Q4_0>(acts, w, N, y, ldy);
}

void quant_gemm_amx(const uint16_t* xb, int64_t M, int64_t K, const QuantWeights& w, int64_t N, float* y, int64_t ldy) {
#ifdef EDGELLM_P_AMX
  if (N <= 0 || M <= 0 || !gguf_amx_available() || w.group <= 0 || w.group % 32 || K % w.group) return;
  std::vector<int32_t> cols((size_t)N);
  for (int64_t n = 0; n < N; ++n) cols[(size_t)n] = (int32_t)n;
  if (w.bits == 8) amx_gemm<GGUF_Q8_0>(xb, M, K, QuantRows<GGUF_Q8_0>{w, K}, N, cols.data(), y, ldy);
  else if (w.bits == 4 && w.mins) amx_gemm<GGUF_Q4_1>(xb, M, K, QuantRows<GGUF_Q4_1>{w, K}, N, cols.data(), y, ldy);
  else if (w.bits == 4) amx_gemm<GGUF_Q4_0>(xb, M, K, QuantRows<GGUF_Q4_0>{w, K}, N, cols.data(), y, ldy);
#else
  (void)xb, (void)M, (void)K, (void)w, (void)N, (void)y, (void)ldy;
#endif
}

bool gguf_prompt_gemm_fast() {
#ifdef EDGELLM_G_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace edgellm
