// CPU kernels of the tree verification family: greedy tree verification and lossless tree rejection sampling.
// Parallel over requests; each request walks its tree from the root, reading only the rows of the nodes it visits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks/tree.h"
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

void set_error(const OutputView& out, int64_t b, int32_t code, int64_t node, int64_t detail) {
  out.errors[3 * b] = code;
  out.errors[3 * b + 1] = node;
  out.errors[3 * b + 2] = detail;
}

// Next child of `node` after node index `after` (children are tried in increasing index), or -1.
int64_t next_child(const int64_t* parent, int64_t n, int64_t node, int64_t after) {
  for (int64_t j = std::max(after + 1, node + 1); j < n; ++j) {
    if (parent[j] == node) return j;
  }
  return -1;
}

// First index of the row maximum (the smallest id on ties) in one lane-parallel pass that the compiler vectorises:
// each lane keeps its maximum and the first index reaching it. Returns false with the first NaN's index on NaN.
bool row_argmax(const float* row, int64_t vocab, int64_t* index) {
  constexpr int kLanes = 16;
  float lanes[kLanes];
  int32_t lane_index[kLanes];
  int32_t nan_lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    lanes[k] = -std::numeric_limits<float>::infinity();
    lane_index[k] = 0;
    nan_lanes[k] = 0;
  }
  const int64_t body = vocab - vocab % kLanes;
  for (int64_t y = 0; y < body; y += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float value = row[y + k];
      const bool greater = value > lanes[k];
      lanes[k] = greater ? value : lanes[k];
      lane_index[k] = greater ? static_cast<int32_t>(y + k) : lane_index[k];
      nan_lanes[k] |= value != value;
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = std::numeric_limits<int64_t>::max();
  int32_t any_nan = 0;
  for (int k = 0; k < kLanes; ++k) {
    if (lanes[k] > best || (lanes[k] == best && lane_index[k] < best_index)) {
      best = lanes[k];
      best_index = lane_index[k];
    }
    any_nan |= nan_lanes[k];
  }
  for (int64_t y = body; y < vocab; ++y) {
    if (row[y] > best) {
      best = row[y];
      best_index = y;
    }
    any_nan |= row[y] != row[y];
  }
  if (any_nan) {
    int64_t y = 0;
    while (row[y] == row[y]) ++y;
    *index = y;
    return false;
  }
  // A row of -inf only: no lane moved; the first index wins.
  *index = best == -std::numeric_limits<float>::infinity() ? 0 : best_index;
  return true;
}

