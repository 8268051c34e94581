// CUDA kernels of the harness ops (see harness_kernels.h; math: peagle/harness.h). No torch headers here.
#include <cuda_runtime.h>

#include <cstdint>

#include "harness_kernels.h"
#include "peagle/harness.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void harness_decide_kernel(const HarnessDecideArgs a) {
  int live = 0;
  for (int64_t b = threadIdx.x; b < a.batch; b += blockDim.x) {
    if (a.stop[b] != 0) {
      a.width[b] = 0;
      continue;
    }
    const double scale = harness::calibration_scale(a.calibration[2 * b], a.calibration[2 * b + 1]);
    const harness::Decision r =
        harness::decide(a.scores + b * a.frontier, a.frontier, scale, a.widths, a.draft_cost, a.num_widths,
                        a.verify_cost, a.max_nodes, harness::Running{a.expected[b], a.draft_time[b], a.num_nodes[b]});
    a.width[b] = r.width;
    a.stop[b] = r.width == 0 ? 1 : 0;
    a.expected[b] = r.next.expected;
    a.draft_time[b] = r.next.draft_time;
    a.num_nodes[b] = r.next.nodes;
    live |= r.width != 0 ? 1 : 0;
  }
  const int any = __syncthreads_or(live);
  if (threadIdx.x == 0) a.go[0] = any != 0 ? 1 : 0;
}

__global__ void harness_pass_decide_kernel(const HarnessPassArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.batch) return;
  const int64_t n = a.num_nodes[b];
  const int64_t count = n < 1 ? 1 : (n > a.nodes ? a.nodes : n);
  const double scale = harness::calibration_scale(a.calibration[2 * b], a.calibration[2 * b + 1]);
  const harness::PassDecision r =
      harness::pass_decide(a.scores + b * a.nodes, a.depth + b * a.nodes, count, scale, a.pass_time, a.num_pass,
                           a.drafted_depth, a.verify_cost, a.max_nodes);
  a.budget[b] = r.budget;
  a.next_depth[b] = r.next_depth;
  a.predicted[b] = r.predicted;
}

constexpr int kPassThreads = 128;

__global__ void harness_observe_kernel(const HarnessObserveArgs a) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.num_rows) return;
  const int64_t b = a.rows != nullptr ? a.rows[r] : r;
  if (b < 0 || b >= a.batch) return;
  const double accepted =
      a.accepted_long != nullptr ? static_cast<double>(a.accepted_long[r]) : static_cast<double>(a.accepted_int[r]);
  const harness::Calibration c =
      harness::observe(harness::Calibration{a.calibration[2 * b], a.calibration[2 * b + 1], a.gamma[b]}, accepted,
                       a.predicted[b], a.decay, a.gamma_min, a.gamma_max);
  a.calibration[2 * b] = c.observed;
  a.calibration[2 * b + 1] = c.predicted;
  a.gamma[b] = c.gamma;
}

__global__ void harness_edge_scores_kernel(const HarnessEdgeScoresArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.batch) return;
  const int64_t n = a.num_nodes[b];
  const int64_t count = n < 1 ? 1 : (n > a.nodes ? a.nodes : n);
  const harness::EdgeTable edges{a.table,           a.table + a.kinds, a.prior,
                                 a.prior + a.kinds, a.thresholds,      a.num_thresholds};
  const int64_t o = b * a.nodes;
  harness::edge_scores(a.scores + o, a.parent + o, count, a.nodes, edges, a.path + o, a.q + o, a.kind + o);
}

__global__ void harness_edge_observe_kernel(const HarnessEdgeObserveArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double* accepted = a.table;
  double* drafted = a.table + a.kinds;
  if (t < a.kinds) {  // kind t: decay, then every row's observations of it in order
    accepted[t] = harness::mul_rn(accepted[t], a.edge_decay);
    drafted[t] = harness::mul_rn(drafted[t], a.edge_decay);
    for (int64_t r = 0; r < a.num_rows; ++r) {
      const int64_t o = r * a.nodes;
      harness::edge_observe(a.q + o, a.kind + o, a.path + o, a.parent + o, a.nodes, a.accepted_path + r * a.path_len,
                            a.path_len, a.num_accepted[r], a.kinds, t, accepted, drafted);
    }
    return;
  }
  const int64_t r = t - a.kinds;
  if (r >= a.num_rows) return;
  const int64_t b = a.rows != nullptr ? a.rows[r] : r;
  if (b < 0 || b >= a.batch) return;
  const int64_t o = r * a.nodes;
  // only = kinds: no kind matches, the table is left to the kind threads; the row's predicted drafts come back.
  const double predicted =
      harness::edge_observe(a.q + o, a.kind + o, a.path + o, a.parent + o, a.nodes, a.accepted_path + r * a.path_len,
                            a.path_len, a.num_accepted[r], a.kinds, a.kinds, accepted, drafted);
  a.calibration[2 * b] =
      harness::add_rn(harness::mul_rn(a.calibration[2 * b], a.path_decay), static_cast<double>(a.num_accepted[r]));
  a.calibration[2 * b + 1] = harness::add_rn(harness::mul_rn(a.calibration[2 * b + 1], a.path_decay), predicted);
}

}  // namespace

cudaError_t harness_edge_scores(const HarnessEdgeScoresArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const int64_t blocks = (args.batch + kPassThreads - 1) / kPassThreads;
  harness_edge_scores_kernel<<<static_cast<unsigned>(blocks), kPassThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t harness_edge_observe(const HarnessEdgeObserveArgs& args, cudaStream_t stream) {
  const int64_t threads = args.kinds + args.num_rows;
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + kPassThreads - 1) / kPassThreads;
  harness_edge_observe_kernel<<<static_cast<unsigned>(blocks), kPassThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t harness_observe(const HarnessObserveArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0) return cudaSuccess;
  const int64_t blocks = (args.num_rows + kPassThreads - 1) / kPassThreads;
  harness_observe_kernel<<<static_cast<unsigned>(blocks), kPassThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t harness_pass_decide(const HarnessPassArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const int64_t blocks = (args.batch + kPassThreads - 1) / kPassThreads;  // x grid: up to 2^31 - 1 blocks
  harness_pass_decide_kernel<<<static_cast<unsigned>(blocks), kPassThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t harness_decide(const HarnessDecideArgs& args, cudaStream_t stream) {
  harness_decide_kernel<<<1, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
