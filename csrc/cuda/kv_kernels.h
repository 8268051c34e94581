// Raw-pointer entry point of the kv_compact CUDA kernels. Implemented in kv_kernels.cu (no torch headers); the
// torch-facing launcher (kv_cuda.cpp) checks shapes, converts the small index tensors to int64, allocates the scratch
// and calls this on the current stream. The math is csrc/include/peagle/kv.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {
namespace cuda {

// Caches (k then v, every layer) one move launch takes as a kernel parameter; more caches take more launches.
constexpr int kMaxCachesPerLaunch = 256;

struct KvCompactArgs {
  const int64_t* block_table;   // [B, max_blocks]
  const int64_t* path;          // [B, P]
  const int64_t* num_accepted;  // [B]
  void* seq_len;                // [B] int32 or int64 with stride seq_len_stride: read by validation, then updated
  int64_t seq_len_stride;
  bool seq_len_int32;
  int64_t batch, num_blocks, block_size, max_blocks, path_len, len_max;
  int64_t row_bytes;  // kv_heads * head_dim * element size: one slot of one cache
  int64_t unit;       // copy unit in bytes (16, 8, 4, 2 or 1): divides row_bytes and every cache's address
  int64_t* plan;      // [B, 2] scratch: committed length and first move of each request
  int64_t* owner;     // [num_blocks] scratch: owner key of each claimed physical block
  int64_t* errors;    // [B * 4 + 1] zeroed: per request (code, index, value, bound) as kv::Check, then "any error"
};

// Validates every request on the device (kv::check_request, kv::claim_blocks) and records errors; unless any request
// is bad, moves the accepted rows of every cache (caches[0 .. num_caches)) and sets seq_len += num_accepted + 1.
// When any request is bad nothing is modified. No host synchronisation.
cudaError_t kv_compact(const KvCompactArgs& args, void* const* caches, int64_t num_caches, cudaStream_t stream);

// Deferred checks: after kv_compact, copies the first bad request's kv::Check into the device error record
// (csrc/include/peagle/deferred.h), unless the record already holds an error.
cudaError_t kv_publish_error(const KvCompactArgs& args, int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
