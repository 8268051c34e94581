"""Sampling: temperature / top-k / top-p on target rows, draft distributions, and per-request random streams.

Target rows (:func:`target_probs`) follow Hugging Face's warpers (and vLLM's sampler): logits / temperature, then top-k
(keep the scores >= the k-th largest), then top-p (drop the smallest tokens whose cumulative probability stays <=
1 - top_p, always keeping the most likely one), then softmax. Temperature 0 means greedy decoding and never comes here.

Randomness: every request r owns a 32-bit seed, and all its draws are Philox 4x32-10 24-bit uniforms
(:func:`peagle.ops.philox_uniforms`) with the request's seed in the counter's request word, ``offset = round *
STREAMS + stream`` and a per-draw index. A request's draws depend only on its seed and its own round number, never on
the other requests of the batch, so its output does not change when it is batched with others.

Stochastic drafts are sampled without replacement from the drafter's distribution q by the Gumbel top-k trick: the
token order of ``log q + Gumbel`` is a sequence of draws without replacement, so the first c entries are c children
drawn in order (:func:`gumbel_order`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.ops import philox_uniforms

__all__ = ["STREAMS", "draft_distribution", "gumbel_order", "target_probs", "uniforms"]

UNIFORM_ONE = float(1 << 24)
# Random streams of a round (offset = round * STREAMS + stream).
STREAMS = 4
VERIFY_STREAM, DRAFT_STREAM = 0, 1
# Draft probabilities below this are raised to it (then renormalised), so every drawable token has q > 0.
DRAFT_FLOOR = 1e-9


def target_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """float32 probabilities [..., V] after temperature (> 0), top-k (0 = off) and top-p (1 = off)."""
    scores = logits.double() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.softmax(dim=-1).float()


def draft_distribution(logits: Tensor, temperature: float) -> Tensor:
    """The drafter's float32 distribution [..., V] at ``temperature`` (1 when greedy), floored so that every token
    has positive probability (a Gumbel draw must never pick a token of probability 0)."""
    probs = (logits.float() / (temperature if temperature > 0 else 1.0)).softmax(dim=-1).clamp_min(DRAFT_FLOOR)
    return probs / probs.sum(dim=-1, keepdim=True)


def uniforms(seeds: Tensor, offset: int, count: int) -> Tensor:
    """float32 uniforms U / 2^24 in [0, 1) [b, count]: draws 0 .. count - 1 of stream ``offset`` of each request
    (``seeds`` [b] int64 per-request seeds)."""
    index = torch.arange(count, device=seeds.device)
    return philox_uniforms(0, offset, seeds[:, None], index[None, :]).float() / UNIFORM_ONE


def gumbel_order(probs: Tensor, count: int, seeds: Tensor, offset: int, first_index: int = 0) -> Tensor:
    """The first ``count`` tokens of a sample without replacement from each row of ``probs`` [b, m, V], in draw
    order [b, m, count]. Row j of request b uses draws ``first_index + j * V + v`` of stream ``offset``."""
    batch, rows, vocab = probs.shape
    index = first_index + torch.arange(rows * vocab, device=probs.device).view(1, rows, vocab)
    u = (philox_uniforms(0, offset, seeds.view(batch, 1, 1), index).double() + 0.5) / UNIFORM_ONE
    keys = probs.double().log() - torch.log(-torch.log(u))
    return torch.topk(keys, count, dim=-1).indices
