// Argument checks of the Gated DeltaNet family, shared by the CPU and CUDA launchers (same messages on both).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "checks/common.h"
#include "peagle/gdn.h"

namespace peagle {

inline void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, "peagle.", op, ": ", name,
              " must be float32, bfloat16 or float16, got ", s);
}

inline void check_dims(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected,
                       const char* layout) {
  TORCH_CHECK(t.sizes() == expected, "peagle.", op, ": ", name, " must have shape ", layout, " = ", expected, ", got ",
              shape_str(t));
}

struct GdnDims {
  int64_t batch, nodes, qk_heads, value_heads, key_dim, value_dim, pool;
};

// Shared checks of the tree layout: parent [B, n] integer on `ref`'s device, 1 <= n <= 64.
inline void check_parent(const char* op, const at::Tensor& parent, int64_t batch, int64_t nodes, const at::Tensor& ref,
                         const char* ref_name) {
  check_rank(op, "parent", parent, 2, "[B, n]");
  check_integer(op, "parent", parent);
  check_dims(op, "parent", parent, {batch, nodes}, "[B, n]");
  check_same_device(op, "parent", parent, ref, ref_name);
  TORCH_CHECK(nodes >= 1 && nodes <= gdn::kMaxNodes, "peagle.", op, ": the number of tree nodes n must be in [1, ",
              gdn::kMaxNodes, "], got ", nodes);
}

inline void check_slots(const char* op, const at::Tensor& slots, int64_t batch, const at::Tensor& ref) {
  check_rank(op, "slots", slots, 1, "[B]");
  check_integer(op, "slots", slots);
  TORCH_CHECK(slots.size(0) == batch, "peagle.", op, ": slots must be [B] with B = ", batch, ", got shape ",
              shape_str(slots));
  check_same_device(op, "slots", slots, ref, "state_pool");
}

// True when the last dim is contiguous and each outer dim steps past everything the inner dims span (nested, hence
// non-overlapping, as any slice of a contiguous tensor). Dims of size 1 have no step.
inline bool nested_rows(const at::Tensor& t) {
  int64_t span = 1;  // elements spanned by one index of the dim being checked's inner dims
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.size(d) <= 1) continue;
    if (d == t.dim() - 1 ? t.stride(d) != 1 : t.stride(d) < span) return false;
    span += (t.size(d) - 1) * t.stride(d);
  }
  return true;
}

// A cache of states [P, HV, K, V] (`name`) read and written in place: never copied, so a slice of a larger cache is
// fine as long as its elements do not overlap.
inline void check_state_layout(const char* op, const char* name, const at::Tensor& states, int64_t value_heads,
                               int64_t key_dim, int64_t value_dim) {
  TORCH_CHECK(states.size(1) == value_heads && states.size(2) == key_dim && states.size(3) == value_dim, "peagle.", op,
              ": ", name, " must be [P, HV, K, V] = [P, ", value_heads, ", ", key_dim, ", ", value_dim, "], got shape ",
              shape_str(states));
  TORCH_CHECK(nested_rows(states), "peagle.", op, ": ", name,
              " must have contiguous rows (stride 1 along V) and non-overlapping [P, HV, K] strides (it is "
              "updated in place), got strides ",
              states.strides());
}

inline void check_state_pool(const char* op, const at::Tensor& state_pool, int64_t value_heads, int64_t key_dim,
                             int64_t value_dim) {
  check_rank(op, "state_pool", state_pool, 4, "[P, HV, K, V]");
  TORCH_CHECK(state_pool.scalar_type() == at::kFloat, "peagle.", op, ": state_pool must be float32, got ",
              state_pool.scalar_type());
  check_state_layout(op, "state_pool", state_pool, value_heads, key_dim, value_dim);
}

