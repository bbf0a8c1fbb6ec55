#include "model/params.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace trellis {

int64_t ParamInfo::numel() const {
  int64_t rows_held = 0;
  for (const RowRange& r : rows) rows_held += r.end - r.begin;
  return rows_held * (col_end - col_begin);
}

int64_t ParamInfo::global_numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ParamInfo::global_index(int64_t i) const {
  const int64_t local_cols = col_end - col_begin;
  const int64_t global_cols = shape.size() > 1 ? shape[1] : 1;
  int64_t row = i / local_cols, col = i % local_cols;
  for (const RowRange& r : rows) {
    if (row < r.end - r.begin) {
      const int64_t global_row = r.begin + row;
      if (global_row >= shape[0]) return -1;  // padding
      return global_row * global_cols + col_begin + col;
    }
    row -= r.end - r.begin;
  }
  return -1;
}

int64_t ParamTable::add(const std::string& name, std::vector<int64_t> shape,
                        std::vector<RowRange> rows, int64_t col_begin, int64_t col_end,
                        TpSplit split, int layer, bool decay, double init_std, float init_value) {
  ParamInfo p;
  p.name = name;
  p.shape = std::move(shape);
  p.rows = std::move(rows);
  p.col_begin = col_begin;
  p.col_end = col_end;
  p.split = split;
  p.layer = layer;
  p.decay = decay;
  p.init_std = init_std;
  p.init_value = init_value;
  p.offset = total_;
  total_ += p.numel();
  params_.push_back(p);
  return p.offset;
}

int vocab_rows_per_rank(const ModelConfig& m, int tp) {
  const int64_t share = (int64_t(m.vocab) + tp - 1) / tp;
  int64_t step = m.vocab_multiple;  // (any number, not only a power of two)
  if (step > share / 8)
    for (step = 1; step * 2 <= share / 8;) step *= 2;
  return int((share + step - 1) / step * step);
}

StageSpec stage_spec(const Config& cfg, int stage) {
  const int pp = cfg.parallel.pp;
  StageSpec spec{0, 0, stage == 0, stage == pp - 1};
  const int chunks = cfg.parallel.schedule == "interleaved" ? cfg.parallel.virtual_stages : 1;
  if (chunks > 1) {
    const int per_chunk = cfg.model.layers / (pp * chunks);
    spec.first_layer = stage * per_chunk;
    spec.end_layer = (stage + 1) * per_chunk;
    spec.chunks = chunks;
    spec.chunk_stride = pp * per_chunk;
  } else {
    const StageLayers layers = stage_layers(cfg.model, cfg.parallel, stage);
    spec.first_layer = layers.first;
    spec.end_layer = layers.end;
  }
  return spec;
}

