"""Gated DeltaNet tree ops on CUDA: CUDA op == CPU op bit for bit (both follow the fp32 operation order of
csrc/include/peagle/gdn.h; the CPU tests hold the CPU op to the fp64 per-path reference)."""

from __future__ import annotations

import os

import pytest
import torch

from peagle.ops import (
    causal_conv1d_commit,
    causal_conv1d_tree,
    check_errors,
    deferred_checks,
    gdn_commit,
    gdn_recurrence_reference,
    gdn_spec_step,
    gdn_spec_step_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
    gdn_tree_verify_slots,
)
from peagle.ops.gdn import tree_path
from testkit import gdn_inputs_to, random_gdn_inputs, random_gdn_spec_inputs, random_tree, strided_gdn_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KINDS = ["chain", "star", "deep", "random", "forest"]
SHAPES = [(1, 1, 16, 8), (2, 4, 16, 24), (4, 8, 128, 128), (2, 4, 64, 200), (1, 2, 256, 64)]  # H, HV, K, V


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    diff = actual.double().cpu() - expected
    return float(diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30))


def to_cuda(inputs):
    return gdn_inputs_to(inputs, "cuda")


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, *context) -> None:
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, context
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    assert same.all(), (*context, f"{int((~same).sum())} of {same.numel()} differ", rel_rms(actual, expected))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("nodes", [1, 17, 64])
def test_verify_cuda_equals_cpu(generator, kind, shape, l2norm, nodes):
    h, hv, kd, vd = shape
    x = random_gdn_inputs(generator, 3, nodes, h, hv, kd, vd, kind=kind)
    o, u = gdn_tree_verify(*x, use_qk_l2norm=l2norm)
    o_cuda, u_cuda = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=l2norm)
    assert o_cuda.device.type == "cuda" and o_cuda.dtype == torch.float32
    assert_same_bits(o_cuda, o)
    assert_same_bits(u_cuda, u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(1, 8, 32, 40), (2, 16, 64, 33), (4, 32, 128, 128)])  # H, HV, K, V
def test_many_value_heads_per_qk_head_every_tree_size(generator, dtype, heads):
    """The q/k products are shared by HV / H value heads and every column tile: n = 1..64, bit for bit."""
    h, hv, kd, vd = heads
    for nodes in range(1, 65):
        kind = KINDS[nodes % len(KINDS)]
        x = random_gdn_inputs(generator, 2, nodes, h, hv, kd, vd, kind=kind, dtype=dtype)
        if nodes % 3 == 0:
            x = strided_gdn_inputs(x)
        o, u = gdn_tree_verify(*x, use_qk_l2norm=nodes % 2 == 0)
        o_cuda, u_cuda = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=nodes % 2 == 0, validate=False)
        assert_same_bits(o_cuda, o, nodes)
        assert_same_bits(u_cuda, u, nodes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_cuda_half_against_fp64(generator, dtype):
    x = random_gdn_inputs(generator, 2, 32, 4, 8, 128, 128, kind="random", dtype=dtype)
    o_cuda, _ = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=True)
    ref = gdn_tree_verify_reference(*x, use_qk_l2norm=True, compute_dtype=torch.float64)
    assert o_cuda.dtype == dtype and rel_rms(o_cuda, ref) <= 2e-3


def test_cuda_chain_equals_sequential(generator):
    x = random_gdn_inputs(generator, 1, 64, 2, 4, 128, 128, kind="chain")
    o_cuda, _ = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=True)
    s0 = x.state_pool[int(x.slots[0])].double()
    expected, _ = gdn_recurrence_reference(x.q[0], x.k[0], x.v[0], x.g[0], x.beta[0], s0, None, True)
    assert rel_rms(o_cuda[0], expected) <= 1e-5


