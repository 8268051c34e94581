"""Step 2, extract: run the target over prepared rows and store what training needs.

Per row: the hidden states of the auxiliary target layers (concatenated, [T, num_aux * H]; layer id i is the input
of decoder layer i, i.e. ``hidden_states[i]`` of Hugging Face, the vLLM convention) and the target's final normalised
hidden state [T, H]; the target's LM head (and input embeddings, to initialise the drafter) are written once. The
target distribution at any position is ``lm_head(final_hidden)``: H numbers a position instead of a vocabulary.
Each document of a packed row runs separately (no attention across documents). Shards are written atomically and
recorded in the manifest as they finish, so an interrupted run resumes after the last finished shard; the manifest
records a digest of the prepared data, so a resumed run never mixes two versions of it.

Backends come from a registry (:func:`register_extraction_backend`): ``hf`` (here) runs the transformers model in this
process; ``vllm`` runs the target in vLLM and gives the same states within float tolerance. The vLLM backend registers
itself when :mod:`peagle.vllm.extract` is imported (it needs the ``vllm`` extra), so import that module before
``extract(..., backend="vllm")``; ``peagle extract --backend vllm`` does.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from peagle.io import (
    atomic_save_tensors,
    atomic_write_json,
    check_output_directory,
    clear_directory,
    is_empty_directory,
    remove_temporaries,
)
from peagle.model.config import default_aux_layer_ids
from peagle.model.target import load_target
from peagle.train.data import MANIFEST, iter_prepared_rows, manifest_fingerprint, read_manifest
from peagle.train.dataset import load_target_head

__all__ = [
    "ExtractionBackend",
    "ExtractionTarget",
    "extract",
    "extraction_backends",
    "load_target_head",
    "open_backend",
    "open_target",
    "register_extraction_backend",
    "row_states",
    "target_fields",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _target_text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def _document_runs(document_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[lo, hi) of each document of a packed row (packing writes a document as one run); padding (< 0) is skipped."""
    docs = document_ids.long()
    change = torch.nonzero(docs[1:] != docs[:-1]).squeeze(1) + 1
    bounds = [0, *change.tolist(), docs.numel()]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if int(docs[lo]) >= 0]


@dataclass(frozen=True)
class ExtractionTarget:
    """What a backend is opened for: the target directory, its (text) config from ``transformers.AutoConfig``, the aux
    layer ids to collect, the longest document (positions of a packed row) and the device asked for; ``full_config``
    is the whole config (of a multimodal target too)."""

    path: Path
    config: Any
    layer_ids: list[int]
    seq_len: int
    device: str
    full_config: Any = None


def open_target(
    target_path: str | os.PathLike, layer_ids: list[int] | None, seq_len: int, device: str, backend: str = "hf"
) -> ExtractionTarget:
    """The target to extract from, checked before any work: the directory exists, the aux ``layer_ids`` (default:
    early, middle, late as vLLM chooses them) are layers of it, and ``backend`` can run it."""
    from transformers import AutoConfig

    registered = _backend(backend)
    if not Path(target_path).exists():
        raise FileNotFoundError(f"target model directory {target_path} does not exist")
    config = AutoConfig.from_pretrained(str(target_path))
    cfg = getattr(config, "text_config", None) or config
    num_layers = cfg.num_hidden_layers
    layer_ids = list(layer_ids) if layer_ids else default_aux_layer_ids(num_layers)
    bad = [i for i in layer_ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} are outside the target's layers [1, {num_layers}]")
    if registered.check_target is not None:
        registered.check_target(cfg)
    return ExtractionTarget(Path(target_path), cfg, layer_ids, seq_len, device, config)


def open_backend(target: ExtractionTarget, backend: str = "hf") -> ExtractionBackend:
    """An open extraction backend (``close()`` it) for ``target`` (:func:`open_target`)."""
    return _backend(backend).open(target)


class ExtractionBackend(Protocol):
    """An open target that gives per-document states (see :func:`register_extraction_backend`)."""

    def states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per 1-D token tensor: (aux [n, len(layer_ids) * H] float32, final normalised hidden [n, H] float32)."""
        ...

    def target_head(self) -> dict[str, torch.Tensor]:
        """The target's ``lm_head.weight`` and ``embed_tokens.weight``."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Registered:
    open: Callable[[ExtractionTarget], ExtractionBackend]
    batch_shards: bool
    check_target: Callable[[Any], None] | None


_BACKENDS: dict[str, _Registered] = {}


def register_extraction_backend(
    name: str,
    factory: Callable[[ExtractionTarget], ExtractionBackend],
    *,
    batch_shards: bool = False,
    check_target: Callable[[Any], None] | None = None,
) -> None:
    """Makes ``extract(..., backend=name)`` open targets with ``factory``.

    ``batch_shards``: one ``states`` call gets every document of a shard (for engines that batch requests), instead of
    one row's documents. ``check_target(config)`` raises ValueError for a target config the backend cannot extract;
    it runs before anything is written."""
    _BACKENDS[name] = _Registered(factory, batch_shards, check_target)


def extraction_backends() -> list[str]:
    """The names ``extract`` accepts now (``vllm`` after :mod:`peagle.vllm.extract` is imported)."""
    return sorted(_BACKENDS)


