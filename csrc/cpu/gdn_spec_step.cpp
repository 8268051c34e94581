// gdn_spec_step: vLLM's speculative Gated DeltaNet step as one op, by vLLM's argument names, so that the vLLM plugin
// calls it as it is: the sigmoid gates, each request's start slot, then one gdn_tree_verify_slots over the chains.
//
// Why one op: the same composition in Python cost about 80 us a call at batch 1 on a Xeon (a third of vLLM's whole
// step) and 0.35-0.45 ms with cold caches, as in serving, where every other layer runs between two steps of one layer:
// the interpreter's and the dispatcher's paths through a dozen small tensor ops miss the caches as the states do.
// One implementation for both backends; only the gates differ: a plain loop on the CPU (no tensor op at all), tensor
// ops on CUDA. The chain lengths are shapes, so cu_seqlens is read on the host (as vLLM's own step does), and the
// chains' layout (start and written slots, padding) is computed there with it, then handed over as int64.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks/common.h"
#include "checks/gdn.h"

namespace peagle {
namespace {

constexpr const char* kOp = "gdn_spec_step";

at::Tensor verify_slots(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, const at::Tensor& parent, at::Tensor& state_cache,
                        const at::Tensor& start_slots, const at::Tensor& state_slots, bool use_qk_l2norm) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("peagle::gdn_tree_verify_slots", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                            c10::optional<double>, bool, bool)>();
  // Straight to the backend's kernel: this op has passed autograd's dispatch already.
  const c10::DispatchKeySet backend(q.is_cpu() ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA);
  return op.redispatch(backend, q, k, v, g, beta, parent, state_cache, start_slots, state_slots, c10::nullopt,
                       use_qk_l2norm, true);
}

// An alias of t's storage with these sizes and strides from element `offset` of it, as view() would return it. On
// the CPU view() passes through the dispatcher, and with cold caches (as in serving) the five views of a step cost
// about 25 us at batch 1 on a Xeon, a tenth of the whole step; the alias is built here instead.
at::Tensor alias(const at::Tensor& t, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset) {
  if (!t.is_cpu()) return t.as_strided(sizes, strides, offset);
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(), t.dtype());
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

// A contiguous block of `sizes` at element `offset` of the flat buffer t (the chains' layout and the gates each take
// one allocation, not one per tensor).
at::Tensor block(const at::Tensor& t, std::vector<int64_t> sizes, int64_t offset) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size() - 1; d > 0; --d) strides[d - 1] = strides[d] * sizes[d];
  return alias(t, std::move(sizes), std::move(strides), t.storage_offset() + offset);
}

// t [S * n, ...] as [S, n, ...].
at::Tensor split_rows(const at::Tensor& t, int64_t S, int64_t n) {
  std::vector<int64_t> sizes{S, n}, strides{n * t.stride(0), t.stride(0)};
  sizes.insert(sizes.end(), t.sizes().begin() + 1, t.sizes().end());
  strides.insert(strides.end(), t.strides().begin() + 1, t.strides().end());
  return alias(t, std::move(sizes), std::move(strides), t.storage_offset());
}

// t [S, n, ...] as [S * n, ...]; its first two dimensions must merge (stride(0) = n stride(1), as split_rows makes
// them and as a fresh output has them).
at::Tensor merge_rows(const at::Tensor& t) {
  std::vector<int64_t> sizes{t.size(0) * t.size(1)}, strides{t.stride(1)};
  sizes.insert(sizes.end(), t.sizes().begin() + 2, t.sizes().end());
  strides.insert(strides.end(), t.strides().begin() + 2, t.strides().end());
  return alias(t, std::move(sizes), std::move(strides), t.storage_offset());
}

// The values of a 1-D CPU tensor (any stride) as float / int64: no tensor op (each costs microseconds cold).
std::vector<float> float_values(const at::Tensor& t) {
  std::vector<float> out(t.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), kOp, [&] {
    const scalar_t* ptr = t.data_ptr<scalar_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(ptr[i * t.stride(0)]);
  });
  return out;
}

std::vector<int64_t> index_values(const at::Tensor& t) {
  std::vector<int64_t> out(t.numel());
  AT_DISPATCH_INDEX_TYPES(t.scalar_type(), kOp, [&] {
    const index_t* ptr = t.data_ptr<index_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = ptr[i * t.stride(0)];
  });
  return out;
}

