// Argument checks of harness_decide, shared by the CPU and CUDA launchers (same messages on both). The value checks
// (check_harness_values) need the data on the host: the CPU backend runs them, the CUDA backend skips them (no host
// synchronisation inside a round; the kernel treats bad entries as padding / a stopped request).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <vector>

#include "checks/common.h"

namespace peagle {

struct HarnessDims {
  int64_t batch, frontier, num_widths, max_nodes;
};

inline void check_harness_tensor(const char* name, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape,
                                 const char* layout, const at::Tensor& ref, const char* op = "harness_decide",
                                 const char* ref_name = "frontier_scores") {
  TORCH_CHECK(t.dim() == static_cast<int64_t>(shape.size()), "peagle.", op, ": ", name, " must be ", shape.size(),
              "-D ", layout, ", got shape ", shape_str(t));
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(shape[i] < 0 || t.size(static_cast<int64_t>(i)) == shape[i], "peagle.", op, ": ", name,
                " must have shape ", layout, ", got shape ", shape_str(t), " (dimension ", i, " must be ", shape[i],
                ")");
  }
  TORCH_CHECK(t.scalar_type() == dtype, "peagle.", op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "peagle.", op, ": ", name, " must be contiguous");
  check_same_device(op, name, t, ref, ref_name);
}

inline HarnessDims check_harness_decide_args(const at::Tensor& frontier_scores, const at::Tensor& calibration,
                                             const at::Tensor& widths, const at::Tensor& draft_cost,
                                             const at::Tensor& verify_cost, const at::Tensor& expected,
                                             const at::Tensor& draft_time, const at::Tensor& num_nodes,
                                             const at::Tensor& width, const at::Tensor& stop, const at::Tensor& go) {
  const auto& f = frontier_scores;
  check_harness_tensor("frontier_scores", f, at::kDouble, {-1, -1}, "[B, F]", f);
  const int64_t batch = f.size(0);
  check_harness_tensor("calibration", calibration, at::kDouble, {batch, 2}, "[B, 2] (observed, predicted)", f);
  check_harness_tensor("widths", widths, at::kLong, {-1}, "[W]", f);
  const int64_t num_widths = widths.size(0);
  TORCH_CHECK(num_widths >= 1, "peagle.harness_decide: widths must hold at least one width, got none");
  check_harness_tensor("draft_cost", draft_cost, at::kDouble, {num_widths}, "[W] (one per width)", f);
  check_harness_tensor("verify_cost", verify_cost, at::kDouble, {-1}, "[M + 1] (index = nodes)", f);
  TORCH_CHECK(verify_cost.size(0) >= 2, "peagle.harness_decide: verify_cost must cover at least 1 node (size >= 2), ",
              "got shape ", shape_str(verify_cost));
  check_harness_tensor("expected", expected, at::kDouble, {batch}, "[B]", f);
  check_harness_tensor("draft_time", draft_time, at::kDouble, {batch}, "[B]", f);
  check_harness_tensor("num_nodes", num_nodes, at::kLong, {batch}, "[B]", f);
  check_harness_tensor("width", width, at::kInt, {batch}, "[B]", f);
  check_harness_tensor("stop", stop, at::kInt, {batch}, "[B]", f);
  check_harness_tensor("go", go, at::kInt, {1}, "[1]", f);
  return HarnessDims{batch, f.size(1), num_widths, verify_cost.size(0) - 1};
}

