"""The EAGLE-4 drafter options (eh_proj, NoPE, sliding window, MoE, efficient LM head): train/serve parity, each
option against an independent reference, checkpoints (CPU, float64 where exactness)."""

from __future__ import annotations

import json

import pytest
import torch
from test_model import VOCAB, make_drafter, make_row, tiny_config

from peagle.model import PEagleDrafter, from_pretrained, save_pretrained
from peagle.model.config import OPTIONS_KEY
from peagle.model.drafter import routing_balance

OPTION_CASES = [
    dict(eh_proj=True),
    dict(nope=True, layer_style="qwen3"),
    dict(sliding_window=5),
    dict(sliding_window=1, num_layers=3),
    dict(moe_num_experts=4, moe_top_k=2),
    dict(eh_proj=True, nope=True, sliding_window=3, moe_num_experts=3, moe_top_k=1, draft_vocab_size=40),
]
EFFICIENT = dict(efficient_lm_head_rank=6, efficient_lm_head_candidates=10)


def case_id(changes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in changes.items())


@pytest.mark.parametrize("attention", ["sdpa", "sdpa-full"])
@pytest.mark.parametrize("changes", OPTION_CASES, ids=case_id)
def test_train_serve_parity_with_options(generator, changes, attention):
    """Element (a, d) of the training forward == inference on the document prefix ending at a plus d mask tokens."""
    model = make_drafter(generator, **changes)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 96, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    with torch.no_grad():
        out = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids, attention=attention)
    docs = row.document_ids
    valid = torch.nonzero(docs[anchors] != -1).squeeze(1)
    deep, shallow = valid[depths[valid] > 0], valid[depths[valid] == 0]
    pick = torch.cat([deep[torch.randperm(deep.numel(), generator=generator)[:30]], shallow[::8]])
    for e in pick.tolist():
        a, d = int(anchors[e]), int(depths[e])
        start = int(torch.nonzero(docs == docs[a])[0])
        with torch.no_grad():
            logits = model.forward_inference(input_ids[start : a + 1], hidden[start : a + 1], d, start_position=start)
        torch.testing.assert_close(out.logits[e], logits[-1], rtol=1e-10, atol=1e-10, msg=f"element (a={a}, d={d})")
    assert pick.numel() >= 10


def test_options_change_the_logits(generator):
    """Each option really changes the computation (the parity test above could not tell an ignored option)."""
    base = make_drafter(generator, num_layers=1)
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, 4, 3 * 32, mean_doc=40.0)
    with torch.no_grad():
        ref = base.forward_train(input_ids, hidden, anchors, depths, row.document_ids).logits
        for changes in (dict(nope=True), dict(sliding_window=4)):
            other = PEagleDrafter(tiny_config(num_layers=1, **changes)).double()
            other.load_state_dict(base.state_dict())
            logits = other.forward_train(input_ids, hidden, anchors, depths, row.document_ids).logits
            assert not torch.allclose(logits, ref, atol=1e-6), changes


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_is_attention_over_the_last_w_positions(generator, window):
    """One layer: an element under window W == the unwindowed drafter on the prefix it may see (positions > a + d - W,
    never less than its anchor a), with the positions kept."""
    model = make_drafter(generator, num_layers=1, sliding_window=window)
    full = PEagleDrafter(tiny_config(num_layers=1)).double()
    full.load_state_dict(model.state_dict())
    _, input_ids, hidden, _, _ = make_row(generator, 24, 4, 3 * 32)
    with torch.no_grad():
        for a in (0, 5, 17, 23):
            for d in range(4):
                got = model.forward_inference(input_ids[: a + 1], hidden[: a + 1], d)[-1]
                lo = max(0, min(a, a + d - window + 1))
                want = full.forward_inference(input_ids[lo : a + 1], hidden[lo : a + 1], d, start_position=lo)[-1]
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"a={a}, d={d}")


def test_moe_mlp_is_the_routed_mixture_of_its_experts(generator):
    """Each row's MoE output == sum over its top-k experts of the renormalised router probability x expert(row)."""
    model = make_drafter(generator, moe_num_experts=5, moe_top_k=2)
    moe = model.layers[1].mlp
    x = torch.randn(30, 32, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        got = moe(x)
        for i in range(x.shape[0]):
            probs = torch.softmax(moe.gate.weight @ x[i], dim=0)
            top = probs.argsort(descending=True)[:2]
            want = sum(probs[e] / probs[top].sum() * moe.experts[int(e)](x[i]) for e in top)
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)


