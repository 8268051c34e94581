// CPU kernels of the Gated DeltaNet family: tree verification and state commit (closed form over the tree, see
// peagle/gdn.h) and the causal conv1d in front of GDN over a tree, with its commit along the accepted path.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <unistd.h>

#include "checks/gdn.h"
#include "isa.h"
#include "peagle/gdn.h"

namespace peagle {
namespace {

// The row loops of gdn_rows.h for each instruction set (see isa.h).
namespace rows_generic {
#define PEAGLE_GDN_TARGET
#define PEAGLE_GDN_BLOCK 0
#define PEAGLE_GDN_STREAM 0
#define PEAGLE_GDN_BF16 0
#include "gdn_rows.h"  // NOLINT(build/include)
#undef PEAGLE_GDN_TARGET
#undef PEAGLE_GDN_BLOCK
#undef PEAGLE_GDN_STREAM
#undef PEAGLE_GDN_BF16
}  // namespace rows_generic

#if defined(PEAGLE_CPU_X86)
namespace rows_avx2 {
#define PEAGLE_GDN_TARGET PEAGLE_CPU_AVX2
#define PEAGLE_GDN_BLOCK 32
#define PEAGLE_GDN_STREAM 0
#define PEAGLE_GDN_BF16 0
#include "gdn_rows.h"  // NOLINT(build/include)
#undef PEAGLE_GDN_TARGET
#undef PEAGLE_GDN_BLOCK
#undef PEAGLE_GDN_STREAM
#undef PEAGLE_GDN_BF16
}  // namespace rows_avx2

namespace rows_avx512 {
#define PEAGLE_GDN_TARGET PEAGLE_CPU_AVX512
#define PEAGLE_GDN_BLOCK 64
#define PEAGLE_GDN_STREAM 1
#define PEAGLE_GDN_BF16 0
#include "gdn_rows.h"  // NOLINT(build/include)
#undef PEAGLE_GDN_TARGET
#undef PEAGLE_GDN_BLOCK
#undef PEAGLE_GDN_STREAM
#undef PEAGLE_GDN_BF16
}  // namespace rows_avx512

namespace rows_avx512_bf16 {
#define PEAGLE_GDN_TARGET PEAGLE_CPU_AVX512_BF16
#define PEAGLE_GDN_BLOCK 64
#define PEAGLE_GDN_STREAM 1
#define PEAGLE_GDN_BF16 1
#include "gdn_rows.h"  // NOLINT(build/include)
#undef PEAGLE_GDN_TARGET
#undef PEAGLE_GDN_BLOCK
#undef PEAGLE_GDN_STREAM
#undef PEAGLE_GDN_BF16
}  // namespace rows_avx512_bf16
#endif

#define PEAGLE_GDN_DISPATCH(call) PEAGLE_CPU_DISPATCH(rows_generic, rows_avx2, rows_avx512, rows_avx512_bf16, call)

template <typename start_t>
void project_kq(const float* k, const float* fk, const float* q, const float* fq, const start_t* s0, int64_t row_stride,
                int64_t n, int64_t K, int64_t V, float* out_k, float* out_q) {
  PEAGLE_GDN_DISPATCH(project_kq(k, fk, q, fq, s0, row_stride, n, K, V, out_k, out_q))
}

void commit_rows(float* s, int64_t row_stride, float coef, const float* k, const float* u, int64_t K, int64_t V) {
  PEAGLE_GDN_DISPATCH(commit_rows(s, row_stride, coef, k, u, K, V))
}

template <typename state_t>
void load_head(const state_t* head, int64_t row_stride, int64_t K, int64_t V, float* s0) {
  PEAGLE_GDN_DISPATCH(load_head(head, row_stride, K, V, s0))
}

template <typename state_t>
void prefetch_head(const state_t* head, int64_t row_stride, int64_t K, int64_t V) {
  PEAGLE_GDN_DISPATCH(prefetch_head(head, row_stride, K, V))
}

template <typename state_t, typename start_t>
void node_states(const start_t* s0, int64_t s0_stride, int64_t n, const int64_t* parent, const char* needed,
                 const float* decay, const float* row_coef, const float* u, state_t* const* dest, int64_t row_stride,
                 int64_t K, int64_t V, float* rows, bool stream, const state_t* next_start) {
  PEAGLE_GDN_DISPATCH(node_states(s0, s0_stride, n, parent, needed, decay, row_coef, u, dest, row_stride, K, V, rows,
                                  stream, next_start))
}

// Raw fp32 rows of q and k of one (request, q/k head), their factors and normalised Gram matrices (peagle/gdn.h):
// computed once and shared by the value heads of the group.
struct QkProducts {
  // One dot product of qk_products: out = x . y over K.
  struct Dot {
    const float* x;
    const float* y;
    float* out;
  };
  std::vector<float> q, k, fq, fk, qk, kk, sq_q, sq_k;
  std::vector<uint64_t> anc;
  std::vector<Dot> dots;
  QkProducts(int64_t n, int64_t K) : q(n * K), k(n * K), fq(n), fk(n), qk(n * n), kk(n * n), sq_q(n), sq_k(n), anc(n) {}
};

template <typename scalar_t>
void load_row(const scalar_t* row, int64_t K, float* dst) {
  for (int64_t r = 0; r < K; ++r) dst[r] = static_cast<float>(row[r]);
}

template <typename scalar_t>
void load_rows(const scalar_t* src, gdn::RowStrides st, int64_t b, int64_t h, int64_t n, int64_t K, float* dst) {
  for (int64_t i = 0; i < n; ++i) load_row(src + st.at(b, i, h), K, dst + i * K);
}

float sum_sq(const float* x, int64_t K) {
  float acc = 0.0f;
  for (int64_t r = 0; r < K; ++r) acc = gdn::mac(acc, x[r], x[r]);
  return acc;
}

// Each dot's sum in increasing r from 0 (gdn.h's order for sums over K), kDots of them side by side: one sum is a chain
// of dependent adds, so several in flight hide the adds' latency. The same bits as one dot at a time.
void batched_dots(const QkProducts::Dot* dots, size_t count, int64_t K) {
  constexpr size_t kDots = 8;
  for (size_t first = 0; first < count; first += kDots) {
    const QkProducts::Dot* d = dots + first;
    const size_t m = count - first < kDots ? count - first : kDots;
    const float* x[kDots];
    const float* y[kDots];
    for (size_t e = 0; e < kDots; ++e) {  // a short last batch repeats its first dot in the unused lanes
      x[e] = d[e < m ? e : 0].x;
      y[e] = d[e < m ? e : 0].y;
    }
    float acc[kDots] = {};
    for (int64_t r = 0; r < K; ++r) {
      for (size_t e = 0; e < kDots; ++e) acc[e] = gdn::mac(acc[e], x[e][r], y[e][r]);
    }
    for (size_t e = 0; e < m; ++e) *d[e].out = acc[e];
  }
}

// Norm factors and the Gram entries of ancestor-or-self pairs (p.anc and the raw rows are filled by the caller).
void qk_products(int64_t n, int64_t K, bool l2norm, float q_scale, QkProducts& p) {
  p.dots.clear();
  for (int64_t i = 0; i < n; ++i) {
    p.dots.push_back({&p.q[i * K], &p.q[i * K], &p.sq_q[i]});
    p.dots.push_back({&p.k[i * K], &p.k[i * K], &p.sq_k[i]});
    for (uint64_t bits = p.anc[i]; bits != 0; bits &= bits - 1) {
      const int64_t j = gdn::lowest_bit(bits);
      p.dots.push_back({&p.q[i * K], &p.k[j * K], &p.qk[i * n + j]});
      p.dots.push_back({&p.k[i * K], &p.k[j * K], &p.kk[i * n + j]});
    }
  }
  batched_dots(p.dots.data(), p.dots.size(), K);
  for (int64_t i = 0; i < n; ++i) {
    p.fq[i] = gdn::row_factor(p.sq_q[i], l2norm, q_scale);
    p.fk[i] = gdn::row_factor(p.sq_k[i], l2norm, 1.0f);
  }
  for (int64_t i = 0; i < n; ++i) {  // the raw dots become normalised entries in place
    for (uint64_t bits = p.anc[i]; bits != 0; bits &= bits - 1) {
      const int64_t j = gdn::lowest_bit(bits);
      p.qk[i * n + j] = gdn::gram_entry(p.qk[i * n + j], p.fq[i], p.fk[j]);
      p.kk[i * n + j] = gdn::gram_entry(p.kk[i * n + j], p.fk[i], p.fk[j]);
    }
  }
}

// Per-task buffers of the verification of one (request, q/k head) and its value heads.
struct VerifyScratch {
  QkProducts p;
  std::vector<float> uf, of, gate, gate_sum, bet, root, self, a, b;
  VerifyScratch(int64_t n, int64_t K, int64_t V)
      : p(n, K),
        uf(n * V),
        of(n * V),
        gate(n),
        gate_sum(n),
        bet(n),
        root(n),
        self(n),
        a(std::max(gdn::triangle_size(static_cast<int>(n)), 1)),
        b(a.size()) {}
};

// Loads request b's raw q/k rows of q/k head h and their products (shared by the head's group of value heads).
template <typename scalar_t>
void load_qk(const at::Tensor& q, const at::Tensor& k, gdn::RowStrides qs, gdn::RowStrides ks, const int64_t* parent,
             int64_t b, int64_t h, int64_t n, int64_t K, bool l2norm, float q_scale, QkProducts& p) {
  load_rows(q.data_ptr<scalar_t>(), qs, b, h, n, K, p.q.data());
  load_rows(k.data_ptr<scalar_t>(), ks, b, h, n, K, p.k.data());
  gdn::build_tree(parent, static_cast<int>(n), nullptr, 1, p.anc.data(), nullptr, nullptr);
  qk_products(n, K, l2norm, q_scale, p);
}

// Delta values (w.uf) and outputs (w.of) of value head hv of request b from its committed state s0 (K rows of V floats,
// row_stride apart); w.gate holds the head's raw log decays afterwards.
template <typename scalar_t, typename start_t>
void verify_value_head(VerifyScratch& w, const scalar_t* v, gdn::RowStrides vs, const float* g, const float* beta,
                       const int64_t* parent, const start_t* s0, int64_t row_stride, int64_t b, int64_t hv, int64_t n,
                       int64_t HV, int64_t K, int64_t V) {
  QkProducts& p = w.p;
  for (int64_t i = 0; i < n; ++i) {
    w.gate[i] = g[(b * n + i) * HV + hv];
    w.bet[i] = beta[(b * n + i) * HV + hv];
  }
  gdn::build_tree(parent, static_cast<int>(n), w.gate.data(), 1, p.anc.data(), nullptr, w.gate_sum.data());
  gdn::tree_coefficients(static_cast<int>(n), p.anc.data(), w.gate_sum.data(), p.kk.data(), p.qk.data(), w.root.data(),
                         w.a.data(), w.b.data(), w.self.data());
  project_kq(p.k.data(), p.fk.data(), p.q.data(), p.fq.data(), s0, row_stride, n, K, V, w.uf.data(), w.of.data());
  const auto v_at = [&](int i, int c) { return static_cast<float>(v[vs.at(b, i, hv) + c]); };
  gdn::solve_delta_columns(static_cast<int>(n), p.anc.data(), w.root.data(), w.bet.data(), w.a.data(), v_at,
                           w.uf.data(), V, 0, static_cast<int>(V));
  for (int64_t i = 0; i < n; ++i) {
    gdn::output_columns(static_cast<int>(i), p.anc.data(), w.root.data(), w.b.data(), w.self.data(), w.uf.data(), V,
                        w.of.data() + i * V, 0, static_cast<int>(V));
  }
}

template <typename scalar_t>
void store_outputs(const VerifyScratch& w, scalar_t* o, int64_t b, int64_t hv, int64_t n, int64_t HV, int64_t V) {
  for (int64_t i = 0; i < n; ++i) {
    scalar_t* row = o + ((b * n + i) * HV + hv) * V;
    for (int64_t c = 0; c < V; ++c) row[c] = static_cast<scalar_t>(w.of[i * V + c]);
  }
}

std::tuple<at::Tensor, at::Tensor> gdn_tree_verify_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& g, const at::Tensor& beta,
                                                       const at::Tensor& parent, const at::Tensor& state_pool,
                                                       const at::Tensor& slots, c10::optional<double> scale,
                                                       bool use_qk_l2norm, bool /*validate: always on CPU*/,
                                                       bool /*tensor_cores: the CPU has the exact path only*/) {
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
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  float* u_ptr = u.data_ptr<float>();
  const int64_t group = HV / H;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "gdn_tree_verify_cpu", [&] {
    const scalar_t* v_ptr = vc.data_ptr<scalar_t>();
    scalar_t* o_ptr = o.data_ptr<scalar_t>();
    // One task per (request, q/k head): its q/k products serve every value head of its group.
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      VerifyScratch w(n, K, V);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / H, h = task % H;
        load_qk<scalar_t>(qc, kc, qs, ks, parent_ptr + b * n, b, h, n, K, use_qk_l2norm, q_scale, w.p);
        for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
          verify_value_head(w, v_ptr, vs, gc.data_ptr<float>(), bc.data_ptr<float>(), parent_ptr + b * n,
                            pool + ps.at(slot_ptr[b], hv, 0), ps.inner, b, hv, n, HV, K, V);
          store_outputs(w, o_ptr, b, hv, n, HV, V);
          for (int64_t i = 0; i < n; ++i) {
            std::copy(w.uf.begin() + i * V, w.uf.begin() + (i + 1) * V, u_ptr + ((b * n + i) * HV + hv) * V);
          }
        }
      }
    });
  });
  return {o, u};
}

