"""A full verify round captured in one CUDA graph with deferred checks (peagle.ops.errors): tree construction from the
drafter's per-depth rows (tree_build_parallel), tree rejection sampling, GDN tree verify + commit of the accepted node,
kv_compact of the accepted path. Replayed with changed inputs, it must give the eager CPU ops' results; a bad tree in
the replayed inputs must surface from check_errors() after the replay with the immediate mode's message."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import (
    check_errors,
    deferred_checks,
    gdn_commit,
    gdn_tree_verify,
    kv_compact,
    tree_build_parallel,
    tree_rejection_sample,
)
from python_tests.test_kv import random_case
from testkit import random_gdn_inputs, random_tree_batch, random_tree_probs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH, NODES, VOCAB, HEADS, DIM = 3, 8, 64, 2, 16
TOPK = [3, 2, 2]  # the drafter's per-depth widths of the built tree


def round_inputs(generator, first: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every input of one round (the mutable state too) as a flat dict, so a replay can copy new values in. Later rounds
    keep the first round's paged geometry (block table, lengths) and draw everything else anew."""
    tree = random_tree_batch(generator, BATCH, NODES, VOCAB)
    gdn = random_gdn_inputs(generator, BATCH, NODES, HEADS, HEADS, DIM, DIM)
    kv = random_case(generator, batch=BATCH, layers=2, block_size=4, kv_heads=2, head_dim=8, path_len=NODES)
    inputs = {
        "parent": tree.parent,
        "tokens": tree.tokens,
        "num_nodes": tree.num_nodes,
        "target": random_tree_probs(generator, tree, VOCAB),
        "draft": random_tree_probs(generator, tree, VOCAB),
        "uniforms": torch.rand(BATCH, NODES, generator=generator),
        "draft_rows": torch.softmax(torch.randn(BATCH, len(TOPK), VOCAB, generator=generator), -1),
        **{name: getattr(gdn, name) for name in ("q", "k", "v", "g", "beta", "state_pool", "slots")},
        "block_table": kv.block_table,
        "seq_len": kv.seq_len,
    }
    for i, cache in enumerate([*kv.k_caches, *kv.v_caches]):
        inputs[f"cache{i}"] = cache
    if first is not None:
        for name in ("block_table", "seq_len"):
            inputs[name] = first[name].clone()
        for i in range(4):
            inputs[f"cache{i}"] = torch.randn(first[f"cache{i}"].shape, generator=generator)
    return inputs


def verify_round(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One round; updates state_pool, seq_len and the caches in place and returns the outputs."""
    spec = tree_build_parallel(x["draft_rows"], TOPK, NODES)
    out = tree_rejection_sample(x["parent"], x["tokens"], x["num_nodes"], x["target"], x["draft"], x["uniforms"])
    real = torch.arange(NODES, device=x["parent"].device) < x["num_nodes"][:, None]
    gdn_parent = torch.where(real, x["parent"], -1)  # padding nodes start from the committed state
    gdn_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], gdn_parent, x["state_pool"], x["slots"])
    o, u = gdn_tree_verify(*gdn_args)
    gdn_commit(x["k"], x["g"], u, gdn_parent, out.last_node, x["state_pool"], x["slots"])
    caches = [x[f"cache{i}"] for i in range(4)]
    kv_compact(caches[:2], caches[2:], x["block_table"], x["seq_len"], out.accepted_path, out.num_accepted)
    return {**out._asdict(), "o": o, **{f"tree_{name}": t for name, t in spec._asdict().items()}}


def assert_round_equal(cuda_out, cuda_state, cpu_out, cpu_state):
    built = [name for name in cpu_out if name.startswith("tree_")]
    for name in ("accepted_path", "num_accepted", "emitted_tokens", "last_node", *built):
        assert torch.equal(cuda_out[name].cpu(), cpu_out[name]), name
    torch.testing.assert_close(cuda_out["o"].cpu(), cpu_out["o"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cuda_state["state_pool"].cpu(), cpu_state["state_pool"], rtol=1e-4, atol=1e-5)
    for name in ["seq_len", *(f"cache{i}" for i in range(4))]:
        assert torch.equal(cuda_state[name].cpu(), cpu_state[name]), name


def test_verify_round_in_one_graph(generator):
    first = round_inputs(generator)
    static = {name: t.cuda() for name, t in first.items()}
    with deferred_checks():  # allocates the error record before the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up, as CUDA graphs want
            verify_round({name: t.clone() for name, t in static.items()})
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = verify_round(static)
        check_errors()

        for replay in range(3):
            inputs = first if replay == 0 else round_inputs(generator, first)
            for name, t in inputs.items():
                static[name].copy_(t)
            graph.replay()
            cpu_state = {name: t.clone() for name, t in inputs.items()}
            cpu_out = verify_round(cpu_state)
            check_errors()
            assert_round_equal(outputs, static, cpu_out, cpu_state)

        # A bad tree in the replayed inputs: duplicate sibling tokens in request 1 (nodes 1 and 2 under the root).
        bad = {name: t.clone() for name, t in first.items()}
        bad["parent"][1, :3] = torch.tensor([-1, 0, 0])
        bad["tokens"][1, 2] = bad["tokens"][1, 1]
        bad["num_nodes"][1] = max(int(bad["num_nodes"][1]), 3)
        with pytest.raises(RuntimeError) as immediate:
            with deferred_checks(False):
                tree_rejection_sample(
                    *(bad[n].cuda() for n in ("parent", "tokens", "num_nodes", "target", "draft", "uniforms"))
                )
        for name, t in bad.items():
            static[name].copy_(t)
        graph.replay()
        with pytest.raises(RuntimeError) as deferred:
            check_errors()
        assert "sibling tokens must be distinct" in str(deferred.value)
        assert str(deferred.value).splitlines()[0] == str(immediate.value).splitlines()[0]
        check_errors()  # reset
