#include "plan/memory.hpp"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <thread>

#include "backend/cuda_switches.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "model/params.hpp"
#include "parallel/schedule.hpp"

namespace trellis {

Precision parse_precision(const std::string& text) {
  if (text == "fp32") return Precision::FP32;
  if (text == "bf16") return Precision::BF16;
  if (text == "bf16-full") return Precision::BF16_FULL;
  throw UserError("--precision '" + text + "': expected fp32, bf16 or bf16-full");
}

const char* precision_name(Precision p) {
  return p == Precision::FP32 ? "fp32" : p == Precision::BF16 ? "bf16" : "bf16-full";
}

ModelStates zero_model_states(double psi, int dp, int zero_stage, Precision precision) {
  // Bytes per parameter of each state: bf16 weights and gradients with an fp32 copy, m and v
  // (ZeRO's K = 12); this code's bf16 keeps fp32 gradients (K = 12 as well); fp32 runs keep no
  // extra copy (K = 8).
  const bool full = precision == Precision::BF16_FULL, bf16 = precision == Precision::BF16;
  const double p = full || bf16 ? 2 : 4, g = full ? 2 : 4, o = full || bf16 ? 12 : 8;
  const double shard = psi / dp;
  return {p * (zero_stage >= 3 ? shard : psi), g * (zero_stage >= 2 ? shard : psi),
          o * (zero_stage >= 1 ? shard : psi)};
}

double megatron_layer_activation_bytes(int64_t seq, int64_t micro_batch, const ModelConfig& m,
                                       int tp, bool sequence_parallel,
                                       const std::string& recompute) {
  const double s = double(seq), b = double(micro_batch), h = double(m.d_model), a = double(m.heads);
  const double t = double(tp);
  const double sbh = s * b * h;
  const double sp_div = sequence_parallel ? t : 1.0;
  if (recompute == "full") return 2 * sbh / sp_div;  // the layer's input only
  // Outside the tensor-parallel region (replicated over tp unless sequence-parallel): the two
  // LayerNorms' inputs 4sbh, the QKV and first MLP linears' inputs 2sbh each, two dropout masks.
  const double replicated = 10 * sbh;
  // Inside it (split over tp): Q, K, V and the projection's input; the MLP's GeLU input and output.
  const double kv = double(m.kv_heads) / a, ff = double(m.d_ff) / (4 * h);
  const double sharded = (2 + 2 * kv + 2 * kv + 2) * sbh + 16 * ff * sbh;
  // Attention scores: softmax output 2as²b, dropout mask as²b, dropout output 2as²b.
  const double scores = recompute == "selective" ? 0.0 : 5 * a * s * s * b;
  return replicated / sp_div + (sharded + scores) / t;
}

int64_t model_parameter_count(const ModelConfig& m) {
  // The parameter table's tensors (README, "The model"), counted without building the table.
  const int64_t C = m.d_model, F = m.d_ff, hd = m.d_model / m.heads;
  const int64_t qkv = (int64_t(m.heads) + 2 * m.kv_heads) * hd;
  const int64_t block = 2 * C + (qkv * C + qkv) + (C * m.heads * hd + C) + 2 * C + (F * C + F) + (C * F + C);
  return int64_t(m.vocab) * C + int64_t(m.seq_len) * C + m.layers * block + 2 * C;
}

// ---------------------------------------------------------------------------------------------
// the activation arena: the same list, in the same order, as GPT::allocate_activations

int64_t activation_arena_bytes(const ArenaShape& s) {
  Arena a = Arena::measuring();
  const int64_t N = int64_t(s.micro_batch) * s.seq_len;
  const bool sp = s.sequence_parallel && s.tp > 1;
  const int64_t R = sp ? N / s.tp : N, C = s.d_model;
  const int64_t QKV = int64_t(s.heads_local + 2 * s.kv_heads_local) * s.head_dim;
  const int64_t att = int64_t(s.micro_batch) * s.heads_local * s.seq_len *
                     (s.attention_state_per_row ? 1 : s.seq_len);
  const bool full = s.recompute == "full", selective = s.recompute == "selective";
  auto act = [&](int64_t n) { a.take(size_t(n) * s.act_bytes); };  // of the run's type
  auto block = [&](bool with_att, bool with_output) {
    act(R * C);  // ln1
    a.take_f32(R);
    a.take_f32(R);
    act(N * QKV);
    act(N * s.heads_local * s.head_dim);  // atty
    if (with_att) a.take_f32(att);
    act(R * C);  // res2
    act(R * C);  // ln2
    a.take_f32(R);
    a.take_f32(R);
    act(N * s.d_ff_local);        // fch
    act(N * s.d_ff_local);        // fch_gelu
    if (with_output) act(R * C);  // res3
  };
  if (full) block(true, false);  // the block being recomputed, shared by every slot
  if (selective) a.take_f32(att);
  for (int i = 0; i < s.chunks * s.slots; ++i) {
    const bool head = s.last_stage && i / s.slots == s.chunks - 1;
    a.take_i32(N);  // inputs
    a.take_i32(N);  // targets
    act(R * C);     // x
    for (int b = 0; b < s.blocks_per_chunk; ++b) {
      if (full)
        act(R * C);
      else block(!selective, true);
    }
    if (head) {
      act(R * C);  // lnf
      a.take_f32(R);
      a.take_f32(R);
      act(N * s.vocab_local);  // logits
      a.take_f32(N);           // losses
      a.take_f32(N);           // row_max
      a.take_f32(2 * N);       // row_sums
    }
  }
  if (sp) act(N * C), act(N * C);  // full_, partial_
  act(R * C);                      // dres_
  if (sp) act(R * C);              // dchunk_
  act(N * C);                      // dbtc_
  act(N * QKV);                    // dqkv_
  act(N * s.d_ff_local);           // dfch_gelu_
  act(N * s.d_ff_local);           // dfch_
  return int64_t(a.used());
}

ArenaShape arena_shape(const Config& cfg, const ParamTable& table, int stage, bool device) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& par = cfg.parallel;
  const StageSpec spec = stage_spec(cfg, stage);
  ArenaShape a{cfg.train.micro_batch, m.seq_len,         m.d_model,
               m.d_model / m.heads,   table.heads_local, table.kv_heads_local,
               table.d_ff_local,      table.vocab_local};
  a.tp = par.tp;
  a.sequence_parallel = par.sequence_parallel;
  a.chunks = spec.chunks;
  a.blocks_per_chunk = int(table.blocks.size()) / spec.chunks;
  a.slots = pipeline_slots(par.schedule, par.pp, stage, cfg.micro_batches_per_step(), spec.chunks);
  a.first_stage = spec.first;
  a.last_stage = spec.last;
  a.recompute = cfg.train.recompute;
  a.attention_state_per_row = device;
  a.act_bytes = cfg.system.precision == "bf16" ? 2 : 4;
  return a;
}

