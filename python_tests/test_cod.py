"""COD sampling and the fused COD gather on the CPU, against the PyTorch references and independent properties."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy import stats

import peagle
from peagle.ops import cod_gather, cod_gather_reference, cod_sample, cod_sample_reference
from peagle.ops.cod import _depth_count
from testkit import fresh_seed, random_packed_row

SAMPLE_CONFIGS = [
    # num_depths, ratio, ratio_min, max_anchors
    (1, 0.7, 0.2, None),
    (2, 0.7, 0.2, None),
    (8, 0.7, 0.2, None),
    (8, 0.7, 0.2, 512),
    (8, 1.0, 0.0, None),
    (4, 0.5, 0.0, 7),
    (6, 0.3, 0.3, 1),
    (16, 0.9, 0.05, 33),
]
LENGTHS = [1, 2, 3, 17, 300, 2048]


def check_cod_properties(loss_mask, document_ids, anchors, depths, num_depths, ratio, ratio_min, max_anchors):
    """Asserts the COD contract from first principles (no reference implementation involved)."""
    length = loss_mask.shape[0]
    trained = loss_mask.bool().tolist()
    docs = document_ids.tolist()
    a_list, d_list = anchors.tolist(), depths.tolist()
    assert anchors.dtype == depths.dtype == torch.long
    assert a_list[:length] == list(range(length)) and d_list[:length] == [0] * length

    def extends(a: int, d: int) -> bool:
        return a + d < length and docs[a] >= 0 and docs[a + d] == docs[a] and trained[a + d]

    seeds = [a for a in range(length) if extends(a, 1)]
    n_seeds = min(len(seeds), max_anchors) if max_anchors is not None else len(seeds)
    by_depth: dict[int, list[int]] = {}
    for a, d in zip(a_list[length:], d_list[length:], strict=True):
        by_depth.setdefault(d, []).append(a)
    assert all(1 <= d < num_depths for d in by_depth)
    previous = None
    for d in range(1, num_depths):
        kept = by_depth.get(d, [])
        assert kept == sorted(set(kept)), f"depth {d} must be sorted by anchor without repeats"
        assert all(extends(a, k) for a in kept for k in range(1, d + 1)), f"depth {d} chain leaves its document"
        if previous is None:  # depth 1 draws from the seeds, capped at max_anchors
            pool, pool_size = seeds, n_seeds
        else:
            pool = [a for a in previous if extends(a, d)]
            pool_size = len(pool)
        assert set(kept) <= set(pool), f"depth {d} is not nested in depth {d - 1}"
        keep = 1.0
        for _ in range(d):
            keep *= ratio
        expected = min(int(n_seeds * max(keep, ratio_min)), pool_size)
        assert len(kept) == expected, f"depth {d}: kept {len(kept)}, expected {expected}"
        previous = kept
    d_tensor = depths[length:]
    assert torch.all(d_tensor[1:] >= d_tensor[:-1]), "depths must be grouped in increasing order"


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("num_depths,ratio,ratio_min,max_anchors", SAMPLE_CONFIGS)
def test_cod_sample_matches_reference_and_contract(generator, length, num_depths, ratio, ratio_min, max_anchors):
    for _ in range(3):
        row = random_packed_row(generator, length, mean_document_length=max(2.0, length / 4))
        seed = int(torch.randint(-(2**62), 2**62, (), generator=generator))
        anchors, depths = cod_sample(row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, max_anchors, seed)
        ref_anchors, ref_depths = cod_sample_reference(
            row.loss_mask, row.document_ids, num_depths, ratio, ratio_min, max_anchors, seed
        )
        assert torch.equal(anchors, ref_anchors) and torch.equal(depths, ref_depths)
        check_cod_properties(
            row.loss_mask, row.document_ids, anchors, depths, num_depths, ratio, ratio_min, max_anchors
        )


@pytest.mark.parametrize(
    "case",
    ["single_position", "documents_of_length_one", "no_trained_labels", "all_padding", "one_long_document"],
)
def test_cod_sample_edge_cases(generator, case):
    length = 64
    loss_mask = torch.ones(length, dtype=torch.bool)
    document_ids = torch.zeros(length, dtype=torch.long)
    if case == "single_position":
        loss_mask, document_ids = loss_mask[:1], document_ids[:1]
    elif case == "documents_of_length_one":
        document_ids = torch.arange(length)
    elif case == "no_trained_labels":
        loss_mask = torch.zeros(length, dtype=torch.bool)
    elif case == "all_padding":
        document_ids = torch.full((length,), -1)
    for mask_type in (torch.bool, torch.int32, torch.float32):
        anchors, depths = cod_sample(loss_mask.to(mask_type), document_ids, 8, 0.7, 0.2, None, fresh_seed())
        check_cod_properties(loss_mask, document_ids, anchors, depths, 8, 0.7, 0.2, None)
        if case == "one_long_document":
            assert anchors.numel() > loss_mask.numel()
        else:  # no chain can extend: depth 0 only
            assert torch.equal(anchors, torch.arange(loss_mask.numel())) and not depths.any()


def test_cod_sample_ratio_one_keeps_every_chain(generator):
    row = random_packed_row(generator, 500)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 6, 1.0, 0.0, None, fresh_seed())
    # With ratio 1 nothing is dropped: depth d holds every anchor whose first d labels are trained in its document.
    docs, trained = row.document_ids, row.loss_mask
    for d in range(1, 6):
        expected = [
            a
            for a in range(500)
            if all(a + k < 500 and docs[a] >= 0 and docs[a + k] == docs[a] and trained[a + k] for k in range(1, d + 1))
        ]
        assert anchors[depths == d].tolist() == expected


def test_cod_sample_int32_document_ids_and_determinism(generator):
    row = random_packed_row(generator, 1000)
    seed = fresh_seed()
    first = cod_sample(row.loss_mask, row.document_ids.int(), 8, 0.7, 0.2, 100, seed)
    again = cod_sample(row.loss_mask, row.document_ids, 8, 0.7, 0.2, 100, seed)
    other = cod_sample(row.loss_mask, row.document_ids, 8, 0.7, 0.2, 100, seed + 1)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0]), "a different seed must draw different elements"


def _exact_two_depth_distribution(trained, docs, seeds, c1, c2):
    """P(depth-1 set, depth-2 set) for uniform draws without replacement, by enumeration."""
    length = len(trained)
    probs = {}
    for set1 in itertools.combinations(seeds, c1):
        pool2 = [a for a in set1 if a + 2 < length and docs[a + 2] == docs[a] and trained[a + 2]]
        k2 = min(c2, len(pool2))
        for set2 in itertools.combinations(pool2, k2):
            probs[(set1, set2)] = 1.0 / (math.comb(len(seeds), c1) * math.comb(len(pool2), k2))
    return probs


@pytest.mark.parametrize("max_anchors", [None, 5])
def test_cod_draws_are_uniform_without_replacement(max_anchors):
    # Two documents; trained labels chosen so that some depth-1 chains cannot extend to depth 2.
    docs = [0] * 6 + [1] * 5
    trained = [False, True, True, True, False, True, False, True, True, True, True]
    loss_mask, document_ids = torch.tensor(trained), torch.tensor(docs)
    seeds = [a for a in range(10) if docs[a + 1] == docs[a] and trained[a + 1]]
    ratio, ratio_min, draws = 0.7, 0.2, 40_000
    n_seeds = len(seeds) if max_anchors is None else min(len(seeds), max_anchors)
    c1, c2 = (_depth_count(n_seeds, ratio, ratio_min, d) for d in (1, 2))
    observed = Counter()
    seed_sets = Counter()
    base = fresh_seed()
    for i in range(draws):
        anchors, depths = cod_sample(loss_mask, document_ids, 3, ratio, ratio_min, max_anchors, base + i)
        set1, set2 = tuple(anchors[depths == 1].tolist()), tuple(anchors[depths == 2].tolist())
        observed[(set1, set2)] += 1
        seed_sets[set1] += 1
    if max_anchors is None:
        expected = _exact_two_depth_distribution(trained, docs, seeds, c1, c2)
        assert set(observed) <= set(expected)
        cells = sorted(expected)
        f_obs = [observed[c] for c in cells]
        f_exp = [expected[c] * draws for c in cells]
    else:
        # Capped seeds are a uniform n_seeds-subset, then depth 1 a uniform c1-subset of it: every c1-subset of
        # all seeds is equally likely.
        assert all(len(s) == c1 for s in seed_sets)
        cells = list(itertools.combinations(seeds, c1))
        f_obs = [seed_sets[c] for c in cells]
        f_exp = [draws / len(cells)] * len(cells)
    assert sum(f_obs) == draws
    p_value = stats.chisquare(f_obs, f_exp).pvalue
    assert p_value > 1e-4, f"COD draws are not uniform (chi-square p = {p_value:.2e})"


def test_cod_selection_marginals_are_uniform_on_a_long_row(generator):
    # Every seed must be equally likely to be kept at depth 1 (each anchor: Binomial(draws, c1 / n_seeds)).
    length, draws = 256, 2000
    loss_mask = torch.ones(length, dtype=torch.bool)
    document_ids = torch.zeros(length, dtype=torch.long)
    hits = torch.zeros(length)
    base = fresh_seed()
    for i in range(draws):
        anchors, depths = cod_sample(loss_mask, document_ids, 2, 0.5, 0.0, None, base + i)
        hits[anchors[depths == 1]] += 1
    n_seeds = length - 1
    expected = draws * _depth_count(n_seeds, 0.5, 0.0, 1) / n_seeds
    p_value = stats.chisquare(hits[:n_seeds].numpy(), [expected] * n_seeds).pvalue
    assert hits[n_seeds] == 0 and p_value > 1e-4, f"depth-1 marginals not uniform (p = {p_value:.2e})"


BAD_SAMPLE_ARGS = [
    (dict(loss_mask=torch.ones(2, 3)), "loss_mask must be 1-D"),
    (dict(document_ids=torch.zeros(5, dtype=torch.long)), "same length T"),
    (dict(document_ids=torch.zeros(4)), "document_ids must be int32 or int64"),
    (dict(num_depths=0), "num_depths must be >= 1"),
    (dict(ratio=0.0), r"ratio must be in \(0, 1\]"),
    (dict(ratio=1.5), r"ratio must be in \(0, 1\]"),
    (dict(ratio=0.5, ratio_min=0.6), "ratio_min must be in"),
    (dict(ratio_min=-0.1), "ratio_min must be in"),
    (dict(max_anchors=0), "max_anchors must be None or >= 1"),
    (dict(loss_mask=torch.ones(4, dtype=torch.complex64)), "loss_mask must be bool, integer or floating"),
]


@pytest.mark.parametrize("bad,message", BAD_SAMPLE_ARGS)
def test_cod_sample_rejects_bad_input(bad, message):
    args = dict(
        loss_mask=torch.ones(4, dtype=torch.bool),
        document_ids=torch.zeros(4, dtype=torch.long),
        num_depths=4,
        ratio=0.7,
        ratio_min=0.2,
        max_anchors=None,
        seed=0,
    )
    args.update(bad)
    with pytest.raises(RuntimeError, match=message):
        cod_sample(**args)


def random_elements(generator, length, count):
    """Arbitrary (anchor, depth) elements in range, with duplicates and no particular order."""
    anchors = torch.randint(0, length, (count,), generator=generator)
    depths = (torch.rand(count, generator=generator) * (length - anchors)).long().clamp(max=7)
    depths[torch.rand(count, generator=generator) < 0.5] = 0
    return anchors, depths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("width", [1, 3, 8, 96, 257])
def test_cod_gather_matches_reference(generator, dtype, id_dtype, width):
    length = int(torch.randint(1, 300, (), generator=generator))
    row = random_packed_row(generator, length)
    input_ids = torch.randint(0, 1000, (length,), generator=generator, dtype=id_dtype)
    hidden = torch.randn(length, width, generator=generator).to(dtype)
    mask_hidden = torch.randn(width, generator=generator).to(dtype)
    for anchors, depths in (
        cod_sample(row.loss_mask, row.document_ids, 8, 0.7, 0.2, None, fresh_seed()),
        random_elements(generator, length, 50),
        (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
    ):
        out = cod_gather(input_ids, hidden, mask_hidden, anchors.int(), depths, 1000)
        ref = cod_gather_reference(input_ids, hidden, mask_hidden, anchors, depths, 1000)
        for name, got, want in zip(out._fields, out, ref, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_cod_gather_casts_parameter_mask_hidden_and_strided_hidden(generator):
    hidden = torch.randn(20, 16, generator=generator, dtype=torch.bfloat16)
    wide = torch.randn(20, 32, generator=generator, dtype=torch.bfloat16)[:, ::2]  # non-contiguous
    mask_hidden = torch.randn(1, 1, 16, generator=generator)  # fp32 [1, 1, D], as speculators stores it
    anchors, depths = random_elements(generator, 20, 30)
    ids = torch.arange(20)
    for h in (hidden, wide):
        out = cod_gather(ids, h, mask_hidden, anchors, depths, 5)
        ref = cod_gather_reference(ids, h, mask_hidden.to(torch.bfloat16), anchors, depths, 5)
        assert torch.equal(out.feats, ref.feats)


def test_cod_gather_gradients(generator):
    length, width = 30, 6
    hidden = torch.randn(length, width, generator=generator, dtype=torch.float64, requires_grad=True)
    mask_hidden = torch.randn(width, generator=generator, dtype=torch.float64, requires_grad=True)
    anchors, depths = random_elements(generator, length, 70)  # duplicate depth-0 anchors accumulate
    ids = torch.arange(length)

    def gathered(h, m):
        return cod_gather(ids, h, m, anchors, depths, 0).feats

    assert torch.autograd.gradcheck(gathered, (hidden, mask_hidden))
    assert torch.autograd.gradgradcheck(gathered, (hidden, mask_hidden))


ROUNDING = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cod_gather_backward_accumulates_in_fp32(generator, dtype):
    length, width = 400, 40
    row = random_packed_row(generator, length)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 8, 0.9, 0.5, None, fresh_seed())
    anchors = torch.cat([anchors, anchors[:100]])  # duplicates at depth 0
    depths = torch.cat([depths, depths[:100]])
    grad = torch.randn(anchors.numel(), width, generator=generator).to(dtype)
    grad_hidden, grad_mask = torch.ops.peagle.cod_gather_backward(grad, anchors, depths, length)
    exact = grad.double()
    want_hidden = torch.zeros(length, width, dtype=torch.float64).index_add_(
        0, anchors[depths == 0], exact[depths == 0]
    )
    want_mask = exact[depths > 0].sum(0)
    assert grad_hidden.dtype == grad_mask.dtype == dtype
    # Hundreds of summed rows: a low-precision accumulator would miss by many ulps; fp32 accumulation rounds once.
    rtol = ROUNDING[dtype]
    torch.testing.assert_close(grad_hidden.double(), want_hidden, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(grad_mask.double(), want_mask, rtol=rtol, atol=1e-4)


def backward_in_documented_order(grad, anchors, depths, length, chunk=256):
    """cod_gather_backward's fixed summation order (csrc/include/peagle/cod.h), one row at a time in fp32: per anchor
    the depth-0 rows in row order; the deeper rows summed per chunk of `chunk` rows, then the chunk sums in order.
    Returns the fp32 (fp64 for float64) accumulators."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    hidden = torch.zeros(length, grad.shape[1], dtype=acc)
    mask = torch.zeros(grad.shape[1], dtype=acc)
    for begin in range(0, grad.shape[0], chunk):
        chunk_sum = torch.zeros(grad.shape[1], dtype=acc)
        for i in range(begin, min(begin + chunk, grad.shape[0])):
            if depths[i] == 0:
                hidden[anchors[i]] += grad[i].to(acc)
            else:
                chunk_sum += grad[i].to(acc)
        mask += chunk_sum
    return hidden, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cod_gather_backward_adds_in_the_documented_order(generator, dtype):
    """Bit-exact against the documented order (which the CUDA kernels follow too), whatever the thread count."""
    length, width, count = 50, 70, 600
    anchors = torch.randint(0, length - 4, (count,), generator=generator)
    depths = torch.randint(0, 4, (count,), generator=generator) * (torch.rand(count, generator=generator) < 0.6)
    grad = (torch.randn(count, width, generator=generator) * torch.logspace(-3, 3, width)).to(dtype)
    hidden_acc, mask_acc = backward_in_documented_order(grad, anchors, depths, length)
    want_hidden, want_mask = hidden_acc.to(dtype), mask_acc.to(dtype)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            grad_hidden, grad_mask = torch.ops.peagle.cod_gather_backward(grad, anchors, depths, length)
            assert torch.equal(grad_hidden, want_hidden) and torch.equal(grad_mask, want_mask)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cod_gather_backward_order_is_chunked(dtype):
    """Power of the test above: a big first row, then 512 ones in the next two chunks. Added one by one, each 1 is
    lost against the big value (half an ulp or less); chunk by chunk the ones first sum to 256 exactly and survive.
    (bf16 outputs cannot hold the difference.)"""
    big = 2.0**54 if dtype == torch.float64 else 2.0**25
    grad = torch.ones(768, 1, dtype=dtype)
    grad[:256] = 0
    grad[0] = big
    ones = torch.ones(768, dtype=torch.long)
    _, grad_mask = torch.ops.peagle.cod_gather_backward(grad, torch.zeros(768, dtype=torch.long), ones, 2)
    assert grad_mask.item() == big + 512
    assert backward_in_documented_order(grad, torch.zeros(768, dtype=torch.long), ones, 2, chunk=768)[1].item() == big


