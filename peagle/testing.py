"""Random inputs shared by the CPU tests, the CUDA tests and the benchmarks."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor


def fresh_seed() -> int:
    """A new seed per call (tests print it, so a failure can be replayed)."""
    return int.from_bytes(os.urandom(4), "little")


class PackedRow(NamedTuple):
    loss_mask: Tensor  # [T] bool
    document_ids: Tensor  # [T] int64, -1 = padding


def random_packed_row(
    generator: torch.Generator,
    length: int,
    *,
    mean_document_length: float = 200.0,
    trained_fraction: float = 0.7,
    padding_fraction: float = 0.1,
) -> PackedRow:
    """A packed row: documents of random lengths, a padding tail, and trained spans (runs of loss-masked labels)."""
    padding = int(length * padding_fraction * torch.rand((), generator=generator).item())
    used = length - padding
    document_ids = torch.full((length,), -1, dtype=torch.long)
    position, doc = 0, 0
    while position < used:
        size = 1 + int(torch.empty(()).exponential_(1.0 / mean_document_length, generator=generator).item())
        document_ids[position : min(used, position + size)] = doc
        position += size
        doc += 1
    # Trained labels come in spans, as assistant turns do.
    loss_mask = torch.zeros(length, dtype=torch.bool)
    position = 0
    while position < used:
        span = 1 + int(torch.randint(0, 64, (), generator=generator).item())
        if torch.rand((), generator=generator).item() < trained_fraction:
            loss_mask[position : min(used, position + span)] = True
        position += span
    return PackedRow(loss_mask, document_ids)
