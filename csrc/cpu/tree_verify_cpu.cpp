// CPU kernels of the tree verification family: greedy tree verification and lossless tree rejection sampling.
// Parallel over requests; each request walks its tree from the root, reading only the rows of the nodes it visits.
// (Construction, the other tree family, is in tree_build_cpu.cpp.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks/tree.h"
#include "isa.h"
#include "peagle/tree.h"

namespace peagle {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct TreeView {
  const int64_t* parent;
  const int64_t* tokens;
  const int64_t* num_nodes;
  const float* target;
  int64_t target_batch_stride;
  const float* draft;  // nullptr: deterministic drafts
  int64_t draft_batch_stride;
  const float* uniforms;  // nullptr: Philox stream
  int64_t seed;
  int64_t offset;
  int64_t n_max;
  int64_t vocab;
};

struct OutputView {
  int64_t* path;
  int64_t* num_accepted;
  int64_t* emitted;
  int64_t* last;
  int64_t* errors;  // [B, 3]
};

struct Prepared {
  at::Tensor parent, tokens, num_nodes, target, draft, uniforms;
  at::Tensor path, num_accepted, emitted, last, errors;
  TreeView view;
  OutputView out;
};

Prepared prepare(const TreeShape& s, const at::Tensor& parent, const at::Tensor& tokens, const at::Tensor& num_nodes,
                 const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs,
                 const c10::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset) {
  Prepared p;
  p.parent = parent.to(at::kLong).contiguous();
  p.tokens = tokens.to(at::kLong).contiguous();
  p.num_nodes = num_nodes.to(at::kLong).contiguous();
  p.target = tree_rows(target_probs);
  if (draft_probs.has_value()) p.draft = tree_rows(*draft_probs);
  if (uniforms.has_value()) p.uniforms = uniforms->contiguous();
  const auto long_opts = parent.options().dtype(at::kLong);
  p.path = at::full({s.batch, s.nodes}, -1, long_opts);
  p.emitted = at::full({s.batch, s.nodes}, -1, long_opts);
  p.num_accepted = at::zeros({s.batch}, long_opts);
  p.last = at::zeros({s.batch}, long_opts);
  p.errors = at::zeros({s.batch, 3}, long_opts);
  p.view = TreeView{p.parent.data_ptr<int64_t>(),
                    p.tokens.data_ptr<int64_t>(),
                    p.num_nodes.data_ptr<int64_t>(),
                    p.target.data_ptr<float>(),
                    p.target.stride(0),
                    p.draft.defined() ? p.draft.data_ptr<float>() : nullptr,
                    p.draft.defined() ? p.draft.stride(0) : 0,
                    p.uniforms.defined() ? p.uniforms.data_ptr<float>() : nullptr,
                    seed,
                    offset,
                    s.nodes,
                    s.vocab};
  p.out = OutputView{p.path.data_ptr<int64_t>(), p.num_accepted.data_ptr<int64_t>(), p.emitted.data_ptr<int64_t>(),
                     p.last.data_ptr<int64_t>(), p.errors.data_ptr<int64_t>()};
  return p;
}

// The row argmax of argmax_rows.h for each instruction set (see isa.h).
namespace argmax_generic {
#define PEAGLE_ARGMAX_TARGET
#include "argmax_rows.h"  // NOLINT(build/include)
#undef PEAGLE_ARGMAX_TARGET
}  // namespace argmax_generic

#if defined(PEAGLE_CPU_X86)
namespace argmax_avx2 {
#define PEAGLE_ARGMAX_TARGET PEAGLE_CPU_AVX2
#include "argmax_rows.h"  // NOLINT(build/include)
#undef PEAGLE_ARGMAX_TARGET
}  // namespace argmax_avx2

namespace argmax_avx512 {
#define PEAGLE_ARGMAX_TARGET PEAGLE_CPU_AVX512
#include "argmax_rows.h"  // NOLINT(build/include)
#undef PEAGLE_ARGMAX_TARGET
}  // namespace argmax_avx512
#endif

bool row_argmax(const float* row, int64_t vocab, int64_t* index) {
  PEAGLE_CPU_DISPATCH(argmax_generic, argmax_avx2, argmax_avx512, argmax_avx512, row_argmax(row, vocab, index))
}

// Row argmaxes computed ahead of the walk (batches smaller than the thread count: one request per thread would leave
// threads idle, so every row of the real nodes is reduced in parallel first). found[b * n_max + i] is node i's argmax
// (or first NaN when nan[...] is set); only rows of nodes below num_nodes are read, and a row's NaN is an error only
// if the walk visits it, as without the precomputation.
struct RowArgmaxes {
  std::vector<int64_t> found;
  std::vector<char> nan;
};

RowArgmaxes all_row_argmaxes(const TreeView& v, int64_t batch) {
  RowArgmaxes r{std::vector<int64_t>(batch * v.n_max, 0), std::vector<char>(batch * v.n_max, 0)};
  at::parallel_for(0, batch * v.n_max, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t b = e / v.n_max, i = e % v.n_max;
      if (i >= v.num_nodes[b]) continue;  // padding (or a bad num_nodes, which the walk reports) is never read
      const float* row = v.target + b * v.target_batch_stride + i * v.vocab;
      r.nan[e] = !row_argmax(row, v.vocab, &r.found[e]);
    }
  });
  return r;
}