double widening_arena_bytes(const ArenaShape& s, Widening w) {
  if (w == Widening::none) return 0.0;
  const int64_t N = int64_t(s.micro_batch) * s.seq_len;
  const bool sp = s.sequence_parallel && s.tp > 1;
  const int64_t R = sp ? N / s.tp : N, C = s.d_model, T = s.seq_len;
  const int64_t QKV = int64_t(s.heads_local + 2 * s.kv_heads_local) * s.head_dim;
  const int64_t A = int64_t(s.heads_local) * s.head_dim, F = s.d_ff_local, V = s.vocab_local;
  double most = 0;
  // One widened call: its distinct bf16 tensors' fp32 copies, each 64-byte aligned
  // (backend_bf16.cpp). `attention`: the call is attention's (widened on a GPU too).
  auto call = [&](std::initializer_list<int64_t> tensors, bool attention = false) {
    if (w == Widening::attention && !attention) return;
    double bytes = 0;
    for (int64_t n : tensors) bytes += double((std::max<int64_t>(n, 1) * 4 + 63) / 64 * 64);
    most = std::max(most, bytes);
  };
  if (s.blocks_per_chunk > 0) {
    // forward (and full recomputation): lib/model/gpt.cpp, block_forward
    call({R * C, R * C, C, C});             // layer norm 1: ln1, x, weight, bias
    call({N * QKV, N * C, QKV * C, QKV});   // qkv
    call({N * A, N * QKV}, true);           // attention
    if (s.tp == 1) {  // each half's residual added by its projection
      call({N * C, N * C, N * A, C * A, C});  // res2 = x + projection
      call({R * C, R * C, C, C});             // layer norm 2
      call({N * F, N * F, N * C, F * C, F});  // fc and GELU
      call({N * C, N * C, N * F, C * F, C});  // res3 = res2 + fc projection
    } else {
      call({N * C, N * A, C * A, C});         // projection
      call({R * C, R * C, R * C, C, C});      // residual + layer norm 2 (res2 in place of the sum)
      call({N * F, N * F, N * C, F * C, F});  // fc and GELU
      call({N * C, N * F, C * F, C});         // fc projection
      call({R * C, R * C});                   // res3 = sum + res2 (in place)
    }
    // backward: block_backward
    call({N * F, N * F, N * C, N * F, N * F, C * F});  // fc projection through the GELU
    call({N * C, N * F, N * C, F * C});                // fc
    call({R * C, R * C, R * C, C});                    // layer norm backward
    call({N * A, N * C, N * A, C * A});                // projection
    call({N * QKV, N * A, N * QKV, N * A}, true);      // attention
    call({N * C, N * QKV, N * C, QKV * C});            // qkv
  }
  if (s.first_stage) {
    call({N * C, V * C});  // token embedding
    call({R * C, T * C});  // positions
    call({R * C});         // their backward
    call({N * C});
  }
  if (s.last_stage) {
    call({R * C, R * C, C, C});          // final layer norm
    call({N * V, N * C, V * C});         // LM head
    call({N * V});                       // cross-entropy
    call({N * C, N * V, N * C, V * C});  // LM head backward
    call({R * C, R * C, R * C, C});      // final layer norm backward
  }
  return most;
}

