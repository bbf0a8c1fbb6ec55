// `trellis inspect CKPT`: metadata, every dataset with its shape, and a full read of each so that
// HDF5 verifies every chunk's Fletcher32 checksum and Trellis the dataset's content digest.
#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/error.hpp"

namespace trellis {

using namespace ckpt_impl;

// ---- inspect ---------------------------------------------------------------------------------------

namespace {

herr_t collect_link(hid_t, const char* name, const H5L_info_t* info, void* data) {
  if (info && info->type == H5L_TYPE_HARD) static_cast<std::vector<std::string>*>(data)->push_back(name);
  return 0;
}

/// Reads a dataset that passed check_dataset fully (HDF5 verifies each chunk's checksum) and
/// computes its content digest; "" or what is wrong.
std::string verify_dataset(hid_t dset, uint64_t key, const std::vector<hsize_t>& dims,
                           int64_t& nonfinite, int64_t& negative, uint64_t& digest) {
  H5Id space(H5Dget_space(dset), H5Sclose);
  if (!space.ok()) return h5_error();
  const int nd = static_cast<int>(dims.size());  // 1 or 2 (check_dataset)
  hsize_t row = 1;
  for (int i = 1; i < nd; ++i) row *= dims[static_cast<size_t>(i)];
  if (row == 0 || dims[0] == 0) return {};
  const hsize_t block = std::max<hsize_t>(1, (hsize_t(16) << 20) / row);  // ~64 MiB a read
  std::vector<float> buf;
  for (hsize_t r0 = 0; r0 < dims[0]; r0 += block) {
    const hsize_t nr = std::min(block, dims[0] - r0);
    std::vector<hsize_t> start(static_cast<size_t>(nd), 0), count(dims);
    start[0] = r0;
    count[0] = nr;
    if (H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                            nullptr) < 0)
      return h5_error();
    // (A memory space of the selection's shape: against a 1-D one HDF5 maps each chunk element
    // by element, several times slower.)
    H5Id mem(H5Screate_simple(nd, count.data(), nullptr), H5Sclose);
    buf.resize(static_cast<size_t>(nr * row));
    if (!mem.ok() ||
        H5Dread(dset, H5T_NATIVE_FLOAT, mem.get(), space.get(), H5P_DEFAULT, buf.data()) < 0)
      return strfmt("rows %llu..%llu: ", (unsigned long long)r0, (unsigned long long)(r0 + nr)) +
             h5_error();
    for (float v : buf) nonfinite += !std::isfinite(v), negative += v < 0;
    digest += digest_rows(key, buf.data(), int64_t(nr), int64_t(row), int64_t(r0), 0);
  }
  return {};
}

}  // namespace

const char* const kInspectUsage =
    "usage: trellis inspect CKPT\n"
    "  A checkpoint's step, layout, deck and tensors (shape, type), each read in full so that\n"
    "  HDF5 verifies its chunks' checksums and Trellis its content digest, checked against the\n"
    "  model its stored deck describes (each dataset present, at its shape). CKPT: a checkpoint\n"
    "  file, a `latest` pointer, or a checkpoint or run directory (its highest step). Exit status\n"
    "  0: sound; 1: unreadable as HDF5 or damaged (each PROBLEM printed); 2: no such file (or not\n"
    "  a regular file), a directory without checkpoints, or a `latest` that names none.\n";

