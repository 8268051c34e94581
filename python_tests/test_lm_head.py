"""efficient_lm_head on the CPU: the reference against an exact integer brute force, the op against the reference
(bit for bit on exactly representable inputs, within float32 rounding on random ones), ties, non-finite scores, the
[N, V] scatter, every argument check, the fake kernel and opcheck."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import efficient_lm_head, efficient_lm_head_full_logits, efficient_lm_head_reference
from peagle.ops.lm_head import low_rank_scores_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class HeadInputs(NamedTuple):
    hidden: torch.Tensor  # [N, H]
    down: torch.Tensor  # [r, H]
    up: torch.Tensor  # [V, r]
    weight: torch.Tensor  # [V, H]

    def to(self, device) -> HeadInputs:
        return HeadInputs(*(t.to(device) for t in self))


def random_inputs(
    generator, rows: int, hidden_size: int, rank: int, vocab: int, dtype=torch.float32, kind: str = "integer"
) -> HeadInputs:
    """kind "integer": entries in {-1, 0, 1}, so every product and sum (|z| <= H <= 256, scores and logits small
    integers) is exact in float32 and z is exact in bfloat16/float16: any accumulation order gives the same bits, and
    scores tie often. kind "normal": Gaussian entries scaled like a trained head (scores and logits of order 1)."""

    def draw(*shape, scale=1.0):
        if kind == "integer":
            return torch.randint(-1, 2, shape, generator=generator).to(dtype)
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    return HeadInputs(
        draw(rows, hidden_size),
        draw(rank, hidden_size, scale=hidden_size**-0.5),
        draw(vocab, rank, scale=rank**-0.5),
        draw(vocab, hidden_size, scale=hidden_size**-0.5),
    )


def brute_force(inputs: HeadInputs, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer inputs only: exact int64 scores and logits, and a per-row Python sort by (-score, id)."""
    h = inputs.hidden.long()
    scores = (h @ inputs.down.long().T) @ inputs.up.long().T
    logits = h @ inputs.weight.long().T
    ids = [
        sorted(range(scores.shape[1]), key=lambda v, row=row: (-int(row[v]), v))[:num_candidates]
        for row in scores.tolist()
        for row in [torch.tensor(row)]
    ]
    ids = torch.tensor(ids, dtype=torch.long).reshape(h.shape[0], num_candidates)
    return ids, logits.gather(1, ids).float()


SHAPES = [  # rows N, hidden H, rank r, vocab V, candidates C
    (1, 8, 2, 5, 1),
    (3, 16, 4, 50, 50),
    (5, 33, 3, 300, 7),
    (2, 64, 8, 1000, 128),
    (4, 7, 1, 200, 199),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_integer_brute_force(generator, dtype, shape):
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype)
    ids, logits = efficient_lm_head_reference(*inputs, candidates)
    want_ids, want_logits = brute_force(inputs, candidates)
    assert ids.dtype == torch.long and logits.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert torch.equal(logits, want_logits)


def test_reference_rounds_z_to_the_input_dtype():
    """z = down @ h = 1 + 2^-9 is exact in float32 and rounds to 1 in bfloat16 (8 significant bits)."""
    hidden, down, up = torch.tensor([[1.0, 2.0**-9]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0]])
    assert low_rank_scores_reference(hidden, down, up).item() == 1.0 + 2.0**-9
    assert low_rank_scores_reference(hidden.bfloat16(), down.bfloat16(), up.bfloat16()).item() == 1.0


def test_reference_non_finite_and_signed_zero_scores():
    """NaN scores count as -inf (they come last, in id order with the -inf ones); -0.0 and +0.0 tie."""
    hidden = torch.tensor([[1.0]])
    down = torch.tensor([[1.0]])
    up = torch.tensor([[float("nan")], [-0.0], [float("-inf")], [0.0], [2.0], [float("inf")]])
    weight = torch.arange(6.0)[:, None]
    ids, logits = efficient_lm_head_reference(hidden, down, up, weight, 6)
    assert ids.tolist() == [[5, 4, 1, 3, 0, 2]]
    assert logits.tolist() == [[5.0, 4.0, 1.0, 3.0, 0.0, 2.0]]


# ---------------------------------------------------------------------------------------------------------------------
# The CPU op against the reference.