// q/k/v as the kernels read them: any strides with a contiguous last dim (no copy); otherwise a contiguous copy.
inline at::Tensor with_contiguous_rows(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

inline gdn::RowStrides row_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// q, k, v, g, beta and parent of a tree verification (gdn_tree_verify, gdn_tree_verify_slots); pool: the state rows'
// count P.
inline GdnDims check_gdn_tree_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& parent,
                                     int64_t pool) {
  check_rank(op, "q", q, 4, "[B, n, H, K]");
  check_rank(op, "k", k, 4, "[B, n, H, K]");
  check_rank(op, "v", v, 4, "[B, n, HV, V]");
  check_rank(op, "g", g, 3, "[B, n, HV]");
  check_rank(op, "beta", beta, 3, "[B, n, HV]");
  check_float_input(op, "q", q);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "peagle.", op,
              ": q, k and v must have the same dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
              v.scalar_type());
  check_float_input(op, "g", g);
  check_float_input(op, "beta", beta);
  GdnDims d{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), pool};
  check_dims(op, "k", k, q.sizes(), "[B, n, H, K] like q");
  TORCH_CHECK(v.size(0) == d.batch && v.size(1) == d.nodes, "peagle.", op,
              ": v must be [B, n, HV, V] with B = ", d.batch, ", n = ", d.nodes, ", got shape ", shape_str(v));
  TORCH_CHECK(d.qk_heads >= 1 && d.value_heads % d.qk_heads == 0, "peagle.", op,
              ": the value heads HV must be a positive multiple of the q/k heads H, got HV = ", d.value_heads,
              ", H = ", d.qk_heads);
  TORCH_CHECK(d.key_dim >= 1 && d.value_dim >= 1, "peagle.", op, ": K and V must be >= 1, got K = ", d.key_dim,
              ", V = ", d.value_dim);
  check_dims(op, "g", g, {d.batch, d.nodes, d.value_heads}, "[B, n, HV]");
  check_dims(op, "beta", beta, {d.batch, d.nodes, d.value_heads}, "[B, n, HV]");
  check_parent(op, parent, d.batch, d.nodes, q, "q");
  check_same_device(op, "k", k, q, "q");
  check_same_device(op, "v", v, q, "q");
  check_same_device(op, "g", g, q, "q");
  check_same_device(op, "beta", beta, q, "q");
  return d;
}

inline GdnDims check_gdn_tree_verify_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& g, const at::Tensor& beta, const at::Tensor& parent,
                                          const at::Tensor& state_pool, const at::Tensor& slots) {
  const char* op = "gdn_tree_verify";
  const GdnDims d = check_gdn_tree_inputs(op, q, k, v, g, beta, parent, state_pool.dim() > 0 ? state_pool.size(0) : 0);
  check_state_pool(op, state_pool, d.value_heads, d.key_dim, d.value_dim);
  check_slots(op, slots, d.batch, state_pool);
  check_same_device(op, "state_pool", state_pool, q, "q");
  return d;
}

// gdn_tree_verify_slots: the state cache holds float32 states or states in q's dtype (vLLM's bf16 caches);
// start_slots [B], state_slots [B, n] integer on its device.
inline GdnDims check_gdn_tree_verify_slots_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& g, const at::Tensor& beta, const at::Tensor& parent,
                                                const at::Tensor& state_cache, const at::Tensor& start_slots,
                                                const at::Tensor& state_slots) {
  const char* op = "gdn_tree_verify_slots";
  check_rank(op, "state_cache", state_cache, 4, "[P, HV, K, V]");
  const GdnDims d = check_gdn_tree_inputs(op, q, k, v, g, beta, parent, state_cache.size(0));
  TORCH_CHECK(state_cache.scalar_type() == at::kFloat || state_cache.scalar_type() == q.scalar_type(), "peagle.", op,
              ": state_cache must be float32 or q's dtype (", q.scalar_type(), "), got ", state_cache.scalar_type());
  check_state_layout(op, "state_cache", state_cache, d.value_heads, d.key_dim, d.value_dim);
  check_rank(op, "start_slots", start_slots, 1, "[B]");
  check_integer(op, "start_slots", start_slots);
  TORCH_CHECK(start_slots.size(0) == d.batch, "peagle.", op, ": start_slots must be [B] with B = ", d.batch,
              ", got shape ", shape_str(start_slots));
  check_rank(op, "state_slots", state_slots, 2, "[B, n]");
  check_integer(op, "state_slots", state_slots);
  check_dims(op, "state_slots", state_slots, {d.batch, d.nodes}, "[B, n]");
  check_same_device(op, "state_cache", state_cache, q, "q");
  check_same_device(op, "start_slots", start_slots, q, "q");
  check_same_device(op, "state_slots", state_slots, q, "q");
  return d;
}

