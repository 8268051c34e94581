"""The thin Python API over ``torch.ops.peagle``: typed wrappers, fake kernels, autograd and PyTorch references."""

from peagle.ops.cod import (
    CodInputs,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
)
from peagle.ops.tree import (
    TreeVerifyOutput,
    philox_uniforms,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_verify_greedy,
    tree_verify_greedy_reference,
)

__all__ = [
    "CodInputs",
    "TreeVerifyOutput",
    "cod_gather",
    "cod_gather_reference",
    "cod_sample",
    "cod_sample_reference",
    "philox_uniforms",
    "tree_rejection_sample",
    "tree_rejection_sample_reference",
    "tree_verify_greedy",
    "tree_verify_greedy_reference",
]
