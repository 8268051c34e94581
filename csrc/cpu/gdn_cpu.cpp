// CPU kernels of the Gated DeltaNet family: tree verification and state commit (closed form over the tree, see
// peagle/gdn.h) and the causal conv1d in front of GDN over a tree, with its commit along the accepted path.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks/gdn.h"
#include "peagle/gdn.h"

namespace peagle {
namespace {

// Loads row `src` (K values) as fp32, l2-normalised when asked, times `scale`.
template <typename scalar_t>
void load_row(const scalar_t* src, int64_t width, bool l2norm, float scale, float* dst) {
  float sum_sq = 0.0f;
  for (int64_t c = 0; c < width; ++c) {
    dst[c] = static_cast<float>(src[c]);
    sum_sq += dst[c] * dst[c];
  }
  const float factor = gdn::inv_l2(sum_sq, l2norm) * scale;
  for (int64_t c = 0; c < width; ++c) dst[c] *= factor;
}

std::tuple<at::Tensor, at::Tensor> gdn_tree_verify_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& g, const at::Tensor& beta,
                                                       const at::Tensor& parent, const at::Tensor& state_pool,
                                                       const at::Tensor& slots, c10::optional<double> scale,
                                                       bool use_qk_l2norm, bool /*validate: always on CPU*/) {
  const char* op = "gdn_tree_verify";
  const GdnDims d = check_gdn_tree_verify_args(q, k, v, g, beta, parent, state_pool, slots);
  check_parent_values(op, parent);
  check_index_values(op, "slots", slots, 0, d.pool);
  const int64_t B = d.batch, n = d.nodes, H = d.qk_heads, HV = d.value_heads, K = d.key_dim, V = d.value_dim;
  const float q_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(K))));
  const at::Tensor qc = with_contiguous_rows(q), kc = with_contiguous_rows(k), vc = with_contiguous_rows(v);
  const gdn::RowStrides qs = row_strides(qc), ks = row_strides(kc), vs = row_strides(vc), ps = row_strides(state_pool);
  const at::Tensor gc = g.to(at::kFloat).contiguous(), bc = beta.to(at::kFloat).contiguous();
  const at::Tensor pc = parent.to(at::kLong).contiguous(), sc = slots.to(at::kLong).contiguous();
  at::Tensor o = at::empty({B, n, HV, V}, v.options());
  at::Tensor u = at::empty({B, n, HV, V}, v.options().dtype(at::kFloat));
  if (B == 0) return {o, u};
  const float* pool = state_pool.data_ptr<float>();
  const float* g_ptr = gc.data_ptr<float>();
  const float* b_ptr = bc.data_ptr<float>();
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  float* u_ptr = u.data_ptr<float>();
  const int64_t group = HV / H;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "gdn_tree_verify_cpu", [&] {
    const scalar_t* q_ptr = qc.data_ptr<scalar_t>();
    const scalar_t* k_ptr = kc.data_ptr<scalar_t>();
    const scalar_t* v_ptr = vc.data_ptr<scalar_t>();
    scalar_t* o_ptr = o.data_ptr<scalar_t>();
    at::parallel_for(0, B * HV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(n * K), kf(n * K), kk(n * n), qk(n * n), vf(n * V), uf(n * V), of(n * V);
      std::vector<float> gate(n), gate_sum(n), bet(n);
      std::vector<uint64_t> anc(n);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / HV, hv = task % HV, h = hv / group;
        for (int64_t i = 0; i < n; ++i) {
          load_row(q_ptr + qs.at(b, i, h), K, use_qk_l2norm, q_scale, qf.data() + i * K);
          load_row(k_ptr + ks.at(b, i, h), K, use_qk_l2norm, 1.0f, kf.data() + i * K);
          const scalar_t* vrow = v_ptr + vs.at(b, i, hv);
          for (int64_t c = 0; c < V; ++c) vf[i * V + c] = static_cast<float>(vrow[c]);
          gate[i] = g_ptr[(b * n + i) * HV + hv];
          bet[i] = b_ptr[(b * n + i) * HV + hv];
        }
        gdn::build_tree(parent_ptr + b * n, static_cast<int>(n), gate.data(), 1, anc.data(), nullptr, gate_sum.data());
        // Gram entries for ancestor-or-self pairs only.
        for (int64_t i = 0; i < n; ++i) {
          uint64_t bits = anc[i];
          while (bits != 0) {
            const int64_t j = __builtin_ctzll(bits);
            bits &= bits - 1;
            float dk = 0.0f, dq = 0.0f;
            const float* ki = kf.data() + i * K;
            const float* qi = qf.data() + i * K;
            const float* kj = kf.data() + j * K;
            for (int64_t c = 0; c < K; ++c) {
              dk += ki[c] * kj[c];
              dq += qi[c] * kj[c];
            }
            kk[i * n + j] = dk;
            qk[i * n + j] = dq;
          }
        }
        // Projections of the committed state: row i of uf = S0^T k_i, of of = S0^T q_i.
        const float* s0 = pool + ps.at(slot_ptr[b], hv, 0);
        std::fill(uf.begin(), uf.end(), 0.0f);
        std::fill(of.begin(), of.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          float* ur = uf.data() + i * V;
          float* orow = of.data() + i * V;
          for (int64_t r = 0; r < K; ++r) {
            const float a = kf[i * K + r], c2 = qf[i * K + r];
            const float* srow = s0 + r * ps.inner;
            for (int64_t c = 0; c < V; ++c) {
              ur[c] += a * srow[c];
              orow[c] += c2 * srow[c];
            }
          }
        }
        gdn::tree_delta_columns(static_cast<int>(n), anc.data(), gate_sum.data(), bet.data(), kk.data(), qk.data(),
                                vf.data(), V, uf.data(), V, of.data(), V, 0, static_cast<int>(V));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t vrow = ((b * n + i) * HV + hv) * V;
          for (int64_t c = 0; c < V; ++c) {
            u_ptr[vrow + c] = uf[i * V + c];
            o_ptr[vrow + c] = static_cast<scalar_t>(of[i * V + c]);
          }
        }
      }
    });
  });
  return {o, u};
}

