"""Gated DeltaNet tree verification / commit and the tree causal conv1d on the CPU, against per-path sequential
references computed in float64."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import (
    causal_conv1d_commit,
    causal_conv1d_commit_reference,
    causal_conv1d_tree,
    causal_conv1d_tree_reference,
    gdn_commit,
    gdn_commit_reference,
    gdn_recurrence_reference,
    gdn_spec_step,
    gdn_spec_step_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
    gdn_tree_verify_slots,
    gdn_tree_verify_slots_reference,
    set_gdn_cache_layers,
)
from peagle.ops.gdn import tree_path
from testkit import random_gdn_inputs, random_gdn_spec_inputs, random_tree, strided_gdn_inputs

KINDS = ["chain", "star", "deep", "random", "forest"]
HEADS = [(1, 1, 16, 8), (2, 4, 16, 24), (2, 2, 32, 16), (1, 3, 8, 33), (2, 16, 8, 12)]  # H, HV, K, V


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    diff = actual.double() - expected
    return float(diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30))


def verify_both(inputs, scale=None, l2norm=False):
    o, u = gdn_tree_verify(*inputs, scale=scale, use_qk_l2norm=l2norm)
    ref = gdn_tree_verify_reference(*inputs, scale=scale, use_qk_l2norm=l2norm, compute_dtype=torch.float64)
    return o, u, ref


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("l2norm", [False, True])
def test_verify_fp32_matches_per_path_reference(generator, kind, heads, l2norm):
    h, hv, kd, vd = heads
    for nodes in (1, 7, 33):
        inputs = random_gdn_inputs(generator, 2, nodes, h, hv, kd, vd, kind=kind)
        o, u, ref = verify_both(inputs, l2norm=l2norm)
        assert o.dtype == torch.float32 and u.dtype == torch.float32 and o.shape == (2, nodes, hv, vd)
        assert rel_rms(o, ref) <= 1e-5, (nodes, rel_rms(o, ref))


@pytest.mark.parametrize("kind", ["deep", "random", "chain"])
def test_verify_64_nodes_and_custom_scale(generator, kind):
    inputs = random_gdn_inputs(generator, 1, 64, 2, 4, 16, 16, kind=kind)
    o, _, ref = verify_both(inputs, scale=0.3, l2norm=True)
    assert rel_rms(o, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2norm", [False, True])
def test_verify_half_inputs_against_fp64(generator, dtype, l2norm):
    inputs = random_gdn_inputs(generator, 3, 24, 2, 4, 32, 32, kind="random", dtype=dtype)
    o, u, ref = verify_both(inputs, l2norm=l2norm)
    assert o.dtype == dtype and u.dtype == torch.float32
    assert rel_rms(o, ref) <= 2e-3


def test_chain_equals_sequential_recurrence(generator):
    inputs = random_gdn_inputs(generator, 2, 40, 2, 4, 16, 8, kind="chain")
    o, _ = gdn_tree_verify(*inputs, use_qk_l2norm=True)
    for b in range(2):
        s0 = inputs.state_pool[int(inputs.slots[b])].double()
        expected, _ = gdn_recurrence_reference(
            inputs.q[b], inputs.k[b], inputs.v[b], inputs.g[b], inputs.beta[b], s0, None, True
        )
        assert rel_rms(o[b], expected) <= 1e-5


def test_verify_reads_the_pool_only(generator):
    inputs = random_gdn_inputs(generator, 2, 9, 1, 2, 8, 8)
    before = inputs.state_pool.clone()
    gdn_tree_verify(*inputs)
    assert torch.equal(before, inputs.state_pool)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("l2norm", [False, True])
def test_commit_matches_sequential_over_accepted_path(generator, kind, l2norm):
    batch, nodes = 4, 20
    inputs = random_gdn_inputs(generator, batch, nodes, 2, 4, 16, 12, kind=kind)
    _, u = gdn_tree_verify(*inputs, use_qk_l2norm=l2norm)
    last = torch.randint(0, nodes, (batch,), generator=generator)
    last[1] = -1  # an inactive request keeps its state
    last[2] = 0  # only the root accepted
    expected = gdn_commit_reference(
        inputs.k,
        inputs.v,
        inputs.g,
        inputs.beta,
        inputs.parent,
        last,
        inputs.state_pool,
        inputs.slots,
        l2norm,
        compute_dtype=torch.float64,
    )
    pool = inputs.state_pool.clone()
    gdn_commit(inputs.k, inputs.g, u, inputs.parent, last, pool, inputs.slots, l2norm)
    for b in range(batch):
        slot = int(inputs.slots[b])
        if last[b] < 0:
            assert torch.equal(pool[slot], inputs.state_pool[slot])
        else:
            assert rel_rms(pool[slot], expected[slot]) <= 1e-5
    untouched = sorted(set(range(pool.shape[0])) - set(inputs.slots.tolist()))
    assert torch.equal(pool[untouched], inputs.state_pool[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2norm", [False, True])
def test_strided_splits_equal_contiguous_bit_for_bit(generator, dtype, l2norm):
    """q/k/v sliced from a fused projection and a pool sliced from a larger cache are read in place (no copy): the
    results equal the contiguous inputs' bit for bit, and commit writes only the pool's view."""
    batch, nodes = 3, 11
    x = random_gdn_inputs(generator, batch, nodes, 2, 6, 16, 12, kind="random", dtype=dtype)
    strided = strided_gdn_inputs(x)
    o, u = gdn_tree_verify(*x, use_qk_l2norm=l2norm)
    o_s, u_s = gdn_tree_verify(*strided, use_qk_l2norm=l2norm)
    assert torch.equal(o_s, o) and torch.equal(u_s, u)
    last = torch.tensor([nodes - 1, -1, 4])
    pool = x.state_pool.clone()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, l2norm)
    gdn_commit(strided.k, strided.g, u, strided.parent, last, strided.state_pool, strided.slots, l2norm)
    assert torch.equal(strided.state_pool, pool)
    cache = strided.state_pool._base
    outside = torch.ones_like(cache, dtype=torch.bool)
    outside[:, 1, :, :, 2 : 2 + x.v.shape[3]] = False
    assert torch.isnan(cache[outside]).all()  # the padding around the view is never written


def test_tensor_cores_flag_keeps_the_exact_path_on_the_cpu(generator):
    """tensor_cores selects the TF32 projections on CUDA only: the CPU result stays the exact one, bit for bit."""
    x = random_gdn_inputs(generator, 2, 17, 1, 2, 8, 8, kind="deep")
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    o_tc, u_tc = gdn_tree_verify(*x, use_qk_l2norm=True, tensor_cores=True)
    assert torch.equal(o_tc, o) and torch.equal(u_tc, u)


def test_rows_that_are_not_contiguous_are_copied(generator):
    """q/k/v whose last dim is strided cannot be read in place: they are copied, and the results do not change."""
    x = random_gdn_inputs(generator, 2, 7, 2, 4, 8, 8, kind="chain")
    q_t = x.q.transpose(2, 3).contiguous().transpose(2, 3)  # same values, stride(-1) = H
    v_t = x.v.transpose(2, 3).contiguous().transpose(2, 3)
    assert q_t.stride(-1) != 1 and v_t.stride(-1) != 1
    o, _ = gdn_tree_verify(*x, use_qk_l2norm=True)
    o_t, u_t = gdn_tree_verify(*x._replace(q=q_t, k=q_t.clone(), v=v_t), use_qk_l2norm=True)
    o_k, u_k = gdn_tree_verify(*x._replace(k=x.q.clone()), use_qk_l2norm=True)
    assert torch.equal(o_t, o_k) and torch.equal(u_t, u_k)
    assert not torch.equal(o_k, o)  # the swap of k above is seen


def test_state_pool_layout_errors(generator):
    x = random_gdn_inputs(generator, 2, 4, 1, 2, 8, 8)
    _, u = gdn_tree_verify(*x)
    last = torch.tensor([1, 2])
    overlapping = x.state_pool[:1].expand(4, -1, -1, -1)  # every slot is the same memory
    for pool in (x.state_pool.transpose(2, 3), overlapping):
        with pytest.raises(RuntimeError, match=r"gdn_commit: state_pool must have contiguous rows .* non-overlapping"):
            gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots)
        with pytest.raises(RuntimeError, match=r"gdn_tree_verify: state_pool must have contiguous rows"):
            gdn_tree_verify(*x._replace(state_pool=pool))


def test_opcheck_strided(generator):
    x = strided_gdn_inputs(random_gdn_inputs(generator, 2, 6, 1, 2, 8, 4, kind="random"))
    torch.library.opcheck(torch.ops.peagle.gdn_tree_verify.default, (*x, None, True))
    _, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    pool = x.state_pool._base.clone()[:, 1, :, :, 2:6]
    pool.copy_(x.state_pool)
    torch.library.opcheck(
        torch.ops.peagle.gdn_commit.default, (x.k, x.g, u, x.parent, torch.tensor([3, -1]), pool, x.slots, True)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_rounds_equal_one_long_sequential_run(generator, dtype):
    """verify -> commit -> verify ... equals the sequential recurrence over all accepted tokens, outputs included."""
    batch, h, hv, kd, vd = 2, 2, 4, 16, 16
    base = random_gdn_inputs(generator, batch, 1, h, hv, kd, vd, dtype=dtype)
    pool, slots = base.state_pool.clone(), base.slots
    initial = pool.clone()
    accepted = [[] for _ in range(batch)]  # per request: (q, k, v, g, beta, o) of accepted nodes
    for round_index in range(6):
        nodes = [1, 5, 16, 33, 9, 64][round_index]
        kind = ["random", "chain", "deep", "star", "forest", "random"][round_index]
        x = random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind=kind, dtype=dtype)
        o, u = gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, x.parent, pool, slots, use_qk_l2norm=True)
        last = torch.randint(0, nodes, (batch,), generator=generator)
        gdn_commit(x.k, x.g, u, x.parent, last, pool, slots, True)
        for b in range(batch):
            for i in tree_path(x.parent[b], int(last[b])):
                accepted[b].append((x.q[b, i], x.k[b, i], x.v[b, i], x.g[b, i], x.beta[b, i], o[b, i]))
    for b in range(batch):
        q, k, v, g, beta, o = (torch.stack(t) for t in zip(*accepted[b], strict=True))
        slot = int(slots[b])
        expected_o, expected_s = gdn_recurrence_reference(q, k, v, g, beta, initial[slot].double(), None, True)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert rel_rms(o, expected_o) <= tol
        assert rel_rms(pool[slot], expected_s) <= 1e-5


def test_verify_under_torch_compile_fake(generator):
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = random_gdn_inputs(generator, 2, 5, 1, 2, 8, 4, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in inputs]
        o, u = gdn_tree_verify(*fake)
        assert o.shape == (2, 5, 2, 4) and o.dtype == torch.bfloat16 and u.dtype == torch.float32


def test_opcheck(generator):
    x = random_gdn_inputs(generator, 2, 6, 1, 2, 8, 4, kind="random")
    torch.library.opcheck(torch.ops.peagle.gdn_tree_verify.default, (*x, None, True))
    _, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    last = torch.tensor([3, -1])
    torch.library.opcheck(
        torch.ops.peagle.gdn_commit.default, (x.k, x.g, u, x.parent, last, x.state_pool.clone(), x.slots, True)
    )
    cx, state, weight, bias = random_conv(generator, 2, 6, 5, 4)
    torch.library.opcheck(torch.ops.peagle.causal_conv1d_tree.default, (cx, x.parent, state, weight, bias, "silu"))
    torch.library.opcheck(torch.ops.peagle.causal_conv1d_commit.default, (cx, x.parent, last, state.clone()))


# ---------------------------------------------------------------------------------------------------------------------
# Causal conv1d over the tree.


def random_conv(generator, batch, nodes, channels, width, dtype=torch.float32):
    x = torch.randn(batch, nodes, channels, generator=generator).to(dtype)
    state = torch.randn(batch, channels, width - 1, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator) * 0.5
    bias = torch.randn(channels, generator=generator) * 0.1
    return x, state, weight, bias


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [2, 4, 7])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_tree_matches_reference(generator, kind, width, activation):
    batch, nodes, channels = 3, 13, 10
    parent = torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
    x, state, weight, bias = random_conv(generator, batch, nodes, channels, width)
    for b_arg in (bias, None):
        out = causal_conv1d_tree(x, parent, state, weight, b_arg, activation)
        ref = causal_conv1d_tree_reference(x, parent, state, weight, b_arg, activation, compute_dtype=torch.float64)
        assert rel_rms(out, ref) <= 1e-6


def test_conv_tree_bf16_and_int32_parent(generator):
    parent = random_tree(generator, 17, "deep").unsqueeze(0).int()
    x, state, weight, bias = random_conv(generator, 1, 17, 40, 4, dtype=torch.bfloat16)
    out = causal_conv1d_tree(x, parent, state, weight.bfloat16(), bias, "silu")
    ref = causal_conv1d_tree_reference(x, parent, state, weight.bfloat16(), bias, "silu", compute_dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and rel_rms(out, ref) <= 4e-3


@pytest.mark.parametrize("kind", KINDS)
def test_conv_commit_and_rounds_equal_plain_causal_conv(generator, kind):
    batch, channels, width = 3, 6, 4
    state = torch.randn(batch, channels, width - 1, generator=generator)
    initial = state.clone()
    weight = torch.randn(channels, width, generator=generator)
    accepted_x = [[] for _ in range(batch)]
    accepted_y = [[] for _ in range(batch)]
    for nodes in (1, 2, 9, 5):
        parent = torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
        x = torch.randn(batch, nodes, channels, generator=generator)
        y = causal_conv1d_tree(x, parent, state, weight)
        last = torch.randint(-1, nodes, (batch,), generator=generator)
        expected_state = causal_conv1d_commit_reference(x, parent, last, state)
        causal_conv1d_commit(x, parent, last, state)
        assert torch.equal(state, expected_state)
        for b in range(batch):
            if last[b] >= 0:
                for i in tree_path(parent[b], int(last[b])):
                    accepted_x[b].append(x[b, i])
                    accepted_y[b].append(y[b, i])
    for b in range(batch):
        if not accepted_x[b]:
            continue
        seq = torch.cat([initial[b], torch.stack(accepted_x[b]).T], dim=1)  # [C, W - 1 + T]
        plain = torch.nn.functional.conv1d(seq[None].double(), weight[:, None].double(), groups=channels)[0].T
        assert rel_rms(torch.stack(accepted_y[b]), plain) <= 1e-6
        assert torch.equal(state[b], seq[:, -(width - 1) :])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input.


def test_verify_errors(generator):
    x = random_gdn_inputs(generator, 2, 4, 2, 4, 8, 8)
    q, k, v, g, beta, parent, pool, slots = x
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: q must be 4-D"):
        gdn_tree_verify(q[0], k, v, g, beta, parent, pool, slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: q, k and v must have the same dtype"):
        gdn_tree_verify(q, k.double(), v, g, beta, parent, pool, slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: q must be float32, bfloat16 or float16"):
        gdn_tree_verify(q.double(), k.double(), v.double(), g, beta, parent, pool, slots)
    with pytest.raises(RuntimeError, match=r"value heads HV must be a positive multiple of the q/k heads H"):
        gdn_tree_verify(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], parent, pool[:, :3], slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: g must have shape \[B, n, HV\]"):
        gdn_tree_verify(q, k, v, g[:, :3], beta, parent, pool, slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: state_pool must be float32"):
        gdn_tree_verify(q, k, v, g, beta, parent, pool.double(), slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: state_pool must be \[P, HV, K, V\]"):
        gdn_tree_verify(q, k, v, g, beta, parent, pool[:, :, :4], slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: parent must be int32 or int64"):
        gdn_tree_verify(q, k, v, g, beta, parent.float(), pool, slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: parent\[1, 2\] must be in \[-1, 2\).*got 2"):
        bad = parent.clone()
        bad[1, 2] = 2
        gdn_tree_verify(q, k, v, g, beta, bad, pool, slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: slots must be in \[0, 4\), got 4 for request 1"):
        gdn_tree_verify(q, k, v, g, beta, parent, pool, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: slots must be \[B\]"):
        gdn_tree_verify(q, k, v, g, beta, parent, pool, slots[:1])
    big = random_gdn_inputs(generator, 1, 65, 1, 1, 4, 4)
    with pytest.raises(RuntimeError, match=r"number of tree nodes n must be in \[1, 64\], got 65"):
        gdn_tree_verify(*big)


def test_commit_errors(generator):
    x = random_gdn_inputs(generator, 2, 4, 1, 2, 8, 8)
    _, u = gdn_tree_verify(*x)
    pool = x.state_pool.clone()
    with pytest.raises(RuntimeError, match=r"gdn_commit: u must be float32"):
        gdn_commit(x.k, x.g, u.double(), x.parent, torch.tensor([0, 1]), pool, x.slots)
    with pytest.raises(RuntimeError, match=r"gdn_commit: last_accepted must be in \[-1, 4\), got 4 for request 0"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([4, 1]), pool, x.slots)
    with pytest.raises(RuntimeError, match=r"gdn_commit: last_accepted must be \[B\]"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([1]), pool, x.slots)
    with pytest.raises(RuntimeError, match=r"gdn_commit: slots of requests with last_accepted >= 0 must be distinct"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([1, 2]), pool, torch.tensor([3, 3]))
    gdn_commit(x.k, x.g, u, x.parent, torch.tensor([1, -1]), pool, torch.tensor([3, 3]))  # inactive may share
    with pytest.raises(RuntimeError, match=r"gdn_commit: slots must be in \[0, 4\), got 99 for request 1"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([-1, 2]), pool, torch.tensor([-5, 99]))  # inactive may be bad
    with pytest.raises(RuntimeError, match=r"gdn_commit: state_pool must have contiguous rows"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([1, 2]), pool.transpose(2, 3), x.slots)
    with pytest.raises(RuntimeError, match=r"gdn_commit: u must be \[B, n, HV, V\]"):
        gdn_commit(x.k, x.g, u[:, :3], x.parent, torch.tensor([1, 2]), pool, x.slots)


def test_conv_errors(generator):
    parent = random_tree(generator, 5, "random").unsqueeze(0)
    x, state, weight, bias = random_conv(generator, 1, 5, 4, 3)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: conv_state must have shape \[B, C, W - 1\]"):
        causal_conv1d_tree(x, parent, state[:, :, :1], weight, bias)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: conv_state must have x's dtype"):
        causal_conv1d_tree(x, parent, state.bfloat16(), weight, bias)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: weight must be \[C, W\] with C = 4 and W >= 2"):
        causal_conv1d_tree(x, parent, state, weight[:3], bias)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: bias must be \[C\]"):
        causal_conv1d_tree(x, parent, state, weight, bias[:2])
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: activation must be None, 'silu'"):
        causal_conv1d_tree(x, parent, state, weight, bias, "relu")
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: parent\[0, 3\] must be in \[-1, 3\)"):
        bad = parent.clone()
        bad[0, 3] = 7
        causal_conv1d_tree(x, bad, state, weight, bias)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_commit: last_accepted must be in \[-1, 5\)"):
        causal_conv1d_commit(x, parent, torch.tensor([5]), state)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_commit: conv_state must be contiguous"):
        causal_conv1d_commit(x, parent, torch.tensor([1]), torch.randn(1, 2, 4).transpose(1, 2))


def test_empty_batch(generator):
    x = random_gdn_inputs(generator, 0, 5, 1, 2, 8, 8)
    o, u = gdn_tree_verify(*x)
    assert o.shape == u.shape == (0, 5, 2, 8)
    gdn_commit(x.k, x.g, u, x.parent, torch.empty(0, dtype=torch.long), x.state_pool, x.slots)
    out = causal_conv1d_tree(torch.randn(0, 5, 3), x.parent, torch.randn(0, 3, 2), torch.randn(3, 3))
    assert out.shape == (0, 5, 3)


def test_conv_width_limit(generator):
    parent = random_tree(generator, 5, "chain").unsqueeze(0)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: the conv width W must be <= 64, got 65"):
        causal_conv1d_tree(torch.randn(1, 5, 3), parent, torch.randn(1, 3, 64), torch.randn(3, 65))
    with pytest.raises(RuntimeError, match=r"causal_conv1d_commit: the conv width W must be <= 64, got 65"):
        causal_conv1d_commit(torch.randn(1, 5, 3), parent, torch.tensor([1]), torch.randn(1, 3, 64))


def full_forgets(generator, g: torch.Tensor, value: float, share: float = 0.2) -> torch.Tensor:
    """``g`` with a ``share`` of its entries (random nodes and value heads) set to ``value``: log decays whose exp is 0
    (the state is forgotten there)."""
    return torch.where(torch.rand(g.shape, generator=generator) < share, torch.full_like(g, value), g)


@pytest.mark.parametrize("gate", ["zero", "strong", "mixed", "-inf", "-1e30"])
def test_verify_gate_and_beta_extremes_int32_indices(generator, gate):
    """Full forgets (g = -inf, or a huge finite g) at random nodes: the closed form once gave NaN (-inf + inf) or a
    decay of 1 (every sum rounding to -1e30) below them; the recurrence stays finite."""
    x = random_gdn_inputs(generator, 2, 24, 2, 4, 16, 16, kind="random")
    g = {"zero": torch.zeros_like(x.g), "strong": torch.full_like(x.g, -30.0), "mixed": x.g * 40}.get(gate)
    if g is None:
        g = full_forgets(generator, x.g, float(gate))
    beta = x.beta.clone()
    beta[:, ::3] = 0.0
    beta[:, 1::3] = 1.0
    x = x._replace(g=g, beta=beta, parent=x.parent.int(), slots=x.slots.int())
    o, u, ref = verify_both(x, l2norm=True)
    assert torch.isfinite(o).all() and rel_rms(o, ref) <= 1e-5
    last = torch.tensor([23, 5], dtype=torch.int32)
    pool = x.state_pool.clone()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True)
    expected = gdn_commit_reference(
        x.k, x.v, x.g, x.beta, x.parent, last, x.state_pool, x.slots, True, compute_dtype=torch.float64
    )
    assert rel_rms(pool, expected) <= 1e-5


def test_cpu_validates_even_when_asked_not_to(generator):
    x = random_gdn_inputs(generator, 1, 4, 1, 1, 4, 4)
    bad = x.parent.clone()
    bad[0, 1] = 1
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: parent\[0, 1\] must be in \[-1, 1\)"):
        gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, bad, x.state_pool, x.slots, validate=False)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: parent\[0, 1\] must be in \[-1, 1\)"):
        causal_conv1d_tree(torch.randn(1, 4, 2), bad, torch.randn(1, 2, 2), torch.randn(2, 3), validate=False)


# ---------------------------------------------------------------------------------------------------------------------
# gdn_tree_verify_slots: the start state read from a state cache, every node's state written into its own slot.


def slots_case(generator, batch, nodes, kind, heads=(2, 4, 16, 80), dtype=torch.float32, extra=5):
    """Inputs with a cache of batch * (nodes + 1) + extra states, random distinct start slots and written slots (some
    -1), and request 0 writing its node 0 into its own start slot (vLLM's case of one accepted token). 80 value
    columns: the CPU row loops' whole register blocks (16 to 64 columns) and a narrower last block."""
    h, hv, kd, vd = heads
    x = random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind=kind, dtype=dtype, pool_extra=0)
    slots = batch * (nodes + 1) + extra
    cache = torch.randn(slots, hv, kd, vd, generator=generator) * 0.3
    perm = torch.randperm(slots, generator=generator)
    start = perm[:batch]
    dest = perm[batch : batch + batch * nodes].view(batch, nodes).clone()
    dest[torch.rand(batch, nodes, generator=generator) < 0.25] = -1
    dest[0, 0] = start[0]
    return x, cache, start, dest


