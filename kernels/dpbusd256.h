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
#endif