void gdn_commit_cpu(const at::Tensor& k, const at::Tensor& g, const at::Tensor& u, const at::Tensor& parent,
                    const at::Tensor& last_accepted, at::Tensor& state_pool, const at::Tensor& slots,
                    bool use_qk_l2norm, bool /*validate: always on CPU*/) {
  const char* op = "gdn_commit";
  const GdnDims d = check_gdn_commit_args(k, g, u, parent, last_accepted, state_pool, slots);
  check_parent_values(op, parent);
  check_index_values(op, "last_accepted", last_accepted, -1, d.nodes);
  check_active_slot_values(op, slots, last_accepted, d.pool);
  check_distinct_active_slots(op, slots, last_accepted);
  const int64_t B = d.batch, n = d.nodes, H = d.qk_heads, HV = d.value_heads, K = d.key_dim, V = d.value_dim;
  const at::Tensor kc = with_contiguous_rows(k), uc = u.contiguous(), gc = g.to(at::kFloat).contiguous();
  const gdn::RowStrides ks = row_strides(kc), ps = row_strides(state_pool);
  const at::Tensor pc = parent.to(at::kLong).contiguous(), sc = slots.to(at::kLong).contiguous();
  const at::Tensor ac = last_accepted.to(at::kLong).contiguous();
  float* pool = state_pool.data_ptr<float>();
  const float* u_ptr = uc.data_ptr<float>();
  const float* g_ptr = gc.data_ptr<float>();
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  const int64_t* acc_ptr = ac.data_ptr<int64_t>();
  const int64_t group = HV / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "gdn_commit_cpu", [&] {
    const scalar_t* k_ptr = kc.data_ptr<scalar_t>();
    at::parallel_for(0, B * HV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kf(K), gate(n), gate_sum(n);
      std::vector<uint64_t> anc(n);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / HV, hv = task % HV, h = hv / group;
        const int64_t a = acc_ptr[b];
        if (a < 0) continue;
        for (int64_t i = 0; i < n; ++i) gate[i] = g_ptr[(b * n + i) * HV + hv];
        gdn::build_tree(parent_ptr + b * n, static_cast<int>(n), gate.data(), 1, anc.data(), nullptr, gate_sum.data());
        float* s = pool + ps.at(slot_ptr[b], hv, 0);
        const float root = std::exp(gate_sum[a]);
        for (int64_t r = 0; r < K; ++r) {
          for (int64_t c = 0; c < V; ++c) s[r * ps.inner + c] *= root;
        }
        uint64_t bits = anc[a];
        while (bits != 0) {
          const int64_t j = __builtin_ctzll(bits);
          bits &= bits - 1;
          load_row(k_ptr + ks.at(b, j, h), K, use_qk_l2norm, std::exp(gate_sum[a] - gate_sum[j]), kf.data());
          const float* uj = u_ptr + ((b * n + j) * HV + hv) * V;
          for (int64_t r = 0; r < K; ++r) {
            const float coef = kf[r];
            float* srow = s + r * ps.inner;
            for (int64_t c = 0; c < V; ++c) srow[c] += coef * uj[c];
          }
        }
      }
    });
  });
}