int inspect_checkpoint(const std::string& path, std::FILE* out,
                       const ExpectedDatasets& expected_datasets) {
  silence_hdf5();
  // No file there at all (a mistyped path) is not a damaged checkpoint: a script that removes
  // what exits 1 must not take one for the other.
  std::string err = check_regular(path);
  if (!err.empty()) throw UserError(path + ": " + err);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) {
    bool gone = false;
    const std::string why = open_failure(path, &gone);
    if (gone) throw UserError(path + ": " + why);  // as a mistyped path: not damage
    std::fprintf(out, "%s: %s\n", path.c_str(), why.c_str());
    return 1;
  }
  int problems = 0;
  const double file_bytes = file_size(path);
  if (file_bytes >= 0)
    std::fprintf(out, "checkpoint %s (%.0f bytes)\n", path.c_str(), file_bytes);
  else  // (its name removed since it was opened: a run's retention)
    std::fprintf(out, "checkpoint %s (size unknown: removed since it was opened)\n", path.c_str());
  CkptMeta meta;
  err = read_attributes(file.get(), meta);
  if (!err.empty()) {
    std::fprintf(out, "  PROBLEM: %s\n", err.c_str());
    ++problems;
  }
  // What a resume refuses: another format, counters no run writes.
  if (const auto v = meta.integers.find("format_version");
      v == meta.integers.end() || v->second != kCheckpointFormat) {
    std::fprintf(out, "  PROBLEM: format_version is not %lld (trellis train refuses the file)\n",
                 (long long)kCheckpointFormat);
    ++problems;
  }
  if (const std::string problem = counter_problem(meta); !problem.empty()) {
    std::fprintf(out, "  PROBLEM: %s (damaged or edited)\n", problem.c_str());
    ++problems;
  }
  // A step file copied or renamed to another step's name: sound, but a resume from its directory
  // orders it by its name (and says so when it loads it).
  if (const auto step = meta.integers.find("step"); step != meta.integers.end()) {
    const int64_t named = checkpoint_step(std::filesystem::path(path).filename().string());
    if (named >= 0 && named != step->second)
      std::fprintf(out, "  note: named for step %lld, holds step %lld (copied or renamed?): a "
                   "resume from its directory takes it for step %lld's place\n",
                   (long long)named, (long long)step->second, (long long)named);
  }
  // The datasets the model its attributes describe has, where the caller can tell.
  std::map<std::string, std::vector<int64_t>> expected;
  bool check_model = false;
  if (expected_datasets) {
    if (const std::string problem = expected_datasets(meta, expected); problem.empty()) {
      check_model = true;
    } else {
      std::fprintf(out, "  PROBLEM: %s\n", problem.c_str());
      ++problems;
    }
  }
  for (const auto& [k, v] : meta.integers) std::fprintf(out, "  %s = %lld\n", k.c_str(), (long long)v);
  for (const auto& [k, v] : meta.reals) std::fprintf(out, "  %s = %.17g\n", k.c_str(), v);
  for (const auto& [k, v] : meta.text) {
    if (v.find('\n') == std::string::npos) {
      std::fprintf(out, "  %s = %s\n", k.c_str(), v.c_str());
      continue;
    }
    std::fprintf(out, "  %s:\n", k.c_str());
    size_t pos = 0;
    while (pos < v.size()) {
      size_t nl = v.find('\n', pos);
      if (nl == std::string::npos) nl = v.size();
      std::fprintf(out, "    | %s\n", v.substr(pos, nl - pos).c_str());
      pos = nl + 1;
    }
  }

  // Native order walks each group's index as stored; sorted order would first build a table of
  // the links, and on a damaged group that path frees an invalid pointer inside HDF5 1.10.8
  // (tests/fuzz/findings/). Sorted here instead.
  std::vector<std::string> links;
  if (H5Lvisit(file.get(), H5_INDEX_NAME, H5_ITER_NATIVE, collect_link, &links) < 0) {
    std::fprintf(out, "  PROBLEM: cannot list the file's objects: %s\n", h5_error().c_str());
    ++problems;
  }
  std::sort(links.begin(), links.end());
  // A file whose datasets carry digests carries one on each; another version's are not checked.
  const Digests stated = digests_stated(meta);
  const bool other_digests = stated == Digests::kOther;
  bool digests = stated == Digests::kThese;
  for (const std::string& name : links) {
    if (digests || other_digests) break;
    digests = H5Aexists_by_name(file.get(), name.c_str(), "content_digest", H5P_DEFAULT) > 0;
    H5Eclear2(H5E_DEFAULT);
  }
  int64_t ndatasets = 0, nelems = 0;
  std::fprintf(out, "datasets:\n");
  for (const std::string& name : links) {
    H5Id dset(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!dset.ok()) {
      H5Eclear2(H5E_DEFAULT);
      continue;  // a group
    }
    ++ndatasets;
    std::vector<int64_t> shape;
    std::string status = check_dataset(dset.get(), shape, file_bytes);
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    bool checksummed = false;
    if (H5Id dcpl(H5Dget_create_plist(dset.get()), H5Pclose); dcpl.ok()) {
      unsigned flags = 0;
      size_t nelmts = 0;
      unsigned config = 0;
      checksummed = H5Pget_filter_by_id2(dcpl.get(), H5Z_FILTER_FLETCHER32, &flags, &nelmts,
                                         nullptr, 0, nullptr, &config) >= 0;
    }
    H5Eclear2(H5E_DEFAULT);
    int64_t nonfinite = 0, negative = 0;
    uint64_t digest = 0, stored_digest = 0;
    bool has_digest = false;
    if (status.empty()) {  // the shape is plausible: its product fits
      status = verify_dataset(dset.get(), digest_key(name), dims, nonfinite, negative, digest);
      if (status.empty()) status = read_digest(dset.get(), has_digest, stored_digest);
      if (other_digests) has_digest = false;
      if (status.empty() && !has_digest && digests) status = missing_digest();
      if (status.empty() && has_digest && digest != stored_digest)
        status = digest_mismatch(stored_digest, digest);
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      nelems += n;
    }
    // A Trellis checkpoint holds no value that is not finite (a run skips or stops at a step
    // that would write one) and no negative second moment: they are damage its checksums missed.
    if (status.empty() && check_model && nonfinite)
      status = strfmt("%lld non-finite values (no run writes them: damaged or edited)",
                      (long long)nonfinite);
    if (status.empty() && check_model && negative && name.rfind("optim/v/", 0) == 0)
      status = strfmt("%lld negative second moments (no run writes them: damaged or edited)",
                      (long long)negative);
    if (status.empty()) {
      if (checksummed && has_digest)
        status = "ok (checksums and content digest verified)";
      else if (checksummed && other_digests)
        status = "ok (checksums verified; a content digest of another version, not checked)";
      else if (checksummed)
        status = "ok (checksums verified; no content digest: an older file)";
      else
        status = has_digest ? "ok (content digest verified; no checksums)"
                            : "ok (no checksums, no content digest)";
      if (nonfinite) status += strfmt(", %lld non-finite values", (long long)nonfinite);
    } else {
      ++problems;
      status = "PROBLEM: " + status;
    }
    if (check_model) {  // what the stored deck's model says of it
      const auto want = expected.find(name);
      const std::string model_problem =
          want == expected.end() ? "not in its stored deck's model"
          : want->second != shape
              ? "its stored deck's model has it " + shape_text(want->second)
              : std::string();
      if (want != expected.end()) expected.erase(want);
      if (!model_problem.empty()) {
        const bool counted = status.rfind("PROBLEM", 0) == 0;  // (the dataset's own, above)
        if (!counted) ++problems;
        status = (counted ? status + "; " : "PROBLEM: ") + model_problem;
      }
    }
    std::fprintf(out, "  %-48s %-16s %s\n", name.c_str(), shape_text(shape).c_str(),
                 status.c_str());
  }
  // What the model has and the file lacks (a resume would refuse the file).
  for (const auto& [name, shape] : expected) {
    std::fprintf(out, "  %-48s %-16s PROBLEM: missing (its stored deck's model has it)\n",
                 name.c_str(), shape_text(shape).c_str());
    ++problems;
  }
  if (!file.close()) {
    std::fprintf(out, "  PROBLEM: close: %s\n", h5_error().c_str());
    ++problems;
  }
  std::fprintf(out, "%lld datasets, %lld elements: %s\n", (long long)ndatasets, (long long)nelems,
               problems ? strfmt("%d problem(s)", problems).c_str() : "sound");
  return problems ? 1 : 0;
}

}  // namespace trellis
