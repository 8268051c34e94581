"""Speculative decoding on Hugging Face targets: the round loop (engine) and the policies it asks (rounds), the target
runner over a paged KV cache, P-EAGLE / EAGLE-3 drafting (chains, parallel trees, EAGLE-2 dynamic trees), the
cost-aware harness, sampling, and the GDN state of hybrid targets."""

from peagle.decode.drafting import DraftTree, eagle2_dynamic_tree
from peagle.decode.engine import SpeculativeDecoder
from peagle.decode.hybrid import GdnStates
from peagle.decode.kv_cache import PagedKVCache
from peagle.decode.metrics import GenerateMetrics, GenerateOutput, RequestStats
from peagle.decode.rounds import CallReport, RoundPolicies, RoundPolicy
from peagle.decode.sampling import target_probs
from peagle.decode.target import TargetRunner

__all__ = [
    "CallReport",
    "DraftTree",
    "GdnStates",
    "GenerateMetrics",
    "GenerateOutput",
    "PagedKVCache",
    "RequestStats",
    "RoundPolicies",
    "RoundPolicy",
    "SpeculativeDecoder",
    "TargetRunner",
    "eagle2_dynamic_tree",
    "target_probs",
]
