// CUDA kernels of the tree verification family (see tree_verify_kernels.h), in two phases.
//  1. row_stats_kernel, parallel over (request, node, vocabulary chunk): each block reduces one chunk of one node's row
//     with coalesced loads into a partial (greedy: the argmax and the first NaN; sampling: the fixed-point sum and the
//     first invalid entry of the target row and, for stochastic drafts, of the draft row of a node with children).
//  2. One block per request walks its tree: it combines the partials of each visited row in chunk order and decides.
//     Deterministic drafts read only the tried children's target entries and, for the final sample, the chunk sums
//     and one chunk; stochastic drafts write the residual (one [V] row per request) only where a child is rejected.
// All sums are integer (40-bit fixed point, csrc/include/peagle/tree.h), so every reduction order gives the same
// value and the results equal the CPU kernels' bit for bit.
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "peagle/deferred.h"
#include "peagle/tree.h"
#include "tree_verify_kernels.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kRowThreads = 256;                     // phase 1: kVerifyChunk / 256 = 16 entries per thread
constexpr int kWalkThreads = 256;                    // phase 2
constexpr int64_t kMaxRowBlocks = int64_t{1} << 20;  // phase 1 grid (x only); each block loops over the rest

struct ArgmaxOp {
  __device__ tree::ArgmaxPartial operator()(const tree::ArgmaxPartial& a, const tree::ArgmaxPartial& b) const {
    return tree::argmax_combine(a, b);
  }
};

struct SumOp {
  __device__ tree::SumPartial operator()(const tree::SumPartial& a, const tree::SumPartial& b) const {
    return tree::sum_combine(a, b);
  }
};

// ---------------------------------------------------------------------------------------------------------------------
// Phase 1: partial `block` = (b * n_max + node) * chunks + chunk. Nodes at or past num_nodes are never visited and get
// no partial; neither do the draft rows of leaves.

