// Torch-facing launcher of the Gated DeltaNet CUDA kernels: checks (shared with the CPU backend), dtype/index
// normalisation, allocation and the current stream; the kernels live in gdn_kernels.cu (no torch headers there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "checks/gdn.h"
#include "deferred_cuda.h"
#include "gdn_kernels.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

cuda::GdnType gdn_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cuda::GdnType::kFloat32;
    case at::kBFloat16:
      return cuda::GdnType::kBFloat16;
    default:
      return cuda::GdnType::kFloat16;  // the checks admit float32, bfloat16 and float16 only
  }
}

// Deferred checks: the value checks of validate=True run on the device (no host synchronisation). Returns true when
// they did; false means the caller `name` runs the immediate (host) checks (not while a graph is captured).
bool validate_on_device(const char* name, int64_t op, const at::Tensor& parent, const at::Tensor& last_accepted,
                        const at::Tensor& slots, int64_t pool, const at::Tensor& state_slots = at::Tensor()) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (!deferred_checks_enabled()) {
    check_not_capturing(name, stream);
    return false;
  }
  const at::Tensor p = parent.to(at::kLong).contiguous();
  const at::Tensor a = last_accepted.defined() ? last_accepted.to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor s = slots.defined() ? slots.to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor d = state_slots.defined() ? state_slots.to(at::kLong).contiguous() : at::Tensor();
  check_cuda(
      cuda::gdn_validate(p.data_ptr<int64_t>(), a.defined() ? a.data_ptr<int64_t>() : nullptr,
                         s.defined() ? s.data_ptr<int64_t>() : nullptr, d.defined() ? d.data_ptr<int64_t>() : nullptr,
                         p.size(0), p.size(1), pool, op, deferred_record(parent.get_device(), stream), stream),
      "check_errors");
  return true;
}

cuda::GdnShape gdn_shape(const GdnDims& d) {
  return {d.batch, d.nodes, d.qk_heads, d.value_heads, d.key_dim, d.value_dim, d.pool};
}

std::tuple<at::Tensor, at::Tensor> gdn_tree_verify_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& g, const at::Tensor& beta,
                                                        const at::Tensor& parent, const at::Tensor& state_pool,
                                                        const at::Tensor& slots, c10::optional<double> scale,
                                                        bool use_qk_l2norm, bool validate, bool tensor_cores) {
  const char* op = "gdn_tree_verify";
  const GdnDims d = check_gdn_tree_verify_args(q, k, v, g, beta, parent, state_pool, slots);
  const c10::cuda::CUDAGuard guard(q.device());
  if (validate && !validate_on_device(op, deferred::kGdnTreeVerify, parent, at::Tensor(), slots, d.pool)) {
    check_parent_values(op, parent);
    check_index_values(op, "slots", slots, 0, d.pool);
  }
  const float q_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d.key_dim))));
  const at::Tensor qc = with_contiguous_rows(q), kc = with_contiguous_rows(k), vc = with_contiguous_rows(v);
  const cuda::GdnStrides strides{row_strides(qc), row_strides(kc), row_strides(vc), row_strides(state_pool)};
  const at::Tensor gc = g.to(at::kFloat).contiguous(), bc = beta.to(at::kFloat).contiguous();
  const at::Tensor pc = parent.to(at::kLong).contiguous(), sc = slots.to(at::kLong).contiguous();
  at::Tensor o = at::empty({d.batch, d.nodes, d.value_heads, d.value_dim}, v.options());
  at::Tensor u = at::empty({d.batch, d.nodes, d.value_heads, d.value_dim}, v.options().dtype(at::kFloat));
  at::Tensor scratch = at::empty({cuda::gdn_verify_scratch_floats(gdn_shape(d))}, u.options());
  check_cuda(cuda::gdn_tree_verify(gdn_type(q.scalar_type()), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                   gc.data_ptr<float>(), bc.data_ptr<float>(), pc.data_ptr<int64_t>(),
                                   state_pool.data_ptr<float>(), sc.data_ptr<int64_t>(), gdn_shape(d), strides, q_scale,
                                   use_qk_l2norm, tensor_cores, scratch.data_ptr<float>(), o.data_ptr(),
                                   u.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
             op);
  return {o, u};
}

