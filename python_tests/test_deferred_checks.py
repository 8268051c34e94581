"""Deferred checks on the CPU: the mode switch, check_errors as a no-op, and CPU kernels that still raise at once with
the immediate message. The device side (records, graph capture): cuda_tests/test_deferred_checks_cuda.py."""

from __future__ import annotations

import pytest
import torch

import peagle  # noqa: F401
from peagle.ops import DEFERRED_OPS, check_errors, deferred_checks, set_deferred_checks, tree_verify_greedy


@pytest.fixture(autouse=True)
def immediate_after():
    yield
    set_deferred_checks(False)


def duplicate_siblings():
    parent = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.tensor([[0, 1, 1, 3]])
    return parent, tokens, torch.tensor([4]), torch.full((1, 4, 5), 0.2)


def test_switch_returns_the_previous_mode():
    assert set_deferred_checks(True) is False
    assert set_deferred_checks(True) is True
    assert set_deferred_checks(False) is True
    assert torch.ops.peagle.set_deferred_checks(False) is False


def test_context_manager_restores_the_mode_on_error():
    with pytest.raises(ValueError), deferred_checks():
        assert set_deferred_checks(True) is True
        raise ValueError
    assert set_deferred_checks(False) is False
    set_deferred_checks(True)
    with deferred_checks(False):
        assert set_deferred_checks(False) is False
    assert set_deferred_checks(False) is True


def test_check_errors_is_a_no_op_on_cpu():
    assert check_errors() is None
    with deferred_checks():
        assert check_errors() is None


def test_cpu_kernels_raise_immediately_with_the_same_message():
    with pytest.raises(RuntimeError) as immediate:
        tree_verify_greedy(*duplicate_siblings())
    with deferred_checks(), pytest.raises(RuntimeError) as deferred:
        tree_verify_greedy(*duplicate_siblings())
    expected = (
        "peagle.tree_verify_greedy: sibling tokens must be distinct, got duplicate token 1 at node 2 of request 0"
    )
    assert str(immediate.value).startswith(expected)
    assert str(deferred.value) == str(immediate.value)
    check_errors()  # nothing was recorded


def test_mode_ops_are_composite():
    """No tensor to dispatch on: one composite kernel (no CPU or CUDA kernel, so no sanitizer case is needed)."""
    for name in ("peagle::set_deferred_checks", "peagle::check_errors"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    assert set(DEFERRED_OPS) <= {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()}