void verify_greedy_request(const TreeView& v, const OutputView& out, int64_t b) {
  const int64_t* parent = v.parent + b * v.n_max;
  const int64_t* tokens = v.tokens + b * v.n_max;
  const int64_t n = v.num_nodes[b];
  int64_t node = 0, detail = 0;
  const int32_t code = tree::check_request(parent, tokens, n, v.n_max, v.vocab, &node, &detail);
  if (code != tree::kOk) return set_error(out, b, code, node, detail);
  int64_t* path = out.path + b * v.n_max;
  int64_t* emitted = out.emitted + b * v.n_max;
  int64_t cur = 0, count = 0;
  path[0] = 0;
  while (true) {
    const float* row = v.target + b * v.target_batch_stride + cur * v.vocab;
    int64_t best_index = 0;
    if (!row_argmax(row, v.vocab, &best_index)) return set_error(out, b, tree::kTargetNaN, cur, best_index);
    int64_t accepted = -1;
    for (int64_t j = next_child(parent, n, cur, cur); j >= 0; j = next_child(parent, n, cur, j)) {
      if (tokens[j] == best_index) {
        accepted = j;
        break;
      }
    }
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
  if (bad) {
    int64_t y = 0;
    while (tree::prob_ok(row[y])) ++y;
    set_error(out, b, value_error, node, y);
    return -1;
  }
  if (!tree::sum_ok(sum)) {
    set_error(out, b, sum_error, node, sum);
    return -1;
  }
  return sum;
}

void rejection_sample_request(const TreeView& v, const OutputView& out, int64_t b, std::vector<int64_t>& residual,
                              std::vector<int64_t>& removed) {
  const int64_t* parent = v.parent + b * v.n_max;
  const int64_t* tokens = v.tokens + b * v.n_max;
  const int64_t n = v.num_nodes[b];
  int64_t node = 0, detail = 0;
  const int32_t code = tree::check_request(parent, tokens, n, v.n_max, v.vocab, &node, &detail);
  if (code != tree::kOk) return set_error(out, b, code, node, detail);
  const bool stochastic = v.draft != nullptr;
  const int64_t V = v.vocab;
  auto uniform = [&](int64_t index, int64_t* value) {
    if (v.uniforms == nullptr) {
      *value = tree::philox_uniform24(v.seed, v.offset, b, index);
      return true;
    }
    const float u = v.uniforms[b * v.n_max + index];
    if (!tree::uniform_ok(u)) {
      set_error(out, b, tree::kUniform, index, 0);
      return false;
    }
    *value = tree::uniform24(u);
    return true;
  };

  int64_t* path = out.path + b * v.n_max;
  int64_t* emitted = out.emitted + b * v.n_max;
  int64_t cur = 0, count = 0;
  path[0] = 0;
  while (true) {
    const float* p = v.target + b * v.target_batch_stride + cur * V;
    const int64_t target_sum = row_sum(p, V, tree::kTargetValue, tree::kTargetSum, out, b, cur);
    if (target_sum < 0) return;
    const int64_t first_child = next_child(parent, n, cur, cur);
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
    for (int64_t j = first_child; j >= 0; j = next_child(parent, n, cur, j)) {
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
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) verify_greedy_request(p.view, p.out, b);
  });
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

// ---------------------------------------------------------------------------------------------------------------------
// Tree construction.

using TreeSpecOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor>;

struct SpecView {
  int64_t nodes;     // N
  int64_t path_len;  // L
  int64_t words;     // ceil(N / 32)
  int64_t* tokens;
  int64_t* parent;
  int64_t* depth;
  int64_t* num_nodes;
  double* scores;
  bool* mask;
  int32_t* packed;
  int64_t* paths;
  int64_t* num_paths;
};

struct SpecTensors {
  at::Tensor tokens, parent, depth, num_nodes, scores, mask, packed, paths, num_paths;
  SpecView view;
  TreeSpecOutputs tuple() const { return {tokens, parent, depth, num_nodes, scores, mask, packed, paths, num_paths}; }
};

SpecTensors make_spec(const at::TensorOptions& opts, int64_t batch, int64_t nodes, int64_t path_len) {
  SpecTensors t;
  const auto long_opts = opts.dtype(at::kLong);
  const int64_t words = (nodes + 31) / 32;
  t.tokens = at::full({batch, nodes}, -1, long_opts);
  t.parent = at::full({batch, nodes}, -1, long_opts);
  t.depth = at::full({batch, nodes}, -1, long_opts);
  t.num_nodes = at::zeros({batch}, long_opts);
  t.scores = at::zeros({batch, nodes}, opts.dtype(at::kDouble));
  t.mask = at::zeros({batch, nodes, nodes}, opts.dtype(at::kBool));
  t.packed = at::zeros({batch, nodes, words}, opts.dtype(at::kInt));
  t.paths = at::full({batch, nodes, path_len}, -1, long_opts);
  t.num_paths = at::zeros({batch}, long_opts);
  t.view = SpecView{nodes,
                    path_len,
                    words,
                    t.tokens.data_ptr<int64_t>(),
                    t.parent.data_ptr<int64_t>(),
                    t.depth.data_ptr<int64_t>(),
                    t.num_nodes.data_ptr<int64_t>(),
                    t.scores.data_ptr<double>(),
                    t.mask.data_ptr<bool>(),
                    t.packed.data_ptr<int32_t>(),
                    t.paths.data_ptr<int64_t>(),
                    t.num_paths.data_ptr<int64_t>()};
  return t;
}

struct Candidates {
  std::vector<int64_t> tokens, parent, depth, order, new_index;
  std::vector<double> scores;
  std::vector<uint8_t> has_child;
  void clear() {
    tokens.clear();
    parent.clear();
    scores.clear();
  }
  void push(int64_t token, int64_t par, double score) {
    tokens.push_back(token);
    parent.push_back(par);
    scores.push_back(score);
  }
};

// Validates the candidates of one request; returns the error code (detail: the candidate index).
int32_t check_candidates(const Candidates& c, int64_t* node) {
  const int64_t count = static_cast<int64_t>(c.tokens.size());
  if (c.parent[0] != -1) return tree::kCandidateRoot;
  for (int64_t i = 0; i < count; ++i) {
    *node = i;
    if (c.scores[i] != c.scores[i]) return tree::kCandidateScore;
    if (i == 0) continue;
    if (c.parent[i] < 0 || c.parent[i] >= i) return tree::kCandidateParent;
    if (c.scores[i] > c.scores[c.parent[i]]) return tree::kCandidateScore;
  }
  return tree::kBuildOk;
}

// Keeps the best N candidates (root included), orders them by depth then selection order and writes request b's tree.
void select_request(Candidates& c, const SpecView& out, int64_t b) {
  const int64_t count = static_cast<int64_t>(c.tokens.size());
  const int64_t keep = std::min(out.nodes, count);
  c.order.resize(count - 1);
  for (int64_t i = 1; i < count; ++i) c.order[i - 1] = i;
  auto by_score = [&](int64_t a, int64_t z) { return tree::score_before(c.scores[a], a, c.scores[z], z); };
  std::partial_sort(c.order.begin(), c.order.begin() + (keep - 1), c.order.end(), by_score);
  c.order.resize(keep - 1);
  c.order.insert(c.order.begin(), 0);
  c.depth.assign(count, 0);
  for (int64_t i = 1; i < count; ++i) c.depth[i] = c.depth[c.parent[i]] + 1;
  std::sort(c.order.begin(), c.order.end(), [&](int64_t a, int64_t z) {
    return tree::node_before(c.depth[a], c.scores[a], a, c.depth[z], c.scores[z], z);
  });
  c.new_index.assign(count, -1);
  for (int64_t k = 0; k < keep; ++k) c.new_index[c.order[k]] = k;
  c.has_child.assign(keep, 0);
  const int64_t n = out.nodes;
  bool* mask = out.mask + b * n * n;
  int32_t* packed = out.packed + b * n * out.words;
  for (int64_t k = 0; k < keep; ++k) {
    const int64_t i = c.order[k];
    const int64_t p = i == 0 ? -1 : c.new_index[c.parent[i]];
    out.tokens[b * n + k] = c.tokens[i];
    out.parent[b * n + k] = p;
    out.depth[b * n + k] = c.depth[i];
    out.scores[b * n + k] = c.scores[i];
    if (p >= 0) {
      c.has_child[p] = 1;
      std::copy(mask + p * n, mask + p * n + n, mask + k * n);
      std::copy(packed + p * out.words, packed + (p + 1) * out.words, packed + k * out.words);
    }
    mask[k * n + k] = true;
    packed[k * out.words + k / 32] |= static_cast<int32_t>(uint32_t{1} << (k % 32));
  }
  out.num_nodes[b] = keep;
  int64_t leaves = 0;
  for (int64_t k = 0; k < keep; ++k) {
    if (c.has_child[k]) continue;
    int64_t* path = out.paths + (b * n + leaves) * out.path_len;
    const int64_t d = out.depth[b * n + k];
    for (int64_t node = k, level = d; node >= 0; node = out.parent[b * n + node], --level) path[level] = node;
    ++leaves;
  }
  out.num_paths[b] = leaves;
}

void check_build_errors(const char* op, const at::Tensor& errors) {
  const int64_t* e = errors.data_ptr<int64_t>();
  for (int64_t b = 0; b < errors.size(0); ++b) {
    const int64_t code = e[3 * b], i = e[3 * b + 1], detail = e[3 * b + 2];
    switch (code) {
      case tree::kBuildOk:
        continue;
      case tree::kCandidateCount:
        TORCH_CHECK(false, "peagle.", op, ": num_candidates[", b, "] must be in [1, M], got ", detail);
      case tree::kCandidateRoot:
        TORCH_CHECK(false, "peagle.", op, ": cand_parent[", b, ", 0] must be -1 (candidate 0 is the root)");
      case tree::kCandidateParent:
        TORCH_CHECK(false, "peagle.", op, ": cand_parent[", b, ", ", i, "] must be in [0, ", i,
                    ") (parents come before their children)");
      case tree::kCandidateScore:
        TORCH_CHECK(false, "peagle.", op, ": cand_scores[", b, ", ", i,
                    "] must not be NaN and must not exceed its parent's score");
      case tree::kDraftRow:
        TORCH_CHECK(false, "peagle.", op, ": draft probabilities must be non-negative and not NaN, got a bad entry ",
                    "in row ", i, " of request ", b, " at token ", detail);
      default:
        TORCH_CHECK(false, "peagle.", op, ": internal error code ", code);
    }
  }
}

TreeSpecOutputs tree_select_cpu(const at::Tensor& cand_tokens, const at::Tensor& cand_parent,
                                const at::Tensor& cand_scores, const at::Tensor& num_candidates, int64_t num_nodes) {
  const char* op = "tree_select";
  check_rank(op, "cand_tokens", cand_tokens, 2, "[B, M]");
  check_rank(op, "cand_parent", cand_parent, 2, "[B, M]");
  check_rank(op, "cand_scores", cand_scores, 2, "[B, M]");
  check_rank(op, "num_candidates", num_candidates, 1, "[B]");
  check_integer(op, "cand_tokens", cand_tokens);
  check_integer(op, "cand_parent", cand_parent);
  check_integer(op, "num_candidates", num_candidates);
  TORCH_CHECK(c10::isFloatingType(cand_scores.scalar_type()), "peagle.tree_select: cand_scores must be floating, got ",
              cand_scores.scalar_type());
  TORCH_CHECK(cand_parent.sizes() == cand_tokens.sizes() && cand_scores.sizes() == cand_tokens.sizes(),
              "peagle.tree_select: cand_tokens, cand_parent and cand_scores must have the same shape [B, M], got ",
              shape_str(cand_tokens), ", ", shape_str(cand_parent), " and ", shape_str(cand_scores));
  const int64_t batch = cand_tokens.size(0), m = cand_tokens.size(1);
  TORCH_CHECK(num_candidates.size(0) == batch, "peagle.tree_select: num_candidates must have shape [", batch, "], got ",
              shape_str(num_candidates));
  TORCH_CHECK(m >= 1, "peagle.tree_select: need M >= 1 candidates (the root), got shape ", shape_str(cand_tokens));
  TORCH_CHECK(num_nodes >= 1, "peagle.tree_select: num_nodes must be >= 1, got ", num_nodes);
  check_same_device(op, "cand_parent", cand_parent, cand_tokens, "cand_tokens");
  check_same_device(op, "cand_scores", cand_scores, cand_tokens, "cand_tokens");
  check_same_device(op, "num_candidates", num_candidates, cand_tokens, "cand_tokens");
  const at::Tensor tok = cand_tokens.to(at::kLong).contiguous();
  const at::Tensor par = cand_parent.to(at::kLong).contiguous();
  const at::Tensor sc = cand_scores.to(at::kDouble).contiguous();
  const at::Tensor cnt = num_candidates.to(at::kLong).contiguous();
  SpecTensors out = make_spec(cand_tokens.options(), batch, num_nodes, num_nodes);
  at::Tensor errors = at::zeros({batch, 3}, cand_tokens.options().dtype(at::kLong));
  int64_t* err = errors.data_ptr<int64_t>();
  const int64_t* tok_p = tok.data_ptr<int64_t>();
  const int64_t* par_p = par.data_ptr<int64_t>();
  const double* sc_p = sc.data_ptr<double>();
  const int64_t* cnt_p = cnt.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Candidates c;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t count = cnt_p[b];
      if (count < 1 || count > m) {
        err[3 * b] = tree::kCandidateCount;
        err[3 * b + 2] = count;
        continue;
      }
      c.clear();
      for (int64_t i = 0; i < count; ++i) c.push(tok_p[b * m + i], par_p[b * m + i], sc_p[b * m + i]);
      int64_t node = 0;
      const int32_t code = check_candidates(c, &node);
      if (code != tree::kBuildOk) {
        err[3 * b] = code;
        err[3 * b + 1] = node;
        continue;
      }
      select_request(c, out.view, b);
    }
  });
  check_build_errors(op, errors);
  return out.tuple();
}

