"""The speculative decoding engine (CPU, tiny targets and self-distilled tiny drafters).

Greedy output equals the target's own greedy decoding (Hugging Face ``generate``) in every mode; EOS and
max_new_tokens may stop a request inside an accepted run; the target runner's logits after compaction equal a fresh
forward over the committed sequence for every supported family; the drafter's cached passes equal its uncached
forwards; bad arguments get clear errors; seeds reproduce sampled outputs and batching does not change them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle.decode import SpeculativeDecoder, TargetRunner
from peagle.decode.drafting import Eagle3Drafting, PEagleDrafting, Sampling
from peagle.decode.engine import _Generation
from peagle.decode.harness import CostTable, HarnessPolicy
from peagle.decode.harness.evidence import PAIRED_MEMORY, PairedGains
from peagle.decode.harness.policy import MIN_TRIALS, PAIRED_MINORITY_SHARE
from peagle.model import DrafterConfig, PEagleDrafter, context_limit
from peagle.ops.gdn import tree_path
from peagle.train.evaluate import chain_drafts
from testkit import (
    TINY_FAMILIES,
    flat_cost_table,
    fresh_seed,
    greedy_reference,
    random_tree,
    self_distilled_rows,
    target_aux_states,
    tiny_target,
    train_tiny_drafter,
)

PROMPTS = [[3, 9, 1], [5, 6, 7, 8, 9, 10, 11, 40, 2, 17, 33], [20], [30, 31, 2, 7, 50]]
NEW_TOKENS = 200
# Tree options per method (P-EAGLE: top-k per depth; EAGLE-3: depth, top-k, budget).
OPTIONS = {
    ("peagle", "chain"): {},
    ("peagle", "tree"): dict(topk=[3, 2, 2, 1], num_nodes=12),
    ("eagle3", "chain"): dict(depth=4),
    ("eagle3", "tree"): dict(depth=4, topk=3, num_nodes=12),
    # Decisions by the table and the observed acceptance alone: the tiny target is so cheap that, timed, drafting
    # may lose to plain decoding on the wall clock (the timed harness: test_timed_harness_* below).
    ("peagle", "harness"): dict(cost_table=flat_cost_table(), num_nodes=12, harness_timing=False),
    ("eagle3", "harness"): dict(depth=4, cost_table=flat_cost_table(), num_nodes=12, harness_timing=False),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_setup(family: str, seed: int, **target) -> SimpleNamespace:
    model = tiny_target(family, seed=seed, **target)
    rows = self_distilled_rows(model, seed=seed)
    # The dense P-EAGLE drafter and the hybrid EAGLE-3 drafter use a draft vocabulary (d2t).
    dense = family != "qwen3_next"
    peagle = train_tiny_drafter(model, 4, rows, draft_vocab_size=56 if dense else None)
    eagle3 = train_tiny_drafter(model, 1, rows, draft_vocab_size=None if dense else 56)
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = greedy_reference(model, prompt, NEW_TOKENS)
        return cache[tuple(prompt)]

    return SimpleNamespace(model=model, peagle=peagle, eagle3=eagle3, reference=reference)


@pytest.fixture(scope="module")
def dense(one_thread):
    return make_setup("llama", 1)


@pytest.fixture(scope="module")
def hybrid(one_thread):
    return make_setup("qwen3_next", 2)


@pytest.fixture(scope="module")
def flat(one_thread):
    """A target with a flat distribution (sampled outputs vary with the seed)."""
    return make_setup("llama", 4, logit_scale=0.3)


def decoder(setup, method: str, mode: str, **extra) -> SpeculativeDecoder:
    drafter = setup.peagle if method == "peagle" else setup.eagle3
    return SpeculativeDecoder(setup.model, drafter, mode, method=method, **OPTIONS[(method, mode)], **extra)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize(("method", "mode"), list(OPTIONS))
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_greedy_output_is_the_targets_greedy_output(request, kind, method, mode, batch):
    setup = request.getfixturevalue(kind)
    prompts = PROMPTS if batch == 4 else PROMPTS[1:2]
    out = decoder(setup, method, mode).generate(prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, out.tokens, strict=True):
        assert tokens == setup.reference(prompt)
    metrics = out.metrics
    print(f"{kind} {method} {mode} batch {batch}: AL {metrics.acceptance_length:.2f}, {metrics.tokens_per_s:.0f} tok/s")
    # Real speculation: drafts were accepted, and per-request figures add up to the overall ones.
    assert metrics.acceptance_length > 1.5
    assert metrics.new_tokens == batch * NEW_TOKENS
    assert metrics.request_rounds == sum(r.rounds for r in out.requests)
    assert all(r.finish_reason == "length" and r.new_tokens == NEW_TOKENS for r in out.requests)
    emitted = sum(r.emitted for r in out.requests)
    assert metrics.acceptance_length == pytest.approx(emitted / metrics.request_rounds)
    assert len(metrics.conditional_acceptance) == (4 if method == "peagle" else OPTIONS[(method, mode)]["depth"])
    if mode == "harness":  # the harness verified trees of more than one shape
        assert len({a for r in out.requests for a in r.accepted}) > 1
    assert metrics.drafted_rounds == metrics.rounds  # the flat table's break-even rate is far below these drafters'
    assert metrics.total_s >= metrics.draft_s + metrics.verify_s + metrics.other_s


def test_target_alone_decodes_greedily_one_token_per_forward(dense):
    out = SpeculativeDecoder(dense.model).generate(PROMPTS, 40)
    assert out.tokens == [dense.reference(p)[:40] for p in PROMPTS]
    assert out.metrics.acceptance_length == 1.0
    assert [r.rounds for r in out.requests] == [39] * 4  # prefill emits the first token
    assert out.metrics.drafted_rounds == 0 and out.metrics.harness_call == ""


def costly_drafts_table():
    """Drafting costs about a third of a verify and each verified node a tenth: speculation pays above a per-position
    acceptance rate of about 0.45, and at the policy's prior (0.7) the plan speculates."""
    nodes, batches, depths = [1, 2, 4, 8, 16], [1, 4, 16], 8
    return CostTable(
        batch_sizes=batches,
        contexts=[0],
        verify_nodes=nodes,
        verify_s=[[[10e-3 + 1e-3 * (n - 1) for n in nodes]]] * len(batches),
        draft_widths=[1, 2, 4],
        draft_s=[[[3.5e-3, 4e-3, 5e-3]] * depths] * len(batches),
        pass_s=[[3.5e-3 + 0.5e-3 * k for k in range(depths)]] * len(batches),
    )


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_harness_stops_drafting_where_the_observed_acceptance_loses(dense, method, batch):
    """An untrained drafter (acceptance near 0) under a table whose break-even rate is about 0.45: after MIN_TRIALS
    observations the call decodes without drafting, and its output is still the target's greedy output. (A drafter
    above the break-even rate drafts to the end: the greedy test above, under the flat table.)"""
    table = costly_drafts_table()
    policy = HarnessPolicy(table, 12)
    assert policy.plan(batch, 0).kind != "plain" and 0.3 < policy.break_even_rate(batch, 0) < 0.6
    torch.manual_seed(fresh_seed())
    untrained = PEagleDrafter((dense.peagle if method == "peagle" else dense.eagle3).config).eval()
    prompts = PROMPTS[:batch]
    options = dict(method=method, cost_table=table, num_nodes=12, **(dict(depth=4) if method == "eagle3" else {}))
    options["harness_timing"] = False  # the acceptance rate decides, not the wall clock
    out = SpeculativeDecoder(dense.model, untrained, "harness", **options).generate(prompts, NEW_TOKENS)
    assert out.tokens == [dense.reference(p) for p in prompts]
    m = out.metrics
    # Each drafting round observes at least one trial per live request and at most 1 + depth.
    assert MIN_TRIALS / (5 * batch) <= m.drafted_rounds <= MIN_TRIALS / batch + 1 < m.rounds


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_calls_after_one_where_speculation_lost_decode_plainly_then_probe(dense, method):
    """The decoder's next call after one that stopped drafting decodes without drafting from its start; the call
    after that probes (drafts until it observes MIN_TRIALS again). Outputs stay the target's greedy output."""
    table = costly_drafts_table()
    torch.manual_seed(fresh_seed())
    untrained = PEagleDrafter((dense.peagle if method == "peagle" else dense.eagle3).config).eval()
    options = dict(method=method, cost_table=table, num_nodes=12, **(dict(depth=4) if method == "eagle3" else {}))
    options["harness_timing"] = False  # the acceptance rate decides, not the wall clock
    decoder = SpeculativeDecoder(dense.model, untrained, "harness", **options)
    drafted, starts = [], []
    for prompt in PROMPTS[:3]:
        out = decoder.generate([prompt], NEW_TOKENS)
        assert out.tokens == [dense.reference(prompt)]
        drafted.append(out.metrics.drafted_rounds)
        starts.append(out.metrics.harness_call)
    first, skipped, probe = drafted
    assert MIN_TRIALS / 5 <= first <= MIN_TRIALS + 1 and skipped == 0 and MIN_TRIALS / 5 <= probe <= MIN_TRIALS + 1
    assert starts == ["draft", "plain", "probe"]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_timed_harness_pairs_drafting_and_plain_phases_in_control_calls_losslessly(dense, method, batch, monkeypatch):
    """With harness_timing, while speculating pays the 2nd call of a batch size, then every 2nd while the gains lean
    neither way, is a paired call: it drafts, then decodes a quarter of its tokens plainly, or the other way round
    (every other paired call; the drafter then catches up on the plain rounds' tokens); the calls between draft. The
    gains are held undecided and at 0 here (on the tiny target it is the wall clock's call); every output is the
    target's greedy output, and each paired call's gain is counted."""
    monkeypatch.setattr(PairedGains, "verdict", lambda self: 0.0)
    monkeypatch.setattr(PairedGains, "mean", property(lambda self: 0.0))
    prompts = PROMPTS[:batch] if batch == 4 else PROMPTS[1:2]
    options = dict(OPTIONS[(method, "harness")], harness_timing=True)
    drafter = dense.peagle if method == "peagle" else dense.eagle3
    decoder = SpeculativeDecoder(dense.model, drafter, "harness", method=method, **options)
    phases, starts, phase_of_round, emitted = [], [], [], []
    round_ = _Generation._round

    def recorded(self, *args):
        drafts = self.rounds.drafts
        before = sum(map(len, self.tokens))
        active = round_(self, *args)
        phase_of_round.append(drafts)
        emitted.append(sum(map(len, self.tokens)) - before)
        return active

    monkeypatch.setattr(_Generation, "_round", recorded)
    for _ in range(6):
        phase_of_round.clear()
        emitted.clear()
        out = decoder.generate(prompts, NEW_TOKENS)
        assert out.tokens == [dense.reference(p) for p in prompts]
        m = out.metrics
        starts.append(m.harness_call)
        assert m.drafted_rounds == sum(phase_of_round) and m.acceptance_length > 1.2
        # Runs of drafting (True) and plain (False) rounds.
        phases.append([kind for i, kind in enumerate(phase_of_round) if i == 0 or kind != phase_of_round[i - 1]])
        if m.harness_call == "control":  # a quarter of the tokens plain, to a drafting round's tokens
            plain_tokens = sum(n for n, drafts in zip(emitted, phase_of_round, strict=True) if not drafts)
            assert abs(plain_tokens - len(prompts) * NEW_TOKENS * PAIRED_MINORITY_SHARE) <= len(prompts) * 6
    assert starts == ["draft", "control", "draft", "control", "draft", "control"]
    assert phases == [[True], [True, False], [True], [False, True], [True], [True, False]]
    gains = decoder.policy.paired_gains[decoder.policy.table_key(len(prompts), max(map(len, prompts)))]
    assert gains.calls == pytest.approx(sum((1 - 1 / PAIRED_MEMORY) ** k for k in range(3)))


