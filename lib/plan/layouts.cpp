#include "plan/layouts.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "core/log.hpp"
#include "model/params.hpp"
#include "parallel/schedule.hpp"
#include "plan/flops.hpp"

namespace trellis {

namespace {

int chunks_of(const ParallelConfig& p) { return p.schedule == "interleaved" ? p.virtual_stages : 1; }

int group_size(const ParallelConfig& p, const std::string& g) {
  return g == "tp" ? p.tp : g == "dp" ? p.dp : p.pp;
}

/// A ring collective over a group: the link it uses and its cost.
struct Link {
  int size = 1;
  double bw = 1, latency = 0;
  /// All-reduce of n bytes: reduce-scatter then all-gather.
  double all_reduce(double n) const { return size > 1 ? 2 * ((size - 1.0) / size * n / bw + (size - 1) * latency) : 0; }
  /// Reduce-scatter or all-gather of n bytes in all.
  double half(double n) const { return size > 1 ? (size - 1.0) / size * n / bw + (size - 1) * latency : 0; }
  /// ZeRO's gradient buckets and stage 3's units, n bytes in all: each a run of whole layers,
  /// reduced onto (gathered from) the few ranks whose contiguous shards it covers — for most, one
  /// rank: a reduce (broadcast) whose ring carries all of it on every link (comm/nccl_link.hpp),
  /// so n/β over the step instead of an even reduce-scatter's (g−1)/g·n/β.
  double to_owners(double n) const { return size > 1 ? n / bw + (size - 1) * latency : 0; }
  double p2p(double n) const { return n / bw + latency; }
};

Link link_of(const ParallelConfig& p, const std::string& group, const DeviceModel& dev) {
  const bool inside = group_inside_node(p.order, p, group, dev.per_node);
  return {group_size(p, group), inside ? dev.intra_bw : dev.inter_bw,
          inside ? dev.intra_latency : dev.inter_latency};
}

/// Training FLOPs per token of one block (flops.hpp's convention: 6 per matmul weight, 12·T·C for
/// attention) and of the LM head.
double block_flops_per_token(const ModelConfig& m) {
  const double C = m.d_model, F = m.d_ff, hd = double(m.d_model) / m.heads;
  const double qkv = (m.heads + 2.0 * m.kv_heads) * hd;
  return 6.0 * (C * qkv + m.heads * hd * C + 2 * C * F) + 12.0 * m.seq_len * m.heads * hd;
}

/// What recomputation adds per token and block: the forward again (full), or the attention
/// scores and their product with V (selective).
double recompute_flops_per_token(const ModelConfig& m, const std::string& recompute) {
  if (recompute == "full") return block_flops_per_token(m) / 3.0;
  if (recompute == "selective") return 4.0 * m.seq_len * m.d_model;
  return 0;
}

std::string pct(double x) { return strfmt("%.0f%%", 100 * x); }

}  // namespace

bool group_inside_node(const std::string& order, const ParallelConfig& p, const std::string& group,
                       int per_node) {
  std::vector<std::string> names;
  std::stringstream ss(order);
  for (std::string g; std::getline(ss, g, '-');) names.push_back(g);
  if (names.size() != 3) names = {"tp", "dp", "pp"};
  int64_t stride = 1;
  for (const std::string& g : names) {
    if (g == group) break;
    stride *= group_size(p, g);
  }
  const int64_t span = stride * group_size(p, group);
  return group_size(p, group) == 1 || (span <= per_node && per_node % span == 0);
}

StepTime estimate_step_time(const Config& cfg, Precision precision, const DeviceModel& dev) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& p = cfg.parallel;
  const int B = cfg.train.micro_batch, T = m.seq_len, mbs = cfg.micro_batches_per_step();
  const int v = chunks_of(p);
  const double tokens = double(B) * T;  // per micro-batch
  // Bytes of an activation and a parameter on the wire: 2 in bf16; gradients travel as they are
  // kept, fp32 in this code's bf16 (system.grad_reduce = bf16 would halve them).
  const double act = precision == Precision::FP32 ? 4.0 : 2.0;
  const double param = act, grad = precision == Precision::BF16_FULL ? 2.0 : 4.0;
  const bool sp = p.sequence_parallel && p.tp > 1;

