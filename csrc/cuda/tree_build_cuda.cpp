// Tree construction on CUDA tensors has no CUDA kernel yet: its work is tiny next to the drafter pass, so the CUDA
// registrations run the CPU kernels (csrc/cpu/tree_build_cpu.cpp) on host copies until construction moves to the GPU.
#include <torch/library.h>

#include "host_fallback.h"

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  peagle::cuda::register_host_fallback(m, "tree_select");
  peagle::cuda::register_host_fallback(m, "tree_build_parallel");
  peagle::cuda::register_host_fallback(m, "tree_expand_topk");
}
