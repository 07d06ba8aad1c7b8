// The grid-codebook and ternary GGUF types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; TQ1_0, TQ2_0)
// dequantized to fp32 (`--weights fp`), or requantized straight to Q8_0 blocks for the types without a product
// kernel, which the loader multiplies in their place (edgellm/loading.py `_as_q8_0`); and IQ2_XXS / IQ3_XXS / IQ3_S /
// IQ1_S recoded as L4 blocks (cpu_gguf.h GGUF_L4), IQ2_XS / IQ2_S / IQ1_M as L4-per-16 blocks, the CPU loader's form
// of those.  Portable C++, one pass per 256-value block; what gguf.quants' numpy did at ~70 ns a weight (an 8B IQ3
// file: minutes of load) takes a few ns.
//
// Values: the fp32 operations of ggml's dequantize_row_* in their order, so the results are gguf.quants.dequantize's
// bit for bit.  Q8_0: as gguf.quants.quantize (and ggml's quantize_row_q8_0_ref) per 32 values: d = amax / 127,
// q = roundf(x / d) as x * (1 / d), d stored as fp16.
//
// The grids of the other grid types (each entry: 8 small integers) and the 128 sign bytes are the caller's, from
// gguf.quants; IQ2_XXS, IQ3_XXS and IQ3_S decode as the kernels do, from gguf_grids.h (written from gguf.quants).
//
// Block layouts (ggml-common.h), d fp16 unless said:
//   IQ2_XXS, IQ3_XXS, IQ3_S: cpu_gguf.h (gguf_grid_sub, which the kernels share)
//   IQ2_XS  d, qs u16[32], scales[8]: q = qs[i] (8 values): grid q & 511, signs ksigns[q >> 9]; scale per 16 values
//           (nibbles, low first), db = d (0.5 + s) / 4
//   IQ2_S   d, qs[32], signs[32], qh[8], scales[8]: grid qs[i] | ((qh[i/4] >> 2 (i%4)) & 3) << 8, signs[i] the sign
//           bits, scales as IQ2_XS
//   IQ1_S   d, qs[32], qh u16[8]: per 32 values qh: grid qs[4 ib + l] | ((qh >> 3 l) & 7) << 8 (values -1, 0, 1),
//           dl = d (2 ((qh >> 12) & 7) + 1), w = dl (g + delta), delta = -1/8 if qh bit 15 else 1/8
//   IQ1_M   qs[32], qh[16], sc u16[4]: d = the top nibbles of sc; 3-bit scales per 16 values (dl = d (2 s + 1)); per
//           8 values the nibble qh[i/2] >> 4 (i%2): its low 3 bits extend qs[i], bit 3 the delta's sign
//   TQ1_0   qs[48], qh[4], d: base-3 digits, value (x 3^p mod 256) * 3 >> 8, minus 1
//   TQ2_0   qs[64], d: 2-bit codes minus 1
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gguf.h"
#include "half.h"