  // The slowest stage: the most blocks, plus the LM head on the last.
  const double per_block = block_flops_per_token(m) + recompute_flops_per_token(m, cfg.train.recompute);
  const double head = 6.0 * m.vocab * m.d_model;
  double stage_flops = 0;
  int stage_blocks = 0;
  for (int s = 0; s < p.pp; ++s) {
    const int blocks = v > 1 ? m.layers / p.pp : stage_layers(m, p, s).end - stage_layers(m, p, s).first;
    const double f = blocks * per_block + (s == p.pp - 1 ? head : 0);
    if (f > stage_flops) stage_flops = f, stage_blocks = blocks;
  }
  StepTime t;
  const double compute_mb = stage_flops * tokens / p.tp / (dev.peak_flops * dev.efficiency);

  // Tensor parallelism: 4 collectives of (B·T, C) per block (6 with full recomputation), plus the
  // embedding's sum and the LM head's input gradient.
  const Link tp = link_of(p, "tp", dev);
  const double rows_bytes = tokens * m.d_model * act;
  const int per_block_ops = cfg.train.recompute == "full" ? 6 : 4;
  const double tp_mb = (per_block_ops * stage_blocks + 2) * tp.all_reduce(rows_bytes);

  // Pipeline: each chunk's activation forward and its gradient back, per micro-batch.
  const Link pp = link_of(p, "pp", dev);
  const double pp_mb = p.pp > 1 ? 2.0 * v * pp.p2p(rows_bytes / (sp ? p.tp : 1)) : 0;

  // Launches and tails: per layer of the stage and its LM head or embedding, per micro-batch.
  const double overhead_mb = (stage_blocks + 1) * dev.layer_overhead;

  const double mb_time = compute_mb + overhead_mb + tp_mb + pp_mb;
  t.compute = compute_mb * mbs;
  t.overhead = overhead_mb * mbs;
  t.tp = tp_mb * mbs;
  t.pp = pp_mb * mbs;
  t.bubble = mb_time * (p.pp - 1) / double(v);

  // Data parallelism: the stage's parameters, per rank (tp-sharded).
  const Link dp = link_of(p, "dp", dev);
  const double psi = double(model_parameter_count(m)) / (p.tp * p.pp);
  const double backward_mb = compute_mb * 2.0 / 3.0;
  auto exposed = [](double comm, double hidden_behind) { return std::max(0.0, comm - hidden_behind); };
  // Stages 1-2: the updated parameters all-gathered after the step — with overlap, bucket by
  // bucket (a broadcast each, its latency each) behind the next step's first forward
  // (parallel/zero.hpp). That forward waits for the first bucket (at most the embeddings and a
  // bucket's worth of layers) and for the last (the last layers' and the final LayerNorm's),
  // which only the blocks before the last bucket's can hide — not the head, not recomputation.
  const double bucket = p.bucket_mb * 1024 * 1024 / sizeof(float);
  const double embeddings = (double(vocab_rows_per_rank(m, p.tp)) + m.seq_len) * m.d_model;
  const double first_bucket = std::min(psi, embeddings + bucket);
  // (a block's matmul weights on this tp rank: block_flops_per_token's 6 per weight, less attention)
  const double block_weights = (block_flops_per_token(m) - 12.0 * m.seq_len * m.d_model) / 6 / p.tp;
  const int last_bucket_blocks = std::min(stage_blocks, int(std::ceil(bucket / block_weights)));
  const int buckets = 1 + (stage_blocks + last_bucket_blocks - 1) / std::max(1, last_bucket_blocks);
  const double forward_before_last = double(stage_blocks - last_bucket_blocks) *
                                     block_flops_per_token(m) / 3.0 * tokens / p.tp /
                                     (dev.peak_flops * dev.efficiency);
  const double all_buckets = dp.to_owners(psi * param) + (buckets - 1) * (p.dp - 1) * dp.latency;
  const double param_gather =
      p.overlap_param_gather
          ? std::max(dp.to_owners(first_bucket * param), all_buckets - forward_before_last)
          : dp.half(psi * param);
  if (p.dp > 1) {
    switch (p.zero) {
      case 0: t.dp = exposed(dp.all_reduce(psi * grad), backward_mb); break;
      case 1: t.dp = exposed(dp.to_owners(psi * grad), backward_mb) + param_gather; break;
      case 2: t.dp = mbs * exposed(dp.to_owners(psi * grad), backward_mb) + param_gather; break;
      default:
        t.dp = mbs * exposed(dp.to_owners(psi * grad) + 2 * dp.to_owners(psi * param),
                             compute_mb);
    }
  }
  return t;
}

