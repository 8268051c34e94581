"""The thin Python API over ``torch.ops.peagle``: typed wrappers, fake kernels, autograd and PyTorch references."""

from peagle.ops.cod import (
    CodInputs,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
)
from peagle.ops.gdn import (
    GdnVerifyOutput,
    causal_conv1d_commit,
    causal_conv1d_commit_reference,
    causal_conv1d_tree,
    causal_conv1d_tree_reference,
    gdn_commit,
    gdn_commit_reference,
    gdn_recurrence_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
)

__all__ = [
    "CodInputs",
    "GdnVerifyOutput",
    "causal_conv1d_commit",
    "causal_conv1d_commit_reference",
    "causal_conv1d_tree",
    "causal_conv1d_tree_reference",
    "cod_gather",
    "cod_gather_reference",
    "cod_sample",
    "cod_sample_reference",
    "gdn_commit",
    "gdn_commit_reference",
    "gdn_recurrence_reference",
    "gdn_tree_verify",
    "gdn_tree_verify_reference",
]
