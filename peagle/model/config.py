"""Drafter configuration and its speculators-format ``config.json`` (what vLLM reads to serve the checkpoint)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["OPTIONS_KEY", "DrafterConfig", "default_aux_layer_ids"]

SPECULATORS_VERSION = "0.9.0"
# peagle's extension of the speculators config: the EAGLE-4 drafter options (README, "Drafter options"). vLLM cannot
# serve a drafter that has it; peagle's engine can.
OPTIONS_KEY = "peagle_drafter_options"


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """Early, middle and late target layers (vLLM's EAGLE-3 default), clamped into [1, L]."""
    ids = [2, num_target_layers // 2, num_target_layers - 3]
    return [min(max(i, 1), num_target_layers) for i in ids]


@dataclass
class DrafterConfig:
    """Shape and options of a P-EAGLE drafter (K = ``num_depths`` = 1 is an EAGLE-3 autoregressive drafter).

    ``hidden_size`` is the target's hidden size (the drafter works at the target's width, as EAGLE-3 does);
    ``vocab_size`` is the target vocabulary; ``draft_vocab_size`` (if smaller) uses a d2t / t2d draft vocabulary.
    """

    hidden_size: int
    vocab_size: int
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int | None = None  # default 4 x hidden_size
    layer_style: Literal["llama", "qwen3"] = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    draft_vocab_size: int | None = None
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 16, 29])
    mask_token_id: int = 0
    num_depths: int = 8
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    tie_word_embeddings: bool = False
    # EAGLE-4 options (all off by default; written to config.json under OPTIONS_KEY only when one is on).
    eh_proj: bool = False  # pre-attention norms, then a 2H -> H projection of [embedding, fc output]
    nope: bool = False  # no rotary position encoding in the decoder layers
    sliding_window: int | None = None  # attend to the last W positions
    moe_num_experts: int = 0  # mixture-of-experts MLP with E experts (0 = the dense MLP)
    moe_top_k: int = 2  # experts per element
    efficient_lm_head_rank: int = 0  # rank r of the low-rank scoring head (0 = the full LM head only)
    efficient_lm_head_candidates: int = 128  # C candidates the full head rescores

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        errors = []
        if self.layer_style not in ("llama", "qwen3"):
            errors.append(f"layer_style must be 'llama' or 'qwen3', got {self.layer_style!r}")
        if self.num_layers < 1:
            errors.append(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            errors.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            errors.append(f"head_dim must be even (rotary), got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            errors.append(f"mask_token_id must be in [0, vocab_size = {self.vocab_size}), got {self.mask_token_id}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            errors.append(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_depths < 1:
            errors.append(f"num_depths must be >= 1, got {self.num_depths}")
        if self.norm_before_fc and self.fc_norm:
            errors.append("norm_before_fc and fc_norm are mutually exclusive")
        if len(self.aux_layer_ids) < 1:
            errors.append("aux_layer_ids must name at least one target layer")
        errors += self._option_errors()
        if errors:
            raise ValueError("invalid DrafterConfig: " + "; ".join(errors))

    def _option_errors(self) -> list[str]:
        errors = []
        if self.sliding_window is not None and self.sliding_window < 1:
            errors.append(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.moe_num_experts < 0:
            errors.append(f"moe_num_experts must be >= 0 (0 = dense MLP), got {self.moe_num_experts}")
        if self.moe and not 1 <= self.moe_top_k <= self.moe_num_experts:
            errors.append(f"moe_top_k must be in [1, moe_num_experts = {self.moe_num_experts}], got {self.moe_top_k}")
        if not 0 <= self.efficient_lm_head_rank <= self.hidden_size:
            errors.append(
                f"efficient_lm_head_rank must be in [0, hidden_size = {self.hidden_size}], got "
                f"{self.efficient_lm_head_rank}"
            )
        if self.efficient_lm_head and not 1 <= self.efficient_lm_head_candidates <= self.draft_vocab_size:
            errors.append(
                f"efficient_lm_head_candidates must be in [1, draft_vocab_size = {self.draft_vocab_size}], got "
                f"{self.efficient_lm_head_candidates}"
            )
        return errors

    @property
    def moe(self) -> bool:
        return self.moe_num_experts > 0

    @property
    def efficient_lm_head(self) -> bool:
        return self.efficient_lm_head_rank > 0

    def options_dict(self) -> dict[str, Any]:
        """The EAGLE-4 options that are on, as written under ``OPTIONS_KEY`` in config.json (empty: none on)."""
        options: dict[str, Any] = {}
        if self.eh_proj:
            options["eh_proj"] = True
        if self.nope:
            options["nope"] = True
        if self.sliding_window is not None:
            options["sliding_window"] = self.sliding_window
        if self.moe:
            options["moe"] = {"num_experts": self.moe_num_experts, "top_k": self.moe_top_k}
        if self.efficient_lm_head:
            options["efficient_lm_head"] = {
                "rank": self.efficient_lm_head_rank,
                "num_candidates": self.efficient_lm_head_candidates,
            }
        return options

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    # -----------------------------------------------------------------------------------------------------------------
    # speculators format

    def transformer_layer_config(self) -> dict[str, Any]:
        """The Hugging Face layer config (``LlamaConfig`` / ``Qwen3Config`` fields) vLLM builds the layers from."""
        arch = "LlamaForCausalLM" if self.layer_style == "llama" else "Qwen3ForCausalLM"
        return {
            "model_type": self.layer_style,
            "architectures": [arch],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    def to_speculators_dict(self) -> dict[str, Any]:
        """``config.json`` content in the speculators 0.9 ``peagle`` format."""
        return {
            "architectures": ["PEagleSpeculator"],
            "speculators_model_type": "peagle",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "peagle",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_depths}],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier_name_or_path,
                    "architectures": list(self.verifier_architectures),
                },
            },
            "transformer_layer_config": self.transformer_layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "embed_requires_grad": True,
            "torch_dtype": "float32",
        } | ({OPTIONS_KEY: options} if (options := self.options_dict()) else {})

    @classmethod
    def from_speculators_dict(cls, config: dict[str, Any]) -> DrafterConfig:
        """Parses a speculators ``peagle`` (or ``eagle3``, giving K from its proposal) config.json."""
        kind = config.get("speculators_model_type")
        if kind not in ("peagle", "eagle3"):
            raise ValueError(f"not a P-EAGLE / EAGLE-3 speculators config: speculators_model_type = {kind!r}")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError("config.json has no transformer_layer_config")
        style = layer.get("model_type", "llama")
        if style not in ("llama", "qwen3"):
            raise ValueError(f"unsupported transformer_layer_config.model_type {style!r} (llama or qwen3)")
        heads = layer["num_attention_heads"]
        hidden = layer["hidden_size"]
        rope = layer.get("rope_parameters") or {}
        spec = config.get("speculators_config") or {}
        proposals = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        if layer.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError("only default rotary embeddings are supported")
        aux = config.get("eagle_aux_hidden_state_layer_ids") or [2, layer["num_hidden_layers"] // 2, 1]
        return cls(
            hidden_size=hidden,
            vocab_size=layer["vocab_size"],
            num_layers=layer["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            intermediate_size=layer["intermediate_size"],
            layer_style=style,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
            max_position_embeddings=layer.get("max_position_embeddings", 32768),
            attention_bias=layer.get("attention_bias", False),
            draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
            aux_layer_ids=list(aux),
            mask_token_id=config.get("mask_token_id") or 0,
            num_depths=proposals[0].get("speculative_tokens", 1),
            norm_before_residual=config.get("norm_before_residual", False),
            norm_before_fc=config.get("norm_before_fc", False),
            fc_norm=config.get("fc_norm", False),
            norm_output=config.get("norm_output", False),
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=list(verifier.get("architectures") or []),
            tie_word_embeddings=layer.get("tie_word_embeddings", False),
            **_options_from_dict(config.get(OPTIONS_KEY) or {}),
        )

    @classmethod
    def from_manifest(
        cls,
        manifest: dict[str, Any],
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        layer_style: Literal["llama", "qwen3"] | None = None,
        **options: Any,
    ) -> DrafterConfig:
        """A drafter for the target that an extracted-data manifest (``peagle extract``'s ``manifest.json``)
        describes: width, vocabulary, aux layers, norm epsilon and verifier come from the target; the attention shape,
        MLP width and layer style default to the target's; ``options`` are further fields (``num_layers``,
        ``num_depths``, ``mask_token_id``, ...)."""
        if manifest.get("kind") != "peagle-extracted":
            raise ValueError(
                f"manifest must be an extracted-data manifest (kind 'peagle-extracted'), got {manifest.get('kind')!r}"
            )
        model_type = str(manifest["target_model_type"])
        return cls(
            hidden_size=manifest["hidden_size"],
            vocab_size=manifest["vocab_size"],
            num_heads=num_heads or manifest["target_num_heads"],
            num_kv_heads=num_kv_heads or manifest["target_num_kv_heads"],
            head_dim=head_dim or manifest["target_head_dim"],
            intermediate_size=intermediate_size or manifest["target_intermediate_size"],
            layer_style=layer_style or ("qwen3" if model_type.startswith("qwen3") else "llama"),
            rms_norm_eps=manifest.get("target_rms_norm_eps", 1e-6),
            aux_layer_ids=manifest["aux_layer_ids"],
            verifier_name_or_path=manifest["target"],
            verifier_architectures=manifest.get("target_architectures") or [],
            **options,
        )

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)


def _options_from_dict(options: dict[str, Any]) -> dict[str, Any]:
    """DrafterConfig fields of a config.json's ``OPTIONS_KEY`` block (the inverse of ``options_dict``)."""
    known = {"eh_proj", "nope", "sliding_window", "moe", "efficient_lm_head"}
    if not isinstance(options, dict) or set(options) - known:
        raise ValueError(f"{OPTIONS_KEY} must be a dict with keys among {sorted(known)}, got {options!r}")
    fields: dict[str, Any] = {
        "eh_proj": bool(options.get("eh_proj", False)),
        "nope": bool(options.get("nope", False)),
        "sliding_window": options.get("sliding_window"),
    }
    if "moe" in options:
        fields["moe_num_experts"] = options["moe"]["num_experts"]
        fields["moe_top_k"] = options["moe"]["top_k"]
    if "efficient_lm_head" in options:
        fields["efficient_lm_head_rank"] = options["efficient_lm_head"]["rank"]
        fields["efficient_lm_head_candidates"] = options["efficient_lm_head"]["num_candidates"]
    return fields
