// Raw-pointer entry points of the harness CUDA kernels. Implemented in harness_kernels.cu (no torch headers);
// the torch-facing launcher (harness_cuda.cpp) checks shapes/dtypes/devices and calls these on the current stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {
namespace cuda {

struct HarnessDecideArgs {
  const double* scores;       // [B, F]
  const double* calibration;  // [B, 2]
  const int64_t* widths;      // [W]
  const double* draft_cost;   // [W]
  const double* verify_cost;  // [M + 1]
  double* expected;           // [B]
  double* draft_time;         // [B]
  int64_t* num_nodes;         // [B]
  int32_t* width;             // [B]
  int32_t* stop;              // [B]
  int32_t* go;                // [1]
  int64_t batch, frontier, num_widths, max_nodes;
};

// One block: a thread per request (grid-stride over requests), then a block-wide OR for go. No host synchronisation.
cudaError_t harness_decide(const HarnessDecideArgs& args, cudaStream_t stream);

struct HarnessPassArgs {
  const double* scores;       // [B, N]
  const int64_t* depth;       // [B, N]
  const int64_t* num_nodes;   // [B]
  const double* calibration;  // [B, 2]
  const double* pass_time;    // [P]
  const double* verify_cost;  // [M + 1]
  int64_t* budget;            // [B]
  int64_t* next_depth;        // [B]
  double* predicted;          // [B]
  int64_t batch, nodes, num_pass, max_nodes, drafted_depth;
};

// A thread per request (1-D grid). num_nodes is clamped to [1, N] (the value checks are the CPU's).
cudaError_t harness_pass_decide(const HarnessPassArgs& args, cudaStream_t stream);

struct HarnessObserveArgs {
  double* calibration;           // [B, 2]
  double* gamma;                 // [B]
  const double* predicted;       // [B]
  const int64_t* accepted_long;  // [R], or null when accepted is int32
  const int32_t* accepted_int;   // [R], or null when accepted is int64
  const int64_t* rows;           // [R], or null: row r = request r
  int64_t batch, num_rows;
  double decay, gamma_min, gamma_max;
};

// A thread per row (1-D grid); nothing launched for R = 0. Rows outside [0, B) are skipped (the range and distinctness
// checks are the CPU's: they would need a host synchronisation).
cudaError_t harness_observe(const HarnessObserveArgs& args, cudaStream_t stream);

struct HarnessEdgeScoresArgs {
  const double* scores;      // [B, N]
  const int64_t* parent;     // [B, N]
  const int64_t* num_nodes;  // [B]
  const double* table;       // [2, E]
  const double* prior;       // [2, E]
  const double* thresholds;  // [T]
  double* path;              // [B, N]
  double* q;                 // [B, N]
  int64_t* kind;             // [B, N]
  int64_t batch, nodes, kinds, num_thresholds;
};

// A thread per request (1-D grid). num_nodes is clamped to [1, N]; a parent outside [0, i) makes node i padding.
cudaError_t harness_edge_scores(const HarnessEdgeScoresArgs& args, cudaStream_t stream);

struct HarnessEdgeObserveArgs {
  double* table;                 // [2, E]
  double* calibration;           // [B, 2]
  const double* q;               // [R, N]
  const int64_t* kind;           // [R, N]
  const double* path;            // [R, N]
  const int64_t* parent;         // [R, N]
  const int64_t* accepted_path;  // [R, L]
  const int64_t* num_accepted;   // [R]
  const int64_t* rows;           // [R], or null: row r = request r
  int64_t batch, num_rows, nodes, path_len, kinds;
  double edge_decay, path_decay;
};

// A thread per kind of edge (its decay, then its observations in order of row and node: the CPU's sums, bit for bit)
// and a thread per row (its request's calibration sums), on a 1-D grid. Rows outside [0, B) are skipped (the range
// and distinctness checks are the CPU's).
cudaError_t harness_edge_observe(const HarnessEdgeObserveArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
