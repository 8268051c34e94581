// Raw-pointer entry points of the tree verification CUDA kernels. Implemented in tree_verify_kernels.cu, which includes
// no torch header; the torch-facing launcher (tree_verify_cuda.cpp) checks arguments, allocates and calls these on the
// current stream. Two phases: row statistics parallel over (request, node, vocabulary chunk), then one block per
// request walks its tree from those statistics; the math is csrc/include/peagle/tree.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "peagle/tree.h"

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
  // Phase 1 output, [B, n_max, verify_chunks(V)] partials per row chunk (tree_verify_partials says which are used).
  tree::ArgmaxPartial* argmax_parts;  // greedy: every target row of a node < num_nodes
  tree::SumPartial* target_parts;     // sampling: every target row of a node < num_nodes
  tree::SumPartial* draft_parts;      // stochastic sampling: the draft rows of nodes with a child
  int64_t* residual;                  // [B, V] scratch, stochastic drafts only, written where a child is rejected
  int64_t* path;                      // [B, n_max], pre-filled with -1
  int64_t* num_accepted;
  int64_t* emitted;  // [B, n_max], pre-filled with -1
  int64_t* last;
  int64_t* errors;  // [B, 3], zeroed: (code, node, detail) as in csrc/checks/tree.h
};

// Number of partials each of argmax_parts / target_parts / draft_parts holds (B * n_max * chunks).
inline int64_t tree_verify_partials(int64_t batch, int64_t n_max, int64_t vocab) {
  return batch * n_max * tree::verify_chunks(vocab);
}

cudaError_t tree_verify_greedy(const TreeVerifyArgs& args, cudaStream_t stream);
cudaError_t tree_rejection_sample(const TreeVerifyArgs& args, cudaStream_t stream);
// Deferred checks: after either kernel, copies the first failing request's error (with the value its message needs)
// into the device error record (csrc/include/peagle/deferred.h) as op `op`, unless the record already holds one.
cudaError_t tree_publish_error(const TreeVerifyArgs& args, int64_t op, int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
