"""Extracted rows in the drafter's index layout (DESIGN: index i pairs x_{i+1}, g_i and the target at i + 1)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from peagle.train.data import read_manifest

__all__ = ["ExtractedData", "MemoryRows", "TrainRow", "load_target_head", "shift_row"]


class TrainRow(NamedTuple):
    input_ids: Tensor  # [T] x_{i+1}
    hidden: Tensor  # [T, num_aux * H] g_i
    target_hidden: Tensor  # [T, H] final normalised target hidden at i + 1 (target logits = lm_head of it)
    document_ids: Tensor  # [T] document of index i, -1 where x_{i+1} is not in g_i's document (or padding)
    loss_mask: Tensor  # [T] bool: the label predicted at index i (token x_{i+2}) is trained


def shift_row(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, aux_hidden: Tensor, final_hidden: Tensor
) -> TrainRow:
    """Token-aligned extracted arrays -> the index layout of the drafter (one row, length T)."""
    length = input_ids.shape[0]
    docs = document_ids.long()
    nxt = torch.full_like(docs, -2)
    nxt[:-1] = docs[1:]
    nxt2 = torch.full_like(docs, -2)
    nxt2[:-2] = docs[2:]
    shifted_docs = torch.where((docs >= 0) & (nxt == docs), docs, torch.full_like(docs, -1))
    ids = torch.zeros(length, dtype=torch.long)
    ids[:-1] = input_ids[1:].long()
    trained = torch.zeros(length, dtype=torch.bool)
    trained[:-2] = loss_mask[2:].bool()
    trained &= (nxt2 == docs) & (shifted_docs >= 0)
    target = torch.zeros_like(final_hidden)
    target[:-1] = final_hidden[1:]
    return TrainRow(ids, aux_hidden, target, shifted_docs, trained)


def load_target_head(directory: str | os.PathLike) -> dict[str, Tensor]:
    """The target's ``lm_head.weight`` and ``embed_tokens.weight`` (float32) an ``extract`` output directory holds."""
    return load_file(Path(directory) / "target_head.safetensors")


class ExtractedData:
    """Random access to the rows of an ``extract`` output directory (one row read at a time)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.manifest: dict[str, Any] = read_manifest(directory, "peagle-extracted")
        if not self.manifest.get("complete"):
            raise ValueError(f"{directory}: extraction is not complete; run `peagle extract` again to finish it")
        self._starts = []
        total = 0
        for shard in self.manifest["shards"]:
            self._starts.append(total)
            total += shard["rows"]
        self.num_rows = total
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return self.num_rows

    def raw(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range [0, {self.num_rows})")
        shard = max(i for i, s in enumerate(self._starts) if s <= index)
        name = self.manifest["shards"][shard]["file"]
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        handle = self._handles[name]
        r = index - self._starts[shard]
        return {k: handle.get_slice(k)[r : r + 1][0] for k in handle.keys()}

    def target_head(self) -> dict[str, Tensor]:
        return load_target_head(self.directory)

    def row(self, index: int, dtype: torch.dtype = torch.float32) -> TrainRow:
        raw = self.raw(index)
        return raw_row(raw, dtype)


def raw_row(raw: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> TrainRow:
    """The index layout of one row as ``extract`` stores it (``input_ids``, ``loss_mask``, ``document_ids``,
    ``aux_hidden``, ``final_hidden``), hidden states in ``dtype``."""
    return shift_row(
        raw["input_ids"],
        raw["loss_mask"],
        raw["document_ids"],
        raw["aux_hidden"].to(dtype),
        raw["final_hidden"].to(dtype),
    )


class MemoryRows:
    """Rows held in memory with the interface of :class:`ExtractedData` (``manifest``, ``row``, ``target_head``):
    the held-out rows a streaming run receives from its producers instead of reading them from disk."""

    def __init__(self, manifest: dict[str, Any], head: dict[str, Tensor], rows: list[dict[str, Tensor]]) -> None:
        self.manifest, self._head, self._rows = manifest, head, rows

    def __len__(self) -> int:
        return len(self._rows)

    def target_head(self) -> dict[str, Tensor]:
        return self._head

    def row(self, index: int, dtype: torch.dtype = torch.float32) -> TrainRow:
        return raw_row(self._rows[index], dtype)