// The GDN layers whose state caches one serving step writes (set_gdn_cache_layers; the vLLM plugin counts them): the
// states a call writes are read at the next step, after every other layer wrote as much, so they stay in the
// last-level cache only while layers x the bytes of one call fit.
std::atomic<int64_t> gdn_cache_layers{2};

int64_t set_gdn_cache_layers(int64_t layers) {
  TORCH_CHECK(layers >= 1,
              "set_gdn_cache_layers: layers must be >= 1 (the GDN layers whose state caches one step "
              "writes), got ",
              layers);
  return gdn_cache_layers.exchange(layers);
}

// The bytes of states one step of all GDN layers may write before gdn_tree_verify_slots streams them (no read for
// ownership, nothing evicted for them): a quarter of the last-level cache as the OS reports it, at least 32 MiB (two
// layers of the 16 MiB a call tuned on an AMD EPYC whose L3 slices are 32 MiB). On a Xeon with 480 MB of L3
// (2026-12-07), B = 1 K = 3 bf16 (4 MB a call): each call right after another layer's, 0.22 ms cached against
// 0.25-0.27 ms streamed; with the caches evicted before each (a model of many GDN layers), 0.49 ms streamed against
// 0.53-0.54 ms cached, and B = 1 K = 8 float32 (18 MiB) 0.90 against 1.25 ms. PEAGLE_CPU_STREAMING_BYTES overrides it
// (tests take both store paths).
int64_t streaming_threshold_bytes() {
  if (const char* forced = std::getenv("PEAGLE_CPU_STREAMING_BYTES")) return std::atoll(forced);
  static const int64_t threshold = [] {
    constexpr int64_t kLeast = int64_t{32} << 20;
    int64_t last_level = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    last_level = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (last_level <= 0) last_level = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::max(kLeast, last_level / 4);
  }();
  return threshold;
}