template <bool kGreedy>
__global__ void __launch_bounds__(kRowThreads) row_stats_kernel(TreeVerifyArgs a, int64_t chunks) {
  using ReduceArgmax = cub::BlockReduce<tree::ArgmaxPartial, kRowThreads>;
  using ReduceSum = cub::BlockReduce<tree::SumPartial, kRowThreads>;
  __shared__ union {
    typename ReduceArgmax::TempStorage argmax;
    typename ReduceSum::TempStorage sum;
  } temp;
  const int64_t total = a.batch * a.n_max * chunks;
  for (int64_t block = blockIdx.x; block < total; block += gridDim.x) {
    const int64_t chunk = block % chunks, row = block / chunks;
    const int64_t b = row / a.n_max, node = row % a.n_max;
    const int64_t n = a.num_nodes[b] < a.n_max ? a.num_nodes[b] : a.n_max;  // a bad count is the walk's error
    if (node >= n) continue;
    const int64_t begin = chunk * tree::kVerifyChunk;
    const int64_t end = begin + tree::kVerifyChunk < a.vocab ? begin + tree::kVerifyChunk : a.vocab;
    const float* target = a.target + b * a.target_batch_stride + node * a.vocab;
    if constexpr (kGreedy) {
      tree::ArgmaxPartial acc = tree::argmax_start();
      for (int64_t y = begin + threadIdx.x; y < end; y += kRowThreads) tree::argmax_add(acc, target[y], y);
      const tree::ArgmaxPartial part = ReduceArgmax(temp.argmax).Reduce(acc, ArgmaxOp{});
      if (threadIdx.x == 0) a.argmax_parts[block] = part;
    } else {
      tree::SumPartial acc = tree::sum_start();
      for (int64_t y = begin + threadIdx.x; y < end; y += kRowThreads) tree::sum_add(acc, target[y], y);
      const tree::SumPartial part = ReduceSum(temp.sum).Reduce(acc, SumOp{});
      if (threadIdx.x == 0) a.target_parts[block] = part;
      if (a.draft != nullptr && tree::next_child(a.parent + b * a.n_max, n, node, node) >= 0) {
        const float* draft = a.draft + b * a.draft_batch_stride + node * a.vocab;
        tree::SumPartial dacc = tree::sum_start();
        for (int64_t y = begin + threadIdx.x; y < end; y += kRowThreads) tree::sum_add(dacc, draft[y], y);
        __syncthreads();  // the temp storage is reused
        const tree::SumPartial dpart = ReduceSum(temp.sum).Reduce(dacc, SumOp{});
        if (threadIdx.x == 0) a.draft_parts[block] = dpart;
      }
    }
    __syncthreads();  // the next block of the loop reuses the temp storage
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Phase 2: one block per request. Every thread follows the same walk (its decisions come from thread 0 through shared
// memory); thread 0 writes the outputs.

using ReduceI64 = cub::BlockReduce<int64_t, kWalkThreads>;
using ScanI64 = cub::BlockScan<int64_t, kWalkThreads>;

union TempStorage {
  typename ReduceI64::TempStorage reduce;
  typename ScanI64::TempStorage scan;
};

struct Shared {
  TempStorage temp;
  int64_t first_bad;
  int64_t value0, value1;
  int64_t sample, prefix;
  int32_t code;
  bool accepted;
};

// Structure check of request b by the whole block; true (on every thread) if the request is well formed.
__device__ bool check_structure(const TreeVerifyArgs& a, int64_t b, Shared& s) {
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  if (threadIdx.x == 0) s.first_bad = a.n_max + 1;
  __syncthreads();
  const bool count_ok = n >= 1 && n <= a.n_max;
  if (count_ok && parent[0] == -1) {
    for (int64_t i = 1 + threadIdx.x; i < n; i += blockDim.x) {
      if (tree::check_node(parent, tokens, i, a.vocab) != tree::kOk) {
        atomicMin(reinterpret_cast<unsigned long long*>(&s.first_bad), static_cast<unsigned long long>(i));
      }
    }
  }
  __syncthreads();
  bool ok = true;
  if (!count_ok) {
    if (threadIdx.x == 0) tree::set_error(a.errors, b, tree::kNumNodes, 0, n);
    ok = false;
  } else if (parent[0] != -1) {
    if (threadIdx.x == 0) tree::set_error(a.errors, b, tree::kRootParent, 0, parent[0]);
    ok = false;
  } else if (s.first_bad <= a.n_max) {
    const int64_t i = s.first_bad;
    if (threadIdx.x == 0) {
      const int32_t code = tree::check_node(parent, tokens, i, a.vocab);
      tree::set_error(a.errors, b, code, i, tree::node_error_detail(code, parent, tokens, i));
    }
    ok = false;
  }
  __syncthreads();
  return ok;
}

__global__ void __launch_bounds__(kWalkThreads) greedy_walk_kernel(TreeVerifyArgs a, int64_t chunks) {
  __shared__ Shared s;
  const int64_t b = blockIdx.x;
  if (!check_structure(a, b, s) || threadIdx.x != 0) return;
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  int64_t* path = a.path + b * a.n_max;
  int64_t* emitted = a.emitted + b * a.n_max;
  int64_t cur = 0, count = 0;
  path[0] = 0;
  while (true) {
    const tree::ArgmaxPartial row = tree::combine_argmax_chunks(a.argmax_parts + (b * a.n_max + cur) * chunks, chunks);
    if (row.first_nan != tree::kNoIndex) return tree::set_error(a.errors, b, tree::kTargetNaN, cur, row.first_nan);
    const int64_t child = tree::child_with_token(parent, tokens, n, cur, row.index);
    if (child < 0) {
      emitted[count] = row.index;
      break;
    }
    emitted[count] = tokens[child];
    path[++count] = child;
    cur = child;
  }
  a.num_accepted[b] = count;
  a.last[b] = cur;
}

__device__ bool uniform_at(const TreeVerifyArgs& a, int64_t b, int64_t index, int64_t* value) {
  if (tree::draw_uniform24(a.uniforms, a.n_max, a.seed, a.offset, b, index, value)) return true;
  tree::set_error(a.errors, b, tree::kUniform, index, 0);
  return false;
}

// Block-wide check of node `cur`'s target row (and draft row) from their combined partials, in the CPU's order.
// True on every thread when both are valid; then `target_mass` / `draft_mass` hold their fixed-point sums.
__device__ bool node_rows(const TreeVerifyArgs& a, int64_t b, int64_t cur, int64_t chunks, bool with_draft,
                          int64_t* target_mass, int64_t* draft_mass, Shared& s) {
  if (threadIdx.x == 0) {
    const int64_t row = (b * a.n_max + cur) * chunks;
    int64_t detail = 0;
    const tree::SumPartial target = tree::combine_sum_chunks(a.target_parts + row, chunks);
    s.code = tree::row_check(target, tree::kTargetValue, tree::kTargetSum, &detail);
    s.value0 = target.sum;
    s.value1 = 0;
    if (s.code == tree::kOk && with_draft) {
      const tree::SumPartial draft = tree::combine_sum_chunks(a.draft_parts + row, chunks);
      s.code = tree::row_check(draft, tree::kDraftValue, tree::kDraftSum, &detail);
      s.value1 = draft.sum;
    }
    if (s.code != tree::kOk) tree::set_error(a.errors, b, s.code, cur, detail);
  }
  __syncthreads();
  const bool ok = s.code == tree::kOk;
  *target_mass = s.value0;
  *draft_mass = s.value1;
  __syncthreads();
  return ok;
}

// Block-wide rejection of token x at a stochastic node: r <- max(0, r - M q~) and r(x) = 0, with r read from the
// target row at the node's first rejection (`live` false) and from the residual row after it. Returns sum(r).
__device__ int64_t reject_pass(const float* p, const float* q, int64_t* residual, int64_t vocab, bool live, int64_t x,
                               double scale, Shared& s) {
  int64_t part = 0;
  for (int64_t y = threadIdx.x; y < vocab; y += kWalkThreads) {
    int64_t r = (live ? residual[y] : tree::fixed(p[y])) - tree::scaled_draft(tree::fixed(q[y]), scale);
    r = (r < 0 || y == x) ? 0 : r;
    residual[y] = r;
    part += r;
  }
  const int64_t total = ReduceI64(s.temp.reduce).Sum(part);
  if (threadIdx.x == 0) s.value1 = total;
  __syncthreads();
  const int64_t mass = s.value1;
  __syncthreads();
  return mass;
}

// Block-wide: the smallest y in [begin, end) with before + sum(value[begin..y]) > target, by per-thread contiguous
// ranges and a block scan. Found: s.sample = y and s.prefix = the sum before y; otherwise s is left as it was.
template <typename Value>
__device__ void find_prefix(int64_t begin, int64_t end, int64_t before, int64_t target, const Value& value, Shared& s) {
  const int64_t per = (end - begin + kWalkThreads - 1) / kWalkThreads;
  const int64_t lo = begin + threadIdx.x * per;
  const int64_t hi = lo + per < end ? lo + per : end;
  int64_t part = 0;
  for (int64_t y = lo; y < hi; ++y) part += value(y);
  int64_t mine = 0;
  ScanI64(s.temp.scan).ExclusiveSum(part, mine);
  mine += before;
  if (part > 0 && mine <= target && target < mine + part) {
    for (int64_t y = lo; y < hi; ++y) {
      const int64_t v = value(y);
      if (mine + v > target) {
        s.sample = y;
        s.prefix = mine;
        break;
      }
      mine += v;
    }
  }
  __syncthreads();
}

// Block-wide final sample from the residual row: the smallest y with prefix_sum(r)[y] > target.
__device__ int64_t sample_residual(const int64_t* residual, int64_t vocab, int64_t target, Shared& s) {
  if (threadIdx.x == 0) s.sample = vocab - 1;
  __syncthreads();
  find_prefix(0, vocab, 0, target, [&](int64_t y) { return residual[y]; }, s);
  const int64_t sample = s.sample;
  __syncthreads();
  return sample;
}

// Block-wide final sample from node `cur`'s target row, its children's tokens removed when `remove_children`
// (deterministic drafts, all children rejected): the chunk sums of phase 1 locate the chunk, one scan of that chunk
// the entry. No residual row is written.
__device__ int64_t sample_target_row(const TreeVerifyArgs& a, int64_t b, int64_t cur, int64_t chunks, const float* p,
                                     bool remove_children, int64_t target, Shared& s) {
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  const tree::SumPartial* parts = a.target_parts + (b * a.n_max + cur) * chunks;
  const auto chunk_mass = [&](int64_t c) {
    int64_t mass = parts[c].sum;
    if (!remove_children) return mass;
    for (int64_t j = tree::next_child(parent, n, cur, cur); j >= 0; j = tree::next_child(parent, n, cur, j)) {
      if (tokens[j] / tree::kVerifyChunk == c) mass -= tree::fixed(p[tokens[j]]);
    }
    return mass;
  };
  const auto entry = [&](int64_t y) {
    return remove_children && tree::is_child_token(parent, tokens, n, cur, y) ? int64_t{0} : tree::fixed(p[y]);
  };
  if (threadIdx.x == 0) {
    s.sample = -1;
    s.prefix = 0;
  }
  __syncthreads();
  find_prefix(0, chunks, 0, target, chunk_mass, s);
  const int64_t chunk = s.sample, before = s.prefix;
  __syncthreads();
  if (threadIdx.x == 0) s.sample = a.vocab - 1;
  __syncthreads();
  if (chunk >= 0) {
    const int64_t begin = chunk * tree::kVerifyChunk;
    const int64_t end = begin + tree::kVerifyChunk < a.vocab ? begin + tree::kVerifyChunk : a.vocab;
    find_prefix(begin, end, before, target, entry, s);
  }
  const int64_t sample = s.sample;
  __syncthreads();
  return sample;
}

// Block-wide: thread 0 draws uniform `index` and tests it; the outcome on every thread (false: error recorded).
__device__ bool draw_and_test(const TreeVerifyArgs& a, int64_t b, int64_t index, int64_t lhs, int64_t residual,
                              bool* accepted, Shared& s) {
  if (threadIdx.x == 0) {
    int64_t u = 0;
    s.code = uniform_at(a, b, index, &u) ? tree::kOk : tree::kUniform;
    s.accepted = s.code == tree::kOk && tree::accept(u, lhs, residual);
  }
  __syncthreads();
  const bool ok = s.code == tree::kOk;
  *accepted = s.accepted;
  __syncthreads();
  return ok;
}

__global__ void __launch_bounds__(kWalkThreads) rejection_walk_kernel(TreeVerifyArgs a, int64_t chunks) {
  __shared__ Shared s;
  const int64_t b = blockIdx.x;
  if (!check_structure(a, b, s)) return;
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  const int64_t V = a.vocab;
  int64_t* residual = a.residual == nullptr ? nullptr : a.residual + b * V;
  int64_t* path = a.path + b * a.n_max;
  int64_t* emitted = a.emitted + b * a.n_max;
  if (threadIdx.x == 0) path[0] = 0;
  int64_t cur = 0, count = 0;
  while (true) {
    const float* p = a.target + b * a.target_batch_stride + cur * V;
    const int64_t first_child = tree::next_child(parent, n, cur, cur);
    const bool with_draft = a.draft != nullptr && first_child >= 0;
    int64_t target_mass = 0, draft_mass = 0;
    if (!node_rows(a, b, cur, chunks, with_draft, &target_mass, &draft_mass, s)) return;
    const float* q = with_draft ? a.draft + b * a.draft_batch_stride + cur * V : nullptr;
    int64_t mass = target_mass;  // M = sum(r)
    bool live = false;           // stochastic: r lives in `residual` once a child was rejected
    int64_t accepted = -1;
    for (int64_t j = first_child; j >= 0; j = tree::next_child(parent, n, cur, j)) {
      const int64_t x = tokens[j];
      const int64_t rx = live ? residual[x] : tree::fixed(p[x]);  // siblings are distinct: x was not removed
      const double scale = q == nullptr ? 0.0 : tree::draft_scale(mass, draft_mass);
      const int64_t lhs = q == nullptr ? mass : tree::scaled_draft(tree::fixed(q[x]), scale);
      bool take = false;
      if (!draw_and_test(a, b, j, lhs, rx, &take, s)) return;
      if (take) {
        accepted = j;
        break;
      }
      if (q == nullptr) {
        mass -= rx;
      } else {
        mass = reject_pass(p, q, residual, V, live, x, scale, s);
        draft_mass -= tree::fixed(q[x]);
        live = true;
      }
    }
    if (accepted >= 0) {
      if (threadIdx.x == 0) {
        emitted[count] = tokens[accepted];
        path[count + 1] = accepted;
      }
      ++count;
      cur = accepted;
      continue;
    }
    // Correction (some child rejected) or bonus (leaf): sample from r / sum(r); from the target if r vanished.
    if (threadIdx.x == 0) {
      int64_t u = 0;
      s.code = uniform_at(a, b, 0, &u) ? tree::kOk : tree::kUniform;
      s.value0 = tree::sample_target(u, mass > 0 ? mass : target_mass);
    }
    __syncthreads();
    const bool ok = s.code == tree::kOk;
    const int64_t target = s.value0;
    __syncthreads();
    if (!ok) return;
    // Without a live residual row, r is the target row less the rejected children (deterministic drafts) or the
    // whole target row (a stochastic leaf has no children; r vanished: the target itself).
    const int64_t sample = mass > 0 && live ? sample_residual(residual, V, target, s)
                                            : sample_target_row(a, b, cur, chunks, p, mass > 0, target, s);
    if (threadIdx.x == 0) {
      emitted[count] = sample;
      a.num_accepted[b] = count;
      a.last[b] = cur;
    }
    return;
  }
}

// One thread: requests in order, so the recorded error is the one the immediate check raises (the first failing
// request's).
__global__ void publish_error_kernel(TreeVerifyArgs a, int64_t op, int64_t* record) {
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t code = a.errors[3 * b];
    if (code == tree::kOk) continue;
    const int64_t i = a.errors[3 * b + 1], detail = a.errors[3 * b + 2];
    int64_t extra = 0;
    if (code == tree::kDuplicate) extra = a.parent[b * a.n_max + i];
    if (code == tree::kTargetValue) extra = __float_as_uint(a.target[b * a.target_batch_stride + i * a.vocab + detail]);
    if (code == tree::kDraftValue) extra = __float_as_uint(a.draft[b * a.draft_batch_stride + i * a.vocab + detail]);
    if (code == tree::kUniform) extra = __float_as_uint(a.uniforms[b * a.n_max + i]);
    auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
    if (atomicCAS(claimed, 0ULL, 1ULL) == 0ULL) {
      record[deferred::kOp] = op;
      record[deferred::kCode] = code;
      record[deferred::kRow] = b;
      record[deferred::kIndex] = i;
      record[deferred::kDetail] = detail;
      record[deferred::kExtra] = extra;
      record[deferred::kDim0] = a.n_max;
      record[deferred::kDim1] = a.vocab;
    }
    return;
  }
}

}  // namespace

cudaError_t tree_publish_error(const TreeVerifyArgs& args, int64_t op, int64_t* record, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  publish_error_kernel<<<1, 1, 0, stream>>>(args, op, record);
  return cudaGetLastError();
}

namespace {

// Phase 1 grid: one block per (request, node, chunk) up to kMaxRowBlocks (x only: no y/z limit applies).
unsigned row_blocks(const TreeVerifyArgs& args, int64_t chunks) {
  const int64_t total = args.batch * args.n_max * chunks;
  return static_cast<unsigned>(total < kMaxRowBlocks ? total : kMaxRowBlocks);
}

}  // namespace

cudaError_t tree_verify_greedy(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const int64_t chunks = tree::verify_chunks(args.vocab);
  row_stats_kernel<true><<<row_blocks(args, chunks), kRowThreads, 0, stream>>>(args, chunks);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  greedy_walk_kernel<<<static_cast<unsigned>(args.batch), kWalkThreads, 0, stream>>>(args, chunks);
  return cudaGetLastError();
}

cudaError_t tree_rejection_sample(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const int64_t chunks = tree::verify_chunks(args.vocab);
  row_stats_kernel<false><<<row_blocks(args, chunks), kRowThreads, 0, stream>>>(args, chunks);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  rejection_walk_kernel<<<static_cast<unsigned>(args.batch), kWalkThreads, 0, stream>>>(args, chunks);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