BAD_GATHER_ARGS = [
    (dict(input_ids=torch.zeros(4, 1, dtype=torch.long)), "input_ids must be 1-D"),
    (dict(input_ids=torch.zeros(4)), "input_ids must be int32 or int64"),
    (dict(input_ids=torch.zeros(5, dtype=torch.long)), "must agree on T"),
    (dict(hidden=torch.zeros(4)), "hidden must be 2-D"),
    (dict(hidden=torch.zeros(4, 8, dtype=torch.int32)), "hidden must be float32"),
    (dict(mask_hidden=torch.zeros(7)), "mask_hidden must be \\[D\\] with D = 8"),
    (dict(mask_hidden=torch.zeros(2, 8)), "mask_hidden must be 1-D"),
    (dict(anchors=torch.zeros(3, dtype=torch.long)), "anchors and depths must have the same length"),
    (dict(depths=torch.zeros(2)), "depths must be int32 or int64"),
    (dict(anchors=torch.tensor([0, 4])), r"element 1 \(anchor 4, depth 1\) is out of range for T = 4"),
    (dict(anchors=torch.tensor([-1, 0])), r"element 0 \(anchor -1, depth 0\) is out of range"),
    (dict(depths=torch.tensor([0, 4])), r"element 1 \(anchor 1, depth 4\) is out of range"),
    (dict(depths=torch.tensor([-1, 0])), "out of range"),
    (dict(mask_token_id=-1), "mask_token_id must be in"),
    (dict(input_ids=torch.zeros(4, dtype=torch.int32), mask_token_id=2**31), "mask_token_id must be in"),
    (dict(mask_token_id=10, vocab_size=10), "mask_token_id must be < vocab_size = 10"),
]


