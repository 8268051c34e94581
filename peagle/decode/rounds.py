"""How a generate call's rounds draft, as the round loop sees it: a :class:`RoundPolicy`, which the loop asks before
each round (does it draft? does the drafter take in its tokens? what does drafting ask within it?) and tells after it
(what was verified and accepted; how long the round took). That is the loop's only door to a policy.

Fixed configurations (a chain, a tree, the target alone) draft every round alike: :class:`FixedRounds`. The cost-aware
harness decides per round and learns across calls: :class:`peagle.decode.harness.rounds.HarnessCalls`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from peagle.decode.drafting import CachedDrafter, DepthPlanner, DraftTree, PassPlanner
from peagle.ops import TreeVerifyOutput

__all__ = ["CallReport", "FixedCalls", "FixedRounds", "RoundPolicies", "RoundPolicy"]


class CallReport(NamedTuple):
    """What a policy reports of a finished generate call (:class:`peagle.decode.GenerateMetrics` carries it)."""

    harness_call: str = ""  # how the harness started the call ("draft", "plain", "probe", "control"); "" otherwise
    depth_chain: str = ""  # how EAGLE-3 harness rounds ran their depth steps ("device", "host", ...); "" if none ran


class RoundPolicy(Protocol):
    """One generate call's rounds, as the round loop asks and tells them."""

    @property
    def drafts(self) -> bool:
        """This round drafts a tree (False: the root alone, one token per request)."""

    @property
    def feeds_drafter(self) -> bool:
        """The drafter takes in this round's tokens: the call drafts in this round or in a later one."""

    @property
    def planner(self) -> PassPlanner | DepthPlanner | None:
        """What the drafting asks within a drafted round (its depth, widths and budget), or None: the drafting's own
        fixed configuration."""

    def observe(
        self, rows: Tensor, tree: DraftTree, result: TreeVerifyOutput, accepted: list[int], nodes: list[int]
    ) -> None:
        """After the verification of a drafted round: its trees, the verifier's result and, as read back once, each
        request's accepted drafts and verified nodes."""

    def end_round(self, seconds: float, tokens: int, live: int, emitted_share: float) -> None:
        """After the round's tokens reached the host: its wall time, the tokens it emitted, the requests it ran, and
        the share of the call's most tokens emitted so far."""

    def finish(self) -> CallReport:
        """The call is over (also where it ended early)."""


class RoundPolicies(Protocol):
    """A decoder's source of per-call policies."""

    def start_call(
        self, drafting: CachedDrafter | None, batch: int, context: int, device: torch.device, sampled: bool
    ) -> RoundPolicy:
        """The policy of a generate call of ``batch`` requests whose longest prompt is ``context`` tokens; ``sampled``:
        its drafts are drawn (temperature > 0 with Gumbel drafts)."""


class FixedRounds:
    """Every round drafts the decoder's configuration, or none without a drafter."""

    planner = None

    def __init__(self, drafts: bool) -> None:
        self.drafts = self.feeds_drafter = drafts

    def observe(
        self, rows: Tensor, tree: DraftTree, result: TreeVerifyOutput, accepted: list[int], nodes: list[int]
    ) -> None:
        pass

    def end_round(self, seconds: float, tokens: int, live: int, emitted_share: float) -> None:
        pass

    def finish(self) -> CallReport:
        return CallReport()


class FixedCalls:
    """The per-call policies of a fixed configuration (modes "chain" and "tree", or the target alone)."""

    def start_call(
        self, drafting: CachedDrafter | None, batch: int, context: int, device: torch.device, sampled: bool
    ) -> FixedRounds:
        return FixedRounds(drafting is not None)