def step_states(x, u, cache, start, dest, l2norm):
    """The state cache a chain of single-node gdn_commit calls leaves: node i's state from its parent's (the start
    state for a root), written to dest[b, i] in the cache's dtype. The same fp32 steps as the op's, so equal to it bit
    for bit."""
    batch, nodes = x.parent.shape
    root, zero = torch.full((1, 1), -1), torch.zeros(1, dtype=torch.long)
    out = cache.clone()
    for b in range(batch):
        states = []
        for i in range(nodes):
            p = int(x.parent[b, i])
            pool = (states[p] if p >= 0 else cache[int(start[b])].float()).clone()[None]
            sl = (slice(b, b + 1), slice(i, i + 1))
            gdn_commit(x.k[sl], x.g[sl], u[sl], root, zero, pool, torch.zeros(1, dtype=torch.long), l2norm)
            states.append(pool[0])
            if dest[b, i] >= 0:
                out[int(dest[b, i])] = pool[0].to(cache.dtype)
    return out


@pytest.mark.parametrize("kind", [*KINDS, "chains"])  # chains: the CPU kernel's register path, with several roots
@pytest.mark.parametrize("l2norm", [False, True])
def test_verify_slots_matches_reference_and_the_verify_commit_path(generator, kind, l2norm):
    batch, nodes = 3, 9
    x, cache, start, dest = slots_case(generator, batch, nodes, kind)
    written = cache.clone()
    o = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, written, start, dest, use_qk_l2norm=l2norm)
    ref_o, ref_cache = gdn_tree_verify_slots_reference(
        x.q, x.k, x.v, x.g, x.beta, x.parent, cache, start, dest, None, l2norm, compute_dtype=torch.float64
    )
    assert rel_rms(o, ref_o) <= 1e-5
    targets = dest[dest >= 0]
    assert rel_rms(written[targets], ref_cache[targets]) <= 1e-5
    others = torch.ones(cache.shape[0], dtype=torch.bool)
    others[targets] = False
    assert others.sum() >= 5 and torch.equal(written[others], cache[others])  # start slots not written stay too
    # Bit for bit: outputs as gdn_tree_verify's, states as single-node commits from the parent's state.
    o_verify, u = gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, x.parent, cache, start, use_qk_l2norm=l2norm)
    assert torch.equal(o, o_verify)
    assert torch.equal(written, step_states(x, u, cache, start, dest, l2norm))


