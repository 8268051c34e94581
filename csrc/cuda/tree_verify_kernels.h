// Raw-pointer entry points of the tree verification CUDA kernels. Implemented in tree_verify_kernels.cu, which includes
// no torch header; the torch-facing launcher (tree_verify_cuda.cpp) checks arguments, allocates and calls these on the
// current stream. One block per request; vocabulary-parallel reductions; the math is csrc/include/peagle/tree.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {
namespace cuda {

struct TreeVerifyArgs {
  const int64_t* parent;     // [B, n_max]
  const int64_t* tokens;     // [B, n_max]
  const int64_t* num_nodes;  // [B]
  const float* target;       // rows [n_max, V] per request, request b at target + b * target_batch_stride
  int64_t target_batch_stride;
  const float* draft;  // nullptr: deterministic drafts
  int64_t draft_batch_stride;
  const float* uniforms;  // [B, n_max] or nullptr (Philox)
  int64_t seed;
  int64_t offset;
  int64_t batch;
  int64_t n_max;
  int64_t vocab;
  int64_t* residual;  // [B, V] scratch (sampling only)
  int64_t* path;      // [B, n_max], pre-filled with -1
  int64_t* num_accepted;
  int64_t* emitted;  // [B, n_max], pre-filled with -1
  int64_t* last;
  int64_t* errors;  // [B, 3], zeroed: (code, node, detail) as in csrc/checks/tree.h
};

cudaError_t tree_verify_greedy(const TreeVerifyArgs& args, cudaStream_t stream);
cudaError_t tree_rejection_sample(const TreeVerifyArgs& args, cudaStream_t stream);
// Deferred checks: after either kernel, copies the first failing request's error (with the value its message needs)
// into the device error record (csrc/include/peagle/deferred.h) as op `op`, unless the record already holds one.
cudaError_t tree_publish_error(const TreeVerifyArgs& args, int64_t op, int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
