"""Checkpoint compatibility with speculators 0.9.0 (the format vLLM serves): its config class parses our config.json,
and a checkpoint written by speculators' own P-EAGLE model loads into ours weight for weight."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.model import DrafterConfig, PEagleDrafter, from_pretrained, save_pretrained

# speculators 0.9.0 is installed --no-deps by the test environment (requirements/peers.txt): a failure to import it
# is a broken environment, not a reason to skip the compatibility tests (the conftest fixture errors, never skips).


CONFIGS = [
    dict(),
    dict(layer_style="qwen3", draft_vocab_size=50, num_kv_heads=1),
    dict(fc_norm=True, norm_before_residual=True, num_layers=1),
    dict(norm_before_fc=True, num_depths=1),
]


def config(**changes) -> DrafterConfig:
    base = dict(hidden_size=128, vocab_size=100, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64,
                intermediate_size=256, mask_token_id=99, num_depths=5, aux_layer_ids=[1, 2, 3],
                verifier_name_or_path="/models/target")  # fmt: skip
    base.update(changes)
    return DrafterConfig(**base)


@pytest.mark.parametrize("changes", CONFIGS)
def test_speculators_config_class_parses_ours(tmp_path, changes, speculators_peagle):
    ours = config(**changes)
    model = PEagleDrafter(ours)
    save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    parsed = speculators_peagle.PEagleSpeculatorConfig.model_validate(written)
    assert parsed.speculators_model_type == "peagle"
    assert parsed.mask_token_id == ours.mask_token_id
    assert parsed.draft_vocab_size == ours.draft_vocab_size
    assert parsed.eagle_aux_hidden_state_layer_ids == ours.aux_layer_ids
    assert parsed.speculators_config.proposal_methods[0].speculative_tokens == ours.num_depths
    layer = parsed.transformer_layer_config
    assert (layer.model_type, layer.hidden_size, layer.head_dim) == (ours.layer_style, 128, 64)
    assert (layer.num_attention_heads, layer.num_key_value_heads) == (ours.num_heads, ours.num_kv_heads)
    assert (parsed.fc_norm, parsed.norm_before_fc, parsed.norm_before_residual) == (
        ours.fc_norm,
        ours.norm_before_fc,
        ours.norm_before_residual,
    )
    # And back: what speculators writes from it is the same drafter for us.
    assert DrafterConfig.from_speculators_dict(json.loads(parsed.to_json_string())) == ours


@pytest.mark.parametrize("changes", CONFIGS)
def test_speculators_written_checkpoint_loads(tmp_path, changes, speculators_peagle):
    ours = config(**changes)
    layer_config = ours.to_speculators_dict()
    layer_config["transformer_layer_config"]["attn_implementation"] = "sdpa"
    theirs = speculators_peagle.PEagleDraftModel(speculators_peagle.PEagleSpeculatorConfig.model_validate(layer_config))
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in theirs.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor))
        if theirs.t2d is not None:
            ids = torch.randperm(ours.vocab_size)[: ours.draft_vocab_size].sort().values
            theirs.t2d.zero_()
            theirs.t2d[ids] = True
            theirs.d2t.copy_(ids - torch.arange(ids.numel()))
    theirs.save_pretrained(str(tmp_path))
    loaded = from_pretrained(tmp_path)
    assert loaded.config.mask_token_id == ours.mask_token_id
    assert loaded.config.num_depths == ours.num_depths
    state = loaded.state_dict()
    reference = {k: v for k, v in theirs.state_dict().items() if not k.startswith("verifier_")}
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor.reshape(state[name].shape)), name


def eagle3_source(tmp_path, source: str, speculators_peagle) -> dict[str, torch.Tensor]:
    """An EAGLE-3 (K = 1) checkpoint with random weights and a draft vocabulary, written by peagle or by speculators'
    own Eagle3DraftModel; returns its drafter weights."""
    ours = config(num_depths=1, draft_vocab_size=50, mask_token_id=0)
    torch.manual_seed(1)
    if source == "peagle":
        model = PEagleDrafter(ours)
        model.reset_parameters(std=0.5)
        model.set_draft_vocab(torch.randperm(100)[:50].sort().values)
        save_pretrained(model, tmp_path)
        return model.state_dict()
    layout = ours.to_speculators_dict()
    layout["speculators_model_type"] = "eagle3"
    layout.pop("mask_token_id")
    layout["transformer_layer_config"]["attn_implementation"] = "sdpa"
    theirs = speculators_peagle.Eagle3DraftModel(speculators_peagle.Eagle3SpeculatorConfig.model_validate(layout))
    with torch.no_grad():
        for tensor in theirs.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor))
        ids = torch.randperm(100)[:50].sort().values
        theirs.t2d.zero_()
        theirs.t2d[ids] = True
        theirs.d2t.copy_(ids - torch.arange(ids.numel()))
    theirs.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["speculators_model_type"] == "eagle3"
    return {k: v for k, v in theirs.state_dict().items() if not k.startswith("verifier_")}


@pytest.mark.parametrize("source", ["peagle", "speculators"])
def test_warm_start_copies_an_eagle3_checkpoint_and_initialises_the_mask_inputs(tmp_path, source, speculators_peagle):
    from peagle.model import warm_start

    reference = eagle3_source(tmp_path, source, speculators_peagle)
    torch.manual_seed(7)
    drafter = PEagleDrafter(config(num_depths=5, draft_vocab_size=50, mask_token_id=99))
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    report = warm_start(drafter, tmp_path)
    state = drafter.state_dict()
    assert report["source_kind"] == "EAGLE-3"
    assert report["initialised"] == ["mask_hidden", "embed_tokens.weight[99]"]
    assert sorted(report["copied"]) == sorted(k for k in reference if k != "mask_hidden")
    for name in report["copied"]:
        expected = reference[name].reshape(state[name].shape).clone()
        if name == "embed_tokens.weight":
            expected[99] = fresh[name][99]  # the mask row keeps its own initialisation
        assert torch.equal(state[name], expected), name
    assert torch.equal(state["mask_hidden"], fresh["mask_hidden"])
    assert not torch.equal(state["embed_tokens.weight"][99], reference["embed_tokens.weight"][99])
    # The warm-started drafter drafts depth 0 as the EAGLE-3 drafter did (same weights, same draft vocabulary).
    if source == "peagle":
        source_model = from_pretrained(tmp_path)
        ids, hidden = torch.randint(0, 99, (12,)), torch.randn(12, 384)
        with torch.no_grad():
            torch.testing.assert_close(
                drafter.forward_inference(ids, hidden, 0),
                source_model.forward_inference(ids, hidden, 0),
                rtol=1e-4,
                atol=1e-4,
            )
    assert torch.equal(drafter.draft_ids(), reference["d2t"] + torch.arange(50))  # the source's draft vocabulary


def test_warm_start_from_a_peagle_drafter_copies_its_mask_inputs_and_refuses_other_shapes(tmp_path):
    from peagle.model import warm_start

    torch.manual_seed(2)
    source = PEagleDrafter(config())
    source.reset_parameters(std=0.5)
    save_pretrained(source, tmp_path / "peagle")
    drafter = PEagleDrafter(config(num_depths=3))
    report = warm_start(drafter, tmp_path / "peagle")
    assert report["source_kind"] == "P-EAGLE" and report["initialised"] == []
    assert "mask_hidden" in report["copied"] and "embed_tokens.weight[99]" in report["copied"]
    for name, tensor in source.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match=r"num_layers 2 \(ours 1: --layers\)"):
        warm_start(PEagleDrafter(config(num_layers=1)), tmp_path / "peagle")
    with pytest.raises(FileNotFoundError, match="--init-from"):
        warm_start(drafter, tmp_path / "nothing")
