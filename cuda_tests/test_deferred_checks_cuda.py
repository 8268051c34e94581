"""Deferred checks on CUDA: no host synchronisation in the ops that have the mode, the immediate check's message from
check_errors(), the first error wins, the record is reset, and results equal the immediate mode's. The graph-captured
verify round: test_graph_capture_round_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import check_errors, deferred_checks, set_deferred_checks, tree_rejection_sample, tree_verify_greedy
from testkit import random_tree_batch, random_tree_probs

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


def message(error: BaseException) -> str:
    return str(error).splitlines()[0]


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
        immediate = message(error)
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
    assert message(deferred.value) == immediate
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
