// K-quant rows repacked eight at a time ("x8"): the same codes, scales and d's bit for bit, reordered so that one
// 32-byte load holds 4 consecutive values of each of 8 rows.  The int8 dot products then land in one int32 lane
// per row (vpdpbusd / maddubs with the activation's 4 bytes broadcast), and no horizontal reduction is left: a
// super-block of 8 rows costs ~35 vector instructions per row against ~80 for the per-row kernel in
// cpu_gguf.cpp, which made decode compute-bound (benchmarks/gguf_kernel_ab.py).  llama.cpp repacks its Q4_K for
// the same reason.  The activations are the same per-32 int8 blocks (GgufActs), and the arithmetic per row is
// the per-row kernel's: int sums per 32 values (Q6_K: per 16, times its int8 scale), one fp32 FMA per 32.
//
// Layouts (one "x8 super-block" = 256 values of 8 rows r; g = group of 4 values, i = byte in the group):
//   Q4_K (1184 bytes): d[r] fp16 | dmin[r] fp16 | sc[j][r] u8 (the 6-bit scales of sub-blocks j = 0..7, unpacked)
//        | m[j][r] u8 | qs[k][g][r][i] = row r's qs[32k + 4g + i] (low nibble: sub-block 2k, high: 2k + 1)
//   Q5_K (1440): Q4_K's 1184 bytes, then qh[g][r][i] = row r's qh[4g + i] (bit j: bit 4 of sub-block j)
//   Q6_K (1680): d[r] fp16 | sc[t][r] int8 (t = 16-value sub-block) | then for each half h and group g, 96 bytes:
//        ql[q][r][i] = ql[64h + 32q + 4g + i] for q = 0, 1 (low nibble: sub-block 4h + q, high: 4h + q + 2), and
//        qh[r][i] = qh[32h + 4g + i] (bits 2j', 2j' + 1: bits 4, 5 of sub-block 4h + j'): one stream in the
//        order the kernel reads it (two streams 1 KiB apart left the prefetchers behind: 9 GB/s against 26)
//   Q3_K (912): d[r] fp16 | sc[t][r] int8 (the 6-bit scales unpacked, minus 32) | then for each group g, 96 bytes:
//        hm[r][i] = hmask[4g + i] (bit j: the high bit of sub-block j), qs[n][r][i] = qs[32n + 4g + i] for n = 0, 1
//        (bits 2i', 2i' + 1: sub-block 4n + i'); 32 bytes more than the 8 stored blocks (3.6%)
//   Q2_K (672): d[r] fp16 | dmin[r] fp16 | sc[t][r] u8 (as stored: scale | min << 4 of 16-value sub-block t) | then
//        for each group g, 64 bytes: qs[n][r][i] = qs[32n + 4g + i] for n = 0, 1; the stored blocks' size
//   IQ4_XS (1104): d[r] fp16 | sc[j][r] int8 (the 6-bit scales of sub-blocks j unpacked, minus 32) | then for each
//        sub-block j and group g (0..3), 32 bytes: row r's qs[16 j + 4g + i] (low nibble: value 4g + i, high: 16 +
//        4g + i), codes that index the 16 int8 levels; 16 bytes more than the 8 stored blocks (1.5%)
//   L4 per 16 (1168; cpu_gguf.h GGUF_IQ2_XS_L4): d[r] fp16 | m[t][r] int8 (t = 16-value sub-block) | then IQ4_XS's
//        codes from byte 144; the stored size
// The unpacked Q4_K / Q5_K scales cost 32 bytes per 8 super-blocks (2.8%) and save the 6-bit unpacking per row.
// The 32-value types (Q5_0 / Q5_1 with their fifth bits, IQ4_NL) take the same idea per 32-value block ("x8 unit" =
// 32 values of 8 rows; their tensors are the ones whose K is not a multiple of 256, e.g. most of a Qwen2.5-0.5B or
// SmolLM2 Q4_K_M / IQ4_XS):
//   Q5_0 (176 bytes): d[r] fp16 | qh[r][i] (bit g: the fifth bit of row r's value 4g + i) | nib[j][r][i] = row r's
//        qs[4j + i] (j = 0..3; low nibble: value 4j + i, high: 16 + 4j + i)
//   Q5_1 (192): d[r] fp16 | m[r] fp16 | then as Q5_0
//   IQ4_NL (144): d[r] fp16 | nib[g][r][i] = row r's qs[4g + i] (g = 0..3; low nibble: value 4g + i, high: 16 + 4g + i),
//        codes that index the 16 int8 levels (IQ4_XS's per-sub-block layout, one sub-block a unit); the stored size
// A code vector (value 4g + i of each row r at byte 4r + i) is then an and or a shift, a shift of qh, an and and an
// or: against the stored blocks' broadcast, shuffle, compare and horizontal sums, 1.6-1.9x the rows a second.
// Rows are taken in groups of 8: a tensor's first N / 8 * 8 rows (the loader keeps the rest as stored).
#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "cpu_gguf.h"
#include "gguf_low_k_codes.h"
#include "half.h"
#include "simd_transpose.h"

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__)
#include <immintrin.h>
#endif
#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__) && (defined(_MSC_VER) || (defined(__FMA__) && defined(__F16C__)))
#define EDGELLM_X8 1
#include "dpbusd256.h"
#ifdef EDGELLM_DPBUSD256  // AVX-512 VNNI, or AVX-VNNI on an AVX2 machine
#define EDGELLM_X8_VNNI 1
#endif
#endif

