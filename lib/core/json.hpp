// JSON text for the files Trellis writes (summary.json, safetensors headers, config.json).
#pragma once
#include <string>

namespace trellis {

/// `s` as a JSON string literal, quotes included: '"' and '\' escaped, control characters as
/// \u00XX, well-formed UTF-8 as it is, and each byte that is not part of well-formed UTF-8 (a
/// path in another encoding) as \u00XX — the byte read as Latin-1 — so that the file stays valid
/// JSON whatever the bytes.
std::string json_string(const std::string& s);

}  // namespace trellis