inline GdnDims check_gdn_commit_args(const at::Tensor& k, const at::Tensor& g, const at::Tensor& u,
                                     const at::Tensor& parent, const at::Tensor& last_accepted,
                                     const at::Tensor& state_pool, const at::Tensor& slots) {
  const char* op = "gdn_commit";
  check_rank(op, "k", k, 4, "[B, n, H, K]");
  check_rank(op, "g", g, 3, "[B, n, HV]");
  check_rank(op, "u", u, 4, "[B, n, HV, V]");
  check_float_input(op, "k", k);
  check_float_input(op, "g", g);
  TORCH_CHECK(u.scalar_type() == at::kFloat, "peagle.", op,
              ": u must be float32 (as returned by gdn_tree_verify), got ", u.scalar_type());
  GdnDims d{
      k.size(0), k.size(1), k.size(2), u.size(2), k.size(3), u.size(3), state_pool.dim() > 0 ? state_pool.size(0) : 0};
  TORCH_CHECK(u.size(0) == d.batch && u.size(1) == d.nodes, "peagle.", op,
              ": u must be [B, n, HV, V] with B = ", d.batch, ", n = ", d.nodes, ", got shape ", shape_str(u));
  TORCH_CHECK(d.qk_heads >= 1 && d.value_heads % d.qk_heads == 0, "peagle.", op,
              ": the value heads HV must be a positive multiple of the k heads H, got HV = ", d.value_heads,
              ", H = ", d.qk_heads);
  check_dims(op, "g", g, {d.batch, d.nodes, d.value_heads}, "[B, n, HV]");
  check_parent(op, parent, d.batch, d.nodes, k, "k");
  check_rank(op, "last_accepted", last_accepted, 1, "[B]");
  check_integer(op, "last_accepted", last_accepted);
  TORCH_CHECK(last_accepted.size(0) == d.batch, "peagle.", op, ": last_accepted must be [B] with B = ", d.batch,
              ", got shape ", shape_str(last_accepted));
  check_state_pool(op, state_pool, d.value_heads, d.key_dim, d.value_dim);
  check_slots(op, slots, d.batch, state_pool);
  check_same_device(op, "g", g, k, "k");
  check_same_device(op, "u", u, k, "k");
  check_same_device(op, "last_accepted", last_accepted, k, "k");
  check_same_device(op, "state_pool", state_pool, k, "k");
  return d;
}

struct ConvDims {
  int64_t batch, nodes, channels, width;
  int64_t rows;  // conv_state's rows: B, or the cache's P when requests name their rows (slots)
};

// Conv states: [B, C, W - 1] (row b per request), or with slots a cache [P, C, W - 1] whose row slots[b] is request
// b's (read and written in place).
inline int64_t check_conv_state(const char* op, const at::Tensor& conv_state, const c10::optional<at::Tensor>& slots,
                                const at::Tensor& x, int64_t batch, int64_t channels, int64_t width) {
  if (!slots.has_value()) {
    check_dims(op, "conv_state", conv_state, {batch, channels, width - 1}, "[B, C, W - 1]");
    return batch;
  }
  TORCH_CHECK(conv_state.size(1) == channels && conv_state.size(2) == width - 1, "peagle.", op,
              ": conv_state must be [P, C, W - 1] with C = ", channels, ", W - 1 = ", width - 1,
              " (a cache of conv states, row slots[b] for request b), got shape ", shape_str(conv_state));
  check_rank(op, "slots", *slots, 1, "[B]");
  check_integer(op, "slots", *slots);
  TORCH_CHECK(slots->size(0) == batch, "peagle.", op, ": slots must be [B] with B = ", batch, ", got shape ",
              shape_str(*slots));
  check_same_device(op, "slots", *slots, x, "x");
  return conv_state.size(0);
}