// Whether gdn_tree_verify_slots' values pass check_slots_values (checks/gdn.h), in loops: parents in [-1, i), start
// slots in [0, pool), written slots in [-1, pool), distinct, and none another request's start slot.
bool slots_values_valid(const int64_t* parent, const int64_t* start, const int64_t* dest, int64_t batch, int64_t nodes,
                        int64_t pool) {
  for (int64_t e = 0; e < batch * nodes; ++e) {
    if (parent[e] < -1 || parent[e] >= e % nodes || dest[e] < -1 || dest[e] >= pool) return false;
  }
  // (slot, request, writes) of every start slot and written slot, sorted by slot: a written slot must be alone in its
  // run but for reads of its own request.
  struct Use {
    int64_t slot, request;
    bool writes;
  };
  std::vector<Use> uses;
  uses.reserve(batch * (nodes + 1));
  for (int64_t b = 0; b < batch; ++b) {
    if (start[b] < 0 || start[b] >= pool) return false;
    uses.push_back({start[b], b, false});
  }
  for (int64_t e = 0; e < batch * nodes; ++e) {
    if (dest[e] >= 0) uses.push_back({dest[e], e / nodes, true});
  }
  std::sort(uses.begin(), uses.end(), [](const Use& x, const Use& y) { return x.slot < y.slot; });
  for (size_t lo = 0, hi = 0; lo < uses.size(); lo = hi) {
    int64_t writes = 0, writer = -1;
    bool foreign_read = false;
    for (hi = lo; hi < uses.size() && uses[hi].slot == uses[lo].slot; ++hi) {
      if (uses[hi].writes) {
        ++writes;
        writer = uses[hi].request;
      }
    }
    for (size_t j = lo; j < hi; ++j) foreign_read = foreign_read || (!uses[j].writes && uses[j].request != writer);
    if (writes > 1 || (writes == 1 && foreign_read)) return false;
  }
  return true;
}

