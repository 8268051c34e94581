// Math of efficient_lm_head shared by the CPU and CUDA kernels (see peagle/ops/lm_head.py for the contract).
//
// Ranking key. Every (score, token id) pair maps to one uint64: the high 32 bits order the float score (NaN counts as
// -inf, -0.0 as +0.0), the low 32 bits hold ~id, so a larger key is a better candidate (higher score, then lower id).
// Keys are unique per row, so "the C largest keys" is the exact top C with ties to the lower id, whatever order the
// candidates arrive in: both backends select on keys and the results cannot depend on arrival order.
#pragma once

#include <cstdint>
#include <cstring>

#include "peagle/common.h"

namespace peagle {
namespace lm_head {

// Monotone map of float32 bits to uint32: a < b (as floats, NaN as -inf, -0 == +0) <=> ordered(a) < ordered(b).
PEAGLE_HD uint32_t ordered_bits(float score) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(score);
#else
  std::memcpy(&bits, &score, sizeof(bits));
#endif
  if ((bits & 0x7fffffffu) > 0x7f800000u) bits = 0xff800000u;  // NaN -> -inf
  if (bits == 0x80000000u) bits = 0u;                          // -0.0 -> +0.0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

PEAGLE_HD uint64_t make_key(float score, int64_t id) {
  return (static_cast<uint64_t>(ordered_bits(score)) << 32) | static_cast<uint64_t>(~static_cast<uint32_t>(id));
}

PEAGLE_HD int64_t key_id(uint64_t key) { return static_cast<int64_t>(~static_cast<uint32_t>(key & 0xffffffffu)); }

// Largest vocabulary the keys hold (ids in 32 bits).
constexpr int64_t kMaxVocab = int64_t{0xffffffff};

}  // namespace lm_head
}  // namespace peagle
