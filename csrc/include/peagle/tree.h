// Draft-tree math shared by the CPU and CUDA kernels of both tree families, verification (mirrored bit for bit by the
// PyTorch reference in peagle/ops/tree_verify.py) and construction (peagle/ops/tree_build.py).
//
// Draft tree per request (padded batch): n nodes, node 0 = root, parent[0] = -1, 0 <= parent[i] < i, sibling tokens
// distinct. target_probs[i] is the target distribution after node i; draft_probs[i] the distribution node i's children
// were drawn from. Children of a node are tried in increasing node index.
//
// Exactness across backends: probabilities are converted to 40-bit fixed point (int64, truncation of p * 2^40), so
// every sum and prefix sum is an integer sum whose value does not depend on the reduction order. The only
// floating-point operations left are single IEEE-rounded double multiplications/divisions of integers (no contraction),
// which give the same bits on the CPU, on the GPU and in PyTorch. Uniforms are 24-bit: u = U / 2^24 with U in [0,
// 2^24).
#pragma once

#include <cstdint>
#include <cstring>

#include "peagle/common.h"
#include "peagle/rounding.h"

namespace peagle {
namespace tree {

constexpr int kFixedBits = 40;
constexpr double kFixedOne = 1099511627776.0;  // 2^40
constexpr double kUniformScale = 16777216.0;   // 2^24
constexpr double kSumTolerance = 1e-3;         // |sum(row) - 1| allowed for probability rows

// Error codes of a request (first error found wins; see csrc/checks/tree.h for the messages).
enum Error : int32_t {
  kOk = 0,
  kNumNodes = 1,     // num_nodes outside [1, n_max]
  kRootParent = 2,   // parent[0] != -1
  kParent = 3,       // parent[i] outside [0, i)
  kToken = 4,        // token outside [0, V)
  kDuplicate = 5,    // two siblings share a token
  kTargetValue = 6,  // target row has a negative, NaN, infinite or > 1 entry (greedy: NaN)
  kTargetSum = 7,    // target row does not sum to 1 within kSumTolerance
  kDraftValue = 8,   // draft row has a negative, NaN, infinite or > 1 entry
  kDraftSum = 9,     // draft row does not sum to 1 within kSumTolerance
  kUniform = 10,     // explicit uniform outside [0, 1)
  kTargetNaN = 11,   // greedy: target row has a NaN
};

// ---------------------------------------------------------------------------------------------------------------------
// Philox 4x32-10 (Salmon et al., SC'11), counter-based: the same (seed, offset, request, index) gives the same bits
// everywhere.

PEAGLE_HD void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
  const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
  const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
  c0 = n0;
  c1 = lo1;
  c2 = n2;
  c3 = lo0;
}

// First output word of Philox4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1).
PEAGLE_HD uint32_t philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    philox_round(c0, c1, c2, c3, k0, k1);
  }
  return c0;
}

