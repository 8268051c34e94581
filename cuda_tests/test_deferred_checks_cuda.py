"""Deferred checks on CUDA: no host synchronisation in the ops that have the mode, the immediate check's message from
check_errors(), the first error wins, the record is reset, and results equal the immediate mode's. The graph-captured
verify round: test_graph_capture_round_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import (
    causal_conv1d_commit,
    causal_conv1d_tree,
    check_errors,
    deferred_checks,
    gdn_commit,
    gdn_tree_verify,
    kv_compact,
    set_deferred_checks,
    tree_rejection_sample,
    tree_verify_greedy,
)
from python_tests.test_kv import assert_same, edit, two_requests
from testkit import (
    assert_deferred_like_immediate,
    error_message,
    random_gdn_inputs,
    random_tree_batch,
    random_tree_probs,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def immediate_after():
    yield
    set_deferred_checks(False)
    check_errors()


def good_inputs():
    parent = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 1]])
    tokens = torch.tensor([[0, 1, 2, 3], [0, 4, 1, 2]])
    return [parent, tokens, torch.tensor([4, 4]), torch.full((2, 4, 5), 0.2), torch.full((2, 4, 5), 0.2), None]


def set_uniforms(a, value):
    a[5] = torch.full((2, 4), value)


MUTATIONS = [
    lambda a: a[0].__setitem__((1, 3), 3),
    lambda a: a[0].__setitem__((0, 0), 0),
    lambda a: a[1].__setitem__((1, 3), 1),  # duplicate sibling tokens
    lambda a: a[1].__setitem__((0, 3), 5),
    lambda a: a[2].__setitem__(1, 5),
    lambda a: a[3].__setitem__((1, 0, 2), -0.1),
    lambda a: a[3].__setitem__((0, 0, 2), math.nan),
    lambda a: a[3].__setitem__((0, 0), 0.25),
    lambda a: a[4].__setitem__((1, 0, 1), -1.0),
    lambda a: a[4].__setitem__((0, 0), 0.1),
    lambda a: set_uniforms(a, 1.0),
]


def calls(a):
    parent, tokens, num_nodes, target, draft, uniforms = [None if t is None else t.cuda() for t in a]
    return {
        "greedy": lambda: tree_verify_greedy(parent, tokens, num_nodes, target),
        "sampling": lambda: tree_rejection_sample(parent, tokens, num_nodes, target, draft, uniforms),
    }


@pytest.mark.parametrize("which", ["greedy", "sampling"])
@pytest.mark.parametrize("mutation", range(len(MUTATIONS)))
def test_deferred_error_has_the_immediate_message(which, mutation):
    args = good_inputs()
    MUTATIONS[mutation](args)
    call = calls(args)[which]
    try:
        call()
        immediate = None
    except RuntimeError as error:
        immediate = error_message(error)
    with deferred_checks():
        torch.cuda.set_sync_debug_mode("error")  # the op itself must not synchronise
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if immediate is None:  # e.g. a row greedy does not validate: nothing recorded either
        check_errors()
        return
    with pytest.raises(RuntimeError) as deferred:
        check_errors()
    assert error_message(deferred.value) == immediate
    check_errors()  # the record was reset


def test_first_error_wins_and_good_results_match():
    first, second = good_inputs(), good_inputs()
    MUTATIONS[2](first)
    MUTATIONS[3](second)
    with deferred_checks():
        calls(first)["sampling"]()
        calls(second)["greedy"]()
        with pytest.raises(RuntimeError, match=r"tree_rejection_sample: sibling tokens must be distinct"):
            check_errors()
    generator = torch.Generator().manual_seed(3)
    tree = random_tree_batch(generator, 6, 9, 50)
    target, draft = random_tree_probs(generator, tree, 50), random_tree_probs(generator, tree, 50)
    args = [tree.parent.cuda(), tree.tokens.cuda(), tree.num_nodes.cuda(), target.cuda(), draft.cuda()]
    immediate = tree_rejection_sample(*args, seed=5, offset=2)
    with deferred_checks():
        deferred = tree_rejection_sample(*args, seed=5, offset=2)
        check_errors()
    for a, e in zip(deferred, immediate, strict=True):
        assert torch.equal(a, e)


def test_kv_compact_deferred_errors_change_nothing(generator):
    c = two_requests(generator)
    bad_cases = {
        "num_accepted": c._replace(num_accepted=edit(c.num_accepted, 1, 4)),
        "seq_len": c._replace(seq_len=edit(c.seq_len, 0, -3)),
        "order": c._replace(accepted_path=edit(c.accepted_path, (0, 2), 1)),
        "block": c._replace(block_table=edit(c.block_table, (0, (int(c.seq_len[0]) + 1) // 4), -1)),
    }
    for name, bad in bad_cases.items():
        cuda = bad.to("cuda")
        assert_deferred_like_immediate(lambda cuda=cuda: kv_compact(*cuda))
        assert_same(cuda.to("cpu"), bad), name


def gdn_calls(generator, change, device="cuda"):
    x = random_gdn_inputs(generator, 3, 6, 2, 2, 8, 8)
    parent, slots = x.parent.clone(), x.slots.clone()
    last = torch.tensor([5, -1, 3])
    conv_x, conv_state, weight = torch.randn(3, 6, 16), torch.randn(3, 16, 3), torch.randn(16, 4)
    parent, slots, last = change(parent, slots, last)
    d = [t.to(device) for t in (*x[:5], parent, x.state_pool, slots, last, conv_x, conv_state, weight)]
    q, k, v, g, beta, parent, pool, slots, last, conv_x, conv_state, weight = d
    u = torch.zeros(3, 6, 2, 8, device=device)
    return {
        "verify": lambda: gdn_tree_verify(q, k, v, g, beta, parent, pool, slots),
        "commit": lambda: gdn_commit(k, g, u, parent, last, pool.clone(), slots),
        "conv": lambda: causal_conv1d_tree(conv_x, parent, conv_state, weight),
        "conv_commit": lambda: causal_conv1d_commit(conv_x, parent, last, conv_state.clone()),
    }


def with_parent(p, s, a):
    p[1, 4] = 4
    return p, s, a


def with_slot(p, s, a):
    s[2] = 99
    return p, s, a


def with_last(p, s, a):
    a[1] = 6
    return p, s, a


def with_shared_slot(p, s, a):
    s[2] = s[0]
    return p, s, a


@pytest.mark.parametrize(
    "change,ops",
    [
        (with_parent, ["verify", "commit", "conv", "conv_commit"]),
        (with_slot, ["verify", "commit"]),
        (with_last, ["commit", "conv_commit"]),
        (with_shared_slot, ["commit"]),
    ],
)
def test_gdn_family_deferred_errors(generator, change, ops):
    calls = gdn_calls(generator, change)
    for name in ops:
        assert_deferred_like_immediate(calls[name]), name
    with deferred_checks():  # good inputs record nothing
        for call in gdn_calls(generator, lambda *a: a).values():
            call()
        check_errors()


def test_cod_deferred_errors():
    ids, hidden, mask_hidden = torch.arange(10).cuda(), torch.randn(10, 8).cuda(), torch.randn(8).cuda()
    anchors, depths = torch.tensor([0, 3, 8]).cuda(), torch.tensor([0, 1, 2]).cuda()  # 8 + 2 >= T = 10
    ops = torch.ops.peagle
    assert_deferred_like_immediate(lambda: ops.cod_gather(ids, hidden, mask_hidden, anchors, depths, 7, None))
    grad = torch.randn(3, 8).cuda()
    assert_deferred_like_immediate(lambda: ops.cod_gather_backward(grad, anchors, depths, 10))
    with deferred_checks():  # in range: nothing recorded
        ops.cod_gather(ids, hidden, mask_hidden, anchors, depths.clamp(max=1), 7, None)
        check_errors()


def mask_calls(anchors, depths, docs):
    from peagle.ops import mask_slice_table

    ops, table = torch.ops.peagle, mask_slice_table(10, 3, 4, device="cuda")  # [K = 3, L = 10]
    anchors, depths, docs = anchors.cuda(), depths.cuda(), docs.cuda()
    return {
        "dense": lambda: ops.mask_dense(anchors, depths, docs, 4),
        "block": lambda: ops.mask_block(anchors, depths, docs, 2, None),
        "slice_dense": lambda: ops.mask_slice_dense(table, anchors, depths, docs),
        "slice_block": lambda: ops.mask_slice_block(table, anchors, depths, docs, 2),
    }


@pytest.mark.parametrize(
    "anchors,depths,docs,ops",
    [
        ([0, 3, 12], [0, 1, 2], None, "all"),  # anchor outside [0, T)
        ([0, 3, 5], [0, -1, 2], None, "all"),  # negative depth
        ([0, 3, 5], [0, 12, 2], None, "all"),  # depth >= T
        ([0, 3, 5], [0, 1, 2], -2, "all"),  # document id < -1
        ([0, 3, 11], [0, 1, 2], None, "slice"),  # anchor >= the table's max_length
        ([0, 3, 5], [0, 1, 3], None, "slice"),  # depth >= the table's num_depths
    ],
)
def test_mask_deferred_errors(anchors, depths, docs, ops):
    document_ids = torch.zeros(12, dtype=torch.long)
    if docs is not None:
        document_ids[4] = docs
    calls = mask_calls(torch.tensor(anchors), torch.tensor(depths), document_ids)
    for name, call in calls.items():
        if ops == "all" or name.startswith(ops):
            assert_deferred_like_immediate(call)


def test_mask_deferred_results_equal_immediate():
    calls = mask_calls(torch.tensor([0, 3, 5, 9, 2]), torch.tensor([0, 1, 2, 2, 0]), torch.tensor([0] * 6 + [1] * 6))
    for name, call in calls.items():
        immediate = call()
        with deferred_checks():
            deferred = call()
            check_errors()
        for a, e in zip(
            deferred if isinstance(deferred, tuple) else [deferred],
            immediate if isinstance(immediate, tuple) else [immediate],
            strict=True,
        ):
            assert torch.equal(a, e), name


@pytest.mark.parametrize("which", ["greedy", "sampling"])
def test_immediate_checks_refuse_a_capture_with_a_clear_error(which):
    """Immediate checks read the device's error table on the host, which a capture forbids: the op says to capture
    under deferred checks (instead of the capture's own error), and the same call captures under them."""
    a = good_inputs()
    a[5] = torch.full((2, 4), 0.5)
    call = calls(a)[which]
    call()  # warm-up outside the capture (allocations, module loading)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"capture it under peagle\.ops\.deferred_checks\(\)"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call()
    graph = torch.cuda.CUDAGraph()
    with deferred_checks():
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        check_errors()
    assert all(torch.equal(x, y) for x, y in zip(captured, call(), strict=True))
