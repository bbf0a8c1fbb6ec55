// A checkpoint file is untrusted input: it may be truncated, damaged, or made by someone else.
// These checks run on a dataset before any of its data is read, so that a malformed file is a
// clear error and never a huge allocation, a read of another file, or a long loop inside HDF5.
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"

namespace trellis::ckpt_impl {

namespace {

/// HDF5's own filters; anything else would be a plugin (a shared library named by the file).
bool builtin_filter(H5Z_filter_t id) {
  return id == H5Z_FILTER_DEFLATE || id == H5Z_FILTER_SHUFFLE || id == H5Z_FILTER_FLETCHER32 ||
         id == H5Z_FILTER_SZIP || id == H5Z_FILTER_NBIT || id == H5Z_FILTER_SCALEOFFSET;
}

}  // namespace

std::string check_dataset(hid_t dset, std::vector<int64_t>& shape, double file_bytes) {
  H5Id type(H5Dget_type(dset), H5Tclose);
  H5Id space(H5Dget_space(dset), H5Sclose);
  H5Id dcpl(H5Dget_create_plist(dset), H5Pclose);
  if (!type.ok() || !space.ok() || !dcpl.ok()) return h5_error();
  if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 4) return "not float32";
  if (H5Sget_simple_extent_type(space.get()) != H5S_SIMPLE) return "not a simple dataspace";
  const int nd = H5Sget_simple_extent_ndims(space.get());
  if (nd < 1 || nd > 2) return "not 1-D or 2-D";
  hsize_t dims[2] = {0, 0};
  if (H5Sget_simple_extent_dims(space.get(), dims, nullptr) != nd) return h5_error();
  shape.assign(dims, dims + nd);
  // Elements and bytes, guarded against overflow: nothing real is near 2^62 bytes.
  double values = 1;
  for (int64_t d : shape) values *= double(d);
  if (values * 4 > 0x1p62) return "shape " + shape_text(shape) + " is implausibly large";

  // Layout: data stored in this file — no external raw-data files, no virtual datasets.
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout != H5D_CHUNKED && layout != H5D_CONTIGUOUS && layout != H5D_COMPACT)
    return "unsupported storage layout (virtual dataset?)";
  if (H5Pget_external_count(dcpl.get()) != 0) return "raw data in an external file";
  bool compressed = false;
  const int nfilters = H5Pget_nfilters(dcpl.get());
  if (nfilters < 0) return h5_error();
  for (int i = 0; i < nfilters; ++i) {
    unsigned flags = 0, config = 0;
    size_t nelmts = 0;
    const H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &nelmts,
                                           nullptr, 0, nullptr, &config);
    if (id < 0) return h5_error();
    if (!builtin_filter(id)) return strfmt("filter %d is not built into HDF5", int(id));
    compressed |= id != H5Z_FILTER_FLETCHER32 && id != H5Z_FILTER_SHUFFLE;
  }

  // Sizes: what the file stores for the dataset must fit in the file, and (uncompressed) hold
  // every value — a chunk never written would otherwise read back as zeros.
  const double stored = double(H5Dget_storage_size(dset));
  if (file_bytes >= 0 && stored > file_bytes)  // (-1: the size unknown)
    return strfmt("claims %.0f bytes of data in a file of %.0f bytes", stored, file_bytes);
  if (!compressed && stored < values * 4)
    return strfmt("only %.0f of %.0f bytes of data stored (an incomplete file?)", stored,
                  values * 4);
  if (file_bytes >= 0 && compressed && values * 4 > 1100 * file_bytes)  // deflate expands at most ~1032:1
    return strfmt("%.0f values cannot come from a file of %.0f bytes", values, file_bytes);
  return {};
}

}  // namespace trellis::ckpt_impl