namespace edgellm {

namespace {

// The raw block (QV values of a row, BYTES bytes), the x8 unit (8 rows: XB bytes), and where the raw parts lie.
template <int TYPE> struct Raw;
template <> struct Raw<GGUF_Q4_K> { static constexpr int64_t QV = 256, BYTES = 144, XB = 1184, QS = 16; };
template <> struct Raw<GGUF_Q5_K> { static constexpr int64_t QV = 256, BYTES = 176, XB = 1440, QS = 48, QH = 16; };
template <> struct Raw<GGUF_Q6_K> { static constexpr int64_t QV = 256, BYTES = 210, XB = 1680, QS = 0; };
template <> struct Raw<GGUF_Q3_K> { static constexpr int64_t QV = 256, BYTES = 110, XB = 912, QS = 32; };
template <> struct Raw<GGUF_Q2_K> { static constexpr int64_t QV = 256, BYTES = 84, XB = 672, QS = 16; };
template <> struct Raw<GGUF_IQ4_XS> { static constexpr int64_t QV = 256, BYTES = 136, XB = 1104, QS = 8; };
template <> struct Raw<GGUF_IQ2_XXS_L4> : Raw<GGUF_IQ4_XS> {};  // (cpu_gguf.h GGUF_L4: IQ4_XS blocks)
template <> struct Raw<GGUF_IQ3_XXS_L4> : Raw<GGUF_IQ4_XS> {};
template <> struct Raw<GGUF_IQ3_S_L4> : Raw<GGUF_IQ4_XS> {};
template <> struct Raw<GGUF_IQ1_S_L4> : Raw<GGUF_IQ4_XS> {};
template <> struct Raw<GGUF_IQ2_XS_L4> {
  static constexpr int64_t QV = 256, BYTES = GGUF_L4_16_BYTES, XB = 1168, QS = 18;
};
template <> struct Raw<GGUF_IQ2_S_L4> : Raw<GGUF_IQ2_XS_L4> {};
template <> struct Raw<GGUF_IQ1_M_L4> : Raw<GGUF_IQ2_XS_L4> {};
// IQ4_XS and the L4 types: the same layout, their own levels
constexpr bool iq4xs_like(int type) {
  return type == GGUF_IQ4_XS || (type > GGUF_L4 && gguf_l4_base(type - GGUF_L4) && !gguf_l4_16(type));
}
// Where a type's codes start in its x8 unit (IQ4_XS's layout: after d and the 8 or 16 scales of each row)
template <int TYPE>
constexpr int64_t x8_codes_at() { return gguf_l4_16(TYPE) ? 144 : 80; }
// Q5_0 / Q5_1: HOFF = the stored qh's offset (qs after it), XH = the x8 unit's qh (nibbles after it)
template <> struct Raw<GGUF_Q5_0> { static constexpr int64_t QV = 32, BYTES = 22, XB = 176, HOFF = 2, XH = 16; };
template <> struct Raw<GGUF_Q5_1> { static constexpr int64_t QV = 32, BYTES = 24, XB = 192, HOFF = 4, XH = 32; };
constexpr bool is_q5(int type) { return type == GGUF_Q5_0 || type == GGUF_Q5_1; }
template <> struct Raw<GGUF_IQ4_NL> { static constexpr int64_t QV = 32, BYTES = 18, XB = 144; };

// f(std::integral_constant<int, TYPE>()) for a base type with an x8 layout (nothing for the others).
template <class F>
void on_x8_type(int base_type, F&& f) {
  switch (base_type) {
    case GGUF_Q4_K: f(std::integral_constant<int, GGUF_Q4_K>()); break;
    case GGUF_Q5_K: f(std::integral_constant<int, GGUF_Q5_K>()); break;
    case GGUF_Q6_K: f(std::integral_constant<int, GGUF_Q6_K>()); break;
    case GGUF_Q3_K: f(std::integral_constant<int, GGUF_Q3_K>()); break;
    case GGUF_Q2_K: f(std::integral_constant<int, GGUF_Q2_K>()); break;
    case GGUF_IQ4_XS: f(std::integral_constant<int, GGUF_IQ4_XS>()); break;
    case GGUF_IQ2_XXS_L4: f(std::integral_constant<int, GGUF_IQ2_XXS_L4>()); break;
    case GGUF_IQ3_XXS_L4: f(std::integral_constant<int, GGUF_IQ3_XXS_L4>()); break;
    case GGUF_IQ3_S_L4: f(std::integral_constant<int, GGUF_IQ3_S_L4>()); break;
    case GGUF_IQ1_S_L4: f(std::integral_constant<int, GGUF_IQ1_S_L4>()); break;
    case GGUF_IQ2_XS_L4: f(std::integral_constant<int, GGUF_IQ2_XS_L4>()); break;
    case GGUF_IQ2_S_L4: f(std::integral_constant<int, GGUF_IQ2_S_L4>()); break;
    case GGUF_IQ1_M_L4: f(std::integral_constant<int, GGUF_IQ1_M_L4>()); break;
    case GGUF_Q5_0: f(std::integral_constant<int, GGUF_Q5_0>()); break;
    case GGUF_Q5_1: f(std::integral_constant<int, GGUF_Q5_1>()); break;
    case GGUF_IQ4_NL: f(std::integral_constant<int, GGUF_IQ4_NL>()); break;
    default: break;
  }
}

// A stored qh's bits i, 4 + i, .., 28 + i (value i of each 4-value group g) as the 8 bits of one byte, and back.
inline uint8_t gather_fifth_bits(uint32_t qh, int i) {
  uint32_t x = (qh >> i) & 0x11111111u;
  x = (x | (x >> 3)) & 0x03030303u;
  x = (x | (x >> 6)) & 0x000F000Fu;
  return (uint8_t)((x | (x >> 12)) & 0xFFu);
}
inline uint32_t spread_fifth_bits(uint8_t byte, int i) {
  uint32_t x = byte;
  x = (x | (x << 12)) & 0x000F000Fu;
  x = (x | (x << 6)) & 0x03030303u;
  return ((x | (x << 3)) & 0x11111111u) << i;
}

// One Q5_0 / Q5_1 unit of 8 rows, either way (TO_X8: raw -> x8).  raw[r] = row r's block.
template <int TYPE, bool TO_X8>
void convert_q5(uint8_t* const raw[8], uint8_t* o) {
  using R = Raw<TYPE>;
  for (int r = 0; r < 8; ++r) {
    uint8_t* b = raw[r];
    if (TO_X8) {
      std::memcpy(o + 2 * r, b, 2);
      if (TYPE == GGUF_Q5_1) std::memcpy(o + 16 + 2 * r, b + 2, 2);
      uint32_t qh;
      std::memcpy(&qh, b + R::HOFF, 4);
      for (int i = 0; i < 4; ++i) o[R::XH + 4 * r + i] = gather_fifth_bits(qh, i);
      for (int j = 0; j < 4; ++j) std::memcpy(o + R::XH + 32 + 32 * j + 4 * r, b + R::HOFF + 4 + 4 * j, 4);
    } else {
      std::memcpy(b, o + 2 * r, 2);
      if (TYPE == GGUF_Q5_1) std::memcpy(b + 2, o + 16 + 2 * r, 2);
      uint32_t qh = 0;
      for (int i = 0; i < 4; ++i) qh |= spread_fifth_bits(o[R::XH + 4 * r + i], i);
      std::memcpy(b + R::HOFF, &qh, 4);
      for (int j = 0; j < 4; ++j) std::memcpy(b + R::HOFF + 4 + 4 * j, o + R::XH + 32 + 32 * j + 4 * r, 4);
    }
  }
}

// One IQ4_NL unit of 8 rows, either way (TO_X8: raw -> x8): the d's, then each row's 16 code bytes as 4 groups.
template <bool TO_X8>
void convert_nl(uint8_t* const raw[8], uint8_t* o) {
  for (int r = 0; r < 8; ++r) {
    uint8_t* b = raw[r];
    if (TO_X8) std::memcpy(o + 2 * r, b, 2);
    else std::memcpy(b, o + 2 * r, 2);
    for (int g = 0; g < 4; ++g) {
      if (TO_X8) std::memcpy(o + 16 + 32 * g + 4 * r, b + 2 + 4 * g, 4);
      else std::memcpy(b + 2 + 4 * g, o + 16 + 32 * g + 4 * r, 4);
    }
  }
}

// ggml's get_scale_min_k4 for all 8 sub-blocks: out[0..7] scales, out[8..15] mins
inline void kquant_scales6(const uint8_t* s, uint8_t out[16]) {
  for (int j = 0; j < 4; ++j) {
    out[j] = s[j] & 63;
    out[8 + j] = s[j + 4] & 63;
    out[4 + j] = (uint8_t)((s[j + 8] & 0xF) | ((s[j] >> 6) << 4));
    out[12 + j] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// The inverse: 8 scales and 8 mins (6 bits each) back into the 12 packed bytes.
inline void kquant_pack6(const uint8_t* sc, const uint8_t* mn, uint8_t s[12]) {
  for (int j = 0; j < 4; ++j) {
    s[j] = (uint8_t)((sc[j] & 63) | ((sc[4 + j] >> 4) << 6));
    s[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[4 + j] >> 4) << 6));
    s[j + 8] = (uint8_t)((sc[4 + j] & 15) | ((mn[4 + j] & 15) << 4));
  }
}

// The inverse of gguf_q3k_scales: 16 scales (-32 .. 31) back into the 12 packed bytes.
inline void q3k_pack_scales(const int8_t* sc, uint8_t s[12]) {
  std::memset(s, 0, 12);
  for (int i = 0; i < 16; ++i) {
    const int v = sc[i] + 32;
    s[i % 8] = (uint8_t)(s[i % 8] | (v & 15) << (4 * (i / 8)));
    s[8 + i % 4] = (uint8_t)(s[8 + i % 4] | (v >> 4) << (2 * (i / 4)));
  }
}

// 8 rows x 32 bytes <-> 8 groups x 32 bytes: raw row r's bytes [raw[r] + off + 4g, +4) <-> x8 [x8 + g * stride +
// 4r, +4).  Either way it is an 8 x 8 transpose of dwords.
inline void transpose8(const uint8_t* const in[8], uint8_t* const out[8]) {
#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__)
  __m256i v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_si256((const __m256i*)in[i]);
  transpose8x8_epi32(v);
  for (int i = 0; i < 8; ++i) _mm256_storeu_si256((__m256i*)out[i], v[i]);
#else
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) std::memcpy(out[j] + 4 * i, in[i] + 4 * j, 4);
#endif
}

template <bool TO_X8>
inline void groups8(uint8_t* x8, uint8_t* const raw[8], int64_t off, int64_t stride = 32) {
  uint8_t* rows[8];
  uint8_t* grp[8];
  for (int i = 0; i < 8; ++i) {
    rows[i] = raw[i] + off;
    grp[i] = x8 + i * stride;
  }
  if (TO_X8) transpose8(rows, grp);
  else transpose8(grp, rows);
}

// One super-block of 8 rows, either way (TO_X8: raw -> x8).  raw[r] = row r's super-block.
template <int TYPE, bool TO_X8>
void convert_sb(uint8_t* const raw[8], uint8_t* o) {
  for (int r = 0; r < 8; ++r) {  // the fp16 d's and the scales, a row at a time
    uint8_t* b = raw[r];
    if (iq4xs_like(TYPE)) {
      if (TO_X8) {
        std::memcpy(o + 2 * r, b, 2);
        for (int j = 0; j < 8; ++j) o[16 + 8 * j + r] = (uint8_t)(int8_t)gguf_iq4xs_scale(b, j);
      } else {
        std::memcpy(b, o + 2 * r, 2);
        unsigned h = 0;
        std::memset(b + 4, 0, 4);
        for (int j = 0; j < 8; ++j) {
          const unsigned ls = (unsigned)((int8_t)o[16 + 8 * j + r] + 32);
          b[4 + j / 2] = (uint8_t)(b[4 + j / 2] | (ls & 15) << (4 * (j & 1)));
          h |= (ls >> 4) << (2 * j);
        }
        b[2] = (uint8_t)(h & 0xFF);
        b[3] = (uint8_t)(h >> 8);
      }
      continue;
    }
    if (TYPE == GGUF_Q2_K) {
      for (int t = 0; t < 16; ++t) {
        if (TO_X8) o[32 + t * 8 + r] = b[t];
        else b[t] = o[32 + t * 8 + r];
      }
      if (TO_X8) {
        std::memcpy(o + 2 * r, b + 80, 2);
        std::memcpy(o + 16 + 2 * r, b + 82, 2);
      } else {
        std::memcpy(b + 80, o + 2 * r, 2);
        std::memcpy(b + 82, o + 16 + 2 * r, 2);
      }
    } else if (TYPE == GGUF_Q3_K) {
      int8_t sc[16];
      if (TO_X8) {
        std::memcpy(o + 2 * r, b + 108, 2);
        gguf_q3k_scales(b + 96, sc);
        for (int t = 0; t < 16; ++t) o[16 + t * 8 + r] = (uint8_t)sc[t];
      } else {
        std::memcpy(b + 108, o + 2 * r, 2);
        for (int t = 0; t < 16; ++t) sc[t] = (int8_t)o[16 + t * 8 + r];
        q3k_pack_scales(sc, b + 96);
      }
    } else if (TYPE == GGUF_Q6_K || gguf_l4_16(TYPE)) {
      constexpr int64_t D = TYPE == GGUF_Q6_K ? 208 : 0, SC = TYPE == GGUF_Q6_K ? 192 : 2;
      if (TO_X8) std::memcpy(o + 2 * r, b + D, 2);
      else std::memcpy(b + D, o + 2 * r, 2);
      for (int t = 0; t < 16; ++t) {
        if (TO_X8) o[16 + t * 8 + r] = b[SC + t];
        else b[SC + t] = o[16 + t * 8 + r];
      }
    } else if (TO_X8) {
      std::memcpy(o + 2 * r, b, 2);
      std::memcpy(o + 16 + 2 * r, b + 2, 2);
      uint8_t sm[16];
      kquant_scales6(b + 4, sm);
      for (int j = 0; j < 8; ++j) {
        o[32 + j * 8 + r] = sm[j];
        o[96 + j * 8 + r] = sm[8 + j];
      }
    } else {
      std::memcpy(b, o + 2 * r, 2);
      std::memcpy(b + 2, o + 16 + 2 * r, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; ++j) {
        sc[j] = o[32 + j * 8 + r];
        mn[j] = o[96 + j * 8 + r];
      }
      kquant_pack6(sc, mn, b + 4);
    }
  }
  if (iq4xs_like(TYPE) || gguf_l4_16(TYPE)) {  // [j][g]: the 16 qs bytes of sub-block j as 4 groups (two sub-blocks
    // a transpose)
    for (int p = 0; p < 4; ++p) groups8<TO_X8>(o + x8_codes_at<TYPE>() + 256 * p, raw, Raw<TYPE>::QS + 32 * p);
    return;
  }
  if (TYPE == GGUF_Q2_K) {  // [g]: qs (n = 0), qs (n = 1), 32 bytes each
    for (int n = 0; n < 2; ++n) groups8<TO_X8>(o + 160 + 32 * n, raw, 16 + 32 * n, 64);
    return;
  }
  if (TYPE == GGUF_Q3_K) {  // [g]: hmask, qs (n = 0), qs (n = 1), 32 bytes each
    groups8<TO_X8>(o + 144, raw, 0, 96);
    for (int n = 0; n < 2; ++n) groups8<TO_X8>(o + 144 + 32 + 32 * n, raw, 32 + 32 * n, 96);
    return;
  }
  if (TYPE == GGUF_Q6_K) {
    for (int h = 0; h < 2; ++h) {  // [h][g]: ql (q = 0), ql (q = 1), qh, 32 bytes each
      for (int q = 0; q < 2; ++q) groups8<TO_X8>(o + 144 + h * 768 + 32 * q, raw, 64 * h + 32 * q, 96);
      groups8<TO_X8>(o + 144 + h * 768 + 64, raw, 128 + 32 * h, 96);
    }
    return;
  }
  for (int k = 0; k < 4; ++k) groups8<TO_X8>(o + 160 + k * 256, raw, Raw<TYPE>::QS + 32 * k);
  if (TYPE == GGUF_Q5_K) groups8<TO_X8>(o + 1184, raw, 16);
}

// Groups [g0, g1) of 8 rows, either way, on the calling thread.
template <int TYPE, bool TO_X8>
void convert_groups(uint8_t* raw, uint8_t* x8, int64_t g0, int64_t g1, int64_t K) {
  using R = Raw<TYPE>;
  const int64_t nsb = K / R::QV, rb = nsb * R::BYTES;
  for (int64_t grp = g0; grp < g1; ++grp)
    for (int64_t s = 0; s < nsb; ++s) {
      uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = raw + (grp * 8 + r) * rb + s * R::BYTES;
      if constexpr (is_q5(TYPE)) convert_q5<TYPE, TO_X8>(rows, x8 + (grp * nsb + s) * R::XB);
      else if constexpr (TYPE == GGUF_IQ4_NL) convert_nl<TO_X8>(rows, x8 + (grp * nsb + s) * R::XB);
      else convert_sb<TYPE, TO_X8>(rows, x8 + (grp * nsb + s) * R::XB);
    }
}

template <int TYPE, bool TO_X8>
void convert(uint8_t* raw, uint8_t* x8, int64_t N, int64_t K) {
  parallel_run(0, N / 8, 16, [&](int64_t g0, int64_t g1) { convert_groups<TYPE, TO_X8>(raw, x8, g0, g1, K); });
}

#ifdef EDGELLM_X8
// ------------------------------------------------------------------------------------------------ AVX2 / VNNI
inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The stream 4 KiB ahead, a super-block at a time (the hardware prefetcher stops at each page), into L2 (T1): a
// prefetch into L1 holds one of the core's ~16 fill buffers until the line arrives, which caps a core streaming from
// DRAM at ~16 lines per memory latency (~8 GB/s on a 2-core slice of a Xeon with a 480 MiB L3, where one thread
// decoded the 1B-shaped Q4_K_M at 12.0 tok/s); L2's queue takes ~48: 13.7 tok/s, 2 threads 22.6 -> 25.9 (8 KiB
// ahead: the same).
template <int64_t BYTES, int64_t DIST = 4096>
inline void prefetch_sb(const uint8_t* o) {
  for (int64_t b = 0; b < BYTES; b += 64) _mm_prefetch((const char*)(o + DIST + b), _MM_HINT_T1);
}

inline __m256 u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// Codes of the sub-block pair (2k, 2k+1), group g, of a Q4_K / Q5_K x8 super-block.
template <int TYPE>
inline void codes_k(const uint8_t* o, int k, int g, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(o + 160 + (k * 8 + g) * 32));
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if (TYPE == GGUF_Q5_K) {  // bit 2k / 2k+1 of each qh byte to bit 4 (16-bit shifts; what crosses bytes is masked)
    const __m256i h = _mm256_loadu_si256((const __m256i*)(o + 1184 + g * 32));
    const __m256i b4 = _mm256_set1_epi8(0x10);
    const int s0 = 4 - 2 * k, s1 = 3 - 2 * k;
    const __m256i h0 = s0 >= 0 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(s0)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(-s0));
    const __m256i h1 = s1 >= 0 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(s1)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(-s1));
    lo = _mm256_or_si256(lo, _mm256_and_si256(h0, b4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(h1, b4));
  }
}

