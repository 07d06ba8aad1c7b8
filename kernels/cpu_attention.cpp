// Causal attention of a prompt chunk over the keys before it and its own, fp32, AVX2 + FMA, in AVX-512 builds 16 lanes
// wide for head dims that are multiples of 32 (for a quantized cache: over its own keys, the diagonal part, the
// prefix's tiles going through torch's kernel).
//
// torch's CPU flash kernel (what kernels/attention.py calls for the rest) splits keys into blocks of 512 and, with
// is_causal, still computes a whole block for every query block: for a chunk of up to 512 rows it does the full
// T x T square, twice the causal work.  Here query blocks of BQ rows walk key blocks of BK only up to their last
// row, so the work is the triangle (plus half a block on the diagonal):
//   - per KV head, K is transposed once per call into key blocks [L / BK][D][BK] (zeros past the last key), so that
//     scores vectorize over keys and a block's keys sit together;
//   - per (query head, query block): S = Q K^T a key block at a time (RT = 6 rows x 16 keys of FMA accumulators),
//     the causal mask on the diagonal block, the online softmax (running max and sum per row, exp256), then
//     O += P V (6 rows x 16 values of D);
//   - out = O / sum and the log-sum-exp per row (max + log sum), for a caller that merges another part.
// Work items are (head, query block) with the blocks of a head taken from both ends in turn, so that the two
// halves of any range of items cost about the same (at::parallel_for gives each thread one contiguous range).
// Builds without AVX2 have only flash_causal_fast() == false: the caller uses torch's kernel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>

#include "amx_tiles.h"
#include "simd_math.h"

namespace edgellm {

void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
bool gguf_amx_available();  // cpu_gguf.cpp: AMX-BF16 here and the tile state granted

#ifdef EDGELLM_SIMD_AVX2
namespace {

constexpr int BQ = 32, BK = 64;

// The vector width the blocks below are written for: 8 floats (AVX2), or 16 in AVX-512 builds, which take head dims
// that are multiples of 32 (two registers a row across D).  Same operations in the same order per lane.
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_store_ps(p, a); }
  static void storeu(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float sum(V a) { return hsum(a); }
  static float maximum(V a) { return hmax(a); }
  // e^(x - m) for x - m <= 0 (scores minus their running max); below -87, and -inf (the mask), exactly 0.
  static V exp_neg(V x, V m) {
    const V d = _mm256_sub_ps(x, m);
    return _mm256_and_ps(exp256(d), _mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
  }
};

#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_store_ps(p, a); }
  static void storeu(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float sum(V a) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_castps512_ps256(_mm512_shuffle_f32x4(a, a, 0xEE))));
  }
  static float maximum(V a) { return _mm512_reduce_max_ps(a); }
  static V exp_neg(V x, V m) {
    const V d = _mm512_sub_ps(x, m);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), exp512(d));
  }
};
#endif