// Values (CPU tensors): path scores -inf or in [0, 1]; calibration sums finite and >= 0; widths ascending and >= 1;
// costs finite and >= 0; running node counts in [1, M].
inline void check_harness_values(const HarnessDims& d, const double* scores, const double* calibration,
                                 const int64_t* widths, const double* draft_cost, const double* verify_cost,
                                 const int64_t* num_nodes) {
  const char* op = "peagle.harness_decide: ";
  for (int64_t i = 0; i < d.batch * d.frontier; ++i) {
    const double p = scores[i];
    TORCH_CHECK(p == -INFINITY || (p >= 0.0 && p <= 1.0), op, "frontier_scores must be -inf (padding) or in [0, 1], ",
                "got ", p, " at [", i / d.frontier, ", ", i % d.frontier, "]");
  }
  for (int64_t i = 0; i < 2 * d.batch; ++i) {
    TORCH_CHECK(std::isfinite(calibration[i]) && calibration[i] >= 0.0, op, "calibration must be finite and >= 0, got ",
                calibration[i], " at [", i / 2, ", ", i % 2, "]");
  }
  for (int64_t j = 0; j < d.num_widths; ++j) {
    TORCH_CHECK(widths[j] >= 1 && (j == 0 || widths[j] > widths[j - 1]), op,
                "widths must be >= 1 and strictly ascending, got ", widths[j], " at ", j);
    TORCH_CHECK(std::isfinite(draft_cost[j]) && draft_cost[j] >= 0.0, op, "draft_cost must be finite and >= 0, got ",
                draft_cost[j], " at ", j);
  }
  for (int64_t n = 0; n <= d.max_nodes; ++n) {
    TORCH_CHECK(std::isfinite(verify_cost[n]) && verify_cost[n] >= 0.0, op, "verify_cost must be finite and >= 0, got ",
                verify_cost[n], " at ", n);
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    TORCH_CHECK(num_nodes[b] >= 1 && num_nodes[b] <= d.max_nodes, op, "num_nodes must be in [1, M] = [1, ", d.max_nodes,
                "], got ", num_nodes[b], " at ", b);
  }
}

struct PassDims {
  int64_t batch, nodes, num_pass, max_nodes;
};

// harness_pass_decide: scores [B, N] float64, depth [B, N] int64, num_nodes [B] int64, calibration [B, 2] float64,
// pass_time [P] float64 (1 <= P <= kMaxPassDepth), verify_cost [M + 1] float64, 1 <= drafted_depth <= P.
inline PassDims check_harness_pass_args(const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& num_nodes,
                                        const at::Tensor& calibration, const at::Tensor& pass_time,
                                        const at::Tensor& verify_cost, int64_t drafted_depth, int64_t max_pass_depth) {
  const char* op = "harness_pass_decide";
  const auto check = [&](const char* name, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape,
                         const char* layout) {
    check_harness_tensor(name, t, dtype, shape, layout, scores, op, "scores");
  };
  check("scores", scores, at::kDouble, {-1, -1}, "[B, N]");
  const int64_t batch = scores.size(0), nodes = scores.size(1);
  TORCH_CHECK(nodes >= 1, "peagle.harness_pass_decide: scores must hold at least the root (N >= 1), got shape ",
              shape_str(scores));
  check("depth", depth, at::kLong, {batch, nodes}, "[B, N] (like scores)");
  check("num_nodes", num_nodes, at::kLong, {batch}, "[B]");
  check("calibration", calibration, at::kDouble, {batch, 2}, "[B, 2] (observed, predicted)");
  check("pass_time", pass_time, at::kDouble, {-1}, "[P] (one per pass depth)");
  const int64_t num_pass = pass_time.size(0);
  TORCH_CHECK(num_pass >= 1 && num_pass <= max_pass_depth, "peagle.harness_pass_decide: pass_time must hold 1 to ",
              max_pass_depth, " pass depths, got ", num_pass);
  check("verify_cost", verify_cost, at::kDouble, {-1}, "[M + 1] (index = nodes)");
  TORCH_CHECK(verify_cost.size(0) >= 2,
              "peagle.harness_pass_decide: verify_cost must cover at least 1 node (size >= 2), ", "got shape ",
              shape_str(verify_cost));
  TORCH_CHECK(drafted_depth >= 1 && drafted_depth <= num_pass,
              "peagle.harness_pass_decide: drafted_depth must be in [1, ", num_pass,
              "] (the pass depths pass_time has), got ", drafted_depth);
  return PassDims{batch, nodes, num_pass, verify_cost.size(0) - 1};
}