def test_num_threads_applies_during_generate_only(dense, monkeypatch):
    seen, round_ = [], _Generation._round

    def counted(self, *args):
        seen.append(torch.get_num_threads())
        return round_(self, *args)

    monkeypatch.setattr(_Generation, "_round", counted)
    out = SpeculativeDecoder(dense.model, num_threads=2).generate(PROMPTS[:1], 5)
    assert out.tokens == [dense.reference(PROMPTS[0])[:5]]
    assert set(seen) == {2} and torch.get_num_threads() == 1  # the module's setting is back
    with pytest.raises(ValueError, match="num_threads"):
        SpeculativeDecoder(dense.model, num_threads=0)


@pytest.mark.parametrize(("method", "mode"), [("peagle", "tree"), ("eagle3", "chain")])
def test_long_ragged_prompts_prefill_in_chunks(dense, method, mode):
    """Prompts longer than the target's prefill chunk and the drafter's (256 elements) pass through chunked prefill."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (300, 45, 130)]
    out = decoder(dense, method, mode, prefill_chunk=64).generate(prompts, 30)
    assert out.tokens == [greedy_reference(dense.model, p, 30) for p in prompts]
    assert out.metrics.acceptance_length > 1.2


def run_starts(accepted: list[int]) -> list[tuple[int, int]]:
    """(index of the round's first new token, tokens the round emitted) per round (token 0 comes from prefill)."""
    starts, position = [], 1
    for a in accepted:
        starts.append((position, a + 1))
        position += a + 1
    return starts


@pytest.mark.parametrize(("method", "mode"), [("peagle", "tree"), ("eagle3", "chain")])
def test_eos_and_max_new_tokens_inside_an_accepted_run(dense, method, mode):
    dec = decoder(dense, method, mode)
    free = dec.generate(PROMPTS, 60)
    eos, limits = [], []
    for prompt, tokens, stats in zip(PROMPTS, free.tokens, free.requests, strict=True):
        assert tokens == dense.reference(prompt)[:60]
        # A round that emitted >= 3 tokens, whose second token appears nowhere before it: stop there.
        for start, count in run_starts(stats.accepted):
            if count >= 3 and tokens[start + 1] not in tokens[: start + 1]:
                eos.append(tokens[start + 1])
                limits.append(start + 2)
                break
        else:
            pytest.fail(f"no accepted run of >= 3 tokens with a fresh token in {stats.accepted}")
    for r, prompt in enumerate(PROMPTS):
        stopped = dec.generate([prompt], 60, eos_token_id=eos[r])
        assert stopped.tokens[0] == free.tokens[r][: limits[r]]
        assert stopped.requests[0].finish_reason == "eos"
        assert stopped.requests[0].emitted > limits[r] - 1  # the verifier emitted more; the run was cut at EOS
        cut = dec.generate([prompt], limits[r])
        assert cut.tokens[0] == free.tokens[r][: limits[r]]
        assert cut.requests[0].finish_reason == "length"
        assert cut.requests[0].emitted > limits[r] - 1
    # In a batch every request stops on its own (and a list of EOS ids works).
    both = dec.generate(PROMPTS, 60, eos_token_id=[eos[0], eos[1]])
    for r in range(len(PROMPTS)):
        stop = [i for i, t in enumerate(free.tokens[r]) if t in (eos[0], eos[1])]
        expected = free.tokens[r][: stop[0] + 1] if stop else free.tokens[r]
        assert both.tokens[r] == expected


def test_eos_as_the_first_token_and_a_single_new_token(dense):
    dec = decoder(dense, "peagle", "chain")
    first = dense.reference(PROMPTS[0])[0]
    out = dec.generate(PROMPTS[:2], 50, eos_token_id=first)
    assert out.tokens[0] == [first] and out.requests[0].rounds == 0
    other = dense.reference(PROMPTS[1])[:50]
    assert out.tokens[1] == (other[: other.index(first) + 1] if first in other else other)
    one = dec.generate(PROMPTS, 1)
    assert one.tokens == [[dense.reference(p)[0]] for p in PROMPTS]


# ---------------------------------------------------------------------------------------------------------------------
# Target runner


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_runner_tree_logits_after_compaction_equal_fresh_forwards(family):
    """Ragged prompts through chunked prefill, then rounds of random trees whose nodes' logits (and aux states) equal
    Hugging Face forwards over the committed sequence + the node's path, with a random accepted path per request
    (different lengths) compacted in between."""
    seed = fresh_seed()
    print(f"input seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    extra = dict(sliding_window=7) if family == "mistral" else {}  # the window cuts into the committed prefix
    model = tiny_target(family, vocab_size=97, seed=seed % 1000, successor=False, **extra)
    aux_ids = [1, 3, 4]
    runner = TargetRunner(model, aux_ids, block_size=4, prefill_chunk=5)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (11, 3, 8)]
    runner.allocate(3, 40)
    last, aux = runner.prefill(prompts)
    history = [list(p) for p in prompts]
    for b, prompt in enumerate(prompts):
        torch.testing.assert_close(runner.logits(last[b]), full_logits(model, prompt), rtol=1e-4, atol=1e-4)
        states, _ = target_aux_states(model, torch.tensor(prompt), aux_ids)
        torch.testing.assert_close(aux[b, : len(prompt)], states, rtol=1e-4, atol=1e-4)
    rows = torch.arange(3)
    for nodes, kind in ((9, "random"), (6, "deep"), (1, "chain")):
        parent = torch.stack([random_tree(gen, nodes, kind) for _ in range(3)])
        tokens = torch.randint(0, 97, (3, nodes), generator=gen)
        mask = torch.stack([_ancestors(p) for p in parent])
        depth = mask.sum(-1) - 1
        count = torch.tensor([nodes, max(1, nodes - 2), nodes])  # padding nodes in request 1
        final, tree_aux = runner.forward(rows, [0, 1, 2], tokens, depth, mask, parent, count)
        logits = runner.logits(final)
        last_nodes = []
        for b in range(3):
            for i in range(int(count[b])):
                sequence = history[b] + tokens[b, tree_path(parent[b], i)].tolist()
                torch.testing.assert_close(logits[b, i], full_logits(model, sequence), rtol=1e-4, atol=1e-4)
            check = int(count[b]) - 1
            states, _ = target_aux_states(
                model, torch.tensor(history[b] + tokens[b, tree_path(parent[b], check)].tolist()), aux_ids
            )
            torch.testing.assert_close(tree_aux[b, check], states[-1], rtol=1e-4, atol=1e-4)
            last_nodes.append(int(torch.randint(0, int(count[b]), (), generator=gen)))
        paths = [tree_path(parent[b], last_nodes[b]) for b in range(3)]
        accepted_path = torch.full((3, nodes), -1, dtype=torch.long)
        for b, path in enumerate(paths):
            accepted_path[b, : len(path)] = torch.tensor(path)
        num_accepted = torch.tensor([len(p) - 1 for p in paths])
        runner.commit(rows, [0, 1, 2], accepted_path, num_accepted, torch.tensor(last_nodes), num_accepted.tolist())
        for b in range(3):
            history[b] += tokens[b, paths[b]].tolist()
        assert runner.kv.seq_len.tolist() == [len(h) for h in history] == runner.kv.host_len


def _ancestors(parent: torch.Tensor) -> torch.Tensor:
    nodes = parent.numel()
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        mask[i, tree_path(parent, i)] = True
    return mask


def test_unsupported_target_family_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral"):
        SpeculativeDecoder(model)
    with pytest.raises(TypeError, match="target must be a model directory or a transformers module"):
        SpeculativeDecoder(42)


# ---------------------------------------------------------------------------------------------------------------------
# Drafter cache parity


def random_drafter(gen: torch.Generator, num_depths: int, **changes) -> PEagleDrafter:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    config = dict(hidden_size=32, vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=48, aux_layer_ids=[1, 2, 3], mask_token_id=60, num_depths=num_depths)  # fmt: skip
    model = PEagleDrafter(DrafterConfig(**{**config, **changes}))
    model.reset_parameters(std=0.2)
    return model.double().eval()


def feed(drafting, tokens: torch.Tensor, hidden: torch.Tensor, start: list[int], lengths: list[int]) -> None:
    """Pending elements start[b] .. start[b] + lengths[b] - 1 of each request's (tokens [B, T], hidden [B, T, A])."""
    index = (torch.tensor(start)[:, None] + torch.arange(max(lengths))).clamp(max=tokens.shape[1] - 1)
    rows = torch.arange(len(lengths))
    drafting.set_pending(rows, rows.tolist(), tokens.gather(1, index),
                         hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[2])), lengths)  # fmt: skip