ParamTable::ParamTable(const ModelConfig& m, int tp, int tp_rank, StageSpec stage_spec)
    : stage(stage_spec) {
  if (stage.end_layer < 0) stage.end_layer = m.layers;
  const int64_t C = m.d_model, V = m.vocab, T = m.seq_len, F = m.d_ff, H = m.heads, KV = m.kv_heads;
  const int64_t hd = m.d_model / m.heads;
  const int64_t QKV = (H + 2 * KV) * hd;
  const double std = m.init_std;
  const double residual_std = m.init_std / std::sqrt(2.0 * m.layers);

  // This rank's share (validated in config: heads % tp, kv_heads % tp or tp % kv_heads, d_ff % tp).
  heads_local = int(H / tp);
  const int64_t h0 = int64_t(tp_rank) * heads_local;
  int64_t kv0;
  if (KV >= tp) {
    kv_heads_local = int(KV / tp);
    kv0 = int64_t(tp_rank) * kv_heads_local;
  } else {
    kv_heads_local = 1;
    kv0 = tp_rank / (tp / KV);
  }
  const TpSplit qkv_split = KV < tp ? TpSplit::KvReplicated : (tp > 1 ? TpSplit::Sharded : TpSplit::Replicated);
  const TpSplit sharded = tp > 1 ? TpSplit::Sharded : TpSplit::Replicated;
  d_ff_local = int(F / tp);
  const int64_t f0 = int64_t(tp_rank) * d_ff_local;
  vocab_local = vocab_rows_per_rank(m, tp);
  vocab_padded = vocab_local * tp;
  vocab_begin = tp_rank * vocab_local;

  const std::vector<RowRange> qkv_rows = {
      {h0 * hd, (h0 + heads_local) * hd},                          // query heads
      {(H + kv0) * hd, (H + kv0 + kv_heads_local) * hd},           // key heads
      {(H + KV + kv0) * hd, (H + KV + kv0 + kv_heads_local) * hd}  // value heads
  };
  auto all = [](int64_t n) { return std::vector<RowRange>{{0, n}}; };
  const auto R = TpSplit::Replicated;

  if (stage.first) {
    wte = add("wte", {V, C}, {{vocab_begin, vocab_begin + vocab_local}}, 0, C, sharded, -1, true, std);
    wpe = add("wpe", {T, C}, all(T), 0, C, R, -1, true, std);
  }
  std::vector<int> layers;
  for (int k = 0; k < stage.chunks; ++k)
    for (int l = stage.first_layer; l < stage.end_layer; ++l) layers.push_back(l + k * stage.chunk_stride);
  for (int l : layers) {
    const std::string h = "h." + std::to_string(l) + ".";
    BlockOffsets b;
    b.begin = total_;
    b.ln1_w = add(h + "ln_1.weight", {C}, all(C), 0, 1, R, l, false, 0, 1.f);
    b.ln1_b = add(h + "ln_1.bias", {C}, all(C), 0, 1, R, l, false, 0);
    b.qkv_w = add(h + "attn.c_attn.weight", {QKV, C}, qkv_rows, 0, C, qkv_split, l, true, std);
    b.qkv_b = add(h + "attn.c_attn.bias", {QKV}, qkv_rows, 0, 1, qkv_split, l, false, 0);
    b.attproj_w = add(h + "attn.c_proj.weight", {C, H * hd}, all(C), h0 * hd,
                      (h0 + heads_local) * hd, sharded, l, true, residual_std);
    b.attproj_b = add(h + "attn.c_proj.bias", {C}, all(C), 0, 1, R, l, false, 0);
    b.ln2_w = add(h + "ln_2.weight", {C}, all(C), 0, 1, R, l, false, 0, 1.f);
    b.ln2_b = add(h + "ln_2.bias", {C}, all(C), 0, 1, R, l, false, 0);
    b.fc_w = add(h + "mlp.c_fc.weight", {F, C}, {{f0, f0 + d_ff_local}}, 0, C, sharded, l, true, std);
    b.fc_b = add(h + "mlp.c_fc.bias", {F}, {{f0, f0 + d_ff_local}}, 0, 1, sharded, l, false, 0);
    b.fcproj_w = add(h + "mlp.c_proj.weight", {C, F}, all(C), f0, f0 + d_ff_local, sharded, l, true,
                     residual_std);
    b.fcproj_b = add(h + "mlp.c_proj.bias", {C}, all(C), 0, 1, R, l, false, 0);
    b.end = total_;
    blocks.push_back(b);
  }
  const int64_t blocks_end = total_;
  if (stage.last) {
    lnf_w = add("ln_f.weight", {C}, all(C), 0, 1, R, -1, false, 0, 1.f);
    lnf_b = add("ln_f.bias", {C}, all(C), 0, 1, R, -1, false, 0);
  }

  const int per_chunk = blocks.empty() ? 1 : int(blocks.size()) / stage.chunks;
  if (stage.first) {
    units.push_back({wte, blocks.empty() ? blocks_end : blocks.front().begin});
    unit_chunk.push_back(0);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    units.push_back({blocks[i].begin, blocks[i].end});
    unit_chunk.push_back(int(i) / per_chunk);
  }
  if (stage.last) {
    units.push_back({lnf_w, total_});
    unit_chunk.push_back(stage.chunks - 1);
  }
}

std::vector<Unit> ParamTable::replicated_ranges() const {
  std::vector<Unit> out;
  for (const ParamInfo& p : params_)
    if (p.split == TpSplit::Replicated) out.push_back({p.offset, p.offset + p.numel()});
  return out;
}

std::vector<Unit> ParamTable::kv_replicated_ranges() const {
  std::vector<Unit> out;
  for (const ParamInfo& p : params_) {
    if (p.split != TpSplit::KvReplicated) continue;
    // Local rows: query heads first, then the key and value rows, which are the replicated part.
    const int64_t cols = p.col_end - p.col_begin;
    const int64_t q_rows = p.rows[0].end - p.rows[0].begin;
    out.push_back({p.offset + q_rows * cols, p.offset + p.numel()});
  }
  return out;
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
      for (int64_t i = lo; i < hi; ++i) dst[i - lo] = p.global_index(i) < 0 ? 0.f : p.init_value;
      continue;
    }
    const uint64_t key = mix64(seed ^ hash_name(p.name));
    for (int64_t i = lo; i < hi; ++i) {
      // Box–Muller from two 53-bit uniforms derived from the element's global index, so that
      // every layout initialises the same global tensor. Padding rows stay zero.
      const int64_t g = p.global_index(i);
      if (g < 0) {
        dst[i - lo] = 0.f;
        continue;
      }
      uint64_t a = mix64(key + 2 * static_cast<uint64_t>(g));
      uint64_t b = mix64(key + 2 * static_cast<uint64_t>(g) + 1);
      double u1 = ((a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
      double u2 = (b >> 11) * 0x1.0p-53;          // [0, 1)
      double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      dst[i - lo] = static_cast<float>(z * p.init_std);
    }
  }
}

}  // namespace trellis
