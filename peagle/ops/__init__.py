"""The thin Python API over ``torch.ops.peagle``: typed wrappers, fake kernels, autograd and PyTorch references."""

from peagle.ops.cod import (
    CodInputs,
    cod_gather,
    cod_gather_reference,
    cod_sample,
    cod_sample_reference,
)

__all__ = [
    "CodInputs",
    "cod_gather",
    "cod_gather_reference",
    "cod_sample",
    "cod_sample_reference",
]
