// Raw-pointer entry point of the efficient_lm_head CUDA kernels. Implemented in lm_head_kernels.cu (no torch headers);
// the torch-facing launcher (lm_head_cuda.cpp) checks the arguments, allocates the workspace and calls this on the
// current stream. The ranking keys are csrc/include/peagle/lm_head.h's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace peagle {
namespace cuda {

enum class HeadDtype { kFloat, kBFloat16, kHalf };

struct LmHeadArgs {
  HeadDtype dtype;
  const void* hidden;  // [N, H] contiguous
  const void* down;    // [r, H]
  const void* up;      // [V, r]
  const void* weight;  // [V, H]
  int64_t rows, hidden_size, rank, vocab, candidates;
  int64_t chunk;  // vocabulary tokens scored per GEMM (>= candidates, <= vocab): lm_head_chunk()
  // Workspace, carved by the launcher (lm_head_workspace_bytes gives the sizes):
  void* z;            // [N, r] in the inputs' dtype
  float* scores;      // [N, chunk]
  uint64_t* keys[2];  // [N, C] each: the running top C (unsorted), double-buffered
  uint64_t* sorted;   // [N, C]
  int64_t* offsets;   // [N + 1] = n * C
  void* sort_temp;    // cub temporary storage
  size_t sort_temp_bytes;
  int64_t* ids;   // [N, C] output
  float* logits;  // [N, C] output
};

// Vocabulary tokens per scoring GEMM for N rows: about 2^25 scores per chunk, at least C, at most V.
int64_t lm_head_chunk(int64_t rows, int64_t vocab, int64_t candidates);

// Bytes of cub's temporary storage for the final per-row sort of N rows of C keys.
size_t lm_head_sort_temp_bytes(int64_t rows, int64_t candidates);

// z = round(down @ h); per chunk of the vocabulary: scores = z @ up[chunk]^T (a CUTLASS GEMM when built with CUTLASS
// and the operands allow it, else a tiled SIMT kernel), then one block per row selects the C best keys among its
// running C and the chunk's; finally the C keys of each row are sorted and rescored exactly. No host synchronisation.
// A CUTLASS GEMM that accepted its operands and then failed to run sets *gemm_failure to CUTLASS's status text (it is
// nullptr otherwise) and returns cudaErrorLaunchFailure: no silent fallback.
cudaError_t efficient_lm_head(const LmHeadArgs& args, cudaStream_t stream, const char** gemm_failure);

}  // namespace cuda
}  // namespace peagle
