// Deferred checks (see peagle/ops/errors.py): the process-wide mode switch, the ops set_deferred_checks and
// check_errors, and the decoder of a device error record. Built in every build; without a device backend (the CPU
// build) check_errors has nothing to read and returns.
#include "checks/deferred.h"

#include <torch/library.h>

#include <atomic>
#include <mutex>

#include "checks/cod.h"
#include "checks/gdn.h"
#include "checks/kv.h"
#include "checks/mask.h"
#include "checks/tree.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

const char* gdn_op_name(int64_t op) {
  switch (op) {
    case deferred::kGdnTreeVerify:
      return "gdn_tree_verify";
    case deferred::kGdnCommit:
      return "gdn_commit";
    case deferred::kGdnTreeVerifySlots:
      return "gdn_tree_verify_slots";
    case deferred::kCausalConv1dTree:
      return "causal_conv1d_tree";
    default:
      return "causal_conv1d_commit";
  }
}

[[noreturn]] void raise_gdn_error(const int64_t* r) {
  using namespace deferred;
  const char* op = gdn_op_name(r[kOp]);
  switch (r[kCode]) {
    case kGdnParent:
      raise_parent_value(op, r[kRow], r[kIndex], r[kDetail]);
    case kGdnSlots:
      raise_index_value(op, r[kOp] == kGdnTreeVerifySlots ? "start_slots" : "slots", r[kDim0], r[kDim1], r[kDetail],
                        r[kRow]);
    case kGdnStateSlots:
      raise_index_value(op, "state_slots", r[kDim0], r[kDim1], r[kDetail], r[kRow]);
    case kGdnSharedStateSlot:
      raise_shared_state_slot(op, r[kDetail]);
    case kGdnForeignStartSlot:
      raise_foreign_start_slot(op, r[kRow], r[kIndex], r[kDetail], r[kExtra]);
    case kGdnLastAccepted:
      raise_index_value(op, "last_accepted", r[kDim0], r[kDim1], r[kDetail], r[kRow]);
    case kGdnSharedSlot:
      raise_shared_slot(op, r[kDetail]);
    default:
      TORCH_CHECK(false, "peagle.", op, ": internal error code ", r[kCode], " in the device error record");
  }
}

[[noreturn]] void raise_mask_error(const int64_t* r) {
  using namespace deferred;
  static const char* const names[] = {"mask_dense", "mask_block", "mask_slice_dense", "mask_slice_block"};
  const char* op = names[r[kOp] - kMaskDense];
  switch (r[kCode]) {
    case kMaskAnchors:
      raise_mask_anchors(op, r[kDim0], r[kDetail], r[kExtra]);
    case kMaskNegativeDepth:
      raise_mask_negative_depth(op, r[kDetail]);
    case kMaskDepthOutsideRow:
      raise_mask_depth_outside_row(op, r[kIndex], r[kDetail], r[kDim0]);
    case kMaskDocumentIds:
      raise_document_ids(op, r[kDetail]);
    case kMaskSliceAnchors:
      raise_slice_anchors(op, r[kDim0], r[kDetail]);
    case kMaskSliceDepths:
      raise_slice_depths(op, r[kDim0], r[kDetail]);
    default:
      TORCH_CHECK(false, "peagle.", op, ": internal error code ", r[kCode], " in the device error record");
  }
}

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
    case kKvCompact: {
      KvDims d{};
      d.geometry.block_size = r[kDim0];
      d.geometry.max_blocks = r[kDim1];
      raise_kv_error(r[kRow], kv::Check{r[kCode], r[kIndex], r[kDetail], r[kExtra]}, d);
      TORCH_CHECK(false, "peagle.kv_compact: internal error: an error record without an error");
    }
    case kGdnTreeVerify:
    case kGdnTreeVerifySlots:
    case kGdnCommit:
    case kCausalConv1dTree:
    case kCausalConv1dCommit:
      raise_gdn_error(r);
    case kCodGather:
    case kCodGatherBackward:
      check_elements_in_range(r[kOp] == kCodGather ? "cod_gather" : "cod_gather_backward", false, r[kDim0]);
      TORCH_CHECK(false, "peagle.check_errors: internal error: a COD record without an error");
    case kMaskDense:
    case kMaskBlock:
    case kMaskSliceDense:
    case kMaskSliceBlock:
      raise_mask_error(r);
    case kTreeSelect:
    case kTreeBuildParallel:
    case kTreeExpandTopk: {
      static const char* const names[] = {"tree_select", "tree_build_parallel", "tree_expand_topk"};
      raise_build_error_at(names[r[kOp] - kTreeSelect], r[kCode], r[kRow], r[kIndex], r[kDetail]);
    }
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