inline int check_activation(const char* op, const c10::optional<c10::string_view>& activation) {
  if (!activation.has_value()) return 0;
  const std::string a(activation->data(), activation->size());
  if (a == "silu" || a == "swish") return 1;
  TORCH_CHECK(a == "none" || a == "identity", "peagle.", op,
              ": activation must be None, 'silu', 'swish', 'none' or 'identity', got '", a, "'");
  return 0;
}

inline ConvDims check_causal_conv1d_tree_args(const at::Tensor& x, const at::Tensor& parent,
                                              const at::Tensor& conv_state, const at::Tensor& weight,
                                              const c10::optional<at::Tensor>& bias,
                                              const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_tree";
  check_rank(op, "x", x, 3, "[B, n, C]");
  check_rank(op, "weight", weight, 2, "[C, W]");
  check_rank(op, "conv_state", conv_state, 3, slots.has_value() ? "[P, C, W - 1]" : "[B, C, W - 1]");
  check_float_input(op, "x", x);
  check_float_input(op, "weight", weight);
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type(), "peagle.", op, ": conv_state must have x's dtype ",
              x.scalar_type(), ", got ", conv_state.scalar_type());
  ConvDims d{x.size(0), x.size(1), x.size(2), weight.size(1), 0};
  TORCH_CHECK(weight.size(0) == d.channels && d.width >= 2, "peagle.", op,
              ": weight must be [C, W] with C = ", d.channels, " and W >= 2, got shape ", shape_str(weight));
  TORCH_CHECK(d.width <= gdn::kMaxConvWidth, "peagle.", op, ": the conv width W must be <= ", gdn::kMaxConvWidth,
              ", got ", d.width);
  d.rows = check_conv_state(op, conv_state, slots, x, d.batch, d.channels, d.width);
  check_parent(op, parent, d.batch, d.nodes, x, "x");
  check_same_device(op, "weight", weight, x, "x");
  check_same_device(op, "conv_state", conv_state, x, "x");
  if (bias.has_value()) {
    check_rank(op, "bias", *bias, 1, "[C]");
    check_float_input(op, "bias", *bias);
    TORCH_CHECK(bias->size(0) == d.channels, "peagle.", op, ": bias must be [C] with C = ", d.channels, ", got shape ",
                shape_str(*bias));
    check_same_device(op, "bias", *bias, x, "x");
  }
  return d;
}

inline ConvDims check_causal_conv1d_commit_args(const at::Tensor& x, const at::Tensor& parent,
                                                const at::Tensor& last_accepted, const at::Tensor& conv_state,
                                                const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_commit";
  check_rank(op, "x", x, 3, "[B, n, C]");
  check_rank(op, "conv_state", conv_state, 3, slots.has_value() ? "[P, C, W - 1]" : "[B, C, W - 1]");
  check_float_input(op, "x", x);
  TORCH_CHECK(conv_state.scalar_type() == x.scalar_type(), "peagle.", op, ": conv_state must have x's dtype ",
              x.scalar_type(), ", got ", conv_state.scalar_type());
  ConvDims d{x.size(0), x.size(1), x.size(2), conv_state.size(2) + 1, 0};
  TORCH_CHECK(d.width >= 2, "peagle.", op, ": conv_state must have W - 1 >= 1 columns, got shape ",
              shape_str(conv_state));
  d.rows = check_conv_state(op, conv_state, slots, x, d.batch, d.channels, d.width);
  TORCH_CHECK(d.width <= gdn::kMaxConvWidth, "peagle.", op, ": the conv width W must be <= ", gdn::kMaxConvWidth,
              ", got ", d.width);
  TORCH_CHECK(conv_state.is_contiguous(), "peagle.", op, ": conv_state must be contiguous (it is updated in place)");
  check_parent(op, parent, d.batch, d.nodes, x, "x");
  check_rank(op, "last_accepted", last_accepted, 1, "[B]");
  check_integer(op, "last_accepted", last_accepted);
  TORCH_CHECK(last_accepted.size(0) == d.batch, "peagle.", op, ": last_accepted must be [B] with B = ", d.batch,
              ", got shape ", shape_str(last_accepted));
  check_same_device(op, "last_accepted", last_accepted, x, "x");
  check_same_device(op, "conv_state", conv_state, x, "x");
  return d;
}

