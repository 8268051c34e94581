"""Step 2, extract: run the target over prepared rows and store what training needs.

Per row: the hidden states of the auxiliary target layers (concatenated, [T, num_aux * H]; layer id i is the input
of decoder layer i, i.e. ``hidden_states[i]`` of Hugging Face, the vLLM convention) and the target's final normalised
hidden state [T, H]; the target's LM head (and input embeddings, to initialise the drafter) are written once. The
target distribution at any position is ``lm_head(final_hidden)``: H numbers a position instead of a vocabulary.
Each document of a packed row runs separately (no attention across documents). Shards are written atomically and
recorded in the manifest as they finish, so an interrupted run resumes after the last finished shard.

Backends: ``hf`` runs the transformers model in this process; ``vllm`` runs the target in vLLM
(:mod:`peagle.vllm.extract`) and gives the same states within float tolerance.
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

__all__ = ["BACKENDS", "extract", "load_target"]

BACKENDS = ("hf", "vllm")
# The vLLM backend computes the final hidden state as the RMSNorm of the last layer's residual stream, as these do.
RMSNORM_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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


def _document_runs(document_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) of each document of a packed row (packing writes a document as one run); padding (< 0) is skipped."""
    docs = document_ids.long()
    change = torch.nonzero(docs[1:] != docs[:-1]).squeeze(1) + 1
    bounds = [0, *change.tolist(), docs.numel()]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if int(docs[lo]) >= 0]


class _HFStates:
    """Per-document states from the transformers model."""

    def __init__(self, target_path: str | os.PathLike, layer_ids: list[int], device: str):
        self.model = load_target(target_path, device=device)
        self.layer_ids = layer_ids
        self.num_layers = _target_text_config(self.model).num_hidden_layers
        self.device = device

    @torch.no_grad()
    def states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Layer id i is the residual stream after i decoder layers, as vLLM collects it. transformers reports the last
        # entry (i = L) after the final norm, so that one is taken from the norm's input instead.
        pre_norm: list[torch.Tensor] = []
        hook = None
        if self.num_layers in self.layer_ids:
            hook = self.model.base_model.norm.register_forward_pre_hook(lambda module, args: pre_norm.append(args[0]))
        result = []
        try:
            for doc in documents:
                pre_norm.clear()
                out = self.model.base_model(doc.long()[None].to(self.device), output_hidden_states=True)
                states = list(out.hidden_states)
                if pre_norm:
                    states[self.num_layers] = pre_norm[-1]
                aux = torch.cat([states[i][0].float().cpu() for i in self.layer_ids], dim=-1)
                result.append((aux, out.last_hidden_state[0].float().cpu()))
        finally:
            if hook is not None:
                hook.remove()
        return result

    def close(self) -> None:
        pass


def _rows_states(backend, rows: list[dict[str, torch.Tensor]], num_aux: int, hidden: int):
    """(aux [T, num_aux * H], final [T, H]) per row, zero on padding; all documents of ``rows`` go in one call."""
    runs = [_document_runs(row["document_ids"]) for row in rows]
    documents = [row["input_ids"][lo:hi] for row, row_runs in zip(rows, runs, strict=True) for lo, hi in row_runs]
    states = iter(backend.states(documents))
    result = []
    for row, row_runs in zip(rows, runs, strict=True):
        length = row["input_ids"].numel()
        aux = torch.zeros(length, num_aux * hidden, dtype=torch.float32)
        final = torch.zeros(length, hidden, dtype=torch.float32)
        for lo, hi in row_runs:
            aux[lo:hi], final[lo:hi] = next(states)
        result.append((aux, final))
    return result