// T activation rows m0.. against one group of 8 rows (nsb super-blocks from `w`): out[t] lane r = y[m0 + t, row r].
template <int TYPE, int T>
void group_k(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  const int64_t nsb = a.K / 256;
  __m256 acc[T], accm[T];
  for (int t = 0; t < T; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = w + s * Raw<TYPE>::XB;
    prefetch_sb<Raw<TYPE>::XB>(o);
    __m256 sacc[T], macc[T];
    for (int t = 0; t < T; ++t) sacc[t] = macc[t] = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      __m256i iA[T], iB[T];
      for (int t = 0; t < T; ++t) iA[t] = iB[t] = _mm256_setzero_si256();
#ifdef EDGELLM_X8_VNNI
      for (int g = 0; g < 8; ++g) {
        __m256i lo, hi;
        codes_k<TYPE>(o, k, g, lo, hi);
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 64 * k + 4 * g;
          iA[t] = dot4_u8s8(iA[t], lo, bcast4(xq));
          iB[t] = dot4_u8s8(iB[t], hi, bcast4(xq + 32));
        }
      }
#else
      // maddubs pair sums in int16: 4 groups of codes <= 31 stay below 4 * 2 * 31 * 127 = 31496
      for (int g0 = 0; g0 < 8; g0 += 4) {
        __m256i hA[T], hB[T];
        for (int t = 0; t < T; ++t) hA[t] = hB[t] = _mm256_setzero_si256();
        for (int g = g0; g < g0 + 4; ++g) {
          __m256i lo, hi;
          codes_k<TYPE>(o, k, g, lo, hi);
          for (int t = 0; t < T; ++t) {
            const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 64 * k + 4 * g;
            hA[t] = _mm256_add_epi16(hA[t], _mm256_maddubs_epi16(lo, bcast4(xq)));
            hB[t] = _mm256_add_epi16(hB[t], _mm256_maddubs_epi16(hi, bcast4(xq + 32)));
          }
        }
        const __m256i ones = _mm256_set1_epi16(1);
        for (int t = 0; t < T; ++t) {
          iA[t] = _mm256_add_epi32(iA[t], _mm256_madd_epi16(hA[t], ones));
          iB[t] = _mm256_add_epi32(iB[t], _mm256_madd_epi16(hB[t], ones));
        }
      }
#endif
      const __m256 scA = u8x8_ps(o + 32 + 16 * k), scB = u8x8_ps(o + 40 + 16 * k);
      const __m256 mA = u8x8_ps(o + 96 + 16 * k), mB = u8x8_ps(o + 104 + 16 * k);
      for (int t = 0; t < T; ++t) {
        const int64_t b = (m0 + t) * a.nb + s * 8 + 2 * k;
        sacc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(iA[t]), _mm256_set1_ps(a.d[b])), scA, sacc[t]);
        sacc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(iB[t]), _mm256_set1_ps(a.d[b + 1])), scB, sacc[t]);
        macc[t] = _mm256_fmadd_ps(mA, _mm256_set1_ps(a.s[b]), macc[t]);
        macc[t] = _mm256_fmadd_ps(mB, _mm256_set1_ps(a.s[b + 1]), macc[t]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm256_fmadd_ps(sacc[t], d, acc[t]);
      accm[t] = _mm256_fmadd_ps(macc[t], dm, accm[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = _mm256_sub_ps(acc[t], accm[t]);
}

template <int T>
void group_q6k(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  const int64_t nsb = a.K / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x30);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = w + s * 1680;
    prefetch_sb<1680>(o);
    __m256 sacc[T];
    for (int t = 0; t < T; ++t) sacc[t] = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {  // values 16 half .. +16 of the sub-blocks 4h + j'
        __m256i is[T][4];                     // [j']
        for (int t = 0; t < T; ++t) is[t][0] = is[t][1] = is[t][2] = is[t][3] = _mm256_setzero_si256();
        for (int g = 4 * half; g < 4 * half + 4; ++g) {
          const uint8_t* p = o + 144 + (h * 8 + g) * 96;
          const __m256i v0 = _mm256_loadu_si256((const __m256i*)p), v1 = _mm256_loadu_si256((const __m256i*)(p + 32));
          const __m256i hq = _mm256_loadu_si256((const __m256i*)(p + 64));
          // bits 2j', 2j'+1 of each qh byte to bits 4, 5 (16-bit shifts; what crosses bytes is masked off)
          __m256i u[4];
          u[0] = _mm256_or_si256(_mm256_and_si256(v0, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 4), m3));
          u[1] = _mm256_or_si256(_mm256_and_si256(v1, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 2), m3));
          u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), _mm256_and_si256(hq, m3));
          u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(hq, 2), m3));
          for (int t = 0; t < T; ++t) {
            const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 128 * h + 4 * g;
            for (int j = 0; j < 4; ++j) is[t][j] = dot4_u8s8(is[t][j], u[j], bcast4(xq + 32 * j));
          }
        }
        for (int j = 0; j < 4; ++j) {
          const int sub16 = 2 * (4 * h + j) + half;
          const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(o + 16 + 8 * sub16)));
          for (int t = 0; t < T; ++t) {
            const int64_t b = (m0 + t) * a.nb + s * 8;
            // (sum q x - 32 sum x) * sc over these 16 values (the -32 offset through the activations' sums)
            const __m256i v = _mm256_mullo_epi32(
                _mm256_sub_epi32(is[t][j], _mm256_set1_epi32(32 * a.sum16[2 * b + sub16])), sc);
            sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(a.d[b + 4 * h + j]), sacc[t]);
          }
        }
      }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(sacc[t], d, acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = acc[t];
}

