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

/// The values two ranges share (empty: size() <= 0).
ShardRange intersection(const ShardRange& a, const ShardRange& b) {
  return {std::max(a.begin, b.begin), std::min(a.end, b.end)};
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
    const ShardRange give = intersection(from[me], to[q]), take = intersection(to[me], from[q]);
    if (give.size() > 0)
      pending.push_back(dp.isend(in + (give.begin - from[me].begin), give.size(), q));
    if (take.size() > 0)
      pending.push_back(dp.irecv(out + (take.begin - to[me].begin), take.size(), q));
  }
  const ShardRange own = intersection(from[me], to[me]);
  if (own.size() > 0)
    std::memcpy(out + (own.begin - to[me].begin), in + (own.begin - from[me].begin),
                sizeof(float) * size_t(own.size()));
  for (Request& r : pending) r.wait();
}

}  // namespace trellis
