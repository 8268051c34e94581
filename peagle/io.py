"""Atomic file writes: every file goes to a temporary name in its directory and is renamed into place, so a crash
never leaves a half-written file that looks complete (checkpoints, data shards, manifests, reports).

The bottom layer of peagle: every package may import it, and it imports none of them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["atomic_save_tensors", "atomic_torch_save", "atomic_write_bytes", "atomic_write_json"]


def _atomic_replace(path: Path, write: Callable[[str], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_replace(Path(path), lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_save_tensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """A safetensors file of ``tensors`` (detached, contiguous, on the CPU)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _atomic_replace(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    _atomic_replace(Path(path), lambda tmp: torch.save(obj, tmp))
