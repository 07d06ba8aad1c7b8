// AVX2 + FMA helpers shared by the fused decode step (cpu_decode.cpp) and the prefill's causal attention
// (cpu_attention.cpp): horizontal sum / max of 8 floats, and e^x (also on 16 lanes in AVX-512 builds).
#pragma once

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__) && (defined(_MSC_VER) || defined(__FMA__))
#define EDGELLM_SIMD_AVX2 1  // the helpers are defined: cpu_attention.cpp / cpu_pointwise.cpp take their AVX2 paths
#include <immintrin.h>

namespace edgellm {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// e^x, |rel err| < 2e-7 on [-87, 88] (Cephes' polynomial); inputs below -87 give ~0. One set of constants for
// the 8- and 16-lane forms: x = n ln2 + r (ln2 in two parts), e^r = 1 + r + r^2 P(r), times 2^n.
struct ExpPoly {
  static constexpr float LO = -87.0f, HI = 88.0f, LOG2E = 1.44269504088896341f;
  static constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
  static constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

inline __m256 exp256(__m256 x) {
  using C = ExpPoly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(C::LO)), _mm256_set1_ps(C::HI));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(C::LN2_HI), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(C::LN2_LO), r);
  __m256 p = _mm256_set1_ps(C::P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::P[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// The same e^x on 16 lanes (AVX-512F): the rounding of x log2(e) to an integer is the conversion's (to nearest
// under the default MXCSR, as _mm256_round_ps's).
inline __m512 exp512(__m512 x) {
  using C = ExpPoly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(C::LO)), _mm512_set1_ps(C::HI));
  const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(C::LOG2E)));
  const __m512 fx = _mm512_cvtepi32_ps(n);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(C::LN2_HI), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(C::LN2_LO), r);
  __m512 p = _mm512_set1_ps(C::P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::P[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

}  // namespace edgellm
#endif
