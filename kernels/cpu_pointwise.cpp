// The prefill's row-wise ops in one pass each, fp32 (AVX2 + FMA, portable elsewhere): RMSNorm, and the gated
// activations of the MLP (SwiGLU: silu(gate) * up; GeGLU: gelu_tanh(gate) * up) from the fused gate/up product.
// torch runs these as 4-6 separate passes over [T, dim] / [T, hidden] tensors (x^2, mean, rsqrt, two products;
// silu into a new tensor, then the product), each through memory for a 512-row chunk.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>

#include "simd_math.h"

namespace edgellm {

void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

namespace {

// Rows per task: ~64k values, so a 512-row chunk splits over the threads and a single row stays on one.
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(n, 1)); }

#ifdef EDGELLM_SIMD_AVX2
// gate * sigmoid(gate) (SwiGLU) or gelu_tanh(gate) = gate * sigmoid(2 c (gate + 0.044715 gate^3)) (GeGLU), times up.
template <bool GELU>
inline __m256 gated(__m256 g, __m256 u) {
  __m256 z = g;
  if (GELU) {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  }
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), z));  // e^-z, clamped to [e^-88, e^87]
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

template <bool GELU>
inline float gated1(float g, float u) {
  const float z = GELU ? 2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g) : g;
  return g / (1.0f + std::exp(-z)) * u;
}

template <bool GELU>
void gated_rows(const float* gu, int64_t M, int64_t H, float* y) {
  parallel_run(0, M, grain_rows(H), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      const float* g = gu + m * 2 * H;
      const float* u = g + H;
      float* o = y + m * H;
      int64_t i = 0;
#ifdef EDGELLM_SIMD_AVX2
      for (; i + 8 <= H; i += 8) _mm256_storeu_ps(o + i, gated<GELU>(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
      for (; i < H; ++i) o[i] = gated1<GELU>(g[i], u[i]);
    }
  });
}

}  // namespace

// y [M, H] = act(gu[:, :H]) * gu[:, H:], gu [M, 2H] the fused gate/up product; act silu, or gelu_tanh if gelu.
void gated_mlp(const float* gu, int64_t M, int64_t H, bool gelu, float* y) {
  if (gelu) gated_rows<true>(gu, M, H, y);
  else gated_rows<false>(gu, M, H, y);
}

// y [M, N] = x / sqrt(mean(x^2) + eps) * w, per row (the sum of squares in fp32, as torch's x.square().mean()).
void rms_norm(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y) {
  parallel_run(0, M, grain_rows(N), [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      const float* xr = x + m * N;
      float* yr = y + m * N;
      int64_t i = 0;
      float ss = 0.0f;
#ifdef EDGELLM_SIMD_AVX2
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      for (; i + 16 <= N; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
        s0 = _mm256_fmadd_ps(v0, v0, s0);
        s1 = _mm256_fmadd_ps(v1, v1, s1);
      }
      ss = hsum(_mm256_add_ps(s0, s1));
#endif
      for (; i < N; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / (float)N + eps);
      i = 0;
#ifdef EDGELLM_SIMD_AVX2
      const __m256 iv = _mm256_set1_ps(inv);
      for (; i + 8 <= N; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv)));
#endif
      for (; i < N; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
  });
}

}  // namespace edgellm
