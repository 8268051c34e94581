"""Tree verification on the CPU: greedy == brute force and reference, rejection sampling == reference, exact
losslessness by chi-square against enumerated target distributions (with a power check), opcheck and error paths."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

import peagle  # noqa: F401
from peagle.ops import (
    philox_uniforms,
    tree_rejection_sample,
    tree_rejection_sample_reference,
    tree_verify_greedy,
    tree_verify_greedy_reference,
)
from testkit import fresh_seed, random_tree_batch


def assert_outputs_equal(actual, expected):
    for name, a, e in zip(actual._fields, actual, expected, strict=True):
        assert a.dtype == torch.long, name
        assert torch.equal(a, e), f"{name} differs:\n{a}\n{e}"


def steered_probs(generator, tree, vocab, follow=0.8, sharp=3.0):
    """Random target rows where, at most nodes, one child's token is the most likely (so paths go deep)."""
    batch, n_max = tree.parent.shape
    logits = torch.randn(batch, n_max, vocab, generator=generator) * sharp
    idx = torch.arange(n_max)
    valid = (idx[None, :] < tree.num_nodes[:, None]) & (idx[None, :] >= 1)
    boost = valid & (torch.rand(batch, n_max, generator=generator) < follow)
    rows = torch.arange(batch)[:, None].expand(batch, n_max)
    # Boosting every chosen child of the same parent keeps the max unique only for the last one; that is fine.
    logits[rows[boost], tree.parent[boost], tree.tokens[boost]] += 4.0 * sharp
    return torch.softmax(logits, dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# Greedy


def greedy_brute_force(parent, tokens, num_nodes, target):
    """Independent scalar implementation: enumerate every node's root path and keep the longest fully matching one."""
    out_path, out_count, out_emitted, out_last = [], [], [], []
    batch, n_max, _ = target.shape
    for b in range(batch):
        n = int(num_nodes[b])
        best = [int(torch.argmax(target[b, i])) for i in range(n)]
        longest = [0]
        for i in range(1, n):
            path, node = [], i
            while node != 0:
                path.append(node)
                node = int(parent[b, node])
            path = [0, *reversed(path)]
            if all(int(tokens[b, c]) == best[int(parent[b, c])] for c in path[1:]) and len(path) > len(longest):
                longest = path
        toks = [int(tokens[b, c]) for c in longest[1:]] + [best[longest[-1]]]
        out_path.append(longest + [-1] * (n_max - len(longest)))
        out_emitted.append(toks + [-1] * (n_max - len(toks)))
        out_count.append(len(longest) - 1)
        out_last.append(longest[-1])
    return (torch.tensor(out_path), torch.tensor(out_count), torch.tensor(out_emitted), torch.tensor(out_last))


@pytest.mark.parametrize(
    "batch,n_max,vocab,chain",
    [
        (1, 1, 1, False),
        (1, 1, 5, False),
        (3, 2, 4, False),
        (16, 8, 32, False),
        (16, 8, 32, True),
        (7, 33, 40, False),
        (4, 64, 200, False),
        (2, 17, 1000, True),
    ],
)
def test_greedy_matches_brute_force_and_reference(generator, batch, n_max, vocab, chain):
    vocab = max(vocab, n_max - 1)
    wants_deep = n_max > 4 and batch > 4
    deepest = 0
    # Fresh inputs until one accepts a deep path, so that deep paths are checked too: about 1 steered batch of 16 trees
    # of 8 nodes in 1000 accepts no path 2 drafts deep.
    for _ in range(3):
        tree = random_tree_batch(generator, batch, n_max, vocab, chain=chain)
        target = steered_probs(generator, tree, vocab)
        out = tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, target)
        brute = greedy_brute_force(tree.parent, tree.tokens, tree.num_nodes, target)
        for name, a, e in zip(out._fields, out, brute, strict=True):
            assert torch.equal(a, e), f"{name}:\n{a}\n{e}"
        assert_outputs_equal(out, tree_verify_greedy_reference(tree.parent, tree.tokens, tree.num_nodes, target))
        deepest = max(deepest, int(out.num_accepted.max()))
        if not wants_deep or deepest >= 2:
            break
    if wants_deep:
        assert deepest >= 2, "steered trees should accept deep paths"