@pytest.mark.parametrize("forget", [float("-inf"), -1e30])
def test_full_forgets_cuda_equal_cpu(generator, forget):
    """Log decays whose exp is 0 at random nodes: both backends sum them as kMinLogDecay (gdn.h), bit for bit."""
    batch, nodes = 3, 33
    x = random_gdn_inputs(generator, batch, nodes, 2, 4, 64, 48, kind="random")
    x = x._replace(g=torch.where(torch.rand(x.g.shape, generator=generator) < 0.2, forget, x.g))
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    o_cuda, u_cuda = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=True)
    assert torch.isfinite(o).all()
    assert_same_bits(o_cuda, o)
    assert_same_bits(u_cuda, u)
    last = torch.randint(0, nodes, (batch,), generator=generator)
    pool, pool_cuda = x.state_pool.clone(), x.state_pool.cuda()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True)
    gdn_commit(x.k.cuda(), x.g.cuda(), u.cuda(), x.parent.cuda(), last.cuda(), pool_cuda, x.slots.cuda(), True)
    assert_same_bits(pool_cuda, pool)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_cuda_equals_cpu(generator, kind, dtype):
    batch, nodes = 5, 40
    x = random_gdn_inputs(generator, batch, nodes, 2, 4, 128, 96, kind=kind, dtype=dtype)
    _, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    last = torch.randint(-1, nodes, (batch,), generator=generator)
    pool = x.state_pool.clone()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True)
    pool_cuda = x.state_pool.cuda()
    gdn_commit(x.k.cuda(), x.g.cuda(), u.cuda(), x.parent.cuda(), last.cuda(), pool_cuda, x.slots.cuda(), True)
    assert_same_bits(pool_cuda, pool)


def test_repeated_rounds_cuda_equal_one_long_run(generator):
    batch, h, hv, kd, vd = 2, 2, 4, 64, 64
    base = random_gdn_inputs(generator, batch, 1, h, hv, kd, vd)
    pool, slots = base.state_pool.cuda(), base.slots.cuda()
    initial = base.state_pool.clone()
    accepted = [[] for _ in range(batch)]
    for nodes, kind in zip([1, 5, 16, 33, 64], ["random", "chain", "deep", "star", "forest"], strict=True):
        x = random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind=kind)
        xc = to_cuda(x)
        o, u = gdn_tree_verify(xc.q, xc.k, xc.v, xc.g, xc.beta, xc.parent, pool, slots, use_qk_l2norm=True)
        last = torch.randint(0, nodes, (batch,), generator=generator)
        gdn_commit(xc.k, xc.g, u, xc.parent, last.cuda(), pool, slots, True)
        for b in range(batch):
            for i in tree_path(x.parent[b], int(last[b])):
                accepted[b].append((x.q[b, i], x.k[b, i], x.v[b, i], x.g[b, i], x.beta[b, i], o[b, i].cpu()))
    for b in range(batch):
        q, k, v, g, beta, o = (torch.stack(t) for t in zip(*accepted[b], strict=True))
        slot = int(base.slots[b])
        expected_o, expected_s = gdn_recurrence_reference(q, k, v, g, beta, initial[slot].double(), None, True)
        assert rel_rms(o, expected_o) <= 1e-5
        assert rel_rms(pool[slot], expected_s) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4, 9])
def test_conv_cuda_equals_cpu(generator, kind, dtype, width):
    batch, nodes, channels = 3, 21, 300
    parent = torch.stack([random_tree(generator, nodes, kind) for _ in range(batch)])
    x = torch.randn(batch, nodes, channels, generator=generator).to(dtype)
    state = torch.randn(batch, channels, width - 1, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator)
    bias = torch.randn(channels, generator=generator)
    for b_arg, act in ((bias, "silu"), (None, None)):
        out = causal_conv1d_tree(x, parent, state, weight, b_arg, act)
        out_cuda = causal_conv1d_tree(
            x.cuda(), parent.cuda(), state.cuda(), weight.cuda(), None if b_arg is None else b_arg.cuda(), act
        )
        assert rel_rms(out_cuda, out) <= (1e-6 if dtype == torch.float32 else 4e-3)
    last = torch.randint(-1, nodes, (batch,), generator=generator)
    state_cpu, state_cuda = state.clone(), state.cuda()
    causal_conv1d_commit(x, parent, last, state_cpu)
    causal_conv1d_commit(x.cuda(), parent.cuda(), last.cuda(), state_cuda)
    assert torch.equal(state_cuda.cpu(), state_cpu)


