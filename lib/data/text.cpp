// The text source: the bytes of one file, vocab 256, memory-mapped.
#include <algorithm>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data/mapped_file.hpp"

namespace trellis {
namespace {

class TextSource final : public TokenSource {
 public:
  TextSource(const std::string& path, const std::string& key) : file_(path, key) {}
  std::string describe() const override {
    return strfmt("text file '%s': %zu bytes, byte-level (vocab 256)", file_.path().c_str(),
                  file_.size());
  }
  int vocab() const override { return 256; }
  std::vector<File> files() const override { return {{file_.path(), file_.id()}}; }
  int64_t size() const override { return int64_t(file_.size()); }
  int64_t num_windows(int len) const override { return std::max<int64_t>(0, size() - len + 1); }
  void window(int64_t k, int len, int32_t* out) const override {
    TRELLIS_CHECK(k >= 0 && len >= 0 && k + len <= size(), "window %lld of %d bytes",
                  static_cast<long long>(k), len);
    const uint8_t* p = file_.data() + k;
    for (int i = 0; i < len; ++i) out[i] = p[i];
  }

 private:
  MappedFile file_;
};

}  // namespace

std::unique_ptr<TokenSource> make_text_source(const DataConfig& data, const ModelConfig& model,
                                              const std::string& key) {
  if (data.path.empty()) throw UserError(key + ": data.source = text needs a file in " + key);
  if (model.vocab < 256)
    throw UserError(
        strfmt("model.vocab = %d is too small for the byte-level text in %s "
               "'%s': it needs model.vocab ≥ 256",
               model.vocab, key.c_str(), data.path.c_str()));
  return std::make_unique<TextSource>(data.path, key);
}

}  // namespace trellis
