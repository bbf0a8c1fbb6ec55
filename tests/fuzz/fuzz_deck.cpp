// libFuzzer target: the deck parser. Any input must end in a Config or a UserError — never a
// crash, a hang or another exception. Run by `make fuzz`.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "config/config.hpp"
#include "core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/trellis-fuzz-deck-" + std::to_string(::getpid()) + ".deck";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    trellis::Config cfg = trellis::load_config(path, {}, 1);
    (void)trellis::effective_deck_ini(cfg);
  } catch (const trellis::UserError&) {
  }
  return 0;
}