// 24-bit uniform integer U (u = U / 2^24 in [0, 1)) of draw `index` of request `request`. Index i >= 1 is the
// acceptance test of node i, index 0 the final (correction/bonus) sample.
PEAGLE_HD int64_t philox_uniform24(int64_t seed, int64_t offset, int64_t request, int64_t index) {
  const uint64_t s = static_cast<uint64_t>(seed), o = static_cast<uint64_t>(offset);
  const uint32_t word =
      philox4x32_10(static_cast<uint32_t>(index), static_cast<uint32_t>(request), static_cast<uint32_t>(o),
                    static_cast<uint32_t>(o >> 32), static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return static_cast<int64_t>(word >> 8);
}

// Explicit uniform u in [0, 1) -> U = floor(u * 2^24) (exact: multiplying by a power of two, then truncation).
PEAGLE_HD int64_t uniform24(float u) { return static_cast<int64_t>(static_cast<double>(u) * kUniformScale); }

PEAGLE_HD bool uniform_ok(float u) { return u >= 0.0f && u < 1.0f; }

// ---------------------------------------------------------------------------------------------------------------------
// Fixed point.

// Whether a probability entry is valid (finite, in [0, 1 + tolerance]); NaN fails every comparison.
PEAGLE_HD bool prob_ok(float p) { return p >= 0.0f && static_cast<double>(p) <= 1.0 + kSumTolerance; }

// p in [0, 1 + tol] -> floor(p * 2^40).
PEAGLE_HD int64_t fixed(float p) { return static_cast<int64_t>(static_cast<double>(p) * kFixedOne); }

PEAGLE_HD bool sum_ok(int64_t sum) {
  const double s = static_cast<double>(sum) / kFixedOne;
  return s >= 1.0 - kSumTolerance && s <= 1.0 + kSumTolerance;
}

using ::peagle::div_rn;  // peagle/rounding.h
using ::peagle::mul_rn;

// Acceptance test u * M * q~(x) < r(x) in fixed point: `mass` = M * q~(x) (deterministic drafts: M).
PEAGLE_HD bool accept(int64_t uniform, int64_t mass, int64_t residual) {
  return mul_rn(static_cast<double>(uniform), static_cast<double>(mass)) <
         mul_rn(static_cast<double>(residual), kUniformScale);
}

// M / Qrem, the factor that maps draft fixed-point mass onto residual mass (0 when no draft mass is left).
PEAGLE_HD double draft_scale(int64_t residual_mass, int64_t draft_mass) {
  return draft_mass > 0 ? div_rn(static_cast<double>(residual_mass), static_cast<double>(draft_mass)) : 0.0;
}

// M * q~(y) for a draft entry q(y) (fixed point).
PEAGLE_HD int64_t scaled_draft(int64_t q, double scale) {
  return static_cast<int64_t>(mul_rn(static_cast<double>(q), scale));
}

// Sampling target T = floor(u * M) in [0, M): the sample is the smallest y with prefix_sum(r)[y] > T.
PEAGLE_HD int64_t sample_target(int64_t uniform, int64_t mass) {
  return static_cast<int64_t>(
      mul_rn(mul_rn(static_cast<double>(uniform), static_cast<double>(mass)), 1.0 / kUniformScale));
}

// Greedy argmax order: larger value first, then smaller index.
PEAGLE_HD bool argmax_better(float value, int64_t index, float best_value, int64_t best_index) {
  return value > best_value || (value == best_value && index < best_index);
}

// Structure check of node i (1 <= i < n) of a request; returns kOk or the error code.
template <typename index_t>
PEAGLE_HD int32_t check_node(const index_t* parent, const index_t* tokens, int64_t i, int64_t vocab) {
  const int64_t p = static_cast<int64_t>(parent[i]);
  if (p < 0 || p >= i) return kParent;
  const int64_t t = static_cast<int64_t>(tokens[i]);
  if (t < 0 || t >= vocab) return kToken;
  for (int64_t j = 1; j < i; ++j) {
    if (static_cast<int64_t>(parent[j]) == p && static_cast<int64_t>(tokens[j]) == t) return kDuplicate;
  }
  return kOk;
}

// Detail value reported with a structure error of node i.
template <typename index_t>
PEAGLE_HD int64_t node_error_detail(int32_t code, const index_t* parent, const index_t* tokens, int64_t i) {
  return code == kParent ? static_cast<int64_t>(parent[i]) : static_cast<int64_t>(tokens[i]);
}

// Whole-request structure check (sequential form; the CUDA kernel checks nodes in parallel and keeps the first).
template <typename index_t>
PEAGLE_HD int32_t check_request(const index_t* parent, const index_t* tokens, int64_t n, int64_t n_max, int64_t vocab,
                                int64_t* node, int64_t* detail) {
  *node = 0;
  *detail = 0;
  if (n < 1 || n > n_max) {
    *detail = n;
    return kNumNodes;
  }
  if (static_cast<int64_t>(parent[0]) != -1) {
    *detail = static_cast<int64_t>(parent[0]);
    return kRootParent;
  }
  for (int64_t i = 1; i < n; ++i) {
    const int32_t code = check_node(parent, tokens, i, vocab);
    if (code != kOk) {
      *node = i;
      *detail = node_error_detail(code, parent, tokens, i);
      return code;
    }
  }
  return kOk;
}

// Records the first error of request b in the [B, 3] error table: (code, node, detail).
PEAGLE_HD void set_error(int64_t* errors, int64_t b, int32_t code, int64_t node, int64_t detail) {
  errors[3 * b] = code;
  errors[3 * b + 1] = node;
  errors[3 * b + 2] = detail;
}

// Next child of `node` after node index `after` (children are tried in increasing index), or -1.
PEAGLE_HD int64_t next_child(const int64_t* parent, int64_t n, int64_t node, int64_t after) {
  for (int64_t j = (after > node ? after : node) + 1; j < n; ++j) {
    if (parent[j] == node) return j;
  }
  return -1;
}

// First child of `node` whose token is `token` (greedy acceptance), or -1.
PEAGLE_HD int64_t child_with_token(const int64_t* parent, const int64_t* tokens, int64_t n, int64_t node,
                                   int64_t token) {
  for (int64_t j = next_child(parent, n, node, node); j >= 0; j = next_child(parent, n, node, j)) {
    if (tokens[j] == token) return j;
  }
  return -1;
}

// Whether `token` is the token of a child of `node` (siblings are distinct, so at most one is).
PEAGLE_HD bool is_child_token(const int64_t* parent, const int64_t* tokens, int64_t n, int64_t node, int64_t token) {
  return child_with_token(parent, tokens, n, node, token) >= 0;
}

// 24-bit uniform of draw `index` of request b: uniforms[b * n_max + index] when explicit uniforms are given (nullptr:
// the Philox stream). False when that explicit uniform is outside [0, 1) (the caller records kUniform).
PEAGLE_HD bool draw_uniform24(const float* uniforms, int64_t n_max, int64_t seed, int64_t offset, int64_t b,
                              int64_t index, int64_t* value) {
  if (uniforms == nullptr) {
    *value = philox_uniform24(seed, offset, b, index);
    return true;
  }
  const float u = uniforms[b * n_max + index];
  if (!uniform_ok(u)) return false;
  *value = uniform24(u);
  return true;
}

// ---------------------------------------------------------------------------------------------------------------------
// Row statistics in vocabulary chunks (the CUDA kernels' first phase: parallel over (request, node, chunk)). A chunk's
// partial is reduced in any order and the partials of a row are combined in chunk order; every reduction below is
// exact (integer sums, minima, a total order for the argmax), so the combined row equals the CPU kernels' row pass.

constexpr int64_t kVerifyChunk = 4096;   // vocabulary entries per chunk
constexpr int64_t kNoIndex = INT64_MAX;  // "no such entry" in a partial (no NaN, no bad value)
constexpr float kNegInfinity = -__builtin_huge_valf();

PEAGLE_HD int64_t verify_chunks(int64_t vocab) { return (vocab + kVerifyChunk - 1) / kVerifyChunk; }

PEAGLE_HD int64_t min_index(int64_t a, int64_t b) { return a < b ? a : b; }

// Greedy: the argmax of the non-NaN entries (argmax_better order) and the first NaN's index.
struct ArgmaxPartial {
  float value;
  int64_t index;
  int64_t first_nan;
};

PEAGLE_HD ArgmaxPartial argmax_start() { return ArgmaxPartial{kNegInfinity, kNoIndex, kNoIndex}; }

PEAGLE_HD void argmax_add(ArgmaxPartial& acc, float value, int64_t index) {
  if (value != value) {
    acc.first_nan = min_index(acc.first_nan, index);
  } else if (argmax_better(value, index, acc.value, acc.index)) {
    acc.value = value;
    acc.index = index;
  }
}

PEAGLE_HD ArgmaxPartial argmax_combine(const ArgmaxPartial& a, const ArgmaxPartial& b) {
  ArgmaxPartial r = argmax_better(b.value, b.index, a.value, a.index) ? b : a;
  r.first_nan = min_index(a.first_nan, b.first_nan);
  return r;
}

// Sampling: the fixed-point sum of the valid entries (prob_ok) and the first invalid entry's index.
struct SumPartial {
  int64_t sum;
  int64_t first_bad;
};

PEAGLE_HD SumPartial sum_start() { return SumPartial{0, kNoIndex}; }

PEAGLE_HD void sum_add(SumPartial& acc, float p, int64_t index) {
  if (prob_ok(p)) {
    acc.sum += fixed(p);
  } else {
    acc.first_bad = min_index(acc.first_bad, index);
  }
}

PEAGLE_HD SumPartial sum_combine(const SumPartial& a, const SumPartial& b) {
  return SumPartial{a.sum + b.sum, min_index(a.first_bad, b.first_bad)};
}

// The partials of one row, combined in chunk order.
PEAGLE_HD ArgmaxPartial combine_argmax_chunks(const ArgmaxPartial* parts, int64_t chunks) {
  ArgmaxPartial acc = argmax_start();
  for (int64_t c = 0; c < chunks; ++c) acc = argmax_combine(acc, parts[c]);
  return acc;
}

PEAGLE_HD SumPartial combine_sum_chunks(const SumPartial* parts, int64_t chunks) {
  SumPartial acc = sum_start();
  for (int64_t c = 0; c < chunks; ++c) acc = sum_combine(acc, parts[c]);
  return acc;
}

// Check of a probability row from its combined partial, as the CPU's row pass makes it: kOk (the sum is the row's
// mass), value_error at the first invalid entry, or sum_error with the sum. `detail` gets the error's detail.
PEAGLE_HD int32_t row_check(const SumPartial& row, int32_t value_error, int32_t sum_error, int64_t* detail) {
  if (row.first_bad != kNoIndex) {
    *detail = row.first_bad;
    return value_error;
  }
  *detail = row.sum;
  return sum_ok(row.sum) ? kOk : sum_error;
}

// ---------------------------------------------------------------------------------------------------------------------
// Tree construction. Candidates carry a path score (a product of draft probabilities, in double: child = parent * p,
// one IEEE multiplication, so every backend computes the same bits). Selection order: higher score first, then the
// smaller candidate index; since a child never scores above its parent and comes after it, the best N always include
// each kept node's parent. Scores and draft probabilities must be finite: a NaN or an infinity has no place in that
// order (inf * 0 is NaN) and would make the kernels and the reference disagree.

// Largest tree a construction op lays out: num_nodes sizes the [B, N, N] mask, so it is bounded.
constexpr int64_t kMaxTreeNodes = 4096;
constexpr float kFloatMax = 3.40282347e+38f;
constexpr double kDoubleMax = 1.7976931348623157e+308;

PEAGLE_HD bool score_before(double score_a, int64_t index_a, double score_b, int64_t index_b) {
  return score_a > score_b || (score_a == score_b && index_a < index_b);
}

// Top-k order of a draft row: larger probability first, then the smaller token id.
PEAGLE_HD bool prob_before(float p_a, int64_t token_a, float p_b, int64_t token_b) {
  return p_a > p_b || (p_a == p_b && token_a < token_b);
}

// Radix keys of the two orders above, for the CUDA kernels' block-wide top-k (a radix select needs an unsigned key
// whose order is the value order): key(a) > key(b) exactly when a ranks before b by value, key(a) == key(b) exactly
// when the values compare equal (-0 and +0 share a key), so "key, then the smaller index" is prob_before /
// score_before. prob_key is for valid draft entries (draft_entry_ok: non-negative floats, whose bits are ordered like
// their values); score_key for finite doubles (the sign-flip map of IEEE order onto unsigned order).
PEAGLE_HD uint32_t prob_key(float p) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(p);
#else
  uint32_t bits = 0;
  std::memcpy(&bits, &p, sizeof(bits));
#endif
  return bits == 0x80000000u ? 0u : bits;
}

