// Causal attention of a prompt chunk over the keys before it and its own, fp32, AVX2 + FMA (for a quantized cache:
// over its own keys, the diagonal part, the prefix's tiles going through torch's kernel).
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

// e^x for x <= 0 (scores minus their running max); below -87, and -inf (the mask), exactly 0.
inline __m256 exp_neg(__m256 x) {
  return _mm256_and_ps(exp256(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
}

// s[R][BK] = q rows [R][D] (row stride D) against one key block kt[D][BK].
template <int R>
void scores(const float* q, int64_t D, const float* kt, float* s) {
  constexpr int64_t ldk = BK;
  for (int j = 0; j < BK; j += 16) {
    __m256 a[R][2];
    for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    const float* k = kt + j;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(k + d * ldk), k1 = _mm256_loadu_ps(k + d * ldk + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 x = _mm256_broadcast_ss(q + i * D + d);
        a[i][0] = _mm256_fmadd_ps(x, k0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(x, k1, a[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(s + i * BK + j, a[i][0]);
      _mm256_store_ps(s + i * BK + j + 8, a[i][1]);
    }
  }
}

// o[R][D] += p[R][0, nk) (row stride BK) times v rows [nk][D].
template <int R>
void accumulate(const float* p, int nk, const float* v, int64_t D, float* o) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256 a[R][2];
    for (int i = 0; i < R; ++i) {
      a[i][0] = _mm256_load_ps(o + i * D + c);
      a[i][1] = _mm256_load_ps(o + i * D + c + 8);
    }
    for (int j = 0; j < nk; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * D + c), v1 = _mm256_loadu_ps(v + j * D + c + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * BK + j);
        a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(o + i * D + c, a[i][0]);
      _mm256_store_ps(o + i * D + c + 8, a[i][1]);
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
void query_block(const float* q, const float* kt, const float* v, float* out, float* lse, int64_t pos0, int64_t r0,
                 int nr, int64_t D) {
  alignas(32) float s[BQ * BK];
  alignas(32) float o[BQ * 256];
  float m[BQ], l[BQ];
  std::fill(o, o + nr * D, 0.0f);
  std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nr, 0.0f);
  const int64_t end = pos0 + r0 + nr;
  for (int64_t c0 = 0; c0 < end; c0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, end - c0);
    in_tiles(nr, [&](auto R, int i) { scores<decltype(R)::value>(q + (r0 + i) * D, D, kt + c0 * D, s + i * BK); });
    for (int i = 0; i < nr; ++i) {
      float* si = s + i * BK;
      const int64_t last = pos0 + r0 + i - c0;  // the row's last visible key in this block (causal)
      for (int j = (int)std::max<int64_t>(0, std::min<int64_t>(last + 1, BK)); j < BK; ++j)
        si[j] = -std::numeric_limits<float>::infinity();
      __m256 mx = _mm256_load_ps(si);
      for (int j = 8; j < BK; j += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(si + j));
      const float m_new = std::max(m[i], hmax(mx));  // finite: the first block holds key 0, visible to every row
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < BK; j += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(si + j), mv));
        _mm256_store_ps(si + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float alpha = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
      l[i] = l[i] * alpha + hsum(sum);
      m[i] = m_new;
      if (alpha != 1.0f) {
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t c = 0; c < D; c += 8) _mm256_store_ps(o + i * D + c, _mm256_mul_ps(_mm256_load_ps(o + i * D + c), av));
      }
    }
    in_tiles(nr, [&](auto R, int i) { accumulate<decltype(R)::value>(s + i * BK, nk, v + c0 * D, D, o + i * D); });
  }
  for (int i = 0; i < nr; ++i) {
    const __m256 inv = _mm256_set1_ps(1.0f / l[i]);
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(out + (r0 + i) * D + c, _mm256_mul_ps(_mm256_load_ps(o + i * D + c), inv));
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
      query_block(q + h * T * D, kt.get() + hk * hb, v + hk * kvs, out + h * T * D, lse + h * T, pos0, r0,
                  (int)std::min<int64_t>(BQ, T - r0), D);
    }
  });
#else
  (void)q, (void)k, (void)v, (void)kvs, (void)out, (void)lse, (void)Hq, (void)Hkv, (void)T, (void)D, (void)pos0;
#endif
}

}  // namespace edgellm