def test_routing_balance_loss_and_imbalance():
    balanced = torch.full((8, 4), 0.25, dtype=torch.float64)
    picked = torch.arange(8).remainder(4)[:, None]
    loss, imbalance = routing_balance(balanced, picked)
    assert float(loss) == pytest.approx(1.0) and float(imbalance) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]], dtype=torch.float64).expand(8, 4)
    loss, imbalance = routing_balance(skewed, torch.zeros(8, 1, dtype=torch.long))
    assert float(loss) == pytest.approx(4 * 0.7) and float(imbalance) == pytest.approx(4.0)


def test_gradients_reach_every_option_parameter(generator):
    model = make_drafter(generator, dtype=torch.float32, eh_proj=True, moe_num_experts=3, moe_top_k=2)
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    out = model.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids)
    keep = (row.document_ids[anchors] != -1).float()
    loss, imbalance = model.moe_balance()
    ((out.logits.logsumexp(-1) * keep).sum() + loss).backward()
    assert float(imbalance) >= 1.0
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "layers.0.post_mlp_layernorm.weight"} <= set(
        dict(model.named_parameters())
    )
    assert "layers.0.hidden_norm.weight" not in dict(model.named_parameters())  # eh_proj replaces the 2H-wide layer


@pytest.mark.parametrize(
    "changes", [OPTION_CASES[-1], dict(sliding_window=7, nope=True), dict(EFFICIENT, moe_num_experts=2)], ids=case_id
)
def test_checkpoint_round_trip_with_options(generator, tmp_path, changes):
    model = make_drafter(generator, dtype=torch.float32, **changes)
    save_pretrained(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config[OPTIONS_KEY] == model.config.options_dict() != {}
    loaded = from_pretrained(tmp_path / "ckpt")
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    row, input_ids, hidden, anchors, depths = make_row(generator, 40, 4, model.config.num_aux * 32)
    with torch.no_grad():
        a = model.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids).logits
        b = loaded.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids).logits
    assert torch.equal(a, b)


def test_options_off_leave_the_config_json_as_it_was():
    assert OPTIONS_KEY not in tiny_config().to_speculators_dict()
    assert tiny_config().options_dict() == {}


def test_bad_options_are_named():
    for changes, name in [
        (dict(sliding_window=0), "sliding_window"),
        (dict(moe_num_experts=2, moe_top_k=3), "moe_top_k"),
        (dict(efficient_lm_head_rank=33), "efficient_lm_head_rank"),
        (dict(efficient_lm_head_rank=4, efficient_lm_head_candidates=VOCAB + 1), "efficient_lm_head_candidates"),
    ]:
        with pytest.raises(ValueError, match=name):
            tiny_config(**changes)
    with pytest.raises(ValueError, match=OPTIONS_KEY):
        from peagle.model import DrafterConfig

        DrafterConfig.from_speculators_dict(tiny_config().to_speculators_dict() | {OPTIONS_KEY: {"rope": 1}})


def test_vllm_serve_refuses_a_drafter_with_options(generator, tmp_path):
    from peagle.vllm.serve import serve_command

    save_pretrained(make_drafter(generator, dtype=torch.float32, nope=True), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="peagle's engine"):
        serve_command(str(tmp_path / "ckpt"), target="t")
    save_pretrained(make_drafter(generator, dtype=torch.float32), tmp_path / "plain")
    assert serve_command(str(tmp_path / "plain"), target="t")[:3] == ["vllm", "serve", "t"]


