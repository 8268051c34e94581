// Every peagle op schema, in one place. Backends register their kernels with TORCH_LIBRARY_IMPL in csrc/cpu and
// csrc/cuda; fake (meta) kernels and autograd formulas are registered from Python (peagle/ops).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(peagle, m) {
  // COD sampling of training elements (anchor, depth) for a packed row of T positions.
  m.def(
      "cod_sample(Tensor loss_mask, Tensor document_ids, int num_depths, float ratio, float ratio_min, "
      "int? max_anchors, int seed) -> (Tensor anchors, Tensor depths)");
  // Fused gather of drafter inputs for COD elements: real token/hidden at depth 0, mask token/mask_hidden deeper.
  // feats comes first so that generic harnesses (opcheck) that sum the outputs start from a floating tensor.
  m.def(
      "cod_gather(Tensor input_ids, Tensor hidden, Tensor mask_hidden, Tensor anchors, Tensor depths, "
      "int mask_token_id, int? vocab_size=None) -> (Tensor feats, Tensor ids, Tensor position_ids, "
      "Tensor label_index)");
  m.def(
      "cod_gather_backward(Tensor grad_feats, Tensor anchors, Tensor depths, int num_positions) -> "
      "(Tensor grad_hidden, Tensor grad_mask_hidden)");

  // Attention masks: the P-EAGLE predicate (DESIGN.md) as a dense boolean mask for SDPA/eager attention, and as the
  // block-sparse tensors of a flex-attention BlockMask (per q block: partial kv blocks, then full kv blocks).
  m.def("mask_dense(Tensor anchors, Tensor depths, Tensor document_ids, int? window=None) -> Tensor");
  m.def(
      "mask_block(Tensor anchors, Tensor depths, Tensor document_ids, int block_size=128, int? window=None) -> "
      "(Tensor kv_num_blocks, Tensor kv_indices, Tensor full_kv_num_blocks, Tensor full_kv_indices)");
  // The same masks sliced out of a table precomputed once per maximum length (the paper's amortized construction):
  // table[d, a] = the lowest depth-0 anchor that element (a, d) may see (the window's bound; 0 without one).
  m.def("mask_slice_dense(Tensor table, Tensor anchors, Tensor depths, Tensor document_ids) -> Tensor");
  m.def(
      "mask_slice_block(Tensor table, Tensor anchors, Tensor depths, Tensor document_ids, int block_size=128) -> "
      "(Tensor kv_num_blocks, Tensor kv_indices, Tensor full_kv_num_blocks, Tensor full_kv_indices)");

  // Gated DeltaNet: tree verification of GDN layers (closed form over the tree, no per-node states), commit of the
  // last accepted node's state into the pool, and the causal conv1d in front of GDN over a tree and its commit.
  // validate=False skips the value checks that need a host synchronisation on CUDA (parent/slot/last_accepted
  // ranges; CUDA graph capture cannot synchronise): the kernels then guard themselves (NaN outputs / no commit for a
  // request with bad indices). Shape/dtype/device checks always run; the CPU backend always validates values.
  // gdn_tree_verify's tensor_cores=True runs the state projections on TF32 tensor cores where CUDA has them (close to
  // the exact fp32 path, not bit-identical); elsewhere, and on the CPU, it is ignored.
  m.def(
      "gdn_tree_verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor parent, Tensor state_pool, "
      "Tensor slots, float? scale=None, bool use_qk_l2norm=False, bool validate=True, bool tensor_cores=False) -> "
      "(Tensor o, Tensor u)");
  // gdn_tree_verify_slots: verification that reads each request's start state from a state cache (float32 or q's
  // dtype) at start_slots[b] and writes the state after every node i with state_slots[b, i] >= 0 into that slot, in
  // place (vLLM's speculative GDN step keeps the state after each draft in its own slot). Returns the outputs.
  m.def(
      "gdn_tree_verify_slots(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor parent, "
      "Tensor(a!) state_cache, Tensor start_slots, Tensor state_slots, float? scale=None, bool use_qk_l2norm=False, "
      "bool validate=True) -> Tensor");
  // gdn_spec_step: vLLM's speculative GDN step by vLLM's argument names (its fused_sigmoid_gating_delta_rule_update
  // contract): the sigmoid gates from a, b, A_log and dt_bias, then one gdn_tree_verify_slots over the chains of
  // cu_seqlens, sequence s starting from slot spec_state_indices[s, num_accepted_tokens[s] - 1] and leaving the state
  // after its token t in slot spec_state_indices[s, t]. Returns the outputs [T, HV, V] in v's dtype.
  m.def(
      "gdn_spec_step(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
      "Tensor(a!) initial_state_source, Tensor spec_state_indices, Tensor num_accepted_tokens, Tensor cu_seqlens, "
      "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor");
  // set_gdn_cache_layers: how many GDN layers' state caches one serving step writes (the CPU kernels stream the
  // states they write past the caches when that many calls' states would not fit the last-level cache). Returns the
  // previous value (2 until set).
  m.def("set_gdn_cache_layers(int layers) -> int");
  m.def(
      "gdn_commit(Tensor k, Tensor g, Tensor u, Tensor parent, Tensor last_accepted, Tensor(a!) state_pool, "
      "Tensor slots, bool use_qk_l2norm=False, bool validate=True) -> ()");
  // The conv pair's slots (optional): conv_state is then a cache [P, C, W - 1] whose row slots[b] request b reads
  // and commits into, in place (no gathered copy of the conv states).
  m.def(
      "causal_conv1d_tree(Tensor x, Tensor parent, Tensor conv_state, Tensor weight, Tensor? bias=None, "
      "str? activation=None, bool validate=True, Tensor? slots=None) -> Tensor");
  m.def(
      "causal_conv1d_commit(Tensor x, Tensor parent, Tensor last_accepted, Tensor(a!) conv_state, "
      "bool validate=True, Tensor? slots=None) -> ()");

  // Tree verification. A batch of draft trees padded to n_max nodes: parent/tokens [B, n_max], num_nodes [B],
  // target_probs (and draft_probs) [B, n_max, V] float32. Outputs: accepted path [B, n_max] (node indices from the
  // root, -1 padded), number of accepted drafts [B], emitted tokens [B, n_max] (accepted drafts + one bonus/correction,
  // -1 padded), last accepted node [B].
  m.def(
      "tree_verify_greedy(Tensor parent, Tensor tokens, Tensor num_nodes, Tensor target_probs) -> "
      "(Tensor accepted_path, Tensor num_accepted, Tensor emitted_tokens, Tensor last_node)");
  m.def(
      "tree_rejection_sample(Tensor parent, Tensor tokens, Tensor num_nodes, Tensor target_probs, "
      "Tensor? draft_probs=None, Tensor? uniforms=None, int seed=0, int offset=0) -> "
      "(Tensor accepted_path, Tensor num_accepted, Tensor emitted_tokens, Tensor last_node)");
  // Tree construction. Outputs of a built tree (N = num_nodes): tokens, parent, depth (= position offset) [B, N] (-1
  // padded), num_nodes [B], path scores [B, N] float64, ancestor-or-self mask [B, N, N] bool and bit-packed
  // [B, N, ceil(N/32)] int32 (bit j % 32 of word j / 32), root-to-leaf paths [B, N, L] (-1 padded) and their count [B].
  m.def(
      "tree_select(Tensor cand_tokens, Tensor cand_parent, Tensor cand_scores, Tensor num_candidates, int num_nodes) "
      "-> (Tensor tokens, Tensor parent, Tensor depth, Tensor num_nodes, Tensor scores, Tensor mask, "
      "Tensor mask_packed, Tensor paths, Tensor num_paths)");
  m.def(
      "tree_build_parallel(Tensor draft_probs, int[] topk, int num_nodes) -> (Tensor tokens, Tensor parent, "
      "Tensor depth, Tensor num_nodes, Tensor scores, Tensor mask, Tensor mask_packed, Tensor paths, "
      "Tensor num_paths)");
  m.def(
      "tree_expand_topk(Tensor frontier_scores, Tensor child_probs, int topk) -> (Tensor tokens, Tensor frontier_slot, "
      "Tensor scores)");

  // Accepted-path KV compaction of a paged cache (all layers' k/v caches at once), in place; seq_len += accepted + 1.
  m.def(
      "kv_compact(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor block_table, Tensor(c!) seq_len, "
      "Tensor accepted_path, Tensor num_accepted) -> ()");

  // Efficient LM head (peagle/ops/lm_head.py): low-rank scores up @ (down @ h) over the whole vocabulary, the top
  // num_candidates per row (score descending, ties to the lower id), and their exact logits weight[ids] @ h, without
  // [N, V] scores or logits in the kernels. Outputs: candidate ids [N, C] int64, candidate logits [N, C] float32.
  m.def(
      "efficient_lm_head(Tensor hidden, Tensor down, Tensor up, Tensor weight, int num_candidates) -> "
      "(Tensor candidate_ids, Tensor candidate_logits)");
  // Harness decision of one draft depth (math: csrc/include/peagle/harness.h). Reads the candidates' path scores
  // [B, F] (-inf padding), calibration sums [B, 2], the cost-table row (widths [W], draft_cost [W], verify_cost
  // [M + 1]); updates the running state (expected, draft_time, num_nodes) and writes the chosen width [B], stop [B]
  // (requests already stopped stay stopped) and go [1] in place: no outputs, so CUDA graphs can capture it.
  m.def(
      "harness_decide(Tensor frontier_scores, Tensor calibration, Tensor widths, Tensor draft_cost, "
      "Tensor verify_cost, Tensor(a!) expected, Tensor(b!) draft_time, Tensor(c!) num_nodes, Tensor(d!) width, "
      "Tensor(e!) stop, Tensor(f!) go) -> ()");
  // P-EAGLE pass decision (math: (5) of csrc/include/peagle/harness.h): from the candidate tree of a pass that drafted
  // drafted_depth depths (path scores [B, N], depths [B, N], num_nodes [B]), calibration sums [B, 2] and the cost
  // table's pass_time [P] and verify_cost [M + 1]: the verify budget [B], the next pass depth [B] and the budget's
  // predicted accepted drafts [B].
  m.def(
      "harness_pass_decide(Tensor scores, Tensor depth, Tensor num_nodes, Tensor calibration, Tensor pass_time, "
      "Tensor verify_cost, int drafted_depth) -> (Tensor budget, Tensor next_depth, Tensor predicted)");
  // Calibration update after a verified round (math: (6) of csrc/include/peagle/harness.h): for each row r, request
  // b = rows[r] (row r itself without rows; rows distinct) decays its (observed, predicted) sums calibration[b] and
  // adds accepted[r] and predicted[b], then moves its path-score exponent gamma[b]; in place, no outputs.
  m.def(
      "harness_observe(Tensor(a!) calibration, Tensor(b!) gamma, Tensor predicted, Tensor accepted, Tensor? rows, "
      "float decay, float gamma_min, float gamma_max) -> ()");
  // P-EAGLE edge calibration (math: (7) and (8) of csrc/include/peagle/harness.h). harness_edge_scores: from a
  // candidate tree (path scores [B, N], parent [B, N], num_nodes [B]) and the edge table (decayed sums [2, E], their
  // prior [2, E], bin thresholds [T]): each node's predicted acceptance [B, N] (the product of its path's calibrated
  // edges), its edge probability [B, N] and its kind of edge [B, N] (-1: root, padding). harness_edge_observe: folds a
  // verified round into the table and, per row r, request b = rows[r]'s (observed, predicted) sums, in place.
  m.def(
      "harness_edge_scores(Tensor scores, Tensor parent, Tensor num_nodes, Tensor table, Tensor prior, "
      "Tensor thresholds) -> (Tensor path, Tensor q, Tensor kind)");
  m.def(
      "harness_edge_observe(Tensor(a!) table, Tensor(b!) calibration, Tensor q, Tensor kind, Tensor path, "
      "Tensor parent, Tensor accepted_path, Tensor num_accepted, Tensor? rows, float edge_decay, float path_decay) "
      "-> ()");

  // Returns the CPU output blocks kept for reuse (see csrc/cpu/large_buffers.h) to the OS; bytes released. Takes no
  // tensor, so its one kernel is composite (registered in csrc/cpu/large_buffers.cpp).
  m.def("release_cpu_buffers() -> int");

  // Deferred checks (csrc/cpu/deferred_checks.cpp, peagle/ops/errors.py): while on, the CUDA kernels of the ops that
  // support it record their first bad value in a per-device error record instead of synchronising to raise;
  // check_errors() synchronises, raises that error with the immediate check's message and resets the record.
  // set_deferred_checks returns the previous mode.
  m.def("set_deferred_checks(bool enabled) -> bool");
  m.def("check_errors() -> ()");
}

// `import peagle._C` only needs to run the static registrations above and in the backend files.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "peagle C++/CUDA ops (torch.ops.peagle)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