def test_greedy_ties_int32_logits_and_broadcast_batch(generator):
    tree = random_tree_batch(generator, 6, 10, 12, full=True)
    logits = torch.randn(1, 10, 12, generator=generator).expand(6, 10, 12)  # stride-0 batch, not copied
    logits = logits.clone()
    logits[:, :, 3] = logits[:, :, 5] = logits.amax(dim=-1) + 1  # tie: the smaller token id wins
    logits[:, :, 0] = -math.inf
    p32, t32, n32 = tree.parent.int(), tree.tokens.int(), tree.num_nodes.int()
    out = tree_verify_greedy(p32, t32, n32, logits)
    assert_outputs_equal(out, tree_verify_greedy_reference(tree.parent, tree.tokens, tree.num_nodes, logits))
    assert torch.all(out.emitted_tokens[torch.arange(6), out.num_accepted] == 3)
    base = torch.randn(1, 10, 12, generator=generator)
    assert_outputs_equal(
        tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, base.expand(6, 10, 12)),
        tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, base.expand(6, 10, 12).contiguous()),
    )


def test_greedy_chain_equals_target_greedy_decoding(generator):
    """On a chain the output must be exactly what the target would decode greedily, token for token."""
    vocab, n = 50, 9
    target = torch.softmax(torch.randn(1, n, vocab, generator=generator) * 4, -1)
    best = target.argmax(-1)[0]
    tokens = torch.zeros(1, n, dtype=torch.long)
    tokens[0, 1:] = best[:-1]
    tokens[0, 6] = (best[5] + 1) % vocab  # mismatch at node 6: accept 5 drafts, then the correction best[5]
    parent = torch.arange(-1, n - 1)[None]
    out = tree_verify_greedy(parent, tokens, torch.tensor([n]), target)
    assert out.num_accepted.tolist() == [5]
    assert out.emitted_tokens[0, :6].tolist() == best[:6].tolist()
    assert out.last_node.tolist() == [5]


# ---------------------------------------------------------------------------------------------------------------------
# Rejection sampling == reference


def philox_reference_words():
    """Known-answer vectors of Philox4x32-10 (Random123 kat_vectors): counter, key -> first output word."""
    return [
        ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, 0x408F276D),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
    ]


@pytest.mark.parametrize("counter,key,word", philox_reference_words())
def test_philox_known_answers(counter, key, word):
    c0, c1, c2, c3 = counter
    u = philox_uniforms(key[0] | (key[1] << 32), c2 | (c3 << 32), torch.tensor([c1]), torch.tensor([c0]))
    assert int(u) == word >> 8


def random_sampling_inputs(generator, batch, n_max, vocab, stochastic, chain=False):
    tree = random_tree_batch(generator, batch, n_max, vocab, chain=chain)
    target = steered_probs(generator, tree, vocab, sharp=1.5)
    draft = None
    if stochastic:
        draft = torch.softmax(torch.log(target) + 0.5 * torch.randn(target.shape, generator=generator), -1)
    return tree, target, draft


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(
    "batch,n_max,vocab,chain",
    [
        (1, 1, 1, False),
        (5, 3, 3, False),
        (64, 8, 16, False),
        (64, 8, 16, True),
        (16, 40, 64, False),
        (3, 64, 3000, False),
    ],
)
def test_rejection_sample_matches_reference(generator, stochastic, batch, n_max, vocab, chain):
    tree, target, draft = random_sampling_inputs(generator, batch, n_max, vocab, stochastic, chain)
    seed, offset = fresh_seed(), int(torch.randint(0, 1 << 40, (), generator=generator))
    out = tree_rejection_sample(tree.parent, tree.tokens, tree.num_nodes, target, draft, seed=seed, offset=offset)
    ref = tree_rejection_sample_reference(
        tree.parent, tree.tokens, tree.num_nodes, target, draft, seed=seed, offset=offset
    )
    assert_outputs_equal(out, ref)
    uniforms = torch.rand(batch, n_max, generator=generator)
    out = tree_rejection_sample(tree.parent, tree.tokens, tree.num_nodes, target, draft, uniforms)
    assert_outputs_equal(
        out, tree_rejection_sample_reference(tree.parent, tree.tokens, tree.num_nodes, target, draft, uniforms)
    )
    check_path_contract(tree, out)


