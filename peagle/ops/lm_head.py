"""The efficient LM head: a rank-r factorisation scores the whole vocabulary, the exact head rescores the best C.

Inputs: ``hidden`` [N, H] (one row per drafted token), ``down`` [r, H] and ``up`` [V, r] (the low-rank head, D and U:
the scores are ``up @ (down @ h)``) and ``weight`` [V, H] (the full LM head), all float32, bfloat16 or float16 (one
dtype, one device). For every row:

1. ``z = down @ h`` with float32 accumulation, rounded to the inputs' dtype (the GEMM that scores the vocabulary takes
   both operands in one dtype; float32 inputs are not rounded);
2. ``s = up @ z`` with float32 accumulation: one low-rank score per token (a NaN score counts as -inf);
3. the ``num_candidates`` = C best tokens by score, ordered by score descending, ties to the lower token id
   (-0.0 and +0.0 tie);
4. ``candidate_logits = weight[ids] @ h`` with float32 accumulation: the exact full-head logits of those C tokens.

Outputs: ``candidate_ids`` [N, C] int64 and ``candidate_logits`` [N, C] float32. The kernels never hold [N, V] scores
or logits: the CPU scores the vocabulary in blocks and keeps a bounded top-C buffer per row (memory O(N (C + block))),
CUDA runs the low-rank scoring as CUTLASS GEMMs over vocabulary chunks with the top-C selection in the kernel after
each chunk. :func:`efficient_lm_head_full_logits` scatters the op's output into the [N, V] logits (-inf outside the
candidates) for callers that need a distribution; that tensor is built after the op, from its [N, C] output.

No autograd: the op is for serving. Training fits the low-rank head with plain PyTorch (KL(full || low rank)), and
:func:`efficient_lm_head` raises when an input requires a gradient under grad mode.

The reference below is the executable specification (it materialises [N, V]; the op does not).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["efficient_lm_head", "efficient_lm_head_full_logits", "efficient_lm_head_reference"]


def efficient_lm_head(
    hidden: Tensor, down: Tensor, up: Tensor, weight: Tensor, num_candidates: int
) -> tuple[Tensor, Tensor]:
    """The C best tokens of each row by low-rank score, with their exact full-head logits.

    Args:
        hidden: [N, H] float32/bfloat16/float16 hidden states (one row per drafted token).
        down: [r, H] the low-rank head's down projection D (same dtype and device).
        up: [V, r] the low-rank head's up projection U.
        weight: [V, H] the full LM head.
        num_candidates: C, in [1, V].

    Returns:
        candidate_ids [N, C] int64 (score descending, ties to the lower id) and candidate_logits [N, C] float32
        (``weight[ids] @ h``).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, down, up, weight)):
        raise RuntimeError(
            "peagle.efficient_lm_head has no backward (it serves drafts); call it under torch.no_grad() or "
            "torch.inference_mode(), and train the heads with plain PyTorch (e.g. efficient_lm_head_reference's math)"
        )
    return torch.ops.peagle.efficient_lm_head(hidden, down, up, weight, num_candidates)


def efficient_lm_head_full_logits(
    hidden: Tensor, down: Tensor, up: Tensor, weight: Tensor, num_candidates: int
) -> Tensor:
    """[N, V] float32 logits: the exact full-head logit at each row's C candidates, -inf everywhere else.

    Built by a scatter from :func:`efficient_lm_head`'s [N, C] output (so this one tensor is [N, V]); softmax over it
    is the drafter's distribution restricted to the candidates.
    """
    ids, logits = efficient_lm_head(hidden, down, up, weight, num_candidates)
    full = logits.new_full((hidden.shape[0], up.shape[0]), float("-inf"))
    return full.scatter_(1, ids, logits)


@torch.library.register_fake("peagle::efficient_lm_head")
def _efficient_lm_head_fake(hidden, down, up, weight, num_candidates):
    rows = hidden.shape[0]
    return (
        hidden.new_empty(rows, num_candidates, dtype=torch.long),
        hidden.new_empty(rows, num_candidates, dtype=torch.float32),
    )


def low_rank_scores_reference(hidden: Tensor, down: Tensor, up: Tensor) -> Tensor:
    """[N, V] float32 low-rank scores ``up @ round(down @ h)`` (steps 1-2 of the module docstring), NaN -> -inf."""
    z = (hidden.float() @ down.float().T).to(hidden.dtype).float()
    scores = z @ up.float().T
    return scores.masked_fill(scores.isnan(), float("-inf"))


def efficient_lm_head_reference(
    hidden: Tensor, down: Tensor, up: Tensor, weight: Tensor, num_candidates: int
) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch :func:`efficient_lm_head` (valid inputs assumed: the op holds the checks).

    A stable descending sort keeps equal scores in token-id order, so ties go to the lower id.
    """
    scores = low_rank_scores_reference(hidden, down, up)
    ids = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_candidates]
    rows = weight[ids].float()  # [N, C, H]
    logits = (rows @ hidden.float()[:, :, None]).squeeze(-1)
    return ids, logits
