// Raw-pointer entry point of the harness_decide CUDA kernel. Implemented in harness_kernels.cu (no torch headers);
// the torch-facing launcher (harness_cuda.cpp) checks shapes/dtypes/devices and calls this on the current stream.
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

}  // namespace cuda
}  // namespace peagle