@pytest.mark.parametrize("kind", ["random", "chain", "chains"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_slots_half_cache_rounds_the_fp32_states(generator, dtype, kind):
    """A cache in q's dtype: the start state is read exactly (a bfloat16 one where it is, converted in registers; a
    forest of chains whose later root starts from a slot node 0 overwrote, from a copy) and each written state is the
    fp32 result rounded to nearest even (as .to(dtype) rounds it)."""
    x, cache, start, dest = slots_case(generator, 4, 7, kind, dtype=dtype)
    cache = cache.to(dtype)
    half, full = cache.clone(), cache.float()
    o_half = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, half, start, dest, use_qk_l2norm=True)
    o_full = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, full, start, dest, use_qk_l2norm=True)
    assert torch.equal(o_half, o_full)
    assert torch.equal(half, full.to(dtype)) and not torch.equal(full, half.float())  # rounding happened


@pytest.fixture
def cache_layers():
    """set_gdn_cache_layers at its default (2) during the test, and back to the process's value after it."""
    previous = set_gdn_cache_layers(2)
    yield
    set_gdn_cache_layers(previous)


def test_set_gdn_cache_layers_returns_the_previous_count_and_refuses_fewer_than_one(cache_layers):
    assert set_gdn_cache_layers(36) == 2
    assert set_gdn_cache_layers(1) == 36
    with pytest.raises(RuntimeError, match=r"layers must be >= 1 .*got 0"):
        set_gdn_cache_layers(0)
    assert set_gdn_cache_layers(2) == 1  # the refused call changed nothing


