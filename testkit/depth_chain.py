"""A toy depth-by-depth drafter for the graph chain (peagle.decode.harness.graphs): deterministic device work per depth
that decides on the device whether the next depth runs, plus its pure-Python reference."""

from __future__ import annotations

from collections.abc import Callable

import torch


def toy_token(prev: int, seed: int, depth: int, vocab: int) -> int:
    """The token depth ``depth`` drafts after ``prev`` (the formula of :meth:`ToyDrafter.step`)."""
    return (prev * 31 + seed * 7 + depth) % vocab


class ToyDrafter:
    """Depth d writes ``tokens[:, d + 1]`` from ``tokens[:, d]`` and the round's seed, counts the depth on the device
    and sets ``go`` = (depths so far < stop_after) and (no row drafted stop_token). Finalize copies the drafted tokens
    of the depths that ran into ``emitted`` (-1 beyond) and counts finalizes. Per-round values (root tokens, seed,
    stop_after, stop_token) are device tensors updated in place by :meth:`start_round`, so captured graphs serve every
    round. ``calls`` records the host calls of the steps (eager runs only)."""

    def __init__(self, batch: int, max_depth: int, vocab: int = 1009, device: str | torch.device = "cpu") -> None:
        self.batch, self.max_depth, self.vocab = batch, max_depth, vocab
        longs = {"dtype": torch.int64, "device": device}
        ints = {"dtype": torch.int32, "device": device}
        self.tokens = torch.full((batch, max_depth + 1), -1, **longs)  # column 0: the round's root tokens
        self.emitted = torch.full((batch, max_depth), -1, **longs)
        self.seed = torch.zeros((), **longs)
        self.stop_after = torch.zeros((), **ints)
        self.stop_token = torch.full((), -1, **longs)
        self.depth_count = torch.zeros((), **ints)
        self.finalized = torch.zeros((), **ints)
        self.go = torch.zeros(1, **ints)
        self.positions = torch.arange(max_depth, device=device)
        self.calls: list[str] = []

    def start_round(self, root: list[int], seed: int, stop_after: int, stop_token: int = -1) -> None:
        self.tokens.fill_(-1)
        self.tokens[:, 0].copy_(torch.tensor(root, dtype=torch.int64))
        self.emitted.fill_(-1)
        self.seed.fill_(seed)
        self.stop_after.fill_(stop_after)
        self.stop_token.fill_(stop_token)
        self.depth_count.zero_()
        self.go.zero_()

    def step(self, depth: int) -> Callable[[], None]:
        def run() -> None:
            self.calls.append(f"depth {depth}")
            drafted = (self.tokens[:, depth] * 31 + self.seed * 7 + depth) % self.vocab
            self.tokens[:, depth + 1].copy_(drafted)
            self.depth_count.add_(1)
            keep_going = (self.depth_count < self.stop_after) & (drafted != self.stop_token).all()
            self.go.copy_(keep_going.to(torch.int32).reshape(1))

        return run

    def steps(self) -> list[Callable[[], None]]:
        return [self.step(d) for d in range(self.max_depth)]

    def finalize(self) -> None:
        self.calls.append("finalize")
        ran = self.positions < self.depth_count
        self.emitted.copy_(torch.where(ran, self.tokens[:, 1:], -1))
        self.finalized.add_(1)


def expected_round(
    root: list[int], seed: int, stop_after: int, max_depth: int, vocab: int = 1009, stop_token: int = -1
) -> tuple[int, list[list[int]]]:
    """(depths run, emitted rows padded with -1) of one round, computed in Python without torch."""
    rows = [[r] for r in root]
    depths = 0
    for depth in range(max_depth):
        for row in rows:
            row.append(toy_token(row[-1], seed, depth, vocab))
        depths += 1
        if depths >= stop_after or any(row[-1] == stop_token for row in rows):
            break
    return depths, [row[1:] + [-1] * (max_depth - depths) for row in rows]
