"""The thin Python API over ``torch.ops.peagle``: typed wrappers, fake kernels, autograd and PyTorch references."""

from peagle.ops.cod import (
    CodInputs,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
)
from peagle.ops.mask import (
    BlockMaskBuilder,
    MaskBlocks,
    block_kinds,
    block_kinds_from_predicate,
    build_block_mask,
    make_mask_mod,
    mask_block,
    mask_block_reference,
    mask_dense,
    mask_dense_reference,
)

__all__ = [
    "BlockMaskBuilder",
    "CodInputs",
    "MaskBlocks",
    "block_kinds",
    "block_kinds_from_predicate",
    "build_block_mask",
    "cod_gather",
    "cod_gather_reference",
    "cod_sample",
    "cod_sample_reference",
    "make_mask_mod",
    "mask_block",
    "mask_block_reference",
    "mask_dense",
    "mask_dense_reference",
]
