// The safetensors format (Hugging Face), written by Trellis itself: an 8-byte little-endian
// header length N, N bytes of JSON — {"__metadata__": {...}, name: {"dtype": "F32", "shape":
// [...], "data_offsets": [begin, end]}, ...} with offsets into the data that follows, padded with
// spaces to a multiple of 8 — then the tensors' raw little-endian bytes, back to back.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trellis {

struct SafeTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, Πshape values
};

/// Writes float32 tensors in the order given, with string metadata (e.g. {"format": "pt"}),
/// atomically (write_file_atomically). I/O failure → UserError naming the path.
void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace trellis
