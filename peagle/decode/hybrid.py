"""Gated DeltaNet (GDN) state of Qwen3-Next-style hybrid targets: tree verification and commit of the accepted path.

The target runner (:mod:`peagle.decode.target`) runs a hybrid target like any other: its gated-attention layers use
the paged KV cache, and its GDN layers come here. Each request owns one row of every GDN layer's recurrent state pool
[R, HV, K, V] (fp32) and conv window [R, C, W - 1]. A tree forward runs :func:`peagle.ops.causal_conv1d_tree` and
:func:`peagle.ops.gdn_tree_verify` from the committed states (node i from its parent's state, the root from the
committed one) and keeps what commit needs; :meth:`GdnStates.commit` then makes the state after each request's last
accepted node the committed one through ``gdn_commit`` / ``causal_conv1d_commit``. Requests accept paths of any
lengths: both ops commit per request. Every op reads and writes the request's rows of the pools in place (``slots``),
so no state is gathered or scattered.

The Hugging Face modules' weights and sub-modules (projections, norms, gates) are reused, so the only new arithmetic is
the tree-structured token mixing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.ops import causal_conv1d_commit, causal_conv1d_tree, gdn_commit, gdn_tree_verify

__all__ = ["GdnStates", "gated_attention_projections"]

# Nodes per tree forward the GDN kernels take (gdn_tree_verify: 1 <= n <= 64).
MAX_GDN_NODES = 64


class GdnStates:
    """Committed recurrent and conv states of every GDN layer for ``num_requests`` requests (one row each)."""

    def __init__(self, model, num_requests: int, device: torch.device) -> None:
        config = model.config
        self.state_pools: dict[int, Tensor] = {}
        self.conv_states: dict[int, Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            if config.layer_types[i] == "linear_attention":
                gdn = layer.linear_attn
                self.state_pools[i] = torch.zeros(
                    num_requests, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, device=device
                )
                self.conv_states[i] = torch.zeros(
                    num_requests, gdn.conv_dim, gdn.conv_kernel_size - 1, dtype=model.dtype, device=device
                )
        self.pending: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self.parent: Tensor | None = None

    def layer_forward(self, index: int, layer, hidden: Tensor, parent: Tensor, rows: Tensor) -> Tensor:
        """GDN block output [b, n, hidden] of tree nodes (``parent`` [b, n], -1 at the root and padding) of ``rows``;
        keeps what :meth:`commit` needs."""
        gdn = layer.linear_attn
        batch, nodes, _ = hidden.shape
        query, key, value, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(hidden), gdn.in_proj_ba(hidden))
        mixed = torch.cat([t.reshape(batch, nodes, -1) for t in (query, key, value)], dim=-1)  # [b, n, C]
        conv_weight = gdn.conv1d.weight.squeeze(1)
        mixed_out = causal_conv1d_tree(
            mixed, parent, self.conv_states[index], conv_weight, gdn.conv1d.bias, gdn.activation, slots=rows
        )
        query, key, value = torch.split(mixed_out, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(batch, nodes, -1, gdn.head_k_dim).contiguous()
        key = key.reshape(batch, nodes, -1, gdn.head_k_dim).contiguous()
        value = value.reshape(batch, nodes, -1, gdn.head_v_dim).contiguous()
        beta = b.sigmoid().contiguous()
        g = (-gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)).contiguous()
        o, u = gdn_tree_verify(query, key, value, g, beta, parent, self.state_pools[index], rows, None, True)
        core = gdn.norm(o.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(batch, nodes, -1)
        self.pending[index] = (mixed, key, g, u)
        self.parent = parent
        return gdn.out_proj(core)

    def commit(self, rows: Tensor, last_node: Tensor) -> None:
        """Makes the state after node ``last_node[b]`` of the last tree forward request rows[b]'s committed state
        (-1 leaves it unchanged)."""
        last_node = last_node.long()
        for index, (mixed, key, g, u) in self.pending.items():
            gdn_commit(key, g, u, self.parent, last_node, self.state_pools[index], rows, True)
            causal_conv1d_commit(mixed, self.parent, last_node, self.conv_states[index], slots=rows)
        self.pending = {}
        self.parent = None


def gated_attention_projections(attn, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3-Next gated attention: (query, key, value) [b, n, heads, head_dim] after q/k norms (before rotary) and
    the output gate [b, n, heads * head_dim]."""
    batch, nodes, _ = hidden.shape
    shape = (batch, nodes, -1, attn.head_dim)
    query, gate = torch.chunk(attn.q_proj(hidden).view(batch, nodes, -1, attn.head_dim * 2), 2, dim=-1)
    query = attn.q_norm(query.reshape(shape))
    key = attn.k_norm(attn.k_proj(hidden).view(shape))
    value = attn.v_proj(hidden).view(shape)
    return query, key, value, gate.reshape(batch, nodes, -1)
