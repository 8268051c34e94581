"""kv_compact on CUDA: CUDA op == CPU op bit for bit (the CPU tests hold the CPU op to the references), the same
errors with nothing modified, and the device checks."""

from __future__ import annotations

import pytest
import torch

from peagle.ops import kv_compact
from python_tests.test_kv import KvCase, assert_same, edit, many_cases, random_case, run_op, two_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_cuda(case: KvCase) -> KvCase:
    out = case.to("cuda")
    kv_compact(*out)
    torch.cuda.synchronize()
    return out.to("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", ["int64", "int32", "mixed"])
def test_cuda_equals_cpu_on_random_cases(generator, dtype, index):
    index_dtype = torch.int32 if index == "int32" else torch.int64
    table_dtype = torch.int32 if index == "mixed" else None
    for case in many_cases(generator, 25, dtype=dtype, index_dtype=index_dtype, table_dtype=table_dtype):
        assert_same(run_cuda(case), run_op(case))


@pytest.mark.parametrize("accept", ["none", "full", "random"])
@pytest.mark.parametrize("head_dim", [1, 3, 64, 128, 200])  # copy units of 2 to 16 bytes
def test_cuda_equals_cpu_row_sizes(generator, accept, head_dim):
    for case in many_cases(generator, 6, head_dim=head_dim, dtype=torch.float16, accept=accept, path_len=12):
        assert_same(run_cuda(case), run_op(case))


def test_cuda_rows_of_several_chunks(generator):
    """3 x 129 fp16 = 774-byte rows: 387 copy units of 2 bytes, split over two column chunks of 256 threads."""
    case = random_case(
        generator,
        batch=3,
        layers=2,
        block_size=4,
        kv_heads=3,
        head_dim=129,
        path_len=6,
        dtype=torch.float16,
        path_mode="gaps",
    )
    assert_same(run_cuda(case), run_op(case))


def test_cuda_many_layers_and_long_paths(generator):
    """130 layers = 260 caches: two move launches (256 caches each at most); paths of up to 20 moves (3 batches)."""
    case = random_case(
        generator, batch=5, layers=130, block_size=16, kv_heads=2, head_dim=32, path_len=21, dtype=torch.bfloat16
    )
    assert_same(run_cuda(case), run_op(case))


def test_cuda_large_batch(generator):
    case = random_case(generator, batch=300, layers=2, block_size=16, kv_heads=8, head_dim=128, path_len=8)
    assert_same(run_cuda(case), run_op(case))


def test_cuda_strided_seq_len(generator):
    case = random_case(generator, batch=4, layers=3, block_size=4, kv_heads=2, head_dim=16, path_len=6)
    cuda = case.to("cuda")
    lengths = torch.zeros(8, dtype=case.seq_len.dtype, device="cuda")
    lengths[::2] = cuda.seq_len
    kv_compact(*cuda._replace(seq_len=lengths[::2]))
    expected = run_op(case)
    assert_same(cuda._replace(seq_len=lengths[::2]).to("cpu"), expected)
    assert not lengths[1::2].any()


def test_cuda_errors_match_cpu_and_change_nothing(generator):
    c = two_requests(generator)
    bad_cases = {
        "num_accepted": c._replace(num_accepted=edit(c.num_accepted, 1, 4)),
        "seq_len": c._replace(seq_len=edit(c.seq_len, 0, -3)),
        "root": c._replace(accepted_path=edit(c.accepted_path, (1, 0), 2)),
        "order": c._replace(accepted_path=edit(c.accepted_path, (0, 2), 1)),
        "capacity": c._replace(seq_len=edit(c.seq_len, 1, c.block_table.shape[1] * 4)),
        "block": c._replace(block_table=edit(c.block_table, (0, (int(c.seq_len[0]) + 1) // 4), -1)),  # j = 1's
    }
    for name, bad in bad_cases.items():
        with pytest.raises(RuntimeError) as cpu_error:
            kv_compact(*bad.clone())
        cuda = bad.to("cuda")
        with pytest.raises(RuntimeError) as cuda_error:
            kv_compact(*cuda)
        assert str(cuda_error.value).splitlines()[0] == str(cpu_error.value).splitlines()[0], name
        assert_same(cuda.to("cpu"), bad)


def test_cuda_shared_block_is_rejected(generator):
    c = two_requests(generator)
    block = int(c.block_table[0, (int(c.seq_len[0]) + 7) // 4])  # request 0's last source block
    bad = c._replace(block_table=edit(c.block_table, (1, (int(c.seq_len[1]) + 6) // 4), block)).to("cuda")
    with pytest.raises(RuntimeError, match=rf"kv_compact: physical block {block} is read or written through"):
        kv_compact(*bad)


def test_cuda_device_checks(generator):
    c = two_requests(generator).to("cuda")
    with pytest.raises(RuntimeError, match=r"kv_compact: block_table must be on the same device as k_caches\[0\]"):
        kv_compact(*c._replace(block_table=c.block_table.cpu()))
    with pytest.raises(RuntimeError, match=r"kv_compact: v_caches\[1\] must be on k_caches\[0\]'s device"):
        kv_compact(*c._replace(v_caches=[c.v_caches[0], c.v_caches[1].cpu()]))
    with pytest.raises(RuntimeError, match=r"kv_compact: seq_len must be on the same device as k_caches\[0\]"):
        kv_compact(*c._replace(seq_len=c.seq_len.cpu()))