def check_path_contract(tree, out):
    """Accepted path: starts at the root, each node a child of the previous, emitted = path tokens + one token."""
    for b in range(tree.parent.shape[0]):
        k = int(out.num_accepted[b])
        path = out.accepted_path[b].tolist()
        assert path[0] == 0 and all(x == -1 for x in path[k + 1 :])
        for d in range(1, k + 1):
            assert int(tree.parent[b, path[d]]) == path[d - 1]
            assert int(out.emitted_tokens[b, d - 1]) == int(tree.tokens[b, path[d]])
        assert int(out.emitted_tokens[b, k]) >= 0 and all(x == -1 for x in out.emitted_tokens[b, k + 1 :].tolist())
        assert int(out.last_node[b]) == path[k]


def test_rejection_sample_seed_determinism_and_offsets(generator):
    tree, target, draft = random_sampling_inputs(generator, 256, 8, 16, True)
    args = (tree.parent, tree.tokens, tree.num_nodes, target, draft)
    a = tree_rejection_sample(*args, seed=5, offset=9)
    assert_outputs_equal(a, tree_rejection_sample(*args, seed=5, offset=9))
    b = tree_rejection_sample(*args, seed=5, offset=10)
    assert not torch.equal(a.emitted_tokens, b.emitted_tokens)


def test_rejection_sample_corner_cases():
    # Target equal to a point mass on the drafted token: always accepted, in both modes.
    vocab = 5
    parent = torch.tensor([[-1, 0, 1]])
    tokens = torch.tensor([[0, 2, 4]])
    target = torch.zeros(1, 3, vocab)
    target[0, 0, 2] = target[0, 1, 4] = target[0, 2, 1] = 1.0
    for draft in (None, torch.full((1, 3, vocab), 1.0 / vocab)):
        for seed in range(20):
            out = tree_rejection_sample(parent, tokens, torch.tensor([3]), target, draft, seed=seed)
            assert out.emitted_tokens.tolist() == [[2, 4, 1]] and out.num_accepted.tolist() == [2]
    # Target with zero mass on the drafted tokens: always rejected; the correction avoids them.
    target = torch.full((1, 3, vocab), 1.0 / vocab)
    target[0, 0] = 0.0
    target[0, 0, 1] = target[0, 0, 3] = 0.5
    tokens = torch.tensor([[0, 2, 4]])
    parent = torch.tensor([[-1, 0, 0]])
    for seed in range(20):
        out = tree_rejection_sample(parent, tokens, torch.tensor([3]), target, seed=seed)
        assert out.num_accepted.tolist() == [0] and int(out.emitted_tokens[0, 0]) in (1, 3)
    # u = 0 accepts any child with positive target mass; u -> 1 samples the last token with mass.
    u = torch.zeros(1, 3)
    target[0, 0, 2] = 0.25
    target[0, 0, 1] = 0.25
    out = tree_rejection_sample(parent, tokens, torch.tensor([3]), target, uniforms=u)
    assert out.num_accepted.tolist() == [1] and out.accepted_path[0, 1].item() == 1