// ---------------------------------------------------------------------------------------------
// one rank

namespace {

/// ZeRO's gradient buckets (lib/parallel/zero.cpp, build_buckets): runs of whole units in backward
/// order holding at least bucket_mb, never mixing two model chunks. Returns their sizes
/// (elements), the embeddings' bucket (the one holding unit 0) first.
std::vector<int64_t> bucket_sizes(const ParamTable& t, double bucket_mb) {
  const int64_t target = std::max<int64_t>(1, int64_t(bucket_mb * 1024 * 1024 / sizeof(float)));
  std::vector<int64_t> sizes;
  int last = int(t.units.size()) - 1;
  while (last >= 0) {
    int first = last;
    while (first > 0 && t.units[last].end - t.units[first].begin < target &&
           t.unit_chunk[first - 1] == t.unit_chunk[last])
      --first;
    sizes.insert(sizes.begin(), t.units[last].end - t.units[first].begin);
    last = first - 1;
  }
  return sizes;
}

struct ElementBytes {
  double param, grad, optim;  // optim: every optimizer value kept per parameter, together
};

std::string n_elems(double n) {
  if (n >= 1e9) return strfmt("%.2fG", n / 1e9);
  if (n >= 1e6) return strfmt("%.2fM", n / 1e6);
  if (n >= 1e4) return strfmt("%.1fK", n / 1e3);
  return strfmt("%.0f", n);
}

}  // namespace

const ParamTable& ParamTableCache::get(const ModelConfig& m, int tp, const StageSpec& spec) {
  const Key key{tp, spec.first_layer, spec.end_layer, spec.first, spec.last, spec.chunks, spec.chunk_stride};
  auto& slot = tables_[key];
  if (!slot) slot = std::make_unique<ParamTable>(m, tp, 0, spec);
  return *slot;
}

/// The host threads a CPU rank takes where system.threads is 0 (backend.cpp, default_cpu_threads):
/// where the environment sets a BLAS thread count, OpenBLAS's — the first positive of
/// OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS and OMP_NUM_THREADS, at most the cores (none: all of
/// them) —, else the node's cores shared among its ranks.
static int blas_threads(int ranks_on_node) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  bool set = false;
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* v = std::getenv(var);
    if (!v || !*v) continue;
    set = true;
    if (std::atoi(v) > 0) return std::min(std::atoi(v), cores);
  }
  return set ? cores : std::max(1, cores / std::max(1, ranks_on_node));
}