std::string LayoutPlan::overrides() const {
  const ParallelConfig& p = cfg.parallel;
  // Every key the layout sets, its defaults too: the deck (or the command line) may say
  // otherwise, and the run must be the one planned.
  std::string s = strfmt("--parallel.dp=%d --parallel.tp=%d --parallel.pp=%d --parallel.zero=%d "
                         "--train.micro_batch=%d --train.recompute=%s "
                         "--parallel.sequence_parallel=%s",
                         p.dp, p.tp, p.pp, p.zero, cfg.train.micro_batch,
                         cfg.train.recompute.c_str(), p.sequence_parallel ? "true" : "false");
  if (p.pp > 1 || schedule_fallback) s += " --parallel.schedule=" + p.schedule;
  if (p.schedule == "interleaved") s += strfmt(" --parallel.virtual_stages=%d", p.virtual_stages);
  else if (schedule_fallback)
    s += " --parallel.virtual_stages=1";
  if (stage_layers_cleared) s += " --parallel.stage_layers=";
  if ((p.zero == 1 || p.zero == 2) && p.dp > 1)
    s += strfmt(" --parallel.overlap_param_gather=%s", p.overlap_param_gather ? "true" : "false");
  return s;
}

LayoutPlan evaluate_layout(const Config& cfg, const PlanRequest& req, bool fits_one_device) {
  LayoutPlan L;
  L.cfg = cfg;
  MemoryOptions mo = req.memory;
  mo.precision = req.precision;
  L.memory = largest(layout_memory(cfg, mo));
  const DeviceModel& dev = req.device;
  L.fits = L.memory.total() <= dev.usable();
  L.time = estimate_step_time(cfg, req.precision, dev);
  if ((cfg.parallel.zero == 1 || cfg.parallel.zero == 2) && cfg.parallel.dp > 1) {
    // The parameters' gathers after the step: bucket by bucket behind the next forward, or one
    // all-gather of (N − 1)/N of their bytes at the step's end — whichever the estimate finds
    // faster (the latter where the forward is too short to hide the former).
    Config other = cfg;
    other.parallel.overlap_param_gather = !cfg.parallel.overlap_param_gather;
    const StepTime t = estimate_step_time(other, req.precision, dev);
    if (t.total() < L.time.total()) L.cfg = other, L.time = t;
  }
  const double step_tokens = double(cfg.train.global_batch) * cfg.model.seq_len;
  L.tokens_per_s = step_tokens / L.time.total();
  L.mfu = train_flops_per_token(cfg.model) * L.tokens_per_s /
          (double(cfg.parallel.dp) * cfg.parallel.tp * cfg.parallel.pp * dev.peak_flops);

  // One line: the first rule that applies, in the order of the seed documents' table.
  const ParallelConfig& p = cfg.parallel;
  const int mbs = cfg.micro_batches_per_step();
  const double bubble = L.time.bubble / L.time.total();
  const bool tp_inside = group_inside_node(p.order, p, "tp", dev.per_node);
  const bool pp_inside = group_inside_node(p.order, p, "pp", dev.per_node);
  std::string a;
  if (!L.fits) {
    a = strfmt("does not fit: %s > %s usable; ", format_bytes(L.memory.total()).c_str(),
               format_bytes(dev.usable()).c_str());
    const double act = L.memory.activations.bytes, states = L.memory.params.bytes +
                                                            L.memory.grads.bytes + L.memory.optim.bytes;
    if (act > states) a += cfg.train.recompute == "full" ? "activations dominate: smaller micro-batches, more tp (with SP) or pp"
                                                         : "activations dominate: recompute, or more tp (with SP)";
    else a += p.zero < 3 && p.dp > 1 ? "model states dominate: a higher ZeRO stage, tp inside the node, pp across nodes"
                                      : "model states dominate: tp inside the node, pp across nodes";
  } else if (fits_one_device && (p.tp > 1 || p.pp > 1)) {
    a = "the model fits one device: plain data parallelism needs no tp/pp traffic (seed table)";
  } else if (fits_one_device && p.zero > 0) {
    // (Not "saves memory": on a small model ZeRO-2's gradient buckets outweigh its shards — the
    // mem/rank column says which layout holds less.)
    a = strfmt("fits without sharding; ZeRO-%d shards the model states at the cost of %s", p.zero,
               p.zero >= 2 ? "a reduction per micro-batch" : "an all-gather per step");
  } else if (!tp_inside) {
    a = "tp crosses nodes: keep tensor parallelism inside a node (NVLink), pipeline across nodes";
  } else if (bubble > 0.2) {
    a = strfmt("pipeline bubble %s with %d micro-batches: more of them (smaller micro_batch)%s",
               pct(bubble).c_str(), mbs, p.schedule == "interleaved" ? "" : " or interleaved");
  } else if (L.time.comm_share() > 0.4) {
    a = strfmt("communication is %s of the step: fewer devices per group may be as fast — measure",
               pct(L.time.comm_share()).c_str());
  } else if (fits_one_device) {
    a = "data parallel: each device a full replica, gradients reduced during backward (seed table)";
  } else if (p.pp > 1 && pp_inside && p.tp < dev.per_node) {
    a = "pp inside a node: tp would use the NVLink better, pipeline across nodes (seed 3-D)";
  } else {
    std::vector<std::string> parts;
    if (p.zero > 0) parts.push_back(strfmt("ZeRO-%d over dp %d", p.zero, p.dp));
    if (p.tp > 1) parts.push_back(strfmt("tp %d inside the node", p.tp));
    if (p.pp > 1) parts.push_back(strfmt("pp %d across nodes, bubble %s", p.pp, pct(bubble).c_str()));
    if (cfg.train.recompute != "none") parts.push_back(cfg.train.recompute + " recomputation");
    a = parts.empty() ? "data parallel" : "";
    for (size_t i = 0; i < parts.size(); ++i) a += (i ? ", " : "") + parts[i];
    a += " (seed 3-D parallelism)";
  }
  L.advice = a;
  return L;
}

