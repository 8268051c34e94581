"""`python cuda_tests/sanitizer_cases.py [cuda|cpu] [--without-graph-chain | --graph-chain-only]`: one small case of
every peagle op with a kernel for the device, meant to run under compute-sanitizer (memcheck, racecheck) from
cuda_tests/run_gpu.sh. Small shapes keep the sanitizers fast; each case still reaches every kernel of its op (several
tree shapes, dtypes, windows, padding). The graph chain's case captures CUDA graphs, which fails without torch's
caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1, under which the other cases run): the flags split it off.

Exits non-zero when an op with a kernel for the device has no case here, so a new kernel cannot skip the sanitizers.
The CPU test suite runs it on the CPU (python_tests/test_gpu_script.py): the cases stay valid inputs, and coverage
is checked on every machine.
"""

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peagle  # noqa: F401  (registers torch.ops.peagle)
from testkit import (
    gdn_inputs_to,
    random_edge_case,
    random_gdn_inputs,
    random_gdn_spec_inputs,
    random_packed_row,
    random_tree_batch,
    random_tree_probs,
    strided_gdn_inputs,
)
from testkit.depth_chain import ToyDrafter

OPS = torch.ops.peagle
DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
PART = sys.argv[2] if len(sys.argv) > 2 else "all"
if PART not in ("all", "--without-graph-chain", "--graph-chain-only"):
    sys.exit(f"the second argument must be --without-graph-chain or --graph-chain-only, got {PART!r}")
CASES: dict[str, Callable[[torch.Generator], None]] = {}


def case(*names: str):
    def register(fn):
        for name in names:
            CASES[name] = fn
        return fn

    return register


def dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


@case("cod_sample", "cod_gather", "cod_gather_backward")
def cod(generator):
    row = random_packed_row(generator, 300)
    anchors, depths = OPS.cod_sample(*dev(row.loss_mask, row.document_ids), 5, 0.7, 0.2, None, 3)
    for dtype, width in [(torch.float32, 24), (torch.bfloat16, 41)]:
        hidden = torch.randn(300, width, generator=generator).to(dtype).to(DEVICE)
        mask_hidden = torch.randn(width, generator=generator).to(dtype).to(DEVICE)
        feats, *_ = OPS.cod_gather(torch.arange(300, device=DEVICE), hidden, mask_hidden, anchors, depths, 7, None)
        OPS.cod_gather_backward(torch.randn_like(feats), anchors, depths, 300)


@case("mask_dense", "mask_block", "mask_slice_dense", "mask_slice_block")
def mask(generator):
    from peagle.ops import mask_slice_table

    row = random_packed_row(generator, 200)
    anchors, depths = OPS.cod_sample(*dev(row.loss_mask, row.document_ids), 4, 0.7, 0.2, None, 1)
    docs = row.document_ids.to(DEVICE)
    for window in (None, 16):
        OPS.mask_dense(anchors, depths, docs, window)
        OPS.mask_block(anchors, depths, docs, 32, window)
        table = mask_slice_table(256, 4, window, device=DEVICE)
        OPS.mask_slice_dense(table, anchors, depths, docs)
        OPS.mask_slice_block(table, anchors, depths, docs, 32)


@case("gdn_tree_verify_slots")
def gdn_slots(generator):
    # fp32 and q-dtype caches, two column tiles, a request writing its own start slot, -1 slots, and an unvalidated
    # call whose device slot claims find a slot written twice (those requests are skipped).
    for dtype, cache_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        x = random_gdn_inputs(generator, 3, 6, 2, 4, 24, 40, kind="random", dtype=dtype, pool_extra=0)
        cache = torch.randn(25, 4, 24, 40, generator=generator).to(cache_dtype).to(DEVICE)
        start = torch.tensor([20, 21, 22], device=DEVICE)
        dest = torch.arange(18, device=DEVICE).view(3, 6)
        dest[0, 0], dest[2, 5] = 20, -1
        OPS.gdn_tree_verify_slots(*dev(*x[:6]), cache, start, dest, None, True, True)
        if DEVICE.type == "cuda":  # the CPU validates every call: the conflict would raise there
            dest[1, 2] = 3
            OPS.gdn_tree_verify_slots(*dev(*x[:6]), cache, start, dest, None, True, False)


