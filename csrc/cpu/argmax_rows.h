// The greedy row argmax of the CPU tree verification, compiled once per x86 instruction set and picked at run time
// (isa.h: tree_verify_cpu.cpp includes this file in several namespaces, each time with PEAGLE_ARGMAX_TARGET set to a
// target attribute). Comparisons only, so every version finds the same index. Raw-pointer code with internal linkage;
// no include guard: included on purpose once per instruction set.

// First index of the row maximum (the smallest id on ties); false with the first NaN's index when the row has one.
// Two passes that vectorise: the maximum (per-lane maxima, NaNs flagged aside), then the first entry equal to it, found
// chunk by chunk (the row is in cache by then: one read of it from memory).
static PEAGLE_ARGMAX_TARGET bool row_argmax(const float* row, int64_t vocab, int64_t* index) {
  constexpr int kLanes = 32;
  constexpr int64_t kChunk = 256;
  float lanes[kLanes];
  int32_t nan_lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    lanes[k] = -std::numeric_limits<float>::infinity();
    nan_lanes[k] = 0;
  }
  const int64_t body = vocab - vocab % kLanes;
  for (int64_t y = 0; y < body; y += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float value = row[y + k];
      lanes[k] = value > lanes[k] ? value : lanes[k];  // NaN compares false: never a maximum
      nan_lanes[k] |= value != value;
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  int32_t any_nan = 0;
  for (int k = 0; k < kLanes; ++k) {
    best = lanes[k] > best ? lanes[k] : best;
    any_nan |= nan_lanes[k];
  }
  for (int64_t y = body; y < vocab; ++y) {
    best = row[y] > best ? row[y] : best;
    any_nan |= row[y] != row[y];
  }
  if (any_nan) {
    int64_t y = 0;
    while (row[y] == row[y]) ++y;
    *index = y;
    return false;
  }
  // The first entry equal to the maximum (a row of -inf only: its first entry).
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < vocab ? c0 + kChunk : vocab;
    int32_t hit = 0;
    for (int64_t y = c0; y < c1; ++y) hit |= row[y] == best;
    if (!hit) continue;
    int64_t y = c0;
    while (row[y] != best) ++y;
    *index = y;
    return true;
  }
  *index = 0;  // not reached: the maximum is an entry
  return true;
}
