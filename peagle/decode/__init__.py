"""Speculative decoding on Hugging Face targets: drafting policy (draft trees from a drafter) and tree verification
through hybrid (attention + GDN) targets."""

from peagle.decode.drafting import eagle2_dynamic_tree
from peagle.decode.hybrid import HybridTreeCache, hybrid_prefill, hybrid_tree_commit, hybrid_tree_forward

__all__ = ["HybridTreeCache", "eagle2_dynamic_tree", "hybrid_prefill", "hybrid_tree_commit", "hybrid_tree_forward"]
