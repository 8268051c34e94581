"""The P-EAGLE drafter: EAGLE-3 body (fc over 3 target layers, 2H-wide first layer, Llama/Qwen3 layers, LM head) plus
a learnable ``mask_hidden`` and mask-token embedding for the parallel depths.

Two forwards share every weight:
- :meth:`PEagleDrafter.forward_train` runs N COD elements (anchor a, depth d) of one packed row under the P-EAGLE mask
  (dense boolean mask + SDPA on the CPU, flex attention + BlockMask on the GPU). ``fc`` runs on the T depth-0 rows and
  once on ``mask_hidden``; the fused COD gather then picks the projected rows of the elements.
- :meth:`PEagleDrafter.forward_inference` runs what a server runs: a prefix of real (token, hidden) pairs followed by
  d mask elements under a plain causal mask.
- :meth:`PEagleDrafter.forward_cached` runs a batch of new elements after their requests' cached keys/values under an
  explicit mask (the serving loop's pass; the cache itself is kept by ``peagle.decode``).
Parameter names follow the speculators / vLLM Eagle3 layout (fc, layers.i.*, norm, lm_head, embed_tokens,
mask_hidden, d2t, t2d), so a state dict is a servable checkpoint.

The EAGLE-4 options of :class:`DrafterConfig` (off by default) change the body in every forward alike: ``eh_proj``
(enorm, hnorm, eh_proj before a plain first layer), ``nope`` (no rotary), ``sliding_window`` (the mask ops' window in
training, :func:`window_visible` where a forward builds its own mask), ``moe`` (:class:`_MoE` plus
post_mlp_layernorm) and ``efficient_lm_head`` (lm_head_down / lm_head_up; :meth:`PEagleDrafter.head` serves through
the fused op in eval mode, training keeps the full head and returns the low-rank logits beside it).
"""

from __future__ import annotations

import itertools
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from peagle.model.config import DrafterConfig
from peagle.ops import BlockMaskBuilder, cod_gather, efficient_lm_head_full_logits, mask_dense

__all__ = [
    "DocumentBlocks",
    "DraftOutput",
    "PEagleDrafter",
    "RMSNorm",
    "document_blocks",
    "routing_balance",
    "window_visible",
]

Attention = Literal["sdpa", "sdpa-full", "flex"]


class DocumentBlocks(NamedTuple):
    """The P-EAGLE mask as one dense block per document (no element attends across documents, DESIGN's predicate).

    Elements are reordered by document (``order``); block g covers the contiguous rows bounds[g] .. bounds[g + 1]
    with its dense mask ``masks[g]``; rows from ``bounds[-1]`` on are padding (their attention output is zero).
    Attention work is the sum of the squared document sizes instead of N^2.
    """

    order: Tensor
    inverse: Tensor
    bounds: list[int]
    masks: list[Tensor]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, gqa: bool) -> Tensor:
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, enable_gqa=gqa
            )
            for (lo, hi), mask in zip(itertools.pairwise(self.bounds), self.masks, strict=True)
        ]
        tail = q.shape[2] - self.bounds[-1]
        if tail:
            outs.append(q.new_zeros(q.shape[0], q.shape[1], tail, v.shape[3]))
        return torch.cat(outs, dim=2)