# ---------------------------------------------------------------------------------------------------------------------
# Exact losslessness.
#
# Target "model": the distribution after a node depends on (depth, last token) through a table T[d, t]; the root (depth
# 0, token 0) uses T[0, 0]. Its exact k-token distribution is prod_d T[d, t_d](t_{d+1}) (enumerated below, independent
# of the kernel). Draft model Q[d, t] the same way (P-EAGLE: Q[d] for every token: one pass gives all depths).
# A spec-decoding round emits L >= 1 tokens; the following round would sample from the target after them, so the test
# continues each emitted sequence to 3 tokens with exact target draws and compares the first 1, 2 and 3 tokens with the
# enumerated distributions.

LOSSLESS_VOCAB = 8
LOSSLESS_SAMPLES = 1_000_000
LOSSLESS_DEPTH = 8


def branching_tree(branching: list[int]) -> list[int]:
    """Parent list of a full tree with branching[d] children per node at depth d."""
    parent, frontier = [-1], [0]
    for k in branching:
        nxt = []
        for node in frontier:
            for _ in range(k):
                parent.append(node)
                nxt.append(len(parent) - 1)
        frontier = nxt
    return parent


TREE_SHAPES = {
    "chain": ([-1, 0, 1, 2, 3], False),
    "star": ([-1, 0, 0, 0, 0], False),
    "deep_narrow": ([-1, 0, 0, 1, 1, 3, 5, 6, 6, 7], False),
    "wide_shallow": (branching_tree([5, 2]), False),
    "peagle_cartesian": (branching_tree([3, 2, 2]), True),
}


def model_tables(generator, cartesian: bool):
    """T [D, V, V] target and Q [D, V, V] draft rows; mixed with uniform so every category is well populated."""
    v, d = LOSSLESS_VOCAB, LOSSLESS_DEPTH

    def table(shape):
        raw = torch.distributions.Dirichlet(torch.ones(v)).sample(shape)
        return (0.6 * raw + 0.4 / v).float()

    torch.manual_seed(int(torch.randint(0, 1 << 31, (), generator=generator)))
    target = table((d, v))
    draft = table((d,))[:, None, :].expand(d, v, v).contiguous() if cartesian else table((d, v))
    # Correlate the draft with the target (as a trained drafter would) without making them equal.
    draft = 0.5 * draft + 0.5 * target
    return target, draft / draft.sum(-1, keepdim=True)


def node_depths(parent: list[int]) -> torch.Tensor:
    depth = [0] * len(parent)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    return torch.tensor(depth)


def gumbel_topk_children(generator, q_rows: torch.Tensor, k: int) -> torch.Tensor:
    """k draws without replacement, in draw order, from each row of q (Gumbel top-k == sequential sampling)."""
    gumbel = -torch.log(-torch.log(torch.rand(q_rows.shape, generator=generator).clamp_min(1e-12)))
    return torch.topk(torch.log(q_rows) + gumbel, k, dim=-1).indices


def lossless_inputs(generator, parent_list: list[int], cartesian: bool, stochastic: bool, batch: int):
    target_table, draft_table = model_tables(generator, cartesian)
    n = len(parent_list)
    parent = torch.tensor(parent_list)
    depth = node_depths(parent_list)
    children = [[j for j in range(n) if parent_list[j] == i] for i in range(n)]
    rows = 1 if not stochastic else batch  # deterministic drafts: one tree for the whole batch
    tokens = torch.zeros(rows, n, dtype=torch.long)
    for i in range(n):  # nodes in order: a parent's token is known before its children are drafted
        if not children[i]:
            continue
        q = draft_table[depth[i], tokens[:, i]]  # [rows, V]
        if stochastic:
            drawn = gumbel_topk_children(generator, q, len(children[i]))
        else:
            drawn = torch.topk(q, len(children[i]), dim=-1).indices  # deterministic top-k drafts
        tokens[:, children[i]] = drawn
    flat = (depth[None, :] * LOSSLESS_VOCAB + tokens).reshape(-1)  # row of (depth, token) in the [D * V, V] tables
    target = target_table.reshape(-1, LOSSLESS_VOCAB).index_select(0, flat).view(rows, n, LOSSLESS_VOCAB)
    draft = draft_table.reshape(-1, LOSSLESS_VOCAB).index_select(0, flat).view(rows, n, LOSSLESS_VOCAB)
    if not stochastic:
        tokens = tokens.expand(batch, n)
        target = target.expand(batch, n, LOSSLESS_VOCAB)
        draft = draft.expand(batch, n, LOSSLESS_VOCAB)
    return (parent.expand(batch, n), tokens, torch.full((batch,), n), target, draft), target_table


