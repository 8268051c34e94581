// Raw-pointer entry points of the COD CUDA kernels. Implemented in cod_kernels.cu, which includes no torch header;
// the torch-facing launcher (cod_cuda.cpp) allocates tensors and calls these on the current stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace peagle {
namespace cuda {

// Scratch of cod_sample for a row of `length` positions and `num_depths` depths, carved from one byte buffer.
struct CodSampleScratch {
  uint64_t* keys_in;     // [length]
  uint64_t* keys_out;    // [length]
  int64_t* anchors_in;   // [length]
  int64_t* anchors_out;  // [length]
  uint8_t* kept;         // [num_depths, length]: row 0 = seeds, row d = kept at depth d
  int64_t* scan;         // [(num_depths - 1) * length] output slot of each kept element
  int64_t* counts;       // [num_depths + 1]: counts[0] = n_seeds, counts[d] = kept at depth d, counts[K] = pool size
  void* cub_temp;
  size_t cub_temp_bytes;
};

// Bytes of one buffer that holds all of CodSampleScratch (each part 256-byte aligned).
size_t cod_sample_scratch_bytes(int64_t length, int64_t num_depths);
CodSampleScratch cod_sample_scratch(void* buffer, int64_t length, int64_t num_depths);

// Selects seeds and the kept elements of every depth into scratch.kept / scratch.counts (no host synchronisation).
// max_anchors < 0 means no cap. Returns the first CUDA error.
cudaError_t cod_sample_select(const bool* loss_mask, const int64_t* document_ids, int64_t length, int64_t num_depths,
                              double ratio, double ratio_min, int64_t max_anchors, int64_t seed,
                              const CodSampleScratch& scratch, cudaStream_t stream);

// Writes depth 0 (all positions) then the kept elements of depths 1..K-1, each sorted by anchor.
cudaError_t cod_sample_emit(const CodSampleScratch& scratch, int64_t length, int64_t num_depths, int64_t* anchors,
                            int64_t* depths, cudaStream_t stream);

// Row copy of the fused gather (dtype-agnostic: rows are `row_bytes` bytes). ids are int32 (id_bytes 4) or int64 (8).
// Sets *bad_element to 1 if any element is out of range (its outputs are then zero).
cudaError_t cod_gather(const void* input_ids, int id_bytes, const void* hidden, const void* mask_hidden,
                       const int64_t* anchors, const int64_t* depths, int64_t count, int64_t length, int64_t row_bytes,
                       int64_t mask_token_id, void* ids, void* feats, int64_t* position_ids, int64_t* label_index,
                       int32_t* bad_element, cudaStream_t stream);

enum class FloatType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// Scratch of cod_gather_backward for `count` rows of `width` columns, carved from one byte buffer.
struct CodBackwardScratch {
  int64_t* keys_in;   // [count] anchor of each depth-0 row, length for the others
  int64_t* keys_out;  // [count] the keys sorted (stable)
  int64_t* rows_in;   // [count] 0..count-1
  int64_t* rows_out;  // [count] the rows in key order
  void* chunk_sums;   // [ceil(count / cod::kBackwardChunk), width] in the accumulation type
  void* cub_temp;
  size_t cub_temp_bytes;
};

size_t cod_backward_scratch_bytes(int64_t count, int64_t width, FloatType type);
CodBackwardScratch cod_backward_scratch(void* buffer, int64_t count, int64_t width, FloatType type);

// Adjoint of the gather: grad_hidden[a] = the sum of the depth-0 rows anchored at a (zero elsewhere), grad_mask_hidden
// = the sum of the deeper rows, accumulated in fp32 (fp64 for float64) in the fixed order of peagle/cod.h, so the
// results are bit-identical to the CPU kernel's and from run to run. Outputs are written whole (no zeroing needed).
cudaError_t cod_gather_backward(FloatType type, const void* grad_feats, const int64_t* anchors, const int64_t* depths,
                                int64_t count, int64_t width, int64_t length, const CodBackwardScratch& scratch,
                                void* grad_hidden, void* grad_mask_hidden, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
