#include "ckpt/safetensors.hpp"

#include <bit>
#include <cstdio>

#include "ckpt/checkpoint.hpp"  // write_file_atomically
#include "core/error.hpp"
#include "core/json.hpp"

namespace trellis {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; this writer copies memory as it is");

void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    if (!first) header += ',';
    header += json_string(k) + ":" + json_string(v);
    first = false;
  }
  header += "}";
  uint64_t offset = 0;
  for (const SafeTensor& t : tensors) {
    int64_t n = 1;
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      n *= t.shape[i];
      if (i) shape += ',';
      shape += std::to_string(t.shape[i]);
    }
    TRELLIS_CHECK(n == int64_t(t.data.size()), "tensor %s: shape holds %lld values, data %zu",
                  t.name.c_str(), (long long)n, t.data.size());
    const uint64_t bytes = uint64_t(n) * sizeof(float);
    header += ',';
    header += json_string(t.name);
    header += strfmt(":{\"dtype\":\"F32\",\"shape\":[%s],\"data_offsets\":[%llu,%llu]}",
                     shape.c_str(), (unsigned long long)offset, (unsigned long long)(offset + bytes));
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned

  const uint64_t n = header.size();
  write_file_atomically(path, [&](std::FILE* f) {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(header.data(), 1, n, f) == n;
    for (const SafeTensor& t : tensors)
      ok = ok && std::fwrite(t.data.data(), sizeof(float), t.data.size(), f) == t.data.size();
    return ok;
  });
}

}  // namespace trellis