// As group_q6k for Q3_K: per 16 values of each sub-block, the pair sums of 4 groups in int16 (codes <= 7:
// |.| <= 4 * 2 * 7 * 127), the offset -4 sum(q_x) added to the low int16 of each row's pair (|.| <= 8128 more), then
// one madd with the row's scale gives sc (sum q x - 4 sum x) in int32, and one FMA with d_x.
template <int T, int N>
inline void half_q3k(const GgufActs& a, int64_t m0, const uint8_t* o, int64_t s, __m256 sacc[T]) {
  for (int half = 0; half < 2; ++half) {  // values 16 half .. +16 of the sub-blocks 4N + i
    __m256i hs[T][4];                     // [i]
    for (int t = 0; t < T; ++t) hs[t][0] = hs[t][1] = hs[t][2] = hs[t][3] = _mm256_setzero_si256();
    for (int g = 4 * half; g < 4 * half + 4; ++g) {
      const uint8_t* p = o + 144 + g * 96;
      __m256i u[4];
      codes_q3k<N>(_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * N)), u);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 128 * N + 4 * g;
        for (int i = 0; i < 4; ++i) hs[t][i] = _mm256_add_epi16(hs[t][i], _mm256_maddubs_epi16(u[i], bcast4(xq + 32 * i)));
      }
    }
    for (int i = 0; i < 4; ++i) {
      const int sub16 = 2 * (4 * N + i) + half;
      // the 8 rows' scales as int16, each in both halves of its row's dword
      const __m128i s8 = _mm_loadl_epi64((const __m128i*)(o + 16 + 8 * sub16));
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));
      for (int t = 0; t < T; ++t) {
        const int64_t b = (m0 + t) * a.nb + s * 8;
        const __m256i v = _mm256_madd_epi16(_mm256_add_epi16(hs[t][i], _mm256_set1_epi32(a.q3k_off[2 * b + sub16])), sc);
        sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(a.d[b + 4 * N + i]), sacc[t]);
      }
    }
  }
}