MemoryOptions run_memory_options(const Config& cfg, int ranks_on_node) {
  MemoryOptions opt;
  opt.precision = parse_precision(cfg.system.precision);
  opt.device = cfg.system.backend == "cuda";
  // The CUDA backend's switches, read as it reads them.
  const CudaSwitches cuda = cuda_switches();
  opt.tc_attention = cuda.tc_attention != 0;
  opt.cudnn_attention = cuda.tc_attention < 0 && cuda.cudnn;  // (the checked default only)
  opt.cudnn_deterministic = cuda.cudnn_deterministic;
  opt.gelu_epilogue = cuda.gelu_epilogue;
  opt.threads = cfg.system.threads > 0 ? cfg.system.threads : blas_threads(ranks_on_node);
  return opt;
}

MemoryOptions run_memory_options(const Config& cfg, const Backend& backend) {
  MemoryOptions opt = run_memory_options(cfg);
  opt.threads = backend.threads();
  if (backend.multiprocessors() > 0) opt.sm_count = backend.multiprocessors();
  // Whether its bf16 attention is on the tensor cores, as the backend decided (its check).
  if (opt.device && opt.precision == Precision::BF16 && cfg.model.heads > 0) {
    const int hd = cfg.model.d_model / cfg.model.heads;
    opt.tc_attention = backend.widened_calls(hd) == Widening::none;
    opt.cudnn_attention = backend.library_attention(hd);
  }
  return opt;
}

