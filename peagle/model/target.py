"""Loading a target: a transformers causal LM of a supported family, from a directory or as a module.

Shared by the serving side (:class:`peagle.decode.TargetRunner` runs it) and the training side (hidden-state
extraction reads it), which are siblings over this package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "check_context",
    "context_limit",
    "llama_config",
    "load_target",
    "load_target_model",
    "read_target_tensors",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_next")


def context_limit(config: Any) -> int | None:
    """The positions a target was built for (``max_position_embeddings``), or None when its config names none."""
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_context(
    prompt_lengths: Sequence[int],
    new_tokens: int,
    limit: int | None,
    option: str = "max_new_tokens",
    prompts: str = "prompts",
) -> None:
    """Refuses requests whose prompt and new tokens would pass the target's ``limit`` (:func:`context_limit`):
    a model decoded past the positions it was built for generates without a word, and its text no longer follows
    its training (Hugging Face only warns; vLLM refuses). ``option`` and ``prompts`` name the new-token count and the
    prompts in the message (a command's flags)."""
    if limit is None:
        return
    for i, length in enumerate(prompt_lengths):
        if length + new_tokens > limit:
            room = f"at most {limit - length} new tokens" if length < limit else "no room for a new token"
            raise ValueError(
                f"{prompts}[{i}] has {length} tokens and {option} = {new_tokens} asks for {new_tokens} more: "
                f"{length + new_tokens} positions pass the target's max_position_embeddings = {limit} ({room} "
                f"there; shorten it or ask for fewer tokens)"
            )


def load_target(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """A transformers causal LM from a directory, with weights owned in memory, in eval mode."""
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"target model directory {path} does not exist")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad():
        # Own the weights instead of reading a memory-mapped file on every use (much faster on the CPU).
        for param in model.parameters():
            param.data = param.data.clone()
    return model.to(device).eval()


def load_target_model(
    target: str | os.PathLike | nn.Module, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> nn.Module:
    """The target module (from a directory, or as given) after checking that its family is supported."""
    if isinstance(target, (str, os.PathLike)):
        model = load_target(target, dtype=dtype or torch.float32, device=device or "cpu")
    elif isinstance(target, nn.Module):
        model = target
        if dtype is not None or device is not None:
            model = model.to(device=device, dtype=dtype)
    else:
        raise TypeError(f"target must be a model directory or a transformers module, got {type(target).__name__}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"target model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model.eval()


def llama_config(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    head_dim: int | None = None,
    **extra: Any,
):
    """A transformers ``LlamaConfig`` for a small target: the one helper the demo's target, the tests' tiny targets and
    the benchmarks' random ones are built from. ``head_dim`` defaults to ``hidden_size // num_heads``; ``extra``: any
    other LlamaConfig field (``max_position_embeddings``, token ids, ``attn_implementation``, ...)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads if head_dim is None else head_dim,
        **extra,
    )


def read_target_tensors(target_path: str | os.PathLike, suffixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Reads single tensors of a Hugging Face checkpoint by name suffix (e.g. {"norm": "model.norm.weight"}) without
    loading the model. A missing ``lm_head.weight`` falls back to the tied ``embed_tokens.weight``."""
    from safetensors import safe_open

    root = Path(target_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = {name: root / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = {}
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                files.update({name: file for name in f.keys()})
    out: dict[str, torch.Tensor] = {}
    for key, name in suffixes.items():
        candidates = [n for n in files if n == name or n.endswith("." + name)]
        if not candidates and name == "lm_head.weight":
            candidates = [n for n in files if n.endswith("embed_tokens.weight")]
        if len(candidates) != 1:
            raise ValueError(f"target checkpoint {root}: expected one tensor named like {name!r}, found {candidates}")
        with safe_open(str(files[candidates[0]]), "pt") as f:
            out[key] = f.get_tensor(candidates[0])
    return out
