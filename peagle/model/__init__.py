"""The P-EAGLE drafter (EAGLE-3 autoregressive as the K = 1 case), its config and speculators-format checkpoints."""

from peagle.model.checkpoint import from_pretrained, load_state_dict, save_pretrained, warm_start
from peagle.model.config import DrafterConfig, default_aux_layer_ids
from peagle.model.drafter import DraftOutput, PEagleDrafter

__all__ = [
    "DraftOutput",
    "DrafterConfig",
    "PEagleDrafter",
    "default_aux_layer_ids",
    "from_pretrained",
    "load_state_dict",
    "save_pretrained",
    "warm_start",
]
