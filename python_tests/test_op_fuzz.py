"""Standing fuzz suite of the ops: every op on arbitrary shapes (empty included) and values (NaN, inf, negative and
out-of-range ids included) either equals its PyTorch reference or raises a clear error, one that names the op.

Hypothesis draws the cases (modest ``max_examples``, no deadline: the first call of an op may load the library).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor

from peagle.ops import (
    causal_conv1d_commit,
    causal_conv1d_commit_reference,
    causal_conv1d_tree,
    causal_conv1d_tree_reference,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
    efficient_lm_head,
    efficient_lm_head_reference,
    gdn_commit,
    gdn_commit_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
    gdn_tree_verify_slots,
    gdn_tree_verify_slots_reference,
    kv_compact,
    kv_compact_reference,
    mask_block,
    mask_block_reference,
    mask_dense,
    mask_dense_reference,
    mask_slice_block,
    mask_slice_block_reference,
    mask_slice_dense,
    mask_slice_dense_reference,
    tree_build_parallel,
    tree_build_parallel_reference,
    tree_expand_topk,
    tree_expand_topk_reference,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_select,
    tree_select_reference,
    tree_verify_greedy,
    tree_verify_greedy_reference,
)


@pytest.fixture(autouse=True, scope="module")
def gradual_underflow():
    """Hypothesis draws subnormal floats and refuses to run while the CPU flushes them to zero. Training and extraction
    turn flushing on for speed, process-wide, so an earlier test in the same process may have left it on."""
    torch.set_flush_denormal(False)
    yield


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = [math.nan, math.inf, -math.inf, -1.0, 0.0]


def run_or_clear_error(op: str, call):
    """The op's result, or None when it raised an error that names the op (``peagle.<op>: ...``)."""
    try:
        return call()
    except (RuntimeError, ValueError) as error:
        assert f"peagle.{op}:" in str(error), f"unclear error from {op}: {error}"
        return None


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        assert torch.equal(g, w) or (g.is_floating_point() and torch.allclose(g, w, rtol=0, atol=0, equal_nan=True))


@st.composite
def floats_tensor(draw, shape, low=0.0, high=1.0, special=0.2, specials=tuple(SPECIAL)):
    """float32 values in [low, high], with a fraction of specials (by default NaN, +-inf, -1, 0)."""
    n = math.prod(shape)
    values = draw(st.lists(st.floats(low, high, width=32), min_size=n, max_size=n))
    for i in range(n):
        if draw(st.floats(0, 1)) < special:
            values[i] = draw(st.sampled_from(specials))
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def ints(draw, n, low, high):
    return torch.tensor(draw(st.lists(st.integers(low, high), min_size=n, max_size=n)), dtype=torch.long)


def probability_rows(draw, shape, special=0.1):
    """Rows that mostly sum to 1 (softmax), sometimes with a NaN / inf / negative entry or a bad sum."""
    logits = torch.tensor(draw(st.lists(st.floats(-4, 4), min_size=math.prod(shape), max_size=math.prod(shape))))
    probs = torch.softmax(logits.reshape(shape).float(), -1) if math.prod(shape) else torch.zeros(shape)
    flat = probs.reshape(-1)
    for i in range(flat.numel()):
        if draw(st.floats(0, 1)) < special:
            flat[i] = draw(st.sampled_from([*SPECIAL, 2.0]))
    return probs


# ---------------------------------------------------------------------------------------------------------------------
# COD


@FUZZ
@given(data=st.data())
def test_cod_sample_fuzz(data):
    length = data.draw(st.integers(0, 40))
    loss_mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=length, max_size=length)), dtype=torch.bool)
    docs = ints(data.draw, length, -3, 3).sort().values
    num_depths = data.draw(st.integers(0, 5))
    ratio = data.draw(st.one_of(st.floats(0, 1.2), st.sampled_from([math.nan, math.inf])))
    ratio_min = data.draw(st.one_of(st.floats(0, 1), st.just(math.nan)))
    max_anchors = data.draw(st.one_of(st.none(), st.integers(0, 50)))
    seed = data.draw(st.integers(0, 2**62))
    args = (loss_mask, docs, num_depths, ratio, ratio_min, max_anchors, seed)
    got = run_or_clear_error("cod_sample", lambda: cod_sample(*args))
    if got is not None:
        assert_same(got, cod_sample_reference(*args))