RankMemory rank_memory(const Config& cfg, int stage, const MemoryOptions& opt) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& par = cfg.parallel;
  const bool textbook = opt.precision == Precision::BF16_FULL;  // the papers' full bf16 run
  const bool bf16 = opt.precision == Precision::BF16;           // this code's bf16 (zero.hpp)
  const bool device = opt.device || textbook;                   // a GPU run
  const ElementBytes eb = textbook ? ElementBytes{2, 2, 12}
                          : bf16   ? ElementBytes{2, 4, 12}
                                   : ElementBytes{4, 4, 8};
  // (over dp 1 every ZeRO stage runs as stage 0: parallel/zero.hpp)
  const int dp = par.dp, tp = par.tp, pp = par.pp, zero = dp > 1 ? par.zero : 0;
  const StageSpec spec = stage_spec(cfg, stage);
  // Tensor-parallel rank 0: every tp rank holds as much (the vocabulary is padded to a multiple).
  std::unique_ptr<ParamTable> own;
  if (!opt.tables) own = std::make_unique<ParamTable>(m, tp, 0, spec);
  const ParamTable& table = opt.tables ? opt.tables->get(m, tp, spec) : *own;
  const int64_t P = table.total();
  const int64_t S = (P + dp - 1) / dp;  // dp rank 0's shard: the largest (comm/comm.cpp shard_range)
  const int micro_batches = cfg.micro_batches_per_step();
  const int chunks = spec.chunks;
  const int slots = pipeline_slots(par.schedule, pp, stage, micro_batches, chunks);
  const bool sp = par.sequence_parallel && tp > 1;
  const int64_t N = int64_t(cfg.train.micro_batch) * m.seq_len;
  const int64_t R = sp ? N / tp : N, C = m.d_model;
  const int64_t head = int64_t(table.vocab_local) * C;  // the tied LM head on this tp rank
  const bool head_copy = spec.last && !spec.first;       // pipeline.cpp keeps its own wte copy

  RankMemory r;
  r.stage = stage;
  r.stage_params = P;
  const std::string psi = "Ψ_rank = " + n_elems(double(P)) + " parameters";

  // ---- parameters ----
  if (zero == 0 || (zero < 3 && dp * S == P)) {
    r.params = {eb.param * P, strfmt("%g B x %s", eb.param, psi.c_str())};
  } else if (zero < 3) {
    // Padded to dp shards of S, for an all-gather of equal blocks (parallel/zero.hpp).
    r.params = {eb.param * double(dp * S),
                strfmt("%g B x %s, padded to dp x %s", eb.param, psi.c_str(), n_elems(S).c_str())};
  } else {
    // Stage 3 gathers a unit just before use and prefetches the next: the largest pair of
    // neighbours in the walk of one model chunk (model/gpt.cpp prefetches no other chunk's
    // block: with one block a chunk, a middle stage holds one unit at a time), or with the
    // embeddings and the final LayerNorm, which meet at the tied LM head.
    int64_t pair = 0;
    const auto& u = table.units;
    const auto size = [&](size_t i) { return u[i].end - u[i].begin; };
    for (size_t i = 0; i < u.size(); ++i) {
      pair = std::max(pair, size(i));
      if (i + 1 < u.size() && table.unit_chunk[i] == table.unit_chunk[i + 1])
        pair = std::max(pair, size(i) + size(i + 1));
    }
    if (spec.first && spec.last && u.size() > 1) pair = std::max(pair, size(0) + size(u.size() - 1));
    r.params = {eb.param * (S + pair),
                strfmt("%g B x (Ψ_rank/dp = %s + 2 gathered units %s)", eb.param, n_elems(S).c_str(),
                       n_elems(pair).c_str())};
  }
  if (head_copy) {
    r.params.bytes += eb.param * head;
    r.params.how += strfmt(" + LM-head copy %s", n_elems(head).c_str());
  }

  // ---- gradients, ZeRO's reduction buffers ----
  const std::vector<int64_t> buckets = bucket_sizes(table, par.bucket_mb);
  double comm_bytes = 0;
  std::string comm_how;
  if (zero < 2) {
    r.grads = {eb.grad * P, strfmt("%g B x Ψ_rank", eb.grad)};
    if (zero == 1) {
      // Each bucket's reduce-scatter (run even over one rank) receives its part of this rank's
      // shard into a buffer freed when it completes: at most the whole shard.
      comm_bytes += eb.grad * S;
      comm_how = strfmt("reduce-scatter receive %g B x Ψ_rank/dp", eb.grad);
    }
  } else {
    // A bucket's full gradient lives while it fills and reduces; zero.cpp lets one reduce while
    // the next fills, and the embeddings' bucket stays open through the whole backward.
    int64_t alive = 0;
    std::vector<int64_t> others(buckets.begin() + (spec.first ? 1 : 0), buckets.end());
    std::sort(others.rbegin(), others.rend());
    for (size_t i = 0; i < others.size() && i < 2; ++i) alive += others[i];
    if (spec.first) alive += buckets.front();
    const int n_alive = int(std::min<size_t>(others.size(), 2)) + (spec.first ? 1 : 0);
    r.grads = {eb.grad * (S + alive),
               strfmt("%g B x (Ψ_rank/dp + %d bucket(s) alive %s; %zu bucket(s) of %g MB)", eb.grad,
                      n_alive, n_elems(alive).c_str(), buckets.size(), par.bucket_mb)};
    // The alive buckets' reduce-scatters receive their parts of this rank's shard.
    const double recv = std::min<double>(double(S), double(alive));
    comm_bytes += eb.grad * recv;
    comm_how = strfmt("reduce-scatter receive %s", n_elems(recv).c_str());
  }
  if (head_copy) {
    r.grads.bytes += eb.grad * head;
    r.grads.how += " + LM-head copy";
  }

  // ---- optimizer ----
  r.optim = {eb.optim * (zero >= 1 ? S : P),
             strfmt(textbook || bf16 ? "%g B x %s (fp32 master weights, AdamW m, v)"
                                     : "%g B x %s (AdamW m, v)",
                    eb.optim, zero >= 1 ? "Ψ_rank/dp" : "Ψ_rank")};

  // ---- activations ----
  const int blocks_per_chunk = int(table.blocks.size()) / chunks;
  ArenaShape a = arena_shape(cfg, table, stage, device);
  a.act_bytes = bf16 ? 2 : 4;
  if (!textbook) {
    r.activations.bytes = double(activation_arena_bytes(a));
    ArenaShape one_slot = a, two_slots = a;
    one_slot.slots = 1;
    two_slots.slots = 2;
    const double one = double(activation_arena_bytes(two_slots)) -  // what each slot adds
                       double(activation_arena_bytes(one_slot));
    r.activations.how = strfmt(
        "%d layer(s) x %d chunk(s) x %d micro-batch(es) in flight (%s), "
        "B=%d T=%d%s%s%s; %s per micro-batch in flight",
        blocks_per_chunk, chunks, slots, par.schedule.c_str(), cfg.train.micro_batch, m.seq_len,
        sp ? ", SP" : "",
        cfg.train.recompute != "none" ? (", recompute " + cfg.train.recompute).c_str() : "",
        bf16 ? ", bf16" : "", format_bytes(one).c_str());
  } else {
    const double layer = megatron_layer_activation_bytes(m.seq_len, cfg.train.micro_batch, m, tp, sp,
                                                         cfg.train.recompute);
    double bytes = layer * blocks_per_chunk * chunks * slots;
    // Around the blocks: the embeddings' dropout mask (first stage); the final LayerNorm's input
    // and the fp32 logits the cross-entropy keeps (last stage).
    if (spec.first) bytes += double(slots) * R * C;
    if (spec.last) bytes += 2.0 * R * C + 4.0 * N * table.vocab_local;
    r.activations = {bytes, strfmt("%d layer(s) x %d chunk(s) x %d micro-batch(es) in flight (%s) x "
                                   "%s per layer (Megatron, B=%d T=%d t=%d%s%s)",
                                   blocks_per_chunk, chunks, slots, par.schedule.c_str(),
                                   format_bytes(layer).c_str(), cfg.train.micro_batch, m.seq_len, tp,
                                   sp ? " SP" : "",
                                   cfg.train.recompute != "none" ? (" recompute " + cfg.train.recompute).c_str() : "")};
  }

  // ---- pipeline message buffers ----
  if (pp > 1) {
    // pipeline.cpp: a stage other than the first keeps one buffer per slot for the gradients it
    // sends back (interleaved: per chunk that is not the first model chunk); the first stage
    // receives the LM head's gradient into a (Vl, C) buffer.
    const int sending_chunks = chunks - (spec.first ? 1 : 0);
    const int buffers = sending_chunks * std::min(slots, micro_batches);
    const double act = textbook || bf16 ? 2.0 : 4.0;
    if (buffers > 0) {
      comm_bytes += act * buffers * R * C;
      comm_how += std::string(comm_how.empty() ? "" : "; ") +
                  strfmt("%d gradient send buffer(s) of (R, C)", buffers);
    }
    if (spec.first && !spec.last) {
      comm_bytes += eb.grad * head;
      comm_how += std::string(comm_how.empty() ? "" : "; ") + "LM-head gradient from the last stage";
    }
  }
  r.comm = {comm_bytes, comm_how.empty() ? "none" : comm_how};

  // ---- workspace ----
  // A bf16 run's widening arena (backend.hpp, Widened): every kernel on the CPU; on a GPU the
  // attention unless the tensor-core kernels take its head size.
  // cuDNN takes head sizes that are multiples of 8 up to 128; the mma.sync kernels 32, 64, 128.
  const int hd = m.d_model / m.heads;
  const bool cudnn_takes = opt.cudnn_attention && hd % 8 == 0 && hd <= 128;
  const bool mma_takes = opt.tc_attention && (hd == 32 || hd == 64 || hd == 128);
  const Widening widening = !bf16                      ? Widening::none
                            : !device                  ? Widening::all
                            : cudnn_takes || mma_takes ? Widening::none
                                                       : Widening::attention;
  const double widened = widening_arena_bytes(a, widening);
  const std::string widened_how =
      widened > 0
          ? strfmt(", widening arena %s (bf16 %s widened to fp32)", format_bytes(widened).c_str(),
                   widening == Widening::all ? "kernels" : "attention")
          : std::string();
  if (device && !textbook) {
    // cuBLASLt's, and the backend's scratch grown to its largest use: the attention backward's
    // Σ dout·out per row (B,H,T) (cuda_attention.cu); the layer norm backward's partial sums, 2·C
    // per chunk of rows of the R this rank holds (cuda_layernorm.cu: chunks of
    // layernorm_backward_chunk_rows where a lane's registers take a row, C ≤ 256·W with W values
    // a 16-byte load, else of 256 rows); the gradient norm's 512 partial sums in fp64
    // (cuda_loss_optim.cu); and, in bf16 with the GELU kept out of the GEMM's epilogue
    // (TRELLIS_GELU_EPILOGUE=0), the MLP GEMM's fp32 output (N, d_ff) (cuda_linear.cu); on the
    // first stage the embedding gradient's sort of the positions by token (cuda_embedding.cu).
    // On cuDNN the attention backward's are its dQ accumulator (B,H,T,hd) and Σ dout·out
    // (B,H,T) in fp32 (cudnn_attention.cu; the engine's own workspace, unknown here, comes on
    // top); with its deterministic backward (TRELLIS_CUDNN_DETERMINISTIC=1) no accumulator, but
    // the engine keeps dP in its workspace: 2 bytes × (B,H) × T² with T rounded up to 64, the size
    // cuDNN's frontend gives it.
    const double rows = double(cfg.train.micro_batch) * table.heads_local * m.seq_len;
    const bool cudnn = bf16 && cudnn_takes;
    const double padded_T = double((m.seq_len + 63) / 64 * 64);
    const double attention =
        !cudnn                  ? 4.0 * rows
        : opt.cudnn_deterministic ? 4.0 * rows + 2.0 * cfg.train.micro_batch * table.heads_local *
                                                   padded_T * padded_T
                                : 4.0 * rows * (hd + 1);
    const int lane_values = C % (bf16 ? 8 : 4) == 0 ? (bf16 ? 8 : 4) : 1;
    const int64_t ln_rows =
        C <= 256 * lane_values ? layernorm_backward_chunk_rows(R, opt.sm_count) : 256;
    const double layernorm = 4.0 * ((R + ln_rows - 1) / ln_rows) * 2 * C;
    const double gelu = bf16 && !opt.gelu_epilogue ? 4.0 * N * table.d_ff_local : 0.0;
    const double embedding =
        spec.first ? 4.0 * double(embedding_sort_scratch_ints(N, table.vocab_local)) : 0.0;
    const double scratch = std::max({attention, layernorm, 8.0 * 512, gelu, embedding});
    const char* largest = scratch == gelu        ? "MLP GEMM fp32 output"
                          : scratch == attention ? (cudnn ? "cuDNN attention backward"
                                                          : "attention backward")
                          : scratch == layernorm ? "layer norm backward"
                          : scratch == embedding ? "embedding gradient's sort by token"
                                                 : "gradient norm partial sums";
    r.workspace = {
        opt.workspace_bytes + scratch + widened,
        strfmt("cuBLASLt workspace %s, scratch %s (%s)", format_bytes(opt.workspace_bytes).c_str(),
               format_bytes(scratch).c_str(), largest) +
            widened_how};
  } else if (!textbook) {
    // The CPU backend's scratch, grown to the larger of its two uses: the attention backward's
    // (T, T) dP / dS per thread (cpu_gemm.cpp) and the layer norm backward's partial sums, 2·C
    // per 64 rows (cpu_elementwise.cpp).
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(int64_t(cfg.train.micro_batch) * table.kv_heads_local, opt.threads));
    const double attention = 4.0 * parts * m.seq_len * m.seq_len;
    const double layernorm = 4.0 * ((R + 63) / 64) * 2 * C;
    r.workspace = {
        std::max(attention, layernorm) + widened,
        strfmt("attention / layer norm backward scratch, %lld thread(s)", (long long)parts) +
            widened_how};
  } else {
    r.workspace = {opt.workspace_bytes, "cuBLASLt workspace"};
  }
  return r;
}

std::vector<RankMemory> layout_memory(const Config& cfg, const MemoryOptions& opt) {
  std::vector<RankMemory> out;
  for (int s = 0; s < cfg.parallel.pp; ++s) out.push_back(rank_memory(cfg, s, opt));
  return out;
}

const RankMemory& largest(const std::vector<RankMemory>& stages) {
  TRELLIS_CHECK(!stages.empty(), "no stages");
  return *std::max_element(stages.begin(), stages.end(),
                           [](const RankMemory& a, const RankMemory& b) { return a.total() < b.total(); });
}

}  // namespace trellis
