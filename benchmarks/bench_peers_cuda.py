"""peagle's CUDA kernels side by side with the strongest public kernels for the same work, where those are installed on
the GPU machine (skipped without CUDA). Ratios come from one run; nothing is asserted about time. Each case first checks
that peagle and the peer give the same answer on the same inputs, so that the times compare equal work:

- chains (B in {1, 16, 64} requests of K = 7 drafts, V = 151936) against flashinfer's ``chain_speculative_sampling``
  (sampled; agreement on one-hot rows, where sampling is deterministic: both must emit greedy verification's tokens)
  and against vLLM's rejection sampler (``rejection_sample``: its Triton kernels with the target rows gathered and the
  bonus token given; ``RejectionSampler.forward``: the whole step). Greedy: the same tokens; sampled: the same rows;
- GDN verification over the same chains at Qwen3-Next's GDN shapes (16 q/k heads, 32 value heads, K = V = 128, bf16)
  against FLA's ``fused_recurrent_gated_delta_rule`` (outputs allclose);
- COD sampling + gather at bench_cod.py's training shapes against speculators' P-EAGLE path (the gather equal on
  speculators' own elements, the element counts per depth alike);
- the per-sample block mask at bench_mask.py's shapes against ``torch.compile(create_block_mask)`` (no block empty
  that has an allowed pair, none full that has a disallowed one: the same attention).

A peer that does not import is a skipped case ("skipped: <package> not installed", shown by ``-rs``) and a row of the
summary table, which is printed at the end and written to $PEAGLE_PEERS_SUMMARY when set.

    PEAGLE_GPU_TIMINGS=1 bash cuda_tests/run_gpu.sh        # the opt-in timing stage; JSON and summary in $OUT
    python -m pytest benchmarks/bench_peers_cuda.py -q -rs --benchmark-json peers.json   # after a CUDA build
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

import pytest
import torch
from bench_cod import LENGTHS as COD_LENGTHS
from bench_cod import (
    MASK_ID,
    MAX_ANCHORS,
    NUM_DEPTHS,
    RATIO,
    RATIO_MIN,
    make_row,
    peagle_path,
    speculators_gather,
    speculators_path,
)
from bench_cod import WIDTH as COD_WIDTH
from bench_cod import speculators_data as speculators_cod
from bench_cod import speculators_sample as speculators_cod_sample
from bench_mask import BLOCK, BUILD_LENGTHS, compiled_create_block_mask, make_sample
from bench_tree_cuda import tree_inputs
from common import SKIPPED_PEERS, cuda_round_time, record_skipped_peer, skip_peer
from peers import import_peer, peer_name, vllm_rejection_sampler, vllm_sampling_metadata, vllm_spec_metadata

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import (
    BlockMaskBuilder,
    block_kinds,
    cod_gather,
    cod_sample,
    gdn_tree_verify,
    make_mask_mod,
    mask_block,
    tree_rejection_sample,
    tree_verify_greedy,
)
from peagle.ops.mask import EMPTY, FULL, MaskBlocks
from testkit import random_gdn_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"
ROUNDS = 10
BATCHES = [1, 16, 64]
DRAFTS, VOCAB = 7, 151936
GDN_HEADS = (16, 32, 128, 128)  # q/k heads, value heads, K, V of Qwen3-Next's GDN layers
ROWS: list[dict] = []  # the summary table: one row per timed (case, peer); the skipped ones are in SKIPPED_PEERS

NOTES = {
    "flashinfer": "flashinfer chains: `chain_speculative_sampling` on the same draft and target probabilities; "
    "peagle runs `tree_rejection_sample` with stochastic drafts (the same acceptance rule on a chain). Agreement is "
    "checked on one-hot rows, where both must emit greedy verification's tokens.",
    "vllm": "vLLM chains: `rejection_sample` is vLLM's core (its Triton kernels) with the target rows gathered and the "
    "bonus token given, `RejectionSampler.forward` the whole step (bonus sampling, logits gathers, softmax); peagle "
    "verifies the same logits in place (greedy: the argmax walk; sampled: a softmax, then the walk).",
    "fla": "GDN chains: FLA's `fused_recurrent_gated_delta_rule` kernel alone (q/k repeated to the value heads and the "
    "start states gathered from the pool beforehand, outside its time) against `gdn_tree_verify` on the chains "
    "(reading the pool through the slots, validate=False as in a CUDA graph); outputs allclose.",
    "speculators": "COD on the GPU: speculators' `generate_cod_sample_indices` plus the indexing its "
    "PEagleDraftModel.forward does, against `cod_sample` + `cod_gather`; the gather is checked equal on speculators' "
    "own elements (its chains anchored before position 0 left out) and the element counts per depth alike.",
    "create_block_mask": "Block masks on the GPU: `torch.compile(create_block_mask)` in steady state (compile time in "
    "extra_info compile_s) against `BlockMaskBuilder.build` (the same BlockMask); no block empty that has an allowed "
    "pair, none full that has a disallowed one.",
}


def sync() -> None:
    torch.cuda.synchronize()


def require(module: str, case: str, peer: str) -> object:
    """The peer's module, or a skipped case (and summary row) that names the package and why."""
    found, why = import_peer(module)
    if found is None:
        skip_peer(__file__, case, peer, why)
    return found


