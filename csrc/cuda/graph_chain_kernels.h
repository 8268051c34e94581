// Raw-pointer entry points of the graph chain (device graph launch). Implemented in graph_chain_kernels.cu (no torch
// headers); the torch-facing ops are in graph_chain_cuda.cpp.
//
// A chain of G = D + 1 executable graphs: D depth graphs, then the finalize graph. Each depth graph ends with the
// tail kernel (captured into it), which reads the go flag and tail-launches the next depth's graph (go != 0 and a
// next depth exists) or the finalize graph. The handles live in device memory (execs[0 .. G)), written once the
// graphs are instantiated for device launch, so the tail kernel captured before instantiation finds them at run time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {
namespace cuda {

// status[kChainLaunches]: tail launches made so far (every depth -> depth and depth -> finalize transition);
// status[kChainError]: the first failure of the chain (a cudaError_t, or kChainNoHandle), 0 while none.
constexpr int kChainLaunches = 0;
constexpr int kChainError = 1;
constexpr int kChainStatusSize = 2;
// Recorded when the graph to launch has no handle yet (its chain was never instantiated, or was destroyed).
constexpr int32_t kChainNoHandle = -1;

// True when this build compiled the tail kernel with relocatable device code (device graph launch linked in); a
// build without it (PEAGLE_NO_DLINK=1) records cudaErrorNotSupported instead of launching.
bool device_graph_launch_compiled();

// Launches the one-thread tail kernel of depth `depth` (0 <= depth < num_graphs - 1) on `stream`: normally inside a
// stream capture, so that it becomes the last node of that depth's graph.
cudaError_t launch_chain_tail(const int32_t* go, const int64_t* execs, int64_t num_graphs, int64_t depth,
                              int32_t* status, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