def _backend(name: str) -> _Registered:
    if name in _BACKENDS:
        return _BACKENDS[name]
    hint = ""
    if name == "vllm":
        hint = (
            "; the vLLM backend registers itself when peagle.vllm.extract is imported, which needs vLLM "
            "(pip install 'peagle[vllm]')"
        )
    raise ValueError(f"backend (--backend) must be one of {extraction_backends()}, got {name!r}{hint}")


class _HFStates:
    """Per-document states from the transformers model."""

    def __init__(self, target: ExtractionTarget):
        self.model = load_target(target.path, device=target.device)
        self.layer_ids = target.layer_ids
        self.num_layers = _target_text_config(self.model).num_hidden_layers
        self.device = target.device

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

    def target_head(self) -> dict[str, torch.Tensor]:
        return {
            "lm_head.weight": self.model.get_output_embeddings().weight,
            "embed_tokens.weight": self.model.get_input_embeddings().weight,
        }

    def close(self) -> None:
        pass


register_extraction_backend("hf", _HFStates)


def row_states(
    backend: ExtractionBackend, rows: list[dict[str, torch.Tensor]], num_aux: int, hidden: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, num_aux * H], final [T, H]) float32 per prepared row (``input_ids``, ``document_ids``), zero on
    padding; all documents of ``rows`` go to the backend in one call."""
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
    overwrite: bool = False,
) -> dict[str, Any]:
    """Runs step 2 (resuming an interrupted run in ``out_dir``) and returns the manifest.

    ``out_dir`` must be new, empty, or an extraction of the same prepared data with the same settings (which then
    resumes, or stands when complete); anything else is refused unless ``overwrite``, which clears it first.
    ``backend``: "hf" (transformers, on ``device``), "vllm" (vLLM on its own device; import
    :mod:`peagle.vllm.extract` first) or another registered name (:func:`register_extraction_backend`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype (--dtype) must be one of {sorted(DTYPES)}, got {dtype!r}")
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard (--rows-per-shard) must be at least 1, got {rows_per_shard}")
    out = check_output_directory(out_dir, {"--data": data_dir, "--target": target_path})
    registered = _backend(backend)
    prepared = read_manifest(data_dir, "peagle-prepared")
    target = open_target(target_path, layer_ids, prepared["seq_len"], device, backend)
    config, cfg, layer_ids = target.full_config, target.config, target.layer_ids
    if prepared["vocab_size"] > cfg.vocab_size:
        raise ValueError(
            f"the data's tokenizer has {prepared['vocab_size']} tokens but the target's vocabulary is {cfg.vocab_size}"
        )
    settings = {
        "target": str(Path(target_path).resolve()),
        "data": str(Path(data_dir).resolve()),
        "data_fingerprint": manifest_fingerprint(prepared),
        "aux_layer_ids": layer_ids,
        "dtype": dtype,
        "rows_per_shard": rows_per_shard,
    }
    manifest_path = out / MANIFEST
    if overwrite and out.exists():
        clear_directory(out)
    elif manifest_path.exists():
        manifest = read_manifest(out, "peagle-extracted")
        previous = {k: manifest.get(k) for k in settings}
        if previous != settings:
            changed = ", ".join(f"{k}: {previous[k]!r} -> {v!r}" for k, v in settings.items() if previous[k] != v)
            raise ValueError(
                f"output (--out) {out} holds an extraction of other data or settings ({changed}); pass --overwrite "
                "to replace it"
            )
        if manifest["complete"]:
            return manifest
        remove_temporaries(out)
    elif not is_empty_directory(out):
        raise ValueError(f"output (--out) {out} is not empty and holds no extraction; pass --overwrite to clear it")
    out.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        torch.set_flush_denormal(True)  # tiny activations of random/small targets otherwise run ~10x slower
    states_backend = open_backend(target, backend)
    rows_per_call = rows_per_shard if registered.batch_shards else 1
    try:
        if not manifest_path.exists():
            manifest = {
                "kind": "peagle-extracted",
                **settings,
                "backend": backend,
                "seq_len": prepared["seq_len"],
                "num_rows": prepared["num_rows"],
                **target_fields(config),
                "shards": [],
                "complete": False,
            }
            head = states_backend.target_head()
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
        for row, (aux, final) in zip(pending, row_states(states_backend, pending, num_aux, hidden), strict=True):
            batch.append({**row, "aux_hidden": aux.to(store), "final_hidden": final.to(store)})
        bar.update(len(pending))
        pending.clear()

    def flush() -> None:
        name = f"states-{len(manifest['shards']):05d}.safetensors"
        tensors = {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
        atomic_save_tensors(out / name, tensors)
        manifest["shards"].append({"file": name, "rows": len(batch), "bytes": (out / name).stat().st_size})
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


def target_fields(config: Any) -> dict[str, Any]:
    """What an extracted-data manifest records about the target (``transformers.AutoConfig``; the text config of a
    multimodal one): what the drafter's config (:meth:`peagle.model.DrafterConfig.from_manifest`) takes from it."""
    cfg = getattr(config, "text_config", None) or config
    return {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_hidden_layers,
        "target_model_type": cfg.model_type,
        "target_architectures": list(getattr(config, "architectures", None) or []),
        "target_num_heads": cfg.num_attention_heads,
        "target_num_kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "target_head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "target_intermediate_size": cfg.intermediate_size,
        "target_rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6),
    }
