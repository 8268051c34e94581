"""Step 2, extract: run the target (Hugging Face backend) over prepared rows and store what training needs.

Per row: the hidden states of the auxiliary target layers (concatenated, [T, num_aux * H]; layer id i is the input
of decoder layer i, i.e. ``hidden_states[i]`` of Hugging Face, the vLLM convention) and the target's final normalised
hidden state [T, H]; the target's LM head (and input embeddings, to initialise the drafter) are written once. The
target distribution at any position is ``lm_head(final_hidden)``: H numbers a position instead of a vocabulary.
Each document of a packed row runs separately (no attention across documents). Shards are written atomically and
recorded in the manifest as they finish, so an interrupted run resumes after the last finished shard.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from peagle.model.checkpoint import atomic_save_tensors, atomic_write_json
from peagle.model.config import default_aux_layer_ids
from peagle.train.data import MANIFEST, iter_prepared_rows, read_manifest

__all__ = ["extract", "load_target"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def load_target(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"target model directory {path} does not exist")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad():
        # Own the weights instead of reading a memory-mapped file on every use (much faster on the CPU).
        for param in model.parameters():
            param.data = param.data.clone()
    return model.to(device).eval()


def _target_text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


@torch.no_grad()
def _row_states(model, input_ids: torch.Tensor, document_ids: torch.Tensor, layer_ids: list[int]):
    length = input_ids.numel()
    cfg = _target_text_config(model)
    device = next(model.parameters()).device
    aux = torch.zeros(length, len(layer_ids) * cfg.hidden_size, dtype=torch.float32)
    final = torch.zeros(length, cfg.hidden_size, dtype=torch.float32)
    docs = document_ids.long()
    # Contiguous runs of one document (packing writes each document as one run).
    change = torch.nonzero(docs[1:] != docs[:-1]).squeeze(1) + 1
    bounds = [0, *change.tolist(), length]
    # Layer id i is the residual stream after i decoder layers, as vLLM collects it. transformers reports the last
    # entry (i = L) after the final norm, so that one is taken from the norm's input instead.
    num_layers = cfg.num_hidden_layers
    pre_norm: list[torch.Tensor] = []
    hook = None
    if num_layers in layer_ids:
        hook = model.base_model.norm.register_forward_pre_hook(lambda module, args: pre_norm.append(args[0]))
    try:
        for lo, hi in itertools.pairwise(bounds):
            if int(docs[lo]) < 0:
                continue
            pre_norm.clear()
            out = model.base_model(input_ids[lo:hi].long()[None].to(device), output_hidden_states=True)
            states = list(out.hidden_states)
            if pre_norm:
                states[num_layers] = pre_norm[-1]
            aux[lo:hi] = torch.cat([states[i][0].float().cpu() for i in layer_ids], dim=-1)
            final[lo:hi] = out.last_hidden_state[0].float().cpu()
    finally:
        if hook is not None:
            hook.remove()
    return aux, final


def extract(
    data_dir: str | os.PathLike,
    target_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    layer_ids: list[int] | None = None,
    dtype: str = "bfloat16",
    rows_per_shard: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Runs step 2 (resuming an interrupted run in ``out_dir``) and returns the manifest."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    prepared = read_manifest(data_dir, "peagle-prepared")
    if device == "cpu":
        torch.set_flush_denormal(True)  # tiny activations of random/small targets otherwise run ~10x slower
    model = load_target(target_path, device=device)
    cfg = _target_text_config(model)
    num_layers = cfg.num_hidden_layers
    layer_ids = list(layer_ids) if layer_ids else default_aux_layer_ids(num_layers)
    bad = [i for i in layer_ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} are outside the target's layers [1, {num_layers}]")
    if prepared["vocab_size"] > cfg.vocab_size:
        raise ValueError(
            f"the data's tokenizer has {prepared['vocab_size']} tokens but the target's vocabulary is {cfg.vocab_size}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "target": str(Path(target_path).resolve()),
        "data": str(Path(data_dir).resolve()),
        "aux_layer_ids": layer_ids,
        "dtype": dtype,
        "rows_per_shard": rows_per_shard,
    }
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        manifest = read_manifest(out, "peagle-extracted")
        previous = {k: manifest[k] for k in settings}
        if previous != settings:
            raise ValueError(f"{out} holds an extraction with other settings {previous}; use a new directory")
    else:
        manifest = {
            "kind": "peagle-extracted",
            **settings,
            "seq_len": prepared["seq_len"],
            "num_rows": prepared["num_rows"],
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "num_target_layers": num_layers,
            "target_model_type": cfg.model_type,
            "target_architectures": list(getattr(model.config, "architectures", None) or []),
            "target_num_heads": cfg.num_attention_heads,
            "target_num_kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            "target_head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "target_intermediate_size": cfg.intermediate_size,
            "target_rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6),
            "shards": [],
            "complete": False,
        }
        head = {
            "lm_head.weight": model.get_output_embeddings().weight,
            "embed_tokens.weight": model.get_input_embeddings().weight,
        }
        atomic_save_tensors(out / "target_head.safetensors", {k: v.float() for k, v in head.items()})
        atomic_write_json(manifest_path, manifest)
    if manifest["complete"]:
        return manifest
    done_rows = sum(s["rows"] for s in manifest["shards"])
    store = DTYPES[dtype]
    batch: list[dict[str, torch.Tensor]] = []
    bar = tqdm(total=prepared["num_rows"], initial=done_rows, desc="extract", unit="row", disable=not progress)

    def flush() -> None:
        name = f"states-{len(manifest['shards']):05d}.safetensors"
        tensors = {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
        atomic_save_tensors(out / name, tensors)
        manifest["shards"].append({"file": name, "rows": len(batch)})
        atomic_write_json(manifest_path, manifest)
        batch.clear()

    for index, row in enumerate(iter_prepared_rows(data_dir)):
        if index < done_rows:
            continue
        aux, final = _row_states(model, row["input_ids"], row["document_ids"], layer_ids)
        batch.append({**row, "aux_hidden": aux.to(store), "final_hidden": final.to(store)})
        bar.update(1)
        if len(batch) == rows_per_shard:
            flush()
    if batch:
        flush()
    bar.close()
    manifest["complete"] = True
    atomic_write_json(manifest_path, manifest)
    return manifest


def load_target_head(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(Path(directory) / "target_head.safetensors")
