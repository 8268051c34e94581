// CPU kernel of kv_compact: validates every request first (nothing is modified when any value is bad), then moves the
// accepted rows in parallel over (request, cache) tasks with the shared peagle/kv.h math, then sets the new lengths.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "checks/kv.h"
#include "peagle/kv.h"

namespace peagle {
namespace {

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

// Owner of each claimed physical block (a map: a round touches few blocks of a possibly large pool).
struct HostClaim {
  std::unordered_map<int64_t, int64_t> owner;
  int64_t operator()(int64_t block, int64_t key) {
    const auto inserted = owner.emplace(block, key);
    return inserted.second ? -1 : inserted.first->second;
  }
};

struct Plan {
  const int64_t* table;
  const int64_t* path;
  const int64_t* seq;
  const int64_t* num_accepted;
  std::vector<int64_t> first;  // first non-identity move per request
};

// Validates every request in order and raises the first error; returns the first move of each request.
std::vector<int64_t> validate(const KvDims& d, const Plan& p) {
  const kv::Geometry& g = d.geometry;
  std::vector<int64_t> first(d.batch);
  HostClaim claim;
  for (int64_t b = 0; b < d.batch; ++b) {
    const int64_t* row = p.table + b * g.max_blocks;
    const int64_t* path = p.path + b * g.path_len;
    kv::Check c = kv::check_request(g, row, p.seq[b], path, p.num_accepted[b], d.len_max);
    if (c.code == kv::kOk) c = kv::claim_blocks(g, row, b, p.seq[b], path, p.num_accepted[b], claim);
    if (c.code != kv::kOk) raise_kv_error(b, c, d);
    first[b] = kv::first_move(path, p.num_accepted[b]);
  }
  return first;
}

template <typename Unit>
void move_all(const KvDims& d, const Plan& p, const std::vector<char*>& caches) {
  const int64_t row_units = d.row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int64_t num_caches = static_cast<int64_t>(caches.size());
  const kv::Geometry& g = d.geometry;
  // Each task moves at most P - 1 rows; aim for >= 64 KiB per parallel chunk.
  const int64_t task_bytes = std::max<int64_t>(1, d.row_bytes * (g.path_len - 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / task_bytes);
  at::parallel_for(0, d.batch * num_caches, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_caches, cache = task % num_caches;
      if (p.first[b] > p.num_accepted[b]) continue;
      kv::move_rows(reinterpret_cast<Unit*>(caches[cache]), row_units, p.table + b * g.max_blocks, g.block_size,
                    p.seq[b], p.path + b * g.path_len, p.first[b], p.num_accepted[b]);
    }
  });
}

void kv_compact_cpu(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                    const at::Tensor& seq_len, const at::Tensor& accepted_path, const at::Tensor& num_accepted) {
  const KvDims d = check_kv_compact_args(k_caches, v_caches, block_table, seq_len, accepted_path, num_accepted);
  if (d.batch == 0) return;
  const at::Tensor table = block_table.to(at::kLong).contiguous(), path = accepted_path.to(at::kLong).contiguous();
  const at::Tensor seq = seq_len.to(at::kLong).contiguous(), count = num_accepted.to(at::kLong).contiguous();
  Plan p{table.data_ptr<int64_t>(), path.data_ptr<int64_t>(), seq.data_ptr<int64_t>(), count.data_ptr<int64_t>(), {}};
  p.first = validate(d, p);

  std::vector<char*> caches;
  uint64_t address_bits = 0;
  for (const at::TensorList list : {k_caches, v_caches}) {
    for (const at::Tensor& c : list) {
      caches.push_back(static_cast<char*>(c.data_ptr()));
      address_bits |= reinterpret_cast<uintptr_t>(c.data_ptr());
    }
  }
  switch (kv::unit_bytes(d.row_bytes, address_bits)) {
    case 16:
      move_all<Bytes16>(d, p, caches);
      break;
    case 8:
      move_all<uint64_t>(d, p, caches);
      break;
    case 4:
      move_all<uint32_t>(d, p, caches);
      break;
    case 2:
      move_all<uint16_t>(d, p, caches);
      break;
    default:
      move_all<uint8_t>(d, p, caches);
  }
  const at::Tensor new_len = seq + count + 1;  // a new tensor: `seq` may alias seq_len
  seq_len.copy_(new_len);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("kv_compact", &peagle::kv_compact_cpu); }
