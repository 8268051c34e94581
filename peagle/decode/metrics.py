"""What a generate call returns: the new tokens of every request, each request's figures and the call's metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["GenerateMetrics", "GenerateOutput", "RequestStats", "conditional_acceptance"]


@dataclass
class RequestStats:
    """One request's figures. A round is one target forward after prefill (prefill's first token is not counted)."""

    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "eos" or "length"
    accepted: list[int]  # accepted drafts of each round (the verifier emitted one token more)
    max_depth: int  # the deepest draft position of the configuration

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def emitted(self) -> int:
        """Tokens the verifier emitted over the rounds, before truncation at EOS / max_new_tokens."""
        return sum(self.accepted) + len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        """P(draft position d accepted | positions < d accepted), d = 1 .. max_depth."""
        return conditional_acceptance(self.accepted, self.max_depth)


@dataclass
class GenerateMetrics:
    """Figures over all requests of a generate call (times in seconds, wall clock)."""

    new_tokens: int
    rounds: int  # batched target forwards after prefill
    request_rounds: int  # sum over requests of their rounds
    acceptance_length: float  # tokens emitted per target forward of a request
    conditional_acceptance: list[float]  # P(position d accepted | positions < d accepted), d = 1 ..
    prefill_s: float
    draft_s: float
    verify_s: float  # target forward + verification
    other_s: float  # commit, read-back, bookkeeping
    total_s: float
    tokens_per_s: float  # new tokens / total_s
    # How EAGLE-3 harness rounds ran their depth steps (DepthStepper mode: "device" = CUDA graphs chained on the
    # device, "host" = the host loop; a fallback to the host loop on a GPU says why in parentheses); "" if none ran.
    depth_chain: str = ""
    # Batched rounds that drafted: all of them, except under mode "harness" once the observed acceptance or speed said
    # that speculation loses (plain decoding from there on), or none when the cost table or earlier calls said so, or
    # the plain phase of a paired call (a quarter of a control's tokens, three quarters of a probe's, timed to weigh
    # drafting against).
    drafted_rounds: int = 0
    # How mode "harness" started the call (HarnessPolicy.start_call): "draft", "plain", or a paired call: "probe"
    # (after calls that found speculation did not pay) or "control" (while it pays); "" in the other modes.
    harness_call: str = ""


@dataclass
class GenerateOutput:
    tokens: list[list[int]]  # new tokens per request (EOS included when it stopped the request)
    requests: list[RequestStats]
    metrics: GenerateMetrics


def conditional_acceptance(accepted: Sequence[int], depth: int) -> list[float]:
    counts = torch.bincount(torch.tensor(accepted, dtype=torch.long), minlength=depth + 1)[: depth + 1]
    reached = counts.flip(0).cumsum(0).flip(0).tolist()  # reached[d]: rounds with >= d accepted drafts
    return [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, depth + 1)]
