"""kv_compact on the CPU: the op against the vectorised reference and an independent per-slot loop, untouched entries,
the read-before-write order, every argument check, the fake kernel and opcheck."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from peagle.ops import kv_compact, kv_compact_reference


class KvCase(NamedTuple):
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    block_table: torch.Tensor  # [B, max_blocks]
    seq_len: torch.Tensor  # [B]
    accepted_path: torch.Tensor  # [B, P]
    num_accepted: torch.Tensor  # [B]

    def clone(self) -> KvCase:
        return KvCase(
            [c.clone() for c in self.k_caches], [c.clone() for c in self.v_caches], *(t.clone() for t in self[2:])
        )

    def to(self, device) -> KvCase:
        return KvCase(
            [c.to(device) for c in self.k_caches],
            [c.to(device) for c in self.v_caches],
            *(t.to(device) for t in self[2:]),
        )


def randint(generator, low: int, high: int) -> int:
    """Uniform in [low, high]."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def random_path(generator, nodes: int, accepted: int, mode: str) -> list[int]:
    """An accepted path of `accepted` drafts in a tree of `nodes` nodes: 0 then strictly increasing node indices."""
    if mode == "chain":  # every move an identity
        return list(range(accepted + 1))
    if mode == "tail":  # identities, then a gap
        keep = randint(generator, 0, accepted)
        rest = torch.randperm(nodes - 1 - keep, generator=generator)[: accepted - keep] + keep + 1
        return list(range(keep + 1)) + sorted(rest.tolist())
    return [0, *sorted((torch.randperm(nodes - 1, generator=generator)[:accepted] + 1).tolist())]


