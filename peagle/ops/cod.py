"""COD sampling and the fused COD gather: the first stage of a P-EAGLE training step.

A packed training row of T positions becomes N elements (anchor a, depth d). Depth 0 is every position in order; depth
d >= 1 keeps floor(n_seeds * max(ratio^d, ratio_min)) chains drawn uniformly without replacement from the chains kept at
depth d - 1 that can extend (the next label is in the same document and trained). ``cod_gather`` then lays out the
drafter inputs of those elements in one pass.

The references below are the executable specification: the CPU and CUDA kernels must match them exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["CodInputs", "cod_gather", "cod_gather_reference", "cod_sample", "cod_sample_reference"]


class CodInputs(NamedTuple):
    """Drafter inputs of N COD elements."""

    ids: Tensor  # [N] input token (depth 0) or mask token (deeper)
    feats: Tensor  # [N, D] target hidden state (depth 0) or mask_hidden (deeper)
    position_ids: Tensor  # [N] a + d
    label_index: Tensor  # [N] a + d: the row whose target distribution the element predicts


def cod_sample(
    loss_mask: Tensor,
    document_ids: Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Samples COD elements of one packed row.

    Args:
        loss_mask: [T] bool/int/float, nonzero where the label at that index is trained.
        document_ids: [T] int32/int64 document of each position, -1 for padding (the rule of every op: ids below -1
            are an error).
        num_depths: K >= 1, the number of parallel depths (K = 1: depth 0 only, autoregressive EAGLE-3).
        ratio: r in (0, 1], geometric keep ratio per depth.
        ratio_min: floor of the keep ratio, in [0, ratio].
        max_anchors: cap on the seed chains (uniformly chosen), None for no cap.
        seed: selection seed; the result is a deterministic function of the inputs and the seed.

    Returns:
        anchors, depths: int64 [N], depth 0 (all T positions) first, then each depth sorted by anchor.
    """
    return torch.ops.peagle.cod_sample(loss_mask, document_ids, num_depths, ratio, ratio_min, max_anchors, seed)


def cod_gather(
    input_ids: Tensor,
    hidden: Tensor,
    mask_hidden: Tensor,
    anchors: Tensor,
    depths: Tensor,
    mask_token_id: int,
    vocab_size: int | None = None,
) -> CodInputs:
    """Gathers drafter inputs for COD elements in one pass (differentiable in ``hidden`` and ``mask_hidden``).

    Args:
        input_ids: [T] int32/int64, the token x_{i+1} paired with hidden row i.
        hidden: [T, D] target hidden states (float32/bfloat16/float16/float64).
        mask_hidden: [D] (or [1, D], [1, 1, D]) learnable hidden of mask elements; cast to hidden's dtype.
        anchors, depths: [N] elements, e.g. from :func:`cod_sample`.
        mask_token_id: token id of mask elements.
        vocab_size: when given, mask_token_id must be below it.
    """
    if mask_hidden.dim() > 1 and all(s == 1 for s in mask_hidden.shape[:-1]):
        mask_hidden = mask_hidden.reshape(-1)
    if mask_hidden.dtype != hidden.dtype and mask_hidden.is_floating_point():
        mask_hidden = mask_hidden.to(hidden.dtype)
    feats, ids, position_ids, label_index = torch.ops.peagle.cod_gather(
        input_ids, hidden, mask_hidden, anchors, depths, mask_token_id, vocab_size
    )
    return CodInputs(ids, feats, position_ids, label_index)


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


@torch.library.register_fake("peagle::cod_sample")
def _cod_sample_fake(loss_mask, document_ids, num_depths, ratio, ratio_min, max_anchors, seed):
    num_elements = torch.library.get_ctx().new_dynamic_size()
    return loss_mask.new_empty(num_elements, dtype=torch.long), loss_mask.new_empty(num_elements, dtype=torch.long)


@torch.library.register_fake("peagle::cod_gather")
def _cod_gather_fake(input_ids, hidden, mask_hidden, anchors, depths, mask_token_id, vocab_size=None):
    n = anchors.shape[0]
    return (
        hidden.new_empty(n, hidden.shape[1]),
        input_ids.new_empty(n),
        anchors.new_empty(n, dtype=torch.long),
        anchors.new_empty(n, dtype=torch.long),
    )


@torch.library.register_fake("peagle::cod_gather_backward")
def _cod_gather_backward_fake(grad_feats, anchors, depths, num_positions):
    return grad_feats.new_empty(num_positions, grad_feats.shape[1]), grad_feats.new_empty(grad_feats.shape[1])


# ---------------------------------------------------------------------------------------------------------------------
# Autograd: the gather is linear in (hidden, mask_hidden); its adjoint is cod_gather_backward and vice versa.


def _cod_gather_setup_context(ctx, inputs, output):
    _, hidden, _, anchors, depths, _, _ = inputs
    ctx.save_for_backward(anchors, depths)
    ctx.num_positions = hidden.shape[0]


def _cod_gather_backward(ctx, grad_feats, grad_ids, grad_position_ids, grad_label_index):
    if grad_feats is None:
        return None, None, None, None, None, None, None
    anchors, depths = ctx.saved_tensors
    grad_hidden, grad_mask_hidden = torch.ops.peagle.cod_gather_backward(
        grad_feats.contiguous(), anchors, depths, ctx.num_positions
    )
    return None, grad_hidden, grad_mask_hidden, None, None, None, None


