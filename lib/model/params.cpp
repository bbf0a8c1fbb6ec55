#include "model/params.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace trellis {

int64_t ParamInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ParamTable::add(const std::string& name, std::vector<int64_t> shape, int layer, bool decay,
                        double init_std, float init_value) {
  ParamInfo p;
  p.name = name;
  p.shape = std::move(shape);
  p.layer = layer;
  p.decay = decay;
  p.init_std = init_std;
  p.init_value = init_value;
  p.offset = total_;
  total_ += p.numel();
  params_.push_back(p);
  return p.offset;
}

ParamTable::ParamTable(const ModelConfig& m) {
  const int64_t C = m.d_model, V = m.vocab, T = m.seq_len, F = m.d_ff;
  const int64_t hd = m.d_model / m.heads;
  const int64_t QKV = (m.heads + 2 * m.kv_heads) * hd;
  const double std = m.init_std;
  const double residual_std = m.init_std / std::sqrt(2.0 * m.layers);

  wte = add("wte", {V, C}, -1, true, std);
  wpe = add("wpe", {T, C}, -1, true, std);
  for (int l = 0; l < m.layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    BlockOffsets b;
    b.begin = total_;
    b.ln1_w = add(h + "ln_1.weight", {C}, l, false, 0, 1.f);
    b.ln1_b = add(h + "ln_1.bias", {C}, l, false, 0);
    b.qkv_w = add(h + "attn.c_attn.weight", {QKV, C}, l, true, std);
    b.qkv_b = add(h + "attn.c_attn.bias", {QKV}, l, false, 0);
    b.attproj_w = add(h + "attn.c_proj.weight", {C, m.heads * hd}, l, true, residual_std);
    b.attproj_b = add(h + "attn.c_proj.bias", {C}, l, false, 0);
    b.ln2_w = add(h + "ln_2.weight", {C}, l, false, 0, 1.f);
    b.ln2_b = add(h + "ln_2.bias", {C}, l, false, 0);
    b.fc_w = add(h + "mlp.c_fc.weight", {F, C}, l, true, std);
    b.fc_b = add(h + "mlp.c_fc.bias", {F}, l, false, 0);
    b.fcproj_w = add(h + "mlp.c_proj.weight", {C, F}, l, true, residual_std);
    b.fcproj_b = add(h + "mlp.c_proj.bias", {C}, l, false, 0);
    b.end = total_;
    blocks.push_back(b);
  }
  lnf_w = add("ln_f.weight", {C}, -1, false, 0, 1.f);
  lnf_b = add("ln_f.bias", {C}, -1, false, 0);

  units.push_back({wte, blocks.empty() ? lnf_w : blocks.front().begin});
  for (const BlockOffsets& b : blocks) units.push_back({b.begin, b.end});
  units.push_back({lnf_w, total_});
}

const ParamInfo& ParamTable::find(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  throw std::logic_error("no parameter named " + name);
}

// splitmix64: a strong 64-bit mixer, so that hashing (seed, tensor, index) gives independent
// uniform bits without any sequential RNG state.
static uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void init_parameters(const ParamTable& table, uint64_t seed, float* out, int64_t begin,
                     int64_t end) {
  if (end < 0) end = table.total();
  for (const ParamInfo& p : table.params()) {
    // The part of this tensor inside [begin, end), as element indices i within the tensor.
    const int64_t lo = std::max<int64_t>(0, begin - p.offset);
    const int64_t hi = std::min<int64_t>(p.numel(), end - p.offset);
    if (lo >= hi) continue;
    float* dst = out + (p.offset + lo - begin);
    if (p.init_std == 0) {
      for (int64_t i = lo; i < hi; ++i) dst[i - lo] = p.init_value;
      continue;
    }
    const uint64_t key = mix64(seed ^ hash_name(p.name));
    for (int64_t i = lo; i < hi; ++i) {
      // Box–Muller from two 53-bit uniforms derived from the element's own index.
      uint64_t a = mix64(key + 2 * static_cast<uint64_t>(i));
      uint64_t b = mix64(key + 2 * static_cast<uint64_t>(i) + 1);
      double u1 = ((a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
      double u2 = (b >> 11) * 0x1.0p-53;          // [0, 1)
      double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      dst[i - lo] = static_cast<float>(z * p.init_std);
    }
  }
}

}  // namespace trellis
