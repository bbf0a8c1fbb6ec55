// Which rank digests which values of a load. Every rank of a load reads its region of each
// dataset (rows × columns); the regions overlap wherever ranks hold the same values (tensors
// that tensor ranks hold alike, KV heads shared by them; data-parallel replicas where a reader
// reads the whole stage) and together usually cover the dataset.
// The digests of a load are then summed from what the ranks read, each value counted by one of
// the ranks that read it — the ranks that read a piece sharing its rows evenly — instead of from
// the file read once more.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis::ckpt_impl {

namespace {

/// Another group's interval of rows and its columns, clipped to this rank's. A group: the ranks
/// that read the same regions of every dataset, sent once.
struct Cover {
  int group;
  int64_t begin, end, col_begin, col_end;
};

/// The groups' ranks (ascending) and, for this rank, its group.
struct Groups {
  std::vector<std::vector<int>> ranks;
  int mine = 0;
  /// Ranks of group g below `rank`.
  int64_t below(int g, int rank) const {
    const std::vector<int>& r = ranks[size_t(g)];
    return std::lower_bound(r.begin(), r.end(), rank) - r.begin();
  }
};

/// The cut points of `sorted` (ascending, unique) strictly inside (lo, hi), with lo and hi.
std::vector<int64_t> cuts_within(int64_t lo, int64_t hi, const std::vector<int64_t>& sorted) {
  std::vector<int64_t> cuts = {lo};
  for (auto it = std::upper_bound(sorted.begin(), sorted.end(), lo);
       it != sorted.end() && *it < hi; ++it)
    cuts.push_back(*it);
  cuts.push_back(hi);
  return cuts;
}

/// This rank's share of its region `mine`; `others`: the other groups' intervals that overlap
/// its columns, sorted by their first row. The ends of every group's row intervals (`row_ends`)
/// and column ranges (`col_ends`), both sorted and unique, wherever they lie, cut the dataset
/// into one grid of pieces that each rank reads whole or not at all, the same grid from any
/// rank; the ranks that read a piece split its rows evenly, in rank order.
std::vector<Block> share_of(int rank, const Groups& groups, const ReadRegion& mine,
                            const std::vector<Cover>& others, const std::vector<int64_t>& row_ends,
                            const std::vector<int64_t>& col_ends) {
  const std::vector<int64_t> cols = cuts_within(mine.col_begin, mine.col_end, col_ends);
  const int64_t own = int64_t(groups.ranks[size_t(groups.mine)].size()),
                own_below = groups.below(groups.mine, rank);
  std::vector<Block> out;
  std::vector<const Cover*> active;  // (the intervals that reach the current piece's rows)
  size_t next = 0;
  for (const RowRange& iv : mine.rows) {
    const std::vector<int64_t> rows = cuts_within(iv.begin, iv.end, row_ends);
    for (size_t i = 0; i + 1 < rows.size(); ++i) {
      const int64_t s = rows[i], t = rows[i + 1];
      for (; next < others.size() && others[next].begin <= s; ++next)
        active.push_back(&others[next]);
      active.erase(std::remove_if(active.begin(), active.end(),
                                  [s](const Cover* c) { return c->end <= s; }),
                   active.end());
      for (size_t k = 0; k + 1 < cols.size(); ++k) {
        const int64_t a = cols[k], b = cols[k + 1];
        int64_t readers = own, before = own_below;  // (this rank's group, and those in it before)
        for (const Cover* c : active)  // (no piece is cut by an interval's ends: it holds or not)
          if (c->col_begin <= a && b <= c->col_end) {
            readers += int64_t(groups.ranks[size_t(c->group)].size());
            before += groups.below(c->group, rank);
          }
        const int64_t r0 = s + (t - s) * before / readers,
                      r1 = s + (t - s) * (before + 1) / readers;
        if (r0 >= r1) continue;
        if (!out.empty() && out.back().row_begin == r0 && out.back().row_end == r1 &&
            out.back().col_end == a)
          out.back().col_end = b;  // (beside the piece before, the same rows: one block)
        else
          out.push_back({r0, r1, a, b});
      }
    }
  }
  return out;
}

uint64_t hash_of(const std::vector<int64_t>& v) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the values' bytes
  for (const int64_t x : v) {
    unsigned char b[sizeof x];
    std::memcpy(b, &x, sizeof x);
    for (const unsigned char c : b) h = (h ^ c) * 0x100000001B3ull;
  }
  return h;
}

}  // namespace

