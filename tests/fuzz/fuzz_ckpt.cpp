// libFuzzer target: the checkpoint reader treats files as untrusted. Any file must give metadata,
// a verdict from inspect, or a UserError — never a crash or an out-of-bounds access (the target
// is built with AddressSanitizer). Run by `make fuzz`.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"

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
  return 0;
}
