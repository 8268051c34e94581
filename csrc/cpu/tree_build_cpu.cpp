// CPU kernels of the tree construction family: P-EAGLE parallel trees (tree_build_parallel), the best-N selection of
// scored candidates (tree_select) and one EAGLE-2 expansion step (tree_expand_topk). Parallel over requests. The CUDA
// kernels (csrc/cuda/tree_build_kernels.cu) apply the same orders of csrc/include/peagle/tree.h and equal these.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "checks/tree.h"
#include "peagle/tree.h"

namespace peagle {
namespace {

using tree::SpecView;

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

TreeSpecOutputs tree_select_cpu(const at::Tensor& cand_tokens, const at::Tensor& cand_parent,
                                const at::Tensor& cand_scores, const at::Tensor& num_candidates, int64_t num_nodes) {
  const int64_t m = check_tree_select_args(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes);
  const int64_t batch = cand_tokens.size(0);
  const at::Tensor tok = cand_tokens.to(at::kLong).contiguous();
  const at::Tensor par = cand_parent.to(at::kLong).contiguous();
  const at::Tensor sc = cand_scores.to(at::kDouble).contiguous();
  const at::Tensor cnt = num_candidates.to(at::kLong).contiguous();
  TreeSpecTensors out = make_tree_spec(cand_tokens.options(), batch, num_nodes, num_nodes);
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
        tree::set_error(err, b, tree::kCandidateCount, 0, count);
        continue;
      }
      int64_t node = 0;
      const int32_t code = tree::check_candidates(par_p + b * m, sc_p + b * m, count, &node);
      if (code != tree::kBuildOk) {
        tree::set_error(err, b, code, node, 0);
        continue;
      }
      c.clear();
      for (int64_t i = 0; i < count; ++i) c.push(tok_p[b * m + i], par_p[b * m + i], sc_p[b * m + i]);
      select_request(c, out.view, b);
    }
  });
  raise_build_error("tree_select", errors);
  return out.tuple();
}

// Top-k token ids of a draft row (larger probability first, ties to the smaller id); false on a NaN/negative entry.
bool row_topk(const float* row, int64_t vocab, int64_t k, std::vector<int64_t>& ids, int64_t* bad) {
  for (int64_t y = 0; y < vocab; ++y) {
    if (!tree::draft_entry_ok(row[y])) {
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
  check_tree_build_parallel_args(draft_probs, topk, num_nodes);
  const int64_t batch = draft_probs.size(0), depths = draft_probs.size(1), vocab = draft_probs.size(2);
  const at::Tensor probs = draft_probs.contiguous();
  const float* p = probs.data_ptr<float>();
  TreeSpecTensors out = make_tree_spec(draft_probs.options(), batch, num_nodes, std::min(num_nodes, depths + 1));
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
          tree::set_error(err, b, tree::kDraftRow, d, bad);
          ok = false;
          break;
        }
        const int64_t next_start = static_cast<int64_t>(c.tokens.size());
        for (int64_t j = level_start; j < level_start + level_count; ++j) {
          for (const int64_t t : ids) c.push(t, j, tree::mul_rn(c.scores[j], static_cast<double>(row[t])));
        }
        level_start = next_start;
        level_count *= ks[d];
      }
      if (ok) select_request(c, out.view, b);
    }
  });
  raise_build_error(op, errors);
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_expand_topk_cpu(const at::Tensor& frontier_scores,
                                                                    const at::Tensor& child_probs, int64_t topk) {
  const char* op = "tree_expand_topk";
  check_tree_expand_topk_args(frontier_scores, child_probs, topk);
  const int64_t batch = child_probs.size(0), width = child_probs.size(1), vocab = child_probs.size(2);
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
      for (int64_t f = 0; f < width && ok; ++f) {
        if (!tree::frontier_score_ok(s[b * width + f])) {
          tree::set_error(err, b, tree::kFrontierScore, f, 0);
          ok = false;
        }
      }
      for (int64_t f = 0; f < width && ok; ++f) {
        const float* row = p + (b * width + f) * vocab;
        int64_t bad = 0;
        if (!row_topk(row, vocab, topk, ids, &bad)) {
          tree::set_error(err, b, tree::kDraftRow, f, bad);
          ok = false;
          break;
        }
        for (int64_t r = 0; r < topk; ++r) {
          flat_tok[f * topk + r] = ids[r];
          flat_score[f * topk + r] = tree::mul_rn(s[b * width + f], static_cast<double>(row[ids[r]]));
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
  raise_build_error(op, errors);
  return {tokens, slots, out_scores};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("tree_select", &peagle::tree_select_cpu);
  m.impl("tree_build_parallel", &peagle::tree_build_parallel_cpu);
  m.impl("tree_expand_topk", &peagle::tree_expand_topk_cpu);
}
