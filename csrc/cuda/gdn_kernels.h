// Raw-pointer entry points of the Gated DeltaNet CUDA kernels. Implemented in gdn_kernels.cu (no torch headers); the
// torch-facing launcher (gdn_cuda.cpp) validates, converts small side inputs (g, beta, indices, conv weights) to
// fp32/int64 and calls these on the current stream. q, k, v and the state pool are read (and the pool written) through
// their row strides (last dim contiguous, GdnStrides); every other tensor is contiguous.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "peagle/gdn.h"

namespace peagle {
namespace cuda {

enum class GdnType { kFloat32, kBFloat16, kFloat16 };

struct GdnShape {
  int64_t batch, nodes, qk_heads, value_heads, key_dim, value_dim, pool;
};

// Row strides in elements: q, k [B, n, H, K], v [B, n, HV, V] and the pool [P, HV, K, V] (its rows: slot, head, k).
struct GdnStrides {
  gdn::RowStrides q, k, v, pool;
};

// Every kernel guards its own indices (the launcher may skip the synchronising host checks, validate=False): a
// request whose parent array or slot is out of range gets NaN outputs (verify, conv) or is left uncommitted (commits).

// fp32 elements of the scratch buffer gdn_tree_verify needs (the q/k products shared by the value heads).
int64_t gdn_verify_scratch_floats(GdnShape shape);

// o [B, n, HV, V] (type), u [B, n, HV, V] fp32 from q, k [B, n, H, K], v [B, n, HV, V] (type), g, beta [B, n, HV]
// fp32, parent [B, n], the committed states state_pool[slots[b]] [HV, K, V] fp32 (read only). scratch: at least
// gdn_verify_scratch_floats(shape) floats (contents irrelevant). Bit-identical to the CPU kernel, unless
// tensor_cores: the state projections then run on TF32 tensor cores (fp32 accumulation; close to, not equal to, the
// exact path), where gdn_tensor_cores_available().
cudaError_t gdn_tree_verify(GdnType type, const void* q, const void* k, const void* v, const float* g,
                            const float* beta, const int64_t* parent, const float* state_pool, const int64_t* slots,
                            GdnShape shape, GdnStrides strides, float scale, bool use_qk_l2norm, bool tensor_cores,
                            float* scratch, void* o, float* u, cudaStream_t stream);

// gdn_tree_verify_slots: o [B, n, HV, V] (type) as gdn_tree_verify's, from the start states
// state_cache[start_slots[b]] ([P, HV, K, V] in state_type, strides.pool), and the state after node i of request b
// written into state_cache[state_slots[b, i]] when >= 0 (gdn::state_step from its parent's, rounded to state_type).
// scratch as for gdn_tree_verify. Slot claim, for unvalidated slots: with claims ([pool + 2] int32, zeroed by the
// caller) the written slots are claimed on the device first; a request whose written slot is contested (written twice)
// or whose start slot another request writes is skipped (NaN outputs, nothing written), and the host check's error
// (shared slot first, then the first foreign start slot) is recorded in `record` (nullable). claims == nullptr: the
// host checked the slots.
cudaError_t gdn_tree_verify_slots(GdnType type, GdnType state_type, const void* q, const void* k, const void* v,
                                  const float* g, const float* beta, const int64_t* parent, void* state_cache,
                                  const int64_t* start_slots, const int64_t* state_slots, GdnShape shape,
                                  GdnStrides strides, float scale, bool use_qk_l2norm, float* scratch, void* o,
                                  int32_t* claims, int64_t* record, cudaStream_t stream);

// True when peagle was built with the CUTLASS (CuTe) headers and the current device has TF32 tensor cores (sm_80+).
bool gdn_tensor_cores_available();

// state_pool[slots[b]] <- state after node last_accepted[b] (skipped when < 0), from k (type), g fp32, u fp32.
// Slot claim, for unvalidated slots: with claims ([pool + 1] int32, zeroed by the caller) the committing requests
// first claim their slots on the device; a slot claimed by several of them is left unchanged, and the smallest such
// slot is recorded in `record` (the deferred error record, nullable) as the shared-slot error of the host check.
// claims == nullptr: the slots are known to be distinct.
cudaError_t gdn_commit(GdnType type, const void* k, const float* g, const float* u, const int64_t* parent,
                       const int64_t* last_accepted, float* state_pool, const int64_t* slots, GdnShape shape,
                       GdnStrides strides, bool use_qk_l2norm, int32_t* claims, int64_t* record, cudaStream_t stream);

// out [B, n, C] = act(bias + sum_w weight[c, w] * window_w) over each node's (committed state, ancestors, self) window.
// x, conv_state [rows, C, W - 1] and out in `type`; request b's state is row slots[b] (slots nullable: row b; a slot
// outside [0, rows) gives NaN outputs); weight [C, W] and bias [C] (nullable) fp32; activation 1 = silu.
cudaError_t causal_conv1d_tree(GdnType type, const void* x, const int64_t* parent, const void* conv_state,
                               const int64_t* slots, int64_t rows, const float* weight, const float* bias,
                               int64_t batch, int64_t nodes, int64_t channels, int64_t width, int activation, void* out,
                               cudaStream_t stream);

// conv_state[row b] <- last W - 1 inputs of (conv_state[row b], path root..last_accepted[b]); skipped when < 0. Rows
// as for causal_conv1d_tree (a slot outside [0, rows) is skipped); claims and record as for gdn_commit (claims
// [rows + 1] int32 zeroed, nullptr when the slots are known distinct or there are none).
cudaError_t causal_conv1d_commit(GdnType type, const void* x, const int64_t* parent, const int64_t* last_accepted,
                                 void* conv_state, const int64_t* slots, int64_t rows, int32_t* claims, int64_t* record,
                                 int64_t batch, int64_t nodes, int64_t channels, int64_t width, cudaStream_t stream);

// Deferred checks: the value checks of the launcher's validation (checks/gdn.h, same order, same first error) run on
// the device by one block and record the first error as op `op` in the error record (peagle/deferred.h).
// last_accepted, slots and state_slots may be null (not checked); slots are checked only for requests with
// last_accepted >= 0 when last_accepted is given; state_slots [batch, nodes] (gdn_tree_verify_slots) in [-1, pool),
// after the slots. That slots are distinct is the slot claims' check of gdn_commit and gdn_tree_verify_slots (they run
// after this, so its errors come first, as on the host).
cudaError_t gdn_validate(const int64_t* parent, const int64_t* last_accepted, const int64_t* slots,
                         const int64_t* state_slots, int64_t batch, int64_t nodes, int64_t pool, int64_t op,
                         int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