def run_op(inputs: HeadInputs, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return efficient_lm_head(*inputs, num_candidates)


# Rows x vocabulary large enough for several vocabulary blocks (4096 tokens at most each) and many buffer prunes.
OP_SHAPES = [*SHAPES, (1, 16, 4, 9000, 3), (70, 24, 5, 5000, 64), (3, 5, 2, 4097, 4097), (0, 8, 2, 10, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", OP_SHAPES)
def test_op_equals_reference_bitwise_on_exact_inputs(generator, dtype, shape):
    """Integer inputs make every sum exact, so the op must equal the reference bit for bit (ids and logits), ties
    (frequent here: small integer scores) included."""
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype)
    ids, logits = run_op(inputs, candidates)
    want_ids, want_logits = efficient_lm_head_reference(*inputs, candidates)
    assert ids.dtype == torch.long and logits.dtype == torch.float32
    assert ids.shape == logits.shape == (rows, candidates)
    assert torch.equal(ids, want_ids)
    assert torch.equal(logits, want_logits)


def assert_selection_close(ids, logits, inputs: HeadInputs, num_candidates: int, dtype) -> None:
    """Random (inexact) inputs: the op's accumulation order differs from the reference's, so near-ties may swap. Every
    chosen token must be within the rounding bound of the reference's C-th score, the chosen scores must not rise by
    more than that bound, ids must be distinct, and the logits must equal float64 dot products within float32
    rounding. The bound: float32 rounding of the score sums, plus one unit of z's dtype (bfloat16/float16 round z =
    down @ h, whose float32 sum may round the other way)."""
    hidden, down, up, weight = (t.double() for t in inputs)
    z = hidden @ down.T
    scores = z @ up.T
    z_unit = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}[dtype]
    bound = (up.abs() @ z.abs().T).T * (z_unit + 64 * 2.0**-24)  # [N, V]
    kth = scores.topk(num_candidates, dim=1).values[:, -1:]
    chosen, chosen_bound = scores.gather(1, ids), bound.gather(1, ids)
    assert torch.all(chosen >= kth - chosen_bound - bound.max(dim=1, keepdim=True).values)
    assert torch.all(chosen[:, 1:] <= chosen[:, :-1] + chosen_bound[:, 1:] + chosen_bound[:, :-1])
    assert all(len(set(row)) == num_candidates for row in ids.tolist())
    exact = (weight[ids] @ hidden[:, :, None]).squeeze(-1)
    logit_bound = (weight[ids].abs() @ hidden.abs()[:, :, None]).squeeze(-1) * 64 * 2.0**-24
    assert torch.all((logits.double() - exact).abs() <= logit_bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 64, 16, 6000, 128), (1, 100, 7, 5000, 1), (40, 32, 8, 3000, 500)])
def test_op_matches_reference_on_random_inputs(generator, dtype, shape):
    rows, hidden_size, rank, vocab, candidates = shape
    inputs = random_inputs(generator, rows, hidden_size, rank, vocab, dtype, kind="normal")
    ids, logits = run_op(inputs, candidates)
    assert_selection_close(ids, logits, inputs, candidates, dtype)
    want_ids, _ = efficient_lm_head_reference(*inputs, candidates)
    # Swaps need near-ties: nearly every candidate agrees with the reference exactly.
    assert (ids == want_ids).float().mean() > 0.9


def test_op_ties_go_to_the_lower_id(generator):
    """Duplicate rows of up give bit-identical scores: the lower id comes first, across vocabulary blocks."""
    inputs = random_inputs(generator, 32, 32, 8, 9000, kind="normal")
    up = inputs.up.clone()
    up[17] *= 1000  # token 17 and its copies win about half the rows (those where their score is not tiny)
    up[4100] = up[17]
    up[8500] = up[17]
    ids, _ = run_op(inputs._replace(up=up), 5)
    scores = low_rank_scores_reference(inputs.hidden, inputs.down, up)
    others = scores.clone()
    others[:, [17, 4100, 8500]] = float("-inf")
    winning = (scores[:, 17] > others.amax(1)).nonzero().flatten()
    assert len(winning) > 0  # a row fails to be won with probability about 1/2, all 32 with about 2^-32
    for n in winning.tolist():
        assert ids[n, :3].tolist() == [17, 4100, 8500]


def test_op_non_finite_and_signed_zero_scores():
    hidden, down = torch.tensor([[1.0]]), torch.tensor([[1.0]])
    up = torch.tensor([[float("nan")], [-0.0], [float("-inf")], [0.0], [2.0], [float("inf")]])
    weight = torch.arange(6.0)[:, None]
    for c in range(1, 7):
        ids, logits = run_op(HeadInputs(hidden, down, up, weight), c)
        assert ids.tolist() == [[5, 4, 1, 3, 0, 2][:c]]
        assert logits.tolist() == [[5.0, 4.0, 1.0, 3.0, 0.0, 2.0][:c]]


def test_op_accepts_non_contiguous_inputs(generator):
    inputs = random_inputs(generator, 4, 16, 4, 300, kind="integer")
    strided = HeadInputs(*(torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0] for t in inputs))
    assert not strided.hidden.is_contiguous()
    out, want = run_op(strided, 20), efficient_lm_head_reference(*inputs, 20)
    assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))