// As half_q3k for Q2_K (no offset): per 16 values, one madd with the rows' 4-bit scales, one FMA with d_x; the mins
// meet the activations' 16-value sums, (m sum(q_x)) d_x summed apart and scaled by dmin at the end.
template <int T, int N>
inline void half_q2k(const GgufActs& a, int64_t m0, const uint8_t* o, int64_t s, __m256 sacc[T], __m256 macc[T]) {
  for (int half = 0; half < 2; ++half) {
    __m256i hs[T][4];
    for (int t = 0; t < T; ++t) hs[t][0] = hs[t][1] = hs[t][2] = hs[t][3] = _mm256_setzero_si256();
    for (int g = 4 * half; g < 4 * half + 4; ++g) {  // pair sums of 4 groups in int16: |.| <= 4 * 2 * 3 * 127
      __m256i u[4];
      codes_q2k(_mm256_loadu_si256((const __m256i*)(o + 160 + g * 64 + 32 * N)), u);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 128 * N + 4 * g;
        for (int i = 0; i < 4; ++i) hs[t][i] = _mm256_add_epi16(hs[t][i], _mm256_maddubs_epi16(u[i], bcast4(xq + 32 * i)));
      }
    }
    for (int i = 0; i < 4; ++i) {
      const int sub16 = 2 * (4 * N + i) + half;
      const __m128i s8 = _mm_loadl_epi64((const __m128i*)(o + 32 + 8 * sub16)), m4 = _mm_set1_epi8(0x0F);
      const __m128i sc8 = _mm_and_si128(s8, m4);
      const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(s8, 4), m4)));
      for (int t = 0; t < T; ++t) {
        const int64_t b = (m0 + t) * a.nb + s * 8;
        const __m256i v = _mm256_madd_epi16(hs[t][i], sc);
        sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(a.d[b + 4 * N + i]), sacc[t]);
        macc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.d_sum16[2 * b + sub16]), macc[t]);
      }
    }
  }
}

