// Deferred checks (see peagle/ops/errors.py): the process-wide mode switch, the ops set_deferred_checks and
// check_errors, and the decoder of a device error record. Built in every build; without a device backend (the CPU
// build) check_errors has nothing to read and returns.
#include "checks/deferred.h"

#include <torch/library.h>

#include <atomic>
#include <mutex>

#include "checks/tree.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

std::atomic<bool> g_deferred{false};
std::mutex g_backend_mutex;
DeferredBackend g_backend{nullptr, nullptr};

DeferredBackend backend() {
  const std::lock_guard<std::mutex> lock(g_backend_mutex);
  return g_backend;
}

// Returns the previous mode. Turning deferred checks on allocates the device records now, outside any graph capture.
bool set_deferred_checks(bool enabled) {
  const DeferredBackend b = backend();
  if (enabled && b.prepare != nullptr) b.prepare();
  return g_deferred.exchange(enabled);
}

void check_errors() {
  const DeferredBackend b = backend();
  if (b.check != nullptr) b.check();
}

}  // namespace

bool deferred_checks_enabled() { return g_deferred.load(); }

void register_deferred_backend(DeferredBackend b) {
  const std::lock_guard<std::mutex> lock(g_backend_mutex);
  g_backend = b;
}

void raise_deferred_error(const int64_t* r) {
  using namespace deferred;
  switch (r[kOp]) {
    case kTreeVerifyGreedy:
    case kTreeRejectionSample:
      raise_tree_error_at(r[kOp] == kTreeVerifyGreedy ? "tree_verify_greedy" : "tree_rejection_sample", r[kCode],
                          r[kRow], r[kIndex], r[kDetail], r[kExtra], r[kDim0], r[kDim1]);
    default:
      TORCH_CHECK(false, "peagle.check_errors: internal error: unknown op ", r[kOp], " in the device error record");
  }
}

}  // namespace peagle

// No tensor argument to dispatch on: one composite kernel serves every backend.
TORCH_LIBRARY_IMPL(peagle, CompositeImplicitAutograd, m) {
  m.impl("set_deferred_checks", &peagle::set_deferred_checks);
  m.impl("check_errors", &peagle::check_errors);
}
