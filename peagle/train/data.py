"""Step 1, prepare-data: conversations, text or token ids -> tokenized documents with loss masks, packed into T-length
rows.

Records (one JSON object a line): ``{"messages": [...]}`` / ShareGPT ``{"conversations": [...]}`` (assistant turns
trained), ``{"text": ...}`` (every token trained), or pre-tokenized ``{"prompt_ids": [...], "completion_ids": [...]}``
(``prompt_ids`` optional; the completion tokens are trained, the prompt is context only). Token ids are taken as they
are, no special tokens added: the form for the target's own generations (self-distillation), which decoded text would
not reproduce exactly since BPE decoding does not round-trip.

Output directory: ``rows-XXXXX.safetensors`` shards (``input_ids`` int32 [R, T], ``loss_mask`` uint8 [R, T],
``document_ids`` int32 [R, T], -1 = padding), ``token_freq.safetensors`` (counts of trained tokens, for a draft
vocabulary), the tokenizer, and ``manifest.json``. Documents stream through: only one shard is held in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from peagle.io import atomic_save_tensors, atomic_write_json

__all__ = [
    "MASK_TOKEN",
    "Document",
    "MaskTokenError",
    "chat_messages",
    "load_tokenizer",
    "pack_documents",
    "prepare_data",
    "read_records",
    "resolve_mask_token",
    "tokenize_record",
]

MANIFEST = "manifest.json"
MASK_TOKEN = "<|peagle_mask|>"


class Document:
    __slots__ = ("ids", "loss")

    def __init__(self, ids: list[int], loss: list[bool]) -> None:
        self.ids, self.loss = ids, loss


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    return AutoTokenizer.from_pretrained(str(path))


def read_records(source: str) -> Iterator[dict[str, Any]]:
    """Records of a ``.jsonl`` file (one JSON object a line) or ``hf:NAME[:SPLIT]`` (Hugging Face datasets)."""
    if source.startswith("hf:"):
        try:
            import datasets
        except ImportError as err:
            raise RuntimeError("reading hf:NAME needs the `datasets` package (pip install datasets)") from err
        name, _, split = source[3:].partition(":")
        yield from datasets.load_dataset(name, split=split or "train", streaming=True)
        return
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data file {source} does not exist")
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{source}:{number}: not a JSON object: {err}") from err


def chat_messages(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """The turns of a chat record (``messages``, or ShareGPT ``conversations``) as role/content dicts; None for a
    record that is not a chat."""
    for key in ("messages", "conversations", "conversation"):
        if key in record:
            turns = record[key]
            # ShareGPT style {"from": "human"/"gpt", "value": ...} -> role/content.
            roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
            return [
                {
                    "role": roles.get(t.get("role", t.get("from")), t.get("role", t.get("from"))),
                    "content": t.get("content", t.get("value", "")),
                }
                for t in turns
            ]
    return None


def _token_ids(record: dict[str, Any], key: str, vocab: int) -> list[int]:
    ids = record.get(key, [])
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"record {key!r} must be a list of integer token ids, got {str(ids)[:80]}")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"record {key!r} has token ids outside the tokenizer's [0, {vocab}): {bad[:5]}")
    return ids


def tokenize_record(tokenizer, record: dict[str, Any]) -> Document:
    """Tokens and loss mask of one record: assistant turns only for chats (rendered by the chat template), every
    token for ``{"text": ...}``, the completion for ``{"prompt_ids", "completion_ids"}`` (ids used as given)."""
    if "completion_ids" in record or "prompt_ids" in record:
        if "completion_ids" not in record:
            raise ValueError("a record with prompt_ids needs completion_ids (the trained tokens)")
        prompt = _token_ids(record, "prompt_ids", len(tokenizer))
        completion = _token_ids(record, "completion_ids", len(tokenizer))
        return Document(prompt + completion, [False] * len(prompt) + [True] * len(completion))
    messages = chat_messages(record)
    if messages is None:
        if "text" not in record:
            raise ValueError(
                f"record has neither messages/conversations, text nor completion_ids: keys {sorted(record)}"
            )
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        return Document(list(ids), [True] * len(ids))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat records need a tokenizer with a chat_template")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    # Character spans of the assistant turns: render the prefix before and after each assistant message.
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(before) or not text.startswith(after):
            raise ValueError("the chat template does not render conversations prefix-consistently")
        spans.append((len(before), len(after)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([o[0] for o in enc["offset_mapping"]], dtype=torch.long)
    loss = torch.zeros(starts.numel(), dtype=torch.bool)
    for lo, hi in spans:
        loss |= (starts >= lo) & (starts < hi)
    return Document(list(enc["input_ids"]), loss.tolist())


def pack_documents(documents: Iterable[Document], seq_len: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Greedy packing into rows of ``seq_len``: (input_ids, loss_mask, document_ids); longer documents are cut."""
    ids = torch.zeros(seq_len, dtype=torch.int32)
    loss = torch.zeros(seq_len, dtype=torch.uint8)
    docs = torch.full((seq_len,), -1, dtype=torch.int32)
    used, doc = 0, 0
    for document in documents:
        tokens = torch.tensor(document.ids, dtype=torch.int32)
        mask = torch.tensor(document.loss, dtype=torch.uint8)
        for lo in range(0, tokens.numel(), seq_len):
            piece, piece_loss = tokens[lo : lo + seq_len], mask[lo : lo + seq_len]
            if piece.numel() < 2:
                continue
            if used + piece.numel() > seq_len:
                yield ids, loss, docs
                ids, loss = torch.zeros_like(ids), torch.zeros_like(loss)
                docs = torch.full_like(docs, -1)
                used, doc = 0, 0
            ids[used : used + piece.numel()] = piece
            loss[used : used + piece.numel()] = piece_loss
            docs[used : used + piece.numel()] = doc
            used += piece.numel()
            doc += 1
    if used:
        yield ids, loss, docs