def document_blocks(anchors: Tensor, depths: Tensor, document_ids: Tensor, window: int | None = None) -> DocumentBlocks:
    docs = document_ids.long()[anchors.long()]
    key = torch.where(docs < 0, torch.full_like(docs, torch.iinfo(torch.long).max), docs)
    key, order = torch.sort(key, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    valid = int((docs >= 0).sum())
    _, counts = torch.unique_consecutive(key[:valid], return_counts=True)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    a, d = anchors[order], depths[order]
    masks = [mask_dense(a[lo:hi], d[lo:hi], document_ids, window) for lo, hi in itertools.pairwise(bounds)]
    return DocumentBlocks(order, inverse, bounds, masks)


def window_visible(query_pos: Tensor, key_pos: Tensor, anchor_pos: Tensor, window: int | None) -> Tensor:
    """Which keys a query may see under the sliding window [..., n, m] (True everywhere without one): keys in the last
    W positions up to the query's, and its own chain from its anchor on (the P-EAGLE mask's rule: a mask element
    always sees its anchor and the mask elements before it). ``query_pos``/``anchor_pos`` [..., n], ``key_pos``
    [..., m]; causality is the caller's."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]
    if window is None:
        return torch.ones_like(q - k, dtype=torch.bool)
    return (k > q - window) | (k >= anchor_pos[..., :, None])


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (or float64), then scale in the input dtype: the Hugging Face / vLLM arithmetic.
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * work.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids.to(torch.float64)[:, None] * self.inv_freq.to(position_ids.device)[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class _SelfAttention(nn.Module):
    def __init__(self, config: DrafterConfig, in_width: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary = not config.nope
        if config.layer_style == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., heads, D], k, v [..., kv_heads, D] of rows x [..., in] (after q/k norms and rotary)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rotary:  # NoPE
            return q, k, v
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: object) -> Tensor:
        n = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        # [1, heads, N, head_dim]: SDPA's fused CPU kernel and flex attention both take this layout.
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        gqa = self.heads != self.kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, DocumentBlocks):
            out = mask.attend(q, k, v, gqa)
        elif isinstance(mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim))

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Batched rows x [B, n, in] after cached keys/values [B, C, kv_heads, D]; mask [B, n, C + n] bool.
        Returns the output [B, n, hidden] and the rows' own keys and values [B, n, kv_heads, D]."""
        batch, n = x.shape[:2]
        q, k, v = self.project(x, cos, sin)
        keys = torch.cat([past_k, k], dim=1).transpose(1, 2)
        values = torch.cat([past_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask[:, None], enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim)), k, v


_FLEX = None


def _flex_attention():
    """flex attention, compiled once on the GPU (eager flex materialises the scores; fine for CPU forward tests)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MoE(nn.Module):
    """Mixture-of-experts MLP: a router (``gate``) picks the top-k of E experts per element; their outputs are mixed
    with the renormalised router probabilities of the picked experts. The routing of the last forward is kept in
    ``routing`` (router probabilities [n, E] and picked experts [n, k]) for the load-balancing loss."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(_MLP(hidden, intermediate) for _ in range(num_experts))
        self.routing: tuple[Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).to(torch.promote_types(flat.dtype, torch.float32)), dim=-1)
        weight, picked = torch.topk(probs, self.top_k, dim=-1)
        weight = (weight / weight.sum(-1, keepdim=True)).to(flat.dtype)
        self.routing = (probs, picked)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(picked == e, as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weight[rows, slot, None])
        return out.view_as(x)


def routing_balance(probs: Tensor, picked: Tensor) -> tuple[Tensor, Tensor]:
    """Load-balancing loss E * sum_e f_e P_e (f_e: share of the routed slots that went to expert e, P_e: its mean
    router probability; 1 when balanced) and the load imbalance max_e f_e / mean_e f_e of one MoE layer's routing."""
    num_experts = probs.shape[-1]
    load = torch.bincount(picked.flatten(), minlength=num_experts).to(probs.dtype) / max(picked.numel(), 1)
    loss = num_experts * (load * probs.mean(0)).sum()
    return loss, load.max() * num_experts


