// libFuzzer target: the checkpoint reader treats files as untrusted. Any file must give metadata,
// a verdict from inspect, data read into the slabs of the seed checkpoint's model (the parallel
// reader a resuming run uses, on MPI_COMM_SELF), or a UserError — never a crash, an out-of-bounds
// access (the target is built with AddressSanitizer) or a hang. Run by `make fuzz`.
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"

namespace {

// The seed's tensors (name, global shape), each read whole, as one rank of a run of that model.
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};
std::vector<Tensor> g_tensors;

herr_t add_dataset(hid_t file, const char* name, const H5L_info_t*, void*) {
  hid_t d = H5Dopen2(file, name, H5P_DEFAULT);
  if (d < 0) return 0;  // a group
  hid_t sp = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  const int nd = H5Sget_simple_extent_dims(sp, dims, nullptr);
  if (nd == 1 || nd == 2) g_tensors.push_back({name, std::vector<int64_t>(dims, dims + nd), {}});
  H5Sclose(sp);
  H5Dclose(d);
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  MPI_Init(argc, argv);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  const char* seed = std::getenv("TRELLIS_FUZZ_CKPT_SEED");
  hid_t f = H5Fopen(seed ? seed : "tests/fuzz/corpus/ckpt/tiny.h5", H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f >= 0) {
    H5Lvisit(f, H5_INDEX_NAME, H5_ITER_NATIVE, add_dataset, nullptr);
    H5Fclose(f);
  }
  if (g_tensors.empty()) std::fprintf(stderr, "fuzz_ckpt: no seed checkpoint: the parallel reader is not fuzzed\n");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/trellis-fuzz-ckpt-" + std::to_string(::getpid()) + ".h5";
  static std::FILE* devnull = std::fopen("/dev/null", "w");
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    (void)trellis::read_checkpoint_meta(path);
  } catch (const trellis::UserError&) {
  }
  (void)trellis::inspect_checkpoint(path, devnull);
  if (!g_tensors.empty()) {
    std::vector<trellis::CkptSlab> slabs;
    for (Tensor& t : g_tensors) {
      trellis::CkptSlab s;
      s.name = t.name;
      s.global_shape = t.shape;
      s.rows = {{0, t.shape[0]}};
      s.col_end = t.shape.size() == 2 ? t.shape[1] : 1;
      t.data.assign(static_cast<size_t>(t.shape[0] * s.col_end), 0.f);
      s.data = t.data.data();
      slabs.push_back(s);
    }
    trellis::CkptMeta meta;
    try {
      trellis::read_checkpoint(MPI_COMM_SELF, path, slabs, meta);
    } catch (const trellis::UserError&) {
    }
  }
  return 0;
}
