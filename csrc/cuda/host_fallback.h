// CUDA registrations of ops that have no CUDA kernel yet: they copy the inputs to the host, run the op's CPU kernel
// and copy the outputs back to the inputs' device. Register such an op only through register_host_fallback: it also
// records the op, so torch.ops.peagle.cuda_host_fallbacks() lists every host fallback and scripts/check_cuda_build.py
// reports them as host fallbacks, never as CUDA kernels.
#pragma once

#include <torch/library.h>

#include <string>
#include <vector>

namespace peagle {
namespace cuda {

// Registers `op` in a TORCH_LIBRARY_IMPL(peagle, CUDA, m) block as a host fallback. Tensor (and Tensor[]) arguments
// must share one device (checked with the CPU kernels' message); every other check is the CPU kernel's.
void register_host_fallback(torch::Library& m, const char* op);

// Names of the ops registered through register_host_fallback (without the "peagle::" namespace).
std::vector<std::string> host_fallbacks();

}  // namespace cuda
}  // namespace peagle