@pytest.mark.parametrize("stores", ["streamed", "cached", "many layers"])
@pytest.mark.parametrize("kind", ["chain", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_slots_large_calls_write_the_same_bits(generator, monkeypatch, cache_layers, kind, dtype, stores):
    """A call that writes many states (18 MiB here), with streaming stores or cached ones (the CPU kernel picks by
    the bytes written times set_gdn_cache_layers; PEAGLE_CPU_STREAMING_BYTES forces either), leaves the same outputs
    and cache as its requests verified one call each (2.3 MiB or less, below the forced threshold; streamed too when
    told 2^62 layers: a count that large is taken, though both store paths give the same bits)."""
    if stores == "many layers":
        monkeypatch.delenv("PEAGLE_CPU_STREAMING_BYTES", raising=False)
        set_gdn_cache_layers(2**62)
    else:
        monkeypatch.setenv("PEAGLE_CPU_STREAMING_BYTES", str(4 << 20) if stores == "streamed" else str(1 << 40))
    batch, nodes = 8 if dtype == torch.float32 else 16, 9
    x = random_gdn_inputs(generator, batch, nodes, 2, 4, 128, 128, kind=kind, dtype=dtype)
    slots = torch.randperm(batch * (nodes + 1), generator=generator)
    start, dest = slots[:batch], slots[batch:].view(batch, nodes)  # every node written
    cache = (torch.randn(batch * (nodes + 1), 4, 128, 128, generator=generator) * 0.3).to(dtype)
    whole, parts = cache.clone(), cache.clone()
    o = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, whole, start, dest, use_qk_l2norm=True)
    for b in range(batch):
        r = slice(b, b + 1)
        o_b = gdn_tree_verify_slots(
            x.q[r], x.k[r], x.v[r], x.g[r], x.beta[r], x.parent[r], parts, start[r], dest[r], use_qk_l2norm=True
        )
        assert torch.equal(o_b, o[r])
    assert torch.equal(whole, parts) and not torch.equal(whole, cache)


def test_verify_slots_bf16_cache_rounds_subnormal_states_exactly(generator):
    """Subnormal states are rounded to bfloat16 as torch rounds them, not flushed to zero (the AVX-512 BF16
    conversion instruction would flush them): rows whose k is 0 only decay, so subnormal start rows stay subnormal."""
    torch.set_flush_denormal(False)  # other tests' pipelines turn flushing on for the process
    x, cache, start, dest = slots_case(generator, 3, 6, "chain", dtype=torch.bfloat16)
    x.k[..., :4] = 0
    cache = cache.bfloat16()
    cache[:, :, :4] *= 1e-38
    half, full = cache.clone(), cache.float()
    gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, half, start, dest)
    gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, full, start, dest)
    written = dest[dest >= 0]
    tiny = full[written, :, :4]
    assert ((tiny.abs() < 2**-126) & (tiny != 0)).float().mean() > 0.5  # the states are subnormal
    assert torch.equal(half, full.to(torch.bfloat16))