@case("gdn_spec_step")
def gdn_spec(generator):
    # vLLM's step: equal chains (views) and ragged ones with an empty last sequence (padded gathers), bf16 and fp32
    # caches.
    for lengths, state_dtype in [([4, 4], torch.bfloat16), ([3, 1, 0], torch.float32)]:
        args, state = random_gdn_spec_inputs(
            generator, lengths, heads=(2, 4, 24, 40), dtype=state_dtype, state_dtype=state_dtype
        )
        moved = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in args.items()}
        OPS.gdn_spec_step(initial_state_source=state.to(DEVICE), **moved)


@case("gdn_tree_verify", "gdn_commit", "causal_conv1d_tree", "causal_conv1d_commit")
def gdn(generator):
    for kind, dtype in [("random", torch.float32), ("chain", torch.bfloat16)]:
        x = random_gdn_inputs(generator, 3, 6, 2, 4, 16, 16, kind=kind, dtype=dtype)
        q, k, v, g, beta, parent, pool, slots = dev(*x)
        strided = strided_gdn_inputs(random_gdn_inputs(generator, 2, 33, 1, 4, 40, 36, kind=kind, dtype=dtype))
        for tensor_cores in (False, True):  # row strides, two column tiles, n > 32; exact and TF32 mma projections
            OPS.gdn_tree_verify(*gdn_inputs_to(strided, DEVICE), None, True, False, tensor_cores)
        _, u = OPS.gdn_tree_verify(q, k, v, g, beta, parent, pool, slots, None, True, True)
        last = torch.tensor([0, 5, 3], device=DEVICE)
        OPS.gdn_commit(k, g, u, parent, last, pool, slots, True, True)
        channels, width = 8, 4
        xs = torch.randn(3, 6, channels, generator=generator).to(dtype).to(DEVICE)
        state = torch.randn(3, channels, width - 1, generator=generator).to(dtype).to(DEVICE)
        weight = torch.randn(channels, width, generator=generator).to(DEVICE)
        OPS.causal_conv1d_tree(xs, parent, state, weight, None, "silu", True)
        OPS.causal_conv1d_commit(xs, parent, last, state, True)
        cache = torch.randn(7, channels, width - 1, generator=generator).to(dtype).to(DEVICE)  # rows named by slots
        rows = torch.tensor([5, 0, 2], device=DEVICE)
        OPS.causal_conv1d_tree(xs, parent, cache, weight, None, "silu", True, rows)
        OPS.causal_conv1d_commit(xs, parent, last, cache, True, rows)
        if DEVICE.type == "cuda":  # unvalidated, two requests on one row: the device claims (the CPU would raise)
            OPS.causal_conv1d_commit(xs, parent, last, cache, False, torch.tensor([5, 5, 2], device=DEVICE))


@case("tree_verify_greedy", "tree_rejection_sample")
def tree_verify(generator):
    # One vocabulary chunk, then three (the CUDA row phase reduces 4096 entries per block): both phases, the walk's
    # chunk-located correction sample (deterministic drafts) and its residual row (stochastic drafts).
    for chain, vocab in [(False, 50), (True, 50), (False, 2 * 4096 + 7)]:
        tree = random_tree_batch(generator, 4, 7, vocab, chain=chain)
        target = random_tree_probs(generator, tree, vocab)
        draft = random_tree_probs(generator, tree, vocab)
        args = dev(tree.parent, tree.tokens, tree.num_nodes, target)
        uniforms = torch.rand(4, 7, generator=generator).to(DEVICE)
        OPS.tree_verify_greedy(*args)
        OPS.tree_rejection_sample(*args, draft.to(DEVICE), None, 3, 0)
        OPS.tree_rejection_sample(*args, None, None, 3, 0)
        OPS.tree_rejection_sample(*args, draft.to(DEVICE), uniforms, 0, 0)
        OPS.tree_rejection_sample(*args, None, uniforms, 0, 0)


