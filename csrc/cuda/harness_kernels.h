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

}  // namespace cuda
}  // namespace peagle