def random_case(
    generator,
    *,
    batch: int,
    layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    path_len: int,
    dtype=torch.float32,
    index_dtype=torch.int64,
    table_dtype=None,
    accept: str = "random",
    path_mode: str | None = None,
    min_nodes: int = 1,
) -> KvCase:
    """Ragged requests, each with a tree of n >= path_len nodes written after its committed prefix, an accepted path
    (random / none / full acceptance) and its own shuffled physical blocks; spare blocks and -1 entries around them."""
    seqs, paths, counts, needed = [], [], [], []
    for _ in range(batch):
        seq = randint(generator, 0, 3 * block_size + 5)
        nodes = randint(generator, max(path_len, min_nodes), max(path_len, min_nodes) + 6)
        top = path_len - 1
        accepted = {"none": 0, "full": top}.get(accept, randint(generator, 0, top))
        mode = path_mode or ["gaps", "chain", "tail"][randint(generator, 0, 2)]
        seqs.append(seq)
        counts.append(accepted)
        paths.append(random_path(generator, nodes, accepted, mode) + [-1] * (path_len - 1 - accepted))
        needed.append(-(-(seq + nodes) // block_size))
    max_blocks = max(needed) + randint(generator, 0, 2)
    num_blocks = sum(needed) + randint(generator, 0, 4)
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((batch, max_blocks), -1, dtype=torch.long)
    for b, count in enumerate(needed):
        table[b, :count] = torch.tensor(physical[:count])
        physical = physical[count:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2 * layers)]
    return KvCase(
        caches[:layers],
        caches[layers:],
        table.to(table_dtype or index_dtype),
        torch.tensor(seqs, dtype=index_dtype),
        torch.tensor(paths, dtype=index_dtype),
        torch.tensor(counts, dtype=index_dtype),
    )


def many_cases(generator, count: int, **fixed):
    for _ in range(count):
        params = dict(
            batch=randint(generator, 1, 6),
            layers=randint(generator, 1, 4),
            block_size=[1, 2, 3, 4, 16][randint(generator, 0, 4)],
            kv_heads=randint(generator, 1, 3),
            head_dim=[1, 2, 3, 8, 16, 64][randint(generator, 0, 5)],
            path_len=randint(generator, 1, 9),
        )
        params.update(fixed)
        yield random_case(generator, **params)


def run_op(case: KvCase) -> KvCase:
    out = case.clone()
    kv_compact(*out)
    return out


def run_reference(case: KvCase) -> KvCase:
    out = case.clone()
    kv_compact_reference(*out)
    return out


def slot_row(case: KvCase, b: int, slot: int) -> tuple[int, int]:
    block_size = case.k_caches[0].shape[1]
    return int(case.block_table[b, slot // block_size]), slot % block_size


def loop_reference(case: KvCase, *, snapshot: bool = True, increasing: bool = True) -> KvCase:
    """Independent spec: slot by slot, request by request. snapshot=True copies every source before writing; with
    snapshot=False the moves run in place in the given order (correct in increasing order, see peagle/kv.h)."""
    out = case.clone()
    for b in range(len(case.seq_len)):
        seq, count = int(case.seq_len[b]), int(case.num_accepted[b])
        path = case.accepted_path[b].tolist()
        order = list(range(1, count + 1)) if increasing else list(range(count, 0, -1))
        for cache in (*out.k_caches, *out.v_caches):
            sources = {j: cache[slot_row(case, b, seq + path[j])].clone() for j in order} if snapshot else None
            for j in order:
                value = sources[j] if snapshot else cache[slot_row(case, b, seq + path[j])].clone()
                cache[slot_row(case, b, seq + j)] = value
        out.seq_len[b] = seq + count + 1
    return out


def same(a: KvCase, b: KvCase) -> bool:
    caches = all(torch.equal(x, y) for x, y in zip([*a.k_caches, *a.v_caches], [*b.k_caches, *b.v_caches], strict=True))
    return caches and a.seq_len.dtype == b.seq_len.dtype and torch.equal(a.seq_len, b.seq_len)


def assert_same(a: KvCase, b: KvCase) -> None:
    for x, y in zip([*a.k_caches, *a.v_caches], [*b.k_caches, *b.v_caches], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a.seq_len.dtype == b.seq_len.dtype and torch.equal(a.seq_len, b.seq_len)


# ---------------------------------------------------------------------------------------------------------------------
# Results.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", ["int64", "int32", "mixed"])
def test_op_matches_references_on_random_cases(generator, dtype, index):
    index_dtype = torch.int32 if index == "int32" else torch.int64
    table_dtype = torch.int32 if index == "mixed" else None
    for case in many_cases(generator, 25, dtype=dtype, index_dtype=index_dtype, table_dtype=table_dtype):
        got = run_op(case)
        assert_same(got, run_reference(case))
        assert_same(got, loop_reference(case))
        assert got.block_table.equal(case.block_table) and got.accepted_path.equal(case.accepted_path)


@pytest.mark.parametrize("accept", ["none", "full"])
@pytest.mark.parametrize("path_mode", ["gaps", "chain", "tail"])
def test_edge_acceptance(generator, accept, path_mode):
    for case in many_cases(generator, 10, accept=accept, path_mode=path_mode):
        got = run_op(case)
        assert_same(got, loop_reference(case))
        expected_len = case.seq_len + (0 if accept == "none" else case.accepted_path.shape[1] - 1) + 1
        assert torch.equal(got.seq_len, expected_len)
        if accept == "none" or path_mode == "chain":  # no move at all: the caches are unchanged
            assert_same(got._replace(seq_len=case.seq_len), case)


def test_large_rows_and_many_layers(generator):
    """Rows of 8 x 128 bf16 (2 KiB, 16-byte copy units), 12 layers, blocks of 16, a batch of 8."""
    for case in many_cases(
        generator, 3, batch=8, layers=12, block_size=16, kv_heads=8, head_dim=128, path_len=8, dtype=torch.bfloat16
    ):
        assert_same(run_op(case), run_reference(case))


def test_entries_outside_the_destinations_are_untouched(generator):
    for case in many_cases(generator, 20):
        got = run_op(case)
        touched = torch.zeros(case.k_caches[0].shape[:2], dtype=torch.bool)
        for b in range(len(case.seq_len)):
            seq, path = int(case.seq_len[b]), case.accepted_path[b].tolist()
            for j in range(1, int(case.num_accepted[b]) + 1):
                touched[slot_row(case, b, seq + j)] = path[j] != j
        for before, after in zip([*case.k_caches, *case.v_caches], [*got.k_caches, *got.v_caches], strict=True):
            assert torch.equal(before[~touched], after[~touched])
            # ... and the destinations do change (random data: a moved row differs from the one it replaces).
            assert not (before[touched] == after[touched]).all(dim=(-1, -2)).any()


def crafted_case(path: list[int], seq: int = 3, block_size: int = 2) -> KvCase:
    """One request, one layer, head_dim 1: slot s of the tree holds the value 100 + s, so results read as slots."""
    nodes = path[-1] + 1
    blocks = -(-(seq + nodes) // block_size)
    table = torch.tensor([list(range(blocks))[::-1]])  # reversed: logical order != physical order
    k = torch.zeros(blocks, block_size, 1, 1)
    for s in range(seq + nodes):
        k[table[0, s // block_size], s % block_size] = 100.0 + s
    count = len(path) - 1
    return KvCase([k], [-k], table, torch.tensor([seq]), torch.tensor([path]), torch.tensor([count]))


def logical_values(case: KvCase, length: int) -> list[float]:
    return [float(case.k_caches[0][slot_row(case, 0, s)]) for s in range(length)]


@pytest.mark.parametrize("path", [[0, 2, 4], [0, 1, 3, 4, 6], [0, 3], [0, 2, 3, 5, 8]])
def test_destination_that_is_another_source(path):
    """Path [0, 2, 4]: slot seq + 2 is j = 2's destination and j = 1's source; it must be read first."""
    case = crafted_case(path)
    seq = int(case.seq_len[0])
    got = run_op(case)
    expected = [100.0 + s for s in range(seq)] + [100.0 + seq + p for p in path]
    assert logical_values(got, seq + len(path)) == expected
    assert int(got.seq_len[0]) == seq + len(path)
    assert_same(got, run_reference(case))


def test_power_write_before_read_is_detected(generator):
    """The comparison catches an implementation that writes before it reads: moving in decreasing j in place gives
    [.., 104, 107, 107] instead of [.., 103 + 2, 103 + 4] on path [0, 2, 4]; in increasing order it is right (the
    argument of peagle/kv.h), which the random cases confirm."""
    case = crafted_case([0, 2, 4])
    assert not same(run_op(case), loop_reference(case, snapshot=False, increasing=False))
    assert same(run_op(case), loop_reference(case, snapshot=False, increasing=True))
    wrong = 0
    for case in many_cases(generator, 20, path_mode="gaps", accept="full", path_len=5):
        got = run_op(case)
        assert same(got, loop_reference(case, snapshot=False, increasing=True))
        wrong += not same(got, loop_reference(case, snapshot=False, increasing=False))
    assert wrong >= 10  # about 90% of these cases have a destination that is another move's source


def test_empty_batch():
    case = crafted_case([0, 2])
    empty = case._replace(
        block_table=case.block_table[:0],
        seq_len=case.seq_len[:0],
        accepted_path=case.accepted_path[:0],
        num_accepted=case.num_accepted[:0],
    )
    assert_same(run_op(empty), empty)


# ---------------------------------------------------------------------------------------------------------------------
# Checks: each raises a clear error naming the argument, and a bad value leaves everything unchanged.


def call(case: KvCase, **changes) -> None:
    kv_compact(*case._replace(**changes))


def two_requests(generator) -> KvCase:
    """Two requests of trees with >= 8 nodes, both accepting 3 drafts along paths with gaps (every path moves)."""
    case = random_case(generator, batch=2, layers=2, block_size=4, kv_heads=2, head_dim=8, path_len=4, min_nodes=8)
    paths = torch.tensor([[0, 2, 4, 7], [0, 1, 3, 6]], dtype=case.accepted_path.dtype)
    return case._replace(accepted_path=paths, num_accepted=torch.full_like(case.num_accepted, 3))


def test_layer_list_checks(generator):
    c = two_requests(generator)
    k, v = c.k_caches, c.v_caches
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: k_caches and v_caches must list the same number of layers, "
        r"got 2 and 1",
    ):
        call(c, v_caches=v[:1])
    with pytest.raises(RuntimeError, match=r"kv_compact: k_caches must list at least one layer, got 0"):
        call(c, k_caches=[], v_caches=[])
    with pytest.raises(RuntimeError, match=r"kv_compact: k_caches\[0\] must be 4-D \[num_blocks, block_size, kv_heads"):
        call(c, k_caches=[k[0][0], k[1]])
    with pytest.raises(RuntimeError, match=r"kv_compact: k_caches\[0\] must be float32, bfloat16 or float16, got Int"):
        call(c, k_caches=[x.int() for x in k], v_caches=[x.int() for x in v])
    with pytest.raises(RuntimeError, match=r"kv_compact: k_caches\[0\] must not be empty"):
        call(c, k_caches=[x[:0] for x in k], v_caches=[x[:0] for x in v])
    with pytest.raises(RuntimeError, match=r"kv_compact: v_caches\[1\] must have k_caches\[0\]'s shape"):
        call(c, v_caches=[v[0], v[1][:, :, :1].contiguous()])
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: k_caches\[1\] must have k_caches\[0\]'s dtype Float, got "
        r"BFloat16",
    ):
        call(c, k_caches=[k[0], k[1].bfloat16()])
    with pytest.raises(RuntimeError, match=r"kv_compact: v_caches\[0\] must be contiguous \(updated in place\)"):
        call(c, v_caches=[v[0].transpose(2, 3).contiguous().transpose(2, 3), v[1]])
    with pytest.raises(RuntimeError, match=r"kv_compact: the layers' caches must not overlap in memory"):
        call(c, v_caches=[v[0], k[1]])
    both = torch.cat([k[0], k[0]])  # two layers as halves of one buffer, offset by one block: overlapping
    with pytest.raises(RuntimeError, match=r"kv_compact: the layers' caches must not overlap in memory"):
        call(c, k_caches=[both[:4], both[1:5]], v_caches=[v[0][:4].clone(), v[1][:4].clone()])


def test_index_checks(generator):
    c = two_requests(generator)
    with pytest.raises(RuntimeError, match=r"kv_compact: block_table must be 2-D \[B, max_blocks\], got shape \[2\]"):
        call(c, block_table=c.block_table[:, 0])
    with pytest.raises(RuntimeError, match=r"kv_compact: block_table must be int32 or int64, got Float"):
        call(c, block_table=c.block_table.float())
    with pytest.raises(RuntimeError, match=r"kv_compact: seq_len must be int32 or int64, got Float"):
        call(c, seq_len=c.seq_len.float())
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: seq_len must be \[B\] with B = 2 \(block_table's rows\), got "
        r"shape \[3\]",
    ):
        call(c, seq_len=torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"kv_compact: accepted_path must be 2-D \[B, P\]"):
        call(c, accepted_path=c.accepted_path[0])
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: accepted_path must be \[B, P\] with B = 2 and P >= 1, got "
        r"shape \[2, 0\]",
    ):
        call(c, accepted_path=c.accepted_path[:, :0])
    with pytest.raises(RuntimeError, match=r"kv_compact: accepted_path must be int32 or int64, got Double"):
        call(c, accepted_path=c.accepted_path.double())
    with pytest.raises(RuntimeError, match=r"kv_compact: num_accepted must be \[B\] with B = 2, got shape \[1\]"):
        call(c, num_accepted=c.num_accepted[:1])
    with pytest.raises(RuntimeError, match=r"kv_compact: num_accepted must be 1-D \[B\]"):
        call(c, num_accepted=c.num_accepted[None])
    with pytest.raises(RuntimeError, match=r"kv_compact: num_accepted must be int32 or int64, got Bool"):
        call(c, num_accepted=c.num_accepted > 0)


def edit(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def test_value_checks(generator):
    c = two_requests(generator)  # P = 4, full acceptance with gaps
    path = c.accepted_path
    with pytest.raises(RuntimeError, match=r"kv_compact: num_accepted\[1\] must be in \[0, P - 1\] = \[0, 3\], got 4"):
        call(c, num_accepted=edit(c.num_accepted, 1, 4))
    with pytest.raises(RuntimeError, match=r"kv_compact: num_accepted\[0\] must be in \[0, P - 1\] = \[0, 3\], got -1"):
        call(c, num_accepted=edit(c.num_accepted, 0, -1))
    with pytest.raises(RuntimeError, match=r"kv_compact: seq_len\[1\] must be >= 0, got -2"):
        call(c, seq_len=edit(c.seq_len, 1, -2))
    with pytest.raises(RuntimeError, match=r"kv_compact: accepted_path\[0, 0\] must be 0 \(the root\), got 1"):
        call(c, accepted_path=edit(path, (0, 0), 1))
    with pytest.raises(
        RuntimeError,
        match=rf"kv_compact: accepted_path\[1, 2\] must be > accepted_path\[1, 1\] = "
        rf"{int(path[1, 1])} \(node indices strictly increase along the path\), got {int(path[1, 1])}",
    ):
        call(c, accepted_path=edit(path, (1, 2), path[1, 1]))
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: accepted_path\[0, 3\] must be > accepted_path\[0, 2\] = .*"
        r"got -1",
    ):
        call(c, accepted_path=edit(path, (0, 3), -1))
    capacity = c.block_table.shape[1] * 4
    seq = capacity - int(path[1, 3])  # the last accepted node's slot is one past the covered slots
    with pytest.raises(
        RuntimeError,
        match=rf"kv_compact: slot seq_len\[1\] \+ accepted_path\[1, 3\] = {capacity} must "
        rf"be < the slots block_table covers \(max_blocks \* block_size = .* = {capacity}\)",
    ):
        call(c, seq_len=edit(c.seq_len, 1, seq))
    seq1, last = int(c.seq_len[1]), int(path[1, 3])
    source_block = (seq1 + last) // 4
    num_blocks = c.k_caches[0].shape[0]
    for bad in (-1, num_blocks):
        with pytest.raises(
            RuntimeError,
            match=rf"kv_compact: block_table\[1, {source_block}\] must be a physical block "
            rf"in \[0, num_blocks\) = \[0, {num_blocks}\) .* got {bad}",
        ):
            call(c, block_table=edit(c.block_table, (1, source_block), bad))
    stolen = int(c.block_table[0, (int(c.seq_len[0]) + int(path[0, 3])) // 4])
    with pytest.raises(
        RuntimeError,
        match=rf"kv_compact: physical block {stolen} is read or written through "
        rf"block_table\[1, {source_block}\] and also through block_table\[0, \d+\]",
    ):
        call(c, block_table=edit(c.block_table, (1, source_block), stolen))


def test_block_used_twice_by_one_request():
    case = crafted_case([0, 5], seq=0, block_size=2)  # moves slot 5 (logical block 2) to slot 1 (logical block 0)
    table = edit(case.block_table, (0, 2), int(case.block_table[0, 0]))
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: physical block 2 is read or written through block_table\[0, "
        r"0\] and also through block_table\[0, 2\]",
    ):
        call(case, block_table=table)


def test_int32_seq_len_overflow():
    """A block table covering 2^31 slots (one 2^20-slot block, mapped 2048 times, no move) and an int32 length."""
    k = torch.zeros(1, 1 << 20, 1, 1)
    table = torch.zeros(1, 2048, dtype=torch.int32)
    seq_len = torch.tensor([2**31 - 1], dtype=torch.int32)
    path, count = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(
        RuntimeError,
        match=r"kv_compact: the new seq_len\[0\] = 2147483648 does not fit seq_len's "
        r"dtype \(max 2147483647\)",
    ):
        kv_compact([k], [k.clone()], table, seq_len, path, count)
    kv_compact([k], [k.clone()], table, seq_len.long(), path, count)  # int64 lengths hold it


def test_bad_value_changes_nothing(generator):
    """Request 0 is valid and would move rows; request 1 is bad: the op raises before writing anything."""
    c = two_requests(generator)
    bad = c._replace(num_accepted=edit(c.num_accepted, 1, 9))
    out = bad.clone()
    with pytest.raises(RuntimeError, match=r"num_accepted\[1\]"):
        kv_compact(*out)
    assert_same(out, bad)


# ---------------------------------------------------------------------------------------------------------------------
# Fake kernel and opcheck.


def test_fake_kernel(generator):
    case = two_requests(generator)
    with FakeTensorMode() as mode:
        fake = KvCase(
            [mode.from_tensor(t) for t in case.k_caches],
            [mode.from_tensor(t) for t in case.v_caches],
            *(mode.from_tensor(t) for t in case[2:]),
        )
        assert kv_compact(*fake) is None


def test_compiled_matches_eager(generator):
    case = two_requests(generator)
    compiled = case.clone()
    torch.compile(kv_compact, fullgraph=True, backend="aot_eager")(*compiled)
    assert_same(compiled, run_op(case))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_opcheck(generator, index_dtype):
    case = random_case(
        generator,
        batch=3,
        layers=2,
        block_size=4,
        kv_heads=2,
        head_dim=4,
        path_len=4,
        index_dtype=index_dtype,
        path_mode="gaps",
    )
    # Room for the repeated calls opcheck makes on the same inputs (each grows seq_len).
    table = torch.cat([case.block_table, torch.full_like(case.block_table, -1).repeat(1, 8)], dim=1)
    torch.library.opcheck(torch.ops.peagle.kv_compact.default, tuple(case._replace(block_table=table)))
