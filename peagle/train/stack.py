"""A small drafter-like attention stack for partitioning proofs and memory benchmarks (not the production drafter).

Inputs follow the P-EAGLE layout: fc(target hidden or mask_hidden) + token embedding (real token at depth 0, mask token
deeper) + a learned position embedding of a + d, then pre-norm attention/MLP blocks over a boolean element mask
(SDPA, so it runs forward and backward on the CPU), a final norm and an LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        n, width = x.shape
        # [1, heads, N, head_dim]: the 4-D layout lets SDPA pick its fused CPU kernel (no N x N score matrix kept).
        q, k, v = (
            self.qkv(self.norm1(x)).view(1, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        )
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attn[0].transpose(0, 1).reshape(n, width))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class DrafterLikeStack(nn.Module):
    """``num_layers`` attention blocks over N elements; ``forward`` returns logits [N, vocab].

    ``forward`` sets the diagonal of empty mask rows in place.
    """

    def __init__(
        self, hidden: int, feature_dim: int, vocab: int, max_positions: int, num_layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(feature_dim, hidden, bias=False)
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_positions, hidden)
        self.mask_hidden = nn.Parameter(torch.randn(feature_dim) * 0.1)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, feats: Tensor, ids: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
        # Padding queries attend to nothing; let them see themselves (in place: no second N x N mask) so no softmax row
        # is empty. They carry no loss, and the own element is the same in a segment as in the whole row.
        diagonal = mask.diagonal()
        diagonal |= ~mask.any(1)
        x = self.fc(feats) + self.embed(ids) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))