at::Tensor gdn_tree_verify_slots_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& parent,
                                      at::Tensor& state_cache, const at::Tensor& start_slots,
                                      const at::Tensor& state_slots, c10::optional<double> scale, bool use_qk_l2norm,
                                      bool validate) {
  const char* op = "gdn_tree_verify_slots";
  const GdnDims d = check_gdn_tree_verify_slots_args(q, k, v, g, beta, parent, state_cache, start_slots, state_slots);
  const c10::cuda::CUDAGuard guard(q.device());
  const bool host_checked = validate && !validate_on_device(op, deferred::kGdnTreeVerifySlots, parent, at::Tensor(),
                                                            start_slots, d.pool, state_slots);
  if (host_checked) check_slots_values(op, parent, start_slots, state_slots, d.pool);
  const float q_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d.key_dim))));
  const at::Tensor qc = with_contiguous_rows(q), kc = with_contiguous_rows(k), vc = with_contiguous_rows(v);
  const cuda::GdnStrides strides{row_strides(qc), row_strides(kc), row_strides(vc), row_strides(state_cache)};
  const at::Tensor gc = g.to(at::kFloat).contiguous(), bc = beta.to(at::kFloat).contiguous();
  const at::Tensor pc = parent.to(at::kLong).contiguous(), sc = start_slots.to(at::kLong).contiguous();
  const at::Tensor dc = state_slots.to(at::kLong).contiguous();
  at::Tensor o = at::empty({d.batch, d.nodes, d.value_heads, d.value_dim}, v.options());
  at::Tensor scratch = at::empty({cuda::gdn_verify_scratch_floats(gdn_shape(d))}, v.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Slots the host has not checked are claimed on the device: requests that share a slot never race on it.
  at::Tensor claims;
  int64_t* record = nullptr;
  if (!host_checked && d.batch > 0) {
    TORCH_CHECK(d.pool < (int64_t{1} << 30) && d.batch * d.nodes < (int64_t{1} << 30), "peagle.", op,
                ": state_cache must have fewer than 2^30 slots and B x n must be below 2^30, got ", d.pool, " and ",
                d.batch * d.nodes);
    claims = at::zeros({d.pool + 2}, sc.options().dtype(at::kInt));
    record = deferred_record_if_available(q.get_device(), stream);
  }
  check_cuda(cuda::gdn_tree_verify_slots(gdn_type(q.scalar_type()), gdn_type(state_cache.scalar_type()), qc.data_ptr(),
                                         kc.data_ptr(), vc.data_ptr(), gc.data_ptr<float>(), bc.data_ptr<float>(),
                                         pc.data_ptr<int64_t>(), state_cache.data_ptr(), sc.data_ptr<int64_t>(),
                                         dc.data_ptr<int64_t>(), gdn_shape(d), strides, q_scale, use_qk_l2norm,
                                         scratch.data_ptr<float>(), o.data_ptr(),
                                         claims.defined() ? claims.data_ptr<int32_t>() : nullptr, record, stream),
             op);
  return o;
}

void gdn_commit_cuda(const at::Tensor& k, const at::Tensor& g, const at::Tensor& u, const at::Tensor& parent,
                     const at::Tensor& last_accepted, at::Tensor& state_pool, const at::Tensor& slots,
                     bool use_qk_l2norm, bool validate) {
  const char* op = "gdn_commit";
  const GdnDims d = check_gdn_commit_args(k, g, u, parent, last_accepted, state_pool, slots);
  const c10::cuda::CUDAGuard guard(k.device());
  const bool host_checked =
      validate && !validate_on_device(op, deferred::kGdnCommit, parent, last_accepted, slots, d.pool);
  if (host_checked) {
    check_parent_values(op, parent);
    check_index_values(op, "last_accepted", last_accepted, -1, d.nodes);
    check_active_slot_values(op, slots, last_accepted, d.pool);
    check_distinct_active_slots(op, slots, last_accepted);
  }
  const at::Tensor kc = with_contiguous_rows(k), uc = u.contiguous(), gc = g.to(at::kFloat).contiguous();
  const cuda::GdnStrides strides{{}, row_strides(kc), {}, row_strides(state_pool)};
  const at::Tensor pc = parent.to(at::kLong).contiguous(), sc = slots.to(at::kLong).contiguous();
  const at::Tensor ac = last_accepted.to(at::kLong).contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Slots the host has not seen distinct are claimed on the device: requests sharing one never race on it.
  at::Tensor claims;
  int64_t* record = nullptr;
  if (!host_checked && d.batch > 1) {
    TORCH_CHECK(d.pool < (int64_t{1} << 30), "peagle.", op, ": state_pool must have fewer than 2^30 slots, got ",
                d.pool);
    claims = at::zeros({d.pool + 1}, sc.options().dtype(at::kInt));
    record = deferred_record_if_available(k.get_device(), stream);
  }
  check_cuda(cuda::gdn_commit(gdn_type(k.scalar_type()), kc.data_ptr(), gc.data_ptr<float>(), uc.data_ptr<float>(),
                              pc.data_ptr<int64_t>(), ac.data_ptr<int64_t>(), state_pool.data_ptr<float>(),
                              sc.data_ptr<int64_t>(), gdn_shape(d), strides, use_qk_l2norm,
                              claims.defined() ? claims.data_ptr<int32_t>() : nullptr, record, stream),
             op);
}

