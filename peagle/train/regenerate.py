"""`peagle regenerate`: the target answers the dataset's prompts itself, so a drafter trains on the text it will draft
against when served (self-distillation).

Records in (one JSON object a line, or ``hf:NAME[:SPLIT]``), records out that ``prepare-data`` reads as they are:

- a chat (``messages``, or ShareGPT ``conversations``) is answered turn by turn: every assistant turn is replaced by
  the target's answer to the conversation before it (the user turns as given, the earlier assistant turns the target's
  own), and a chat that ends with a user turn gets one more assistant turn. Out: ``{"messages": [...]}`` with the
  answers as text (``prepare-data`` renders them with the chat template and trains the assistant turns).
- ``{"prompt_ids": [...]}`` (token ids; a ``completion_ids`` there is replaced) or ``{"prompt": "text"}`` (tokenized
  with the tokenizer's special tokens) is continued once. Out: ``{"prompt_ids", "completion_ids"}``, the ids as the
  target generated them (decoding and re-tokenizing would not give them back), cut before any id the tokenizer does
  not have.

Generation is greedy at temperature 0, else sampled (temperature, top-p) with a seed per record, turn and pass
(:func:`answer_seed`), so an answer does not depend on which records share its batch. Records go to the backend in
consecutive chunks of ``batch_size``, the same chunks in every run, so a streaming producer that regenerates the same
records in the same chunks (``peagle train --stream``) gets the same answers. Backends come from a registry
(:func:`register_generation_backend`): ``hf`` (here) runs the transformers model with a KV cache, prompts of equal
length batched together; ``vllm`` (registered by importing :mod:`peagle.vllm.regenerate`) batches every prompt of a
chunk in vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from peagle.train.data import chat_messages, load_tokenizer, read_located_records

__all__ = [
    "Answerer",
    "Cancelled",
    "HFAnswerer",
    "Sampling",
    "answer_seed",
    "chunks",
    "generation_backends",
    "open_generator",
    "read_prompt_records",
    "regenerate",
    "regenerate_chunk",
    "regenerate_records",
    "register_generation_backend",
]


@dataclass(frozen=True)
class Sampling:
    """How the target answers: ``max_new_tokens`` per turn; greedy at ``temperature`` 0, else sampled with nucleus
    ``top_p``; ``seed`` fixes the sampled answers; ``ignore_eos`` keeps generating after the end-of-sequence token
    (else an answer ends with it)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def check(self) -> None:
        """ValueError naming the option of the first setting out of range."""
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"--temperature must be at least 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2^63), got {self.seed}")


