"""The P-EAGLE harness over one generate call: per-request calibration of the pass's candidate trees (edges calibrated
by kind, :mod:`peagle.decode.harness.calibration`), the verified budget, the next pass's depth, and trees against
chains (the planner :class:`peagle.decode.drafting.PEagleDrafting` asks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.decode.harness.budget import select_widest, tree_width, verified_tree_counts, widest
from peagle.decode.harness.policy import EXPLORE_EVERY, MAX_EXPLORE_EVERY, CallHarness, HarnessPolicy, TreeLearning
from peagle.ops import TreeSpec, harness_pass_decide, tree_select

__all__ = ["CANDIDATES_PER_VERIFIED", "PATH_SCALE_DECAY", "PassHarness"]

# ... of the P-EAGLE harness's per-request scale of its edge-calibrated path scores (about the last 2 rounds: the
# shared edge table knows the drafter, the scale follows how hard the request's text is right now; on the demo's
# recorded trees 0.3-0.5 did best, 0.9 lost 1%, and in the simulation 0.9 lost up to 4% to 0.5).
PATH_SCALE_DECAY = 0.5
CANDIDATES_PER_VERIFIED = 2  # a P-EAGLE candidate tree's nodes per node a round may verify


class PassHarness(CallHarness):
    """The P-EAGLE harness over one generate call: per-request calibration, the next pass's depth K and the budgets.

    Per round: :meth:`select` turns the pass's candidate tree (``topk`` children per node at every depth, at most
    ``max_nodes`` kept by score) into the verified tree, and :meth:`observe` folds the verified acceptance into the
    calibration. Sampled rounds draft a chain whose length :meth:`observe` fixed after the previous round, from the
    observed acceptance rate (see the module doc), and verify it whole.
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
        table = policy.table
        self.draft_vocab, self.max_depth = draft_vocab, max_depth
        self.pass_time = torch.tensor(
            [table.pass_time(batch, k) for k in range(1, max_depth + 1)], dtype=torch.float64, device=device
        )
        self.verify_cost = self.plan.verify_cost.to(device)
        # What an edge of a candidate tree is worth (:mod:`peagle.decode.harness.calibration`), learnt by earlier calls,
        # and per request the op's scale of those path scores (decayed sums of accepted and predicted drafts, from 0:
        # how hard this request's text is, which the shared edge table learns too slowly).
        self.edges = policy.learnt_edges.to(device)
        self.calibration = torch.zeros(batch, 2, dtype=torch.float64, device=device)
        # (q, kind, path) of the nodes of the trees under verification (EdgeCalibration.scores).
        self.verified: tuple[Tensor, Tensor, Tensor] | None = None
        self._index_cache: dict[torch.Size, Tensor] = {}
        # The candidate tree keeps the best nodes by raw path score before the edge calibration scores them: at the
        # verify limit itself, a flat drafter's deep chain nodes lose their places to shallow siblings (on the demo's
        # recorded trees, budgets from 32 candidates emitted 3.5% fewer tokens per second than from 64 or all 124).
        self.candidates = CANDIDATES_PER_VERIFIED * self.max_nodes
        self.next_depth = torch.full((batch,), max_depth, dtype=torch.long, device=device)
        learnt = policy.learnt_trees.get(self.key, TreeLearning())
        # What tree rounds gained over chains: accepted drafts from where a path left the top-1 chain on, and the
        # verify seconds their trees cost beyond a chain of the pass depth (:meth:`topk`).
        self.siblings = list(learnt.siblings)
        # Tokens emitted and batched rounds (greedy), from earlier calls on: the first rounds of a generation alone
        # would understate a chain round's tokens per second.
        self.emitted = list(learnt.emitted)
        self.pass_s = self.pass_time.tolist()  # host copy
        self.explore_every, self.since_tree = learnt.explore_every, 0
        self.chain_round = False  # this round's candidates form a chain (set by topk)
        self.exploring = False  # ... or a tree drafted only to look for accepted drafts off the chain

    def depth(self, rows: Tensor) -> int:
        """The pass depth K of a round of ``rows`` (the deepest any of them wants; one host read)."""
        return max(self._of(rows, self.next_depth).tolist())

    def _of(self, rows: Tensor, values: Tensor) -> Tensor:
        """``values[rows]``: the per-request tensor itself when ``rows`` holds every request (ascending, distinct:
        then it is arange(batch)), which spares a batch-1 round its gathers."""
        return values if rows.numel() == values.shape[0] else values[rows]

    def _set(self, rows: Tensor, name: str, new: Tensor) -> None:
        """Per-request tensor ``name``: ``[rows] = new`` in place, or ``new`` itself when ``rows`` holds every request
        (no copy)."""
        values = getattr(self, name)
        if rows.numel() == values.shape[0]:
            setattr(self, name, new)
        else:
            values[rows] = new

    def topk(self, depth: int, sampled: bool = False) -> list[int]:
        """Children per candidate node: the plan's top-k at the root, then 2 (a tree) or 1 (a chain) per depth; a
        chain when the round's drafts are ``sampled``.

        A tree plan drafts trees while what they gained pays for what they cost: the accepted drafts from where a
        path left the top-1 chain on (plus a prior of one), per second that tree rounds took beyond chain rounds,
        must beat the tokens per second of a chain round (the tokens per round observed so far, earlier calls
        included, over a chain round's seconds). Once both kinds of round have been timed (:meth:`timed`), those
        seconds are the measured ones, every cost of a round included (a tree's wider pass, its layout and
        bookkeeping, not only its verify); before that, the cost table's verify time of the trees beyond chains of the
        same pass depth and its time of a chain round. Budgets come from calibrated path scores, and a drafter whose
        siblings score far above how often they are accepted would otherwise verify wide trees for nothing.
        While trees pay, a chain round is drafted whenever fewer than 1 in EXPLORE_EVERY of the timed rounds were
        chains, so that both kinds are timed (never where no round is timed: the simulation). Otherwise it
        drafts chains, and every ``explore_every``-th round still drafts the tree, so a change is noticed; that
        interval starts at EXPLORE_EVERY, doubles after each exploring round whose accepted drafts all
        stayed on the chain (up to MAX_EXPLORE_EVERY) and starts over when one left it (:meth:`observe`)."""
        self.sampled = sampled
        if sampled:
            self.chain_round, self.exploring, self.round_kind = True, False, "chain"
            return [1] * depth
        self.since_tree += 1
        gain, cost = self.siblings
        tokens, rounds = self.emitted
        tree_times, chain_times = self.timing["tree"], self.timing["chain"]
        chain_round_s = self._chain_seconds(depth)
        if tree_times.rounds and chain_times.rounds:
            chain_round_s = chain_times.seconds / chain_times.rounds
            cost = max(0.0, tree_times.seconds - tree_times.rounds * chain_round_s)
        chain_rate = (tokens / rounds if rounds else 1.0 + depth) / chain_round_s
        on_chain = (gain + 1.0) < chain_rate * cost
        if on_chain:
            chain = self.since_tree < self.explore_every
        else:  # timed chain rounds are kept at 1 in EXPLORE_EVERY timed rounds, so both kinds' times stay known
            chain = chain_times.rounds * EXPLORE_EVERY < tree_times.rounds
        self.exploring = on_chain and not chain
        if not chain:
            self.since_tree = 0
        top = 1 if chain else self.plan.topk
        deeper = min(2, top)
        self.chain_round = top == 1 or self.draft_vocab == 1 or depth == 0
        self.round_kind = "chain" if self.chain_round else "tree"
        return [min(k, self.draft_vocab) for k in [top] + [deeper] * (depth - 1)]

    def _chain_seconds(self, depth: int) -> float:
        """The cost table's seconds of a round that drafts and verifies a chain of ``depth``."""
        return self._round_seconds(depth, depth + 1)

    def _round_seconds(self, depth: int, width: int) -> float:
        """The cost table's seconds of a round whose pass drafted ``depth`` depths and whose trees have ``width``
        slots."""
        return self.pass_s[max(depth, 1) - 1] + self.verify_seconds(width)

    def select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec:
        tree = self._select(rows, spec, depth, sampled)
        self.predicted_s = self._round_seconds(depth, tree.tokens.shape[1])
        return tree

    def _select(self, rows: Tensor, spec: TreeSpec, depth: int, sampled: bool) -> TreeSpec:
        self.verified = None
        if sampled:  # a chain whose length, fixed after the previous round, is the pass depth: verify it whole
            width = tree_width(spec.num_nodes, spec.tokens.shape[1], self.max_nodes)
            return tree_select(spec.tokens, spec.parent, spec.scores, spec.num_nodes, width)
        scores, q, kind = self.edges.scores(spec)
        overhead = self.overhead.seconds  # paid once per round, whatever its depth: part of every depth's pass time
        pass_time = self.pass_time + overhead if overhead > 0 else self.pass_time
        calibration = self._of(rows, self.calibration)
        budget, next_depth, _ = harness_pass_decide(
            scores, spec.depth, spec.num_nodes, calibration, pass_time, self.verify_cost, depth
        )
        # At least one draft: a round that verifies none teaches the calibration nothing.
        floored = torch.maximum(budget, torch.clamp(spec.num_nodes, max=2))
        use = widest(floored, spec.num_nodes)  # every request verifies up to the widest budget of its best nodes
        # Selected with each candidate's index for a token, so that the verified nodes' own tokens, q and kinds follow.
        numbered = spec._replace(tokens=self._candidate_index(spec.tokens), scores=scores)
        if self.chain_round:  # a chain's best n nodes are its first n: tree_select lays them out as they are
            width = tree_width(use, spec.tokens.shape[1], self.max_nodes)
            tree = tree_select(numbered.tokens, spec.parent, scores, use, width)
        else:
            tree = select_widest(numbered, use, self.max_nodes)
            # The target verifies every slot: what this tree costs beyond a chain of the pass depth.
            self.siblings[1] += max(0.0, self.verify_seconds(tree.tokens.shape[1]) - self.verify_seconds(depth + 1))
        source = tree.tokens.clamp(min=0)
        drafted = tree.tokens > 0  # the root is candidate 0, padding -1
        self.verified = (q.gather(1, source), torch.where(drafted, kind.gather(1, source), -1), tree.scores)
        self._set(rows, "next_depth", next_depth)
        return tree._replace(tokens=torch.where(drafted, spec.tokens.gather(1, source), -1))

    def _candidate_index(self, tokens: Tensor) -> Tensor:
        """[B, N] each candidate's index (kept per shape: the rounds of a call repeat few shapes)."""
        index = self._index_cache.get(tokens.shape)
        if index is None:
            index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()
            self._index_cache[tokens.shape] = index
        return index

    def observe(
        self,
        rows: Tensor,
        num_accepted: Tensor,
        num_nodes: Tensor | None = None,
        parent: Tensor | None = None,
        accepted_path: Tensor | None = None,
        host: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Folds the verified acceptance of ``rows`` into the edge calibration (given the verified trees' ``parent``
        and the ``accepted_path``); after a tree round, also counts what the tree gained over a chain (the accepted
        drafts from the first one that was not its parent's first child on). After a sampled round: only the chain
        acceptance rate, and the next chain length from it. Every round with ``num_nodes`` or the trees also counts
        into the acceptance rate that decides whether speculating still pays. ``host``: the requests' accepted drafts
        and verified node counts as the engine read them back (chain rounds then count on the host)."""
        tree_known = parent is not None and accepted_path is not None
        gained = 0
        if host is not None and self.chain_round:
            accepted = self.chain_acceptance.observe(num_accepted, num_nodes, host=host)
        elif tree_known:
            accepted, rejections, gained = verified_tree_counts(parent, accepted_path, num_accepted, num_nodes)
            self.chain_acceptance.count(accepted, rejections)
        elif num_nodes is not None:
            accepted = self.chain_acceptance.observe(num_accepted, num_nodes)
        else:
            accepted = float(num_accepted.sum())
        if self.sampled:
            rate = self.chain_acceptance.rate
            length = self.policy.chain_length(self.batch, self.context, rate, sampled=True)
            self.next_depth.fill_(min(max(1, length), self.max_depth))
            return
        self.emitted[0] += accepted + rows.numel()
        self.emitted[1] += 1
        if tree_known and not self.chain_round:  # a chain would have stopped where the path left it
            self.siblings[0] += gained
            if self.exploring:
                found = gained > 0
                self.explore_every = EXPLORE_EVERY if found else min(2 * self.explore_every, MAX_EXPLORE_EVERY)
        if self.verified is not None and tree_known:
            if parent.shape != self.verified[1].shape:
                raise ValueError(
                    f"PassHarness.observe: parent must be that of the trees select returned, [B, N] = "
                    f"{list(self.verified[1].shape)}, got {list(parent.shape)}"
                )
            self.edges.observe(
                self.calibration, self.verified, parent, accepted_path, num_accepted, rows, PATH_SCALE_DECAY
            )

    def finish(self) -> None:
        """Hands what this call learnt to the policy (the next call starts from it)."""
        super().finish()
        self.policy.learnt_edges = self.edges.to("cpu")
        self.policy.learnt_trees[self.key] = TreeLearning(tuple(self.siblings), tuple(self.emitted), self.explore_every)
