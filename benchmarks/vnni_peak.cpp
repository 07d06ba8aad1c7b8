// Peak integer-dot rate of one core: vpdpbusd on 256-bit vs 512-bit registers (12 independent chains each,
// no loads).  Why the CPU kernels' multi-token row groups take 16 rows in 512-bit registers on AVX-512 VNNI
// builds: on Zen 4 a 512-bit vpdpbusd issues as fast as a 256-bit one, so it does twice the work per cycle.
//   g++ -O2 -mavx2 -mavx512f -mavx512vl -mavx512vnni benchmarks/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <class V, class Dot, class Sum>
static double rate(Dot dot, Sum sum, V u, V x, long n) {
  V a[12];
  for (auto& v : a) v = V{};
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; i += 12) {
    for (auto& v : a) v = dot(v, u, x);
    __asm__ volatile("" : "+v"(u));  // keep the loop from being folded
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int check = 0;
  for (auto& v : a) check += sum(v);
  std::printf("  (check %d)\n", check);
  return n / s;
}

int main() {
  const long n = 240000000;
  const double r256 = rate<__m256i>([](__m256i a, __m256i u, __m256i x) { return _mm256_dpbusd_epi32(a, u, x); },
                                    [](__m256i v) { return _mm256_extract_epi32(v, 0); },
                                    _mm256_set1_epi8(3), _mm256_set1_epi8(5), n);
  const double r512 = rate<__m512i>([](__m512i a, __m512i u, __m512i x) { return _mm512_dpbusd_epi32(a, u, x); },
                                    [](__m512i v) { return _mm512_reduce_add_epi32(v); },
                                    _mm512_set1_epi8(3), _mm512_set1_epi8(5), n);
  std::printf("256-bit vpdpbusd: %.2f G/s = %.1f GMAC/s per core\n", r256 / 1e9, r256 * 32 / 1e9);
  std::printf("512-bit vpdpbusd: %.2f G/s = %.1f GMAC/s per core\n", r512 / 1e9, r512 * 64 / 1e9);
}
