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

#include "simd_math.h"

namespace edgellm {

void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

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

// One query block: rows [r0, r0 + nr) of one head, row r at position pos0 + r, against keys [0, pos0 + r0 + nr):
// kt the head's key blocks [.][D][BK], v its values [L][D].
template <class S>
void query_block(const float* q, const float* kt, const float* v, float* out, float* lse, int64_t pos0, int64_t r0,
                 int nr, int64_t D) {
  using V = typename S::V;
  constexpr int W = S::W;
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
    for (int i = 0; i < nr; ++i) {
      float* si = s + i * BK;
      const int64_t last = pos0 + r0 + i - c0;  // the row's last visible key in this block (causal)
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
    in_tiles(nr, [&](auto R, int i) { accumulate<S, decltype(R)::value>(s + i * BK, nk, v + c0 * D, D, o + i * D); });
  }
  for (int i = 0; i < nr; ++i) {
    const V inv = S::set1(1.0f / l[i]);
    for (int64_t c = 0; c < D; c += W) S::storeu(out + (r0 + i) * D + c, S::mul(S::load(o + i * D + c), inv));
    lse[r0 + i] = m[i] + std::log(l[i]);
  }
}

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
                  int64_t Hkv, int64_t T, int64_t D, int64_t pos0) {
#ifdef EDGELLM_SIMD_AVX2
  const int64_t L = pos0 + T, nkb = (L + BK - 1) / BK, hb = nkb * BK * D;  // per head: key blocks [nkb][D][BK]
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
  (void)q, (void)k, (void)v, (void)kvs, (void)out, (void)lse, (void)Hq, (void)Hkv, (void)T, (void)D, (void)pos0;
#endif
}

}  // namespace edgellm