class _DecoderLayer(nn.Module):
    """A Llama / Qwen3 decoder layer; the first one reads cat(norm(embedding), hidden_norm(fc output)) (2H wide)."""

    def __init__(self, config: DrafterConfig, first: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.first = first
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(hidden, eps)
        if first:
            self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = _SelfAttention(config, 2 * hidden if first else hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if config.moe:
            self.mlp = _MoE(hidden, config.intermediate_size, config.moe_num_experts, config.moe_top_k)
            self.post_mlp_layernorm = RMSNorm(hidden, eps)  # the extra norm after the MoE MLP
        else:
            self.mlp = _MLP(hidden, config.intermediate_size)
            self.post_mlp_layernorm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: object, embeds: Tensor | None = None) -> Tensor:
        return self._block(x, embeds, lambda h: self.self_attn(h, cos, sin, mask))

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor, embeds: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The layer on batched rows after cached keys/values (see ``_SelfAttention.forward_cached``); returns the
        output and the rows' keys and values."""
        new = []

        def attend(h: Tensor) -> Tensor:
            out, k, v = self.self_attn.forward_cached(h, cos, sin, past_k, past_v, mask)
            new.append((k, v))
            return out

        x = self._block(x, embeds, attend)
        return x, *new[0]

    def _block(self, x: Tensor, embeds: Tensor | None, attend) -> Tensor:
        if self.first:
            hidden = self.hidden_norm(x)
            residual = hidden if self.norm_before_residual else x
            attn_in = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        else:
            residual, attn_in = x, self.input_layernorm(x)
        x = residual + attend(attn_in)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (mlp if self.post_mlp_layernorm is None else self.post_mlp_layernorm(mlp))


class DraftOutput(NamedTuple):
    logits: Tensor  # [N, draft_vocab]
    label_index: Tensor  # [N] a + d: the row of the target distribution each element predicts
    position_ids: Tensor  # [N]
    # Training with the efficient LM head: the low-rank head's logits [N, draft_vocab] of the detached final states.
    low_rank_logits: Tensor | None = None


class PEagleDrafter(nn.Module):
    """The P-EAGLE drafter of ``config`` (see the module docstring)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        width = config.num_aux * hidden
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.input_norm = RMSNorm(width, eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(hidden, eps) for _ in range(config.num_aux)) if config.fc_norm else None
        self.fc = nn.Linear(width, hidden, bias=False)
        if config.eh_proj:  # pre-attention norms and the 2H -> H projection replace the 2H-wide first layer
            self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            _DecoderLayer(config, i == 0 and not config.eh_proj) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        if config.efficient_lm_head:  # D [r, H] and U [V, r] of the low-rank scoring head
            self.lm_head_down = nn.Linear(hidden, config.efficient_lm_head_rank, bias=False)
            self.lm_head_up = nn.Linear(config.efficient_lm_head_rank, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.rotary = _Rotary(config.head_dim, config.rope_theta)
        if config.uses_draft_vocab:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self._block_builder: BlockMaskBuilder | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        self.mask_hidden.normal_(std=std)
        if self.d2t is not None:
            # Identity-prefix draft vocabulary until a real one is loaded.
            self.d2t.zero_()
            self.t2d.zero_()
            self.t2d[: self.config.draft_vocab_size] = True

    def set_draft_vocab(self, draft_ids: Tensor) -> None:
        """Uses the sorted target token ids ``draft_ids`` [draft_vocab_size] as the draft vocabulary."""
        cfg = self.config
        if not cfg.uses_draft_vocab:
            raise ValueError("this drafter has no draft vocabulary (draft_vocab_size == vocab_size)")
        ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten()
        if ids.numel() != cfg.draft_vocab_size or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft_ids must be {cfg.draft_vocab_size} strictly increasing target ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise ValueError(f"draft_ids must lie in [0, {cfg.vocab_size})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_ids(self) -> Tensor:
        """Target token id of every draft-vocabulary entry [draft_vocab_size] (the identity without a draft vocab)."""
        if self.d2t is None:
            return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    # -----------------------------------------------------------------------------------------------------------------

    def project(self, hidden: Tensor) -> Tensor:
        """fc over target hidden states [..., num_aux * H] (with the optional EAGLE-3.1 norms) -> [..., H]."""
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            chunks = hidden.chunk(len(self.fc_norm), dim=-1)
            hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(hidden)

    def _layer_input(self, embeds: Tensor, feats: Tensor) -> Tensor:
        """The first layer's input: the fc output (the 2H-wide first layer reads the embeddings itself), or with
        ``eh_proj`` the projection of the normed [embedding, fc output]."""
        if not self.config.eh_proj:
            return feats
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feats)], dim=-1))

    def head(self, out: Tensor) -> Tensor:
        """Logits [..., draft_vocab] of final states [..., H]: the full LM head, or (eval mode, ``efficient_lm_head``)
        the fused efficient head: exact logits of the C candidates the low-rank head scores best, -inf elsewhere."""
        cfg = self.config
        if not cfg.efficient_lm_head or self.training:
            return self.lm_head(out)
        # The op takes float32 / bfloat16 / float16: a float64 drafter (tests) runs it in float32.
        work = torch.float32 if out.dtype == torch.float64 else out.dtype
        heads = (self.lm_head_down.weight, self.lm_head_up.weight, self.lm_head.weight)
        logits = efficient_lm_head_full_logits(
            out.reshape(-1, out.shape[-1]).to(work), *(w.to(work) for w in heads), cfg.efficient_lm_head_candidates
        )
        return logits.to(out.dtype).view(*out.shape[:-1], -1)

    def low_rank_logits(self, out: Tensor) -> Tensor:
        """The low-rank head's scores U (D out) [..., draft_vocab] (what the efficient head ranks candidates by)."""
        return self.lm_head_up(self.lm_head_down(out))

    @torch.no_grad()
    def init_efficient_lm_head(self, token_counts: Tensor | None = None) -> None:
        """D and U from a truncated SVD of the trained LM head W, its rows weighted by the tokens' frequencies: D =
        the top-r right singular vectors of diag(sqrt(f)) W, U = W D^T (the rank-r minimiser of sum_v f_v |W_v -
        U_v D|^2). ``token_counts`` [vocab_size] are the training data's target-token counts (None: uniform)."""
        cfg = self.config
        if not cfg.efficient_lm_head:
            raise ValueError("this drafter has no efficient LM head (efficient_lm_head_rank = 0)")
        weight = self.lm_head.weight.double()
        freq = torch.ones(weight.shape[0], dtype=torch.float64, device=weight.device)
        if token_counts is not None:
            counts = torch.as_tensor(token_counts, dtype=torch.float64, device=weight.device).flatten()
            if counts.numel() != cfg.vocab_size or bool((counts < 0).any()):
                raise ValueError(f"token_counts must be {cfg.vocab_size} counts >= 0, got {tuple(counts.shape)}")
            freq = counts[self.draft_ids()] + 1.0  # +1: tokens unseen in the data keep a little weight
        # The right singular vectors of diag(sqrt(f)) W are the eigenvectors of its [H, H] Gram matrix W^T diag(f) W
        # (cheap for a 150K-row head); eigh sorts ascending.
        _, vectors = torch.linalg.eigh(weight.T @ (freq[:, None] * weight))
        down = vectors[:, -cfg.efficient_lm_head_rank :].flip(1).T
        self.lm_head_down.weight.copy_(down)
        self.lm_head_up.weight.copy_(weight @ down.T)

    def _trunk(
        self, embeds: Tensor, feats: Tensor, position_ids: Tensor, mask: object, with_hidden: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        blocks = isinstance(mask, DocumentBlocks)
        if blocks:  # work in document order; back to element order at the end
            embeds, feats, position_ids = embeds[mask.order], feats[mask.order], position_ids[mask.order]
        if mask is None and self.config.sliding_window is not None:  # causal over the elements, windowed
            causal = torch.ones(feats.shape[0], feats.shape[0], dtype=torch.bool, device=feats.device).tril()
            mask = causal & window_visible(position_ids, position_ids, position_ids, self.config.sliding_window)
        cos, sin = self.rotary(position_ids, feats.dtype)
        x = self._layer_input(embeds, feats)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, embeds)
        out = self.norm(x)
        if blocks:
            out, x = out[mask.inverse], x[mask.inverse]
        if not with_hidden:
            return out
        # The hidden state an EAGLE-3 server feeds back to the next drafting step: the residual stream before the
        # final norm (vLLM's Eagle3 models return it beside the normed states), after it with norm_output.
        return out, out if self.config.norm_output else x

    def forward_train(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        anchors: Tensor,
        depths: Tensor,
        document_ids: Tensor,
        *,
        attention: Attention = "sdpa",
        mask: object | None = None,
        logit_rows: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> DraftOutput:
        """Logits of N COD elements of one packed row (or of several rows laid side by side, see ``positions``).

        Args:
            input_ids: [T] token x_{i+1} paired with hidden row i.
            hidden: [T, num_aux * H] target hidden states g_i.
            anchors, depths: [N] elements (e.g. from ``cod_sample``, or one segment of ``partition_elements``).
            document_ids: [T] document of each position (-1 = padding).
            attention: "sdpa" (a dense boolean mask per document, SDPA; forward and backward on any device),
                "sdpa-full" (one dense [N, N] mask) or "flex" (BlockMask, flex attention; GPU training).
            mask: a precomputed mask of the elements (DocumentBlocks, dense [N, N] bool, or BlockMask).
            logit_rows: when given, logits (and label_index, position_ids) of these element rows only.
            positions: [T] position of each index within its own row (default: the index). Rows laid side by side
                (documents numbered apart, so no element sees another row) pass each row's own 0 .. T_row - 1.
        """
        cfg = self.config
        self._check_row(input_ids, hidden, document_ids)
        if positions is not None and positions.shape != hidden.shape[:1]:
            raise ValueError(
                f"positions must be [T] with T = {hidden.shape[0]} (hidden rows), got {tuple(positions.shape)}"
            )
        dtype = self.fc.weight.dtype
        projected = self.project(hidden.to(dtype))  # fc on the T depth-0 rows ...
        mask_projected = self.projected_mask_hidden()  # ... and once on mask_hidden
        inputs = cod_gather(input_ids, projected, mask_projected, anchors, depths, cfg.mask_token_id, cfg.vocab_size)
        if mask is None:
            mask = self.element_mask(anchors, depths, document_ids, attention)
        embeds = self.embed_tokens(inputs.ids)
        position_ids = inputs.position_ids if positions is None else positions[anchors] + depths
        out = self._trunk(embeds, inputs.feats, position_ids, mask)
        label_index = inputs.label_index
        if logit_rows is not None:
            out, label_index, position_ids = out[logit_rows], label_index[logit_rows], position_ids[logit_rows]
        # The low-rank head learns from the full head's distribution, not the trunk from it: detached states.
        low_rank = self.low_rank_logits(out.detach()) if cfg.efficient_lm_head and self.training else None
        return DraftOutput(self.head(out), label_index, position_ids, low_rank)

    def element_mask(self, anchors: Tensor, depths: Tensor, document_ids: Tensor, attention: Attention = "sdpa"):
        """The P-EAGLE mask of the elements from the mask ops (dense for SDPA, BlockMask for flex), windowed with
        ``sliding_window``."""
        window = self.config.sliding_window
        if attention == "flex":
            if self._block_builder is None:
                self._block_builder = BlockMaskBuilder()
            return self._block_builder.build(anchors, depths, document_ids, window)
        if attention == "sdpa":
            return document_blocks(anchors, depths, document_ids, window)
        if attention != "sdpa-full":
            raise ValueError(f"attention must be 'sdpa', 'sdpa-full' or 'flex', got {attention!r}")
        mask = mask_dense(anchors, depths, document_ids, window)
        # Padding queries may attend to nothing; let them see themselves so no softmax row is empty (they carry no
        # loss and no other query can see them).
        diagonal = mask.diagonal()
        diagonal |= ~mask.any(1)
        return mask

    def forward_features(
        self, input_ids: Tensor, feats: Tensor, position_ids: Tensor, mask: object = None
    ) -> tuple[Tensor, Tensor]:
        """The drafter on elements whose H-wide features are given (``project`` of target states, or hidden states the
        drafter itself produced): logits [N, draft_vocab] and the hidden state [N, H] that autoregressive (EAGLE-3)
        drafting feeds back as the features of the next step. ``mask``: None (causal over the N elements), a dense
        [N, N] bool mask, or :class:`DocumentBlocks`."""
        out, hidden = self._trunk(self.embed_tokens(input_ids.long()), feats, position_ids, mask, with_hidden=True)
        return self.head(out), hidden

    def forward_unrolled(
        self, input_ids: Tensor, hidden: Tensor, anchors: Tensor, depths: Tensor, document_ids: Tensor
    ) -> DraftOutput:
        """EAGLE-3 training-time test: the drafter unrolled over autoregressive steps, one pass per step.

        Element (a, 0) is the real pair (x_{a+1}, g_a); element (a, s >= 1) is what an EAGLE-3 server drafts next
        (``peagle.train.evaluate.chain_steps``, vLLM's eagle3 proposer): its token is the drafter's own argmax at
        (a, s - 1) (a target id, no gradient) and its features are the hidden state (a, s - 1) produced (with
        gradient), at position a + s. Step s's queries attend to the keys of steps 0..s under the P-EAGLE mask
        (:func:`peagle.ops.mask_dense`): the depth-0 context up to a and their own chain's earlier steps.

        Args:
            input_ids, hidden, document_ids: one row as in :meth:`forward_train`.
            anchors, depths: [N] elements grouped by depth 0, 1, .. (each depth's anchors strictly increasing), nested:
                (a, s) needs (a, s - 1), e.g. ``cod_sample`` with the number of steps as its depths.

        Returns:
            The logits of all N elements (input order), their label index a + s and position ids.
        """
        self._check_row(input_ids, hidden, document_ids)
        counts = torch.bincount(depths.long()).tolist() if depths.numel() else []
        if depths.numel() and bool((depths[1:] < depths[:-1]).any()):
            raise ValueError("depths must be grouped in ascending order (depth 0 first)")
        bounds = [0, *itertools.accumulate(counts)]
        anchors, depths = anchors.long(), depths.long()
        draft_ids = self.draft_ids()
        real = self.project(hidden.to(self.fc.weight.dtype))
        mask = mask_dense(anchors, depths, document_ids, self.config.sliding_window)
        mask |= torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)  # padding rows see themselves
        context = [(real.new_zeros(1, 0, self.config.num_kv_heads, self.config.head_dim),) * 2] * len(self.layers)
        logits_out: list[Tensor] = []
        fed = real.new_zeros(1, 0, self.config.hidden_size)  # the hidden states of the previous step's elements
        for step, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            a = anchors[lo:hi]
            if step == 0:
                ids, feats = input_ids.long()[a], real[a]
            else:
                previous = anchors[bounds[step - 1] : lo]
                parent = torch.searchsorted(previous, a).clamp(max=max(previous.numel() - 1, 0))
                if previous.numel() == 0 or bool((previous[parent] != a).any()):
                    raise ValueError(f"elements must be nested: an anchor at depth {step} lacks depth {step - 1}")
                ids, feats = draft_ids[logits_out[-1].detach()[parent].argmax(-1)], fed[0, parent]
            logits, fed, new_kv = self.forward_cached(
                ids[None], feats[None], (a + step)[None], context, mask[None, lo:hi, :hi]
            )
            context = [
                (torch.cat([k, new_k], 1), torch.cat([v, new_v], 1))
                for (k, v), (new_k, new_v) in zip(context, new_kv, strict=True)
            ]
            logits_out.append(logits[0])
        position_ids = anchors + depths
        logits = torch.cat(logits_out) if logits_out else real.new_zeros(0, self.config.draft_vocab_size)
        return DraftOutput(logits, position_ids, position_ids)

    def _check_row(self, input_ids: Tensor, hidden: Tensor, document_ids: Tensor) -> None:
        width = self.config.num_aux * self.config.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != width:
            raise ValueError(f"hidden must be [T, {width}] (num_aux x hidden_size), got {tuple(hidden.shape)}")
        if input_ids.shape != hidden.shape[:1] or document_ids.shape != hidden.shape[:1]:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and document_ids {tuple(document_ids.shape)} must be [T] with "
                f"T = {hidden.shape[0]} (hidden rows)"
            )

    def forward_inference(self, input_ids: Tensor, hidden: Tensor, num_mask: int, start_position: int = 0) -> Tensor:
        """What a server runs: L real (token, hidden) elements then ``num_mask`` mask elements, plain causal mask.

        Returns logits [L + num_mask, draft_vocab]; row L - 1 + d is the drafter's guess at depth d.
        """
        cfg = self.config
        width = cfg.num_aux * cfg.hidden_size
        dtype = self.fc.weight.dtype
        feats = self.project(
            torch.cat([hidden.to(dtype), self.mask_hidden.reshape(1, width).to(dtype).expand(num_mask, width)])
        )
        ids = torch.cat([input_ids.long(), input_ids.new_full((num_mask,), cfg.mask_token_id).long()])
        positions = torch.arange(ids.numel(), device=ids.device) + start_position
        mask = None
        if cfg.sliding_window is not None:  # mask elements see their anchor (the last real element) and each other
            anchor = positions.clamp(max=start_position + input_ids.numel() - 1)
            causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool, device=ids.device).tril()
            mask = causal & window_visible(positions, positions, anchor, cfg.sliding_window)
        out = self._trunk(self.embed_tokens(ids), feats, positions, mask)
        return self.head(out)

    def forward_cached(
        self,
        input_ids: Tensor,
        feats: Tensor,
        position_ids: Tensor,
        context: list[tuple[Tensor, Tensor]],
        mask: Tensor,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
        """The drafter on a batch of new elements after cached ones (what a serving loop runs every round).

        Args:
            input_ids: [B, n] token of each new element; feats: [B, n, H] its features (``project`` of target
                states or of ``mask_hidden``, or a hidden state the drafter produced, as in :meth:`forward_features`).
            position_ids: [B, n].
            context: per layer the cached keys and values [B, C, kv_heads, head_dim] (as this method returned them).
            mask: [B, n, C + n] bool, which cached and new elements each new element sees (every row must see one).
            rows: [B, m] indices into n: the elements whose logits and hidden states are wanted (default: all).

        Returns:
            logits [B, m, draft_vocab], the hidden states [B, m, H] autoregressive drafting feeds back (as
            :meth:`forward_features`), and per layer the new elements' keys and values [B, n, kv_heads, head_dim].
        """
        batch, n = input_ids.shape
        embeds = self.embed_tokens(input_ids.long())
        cos, sin = self.rotary(position_ids.reshape(-1), feats.dtype)
        cos, sin = cos.view(batch, n, -1), sin.view(batch, n, -1)
        x = self._layer_input(embeds, feats)
        new_kv = []
        for layer, (past_k, past_v) in zip(self.layers, context, strict=True):
            x, k, v = layer.forward_cached(x, cos, sin, past_k, past_v, mask, embeds)
            new_kv.append((k, v))
        if rows is not None:
            x = x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
        out = self.norm(x)
        return self.head(out), out if self.config.norm_output else x, new_kv

    def moe_balance(self) -> tuple[Tensor, Tensor] | None:
        """Load-balancing loss and expert-load imbalance (max / mean) of the last forward's routing, averaged over the
        MoE layers (:func:`routing_balance`); None without MoE."""
        if not self.config.moe:
            return None
        per_layer = [routing_balance(*layer.mlp.routing) for layer in self.layers]
        return torch.stack([b[0] for b in per_layer]).mean(), torch.stack([b[1] for b in per_layer]).mean()

    def projected_mask_hidden(self) -> Tensor:
        """``project(mask_hidden)`` [H]: the features of every mask element."""
        width = self.config.num_aux * self.config.hidden_size
        return self.project(self.mask_hidden.reshape(1, width).to(self.fc.weight.dtype))[0]
