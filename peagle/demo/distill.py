"""Self-distillation data for the demo's drafters: prompts from a split's records and the target's own greedy
continuations of them, written as pre-tokenized ``{"prompt_ids", "completion_ids"}`` records for prepare-data.

A served drafter drafts against the target's own greedy output, so that is the text it should train on and the text
the offline evaluation should score (the standard recipe; corpus text the target would not have written gives lower
and different acceptance). Token ids are kept as generated: decoding to text and re-tokenizing would not give the
same ids back with a BPE tokenizer.

Generation runs the transformers model with a KV cache in this process, prompts of equal length batched: on the
embedded default it is as fast as vLLM-CPU (about 4000 tokens/s on 2 cores, without vLLM's ~20 s engine start-up),
and its greedy tokens were identical to vLLM's for every prompt checked.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

__all__ = ["generate_hf", "split_prompts", "write_records"]


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


@torch.no_grad()
def generate_hf(
    target: str | os.PathLike,
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = True,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> list[list[int]]:
    """Greedy continuations of ``max_tokens`` tokens (cut after the first EOS unless ``ignore_eos``) with the
    transformers model: a KV cache, prompts of equal length batched together."""
    from tqdm import tqdm

    from peagle.model.target import load_target

    model = load_target(target, device=device)
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_length[len(prompt)].append(i)
    results: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts) * max_tokens, desc="generate", unit="tok", unit_scale=True, disable=not progress)
    for indices in by_length.values():
        for lo in range(0, len(indices), batch_size):
            chunk = indices[lo : lo + batch_size]
            out = model(input_ids=torch.tensor([prompts[i] for i in chunk], device=device), use_cache=True)
            tokens = [out.logits[:, -1].argmax(-1)]
            bar.update(len(chunk))
            for _ in range(max_tokens - 1):
                out = model(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
                tokens.append(out.logits[:, -1].argmax(-1))
                bar.update(len(chunk))
            for i, row in zip(chunk, torch.stack(tokens, 1).tolist(), strict=True):
                if not ignore_eos:
                    end = next((j for j, t in enumerate(row) if t in eos_ids), None)
                    row = row if end is None else row[: end + 1]
                results[i] = row
    bar.close()
    return results


def write_records(path: Path, prompts: list[list[int]], completions: list[list[int]], vocab: int) -> dict[str, Any]:
    """``{"prompt_ids", "completion_ids"}`` records; a completion is cut before any id the tokenizer does not have (a
    target with a padded embedding may, rarely, emit one). Returns counts."""
    tokens, cut = 0, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for prompt, completion in zip(prompts, completions, strict=True):
            end = next((j for j, t in enumerate(completion) if not 0 <= t < vocab), len(completion))
            cut += end < len(completion)
            tokens += end
            f.write(json.dumps({"prompt_ids": prompt, "completion_ids": completion[:end]}) + "\n")
    os.replace(tmp, path)
    return {"records": len(prompts), "completion_tokens": tokens, "cut_at_unknown_id": cut}
