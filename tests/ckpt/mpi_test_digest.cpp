// Content digests of checkpoint datasets (lib/ckpt/digest.cpp), run at np 1, 2 and 4: damage that
// HDF5's per-chunk Fletcher-32 cannot see (a chunk replaced together with its checksum: zeros,
// or another chunk of the file) is an error on every rank and for `trellis inspect`; files
// written before digests still load; writers that do not hold one copy of every value are refused.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "mpi_util.hpp"
#include "read_error.hpp"

namespace trellis {
namespace {

using trellis::testing::read_error;
using trellis::testing::world_rank;
using trellis::testing::world_size;
namespace fs = std::filesystem;

constexpr int64_t kRows = 600, kCols = 1000;  // 262 rows a chunk: chunks of 262, 262, 76 rows

float value(int64_t row, int64_t col) { return float((row * 131 + col * 17) % 1021) * 0.25f - 9.f; }

int64_t part(int64_t n, int p, int i) { return n * i / p; }

/// Rows [b, e) × columns [c0, c1) of the test tensor, with their storage.
struct Block {
  std::vector<float> data;
  CkptSlab slab;
  Block(int64_t b, int64_t e, int64_t c0, int64_t c1, bool fill = true) {
    data.assign(size_t((e - b) * (c1 - c0)), 0.f);
    if (fill)
      for (int64_t r = b; r < e; ++r)
        for (int64_t c = c0; c < c1; ++c) data[size_t((r - b) * (c1 - c0) + c - c0)] = value(r, c);
    slab.name = "model/w";
    slab.global_shape = {kRows, kCols};
    slab.rows = {{b, e}};
    slab.col_begin = c0;
    slab.col_end = c1;
    slab.data = data.data();
  }
  int64_t mismatches() const {
    int64_t bad = 0;
    const RowRange& rr = slab.rows[0];
    const int64_t nc = slab.col_end - slab.col_begin;
    for (int64_t r = rr.begin; r < rr.end; ++r)
      for (int64_t c = slab.col_begin; c < slab.col_end; ++c)
        bad += data[size_t((r - rr.begin) * nc + c - slab.col_begin)] != value(r, c);
    return bad;
  }
};

std::string shared_dir() {
  std::string dir;
  if (world_rank() == 0) {
    char tmpl[] = "/tmp/trellis_digest_XXXXXX";
    dir = mkdtemp(tmpl) ? tmpl : "";
  }
  int64_t n = int64_t(dir.size());
  MPI_Bcast(&n, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  dir.resize(size_t(n));
  MPI_Bcast(dir.data(), int(n), MPI_CHAR, 0, MPI_COMM_WORLD);
  return dir;
}

/// Writes the test tensor split by rows over the ranks; returns the file's path.
std::string write_rows(const std::string& dir, const std::string& name) {
  const int r = world_rank(), np = world_size();
  Block mine(part(kRows, np, r), part(kRows, np, r + 1), 0, kCols);
  const std::string path = dir + "/" + name;
  CkptMeta meta;  // what inspect asks of a checkpoint
  meta.integers["format_version"] = kCheckpointFormat;
  meta.integers["step"] = 1;
  write_checkpoint(MPI_COMM_WORLD, path, {mine.slab}, meta);
  return path;
}

/// Rank 0 edits the file (opened read-write) with `edit`; true on every rank where it succeeded.
bool edit_file(const std::string& path, const std::function<bool(hid_t)>& edit) {
  int ok = 0;
  if (world_rank() == 0) {
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ok = f >= 0 && edit(f);
    ok &= H5Fclose(f) >= 0;
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return ok;
}

/// Reads the test tensor split by columns (another layout than the writer's); the UserError's
/// message or "", and the values that differ from the formula (summed over ranks).
std::string read_columns(const std::string& path, int64_t& wrong) {
  const int r = world_rank(), np = world_size();
  Block mine(0, kRows, part(kCols, np, r), part(kCols, np, r + 1), false);
  const std::string msg = read_error(path, {mine.slab});
  int64_t mine_wrong = mine.mismatches();
  MPI_Allreduce(&mine_wrong, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return msg;
}

/// Where chunk `index` of model/w lies in the file: its offset and size in bytes.
bool chunk_place(const std::string& path, hsize_t index, haddr_t& addr, hsize_t& size) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, "model/w", H5P_DEFAULT);
  hid_t sp = H5Dget_space(d);
  hsize_t offset[2];
  unsigned mask = 0;
  const bool ok = f >= 0 && d >= 0 && sp >= 0 &&
                  H5Dget_chunk_info(d, sp, index, offset, &mask, &addr, &size) >= 0;
  H5Sclose(sp);
  H5Dclose(d);
  H5Fclose(f);
  return ok;
}

std::vector<char> bytes_at(const std::string& path, haddr_t at, hsize_t n) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> b(n);
  f.seekg(std::streamoff(at));
  f.read(b.data(), std::streamsize(n));
  return f ? b : std::vector<char>{};
}

bool put_bytes(const std::string& path, haddr_t at, const std::vector<char>& b) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(std::streamoff(at));
  f.write(b.data(), std::streamsize(b.size()));
  return f.good() && !b.empty();
}

int inspect_quietly(const std::string& path, std::string* said = nullptr) {
  char name[] = "/tmp/trellis_inspect_XXXXXX";
  const int fd = mkstemp(name);
  std::FILE* out = fdopen(fd, "w+");
  const int status = inspect_checkpoint(path, out);
  std::fflush(out);
  std::rewind(out);
  std::string text;
  for (int c; (c = std::fgetc(out)) != EOF;) text += char(c);
  std::fclose(out);
  ::unlink(name);
  if (said) *said = text;
  return status;
}

const uint64_t kKey = ckpt_impl::digest_key("model/x");

TEST(CkptDigest, PartsOfAnyPartitionAddUpToTheWhole) {
  std::vector<float> v(size_t(7 * 9));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 5) - 2.f;  // repeated values, zeros
  const uint64_t whole = ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 3, 11);
  uint64_t by_rows = 0;
  for (int64_t r = 0; r < 7; ++r)
    by_rows += ckpt_impl::digest_rows(kKey, &v[size_t(r * 9)], 1, 9, 3 + r, 11);
  EXPECT_EQ(by_rows, whole);
  uint64_t by_cols = 0;
  for (int64_t r = 0; r < 7; ++r)
    for (int64_t c = 0; c < 9; ++c)
      by_cols += ckpt_impl::digest_rows(kKey, &v[size_t(r * 9 + c)], 1, 1, 3 + r, 11 + c);
  EXPECT_EQ(by_cols, whole);
  // The same values one row or one column further, or two of them swapped, give another digest.
  EXPECT_NE(ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 4, 11), whole);
  EXPECT_NE(ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 3, 12), whole);
  std::swap(v[0], v[1]);
  EXPECT_NE(ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 3, 11), whole);
  std::swap(v[0], v[1]);
  // Zeros in place of a row: another digest too.
  std::fill(v.begin() + 9, v.begin() + 18, 0.f);
  EXPECT_NE(ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 3, 11), whole);
  EXPECT_EQ(ckpt_impl::digest_rows(kKey, v.data(), 0, 9, 3, 11), 0u);  // (no values)
  // The same values under another dataset's name (renamed, or swapped with one of its shape).
  std::fill(v.begin() + 9, v.begin() + 18, 1.f);
  const uint64_t here = ckpt_impl::digest_rows(kKey, v.data(), 7, 9, 3, 11);
  EXPECT_NE(ckpt_impl::digest_rows(ckpt_impl::digest_key("model/y"), v.data(), 7, 9, 3, 11), here);
}

