// Checkpoint files under MPI (run at np 1, 2 and 4): write in one split of the tensors among the
// ranks, read back in another, compare with the global tensors every rank computes from a formula;
// atomic replacement; corrupt, truncated and foreign files become UserErrors on every rank.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
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

/// Element (row, col) of test tensor `tid`: a small integer, exact in float32.
float value(int tid, int64_t row, int64_t col) {
  return static_cast<float>((tid * 7919 + row * 131 + col * 17) % 1021 - 510);
}

void bcast(std::string& s) {
  int64_t n = static_cast<int64_t>(s.size());
  MPI_Bcast(&n, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  s.resize(static_cast<size_t>(n));
  MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
}

/// A slab of test tensor `tid` and the storage behind it.
struct TestSlab {
  int tid;
  CkptSlab slab;
  std::vector<float> data;
};

TestSlab make(int tid, const std::string& name, std::vector<int64_t> shape,
              std::vector<RowRange> rows, int64_t c0, int64_t c1, bool writer = true) {
  TestSlab t{tid, {}, {}};
  t.slab.name = name;
  t.slab.global_shape = std::move(shape);
  t.slab.rows = std::move(rows);
  t.slab.col_begin = c0;
  t.slab.col_end = c1;
  t.slab.writer = writer;
  int64_t n = 0;
  for (const RowRange& r : t.slab.rows) n += r.end - r.begin;
  t.data.assign(static_cast<size_t>(n * (c1 - c0)), 0.f);
  return t;
}

/// Fills with the formula (padding rows: garbage that must never reach the file).
void fill(TestSlab& t, float garbage_for_non_writers = 0, bool garbage = false) {
  const int64_t n0 = t.slab.global_shape[0], nc = t.slab.col_end - t.slab.col_begin;
  int64_t lo = 0;
  for (const RowRange& r : t.slab.rows)
    for (int64_t g = r.begin; g < r.end; ++g, ++lo)
      for (int64_t c = 0; c < nc; ++c)
        t.data[static_cast<size_t>(lo * nc + c)] =
            garbage ? garbage_for_non_writers
                    : (g < n0 ? value(t.tid, g, t.slab.col_begin + c) : 999.f);
}

/// Number of elements that differ from the formula (padding must read as 0).
int64_t mismatches(const TestSlab& t) {
  const int64_t n0 = t.slab.global_shape[0], nc = t.slab.col_end - t.slab.col_begin;
  int64_t lo = 0, bad = 0;
  for (const RowRange& r : t.slab.rows)
    for (int64_t g = r.begin; g < r.end; ++g, ++lo)
      for (int64_t c = 0; c < nc; ++c) {
        const float want = g < n0 ? value(t.tid, g, t.slab.col_begin + c) : 0.f;
        bad += t.data[static_cast<size_t>(lo * nc + c)] != want;
      }
  return bad;
}

std::vector<CkptSlab> slabs_of(std::vector<TestSlab>& v) {
  std::vector<CkptSlab> s;
  for (TestSlab& t : v) {
    t.slab.data = t.data.data();
    s.push_back(t.slab);
  }
  return s;
}

int64_t part(int64_t n, int p, int i) { return n * i / p; }

/// The tensors, split among `np` ranks as rank `r` would hold them. `alt` selects a second,
/// different split (reversed ranks, reversed local order, overlapping reads).
std::vector<TestSlab> layout(int r, int np, bool alt) {
  std::vector<TestSlab> v;
  const int rr = alt ? np - 1 - r : r;
  // A: (37, 5) by rows, uneven; when writing the last rank (np > 1) holds none.
  {
    const int64_t n = 37;
    std::vector<RowRange> rows;
    if (!alt) {
      const int w = np > 1 ? np - 1 : 1;  // uneven: boundaries at quadratic positions
      if (r < w) {
        auto b = [&](int i) { return n * i * i / (int64_t(w) * w); };
        rows.push_back({b(r), b(r + 1)});
      }
    } else {
      // second half of my equal share first, then the first half
      const int64_t b = part(n, np, rr), e = part(n, np, rr + 1), m = (b + e) / 2;
      rows = {{m, e}, {b, m}};
    }
    v.push_back(make(1, "model/a", {n, 5}, rows, 0, 5));
  }
  // B: (6, 11) by columns when writing; every rank reads all of it.
  if (!alt)
    v.push_back(make(2, "model/b", {6, 11}, {{0, 6}}, part(11, np, r), part(11, np, r + 1)));
  else
    v.push_back(make(2, "model/b", {6, 11}, {{0, 6}}, 0, 11));
  // C: attention-like (3·4·np, 3): rank holds its Q, K and V rows (three ranges).
  {
    const int64_t q = 4 * np;
    const int who = rr;
    std::vector<RowRange> rows = {{4 * who, 4 * who + 4}, {q + 4 * who, q + 4 * who + 4},
                                  {2 * q + 4 * who, 2 * q + 4 * who + 4}};
    if (alt) std::reverse(rows.begin(), rows.end());
    v.push_back(make(3, "model/h.0.attn.c_attn.weight", {3 * q, 3}, rows, 0, 3));
  }
  // D: vocabulary-parallel embedding (10, 4) with padding rows.
  {
    const int64_t V = 10, L = V / np + 1;
    if (!alt)
      v.push_back(make(4, "model/wte", {V, 4}, {{r * L, (r + 1) * L}}, 0, 4));
    else
      v.push_back(make(4, "model/wte", {V, 4}, {{V - 3, V + 2}, {0, 2}}, 0, 4));
  }
  // E: replicated 1-D (23): rank 0 writes.
  v.push_back(make(5, "model/ln_f.weight", {23}, {{0, 23}}, 0, 1, r == 0));
  // F: ZeRO-like 1-D shard of (1000).
  v.push_back(make(6, "optim/m/flat", {1000}, {{part(1000, np, rr), part(1000, np, rr + 1)}}, 0, 1));
  // G: (600, 1000), several chunks, rows split across chunk boundaries.
  v.push_back(make(7, "model/big_rows", {600, 1000},
                   {{part(600, np, rr), part(600, np, rr + 1)}}, 0, 1000));
  // H: (300, 1000) split by columns: every chunk is shared by all ranks.
  if (!alt)
    v.push_back(make(8, "model/big_cols", {300, 1000}, {{0, 300}}, part(1000, np, r),
                     part(1000, np, r + 1)));
  else
    v.push_back(make(8, "model/big_cols", {300, 1000}, {{part(300, np, rr), part(300, np, rr + 1)}},
                     0, 1000));
  return v;
}

CkptMeta test_meta() {
  CkptMeta m;
  std::string deck;
  for (int i = 0; deck.size() < 100000; ++i) deck += "[section" + std::to_string(i) + "]\nkey = value\n";
  m.text["deck"] = deck;
  m.text["layout"] = "dp=1 tp=2 pp=1";
  m.text["empty"] = "";
  m.integers["format_version"] = 1;
  m.integers["step"] = 1000;
  m.integers["tokens_seen"] = int64_t(1) << 40;
  m.integers["negative"] = -7;
  m.reals["lr"] = 3e-4;
  return m;
}

class CkptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world_rank() == 0) {
      char tmpl[] = "/tmp/trellis_ckpt_XXXXXX";
      dir_ = mkdtemp(tmpl) ? tmpl : "";
    }
    bcast(dir_);
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  /// Entries of the directory (rank 0's view, on every rank).
  std::vector<std::string> entries() {
    std::string all;
    if (world_rank() == 0)
      for (const auto& e : fs::directory_iterator(dir_)) all += e.path().filename().string() + "\n";
    bcast(all);
    std::vector<std::string> out;
    size_t p = 0;
    while (p < all.size()) {
      const size_t nl = all.find('\n', p);
      out.push_back(all.substr(p, nl - p));
      p = nl + 1;
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  /// Writes the standard test checkpoint to dir_/name.
  CkptIO write_standard(const std::string& name) {
    auto w = layout(world_rank(), world_size(), false);
    for (TestSlab& t : w) fill(t, -1, !t.slab.writer);
    return write_checkpoint(MPI_COMM_WORLD, dir_ + "/" + name, slabs_of(w), test_meta());
  }
  std::string dir_;
};

TEST_F(CkptTest, RoundTripInAnotherSplit) {
  const int r = world_rank(), np = world_size();
  const CkptIO wio = write_standard("step_00001000.h5");
  EXPECT_GT(wio.bytes, 4.0 * (600 + 300) * 1000);
  EXPECT_GE(wio.seconds, 0.0);
  EXPECT_EQ(entries(), std::vector<std::string>{"step_00001000.h5"});  // no *.tmp-* left

  auto rd = layout(r, np, true);
  for (TestSlab& t : rd) std::fill(t.data.begin(), t.data.end(), 777.f);
  CkptMeta meta;
  const CkptIO rio = read_checkpoint(MPI_COMM_WORLD, dir_ + "/step_00001000.h5", slabs_of(rd), meta);
  EXPECT_EQ(rio.bytes, wio.bytes);
  for (const TestSlab& t : rd) EXPECT_EQ(mismatches(t), 0) << t.slab.name;
  CkptMeta want = test_meta();
  want.integers["content_digests"] = 2;  // (the writer's own: its digest version)
  EXPECT_EQ(meta.text, want.text);
  EXPECT_EQ(meta.integers, want.integers);
  EXPECT_EQ(meta.reals, want.reals);

  // The same split as written reads back too (a padding row included, set to 0).
  auto same = layout(r, np, false);
  for (TestSlab& t : same) std::fill(t.data.begin(), t.data.end(), 777.f);
  CkptMeta meta2;
  read_checkpoint(MPI_COMM_WORLD, dir_ + "/step_00001000.h5", slabs_of(same), meta2);
  for (const TestSlab& t : same) EXPECT_EQ(mismatches(t), 0) << t.slab.name;

  if (r == 0) {
    const CkptMeta serial = read_checkpoint_meta(dir_ + "/step_00001000.h5");
    EXPECT_EQ(serial.text, want.text);
    EXPECT_EQ(serial.integers, want.integers);
    EXPECT_EQ(serial.reals, want.reals);
    std::FILE* devnull = std::fopen("/dev/null", "w");
    EXPECT_EQ(inspect_checkpoint(dir_ + "/step_00001000.h5", devnull), 0);
    std::fclose(devnull);
  }
}

// The room check before a write counts the whole file: every chunk stored whole (big_rows' last
// chunk holds 76 of its 262 rows), checksums, metadata, attributes; generously, not wildly.
TEST_F(CkptTest, FileSizeEstimateCoversTheFile) {
  const CkptIO io = write_standard("size.h5");
  auto w = layout(world_rank(), world_size(), false);
  double attributes = 0;
  for (const auto& [name, text] : test_meta().text) attributes += double(name.size() + text.size());
  const ckpt_impl::FileEstimate e = ckpt_impl::estimate_file(slabs_of(w), attributes);
  EXPECT_GE(e.file_bytes(), io.bytes);
  EXPECT_LE(e.file_bytes(), io.bytes + 64 * 1024) << "data " << e.data_bytes;
  EXPECT_GT(io.bytes - e.data_bytes, 0.6e6);  // (the partial chunks, stored whole)
}

TEST_F(CkptTest, ReadableByH5dump) {
  const bool have = access("/usr/bin/h5dump", X_OK) == 0;
  if (!have) GTEST_SKIP() << "no /usr/bin/h5dump";  // same on every rank (one machine)
  write_standard("c.h5");
  if (world_rank() == 0) {
    const std::string out = dir_ + "/dump.txt";
    const int rc = std::system(("/usr/bin/h5dump -H -p " + dir_ + "/c.h5 > " + out + " 2>&1").c_str());
    EXPECT_EQ(rc, 0);
    std::ifstream f(out);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"big_rows\""), std::string::npos) << text.substr(0, 2000);
    EXPECT_NE(text.find("( 600, 1000 )"), std::string::npos);
    EXPECT_NE(text.find("( 37, 5 )"), std::string::npos);
    EXPECT_NE(text.find("( 10, 4 )"), std::string::npos);  // global shape, padding not stored
    EXPECT_NE(text.find("( 23 )"), std::string::npos);
    EXPECT_NE(text.find("FLETCHER32"), std::string::npos);
    EXPECT_NE(text.find("CHUNKED"), std::string::npos);
    EXPECT_NE(text.find("ATTRIBUTE \"step\""), std::string::npos);
  }
}

