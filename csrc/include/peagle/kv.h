// Accepted-path KV compaction math, shared by the CPU and CUDA kernels. No torch includes.
//
// Paged cache, per layer [num_blocks, block_size, kv_heads, head_dim]: logical slot s of request b lives in physical
// row block_table[b, s / block_size] * block_size + s % block_size, a row of kv_heads * head_dim contiguous elements.
// A round wrote tree node i of request b at logical slot seq + i (seq = seq_len[b]). Compaction moves, for
// j = 1..num_accepted, the row of node path[j] (slot seq + path[j]) to slot seq + j, in every layer.
//
// Why the moves may run in increasing j with each destination written after its own source is read (and need no
// snapshot of the sources), even when a destination is another move's source (path [0, 2, 4]: slot 2 is written by
// j = 2 and read by j = 1):
//   path is strictly increasing from path[0] = 0, so path[j] >= j, and a source seq + path[j''] of a later move
//   j'' > j lies at path[j''] > path[j] >= j: strictly after the destination seq + j. A destination is therefore never
//   read by a later move; it can only be the source of an earlier move j' < j (path[j'] = j), already read, or of the
//   move itself (path[j] = j, an identity).
//   The same holds for any split of 1..num_accepted into consecutive ranges handled in order, each range reading all
//   its sources before writing any destination: the destinations of a range end at seq + max(range), before every
//   source of the later ranges. copy_batch reads kBatch rows, then writes them.
// Parallel kernels split a row into columns (copy units at the same byte offset in every row): each column is handled
// by one thread alone, in the order above, and different columns never touch the same bytes (a CUDA block shares only
// the read-only row offsets of each batch). The argument needs distinct logical slots to be distinct physical rows:
// the checks reject requests (or logical blocks of one request) that share a physical block a move reads or writes
// (claim_blocks), and layer caches that overlap in memory.
// Moves with path[j] = j are identities and are skipped: since path[j] - j never decreases, they are exactly the
// j < first_move(...).
#pragma once

#include <cstdint>

#include "peagle/common.h"