// Value checks (tensor ops, so both backends give the same message; on CUDA they synchronise once). Their messages are
// shared with the deferred checks (csrc/cpu/deferred_checks.cpp).
[[noreturn]] inline void raise_parent_value(const char* op, int64_t b, int64_t i, int64_t value) {
  TORCH_CHECK(false, "peagle.", op, ": parent[", b, ", ", i, "] must be in [-1, ", i,
              ") (a parent precedes its child; -1 starts from the committed state), got ", value);
}

[[noreturn]] inline void raise_index_value(const char* op, const char* name, int64_t low, int64_t high, int64_t value,
                                           int64_t b) {
  TORCH_CHECK(false, "peagle.", op, ": ", name, " must be in [", low, ", ", high, "), got ", value, " for request ", b);
}

[[noreturn]] inline void raise_shared_slot(const char* op, int64_t slot) {
  TORCH_CHECK(false, "peagle.", op, ": slots of requests with last_accepted >= 0 must be distinct, got slot ", slot,
              " more than once");
}

inline void check_parent_values(const char* op, const at::Tensor& parent) {
  const int64_t n = parent.size(1);
  const at::Tensor p = parent.to(at::kLong);
  const at::Tensor index = at::arange(n, p.options()).unsqueeze(0);
  const at::Tensor bad = (p < -1) | (p >= index);
  if (!bad.any().item<bool>()) return;
  const at::Tensor where = bad.nonzero().to(at::kCPU);
  const int64_t b = where[0][0].item<int64_t>(), i = where[0][1].item<int64_t>();
  raise_parent_value(op, b, i, p[b][i].item<int64_t>());
}

// In-place commits from several requests into one slot would race: active requests need distinct slots.
inline void check_distinct_active_slots(const char* op, const at::Tensor& slots, const at::Tensor& last_accepted) {
  const at::Tensor active = slots.to(at::kLong).masked_select(last_accepted.to(at::kLong) >= 0);
  if (active.numel() < 2) return;
  const at::Tensor sorted = std::get<0>(active.sort());
  const at::Tensor dup = sorted.slice(0, 1).eq(sorted.slice(0, 0, -1));
  if (!dup.any().item<bool>()) return;
  raise_shared_slot(op, sorted.slice(0, 1).masked_select(dup)[0].item<int64_t>());
}

// The slots of the requests that commit (last_accepted >= 0) lie in [0, pool); the error names the request.
inline void check_active_slot_values(const char* op, const at::Tensor& slots, const at::Tensor& last_accepted,
                                     int64_t pool) {
  if (slots.numel() == 0) return;
  const at::Tensor x = slots.to(at::kLong);
  const at::Tensor bad = ((x < 0) | (x >= pool)) & (last_accepted.to(at::kLong) >= 0);
  if (!bad.any().item<bool>()) return;
  const int64_t b = bad.nonzero().to(at::kCPU)[0][0].item<int64_t>();
  raise_index_value(op, "slots", 0, pool, x[b].item<int64_t>(), b);
}

