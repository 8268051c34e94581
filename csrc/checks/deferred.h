// Deferred checks, host side: the process-wide mode switch, the backend hooks and the decoder of a device error record
// (layout: csrc/include/peagle/deferred.h). Implemented in csrc/cpu/deferred_checks.cpp, built in every build; the CUDA
// build registers its per-device records in csrc/cuda/deferred_cuda.cpp.
#pragma once

#include <cstdint>

namespace peagle {

// True while deferred checks are on (op set_deferred_checks). CPU kernels ignore it: they raise immediately.
bool deferred_checks_enabled();

// What a device backend provides: prepare() allocates the current device's record (before any graph capture);
// check() synchronises, reads and resets the records and raises the first error.
struct DeferredBackend {
  void (*prepare)();
  void (*check)();
};
void register_deferred_backend(DeferredBackend backend);

// Throws the message the op's immediate check gives for the error in `record` (read back from a device).
[[noreturn]] void raise_deferred_error(const int64_t* record);

}  // namespace peagle
