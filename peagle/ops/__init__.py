"""The thin Python API over ``torch.ops.peagle``: typed wrappers, fake kernels, autograd and PyTorch references."""

from peagle.ops.cod import (
    CodInputs,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
)
from peagle.ops.tree import (
    TreeSpec,
    TreeVerifyOutput,
    eagle2_dynamic_tree,
    philox_uniforms,
    tree_build_parallel,
    tree_build_parallel_reference,
    tree_expand_topk,
    tree_expand_topk_reference,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_select,
    tree_select_reference,
    tree_verify_greedy,
    tree_verify_greedy_reference,
)

__all__ = [
    "CodInputs",
    "TreeSpec",
    "TreeVerifyOutput",
    "cod_gather",
    "cod_gather_reference",
    "cod_sample",
    "cod_sample_reference",
    "eagle2_dynamic_tree",
    "philox_uniforms",
    "tree_build_parallel",
    "tree_build_parallel_reference",
    "tree_expand_topk",
    "tree_expand_topk_reference",
    "tree_rejection_sample",
    "tree_rejection_sample_reference",
    "tree_select",
    "tree_select_reference",
    "tree_verify_greedy",
    "tree_verify_greedy_reference",
]
