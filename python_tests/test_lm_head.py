"""efficient_lm_head: the reference against an exact integer brute force, z rounding, non-finite scores."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import efficient_lm_head_reference
from peagle.ops.lm_head import low_rank_scores_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class HeadInputs(NamedTuple):
    hidden: torch.Tensor  # [N, H]
    down: torch.Tensor  # [r, H]
    up: torch.Tensor  # [V, r]
    weight: torch.Tensor  # [V, H]

    def to(self, device) -> HeadInputs:
        return HeadInputs(*(t.to(device) for t in self))


def random_inputs(
    generator, rows: int, hidden_size: int, rank: int, vocab: int, dtype=torch.float32, kind: str = "integer"
) -> HeadInputs:
    """kind "integer": entries in {-1, 0, 1}, so every product and sum (|z| <= H <= 256, scores and logits small
    integers) is exact in float32 and z is exact in bfloat16/float16: any accumulation order gives the same bits, and
    scores tie often. kind "normal": Gaussian entries scaled like a trained head (scores and logits of order 1)."""

    def draw(*shape, scale=1.0):
        if kind == "integer":
            return torch.randint(-1, 2, shape, generator=generator).to(dtype)
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    return HeadInputs(
        draw(rows, hidden_size),
        draw(rank, hidden_size, scale=hidden_size**-0.5),
        draw(vocab, rank, scale=rank**-0.5),
        draw(vocab, hidden_size, scale=hidden_size**-0.5),
    )


def brute_force(inputs: HeadInputs, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer inputs only: exact int64 scores and logits, and a per-row Python sort by (-score, id)."""
    h = inputs.hidden.long()
    scores = (h @ inputs.down.long().T) @ inputs.up.long().T
    logits = h @ inputs.weight.long().T
    ids = [
        sorted(range(scores.shape[1]), key=lambda v, row=row: (-int(row[v]), v))[:num_candidates]
        for row in scores.tolist()
        for row in [torch.tensor(row)]
    ]
    ids = torch.tensor(ids, dtype=torch.long).reshape(h.shape[0], num_candidates)
    return ids, logits.gather(1, ids).float()


SHAPES = [  # rows N, hidden H, rank r, vocab V, candidates C
    (1, 8, 2, 5, 1),
    (3, 16, 4, 50, 50),
    (5, 33, 3, 300, 7),
    (2, 64, 8, 1000, 128),
    (4, 7, 1, 200, 199),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_integer_brute_force(generator, dtype, shape):
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype)
    ids, logits = efficient_lm_head_reference(*inputs, candidates)
    want_ids, want_logits = brute_force(inputs, candidates)
    assert ids.dtype == torch.long and logits.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert torch.equal(logits, want_logits)


def test_reference_rounds_z_to_the_input_dtype():
    """z = down @ h = 1 + 2^-9 is exact in float32 and rounds to 1 in bfloat16 (8 significant bits)."""
    hidden, down, up = torch.tensor([[1.0, 2.0**-9]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0]])
    assert low_rank_scores_reference(hidden, down, up).item() == 1.0 + 2.0**-9
    assert low_rank_scores_reference(hidden.bfloat16(), down.bfloat16(), up.bfloat16()).item() == 1.0


def test_reference_non_finite_and_signed_zero_scores():
    """NaN scores count as -inf (they come last, in id order with the -inf ones); -0.0 and +0.0 tie."""
    hidden = torch.tensor([[1.0]])
    down = torch.tensor([[1.0]])
    up = torch.tensor([[float("nan")], [-0.0], [float("-inf")], [0.0], [2.0], [float("inf")]])
    weight = torch.arange(6.0)[:, None]
    ids, logits = efficient_lm_head_reference(hidden, down, up, weight, 6)
    assert ids.tolist() == [[5, 4, 1, 3, 0, 2]]
    assert logits.tolist() == [[5.0, 4.0, 1.0, 3.0, 0.0, 2.0]]