def rss_high_water_kib() -> tuple[int, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def test_op_never_holds_all_scores(generator):
    """64 rows x 400000 tokens: [N, V] float32 scores would take 100 MiB; the op's peak extra resident memory (its
    blocked scores and top-C buffers) must stay under a tenth of that."""
    inputs = random_inputs(generator, 64, 8, 4, 400_000, kind="normal")
    run_op(inputs, 16)  # warm-up: thread pools and BLAS buffers
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before, _ = rss_high_water_kib()
    run_op(inputs, 16)
    _, peak = rss_high_water_kib()
    full_scores_kib = 64 * 400_000 * 4 // 1024
    assert peak - before < full_scores_kib // 10, (peak - before, full_scores_kib)


def test_full_logits_scatter(generator):
    inputs = random_inputs(generator, 5, 16, 4, 400, kind="normal")
    with torch.no_grad():
        full = efficient_lm_head_full_logits(*inputs, 30)
        ids, logits = efficient_lm_head(*inputs, 30)
    assert full.shape == (5, 400) and full.dtype == torch.float32
    assert torch.equal(full.gather(1, ids), logits)
    outside = torch.ones_like(full, dtype=torch.bool).scatter_(1, ids, False)
    assert torch.all(full[outside] == float("-inf"))
    probs = torch.softmax(full, dim=1)
    assert torch.allclose(probs.sum(1), torch.ones(5))


def test_grad_required_is_an_error(generator):
    inputs = random_inputs(generator, 2, 8, 2, 20, kind="normal")
    with pytest.raises(RuntimeError, match="efficient_lm_head has no backward"):
        efficient_lm_head(inputs.hidden.requires_grad_(), *inputs[1:], 3)
    with torch.no_grad():
        efficient_lm_head(*inputs, 3)


def test_fake_kernel_and_opcheck(generator):
    inputs = random_inputs(generator, 3, 16, 4, 50, kind="normal")
    torch.library.opcheck(torch.ops.peagle.efficient_lm_head, (*inputs, 7))
    torch.library.opcheck(torch.ops.peagle.efficient_lm_head, (*inputs.to(torch.bfloat16), 50))
    with FakeTensorMode() as mode:
        fake = HeadInputs(*(mode.from_tensor(t) for t in inputs))
        ids, logits = torch.ops.peagle.efficient_lm_head(*fake, 7)
    assert ids.shape == logits.shape == (3, 7)
    assert ids.dtype == torch.long and logits.dtype == torch.float32


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda a: a._replace(hidden=a.hidden[0]), r"hidden must be 2-D \[N, H\], got shape \[16\]"),
        (lambda a: a._replace(down=a.down[None]), r"down must be 2-D \[r, H\]"),
        (lambda a: a._replace(up=a.up.flatten()), r"up must be 2-D \[V, r\]"),
        (lambda a: a._replace(weight=a.weight[None]), r"weight must be 2-D \[V, H\]"),
        (lambda a: HeadInputs(*(t.double() for t in a)), "hidden must be float32, bfloat16 or float16, got Double"),
        (lambda a: a._replace(up=a.up.half()), "up must have hidden's dtype Float, got Half"),
        (lambda a: a._replace(weight=a.weight.bfloat16()), "weight must have hidden's dtype Float, got BFloat16"),
        (lambda a: a._replace(hidden=a.hidden[:, :0], down=a.down[:, :0], weight=a.weight[:, :0]), "H >= 1"),
        (lambda a: a._replace(down=a.down[:0], up=a.up[:, :0]), "rank r >= 1"),
        (lambda a: a._replace(down=a.down[:, :15]), r"down must be \[r, H\] with H = 16 \(hidden's columns\)"),
        (lambda a: a._replace(up=a.up[:, :3]), r"up must be \[V, r\] with r = 4 \(down's rows\), got shape \[50, 3\]"),
        (lambda a: a._replace(weight=a.weight[:49]), r"weight must be \[V, H\] = \[50, 16\]"),
        (lambda a: a._replace(weight=a.weight[:, :15]), r"weight must be \[V, H\] = \[50, 16\]"),
    ],
)
def test_argument_errors(generator, edit, message):
    inputs = edit(random_inputs(generator, 3, 16, 4, 50, kind="normal"))
    with pytest.raises(RuntimeError, match=message):
        run_op(inputs, 5)


@pytest.mark.parametrize("candidates", [0, -1, 51])
def test_num_candidates_out_of_range(generator, candidates):
    inputs = random_inputs(generator, 3, 16, 4, 50, kind="normal")
    with pytest.raises(RuntimeError, match=rf"num_candidates must be in \[1, V\] = \[1, 50\], got {candidates}"):
        run_op(inputs, candidates)