Tensor = torch.Tensor


def prepare_data(
    source: str,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    seq_len: int = 2048,
    rows_per_shard: int = 256,
    max_records: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs step 1 and returns the manifest."""
    from tqdm import tqdm

    if seq_len < 4:
        raise ValueError(f"seq_len must be >= 4, got {seq_len}")
    tokenizer = load_tokenizer(tokenizer_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(tokenizer)
    freq = torch.zeros(vocab, dtype=torch.long)

    def documents() -> Iterator[Document]:
        for n, record in enumerate(tqdm(read_records(source), desc="tokenize", disable=not progress, unit="rec")):
            if max_records is not None and n >= max_records:
                break
            doc = tokenize_record(tokenizer, record)
            trained = torch.tensor(doc.ids, dtype=torch.long)[torch.tensor(doc.loss, dtype=torch.bool)]
            freq.add_(torch.bincount(trained, minlength=vocab)[:vocab])
            yield doc

    shards, batch, rows, trained = [], [], 0, 0

    def flush() -> None:
        name = f"rows-{len(shards):05d}.safetensors"
        atomic_save_tensors(
            out / name,
            {k: torch.stack([r[i] for r in batch]) for i, k in enumerate(("input_ids", "loss_mask", "document_ids"))},
        )
        shards.append({"file": name, "rows": len(batch)})
        batch.clear()

    for row in pack_documents(documents(), seq_len):
        batch.append(tuple(t.clone() for t in row))
        rows += 1
        trained += int(row[1].sum())
        if len(batch) == rows_per_shard:
            flush()
    if batch:
        flush()
    if not rows:
        raise ValueError(f"{source} produced no training rows")
    atomic_save_tensors(out / "token_freq.safetensors", {"counts": freq})
    tokenizer.save_pretrained(str(out / "tokenizer"))
    manifest = {
        "kind": "peagle-prepared",
        "seq_len": seq_len,
        "num_rows": rows,
        "trained_tokens": trained,
        "vocab_size": vocab,
        "shards": shards,
        "source": source,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | os.PathLike, kind: str) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no {MANIFEST} in {directory}: run the previous peagle step first")
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != kind:
        raise ValueError(f"{directory} holds {manifest.get('kind')!r} data, expected {kind!r}")
    return manifest


def iter_prepared_rows(directory: str | os.PathLike) -> Iterator[dict[str, Tensor]]:
    manifest = read_manifest(directory, "peagle-prepared")
    for shard in manifest["shards"]:
        tensors = load_file(Path(directory) / shard["file"])
        for r in range(shard["rows"]):
            yield {k: v[r] for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Mask token resolution


class MaskTokenError(ValueError):
    pass


def resolve_mask_token(
    tokenizer,
    vocab_size: int,
    mask_token_id: int | None = None,
    allow_special_reuse: bool = False,
) -> tuple[int, str | None]:
    """The mask token id: explicit id -> the tokenizer's mask token -> a new token in an unused embedding slot ->
    (only with ``allow_special_reuse``) pad / eos / unk -> :class:`MaskTokenError`.

    ``vocab_size`` is the target's embedding rows. Returns (id, how it was chosen); when a token was added, the
    tokenizer now holds it (save the tokenizer with the checkpoint).
    """
    if mask_token_id is not None:
        if not 0 <= mask_token_id < vocab_size:
            raise MaskTokenError(f"mask token id {mask_token_id} is outside the target vocabulary [0, {vocab_size})")
        return mask_token_id, "explicit"
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        if tokenizer.mask_token_id < vocab_size:
            return int(tokenizer.mask_token_id), "tokenizer mask token"
    if tokenizer is not None and len(tokenizer) < vocab_size:
        slot = len(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
        added = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if added != slot:
            raise MaskTokenError(f"adding {MASK_TOKEN} gave id {added}, expected the unused slot {slot}")
        return slot, f"added {MASK_TOKEN}"
    if allow_special_reuse and tokenizer is not None:
        for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None and value < vocab_size:
                return int(value), f"reused {attr.removesuffix('_id')}"
    raise MaskTokenError(
        "no mask token: the tokenizer has no mask token and no unused embedding slot "
        f"(len(tokenizer) = {len(tokenizer) if tokenizer is not None else 'n/a'}, vocab_size = {vocab_size}). "
        "Pass --mask-token-id, or --reuse-special-token-as-mask to train a pad/eos/unk embedding as the mask."
    )
