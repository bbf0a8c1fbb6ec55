// A read-only memory map of a whole regular file (internal to the data module). Opening fails
// with a UserError naming the key that gave the path (`what`, e.g. "data.path") and the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace trellis {

class MappedFile {
 public:
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  /// The file itself (device, inode): one file under two names (a link, ./x and x) is one id.
  std::pair<uint64_t, uint64_t> id() const { return id_; }

 private:
  std::string path_;
  std::pair<uint64_t, uint64_t> id_{0, 0};
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace trellis