@FUZZ
@given(data=st.data())
def test_cod_gather_fuzz(data):
    length, width, count = data.draw(st.integers(0, 10)), data.draw(st.integers(0, 4)), data.draw(st.integers(0, 8))
    vocab = data.draw(st.integers(1, 12))
    input_ids = ints(data.draw, length, -2, vocab + 1)
    hidden = data.draw(floats_tensor((length, width), -2, 2))
    mask_hidden = data.draw(floats_tensor((width,), -2, 2))
    anchors, depths = ints(data.draw, count, -1, length), ints(data.draw, count, -1, 4)
    mask_token_id = data.draw(st.integers(-1, vocab))
    vocab_size = data.draw(st.one_of(st.none(), st.just(vocab)))
    got = run_or_clear_error(
        "cod_gather", lambda: cod_gather(input_ids, hidden, mask_hidden, anchors, depths, mask_token_id, vocab_size)
    )
    if got is not None:
        assert_same(got, cod_gather_reference(input_ids, hidden, mask_hidden, anchors, depths, mask_token_id))
        if vocab_size is not None:  # ids reaching the drafter are inside its vocabulary
            assert bool(((got.ids >= 0) & (got.ids < vocab_size)).all())


# ---------------------------------------------------------------------------------------------------------------------
# Masks


@st.composite
def mask_case(draw):
    length, count = draw(st.integers(0, 20)), draw(st.integers(0, 24))
    anchors = ints(draw, count, -1, length)
    depths = ints(draw, count, -1, 6)
    if count and draw(st.booleans()):  # a depth near 2^63: must be an error, not an overflow
        depths[draw(st.integers(0, count - 1))] = 2**63 - draw(st.integers(1, 3))
    docs = ints(draw, length, -3, 2).sort().values
    window = draw(st.one_of(st.none(), st.integers(0, 8)))
    return anchors, depths, docs, window


@FUZZ
@given(case=mask_case())
def test_mask_dense_fuzz(case):
    got = run_or_clear_error("mask_dense", lambda: mask_dense(*case))
    if got is not None:
        assert torch.equal(got, mask_dense_reference(*case))


@FUZZ
@given(case=mask_case(), block_size=st.integers(0, 9))
def test_mask_block_fuzz(case, block_size):
    anchors, depths, docs, window = case
    got = run_or_clear_error("mask_block", lambda: mask_block(anchors, depths, docs, block_size, window))
    if got is not None:
        assert_same(got, mask_block_reference(anchors, depths, docs, block_size, window))


@FUZZ
@given(case=mask_case(), data=st.data())
def test_mask_slice_fuzz(case, data):
    """Any table (shape, values, dtype, including tables too short for the elements) and any elements."""
    anchors, depths, docs, _ = case
    shape = (data.draw(st.integers(0, 7)), data.draw(st.integers(0, 22)))
    table = ints(data.draw, math.prod(shape), -(2**62), 2**62).reshape(shape)
    if data.draw(st.booleans()):
        table = table.clamp(-(2**31), 2**31 - 1).int()
    got = run_or_clear_error("mask_slice_dense", lambda: mask_slice_dense(table, anchors, depths, docs))
    if got is not None:
        assert torch.equal(got, mask_slice_dense_reference(table, anchors, depths, docs))
    block_size = data.draw(st.integers(0, 9))
    got = run_or_clear_error("mask_slice_block", lambda: mask_slice_block(table, anchors, depths, docs, block_size))
    if got is not None:
        assert_same(got, mask_slice_block_reference(table, anchors, depths, docs, block_size))


# ---------------------------------------------------------------------------------------------------------------------
# Tree construction


@FUZZ
@given(data=st.data())
def test_tree_expand_topk_fuzz(data):
    batch, width, vocab = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4)), data.draw(st.integers(1, 6))
    frontier = data.draw(floats_tensor((batch, width), 0, 1)).double()
    probs = probability_rows(data.draw, (batch, width, vocab))
    topk = data.draw(st.integers(0, vocab + 1))
    got = run_or_clear_error("tree_expand_topk", lambda: tree_expand_topk(frontier, probs, topk))
    if got is not None:
        assert_same(got, tree_expand_topk_reference(frontier, probs, topk))


