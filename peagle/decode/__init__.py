"""Speculative decoding on Hugging Face targets: tree verification through hybrid (attention + GDN) targets."""

from peagle.decode.hybrid import HybridTreeCache, hybrid_prefill, hybrid_tree_commit, hybrid_tree_forward

__all__ = ["HybridTreeCache", "hybrid_prefill", "hybrid_tree_commit", "hybrid_tree_forward"]
