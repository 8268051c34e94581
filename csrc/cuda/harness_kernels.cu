// CUDA kernel of harness_decide (see harness_kernels.h; math: peagle/harness.h). No torch headers here.
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

}  // namespace

cudaError_t harness_decide(const HarnessDecideArgs& args, cudaStream_t stream) {
  harness_decide_kernel<<<1, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
