// Force-included (g++ -include) to build the kernels' AVX-512 VNNI paths on a CPU without AVX-512, for testing
// them: SIMDe (Debian: libsimde-dev) supplies the AVX-512 F/BW/VL/VNNI intrinsics in portable code, AVX2 stays
// native, and the __AVX512*__ macros select the kernels' 512-bit and VNNI paths. Slow, but the same integer and float
// operations in the same order, so the results are the ones the instructions give. Used by the standalone test
// harnesses (tests/test_cpu_kernels.py standalone_plan) and the extension's "avx512vnni-emulated" build
// (cpu_ext.py; `make test-avx512`).
#pragma once
#define EDGELLM_SIMDE_AVX512 1  // the kernels: no inline asm of AVX-512 instructions
#include <immintrin.h>
#define SIMDE_X86_AVX512F_NO_NATIVE
#define SIMDE_X86_AVX512BW_NO_NATIVE
#define SIMDE_X86_AVX512VL_NO_NATIVE
#define SIMDE_X86_AVX512VNNI_NO_NATIVE
#define SIMDE_X86_AVX512CD_NO_NATIVE
#define SIMDE_X86_AVX512DQ_NO_NATIVE
#define SIMDE_X86_AVX512BF16_NO_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cstdint>

// What SIMDe 0.7.4 lacks of what the kernels use, element by element (the conversions round as the instructions do
// under the default MXCSR: to nearest even; the half ones through F16C, native here).
namespace edgellm_simde {
struct F16 { alignas(64) float v[16]; };
struct I16 { alignas(64) int32_t v[16]; };
inline F16 f(simde__m512 a) { F16 r; simde_mm512_store_ps(r.v, a); return r; }
inline I16 i(simde__m512i a) { I16 r; simde_mm512_store_si512(r.v, a); return r; }
inline simde__m512 cvtepi32_ps(simde__m512i a) {
  const I16 x = i(a); F16 r;
  for (int k = 0; k < 16; ++k) r.v[k] = (float)x.v[k];
  return simde_mm512_load_ps(r.v);
}
inline simde__m512i cvtps_epi32(simde__m512 a) {
  const F16 x = f(a); I16 r;
  for (int h = 0; h < 2; ++h)
    _mm256_store_si256(reinterpret_cast<__m256i*>(r.v + 8 * h), _mm256_cvtps_epi32(_mm256_load_ps(x.v + 8 * h)));
  return simde_mm512_load_si512(r.v);
}
inline simde__m512 cvtph_ps(__m256i h) {
  F16 r;
  _mm256_store_ps(r.v, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  _mm256_store_ps(r.v + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  return simde_mm512_load_ps(r.v);
}
template <class T> inline simde__m512i widen(__m128i a) {
  alignas(16) T b[16]; I16 r;
  _mm_store_si128(reinterpret_cast<__m128i*>(b), a);
  for (int k = 0; k < 16; ++k) r.v[k] = b[k];
  return simde_mm512_load_si512(r.v);
}
inline __m128i cvtepi32_epi8(simde__m512i a) {
  const I16 x = i(a);
  alignas(16) int8_t b[16];
  for (int k = 0; k < 16; ++k) b[k] = (int8_t)x.v[k];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
}
inline void mask_storeu_ps(void* p, unsigned k, simde__m512 a) {
  const F16 x = f(a);
  for (int j = 0; j < 16; ++j)
    if (k >> j & 1) static_cast<float*>(p)[j] = x.v[j];
}
inline float reduce_max_ps(simde__m512 a) {
  const F16 x = f(a);
  float m = x.v[0];
  for (int k = 1; k < 16; ++k) m = x.v[k] > m ? x.v[k] : m;
  return m;
}
inline __m256i maskz_loadu_epi16(unsigned k, const void* p) {
  alignas(32) int16_t b[16] = {};
  for (int j = 0; j < 16; ++j)
    if (k >> j & 1) b[j] = static_cast<const int16_t*>(p)[j];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
}  // namespace edgellm_simde
#define _mm512_cvtepi32_ps(a) edgellm_simde::cvtepi32_ps(a)
#define _mm512_cvtps_epi32(a) edgellm_simde::cvtps_epi32(a)
#define _mm512_cvtph_ps(a) edgellm_simde::cvtph_ps(a)
#define _mm512_cvtepu8_epi32(a) edgellm_simde::widen<uint8_t>(a)
#define _mm512_cvtepi8_epi32(a) edgellm_simde::widen<int8_t>(a)
#define _mm512_cvtepi32_epi8(a) edgellm_simde::cvtepi32_epi8(a)
#define _mm512_mask_storeu_ps(p, k, a) edgellm_simde::mask_storeu_ps(p, k, a)
#define _mm512_reduce_max_ps(a) edgellm_simde::reduce_max_ps(a)
#define _mm256_maskz_loadu_epi16(k, p) edgellm_simde::maskz_loadu_epi16(k, p)
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)  // (defined there, not aliased)

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512VNNI__ 1
