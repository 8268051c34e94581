"""Checkpoints in the speculators format: ``config.json`` + ``model.safetensors`` (vLLM serves the directory as is).

Every file is written atomically (:mod:`peagle.io`), so a crash never leaves a half-written checkpoint that looks
complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from peagle.io import atomic_save_tensors, atomic_write_json
from peagle.model.config import DrafterConfig
from peagle.model.drafter import PEagleDrafter

__all__ = ["from_pretrained", "load_state_dict", "save_pretrained"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_pretrained(model: PEagleDrafter, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` (weights in ``dtype``, default: as they are)."""
    directory = Path(directory)
    state = {}
    for name, tensor in model.state_dict().items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor
    config = model.config.to_speculators_dict()
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    else:
        config["torch_dtype"] = str(model.fc.weight.dtype).removeprefix("torch.")
    # Weights first, config last: a directory with a config.json always has its weights.
    atomic_save_tensors(directory / WEIGHTS, state, metadata={"format": "pt"})
    atomic_write_json(directory / CONFIG, config)
    return directory


def load_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint directory (single file or a sharded ``model.safetensors.index.json``)."""
    directory = Path(directory)
    single = directory / WEIGHTS
    if single.exists():
        return load_file(single)
    index = directory / f"{WEIGHTS}.index.json"
    if index.exists():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(directory / shard))
        return state
    raise FileNotFoundError(f"no {WEIGHTS} (or {WEIGHTS}.index.json) in {directory}")


def from_pretrained(directory: str | os.PathLike, dtype: torch.dtype | None = None) -> PEagleDrafter:
    """Loads a peagle- or speculators-written P-EAGLE checkpoint directory."""
    directory = Path(directory)
    config_path = directory / CONFIG
    if not config_path.exists():
        raise FileNotFoundError(f"no {CONFIG} in {directory}: not a drafter checkpoint directory")
    config = DrafterConfig.from_speculators_dict(json.loads(config_path.read_text()))
    state = load_state_dict(directory)
    # Verifier-owned tensors (speculators keeps them in memory only) are not part of the drafter.
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    model = PEagleDrafter(config)
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(model.mask_hidden.shape)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match its config.json: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if dtype is not None:
        model = model.to(dtype)
    else:
        floating = [v.dtype for v in state.values() if v.is_floating_point()]
        if floating:
            model = model.to(floating[0])
    return model