at::Tensor causal_conv1d_tree_cuda(const at::Tensor& x, const at::Tensor& parent, const at::Tensor& conv_state,
                                   const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                   c10::optional<c10::string_view> activation, bool validate,
                                   const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_tree";
  const ConvDims d = check_causal_conv1d_tree_args(x, parent, conv_state, weight, bias, slots);
  const int act = check_activation(op, activation);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor rows = slots.has_value() ? slots->to(at::kLong).contiguous() : at::Tensor();
  if (validate && !validate_on_device(op, deferred::kCausalConv1dTree, parent, at::Tensor(), rows, d.rows)) {
    check_parent_values(op, parent);
    if (rows.defined()) check_index_values(op, "slots", rows, 0, d.rows);
  }
  const at::Tensor xc = x.contiguous(), stc = conv_state.contiguous();
  const at::Tensor wc = weight.to(at::kFloat).contiguous();
  const at::Tensor biasc = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor pc = parent.to(at::kLong).contiguous();
  at::Tensor out = at::empty({d.batch, d.nodes, d.channels}, x.options());
  check_cuda(cuda::causal_conv1d_tree(gdn_type(x.scalar_type()), xc.data_ptr(), pc.data_ptr<int64_t>(), stc.data_ptr(),
                                      rows.defined() ? rows.data_ptr<int64_t>() : nullptr, d.rows, wc.data_ptr<float>(),
                                      biasc.defined() ? biasc.data_ptr<float>() : nullptr, d.batch, d.nodes, d.channels,
                                      d.width, act, out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
             op);
  return out;
}

void causal_conv1d_commit_cuda(const at::Tensor& x, const at::Tensor& parent, const at::Tensor& last_accepted,
                               at::Tensor& conv_state, bool validate, const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_commit";
  const ConvDims d = check_causal_conv1d_commit_args(x, parent, last_accepted, conv_state, slots);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor rows = slots.has_value() ? slots->to(at::kLong).contiguous() : at::Tensor();
  const bool host_checked =
      validate && !validate_on_device(op, deferred::kCausalConv1dCommit, parent, last_accepted, rows, d.rows);
  if (host_checked) {
    check_parent_values(op, parent);
    check_index_values(op, "last_accepted", last_accepted, -1, d.nodes);
    if (rows.defined()) {
      check_active_slot_values(op, rows, last_accepted, d.rows);
      check_distinct_active_slots(op, rows, last_accepted);
    }
  }
  const at::Tensor xc = x.contiguous();
  const at::Tensor pc = parent.to(at::kLong).contiguous(), ac = last_accepted.to(at::kLong).contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Slots the host has not seen distinct are claimed on the device, as gdn_commit's.
  at::Tensor claims;
  int64_t* record = nullptr;
  if (rows.defined() && !host_checked && d.batch > 1) {
    TORCH_CHECK(d.rows < (int64_t{1} << 30), "peagle.", op, ": conv_state must have fewer than 2^30 rows, got ",
                d.rows);
    claims = at::zeros({d.rows + 1}, rows.options().dtype(at::kInt));
    record = deferred_record_if_available(x.get_device(), stream);
  }
  check_cuda(cuda::causal_conv1d_commit(gdn_type(x.scalar_type()), xc.data_ptr(), pc.data_ptr<int64_t>(),
                                        ac.data_ptr<int64_t>(), conv_state.data_ptr(),
                                        rows.defined() ? rows.data_ptr<int64_t>() : nullptr, d.rows,
                                        claims.defined() ? claims.data_ptr<int32_t>() : nullptr, record, d.batch,
                                        d.nodes, d.channels, d.width, stream),
             op);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("gdn_tree_verify", &peagle::gdn_tree_verify_cuda);
  m.impl("gdn_tree_verify_slots", &peagle::gdn_tree_verify_slots_cuda);
  m.impl("gdn_commit", &peagle::gdn_commit_cuda);
  m.impl("causal_conv1d_tree", &peagle::causal_conv1d_tree_cuda);
  m.impl("causal_conv1d_commit", &peagle::causal_conv1d_commit_cuda);
}
