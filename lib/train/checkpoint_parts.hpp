// Which values of a pipeline stage's flat buffer each rank of its dp group writes to a checkpoint
// and reads from one, and how they travel between those parts and the ZeRO shards.
//
// A ZeRO shard (shard_range) is a contiguous range of the flat buffer that may begin and end in
// the middle of a tensor's row; a file's selections are whole rows. The dp rank r's part is the
// rows whose first value lies in its shard: [align(b_r), align(b_{r+1})), align(x) the first row
// start at or after x. The parts tile the buffer as the shards do, each one the shard give or
// take a row at either end, so a checkpoint costs each rank its own share (Ψ/(tp·pp·dp) values)
// rather than the whole stage, and the dp ranks write and read disjoint rows of the file.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "model/params.hpp"

namespace trellis {

/// The parts of `table`'s flat buffer (table.total() values) of the `dp` ranks, in rank order.
std::vector<ShardRange> checkpoint_parts(const ParamTable& table, int dp);

/// The ZeRO shards of the same buffer (shard_range), in rank order.
std::vector<ShardRange> zero_shards(const ParamTable& table, int dp);

/// Collective over `dp`: every rank holds the values `from[rank]` of the flat buffer in `in`
/// ((from[rank].size()) values) and receives `to[rank]` into `out` ((to[rank].size())). `from`
/// and `to` are two tilings of the same buffer; host memory.
void move_values(Comm& dp, const std::vector<ShardRange>& from, const float* in,
                 const std::vector<ShardRange>& to, float* out);

}  // namespace trellis