def first_results(case: str, peers: dict[str, Callable[[], object]]) -> dict[str, object]:
    """Each peer's first result. A peer whose interface is not the one called here is recorded as skipped with its
    error (and left out of the result); the case is skipped when none is left."""
    results, failures = {}, []
    for peer, fn in peers.items():
        try:
            results[peer] = fn()
        except Exception as err:  # the peer's own checks and signature errors, not ours: reported, not hidden
            why = f"{peer} failed on its interface as called here ({type(err).__name__}: {str(err)[:200]})"
            record_skipped_peer(__file__, case, peer, why)
            failures.append(why)
    if not results:
        pytest.skip("skipped: " + "; ".join(failures))
    return results


def call_peer(case: str, peer: str, fn: Callable[[], object]) -> object:
    """The peer's first result, or a skipped case (first_results)."""
    return first_results(case, {peer: fn})[peer]


def compare(
    benchmark, case: str, ours: Callable[[], object], peers: dict[str, Callable[[], object]], note: str, **info
) -> None:
    """Times each peer and peagle by the same protocol (a synchronisation after every call) and records the rows."""
    baselines = {name: cuda_round_time(fn, ROUNDS) for name, fn in peers.items()}
    benchmark.extra_info.update(impl="peagle", case=case, baselines=baselines, note=note, **info)
    benchmark.pedantic(lambda: (ours(), sync()), rounds=ROUNDS, warmup_rounds=1)
    mean = benchmark.stats.stats.mean
    for name, seconds in baselines.items():
        ROWS.append({"case": case, "peer": name, "peagle_ms": mean * 1e3, "peer_ms": seconds * 1e3})


@pytest.fixture(scope="module", autouse=True)
def summary_table():
    yield
    skipped = [row for row in SKIPPED_PEERS if row["source"] == os.path.basename(__file__)]
    if not ROWS and not skipped:
        return
    lines = ["| case | peer | peagle ms | peer ms | peagle vs peer |", "|---|---|---|---|---|"]
    for row in ROWS:
        ratio = row["peer_ms"] / row["peagle_ms"]
        verdict = f"{ratio:.2f}x faster" if ratio >= 1 else f"peagle loses: {1 / ratio:.2f}x slower"
        lines.append(f"| {row['case']} | {row['peer']} | {row['peagle_ms']:.3f} | {row['peer_ms']:.3f} | {verdict} |")
    lines += [f"| {row['case']} | {row['peer']} | | | skipped: {row['why']} |" for row in skipped]
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    path = os.environ.get("PEAGLE_PEERS_SUMMARY")
    if path:
        with open(path, "w") as out:
            out.write(table)


# ---------------------------------------------------------------------------------------------------------------------
# Chain verification.

_chains: dict = {}


def chains(batch: int):
    """(parent, tokens, num_nodes, target_probs), draft_probs [B, K + 1, V] on the device, and the host's chain: one
    batch size at a time (the largest target tensor is 311 MB)."""
    if batch not in _chains:
        _chains.clear()
        _chains[batch] = tree_inputs(batch, DRAFTS + 1, VOCAB, chain=True, device=DEVICE)
    return _chains[batch]