def continue_to_three(generator, emitted: torch.Tensor, target_table: torch.Tensor) -> torch.Tensor:
    """First three tokens of the generation: emitted tokens, continued by exact target draws where the round ended."""
    seq = emitted[:, :3].clone()
    for k in range(3):
        missing = seq[:, k] < 0
        if not bool(missing.any()):
            continue
        prev = torch.zeros_like(seq[:, 0]) if k == 0 else seq[:, k - 1]
        probs = target_table[k, prev[missing]]
        seq[missing, k] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return seq


def exact_prefix_distribution(target_table: torch.Tensor, length: int) -> torch.Tensor:
    """P(t_1..t_length) by enumeration, flattened in row-major token order."""
    v = LOSSLESS_VOCAB
    table = target_table.double() / target_table.double().sum(-1, keepdim=True)  # the float32 rows, renormalised
    probs = table[0, 0]
    for k in range(1, length):
        probs = (probs[..., None] * table[k].view(*([1] * (k - 1)), v, v)).reshape(*([v] * (k + 1)))
    return probs.reshape(-1)


def lossless_pvalues(generator, sampler, shape: str, stochastic: bool) -> list[float]:
    parent_list, cartesian = TREE_SHAPES[shape]
    inputs, target_table = lossless_inputs(generator, parent_list, cartesian, stochastic, LOSSLESS_SAMPLES)
    emitted = sampler(*inputs)
    seq = continue_to_three(generator, emitted, target_table)
    pvalues = []
    v = LOSSLESS_VOCAB
    for length in (1, 2, 3):
        code = torch.zeros(seq.shape[0], dtype=torch.long)
        for k in range(length):
            code = code * v + seq[:, k]
        observed = torch.bincount(code, minlength=v**length).double()
        expected = exact_prefix_distribution(target_table, length)
        expected = expected / expected.sum() * seq.shape[0]
        assert float(expected.min()) > 20, "categories must be well populated for the chi-square approximation"
        pvalues.append(float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue))
    return pvalues


def op_sampler(stochastic: bool):
    def sample(parent, tokens, num_nodes, target, draft):
        out = tree_rejection_sample(
            parent, tokens, num_nodes, target, draft if stochastic else None, seed=fresh_seed(), offset=0
        )
        return out.emitted_tokens

    return sample


def biased_sampler(generator):
    """The classic mistake: accept child x with min(1, p(x) / q(x)) against the unchanged target p and draft marginal q,
    and on rejection of all children sample from norm(max(0, p - q)). Correct for chains, biased on trees."""

    def sample(parent, tokens, num_nodes, target, draft):
        batch, n, _ = target.shape
        rows = torch.arange(batch)
        cur = torch.zeros(batch, dtype=torch.long)
        after = torch.zeros(batch, dtype=torch.long)
        emitted = torch.full((batch, n), -1, dtype=torch.long)
        count = torch.zeros(batch, dtype=torch.long)
        active = torch.ones(batch, dtype=torch.bool)
        idx = torch.arange(n)
        for _ in range(n + 1):
            mask = (parent == cur[:, None]) & (idx > after[:, None]) & (idx > cur[:, None])
            child = torch.where(mask, idx, n).amin(1)
            done = active & (child >= n)
            p, q = target[rows, cur], draft[rows, cur]
            if bool(done.any()):
                resid = (p - q).clamp(min=0)
                leaf = ~mask.any(1) & (after == cur)
                resid = torch.where((leaf | (resid.sum(1) <= 0))[:, None], p, resid)
                pick = torch.multinomial(resid / resid.sum(1, keepdim=True), 1, generator=generator)[:, 0]
                emitted[rows[done], count[done]] = pick[done]
                active &= ~done
            testing = active & (child < n)
            if not bool(testing.any()):
                break
            c = child.clamp(max=n - 1)
            x = tokens[rows, c]
            ratio = (p[rows, x] / q[rows, x]).clamp(max=1)
            ok = testing & (torch.rand(batch, generator=generator) < ratio)
            after = torch.where(testing & ~ok, c, after)
            emitted[rows[ok], count[ok]] = x[ok]
            count += ok.long()
            cur = torch.where(ok, c, cur)
            after = torch.where(ok, c, after)
        return emitted

    return sample


