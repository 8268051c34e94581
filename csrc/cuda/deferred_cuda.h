// The per-device error records of deferred checks on CUDA (layout: csrc/include/peagle/deferred.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {

// Device pointer to `device`'s record. Allocated by set_deferred_checks(True) (or here, outside a graph capture).
int64_t* deferred_record(int device, cudaStream_t stream);

// As deferred_record, but nullptr instead of an error during a graph capture that began before the record existed
// (for reports that ops make with or without deferred checks, e.g. gdn_commit's device slot claim).
int64_t* deferred_record_if_available(int device, cudaStream_t stream);

// Immediate checks read device values on the host (a synchronisation), which a CUDA graph capture forbids: raises a
// clear error naming `op` and deferred checks, instead of the capture's own, when `stream` is capturing.
void check_not_capturing(const char* op, cudaStream_t stream);

// Records error (op, code) with kDim0 = dim0 when the device flag *bad is non-zero (deferred_kernels.cu).
cudaError_t deferred_publish_flag(const int32_t* bad, int64_t op, int64_t code, int64_t dim0, int64_t* record,
                                  cudaStream_t stream);

}  // namespace peagle