def test_efficient_head_init_is_the_frequency_weighted_truncated_svd(generator):
    """D = the top-r right singular vectors of diag(sqrt(f)) W and U = W D^T: the weighted error of U D is the sum of
    the trailing squared singular values (Eckart-Young), and at full rank U D = W."""
    model = make_drafter(generator, efficient_lm_head_rank=6, efficient_lm_head_candidates=8, draft_vocab_size=50)
    model.set_draft_vocab(torch.randperm(VOCAB, generator=generator)[:50].sort().values)
    counts = torch.randint(0, 1000, (VOCAB,), generator=generator).double()
    model.init_efficient_lm_head(counts)
    weight = model.lm_head.weight
    freq = counts[model.draft_ids()] + 1
    singular = torch.linalg.svdvals(freq.sqrt()[:, None] * weight)
    approx = model.lm_head_up.weight @ model.lm_head_down.weight
    error = (freq[:, None] * (weight - approx) ** 2).sum()
    torch.testing.assert_close(error, (singular[6:] ** 2).sum(), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(model.lm_head_down.weight @ model.lm_head_down.weight.T, torch.eye(6).double())
    # The weighting matters: the unweighted SVD has a larger frequency-weighted error.
    model.init_efficient_lm_head()
    uniform = model.lm_head_up.weight @ model.lm_head_down.weight
    assert (freq[:, None] * (weight - uniform) ** 2).sum() > error * 1.001
    full = make_drafter(generator, efficient_lm_head_rank=32, efficient_lm_head_candidates=8)
    full.init_efficient_lm_head()
    torch.testing.assert_close(full.lm_head_up.weight @ full.lm_head_down.weight, full.lm_head.weight)
    with pytest.raises(ValueError, match="token_counts"):
        model.init_efficient_lm_head(counts[:10])


# ---------------------------------------------------------------------------------------------------------------------
# The efficient LM head


def efficient_reference(model: PEagleDrafter, states: torch.Tensor) -> torch.Tensor:
    """Logits of the efficient head by its definition, in plain PyTorch: the C best tokens by the low-rank score
    U (D h) keep their full-head logit W h, every other token gets -inf."""
    cfg = model.config
    scores = states @ model.lm_head_down.weight.T @ model.lm_head_up.weight.T
    ids = scores.topk(cfg.efficient_lm_head_candidates, dim=-1).indices
    full = states @ model.lm_head.weight.T
    return torch.full_like(full, float("-inf")).scatter(-1, ids, full.gather(-1, ids))


def test_efficient_head_serves_the_exact_logits_of_the_low_rank_candidates(generator):
    model = make_drafter(generator, dtype=torch.float32, **EFFICIENT).eval()
    states = torch.randn(64, 32, generator=generator)
    with torch.no_grad():
        got = model.head(states)
        want = efficient_reference(model, states)
        assert torch.equal(got.isinf(), want.isinf())
        assert (got.isfinite().sum(-1) == 10).all()
        torch.testing.assert_close(got[got.isfinite()], want[want.isfinite()], rtol=1e-5, atol=1e-5)
        model.train()  # training scores the whole vocabulary with the full head
        torch.testing.assert_close(model.head(states), states @ model.lm_head.weight.T)


def test_train_serve_parity_with_the_efficient_head(generator):
    """Eval-mode training forward (the efficient head, as evaluation and serving run it) == forward_inference."""
    model = make_drafter(generator, dtype=torch.float32, eh_proj=True, sliding_window=4, **EFFICIENT).eval()
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 64, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    hidden = hidden.float()
    with torch.no_grad():
        out = model.forward_train(input_ids, hidden, anchors, depths, row.document_ids)
    assert out.low_rank_logits is None
    docs = row.document_ids
    valid = torch.nonzero(docs[anchors] != -1).squeeze(1)
    for e in valid[torch.randperm(valid.numel(), generator=generator)[:20]].tolist():
        a, d = int(anchors[e]), int(depths[e])
        start = int(torch.nonzero(docs == docs[a])[0])
        with torch.no_grad():
            logits = model.forward_inference(input_ids[start : a + 1], hidden[start : a + 1], d, start_position=start)
        assert torch.equal(out.logits[e].isinf(), logits[-1].isinf()), f"element (a={a}, d={d})"
        finite = logits[-1].isfinite()
        torch.testing.assert_close(out.logits[e][finite], logits[-1][finite], rtol=1e-4, atol=1e-4)


def test_training_forward_gives_the_low_rank_logits_of_detached_states(generator):
    model = make_drafter(generator, dtype=torch.float32, **EFFICIENT).train()
    cfg = model.config
    row, input_ids, hidden, anchors, depths = make_row(generator, 48, cfg.num_depths, cfg.num_aux * cfg.hidden_size)
    states = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: states.append(inp[0]))
    out = model.forward_train(input_ids, hidden.float(), anchors, depths, row.document_ids)
    torch.testing.assert_close(out.logits, model.lm_head(states[0]))
    torch.testing.assert_close(out.low_rank_logits, model.low_rank_logits(states[0]))
    out.low_rank_logits.sum().backward()
    assert model.lm_head_down.weight.grad is not None and model.lm_head_up.weight.grad is not None
    assert model.fc.weight.grad is None and model.lm_head.weight.grad is None  # the trunk and full head: untouched
