// Large CPU outputs for the kernels that are memory-bound (the COD gather writes hundreds of MB per training step).
//
// torch's CPU allocator hands every large block back to the OS on free, so each step first-touches the same amount of
// fresh memory again: at [9.4K, 12288] bf16 the page faults cost ~6x the copy itself. empty_large() keeps a few freed
// blocks (huge-page backed where the kernel allows) and reuses them, as torch's CUDA caching allocator does on the GPU.
// copy_rows_streaming() writes with non-temporal stores, skipping the read-for-ownership of destination lines.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>

namespace peagle {
namespace cpu {

// An uninitialised CPU tensor; blocks of at least 4 MiB come from (and return to) the reuse cache.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// Returns the cached blocks to the OS; the number of bytes released.
int64_t release_large_buffers();

// memcpy of `bytes` from src to dst, with streaming stores when both are 16-byte aligned and the copy is large.
void copy_streaming(void* dst, const void* src, size_t bytes);
// Finishes the streaming stores of this thread (call once after a batch of copy_streaming).
void streaming_fence();

}  // namespace cpu
}  // namespace peagle