void verify_greedy_request(const TreeView& v, const OutputView& out, int64_t b, const RowArgmaxes* ahead) {
  const int64_t* parent = v.parent + b * v.n_max;
  const int64_t* tokens = v.tokens + b * v.n_max;
  const int64_t n = v.num_nodes[b];
  int64_t node = 0, detail = 0;
  const int32_t code = tree::check_request(parent, tokens, n, v.n_max, v.vocab, &node, &detail);
  if (code != tree::kOk) return tree::set_error(out.errors, b, code, node, detail);
  int64_t* path = out.path + b * v.n_max;
  int64_t* emitted = out.emitted + b * v.n_max;
  int64_t cur = 0, count = 0;
  path[0] = 0;
  while (true) {
    const float* row = v.target + b * v.target_batch_stride + cur * v.vocab;
    int64_t best_index = 0;
    const bool ok = ahead != nullptr ? !ahead->nan[b * v.n_max + cur] : row_argmax(row, v.vocab, &best_index);
    if (ahead != nullptr) best_index = ahead->found[b * v.n_max + cur];
    if (!ok) return tree::set_error(out.errors, b, tree::kTargetNaN, cur, best_index);
    const int64_t accepted = tree::child_with_token(parent, tokens, n, cur, best_index);
    if (accepted < 0) {
      emitted[count] = best_index;
      break;
    }
    emitted[count] = tokens[accepted];
    path[++count] = accepted;
    cur = accepted;
  }
  out.num_accepted[b] = count;
  out.last[b] = cur;
}

// Validates a probability row and returns its fixed-point sum (or sets the error and returns -1).
int64_t row_sum(const float* row, int64_t vocab, int32_t value_error, int32_t sum_error, const OutputView& out,
                int64_t b, int64_t node) {
  int64_t sum = 0;
  int32_t bad = 0;
  for (int64_t y = 0; y < vocab; ++y) {  // branch-free: the rare bad row is rescanned below
    const float p = row[y];
    const bool ok = tree::prob_ok(p);
    bad |= !ok;
    sum += tree::fixed(ok ? p : 0.0f);
  }
  tree::SumPartial whole{sum, tree::kNoIndex};
  if (bad) {
    int64_t y = 0;
    while (tree::prob_ok(row[y])) ++y;
    whole.first_bad = y;
  }
  int64_t detail = 0;
  const int32_t code = tree::row_check(whole, value_error, sum_error, &detail);
  if (code == tree::kOk) return sum;
  tree::set_error(out.errors, b, code, node, detail);
  return -1;
}

