// The tail kernel of the graph chain (see graph_chain_kernels.h). Device graph launch needs relocatable device code
// and cudadevrt (setup.py: -rdc=true, dlink); without them the kernel records cudaErrorNotSupported.
#include <cuda_runtime.h>

#include "graph_chain_kernels.h"

namespace peagle {
namespace cuda {
namespace {

__device__ void record_error(int32_t* status, int32_t code) {
  atomicCAS(&status[kChainError], 0, code);  // keeps the first failure
}

__global__ void chain_tail_kernel(const int32_t* go, const int64_t* execs, int64_t num_graphs, int64_t depth,
                                  int32_t* status) {
  const int64_t finalize = num_graphs - 1;
  const int64_t next = (depth + 1 < finalize && *go != 0) ? depth + 1 : finalize;
  const int64_t handle = execs[next];
  if (handle == 0) {
    record_error(status, kChainNoHandle);
    return;
  }
#if defined(__CUDACC_RDC__)
  // Tail launch: `next` starts once this graph has completed, inside the host launch's execution environment, so
  // work the host queued behind the chain's first graph waits for the whole chain.
  const cudaError_t err = cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(handle), cudaStreamGraphTailLaunch);
  if (err != cudaSuccess) {
    record_error(status, static_cast<int32_t>(err));
    return;
  }
  atomicAdd(&status[kChainLaunches], 1);
#else
  record_error(status, static_cast<int32_t>(cudaErrorNotSupported));
#endif
}

}  // namespace

bool device_graph_launch_compiled() {
#if defined(__CUDACC_RDC__)
  return true;
#else
  return false;
#endif
}

cudaError_t launch_chain_tail(const int32_t* go, const int64_t* execs, int64_t num_graphs, int64_t depth,
                              int32_t* status, cudaStream_t stream) {
  chain_tail_kernel<<<1, 1, 0, stream>>>(go, execs, num_graphs, depth, status);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
