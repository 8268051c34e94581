// COD (conditional-on-distribution) sampling math, shared by the CPU and CUDA kernels and mirrored bit for bit by
// the pure-PyTorch reference in peagle/ops/cod.py.
//
// Elements are (anchor a, depth d). Depth 0 keeps every position. A chain from anchor a may extend to depth d >= 1 when
// position a + d is inside the row, in the same (non-padding) document as a, and its label is trained (loss mask).
// Depth d keeps count(d) = floor(n_seeds * max(ratio^d, ratio_min)) elements drawn uniformly without replacement from
// the chains kept at depth d - 1 that can extend (fewer when that pool is smaller).
//
// Uniform draws without replacement are made by giving every candidate an independent 63-bit hash key of
// (seed, depth, anchor) and keeping the candidates with the smallest keys (ties broken by anchor). This is a uniform
// random subset, needs no sequential RNG state, parallelises trivially and gives the same answer on every backend.
#pragma once

#include <cstdint>

#include "peagle/common.h"

namespace peagle {
namespace cod {

// SplitMix64 finaliser: a bijective 64-bit mixer with full avalanche.
PEAGLE_HD uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t kDepthSalt = 0xD6E8FEB86659FD93ull;

// Selection key of candidate `anchor` at `depth` (depth 0 keys cap the seeds at max_anchors). 63 bits so that it is a
// non-negative int64 everywhere, including in the PyTorch reference.
PEAGLE_HD int64_t key(int64_t seed, int64_t depth, int64_t anchor) {
  const uint64_t per_depth = mix64(static_cast<uint64_t>(seed) ^ (static_cast<uint64_t>(depth) * kDepthSalt));
  return static_cast<int64_t>(mix64(per_depth ^ static_cast<uint64_t>(anchor)) >> 1);
}

// Elements kept at depth >= 1. ratio^depth by repeated multiplication in double so that every backend (and Python)
// rounds identically.
PEAGLE_HD int64_t depth_count(int64_t n_seeds, double ratio, double ratio_min, int64_t depth) {
  double keep = 1.0;
  for (int64_t i = 0; i < depth; ++i) keep *= ratio;
  if (keep < ratio_min) keep = ratio_min;
  return static_cast<int64_t>(static_cast<double>(n_seeds) * keep);
}

// Whether the chain from `anchor` can reach `depth` >= 1, given that it reached depth - 1.
PEAGLE_HD bool extends(const int64_t* document_ids, const bool* loss_mask, int64_t length, int64_t anchor,
                       int64_t depth) {
  const int64_t label = anchor + depth;
  if (label >= length) return false;
  const int64_t doc = document_ids[anchor];
  return doc >= 0 && document_ids[label] == doc && loss_mask[label];
}

// Whether element (anchor, depth) has its label index anchor + depth inside a row of `length` positions.
PEAGLE_HD bool element_in_range(int64_t anchor, int64_t depth, int64_t length) {
  return anchor >= 0 && depth >= 0 && anchor < length && depth < length - anchor;
}

// Strict weak order of candidates: smaller key first, then smaller anchor.
PEAGLE_HD bool key_less(int64_t key_a, int64_t anchor_a, int64_t key_b, int64_t anchor_b) {
  return key_a < key_b || (key_a == key_b && anchor_a < anchor_b);
}

// cod_gather_backward adds in one fixed order on both backends, so its gradients are bit-identical between CPU and
// CUDA and from run to run (no floating-point atomics, nothing that depends on thread counts). In the accumulation
// type (fp32, fp64 for float64), per column:
//   grad_hidden[t]   = ((0 + g_i1) + g_i2) + ...   over the depth-0 rows i1 < i2 < ... anchored at t (0 if none);
//   grad_mask_hidden = ((0 + S_0) + S_1) + ...     over the chunks c of kBackwardChunk consecutive rows, where
//   S_c              = ((0 + g_j1) + g_j2) + ...   over the deeper rows j1 < j2 < ... of chunk c.
// The chunks let the GPU spread the mask sum over count / kBackwardChunk blocks while the order stays fixed.
constexpr int64_t kBackwardChunk = 256;

// S_c of one column: the deeper rows of [begin, end) in row order; load(row) reads grad_feats[row, column].
template <typename Acc, typename Load>
PEAGLE_HD Acc deeper_rows_sum(const int64_t* depths, int64_t begin, int64_t end, Load load) {
  Acc sum = Acc(0);
  for (int64_t row = begin; row < end; ++row) {
    if (depths[row] != 0) sum += load(row);
  }
  return sum;
}

}  // namespace cod
}  // namespace peagle