LOSSLESS_CASES = [(shape, stochastic) for shape in TREE_SHAPES for stochastic in (False, True)]


@pytest.fixture(scope="module")
def lossless_results():
    seed = fresh_seed()
    print(f"lossless seed {seed}")
    generator = torch.Generator().manual_seed(seed)
    return {
        (shape, stochastic): lossless_pvalues(generator, op_sampler(stochastic), shape, stochastic)
        for shape, stochastic in LOSSLESS_CASES
    }


def test_tree_rejection_sampling_is_lossless(lossless_results):
    """Chi-square of the first 1, 2 and 3 generated tokens against the exact target distribution, for every tree shape
    and both draft modes; Bonferroni-corrected over all cases."""
    pvalues = [p for case in LOSSLESS_CASES for p in lossless_results[case]]
    for case in LOSSLESS_CASES:
        print(case, [f"{p:.3g}" for p in lossless_results[case]])
    corrected = min(pvalues) * len(pvalues)
    assert corrected > 1e-3, f"Bonferroni-corrected p = {corrected:.3g}: {lossless_results}"


@pytest.mark.parametrize("stochastic", [False, True])
def test_lossless_test_has_power(stochastic):
    """The same test must reject the biased min(1, p/q) acceptance on trees with siblings."""
    seed = fresh_seed()
    print(f"power seed {seed}")
    generator = torch.Generator().manual_seed(seed)
    pvalues = lossless_pvalues(generator, biased_sampler(generator), "star", stochastic)
    print(f"biased sampler p-values {pvalues}")
    num_tests = 3 * len(LOSSLESS_CASES)
    assert min(pvalues) * num_tests < 1e-3, f"the biased sampler passed: {pvalues}"


# ---------------------------------------------------------------------------------------------------------------------
# opcheck and bad inputs


def test_opcheck(generator):
    tree, target, draft = random_sampling_inputs(generator, 5, 7, 11, True)
    args = (tree.parent, tree.tokens, tree.num_nodes, target)
    torch.library.opcheck(torch.ops.peagle.tree_verify_greedy, args)
    torch.library.opcheck(torch.ops.peagle.tree_rejection_sample, (*args, None, None, 3, 4))
    torch.library.opcheck(torch.ops.peagle.tree_rejection_sample, (*args, draft, None, 3, 4))
    uniforms = torch.rand(5, 7, generator=generator)
    torch.library.opcheck(torch.ops.peagle.tree_rejection_sample, (*args, draft, uniforms, 0, 0))


def test_compiled_round_uses_the_ops(generator):
    tree, target, draft = random_sampling_inputs(generator, 4, 6, 9, True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def round_(parent, tokens, num_nodes, target, draft):
        greedy = tree_verify_greedy(parent, tokens, num_nodes, target)
        sampled = tree_rejection_sample(parent, tokens, num_nodes, target, draft, seed=1, offset=2)
        return greedy.emitted_tokens, sampled.emitted_tokens

    greedy, sampled = round_(tree.parent, tree.tokens, tree.num_nodes, target, draft)
    assert torch.equal(greedy, tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, target).emitted_tokens)
    expected = tree_rejection_sample(tree.parent, tree.tokens, tree.num_nodes, target, draft, seed=1, offset=2)
    assert torch.equal(sampled, expected.emitted_tokens)