PEAGLE_HD uint64_t score_key(double s) {
#if defined(__CUDA_ARCH__)
  uint64_t bits = static_cast<uint64_t>(__double_as_longlong(s));
#else
  uint64_t bits = 0;
  std::memcpy(&bits, &s, sizeof(bits));
#endif
  constexpr uint64_t kSign = uint64_t{1} << 63;
  if (bits == kSign) bits = 0;
  return (bits & kSign) != 0 ? ~bits : bits | kSign;
}

// Output node order of a selected tree: depth, then selection order (so siblings are tried most likely first).
PEAGLE_HD bool node_before(int64_t depth_a, double score_a, int64_t index_a, int64_t depth_b, double score_b,
                           int64_t index_b) {
  return depth_a < depth_b || (depth_a == depth_b && score_before(score_a, index_a, score_b, index_b));
}

// Error codes of a construction request (messages: raise_build_error in csrc/checks/tree.h).
enum BuildError : int32_t {
  kBuildOk = 0,
  kCandidateCount = 21,   // num_candidates outside [1, M]
  kCandidateRoot = 22,    // cand_parent[0] != -1
  kCandidateParent = 23,  // cand_parent[i] outside [0, i)
  kCandidateScore = 24,   // non-finite score, or a child scoring above its parent
  kDraftRow = 25,         // draft row entry outside [0, 1] (NaN included)
  kFrontierScore = 26,    // frontier score NaN, infinite or negative
};

