"""The drafter: train/serve parity, shapes, gradients, K = 1 (EAGLE-3), checkpoints (CPU, float64 where exactness)."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.model import DrafterConfig, PEagleDrafter, from_pretrained, save_pretrained
from peagle.ops import cod_sample
from testkit import random_packed_row

VOCAB = 97


def tiny_config(**changes) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=48,
        mask_token_id=VOCAB - 1,
        num_depths=4,
        aux_layer_ids=[1, 2, 3],
    )
    base.update(changes)
    return DrafterConfig(**base)


def make_drafter(generator, dtype=torch.float64, **changes) -> PEagleDrafter:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
    model = PEagleDrafter(tiny_config(**changes))
    # Larger weights than the training init so the layers do visibly non-linear work in the comparison.
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".q_norm" in name or ".k_norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype)


def make_row(generator, length, num_depths, width, mean_doc=12.0):
    for _ in range(100):  # redraw the rare rows without any deeper element (the tests are about them)
        row = random_packed_row(generator, length, mean_document_length=mean_doc)
        seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
        anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, 0.8, 0.3, None, seed)
        if num_depths == 1 or int(depths.max()) > 0:
            break
    input_ids = torch.randint(0, VOCAB - 1, (length,), generator=generator)
    hidden = torch.randn(length, width, generator=generator, dtype=torch.float64)
    return row, input_ids, hidden, anchors, depths


PARITY_CASES = [
    dict(),
    dict(layer_style="qwen3"),
    dict(fc_norm=True, norm_before_residual=True),
    dict(norm_before_fc=True, num_kv_heads=4, num_layers=3),
    dict(draft_vocab_size=40, layer_style="qwen3", num_kv_heads=1),
]


@pytest.mark.parametrize("attention", ["sdpa", "sdpa-full"])
@pytest.mark.parametrize("changes", PARITY_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "base")
def test_train_serve_parity(generator, changes, attention):
    """Element (a, d) of the training forward == inference on the document prefix ending at a plus d mask tokens."""
    model = make_drafter(generator, **changes)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 96, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    with torch.no_grad():
        out = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids, attention=attention)
    assert out.logits.shape == (anchors.numel(), cfg.draft_vocab_size)
    assert torch.equal(out.label_index, anchors + depths)
    docs = row.document_ids
    valid = torch.nonzero(docs[anchors] != -1).squeeze(1)
    # Every deeper element and a sample of depth-0 ones (each needs its own inference pass).
    deep = valid[depths[valid] > 0]
    shallow = valid[depths[valid] == 0]
    pick = torch.cat(
        [deep[torch.randperm(deep.numel(), generator=generator)[:40]], shallow[:: max(1, shallow.numel() // 12)]]
    )
    assert int((depths[pick] > 0).sum()) > 0, "the row must exercise deeper elements"
    checked = 0
    for e in pick.tolist():
        a, d = int(anchors[e]), int(depths[e])
        start = int(torch.nonzero(docs == docs[a])[0])
        with torch.no_grad():
            logits = model.forward_inference(input_ids[start : a + 1], hidden[start : a + 1], d, start_position=start)
        torch.testing.assert_close(out.logits[e], logits[-1], rtol=1e-10, atol=1e-10, msg=f"element (a={a}, d={d})")
        checked += 1
    assert checked >= 10


def test_parity_detects_a_wrong_mask(generator):
    """The parity check can fail: a plain causal mask over the elements gives different logits for deeper elements."""
    model = make_drafter(generator)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    n = anchors.numel()
    with torch.no_grad():
        good = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids).logits
        bad = model.forward_train(
            input_ids, hidden, anchors, depths, row.document_ids, mask=torch.ones(n, n, dtype=torch.bool).tril()
        ).logits
    deep = depths > 0
    assert not torch.allclose(good[deep], bad[deep], atol=1e-6)


def test_flex_matches_sdpa_forward(generator):
    """The BlockMask + flex attention path gives the dense-mask SDPA logits (forward; flex has no CPU backward)."""
    model = make_drafter(generator, dtype=torch.float32)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 200, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    hidden = hidden.float()
    with torch.no_grad():
        sdpa = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids, attention="sdpa").logits
        flex = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids, attention="flex").logits
    keep = row.document_ids[anchors] != -1  # padding rows: SDPA sees itself, flex outputs zeros; neither is trained
    torch.testing.assert_close(flex[keep], sdpa[keep], rtol=1e-4, atol=1e-4)


def test_k1_is_eagle3_autoregressive(generator):
    """K = 1: depth-0 elements only, and each equals a causal pass over its document prefix (EAGLE-3 drafting)."""
    model = make_drafter(generator, num_depths=1)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 48, 1, cfg.num_aux * cfg.hidden_size)
    assert int(depths.max()) == 0 and anchors.numel() == 48
    with torch.no_grad():
        out = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids).logits
    docs = row.document_ids
    for doc in docs.unique().tolist():
        if doc < 0:
            continue
        where = torch.nonzero(docs == doc).squeeze(1)
        lo, hi = int(where[0]), int(where[-1]) + 1
        with torch.no_grad():
            ref = model.forward_inference(input_ids[lo:hi], hidden[lo:hi], 0, start_position=lo)
        torch.testing.assert_close(out[lo:hi], ref, rtol=1e-10, atol=1e-10)


def eagle3_serving_reference(model, input_ids, hidden, lo, a, k, feedback=None):
    """What vLLM's eagle3 proposer runs for one request, step by step with a plain causal mask: the real (token,
    fc(target states)) pairs of the document prefix lo..a, then per step one new element whose token is the last
    draft and whose features are the previous step's output hidden state (vLLM's ``aux_output``: the residual stream
    before the final norm, the normed one with ``norm_output``)."""
    feedback = feedback or ("normed" if model.config.norm_output else "prenorm")
    ids = input_ids[lo : a + 1].long()
    feats = model.project(hidden[lo : a + 1])
    drafts = []
    for _ in range(k):
        embeds = model.embed_tokens(ids)
        cos, sin = model.rotary(torch.arange(lo, lo + ids.numel()), feats.dtype)
        x = feats
        for layer in model.layers:
            x = layer(x, cos, sin, None, embeds)
        normed = model.norm(x)
        token = model.draft_ids()[model.lm_head(normed[-1]).argmax()]
        fed = normed[-1] if feedback == "normed" else x[-1]
        drafts.append(int(token))
        ids = torch.cat([ids, token.view(1)])
        feats = torch.cat([feats, fed[None]])
    return drafts


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(norm_output=True, draft_vocab_size=40, layer_style="qwen3"), dict(fc_norm=True, num_layers=3)],
    ids=["base", "norm_output,draft_vocab,qwen3", "fc_norm,3_layers"],
)
def test_chain_drafts_equal_step_by_step_eagle3_serving(generator, changes):
    from peagle.train.evaluate import chain_drafts

    k = 5
    model = make_drafter(generator, num_depths=1, **changes)
    cfg = model.config
    row, input_ids, hidden, _, _ = make_row(generator, 80, 1, cfg.num_aux * cfg.hidden_size)
    docs = row.document_ids
    anchors = torch.nonzero(docs >= 0).squeeze(1)
    anchors = anchors[torch.randperm(anchors.numel(), generator=generator)[:16]].sort().values
    with torch.no_grad():
        first, drafts = chain_drafts(model, input_ids, hidden, docs, anchors, k)
        assert drafts.shape == (anchors.numel(), k)
        wrong_feedback = 0
        for i, a in enumerate(anchors.tolist()):
            lo = int(torch.nonzero(docs == docs[a])[0])
            ref = eagle3_serving_reference(model, input_ids, hidden, lo, a, k)
            assert drafts[i].tolist() == ref, f"anchor {a}"
            assert int(first[a]) == ref[0]
            other = "prenorm" if cfg.norm_output else "normed"
            wrong_feedback += eagle3_serving_reference(model, input_ids, hidden, lo, a, k, other) != ref
    # The check can fail: feeding back the other hidden state (normed vs not) changes later drafts.
    assert wrong_feedback > 0


def test_gradients_reach_every_parameter(generator):
    model = make_drafter(generator, dtype=torch.float32, fc_norm=True)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    hidden = hidden.float().requires_grad_()
    out = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids)
    keep = (row.document_ids[anchors] != -1).float()
    (out.logits.logsumexp(-1) * keep).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    # The mask token's embedding row learns (it is the learnable mask embedding).
    assert model.embed_tokens.weight.grad[cfg.mask_token_id].abs().sum() > 0
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_fc_runs_on_depth0_rows_and_once_on_mask_hidden(generator, monkeypatch):
    model = make_drafter(generator, dtype=torch.float32)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    rows = []
    model.fc.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    model.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids)
    assert rows == [64, 1]
    assert anchors.numel() > 64


def test_bad_shapes_are_named(generator):
    model = make_drafter(generator, dtype=torch.float32)
    ids = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden must be"):
        model.forward_train(ids, torch.zeros(10, 7), ids, ids, ids)
    with pytest.raises(ValueError, match="input_ids"):
        model.forward_train(ids[:5], torch.zeros(10, 96), ids, ids, ids)
    with pytest.raises(ValueError, match="num_heads"):
        tiny_config(num_heads=3)
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=VOCAB)


@pytest.mark.parametrize("changes", [dict(), dict(draft_vocab_size=30, layer_style="qwen3", fc_norm=True)])
def test_checkpoint_round_trip(generator, tmp_path, changes):
    model = make_drafter(generator, dtype=torch.float32, **changes)
    if model.config.uses_draft_vocab:
        model.set_draft_vocab(torch.randperm(VOCAB, generator=generator)[:30].sort().values)
    save_pretrained(model, tmp_path / "ckpt")
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["mask_token_id"] == model.config.mask_token_id
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == model.config.num_depths
    loaded = from_pretrained(tmp_path / "ckpt")
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    row, input_ids, hidden, anchors, depths = make_row(generator, 40, 4, model.config.num_aux * 32)
    with torch.no_grad():
        a = model.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids).logits
        b = loaded.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids).logits
    assert torch.equal(a, b)


def test_checkpoint_weight_names_are_the_servable_layout(generator, tmp_path):
    from safetensors.torch import load_file

    model = make_drafter(generator, dtype=torch.float32, draft_vocab_size=30)
    save_pretrained(model, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    for name in [
        "fc.weight",
        "embed_tokens.weight",
        "lm_head.weight",
        "norm.weight",
        "mask_hidden",
        "d2t",
        "t2d",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.gate_proj.weight",
    ]:
        assert name in names, name
    state = load_file(tmp_path / "model.safetensors")
    assert state["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 32)  # first layer reads 2H
    assert state["mask_hidden"].shape == (1, 1, 96)


def test_missing_checkpoint_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        from_pretrained(tmp_path)


def test_config_from_extracted_data_manifest():
    manifest = {
        **{"kind": "peagle-extracted", "target": "/models/qwen", "hidden_size": 256, "vocab_size": 1000},
        **{"aux_layer_ids": [1, 4, 7], "target_model_type": "qwen3_moe", "target_rms_norm_eps": 1e-5},
        **{"target_num_heads": 8, "target_num_kv_heads": 2, "target_head_dim": 32, "target_intermediate_size": 640},
        "target_architectures": ["Qwen3MoeForCausalLM"],
    }
    cfg = DrafterConfig.from_manifest(manifest, num_layers=2, num_depths=6, mask_token_id=999)
    assert cfg == DrafterConfig(
        hidden_size=256, vocab_size=1000, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
        intermediate_size=640, layer_style="qwen3", rms_norm_eps=1e-5, aux_layer_ids=[1, 4, 7], mask_token_id=999,
        num_depths=6, verifier_name_or_path="/models/qwen", verifier_architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    # Choices override the target's shape; a Llama-like target without optional fields gets the defaults.
    plain = {k: v for k, v in manifest.items() if k not in ("target_architectures", "target_rms_norm_eps")}
    shape = dict(num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128)
    cfg = DrafterConfig.from_manifest(
        {**plain, "target_model_type": "mistral"}, **shape, draft_vocab_size=300, fc_norm=True
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 4, 16, 128)
    assert (cfg.layer_style, cfg.rms_norm_eps, cfg.verifier_architectures) == ("llama", 1e-6, [])
    assert cfg.draft_vocab_size == 300 and cfg.fc_norm and cfg.mask_token_id == 0
    assert DrafterConfig.from_manifest(manifest, layer_style="llama").layer_style == "llama"
    with pytest.raises(ValueError, match=r"extracted-data manifest .* got 'peagle-prepared'"):
        DrafterConfig.from_manifest({**manifest, "kind": "peagle-prepared"})