def good_inputs():
    parent = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.tensor([[0, 1, 2, 3]])
    num_nodes = torch.tensor([4])
    target = torch.full((1, 4, 5), 0.2)
    draft = torch.full((1, 4, 5), 0.2)
    return parent, tokens, num_nodes, target, draft


def both_ops(parent, tokens, num_nodes, target, draft=None, uniforms=None, greedy=True):
    """Calls the sampling op (and, for inputs greedy also reads, the greedy op) and returns the errors raised."""
    calls = [lambda: tree_rejection_sample(parent, tokens, num_nodes, target, draft, uniforms)]
    if greedy:
        calls.append(lambda: tree_verify_greedy(parent, tokens, num_nodes, target))
    return calls


@pytest.mark.parametrize(
    "mutate,match,greedy",
    [
        (lambda a: a[0].__setitem__((0, 3), 3), r"parent\[0, 3\] must be in \[0, 3\) \(parents come before", True),
        (lambda a: a[0].__setitem__((0, 2), -1), r"parent\[0, 2\] must be in \[0, 2\)", True),
        (lambda a: a[0].__setitem__((0, 0), 0), r"parent\[0, 0\] must be -1", True),
        (
            lambda a: a[1].__setitem__((0, 2), 1),
            r"sibling tokens must be distinct, got duplicate token 1 at node 2",
            True,
        ),
        (lambda a: a[1].__setitem__((0, 3), 5), r"tokens\[0, 3\] must be in \[0, V\) = \[0, 5\), got 5", True),
        (lambda a: a[1].__setitem__((0, 1), -2), r"tokens\[0, 1\] must be in \[0, V\)", True),
        (lambda a: a[2].__setitem__(0, 5), r"num_nodes\[0\] must be in \[1, n_max\] = \[1, 4\], got 5", True),
        (lambda a: a[2].__setitem__(0, 0), r"num_nodes\[0\] must be in \[1, n_max\]", True),
        (lambda a: a[3].__setitem__((0, 0, 2), -0.1), r"target_probs must hold probabilities in \[0, 1\].*-0.1", False),
        (
            lambda a: a[3].__setitem__((0, 0, 2), math.nan),
            r"target_probs must hold probabilities.*nan at \[0, 0, 2\]",
            False,
        ),
        (lambda a: a[3].__setitem__((0, 0, 2), math.inf), r"target_probs must hold probabilities", False),
        (
            lambda a: a[3].__setitem__((0, 0), 0.25),
            r"target_probs row \[0, 0\] must sum to 1 within 0.001, got 1.25",
            False,
        ),
        (lambda a: a[4].__setitem__((0, 0, 1), -1.0), r"draft_probs must hold probabilities", False),
        (
            lambda a: a[4].__setitem__((0, 0), 0.1),
            r"draft_probs row \[0, 0\] must sum to 1 within 0.001, got 0.5",
            False,
        ),
    ],
)
def test_bad_values(mutate, match, greedy):
    args = list(good_inputs())
    mutate(args)
    for call in both_ops(*args, greedy=greedy):
        with pytest.raises(RuntimeError, match=match):
            call()


