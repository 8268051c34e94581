"""Checkpoints in the speculators format: ``config.json`` + ``model.safetensors`` (vLLM serves the directory as is).

Every file is written atomically (:mod:`peagle.io`), so a crash never leaves a half-written checkpoint that looks
complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from peagle.io import atomic_save_tensors, atomic_write_json
from peagle.model.config import DrafterConfig
from peagle.model.drafter import PEagleDrafter

__all__ = ["from_pretrained", "load_state_dict", "save_pretrained", "warm_start"]

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


# Fields a warm start's source must share with the drafter it starts (they shape or define the copied weights).
SHARED_FIELDS = {
    "hidden_size": "the target's hidden size",
    "vocab_size": "the target's vocabulary",
    "aux_layer_ids": "the extracted aux layers",
    "num_layers": "--layers",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "intermediate_size": "--intermediate-size",
    "layer_style": "--layer-style",
    "draft_vocab_size": "--draft-vocab-size",
    "fc_norm": "--fc-norm",
    "norm_before_fc": "--norm-before-fc",
    "norm_before_residual": "norm_before_residual",
    "attention_bias": "attention_bias",
    "rope_theta": "rope_theta",
}


@torch.no_grad()
def warm_start(model: PEagleDrafter, directory: str | os.PathLike) -> dict[str, Any]:
    """Copies the weights a P-EAGLE drafter shares with an EAGLE-3 checkpoint (speculators format, written by peagle
    or by speculators) into ``model``: fc, the decoder layers, norms, LM head, the draft vocabulary (d2t/t2d) and the
    token embeddings except the row of ``model``'s mask token. ``mask_hidden`` and that row keep ``model``'s own
    initialisation, unless the source is a P-EAGLE drafter (K > 1) with the same mask token, whose trained ones are
    copied too. Returns what was copied and what was initialised (parameter names; the row as
    ``embed_tokens.weight[ID]``).

    Raises:
        ValueError: the source differs from ``model`` in a field that shapes the shared weights (named with its
            ``peagle train`` option), or lacks one of them.
    """
    directory = Path(directory)
    config_path = directory / CONFIG
    if not config_path.exists():
        raise FileNotFoundError(f"--init-from: no {CONFIG} in {directory}: not a drafter checkpoint directory")
    source = DrafterConfig.from_speculators_dict(json.loads(config_path.read_text()))
    ours = model.config
    differ = [
        f"{name} {getattr(source, name)!r} (ours {getattr(ours, name)!r}: {where})"
        for name, where in SHARED_FIELDS.items()
        if getattr(source, name) != getattr(ours, name)
    ]
    if differ:
        raise ValueError(f"--init-from {directory} does not fit this drafter: its " + "; its ".join(differ))
    state = {k: v for k, v in load_state_dict(directory).items() if not k.startswith("verifier_")}
    parallel = source.num_depths > 1 and source.mask_token_id == ours.mask_token_id and "mask_hidden" in state
    mask_row = f"embed_tokens.weight[{ours.mask_token_id}]"
    initialised = [] if parallel else ["mask_hidden", mask_row]
    own = model.state_dict()
    missing = sorted(set(own) - set(state) - {"mask_hidden"})
    if missing:
        raise ValueError(f"--init-from {directory} lacks shared weights: {missing}")
    copied = []
    for name, tensor in state.items():
        if name not in own or (name == "mask_hidden" and not parallel):
            continue
        target = own[name]
        if name == "embed_tokens.weight" and not parallel:
            kept = target[ours.mask_token_id].clone()
            target.copy_(tensor.reshape(target.shape))
            target[ours.mask_token_id] = kept
        else:
            target.copy_(tensor.reshape(target.shape))
        copied.append(name)
    if parallel:
        copied.append(mask_row)
    return {
        "source": str(directory),
        "source_kind": "P-EAGLE" if source.num_depths > 1 else "EAGLE-3",
        "copied": sorted(copied),
        "initialised": initialised,
    }