namespace edgellm {
namespace {

enum GridType { IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22, IQ1_M = 29,
                TQ1_0 = 34, TQ2_0 = 35 };

inline uint16_t u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline float f16(const uint8_t* p) { return half_to_float(u16(p)); }

// IQ2_XXS, IQ3_XXS, IQ3_S: through the kernels' decoding (cpu_gguf.h gguf_grid_sub, codebooks from gguf_grids.h):
// scale * (+-g) is gguf.quants' (db * g) * (+-1) exactly
template <int TYPE>
void grid_iquant(const uint8_t* b, const GridTables&, float* v) {
  const float d = f16(b);
  int8_t w[32];
  for (int j = 0; j < 8; ++j) {
    const float scale = gguf_grid_sub<TYPE>(b, j, d, w);
    for (int l = 0; l < 32; ++l) v[32 * j + l] = scale * (float)w[l];
  }
}

// IQ2_XS / IQ2_S: each 16 values' multiplier m = 2 s + 1 and each value's grid value with its sign: the value is
// ((d / 8) m) w, gguf.quants' (d (0.5 + s) / 4) g (+-1) bit for bit (cpu_gguf.h GGUF_IQ2_XS_L4)
template <int TYPE>
void iq2_levels(const uint8_t* b, const GridTables& t, int m[16], int8_t w[256]) {
  for (int i = 0; i < 32; ++i) {  // 8 values
    int q;
    uint8_t signs;
    if (TYPE == IQ2_XS) {
      const uint16_t v = u16(b + 2 + 2 * i);
      q = v & 511;
      signs = t.ksigns[v >> 9];
    } else {
      q = b[2 + i] | ((b[66 + i / 4] >> 2 * (i % 4)) & 3) << 8;
      signs = b[34 + i];
    }
    const int8_t* g = t.grid + 8 * q;
    for (int j = 0; j < 8; ++j) {  // g negated where sign bit j is set, without a branch (random bits: mispredicted
      const int neg = -((signs >> j) & 1);  // half the time)
      w[8 * i + j] = (int8_t)((g[j] ^ neg) - neg);
    }
  }
  const uint8_t* scales = b + (TYPE == IQ2_XS ? 66 : 74);
  for (int k = 0; k < 16; ++k) m[k] = 2 * ((scales[k / 2] >> 4 * (k % 2)) & 15) + 1;
}

// their values: db = d (0.5 + s) / 4 per 16 values (s = (m - 1) / 2) times each signed grid value, gguf.quants' (db g)
// (+-1) bit for bit (the product's sign is the factor's)
template <int TYPE>
void iq2_block(const uint8_t* b, const GridTables& t, float* v) {
  int m[16];
  int8_t w[256];
  iq2_levels<TYPE>(b, t, m, w);
  const float d = f16(b);
  for (int k = 0; k < 16; ++k) {
    const float db = d * (0.5f + (float)((m[k] - 1) / 2)) * 0.25f;
    for (int l = 0; l < 16; ++l) v[16 * k + l] = db * (float)w[16 * k + l];
  }
}

// IQ1_S: per 32 values the multiplier m = 2 s + 1, and each value's level 8 (g + delta) (g in -1, 0, 1 from the
// grid, delta +-1/8): the value is (d m) (level / 8), as gguf.quants' dl (g + delta) bit for bit
void iq1_s_levels(const uint8_t* b, const GridTables& t, int m[8], int8_t w[256]) {
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 8; ++j) {
    const uint16_t qh = u16(b + 34 + 2 * j);
    m[j] = 2 * ((qh >> 12) & 7) + 1;
    const int delta = qh & 0x8000 ? -1 : 1;
    for (int l = 0; l < 4; ++l) {
      const int8_t* g = t.grid + 8 * (qs[4 * j + l] | ((qh >> 3 * l) & 7) << 8);
      for (int i = 0; i < 8; ++i) w[32 * j + 8 * l + i] = (int8_t)(8 * g[i] + delta);
    }
  }
}

void iq1_s(const uint8_t* b, const GridTables& t, float* v) {
  int m[8];
  int8_t w[256];
  iq1_s_levels(b, t, m, w);
  const float d = f16(b);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * (float)m[j];
    for (int l = 0; l < 32; ++l) v[32 * j + l] = dl * ((float)w[32 * j + l] * 0.125f);
  }
}

// IQ1_M: its fp16 d (the top nibbles of its four u16 scales), per 16 values the multiplier m = 2 s + 1, and each
// value's level 8 (g + delta) (delta +-1/8 per 8 values): the value is (d m) (level / 8), as gguf.quants' bit for bit
uint16_t iq1_m_levels(const uint8_t* b, const GridTables& t, int m[16], int8_t w[256]) {
  const uint8_t *qs = b, *qh = b + 32;
  uint16_t sc[4];
  std::memcpy(sc, b + 48, 8);
  for (int i = 0; i < 32; ++i) {  // 8 values
    const int h = (qh[i / 2] >> 4 * (i % 2)) & 15, delta = h & 8 ? -1 : 1;
    if (i % 2 == 0) m[i / 2] = 2 * ((sc[i / 8] >> 3 * ((i / 2) % 4)) & 7) + 1;
    const int8_t* g = t.grid + 8 * (qs[i] | (h & 7) << 8);
    for (int j = 0; j < 8; ++j) w[8 * i + j] = (int8_t)(8 * g[j] + delta);
  }
  return (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000));
}