// Q2_K / Q3_K: a group of 8 rows, super-block by super-block, through half_q2k / half_q3k.
template <int TYPE, int T>
void group_low_k(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  constexpr int64_t XB = Raw<TYPE>::XB;
  const int64_t nsb = a.K / 256;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = w + s * XB;
    prefetch_sb<XB>(o);
    __m256 sacc[T], macc[T];
    for (int t = 0; t < T; ++t) sacc[t] = macc[t] = _mm256_setzero_ps();
    if constexpr (TYPE == GGUF_Q2_K) {
      half_q2k<T, 0>(a, m0, o, s, sacc, macc);
      half_q2k<T, 1>(a, m0, o, s, sacc, macc);
    } else {
      half_q3k<T, 0>(a, m0, o, s, sacc);
      half_q3k<T, 1>(a, m0, o, s, sacc);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const __m256 dm = TYPE == GGUF_Q2_K ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16))) : _mm256_setzero_ps();
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(sacc[t], d, TYPE == GGUF_Q2_K ? _mm256_fnmadd_ps(macc[t], dm, acc[t]) : acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = acc[t];
}

// The int8 levels of one group of 4-bit codes (32 bytes: values 4g + i | 16 + 4g + i of row r at byte 4r + i).
inline void levels4(const uint8_t* p, __m256i table, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
  hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
}

// IQ4_XS and the L4 types: the codes of group g of sub-block j looked up in `table`.
template <int TYPE>
inline void levels_iq4xs(const uint8_t* o, int j, int g, __m256i table, __m256i& lo, __m256i& hi) {
  levels4(o + x8_codes_at<TYPE>() + 128 * j + 32 * g, table, lo, hi);
}

// IQ4_XS and the L4 types: per sub-block, each row's int dots of its two 16-value halves in int32 lanes, then (dot
// d_x) sc per sub-block (the L4-per-16 types: (sc_a dot_a + sc_b dot_b) d_x) and d per super-block.  IQ4_XS's levels
// are signed int8 (|w| against x with w's sign, as the per-row kernels take Q8_0; the pair sums reach 2 * 127 * 127,
// so each maddubs is widened on its own); the L4 types' are small (|l| <= 62) and looked up as level + 64 instead
// (GGUF_LEVELS_U8): unsigned, straight into the dots, the 64 off through the activations' sums (per 32 values; per 16
// for the L4-per-16 types); the same integer sums with two sign transfers a dot fewer.
template <int TYPE, int T>
void group_iq4xs(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  constexpr int64_t XB = Raw<TYPE>::XB;
  constexpr bool U8 = TYPE != GGUF_IQ4_XS, PER16 = gguf_l4_16(TYPE);
  const int64_t nsb = a.K / 256;
  const uint8_t* levels;
  if constexpr (U8) levels = GGUF_LEVELS_U8<TYPE>.u;
  else levels = reinterpret_cast<const uint8_t*>(gguf_levels_of<TYPE>());
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)levels));
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* o = w + s * XB;
    prefetch_sb<XB>(o);
    __m256 sacc[T];
    for (int t = 0; t < T; ++t) sacc[t] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      __m256i ilo[T], ihi[T];  // values 0..15 / 16..31 of sub-block j
      for (int t = 0; t < T; ++t) ilo[t] = ihi[t] = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        __m256i lo, hi;
        levels_iq4xs<TYPE>(o, j, g, table, lo, hi);
        if constexpr (U8) {
          for (int t = 0; t < T; ++t) {
            const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 32 * j + 4 * g;
            ilo[t] = dot4_u8s8(ilo[t], lo, bcast4(xq));
            ihi[t] = dot4_u8s8(ihi[t], hi, bcast4(xq + 16));
          }
        } else {
          const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
          for (int t = 0; t < T; ++t) {
            const int8_t* xq = a.q + (m0 + t) * a.K + s * 256 + 32 * j + 4 * g;
            ilo[t] = dot4_u8s8(ilo[t], alo, _mm256_sign_epi8(bcast4(xq), lo));
            ihi[t] = dot4_u8s8(ihi[t], ahi, _mm256_sign_epi8(bcast4(xq + 16), hi));
          }
        }
      }
      if constexpr (PER16) {  // the rows' int8 multipliers of the two halves (d[r] | m[t][r] from byte 16)
        const __m256i mlo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(o + 16 + 16 * j)));
        const __m256i mhi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(o + 24 + 16 * j)));
        for (int t = 0; t < T; ++t) {
          const int64_t b = (m0 + t) * a.nb + s * 8 + j;
          const __m256i v = _mm256_add_epi32(
              _mm256_mullo_epi32(_mm256_sub_epi32(ilo[t], _mm256_set1_epi32(64 * a.sum16[2 * b])), mlo),
              _mm256_mullo_epi32(_mm256_sub_epi32(ihi[t], _mm256_set1_epi32(64 * a.sum16[2 * b + 1])), mhi));
          sacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(a.d[b]), sacc[t]);
        }
      } else {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(o + 16 + 8 * j))));
        for (int t = 0; t < T; ++t) {
          const int64_t b = (m0 + t) * a.nb + s * 8 + j;
          __m256i is = _mm256_add_epi32(ilo[t], ihi[t]);
          if constexpr (U8) is = _mm256_sub_epi32(is, _mm256_set1_epi32(64 * a.sum32[b]));
          sacc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(a.d[b])), sc, sacc[t]);
        }
      }
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    if (gguf_l4_scale<TYPE>() != 1.0f) d = _mm256_mul_ps(d, _mm256_set1_ps(gguf_l4_scale<TYPE>()));  // (exact)
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(sacc[t], d, acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = acc[t];
}

// Code vector g (value 4g + i of row r at byte 4r + i, fifth bit included) of a Q5_0 / Q5_1 x8 unit, its qh loaded.
template <int TYPE>
inline __m256i codes_q5(const uint8_t* o, __m256i qh, int g) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)(o + Raw<TYPE>::XH + 32 + 32 * (g & 3)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = g < 4 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  // bit g of each qh byte to bit 4 (16-bit shifts by <= 4: the bits crossing bytes are masked off)
  const __m256i h = g < 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - g)) : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(g - 4));
  return _mm256_or_si256(lo, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
}

// As group_k for Q5_0 / Q5_1: per 32-value block, the int dot of each row (codes 0..31) in one int32 lane, then
// Q5_0: (dot - 16 sum(q_x)) d d_x; Q5_1: dot d d_x + m s_x.
template <int TYPE, int T>
void group_q5(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  using R = Raw<TYPE>;
  __m256 acc[T], accm[T];
  for (int t = 0; t < T; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = w + b * R::XB;
    prefetch_sb<R::XB>(o);
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(o + R::XH));
    __m256i is[T];
    for (int t = 0; t < T; ++t) is[t] = _mm256_setzero_si256();
#ifdef EDGELLM_X8_VNNI
    for (int g = 0; g < 8; ++g) {
      const __m256i u = codes_q5<TYPE>(o, qh, g);
      for (int t = 0; t < T; ++t) is[t] = dot4_u8s8(is[t], u, bcast4(a.q + (m0 + t) * a.K + b * 32 + 4 * g));
    }
#else
    // maddubs pair sums in int16: 4 groups of codes <= 31 stay below 4 * 2 * 31 * 127 = 31496
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g0 = 0; g0 < 8; g0 += 4) {
      __m256i h16[T];
      for (int t = 0; t < T; ++t) h16[t] = _mm256_setzero_si256();
      for (int g = g0; g < g0 + 4; ++g) {
        const __m256i u = codes_q5<TYPE>(o, qh, g);
        for (int t = 0; t < T; ++t)
          h16[t] = _mm256_add_epi16(h16[t], _mm256_maddubs_epi16(u, bcast4(a.q + (m0 + t) * a.K + b * 32 + 4 * g)));
      }
      for (int t = 0; t < T; ++t) is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(h16[t], ones));
    }