@FUZZ
@given(data=st.data())
def test_tree_build_parallel_fuzz(data):
    batch, depths, vocab = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)), data.draw(st.integers(1, 5))
    probs = probability_rows(data.draw, (batch, depths, vocab))
    topk = data.draw(st.lists(st.integers(0, vocab), min_size=depths, max_size=depths))
    num_nodes = data.draw(st.integers(0, 30))
    got = run_or_clear_error("tree_build_parallel", lambda: tree_build_parallel(probs, topk, num_nodes))
    if got is not None:
        assert_same(got, tree_build_parallel_reference(probs, topk, num_nodes))


@FUZZ
@given(data=st.data())
def test_tree_select_fuzz(data):
    batch, m = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 8))
    parent = torch.tensor([([-1] + [data.draw(st.integers(-1, i)) for i in range(1, m)])[:m] for _ in range(batch)])
    parent = parent.reshape(batch, m).long()
    factor = data.draw(floats_tensor((batch, m), 0, 1, special=0.1)).double()
    scores = factor.clone()
    for i in range(1, m):  # mostly monotone along paths, as products of probabilities are
        p = parent[:, i].clamp(0, i - 1) if i else parent[:, i]
        scores[:, i] = scores[torch.arange(batch), p] * factor[:, i]
    tokens = ints(data.draw, batch * m, 0, 20).reshape(batch, m)
    count = ints(data.draw, batch, 0, m + 1)
    num_nodes = data.draw(st.integers(0, 12))
    got = run_or_clear_error("tree_select", lambda: tree_select(tokens, parent, scores, count, num_nodes))
    if got is not None:
        assert_same(got, tree_select_reference(tokens, parent, scores, count, num_nodes))


# ---------------------------------------------------------------------------------------------------------------------
# Tree verification


@st.composite
def verify_case(draw):
    batch, nodes, vocab = draw(st.integers(0, 3)), draw(st.integers(0, 5)), draw(st.integers(1, 5))
    parent = torch.tensor([([-1] + [draw(st.integers(-1, i)) for i in range(1, nodes)])[:nodes] for _ in range(batch)])
    parent = parent.reshape(batch, nodes).long()
    tokens = ints(draw, batch * nodes, -1, vocab).reshape(batch, nodes)
    num_nodes = ints(draw, batch, 0, nodes + 1)
    target = probability_rows(draw, (batch, nodes, vocab), special=0.05)
    return parent, tokens, num_nodes, target


@FUZZ
@given(case=verify_case())
def test_tree_verify_greedy_fuzz(case):
    got = run_or_clear_error("tree_verify_greedy", lambda: tree_verify_greedy(*case))
    if got is not None:
        assert_same(got, tree_verify_greedy_reference(*case))


@FUZZ
@given(case=verify_case(), data=st.data())
def test_tree_rejection_sample_fuzz(case, data):
    parent, tokens, num_nodes, target = case
    draft = probability_rows(data.draw, tuple(target.shape), special=0.05) if data.draw(st.booleans()) else None
    uniforms = data.draw(floats_tensor(tuple(parent.shape), 0, 0.99609375, special=0.05))
    got = run_or_clear_error(
        "tree_rejection_sample", lambda: tree_rejection_sample(parent, tokens, num_nodes, target, draft, uniforms)
    )
    if got is not None:
        assert_same(got, tree_rejection_sample_reference(parent, tokens, num_nodes, target, draft, uniforms))


# ---------------------------------------------------------------------------------------------------------------------
# Paged KV cache


@FUZZ
@given(data=st.data())
def test_kv_compact_fuzz(data):
    layers, blocks, block_size = (
        data.draw(st.integers(1, 2)),
        data.draw(st.integers(0, 4)),
        data.draw(st.integers(1, 4)),
    )
    batch, max_blocks, path = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4))
    caches = [data.draw(floats_tensor((blocks, block_size, 1, 2), -2, 2)) for _ in range(2 * layers)]
    table = ints(data.draw, batch * max_blocks, -1, blocks).reshape(batch, max_blocks)
    seq_len = ints(data.draw, batch, -1, max_blocks * block_size)
    accepted = ints(data.draw, batch * path, -1, path).reshape(batch, path)
    num_accepted = ints(data.draw, batch, -1, path)
    ours = [c.clone() for c in caches], seq_len.clone()
    ok = run_or_clear_error(
        "kv_compact",
        lambda: kv_compact(ours[0][:layers], ours[0][layers:], table, ours[1], accepted, num_accepted) or True,
    )
    if ok:
        ref = [c.clone() for c in caches], seq_len.clone()
        kv_compact_reference(ref[0][:layers], ref[0][layers:], table, ref[1], accepted, num_accepted)
        assert_same([*ours[0], ours[1]], [*ref[0], ref[1]])


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet: floating-point ops whose kernels use the closed form over the tree while the references run the
# recurrence path by path, so "equal" means close where the reference is finite, and non-finite where it is not.