def random_prefix(gen: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 60, (batch, length), generator=gen)
    return tokens, torch.randn(batch, length, 96, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("changes", [{}, dict(layer_style="qwen3", draft_vocab_size=40)])
def test_cached_peagle_pass_equals_forward_inference(changes):
    assert_cached_pass_equals_forward_inference(changes)


def assert_cached_pass_equals_forward_inference(changes: dict) -> None:
    """Elements committed over several passes (the first longer than a prefill chunk) then K - 1 mask elements give
    the distributions of forward_inference on the whole prefix (a drafter built with ``changes``); mask elements never
    enter the cache."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 4, **changes)
    drafting = PEagleDrafting(model, 61, "chain", 4, [1] * 4, 5)
    batch = 3
    tokens, hidden = random_prefix(gen, batch, 300)
    drafting.allocate(batch, 308, 8, block_size=16)
    seen = [0] * batch
    for lengths in ([290, 3, 270], [2, 5, 1], [4, 1, 3]):
        feed(drafting, tokens, hidden, seen, lengths)
        logits, _ = drafting.run_pending(torch.arange(batch), list(range(batch)), 3, 4)
        for b in range(batch):
            seen[b] += lengths[b]
            expected = model.forward_inference(tokens[b, : seen[b]], hidden[b, : seen[b]], 3)[seen[b] - 1 :]
            torch.testing.assert_close(logits[b], expected, rtol=1e-9, atol=1e-9)
        assert drafting.cache.seq_len.tolist() == seen == drafting.cache.host_len


def test_appended_pending_elements_catch_up_in_the_next_pass():
    """Rounds that did not draft (a paired call's plain phase) append their element to the pending ones, one round at
    a time and past the pending buffer's width; the next pass takes them all in and gives the distributions of
    forward_inference on the whole prefix."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 4)
    drafting = PEagleDrafting(model, 61, "chain", 4, [1] * 4, 5)
    batch = 3
    tokens, hidden = random_prefix(gen, batch, 80)
    drafting.allocate(batch, 88, 8, block_size=16)
    prompt = [5, 2, 7]
    feed(drafting, tokens, hidden, [0] * batch, prompt)
    seen = list(prompt)
    rows = torch.arange(batch)
    for _ in range(30):  # plain rounds: each request's next element
        index = torch.tensor(seen)[:, None]
        element = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[2]))
        drafting.set_pending(rows, rows.tolist(), tokens.gather(1, index), element, [1] * batch, append=True)
        seen = [n + 1 for n in seen]
    assert drafting.host_pending == seen
    logits, _ = drafting.run_pending(rows, rows.tolist(), 3, 4)
    for b in range(batch):
        expected = model.forward_inference(tokens[b, : seen[b]], hidden[b, : seen[b]], 3)[seen[b] - 1 :]
        torch.testing.assert_close(logits[b], expected, rtol=1e-9, atol=1e-9)