def test_batches_beyond_the_grid_limit(generator):
    """70000 requests: more than the 65535 a y/z grid dimension allows, so the kernels run in several launches."""
    batch, nodes = 70000, 3
    x = random_gdn_inputs(generator, batch, nodes, 1, 1, 4, 4, pool_extra=1)
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    o_cuda, u_cuda = gdn_tree_verify(*to_cuda(x), use_qk_l2norm=True)
    assert_same_bits(o_cuda, o)
    assert_same_bits(u_cuda, u)
    last = torch.randint(-1, nodes, (batch,), generator=generator)
    pool, pool_cuda = x.state_pool.clone(), x.state_pool.cuda()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True)
    gdn_commit(x.k.cuda(), x.g.cuda(), u.cuda(), x.parent.cuda(), last.cuda(), pool_cuda, x.slots.cuda(), True)
    assert_same_bits(pool_cuda, pool)
    xs = torch.randn(batch, nodes, 2, generator=generator)
    state = torch.randn(batch, 2, 3, generator=generator)
    weight = torch.randn(2, 4, generator=generator)
    out = causal_conv1d_tree(xs, x.parent, state, weight, None, "silu")
    out_cuda = causal_conv1d_tree(xs.cuda(), x.parent.cuda(), state.cuda(), weight.cuda(), None, "silu")
    assert rel_rms(out_cuda, out) <= 1e-6
    state_cuda = state.cuda()
    causal_conv1d_commit(xs, x.parent, last, state)
    causal_conv1d_commit(xs.cuda(), x.parent.cuda(), last.cuda(), state_cuda)
    assert torch.equal(state_cuda.cpu(), state)


def test_opcheck_cuda(generator):
    x = to_cuda(random_gdn_inputs(generator, 2, 6, 1, 2, 8, 4, kind="random"))
    torch.library.opcheck(torch.ops.peagle.gdn_tree_verify.default, (*x, None, True))
    _, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    last = torch.tensor([3, -1], device="cuda")
    torch.library.opcheck(
        torch.ops.peagle.gdn_commit.default, (x.k, x.g, u, x.parent, last, x.state_pool.clone(), x.slots, True)
    )
    cx = torch.randn(2, 6, 5, device="cuda")
    state = torch.randn(2, 5, 3, device="cuda")
    weight = torch.randn(5, 4, device="cuda")
    torch.library.opcheck(torch.ops.peagle.causal_conv1d_tree.default, (cx, x.parent, state, weight, None, "silu"))
    torch.library.opcheck(torch.ops.peagle.causal_conv1d_commit.default, (cx, x.parent, last, state.clone()))


def test_cuda_errors(generator):
    x = to_cuda(random_gdn_inputs(generator, 2, 4, 1, 2, 8, 8))
    bad = x.parent.clone()
    bad[1, 2] = 3
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: parent\[1, 2\] must be in \[-1, 2\)"):
        gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, bad, x.state_pool, x.slots)
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: slots must be in \[0, 4\)"):
        gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, x.parent, x.state_pool, torch.tensor([0, 9], device="cuda"))
    with pytest.raises(RuntimeError, match=r"gdn_tree_verify: parent must be on the same device as q"):
        gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, x.parent.cpu(), x.state_pool, x.slots)
    _, u = gdn_tree_verify(*x)
    with pytest.raises(RuntimeError, match=r"gdn_commit: last_accepted must be in \[-1, 4\)"):
        gdn_commit(x.k, x.g, u, x.parent, torch.tensor([0, 7], device="cuda"), x.state_pool, x.slots)


def test_unvalidated_bad_indices_give_nan_not_crashes(generator):
    x = to_cuda(random_gdn_inputs(generator, 3, 6, 1, 2, 16, 16))
    parent = x.parent.clone()
    parent[1, 4] = 5  # request 1: not a tree
    slots = x.slots.clone()
    slots[2] = 1000  # request 2: slot out of range
    o, u = gdn_tree_verify(x.q, x.k, x.v, x.g, x.beta, parent, x.state_pool, slots, validate=False)
    torch.cuda.synchronize()
    assert torch.isfinite(o[0]).all() and torch.isnan(o[1]).all() and torch.isnan(o[2]).all()
    pool = x.state_pool.clone()
    gdn_commit(x.k, x.g, u, parent, torch.tensor([3, 3, 3], device="cuda"), pool, slots, validate=False)
    untouched = [s for s in range(pool.shape[0]) if s != int(slots[0])]
    assert torch.equal(pool[untouched], x.state_pool[untouched])
    conv = causal_conv1d_tree(
        torch.randn(3, 6, 8, device="cuda"),
        parent,
        torch.randn(3, 8, 3, device="cuda"),
        torch.randn(8, 4, device="cuda"),
        validate=False,
    )
    assert torch.isnan(conv[1, 4]).all() and torch.isfinite(conv[0]).all()