void iq1_m(const uint8_t* b, const GridTables& t, float* v) {
  int m[16];
  int8_t w[256];
  const float d = half_to_float(iq1_m_levels(b, t, m, w));
  for (int j = 0; j < 16; ++j) {
    const float dl = d * (float)m[j];
    for (int l = 0; l < 16; ++l) v[16 * j + l] = dl * ((float)w[16 * j + l] * 0.125f);
  }
}

// TQ1_0 / TQ2_0: the 256 digits minus one (-1..1; TQ2_0's 2-bit code 3 gives 2), in value order
inline int8_t ternary(unsigned x) { return (int8_t)((int)(((x & 255) * 3) >> 8) - 1); }

void tq1_0_digits(const uint8_t* b, int8_t* w) {
  static constexpr uint8_t pow3[5] = {1, 3, 9, 27, 81};
  const uint8_t *qs = b, *qh = b + 48;
  for (int p = 0; p < 5; ++p) {
    for (int j = 0; j < 32; ++j) w[32 * p + j] = ternary(qs[j] * pow3[p]);
    for (int j = 0; j < 16; ++j) w[160 + 16 * p + j] = ternary(qs[32 + j] * pow3[p]);
  }
  for (int p = 0; p < 4; ++p)
    for (int j = 0; j < 4; ++j) w[240 + 4 * p + j] = ternary(qh[j] * pow3[p]);
}

void tq2_0_digits(const uint8_t* b, int8_t* w) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 32; ++j) w[128 * h + 32 * s + j] = (int8_t)(((b[32 * h + j] >> 2 * s) & 3) - 1);
}

// d (stored after the codes) times each digit
template <void (*DIGITS)(const uint8_t*, int8_t*), int D_AT>
void ternary_block(const uint8_t* b, const GridTables&, float* v) {
  int8_t w[256];
  DIGITS(b, w);
  const float d = f16(b + D_AT);
  for (int i = 0; i < 256; ++i) v[i] = d * (float)w[i];
}

using BlockFn = void (*)(const uint8_t*, const GridTables&, float*);

struct GridFormat {
  BlockFn fn;
  int64_t bytes;  // per 256 values
};

GridFormat format_of(int type) {
  switch (type) {
    case IQ2_XXS: return {grid_iquant<IQ2_XXS>, 66};
    case IQ2_XS: return {iq2_block<IQ2_XS>, 74};
    case IQ2_S: return {iq2_block<IQ2_S>, 82};
    case IQ3_XXS: return {grid_iquant<IQ3_XXS>, 98};
    case IQ3_S: return {grid_iquant<IQ3_S>, 110};
    case IQ1_S: return {iq1_s, 50};
    case IQ1_M: return {iq1_m, 56};
    case TQ1_0: return {ternary_block<tq1_0_digits, 52>, 54};
    case TQ2_0: return {ternary_block<tq2_0_digits, 64>, 66};
    default: return {nullptr, 0};
  }
}

// 32 values -> a Q8_0 block (d fp16, 32 int8), gguf.quants' rounding.  Half away from zero as gguf.quants' np_roundf
// computes it, floor(a) + floor(2 (a - floor(a))), every step exact: the same as roundf, but inlined and vectorized
// where roundf and fmaxf are library calls (they were two thirds of the time).
void q8_0_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t dh = float_to_half(d);
  std::memcpy(out, &dh, 2);
  for (int j = 0; j < 32; ++j) {
    const float y = x[j] * id, a = std::fabs(y), whole = std::floor(a);
    const int q = (int)(whole + std::floor(2.0f * (a - whole)));
    out[2 + j] = (uint8_t)(int8_t)(y < 0.0f ? -q : q);
  }
}

