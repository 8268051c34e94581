// The per-device error records of deferred checks on CUDA (layout: csrc/include/peagle/deferred.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {

// Device pointer to `device`'s record. Allocated by set_deferred_checks(True) (or here, outside a graph capture).
int64_t* deferred_record(int device, cudaStream_t stream);

}  // namespace peagle