@pytest.mark.parametrize("bad,message", BAD_GATHER_ARGS)
def test_cod_gather_rejects_bad_input(bad, message):
    args = dict(
        input_ids=torch.zeros(4, dtype=torch.long),
        hidden=torch.zeros(4, 8),
        mask_hidden=torch.zeros(8),
        anchors=torch.tensor([0, 1]),
        depths=torch.tensor([0, 1]),
        mask_token_id=3,
        vocab_size=None,
    )
    args.update(bad)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.peagle.cod_gather(*args.values())


def test_cod_gather_backward_rejects_bad_input():
    grad = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="grad_feats, anchors and depths must agree on N"):
        torch.ops.peagle.cod_gather_backward(
            grad, torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long), 4
        )
    for absurd in (-1, 2**40):  # num_positions sizes the [T, D] gradient: bounded, never an absurd allocation
        with pytest.raises(RuntimeError, match=rf"num_positions must be in \[0, 16777216\], got {absurd}"):
            torch.ops.peagle.cod_gather_backward(
                grad, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), absurd
            )
    with pytest.raises(RuntimeError, match="out of range for T = 4"):
        torch.ops.peagle.cod_gather_backward(grad, torch.tensor([0, 3]), torch.tensor([0, 1]), 4)


def test_opcheck(generator):
    row = random_packed_row(generator, 120)
    torch.library.opcheck(torch.ops.peagle.cod_sample, (row.loss_mask, row.document_ids, 8, 0.7, 0.2, 16, 7))
    torch.library.opcheck(torch.ops.peagle.cod_sample, (row.loss_mask, row.document_ids, 1, 1.0, 0.0, None, 7))
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 8, 0.7, 0.2, None, 3)
    ids = torch.randint(0, 50, (120,), generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(120, 24, generator=generator).to(dtype).requires_grad_()
        mask_hidden = torch.randn(24, generator=generator).to(dtype).requires_grad_()
        torch.library.opcheck(torch.ops.peagle.cod_gather, (ids, hidden, mask_hidden, anchors, depths, 50, None))
        grad = torch.randn(anchors.numel(), 24, generator=generator).to(dtype).requires_grad_()
        torch.library.opcheck(torch.ops.peagle.cod_gather_backward, (grad, anchors, depths, 120))


def test_compiled_training_step_uses_the_ops(generator):
    row = random_packed_row(generator, 64)
    hidden = torch.randn(64, 16, generator=generator, requires_grad=True)
    mask_hidden = torch.randn(16, generator=generator, requires_grad=True)
    ids = torch.arange(64)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 4, 0.7, 0.2, None, 1)

    def step(h, m):
        return cod_gather(ids, h, m, anchors, depths, 99).feats.square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(hidden, mask_hidden)
    grads = torch.autograd.grad(loss, (hidden, mask_hidden))
    ref = cod_gather_reference(ids, hidden, mask_hidden, anchors, depths, 99).feats.square().sum()
    ref_grads = torch.autograd.grad(ref, (hidden, mask_hidden))
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        # mask_hidden's gradient sums every deeper row: the op adds in its fixed order (csrc/include/peagle/cod.h),
        # autograd through the reference in another, so the fp32 sums agree to rounding (~count x eps), not to 1 ulp.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_package_exposes_version():
    assert peagle.__version__


