"""The target runner: a Hugging Face causal LM's decoder layers over a paged KV cache; prefill, tree forward, commit.

Supported targets: transformers causal LMs of model_type llama, mistral, qwen2, qwen3 (dense) and qwen3_next (hybrid:
gated attention + Gated DeltaNet layers, whose recurrent/conv state lives in :mod:`peagle.decode.hybrid`), loaded from
a directory or given as a module. The runner computes its own forward from the modules' weights (embeddings, per
layer input norm, q/k/v (+ q_norm/k_norm), rotary from the model's rotary module, attention over the paged cache,
o_proj, MLP, final norm, LM head), batched over requests of different lengths with no loop over tokens or nodes.

KV layout (:class:`peagle.decode.kv_cache.PagedKVCache`): per attention layer ``k, v [num_blocks, block_size,
kv_heads, head_dim]`` (after k_norm and rotary); per request a block-table row and ``seq_len`` committed entries, slot
s holding position s. One forward takes a batch of draft trees: node i of request b is written at slot
``seq_len[b] + i`` with position ``seq_len[b] + depth[i]`` and attends to the committed prefix plus its ancestors and
itself (``mask``, as ``TreeSpec.mask``); each attention layer writes the nodes' keys/values, then reads the live
blocks of its requests (up to the longest committed length plus the tree, whole blocks), never the whole cache. On the
CPU, dense layers run q|k|v and gate|up as one matmul each (concatenated copies of the weights) and plain RMSNorms as
one ``F.rms_norm``: a small target's round is bound by per-op overhead there. It returns, per node, the final
normalised hidden state (``logits`` turns it into logits) and the aux hidden states the drafter reads: layer id i is
the residual stream after i decoder layers (``hidden_states[i]`` of transformers, before the final norm for i = L), the
ids concatenated in the drafter's order, exactly what :mod:`peagle.train.extract` stores. :meth:`TargetRunner.commit`
keeps each request's accepted path (``kv_compact``: node ``accepted_path[j]`` moves to slot ``seq_len + j``, then
``seq_len += num_accepted + 1``) and commits hybrid targets' GDN states at the last accepted node. Prefill runs prompts
as chains of ``prefill_chunk`` tokens (ragged prompts batched), each chunk committed in place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from peagle.decode.hybrid import MAX_GDN_NODES, GdnStates, gated_attention_projections
from peagle.decode.kv_cache import PagedKVCache
from peagle.model.target import load_target_model

__all__ = ["TargetRunner"]


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [b, n, heads, D] with cos/sin [b, n, R] (R <= D: partial rotary keeps the rest)."""
    rotary = cos.shape[-1]
    c, s = cos[:, :, None], sin[:, :, None]
    if rotary == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot, keep = x[..., :rotary], x[..., rotary:]
    return torch.cat([rot * c + _rotate_half(rot) * s, keep], dim=-1)


# RMSNorm modules computing weight * (x * rsqrt(mean(x^2) + eps)) in float32, which F.rms_norm computes in one op.
_PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _norm_fn(module: nn.Module):
    """The module as a function of x; one ``F.rms_norm`` for a plain RMSNorm on float32 inputs."""
    if type(module).__name__ not in _PLAIN_RMS_NORMS:
        return module
    weight, eps = module.weight, module.variance_epsilon

    def norm(x: Tensor) -> Tensor:
        return F.rms_norm(x, weight.shape, weight, eps) if x.dtype == torch.float32 == weight.dtype else module(x)

    return norm


class _FusedDense(NamedTuple):
    """A dense decoder layer's projections with concatenated weights (q|k|v and gate|up: one matmul each)."""

    qkv_weight: Tensor
    qkv_bias: Tensor | None
    sizes: tuple[int, int, int]
    gate_up: Tensor

    @classmethod
    def of(cls, layer: nn.Module) -> _FusedDense | None:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if not all(isinstance(m, nn.Linear) for m in (*projections, gate, up)) or gate.bias is not None:
            return None
        if up.bias is not None or not hasattr(mlp, "act_fn") or not hasattr(mlp, "down_proj"):
            return None
        biases = [m.bias for m in projections]
        qkv_bias = None
        if any(b is not None for b in biases):
            qkv_bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                                  for b, m in zip(biases, projections, strict=True)])  # fmt: skip
        return cls(
            torch.cat([m.weight for m in projections]),
            qkv_bias,
            tuple(m.out_features for m in projections),
            torch.cat([gate.weight, up.weight]),
        )


