// Raw-pointer entry points of the tree construction CUDA kernels. Implemented in tree_build_kernels.cu, which includes
// no torch header; the torch-facing launcher (tree_build_cuda.cpp) checks arguments, allocates and calls these on the
// current stream. Two phases: a per-row top-k of the draft rows (one block per row, a block-wide radix select), then
// one block per request that applies the CPU kernel's selection rule (csrc/include/peagle/tree.h) and lays the tree
// out. Every value check writes the request's first error into a [B, 3] table, as the CPU kernels do.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "peagle/tree.h"

namespace peagle {
namespace cuda {

// One depth of a P-EAGLE Cartesian candidate tree.
struct Level {
  int64_t k;           // children per node of the previous depth (topk[d])
  int64_t size;        // nodes at this depth (topk[0] * ... * topk[d])
  int64_t start;       // candidate index of its first node
  int64_t ids_offset;  // where its top-k ids start in a request's ids row
};

// Levels travel in kernel parameters in chunks of this many.
constexpr int kLevelChunk = 16;
struct LevelChunk {
  Level levels[kLevelChunk];
  int count;
};

// Copies a chunk of the level table to levels[first ..] on the device (kernel parameters: no host copy).
cudaError_t store_levels(const LevelChunk& chunk, Level* levels, int64_t first, cudaStream_t stream);

// Top-k token ids of draft rows r in [0, rows) (row r at probs + r * vocab), grouped [groups, depths]: row r is depth
// d = r % depths of group g = r / depths. Depth d keeps levels[d].k ids, written best first (larger probability, then
// the smaller id) to ids + g * ids_stride + levels[d].ids_offset; without levels (nullptr) every row keeps k ids at
// ids + r * k. bad[r] gets the row's first entry outside [0, 1], or -1 (the ids of a bad row are not written).
struct RowTopkArgs {
  const float* probs;
  int64_t rows;
  int64_t vocab;
  int64_t depths;
  const Level* levels;
  int64_t k;
  int64_t* ids;
  int64_t ids_stride;
  int64_t* bad;
  int64_t* scratch;  // [rows, scratch_stride], scratch_stride >= every row's k
  int64_t scratch_stride;
};

cudaError_t row_topk(const RowTopkArgs& args, cudaStream_t stream);

// A built tree batch: tree::SpecView (peagle/tree.h), pre-filled by the launcher with the CPU kernel's padding.
using SpecOut = tree::SpecView;

// Per-request scratch of the selection kernels, each [B, N].
struct SelectScratch {
  int64_t* chosen;  // candidate indices of the kept nodes (selection order unknown)
  int64_t* depth;   // their depths
  double* score;    // their scores
  int64_t* order;   // output slot -> position in `chosen`
  int32_t* has_child;
};

struct BuildParallelArgs {
  const float* probs;  // [B, K, V]
  int64_t batch;
  int64_t depths;  // K
  int64_t vocab;
  const Level* levels;  // [K]
  int64_t candidates;   // M: nodes of the Cartesian tree, root included
  const int64_t* ids;   // [B, sum(topk)]
  int64_t ids_stride;
  const int64_t* bad;  // [B, K]
  SpecOut out;
  SelectScratch scratch;
  int64_t* errors;  // [B, 3], zeroed
};

cudaError_t build_parallel_select(const BuildParallelArgs& args, cudaStream_t stream);

struct TreeSelectArgs {
  const int64_t* tokens;  // [B, M]
  const int64_t* parent;
  const double* scores;
  const int64_t* count;  // [B]
  int64_t batch;
  int64_t m;
  SpecOut out;
  SelectScratch scratch;
  int64_t* errors;
};

cudaError_t tree_select(const TreeSelectArgs& args, cudaStream_t stream);

struct ExpandArgs {
  const double* frontier;  // [B, F]
  const float* probs;      // [B, F, V]
  int64_t batch;
  int64_t width;  // F
  int64_t vocab;
  int64_t topk;
  const int64_t* ids;   // [B, F, topk]
  const int64_t* bad;   // [B, F]
  double* flat_scores;  // [B, F * topk] scratch
  int64_t* tokens;      // [B, F * topk]
  int64_t* slots;
  double* scores;
  int64_t* errors;
};

cudaError_t expand_topk(const ExpandArgs& args, cudaStream_t stream);

// Deferred checks: copies the first failing request's error of a [B, 3] table into the device error record
// (csrc/include/peagle/deferred.h) as op `op`, unless the record already holds one.
cudaError_t build_publish_error(const int64_t* errors, int64_t batch, int64_t op, int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