#endif
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const __m256 mw = TYPE == GGUF_Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16))) : d;
    for (int t = 0; t < T; ++t) {
      const int64_t ab = (m0 + t) * a.nb + b;
      __m256i v = is[t];
      if (TYPE == GGUF_Q5_0) v = _mm256_sub_epi32(v, _mm256_set1_epi32(16 * a.sum32[ab]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, _mm256_set1_ps(a.d[ab])), acc[t]);
      if (TYPE == GGUF_Q5_1) accm[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ab]), accm[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = TYPE == GGUF_Q5_1 ? _mm256_add_ps(acc[t], accm[t]) : acc[t];
}

// As group_iq4xs per 32-value unit: each row's int dot (|w| against x with w's sign) in one int32 lane, then d d_x.
template <int T>
void group_iq4nl(const GgufActs& a, int64_t m0, const uint8_t* w, __m256 out[T]) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)GGUF_IQ4_LEVELS));
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = w + b * Raw<GGUF_IQ4_NL>::XB;
    prefetch_sb<Raw<GGUF_IQ4_NL>::XB>(o);
    __m256i is[T];
    for (int t = 0; t < T; ++t) is[t] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      __m256i lo, hi;
      levels4(o + 16 + 32 * g, table, lo, hi);  // (IQ4_NL: group g of the unit)
      const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = a.q + (m0 + t) * a.K + b * 32 + 4 * g;
        is[t] = dot4_u8s8(is[t], alo, _mm256_sign_epi8(bcast4(xq), lo));
        is[t] = dot4_u8s8(is[t], ahi, _mm256_sign_epi8(bcast4(xq + 16), hi));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[(m0 + t) * a.nb + b])), acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = acc[t];
}

template <int TYPE, int T>
inline void group_rows(const GgufActs& a, int64_t m0, const uint8_t* w, float* y, int64_t ldy, const int32_t* cols,
                       int64_t n0) {
  __m256 out[T];
  if constexpr (TYPE == GGUF_Q6_K) group_q6k<T>(a, m0, w, out);
  else if constexpr (TYPE == GGUF_Q3_K || TYPE == GGUF_Q2_K) group_low_k<TYPE, T>(a, m0, w, out);
  else if constexpr (is_q5(TYPE)) group_q5<TYPE, T>(a, m0, w, out);
  else if constexpr (TYPE == GGUF_IQ4_NL) group_iq4nl<T>(a, m0, w, out);
  else if constexpr (iq4xs_like(TYPE) || gguf_l4_16(TYPE)) group_iq4xs<TYPE, T>(a, m0, w, out);
  else group_k<TYPE, T>(a, m0, w, out);
  for (int t = 0; t < T; ++t) {
    float* yr = y + (m0 + t) * ldy;
    if (!cols) {
      _mm256_storeu_ps(yr + n0, out[t]);
    } else {
      alignas(32) float v[8];
      _mm256_store_ps(v, out[t]);
      for (int r = 0; r < 8; ++r) yr[cols[n0 + r]] = v[r];
    }
  }
}

// Activation rows per pass over a group: the passes after the first re-read it from L1 / L2.
constexpr int64_t X8_TILE = 4;  // 6 measured 20% slower at M = 512 (registers)