@case("tree_select", "tree_build_parallel", "tree_expand_topk")
def tree_build(generator):
    """Row top-k (radix select with ties: quantised rows, one longer than a block's stride), the Cartesian selection
    with and without a select (N below / above the candidate count), expansion and tree_select."""
    probs = torch.softmax(torch.randn(2, 3, 40, generator=generator), -1).to(DEVICE)
    OPS.tree_build_parallel(probs, [3, 2, 1], 8)
    OPS.tree_build_parallel(probs, [2, 2, 1], 20)
    tied = (torch.floor(torch.softmax(torch.randn(2, 2, 1500, generator=generator), -1) * 64) / 64).to(DEVICE)
    OPS.tree_build_parallel(tied, [4, 3], 9)
    frontier = torch.rand(2, 3, generator=generator, dtype=torch.float64).to(DEVICE)
    OPS.tree_expand_topk(frontier, probs, 2)
    OPS.tree_expand_topk(frontier[:, :2], tied, 5)
    cand_parent = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 2, device=DEVICE)
    cand_scores = torch.tensor([[1.0, 0.6, 0.3, 0.4, 0.1, 0.2]] * 2, dtype=torch.float64, device=DEVICE)
    cand_tokens = torch.tensor([[5, 1, 2, 3, 4, 6]] * 2, device=DEVICE)
    OPS.tree_select(cand_tokens, cand_parent, cand_scores, torch.tensor([6, 4], device=DEVICE), 4)


@case("kv_compact")
def kv(generator):
    blocks, block_size, heads, dim = 6, 4, 2, 8
    caches = [torch.randn(blocks, block_size, heads, dim, generator=generator).to(DEVICE) for _ in range(4)]
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]], device=DEVICE)
    seq_len = torch.tensor([2, 5], device=DEVICE)
    path = torch.tensor([[0, 2, 3, -1], [0, 1, -1, -1]], device=DEVICE)
    OPS.kv_compact(caches[:2], caches[2:], block_table, seq_len, path, torch.tensor([2, 1], device=DEVICE))


@case("efficient_lm_head")
def lm_head(generator):
    for dtype, rows in [(torch.float32, 3), (torch.bfloat16, 1)]:
        hidden, down, up, weight = (
            torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)
            for shape in [(rows, 32), (8, 32), (300, 8), (300, 32)]
        )
        OPS.efficient_lm_head(hidden, down, up, weight, 16)


@case("harness_decide")
def harness(generator):
    from peagle.ops import HarnessState, harness_decide

    f64 = dict(dtype=torch.float64, device=DEVICE)
    scores = torch.rand(3, 6, generator=generator, dtype=torch.float64).to(DEVICE)
    scores[1, 4:] = -torch.inf
    calibration = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]], **f64)
    widths = torch.tensor([1, 2, 4], device=DEVICE)
    state = HarnessState.start(3, DEVICE, 1e-3)
    for _ in range(2):
        harness_decide(scores, calibration, widths, torch.tensor([1e-3, 2e-3, 3e-3], **f64),
                       torch.linspace(1e-3, 1e-2, 17, **f64), state)  # fmt: skip


@case("harness_pass_decide")
def harness_pass(generator):
    from peagle.ops import harness_pass_decide, tree_build_parallel

    probs = torch.softmax(torch.randn(3, 4, 10, generator=generator), -1)
    spec = tree_build_parallel(probs, [3, 2, 1, 1], 12)
    calibration = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]], dtype=torch.float64)
    passes = torch.tensor([1e-3, 1.2e-3, 1.4e-3, 1.6e-3, 1.8e-3], dtype=torch.float64)
    args = (spec.scores, spec.depth, spec.num_nodes, calibration, passes, torch.linspace(1e-3, 1e-2, 13).double(), 4)
    harness_pass_decide(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))


@case("harness_observe")
def harness_observe_case(generator):
    from peagle.ops import harness_observe

    f64 = dict(dtype=torch.float64, device=DEVICE)
    calibration = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]], **f64)
    gamma, predicted = torch.tensor([1.0, 0.02, 1.5], **f64), torch.tensor([0.5, 3.0, 0.0], **f64)
    every, some = torch.tensor([2, 0, 1], device=DEVICE), torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    harness_observe(calibration, gamma, predicted, every, None, 0.9, (0.02, 1.5))
    harness_observe(calibration, gamma, predicted, some, torch.tensor([2, 0], device=DEVICE), 0.9, (0.02, 1.5))
    harness_observe(calibration, gamma, predicted, every[:0], every[:0], 0.9, (0.02, 1.5))  # no rows: no launch