def assert_close_where_finite(got: Tensor, want: Tensor, tolerance: float = 1e-3) -> None:
    finite = torch.isfinite(want)
    assert bool((~torch.isfinite(got[~finite])).all()), "a non-finite reference value came out finite"
    torch.testing.assert_close(got[finite].double(), want[finite].double(), rtol=tolerance, atol=tolerance)


def tree_parents(draw, batch: int, nodes: int) -> Tensor:
    """Mostly valid parents (parent[i] in [-1, i)), sometimes one that points forward or out of range."""
    rows = [([-1] if nodes else []) + [draw(st.integers(-1, i - 1)) for i in range(1, nodes)] for _ in range(batch)]
    if batch and nodes and draw(st.floats(0, 1)) < 0.15:
        rows[draw(st.integers(0, batch - 1))][draw(st.integers(0, nodes - 1))] = draw(st.integers(nodes, nodes + 3))
    return torch.tensor(rows, dtype=torch.long).reshape(batch, nodes)


@FUZZ
@given(data=st.data())
def test_gdn_tree_verify_and_commit_fuzz(data):
    batch, nodes = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6))
    heads, group, dk, dv = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 4, 3
    hv, pool = heads * group, data.draw(st.integers(1, 4))
    special = data.draw(st.sampled_from([0.0, 0.05]))
    q = data.draw(floats_tensor((batch, nodes, heads, dk), -1, 1, special))
    k = data.draw(floats_tensor((batch, nodes, heads, dk), -1, 1, special))
    v = data.draw(floats_tensor((batch, nodes, hv, dv), -1, 1, special))
    g = data.draw(floats_tensor((batch, nodes, hv), -2, 0, special))
    beta = data.draw(floats_tensor((batch, nodes, hv), 0, 1, special))
    parent = tree_parents(data.draw, batch, nodes)
    state_pool = data.draw(floats_tensor((pool, hv, dk, dv), -1, 1, 0.0))
    slots = ints(data.draw, batch, -1, pool)
    l2norm = data.draw(st.booleans())
    verify_args = (q, k, v, g, beta, parent, state_pool, slots)
    out = run_or_clear_error("gdn_tree_verify", lambda: gdn_tree_verify(*verify_args, use_qk_l2norm=l2norm))
    if out is None:
        return
    assert_close_where_finite(out.o, gdn_tree_verify_reference(*verify_args, use_qk_l2norm=l2norm))
    last = ints(data.draw, batch, -1, nodes - 1) if nodes else torch.full((batch,), -1, dtype=torch.long)
    if batch and len(set(slots.tolist())) < batch:  # two requests may not commit into one slot
        return
    pool_after = state_pool.clone()
    commit = lambda: gdn_commit(k, g, out.u, parent, last, pool_after, slots, use_qk_l2norm=l2norm)  # noqa: E731
    if run_or_clear_error("gdn_commit", lambda: commit() or True) is None:
        return
    want = gdn_commit_reference(k, v, g, beta, parent, last, state_pool, slots, use_qk_l2norm=l2norm)
    assert_close_where_finite(pool_after, want)
    event("gdn: verified and committed")