// A level's 4-bit L4 code (cpu_gguf.h GGUF_L4): its index in the type's levels, by the level's byte
struct L4Codes {
  uint8_t code[256] = {};
  explicit L4Codes(const int8_t levels[16]) {
    for (int i = 15; i >= 0; --i) code[(uint8_t)levels[i]] = (uint8_t)i;  // (0: only unused codes hold it)
  }
};

// The 256 levels' codes as IQ4_XS packs them (sub-block j: qs[16 j + l] = value l | value 16 + l << 4)
void write_l4_codes(const int8_t w[256], const L4Codes& codes, uint8_t* qs) {
  for (int j = 0; j < 8; ++j) {
    const int8_t* v = w + 32 * j;
    for (int l = 0; l < 16; ++l)
      qs[16 * j + l] = (uint8_t)(codes.code[(uint8_t)v[l]] | codes.code[(uint8_t)v[l + 16]] << 4);
  }
}

// One L4 block from its parts: d as fp16 bits, the 8 multipliers m, the 256 levels
void write_l4(uint16_t d, const int m[8], const int8_t w[256], const L4Codes& codes, uint8_t* dst) {
  std::memcpy(dst, &d, 2);  // d as stored (the kernels scale d m by the type's power of two)
  uint16_t high = 0;
  uint8_t low[4] = {0, 0, 0, 0};
  for (int j = 0; j < 8; ++j) {
    const int ls = m[j] + 32;  // IQ4_XS's 6-bit scale, minus 32 when read
    low[j / 2] |= (uint8_t)((ls & 15) << 4 * (j & 1));
    high |= (uint16_t)(((ls >> 4) & 3) << 2 * j);
  }
  std::memcpy(dst + 2, &high, 2);
  std::memcpy(dst + 4, low, 4);
  write_l4_codes(w, codes, dst + 8);
}

// One L4-per-16 block (IQ2_XS / IQ2_S / IQ1_M): d (IQ1_M's from its scales' top nibbles), the 16 multipliers as
// int8, the codes
template <int TYPE>
void block_to_l4_16(const uint8_t* src, const GridTables& t, const L4Codes& codes, uint8_t* dst) {
  int m[16];
  int8_t w[256];
  uint16_t d;
  if constexpr (TYPE == IQ1_M) {
    d = iq1_m_levels(src, t, m, w);
  } else {
    iq2_levels<TYPE>(src, t, m, w);
    d = u16(src);
  }
  std::memcpy(dst, &d, 2);
  for (int k = 0; k < 16; ++k) dst[2 + k] = (uint8_t)m[k];
  write_l4_codes(w, codes, dst + 18);
}

// A block's d, multipliers and levels (as write_l4 takes them) for each type with an L4 form
template <int TYPE>
void l4_parts(const uint8_t* src, const GridTables& t, uint16_t& d, int m[8], int8_t w[256]) {
  d = u16(src);
  if constexpr (TYPE == IQ1_S) {
    iq1_s_levels(src, t, m, w);
  } else {
    for (int j = 0; j < 8; ++j) {
      gguf_grid_sub<TYPE>(src, j, half_to_float(d), w + 32 * j);
      m[j] = TYPE == IQ2_XXS ? 2 * (int)(gguf_ld32(src + 6 + 8 * j) >> 28) + 1
           : TYPE == IQ3_XXS ? 2 * (int)(gguf_ld32(src + 66 + 4 * j) >> 28) + 1
                             : 1 + 2 * ((src[106 + j / 2] >> 4 * (j & 1)) & 15);
    }
  }
}