class TargetRunner:
    """A target model over a paged KV cache (see the module docstring)."""

    def __init__(
        self,
        target: str | os.PathLike | nn.Module,
        aux_layer_ids: Sequence[int] = (),
        *,
        block_size: int = 16,
        prefill_chunk: int = 256,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = load_target_model(target, dtype, device)
        config = self.config = self.model.config
        self.inner = self.model.model
        self.hybrid = config.model_type == "qwen3_next"
        self.num_layers = config.num_hidden_layers
        bad = [i for i in aux_layer_ids if not 1 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's layers [1, {self.num_layers}]")
        self.aux_layer_ids = list(aux_layer_ids)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        self.linear = [self.hybrid and layer_types[i] == "linear_attention" for i in range(self.num_layers)]
        self.window = [self._window(layer_types[i]) for i in range(self.num_layers)]
        attention = [i for i in range(self.num_layers) if not self.linear[i]]
        self.cache_index = {layer: c for c, layer in enumerate(attention)}
        self.head_dim = self.inner.layers[attention[0]].self_attn.head_dim
        self.kv_heads = config.num_key_value_heads
        self.block_size = block_size
        # GDN kernels take at most 64 nodes per forward (prefill chunks included).
        self.max_nodes = MAX_GDN_NODES if self.hybrid else None
        self.prefill_chunk = min(prefill_chunk, MAX_GDN_NODES) if self.hybrid else prefill_chunk
        layers = self.inner.layers[: self.num_layers]
        # On the CPU a small target's round is bound by per-op overhead: fewer, wider matmuls and one-op norms. The
        # fused weights are copies (constant across rounds), so they are not made on accelerators, where memory
        # counts.
        cpu = self.device.type == "cpu"
        self.fused = [_FusedDense.of(layer) if cpu and not self.hybrid else None for layer in layers]
        self.norms = [(_norm_fn(layer.input_layernorm), _norm_fn(layer.post_attention_layernorm)) for layer in layers]
        self.final_norm = _norm_fn(self.inner.norm)
        self.kv: PagedKVCache | None = None
        self.gdn: GdnStates | None = None

    def _window(self, layer_type: str) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        if self.config.model_type == "mistral":
            return window
        return window if layer_type == "sliding_attention" else None

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def allocate(self, num_requests: int, capacity: int) -> None:
        """Fresh caches for ``num_requests`` requests of up to ``capacity`` slots (prompt + output + one tree)."""
        self.kv = PagedKVCache(
            len(self.cache_index),
            self.kv_heads,
            self.head_dim,
            num_requests,
            capacity,
            self.block_size,
            self.dtype,
            self.device,
        )
        self.gdn = GdnStates(self.model, num_requests, self.device) if self.hybrid else None

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden)

    # -----------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        rows: Tensor,
        host_rows: list[int],
        tokens: Tensor,
        depth: Tensor,
        mask: Tensor,
        parent: Tensor,
        num_nodes: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """One forward over a batch of draft trees of requests ``rows``.

        Args:
            tokens, depth, parent: [b, n] per node (node 0 = the root; nodes >= num_nodes[b] are padding).
            mask: [b, n, n] bool, mask[b, i, j] = node j is node i or an ancestor of it.
            num_nodes: [b].

        Returns:
            final normalised hidden states [b, n, H] and aux hidden states [b, n, num_aux * H].
        """
        batch, nodes = tokens.shape
        if self.max_nodes is not None and nodes > self.max_nodes:
            raise ValueError(f"a hybrid target verifies at most {self.max_nodes} nodes per tree, got {nodes}")
        device = tokens.device
        index = torch.arange(nodes, device=device)
        seq = self.kv.seq_len[rows]
        valid = index[None, :] < num_nodes[:, None]
        positions = seq[:, None] + depth.clamp(min=0)
        hidden = self.inner.embed_tokens(tokens.clamp(min=0))
        cos, sin = self.inner.rotary_emb(hidden, positions)
        write_slots = self.kv.flat_slots(rows, seq[:, None] + index, valid)
        # Each attention layer writes the nodes' keys/values first, then reads the live blocks: slot s < seq is
        # committed, slot seq + j is node j (the read covers every node of every request).
        length = self.kv.padded_len(host_rows, nodes)
        blocks = self.kv.context_blocks(rows, length)
        column = torch.arange(length, device=device)[None, :] - seq[:, None]  # node index of a tree slot
        in_tree = (column >= 0) & (column < nodes)
        node = column.clamp(0, nodes - 1)
        tree = (mask & valid[:, :, None] & valid[:, None, :]) | torch.eye(nodes, dtype=torch.bool, device=device)
        tree_part = tree.gather(2, node[:, None, :].expand(batch, nodes, length)) & in_tree[:, None, :]
        full = (column < 0)[:, None, :] | tree_part
        masks = {None: full}
        for window in set(self.window) - {None}:
            key_pos = torch.where(column < 0, column + seq[:, None], positions.gather(1, node))
            masks[window] = full & (key_pos[:, None, :] > positions[:, :, None] - window)
        states = {}
        for i, layer in enumerate(self.inner.layers[: self.num_layers]):
            input_norm, post_norm = self.norms[i]
            normed = input_norm(hidden)
            if self.linear[i]:
                out = self.gdn.layer_forward(i, layer, normed, parent.long(), rows)
            else:
                out = self._attention(i, layer.self_attn, normed, cos, sin, blocks, write_slots, masks[self.window[i]])
            hidden = hidden + out
            hidden = hidden + self._mlp(i, layer.mlp, post_norm(hidden))
            if i + 1 in self.aux_layer_ids:
                states[i + 1] = hidden
        aux = torch.cat([states[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else hidden[..., :0]
        return self.final_norm(hidden), aux

    def _mlp(self, layer: int, mlp: nn.Module, hidden: Tensor) -> Tensor:
        fused = self.fused[layer]
        if fused is None:
            out = mlp(hidden)
            return out[0] if isinstance(out, tuple) else out
        gate, up = F.linear(hidden, fused.gate_up).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _projections(self, layer: int, attn: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor):
        """Query, key, value [b, n, heads, D] after q/k norms and rotary, and the output gate (hybrid) or None."""
        batch, nodes, _ = hidden.shape
        shape = (batch, nodes, -1, attn.head_dim)
        fused = self.fused[layer]
        gate = None
        if self.hybrid:  # q/k norms applied there
            query, key, value, gate = gated_attention_projections(attn, hidden)
            return _rotary(query, cos, sin), _rotary(key, cos, sin), value, gate
        if fused is not None:
            qkv = F.linear(hidden, fused.qkv_weight, fused.qkv_bias)
            q_size, k_size, _ = fused.sizes
            if getattr(attn, "q_norm", None) is None:  # rotary of queries and keys at once
                qk = _rotary(qkv[..., : q_size + k_size].view(shape), cos, sin)
                query, key = qk.split([q_size // attn.head_dim, k_size // attn.head_dim], dim=2)
                return query, key, qkv[..., q_size + k_size :].view(shape), None
            query, key, value = (t.view(shape) for t in qkv.split(fused.sizes, dim=-1))
        else:
            query, key, value = (attn.q_proj(hidden).view(shape), attn.k_proj(hidden).view(shape),
                                 attn.v_proj(hidden).view(shape))  # fmt: skip
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            query, key = attn.q_norm(query), attn.k_norm(key)
        return _rotary(query, cos, sin), _rotary(key, cos, sin), value, gate

    def _attention(
        self,
        layer: int,
        attn,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        blocks: Tensor,
        write_slots: Tensor,
        mask: Tensor,
    ) -> Tensor:
        batch, nodes, _ = hidden.shape
        query, key, value, gate = self._projections(layer, attn, hidden, cos, sin)
        cache = self.cache_index[layer]
        self.kv.write(cache, write_slots, key, value)
        keys, values = self.kv.read(cache, blocks)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=attn.scaling,
            enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(batch, nodes, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)

    def commit(
        self,
        rows: Tensor,
        host_rows: list[int],
        accepted_path: Tensor,
        num_accepted: Tensor,
        last_node: Tensor,
        host_accepted: list[int],
    ) -> None:
        """Keeps each request's accepted path of the last forward (``host_accepted``: num_accepted on the host)."""
        self.kv.compact(rows, host_rows, accepted_path, num_accepted, host_accepted)
        if self.gdn is not None:
            self.gdn.commit(rows, last_node)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Commits every prompt (token-id lists, ragged) in chains of ``prefill_chunk`` tokens.

        Returns the final hidden state of each prompt's last token [B, H] and the aux hidden states of every prompt
        token [B, P_max, num_aux * H] (zero past a prompt's end).
        """
        device = self.device
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        ids = torch.tensor([[*p, *[0] * (longest - len(p))] for p in prompts], dtype=torch.long, device=device)
        aux_all = torch.zeros(
            len(prompts), longest, len(self.aux_layer_ids) * self.hidden_size, dtype=self.dtype, device=device
        )
        last = torch.zeros(len(prompts), self.hidden_size, dtype=self.dtype, device=device)
        chunk = self.prefill_chunk
        for start in range(0, longest, chunk):  # a loop over chunks, not tokens
            host_rows = [r for r in range(len(prompts)) if lengths[r] > start]
            counts = [min(chunk, lengths[r] - start) for r in host_rows]
            rows = torch.tensor(host_rows, device=device)
            num = torch.tensor(counts, device=device)
            nodes = max(counts)
            index = torch.arange(nodes, device=device)
            valid = index[None, :] < num[:, None]
            depth = index.expand(len(host_rows), nodes)
            mask = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril().expand(len(host_rows), -1, -1)
            parent = torch.where(valid, index - 1, -1)
            final, aux = self.forward(rows, host_rows, ids[rows, start : start + nodes], depth, mask, parent, num)
            aux_all[rows, start : start + nodes] = aux * valid[..., None]
            ends = torch.tensor([lengths[r] <= start + chunk for r in host_rows], device=device)
            picked = final[torch.arange(len(host_rows), device=device), num - 1]
            last[rows[ends]] = picked[ends]
            self.kv.advance(rows, host_rows, num, counts)
            if self.gdn is not None:
                self.gdn.commit(rows, num - 1)
        return last, aux_all