def test_verify_and_commit_in_a_cuda_graph(generator):
    """validate=False needs no host synchronisation, so a verify + commit round can be captured and replayed."""
    batch, nodes, h, hv, kd, vd = 2, 16, 2, 4, 64, 64
    x = to_cuda(random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind="random"))
    static = type(x)(*(t.clone() for t in x))
    last = torch.zeros(batch, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        gdn_tree_verify(*static, use_qk_l2norm=True, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, u = gdn_tree_verify(*static, use_qk_l2norm=True, validate=False)
        gdn_commit(static.k, static.g, u, static.parent, last, static.state_pool, static.slots, True, validate=False)
    for _ in range(2):
        fresh = to_cuda(random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind="random"))
        pool_before = static.state_pool.clone()
        for name in ("q", "k", "v", "g", "beta", "parent"):
            getattr(static, name).copy_(getattr(fresh, name))
        last.copy_(torch.randint(0, nodes, (batch,), generator=generator))
        graph.replay()
        eager = type(x)(*(getattr(static, f) if f != "state_pool" else pool_before for f in x._fields))
        o_eager, u_eager = gdn_tree_verify(*eager, use_qk_l2norm=True)
        assert torch.equal(o, o_eager)
        gdn_commit(eager.k, eager.g, u_eager, eager.parent, last, pool_before, eager.slots, True)
        assert torch.equal(static.state_pool, pool_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_splits_cuda_equal_contiguous_bit_for_bit(generator, dtype):
    """Strided q/k/v (slices of a fused projection) and a pool sliced from a larger cache, read in place on CUDA."""
    batch, nodes = 3, 19
    x = to_cuda(random_gdn_inputs(generator, batch, nodes, 2, 8, 64, 96, kind="random", dtype=dtype))
    strided = strided_gdn_inputs(x)
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True, validate=False)
    o_s, u_s = gdn_tree_verify(*strided, use_qk_l2norm=True, validate=False)
    assert torch.equal(o_s, o) and torch.equal(u_s, u)
    last = torch.tensor([nodes - 1, -1, 4], device="cuda")
    pool = x.state_pool.clone()
    gdn_commit(x.k, x.g, u, x.parent, last, pool, x.slots, True, validate=False)
    gdn_commit(strided.k, strided.g, u, strided.parent, last, strided.state_pool, strided.slots, True, validate=False)
    assert torch.equal(strided.state_pool, pool)
    cache = strided.state_pool._base
    outside = torch.ones_like(cache, dtype=torch.bool)
    outside[:, 1, :, :, 2 : 2 + x.v.shape[3]] = False
    assert torch.isnan(cache[outside]).all()


@pytest.mark.parametrize("deferred", [False, True])
def test_unvalidated_shared_slots_are_claimed_not_raced(generator, deferred):
    """validate=False (or deferred checks): requests sharing a slot are caught by the device slot claim. The shared
    slots stay unchanged, the others commit as on the CPU, and check_errors names the smallest shared slot."""
    batch, nodes = 6, 9
    x = random_gdn_inputs(generator, batch, nodes, 2, 4, 32, 24, kind="random", pool_extra=4)
    _, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    slots = torch.tensor([7, 2, 7, 5, 2, 0])
    last = torch.tensor([3, 8, 0, 4, 1, -1])  # slot 0: its only request is inactive
    expected = x.state_pool.clone()
    alone = torch.tensor([False, False, False, True, False, False])
    gdn_commit(x.k[alone], x.g[alone], u[alone], x.parent[alone], last[alone], expected, slots[alone], True)
    pool = x.state_pool.cuda()
    args = (x.k.cuda(), x.g.cuda(), u.cuda(), x.parent.cuda(), last.cuda(), pool, slots.cuda(), True)
    check_errors()
    with deferred_checks(deferred):
        gdn_commit(*args, validate=deferred)
        with pytest.raises(RuntimeError, match=r"gdn_commit: slots of requests .* got slot 2 more than once"):
            check_errors()
    assert torch.equal(pool.cpu(), expected)  # slots 2 and 7 unchanged, slot 5 committed bit for bit
    check_errors()  # the record was reset
    distinct = torch.tensor([7, 2, 1, 5, 3, 0])
    gdn_commit(*args[:6], distinct.cuda(), True, validate=False)
    check_errors()  # distinct slots: nothing recorded


def test_commit_slot_error_names_the_request(generator):
    x = to_cuda(random_gdn_inputs(generator, 3, 4, 1, 2, 8, 8))
    _, u = gdn_tree_verify(*x)
    last, slots = torch.tensor([-1, -1, 2], device="cuda"), torch.tensor([-3, 77, 99], device="cuda")
    for deferred in (False, True):
        with deferred_checks(deferred), pytest.raises(RuntimeError, match=r"got 99 for request 2"):
            gdn_commit(x.k, x.g, u, x.parent, last, x.state_pool.clone(), slots)
            check_errors()


@pytest.mark.parametrize("error", ["parent", "last_accepted", "slots", "shared_slot", "none"])
def test_deferred_validation_names_the_immediate_error_in_a_large_batch(generator, error):
    """Deferred validation (one block, several requests per thread) names the error the immediate checks raise: two
    errors of a kind are planted, the later one where an earlier thread meets it first."""
    batch, nodes = 3000, 5
    x = random_gdn_inputs(generator, batch, nodes, 1, 1, 8, 8, kind="chain", pool_extra=3000)
    _, u = gdn_tree_verify(*x)
    parent, last = x.parent.clone(), torch.full((batch,), nodes - 1)
    slots = torch.randperm(batch, generator=generator) + 1000  # distinct, in [1000, 4000); the pool holds 6000
    if error == "parent":
        parent[2047, 1], parent[1500, 4] = 3, -2
    elif error == "last_accepted":
        last[2999], last[1025] = nodes, -5
    elif error == "slots":
        last[3] = -1
        slots[3], slots[2100], slots[1030] = -1, 6000, -4  # request 3 does not commit: its slot is not checked
    elif error == "shared_slot":
        slots[5], slots[2999] = 900, 900
        slots[1024], slots[2048] = 17, 17
    args = (x.k, x.g, u, parent, last, x.state_pool.clone(), slots)
    expected = None
    try:
        gdn_commit(*args)
    except RuntimeError as e:
        expected = str(e).splitlines()[0]
    assert (expected is None) == (error == "none")
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    check_errors()
    with deferred_checks():
        gdn_commit(*cuda_args)
        if expected is None:
            check_errors()
        else:
            with pytest.raises(RuntimeError) as raised:
                check_errors()
            assert str(raised.value).splitlines()[0] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nodes", [1, 16, 33, 64])
def test_tensor_core_projections_close_to_the_exact_path(generator, dtype, nodes):
    """tensor_cores=True (TF32 mma for the state projections) against the exact fp32 path it is measured by."""
    x = to_cuda(random_gdn_inputs(generator, 3, nodes, 2, 8, 128, 80, kind="random", dtype=dtype))
    o, u = gdn_tree_verify(*x, use_qk_l2norm=True)
    o_tc, u_tc = gdn_tree_verify(*x, use_qk_l2norm=True, tensor_cores=True)
    if torch.equal(u_tc, u):  # the fallback: no CuTe headers in this build, or a GPU without TF32 tensor cores
        assert torch.equal(o_tc, o)
        # run_gpu.sh sets PEAGLE_EXPECT_CUTLASS when the build found the headers: then a tree of 16 nodes or more that
        # equals the exact path bit for bit did not take the mma path (a single node's TF32 products may round alike).
        tensor_cores = torch.cuda.get_device_capability() >= (8, 0) and os.environ.get("PEAGLE_EXPECT_CUTLASS") == "1"
        assert not (tensor_cores and nodes >= 16), "a CUTLASS build on sm_80+ fell back to the exact path"
        pytest.skip("tensor_cores fell back to the exact path (built without CUTLASS, or below sm_80)")
    assert rel_rms(u_tc, u) <= 3e-3, rel_rms(u_tc, u)
    assert rel_rms(o_tc, o) <= (3e-3 if dtype == torch.float32 else 6e-3), rel_rms(o_tc, o)
    strided_o, strided_u = gdn_tree_verify(*strided_gdn_inputs(x), use_qk_l2norm=True, tensor_cores=True)
    assert torch.equal(strided_o, o_tc) and torch.equal(strided_u, u_tc)  # deterministic, strides read in place


# ---------------------------------------------------------------------------------------------------------------------
# gdn_tree_verify_slots: the state cache read and written in place.


def slots_inputs(generator, batch, nodes, kind, heads, dtype, cache_dtype, extra=5):
    h, hv, kd, vd = heads
    x = random_gdn_inputs(generator, batch, nodes, h, hv, kd, vd, kind=kind, dtype=dtype, pool_extra=0)
    slots = batch * (nodes + 1) + extra
    cache = (torch.randn(slots, hv, kd, vd, generator=generator) * 0.3).to(cache_dtype)
    perm = torch.randperm(slots, generator=generator)
    start, dest = perm[:batch], perm[batch : batch + batch * nodes].view(batch, nodes).clone()
    dest[torch.rand(batch, nodes, generator=generator) < 0.25] = -1
    dest[0, 0] = start[0]  # a request overwriting its own start state (vLLM: one accepted token)
    return x, cache, start, dest


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state", ["float32", "q"])
@pytest.mark.parametrize("heads", [(1, 2, 16, 16), (2, 4, 40, 72), (4, 32, 128, 128)])
def test_verify_slots_cuda_equals_cpu(generator, kind, dtype, state, heads):
    """Outputs and every written state bit for bit as on the CPU (the CPU kernel equals verify + per-node commits),
    slots not written untouched; several column tiles, K not a multiple of the staging chunk, a start slot written."""
    cache_dtype = torch.float32 if state == "float32" else dtype
    x, cache, start, dest = slots_inputs(generator, 3, 9, kind, heads, dtype, cache_dtype)
    cpu_cache = cache.clone()
    o = gdn_tree_verify_slots(*x[:6], cpu_cache, start, dest, use_qk_l2norm=True)
    cuda_cache = cache.cuda()
    o_cuda = gdn_tree_verify_slots(*to_cuda(x)[:6], cuda_cache, start.cuda(), dest.cuda(), use_qk_l2norm=True)
    assert_same_bits(o_cuda, o, kind, dtype, state)
    assert_same_bits(cuda_cache, cpu_cache, kind, dtype, state)
    assert not torch.equal(cpu_cache, cache)


@pytest.mark.parametrize("lengths", [[4, 4, 4], [4, 2, 1, 3]])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_spec_step_cuda_matches_the_token_recurrence(generator, lengths, state_dtype):
    """vLLM's speculative step in one op on CUDA (gates and start slots as tensor ops, equal and ragged chains)
    against the token-by-token recurrence, as the CPU op is tested."""
    args, state = random_gdn_spec_inputs(
        generator, lengths, columns=max(lengths) + 1, heads=(2, 4, 64, 32), dtype=state_dtype, state_dtype=state_dtype
    )
    expected_o, expected_cache = gdn_spec_step_reference(initial_state_source=state, **args)
    cache = state.cuda()
    moved = {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in args.items()}
    o = gdn_spec_step(initial_state_source=cache, **moved)
    exact = state_dtype == torch.float32
    torch.testing.assert_close(o.float().cpu(), expected_o, rtol=1e-4 if exact else 2**-7, atol=1e-5)
    torch.testing.assert_close(cache.float().cpu(), expected_cache.float(), rtol=1e-5 if exact else 2**-7, atol=1e-6)


def test_verify_slots_strided_cache_cuda(generator):
    x, cache, start, dest = slots_inputs(generator, 2, 7, "chain", (2, 4, 16, 24), torch.bfloat16, torch.float32)
    strided = strided_gdn_inputs(x._replace(state_pool=cache))
    cpu_cache = cache.clone()
    o = gdn_tree_verify_slots(*x[:6], cpu_cache, start, dest, use_qk_l2norm=True)
    moved = to_cuda(strided)
    o_cuda = gdn_tree_verify_slots(*moved[:6], moved.state_pool, start.cuda(), dest.cuda(), use_qk_l2norm=True)
    assert_same_bits(o_cuda, o)
    assert_same_bits(moved.state_pool, cpu_cache)
    outside = torch.ones_like(moved.state_pool._base, dtype=torch.bool)
    outside[:, 1, :, :, 2 : 2 + x.v.shape[3]] = False
    assert torch.isnan(moved.state_pool._base[outside]).all()


@pytest.mark.parametrize("error", ["start", "state", "shared", "foreign", "none"])
def test_verify_slots_deferred_and_unvalidated_errors(generator, error):
    """Deferred checks name the immediate check's error; without host checks the device claims the written slots:
    requests in a conflict write nothing (NaN outputs), the others equal the CPU's."""
    batch, nodes = 4, 5
    x, cache, _, _ = slots_inputs(generator, batch, nodes, "chain", (1, 2, 16, 16), torch.float32, torch.float32)
    start, dest = torch.tensor([20, 21, 22, 23]), torch.arange(20).view(batch, nodes)  # 29 slots: 24..28 unused
    dest[0, 0] = 20
    if error == "start":
        start[2] = 29
    elif error == "state":
        dest[3, 4], dest[1, 2] = -2, 34
    elif error == "shared":
        dest[3, 1], dest[1, 4] = 25, 25
    elif error == "foreign":
        dest[1, 3] = 22
    args = (*x[:6], cache.clone(), start, dest)
    expected = None
    try:
        gdn_tree_verify_slots(*args)
    except RuntimeError as e:
        expected = str(e).splitlines()[0]
    assert (expected is None) == (error == "none")
    cuda_args = [a.cuda() for a in args]
    check_errors()
    with deferred_checks():
        o = gdn_tree_verify_slots(*cuda_args)
        if expected is None:
            check_errors()
        else:
            with pytest.raises(RuntimeError) as raised:
                check_errors()
            assert str(raised.value).splitlines()[0] == expected
    if error in ("shared", "foreign"):  # the conflicting requests were skipped, the others ran
        skipped = {"shared": [1, 3], "foreign": [1, 2]}[error]
        assert torch.isnan(o[skipped]).all()
        ran = [b for b in range(batch) if b not in skipped]
        cpu_cache = cache.clone()
        sub = [t[ran] for t in x[:6]]
        expected_o = gdn_tree_verify_slots(*sub, cpu_cache, start[ran], dest[ran])
        assert_same_bits(o[ran], expected_o)


def test_opcheck_slots_cuda(generator):
    x, cache, start, dest = slots_inputs(generator, 2, 5, "random", (1, 2, 8, 4), torch.float32, torch.float32)
    torch.library.opcheck(
        torch.ops.peagle.gdn_tree_verify_slots.default,
        (*to_cuda(x)[:6], cache.cuda(), start.cuda(), dest.cuda(), None, True),
    )


@pytest.mark.parametrize("deferred", [False, True])
def test_conv_slots_cuda_equal_cpu(generator, deferred):
    """The conv pair on a cache of conv states (slots) equals the CPU bit for bit; unvalidated commits claim their
    slots on the device (a shared one is left unchanged and check_errors names it)."""
    batch, nodes, channels, width, rows = 4, 9, 40, 4, 11
    parent = torch.stack([random_tree(generator, nodes, "random") for _ in range(batch)])
    x = torch.randn(batch, nodes, channels, generator=generator).bfloat16()
    cache = torch.randn(rows, channels, width - 1, generator=generator).bfloat16()
    weight, bias = torch.randn(channels, width, generator=generator), torch.randn(channels, generator=generator)
    slots = torch.randperm(rows, generator=generator)[:batch]
    last = torch.tensor([nodes - 1, 3, -1, 0])
    out = causal_conv1d_tree(x, parent, cache, weight, bias, "silu", slots=slots)
    out_cuda = causal_conv1d_tree(x.cuda(), parent.cuda(), cache.cuda(), weight.cuda(), bias.cuda(), "silu",
                                  slots=slots.cuda())  # fmt: skip
    assert_same_bits(out_cuda, out)
    committed, committed_cuda = cache.clone(), cache.cuda()
    causal_conv1d_commit(x, parent, last, committed, slots=slots)
    causal_conv1d_commit(x.cuda(), parent.cuda(), last.cuda(), committed_cuda, slots=slots.cuda())
    assert_same_bits(committed_cuda, committed)
    shared = slots.clone()
    shared[3] = shared[0]  # requests 0 and 3 both commit into one row
    check_errors()
    target = cache.cuda()
    with deferred_checks(deferred):
        causal_conv1d_commit(x.cuda(), parent.cuda(), last.cuda(), target, validate=deferred, slots=shared.cuda())
        with pytest.raises(RuntimeError, match=rf"causal_conv1d_commit: slots of requests .* slot {int(shared[0])}"):
            check_errors()
    expected = cache.clone()
    causal_conv1d_commit(x[1:3], parent[1:3], last[1:3], expected, slots=shared[1:3])
    assert_same_bits(target, expected)  # the shared row unchanged, the others committed
