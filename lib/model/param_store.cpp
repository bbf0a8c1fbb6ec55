#include "model/param_store.hpp"

#include <cstring>

namespace trellis {

ResidentParams::ResidentParams(const ParamTable& table)
    : table_(table),
      params_(MemKind::Params, table.total() * sizeof(float)),
      grads_(MemKind::Grads, table.total() * sizeof(float)) {}

void ResidentParams::zero_grads() { std::memset(grads_.data(), 0, grads_.bytes()); }

}  // namespace trellis