inline void check_index_values(const char* op, const char* name, const at::Tensor& index, int64_t low, int64_t high) {
  if (index.numel() == 0) return;
  const at::Tensor x = index.to(at::kLong);
  const at::Tensor bad = (x < low) | (x >= high);
  if (!bad.any().item<bool>()) return;
  const int64_t b = bad.nonzero().to(at::kCPU)[0][0].item<int64_t>();
  raise_index_value(op, name, low, high, x[b].item<int64_t>(), b);
}

[[noreturn]] inline void raise_shared_state_slot(const char* op, int64_t slot) {
  TORCH_CHECK(false, "peagle.", op,
              ": state_slots other than -1 must be distinct (each node state gets its own slot), "
              "got slot ",
              slot, " more than once");
}

[[noreturn]] inline void raise_foreign_start_slot(const char* op, int64_t b, int64_t i, int64_t slot, int64_t reader) {
  TORCH_CHECK(false, "peagle.", op, ": state_slots[", b, ", ", i, "] = ", slot, " is the start slot of request ",
              reader, " (a request may overwrite its own start state only)");
}

// gdn_tree_verify_slots' value checks, in this order: parents, start_slots in [0, P), state_slots in [-1, P), the
// written slots distinct, and none of them another request's start slot (its start state would be overwritten while
// that request reads it). Tensor ops, so both backends give the same message.
inline void check_slots_values(const char* op, const at::Tensor& parent, const at::Tensor& start_slots,
                               const at::Tensor& state_slots, int64_t pool) {
  check_parent_values(op, parent);
  check_index_values(op, "start_slots", start_slots, 0, pool);
  if (state_slots.numel() == 0) return;
  const at::Tensor dest = state_slots.to(at::kLong);
  const at::Tensor bad = (dest < -1) | (dest >= pool);
  if (bad.any().item<bool>()) {
    const at::Tensor where = bad.nonzero().to(at::kCPU);
    const int64_t b = where[0][0].item<int64_t>(), i = where[0][1].item<int64_t>();
    raise_index_value(op, "state_slots", -1, pool, dest[b][i].item<int64_t>(), b);
  }
  const at::Tensor written = dest.masked_select(dest >= 0);
  if (written.numel() == 0) return;
  const at::Tensor sorted = std::get<0>(written.sort());
  const at::Tensor dup = sorted.slice(0, 1).eq(sorted.slice(0, 0, -1));
  if (dup.any().item<bool>()) raise_shared_state_slot(op, sorted.slice(0, 1).masked_select(dup)[0].item<int64_t>());
  // The first and last request reading each slot as its start (batch: none); a written slot that another request
  // reads is an error (several requests may share a start slot as long as none of them writes it).
  const at::Tensor starts = start_slots.to(at::kLong);
  const int64_t batch = starts.size(0);
  const at::Tensor requests = at::arange(batch, dest.options());
  const at::Tensor none = at::full({pool}, batch, dest.options());
  const at::Tensor first = none.scatter_reduce(0, starts, requests, "amin");
  const at::Tensor last = at::full({pool}, -1, dest.options()).scatter_reduce(0, starts, requests, "amax");
  const at::Tensor rows = requests.unsqueeze(1).expand_as(dest);
  const at::Tensor slot = dest.clamp_min(0);
  const at::Tensor first_reader = first.index({slot}), last_reader = last.index({slot});
  const at::Tensor foreign = (dest >= 0) & (first_reader < batch) & ((first_reader != rows) | (last_reader != rows));
  if (!foreign.any().item<bool>()) return;
  const at::Tensor where = foreign.nonzero().to(at::kCPU);
  const int64_t b = where[0][0].item<int64_t>(), i = where[0][1].item<int64_t>();
  const int64_t r0 = first_reader[b][i].item<int64_t>();
  const int64_t reader = r0 != b ? r0 : last_reader[b][i].item<int64_t>();
  raise_foreign_start_slot(op, b, i, dest[b][i].item<int64_t>(), reader);
}

}  // namespace peagle