def test_reused_cpu_output_blocks_never_alias_live_tensors(generator):
    # Outputs of >= 4 MiB come from peagle's block cache: a block is reused only after its tensor is freed.
    torch.ops.peagle.release_cpu_buffers()
    length, width = 2048, 1024
    hidden = torch.randn(length, width, generator=generator)
    mask_hidden = torch.randn(width, generator=generator)
    ids = torch.arange(length)
    row = random_packed_row(generator, length)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 4, 0.7, 0.2, None, fresh_seed())
    first = cod_gather(ids, hidden, mask_hidden, anchors, depths, 1).feats
    kept = first.clone()
    second = cod_gather(ids, hidden * 2, mask_hidden * 2, anchors, depths, 1).feats
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept) and torch.equal(second, kept * 2)
    cached_pointers = {first.data_ptr(), second.data_ptr()}
    del first, second
    third = cod_gather(ids, hidden, mask_hidden, anchors, depths, 1).feats
    assert torch.equal(third, kept)
    assert third.data_ptr() in cached_pointers, "a freed block of the same size must be reused"
    del third
    assert torch.ops.peagle.release_cpu_buffers() >= 2 * kept.numel() * kept.element_size()
    assert torch.ops.peagle.release_cpu_buffers() == 0


def test_cod_sample_rejects_document_ids_below_minus_one():
    # -1 is padding in every op; -2 used to be padding here but a real document for the mask ops.
    docs = torch.tensor([0, 0, -2, -2])
    with pytest.raises(RuntimeError, match=r"peagle\.cod_sample: document_ids must be >= -1 \(-1 = padding\), got -2"):
        cod_sample(torch.ones(4, dtype=torch.bool), docs, 2, 0.5, 0.1)


def test_cod_gather_checks_input_ids_against_vocab_size():
    args = dict(hidden=torch.zeros(4, 8), mask_hidden=torch.zeros(8), anchors=torch.tensor([0, 1]))
    args.update(depths=torch.tensor([0, 1]), mask_token_id=3, vocab_size=10)
    with pytest.raises(RuntimeError, match=r"peagle\.cod_gather: input_ids must be in \[0, vocab_size\) = \[0, 10\)"):
        cod_gather(torch.tensor([1, 2, 10, 3]), **args)
    with pytest.raises(RuntimeError, match=r"input_ids must be in \[0, vocab_size\)"):
        cod_gather(torch.tensor([1, -1, 0, 3]), **args)
    cod_gather(torch.tensor([1, 2, 9, 3]), **args)  # in range: fine