// s[R][BK] = q rows [R][D] (row stride D) against one key block kt[D][BK].
template <class S, int R>
void scores(const float* q, int64_t D, const float* kt, float* s) {
  using V = typename S::V;
  constexpr int64_t ldk = BK, W = S::W;
  for (int j = 0; j < BK; j += 2 * W) {
    V a[R][2];
    for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = S::zero();
    const float* k = kt + j;
    for (int64_t d = 0; d < D; ++d) {
      const V k0 = S::loadu(k + d * ldk), k1 = S::loadu(k + d * ldk + W);
      for (int i = 0; i < R; ++i) {
        const V x = S::bcast(q + i * D + d);
        a[i][0] = S::fmadd(x, k0, a[i][0]);
        a[i][1] = S::fmadd(x, k1, a[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      S::store(s + i * BK + j, a[i][0]);
      S::store(s + i * BK + j + W, a[i][1]);
    }
  }
}

// o[R][D] += p[R][0, nk) (row stride BK) times v rows [nk][D].
template <class S, int R>
void accumulate(const float* p, int nk, const float* v, int64_t D, float* o) {
  using V = typename S::V;
  constexpr int64_t W = S::W;
  for (int64_t c = 0; c < D; c += 2 * W) {
    V a[R][2];
    for (int i = 0; i < R; ++i) {
      a[i][0] = S::load(o + i * D + c);
      a[i][1] = S::load(o + i * D + c + W);
    }
    for (int j = 0; j < nk; ++j) {
      const V v0 = S::loadu(v + j * D + c), v1 = S::loadu(v + j * D + c + W);
      for (int i = 0; i < R; ++i) {
        const V w = S::bcast(p + i * BK + j);
        a[i][0] = S::fmadd(w, v0, a[i][0]);
        a[i][1] = S::fmadd(w, v1, a[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      S::store(o + i * D + c, a[i][0]);
      S::store(o + i * D + c + W, a[i][1]);
    }
  }
}

// f(R, first row) over `rows` rows in tiles of RT (12 accumulators with 2 vectors a row: enough independent FMAs
// to cover their latency), then the rest in one smaller tile.
constexpr int RT = 6;
template <class F>
void in_tiles(int rows, F&& f) {
  int i = 0;
  for (; i + RT <= rows; i += RT) f(std::integral_constant<int, RT>{}, i);
  switch (rows - i) {
    case 5: f(std::integral_constant<int, 5>{}, i); break;
    case 4: f(std::integral_constant<int, 4>{}, i); break;
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// The online softmax of one key block's scores s[nr][BK] (row i's last visible key: last0 + i, block-relative): the
// causal mask, the running max m and sum l per row, s turned into e^(s - m), and o[nr][D] rescaled to the new max.
template <class S>
void softmax_block(float* s, int nr, int64_t last0, float* m, float* l, float* o, int64_t D) {
  using V = typename S::V;
  constexpr int W = S::W;
  for (int i = 0; i < nr; ++i) {
    float* si = s + i * BK;
    const int64_t last = last0 + i;  // the row's last visible key in this block (causal)
    for (int j = (int)std::max<int64_t>(0, std::min<int64_t>(last + 1, BK)); j < BK; ++j)
      si[j] = -std::numeric_limits<float>::infinity();
    V mx = S::load(si);
    for (int j = W; j < BK; j += W) mx = S::max(mx, S::load(si + j));
    const float m_new = std::max(m[i], S::maximum(mx));  // finite: the first block holds key 0, visible to every row
    const V mv = S::set1(m_new);
    V sum = S::zero();
    for (int j = 0; j < BK; j += W) {
      const V e = S::exp_neg(S::load(si + j), mv);
      S::store(si + j, e);
      sum = S::add(sum, e);
    }
    const float alpha = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
    l[i] = l[i] * alpha + S::sum(sum);
    m[i] = m_new;
    if (alpha != 1.0f) {
      const V av = S::set1(alpha);
      for (int64_t c = 0; c < D; c += W) S::store(o + i * D + c, S::mul(S::load(o + i * D + c), av));
    }
  }
}

// out[nr][D] = o / l per row, lse = m + log l.
template <class S>
void finish_rows(const float* o, const float* m, const float* l, int nr, int64_t D, float* out, float* lse) {
  using V = typename S::V;
  constexpr int W = S::W;
  for (int i = 0; i < nr; ++i) {
    const V inv = S::set1(1.0f / l[i]);
    for (int64_t c = 0; c < D; c += W) S::storeu(out + i * D + c, S::mul(S::load(o + i * D + c), inv));
    lse[i] = m[i] + std::log(l[i]);
  }
}

// One query block: rows [r0, r0 + nr) of one head, row r at position pos0 + r, against keys [0, pos0 + r0 + nr):
// kt the head's key blocks [.][D][BK], v its values [L][D].
template <class S>
void query_block(const float* q, const float* kt, const float* v, float* out, float* lse, int64_t pos0, int64_t r0,
                 int nr, int64_t D) {
  alignas(64) float s[BQ * BK];
  alignas(64) float o[BQ * 256];
  float m[BQ], l[BQ];
  std::fill(o, o + nr * D, 0.0f);
  std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nr, 0.0f);
  const int64_t end = pos0 + r0 + nr;
  for (int64_t c0 = 0; c0 < end; c0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, end - c0);
    in_tiles(nr, [&](auto R, int i) { scores<S, decltype(R)::value>(q + (r0 + i) * D, D, kt + c0 * D, s + i * BK); });
    softmax_block<S>(s, nr, pos0 + r0 - c0, m, l, o, D);
    in_tiles(nr, [&](auto R, int i) { accumulate<S, decltype(R)::value>(s + i * BK, nk, v + c0 * D, D, o + i * D); });
  }
  finish_rows<S>(o, m, l, nr, D, out + r0 * D, lse + r0);
}

#ifdef EDGELLM_AMX
#define EDGELLM_ATT_AMX 1
// ------------------------------------------------------------------------------------------------ AMX (bf16 tiles)
// The same walk with S = Q K^T and O += P V on AMX tiles (cpu_gguf.cpp "AMX prefill" for the tiles), each operand
// split into bf16 hi + lo parts (x = bf16(x) + bf16(x - bf16(x))) and multiplied as hi hi + hi lo + lo hi with fp32
// sums: ~2^-16 relative, against 2^-23 for the fp32 path and 2^-11 for the fp16 cache's own rounding (one bf16
// product alone doubled SmolLM2's KL to the fp model: results/gguf-amx-attention-kl-single-bf16.json).  The mask, the online
// softmax and O stay fp32 as above.  Per KV head, once per call:
//   kb: K as the B tiles of Q K^T, [key group of 16][D / 32][hi, lo][16 dim pairs][16 keys][2]
//   vb: V as the B tiles of P V, [key chunk of 32][D / 16][hi, lo][16 key pairs][16 dims][2]
// (zeros past the last key).  A query block (32 rows: two tiles of 16) makes per key block of 64: 4 x (D / 32) x 2 x 3
// TDPBF16PS for S, then (D / 16) x 2 x 2 x 3 for P V; tiles: C 0-1, A 2-3 (hi, lo), B 4-5 (hi, lo).
#define ATT_AMX EDGELLM_AMX_TARGET
using amx::bf16_pairs;
using amx::bf16_to_ps;
using amx::bf16x16;

// C tile 0 (and 1: `two`, the A rows 16 further on) += A B with A and B given as bf16 hi + lo parts: hi hi + hi lo +
// lo hi.  B: the hi and lo tiles at b (1 KiB apart: 16 rows of 64 bytes each); A: rows of `lda` values at ahi, alo.
ATT_AMX inline void split_product(const uint32_t* b, const uint16_t* ahi, const uint16_t* alo, int64_t lda, bool two) {
  _tile_loadd(4, b, 64);
  _tile_loadd(5, b + 256, 64);
  _tile_loadd(2, ahi, lda * 2);
  _tile_loadd(3, alo, lda * 2);
  _tile_dpbf16ps(0, 2, 4);
  _tile_dpbf16ps(0, 2, 5);
  _tile_dpbf16ps(0, 3, 4);
  if (two) {
    _tile_loadd(2, ahi + 16 * lda, lda * 2);
    _tile_loadd(3, alo + 16 * lda, lda * 2);
    _tile_dpbf16ps(1, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(1, 3, 4);
  }
}

// One KV head's keys [0, L) (rows of D) as kb, nkg groups of 16 keys: per group and 32 dims a tile of bf16(k) and
// one of the remainder bf16(k - bf16(k)) (zeros past L).
ATT_AMX void layout_k(const float* k, int64_t L, int64_t D, int64_t nkg, uint32_t* kb) {
  const int64_t ndc = D / 32;
  alignas(64) uint32_t pairs[2][16];
  for (int64_t key = 0; key < nkg * 16; ++key) {
    const int64_t kg = key / 16, kk = key % 16;
    for (int64_t dc = 0; dc < ndc; ++dc) {
      uint32_t* tile = kb + (kg * ndc + dc) * 512;  // hi, then lo: 16 rows x 16 dwords each
      if (key < L) {
        const __m512 a = _mm512_loadu_ps(k + key * D + 32 * dc), b = _mm512_loadu_ps(k + key * D + 32 * dc + 16);
        const __m256i ha = bf16x16(a), hb = bf16x16(b);
        const __m512 ra = _mm512_sub_ps(a, bf16_to_ps(ha)), rb = _mm512_sub_ps(b, bf16_to_ps(hb));
        // 32 values in order: dim pairs (2t, 2t + 1) land in dword t
        _mm512_store_si512((void*)pairs[0], _mm512_inserti64x4(_mm512_castsi256_si512(ha), hb, 1));
        _mm512_store_si512((void*)pairs[1], _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(ra)), bf16x16(rb), 1));
        for (int t = 0; t < 16; ++t) tile[t * 16 + kk] = pairs[0][t], tile[256 + t * 16 + kk] = pairs[1][t];
      } else {
        for (int t = 0; t < 16; ++t) tile[t * 16 + kk] = tile[256 + t * 16 + kk] = 0;
      }
    }
  }
}

// One KV head's values [0, L) as vb, nkc chunks of 32 keys: per chunk and 16 dims a tile of bf16(v) and one of
// bf16(v - bf16(v)) (zeros past L).
ATT_AMX void layout_v(const float* v, int64_t L, int64_t D, int64_t nkc, uint32_t* vb) {
  const int64_t ndg = D / 16;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < nkc; ++kc)
    for (int t = 0; t < 16; ++t) {
      const int64_t k0 = kc * 32 + 2 * t, k1 = k0 + 1;
      for (int64_t dg = 0; dg < ndg; ++dg) {
        const __m512 a = k0 < L ? _mm512_loadu_ps(v + k0 * D + 16 * dg) : zero;
        const __m512 b = k1 < L ? _mm512_loadu_ps(v + k1 * D + 16 * dg) : zero;
        uint32_t* tile = vb + (kc * ndg + dg) * 512;  // (new[]: 16-byte aligned, so unaligned stores)
        _mm512_storeu_si512((void*)(tile + t * 16), bf16_pairs(a, b));
        const __m512 ra = _mm512_sub_ps(a, bf16_to_ps(bf16x16(a))), rb = _mm512_sub_ps(b, bf16_to_ps(bf16x16(b)));
        _mm512_storeu_si512((void*)(tile + 256 + t * 16), bf16_pairs(ra, rb));
      }
    }
}

ATT_AMX void query_block_amx(const float* q, const uint32_t* kb, const uint32_t* vb, float* out, float* lse,
                             int64_t pos0, int64_t r0, int nr, int64_t D) {
  alignas(64) float s[BQ * BK];
  alignas(64) float o[BQ * 256];
  alignas(64) float c[BQ * 16];
  alignas(64) uint16_t qb[2][BQ * 256];  // bf16(q), bf16(q - bf16(q))
  alignas(64) uint16_t pb[2][BQ * BK];  // bf16(p), bf16(p - bf16(p))
  float m[BQ], l[BQ];
  std::fill(o, o + nr * D, 0.0f);
  std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nr, 0.0f);
  for (int i = 0; i < BQ; ++i)  // Q in bf16 as hi + lo, rows past nr zeros
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = i < nr ? _mm512_loadu_ps(q + (r0 + i) * D + d) : _mm512_setzero_ps();
      const __m256i hi = bf16x16(x);
      _mm256_store_si256((__m256i*)(qb[0] + i * D + d), hi);
      _mm256_store_si256((__m256i*)(qb[1] + i * D + d), bf16x16(_mm512_sub_ps(x, bf16_to_ps(hi))));
    }
  std::fill(pb[0], pb[0] + 2 * BQ * BK, (uint16_t)0);
  const int64_t ndc = D / 32, ndg = D / 16, end = pos0 + r0 + nr;
  const bool two = nr > 16;
  amx::configure(6);
  for (int64_t c0 = 0; c0 < end; c0 += BK) {
    for (int kg = 0; kg < BK / 16; ++kg) {  // S, 16 keys at a time
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (int64_t dc = 0; dc < ndc; ++dc)  // q k = qh kh + qh kl + ql kh (ql kl: below the parts' rounding)
        split_product(kb + ((c0 / 16 + kg) * ndc + dc) * 512, qb[0] + 32 * dc, qb[1] + 32 * dc, D, two);
      _tile_stored(0, s + 16 * kg, BK * 4);
      if (two) _tile_stored(1, s + 16 * BK + 16 * kg, BK * 4);
    }
    softmax_block<Avx512>(s, nr, pos0 + r0 - c0, m, l, o, D);
    for (int i = 0; i < nr; ++i)
      for (int j = 0; j < BK; j += 16) {
        const __m512 p = _mm512_load_ps(s + i * BK + j);
        const __m256i hi = bf16x16(p);
        _mm256_store_si256((__m256i*)(pb[0] + i * BK + j), hi);
        _mm256_store_si256((__m256i*)(pb[1] + i * BK + j), bf16x16(_mm512_sub_ps(p, bf16_to_ps(hi))));
      }
    for (int64_t dg = 0; dg < ndg; ++dg) {  // O += P V, 16 values of D at a time: ph vh + ph vl + pl vh
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (int kc = 0; kc < BK / 32; ++kc)
        split_product(vb + ((c0 / 32 + kc) * ndg + dg) * 512, pb[0] + 32 * kc, pb[1] + 32 * kc, BK, two);
      _tile_stored(0, c, 64);
      if (two) _tile_stored(1, c + 256, 64);
      for (int i = 0; i < nr; ++i)
        _mm512_store_ps(o + i * D + 16 * dg, _mm512_add_ps(_mm512_load_ps(o + i * D + 16 * dg), _mm512_load_ps(c + i * 16)));
    }
  }
  _tile_release();
  finish_rows<Avx512>(o, m, l, nr, D, out + r0 * D, lse + r0);
}
#endif

}  // namespace
#endif

bool flash_causal_fast() {
#ifdef EDGELLM_SIMD_AVX2
  return true;
#else
  return false;
#endif
}

// q [Hq][T][D] (already scaled), k and v [Hkv][pos0 + T][D] (rows of D contiguous, heads kvs apart: a cache's
// slice), query head h on KV head h / (Hq / Hkv); row t, at position pos0 + t, sees keys [0, pos0 + t].  out
// [Hq][T][D], lse [Hq][T].  Needs D % 16 == 0, D <= 256 and flash_causal_fast().
void flash_causal(const float* q, const float* k, const float* v, int64_t kvs, float* out, float* lse, int64_t Hq,
                  int64_t Hkv, int64_t T, int64_t D, int64_t pos0, bool amx) {
#ifdef EDGELLM_SIMD_AVX2
  const int64_t L = pos0 + T, nkb = (L + BK - 1) / BK, hb = nkb * BK * D;  // per head: key blocks [nkb][D][BK]
#ifdef EDGELLM_ATT_AMX
  if (amx && D % 32 == 0 && gguf_amx_available()) {
    const int64_t kbh = nkb * BK / 16 * (D / 32) * 512, vbh = nkb * BK / 32 * (D / 16) * 512;  // dwords per head
    std::unique_ptr<uint32_t[]> kb(new uint32_t[(size_t)(Hkv * kbh)]), vb(new uint32_t[(size_t)(Hkv * vbh)]);
    parallel_run(0, 2 * Hkv, 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t h = i / 2;
        if (i % 2 == 0) layout_k(k + h * kvs, L, D, nkb * BK / 16, kb.get() + h * kbh);
        else layout_v(v + h * kvs, L, D, nkb * BK / 32, vb.get() + h * vbh);
      }
    });
    const int64_t nqb = (T + BQ - 1) / BQ, g = Hq / Hkv;
    parallel_run(0, Hq * nqb, 1, [&](int64_t a, int64_t b) {
      for (int64_t item = a; item < b; ++item) {
        const int64_t h = item / nqb, u = item % nqb;
        const int64_t qb = u % 2 == 0 ? u / 2 : nqb - 1 - u / 2;
        const int64_t hk = h / g;
        query_block_amx(q + h * T * D, kb.get() + hk * kbh, vb.get() + hk * vbh, out + h * T * D, lse + h * T, pos0,
                        qb * BQ, (int)std::min<int64_t>(BQ, T - qb * BQ), D);
      }
    });
    return;
  }
