"""Sampling: temperature / top-k / top-p on target rows, draft distributions, and per-request random streams.

Target rows (:func:`target_probs`, defined with the rejection sampler in :mod:`peagle.ops.tree_verify`, where offline
evaluation finds them too) follow Hugging Face's warpers (and vLLM's sampler): logits / temperature, then top-k
(keep the scores >= the k-th largest), then top-p (drop the smallest tokens whose cumulative probability stays <=
1 - top_p, always keeping the most likely one), then softmax. Temperature 0 means greedy decoding and never comes here.

Randomness: every request r owns a 32-bit seed, and each of its draws comes from a torch generator seeded with a
SplitMix64 hash of (the request's seed, ``offset = round * STREAMS + stream``, the first draw's index). A request's
draws depend only on its seed and its own round number, never on the other requests of the batch, so its output does
not change when it is batched with others.

Stochastic drafts are sampled without replacement from the drafter's distribution q by the exponential race (the Gumbel
top-k trick without the logarithms): with independent E_v ~ Exp(1), the tokens in decreasing order of q_v / E_v are a
sequence of draws without replacement, so the first c entries are c children drawn in order (:func:`gumbel_order`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from peagle.ops import DRAFT_FLOOR, draft_distribution, target_probs

__all__ = ["DRAFT_FLOOR", "STREAMS", "draft_distribution", "gumbel_order", "target_probs", "uniforms"]

# Random streams of a round (offset = round * STREAMS + stream).
STREAMS = 4
VERIFY_STREAM, DRAFT_STREAM = 0, 1


_MASK64 = (1 << 64) - 1


def _stream_seed(*words: int) -> int:
    """SplitMix64 over the words: a 64-bit generator seed per (request seed, stream offset, first draw)."""
    x = 0
    for word in words:
        x = ((x ^ (word & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x


def _generators(seeds: Tensor | Sequence[int], offset: int, first_index: int, device) -> list[torch.Generator]:
    host = seeds.tolist() if isinstance(seeds, Tensor) else list(seeds)  # the engine passes host ints: no sync
    return [torch.Generator(device=device).manual_seed(_stream_seed(s, offset, first_index)) for s in host]


def uniforms(seeds: Tensor | Sequence[int], offset: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """float32 uniforms in [0, 1) [b, count]: draws 0 .. count - 1 of stream ``offset`` of each request (``seeds``
    [b] per-request seeds)."""
    return torch.stack([torch.rand(count, generator=g, device=device) for g in _generators(seeds, offset, 0, device)])


def gumbel_order(probs: Tensor, count: int, seeds: Tensor | Sequence[int], offset: int, first_index: int = 0) -> Tensor:
    """The first ``count`` tokens of a sample without replacement from each row of ``probs`` [b, m, V] (all
    positive), in draw order [b, m, count]. Request b's draws are those of stream ``offset`` from ``first_index``."""
    batch, rows, vocab = probs.shape
    race = torch.empty(batch, rows, vocab, dtype=torch.float64, device=probs.device)
    for b, generator in enumerate(_generators(seeds, offset, first_index, probs.device)):
        race[b].exponential_(generator=generator)
    keys = probs.double() / race.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.topk(keys, count, dim=-1).indices