def extract(
    data_dir: str | os.PathLike,
    target_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    layer_ids: list[int] | None = None,
    dtype: str = "bfloat16",
    rows_per_shard: int = 64,
    device: str = "cpu",
    progress: bool = True,
    backend: str = "hf",
) -> dict[str, Any]:
    """Runs step 2 (resuming an interrupted run in ``out_dir``) and returns the manifest.

    ``backend``: "hf" (transformers, on ``device``) or "vllm" (vLLM on its own device; needs vLLM installed)."""
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    prepared = read_manifest(data_dir, "peagle-prepared")
    if not Path(target_path).exists():
        raise FileNotFoundError(f"target model directory {target_path} does not exist")
    config = AutoConfig.from_pretrained(str(target_path))
    cfg = getattr(config, "text_config", None) or config
    num_layers = cfg.num_hidden_layers
    layer_ids = list(layer_ids) if layer_ids else default_aux_layer_ids(num_layers)
    bad = [i for i in layer_ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} are outside the target's layers [1, {num_layers}]")
    if prepared["vocab_size"] > cfg.vocab_size:
        raise ValueError(
            f"the data's tokenizer has {prepared['vocab_size']} tokens but the target's vocabulary is {cfg.vocab_size}"
        )
    if backend == "vllm" and cfg.model_type not in RMSNORM_MODEL_TYPES:
        raise ValueError(
            f"backend 'vllm' supports targets of model_type {list(RMSNORM_MODEL_TYPES)} (final RMSNorm), got "
            f"{cfg.model_type!r}; use backend 'hf'"
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
        previous = {k: manifest.get(k) for k in settings}
        if previous != settings:
            raise ValueError(f"{out} holds an extraction with other settings {previous}; use a new directory")
        if manifest["complete"]:
            return manifest
    if device == "cpu":
        torch.set_flush_denormal(True)  # tiny activations of random/small targets otherwise run ~10x slower
    if backend == "vllm":
        from peagle.vllm.extract import VllmStateExtractor, read_target_tensors

        states_backend = VllmStateExtractor(
            target_path, layer_ids, num_layers, getattr(cfg, "rms_norm_eps", 1e-6), prepared["seq_len"]
        )
        rows_per_call = rows_per_shard  # vLLM batches every document of a shard
    else:
        states_backend = _HFStates(target_path, layer_ids, device)
        rows_per_call = 1
    try:
        if not manifest_path.exists():
            manifest = {
                "kind": "peagle-extracted",
                **settings,
                "backend": backend,
                "seq_len": prepared["seq_len"],
                "num_rows": prepared["num_rows"],
                "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size,
                "num_target_layers": num_layers,
                "target_model_type": cfg.model_type,
                "target_architectures": list(getattr(config, "architectures", None) or []),
                "target_num_heads": cfg.num_attention_heads,
                "target_num_kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                "target_head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                "target_intermediate_size": cfg.intermediate_size,
                "target_rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6),
                "shards": [],
                "complete": False,
            }
            if backend == "vllm":
                head = read_target_tensors(target_path, {n: n for n in ("lm_head.weight", "embed_tokens.weight")})
            else:
                model = states_backend.model
                head = {
                    "lm_head.weight": model.get_output_embeddings().weight,
                    "embed_tokens.weight": model.get_input_embeddings().weight,
                }
            atomic_save_tensors(out / "target_head.safetensors", {k: v.float() for k, v in head.items()})
            atomic_write_json(manifest_path, manifest)
        _extract_rows(states_backend, manifest, data_dir, out, rows_per_call, progress)
    finally:
        states_backend.close()
    return manifest


def _extract_rows(states_backend, manifest, data_dir, out: Path, rows_per_call: int, progress: bool) -> None:
    from tqdm import tqdm

    done_rows = sum(s["rows"] for s in manifest["shards"])
    store = DTYPES[manifest["dtype"]]
    num_aux, hidden = len(manifest["aux_layer_ids"]), manifest["hidden_size"]
    pending: list[dict[str, torch.Tensor]] = []
    batch: list[dict[str, torch.Tensor]] = []
    bar = tqdm(total=manifest["num_rows"], initial=done_rows, desc="extract", unit="row", disable=not progress)

    def compute() -> None:
        for row, (aux, final) in zip(pending, _rows_states(states_backend, pending, num_aux, hidden), strict=True):
            batch.append({**row, "aux_hidden": aux.to(store), "final_hidden": final.to(store)})
        bar.update(len(pending))
        pending.clear()

    def flush() -> None:
        name = f"states-{len(manifest['shards']):05d}.safetensors"
        tensors = {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
        atomic_save_tensors(out / name, tensors)
        manifest["shards"].append({"file": name, "rows": len(batch)})
        atomic_write_json(out / MANIFEST, manifest)
        batch.clear()

    for index, row in enumerate(iter_prepared_rows(data_dir)):
        if index < done_rows:
            continue
        pending.append(row)
        if len(pending) == rows_per_call or len(batch) + len(pending) == manifest["rows_per_shard"]:
            compute()
        if len(batch) == manifest["rows_per_shard"]:
            flush()
    if pending:
        compute()
    if batch:
        flush()
    bar.close()
    manifest["complete"] = True
    atomic_write_json(out / MANIFEST, manifest)


def load_target_head(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(Path(directory) / "target_head.safetensors")