bool read_shares(MPI_Comm comm, const std::vector<ReadRegion>& mine,
                 std::vector<std::vector<Block>>& blocks) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  blocks.assign(mine.size(), {});
  // Each rank's regions, flat: per dataset it reads, the dataset's index, the count of intervals
  // n, n (begin, end) pairs, then the columns (begin, end). (Only those it reads: a checkpoint's
  // datasets are every stage's, and each dp rank reads its own rows, so a full list from every
  // rank took over the limit below from about 800 ranks of GPT-3 175B.)
  std::vector<int64_t> flat;
  for (size_t i = 0; i < mine.size(); ++i) {
    const ReadRegion& r = mine[i];
    if (r.rows.empty() || r.col_begin >= r.col_end) continue;
    flat.insert(flat.end(), {int64_t(i), int64_t(r.rows.size())});
    for (const RowRange& iv : r.rows) flat.insert(flat.end(), {iv.begin, iv.end});
    flat.insert(flat.end(), {r.col_begin, r.col_end});
  }
  // Ranks with the same regions (by a hash of them) form a group whose first rank sends them.
  const uint64_t h = hash_of(flat);
  std::vector<uint64_t> hashes(size_t(size), 0);
  MPI_Allgather(&h, 1, MPI_UINT64_T, hashes.data(), 1, MPI_UINT64_T, comm);
  Groups groups;
  std::vector<int> group_of(size_t(size), 0), leaders;
  std::unordered_map<uint64_t, int> seen;
  for (int q = 0; q < size; ++q) {
    const auto [it, added] = seen.emplace(hashes[size_t(q)], int(leaders.size()));
    if (added) leaders.push_back(q), groups.ranks.emplace_back();
    group_of[size_t(q)] = it->second;
    groups.ranks[size_t(it->second)].push_back(q);
  }
  groups.mine = group_of[size_t(rank)];
  const bool leader = leaders[size_t(groups.mine)] == rank;
  const int count = leader ? static_cast<int>(flat.size()) : 0;
  std::vector<int> counts(static_cast<size_t>(size)), displs(static_cast<size_t>(size), 0);
  MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm);
  double total = 0;
  for (const int c : counts) total += double(c);
  if (total * sizeof(int64_t) > 64.0 * 1024 * 1024) {
    if (rank == 0)
      log(strfmt("checkpoint load: the ranks' %d distinct read regions take %s to gather, over "
                 "64 MiB: the content digests read the file once more instead",
                 int(leaders.size()), format_bytes(total * sizeof(int64_t)).c_str()));
    return false;
  }
  for (int q = 1; q < size; ++q) displs[size_t(q)] = displs[size_t(q - 1)] + counts[size_t(q - 1)];
  std::vector<int64_t> all(static_cast<size_t>(total));
  MPI_Allgatherv(flat.data(), count, MPI_INT64_T, all.data(), counts.data(), displs.data(),
                 MPI_INT64_T, comm);
  // A rank whose regions are not its leader's (the same hash by chance): no shares, on any rank.
  const size_t at_leader = size_t(displs[size_t(leaders[size_t(groups.mine)])]);
  int differs = !leader && (counts[size_t(leaders[size_t(groups.mine)])] != int(flat.size()) ||
                            !std::equal(flat.begin(), flat.end(), all.begin() + long(at_leader)));
  MPI_Allreduce(MPI_IN_PLACE, &differs, 1, MPI_INT, MPI_MAX, comm);
  if (differs) return false;

  // One cursor per group, moved through its datasets in step with this rank's.
  std::vector<size_t> at, end;
  for (const int q : leaders) {
    at.push_back(size_t(displs[size_t(q)]));
    end.push_back(at.back() + size_t(counts[size_t(q)]));
  }
  std::vector<Cover> others;
  std::vector<int64_t> row_ends, col_ends;
  for (size_t i = 0; i < mine.size(); ++i) {
    others.clear(), row_ends.clear(), col_ends.clear();
    const ReadRegion& me = mine[i];
    for (int g = 0; g < int(leaders.size()); ++g) {
      size_t& p = at[size_t(g)];
      if (p >= end[size_t(g)] || all[p] != int64_t(i)) continue;  // (the group reads none of it)
      ++p;
      const int64_t intervals = all[p++];
      const size_t first = p;
      p += size_t(2 * intervals);
      const int64_t gc0 = all[p], gc1 = all[p + 1];
      p += 2;
      if (g == groups.mine || gc0 >= gc1 || intervals == 0) continue;
      col_ends.insert(col_ends.end(), {gc0, gc1});
      const int64_t c0 = std::max(me.col_begin, gc0), c1 = std::min(me.col_end, gc1);
      for (int64_t k = 0; k < intervals; ++k) {
        const int64_t b = all[first + size_t(2 * k)], e = all[first + size_t(2 * k + 1)];
        row_ends.insert(row_ends.end(), {b, e});
        if (b < e && c0 < c1) others.push_back({g, b, e, c0, c1});
      }
    }
    if (me.col_begin >= me.col_end) continue;
    for (auto* v : {&row_ends, &col_ends}) {
      std::sort(v->begin(), v->end());
      v->erase(std::unique(v->begin(), v->end()), v->end());
    }
    std::sort(others.begin(), others.end(),
              [](const Cover& x, const Cover& y) { return x.begin < y.begin; });
    blocks[i] = share_of(rank, groups, me, others, row_ends, col_ends);
  }
  return true;
}

}  // namespace trellis::ckpt_impl