// Values (CPU tensors): num_nodes in [1, N]; the drafted nodes' scores in [0, 1] and depths in [1, drafted_depth];
// calibration sums and costs finite and >= 0.
inline void check_harness_pass_values(const PassDims& d, const double* scores, const int64_t* depth,
                                      const int64_t* num_nodes, const double* calibration, const double* pass_time,
                                      const double* verify_cost, int64_t drafted_depth) {
  const char* op = "peagle.harness_pass_decide: ";
  for (int64_t b = 0; b < d.batch; ++b) {
    TORCH_CHECK(num_nodes[b] >= 1 && num_nodes[b] <= d.nodes, op, "num_nodes must be in [1, N] = [1, ", d.nodes,
                "], got ", num_nodes[b], " at ", b);
    for (int64_t i = 1; i < num_nodes[b]; ++i) {
      const double p = scores[b * d.nodes + i];
      const int64_t k = depth[b * d.nodes + i];
      TORCH_CHECK(p >= 0.0 && p <= 1.0, op, "scores of drafted nodes must be in [0, 1], got ", p, " at [", b, ", ", i,
                  "]");
      TORCH_CHECK(k >= 1 && k <= drafted_depth, op, "depth of drafted nodes must be in [1, drafted_depth] = [1, ",
                  drafted_depth, "], got ", k, " at [", b, ", ", i, "]");
    }
    for (int64_t j = 0; j < 2; ++j) {
      const double c = calibration[2 * b + j];
      TORCH_CHECK(std::isfinite(c) && c >= 0.0, op, "calibration must be finite and >= 0, got ", c, " at [", b, ", ", j,
                  "]");
    }
  }
  for (int64_t k = 0; k < d.num_pass; ++k) {
    TORCH_CHECK(std::isfinite(pass_time[k]) && pass_time[k] >= 0.0, op, "pass_time must be finite and >= 0, got ",
                pass_time[k], " at ", k);
  }
  for (int64_t n = 0; n <= d.max_nodes; ++n) {
    TORCH_CHECK(std::isfinite(verify_cost[n]) && verify_cost[n] >= 0.0, op, "verify_cost must be finite and >= 0, got ",
                verify_cost[n], " at ", n);
  }
}

struct ObserveDims {
  int64_t batch, rows;
};

// harness_observe: calibration [B, 2] and gamma [B] float64 (updated in place), predicted [B] float64 (per request),
// accepted [R] int32 / int64 and rows [R] int64 (or none: R = B, row r = request r); decay in [0, 1] and
// 0 < gamma_min <= gamma_max, all finite.
inline ObserveDims check_harness_observe_args(const at::Tensor& calibration, const at::Tensor& gamma,
                                              const at::Tensor& predicted, const at::Tensor& accepted,
                                              const std::optional<at::Tensor>& rows, double decay, double gamma_min,
                                              double gamma_max) {
  const char* op = "harness_observe";
  const auto check = [&](const char* name, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape,
                         const char* layout) {
    check_harness_tensor(name, t, dtype, shape, layout, calibration, op, "calibration");
  };
  check("calibration", calibration, at::kDouble, {-1, 2}, "[B, 2] (observed, predicted)");
  const int64_t batch = calibration.size(0);
  check("gamma", gamma, at::kDouble, {batch}, "[B]");
  check("predicted", predicted, at::kDouble, {batch}, "[B] (per request)");
  if (rows.has_value()) check("rows", *rows, at::kLong, {-1}, "[R]");
  const int64_t count = rows.has_value() ? rows->size(0) : batch;
  check_integer(op, "accepted", accepted);
  check("accepted", accepted, accepted.scalar_type(), {count},
        rows.has_value() ? "[R] (one per row)" : "[B] (no rows)");
  TORCH_CHECK(std::isfinite(decay) && decay >= 0.0 && decay <= 1.0, "peagle.harness_observe: decay must be in [0, 1], ",
              "got ", decay);
  TORCH_CHECK(std::isfinite(gamma_min) && std::isfinite(gamma_max) && gamma_min > 0.0 && gamma_min <= gamma_max,
              "peagle.harness_observe: gamma_min and gamma_max must be finite with 0 < gamma_min <= gamma_max, got ",
              gamma_min, " and ", gamma_max);
  return ObserveDims{batch, count};
}

// Values (CPU tensors): rows distinct and in [0, B) (the kernels update each row's request independently).
inline void check_harness_observe_rows(const ObserveDims& d, const int64_t* rows) {
  std::vector<bool> seen(static_cast<size_t>(d.batch), false);
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t b = rows[r];
    TORCH_CHECK(b >= 0 && b < d.batch, "peagle.harness_observe: rows must be in [0, B) = [0, ", d.batch, "), got ", b,
                " at ", r);
    TORCH_CHECK(!seen[static_cast<size_t>(b)], "peagle.harness_observe: rows must be distinct, got ", b, " twice");
    seen[static_cast<size_t>(b)] = true;
  }
}

struct EdgeDims {
  int64_t batch, nodes, kinds, num_thresholds;
};