def test_verify_slots_writes_nan_states_as_nan(generator):
    x, cache, start, dest = slots_case(generator, 2, 4, "chain", dtype=torch.bfloat16)
    cache = cache.bfloat16()
    cache[int(start[1])] = float("nan")
    gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, cache, start, dest)
    assert torch.isnan(cache[dest[1][dest[1] >= 0]]).all() and not torch.isnan(cache[dest[0][dest[0] >= 0]]).any()


def test_verify_slots_strided_cache_in_place(generator):
    """A cache sliced from a larger buffer is read and written in place: the same results as the dense cache, and
    nothing outside the view is touched."""
    x, cache, start, dest = slots_case(generator, 3, 6, "random")
    strided = strided_gdn_inputs(x._replace(state_pool=cache))
    dense = cache.clone()
    o = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, dense, start, dest, use_qk_l2norm=True)
    view = strided.state_pool
    o_s = gdn_tree_verify_slots(
        strided.q, strided.k, strided.v, x.g, x.beta, x.parent, view, start.int(), dest.int(), use_qk_l2norm=True
    )
    assert torch.equal(o_s, o) and torch.equal(view, dense)
    outside = torch.ones_like(view._base, dtype=torch.bool)
    outside[:, 1, :, :, 2 : 2 + x.v.shape[3]] = False
    assert torch.isnan(view._base[outside]).all()


