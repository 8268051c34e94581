"""Deferred checks: validation that stays on the device, so that serving ops can be captured in a CUDA graph.

By default (immediate checks) an op that finds a bad value raises at once; on CUDA that costs a device-to-host copy, a
synchronisation that a CUDA graph cannot capture. While deferred checks are on (:func:`deferred_checks`, or
:func:`set_deferred_checks`), the CUDA kernels of the ops below record their first bad value in a per-device error
record instead (the first error wins; no synchronisation), and :func:`check_errors` synchronises, raises that error as a
``RuntimeError`` with the message the immediate check gives (naming the op and the argument) and resets the record.
The engine calls :func:`check_errors` where it reads the emitted tokens back.

Ops with a deferred mode on CUDA (:data:`DEFERRED_OPS`):

* ``tree_verify_greedy``, ``tree_rejection_sample``;
* ``kv_compact`` (as in immediate mode, it changes nothing when a request is bad);
* ``gdn_tree_verify``, ``gdn_tree_verify_slots``, ``gdn_commit``, ``causal_conv1d_tree``, ``causal_conv1d_commit``
  with ``validate=True`` (their kernels guard themselves as with ``validate=False``: bad requests get NaN outputs or
  are not committed; the check is one more kernel of one block, so keep ``validate=False`` where speed matters and
  the inputs are trusted; ``gdn_commit``, ``gdn_tree_verify_slots`` and ``causal_conv1d_commit`` with slots claim
  their slots on the device whenever the host did not check them, even with ``validate=False`` and deferred checks
  off: requests that share a slot leave it unchanged and :func:`check_errors` raises);
* ``cod_gather``, ``cod_gather_backward`` (with the CUDA message, "some element is out of range");
* ``mask_dense``, ``mask_block``, ``mask_slice_dense``, ``mask_slice_block`` (bad anchors / depths are clamped into
  range for the kernels: the outputs of a bad call are garbage, never an out-of-bounds read);
* ``tree_select``, ``tree_build_parallel``, ``tree_expand_topk`` (a bad request keeps the padding of its outputs;
  ``tree_expand_topk`` leaves its rows unwritten).

Still synchronising in either mode: ``cod_gather``'s range check of ``input_ids`` when ``vocab_size`` is given and
``cod_sample`` (its output size depends on the data).
Shape, dtype and device checks are always immediate (they need no device data). CPU kernels always raise immediately,
and :func:`check_errors` is a no-op where no CUDA device ever recorded.

Turning deferred checks on allocates the current CUDA device's record; another device gets its record at its first
deferred op outside a capture. So turn them on with the capturing device current, or run the ops once before capturing
(as a warm-up does). The mode is process-wide and read when an op is launched, so a captured graph keeps the mode it was
captured in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["DEFERRED_OPS", "check_errors", "deferred_checks", "set_deferred_checks"]

DEFERRED_OPS = (
    "tree_verify_greedy",
    "tree_rejection_sample",
    "kv_compact",
    "gdn_tree_verify",
    "gdn_tree_verify_slots",
    "gdn_commit",
    "causal_conv1d_tree",
    "causal_conv1d_commit",
    "cod_gather",
    "cod_gather_backward",
    "mask_dense",
    "mask_block",
    "mask_slice_dense",
    "mask_slice_block",
    "tree_select",
    "tree_build_parallel",
    "tree_expand_topk",
)


def set_deferred_checks(enabled: bool) -> bool:
    """Turns deferred checks on or off for the process; returns the previous mode."""
    return bool(torch.ops.peagle.set_deferred_checks(bool(enabled)))


def check_errors() -> None:
    """Raises (RuntimeError) the first error a deferred check recorded on any CUDA device, and resets the records.

    Synchronises the devices that have a record; returns at once on the CPU.
    """
    torch.ops.peagle.check_errors()


@contextmanager
def deferred_checks(enabled: bool = True) -> Iterator[None]:
    """Deferred checks on (or off) inside the block; the previous mode is restored on exit."""
    previous = set_deferred_checks(enabled)
    try:
        yield
    finally:
        set_deferred_checks(previous)