at::Tensor gdn_tree_verify_slots_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                     const at::Tensor& beta, const at::Tensor& parent, at::Tensor& state_cache,
                                     const at::Tensor& start_slots, const at::Tensor& state_slots,
                                     c10::optional<double> scale, bool use_qk_l2norm,
                                     bool /*validate: always on CPU*/) {
  const char* op = "gdn_tree_verify_slots";
  const GdnDims d = check_gdn_tree_verify_slots_args(q, k, v, g, beta, parent, state_cache, start_slots, state_slots);
  const at::Tensor pc = contiguous_as(parent, at::kLong), sc = contiguous_as(start_slots, at::kLong);
  const at::Tensor dc = contiguous_as(state_slots, at::kLong);
  // The serving path calls this once per GDN layer and step: plain loops find valid values in microseconds, and only
  // a failure runs the shared checks (tensor ops), which name the error as both backends do.
  if (!slots_values_valid(pc.data_ptr<int64_t>(), sc.data_ptr<int64_t>(), dc.data_ptr<int64_t>(), d.batch, d.nodes,
                          d.pool)) {
    check_slots_values(op, parent, start_slots, state_slots, d.pool);
  }
  const int64_t B = d.batch, n = d.nodes, H = d.qk_heads, HV = d.value_heads, K = d.key_dim, V = d.value_dim;
  const float q_scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(K))));
  const at::Tensor qc = with_contiguous_rows(q), kc = with_contiguous_rows(k), vc = with_contiguous_rows(v);
  const gdn::RowStrides qs = row_strides(qc), ks = row_strides(kc), vs = row_strides(vc);
  const gdn::RowStrides cs = row_strides(state_cache);
  const at::Tensor gc = contiguous_as(g, at::kFloat), bc = contiguous_as(beta, at::kFloat);
  at::Tensor o = at::empty({B, n, HV, V}, v.options());
  if (B == 0) return o;
  const int64_t* parent_ptr = pc.data_ptr<int64_t>();
  const int64_t* start_ptr = sc.data_ptr<int64_t>();
  const int64_t* dest_ptr = dc.data_ptr<int64_t>();
  // needed[b, i]: node i's state is written, or is the parent state of one that is (children follow their parents).
  std::vector<char> needed(B * n, 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = n - 1; i >= 0; --i) {
      char& mark = needed[b * n + i];
      mark = mark || dest_ptr[b * n + i] >= 0;
      if (mark && parent_ptr[b * n + i] >= 0) needed[b * n + parent_ptr[b * n + i]] = 1;
    }
  }
  // start_read_in_place[b]: request b's start state is read from the cache directly (float32, bfloat16), unless a node
  // other than node 0 starts from it after it was overwritten (see the value-head loop below).
  std::vector<char> start_read_in_place(B, 1);
  for (int64_t b = 0; b < B; ++b) {
    bool overwritten = false, later_root = false;
    for (int64_t i = 0; i < n; ++i) {
      overwritten = overwritten || dest_ptr[b * n + i] == start_ptr[b];
      later_root = later_root || (i > 0 && parent_ptr[b * n + i] < 0);
    }
    start_read_in_place[b] = !(overwritten && later_root);
  }
  // Streaming stores (no read for ownership) pay off when the written states would not stay in the last-level cache
  // for their next reader, and cost when they would: see gdn_cache_layers and streaming_threshold_bytes.
  const int64_t written = std::count_if(dest_ptr, dest_ptr + B * n, [](int64_t slot) { return slot >= 0; });
  const double step_bytes = static_cast<double>(written * HV * K * V * state_cache.element_size()) * gdn_cache_layers;
  const bool stream = step_bytes > static_cast<double>(streaming_threshold_bytes());  // (any layer count, no overflow)
  const int64_t group = HV / H;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "gdn_tree_verify_slots_cpu", [&] {
    using qkv_t = scalar_t;
    const qkv_t* v_ptr = vc.data_ptr<qkv_t>();
    qkv_t* o_ptr = o.data_ptr<qkv_t>();
    const auto run = [&](auto state_tag) {
      using state_t = decltype(state_tag);
      state_t* cache = static_cast<state_t*>(state_cache.data_ptr());
      at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        VerifyScratch w(n, K, V);
        std::vector<float> s0(K * V), rows((n + 1) * V), decay(n), row_coef(n * K);
        std::vector<state_t*> dest(n);
        // The start state of the value head this thread verifies after (task, hv), if any.
        const auto next_head = [&](int64_t task, int64_t hv) -> const state_t* {
          if (hv + 1 < (task % H + 1) * group) return cache + cs.at(start_ptr[task / H], hv + 1, 0);
          if (task + 1 < end) return cache + cs.at(start_ptr[(task + 1) / H], (task + 1) % H * group, 0);
          return nullptr;
        };
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / H, h = task % H;
          load_qk<qkv_t>(qc, kc, qs, ks, parent_ptr + b * n, b, h, n, K, use_qk_l2norm, q_scale, w.p);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t r = 0; r < K; ++r) row_coef[i * K + r] = gdn::mul_rn(w.p.fk[i], w.p.k[i * K + r]);
          }
          for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) {
            const auto verify_from = [&](const auto* start, int64_t start_stride) {
              verify_value_head(w, v_ptr, vs, gc.data_ptr<float>(), bc.data_ptr<float>(), parent_ptr + b * n, start,
                                start_stride, b, hv, n, HV, K, V);
              store_outputs(w, o_ptr, b, hv, n, HV, V);
              for (int64_t i = 0; i < n; ++i) {
                decay[i] = gdn::node_decay(w.gate[i]);
                const int64_t slot = dest_ptr[b * n + i];
                dest[i] = slot < 0 ? nullptr : cache + cs.at(slot, hv, 0);
              }
              node_states(start, start_stride, n, parent_ptr + b * n, needed.data() + b * n, decay.data(),
                          row_coef.data(), w.uf.data(), dest.data(), cs.inner, K, V, rows.data(), stream,
                          next_head(task, hv));
            };
            // The start state: a float32 or bfloat16 cache's rows are read where they are (converted in registers),
            // float16 ones converted first. A node state may go to the start slot (vLLM's, when one token was
            // accepted): node_states reads each start row before it writes that row, but a chain's later root would
            // read it after, so those requests take the copy.
            const state_t* head = cache + cs.at(start_ptr[b], hv, 0);
            if constexpr (!std::is_same_v<state_t, c10::Half>) {
              if (start_read_in_place[b]) {
                prefetch_head(head, cs.inner, K, V);
                verify_from(head, cs.inner);
                continue;
              }
            }
            load_head(head, cs.inner, K, V, s0.data());
            verify_from(static_cast<const float*>(s0.data()), V);
          }
        }
      });
    };
    switch (state_cache.scalar_type()) {
      case at::kFloat:
        return run(float{});
      case at::kBFloat16:
        return run(c10::BFloat16{});
      default:
        return run(c10::Half{});
    }
  });
  return o;
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
        const float root = gdn::exp_rn(gate_sum[a]);
        for (int64_t r = 0; r < K; ++r) {
          for (int64_t c = 0; c < V; ++c) s[r * ps.inner + c] = gdn::mul_rn(root, s[r * ps.inner + c]);
        }
        for (uint64_t bits = anc[a]; bits != 0; bits &= bits - 1) {
          const int64_t j = gdn::lowest_bit(bits);
          load_row(k_ptr + ks.at(b, j, h), K, kf.data());
          const float coef = gdn::commit_coefficient(gate_sum[a], gate_sum[j],
                                                     gdn::row_factor(sum_sq(kf.data(), K), use_qk_l2norm, 1.0f));
          commit_rows(s, ps.inner, coef, kf.data(), u_ptr + ((b * n + j) * HV + hv) * V, K, V);
        }
      }
    });
  });
}

