// What the AMX kernels share (cpu_gguf.cpp "AMX prefill", cpu_attention.cpp "AMX"): the tile configuration and bf16
// conversions.  Only in AVX-512 builds for Linux x86-64 with GCC or clang (not the SIMDe-emulated one), where
// EDGELLM_AMX is defined; functions that use tiles carry EDGELLM_AMX_TARGET (the rest of the build is not compiled
// for AMX), and run only where gguf_amx_available() (cpu_gguf.cpp) says the CPU and Linux allow it.
#pragma once

#if defined(__AVX512F__) && !defined(EDGELLM_SIMDE_AVX512) && defined(__linux__) && defined(__x86_64__) && \
    (defined(__GNUC__) || defined(__clang__))
#define EDGELLM_AMX 1
#include <immintrin.h>

#include <cstdint>

#define EDGELLM_AMX_TARGET __attribute__((target("avx512bf16,amx-tile,amx-bf16")))

namespace edgellm {
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 .. n-1 as 16 rows x 64 bytes (16 x 16 fp32 sums, or 16 rows of 32 bf16), for this thread.
EDGELLM_AMX_TARGET inline void configure(int n) {
  TileConfig cfg;
  for (int t = 0; t < n; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// 16 floats as bf16 (round to nearest even), and back.
EDGELLM_AMX_TARGET inline __m256i bf16x16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
EDGELLM_AMX_TARGET inline __m512 bf16_to_ps(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Two rows of 16 floats (k, k + 1 of 16 columns) as one B-tile row: per column [bf16(a), bf16(b)].
EDGELLM_AMX_TARGET inline __m512i bf16_pairs(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(bf16x16(a)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(b)), 16));
}

}  // namespace amx
}  // namespace edgellm
#endif