torch.library.register_autograd("peagle::cod_gather", _cod_gather_backward, setup_context=_cod_gather_setup_context)


def _cod_gather_backward_setup_context(ctx, inputs, output):
    _, anchors, depths, num_positions = inputs
    ctx.save_for_backward(anchors, depths)
    ctx.num_positions = num_positions


def _cod_gather_double_backward(ctx, grad_grad_hidden, grad_grad_mask_hidden):
    anchors, depths = ctx.saved_tensors
    if grad_grad_hidden is None and grad_grad_mask_hidden is None:
        return None, None, None, None
    like = grad_grad_hidden if grad_grad_hidden is not None else grad_grad_mask_hidden
    width = like.shape[-1]
    if grad_grad_hidden is None:
        grad_grad_hidden = like.new_zeros(ctx.num_positions, width)
    if grad_grad_mask_hidden is None:
        grad_grad_mask_hidden = like.new_zeros(width)
    no_ids = torch.zeros(ctx.num_positions, dtype=torch.long, device=like.device)
    grad_grad_feats, _, _, _ = torch.ops.peagle.cod_gather(
        no_ids, grad_grad_hidden.contiguous(), grad_grad_mask_hidden.contiguous(), anchors, depths, 0, None
    )
    return grad_grad_feats, None, None, None


torch.library.register_autograd(
    "peagle::cod_gather_backward", _cod_gather_double_backward, setup_context=_cod_gather_backward_setup_context
)


# ---------------------------------------------------------------------------------------------------------------------
# Pure-PyTorch references (the executable spec). The selection keys mirror csrc/include/peagle/cod.h bit for bit:
# uint64 arithmetic is emulated on int64 tensors (wrapping multiply/add, logical shifts by masking).


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right_logical(x: Tensor, bits: int) -> Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: Tensor) -> Tensor:
    z = z + _signed64(0x9E3779B97F4A7C15)
    z = (z ^ _shift_right_logical(z, 30)) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right_logical(z, 27)) * _signed64(0x94D049BB133111EB)
    return z ^ _shift_right_logical(z, 31)


_DEPTH_SALT = 0xD6E8FEB86659FD93


def _selection_keys(seed: int, depth: int, anchors: Tensor) -> Tensor:
    per_depth = _mix64(torch.tensor([_signed64(seed ^ (depth * _DEPTH_SALT))], dtype=torch.long))
    return _shift_right_logical(_mix64(per_depth.to(anchors.device) ^ anchors), 1)


def _depth_count(n_seeds: int, ratio: float, ratio_min: float, depth: int) -> int:
    keep = 1.0
    for _ in range(depth):
        keep *= ratio  # repeated multiplication, as the kernels do, so every backend rounds alike
    return int(n_seeds * max(keep, ratio_min))


def _keep_smallest_keys(candidates: Tensor, count: int, seed: int, depth: int) -> Tensor:
    if count >= candidates.numel():
        return candidates
    order = torch.sort(_selection_keys(seed, depth, candidates), stable=True).indices  # ties: smaller anchor first
    return torch.sort(candidates[order[:count]]).values


def cod_sample_reference(
    loss_mask: Tensor,
    document_ids: Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch :func:`cod_sample` (same outputs for the same seed)."""
    length = loss_mask.shape[0]
    device = loss_mask.device
    trained = loss_mask != 0
    docs = document_ids.long()

    def extends(anchors: Tensor, depth: int) -> Tensor:
        label = anchors + depth
        inside = label < length
        label = label.clamp(max=max(length - 1, 0))
        doc = docs[anchors]
        return inside & (doc >= 0) & (docs[label] == doc) & trained[label]

    positions = torch.arange(length, device=device)
    pool = positions[extends(positions, 1)]
    if max_anchors is not None:
        pool = _keep_smallest_keys(pool, max_anchors, seed, 0)
    n_seeds = pool.numel()
    anchors, depths = [positions], [torch.zeros(length, dtype=torch.long, device=device)]
    for depth in range(1, num_depths):
        count = min(_depth_count(n_seeds, ratio, ratio_min, depth), pool.numel())
        if count <= 0:
            break
        pool = _keep_smallest_keys(pool, count, seed, depth)
        anchors.append(pool)
        depths.append(torch.full((count,), depth, dtype=torch.long, device=device))
        pool = pool[extends(pool, depth + 1)]
    return torch.cat(anchors), torch.cat(depths)


def cod_gather_reference(
    input_ids: Tensor,
    hidden: Tensor,
    mask_hidden: Tensor,
    anchors: Tensor,
    depths: Tensor,
    mask_token_id: int,
) -> CodInputs:
    """Pure-PyTorch :func:`cod_gather` (differentiable through torch's own indexing)."""
    anchors, depths = anchors.long(), depths.long()
    real = depths == 0
    mask_ids = torch.full_like(anchors, mask_token_id).to(input_ids.dtype)
    ids = torch.where(real, input_ids[anchors], mask_ids)
    feats = torch.where(real[:, None], hidden[anchors], mask_hidden.reshape(1, -1).to(hidden.dtype))
    positions = anchors + depths
    return CodInputs(ids, feats, positions, positions.clone())