template <int TYPE>
void block_to_l4(const uint8_t* src, const GridTables& t, const L4Codes& codes, uint8_t* dst) {
  uint16_t d;
  int m[8];
  int8_t w[256];
  l4_parts<TYPE>(src, t, d, m, w);
  write_l4(d, m, w, codes, dst);
}

// rows' blocks [n0 * nb, n1 * nb) to L4, serially
void rows_to_l4(const uint8_t* blocks, int type, const GridTables& t, int64_t n0, int64_t n1, int64_t nb,
                uint8_t* out) {
  static const L4Codes iq2xxs(GGUF_L4_IQ2XXS), iq3xxs(GGUF_L4_IQ3XXS), iq3s(GGUF_L4_IQ3S), iq1s(GGUF_L4_IQ1S);
  const int64_t bytes = format_of(type).bytes, out_bytes = gguf_l4_block_bytes(type + GGUF_L4);
  for (int64_t i = n0 * nb; i < n1 * nb; ++i) {
    const uint8_t* src = blocks + i * bytes;
    uint8_t* dst = out + (i - n0 * nb) * out_bytes;
    switch (type) {
      case IQ2_XS: block_to_l4_16<IQ2_XS>(src, t, iq2xxs, dst); break;  // (the same levels as IQ2_XXS)
      case IQ2_S: block_to_l4_16<IQ2_S>(src, t, iq2xxs, dst); break;
      case IQ1_M: block_to_l4_16<IQ1_M>(src, t, iq1s, dst); break;  // (IQ1_S' levels)
      case IQ2_XXS: block_to_l4<IQ2_XXS>(src, t, iq2xxs, dst); break;
      case IQ3_XXS: block_to_l4<IQ3_XXS>(src, t, iq3xxs, dst); break;
      case IQ3_S: block_to_l4<IQ3_S>(src, t, iq3s, dst); break;
      default: block_to_l4<IQ1_S>(src, t, iq1s, dst); break;
    }
  }
}

// Whether a type has an L4 form and what it needs to make it (IQ1_S, IQ1_M, IQ2_S: its grid; IQ2_XS: and its sign
// bytes; the others' codebooks are gguf_grids.h's)
bool l4_convertible(int type, const GridTables& t) {
  const bool builtin = type == IQ2_XXS || type == IQ3_XXS || type == IQ3_S;
  return gguf_l4_base(type) && (builtin || t.grid) && (type != IQ2_XS || t.ksigns);
}

}  // namespace

bool gguf_grid_to_l4(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables, uint8_t* out) {
  if (!l4_convertible(type, tables)) return false;
  const int64_t nb = K / 256;
  parallel_run(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    rows_to_l4(blocks, type, tables, n0, n1, nb, out + n0 * nb * gguf_l4_block_bytes(type + GGUF_L4));
  });
  return true;
}

bool gguf_grid_to_l4_x8(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables,
                        uint8_t* x8) {
  if (!l4_convertible(type, tables) || N % 8 || !gguf_x8_supported(type + GGUF_L4)) return false;
  const int64_t nb = K / 256, group_bytes = nb * gguf_x8_bytes(type + GGUF_L4);
  parallel_run(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    // one group's rows as L4 (not the whole tensor at once)
    std::vector<uint8_t> l4((size_t)(8 * nb * gguf_l4_block_bytes(type + GGUF_L4)));
    for (int64_t g = g0; g < g1; ++g) {
      rows_to_l4(blocks, type, tables, 8 * g, 8 * g + 8, nb, l4.data());
      gguf_repack_x8(l4.data(), type + GGUF_L4, 8, K, x8 + g * group_bytes);
    }
  });
  return true;
}