// Top-k token ids of a draft row (larger probability first, ties to the smaller id); false on a NaN/negative entry.
bool row_topk(const float* row, int64_t vocab, int64_t k, std::vector<int64_t>& ids, int64_t* bad) {
  for (int64_t y = 0; y < vocab; ++y) {
    if (!(row[y] >= 0.0f)) {
      *bad = y;
      return false;
    }
  }
  ids.resize(vocab);
  for (int64_t y = 0; y < vocab; ++y) ids[y] = y;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int64_t a, int64_t z) { return tree::prob_before(row[a], a, row[z], z); });
  ids.resize(k);
  return true;
}

TreeSpecOutputs tree_build_parallel_cpu(const at::Tensor& draft_probs, at::IntArrayRef topk, int64_t num_nodes) {
  const char* op = "tree_build_parallel";
  check_rank(op, "draft_probs", draft_probs, 3, "[B, K, V]");
  TORCH_CHECK(draft_probs.scalar_type() == at::kFloat, "peagle.tree_build_parallel: draft_probs must be float32, got ",
              draft_probs.scalar_type());
  const int64_t batch = draft_probs.size(0), depths = draft_probs.size(1), vocab = draft_probs.size(2);
  TORCH_CHECK(static_cast<int64_t>(topk.size()) == depths, "peagle.tree_build_parallel: topk must have one entry per ",
              "depth (K = ", depths, "), got ", topk.size());
  TORCH_CHECK(num_nodes >= 1, "peagle.tree_build_parallel: num_nodes must be >= 1, got ", num_nodes);
  int64_t candidates = 1, level = 1;
  for (const int64_t k : topk) {
    TORCH_CHECK(k >= 1 && k <= vocab, "peagle.tree_build_parallel: every topk entry must be in [1, V] = [1, ", vocab,
                "], got ", topk);
    level *= k;
    candidates += level;
    TORCH_CHECK(candidates <= (int64_t{1} << 24), "peagle.tree_build_parallel: the Cartesian candidate tree of topk ",
                topk, " has more than 2^24 nodes");
  }
  const at::Tensor probs = draft_probs.contiguous();
  const float* p = probs.data_ptr<float>();
  SpecTensors out = make_spec(draft_probs.options(), batch, num_nodes, std::min(num_nodes, depths + 1));
  at::Tensor errors = at::zeros({batch, 3}, draft_probs.options().dtype(at::kLong));
  int64_t* err = errors.data_ptr<int64_t>();
  const std::vector<int64_t> ks(topk.begin(), topk.end());
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Candidates c;
    std::vector<int64_t> ids;
    for (int64_t b = begin; b < end; ++b) {
      c.clear();
      c.push(-1, -1, 1.0);
      int64_t level_start = 0, level_count = 1;
      bool ok = true;
      for (int64_t d = 0; d < depths && ok; ++d) {
        const float* row = p + (b * depths + d) * vocab;
        int64_t bad = 0;
        if (!row_topk(row, vocab, ks[d], ids, &bad)) {
          err[3 * b] = tree::kDraftRow;
          err[3 * b + 1] = d;
          err[3 * b + 2] = bad;
          ok = false;
          break;
        }
        const int64_t next_start = static_cast<int64_t>(c.tokens.size());
        for (int64_t j = level_start; j < level_start + level_count; ++j) {
          for (const int64_t t : ids) c.push(t, j, tree::dmul(c.scores[j], static_cast<double>(row[t])));
        }
        level_start = next_start;
        level_count *= ks[d];
      }
      if (ok) select_request(c, out.view, b);
    }
  });
  check_build_errors(op, errors);
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_expand_topk_cpu(const at::Tensor& frontier_scores,
                                                                    const at::Tensor& child_probs, int64_t topk) {
  const char* op = "tree_expand_topk";
  check_rank(op, "frontier_scores", frontier_scores, 2, "[B, F]");
  check_rank(op, "child_probs", child_probs, 3, "[B, F, V]");
  TORCH_CHECK(child_probs.scalar_type() == at::kFloat, "peagle.tree_expand_topk: child_probs must be float32, got ",
              child_probs.scalar_type());
  TORCH_CHECK(c10::isFloatingType(frontier_scores.scalar_type()),
              "peagle.tree_expand_topk: frontier_scores must be floating, got ", frontier_scores.scalar_type());
  const int64_t batch = child_probs.size(0), width = child_probs.size(1), vocab = child_probs.size(2);
  TORCH_CHECK(frontier_scores.size(0) == batch && frontier_scores.size(1) == width,
              "peagle.tree_expand_topk: frontier_scores must have shape [", batch, ", ", width, "], got ",
              shape_str(frontier_scores));
  TORCH_CHECK(topk >= 1 && topk <= vocab, "peagle.tree_expand_topk: topk must be in [1, V] = [1, ", vocab, "], got ",
              topk);
  check_same_device(op, "child_probs", child_probs, frontier_scores, "frontier_scores");
  const at::Tensor probs = child_probs.contiguous();
  const at::Tensor scores = frontier_scores.to(at::kDouble).contiguous();
  const auto opts = child_probs.options();
  at::Tensor tokens = at::empty({batch, width * topk}, opts.dtype(at::kLong));
  at::Tensor slots = at::empty({batch, width * topk}, opts.dtype(at::kLong));
  at::Tensor out_scores = at::empty({batch, width * topk}, opts.dtype(at::kDouble));
  at::Tensor errors = at::zeros({batch, 3}, opts.dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const double* s = scores.data_ptr<double>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  double* sc = out_scores.data_ptr<double>();
  int64_t* err = errors.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> ids, flat_tok, order;
    std::vector<double> flat_score;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t m = width * topk;
      flat_tok.resize(m);
      flat_score.resize(m);
      bool ok = true;
      for (int64_t f = 0; f < width; ++f) {
        const float* row = p + (b * width + f) * vocab;
        int64_t bad = 0;
        if (!row_topk(row, vocab, topk, ids, &bad)) {
          err[3 * b] = tree::kDraftRow;
          err[3 * b + 1] = f;
          err[3 * b + 2] = bad;
          ok = false;
          break;
        }
        for (int64_t r = 0; r < topk; ++r) {
          flat_tok[f * topk + r] = ids[r];
          flat_score[f * topk + r] = tree::dmul(s[b * width + f], static_cast<double>(row[ids[r]]));
        }
      }
      if (!ok) continue;
      order.resize(m);
      for (int64_t i = 0; i < m; ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t z) { return tree::score_before(flat_score[a], a, flat_score[z], z); });
      for (int64_t i = 0; i < m; ++i) {
        tok[b * m + i] = flat_tok[order[i]];
        slot[b * m + i] = order[i] / topk;
        sc[b * m + i] = flat_score[order[i]];
      }
    }
  });
  check_build_errors(op, errors);
  return {tokens, slots, out_scores};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("tree_verify_greedy", &peagle::tree_verify_greedy_cpu);
  m.impl("tree_rejection_sample", &peagle::tree_rejection_sample_cpu);
  m.impl("tree_select", &peagle::tree_select_cpu);
  m.impl("tree_build_parallel", &peagle::tree_build_parallel_cpu);
  m.impl("tree_expand_topk", &peagle::tree_expand_topk_cpu);
}
