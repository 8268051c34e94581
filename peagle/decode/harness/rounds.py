"""The harness as the round loop sees it: :class:`HarnessCalls` gives each generate call a :class:`HarnessRounds`
(a :class:`peagle.decode.rounds.RoundPolicy`) over the call's :class:`PassHarness` (P-EAGLE) or
:class:`DepthHarness` (EAGLE-3). The state machine of a call lives here: whether it drafts at all (the cost table's
plan, what earlier calls found), the phases of a paired call (drafting, then plain decoding, or the other way round),
and stopping for the rest of the call once what it observed and timed says drafting loses.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from peagle.decode.drafting import CachedDrafter, DraftTree
from peagle.decode.harness.cost import CostTable
from peagle.decode.harness.depth_harness import DepthHarness
from peagle.decode.harness.pass_harness import PassHarness
from peagle.decode.harness.policy import HarnessPolicy
from peagle.decode.rounds import CallReport, FixedRounds
from peagle.ops import TreeVerifyOutput

__all__ = ["DEFAULT_MAX_NODES", "HarnessCalls", "HarnessRounds"]

DEFAULT_MAX_NODES = 32  # the most nodes a harness round verifies unless num_nodes says otherwise


class HarnessRounds:
    """One generate call's rounds under the harness.

    A call the plan or earlier calls say should not speculate decodes plainly throughout (the drafter takes in
    nothing). A paired call drafts in one phase and decodes plainly in the other (:class:`CallHarness`): in a plain
    phase before the drafting one the drafter still takes in the tokens (it catches up in the first drafting round),
    after it the drafter is done. Any other call drafts until what it observed and timed says drafting loses; the
    harness then hands what it learnt to the policy and the call decodes plainly to its end.
    """

    def __init__(self, harness: PassHarness | DepthHarness) -> None:
        self.call_start = harness.call_start
        # The cost table's plan, or earlier calls: speculation loses at this batch size (nothing to learn either).
        self._harness: PassHarness | DepthHarness | None = harness if harness.speculate else None
        self.feeds_drafter = self._harness is not None
        self._depth_chain = ""

    @property
    def drafts(self) -> bool:
        return self.feeds_drafter and self._harness.drafting_phase

    @property
    def planner(self) -> PassHarness | DepthHarness | None:
        return self._harness if self.drafts else None

    def observe(
        self, rows: Tensor, tree: DraftTree, result: TreeVerifyOutput, accepted: list[int], nodes: list[int]
    ) -> None:
        self._harness.observe(
            rows, result.num_accepted, tree.num_nodes, tree.parent, result.accepted_path, (accepted, nodes)
        )

    def end_round(self, seconds: float, tokens: int, live: int, emitted_share: float) -> None:
        harness = self._harness
        if harness is None:
            return
        harness.timed(seconds, tokens, live)
        if harness.paired and harness.switch(emitted_share):
            if not harness.drafting_phase:  # a paired call's plain phase comes last: the drafter is done
                self.feeds_drafter = False
        elif self.feeds_drafter and not harness.speculate:  # what it observed and timed: drafting loses
            self._hand_over()

    def finish(self) -> CallReport:
        if self._harness is not None:
            self._hand_over()
        return CallReport(self.call_start, self._depth_chain)

    def _hand_over(self) -> None:
        """Hands the harness's learning to the policy and keeps its report; plain decoding from here on."""
        self._harness.finish()
        self._depth_chain = getattr(self._harness, "chain_report", "")
        self._harness, self.feeds_drafter = None, False


class HarnessCalls:
    """The harness's per-call policies of one decoder, over the :class:`HarnessPolicy` that carries what calls learn.
    ``chain_mode``: the :class:`DepthStepper` mode of EAGLE-3 harness rounds ("auto"; "host" forces the host loop on a
    GPU, for debugging)."""

    def __init__(self, policy: HarnessPolicy, chain_mode: str = "auto") -> None:
        self.policy, self.chain_mode = policy, chain_mode

    @classmethod
    def from_options(
        cls, cost_table: CostTable | str | os.PathLike | None, num_nodes: int | None, timed: bool
    ) -> HarnessCalls:
        """The decoder's arguments of mode "harness", checked: the cost table (or the JSON file ``peagle profile``
        wrote), the verify limit and whether rounds are timed."""
        if isinstance(cost_table, (str, os.PathLike)):
            cost_table = CostTable.load(cost_table)
        if not isinstance(cost_table, CostTable):
            raise ValueError(
                "mode 'harness' needs cost_table: a CostTable or the JSON file `peagle profile` wrote, "
                f"got {type(cost_table).__name__}"
            )
        if num_nodes is not None and (isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 2):
            raise ValueError(f"num_nodes must be an int >= 2 (the root and at least one draft), got {num_nodes!r}")
        return cls(HarnessPolicy(cost_table, DEFAULT_MAX_NODES if num_nodes is None else num_nodes, timed=timed))

    def start_call(
        self, drafting: CachedDrafter | None, batch: int, context: int, device: torch.device, sampled: bool
    ) -> HarnessRounds | FixedRounds:
        if drafting is None:
            return FixedRounds(False)
        kind = PassHarness if drafting.method == "peagle" else DepthHarness
        vocab = drafting.config.draft_vocab_size
        harness = kind(self.policy, batch, drafting.depth, context, vocab, device, sampled=sampled)
        if isinstance(harness, DepthHarness):
            harness.chain_mode = self.chain_mode
        return HarnessRounds(harness)