bool gguf_ternary_to_q2_k(const uint8_t* blocks, int type, int64_t nblocks, uint8_t* out) {
  if (type != TQ1_0 && type != TQ2_0) return false;
  const int64_t bytes = format_of(type).bytes, d_at = type == TQ1_0 ? 52 : 64;
  parallel_run(0, nblocks, 1024, [&](int64_t b0, int64_t b1) {
    int8_t w[256];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* src = blocks + b * bytes;
      uint8_t* dst = out + b * 84;
      std::memset(dst, 0x11, 16);  // each 16 values' scale 1 and min 1
      if (type == TQ2_0) {
        std::memcpy(dst + 16, src, 64);  // the same 2-bit codes in the same order
      } else {
        tq1_0_digits(src, w);
        for (int n = 0; n < 2; ++n)  // value 128 n + 32 j + l: bits 2 j of byte 32 n + l, code digit + 1
          for (int l = 0; l < 32; ++l) {
            uint8_t q = 0;
            for (int j = 0; j < 4; ++j) q |= (uint8_t)((w[128 * n + 32 * j + l] + 1) << 2 * j);
            dst[16 + 32 * n + l] = q;
          }
      }
      std::memcpy(dst + 80, src + d_at, 2);  // d
      std::memcpy(dst + 82, src + d_at, 2);  // dmin = d
    }
  });
  return true;
}

bool gguf_iq1_to_q6_k(const uint8_t* blocks, int type, int64_t nblocks, const GridTables& tables, uint8_t* out) {
  if ((type != IQ1_S && type != IQ1_M) || !tables.grid) return false;
  const int64_t bytes = format_of(type).bytes;
  std::atomic<bool> exact{true};
  parallel_run(0, nblocks, 512, [&](int64_t b0, int64_t b1) {
    int8_t w[256];
    int m[16];
    for (int64_t b = b0; b < b1 && exact.load(std::memory_order_relaxed); ++b) {
      const uint8_t* src = blocks + b * bytes;
      uint8_t* dst = out + b * 210;
      uint16_t dh;
      if (type == IQ1_S) {
        int m32[8];
        iq1_s_levels(src, tables, m32, w);
        for (int j = 0; j < 16; ++j) m[j] = m32[j / 2];
        dh = u16(src);
      } else {
        dh = iq1_m_levels(src, tables, m, w);
      }
      // Q6_K's d = d / 8, which must be an fp16 (not past its subnormal floor) for the values to stay exact
      const float d = half_to_float(dh), d8 = d * 0.125f;
      const uint16_t d8h = float_to_half(d8);
      if (!(half_to_float(d8h) == d8)) {
        exact.store(false, std::memory_order_relaxed);
        return;
      }
      uint8_t *ql = dst, *qh = dst + 128;
      std::memset(dst, 0, 192);
      for (int v = 0; v < 256; ++v) {  // q = level + 32; value 128 h + 32 c + l: ql[64 h + 32 (c % 2) + l] nibble
        // c / 2, qh[32 h + l] bits 2 c
        const int q = w[v] + 32, h = v / 128, c = (v / 32) % 4, l = v % 32;
        ql[64 * h + 32 * (c % 2) + l] |= (uint8_t)((q & 15) << 4 * (c / 2));
        qh[32 * h + l] |= (uint8_t)((q >> 4) << 2 * c);
      }
      for (int j = 0; j < 16; ++j) dst[192 + j] = (uint8_t)(int8_t)m[j];
      std::memcpy(dst + 208, &d8h, 2);
    }
  });
  return exact.load();
}

int64_t gguf_grid_row_bytes(int type, int64_t K) { return K % 256 ? 0 : K / 256 * format_of(type).bytes; }

void gguf_grid_rows(const uint8_t* blocks, int type, int64_t N, int64_t K, const GridTables& tables, float* out,
                    uint8_t* q8_0) {
  const GridFormat f = format_of(type);
  const int64_t nb = K / 256, rb = nb * f.bytes;
  parallel_run(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    float v[256];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        float* dst = out ? out + n * K + b * 256 : v;
        f.fn(blocks + n * rb + b * f.bytes, tables, dst);
        if (q8_0)
          for (int s = 0; s < 8; ++s) q8_0_block(dst + 32 * s, q8_0 + (n * (K / 32) + b * 8 + s) * 34);
      }
  });
}

}  // namespace edgellm
