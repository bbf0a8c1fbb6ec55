#include "plan/flops.hpp"

namespace trellis {

int64_t matmul_params(const ModelConfig& m) {
  const int64_t C = m.d_model, F = m.d_ff, hd = m.d_model / m.heads;
  const int64_t qkv = (int64_t(m.heads) + 2 * m.kv_heads) * hd;
  const int64_t per_block = C * qkv + (m.heads * hd) * C + C * F + F * C;
  return m.layers * per_block + int64_t(m.vocab) * C;
}

double train_flops_per_token(const ModelConfig& m) {
  return 6.0 * double(matmul_params(m)) +
         12.0 * double(m.layers) * double(m.seq_len) * double(m.heads * (m.d_model / m.heads));
}

}  // namespace trellis