at::Tensor causal_conv1d_tree_cpu(const at::Tensor& x, const at::Tensor& parent, const at::Tensor& conv_state,
                                  const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                  c10::optional<c10::string_view> activation, bool /*validate: always on CPU*/) {
  const char* op = "causal_conv1d_tree";
  const ConvDims d = check_causal_conv1d_tree_args(x, parent, conv_state, weight, bias);
  const int act = check_activation(op, activation);
  check_parent_values(op, parent);
  const int64_t B = d.batch, n = d.nodes, C = d.channels, W = d.width;
  const at::Tensor xc = x.contiguous(), stc = conv_state.contiguous();
  const at::Tensor wc = weight.to(at::kFloat).contiguous();
  const at::Tensor biasc = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::zeros({C}, wc.options());
  const at::Tensor pc = parent.to(at::kLong).contiguous();
  at::Tensor out = at::empty({B, n, C}, x.options());
  if (B == 0 || C == 0) return out;
  const float* w_ptr = wc.data_ptr<float>();
  const float* bias_ptr = biasc.data_ptr<float>();
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d_tree_cpu", [&] {
    const scalar_t* x_ptr = xc.data_ptr<scalar_t>();
    const scalar_t* st_ptr = stc.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * n, 1, [&](int64_t begin, int64_t end) {
      std::vector<int> src(W);
      std::vector<float> acc(C);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / n, i = task % n;
        gdn::conv_window(parent_ptr + b * n, static_cast<int>(i), static_cast<int>(W), src.data());
        for (int64_t c = 0; c < C; ++c) acc[c] = bias_ptr[c];
        for (int64_t w = 0; w < W; ++w) {
          if (src[w] >= 0) {
            const scalar_t* xr = x_ptr + (b * n + src[w]) * C;
            for (int64_t c = 0; c < C; ++c) acc[c] += w_ptr[c * W + w] * static_cast<float>(xr[c]);
          } else {
            const int64_t s = -src[w] - 1;
            const scalar_t* sr = st_ptr + b * C * (W - 1) + s;
            for (int64_t c = 0; c < C; ++c) acc[c] += w_ptr[c * W + w] * static_cast<float>(sr[c * (W - 1)]);
          }
        }
        scalar_t* orow = out_ptr + (b * n + i) * C;
        for (int64_t c = 0; c < C; ++c) orow[c] = static_cast<scalar_t>(act == 1 ? gdn::silu(acc[c]) : acc[c]);
      }
    });
  });
  return out;
}

void causal_conv1d_commit_cpu(const at::Tensor& x, const at::Tensor& parent, const at::Tensor& last_accepted,
                              at::Tensor& conv_state, bool /*validate: always on CPU*/) {
  const char* op = "causal_conv1d_commit";
  const ConvDims d = check_causal_conv1d_commit_args(x, parent, last_accepted, conv_state);
  check_parent_values(op, parent);
  check_index_values(op, "last_accepted", last_accepted, -1, d.nodes);
  const int64_t B = d.batch, n = d.nodes, C = d.channels, W = d.width;
  const at::Tensor xc = x.contiguous();
  const at::Tensor pc = parent.to(at::kLong).contiguous(), ac = last_accepted.to(at::kLong).contiguous();
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  const int64_t* acc_ptr = ac.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d_commit_cpu", [&] {
    const scalar_t* x_ptr = xc.data_ptr<scalar_t>();
    scalar_t* st_ptr = conv_state.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<int> src(W);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t a = acc_ptr[b];
        if (a < 0) continue;
        gdn::conv_window(parent_ptr + b * n, static_cast<int>(a), static_cast<int>(W), src.data());
        // New state column s = window tap s + 1 of the last accepted node. A state tap read at column s reads an
        // older column s' > s of the old state, so updating s in increasing order is safe in place.
        for (int64_t c = 0; c < C; ++c) {
          scalar_t* row = st_ptr + (b * C + c) * (W - 1);
          for (int64_t s = 0; s < W - 1; ++s) {
            const int t = src[s + 1];
            row[s] = t >= 0 ? x_ptr[(b * n + t) * C + c] : row[-t - 1];
          }
        }
      }
    });
  });
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("gdn_tree_verify", &peagle::gdn_tree_verify_cpu);
  m.impl("gdn_commit", &peagle::gdn_commit_cpu);
  m.impl("causal_conv1d_tree", &peagle::causal_conv1d_tree_cpu);
  m.impl("causal_conv1d_commit", &peagle::causal_conv1d_commit_cpu);
}
