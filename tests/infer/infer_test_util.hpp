// Parameters for the generation tests: every element of every tensor — biases and LayerNorm
// weights included, which GPT-2's initialisation leaves at 0 and 1 — drawn from a hash of
// (tensor name, global element index), so that any tensor-parallel layout holds the same model
// and a mistake with a bias (added twice, or not at all) shows.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "model/params.hpp"

namespace trellis::testing {

inline void random_parameters(const ParamTable& table, float* out, double scale = 0.3) {
  for (const ParamInfo& p : table.params()) {
    const uint64_t key = std::hash<std::string>{}(p.name);
    for (int64_t i = 0; i < p.numel(); ++i) {
      const int64_t g = p.global_index(i);
      uint64_t h = key ^ (uint64_t(g + 1) * 0x9E3779B97F4A7C15ull);
      h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      const double u = double(h >> 11) * 0x1.0p-53;  // [0, 1)
      out[p.offset + i] = g < 0 ? 0.f : float(scale * (2 * u - 1) * 1.7);  // std ≈ scale
    }
  }
}

}  // namespace trellis::testing