// g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), each [T, HV] float32, computed in float32 as vLLM's step
// and torch's softplus do (x beta > threshold: x; else log1p(exp(x beta)) / beta).
std::pair<at::Tensor, at::Tensor> gates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                        const at::Tensor& dt_bias, double softplus_beta, double softplus_threshold) {
  if (!a.is_cpu()) {
    const at::Tensor softplus =
        at::softplus(a.to(at::kFloat).add(dt_bias.to(at::kFloat)), softplus_beta, softplus_threshold);
    return {softplus.mul_(A_log.to(at::kFloat).exp().neg()), b.to(at::kFloat).sigmoid()};
  }
  const int64_t T = a.size(0), HV = a.size(1);
  const at::Tensor both = at::empty({2 * T * HV}, a.options().dtype(at::kFloat));
  at::Tensor g = block(both, {T, HV}, 0), beta = block(both, {T, HV}, T * HV);
  std::vector<float> rate = float_values(A_log);
  for (float& r : rate) r = -std::exp(r);
  const std::vector<float> bias = float_values(dt_bias);
  const float* rate_ptr = rate.data();
  const float* bias_ptr = bias.data();
  float* g_ptr = g.data_ptr<float>();
  float* beta_ptr = beta.data_ptr<float>();
  const float sp_beta = static_cast<float>(softplus_beta), sp_threshold = static_cast<float>(softplus_threshold);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), kOp, [&] {
    const scalar_t* a_ptr = a.data_ptr<scalar_t>();
    const scalar_t* b_ptr = b.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < HV; ++h) {
        const float x = static_cast<float>(a_ptr[t * a.stride(0) + h * a.stride(1)]) + bias_ptr[h];
        const float scaled = x * sp_beta;
        const float softplus = scaled > sp_threshold ? x : std::log1p(std::exp(scaled)) / sp_beta;
        g_ptr[t * HV + h] = softplus * rate_ptr[h];
        beta_ptr[t * HV + h] = 1.0f / (1.0f + std::exp(-static_cast<float>(b_ptr[t * b.stride(0) + h * b.stride(1)])));
      }
    }
  });
  return {g, beta};
}

// The chains' layout, computed on the host: start[s] = indices[s, max(num_accepted[s] - 1, 0)] (the slot of the
// request's last accepted token; its column comes from the previous step's chain, which may be longer than any of
// this step's), dest[s, i] = indices[s, i] for the sequence's tokens and -1 for padding, token[s, i] = the flattened
// token of position i (padding reads token 0: any real token serves, as nothing of it is kept), parent[s, i] = i - 1,
// and rows [T]: the flat positions of the real tokens, in token order.
struct ChainLayout {
  at::Tensor start, dest, token, parent, rows;
};

ChainLayout chain_layout(const at::Tensor& indices, const at::Tensor& num_accepted, const std::vector<int64_t>& bounds,
                         int64_t n) {
  const int64_t S = static_cast<int64_t>(bounds.size()) - 1, width = indices.size(1);
  const at::Tensor host = indices.is_cpu() ? indices : indices.narrow(0, 0, S).cpu();
  const std::vector<int64_t> counts = index_values(num_accepted.is_cpu() ? num_accepted : num_accepted.cpu());
  const int64_t T = bounds.back();
  // The five tensors as blocks of one buffer, in the order of ChainLayout.
  const auto blocks = [&](const at::Tensor& all) {
    return ChainLayout{block(all, {S}, 0), block(all, {S, n}, S), block(all, {S, n}, S + S * n),
                       block(all, {S, n}, S + 2 * S * n), block(all, {T}, S + 3 * S * n)};
  };
  const at::Tensor all = at::empty({S + 3 * S * n + T}, at::TensorOptions().dtype(at::kLong));
  ChainLayout out = blocks(all);
  int64_t* start = out.start.data_ptr<int64_t>();
  int64_t* dest = out.dest.data_ptr<int64_t>();
  int64_t* token = out.token.data_ptr<int64_t>();
  int64_t* parent = out.parent.data_ptr<int64_t>();
  int64_t* rows = out.rows.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(host.scalar_type(), kOp, [&] {
    const index_t* index_ptr = host.data_ptr<index_t>();
    const auto slot = [&](int64_t s, int64_t column) {
      return index_ptr[s * host.stride(0) + column * host.stride(1)];
    };
    for (int64_t s = 0; s < S; ++s) {
      const int64_t column = std::max<int64_t>(counts[s] - 1, 0);
      TORCH_CHECK(column < width, "peagle.", kOp, ": num_accepted_tokens[", s, "] = ", counts[s], " exceeds the ",
                  width, " slot columns of spec_state_indices");
      start[s] = slot(s, column);
      const int64_t length = bounds[s + 1] - bounds[s];
      for (int64_t i = 0; i < n; ++i) {
        dest[s * n + i] = i < length ? slot(s, i) : -1;
        token[s * n + i] = i < length ? bounds[s] + i : 0;
        parent[s * n + i] = i - 1;
        if (i < length) rows[bounds[s] + i] = s * n + i;
      }
    }
  });
  return indices.is_cpu() ? out : blocks(all.to(indices.device()));  // one copy to the device
}

// The sequence bounds on the host, checked: 0 = cu[0] <= cu[1] <= ... <= cu[S] = tokens.
std::vector<int64_t> sequence_bounds(const at::Tensor& cu_seqlens, int64_t tokens) {
  const std::vector<int64_t> bounds = index_values(cu_seqlens.is_cpu() ? cu_seqlens : cu_seqlens.cpu());
  TORCH_CHECK(bounds.front() == 0 && bounds.back() == tokens, "peagle.", kOp, ": cu_seqlens must run from 0 to the ",
              tokens, " tokens of q, got ", bounds.front(), " .. ", bounds.back());
  for (size_t s = 1; s < bounds.size(); ++s) {
    TORCH_CHECK(bounds[s] >= bounds[s - 1], "peagle.", kOp, ": cu_seqlens must not decrease, got ", bounds[s - 1],
                " then ", bounds[s], " at ", s);
  }
  return bounds;
}