def test_verify_slots_shared_start_slots_that_nobody_writes(generator):
    x, cache, start, dest = slots_case(generator, 2, 3, "chain")
    shared = int(start[1])
    start = torch.tensor([shared, shared])
    written = cache.clone()
    o = gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, written, start, dest)
    o_verify, _ = gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, x.parent, cache, start)
    assert torch.equal(o, o_verify)
    dest[0, 1] = shared  # request 0 would overwrite the start state request 1 reads too
    with pytest.raises(RuntimeError, match=rf"state_slots\[0, 1\] = {shared} is the start slot of request 1"):
        gdn_tree_verify_slots(x.q, x.k, x.v, x.g, x.beta, x.parent, written, start, dest)


def test_verify_slots_errors(generator):
    x, cache, start, dest = slots_case(generator, 2, 4, "chain", extra=0)
    q, k, v, g, beta, parent = x[:6]
    slots = cache.shape[0]

    def call(cache=cache, start=start, dest=dest, q=q, k=k, v=v):
        gdn_tree_verify_slots(q, k, v, g, beta, parent, cache.clone(), start, dest)

    with pytest.raises(RuntimeError, match=rf"gdn_tree_verify_slots: start_slots must be in \[0, {slots}\), got -1"):
        call(start=torch.tensor([int(start[0]), -1]))
    bad = dest.clone()
    bad[1, 2] = slots
    with pytest.raises(RuntimeError, match=rf"state_slots must be in \[-1, {slots}\), got {slots} for request 1"):
        call(dest=bad)
    bad = dest.clone()
    bad[1, 3] = bad[0, 1] = 7 if 7 not in start.tolist() else 8
    with pytest.raises(RuntimeError, match=r"state_slots other than -1 must be distinct .* got slot (7|8) more than"):
        call(dest=bad)
    bad = dest.clone()
    bad[0, 2] = start[1]
    with pytest.raises(RuntimeError, match=rf"state_slots\[0, 2\] = {int(start[1])} is the start slot of request 1"):
        call(dest=bad)
    with pytest.raises(RuntimeError, match=r"state_cache must be float32 or q's dtype \(BFloat16\), got Half"):
        call(cache=cache.half(), q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16())
    with pytest.raises(RuntimeError, match=r"state_cache must be float32 or q's dtype \(Float\), got Double"):
        call(cache=cache.double())
    with pytest.raises(RuntimeError, match=r"state_cache must be \[P, HV, K, V\]"):
        call(cache=cache[:, :, :3])
    with pytest.raises(RuntimeError, match=r"state_cache must have contiguous rows"):
        call(cache=cache.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(RuntimeError, match=r"state_slots must have shape \[B, n\]"):
        call(dest=dest[:, :3])
    with pytest.raises(RuntimeError, match=r"start_slots must be int32 or int64"):
        call(start=start.float())
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify_slots: parent\[1, 2\] must be in \[-1, 2\)"):
        bad_parent = parent.clone()
        bad_parent[1, 2] = 3
        gdn_tree_verify_slots(q, k, v, g, beta, bad_parent, cache.clone(), start, dest)
    # An error leaves the cache as it was (the checks run before any write).
    kept = cache.clone()
    with pytest.raises(RuntimeError):
        bad = dest.clone()
        bad[1, 3] = slots
        gdn_tree_verify_slots(q, k, v, g, beta, parent, kept, start, bad)
    assert torch.equal(kept, cache)


def test_verify_slots_opcheck_and_fake(generator):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, cache, start, dest = slots_case(generator, 2, 5, "random", heads=(1, 2, 8, 4))
    args = (*x[:6], cache.clone(), start, dest, None, True)
    torch.library.opcheck(torch.ops.peagle.gdn_tree_verify_slots.default, args)
    real = (x.q.bfloat16(), x.k.bfloat16(), x.v.bfloat16(), *x[3:6], cache.bfloat16(), start, dest)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        o = gdn_tree_verify_slots(*fake)
        assert o.shape == x.v.shape and o.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------------
# vLLM's speculative step in one op (gdn_spec_step): the gates, the start slots and the chains' layout around
# gdn_tree_verify_slots, against the token-by-token recurrence.

SPEC_HEADS = (2, 4, 16, 8)  # H, HV, K, V


def spec_step_both(generator, lengths, state_dtype=torch.float32, index_dtype=torch.int32, **step):
    """(op's outputs, op's cache, reference outputs, reference cache, inputs, original cache): q/k/v in the cache's
    dtype (vLLM's bf16 caches come with bf16 activations), one spare slot column per sequence (never written), the
    first sequence resuming from column 0 (no token accepted)."""
    args, state = random_gdn_spec_inputs(
        generator, lengths, columns=max(lengths) + 1, heads=SPEC_HEADS, dtype=state_dtype,
        state_dtype=state_dtype, index_dtype=index_dtype,
    )  # fmt: skip
    args["num_accepted_tokens"][0] = 0
    args.update(step)
    expected_o, expected_cache = gdn_spec_step_reference(initial_state_source=state, **args)
    cache = state.clone()
    o = gdn_spec_step(initial_state_source=cache, **args)
    return o, cache, expected_o, expected_cache, args, state


@pytest.mark.parametrize("lengths", [[4], [3, 3, 3], [4, 2, 1, 3], [1], [6, 5], [1, 6], [3, 0, 2], [2, 0]])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_spec_step_matches_the_token_recurrence(generator, lengths, state_dtype, index_dtype):
    o, cache, expected_o, expected_cache, args, state = spec_step_both(generator, lengths, state_dtype, index_dtype)
    assert o.shape == args["v"].shape and o.dtype == args["v"].dtype
    # bf16: both compute in float32 and round each output and stored state once (one bf16 ulp apart at most).
    exact = state_dtype == torch.float32
    torch.testing.assert_close(o.float(), expected_o, rtol=1e-4 if exact else 2**-7, atol=1e-5)
    torch.testing.assert_close(cache.float(), expected_cache.float(), rtol=1e-5 if exact else 2**-7, atol=1e-6)
    written = torch.zeros(state.shape[0], dtype=torch.bool)
    for s, length in enumerate(lengths):
        written[args["spec_state_indices"][s, :length].long()] = True
    assert torch.equal(cache[~written], state[~written])  # the spare columns and every other slot untouched
    assert not torch.equal(cache[written], state[written])


def test_spec_step_gates_follow_softplus_beta_and_threshold(generator):
    """Large a + dt_bias takes softplus' linear branch (x beta > threshold) for some gates and log1p(exp) for others;
    and a power check: the default beta and threshold give other outputs."""
    args, _ = random_gdn_spec_inputs(generator, [5, 5], heads=SPEC_HEADS, dtype=torch.float32)
    a = args["a"] * 4
    o, cache, expected_o, expected_cache, args, state = spec_step_both(
        generator, [5, 5], a=a, softplus_beta=2.0, softplus_threshold=3.0
    )
    x = (a + args["dt_bias"]) * 2.0
    assert (x > 3.0).any() and (x <= 3.0).any()
    torch.testing.assert_close(o, expected_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-6)
    default = gdn_spec_step(**{**args, "softplus_beta": 1.0, "softplus_threshold": 20.0}, initial_state_source=state)
    assert not torch.allclose(default, o, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bounds", [[0], [0, 0]], ids=["no-sequence", "a-sequence-of-no-token"])
def test_spec_step_empty_batches(generator, bounds):
    args, state = random_gdn_spec_inputs(generator, [3], heads=SPEC_HEADS, dtype=torch.float32)
    no_tokens = {name: t[:0] for name, t in args.items() if name in ("q", "k", "v", "a", "b")}
    cache = state.clone()
    o = gdn_spec_step(**{**args, **no_tokens, "cu_seqlens": torch.tensor(bounds)}, initial_state_source=cache)
    assert o.shape == (0, *args["v"].shape[1:]) and torch.equal(cache, state)


def test_spec_step_errors(generator):
    args, state = random_gdn_spec_inputs(generator, [3, 2], heads=SPEC_HEADS, dtype=torch.float32)
    args["num_accepted_tokens"] = torch.tensor([1, 1], dtype=torch.int32)  # start slots in column 0: the slot cases

    def call(**changes):
        cache = changes.pop("initial_state_source", state.clone())
        gdn_spec_step(**{**args, **changes}, initial_state_source=cache)

    with pytest.raises(
        RuntimeError, match=r"gdn_spec_step: cu_seqlens must run from 0 to the 5 tokens of q, got 0 \.\. 4"
    ):
        call(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"gdn_spec_step: cu_seqlens must not decrease, got 6 then 5 at 2"):
        call(cu_seqlens=torch.tensor([0, 6, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"num_accepted_tokens\[1\] = 4 exceeds the 3 slot columns"):
        call(num_accepted_tokens=torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"a sequence of 3 tokens needs as many slot columns, .* has 2"):
        call(spec_state_indices=args["spec_state_indices"][:, :2])
    with pytest.raises(RuntimeError, match=r"need a row for each of the 2 sequences"):
        call(num_accepted_tokens=args["num_accepted_tokens"][:1])
    with pytest.raises(RuntimeError, match=r"gdn_spec_step: a and b must have the same dtype"):
        call(b=args["b"].bfloat16())
    with pytest.raises(RuntimeError, match=r"gdn_spec_step: spec_state_indices must be int32 or int64"):
        call(spec_state_indices=args["spec_state_indices"].float())
    with pytest.raises(RuntimeError, match=r"gdn_spec_step: A_log must have shape \[HV\]"):
        call(A_log=args["A_log"][:2])
    with pytest.raises(RuntimeError, match=r"gdn_spec_step: q must be 3-D"):
        call(q=args["q"][None])
    # The slot rules are gdn_tree_verify_slots': two sequences writing one slot, a slot out of the cache.
    shared = args["spec_state_indices"].clone()
    shared[1, 1] = shared[0, 2]
    with pytest.raises(RuntimeError, match=r"state_slots other than -1 must be distinct"):
        call(spec_state_indices=shared)
    kept = state.clone()
    outside = args["spec_state_indices"].clone()
    outside[0, 1] = state.shape[0]
    with pytest.raises(RuntimeError, match=rf"state_slots must be in \[-1, {state.shape[0]}\)"):
        call(spec_state_indices=outside, initial_state_source=kept)
    assert torch.equal(kept, state)  # an error leaves the cache as it was
    with pytest.raises(RuntimeError, match=r"state_cache must be float32 or q's dtype"):
        call(initial_state_source=state.double())


def test_spec_step_opcheck_and_fake(generator):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, state = random_gdn_spec_inputs(generator, [3, 3], heads=SPEC_HEADS, dtype=torch.float32)
    torch.library.opcheck(torch.ops.peagle.gdn_spec_step.default, (), {**args, "initial_state_source": state.clone()})
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for name, t in args.items()}
        o = gdn_spec_step(**fake, initial_state_source=mode.from_tensor(state))
        assert o.shape == args["v"].shape and o.dtype == args["v"].dtype


ISA_SCRIPT = """
import hashlib, sys, torch
import peagle
from peagle.ops import gdn_tree_verify, gdn_tree_verify_slots
from testkit import random_gdn_inputs
gen = torch.Generator().manual_seed(int(sys.argv[1]))
digest = hashlib.sha256()
cases = ((torch.float32, (2, 4, 64, 80), "random"), (torch.bfloat16, (1, 2, 48, 128), "random"),
         (torch.bfloat16, (1, 2, 48, 144), "chain"), (torch.float32, (2, 2, 32, 80), "chain"))
for dtype, (h, hv, kd, vd), kind in cases:  # chains take the node-state loop's register path
    x = random_gdn_inputs(gen, 3, 9, h, hv, kd, vd, kind=kind, dtype=dtype, pool_extra=40)
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    cache = x.state_pool.to(dtype)
    dest = torch.arange(3, 30).view(3, 9)
    o2 = gdn_tree_verify_slots(*x[:6], cache, torch.tensor([40, 0, 41]), dest, use_qk_l2norm=True)
    for t in (o, u, o2, cache):
        digest.update(t.float().numpy().tobytes())
# Subnormal and NaN states in a bfloat16 cache: the AVX-512 BF16 conversion hands the groups holding them to the exact
# rounding. Rows 0-3 of every state only decay (k is 0 there), so a subnormal start row stays subnormal.
x = random_gdn_inputs(gen, 2, 5, 1, 2, 16, 80, kind="chain", dtype=torch.bfloat16, pool_extra=20)
x.k[..., :4] = 0
cache = x.state_pool.to(torch.bfloat16)
cache[:, :, :4] *= 1e-38
cache[0, 1] = float("nan")
o = gdn_tree_verify_slots(*x[:6], cache, torch.tensor([20, 0]), torch.arange(2, 12).view(2, 5))
written = cache[2:12].float()
assert ((written.abs() < 2**-126) & (written != 0)).any() and written.isnan().any()
for t in (o, cache):
    digest.update(t.float().numpy().tobytes())
logits = torch.randn(2, 5, 40001, generator=gen)
logits[:, :, 17:40001:997] = logits.amax()  # ties: the first index wins
logits[1, 2, 31000] = float("inf")
out = peagle.ops.tree_verify_greedy(torch.arange(5).expand(2, 5) - 1, torch.zeros(2, 5, dtype=torch.long),
                                    torch.tensor([5, 5]), logits)
digest.update(out.emitted_tokens.numpy().tobytes())
print(digest.hexdigest())
"""


def test_every_cpu_instruction_set_computes_the_same_bits(generator):
    """The row loops (GDN projections and node states, the greedy row argmax) are compiled for baseline x86-64, AVX2,
    AVX-512 and AVX-512 with BF16 conversions, and picked at run time; PEAGLE_CPU_ISA caps the pick. Every version must
    give the same bits (the kernels promise bit-identical results across backends)."""
    import os
    import subprocess
    import sys

    seed = str(int(torch.randint(0, 2**31, (), generator=generator)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = {}
    for isa in ("generic", "avx2", "avx512", "native"):
        env = {**os.environ, "PEAGLE_CPU_ISA": isa, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        run = subprocess.run([sys.executable, "-c", ISA_SCRIPT, seed], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        digests[isa] = run.stdout.strip()
    assert len(set(digests.values())) == 1, digests


# ---------------------------------------------------------------------------------------------------------------------
# The conv pair on a cache of conv states (slots): read and committed in place.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_slots_equal_the_gathered_rows(generator, kind, dtype):
    """With slots, the ops read and commit rows of a larger cache in place: the same outputs and rows as the ops on
    the gathered rows (then scattered back), bit for bit, and every other row untouched."""
    batch, nodes, channels, width, rows = 4, 9, 6, 4, 11
    parent = torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
    x = torch.randn(batch, nodes, channels, generator=generator).to(dtype)
    cache = torch.randn(rows, channels, width - 1, generator=generator).to(dtype)
    weight, bias = torch.randn(channels, width, generator=generator), torch.randn(channels, generator=generator)
    slots = torch.randperm(rows, generator=generator)[:batch]
    last = torch.randint(-1, nodes, (batch,), generator=generator)
    last[0] = nodes - 1
    gathered = cache[slots].clone()
    expected = causal_conv1d_tree(x, parent, gathered, weight, bias, "silu")
    out = causal_conv1d_tree(x, parent, cache, weight, bias, "silu", slots=slots)
    assert torch.equal(out, expected)
    reference = causal_conv1d_tree_reference(x, parent, cache, weight, bias, "silu", torch.float64, slots=slots)
    assert rel_rms(out, reference) <= (1e-6 if dtype == torch.float32 else 4e-3)
    causal_conv1d_commit(x, parent, last, gathered)
    committed = cache.clone()
    causal_conv1d_commit(x, parent, last, committed, slots=slots.int())
    expected_cache = cache.clone()
    expected_cache[slots] = gathered
    assert torch.equal(committed, expected_cache)
    assert torch.equal(committed, causal_conv1d_commit_reference(x, parent, last, cache, slots))
    assert not torch.equal(committed, cache)


def test_conv_slots_errors_and_opcheck(generator):
    parent = random_tree(generator, 5, "random").unsqueeze(0).expand(2, 5).contiguous()
    x = torch.randn(2, 5, 4, generator=generator)
    cache = torch.randn(6, 4, 2, generator=generator)
    weight = torch.randn(4, 3, generator=generator)
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: slots must be in \[0, 6\), got 6 for request 1"):
        causal_conv1d_tree(x, parent, cache, weight, slots=torch.tensor([0, 6]))
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: conv_state must be \[P, C, W - 1\] with C = 4"):
        causal_conv1d_tree(x, parent, cache[:, :3], weight, slots=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: slots must be \[B\] with B = 2"):
        causal_conv1d_tree(x, parent, cache, weight, slots=torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"causal_conv1d_tree: slots must be int32 or int64"):
        causal_conv1d_tree(x, parent, cache, weight, slots=torch.tensor([0.0, 1.0]))
    kept = cache.clone()
    with pytest.raises(RuntimeError, match=r"causal_conv1d_commit: slots of requests with last_accepted >= 0 must be"):
        causal_conv1d_commit(x, parent, torch.tensor([1, 2]), kept, slots=torch.tensor([3, 3]))
    assert torch.equal(kept, cache)
    causal_conv1d_commit(x, parent, torch.tensor([1, -1]), kept, slots=torch.tensor([3, 3]))  # inactive may share
    with pytest.raises(RuntimeError, match=r"causal_conv1d_commit: slots must be in \[0, 6\), got -2 for request 0"):
        causal_conv1d_commit(x, parent, torch.tensor([1, -1]), kept, slots=torch.tensor([-2, 99]))
    slots = torch.tensor([4, 1])
    torch.library.opcheck(
        torch.ops.peagle.causal_conv1d_tree.default, (x, parent, cache, weight, None, "silu", True, slots)
    )
    torch.library.opcheck(
        torch.ops.peagle.causal_conv1d_commit.default, (x, parent, torch.tensor([3, 0]), cache.clone(), True, slots)
    )