@case("harness_edge_scores", "harness_edge_observe")
def harness_edge(generator):
    from peagle.ops import harness_edge_observe, harness_edge_scores

    for rows in ("all", "subset", "none"):  # a tree per request, some requests, none (the observe kernel's table only)
        case_ = random_edge_case(generator, 5, rows)
        on_device = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case_]
        path, q, kind = harness_edge_scores(*on_device[:6])
        _, parent, _, table, _, _, accepted_path, num_accepted, calibration, index = on_device
        harness_edge_observe(table, calibration, q, kind, path, parent, accepted_path, num_accepted, index, 0.99, 0.5)


def graph_chain(generator):
    """The graph chain's tail kernel (a catch-all op, so not in the coverage list): a few rounds of a toy drafter."""
    from peagle.decode.harness.graphs import DepthGraphChain

    drafter = ToyDrafter(3, 4, device=DEVICE)
    chain = DepthGraphChain(drafter.steps(), drafter.finalize, drafter.go)
    for seed in range(3):
        drafter.start_round([1, 2, 3], seed, stop_after=1 + seed)
        chain.run()
    chain.check()
    chain.close()


def deferred(generator):
    """The deferred checks' record kernels (set_deferred_checks / check_errors are composite, so not in the coverage
    list): bad inputs of a few op families in deferred mode (the CPU raises at once, CUDA from check_errors)."""
    from peagle.ops import check_errors, deferred_checks

    def expect_error(call, text):
        try:
            call()
            check_errors()
        except RuntimeError as error:
            assert text in str(error), error
        else:
            raise AssertionError(f"no deferred error: {text}")

    parent, tokens, num_nodes = dev(torch.tensor([[-1, 0, 0]]), torch.tensor([[0, 1, 1]]), torch.tensor([3]))
    target = torch.full((1, 3, 4), 0.25, device=DEVICE)
    x = random_gdn_inputs(generator, 2, 5, 1, 2, 8, 8)
    q, k, v, g, beta, gdn_parent, pool, slots = dev(*x)
    gdn_parent[1, 3] = 3
    hidden, anchors, depths = dev(torch.randn(6, 8), torch.tensor([0, 5]), torch.tensor([0, 1]))
    with deferred_checks():
        expect_error(lambda: OPS.tree_verify_greedy(parent, tokens, num_nodes, target), "sibling tokens must be")
        verify = (q, k, v, g, beta, gdn_parent, pool, slots, None, False, True)
        expect_error(lambda: OPS.gdn_tree_verify(*verify), "parent")
        u, last, shared = (
            torch.zeros(2, 5, 2, 8, device=DEVICE),
            torch.tensor([2, 0], device=DEVICE),
            slots[:1].repeat(2),
        )
        chain = torch.arange(-1, 4, device=DEVICE).repeat(2, 1)
        commit = (k, g, u, chain, last, pool, shared, False, False)  # unvalidated: the device slot claim
        expect_error(lambda: OPS.gdn_commit(*commit), "more than once")
        expect_error(
            lambda: OPS.cod_gather(torch.arange(6, device=DEVICE), hidden, hidden[0], anchors, depths, 7, None),
            "out of range",
        )
        docs = torch.zeros(6, dtype=torch.long, device=DEVICE)
        expect_error(lambda: OPS.mask_block(anchors, depths + 5, docs, 2, None), "is out of range for T")
        bad_row = torch.full((1, 2, 4), 0.25, device=DEVICE)
        bad_row[0, 1, 2] = 2.0
        expect_error(lambda: OPS.tree_build_parallel(bad_row, [2, 2], 4), "draft probabilities must be in [0, 1]")


def device_ops() -> list[str]:
    """The peagle ops with a kernel registered for DEVICE's dispatch key (composite helpers have none)."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("peagle::")]
    key = DEVICE.type.upper()
    return sorted(n.split("::")[1] for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, key))


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    if PART == "--graph-chain-only":
        cases = [graph_chain]
    else:
        cases = [*dict.fromkeys(CASES.values()), deferred] + ([graph_chain] if PART == "all" else [])
    for fn in cases:
        fn(generator)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        print(f"ran {fn.__name__}", flush=True)
    if PART == "--graph-chain-only":
        return 0
    missing = [name for name in device_ops() if name not in CASES]
    if missing:
        print(f"ops with a {DEVICE.type} kernel but no sanitizer case: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"sanitizer cases: {len(CASES)} ops covered on {DEVICE.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