def reference_probs(model: PEagleDrafter, tokens: torch.Tensor, hidden: torch.Tensor, path: list[int]) -> torch.Tensor:
    """Draft distribution (draft vocab) after the drafted target ids ``path`` from the prefix, without any cache:
    autoregressive EAGLE-3 drafting (each drafted element's features = the hidden state produced before it)."""
    length = tokens.numel()
    ids, feats = tokens, model.project(hidden)
    logits, out = model.forward_features(ids, feats, torch.arange(length))
    for j, token in enumerate(path, start=1):
        ids = torch.cat([ids, torch.tensor([token])])
        feats = torch.cat([feats, out[-1:]])
        positions = torch.cat([torch.arange(length), length - 1 + torch.arange(1, j + 1)])
        logits, out = model.forward_features(ids, feats, positions)
    return torch.softmax(logits[-1].double(), -1)


def eagle3(model, mode, depth, topk, num_nodes) -> Eagle3Drafting:
    return Eagle3Drafting(model, 61, mode, depth, topk, num_nodes)


def test_cached_eagle3_chain_equals_chain_drafts():
    """Greedy EAGLE-3 chains over the cache equal evaluate.chain_drafts (vLLM's eagle3 proposer without a cache), also
    after a second round of committed elements (the first round's temporary entries are gone)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 1, draft_vocab_size=50)
    drafting = eagle3(model, "chain", 5, 1, 6)
    batch = 3
    tokens, hidden = random_prefix(gen, batch, 40)
    drafting.allocate(batch, 48, 30, block_size=4)
    seen = [0] * batch
    greedy = Sampling(0.0, False, torch.zeros(batch, dtype=torch.long), 0)
    for lengths in ([30, 7, 19], [3, 1, 6]):
        feed(drafting, tokens, hidden, seen, lengths)
        tree = drafting.draft(torch.arange(batch), list(range(batch)), torch.zeros(batch, dtype=torch.long), greedy)
        assert tree.parent.tolist() == [list(range(-1, 5))] * batch
        for b in range(batch):
            seen[b] += lengths[b]
            end = seen[b]
            _, drafts = chain_drafts(model, tokens[b, :end], hidden[b, :end], torch.zeros(end, dtype=torch.long),
                                     torch.tensor([end - 1]), 5)  # fmt: skip
            assert tree.tokens[b, 1:].tolist() == drafts[0].tolist()


@pytest.mark.parametrize("gumbel", [False, True])
def test_eagle3_tree_nodes_follow_the_uncached_drafter(gumbel):
    """Every node of an EAGLE-3 tree (EAGLE-2 dynamic tree when greedy, the depth-by-depth sampled tree otherwise) is
    drafted from the distribution the uncached drafter gives after its path: a top-k token of it, and the recorded
    draft probabilities (sampled) are that distribution."""
    gen = torch.Generator().manual_seed(fresh_seed())
    model = random_drafter(gen, 1, draft_vocab_size=50)
    topk, depth, budget = 3, 4, 14
    drafting = eagle3(model, "tree", depth, topk, budget)
    batch = 2
    tokens, hidden = random_prefix(gen, batch, 20)
    drafting.allocate(batch, 40, 20, block_size=8)
    lengths = [20, 13]
    feed(drafting, tokens, hidden, [0, 0], lengths)
    sampling = Sampling(0.7 if gumbel else 0.0, gumbel, torch.tensor([5, 6]), 3)
    tree = drafting.draft(torch.arange(batch), [0, 1], torch.tensor([7, 8]), sampling)
    draft_ids = model.draft_ids()
    for b in range(batch):
        count = int(tree.num_nodes[b])
        assert count == budget
        for i in range(1, count):
            path = tree_path(tree.parent[b], i)
            probs = reference_probs(
                model, tokens[b, : lengths[b]], hidden[b, : lengths[b]], tree.tokens[b, path[1:-1]].tolist()
            )
            token = int(torch.nonzero(draft_ids == tree.tokens[b, i]))
            if gumbel:
                q = torch.softmax(torch.log(probs) / 0.7, -1)
                parent_row = tree.draft_probs[b, path[-2], draft_ids]
                torch.testing.assert_close(parent_row.double(), q, rtol=1e-4, atol=1e-6)
            else:
                assert probs[token] >= torch.topk(probs, topk).values[-1] - 1e-12


# ---------------------------------------------------------------------------------------------------------------------
# Seeds and arguments


@pytest.mark.parametrize(
    ("method", "mode", "draft_sampling"),
    [("peagle", "tree", "gumbel"), ("peagle", "chain", "topk"), ("eagle3", "tree", "gumbel")],
)
def test_seeds_reproduce_and_batching_does_not_change_a_request(flat, method, mode, draft_sampling):
    dec = decoder(flat, method, mode, draft_sampling=draft_sampling)
    sample = dict(temperature=1.0, top_p=0.95, top_k=40)
    first = dec.generate(PROMPTS, 40, seed=[11, 12, 13, 14], **sample)
    assert dec.generate(PROMPTS, 40, seed=[11, 12, 13, 14], **sample).tokens == first.tokens
    assert dec.generate(PROMPTS, 40, seed=11, **sample).tokens == first.tokens  # an int seed s gives s + i
    other = dec.generate(PROMPTS, 40, seed=[21, 22, 23, 24], **sample)
    # Different seeds give different samples (a request may still repeat one: its text is very likely).
    assert sum(a != b for a, b in zip(first.tokens, other.tokens, strict=True)) >= 3
    # A request's output depends only on its prompt and seed: alone, or batched with other requests.
    alone = dec.generate([PROMPTS[2]], 40, seed=[13], **sample)
    assert alone.tokens[0] == first.tokens[2]
    mixed = dec.generate([PROMPTS[0], PROMPTS[2], [7] * 30], 40, seed=[99, 13, 5], **sample)
    assert mixed.tokens[1] == first.tokens[2]
    assert first.metrics.acceptance_length > 1.0


def test_a_request_that_would_pass_the_targets_positions_is_refused_up_front(dense, monkeypatch):
    # A new user's first try: a 120-token prompt and 30 new tokens on a target built for 128 positions. Hugging Face
    # only warns; the engine refuses before anything runs (no prefill), naming the prompt, its length, the tokens
    # asked for and the limit.
    model = tiny_target("llama", seed=1, max_position_embeddings=128)
    long_prompt = [(7 * i) % 60 + 1 for i in range(120)]
    prefills = []
    for drafter in (None, dense.peagle):
        dec = SpeculativeDecoder(model, drafter)
        assert dec.max_positions == 128
        monkeypatch.setattr(dec.runner, "prefill", lambda *a: prefills.append(a))
        message = (
            r"prompts\[1\] has 120 tokens and max_new_tokens = 30 asks for 30 more: 150 positions pass the target's "
            r"max_position_embeddings = 128 \(at most 8 new tokens there"
        )
        with pytest.raises(ValueError, match=message):
            dec.generate([[1, 2, 3], long_prompt], 30)
        with pytest.raises(ValueError, match=r"prompts\[0\] has 128 tokens .* \(no room for a new token"):
            dec.generate([long_prompt + long_prompt[:8]], 1)
        assert prefills == []
        monkeypatch.undo()
        # Up to the limit exactly, it decodes the target's own greedy text.
        out = dec.generate([long_prompt], 8, temperature=0.0)
        assert out.tokens[0] == greedy_reference(model, long_prompt, 8)
    # A config that names no limit is not checked.
    assert context_limit(SimpleNamespace()) is None and context_limit(model.config) == 128


def test_bad_arguments_get_clear_errors(dense, hybrid):
    model, drafter = dense.model, dense.peagle
    cases = [
        (dict(mode="bush"), ValueError, "mode must be 'chain', 'tree' or 'harness', got 'bush'"),
        (dict(mode="harness"), ValueError, "mode 'harness' needs cost_table: a CostTable or the JSON file"),
        (dict(mode="tree", cost_table=flat_cost_table()), ValueError, "cost_table is for mode 'harness'"),
        (dict(mode="harness", cost_table=flat_cost_table(), num_nodes=1), ValueError, "num_nodes must be an int >= 2"),
        (dict(draft_sampling="beam"), ValueError, "draft_sampling must be 'gumbel' or 'topk'"),
        (dict(method="medusa"), ValueError, "method must be 'peagle' or 'eagle3', got 'medusa'"),
        (dict(depth=5), ValueError, r"depth must be an int in \[1, 4\] \(the drafter's K\), got 5"),
        (dict(mode="tree", topk=[2, 2]), ValueError, r"topk must be an int or 4 ints in \[1, 56\]"),
        (dict(mode="tree", topk=0), ValueError, r"topk must be an int or 4 ints"),
        (dict(mode="tree", num_nodes=1), ValueError, "num_nodes must be an int >= 2"),
        (dict(method="eagle3", depth=0), ValueError, "depth must be an int >= 1, got 0"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            SpeculativeDecoder(model, drafter, **kwargs)
    with pytest.raises(TypeError, match="drafter must be a checkpoint directory, a PEagleDrafter or None"):
        SpeculativeDecoder(model, 3)
    with pytest.raises(ValueError, match="need a drafter"):
        SpeculativeDecoder(model, None, topk=2)
    with pytest.raises(ValueError, match="mode 'harness' needs a drafter"):
        SpeculativeDecoder(model, None, "harness", cost_table=flat_cost_table())
    with pytest.raises(ValueError, match=r"drafter \(hidden_size 64, vocab_size 64\) does not fit the target"):
        SpeculativeDecoder(tiny_target("llama", vocab_size=80), drafter)
    with pytest.raises(ValueError, match="a hybrid target verifies at most 64 nodes per tree"):
        SpeculativeDecoder(hybrid.model, hybrid.eagle3, "tree", depth=8, topk=5, num_nodes=80)
    dec = SpeculativeDecoder(model, drafter)
    calls = [
        (dict(prompts=[]), "prompts must be a non-empty list of token-id lists"),
        (dict(prompts=[[1], []]), r"prompts\[1\] must be a non-empty list of token ids"),
        (dict(prompts=[[1, 64]]), r"prompts\[0\] must hold token ids in \[0, 64\)"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
        (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_k=-1), "top_k must be an int >= 0"),
        (dict(seed=[1]), r"seed must be an int or 2 ints \(one per request\), each in \[0, 2\^32\)"),
        (dict(seed=-3), "seed must be an int or 2 ints"),
        (dict(eos_token_id=64), r"eos_token_id must be None, a token id or token ids in \[0, 64\)"),
    ]
    for kwargs, message in calls:
        arguments = {"prompts": [[1, 2], [3]], "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            dec.generate(**arguments)
