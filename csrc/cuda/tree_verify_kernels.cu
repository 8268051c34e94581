// CUDA kernels of the tree verification family (see tree_verify_kernels.h). One block per request walks its tree; each
// visited row is reduced by the whole block. All sums are integer (40-bit fixed point), so the results equal the CPU
// kernels' bit for bit regardless of the reduction order.
#include <cmath>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "peagle/deferred.h"
#include "peagle/tree.h"
#include "tree_verify_kernels.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kThreads = 512;

struct ArgMax {
  float value;
  int64_t index;
};

struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return tree::argmax_better(b.value, b.index, a.value, a.index) ? b : a;
  }
};

struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

using ReduceI64 = cub::BlockReduce<int64_t, kThreads>;
using ReduceArg = cub::BlockReduce<ArgMax, kThreads>;
using ScanI64 = cub::BlockScan<int64_t, kThreads>;

union TempStorage {
  typename ReduceI64::TempStorage reduce;
  typename ReduceArg::TempStorage argmax;
  typename ScanI64::TempStorage scan;
};

struct Shared {
  TempStorage temp;
  int64_t first_bad;
  int64_t value0, value1;
  int64_t cur, count, child, sample;
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

__global__ void __launch_bounds__(kThreads) greedy_kernel(TreeVerifyArgs a) {
  __shared__ Shared s;
  const int64_t b = blockIdx.x;
  if (!check_structure(a, b, s)) return;
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  int64_t* path = a.path + b * a.n_max;
  int64_t* emitted = a.emitted + b * a.n_max;
  if (threadIdx.x == 0) {
    s.cur = 0;
    s.count = 0;
    path[0] = 0;
  }
  __syncthreads();
  while (true) {
    const int64_t cur = s.cur;
    const float* row = a.target + b * a.target_batch_stride + cur * a.vocab;
    ArgMax best{-INFINITY, INT64_MAX};
    int64_t nan_at = INT64_MAX;
    for (int64_t y = threadIdx.x; y < a.vocab; y += blockDim.x) {
      const float v = row[y];
      if (v != v) {
        nan_at = nan_at < y ? nan_at : y;
      } else if (tree::argmax_better(v, y, best.value, best.index)) {
        best = ArgMax{v, y};
      }
    }
    const int64_t first_nan = ReduceI64(s.temp.reduce).Reduce(nan_at, MinOp{});
    __syncthreads();
    const ArgMax top = ReduceArg(s.temp.argmax).Reduce(best, ArgMaxOp{});
    if (threadIdx.x == 0) {
      s.code = tree::kOk;
      s.child = -1;
      if (first_nan != INT64_MAX) {
        tree::set_error(a.errors, b, tree::kTargetNaN, cur, first_nan);
        s.code = tree::kTargetNaN;
      } else {
        for (int64_t j = tree::next_child(parent, n, cur, cur); j >= 0; j = tree::next_child(parent, n, cur, j)) {
          if (tokens[j] == top.index) {
            s.child = j;
            break;
          }
        }
        if (s.child < 0) {
          emitted[s.count] = top.index;
          a.num_accepted[b] = s.count;
          a.last[b] = cur;
        } else {
          emitted[s.count] = tokens[s.child];
          path[++s.count] = s.child;
          s.cur = s.child;
        }
      }
    }
    __syncthreads();
    if (s.code != tree::kOk || s.child < 0) return;
  }
}

// Validates a probability row and returns its fixed-point sum on every thread, or -1 after recording the error.
__device__ int64_t row_sum(const TreeVerifyArgs& a, int64_t b, int64_t node, const float* row, int32_t value_error,
                           int32_t sum_error, Shared& s) {
  int64_t sum = 0, bad = INT64_MAX;
  for (int64_t y = threadIdx.x; y < a.vocab; y += blockDim.x) {
    const float p = row[y];
    if (tree::prob_ok(p)) {
      sum += tree::fixed(p);
    } else if (y < bad) {
      bad = y;
    }
  }
  const int64_t first_bad = ReduceI64(s.temp.reduce).Reduce(bad, MinOp{});
  __syncthreads();
  const int64_t total = ReduceI64(s.temp.reduce).Sum(sum);
  if (threadIdx.x == 0) {
    s.value0 = total;
    if (first_bad != INT64_MAX) {
      tree::set_error(a.errors, b, value_error, node, first_bad);
      s.value0 = -1;
    } else if (!tree::sum_ok(total)) {
      tree::set_error(a.errors, b, sum_error, node, total);
      s.value0 = -1;
    }
  }
  __syncthreads();
  const int64_t result = s.value0;
  __syncthreads();
  return result;
}

__device__ bool uniform_at(const TreeVerifyArgs& a, int64_t b, int64_t index, int64_t* value) {
  if (tree::draw_uniform24(a.uniforms, a.n_max, a.seed, a.offset, b, index, value)) return true;
  tree::set_error(a.errors, b, tree::kUniform, index, 0);
  return false;
}

__global__ void __launch_bounds__(kThreads) rejection_kernel(TreeVerifyArgs a) {
  __shared__ Shared s;
  const int64_t b = blockIdx.x;
  if (!check_structure(a, b, s)) return;
  const int64_t* parent = a.parent + b * a.n_max;
  const int64_t* tokens = a.tokens + b * a.n_max;
  const int64_t n = a.num_nodes[b];
  const int64_t V = a.vocab;
  int64_t* residual = a.residual + b * V;
  int64_t* path = a.path + b * a.n_max;
  int64_t* emitted = a.emitted + b * a.n_max;
  const bool stochastic = a.draft != nullptr;
  if (threadIdx.x == 0) {
    s.cur = 0;
    s.count = 0;
    path[0] = 0;
  }
  __syncthreads();
  while (true) {
    const int64_t cur = s.cur;
    const float* p = a.target + b * a.target_batch_stride + cur * V;
    const int64_t target_sum = row_sum(a, b, cur, p, tree::kTargetValue, tree::kTargetSum, s);
    if (target_sum < 0) return;
    const int64_t first_child = tree::next_child(parent, n, cur, cur);
    const float* q = nullptr;
    int64_t draft_mass = 0;
    if (first_child >= 0) {
      if (stochastic) {
        q = a.draft + b * a.draft_batch_stride + cur * V;
        draft_mass = row_sum(a, b, cur, q, tree::kDraftValue, tree::kDraftSum, s);
        if (draft_mass < 0) return;
      }
      for (int64_t y = threadIdx.x; y < V; y += blockDim.x) residual[y] = tree::fixed(p[y]);
      __syncthreads();
    }
    int64_t mass = target_sum;
    int64_t accepted = -1;
    for (int64_t j = first_child; j >= 0; j = tree::next_child(parent, n, cur, j)) {
      const int64_t x = tokens[j];
      double scale = 0.0;
      int64_t qx = 0;
      if (threadIdx.x == 0) {
        int64_t u = 0;
        s.code = uniform_at(a, b, j, &u) ? tree::kOk : tree::kUniform;
        if (s.code == tree::kOk) {
          int64_t lhs = mass;
          if (q != nullptr) {
            qx = tree::fixed(q[x]);
            lhs = tree::scaled_draft(qx, tree::draft_scale(mass, draft_mass));
          }
          s.accepted = tree::accept(u, lhs, residual[x]);
        }
      }
      __syncthreads();
      if (s.code != tree::kOk) return;
      if (s.accepted) {
        accepted = j;
        break;
      }
      if (q == nullptr) {
        const int64_t rx = residual[x];
        __syncthreads();
        if (threadIdx.x == 0) residual[x] = 0;
        mass -= rx;
      } else {
        // r <- max(0, r - M q~); the rejected token's residual is exactly zero.
        scale = tree::draft_scale(mass, draft_mass);
        int64_t part = 0;
        for (int64_t y = threadIdx.x; y < V; y += blockDim.x) {
          int64_t r = residual[y] - tree::scaled_draft(tree::fixed(q[y]), scale);
          r = (r < 0 || y == x) ? 0 : r;
          residual[y] = r;
          part += r;
        }
        mass = ReduceI64(s.temp.reduce).Sum(part);
        if (threadIdx.x == 0) s.value1 = mass;
        __syncthreads();
        mass = s.value1;
        draft_mass -= tree::fixed(q[x]);
      }
      __syncthreads();
    }
    if (accepted >= 0) {
      if (threadIdx.x == 0) {
        emitted[s.count] = tokens[accepted];
        path[++s.count] = accepted;
        s.cur = accepted;
      }
      __syncthreads();
      continue;
    }
    // Correction or bonus: the smallest y with prefix_sum(r)[y] > T, by per-thread contiguous chunks and a block scan.
    if (threadIdx.x == 0) {
      int64_t u = 0;
      s.code = uniform_at(a, b, 0, &u) ? tree::kOk : tree::kUniform;
      const bool from_residual = mass > 0;
      s.value0 = tree::sample_target(u, from_residual ? mass : target_sum);
      s.sample = V - 1;
    }
    __syncthreads();
    if (s.code != tree::kOk) return;
    const bool use_buffer = mass > 0 && first_child >= 0;
    const int64_t target = s.value0;
    const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
    const int64_t begin = threadIdx.x * chunk;
    const int64_t end = begin + chunk < V ? begin + chunk : V;
    int64_t part = 0;
    for (int64_t y = begin; y < end; ++y) part += use_buffer ? residual[y] : tree::fixed(p[y]);
    int64_t before = 0;
    ScanI64(s.temp.scan).ExclusiveSum(part, before);
    if (part > 0 && before <= target && target < before + part) {
      int64_t acc = before;
      for (int64_t y = begin; y < end; ++y) {
        acc += use_buffer ? residual[y] : tree::fixed(p[y]);
        if (acc > target) {
          s.sample = y;
          break;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      emitted[s.count] = s.sample;
      a.num_accepted[b] = s.count;
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

cudaError_t tree_verify_greedy(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  greedy_kernel<<<static_cast<unsigned>(args.batch), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t tree_rejection_sample(const TreeVerifyArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  rejection_kernel<<<static_cast<unsigned>(args.batch), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