// The edge table's tensors: table and prior [2, E] float64 (rows accepted, drafted), thresholds [T] float64, with
// E = 2 (T + 1) kinds (first or later child, times the T + 1 bins).
inline int64_t check_edge_table(const char* op, const at::Tensor& table, const at::Tensor& prior,
                                const at::Tensor& thresholds, const at::Tensor& ref, const char* ref_name) {
  check_harness_tensor("table", table, at::kDouble, {2, -1}, "[2, E] (accepted, drafted)", ref, op, ref_name);
  const int64_t kinds = table.size(1);
  check_harness_tensor("prior", prior, at::kDouble, {2, kinds}, "[2, E] (like table)", ref, op, ref_name);
  check_harness_tensor("thresholds", thresholds, at::kDouble, {-1}, "[T]", ref, op, ref_name);
  TORCH_CHECK(kinds == 2 * (thresholds.size(0) + 1), "peagle.", op,
              ": table must have E = 2 * (T + 1) = ", 2 * (thresholds.size(0) + 1),
              " kinds for T = ", thresholds.size(0), " thresholds, got shape ", shape_str(table));
  return kinds;
}

// harness_edge_scores: scores [B, N] float64, parent [B, N] int64, num_nodes [B] int64, and the edge table.
inline EdgeDims check_harness_edge_scores_args(const at::Tensor& scores, const at::Tensor& parent,
                                               const at::Tensor& num_nodes, const at::Tensor& table,
                                               const at::Tensor& prior, const at::Tensor& thresholds) {
  const char* op = "harness_edge_scores";
  check_harness_tensor("scores", scores, at::kDouble, {-1, -1}, "[B, N]", scores, op, "scores");
  const int64_t batch = scores.size(0), nodes = scores.size(1);
  TORCH_CHECK(nodes >= 1, "peagle.harness_edge_scores: scores must hold at least the root (N >= 1), got shape ",
              shape_str(scores));
  check_harness_tensor("parent", parent, at::kLong, {batch, nodes}, "[B, N] (like scores)", scores, op, "scores");
  check_harness_tensor("num_nodes", num_nodes, at::kLong, {batch}, "[B]", scores, op, "scores");
  const int64_t kinds = check_edge_table(op, table, prior, thresholds, scores, "scores");
  return EdgeDims{batch, nodes, kinds, thresholds.size(0)};
}

// The edge table's values (CPU tensors): sums finite and >= 0, prior_drafted > 0 (no kind divides by zero),
// thresholds finite and strictly ascending.
inline void check_edge_table_values(const char* op, const EdgeDims& d, const double* table, const double* prior,
                                    const double* thresholds) {
  for (int64_t i = 0; i < 2 * d.kinds; ++i) {
    TORCH_CHECK(std::isfinite(table[i]) && table[i] >= 0.0, "peagle.", op, ": table must be finite and >= 0, got ",
                table[i], " at [", i / d.kinds, ", ", i % d.kinds, "]");
    const bool positive = i < d.kinds ? prior[i] >= 0.0 : prior[i] > 0.0;
    TORCH_CHECK(std::isfinite(prior[i]) && positive, "peagle.", op, ": prior must be finite, >= 0 (accepted) and > 0 ",
                "(drafted), got ", prior[i], " at [", i / d.kinds, ", ", i % d.kinds, "]");
  }
  for (int64_t j = 0; j < d.num_thresholds; ++j) {
    TORCH_CHECK(std::isfinite(thresholds[j]) && (j == 0 || thresholds[j] > thresholds[j - 1]), "peagle.", op,
                ": thresholds must be finite and strictly ascending, got ", thresholds[j], " at ", j);
  }
}

// Values of harness_edge_scores (CPU tensors): num_nodes in [1, N]; every real node i >= 1 has a parent in [0, i) and
// a score in [0, 1].
inline void check_harness_edge_scores_values(const EdgeDims& d, const double* scores, const int64_t* parent,
                                             const int64_t* num_nodes) {
  const char* op = "peagle.harness_edge_scores: ";
  for (int64_t b = 0; b < d.batch; ++b) {
    TORCH_CHECK(num_nodes[b] >= 1 && num_nodes[b] <= d.nodes, op, "num_nodes must be in [1, N] = [1, ", d.nodes,
                "], got ", num_nodes[b], " at ", b);
    for (int64_t i = 1; i < num_nodes[b]; ++i) {
      const int64_t up = parent[b * d.nodes + i];
      const double p = scores[b * d.nodes + i];
      TORCH_CHECK(up >= 0 && up < i, op, "parent of a real node i must be in [0, i), got ", up, " at [", b, ", ", i,
                  "]");
      TORCH_CHECK(p >= 0.0 && p <= 1.0, op, "scores of real nodes must be in [0, 1], got ", p, " at [", b, ", ", i,
                  "]");
    }
  }
}

