// fp16 <-> fp32, portable (no F16C needed): the scales of edgellm's int4/int8 groups are fp16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace edgellm {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float v = (float)man * 5.9604644775390625e-08f;  // subnormal: man * 2^-24
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> fp16 bits, round to nearest even (as torch's .to(float16) and numpy's astype(float16)): the KV cache's
// scales and mins, Q8_0's d.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                     // a subnormal half: units of 2^-24
    float af;
    std::memcpy(&af, &ax, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(af * 16777216.0f));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;
  return (uint16_t)(sign | h);
}

// fp32 -> bf16 bits, round to nearest even, NaN to 0x7fc0 (as torch's .to(bfloat16)): the bf16 weights of a prefill
// GEMM on CPUs that multiply bf16 natively.
inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace edgellm
