// An 8 x 8 transpose of 32-bit lanes (AVX2), shared by the GGUF prompt GEMM's panels (cpu_gguf.cpp) and the x8
// repacking of K-quant rows (cpu_gguf_x8.cpp): on return r[g] holds dword g of the input rows 0..7.
#pragma once

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__)
#include <immintrin.h>

namespace edgellm {

inline void transpose8x8_epi32(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i s0 = _mm256_unpacklo_epi64(t0, t2), s1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i s2 = _mm256_unpacklo_epi64(t1, t3), s3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i s4 = _mm256_unpacklo_epi64(t4, t6), s5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i s6 = _mm256_unpacklo_epi64(t5, t7), s7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(s0, s4, 0x20);
  r[1] = _mm256_permute2x128_si256(s1, s5, 0x20);
  r[2] = _mm256_permute2x128_si256(s2, s6, 0x20);
  r[3] = _mm256_permute2x128_si256(s3, s7, 0x20);
  r[4] = _mm256_permute2x128_si256(s0, s4, 0x31);
  r[5] = _mm256_permute2x128_si256(s1, s5, 0x31);
  r[6] = _mm256_permute2x128_si256(s2, s6, 0x31);
  r[7] = _mm256_permute2x128_si256(s3, s7, 0x31);
}

}  // namespace edgellm
#endif