TEST_F(CkptTest, UnwritableDirectoryFailsEverywhere) {
  auto w = layout(world_rank(), world_size(), false);
  for (TestSlab& t : w) fill(t);
  const std::string missing = dir_ + "/no/such/dir/step_00000001.h5";
  std::string msg;
  try {
    write_checkpoint(MPI_COMM_WORLD, missing, slabs_of(w), test_meta());
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  // A path under a regular file.
  if (world_rank() == 0) std::ofstream(dir_ + "/afile") << "x";
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_THROW(write_checkpoint(MPI_COMM_WORLD, dir_ + "/afile/x.h5", slabs_of(w), test_meta()),
               UserError);
  EXPECT_EQ(entries(), std::vector<std::string>{"afile"});
}

TEST_F(CkptTest, FailedWriteLeavesPreviousFile) {
  const int r = world_rank(), np = world_size();
  write_standard("step_00000005.h5");
  // A second dataset of the same name makes the write fail after the temporary file exists.
  auto w = layout(r, np, false);
  for (TestSlab& t : w) fill(t);
  std::vector<CkptSlab> bad = slabs_of(w);
  bad.push_back(bad.front());
  std::string msg;
  try {
    write_checkpoint(MPI_COMM_WORLD, dir_ + "/step_00000005.h5", bad, CkptMeta{});
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("step_00000005.h5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model/a"), std::string::npos) << msg;
  EXPECT_EQ(entries(), std::vector<std::string>{"step_00000005.h5"});
  auto rd = layout(r, np, true);
  CkptMeta meta;
  read_checkpoint(MPI_COMM_WORLD, dir_ + "/step_00000005.h5", slabs_of(rd), meta);
  for (const TestSlab& t : rd) EXPECT_EQ(mismatches(t), 0) << t.slab.name;
  EXPECT_EQ(meta.integers.at("step"), 1000);
}

TEST_F(CkptTest, FlippedByteIsAChecksumError) {
  const int r = world_rank(), np = world_size();
  const int64_t n = 200000;  // one chunk of 800 KB
  const float pattern = 1.2345f;
  std::vector<float> mine(static_cast<size_t>(part(n, np, r + 1) - part(n, np, r)), pattern);
  CkptSlab s;
  s.name = "model/const";
  s.global_shape = {n};
  s.rows = {{part(n, np, r), part(n, np, r + 1)}};
  s.data = mine.data();
  const std::string path = dir_ + "/flip.h5";
  write_checkpoint(MPI_COMM_WORLD, path, {s}, CkptMeta{});
  int flipped = 0;
  if (r == 0) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<char> run(4096);
    for (size_t i = 0; i < run.size(); i += 4) std::memcpy(&run[i], &pattern, 4);
    auto it = std::search(bytes.begin(), bytes.end(), run.begin(), run.end());
    if (it != bytes.end()) {
      const size_t at = static_cast<size_t>(it - bytes.begin()) + 2 * n;  // mid-chunk
      if (at < bytes.size()) {
        f.seekp(static_cast<std::streamoff>(at));
        const char c = static_cast<char>(bytes[at] ^ 0x10);
        f.write(&c, 1);
        flipped = f.good();
      }
    }
  }
  MPI_Bcast(&flipped, 1, MPI_INT, 0, MPI_COMM_WORLD);
  EXPECT_TRUE(flipped);
  std::fill(mine.begin(), mine.end(), 0.f);
  const std::string msg = read_error(path, {s});
  EXPECT_NE(msg.find("model/const"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checksum"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  if (r == 0) {
    std::FILE* devnull = std::fopen("/dev/null", "w");
    EXPECT_EQ(inspect_checkpoint(path, devnull), 1);
    std::fclose(devnull);
  }
}

TEST_F(CkptTest, TruncatedForeignAndMismatchedFiles) {
  const int r = world_rank(), np = world_size();
  write_standard("good.h5");
  const std::string good = dir_ + "/good.h5", half = dir_ + "/half.h5", text = dir_ + "/text.h5",
                    dbl = dir_ + "/double.h5";
  if (r == 0) {
    fs::copy_file(good, half);
    fs::resize_file(half, fs::file_size(good) / 2);
    std::ofstream(text) << "this is not an HDF5 file\n";
    // A float64 dataset where float32 is expected.
    hid_t f = H5Fcreate(dbl.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hsize_t d = 23;
    hid_t sp = H5Screate_simple(1, &d, nullptr);
    hid_t ds = H5Dcreate2(f, "x", H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(ds);
    H5Sclose(sp);
    H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto rd = layout(r, np, true);
  const std::vector<CkptSlab> slabs = slabs_of(rd);

  std::string msg = read_error(half, slabs);
  EXPECT_NE(msg.find(half), std::string::npos) << msg;
  msg = read_error(text, slabs);
  EXPECT_NE(msg.find(text), std::string::npos) << msg;
  msg = read_error(dir_ + "/absent.h5", slabs);
  EXPECT_NE(msg.find("absent.h5"), std::string::npos) << msg;

  std::vector<CkptSlab> missing = slabs;
  missing[1].name = "model/nope";
  msg = read_error(good, missing);
  EXPECT_NE(msg.find("model/nope"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  missing[1].name = "nogroup/nope";
  msg = read_error(good, missing);
  EXPECT_NE(msg.find("nogroup/nope"), std::string::npos) << msg;

  std::vector<CkptSlab> wrong = slabs;  // model/a is (37, 5)
  wrong[0].global_shape = {36, 5};
  wrong[0].rows = {};
  msg = read_error(good, wrong);
  EXPECT_NE(msg.find("model/a"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[37, 5]"), std::string::npos) << msg;

  std::vector<float> x(23);
  CkptSlab xs;
  xs.name = "x";
  xs.global_shape = {23};
  xs.rows = {{0, 23}};
  xs.data = x.data();
  msg = read_error(dbl, {xs});
  EXPECT_NE(msg.find("float32"), std::string::npos) << msg;

  if (r == 0) {
    std::FILE* devnull = std::fopen("/dev/null", "w");
    EXPECT_EQ(inspect_checkpoint(half, devnull), 1);
    EXPECT_EQ(inspect_checkpoint(text, devnull), 1);
    EXPECT_EQ(inspect_checkpoint(dbl, devnull), 1);
    EXPECT_THROW(inspect_checkpoint(dir_ + "/absent.h5", devnull), UserError);  // (exit 2)
    std::fclose(devnull);
    EXPECT_THROW(read_checkpoint_meta(half), UserError);
    EXPECT_THROW(read_checkpoint_meta(text), UserError);
  }
}

// Files are untrusted: datasets whose storage the reader must refuse before reading any data.
TEST_F(CkptTest, UntrustedStorageIsRefusedBeforeAnyRead) {
  const int r = world_rank();
  const std::string external = dir_ + "/external.h5", unwritten = dir_ + "/unwritten.h5",
                    huge = dir_ + "/huge.h5", plugin = dir_ + "/plugin.h5";
  // One float32 dataset "x" of `n` values with the given creation properties, never written.
  auto make_file = [](const std::string& path, hsize_t n, hid_t dcpl) {
    hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t sp = H5Screate_simple(1, &n, nullptr);
    hid_t ds = H5Dcreate2(f, "x", H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    const bool ok = f >= 0 && sp >= 0 && ds >= 0;
    H5Dclose(ds);
    H5Sclose(sp);
    H5Fclose(f);
    return ok;
  };
  int made = 1;
  if (r == 0) {
    // Raw data in another file (it could be any file on the machine).
    std::ofstream(dir_ + "/secret.bin") << std::string(92, 'x');
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_external(dcpl, (dir_ + "/secret.bin").c_str(), 0, 92);
    made &= make_file(external, 23, dcpl);
    H5Pclose(dcpl);
    // Chunked, no chunk ever written: would read back as zeros.
    dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hsize_t chunk = 8;
    H5Pset_chunk(dcpl, 1, &chunk);
    made &= make_file(unwritten, 23, dcpl);
    // 2^40 values claimed by a file of a few KiB: inspect must not try to read 4 TiB.
    made &= make_file(huge, hsize_t(1) << 40, dcpl);
    // A filter that is not HDF5's own (bzip2's registered id): a plugin the file names.
    H5Pset_filter(dcpl, 307, H5Z_FLAG_OPTIONAL, 0, nullptr);
    made &= make_file(plugin, 23, dcpl);
    H5Pclose(dcpl);
  }
  MPI_Bcast(&made, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ASSERT_TRUE(made);

  std::vector<float> x(23);
  CkptSlab xs;
  xs.name = "x";
  xs.global_shape = {23};
  xs.rows = {{0, 23}};
  xs.data = x.data();
  std::string msg = read_error(external, {xs});
  EXPECT_NE(msg.find("external file"), std::string::npos) << msg;
  msg = read_error(unwritten, {xs});
  EXPECT_NE(msg.find("of 92 bytes of data stored"), std::string::npos) << msg;
  msg = read_error(plugin, {xs});
  EXPECT_NE(msg.find("filter 307"), std::string::npos) << msg;
  xs.global_shape = {int64_t(1) << 40};
  msg = read_error(huge, {xs});
  EXPECT_NE(msg.find("bytes of data stored"), std::string::npos) << msg;

  if (r == 0) {
    std::FILE* devnull = std::fopen("/dev/null", "w");
    for (const std::string& f : {external, unwritten, huge, plugin})
      EXPECT_EQ(inspect_checkpoint(f, devnull), 1) << f;
    std::fclose(devnull);
  }
}

// Node-local storage: each rank passes a directory of its own (rank r holds step files 100..100+r
// and r names `latest`). Every rank must get rank 0's list and rank 0's choice, or the ranks would
// load different checkpoints (or one would fall back to an older one alone and the next collective
// would pair wrong calls).
TEST_F(CkptTest, RanksTryTheFilesRankZeroSees) {
  const int r = world_rank();
  const std::string mine = dir_ + "/rank" + std::to_string(r);
  fs::create_directories(mine);
  for (int s = 0; s <= r; ++s) std::ofstream(mine + "/" + checkpoint_file_name(100 + s)) << "x";
  publish_latest(mine, checkpoint_file_name(100 + r));
  const std::string zero = dir_ + "/rank0";
  EXPECT_EQ(resume_candidates(MPI_COMM_WORLD, mine),
            (std::vector<std::string>{zero + "/step_00000100.h5"}));
  EXPECT_EQ(resolve_checkpoint(MPI_COMM_WORLD, mine), zero + "/step_00000100.h5");
  // Rank 0's UserError reaches every rank (a rank whose own directory reads fine included).
  const std::string empty = dir_ + "/empty" + std::to_string(r);
  fs::create_directories(empty);
  if (r != 0) std::ofstream(empty + "/" + checkpoint_file_name(5)) << "x";
  std::string msg;
  try {
    resolve_checkpoint(MPI_COMM_WORLD, empty);
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find(dir_ + "/empty0: a directory without step_*.h5"), std::string::npos) << msg;
}

}  // namespace
}  // namespace trellis
