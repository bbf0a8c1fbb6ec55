#include "train/checkpoint_parts.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace trellis {

namespace {

/// The first row start of `table` at or after flat index x (the buffer's end past its last row).
int64_t align_to_row(const ParamTable& table, int64_t x) {
  const std::vector<ParamInfo>& ps = table.params();
  // The tensor that holds x: the last one starting at or before it (offsets ascend).
  auto it = std::upper_bound(ps.begin(), ps.end(), x,
                             [](int64_t v, const ParamInfo& p) { return v < p.offset; });
  if (it == ps.begin()) return std::min(x, table.total());
  const ParamInfo& p = *std::prev(it);
  const int64_t cols = p.col_end - p.col_begin, end = p.offset + p.numel();
  if (x >= end || cols <= 0) return std::min(x, table.total());  // (between tensors, or past all)
  const int64_t row = (x - p.offset + cols - 1) / cols;
  return std::min(p.offset + row * cols, end);
}

int64_t overlap(const ShardRange& a, const ShardRange& b) {
  return std::max<int64_t>(0, std::min(a.end, b.end) - std::max(a.begin, b.begin));
}

}  // namespace

std::vector<ShardRange> zero_shards(const ParamTable& table, int dp) {
  std::vector<ShardRange> out;
  for (int r = 0; r < dp; ++r) out.push_back(shard_range(table.total(), dp, r));
  return out;
}

std::vector<ShardRange> checkpoint_parts(const ParamTable& table, int dp) {
  const std::vector<ShardRange> shards = zero_shards(table, dp);
  std::vector<ShardRange> out(shards.size());
  for (size_t r = 0; r < shards.size(); ++r) {
    out[r].begin = align_to_row(table, shards[r].begin);
    out[r].end = r + 1 < shards.size() ? align_to_row(table, shards[r + 1].begin) : table.total();
  }
  return out;
}

void move_values(Comm& dp, const std::vector<ShardRange>& from, const float* in,
                 const std::vector<ShardRange>& to, float* out) {
  const int me = dp.rank(), n = dp.size();
  if (int(from.size()) != n || int(to.size()) != n)
    throw std::logic_error("move_values: one range per rank of the group");
  std::vector<Request> pending;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    // What q's `to` takes of my `from`, and what my `to` takes of q's `from`.
    const ShardRange give{std::max(from[me].begin, to[q].begin), std::min(from[me].end, to[q].end)};
    const ShardRange take{std::max(to[me].begin, from[q].begin), std::min(to[me].end, from[q].end)};
    if (overlap(from[me], to[q]) > 0)
      pending.push_back(dp.isend(in + (give.begin - from[me].begin), give.size(), q));
    if (overlap(to[me], from[q]) > 0)
      pending.push_back(dp.irecv(out + (take.begin - to[me].begin), take.size(), q));
  }
  if (const int64_t own = overlap(from[me], to[me]); own > 0) {
    const int64_t b = std::max(from[me].begin, to[me].begin);
    std::memcpy(out + (b - to[me].begin), in + (b - from[me].begin), sizeof(float) * own);
  }
  for (Request& r : pending) r.wait();
}

}  // namespace trellis