def test_greedy_nan_and_bad_uniforms():
    parent, tokens, num_nodes, target, draft = good_inputs()
    target[0, 0, 3] = math.nan
    with pytest.raises(
        RuntimeError, match=r"tree_verify_greedy: target_probs must not contain NaN, got NaN at \[0, 0, 3\]"
    ):
        tree_verify_greedy(parent, tokens, num_nodes, target)
    parent, tokens, num_nodes, target, draft = good_inputs()
    for bad in (1.0, -0.5, math.nan):
        uniforms = torch.full((1, 4), bad)
        with pytest.raises(RuntimeError, match=r"uniforms must be in \[0, 1\)"):
            tree_rejection_sample(parent, tokens, num_nodes, target, draft, uniforms)
    # Padding nodes are never read or checked; rows of unvisited nodes neither.
    num_nodes = torch.tensor([1])
    parent[0, 3], tokens[0, 2] = 7, -9
    out = tree_rejection_sample(parent, tokens, num_nodes, target, draft)
    assert out.num_accepted.tolist() == [0]


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(parent=a["parent"][0]), r"parent must be 2-D \[B, n_max\], got shape \[4\]"),
        (lambda a: a.update(parent=a["parent"].float()), r"parent must be int32 or int64, got Float"),
        (lambda a: a.update(tokens=a["tokens"][:, :3]), r"tokens must have parent's shape \[1, 4\], got \[1, 3\]"),
        (lambda a: a.update(num_nodes=a["num_nodes"].expand(2)), r"num_nodes must have shape \[1\], got \[2\]"),
        (lambda a: a.update(target=a["target"].double()), r"target_probs must be float32, got Double"),
        (lambda a: a.update(target=a["target"][:, :3]), r"target_probs must have shape \[1, 4, 5\], got \[1, 3, 5\]"),
        (lambda a: a.update(target=a["target"][0]), r"target_probs must be 3-D \[B, n_max, V\], got shape \[4, 5\]"),
        (lambda a: a.update(draft=a["draft"][..., :4]), r"draft_probs must have shape \[1, 4, 5\], got \[1, 4, 4\]"),
        (lambda a: a.update(draft=a["draft"].half()), r"draft_probs must be float32, got Half"),
        (lambda a: a.update(target=a["target"][..., :0], draft=None), r"target_probs must have 1 <= V <= 4194304"),
        (lambda a: a.update(uniforms=torch.rand(1, 3)), r"uniforms must have shape \[1, 4\], got \[1, 3\]"),
        (lambda a: a.update(uniforms=torch.rand(1, 4).double()), r"uniforms must be float32, got Double"),
    ],
)
def test_bad_shapes_and_dtypes(change, match):
    """(Device mismatches need two backends: cuda_tests/test_tree_verify_cuda.py covers them.)"""
    parent, tokens, num_nodes, target, draft = good_inputs()
    args = {
        "parent": parent,
        "tokens": tokens,
        "num_nodes": num_nodes,
        "target": target,
        "draft": draft,
        "uniforms": None,
    }
    change(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.peagle.tree_rejection_sample(
            args["parent"], args["tokens"], args["num_nodes"], args["target"], args["draft"], args["uniforms"], 0, 0
        )


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 40, 1000, 16384, 40001, 151936])
def test_greedy_argmax_edges(generator, vocab, threads):
    """All -inf rows (first id wins), maxima in the vectorised body and in the tail, and the first NaN's index. One
    request with 3 threads: its rows are reduced in parallel ahead of the walk (the same tokens and errors)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_greedy_argmax_edges(generator, vocab)
    finally:
        torch.set_num_threads(previous)


def check_greedy_argmax_edges(generator, vocab):
    parent, tokens, num_nodes = torch.tensor([[-1]]), torch.tensor([[0]]), torch.tensor([1])
    row = torch.full((1, 1, vocab), -math.inf)
    assert tree_verify_greedy(parent, tokens, num_nodes, row).emitted_tokens.tolist() == [[0]]
    for position in {0, vocab // 3, vocab // 2, vocab - 1}:
        row = torch.randn(1, 1, vocab, generator=generator)
        row[0, 0, position] = 100.0
        assert tree_verify_greedy(parent, tokens, num_nodes, row).emitted_tokens.tolist() == [[position]]
        row[0, 0, :] = 100.0  # all equal: the smallest id
        assert tree_verify_greedy(parent, tokens, num_nodes, row).emitted_tokens.tolist() == [[0]]
        row[0, 0, position] = math.nan
        row[0, 0, vocab - 1] = math.nan
        with pytest.raises(RuntimeError, match=rf"NaN at \[0, 0, {position}\]"):
            tree_verify_greedy(parent, tokens, num_nodes, row)