struct EdgeObserveDims {
  int64_t batch, rows, nodes, path_len, kinds;
};

// harness_edge_observe: table [2, E] and calibration [B, 2] float64 (updated in place); q, path [R, N] float64, kind,
// parent [R, N] int64, accepted_path [R, L] int64, num_accepted [R] int64, rows [R] int64 (or none: R = B); decays in
// [0, 1].
inline EdgeObserveDims check_harness_edge_observe_args(const at::Tensor& table, const at::Tensor& calibration,
                                                       const at::Tensor& q, const at::Tensor& kind,
                                                       const at::Tensor& path, const at::Tensor& parent,
                                                       const at::Tensor& accepted_path, const at::Tensor& num_accepted,
                                                       const std::optional<at::Tensor>& rows, double edge_decay,
                                                       double path_decay) {
  const char* op = "harness_edge_observe";
  const auto check = [&](const char* name, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape,
                         const char* layout) {
    check_harness_tensor(name, t, dtype, shape, layout, table, op, "table");
  };
  check("table", table, at::kDouble, {2, -1}, "[2, E] (accepted, drafted)");
  check("calibration", calibration, at::kDouble, {-1, 2}, "[B, 2] (observed, predicted)");
  check("q", q, at::kDouble, {-1, -1}, "[R, N]");
  const int64_t count = q.size(0), nodes = q.size(1);
  check("kind", kind, at::kLong, {count, nodes}, "[R, N] (like q)");
  check("path", path, at::kDouble, {count, nodes}, "[R, N] (like q)");
  check("parent", parent, at::kLong, {count, nodes}, "[R, N] (like q)");
  check("accepted_path", accepted_path, at::kLong, {count, -1}, "[R, L]");
  check("num_accepted", num_accepted, at::kLong, {count}, "[R]");
  const int64_t batch = calibration.size(0);
  if (rows.has_value()) {
    check("rows", *rows, at::kLong, {count}, "[R] (one per row of q)");
  } else {
    TORCH_CHECK(count == batch, "peagle.harness_edge_observe: without rows, q must have one row per request of ",
                "calibration (R = B = ", batch, "), got shape ", shape_str(q));
  }
  TORCH_CHECK(std::isfinite(edge_decay) && edge_decay >= 0.0 && edge_decay <= 1.0,
              "peagle.harness_edge_observe: edge_decay must be in [0, 1], got ", edge_decay);
  TORCH_CHECK(std::isfinite(path_decay) && path_decay >= 0.0 && path_decay <= 1.0,
              "peagle.harness_edge_observe: path_decay must be in [0, 1], got ", path_decay);
  return EdgeObserveDims{batch, count, nodes, accepted_path.size(1), table.size(1)};
}

// Values of harness_edge_observe (CPU tensors): kinds in [-1, E); rows distinct and in [0, B).
inline void check_harness_edge_observe_values(const EdgeObserveDims& d, const int64_t* kind, const int64_t* rows) {
  for (int64_t i = 0; i < d.rows * d.nodes; ++i) {
    TORCH_CHECK(kind[i] >= -1 && kind[i] < d.kinds, "peagle.harness_edge_observe: kind must be in [-1, E) = [-1, ",
                d.kinds, "), got ", kind[i], " at [", i / d.nodes, ", ", i % d.nodes, "]");
  }
  if (rows == nullptr) return;
  std::vector<bool> seen(static_cast<size_t>(d.batch), false);
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t b = rows[r];
    TORCH_CHECK(b >= 0 && b < d.batch, "peagle.harness_edge_observe: rows must be in [0, B) = [0, ", d.batch, "), got ",
                b, " at ", r);
    TORCH_CHECK(!seen[static_cast<size_t>(b)], "peagle.harness_edge_observe: rows must be distinct, got ", b, " twice");
    seen[static_cast<size_t>(b)] = true;
  }
}

}  // namespace peagle