template <int TYPE>
void gemm_x8(const GgufActs& a, const uint8_t* x8, int64_t N, float* y, int64_t ldy, const int32_t* cols) {
  const int64_t gbytes = a.K / Raw<TYPE>::QV * Raw<TYPE>::XB;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, a.K / 8 * std::min<int64_t>(a.M, 4)));
  const int64_t ngroups = N / 8;
  auto groups = [&](int64_t g0, int64_t g1) {
    for (int64_t grp = g0; grp < g1; ++grp) {
      const uint8_t* w = x8 + grp * gbytes;
      int64_t m = 0;
      for (; m + X8_TILE <= a.M; m += X8_TILE) group_rows<TYPE, X8_TILE>(a, m, w, y, ldy, cols, grp * 8);
      switch (a.M - m) {
        case 3: group_rows<TYPE, 3>(a, m, w, y, ldy, cols, grp * 8); break;
        case 2: group_rows<TYPE, 2>(a, m, w, y, ldy, cols, grp * 8); break;
        case 1: group_rows<TYPE, 1>(a, m, w, y, ldy, cols, grp * 8); break;
        default: break;
      }
    }
  };
  if (max_threads() == 1 || ngroups <= grain) groups(0, ngroups);  // a small product: one thread, as before
  else parallel_runs(ngroups, groups);
}
template <int TYPE>
void panel_sb(const uint8_t* o, uint8_t* codes, int64_t cstride, float* ws, float* wm, int64_t wstride) {
  if constexpr (is_q5(TYPE)) {  // one 32-value unit: its 8 code vectors, d (and m) of each row
    (void)wstride;
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(o + Raw<TYPE>::XH));
    for (int g = 0; g < 8; ++g) _mm256_storeu_si256((__m256i*)(codes + g * cstride), codes_q5<TYPE>(o, qh, g));
    _mm256_storeu_ps(ws, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o)));
    if (TYPE == GGUF_Q5_1) _mm256_storeu_ps(wm, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16))));
    return;
  }
  if (TYPE == GGUF_IQ4_NL) {  // one 32-value unit: d, and the int8 levels (build_panel_x8 splits their signs)
    (void)wm;
    (void)wstride;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)GGUF_IQ4_LEVELS));
    _mm256_storeu_ps(ws, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o)));
    for (int g = 0; g < 4; ++g) {
      __m256i lo, hi;
      levels4(o + 16 + 32 * g, table, lo, hi);  // (IQ4_NL: group g of the unit)
      _mm256_storeu_si256((__m256i*)(codes + g * cstride), lo);
      _mm256_storeu_si256((__m256i*)(codes + (4 + g) * cstride), hi);
    }
    return;
  }
  if constexpr (iq4xs_like(TYPE) || gguf_l4_16(TYPE)) {
    // per sub-block d sc (L4: times its power of two) and the int8 levels (build_panel_x8 splits their signs); the
    // L4-per-16 types: per 16 values (d / 8) m, and the codes as level + 64 (the per16 offset)
    constexpr bool PER16 = gguf_l4_16(TYPE);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const uint8_t* levels;
    if constexpr (PER16) levels = GGUF_LEVELS_U8<TYPE>.u;
    else levels = reinterpret_cast<const uint8_t*>(gguf_levels_of<TYPE>());
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)levels));
    for (int t = 0; t < (PER16 ? 16 : 8); ++t) {
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(o + 16 + 8 * t))));
      __m256 ds = PER16 ? _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(0.125f)), sc) : _mm256_mul_ps(d, sc);
      if (!PER16 && gguf_l4_scale<TYPE>() != 1.0f) ds = _mm256_mul_ps(ds, _mm256_set1_ps(gguf_l4_scale<TYPE>()));
      _mm256_storeu_ps(ws + t * wstride, ds);
    }
    for (int j = 0; j < 8; ++j)
      for (int g = 0; g < 4; ++g) {
        __m256i lo, hi;
        levels_iq4xs<TYPE>(o, j, g, table, lo, hi);
        _mm256_storeu_si256((__m256i*)(codes + (j * 8 + g) * cstride), lo);
        _mm256_storeu_si256((__m256i*)(codes + (j * 8 + 4 + g) * cstride), hi);
      }
    return;
  }
  if (TYPE == GGUF_Q2_K) {  // per 16 values: d sc, -(dmin m); codes as half_q2k decodes them
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int t = 0; t < 16; ++t) {
      const __m128i s8 = _mm_loadl_epi64((const __m128i*)(o + 32 + 8 * t));
      _mm256_storeu_ps(ws + t * wstride, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(s8, m4)))));
      _mm256_storeu_ps(wm + t * wstride, _mm256_xor_ps(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                                _mm_and_si128(_mm_srli_epi16(s8, 4), m4)))), _mm256_set1_ps(-0.0f)));
    }
    for (int g = 0; g < 8; ++g) {
      __m256i u[8];
      codes_q2k(_mm256_loadu_si256((const __m256i*)(o + 160 + g * 64)), u);
      codes_q2k(_mm256_loadu_si256((const __m256i*)(o + 192 + g * 64)), u + 4);
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(codes + (j * 8 + g) * cstride), u[j]);
    }
    return;
  }
  if (TYPE == GGUF_Q3_K || TYPE == GGUF_Q6_K) {  // scales per 16 values: d sc
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
    for (int t = 0; t < 16; ++t)
      _mm256_storeu_ps(ws + t * wstride, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                              _mm_loadl_epi64((const __m128i*)(o + 16 + 8 * t))))));
  }
  if (TYPE == GGUF_Q3_K) {
    for (int g = 0; g < 8; ++g) {  // as half_q3k decodes them
      const uint8_t* p = o + 144 + g * 96;
      const __m256i hm = _mm256_loadu_si256((const __m256i*)p);
      __m256i u[8];
      codes_q3k<0>(hm, _mm256_loadu_si256((const __m256i*)(p + 32)), u);
      codes_q3k<1>(hm, _mm256_loadu_si256((const __m256i*)(p + 64)), u + 4);
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(codes + (j * 8 + g) * cstride), u[j]);
    }
    return;
  }
  if (TYPE == GGUF_Q6_K) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 8; ++g) {  // as group_q6k decodes them
        const uint8_t* p = o + 144 + (h * 8 + g) * 96;
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)p), v1 = _mm256_loadu_si256((const __m256i*)(p + 32));
        const __m256i hq = _mm256_loadu_si256((const __m256i*)(p + 64));
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(v0, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 4), m3)),
            _mm256_or_si256(_mm256_and_si256(v1, m4), _mm256_and_si256(_mm256_slli_epi16(hq, 2), m3)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), m4), _mm256_and_si256(hq, m3)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hq, 2), m3))};
        for (int j = 0; j < 4; ++j) _mm256_storeu_si256((__m256i*)(codes + ((4 * h + j) * 8 + g) * cstride), u[j]);
      }
    return;
  }
  for (int k = 0; k < 4; ++k)
    for (int g = 0; g < 8; ++g) {
      __m256i lo, hi;
      codes_k<TYPE>(o, k, g, lo, hi);
      _mm256_storeu_si256((__m256i*)(codes + (2 * k * 8 + g) * cstride), lo);
      _mm256_storeu_si256((__m256i*)(codes + ((2 * k + 1) * 8 + g) * cstride), hi);
    }
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o));
  const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16)));
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_ps(ws + j * wstride, _mm256_mul_ps(d, u8x8_ps(o + 32 + 8 * j)));
    _mm256_storeu_ps(wm + j * wstride, _mm256_xor_ps(_mm256_mul_ps(dm, u8x8_ps(o + 96 + 8 * j)), _mm256_set1_ps(-0.0f)));
  }
}
#endif  // EDGELLM_X8

}  // namespace

void gguf_x8_panel_sb(const uint8_t* sb, int base_type, uint8_t* codes, int64_t cstride, float* ws, float* wm,
                      int64_t wstride) {
#ifdef EDGELLM_X8
  on_x8_type(base_type, [&](auto t) { panel_sb<decltype(t)::value>(sb, codes, cstride, ws, wm, wstride); });
#else
  (void)sb; (void)base_type; (void)codes; (void)cstride; (void)ws; (void)wm; (void)wstride;
#endif
}

bool gguf_x8_supported(int base_type) {
#ifdef EDGELLM_X8
  return gguf_x8_bytes(base_type) != 0;
#else
  (void)base_type;
  return false;
#endif
}

int64_t gguf_x8_bytes(int base_type) {
  int64_t bytes = 0;
  on_x8_type(base_type, [&](auto t) { bytes = Raw<decltype(t)::value>::XB; });
  return bytes;
}

void gguf_repack_x8(const uint8_t* raw, int base_type, int64_t N, int64_t K, uint8_t* x8) {
  uint8_t* r = const_cast<uint8_t*>(raw);  // only read (convert<..., true> writes x8)
  on_x8_type(base_type, [&](auto t) { convert<decltype(t)::value, true>(r, x8, N, K); });
}

void gguf_unrepack_x8(const uint8_t* x8, int base_type, int64_t N, int64_t K, uint8_t* raw) {
  uint8_t* o = const_cast<uint8_t*>(x8);  // only read (convert<..., false> writes raw)
  on_x8_type(base_type, [&](auto t) { convert<decltype(t)::value, false>(raw, o, N, K); });
}

void gguf_unrepack_x8_group(const uint8_t* x8, int base_type, int64_t K, uint8_t* raw) {
  uint8_t* o = const_cast<uint8_t*>(x8);  // only read
  on_x8_type(base_type, [&](auto t) { convert_groups<decltype(t)::value, false>(raw, o, 0, 1, K); });
}

void gguf_gemm_x8(const GgufActs& acts, const uint8_t* x8, int base_type, int64_t N, float* y, int64_t ldy,
                  const int32_t* out_index) {
#ifdef EDGELLM_X8
  on_x8_type(base_type, [&](auto t) { gemm_x8<decltype(t)::value>(acts, x8, N, y, ldy, out_index); });
#else
  (void)acts; (void)x8; (void)base_type; (void)N; (void)y; (void)ldy; (void)out_index;
#endif
}

}  // namespace edgellm