at::Tensor gdn_spec_step(const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& a, const at::Tensor& b,
                         at::Tensor& initial_state_source, const at::Tensor& spec_state_indices,
                         const at::Tensor& num_accepted_tokens, const at::Tensor& cu_seqlens,
                         bool use_qk_l2norm_in_kernel, double softplus_beta, double softplus_threshold) {
  check_rank(kOp, "q", q, 3, "[T, H, K]");
  check_rank(kOp, "k", k, 3, "[T, H, K]");
  check_rank(kOp, "v", v, 3, "[T, HV, V]");
  check_rank(kOp, "a", a, 2, "[T, HV]");
  check_rank(kOp, "b", b, 2, "[T, HV]");
  check_rank(kOp, "A_log", A_log, 1, "[HV]");
  check_rank(kOp, "dt_bias", dt_bias, 1, "[HV]");
  check_rank(kOp, "spec_state_indices", spec_state_indices, 2, "[S, columns]");
  check_rank(kOp, "num_accepted_tokens", num_accepted_tokens, 1, "[S]");
  check_rank(kOp, "cu_seqlens", cu_seqlens, 1, "[S + 1]");
  check_integer(kOp, "spec_state_indices", spec_state_indices);
  check_integer(kOp, "num_accepted_tokens", num_accepted_tokens);
  check_integer(kOp, "cu_seqlens", cu_seqlens);
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor&>{"a", a}, {"b", b}, {"A_log", A_log}, {"dt_bias", dt_bias}}) {
    check_float_input(kOp, name, t);
    check_same_device(kOp, name, t, q, "q");
  }
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "peagle.", kOp, ": a and b must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
  const int64_t T = q.size(0), HV = v.size(1);
  check_dims(kOp, "a", a, {T, HV}, "[T, HV]");
  check_dims(kOp, "b", b, {T, HV}, "[T, HV]");
  check_dims(kOp, "A_log", A_log, {HV}, "[HV]");
  check_dims(kOp, "dt_bias", dt_bias, {HV}, "[HV]");
  TORCH_CHECK(cu_seqlens.numel() >= 1, "peagle.", kOp, ": cu_seqlens must hold S + 1 >= 1 bounds");
  const int64_t S = cu_seqlens.numel() - 1;
  TORCH_CHECK(spec_state_indices.size(0) >= S && num_accepted_tokens.size(0) >= S, "peagle.", kOp,
              ": spec_state_indices and num_accepted_tokens need a row for each of the ", S,
              " sequences of cu_seqlens, got shapes ", shape_str(spec_state_indices), " and ",
              shape_str(num_accepted_tokens));
  if (S == 0 || T == 0) return at::zeros(v.sizes(), v.options());
  const std::vector<int64_t> bounds = sequence_bounds(cu_seqlens, T);
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) n = std::max(n, bounds[s + 1] - bounds[s]);
  TORCH_CHECK(n <= spec_state_indices.size(1), "peagle.", kOp, ": a sequence of ", n,
              " tokens needs as many slot columns, spec_state_indices has ", spec_state_indices.size(1));

  const auto [g, beta] = gates(a, b, A_log, dt_bias, softplus_beta, softplus_threshold);
  const ChainLayout chains = chain_layout(spec_state_indices, num_accepted_tokens, bounds, n);
  if (T == S * n) {  // every sequence has n tokens (vLLM's usual batch): views, no gathers
    const at::Tensor o = verify_slots(split_rows(q, S, n), split_rows(k, S, n), split_rows(v, S, n),
                                      split_rows(g, S, n), split_rows(beta, S, n), chains.parent, initial_state_source,
                                      chains.start, chains.dest, use_qk_l2norm_in_kernel);
    return merge_rows(o);
  }
  // Flattened tokens -> padded [S, n] chains: padding positions write no slot and are never read back.
  const at::Tensor token = chains.token.view({S * n});
  const auto gather = [&](const at::Tensor& t) {
    std::vector<int64_t> shape{S, n};
    shape.insert(shape.end(), t.sizes().begin() + 1, t.sizes().end());
    return t.index_select(0, token).view(shape);
  };
  const at::Tensor o = verify_slots(gather(q), gather(k), gather(v), gather(g), gather(beta), chains.parent,
                                    initial_state_source, chains.start, chains.dest, use_qk_l2norm_in_kernel);
  return o.view({S * n, HV, v.size(2)}).index_select(0, chains.rows);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("gdn_spec_step", &peagle::gdn_spec_step); }
#if defined(PEAGLE_WITH_CUDA)
TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("gdn_spec_step", &peagle::gdn_spec_step); }
#endif