void rejection_sample_request(const TreeView& v, const OutputView& out, int64_t b, std::vector<int64_t>& residual,
                              std::vector<int64_t>& removed) {
  const int64_t* parent = v.parent + b * v.n_max;
  const int64_t* tokens = v.tokens + b * v.n_max;
  const int64_t n = v.num_nodes[b];
  int64_t node = 0, detail = 0;
  const int32_t code = tree::check_request(parent, tokens, n, v.n_max, v.vocab, &node, &detail);
  if (code != tree::kOk) return tree::set_error(out.errors, b, code, node, detail);
  const bool stochastic = v.draft != nullptr;
  const int64_t V = v.vocab;
  auto uniform = [&](int64_t index, int64_t* value) {
    if (tree::draw_uniform24(v.uniforms, v.n_max, v.seed, v.offset, b, index, value)) return true;
    tree::set_error(out.errors, b, tree::kUniform, index, 0);
    return false;
  };

  int64_t* path = out.path + b * v.n_max;
  int64_t* emitted = out.emitted + b * v.n_max;
  int64_t cur = 0, count = 0;
  path[0] = 0;
  while (true) {
    const float* p = v.target + b * v.target_batch_stride + cur * V;
    const int64_t target_sum = row_sum(p, V, tree::kTargetValue, tree::kTargetSum, out, b, cur);
    if (target_sum < 0) return;
    const int64_t first_child = tree::next_child(parent, n, cur, cur);
    const float* q = nullptr;
    int64_t draft_mass = 0;
    if (stochastic && first_child >= 0) {
      q = v.draft + b * v.draft_batch_stride + cur * V;
      draft_mass = row_sum(q, V, tree::kDraftValue, tree::kDraftSum, out, b, cur);
      if (draft_mass < 0) return;
      for (int64_t y = 0; y < V; ++y) residual[y] = tree::fixed(p[y]);
    }
    int64_t mass = target_sum;   // M = sum(r)
    bool residual_live = false;  // stochastic: r lives in `residual` once a child was rejected
    removed.clear();
    int64_t accepted = -1;
    for (int64_t j = first_child; j >= 0; j = tree::next_child(parent, n, cur, j)) {
      const int64_t x = tokens[j];
      int64_t u = 0;
      if (!uniform(j, &u)) return;
      if (q == nullptr) {
        const int64_t rx = tree::fixed(p[x]);  // siblings are distinct: x was not removed
        if (tree::accept(u, mass, rx)) {
          accepted = j;
          break;
        }
        mass -= rx;
        removed.push_back(x);
      } else {
        const int64_t qx = tree::fixed(q[x]);
        const double scale = tree::draft_scale(mass, draft_mass);
        if (tree::accept(u, tree::scaled_draft(qx, scale), residual[x])) {
          accepted = j;
          break;
        }
        // r <- max(0, r - M q~); the rejected token's residual is exactly zero.
        int64_t next_mass = 0;
        for (int64_t y = 0; y < V; ++y) {
          const int64_t r = std::max<int64_t>(0, residual[y] - tree::scaled_draft(tree::fixed(q[y]), scale));
          residual[y] = y == x ? 0 : r;
          next_mass += residual[y];
        }
        mass = next_mass;
        draft_mass -= qx;
        residual_live = true;
      }
    }
    if (accepted >= 0) {
      emitted[count] = tokens[accepted];
      path[++count] = accepted;
      cur = accepted;
      continue;
    }
    // Correction (some child rejected) or bonus (leaf): sample from r / sum(r); from the target if r vanished.
    int64_t u = 0;
    if (!uniform(0, &u)) return;
    std::sort(removed.begin(), removed.end());
    const bool from_residual = mass > 0;
    const int64_t target = tree::sample_target(u, from_residual ? mass : target_sum);
    int64_t acc = 0, sample = V - 1;
    size_t next_removed = 0;
    for (int64_t y = 0; y < V; ++y) {
      int64_t r;
      if (from_residual && residual_live) {
        r = residual[y];
      } else {
        r = tree::fixed(p[y]);
        if (from_residual && next_removed < removed.size() && removed[next_removed] == y) {
          r = 0;
          ++next_removed;
        }
      }
      acc += r;
      if (acc > target) {
        sample = y;
        break;
      }
    }
    emitted[count] = sample;
    break;
  }
  out.num_accepted[b] = count;
  out.last[b] = cur;
}

void finish(const char* op, const Prepared& p, const at::Tensor& parent, const at::Tensor& tokens,
            const at::Tensor& num_nodes, const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs,
            const c10::optional<at::Tensor>& uniforms) {
  raise_tree_error(op, p.errors, parent, tokens, num_nodes, target_probs, draft_probs, uniforms);
}

Outputs tree_verify_greedy_cpu(const at::Tensor& parent, const at::Tensor& tokens, const at::Tensor& num_nodes,
                               const at::Tensor& target_probs) {
  const char* op = "tree_verify_greedy";
  const TreeShape s = check_tree_args(op, parent, tokens, num_nodes, target_probs);
  Prepared p = prepare(s, parent, tokens, num_nodes, target_probs, c10::nullopt, c10::nullopt, 0, 0);
  if (s.batch < at::get_num_threads()) {  // fewer requests than threads: the rows are reduced in parallel first
    const RowArgmaxes ahead = all_row_argmaxes(p.view, s.batch);
    for (int64_t b = 0; b < s.batch; ++b) verify_greedy_request(p.view, p.out, b, &ahead);
  } else {
    at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) verify_greedy_request(p.view, p.out, b, nullptr);
    });
  }
  finish(op, p, parent, tokens, num_nodes, target_probs, c10::nullopt, c10::nullopt);
  return {p.path, p.num_accepted, p.emitted, p.last};
}

Outputs tree_rejection_sample_cpu(const at::Tensor& parent, const at::Tensor& tokens, const at::Tensor& num_nodes,
                                  const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs,
                                  const c10::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset) {
  const char* op = "tree_rejection_sample";
  const TreeShape s = check_tree_args(op, parent, tokens, num_nodes, target_probs, draft_probs, uniforms);
  Prepared p = prepare(s, parent, tokens, num_nodes, target_probs, draft_probs, uniforms, seed, offset);
  // Small requests are cheap: hand several to each task.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, s.vocab * 4));
  at::parallel_for(0, s.batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> residual(p.view.draft != nullptr ? s.vocab : 0);
    std::vector<int64_t> removed;
    removed.reserve(s.nodes);
    for (int64_t b = begin; b < end; ++b) rejection_sample_request(p.view, p.out, b, residual, removed);
  });
  finish(op, p, parent, tokens, num_nodes, target_probs, draft_probs, uniforms);
  return {p.path, p.num_accepted, p.emitted, p.last};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("tree_verify_greedy", &peagle::tree_verify_greedy_cpu);
  m.impl("tree_rejection_sample", &peagle::tree_rejection_sample_cpu);
}
