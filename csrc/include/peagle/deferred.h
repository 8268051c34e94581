// The device error record of deferred checks (see csrc/checks/deferred.h and peagle/ops/errors.py). Kernels claim it
// with atomicCAS on kClaimed; the first claim wins and later errors are dropped until check_errors() resets it.
// Plain C++ (no torch): included by kernels.
#pragma once

#include <cstdint>

namespace peagle {
namespace deferred {

// Slots of the int64 record.
enum Slot : int {
  kClaimed = 0,  // 0: no error recorded; 1: the slots below hold one
  kOp = 1,       // which op recorded it (Op below)
  kCode = 2,     // the op family's error code (e.g. tree::Error)
  kRow = 3,      // request / batch row
  kIndex = 4,    // node (or other index) within the row
  kDetail = 5,   // the offending value (as the immediate check's error table holds it)
  kExtra = 6,    // a value the message also needs (a parent, or the bits of a float entry)
  kDim0 = 7,     // sizes the message names (tree ops: n_max)
  kDim1 = 8,     // (tree ops: V)
  kRecordSize = 16,
};

enum Op : int64_t {
  kNone = 0,
  kTreeVerifyGreedy = 1,
  kTreeRejectionSample = 2,
  kKvCompact = 3,  // kIndex, kDetail, kExtra: kv::Check's index, value, bound; kDim0, kDim1: block_size, max_blocks
  // GDN family (codes: GdnError): kRow, kIndex: where; kDetail: the bad value; kDim0, kDim1: the allowed range.
  kGdnTreeVerify = 4,
  kGdnCommit = 5,
  kCausalConv1dTree = 6,
  kCausalConv1dCommit = 7,
  // COD (code 1): some element (anchor, depth) is out of range for T = kDim0.
  kCodGather = 8,
  kCodGatherBackward = 9,
  // Masks (codes: MaskError).
  kMaskDense = 10,
  kMaskBlock = 11,
  kMaskSliceDense = 12,
  kMaskSliceBlock = 13,
  // Tree construction (codes: tree::BuildError): kRow, kIndex, kDetail as in the op's [B, 3] error table.
  kTreeSelect = 14,
  kTreeBuildParallel = 15,
  kTreeExpandTopk = 16,
  kGdnTreeVerifySlots = 17,  // GDN family (codes: GdnError)
};

enum GdnError : int64_t {
  kGdnParent = 1,        // parent[row, index] outside [-1, index)
  kGdnSlots = 2,         // slots[row] outside [0, pool) (commit: only requests with last_accepted >= 0)
  kGdnLastAccepted = 3,  // last_accepted value outside [-1, n)
  kGdnSharedSlot = 4,    // two active requests commit into slot kDetail
  // gdn_tree_verify_slots (start_slots out of range: kGdnSlots)
  kGdnStateSlots = 5,        // state_slots[row, index] = kDetail outside [-1, pool)
  kGdnSharedStateSlot = 6,   // slot kDetail is written more than once
  kGdnForeignStartSlot = 7,  // state_slots[row, index] = kDetail is the start slot of request kExtra
};

enum MaskError : int64_t {
  kMaskAnchors = 1,          // anchors outside [0, T = kDim0): kDetail, kExtra = their min, max
  kMaskNegativeDepth = 2,    // kDetail = min depth
  kMaskDepthOutsideRow = 3,  // depths[kIndex] = kDetail >= T = kDim0
  kMaskDocumentIds = 4,      // kDetail = min document id < -1
  kMaskSliceAnchors = 5,     // kDetail = max anchor >= the table's max_length kDim0
  kMaskSliceDepths = 6,      // kDetail = max depth >= the table's num_depths kDim0
};

// Device statistics a mask op's deferred check decides from (int64 slots, computed by ATen ops on the device).
enum MaskStat : int {
  kAnchorMin = 0,
  kAnchorMax = 1,
  kDepthMin = 2,
  kDepthMax = 3,
  kFirstOutside = 4,  // first i with depths[i] >= T, or -1
  kFirstOutsideDepth = 5,
  kDocumentMin = 6,
  kMaskStats = 7,
};

}  // namespace deferred
}  // namespace peagle
