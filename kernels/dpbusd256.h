// vpdpbusd on 8 int32 lanes (acc + 4 u8 x s8 products per lane, exact) where the CPU has it in either encoding:
// AVX-512 VNNI with VL (EVEX; Intel since Cascade Lake, AMD Zen 4) or AVX-VNNI (VEX; Intel Alder Lake and later
// client chips, Sierra Forest, AMD Zen 5: the AVX2 machines with VNNI).  EDGELLM_DPBUSD256 is defined only then.
#pragma once

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EDGELLM_DPBUSD256(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#elif defined(__AVXVNNI__)
#define EDGELLM_DPBUSD256(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#endif

namespace edgellm {
// acc + the int32 sums of 4 products per lane, u8 codes against int8 x: vpdpbusd, or maddubs + madd, which equals it
// where no pair sum leaves int16 (the callers' codes and activations see to that)
inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i x) {
#ifdef EDGELLM_DPBUSD256
  return EDGELLM_DPBUSD256(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}
}  // namespace edgellm
#endif