at::Tensor causal_conv1d_tree_cpu(const at::Tensor& x, const at::Tensor& parent, const at::Tensor& conv_state,
                                  const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                  c10::optional<c10::string_view> activation, bool /*validate: always on CPU*/,
                                  const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_tree";
  const ConvDims d = check_causal_conv1d_tree_args(x, parent, conv_state, weight, bias, slots);
  const int act = check_activation(op, activation);
  check_parent_values(op, parent);
  if (slots.has_value()) check_index_values(op, "slots", *slots, 0, d.rows);
  const at::Tensor rows =
      slots.has_value() ? slots->to(at::kLong).contiguous() : at::arange(d.batch, x.options().dtype(at::kLong));
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
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
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
            const scalar_t* sr = st_ptr + row_ptr[b] * C * (W - 1) + s;
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
                              at::Tensor& conv_state, bool /*validate: always on CPU*/,
                              const c10::optional<at::Tensor>& slots) {
  const char* op = "causal_conv1d_commit";
  const ConvDims d = check_causal_conv1d_commit_args(x, parent, last_accepted, conv_state, slots);
  check_parent_values(op, parent);
  check_index_values(op, "last_accepted", last_accepted, -1, d.nodes);
  if (slots.has_value()) {
    check_active_slot_values(op, *slots, last_accepted, d.rows);
    check_distinct_active_slots(op, *slots, last_accepted);
  }
  const at::Tensor rows =
      slots.has_value() ? slots->to(at::kLong).contiguous() : at::arange(d.batch, x.options().dtype(at::kLong));
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
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
          scalar_t* row = st_ptr + (row_ptr[b] * C + c) * (W - 1);
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
  m.impl("gdn_tree_verify_slots", &peagle::gdn_tree_verify_slots_cpu);
  m.impl("gdn_commit", &peagle::gdn_commit_cpu);
  m.impl("causal_conv1d_tree", &peagle::causal_conv1d_tree_cpu);
  m.impl("causal_conv1d_commit", &peagle::causal_conv1d_commit_cpu);
}

// A setting of the CPU kernels, not of a backend: no tensor to dispatch on.
TORCH_LIBRARY_IMPL(peagle, CompositeImplicitAutograd, m) {
  m.impl("set_gdn_cache_layers", &peagle::set_gdn_cache_layers);
}
