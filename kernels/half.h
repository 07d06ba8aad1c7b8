// fp16 bits -> fp32, portable (no F16C needed): the scales of edgellm's int4/int8 groups are fp16.
#pragma once

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

}  // namespace edgellm
