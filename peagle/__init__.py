"""peagle: parallel-drafting (P-EAGLE) speculative decoding toolkit.

Importing peagle loads the compiled core (``peagle._C``), which registers every op under ``torch.ops.peagle``; the
typed Python API lives in :mod:`peagle.ops`.
"""

import torch  # noqa: F401  (torch must be loaded before the extension that links against it)

from peagle import _C  # noqa: F401
from peagle import ops

__version__ = "0.1.0"
__all__ = ["__version__", "ops"]