// A block of a million values or more is digested over threads (where the process may run on
// several cores): the same sum as its rows' parts, each too small for a thread.
TEST(CkptDigest, ThreadedDigestIsTheSumOfItsParts) {
  const int64_t rows = 1100, cols = 1000;
  std::vector<float> v(size_t(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 977) * 0.01f - 3.f;
  uint64_t parts = 0;
  for (int64_t r = 0; r < rows; r += 100)
    parts += ckpt_impl::digest_rows(kKey, &v[size_t(r * cols)], 100, cols, 5 + r, 7);
  EXPECT_EQ(ckpt_impl::digest_rows(kKey, v.data(), rows, cols, 5, 7), parts);
}

// Two changes must not cancel: the same bit flipped in two values, up in one and down in the
// other. Each flip changes the sum by its term's difference d; two cancel where d_j = -d_i. Among
// the 2^35 pairs of a 512 × 512 block, per bit, a full 64-bit hash leaves none (about 2^-29
// expected); the linear hashes of the first versions left one in 2^22 to 2^27 pairs.
TEST(CkptDigest, TwoFlipsNeverCancel) {
  const int64_t rows = 512, cols = 512;
  std::vector<float> v(size_t(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(float(i)) * 0.05f;  // weights' range
  int64_t cancelling = 0;
  for (const uint32_t bit : {0u, 10u, 22u, 30u, 31u}) {
    std::vector<uint64_t> d(v.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float x = v[size_t(r * cols + c)];
        uint32_t b;
        std::memcpy(&b, &x, 4);
        b ^= 1u << bit;
        float y;
        std::memcpy(&y, &b, 4);
        d[size_t(r * cols + c)] = ckpt_impl::digest_rows(kKey, &y, 1, 1, r, c) -
                                  ckpt_impl::digest_rows(kKey, &x, 1, 1, r, c);
      }
    std::vector<uint64_t> sorted = d;
    std::sort(sorted.begin(), sorted.end());
    for (const uint64_t di : d) {
      const uint64_t want = uint64_t(0) - di;
      const auto [lo, hi] = std::equal_range(sorted.begin(), sorted.end(), want);
      cancelling += (hi - lo) - (want == di);  // (not the value with itself)
    }
  }
  EXPECT_EQ(cancelling, 0);
}

TEST(CkptDigest, ChunkReplacedWithItsChecksumIsDamage) {
  const std::string dir = shared_dir();
  const std::string path = write_rows(dir, "sound.h5");
  const std::string zeroed = dir + "/zeroed.h5", swapped = dir + "/swapped.h5";
  int made = 0;
  if (world_rank() == 0) {
    haddr_t a0 = 0, a1 = 0;
    hsize_t n0 = 0, n1 = 0;
    if (chunk_place(path, 0, a0, n0) && chunk_place(path, 1, a1, n1) && n0 == n1 && n0 > 0) {
      fs::copy_file(path, zeroed);
      fs::copy_file(path, swapped);
      const std::vector<char> c0 = bytes_at(path, a0, n0), c1 = bytes_at(path, a1, n1);
      made = put_bytes(zeroed, a0, std::vector<char>(n0, 0)) && put_bytes(swapped, a0, c1) &&
             put_bytes(swapped, a1, c0);
    }
  }
  MPI_Bcast(&made, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ASSERT_TRUE(made);

  int64_t wrong = -1;
  EXPECT_EQ(read_columns(path, wrong), "");
  EXPECT_EQ(wrong, 0);
  for (const std::string& damaged : {zeroed, swapped}) {
    const std::string msg = read_columns(damaged, wrong);
    EXPECT_NE(msg.find(damaged), std::string::npos) << msg;
    EXPECT_NE(msg.find("dataset model/w: its values do not match the content digest"),
              std::string::npos)
        << msg;
  }
  if (world_rank() == 0) {
    std::string said;
    EXPECT_EQ(inspect_quietly(path, &said), 0);
    EXPECT_NE(said.find("ok (checksums and content digest verified)"), std::string::npos) << said;
    for (const std::string& damaged : {zeroed, swapped}) {
      EXPECT_EQ(inspect_quietly(damaged, &said), 1) << damaged;
      EXPECT_NE(said.find("PROBLEM: its values do not match the content digest"),
                std::string::npos)
          << said;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}

// A load sums the digests from the values its ranks read, each counted once (the ranks that read
// it share it), whatever the overlaps: columns read by two ranks, rows twice by one, padding rows, a
// replica of the whole on each rank, a rank that reads nothing. A load that reads a part of the
// dataset reads it again for its digest. Each finds a chunk zeroed with its checksum.
TEST(CkptDigest, LoadsDigestWhatTheRanksRead) {
  const std::string dir = shared_dir();
  const std::string path = write_rows(dir, "sound.h5"), zeroed = dir + "/zeroed.h5";
  int made = 0;
  if (world_rank() == 0) {
    haddr_t at = 0;
    hsize_t n = 0;
    fs::copy_file(path, zeroed);
    made = chunk_place(path, 1, at, n) && n > 0 && put_bytes(zeroed, at, std::vector<char>(n, 0));
  }
  MPI_Bcast(&made, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ASSERT_TRUE(made);
  const int r = world_rank(), np = world_size();
  const int64_t c0 = std::max<int64_t>(0, part(kCols, np, r) - 37),
                c1 = std::min<int64_t>(kCols, part(kCols, np, r + 1) + 37);
  struct Case {
    const char* what;
    std::vector<RowRange> rows;
    int64_t col_begin, col_end, read_again;
  };
  const std::vector<Case> cases = {
      {"overlapping columns, rows twice", {{0, 400}, {300, kRows}}, c0, c1, 0},
      {"a replica on each rank", {{0, kRows}}, 0, kCols, 0},
      {"padding rows", {{0, kRows + 5}}, 0, kCols, 0},
      {"nothing on rank 0", r == 0 ? std::vector<RowRange>{} : std::vector<RowRange>{{0, kRows}},
       0, kCols, np == 1 ? 1 : 0},
      {"a part of the rows", {{0, 100}}, 0, kCols, 1},
  };
  for (const Case& c : cases) {
    CkptSlab slab;
    slab.name = "model/w";
    slab.global_shape = {kRows, kCols};
    slab.rows = c.rows;
    slab.col_begin = c.col_begin;
    slab.col_end = c.col_end;
    int64_t rows = 0;
    for (const RowRange& rr : c.rows) rows += rr.end - rr.begin;
    const int64_t nc = c.col_end - c.col_begin;
    std::vector<float> data(size_t(rows * nc), -1.f);  // (Σ rows × columns, in `rows` order)
    slab.data = data.data();
    CkptMeta meta;
    CkptIO io{0, 0, -1};
    std::string msg;
    try {
      io = read_checkpoint(MPI_COMM_WORLD, path, {slab}, meta);
    } catch (const UserError& e) {
      msg = e.what();
    }
    EXPECT_EQ(msg, "") << c.what;
    EXPECT_EQ(io.digests_read_again, c.read_again) << c.what;
    int64_t wrong = 0, local = 0;
    for (const RowRange& rr : c.rows)
      for (int64_t g = rr.begin; g < rr.end; ++g, ++local)
        for (int64_t k = 0; k < nc; ++k)
          wrong += data[size_t(local * nc + k)] != (g < kRows ? value(g, c.col_begin + k) : 0.f);
    EXPECT_EQ(wrong, 0) << c.what;
    msg = read_error(zeroed, {slab});
    EXPECT_NE(msg.find("dataset model/w: its values do not match the content digest"),
              std::string::npos)
        << c.what << ": " << msg;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}

// A dataset renamed (or two of one shape swapped by name) passes every checksum; its digest,
// keyed by its name, does not.
TEST(CkptDigest, RenamedDatasetIsDamage) {
  const std::string dir = shared_dir();
  const std::string path = write_rows(dir, "renamed.h5");
  const bool renamed = edit_file(path, [](hid_t f) {
    return H5Lmove(f, "model/w", f, "model/v", H5P_DEFAULT, H5P_DEFAULT) >= 0;
  });
  ASSERT_TRUE(renamed);
  Block mine(0, kRows, part(kCols, world_size(), world_rank()),
             part(kCols, world_size(), world_rank() + 1), false);
  mine.slab.name = "model/v";
  const std::string msg = read_error(path, {mine.slab});
  EXPECT_NE(msg.find("dataset model/v: its values do not match the content digest"),
            std::string::npos)
      << msg;
  if (world_rank() == 0) {
    EXPECT_EQ(inspect_quietly(path), 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}

TEST(CkptDigest, FilesWrittenBeforeDigestsStillLoad) {
  const std::string dir = shared_dir();
  const std::string path = write_rows(dir, "old.h5");
  bool removed = edit_file(path, [](hid_t f) {
    const hid_t d = H5Dopen2(f, "model/w", H5P_DEFAULT);
    const bool ok = d >= 0 && H5Adelete(d, "content_digest") >= 0;
    H5Dclose(d);
    return ok;
  });
  ASSERT_TRUE(removed);
  // The file still says its datasets carry digests: one without is damage.
  int64_t wrong = -1;
  std::string msg = read_columns(path, wrong);
  EXPECT_NE(msg.find("dataset model/w: no content digest, though the file's datasets"),
            std::string::npos)
      << msg;
  if (world_rank() == 0) {
    std::string said;
    EXPECT_EQ(inspect_quietly(path, &said), 1);
    EXPECT_NE(said.find("PROBLEM: no content digest, though"), std::string::npos) << said;
  }
  // Without that statement too, as files written before digests are: they load as before.
  removed = edit_file(path, [](hid_t f) { return H5Adelete(f, "content_digests") >= 0; });
  ASSERT_TRUE(removed);
  msg = read_columns(path, wrong);
  EXPECT_EQ(msg, "");
  EXPECT_EQ(wrong, 0);
  if (world_rank() == 0) {
    std::string said;
    EXPECT_EQ(inspect_quietly(path, &said), 0);
    EXPECT_NE(said.find("ok (checksums verified; no content digest"), std::string::npos) << said;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}

// A file whose datasets carry digests carries one on each: one removed is damage, even with the
// root attribute that says so removed too.
TEST(CkptDigest, OneDigestMissingAmongOthersIsDamage) {
  const int r = world_rank(), np = world_size();
  const std::string dir = shared_dir();
  Block w(part(kRows, np, r), part(kRows, np, r + 1), 0, kCols), w2 = w;
  w2.slab.name = "model/w2";
  w2.slab.data = w2.data.data();
  const std::string path = dir + "/mixed.h5";
  CkptMeta meta;
  meta.integers["format_version"] = kCheckpointFormat;
  meta.integers["step"] = 1;
  write_checkpoint(MPI_COMM_WORLD, path, {w.slab, w2.slab}, meta);
  const bool removed = edit_file(path, [](hid_t f) {
    return H5Adelete(f, "content_digests") >= 0 &&
           H5Adelete_by_name(f, "model/w2", "content_digest", H5P_DEFAULT) >= 0;
  });
  ASSERT_TRUE(removed);
  Block a(0, kRows, part(kCols, np, r), part(kCols, np, r + 1), false), b = a;
  b.slab.name = "model/w2";
  b.slab.data = b.data.data();
  const std::string msg = read_error(path, {a.slab, b.slab});
  EXPECT_NE(msg.find("dataset model/w2: no content digest, though"), std::string::npos) << msg;
  if (r == 0) {
    std::string said;
    EXPECT_EQ(inspect_quietly(path, &said), 1);
    EXPECT_NE(said.find("PROBLEM: no content digest, though"), std::string::npos) << said;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (r == 0) fs::remove_all(dir);
}

// The root attribute gives the digest formula's version: another version's digests (the
// development builds' 1) are not checked, not taken for damage.
TEST(CkptDigest, AnotherVersionsDigestsAreNotChecked) {
  const std::string dir = shared_dir();
  const std::string path = write_rows(dir, "v1.h5");
  const bool edited = edit_file(path, [](hid_t f) {
    const hid_t a = H5Aopen(f, "content_digests", H5P_DEFAULT);
    const int64_t one = 1;
    bool ok = a >= 0 && H5Awrite(a, H5T_NATIVE_INT64, &one) >= 0;
    H5Aclose(a);
    const hid_t d = H5Dopen2(f, "model/w", H5P_DEFAULT);
    const hid_t at = H5Aopen(d, "content_digest", H5P_DEFAULT);
    const uint64_t other = 12345;  // (a digest of another formula)
    ok = ok && d >= 0 && at >= 0 && H5Awrite(at, H5T_NATIVE_UINT64, &other) >= 0;
    H5Aclose(at);
    H5Dclose(d);
    return ok;
  });
  ASSERT_TRUE(edited);
  int64_t wrong = -1;
  EXPECT_EQ(read_columns(path, wrong), "");
  EXPECT_EQ(wrong, 0);
  if (world_rank() == 0) {
    std::string said;
    EXPECT_EQ(inspect_quietly(path, &said), 0);
    EXPECT_NE(said.find("a content digest of another version, not checked"), std::string::npos)
        << said;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}

// A bug in how a layout picks its writers would lose values (none writes them) or write some
// twice: the write fails, on every rank, and leaves nothing behind.
TEST(CkptDigest, WritersMustHoldOneCopyOfEachValue) {
  const int r = world_rank(), np = world_size();
  const std::string dir = shared_dir();
  // Rows 0..9 held by none; 1 rank: by none either.
  Block gap(np > 1 ? part(kRows, np, r) + (r == 0 ? 10 : 0) : 10, part(kRows, np, r + 1), 0, kCols);
  std::string msg;
  try {
    write_checkpoint(MPI_COMM_WORLD, dir + "/gap.h5", {gap.slab}, CkptMeta{});
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find(strfmt("dataset model/w: the ranks hold %lld of its %lld values",
                            (long long)(kRows - 10) * kCols, (long long)kRows * kCols)),
            std::string::npos)
      << msg;
  // Every rank a writer of the whole tensor (np > 1: twice or more).
  Block all(0, kRows, 0, kCols);
  msg.clear();
  try {
    write_checkpoint(MPI_COMM_WORLD, dir + "/twice.h5", {all.slab}, CkptMeta{});
  } catch (const UserError& e) {
    msg = e.what();
  }
  if (np > 1)
    EXPECT_NE(msg.find(strfmt("the ranks hold %lld of its", (long long)np * kRows * kCols)),
              std::string::npos)
        << msg;
  else
    EXPECT_EQ(msg, "");
  // As many values as the tensor has, but the last rank's rows are the first rank's (np > 1):
  // rows held twice, and rows held by none.
  const int who = r == np - 1 && np > 1 ? 0 : r;
  Block shifted(part(kRows, np, who), part(kRows, np, who + 1), 0, kCols);
  msg.clear();
  try {
    write_checkpoint(MPI_COMM_WORLD, dir + "/shifted.h5", {shifted.slab}, CkptMeta{});
  } catch (const UserError& e) {
    msg = e.what();
  }
  if (np > 1)
    EXPECT_NE(msg.find(strfmt("the ranks hold %lld of its %lld values to write, not each of "
                              "them once", (long long)kRows * kCols, (long long)kRows * kCols)),
              std::string::npos)
        << msg;
  else
    EXPECT_EQ(msg, "");
  MPI_Barrier(MPI_COMM_WORLD);
  if (r == 0) {
    EXPECT_FALSE(fs::exists(dir + "/gap.h5"));
    EXPECT_EQ(fs::exists(dir + "/twice.h5"), np == 1);
    EXPECT_EQ(fs::exists(dir + "/shifted.h5"), np == 1);
    size_t entries = 0;
    for (const auto& e : fs::directory_iterator(dir))
      entries += e.path().filename() != "twice.h5" && e.path().filename() != "shifted.h5";
    EXPECT_EQ(entries, 0u);  // no temporary left
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace trellis