// Whether a draft probability may rank a candidate: in [0, 1]. Above 1 a child could score above its parent, and the
// best N nodes by score would no longer hold every kept node's parent (NaN fails both comparisons).
PEAGLE_HD bool draft_entry_ok(float p) { return p >= 0.0f && p <= 1.0f; }

// Whether a path score may be a candidate's score: finite (NaN fails both comparisons).
PEAGLE_HD bool score_finite(double s) { return s >= -kDoubleMax && s <= kDoubleMax; }

// Whether a frontier node's path score may be expanded: a finite product of probabilities.
PEAGLE_HD bool frontier_score_ok(double s) { return s >= 0.0 && s <= kDoubleMax; }

// Value check of candidate i of one request (candidate 0 is the root; its parent is checked by check_candidates).
PEAGLE_HD int32_t check_candidate(const int64_t* parent, const double* scores, int64_t i) {
  if (!score_finite(scores[i])) return kCandidateScore;
  if (i == 0) return kBuildOk;
  if (parent[i] < 0 || parent[i] >= i) return kCandidateParent;
  if (scores[i] > scores[parent[i]]) return kCandidateScore;
  return kBuildOk;
}

// Value check of the `count` candidates of one request, in order (the CUDA kernel checks candidates in parallel and
// keeps the first failing one); `node` gets the failing candidate.
PEAGLE_HD int32_t check_candidates(const int64_t* parent, const double* scores, int64_t count, int64_t* node) {
  *node = 0;
  if (parent[0] != -1) return kCandidateRoot;
  for (int64_t i = 0; i < count; ++i) {
    *node = i;
    const int32_t code = check_candidate(parent, scores, i);
    if (code != kBuildOk) return code;
  }
  return kBuildOk;
}

// A built tree batch (the TreeSpec outputs) as raw pointers, for the CPU and CUDA kernels that fill it; the launchers
// allocate it pre-filled with the padding (make_tree_spec in checks/tree.h).
struct SpecView {
  int64_t nodes;     // N
  int64_t path_len;  // L
  int64_t words;     // ceil(N / 32)
  int64_t* tokens;
  int64_t* parent;
  int64_t* depth;
  int64_t* num_nodes;
  double* scores;
  bool* mask;
  int32_t* packed;
  int64_t* paths;
  int64_t* num_paths;
};

}  // namespace tree
}  // namespace peagle