namespace peagle {
namespace kv {

#if defined(__CUDACC__)
#define PEAGLE_KV_UNROLL _Pragma("unroll")
#define PEAGLE_KV_NO_UNROLL _Pragma("unroll 1")
#else
#define PEAGLE_KV_UNROLL
#define PEAGLE_KV_NO_UNROLL
#endif

constexpr int kBatch = 8;  // moves whose sources are read together before their destinations are written

// Value errors of one request (csrc/checks/kv.h turns them into messages).
enum Error : int64_t {
  kOk = 0,
  kNumAccepted,  // value = num_accepted[b]
  kSeqLen,       // value = seq_len[b]
  kRoot,         // value = path[b, 0]
  kPathOrder,    // index = j, value = path[b, j], bound = path[b, j - 1]
  kCapacity,     // index = j, value = seq + path[b, j] (the slot), bound = the slots the block table covers
  kBlockId,      // index = logical block, value = its physical block id
  kBlockShared,  // index = logical block, value = physical block, bound = owner key of the other user
  kLenOverflow,  // value = seq + num_accepted + 1, bound = the largest seq_len value
};

struct Check {
  int64_t code, index, value, bound;
};

struct Geometry {
  int64_t num_blocks, block_size, max_blocks, path_len;
};

template <typename Index>
PEAGLE_HD int64_t physical_row(const Index* table_row, int64_t block_size, int64_t slot) {
  return static_cast<int64_t>(table_row[slot / block_size]) * block_size + slot % block_size;
}

// Smallest j >= 1 with path[j] != j (num_accepted + 1 when every move is an identity).
template <typename Index>
PEAGLE_HD int64_t first_move(const Index* path, int64_t num_accepted) {
  int64_t j = 1;
  while (j <= num_accepted && static_cast<int64_t>(path[j]) == j) ++j;
  return j;
}

// Checks request b's values: num_accepted, seq_len, the accepted path (from the root 0, strictly increasing, inside
// the slots its block table row covers), the new length, and the physical block ids of every slot a move touches.
template <typename Index>
PEAGLE_HD Check check_request(const Geometry& g, const Index* table_row, int64_t seq, const Index* path,
                              int64_t num_accepted, int64_t len_max) {
  if (num_accepted < 0 || num_accepted >= g.path_len) return {kNumAccepted, 0, num_accepted, g.path_len - 1};
  if (seq < 0) return {kSeqLen, 0, seq, 0};
  if (path[0] != 0) return {kRoot, 0, static_cast<int64_t>(path[0]), 0};
  for (int64_t j = 1; j <= num_accepted; ++j) {
    if (path[j] <= path[j - 1])
      return {kPathOrder, j, static_cast<int64_t>(path[j]), static_cast<int64_t>(path[j - 1])};
  }
  const int64_t capacity = g.max_blocks * g.block_size;
  const int64_t last = static_cast<int64_t>(path[num_accepted]);  // seq + last is the largest slot the path names
  if (seq >= capacity - last) return {kCapacity, num_accepted, seq + last, capacity};
  if (seq + num_accepted >= len_max) return {kLenOverflow, 0, seq + num_accepted + 1, len_max};
  for (int64_t j = first_move(path, num_accepted); j <= num_accepted; ++j) {
    const int64_t blocks[2] = {(seq + static_cast<int64_t>(path[j])) / g.block_size, (seq + j) / g.block_size};
    for (const int64_t lb : blocks) {
      const int64_t id = static_cast<int64_t>(table_row[lb]);
      if (id < 0 || id >= g.num_blocks) return {kBlockId, lb, id, g.num_blocks};
    }
  }
  return {kOk, 0, 0, 0};
}

// Who uses a physical block: request b through its logical block lb.
PEAGLE_HD int64_t owner_key(int64_t b, int64_t logical_block, int64_t max_blocks) {
  return b * max_blocks + logical_block;
}

// Claims every physical block that request b's moves read or write (call after check_request passed). claim(p, key)
// records `key` as p's owner unless it has one and returns the previous owner (-1 if none): a block claimed under
// another (request, logical block) is shared, which the moves cannot allow (see the top of this file).
template <typename Index, typename Claim>
PEAGLE_HD Check claim_blocks(const Geometry& g, const Index* table_row, int64_t b, int64_t seq, const Index* path,
                             int64_t num_accepted, Claim& claim) {
  for (int64_t j = first_move(path, num_accepted); j <= num_accepted; ++j) {
    const int64_t blocks[2] = {(seq + static_cast<int64_t>(path[j])) / g.block_size, (seq + j) / g.block_size};
    for (const int64_t lb : blocks) {
      const int64_t block = static_cast<int64_t>(table_row[lb]);
      const int64_t key = owner_key(b, lb, g.max_blocks);
      const int64_t previous = claim(block, key);
      if (previous != -1 && previous != key) return {kBlockShared, lb, block, previous};
    }
  }
  return {kOk, 0, 0, 0};
}

// Offsets (in copy units) of the source and destination rows of move j of one request.
struct Move {
  int64_t src, dst;
};

template <typename Index>
PEAGLE_HD Move move_offsets(const Index* table_row, int64_t block_size, int64_t seq, const Index* path, int64_t j,
                            int64_t row_units) {
  return {physical_row(table_row, block_size, seq + static_cast<int64_t>(path[j])) * row_units,
          physical_row(table_row, block_size, seq + j) * row_units};
}

// One batch of count <= kBatch consecutive moves, columns c0, c0 + step, ... < c1 of each row: per column, every
// source of the batch is read before any destination is written. The batch loops have a constant trip count (fully
// unrolled on the GPU), so the batch lives in registers.
template <typename Unit>
PEAGLE_HD void copy_batch(Unit* cache, const Move* batch, int64_t count, int64_t c0, int64_t c1, int64_t step) {
  Move m[kBatch];
  PEAGLE_KV_UNROLL
  for (int t = 0; t < kBatch; ++t) {
    m[t] = batch[t < count ? t : count - 1];  // past the batch: a copy that is never used (all initialised)
  }
  PEAGLE_KV_NO_UNROLL
  for (int64_t c = c0; c < c1; c += step) {
    Unit rows[kBatch] = {};
    PEAGLE_KV_UNROLL
    for (int t = 0; t < kBatch; ++t) {
      if (t < count) rows[t] = cache[m[t].src + c];
    }
    PEAGLE_KV_UNROLL
    for (int t = 0; t < kBatch; ++t) {
      if (t < count) cache[m[t].dst + c] = rows[t];
    }
  }
}

// Moves j in [first, last] of one request in one layer (a row is row_units Units), batches in increasing j, all
// columns by one thread. The CUDA kernel runs the same batches with the columns split over a block.
template <typename Unit, typename Index>
PEAGLE_HD void move_rows(Unit* cache, int64_t row_units, const Index* table_row, int64_t block_size, int64_t seq,
                         const Index* path, int64_t first, int64_t last) {
  for (int64_t j0 = first; j0 <= last; j0 += kBatch) {
    const int64_t count = last - j0 + 1 < kBatch ? last - j0 + 1 : kBatch;
    Move batch[kBatch];
    for (int64_t t = 0; t < count; ++t) batch[t] = move_offsets(table_row, block_size, seq, path, j0 + t, row_units);
    copy_batch(cache, batch, count, 0, row_units, 1);
  }
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing the row size and the alignment of every layer's base
// address (`address_bits`: the OR of the base addresses).
inline int64_t unit_bytes(int64_t row_bytes, uint64_t address_bits) {
  int64_t unit = 16;
  while (unit > 1 && (row_bytes % unit != 0 || address_bits % static_cast<uint64_t>(unit) != 0)) unit /= 2;
  return unit;
}

}  // namespace kv
}  // namespace peagle