def answer_seed(seed: int, record: int, turn: int, epoch: int = 0) -> int:
    """The sampling seed of one answer: a hash of (run seed, pass over the data, record index, turn), so no two
    answers share a stream and an answer does not depend on its batch."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{record}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class Answerer(Protocol):
    """An open target that continues token-id prompts (see :func:`register_generation_backend`); ``eos`` holds its
    end-of-sequence ids."""

    eos: set[int]

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: Sampling) -> list[list[int]]:
        """The continuation of each prompt (ending with the end-of-sequence token when it stopped there)."""
        ...

    def close(self) -> None: ...


_BACKENDS: dict[str, Callable[..., Answerer]] = {}


def register_generation_backend(name: str, factory: Callable[..., Answerer]) -> None:
    """Makes ``regenerate(..., backend=name)`` open targets with ``factory(target_path, device=..., max_len=...)``."""
    _BACKENDS[name] = factory


def generation_backends() -> list[str]:
    """The names ``regenerate`` accepts now (``vllm`` after :mod:`peagle.vllm.regenerate` is imported)."""
    return sorted(_BACKENDS)


def open_generator(backend: str, target: str | os.PathLike, device: str = "cpu", max_len: int = 4096) -> Answerer:
    """An open generation backend (``close()`` it); ``max_len`` bounds a prompt plus its answer."""
    if backend not in _BACKENDS:
        hint = ""
        if backend == "vllm":
            hint = "; it registers itself when peagle.vllm.regenerate is imported (pip install 'peagle[vllm]')"
        raise ValueError(f"backend (--backend) must be one of {generation_backends()}, got {backend!r}{hint}")
    if not Path(target).exists():
        raise FileNotFoundError(f"target model directory {target} does not exist")
    return _BACKENDS[backend](target, device=device, max_len=max_len)


def _eos_ids(config: Any) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _pick(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: the argmax, or a draw from the temperature / top-p distribution with the row's own
    generator."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators, strict=True)])


class Cancelled(Exception):
    """Generation stopped because its ``cancel`` event was set."""


class HFAnswerer:
    """The transformers model with a KV cache; prompts of equal length run as one batch (no padding, so an answer is
    the one the prompt gets alone). Setting ``cancel`` (an Event) stops a generation at its next token (raises
    :class:`Cancelled`)."""

    def __init__(
        self, target: str | os.PathLike | torch.nn.Module, device: str = "cpu", max_len: int = 4096, batch: int = 64
    ) -> None:
        from peagle.model.target import load_target

        self.model = load_target(target, device=device) if not isinstance(target, torch.nn.Module) else target
        self.device = device
        self.batch = batch
        self.eos = _eos_ids(self.model.config)
        self.cancel: Any = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: Sampling) -> list[list[int]]:
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            by_length[len(prompt)].append(i)
        results: list[list[int]] = [[] for _ in prompts]
        for indices in by_length.values():
            for lo in range(0, len(indices), self.batch):
                chunk = indices[lo : lo + self.batch]
                generators = [torch.Generator().manual_seed(seeds[i]) for i in chunk]
                ids = torch.tensor([prompts[i] for i in chunk], device=self.device)
                out = self.model(input_ids=ids, use_cache=True)
                tokens = [_pick(out.logits[:, -1], sampling, generators)]
                eos = torch.tensor(sorted(self.eos), dtype=torch.long)
                ended = torch.isin(tokens[-1].cpu(), eos)
                for _ in range(sampling.max_new_tokens - 1):
                    if not sampling.ignore_eos and bool(ended.all()):
                        break  # every answer has ended: what follows would be cut
                    if self.cancel is not None and self.cancel.is_set():
                        raise Cancelled
                    out = self.model(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
                    tokens.append(_pick(out.logits[:, -1], sampling, generators))
                    ended |= torch.isin(tokens[-1].cpu(), eos)
                for i, row in zip(chunk, torch.stack(tokens, 1).tolist(), strict=True):
                    if not sampling.ignore_eos:
                        end = next((j for j, t in enumerate(row) if t in self.eos), None)
                        row = row if end is None else row[: end + 1]
                    results[i] = row
        return results

    def close(self) -> None:
        pass


register_generation_backend("hf", HFAnswerer)


# ---------------------------------------------------------------------------------------------------------------------
# Records


@dataclass
class _Item:
    """One record on its way: a chat (``messages``, the assistant turns ``turns`` to answer) or a token-id prompt."""

    index: int
    record: dict[str, Any]
    messages: list[dict[str, str]] | None = None
    turns: list[int] | None = None
    prompt_ids: list[int] | None = None


def _item(index: int, record: dict[str, Any], tokenizer) -> _Item:
    messages = chat_messages(record)
    if messages is not None:
        if not any(m["role"] == "user" for m in messages):
            raise ValueError("a chat to answer needs a user turn")
        if messages[-1]["role"] != "assistant":
            messages = [*messages, {"role": "assistant", "content": ""}]
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user]
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat records need a tokenizer with a chat_template")
        return _Item(index, record, messages=messages, turns=turns)
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"'prompt_ids' must be a non-empty list of integer token ids, got {str(ids)[:80]}")
        bad = [t for t in ids if not 0 <= t < len(tokenizer)]
        if bad:
            raise ValueError(f"'prompt_ids' has token ids outside the tokenizer's [0, {len(tokenizer)}): {bad[:5]}")
        return _Item(index, record, prompt_ids=list(ids))
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise ValueError(f"'prompt' must be a non-empty string, got {str(record['prompt'])[:80]}")
        return _Item(index, record, prompt_ids=list(tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]))
    raise ValueError(
        "nothing to answer: a record needs messages/conversations (a chat), prompt_ids or prompt, got keys "
        f"{sorted(record)[:8]}"
    )


def _context(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation before an assistant turn, rendered with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _text(tokenizer, ids: list[int], eos: set[int]) -> str:
    """An answer as chat text: its closing end-of-sequence token dropped (the chat template writes the turn's end),
    everything else as generated."""
    if ids and ids[-1] in eos | {tokenizer.eos_token_id}:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


_REPLACED = ("messages", "conversations", "conversation", "prompt", "prompt_ids", "completion_ids")


def regenerate_records(
    records: list[tuple[int, dict[str, Any]]],
    tokenizer,
    generator: Answerer,
    sampling: Sampling,
    epoch: int = 0,
) -> list[dict[str, Any]]:
    """The records (index, record) answered by ``generator``: chats turn by turn (the turns of all chats at the same
    depth in one call), token-id prompts once. A record's other keys are kept; ``epoch`` (the pass over the data)
    is part of each answer's seed."""
    items = [_item(index, record, tokenizer) for index, record in records]
    return _answer(items, tokenizer, generator, sampling, epoch)


def _answer(items: list[_Item], tokenizer, generator: Answerer, sampling: Sampling, epoch: int) -> list[dict[str, Any]]:
    answers: dict[int, list[int]] = {}
    prompts = [item for item in items if item.prompt_ids is not None]
    if prompts:
        seeds = [answer_seed(sampling.seed, item.index, 0, epoch) for item in prompts]
        generated = generator.generate([item.prompt_ids for item in prompts], seeds, sampling)
        answers = {item.index: answer for item, answer in zip(prompts, generated, strict=True)}
    chats = [item for item in items if item.messages is not None]
    for turn in range(max((len(item.turns) for item in chats), default=0)):
        pending = [item for item in chats if turn < len(item.turns)]
        contexts = [_context(tokenizer, item.messages[: item.turns[turn]]) for item in pending]
        seeds = [answer_seed(sampling.seed, item.index, turn, epoch) for item in pending]
        for item, answer in zip(pending, generator.generate(contexts, seeds, sampling), strict=True):
            content = _text(tokenizer, answer, generator.eos)
            item.messages[item.turns[turn]] = {"role": "assistant", "content": content}
    out = []
    vocab = len(tokenizer)
    for item in items:
        kept = {k: v for k, v in item.record.items() if k not in _REPLACED}
        if item.messages is not None:
            out.append({**kept, "messages": item.messages})
        else:
            answer = answers[item.index]
            # A target whose embedding is padded beyond the tokenizer may, rarely, emit an id the tokenizer lacks.
            end = next((j for j, t in enumerate(answer) if not 0 <= t < vocab), len(answer))
            out.append({**kept, "prompt_ids": item.prompt_ids, "completion_ids": answer[:end]})
    return out


def read_prompt_records(
    source: str, max_records: int | None = None, shard: tuple[int, int] = (0, 1)
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(index, location, record) of the records of ``source`` (the first ``max_records``) whose index % count ==
    part for ``shard`` = (part, count)."""
    part, count = shard
    for index, (where, record) in enumerate(read_located_records(source)):
        if max_records is not None and index >= max_records:
            return
        if index % count == part:
            yield index, where, record


def regenerate_chunk(
    chunk: list[tuple[int, str, dict[str, Any]]], tokenizer, generator: Answerer, sampling: Sampling, epoch: int = 0
) -> list[dict[str, Any]]:
    """:func:`regenerate_records` of one chunk of :func:`read_prompt_records` (index, location, record); a bad record
    raises ValueError naming its location."""
    items = []
    for index, where, record in chunk:
        try:
            items.append(_item(index, record, tokenizer))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    return _answer(items, tokenizer, generator, sampling, epoch)


def chunks(records: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    chunk: list[Any] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def check_regenerate_args(
    source: str, target: str | os.PathLike, out: str | os.PathLike, batch_size: int, max_records: int | None
) -> Path:
    """ValueError naming the option of the first bad argument (before any work); the output path."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if max_records is not None and max_records < 1:
        raise ValueError(f"--max-records must be at least 1 (or none for all), got {max_records}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"output (--out) {out} is a directory; expected a .jsonl file")
    if not source.startswith("hf:") and Path(source).exists() and Path(source).resolve() == out.resolve():
        raise ValueError(f"output (--out) {out} is the input (--input); choose another file")
    if not Path(target).exists():
        raise FileNotFoundError(f"target model directory {target} does not exist")
    return out


def regenerate(
    source: str,
    target: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    sampling: Sampling | None = None,
    backend: str = "hf",
    batch_size: int = 64,
    max_records: int | None = None,
    max_len: int = 4096,
    device: str = "cpu",
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Answers the records of ``source`` with the target (see the module docstring) into the .jsonl ``out``, written
    whole at the end (a failed run leaves ``out`` as it was); an existing ``out`` is refused unless ``overwrite``.
    Returns counts: records, answers (turns answered), answer tokens."""
    from tqdm import tqdm

    sampling = sampling or Sampling()
    sampling.check()
    out = check_regenerate_args(source, target, out, batch_size, max_records)
    if out.exists() and not overwrite:
        raise ValueError(f"output (--out) {out} exists (an earlier regenerate?); pass --overwrite to replace it")
    tok = load_tokenizer(tokenizer or target)
    generator = open_generator(backend, target, device=device, max_len=max_len)
    counts = {"records": 0, "answers": 0, "answer_tokens": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f, tqdm(desc="regenerate", unit="rec", disable=not progress) as bar:
            for chunk in chunks(read_prompt_records(source, max_records), batch_size):
                for record in regenerate_chunk(chunk, tok, generator, sampling):
                    f.write(json.dumps(record) + "\n")
                    counts["records"] += 1
                    _count_answers(counts, record, tok)
                bar.update(len(chunk))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        generator.close()
    return counts


def _count_answers(counts: dict[str, int], record: dict[str, Any], tokenizer) -> None:
    if "completion_ids" in record:
        counts["answers"] += 1
        counts["answer_tokens"] += len(record["completion_ids"])
        return
    for message in record["messages"]:
        if message["role"] == "assistant":
            counts["answers"] += 1
            counts["answer_tokens"] += len(tokenizer(message["content"], add_special_tokens=False)["input_ids"])
