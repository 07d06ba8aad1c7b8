// The codes of Q2_K / Q3_K sub-blocks as u8 vectors (AVX2), four sub-blocks of one 128-value half at a time: shared by
// the kernels on the stored blocks (cpu_gguf.cpp decode_chunk) and on the x8 groups (cpu_gguf_x8.cpp), whose 32-byte
// vectors hold the same bits (a stored block's 32 qs / hmask bytes, or 4 bytes of each of 8 rows).
#pragma once

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__)
#include <immintrin.h>

namespace edgellm {

// Q2_K: sub-block 4n + i = bits 2i, 2i+1 of the half's qs vector q (0..3; 16-bit shifts, what crosses bytes is
// masked off).
inline void codes_q2k(__m256i q, __m256i u[4]) {
  const __m256i m2 = _mm256_set1_epi8(3);
  u[0] = _mm256_and_si256(q, m2);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m2);
  u[2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m2);
  u[3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m2);
}

// Q3_K: sub-block 4N + i = bits 2i, 2i+1 of the half's qs vector q, and bit 4N + i of the hmask vector hm as bit 2
// (0..7, offset 4; 16-bit shifts by immediates, what crosses bytes is masked off).
template <int N>
inline void codes_q3k(__m256i hm, __m256i q, __m256i u[4]) {
  const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
  const __m256i h = N == 0 ? hm : _mm256_srli_epi16(hm, 4);  // bits 4N .. 4N + 3 -> 0 .. 3
  u[0] = _mm256_or_si256(_mm256_and_si256(q, m2), _mm256_and_si256(_mm256_slli_epi16(h, 2), b2));
  u[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2), m2), _mm256_and_si256(_mm256_slli_epi16(h, 1), b2));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m2), _mm256_and_si256(h, b2));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 6), m2), _mm256_and_si256(_mm256_srli_epi16(h, 1), b2));
}

}  // namespace edgellm
#endif
