"""Tree construction on CUDA tensors (csrc/cuda/tree_build_kernels.cu) against the CPU kernels, bit for bit: random
inputs full of ties (quantised probabilities, -0.0, denormals), the full Qwen vocabulary (V = 151936) at B = 64 and
K / F = 8, all-zero rows, top-k beyond a row's non-zero entries, N beyond the candidate count; every value error with
the CPU's message, immediate or deferred (no host synchronisation); and the three ops captured in one CUDA graph."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import check_errors, deferred_checks, tree_build_parallel, tree_expand_topk, tree_select
from testkit import assert_deferred_like_immediate, error_message

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

QWEN_VOCAB = 151936


def cuda(*tensors):
    return [t.cuda() for t in tensors]


def assert_same(cuda_out, cpu_out, what=""):
    for i, (a, e) in enumerate(zip(cuda_out, cpu_out, strict=True)):
        name = cpu_out._fields[i] if hasattr(cpu_out, "_fields") else str(i)
        assert a.is_cuda and a.dtype == e.dtype and a.shape == e.shape, (what, name)
        # Bitwise: equal values and the same -0.0 / NaN bits (scores are float64).
        a_bits, e_bits = a.cpu(), e
        if e.dtype == torch.float64:
            a_bits, e_bits = a_bits.view(torch.int64), e_bits.view(torch.int64)
        assert torch.equal(a_bits, e_bits), f"{what} {name}:\n{a.cpu()}\n{e}"


def tied_probs(generator, *shape, levels: int = 16) -> torch.Tensor:
    """Probabilities quantised to `levels` steps (many exact ties), with some -0.0, denormal and all-zero rows and rows
    with only a couple of non-zero entries (top-k then reaches into the zeros, ties to the smaller id)."""
    probs = torch.softmax(torch.randn(*shape, generator=generator) * 3, -1)
    probs = torch.floor(probs * levels) / levels
    flat = probs.view(-1, shape[-1])
    rows = flat.shape[0]
    pick = torch.randint(0, rows, (max(1, rows // 8),), generator=generator)
    flat[pick] = 0.0  # all-zero rows
    sparse = torch.randint(0, rows, (max(1, rows // 8),), generator=generator)
    flat[sparse] = 0.0
    flat[sparse, torch.randint(0, shape[-1], (len(sparse),), generator=generator)] = 0.5
    flat[sparse, 0] = 0.25
    signs = torch.rand(flat.shape, generator=generator) < 0.05
    flat[signs & (flat == 0)] = -0.0
    tiny = torch.rand(flat.shape, generator=generator) < 0.01
    flat[tiny] = 1e-40  # a float32 denormal: no flush to zero on either side
    flat[:, -1] = torch.where(torch.rand(rows, generator=generator) < 0.1, 1.0, flat[:, -1])
    return probs


@pytest.mark.parametrize(
    "batch,vocab,topk,num_nodes",
    [
        (1, 1, [1], 1),
        (3, 7, [7, 1, 3], 30),  # topk = V, N beyond the candidate count
        (5, 50, [4, 3, 2], 20),
        (4, 300, [1, 1, 1, 1, 1, 1, 1, 1], 9),  # chains
        (8, 1000, [8, 4, 2, 2, 1, 1, 1, 1], 64),
        (6, 40, [5, 5, 5], 1),
        (2, 2000, [3] * 8, 200),
        (2, 33, [2] * 20, 70),  # more depths than one level chunk
    ],
)
def test_build_parallel_equals_cpu(generator, batch, vocab, topk, num_nodes):
    for levels in (4, 1000):
        probs = tied_probs(generator, batch, len(topk), vocab, levels=levels)
        cpu = tree_build_parallel(probs, topk, num_nodes)
        assert_same(tree_build_parallel(probs.cuda(), topk, num_nodes), cpu, f"levels={levels}")


@pytest.mark.parametrize("batch,width,vocab,topk", [(1, 1, 1, 1), (4, 3, 20, 20), (7, 5, 500, 4), (3, 8, 64, 9)])
def test_expand_topk_equals_cpu(generator, batch, width, vocab, topk):
    probs = tied_probs(generator, batch, width, vocab, levels=8)
    frontier = torch.floor(torch.rand(batch, width, generator=generator, dtype=torch.float64) * 4) / 4
    frontier[0, 0] = -0.0
    out = tree_expand_topk(*cuda(frontier, probs), topk)
    assert_same(out, tree_expand_topk(frontier, probs, topk))
    # float32 frontier scores are converted as on the CPU
    out = tree_expand_topk(*cuda(frontier.float(), probs), topk)
    assert_same(out, tree_expand_topk(frontier.float(), probs, topk))


def random_candidates(generator, batch: int, m: int, levels: int = 4):
    """Candidate trees: random parents, child score = parent score * a quantised probability (ties everywhere)."""
    parent = torch.zeros(batch, m, dtype=torch.long)
    scores = torch.ones(batch, m, dtype=torch.float64)
    parent[:, 0] = -1
    for i in range(1, m):
        parent[:, i] = torch.randint(0, i, (batch,), generator=generator)
        p = torch.floor(torch.rand(batch, generator=generator, dtype=torch.float64) * levels + 1) / levels
        scores[:, i] = scores.gather(1, parent[:, i : i + 1])[:, 0] * p
    tokens = torch.randint(0, 1000, (batch, m), generator=generator)
    count = torch.randint(1, m + 1, (batch,), generator=generator)
    return tokens, parent, scores, count


@pytest.mark.parametrize("batch,m,num_nodes", [(1, 1, 1), (4, 10, 3), (6, 40, 16), (3, 300, 64), (2, 20, 40)])
def test_select_equals_cpu(generator, batch, m, num_nodes):
    tokens, parent, scores, count = random_candidates(generator, batch, m)
    for dtype in (torch.float64, torch.float32):
        args = (tokens.int(), parent, scores.to(dtype), count)
        assert_same(tree_select(*cuda(*args), num_nodes), tree_select(*args, num_nodes), str(dtype))
    negative = scores - 2.0  # scores need only be finite and not above their parent's
    negative[:, 0] = -0.0
    assert_same(
        tree_select(*cuda(tokens, parent, negative, count), num_nodes),
        tree_select(tokens, parent, negative, count, num_nodes),
    )


def test_full_vocabulary_batch_64(generator):
    """The serving shape: B = 64, K = F = 8 rows of the full Qwen vocabulary, with heavy ties."""
    probs = tied_probs(generator, 64, 8, QWEN_VOCAB, levels=4096)
    topk = [8, 4, 2, 2, 1, 1, 1, 1]
    assert_same(tree_build_parallel(probs.cuda(), topk, 64), tree_build_parallel(probs, topk, 64))
    frontier = torch.rand(64, 8, generator=generator, dtype=torch.float64)
    assert_same(tree_expand_topk(*cuda(frontier, probs), 8), tree_expand_topk(frontier, probs, 8))


# ---------------------------------------------------------------------------------------------------------------------
# Errors.


def bad_build_calls():
    """(name, prepare) pairs: prepare(device) puts the inputs on the device and returns the op call; the CPU call
    raises except where noted, and each CUDA call must raise (or record) the same message."""
    probs = torch.full((3, 2, 6), 0.1)

    def build(edit):
        def prepare(device):
            p = probs.clone()
            edit(p)
            p = p.to(device)
            return lambda: tree_build_parallel(p, [2, 2], 5)

        return prepare

    def expand(edit_frontier=None, edit_probs=None):
        def prepare(device):
            f, p = torch.full((3, 2), 0.5, dtype=torch.float64), probs.clone()
            if edit_frontier:
                edit_frontier(f)
            if edit_probs:
                edit_probs(p)
            f, p = f.to(device), p.to(device)
            return lambda: tree_expand_topk(f, p, 2)

        return prepare

    def select(edit):
        def prepare(device):
            tokens = torch.arange(12).view(2, 6)
            parent = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 2)
            scores = torch.tensor([[1.0, 0.6, 0.3, 0.4, 0.1, 0.2]] * 2, dtype=torch.float64)
            count = torch.tensor([6, 5])
            edit(parent, scores, count)
            args = [t.to(device) for t in (tokens, parent, scores, count)]
            return lambda: tree_select(*args, 4)

        return prepare

    def setitem(index, value):
        return lambda t: t.__setitem__(index, value)

    return [
        ("nan", build(setitem((1, 1, 3), float("nan")))),
        ("negative", build(setitem((2, 0, 5), -0.5))),
        ("above one", build(setitem((0, 1, 0), 1.5))),
        ("two bad rows", build(lambda p: (p.__setitem__((1, 1, 0), -1.0), p.__setitem__((1, 0, 4), 2.0)))),
        ("two bad entries", build(lambda p: (p.__setitem__((2, 0, 4), -1.0), p.__setitem__((2, 0, 1), 2.0)))),
        ("frontier nan", expand(edit_frontier=setitem((1, 1), float("nan")))),
        ("frontier negative", expand(edit_frontier=setitem((2, 0), -1.0))),
        ("frontier inf before a bad row", expand(setitem((1, 1), float("inf")), setitem((1, 0, 0), -1.0))),
        ("expand row", expand(edit_probs=setitem((2, 1, 3), float("inf")))),
        ("count 0", select(lambda p, s, c: c.__setitem__(1, 0))),
        ("count above M", select(lambda p, s, c: c.__setitem__(0, 7))),
        ("root parent", select(lambda p, s, c: p.__setitem__((1, 0), 0))),
        ("parent after", select(lambda p, s, c: p.__setitem__((0, 3), 3))),
        ("child above parent", select(lambda p, s, c: s.__setitem__((1, 4), 0.7))),
        ("score nan", select(lambda p, s, c: s.__setitem__((0, 2), float("nan")))),
        ("score inf past count", select(lambda p, s, c: s.__setitem__((1, 5), float("inf")))),  # valid: not read
    ]


@pytest.mark.parametrize("case", range(len(bad_build_calls())))
def test_errors_immediate_and_deferred_like_cpu(case):
    name, prepare = bad_build_calls()[case]
    call = prepare("cuda")
    try:
        expected = prepare("cpu")()
    except RuntimeError as error:
        expected = error_message(error)
    if not isinstance(expected, str):  # a valid call: the same result on CUDA, nothing recorded
        assert_same(call(), expected, name)
        with deferred_checks():
            assert_same(call(), expected, name)
            check_errors()
        return
    assert assert_deferred_like_immediate(call) == expected, name


def test_good_calls_do_not_synchronise(generator):
    """With deferred checks the three ops only launch kernels: no host synchronisation, the immediate mode's results."""
    x = {name: t.cuda() for name, t in construction_inputs(generator).items()}
    expected = construction(x)
    with deferred_checks():
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = construction(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        check_errors()
    for a, e in zip(got, expected, strict=True):
        for a_t, e_t in zip(a, e, strict=True):
            assert torch.equal(a_t, e_t)


def test_device_mismatch_and_shape_errors_like_cpu(generator):
    scores = torch.rand(2, 3, generator=generator, dtype=torch.float64)
    child = torch.softmax(torch.randn(2, 3, 50, generator=generator), -1)
    with pytest.raises(RuntimeError, match=r"child_probs must be on the same device as frontier_scores \(cpu\)"):
        tree_expand_topk(scores, child.cuda(), 2)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    parent = torch.tensor([[-1, 0, 0, 1]] * 2)
    count = torch.tensor([4, 4])
    with pytest.raises(RuntimeError, match="tree_select: cand_scores must be on the same device as cand_tokens"):
        tree_select(tokens.cuda(), parent.cuda(), torch.ones(2, 4, dtype=torch.float64), count.cuda(), 3)
    with pytest.raises(RuntimeError, match=r"topk must have one entry per depth \(K = 3\), got 2"):
        tree_build_parallel(child.cuda(), [2, 2], 4)


def test_construction_ops_are_cuda_kernels_not_host_fallbacks():
    listed = set(torch.ops.peagle.cuda_host_fallbacks())
    assert not listed & {"tree_build_parallel", "tree_expand_topk", "tree_select"}


# ---------------------------------------------------------------------------------------------------------------------
# CUDA graph capture.


def construction(x: dict[str, torch.Tensor]):
    spec = tree_build_parallel(x["draft"], [4, 2, 2], 12)
    expanded = tree_expand_topk(x["frontier"], x["child"], 3)
    selected = tree_select(x["cand_tokens"], x["cand_parent"], x["cand_scores"], x["count"], 6)
    return spec, expanded, selected


def construction_inputs(generator):
    tokens, parent, scores, count = random_candidates(generator, 4, 12)
    return {
        "draft": tied_probs(generator, 4, 3, 700, levels=64),
        "frontier": torch.rand(4, 5, generator=generator, dtype=torch.float64),
        "child": tied_probs(generator, 4, 5, 700, levels=64),
        "cand_tokens": tokens,
        "cand_parent": parent,
        "cand_scores": scores,
        "count": count,
    }


def test_construction_in_one_graph(generator):
    """Captured with deferred checks, replayed on new inputs: the CPU ops' results; a bad draft row surfaces from
    check_errors() after the replay with the immediate message."""
    first = construction_inputs(generator)
    static = {name: t.cuda() for name, t in first.items()}
    with deferred_checks():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            construction(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = construction(static)
        check_errors()
        for replay in range(3):
            inputs = first if replay == 0 else construction_inputs(generator)
            for name, t in inputs.items():
                static[name].copy_(t)
            graph.replay()
            check_errors()
            for got, expected in zip(outputs, construction(inputs), strict=True):
                assert_same(got, expected, f"replay {replay}")
        bad = {name: t.clone() for name, t in first.items()}
        bad["draft"][2, 1, 5] = float("nan")
        with pytest.raises(RuntimeError) as immediate:
            construction(bad)
        for name, t in bad.items():
            static[name].copy_(t)
        graph.replay()
        with pytest.raises(RuntimeError) as deferred:
            check_errors()
        assert error_message(deferred.value) == error_message(immediate.value)
        check_errors()
