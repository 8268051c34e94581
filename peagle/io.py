"""Atomic file writes: every file goes to a temporary name in its directory and is renamed into place, so a crash
never leaves a half-written file that looks complete (checkpoints, data shards, manifests, reports). Whole directories
are built in a staging directory and published by one rename; what killed writes leave behind is removed at the next
start (:func:`remove_temporaries`).

The bottom layer of peagle: every package may import it, and it imports none of them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "atomic_save_tensors",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_output_directory",
    "clear_directory",
    "is_empty_directory",
    "publish_directory",
    "remove_temporaries",
    "staging_directory",
]


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


# ---------------------------------------------------------------------------------------------------------------------
# Output directories: staged and published whole, or refused when they hold an earlier run.


def check_output_directory(
    path: str | os.PathLike, inputs: dict[str, str | os.PathLike] | None = None, flag: str = "--out"
) -> Path:
    """``path`` as a Path; ValueError naming ``flag`` when it exists and is not a directory, or when it is or holds
    one of ``inputs`` ({option: path}): clearing or replacing it would destroy that input."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output ({flag}) {path} is a file; expected a directory (new or empty)")
    out = path.resolve()
    for option, source in (inputs or {}).items():
        resolved = Path(source).resolve()
        if resolved == out or out in resolved.parents:
            raise ValueError(f"output ({flag}) {path} holds the input ({option}) {source}; choose another directory")
    return path


def is_empty_directory(path: str | os.PathLike) -> bool:
    """True for a missing or empty directory."""
    path = Path(path)
    return not path.exists() or not any(path.iterdir())


def clear_directory(path: str | os.PathLike) -> None:
    """Removes everything inside ``path`` (which stays, empty)."""
    for entry in Path(path).iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def remove_temporaries(directory: str | os.PathLike) -> None:
    """Removes what killed writes left in ``directory`` and its subdirectories: the ``.NAME.*.tmp`` files of atomic
    writes and the ``.NAME.staging-*`` directories of :func:`staging_directory`. Published files are not touched."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in list(directory.rglob(".*")):
        if entry.is_dir() and ".staging-" in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)


def staging_directory(final: str | os.PathLike) -> Path:
    """A new empty directory beside ``final`` to build its content in, published whole by :func:`publish_directory`
    (readers never see a half-built ``final``). Staging directories that killed runs left for ``final`` go first."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for old in final.parent.glob(f".{final.name}.staging-*"):
        shutil.rmtree(old, ignore_errors=True)
    staging = final.parent / f".{final.name}.staging-{os.getpid()}-{os.urandom(4).hex()}"
    staging.mkdir()  # the usual permissions (mkdtemp's would be owner-only once published)
    return staging


def publish_directory(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Moves a complete ``staging`` directory to ``final`` in one rename, replacing what ``final`` held: on Linux the
    two directories are exchanged in one step (a reader sees the old or the new one, never neither), elsewhere the old
    one is removed first."""
    final = Path(final)
    if final.exists():
        if _exchange(staging, final):
            shutil.rmtree(staging)  # now the old content
            _fsync_directory(final.parent)
            return
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_directory(final.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def _exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swaps two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    except (OSError, AttributeError):
        return False