#endif
  std::unique_ptr<float[]> kt(new float[(size_t)(Hkv * hb)]);  // every value written below
  parallel_run(0, Hkv * nkb, 1, [&](int64_t a, int64_t b) {
    for (int64_t hk = a; hk < b; ++hk) {
      const int64_t h = hk / nkb, c0 = hk % nkb * BK, n = std::min<int64_t>(BK, L - c0);  // zeros past L
      float* dst = kt.get() + h * hb + c0 * D;
      const float* src = k + h * kvs + c0 * D;
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t t = 0; t < n; ++t) dst[d * BK + t] = src[t * D + d];
        for (int64_t t = n; t < BK; ++t) dst[d * BK + t] = 0.0f;
      }
    }
  });
  const int64_t nqb = (T + BQ - 1) / BQ, g = Hq / Hkv;
  parallel_run(0, Hq * nqb, 1, [&](int64_t a, int64_t b) {
    for (int64_t item = a; item < b; ++item) {
      const int64_t h = item / nqb, u = item % nqb;
      const int64_t qb = u % 2 == 0 ? u / 2 : nqb - 1 - u / 2;  // both ends of the head in turn
      const int64_t r0 = qb * BQ, hk = h / g;
      const int nr = (int)std::min<int64_t>(BQ, T - r0);
#if defined(__AVX512F__)
      if (D % 32 == 0) {
        query_block<Avx512>(q + h * T * D, kt.get() + hk * hb, v + hk * kvs, out + h * T * D, lse + h * T, pos0, r0,
                            nr, D);
        continue;
      }
#endif
      query_block<Avx2>(q + h * T * D, kt.get() + hk * hb, v + hk * kvs, out + h * T * D, lse + h * T, pos0, r0, nr,
                        D);
    }
  });
#else
  (void)q, (void)k, (void)v, (void)kvs, (void)out, (void)lse, (void)Hq, (void)Hkv, (void)T, (void)D, (void)pos0, (void)amx;
#endif
}

}  // namespace edgellm