def one_hot(index: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(*index.shape, vocab, device=index.device).scatter_(-1, index[..., None].long(), 1.0)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}")
def test_chain_vs_flashinfer(benchmark, batch):
    case = f"cuda chain sampled B={batch} K={DRAFTS} V={VOCAB}"
    sampling = require("flashinfer.sampling", case, "flashinfer chain_speculative_sampling")
    peer = peer_name("flashinfer", "chain_speculative_sampling")
    (parent, tokens, num_nodes, target), draft, _ = chains(batch)
    draft_ids = tokens[:, 1:].int().contiguous()

    def theirs(draft_rows: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
        out = sampling.chain_speculative_sampling(draft_rows, draft_ids, target_rows)
        return out[0] if isinstance(out, tuple) else out  # [B, K + 1] int32, -1 after the first rejection

    # One-hot rows make both samplers deterministic: each must emit exactly greedy verification's tokens.
    greedy = tree_verify_greedy(parent, tokens, num_nodes, target).emitted_tokens
    target_1h = one_hot(target.argmax(-1), VOCAB)
    draft_1h = one_hot(tokens.roll(-1, dims=1), VOCAB)  # row i: node i's child is drawn surely; the leaf's is unused
    chain_draft_1h = draft_1h[:, :DRAFTS].contiguous()
    got = call_peer(case, peer, lambda: theirs(chain_draft_1h, target_1h))
    assert torch.equal(got.long(), greedy), "flashinfer and peagle's greedy verification disagree on one-hot rows"
    ours_1h = tree_rejection_sample(parent, tokens, num_nodes, target_1h, draft_1h, seed=1).emitted_tokens
    assert torch.equal(ours_1h, greedy), "peagle's sampler and its greedy verification disagree on one-hot rows"

    def ours():
        return tree_rejection_sample(parent, tokens, num_nodes, target, draft, seed=1)

    chain_draft = draft[:, :DRAFTS].contiguous()
    compare(
        benchmark,
        case,
        ours,
        {peer: lambda: theirs(chain_draft, target)},
        NOTES["flashinfer"],
        mean_accepted=float(ours().num_accepted.float().mean()),  # random draws: alike, not equal
        peer_mean_accepted=float(((theirs(chain_draft, target) >= 0).sum(1) - 1).float().mean()),
    )


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_chain_vs_vllm(benchmark, mode, batch):
    case = f"cuda chain {mode} B={batch} K={DRAFTS} V={VOCAB}"
    module = require("vllm.v1.sample.rejection_sampler", case, "vllm rejection sampler")
    (parent, tokens, num_nodes, target), draft, chain = chains(batch)
    greedy = mode == "greedy"
    logits = target.log()  # [B, K + 1, V]: the rows of the target after each node
    flat = logits.clone().view(batch * (DRAFTS + 1), VOCAB)  # vLLM's own copy: it may update its logits in place

    def setup():
        return vllm_spec_metadata(chain.tokens, DEVICE), vllm_sampling_metadata(batch, greedy, DEVICE)

    meta, sampling = call_peer(case, peer_name("vllm", "metadata"), setup)
    vllm_draft = None if greedy else draft[:, :DRAFTS].reshape(batch * DRAFTS, VOCAB).contiguous()
    target_rows = flat[meta.target_logits_indices.long()].contiguous()
    bonus = flat[meta.bonus_logits_indices.long()].argmax(-1, keepdim=True)

    def core():
        return module.rejection_sample(
            meta.draft_token_ids,
            meta.num_draft_tokens,
            DRAFTS,
            meta.cu_num_draft_tokens,
            vllm_draft,
            target_rows,
            bonus,
            sampling,
        )

    samplers = []  # made by the first call: a Sampler that this vLLM cannot make skips the whole step alone

    def forward():
        if not samplers:
            samplers.append(vllm_rejection_sampler()[1])
        return samplers[0](meta, vllm_draft, flat, sampling).sampled_token_ids

    candidates = {
        peer_name("vllm", "rejection_sample (core)"): core,
        peer_name("vllm", "RejectionSampler.forward"): forward,
    }
    results = first_results(case, candidates)
    peers = {name: candidates[name] for name in results}
    if greedy:  # the same tokens: accepted drafts, then the target's argmax, -1 padded
        ours = tree_verify_greedy(parent, tokens, num_nodes, logits).emitted_tokens
        for name, got in results.items():
            assert torch.equal(got.long(), ours), f"{name} and peagle disagree on greedy chains"

        def op():
            return tree_verify_greedy(parent, tokens, num_nodes, logits)
    else:

        def op():
            return tree_rejection_sample(parent, tokens, num_nodes, torch.softmax(logits, -1), draft, seed=1)

    compare(benchmark, case, op, peers, NOTES["vllm"])


# ---------------------------------------------------------------------------------------------------------------------
# GDN verification over chains.


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}")
def test_gdn_chain_vs_fla(benchmark, batch):
    heads, value_heads = GDN_HEADS[:2]
    case = f"cuda GDN chain verify B={batch} n={DRAFTS + 1} H,HV,K,V={GDN_HEADS} bf16"
    fla = require("fla.ops.gated_delta_rule", case, "fla fused_recurrent_gated_delta_rule")
    peer = peer_name("fla", "fused_recurrent_gated_delta_rule")
    gen = torch.Generator().manual_seed(batch)
    x = random_gdn_inputs(gen, batch, DRAFTS + 1, *GDN_HEADS, kind="chain", dtype=torch.bfloat16)
    x = type(x)(*(t.to(DEVICE) for t in x))
    group = value_heads // heads
    q, k = (t.repeat_interleave(group, dim=2).contiguous() for t in (x.q, x.k))
    g, start = x.g.float(), x.state_pool[x.slots].contiguous()

    def theirs():
        return fla.fused_recurrent_gated_delta_rule(
            q=q, k=k, v=x.v, g=g, beta=x.beta, initial_state=start, output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    got = call_peer(case, peer, theirs)[0]
    ours = gdn_tree_verify(*x, use_qk_l2norm=True).o
    scale = ours.float().abs().max().item()
    torch.testing.assert_close(got.float(), ours.float(), rtol=2**-6, atol=2**-6 * scale)
    compare(
        benchmark,
        case,
        lambda: gdn_tree_verify(*x, use_qk_l2norm=True, validate=False),
        {peer: theirs},
        NOTES["fla"],
    )


# ---------------------------------------------------------------------------------------------------------------------
# COD sampling + gather.


@pytest.mark.parametrize("length", COD_LENGTHS)
def test_cod_vs_speculators(benchmark, length):
    case = f"cuda cod sample+gather T={length} D={COD_WIDTH} bf16"
    if speculators_cod is None:
        skip_peer(__file__, case, "speculators", "speculators not installed")
    peer = peer_name("speculators", "P-EAGLE COD path")
    inputs = make_row(length, DEVICE)
    loss_mask, document_ids, input_ids, hidden, mask_hidden = inputs
    anchors, depths = call_peer(case, peer, lambda: speculators_cod_sample(loss_mask))
    inside = anchors >= 0  # speculators' depth-1 chain of a trained position 0 is anchored at -1
    anchors, depths = anchors[inside], depths[inside]
    ours = cod_gather(input_ids, hidden, mask_hidden, anchors, depths, MASK_ID)
    theirs = speculators_gather(input_ids, hidden, mask_hidden, anchors, depths)
    mine = (ours.ids, ours.feats, ours.position_ids)
    for name, a, b in zip(("ids", "feats", "positions"), mine, theirs, strict=True):
        assert torch.equal(a, b), f"cod_gather and speculators' gather disagree on {name}"
    _, our_depths = cod_sample(loss_mask, document_ids, NUM_DEPTHS, RATIO, RATIO_MIN, MAX_ANCHORS, 0)
    ours_per_depth = torch.bincount(our_depths, minlength=NUM_DEPTHS).tolist()
    theirs_per_depth = torch.bincount(depths, minlength=NUM_DEPTHS).tolist()
    # Different draws keep different chains; where the pool runs short (deep depths) the counts differ by a few.
    for depth, (a, b) in enumerate(zip(ours_per_depth, theirs_per_depth, strict=True)):
        assert abs(a - b) <= max(8, 0.1 * b), f"depth {depth}: peagle keeps {a} elements, speculators {b}"
    compare(
        benchmark,
        case,
        lambda: peagle_path(*inputs),
        {peer: lambda: speculators_path(*inputs)},
        NOTES["speculators"],
        elements_per_depth=ours_per_depth,
        peer_elements_per_depth=theirs_per_depth,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Block masks (torch's create_block_mask is always there: this case runs on every GPU machine).


def blocks_of(mask) -> MaskBlocks:
    """The block structure of a flex-attention BlockMask of one batch row and one head."""
    return MaskBlocks(
        mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0], mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    )


@pytest.mark.parametrize("length", BUILD_LENGTHS)
def test_mask_vs_create_block_mask(benchmark, length):
    row, anchors, depths = make_sample(length)
    anchors, depths, docs = anchors.to(DEVICE), depths.to(DEVICE), row.document_ids.to(DEVICE)
    n = anchors.numel()
    case = f"cuda mask (block) T={length} N={n}"
    mask_mod = make_mask_mod(anchors, depths, docs)

    def theirs():
        return compiled_create_block_mask()(mask_mod, None, None, n, n, device=DEVICE, BLOCK_SIZE=BLOCK)

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tight = block_kinds(blocks_of(theirs()))
    compile_s = time.perf_counter() - start
    kinds = block_kinds(mask_block(anchors, depths, docs, BLOCK))
    assert not ((tight != EMPTY) & (kinds == EMPTY)).any(), "peagle marks empty a block with an allowed pair"
    assert not ((tight != FULL) & (kinds == FULL)).any(), "peagle marks full a block with a disallowed pair"
    builder = BlockMaskBuilder(BLOCK)
    compare(
        benchmark,
        case,
        lambda: builder.build(anchors, depths, docs),
        {"create_block_mask-compiled": theirs},
        NOTES["create_block_mask"],
        compile_s=round(compile_s, 1),
        full_blocks_kept_partial=int(((tight == FULL) & (kinds != FULL)).sum()),
        full_blocks=int((tight == FULL).sum()),
    )
