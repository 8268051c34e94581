"""Tree verification through a Qwen3-Next-style hybrid target (Gated DeltaNet + gated attention layers).

One forward pass scores every node of a draft tree per request: attention layers see the committed KV cache plus the
node's ancestors (an ancestor mask over the tree), GDN layers run :func:`peagle.ops.causal_conv1d_tree` and
:func:`peagle.ops.gdn_tree_verify` from the committed conv/recurrent states. :func:`hybrid_tree_commit` then makes the
accepted path the committed context: GDN states and conv windows are committed in place, and the accepted nodes' keys
and values are appended to the attention cache. Wiring into generation comes later; this is the model-side glue.

It reuses the Hugging Face modules' weights and sub-modules (projections, norms, MLP/MoE blocks, rotary embedding), so
the only new arithmetic is the tree-structured token mixing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.ops.gdn import causal_conv1d_commit, causal_conv1d_tree, gdn_commit, gdn_tree_verify
from peagle.ops.tree_build import ancestor_mask

__all__ = ["HybridTreeCache", "hybrid_prefill", "hybrid_tree_commit", "hybrid_tree_forward"]


@dataclass
class HybridTreeCache:
    """Committed context of B requests (all with the same committed length, for now)."""

    state_pools: dict[int, Tensor] = field(default_factory=dict)  # GDN layer -> [B, HV, K, V] fp32
    conv_states: dict[int, Tensor] = field(default_factory=dict)  # GDN layer -> [B, C, W - 1]
    keys: dict[int, Tensor] = field(default_factory=dict)  # attention layer -> [B, kvH, T, D] (after norm + rope)
    values: dict[int, Tensor] = field(default_factory=dict)  # attention layer -> [B, kvH, T, D]
    length: int = 0
    pending: dict = field(default_factory=dict)  # what the last tree forward left for commit

    @classmethod
    def empty(cls, model, batch: int) -> HybridTreeCache:
        config = model.config
        cache = cls()
        dtype = model.dtype
        for i, layer in enumerate(model.model.layers):
            if config.layer_types[i] == "linear_attention":
                gdn = layer.linear_attn
                cache.state_pools[i] = torch.zeros(batch, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
                cache.conv_states[i] = torch.zeros(batch, gdn.conv_dim, gdn.conv_kernel_size - 1, dtype=dtype)
            else:
                attn = layer.self_attn
                kv_heads = config.num_key_value_heads
                cache.keys[i] = torch.zeros(batch, kv_heads, 0, attn.head_dim, dtype=dtype)
                cache.values[i] = torch.zeros(batch, kv_heads, 0, attn.head_dim, dtype=dtype)
        return cache


def _attention(layer, hidden: Tensor, cos: Tensor, sin: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor):
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb, repeat_kv

    attn = layer.self_attn
    batch, nodes, _ = hidden.shape
    shape = (batch, nodes, -1, attn.head_dim)
    query, gate = torch.chunk(attn.q_proj(hidden).view(batch, nodes, -1, attn.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(batch, nodes, -1)
    query = attn.q_norm(query.reshape(shape)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    keys = repeat_kv(torch.cat([past_k, key], dim=2), attn.num_key_value_groups)
    values = repeat_kv(torch.cat([past_v, value], dim=2), attn.num_key_value_groups)
    # Committed context: all visible; tree part: ancestors and self.
    full_mask = torch.cat([mask.new_ones(batch, nodes, past_k.shape[2]), mask], dim=2)[:, None]
    scores = (query @ keys.transpose(-1, -2)) * attn.scaling
    scores = scores.masked_fill(~full_mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = (probs @ values).transpose(1, 2).reshape(batch, nodes, -1)
    out = out * torch.sigmoid(gate)
    return attn.o_proj(out), key, value


def _gated_deltanet(layer, hidden: Tensor, parent: Tensor, cache: HybridTreeCache, index: int):
    gdn = layer.linear_attn
    batch, nodes, _ = hidden.shape
    query, key, value, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(hidden), gdn.in_proj_ba(hidden))
    mixed = torch.cat([t.reshape(batch, nodes, -1) for t in (query, key, value)], dim=-1)  # [B, n, C]
    conv_weight = gdn.conv1d.weight.squeeze(1)
    conv_state = cache.conv_states[index]
    mixed_out = causal_conv1d_tree(mixed, parent, conv_state, conv_weight, gdn.conv1d.bias, gdn.activation)
    query, key, value = torch.split(mixed_out, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    query = query.reshape(batch, nodes, -1, gdn.head_k_dim).contiguous()
    key = key.reshape(batch, nodes, -1, gdn.head_k_dim).contiguous()
    value = value.reshape(batch, nodes, -1, gdn.head_v_dim).contiguous()
    beta = b.sigmoid().contiguous()
    g = (-gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)).contiguous()
    slots = torch.arange(batch)
    o, u = gdn_tree_verify(query, key, value, g, beta, parent, cache.state_pools[index], slots, None, True)
    core = gdn.norm(o.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(batch, nodes, -1)
    return gdn.out_proj(core), (mixed, key, g, u)


@torch.no_grad()
def hybrid_tree_forward(model, input_ids: Tensor, parent: Tensor, cache: HybridTreeCache) -> Tensor:
    """Logits [B, n, vocab] of every tree node of a Qwen3-Next ``*ForCausalLM`` given the committed ``cache``.

    input_ids, parent: [B, n]; parent[b, 0] = -1, parent[b, i] < i. Node i sits at position cache.length + depth(i).
    """
    inner = model.model
    parent = parent.to(torch.long)
    mask = ancestor_mask(parent)
    positions = cache.length + mask.sum(-1) - 1  # depth = number of strict ancestors
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    pending = {"parent": parent, "gdn": {}, "attn": {}}
    for i, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        if model.config.layer_types[i] == "linear_attention":
            hidden, pending["gdn"][i] = _gated_deltanet(layer, hidden, parent, cache, i)
        else:
            hidden, key, value = _attention(layer, hidden, cos, sin, cache.keys[i], cache.values[i], mask)
            pending["attn"][i] = (key, value)
        hidden = residual + hidden
        residual = hidden
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = residual + (out[0] if isinstance(out, tuple) else out)
    cache.pending = pending
    return model.lm_head(inner.norm(hidden))


def hybrid_tree_commit(cache: HybridTreeCache, last_accepted: Tensor) -> None:
    """Makes the root-to-last_accepted[b] path of the last tree forward the committed context (all requests must
    accept a path of the same length, as the attention cache is rectangular)."""
    pending = cache.pending
    parent = pending["parent"]
    last_accepted = last_accepted.to(torch.long)
    slots = torch.arange(parent.shape[0])
    for i, (mixed, key, g, u) in pending["gdn"].items():
        gdn_commit(key, g, u, parent, last_accepted, cache.state_pools[i], slots, True)
        causal_conv1d_commit(mixed, parent, last_accepted, cache.conv_states[i])
    on_path = ancestor_mask(parent)[slots, last_accepted.clamp_min(0)] & (last_accepted >= 0)[:, None]
    lengths = on_path.sum(-1)
    if bool((lengths != lengths[0]).any()):
        raise ValueError("hybrid_tree_commit: every request must accept a path of the same length")
    # Ancestors precede their descendants, so each row's node indices in increasing order are the root-to-node path.
    index = on_path.nonzero()[:, 1].reshape(parent.shape[0], -1)  # [B, L]
    for i, (key, value) in pending["attn"].items():
        gather = index[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        cache.keys[i] = torch.cat([cache.keys[i], key.gather(2, gather)], dim=2)
        cache.values[i] = torch.cat([cache.values[i], value.gather(2, gather)], dim=2)
    cache.length += index.shape[1]
    cache.pending = {}


@torch.no_grad()
def hybrid_prefill(model, input_ids: Tensor, cache: HybridTreeCache, chunk: int = 64) -> Tensor:
    """Commits a prompt [B, T] (any T) as chains of at most ``chunk`` <= 64 tokens; returns the last token's logits."""
    batch, length = input_ids.shape
    logits = None
    for start in range(0, length, chunk):  # a loop over chunks of up to 64 tokens, not over tokens
        ids = input_ids[:, start : start + chunk]
        nodes = ids.shape[1]
        chain = (torch.arange(nodes, device=ids.device) - 1).expand(batch, -1)
        logits = hybrid_tree_forward(model, ids, chain, cache)[:, -1]
        hybrid_tree_commit(cache, torch.full((batch,), nodes - 1, device=ids.device))
    return logits