@FUZZ
@given(data=st.data())
def test_gdn_tree_verify_slots_fuzz(data):
    """Slots drawn from a small cache, so that out-of-range, repeated and foreign (another request's start) slots all
    occur; a call that does not raise leaves the outputs and the whole cache as the reference computes them."""
    batch, nodes = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 5))
    heads, group, dk, dv = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), 4, 3
    hv, pool = heads * group, data.draw(st.integers(1, 12))
    special = data.draw(st.sampled_from([0.0, 0.05]))
    q = data.draw(floats_tensor((batch, nodes, heads, dk), -1, 1, special))
    k = data.draw(floats_tensor((batch, nodes, heads, dk), -1, 1, special))
    v = data.draw(floats_tensor((batch, nodes, hv, dv), -1, 1, special))
    g = data.draw(floats_tensor((batch, nodes, hv), -2, 0, special))
    beta = data.draw(floats_tensor((batch, nodes, hv), 0, 1, special))
    parent = tree_parents(data.draw, batch, nodes)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    cache = data.draw(floats_tensor((pool, hv, dk, dv), -1, 1, 0.0)).to(dtype)
    start = ints(data.draw, batch, -1, pool)
    dest = torch.tensor([[data.draw(st.integers(-1, pool)) for _ in range(nodes)] for _ in range(batch)]).long()
    dest = dest.reshape(batch, nodes)
    l2norm = data.draw(st.booleans())
    args = (q, k, v, g, beta, parent)
    ours = cache.clone()
    o = run_or_clear_error(
        "gdn_tree_verify_slots",
        lambda: gdn_tree_verify_slots(*args, ours, start, dest, use_qk_l2norm=l2norm),
    )
    if o is None:
        assert torch.equal(ours, cache), "a call that raised wrote the cache"
        return
    want_o, want_cache = gdn_tree_verify_slots_reference(*args, cache, start, dest, use_qk_l2norm=l2norm)
    assert_close_where_finite(o.float(), want_o)
    # bf16 states: both round nearly equal fp32 states, so they may land one bf16 ulp (2^-7 relative) apart.
    assert_close_where_finite(ours.float(), want_cache.float(), 1e-3 if dtype == torch.float32 else 2**-7)
    event("gdn slots: verified and written")


@FUZZ
@given(data=st.data())
def test_causal_conv1d_tree_and_commit_fuzz(data):
    batch, nodes, channels = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6)), data.draw(st.integers(0, 4))
    width = data.draw(st.integers(1, 4))
    special = data.draw(st.sampled_from([0.0, 0.05]))
    x = data.draw(floats_tensor((batch, nodes, channels), -2, 2, special))
    parent = tree_parents(data.draw, batch, nodes)
    state = data.draw(floats_tensor((batch, channels, width - 1), -2, 2, special))
    weight = data.draw(floats_tensor((channels, width), -1, 1, special))
    bias = data.draw(st.one_of(st.none(), floats_tensor((channels,), -1, 1, special)))
    activation = data.draw(st.sampled_from([None, "silu"]))
    out = run_or_clear_error(
        "causal_conv1d_tree", lambda: causal_conv1d_tree(x, parent, state, weight, bias, activation)
    )
    if out is None:
        return
    assert_close_where_finite(out, causal_conv1d_tree_reference(x, parent, state, weight, bias, activation))
    last = ints(data.draw, batch, -1, nodes - 1) if nodes else torch.full((batch,), -1, dtype=torch.long)
    committed = state.clone()
    if (
        run_or_clear_error("causal_conv1d_commit", lambda: causal_conv1d_commit(x, parent, last, committed) or True)
        is None
    ):
        return
    want = causal_conv1d_commit_reference(x, parent, last, state)
    event("conv: computed and committed")
    assert torch.equal(committed, want) or torch.allclose(committed, want, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------------------
# Efficient LM head


@FUZZ
@given(data=st.data())
def test_efficient_lm_head_fuzz(data):
    """Small integers with NaN / +-inf sprinkled in: every sum is exact or non-finite whatever the order, so the op
    must equal the reference bit for bit (NaN scores rank as -inf, ties to the lower id)."""
    rows, hidden_size, rank, vocab = (data.draw(st.integers(0, high)) for high in (4, 5, 4, 9))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    specials = (math.nan, math.inf, -math.inf, -0.0)

    def draw(*shape):
        values = data.draw(floats_tensor(shape, -3, 3, special=0.05, specials=specials))
        return values.round().to(dtype)

    hidden, down = draw(rows, hidden_size), draw(rank, hidden_size)
    up, weight = draw(vocab, rank), draw(vocab, hidden_size)
    candidates = data.draw(st.integers(-1, vocab + 1))
    with torch.no_grad():
        got = run_or_clear_error("efficient_lm_head", lambda: efficient_lm_head(hidden, down, up, weight, candidates))
    if got is not None:
        assert_same(got, efficient_lm_head_reference(hidden, down, up, weight, candidates))
