"""Step 1, prepare-data: conversations, text or token ids -> tokenized documents with loss masks, packed into T-length
rows.

Records (one JSON object a line): ``{"messages": [...]}`` / ShareGPT ``{"conversations": [...]}`` (assistant turns
trained), ``{"text": ...}`` (every token trained), or pre-tokenized ``{"prompt_ids": [...], "completion_ids": [...]}``
(``prompt_ids`` optional; the completion tokens are trained, the prompt is context only). Token ids are taken as they
are, no special tokens added: the form for the target's own generations (self-distillation), which decoded text would
not reproduce exactly since BPE decoding does not round-trip.

Output directory: ``rows-XXXXX.safetensors`` shards (``input_ids`` int32 [R, T], ``loss_mask`` uint8 [R, T],
``document_ids`` int32 [R, T], -1 = padding), ``token_freq.safetensors`` (counts of trained tokens, for a draft
vocabulary), the tokenizer, and ``manifest.json`` (shards with their rows and sizes; readers check it against the
files). Documents stream through: only one shard is held in memory. The directory is built beside the output and
published whole, so a failed run never leaves new shards beside an old manifest.

A bad record raises ValueError "FILE:LINE: reason"; a record with nothing to train is skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from peagle.io import (
    atomic_save_tensors,
    atomic_write_json,
    check_output_directory,
    is_empty_directory,
    publish_directory,
    staging_directory,
)

__all__ = [
    "MASK_TOKEN",
    "Document",
    "MaskTokenError",
    "RowPacker",
    "chat_messages",
    "check_prepare_args",
    "load_tokenizer",
    "pack_documents",
    "prepare_data",
    "read_located_records",
    "read_records",
    "record_documents",
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


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def read_located_records(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """("FILE:LINE", record) per record of a ``.jsonl`` file (one JSON object a line; blank lines skipped) or
    ("hf:NAME record N", record) for ``hf:NAME[:SPLIT]`` (Hugging Face datasets). A line that is not UTF-8, not JSON
    or not an object raises ValueError "FILE:LINE: reason"."""
    if source.startswith("hf:"):
        try:
            import datasets
        except ImportError as err:
            raise ValueError(f"input (--input) {source} needs the `datasets` package (pip install datasets)") from err
        name, _, split = source[3:].partition(":")
        for number, record in enumerate(datasets.load_dataset(name, split=split or "train", streaming=True), 1):
            yield f"{source} record {number}", dict(record)
        return
    path = _input_file(source)
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{source}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})"
                ) from None
            if not raw.strip():  # ASCII whitespace only: str.strip would also drop a line of control characters (\x1c)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object (one record a line), got {_kind(record)}")
            yield where, record


def read_records(source: str) -> Iterator[dict[str, Any]]:
    """Records of a ``.jsonl`` file (one JSON object a line) or ``hf:NAME[:SPLIT]`` (Hugging Face datasets)."""
    for _, record in read_located_records(source):
        yield record


def record_documents(
    source: str, tokenizer, max_records: int | None = None
) -> Iterator[tuple[str, dict[str, Any], Document]]:
    """(location, record, document) per record of ``source`` (see :func:`read_located_records`), in order; a record
    that cannot be tokenized raises ValueError "LOCATION: reason"."""
    for n, (where, record) in enumerate(read_located_records(source)):
        if max_records is not None and n >= max_records:
            return
        try:
            document = tokenize_record(tokenizer, record)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        yield where, record, document


def _input_file(source: str) -> Path:
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"input (--input) {source} does not exist")
    if path.is_dir():
        raise ValueError(f"input (--input) {source} is a directory; expected a .jsonl file or hf:NAME[:SPLIT]")
    return path


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def chat_messages(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """The turns of a chat record (``messages``, or ShareGPT ``conversations``) as role/content dicts; None for a
    record that is not a chat. ValueError for turns that are not a list of objects with string role and content."""
    for key in ("messages", "conversations", "conversation"):
        if key in record:
            turns = record[key]
            if not isinstance(turns, list):
                raise ValueError(f"{key!r} must be a list of turns, got {_kind(turns)}")
            messages = []
            for i, turn in enumerate(turns):
                if not isinstance(turn, dict):
                    raise ValueError(f"turn {i} of {key!r} must be an object, got {_kind(turn)}")
                # ShareGPT style {"from": "human"/"gpt", "value": ...} -> role/content.
                role = turn.get("role", turn.get("from"))
                content = turn.get("content", turn.get("value", ""))
                if not isinstance(role, str):
                    raise ValueError(f"turn {i} of {key!r} needs a string 'role' (or 'from'), got {_kind(role)}")
                if not isinstance(content, str):
                    raise ValueError(f"turn {i} of {key!r}: 'content' must be a string, got {_kind(content)}")
                messages.append({"role": ROLES.get(role, role), "content": content})
            return messages
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
                f"record has neither messages/conversations, text nor completion_ids: keys {sorted(record)[:8]}"
            )
        if not isinstance(record["text"], str):
            raise ValueError(f"'text' must be a string, got {_kind(record['text'])}")
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        return Document(list(ids), [True] * len(ids))
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat records need a tokenizer with a chat_template")
    text = _render_chat(tokenizer, messages)
    # Character spans of the assistant turns: render the prefix before and after each assistant message.
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        after = _render_chat(tokenizer, messages[: i + 1])
        if not text.startswith(before) or not text.startswith(after):
            raise ValueError("the chat template does not render conversations prefix-consistently")
        spans.append((len(before), len(after)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([o[0] for o in enc["offset_mapping"]], dtype=torch.long)
    loss = torch.zeros(starts.numel(), dtype=torch.bool)
    for lo, hi in spans:
        loss |= (starts >= lo) & (starts < hi)
    return Document(list(enc["input_ids"]), loss.tolist())


def _render_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # a template's own refusal (e.g. roles that must alternate) is a property of the record
        raise ValueError(f"the chat template cannot render this conversation: {err}") from err


class RowPacker:
    """Greedy packing into rows of ``seq_len`` positions: documents are cut into pieces of at most ``seq_len`` tokens
    (a piece shorter than 2 tokens is dropped) and a row is closed when the next piece does not fit. Rows hold
    (input_ids int32, loss_mask uint8, document_ids int32, -1 = padding).

    :meth:`add` returns the rows a document closed, each with the cursor of the next row: (key of the document,
    index of the piece) where the next row starts, so a producer that resumes there (:meth:`add` with
    ``first_piece``) continues with exactly the rows that follow."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self._clear()

    def _clear(self) -> None:
        self.ids = torch.zeros(self.seq_len, dtype=torch.int32)
        self.loss = torch.zeros(self.seq_len, dtype=torch.uint8)
        self.docs = torch.full((self.seq_len,), -1, dtype=torch.int32)
        self.used = self.doc = 0

    def add(
        self, document: Document, key: Any = None, first_piece: int = 0
    ) -> list[tuple[tuple[Tensor, Tensor, Tensor], tuple[Any, int]]]:
        """Packs ``document`` from its piece ``first_piece`` on; returns the rows closed, each with its cursor."""
        closed = []
        tokens = torch.tensor(document.ids, dtype=torch.int32)
        mask = torch.tensor(document.loss, dtype=torch.uint8)
        for piece, lo in enumerate(range(0, tokens.numel(), self.seq_len)):
            if piece < first_piece:
                continue
            part, part_loss = tokens[lo : lo + self.seq_len], mask[lo : lo + self.seq_len]
            if part.numel() < 2:
                continue
            if self.used + part.numel() > self.seq_len:
                closed.append(((self.ids, self.loss, self.docs), (key, piece)))
                self._clear()
            span = slice(self.used, self.used + part.numel())
            self.ids[span], self.loss[span], self.docs[span] = part, part_loss, self.doc
            self.used = span.stop
            self.doc += 1
        return closed

    def finish(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The last, partly filled row (None when empty); the packer starts a new one."""
        row = (self.ids, self.loss, self.docs) if self.used else None
        self._clear()
        return row


def pack_documents(documents: Iterable[Document], seq_len: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Greedy packing into rows of ``seq_len`` (:class:`RowPacker`): (input_ids, loss_mask, document_ids); longer
    documents are cut."""
    packer = RowPacker(seq_len)
    for document in documents:
        for row, _ in packer.add(document):
            yield row
    last = packer.finish()
    if last is not None:
        yield last


Tensor = torch.Tensor


MAX_SEQ_LEN = 1 << 20  # positions of a packed row; far beyond what one row's training fits in memory


def check_prepare_args(
    source: str,
    out_dir: str | os.PathLike,
    seq_len: int,
    rows_per_shard: int,
    max_records: int | None,
    tokenizer_path: str | os.PathLike = "",
) -> None:
    """ValueError naming the option of the first bad argument of :func:`prepare_data` (before any work)."""
    if not 4 <= seq_len <= MAX_SEQ_LEN:
        raise ValueError(f"seq_len (--seq-len) must be in [4, {MAX_SEQ_LEN}], got {seq_len}")
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard (--rows-per-shard) must be at least 1, got {rows_per_shard}")
    if max_records is not None and max_records < 1:
        raise ValueError(f"max_records (--max-records) must be at least 1 (or None for all), got {max_records}")
    inputs = {} if source.startswith("hf:") else {"--input": _input_file(source)}
    if tokenizer_path:
        inputs["--tokenizer"] = tokenizer_path
    check_output_directory(out_dir, inputs)


def prepare_data(
    source: str,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    seq_len: int = 2048,
    rows_per_shard: int = 256,
    max_records: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Runs step 1 and returns the manifest.

    The output is built in a staging directory beside ``out_dir`` and published whole at the end, so a run that
    fails leaves ``out_dir`` as it was. A non-empty ``out_dir`` is refused unless ``overwrite`` (then it is replaced
    when the new data is complete). Records with nothing to train (a chat without an assistant turn, an empty
    completion) are skipped and counted in the manifest (``skipped_records``, ``first_skipped``)."""
    check_prepare_args(source, out_dir, seq_len, rows_per_shard, max_records, tokenizer_path)
    out = Path(out_dir)
    if not overwrite and not is_empty_directory(out):
        raise ValueError(
            f"output (--out) {out} is not empty (an earlier prepare-data?); pass --overwrite to replace it"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    staging = staging_directory(out)
    try:
        manifest = _write_prepared(source, tokenizer, staging, seq_len, rows_per_shard, max_records, progress)
        publish_directory(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _write_prepared(source, tokenizer, out: Path, seq_len, rows_per_shard, max_records, progress) -> dict[str, Any]:
    from tqdm import tqdm

    vocab = len(tokenizer)
    freq = torch.zeros(vocab, dtype=torch.long)
    skipped: list[str] = []

    def documents() -> Iterator[Document]:
        located = record_documents(source, tokenizer, max_records)
        for where, _, doc in tqdm(located, desc="tokenize", disable=not progress, unit="rec"):
            if not any(doc.loss):
                skipped.append(where)
                continue
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
        shards.append({"file": name, "rows": len(batch), "bytes": (out / name).stat().st_size})
        batch.clear()

    for row in pack_documents(documents(), seq_len):
        batch.append(tuple(t.clone() for t in row))
        rows += 1
        trained += int(row[1].sum())
        if len(batch) == rows_per_shard:
            flush()
    if batch:
        flush()
    if not trained:
        detail = f" ({len(skipped)} records without an assistant turn or completion, first at {skipped[0]})"
        raise ValueError(f"{source}: no trained tokens in any record{detail if skipped else ''}")
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
        "skipped_records": len(skipped),
        "first_skipped": skipped[0] if skipped else None,
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


# Shard files per kind of directory: a reader refuses a directory holding one its manifest does not list.
SHARD_PATTERNS = {"peagle-prepared": "rows-*.safetensors", "peagle-extracted": "states-*.safetensors"}


def read_manifest(directory: str | os.PathLike, kind: str) -> dict[str, Any]:
    """The manifest of a ``kind`` directory, checked against its files: every listed shard exists with its recorded
    size, the row counts add up, and (once complete) no shard file is there that the manifest does not list."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"no {MANIFEST} in {directory}: run the previous peagle step first")
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != kind:
        raise ValueError(f"{directory} holds {manifest.get('kind')!r} data, expected {kind!r}")
    _check_shards(Path(directory), manifest)
    return manifest


def _check_shards(directory: Path, manifest: dict[str, Any]) -> None:
    rerun = "; the directory does not hold one complete run: produce it again (with --overwrite)"
    listed = {shard["file"] for shard in manifest["shards"]}
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.is_file():
            raise ValueError(f"{directory}: {shard['file']} listed in {MANIFEST} is missing{rerun}")
        if "bytes" in shard and path.stat().st_size != shard["bytes"]:
            raise ValueError(
                f"{directory}: {shard['file']} has {path.stat().st_size} bytes, {MANIFEST} says {shard['bytes']}{rerun}"
            )
    if manifest.get("complete", True):
        stray = sorted(p.name for p in directory.glob(SHARD_PATTERNS[manifest["kind"]]) if p.name not in listed)
        if stray:
            raise ValueError(f"{directory}: {', '.join(stray[:3])} not listed in {MANIFEST}{rerun}")
        if sum(shard["rows"] for shard in manifest["shards"]) != manifest["num_rows"]:
            raise ValueError(f"{directory}: the shards of {MANIFEST} do not add up to num_rows{rerun}")


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """A digest of what a manifest says about its data (shards with rows and sizes, shape): equal for the same run."""
    keys = ("kind", "seq_len", "num_rows", "vocab_size", "trained_tokens", "shards")
    text = json.dumps({k: manifest.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
