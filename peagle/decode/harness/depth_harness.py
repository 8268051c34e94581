"""The harness of autoregressive (EAGLE-3) drafting over one generate call: a round's state in buffers reset in place
(:class:`DepthRound`: the ``harness_decide`` op per depth, the verify budget at the end) and :class:`DepthStepper`,
which runs the drafting's depth steps as CUDA graphs chained on the device or as a host loop (the planner
:class:`peagle.decode.drafting.Eagle3Drafting` asks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from peagle.decode.harness.budget import (
    harness_budget,
    kept_first,
    predicted_acceptance,
    recalibrate,
    sharpen,
    tree_width,
    widest,
)
from peagle.decode.harness.graphs import DepthGraphChain, device_launch_available, padded_batch_size
from peagle.decode.harness.policy import CallHarness, HarnessPolicy
from peagle.ops import HarnessState, TreeSpec, harness_decide, tree_select

__all__ = ["DepthHarness", "DepthRound", "DepthStepper"]


class DepthStepper:
    """A round's depth steps and finalize run through a :class:`~peagle.decode.harness.graphs.DepthGraphChain`.

    ``steps[d]`` drafts depth d and ends with :func:`harness_decide` writing ``go``; ``finalize`` runs after the last
    depth that ran. The steps read and write only buffers that outlive the stepper (a :class:`DepthRound` and the
    drafter's round buffers, reset in place before each :meth:`run`) and never read the device from the host, so the
    same callables are captured as CUDA graphs chained by device tail launch (``mode="auto"`` on a GPU: capture here,
    replay every round) or called in the chain's host loop (the CPU; a GPU without device graph launch). A capture
    that fails falls back to the host loop, with the reason in :attr:`fallback`.
    """

    def __init__(self, steps: list[Callable[[], None]], finalize: Callable[[], None], go: Tensor, mode: str = "auto"):
        self.fallback = ""
        if mode == "auto" and go.device.type == "cuda" and not device_launch_available(go.device):
            self.fallback = "device graph launch unavailable (CPU build of peagle, PEAGLE_NO_DLINK=1 or an old torch)"
        try:
            self.chain = DepthGraphChain(steps, finalize, go, mode=mode)
        except RuntimeError as error:  # e.g. a step that synchronises cannot be captured
            if mode != "auto" or go.device.type != "cuda":
                raise
            self.fallback = f"capture failed: {error}".splitlines()[0]
            self.chain = DepthGraphChain(steps, finalize, go, mode="host")

    @property
    def mode(self) -> str:
        """``"device"``, ``"host_graphs"`` or ``"host"`` (see :class:`DepthGraphChain`)."""
        return self.chain.mode

    def run(self) -> None:
        """Runs one round; on ``"device"`` it only launches it (no synchronisation)."""
        self.chain.run()

    def check(self) -> None:
        """Raises if a device tail launch failed (reads the chain's status: call it where the host waits anyway)."""
        self.chain.check()

    def close(self) -> None:
        self.chain.close()


class DepthRound:
    """The harness's state of one round at one padded batch size, in buffers reset in place by :meth:`reset`.

    Rows past the round's requests are padding: they repeat the first request's row (harmless device work) and start
    stopped, so :func:`harness_decide` gives them width 0 and they never keep ``go`` up. :meth:`decide` and
    :meth:`select` read only these buffers and the harness's per-call tensors (device work, no host reads), so a CUDA
    graph captures them once per padded batch size.
    """

    def __init__(self, harness: DepthHarness, padded: int) -> None:
        device = harness.device
        self.harness, self.padded, self.count = harness, padded, 0
        self.rows = torch.zeros(padded, dtype=torch.long, device=device)  # request of each row
        self.gamma = torch.ones(padded, dtype=torch.float64, device=device)
        self.calibration = torch.zeros(padded, 2, dtype=torch.float64, device=device)
        self.state = HarnessState.start(padded, device, harness.root_cost)
        self.overhead = 0.0  # the harness's overhead estimate when the round started (in state.draft_time)
        self._index = torch.arange(padded, device=device)

    def reset(self, rows: Tensor) -> None:
        """Starts a round of ``rows`` (request indices, at most ``padded``): the root alone, the root pass spent."""
        count = rows.numel()
        if not 1 <= count <= self.padded:
            raise ValueError(f"rows must hold 1 to {self.padded} requests, got {count}")
        self.count = count
        self.rows[:count].copy_(rows)
        self.rows[count:].copy_(rows[:1].expand(self.padded - count))
        torch.index_select(self.harness.gamma, 0, self.rows, out=self.gamma)
        torch.index_select(self.harness.calibration, 0, self.rows, out=self.calibration)
        state = self.state
        state.expected.zero_()
        # The round's fixed cost beyond the table's, paid once whatever its depths and budget: part of every ratio.
        self.overhead = self.harness.overhead.seconds
        state.draft_time.fill_(self.harness.root_cost + self.overhead)
        state.num_nodes.fill_(1)
        state.width.zero_()
        state.stop.copy_(self._index >= count)
        state.go.fill_(1)

    def decide(self, candidate_scores: Tensor, depth: int) -> None:
        """:func:`harness_decide` for the candidates of ``depth`` (path scores [padded, F], -inf = padding)."""
        harness = self.harness
        cost = harness.draft_cost[min(depth, len(harness.draft_cost)) - 1]
        scores = sharpen(candidate_scores, self.gamma).contiguous()
        harness_decide(scores, self.calibration, harness.widths, cost, harness.verify_cost, self.state)

    def select(
        self, tokens: Tensor, parent: Tensor, scores: Tensor, chosen: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The verify budget of the chosen candidates (root first; ``scores`` 0 where not chosen): the kept ones first
        (:func:`kept_first`), for :meth:`tree`."""
        scores = sharpen(scores, self.gamma)
        drafted = torch.where(chosen, scores, -1.0)[:, 1:]
        budget = harness_budget(drafted, self.calibration, self.state.draft_time, self.harness.verify_cost)
        # Padding rows repeat the first request's, so the widest budget is a real request's.
        return kept_first(tokens, parent, scores, chosen, widest(budget, chosen.sum(1)))

    def tree(self, tokens: Tensor, parent: Tensor, scores: Tensor, count: Tensor) -> TreeSpec:
        """The round's trees from :meth:`select`'s output (the real rows only); records their predicted acceptance.
        Runs after the chain, where the round waits for its tokens anyway."""
        rows = slice(0, self.count)
        width = tree_width(count[rows], tokens.shape[1], self.harness.max_nodes)
        tree = tree_select(tokens[rows], parent[rows], scores[rows], count[rows], width)
        harness = self.harness
        harness.predicted[self.rows[rows]] = predicted_acceptance(tree, self.calibration[rows])
        # The table's seconds of the round: its deepest request's drafting (a device scalar, read once it is timed)
        # and the verify of its slots.
        verify = harness.verify_seconds(tree.tokens.shape[1])
        harness.predicted_s = self.state.draft_time[rows].max() + (verify - self.overhead)
        return tree


class DepthHarness(CallHarness):
    """The harness of autoregressive drafting over one generate call (the planner the drafting steps ask).

    Per round: :meth:`start` resets the :class:`DepthRound` of the round's padded batch size (the root pass already
    spent); each depth step calls its :meth:`DepthRound.decide` (the ``harness_decide`` op with this depth's drafter
    costs), the finalize step its :meth:`DepthRound.select` (the verify budget of the chosen nodes), and
    :meth:`observe` folds the verified acceptance into the calibration. Sampled rounds draft a chain whose length was
    fixed after the previous round (:meth:`chain_depth`). ``chain_mode`` is the :class:`DepthStepper` mode of the
    drafting steps (``"auto"``: CUDA graphs chained on the device where available); ``chain_report`` says which ran.
    """

    def __init__(
        self,
        policy: HarnessPolicy,
        batch: int,
        max_depth: int,
        context: int,
        draft_vocab: int,
        device,
        sampled: bool = False,
    ) -> None:
        super().__init__(policy, batch, context, sampled)
        table = self.table = policy.table
        self.device = torch.device(device)
        widths = [w for w in table.draft_widths if w <= min(draft_vocab, self.max_nodes - 1)] or [1]
        self.max_width = widths[-1] if self.plan.kind == "tree" else 1
        widths = [w for w in widths if w <= self.max_width]
        self.widths = torch.tensor(widths, dtype=torch.long, device=self.device)
        columns = [table.draft_widths.index(w) for w in widths]
        self.draft_cost = [table.draft_row(batch, d)[columns].to(self.device) for d in range(1, max_depth + 1)]
        self.root_cost = float(table.draft_row(batch, 1)[0])
        self.verify_cost = self.plan.verify_cost.to(self.device)
        self.gamma, self.calibration = policy.start_state(batch, self.device)
        self.predicted = torch.zeros(batch, dtype=torch.float64, device=self.device)
        self.rounds: dict[int, DepthRound] = {}
        self.chain_mode = "auto"
        self.chain_report = ""

    def padded(self, rows: Tensor) -> int:
        """The padded batch size of a round of ``rows``."""
        return padded_batch_size(rows.numel(), self.batch)

    def start(self, rows: Tensor) -> DepthRound:
        """The round of ``rows``: the :class:`DepthRound` of their padded batch size, reset."""
        padded = self.padded(rows)
        if padded not in self.rounds:
            self.rounds[padded] = DepthRound(self, padded)
        self.rounds[padded].reset(rows)
        return self.rounds[padded]

    def chain_depth(self, rows: Tensor) -> int:
        """Sampled rounds: the chain length of the table at the acceptance rate observed so far (prior 0.7)."""
        self.sampled = True
        return max(1, self.policy.chain_length(self.batch, self.context, self.chain_acceptance.rate, sampled=True))

    def observe(
        self,
        rows: Tensor,
        num_accepted: Tensor,
        num_nodes: Tensor,
        parent: Tensor | None = None,
        accepted_path: Tensor | None = None,
        host: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Folds the verified acceptance of ``rows`` into their calibration and the acceptance rate (per level of the
        verified trees when their ``parent`` and the ``accepted_path`` come with it; sampled chains count from
        ``host``, the requests' accepted drafts and node counts as read back)."""
        recalibrate(self.calibration, self.gamma, self.predicted, rows, num_accepted)
        if host is not None and self.sampled:
            self.chain_acceptance.observe(num_accepted, num_nodes, host=host)
        else:
            self.chain_acceptance.observe(num_accepted, num_nodes, parent, accepted_path)

    def finish(self) -> None:
        """Hands what this call learnt to the policy (the next call starts from it)."""
        super().finish()
        self.policy.learn(self.gamma, self.calibration)