LayoutSearch search_layouts(const PlanRequest& req_in) {
  LayoutSearch out;
  PlanRequest req = req_in;
  ParamTableCache tables;
  req.memory.tables = &tables;
  const int N = req.devices;
  // Does the model fit one device with plain data parallelism (the deck's micro-batch, ZeRO 0)?
  {
    std::vector<std::string> o = req.overrides;
    for (const char* k : {"--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=1", "--parallel.zero=0",
                          "--parallel.stage_layers=", "--parallel.sequence_parallel=false",
                          "--parallel.schedule=1f1b", "--parallel.virtual_stages=1"})
      o.push_back(k);
    try {
      const Config one = load_config(req.deck, o, 1, false);
      MemoryOptions mo = req.memory;
      mo.precision = req.precision;
      out.fits_one_device = largest(layout_memory(one, mo)).total() <= req.device.usable();
    } catch (const UserError&) {
      out.fits_one_device = false;  // e.g. a global batch the deck's micro-batch does not divide
    }
  }

  const Config deck = load_config(req.deck, req.overrides, 0, false);
  for (int tp = 1; tp <= N; ++tp) {
    if (N % tp) continue;
    for (int pp = 1; pp <= N / tp; ++pp) {
      if ((N / tp) % pp) continue;
      const int dp = N / (tp * pp);
      // Micro-batch sizes: the powers of two and the deck's own that divide a dp rank's share.
      const int share = deck.train.global_batch % dp == 0 ? deck.train.global_batch / dp : 0;
      std::vector<int> sizes;
      for (int mb = 1; share > 0 && mb <= share; mb *= 2)
        if (share % mb == 0) sizes.push_back(mb);
      if (share > 0 && share % deck.train.micro_batch == 0 &&
          std::find(sizes.begin(), sizes.end(), deck.train.micro_batch) == sizes.end())
        sizes.push_back(deck.train.micro_batch);
      if (sizes.empty()) {
        ++out.rejected;  // the global batch does not split over dp
        continue;
      }
      // The deck's uneven split holds for its own pp; any other pp is split evenly.
      const bool clear_split = pp != deck.parallel.pp && !deck.parallel.stage_layers.empty();
      for (int mb : sizes) {
        std::vector<std::string> o = req.overrides;
        for (const std::string& kv :
             {strfmt("--parallel.dp=%d", dp), strfmt("--parallel.tp=%d", tp), strfmt("--parallel.pp=%d", pp),
              strfmt("--train.micro_batch=%d", mb), std::string("--parallel.zero=0"),
              std::string(clear_split ? "--parallel.stage_layers=" : ""),
              std::string("--parallel.sequence_parallel=") + (tp > 1 ? "true" : "false")})
          if (!kv.empty()) o.push_back(kv);
        // Fallbacks, in turn: sequence parallelism needs seq_len % tp; the interleaved schedule
        // needs its own divisions.
        const std::vector<std::vector<std::string>> attempts = {
            {}, {"--parallel.sequence_parallel=false"},
            {"--parallel.schedule=1f1b", "--parallel.virtual_stages=1"},
            {"--parallel.sequence_parallel=false", "--parallel.schedule=1f1b", "--parallel.virtual_stages=1"}};
        std::optional<Config> cfg;
        bool schedule_fallback = false;
        for (const auto& extra : attempts) {
          std::vector<std::string> oo = o;
          oo.insert(oo.end(), extra.begin(), extra.end());
          try {
            cfg = load_config(req.deck, oo, N, false);
            schedule_fallback =
                deck.parallel.schedule != "1f1b" &&
                std::find(extra.begin(), extra.end(), "--parallel.schedule=1f1b") != extra.end();
            break;
          } catch (const UserError&) {
          }
        }
        if (!cfg) {
          ++out.rejected;  // heads, kv_heads or d_ff not divisible by tp; more stages than layers
          continue;
        }
        for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero)
          for (const char* recompute : {"none", "selective", "full"}) {
            Config c = *cfg;
            c.parallel.zero = zero;
            c.train.recompute = recompute;
            out.layouts.push_back(evaluate_layout(c, req, out.fits_one_device));
            out.layouts.back().schedule_fallback = schedule_fallback;
            out.layouts.back().stage_layers_cleared = clear_split;
          }
      }
    }
  }
  // Times compared as floats: what differs only in the double's last bits (the same FLOPs in
  // other micro-batches) is a tie, broken toward the deck's micro-batch, then the larger.
  const int deck_mb = deck.train.micro_batch;
  auto ranked_before = [deck_mb](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits != b.fits) return a.fits;
    if (!a.fits) return a.memory.total() < b.memory.total();
    const float ta = float(a.time.total()), tb = float(b.time.total());
    if (ta != tb) return ta < tb;
    const int ma = a.cfg.train.micro_batch, mb = b.cfg.train.micro_batch;
    if ((ma == deck_mb) != (mb == deck_mb)) return ma == deck_mb;
    return ma > mb;
  };
  std::stable_sort(out.layouts.begin(), out.layouts.end(), ranked_before);
  return out;
}

}  // namespace trellis
