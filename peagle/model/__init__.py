"""The P-EAGLE drafter (EAGLE-3 autoregressive as the K = 1 case), its config and speculators-format checkpoints, and
loading the target it drafts for."""

from peagle.model.checkpoint import from_pretrained, load_state_dict, save_pretrained, warm_start
from peagle.model.config import DrafterConfig, default_aux_layer_ids
from peagle.model.drafter import DraftOutput, PEagleDrafter
from peagle.model.target import SUPPORTED_MODEL_TYPES, check_context, context_limit, load_target, load_target_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DraftOutput",
    "DrafterConfig",
    "PEagleDrafter",
    "check_context",
    "context_limit",
    "default_aux_layer_ids",
    "from_pretrained",
    "load_state_dict",
    "load_target",
    "load_target_model",
    "save_pretrained",
    "warm_start",
]
