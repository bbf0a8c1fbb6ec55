// Tensor parallelism (run at 2 and 4 ranks): every tensor-parallel layer's gradients against the
// unsharded model, training losses against one rank for tp × kv_heads × sequence parallelism and
// with data parallelism and ZeRO, replicated tensors identical across the group, and the
// communication volume against Megatron's count.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/backend.hpp"
#include "config/config.hpp"
#include "model/gpt.hpp"
#include "mpi_util.hpp"
#include "parallel/tensor_parallel.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

ModelConfig small_model(int kv_heads) {
  ModelConfig m;
  m.layers = 2;
  m.d_model = 32;
  m.heads = 4;
  m.kv_heads = kv_heads;
  m.d_ff = 64;
  m.seq_len = 8;
  m.vocab = 29;  // not a multiple of 2 or 4: the last vocabulary shard has padding rows
  m.init_std = 0.2;
  m.seed = 5;
  return m;
}

// The world split into tensor groups of `tp` consecutive ranks.
struct TpGroup {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit TpGroup(int tp) { MPI_Comm_split(MPI_COMM_WORLD, trellis::testing::world_rank() / tp, 0, &comm); }
  ~TpGroup() { MPI_Comm_free(&comm); }
};

struct Case {
  int tp, kv;
  bool sp;
};

std::string name(const Case& c) {
  return "tp" + std::to_string(c.tp) + "_kv" + std::to_string(c.kv) + (c.sp ? "_sp" : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {2, 4})
    if (trellis::testing::world_size() % tp == 0)
      for (int kv : {4, 2, 1})
        for (bool sp : {false, true}) out.push_back({tp, kv, sp});
  return out;
}

}  // namespace

TEST(TensorParallel, EveryLayersGradientsMatchTheUnshardedModel) {
  auto be = make_backend("cpu");
  const int B = 2;
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    ModelConfig m = small_model(c.kv);
    std::mt19937 rng(11);
    std::vector<int32_t> inputs(B * m.seq_len), targets(B * m.seq_len);
    for (auto& t : inputs) t = int32_t(rng() % m.vocab);
    for (auto& t : targets) t = int32_t(rng() % m.vocab);

    // The unsharded model on this rank alone.
    ParamTable ref_table(m);
    ResidentParams ref_store(ref_table);
    init_parameters(ref_table, m.seed, ref_store.params());
    GPT ref(m, ref_table, ref_store, *be, B);
    ref_store.zero_grads();
    const float ref_loss = ref.forward(0, inputs.data(), targets.data(), 1.0f / (B * m.seq_len));
    ref.backward(0);

    // The same model split over a tensor group.
    TpGroup group(c.tp);
    Comm tp(group.comm, "tp"), dp(MPI_COMM_SELF, "dp");
    ParamTable table(m, c.tp, tp.rank());
    ParallelConfig par;
    par.tp = c.tp;
    TrainConfig train;
    ShardedParams store(table, par, train, dp, *be);
    TensorParallelGrads tp_grads(table, m.kv_heads, c.sp, tp, store);
    store.init_parameters(m.seed);
    GPT gpt(m, table, store, *be, B, &tp, c.sp);
    store.begin_step();
    const float loss = gpt.forward(0, inputs.data(), targets.data(), 1.0f / (B * m.seq_len));
    gpt.backward(0);
    store.finish_grad_sync();
    EXPECT_NEAR(loss, ref_loss, 1e-5 * ref_loss);

    const std::vector<float> grads = store.gather_gradients();
    const std::vector<float> params = store.gather_parameters();
    for (const ParamInfo& p : table.params()) {
      const ParamInfo& rp = ref_table.find(p.name);
      double scale = 0;
      for (int64_t i = 0; i < rp.numel(); ++i) scale = std::max(scale, double(std::fabs(ref_store.grads()[rp.offset + i])));
      int bad = 0;
      for (int64_t i = 0; i < p.numel(); ++i) {
        const int64_t g = p.global_index(i);
        const float want_grad = g < 0 ? 0.f : ref_store.grads()[rp.offset + g];
        const float want_param = g < 0 ? 0.f : ref_store.params()[rp.offset + g];
        if (std::fabs(grads[p.offset + i] - want_grad) > 1e-4 * scale + 1e-7) ++bad;
        if (params[p.offset + i] != want_param) ++bad;  // initialisation is layout-invariant
      }
      EXPECT_EQ(bad, 0) << p.name << " (gradient scale " << scale << ")";
    }
    // The norm counts replicated tensors once: it equals the unsharded model's.
    const double ref_norm = std::sqrt(be->sum_squares(ref_store.grads(), ref_table.total()));
    EXPECT_NEAR(store.grad_norm(), ref_norm, 1e-5 * ref_norm);
  }
}

namespace {

const char* kDeck = R"(
[model]
layers = 2
d_model = 32
heads = 4
d_ff = 64
seq_len = 8
vocab = 29
[train]
steps = 20
global_batch = 8
micro_batch = 4
lr = 1e-2
min_lr = 1e-3
warmup_steps = 3
# AdamW's first steps move each weight by about lr·g/(|g| + eps): where a gradient is as small as
# eps, fp32 rounding differences between layouts (sums in another order) become differences of
# order lr. A larger eps keeps that discontinuity away from the comparison.
eps = 1e-6
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

std::string deck_path() { return trellis::testing::write_deck("tp", kDeck); }

std::vector<double> losses(MPI_Comm comm, std::vector<std::string> overrides, Trainer** keep = nullptr) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  Config cfg = load_config(deck_path(), overrides, size);
  auto* t = new Trainer(cfg, comm);
  t->set_quiet(true);
  t->run();
  std::vector<double> out;
  for (const auto& s : t->history()) out.push_back(s.loss);
  if (keep) *keep = t;
  else delete t;
  return out;
}

void expect_same_losses(const std::vector<double>& got, const std::vector<double>& ref) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t s = 0; s < ref.size(); ++s)
    EXPECT_NEAR(got[s], ref[s], 1e-5 * std::fabs(ref[s])) << "step " << s;
}

}  // namespace

TEST(TensorParallel, TrainsLikeOneRank) {
  const int n = trellis::testing::world_size();
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    const std::string kv = "--model.kv_heads=" + std::to_string(c.kv);
    const std::vector<double> ref = losses(MPI_COMM_SELF, {kv, "--parallel.dp=1"});
    const std::string sp = c.sp ? "--parallel.sequence_parallel=true" : "--parallel.sequence_parallel=false";
    // dp fills the rest of the world: tp = 2 on 4 ranks runs 2 × 2, with ZeRO 1 and 3.
    for (int zero : n / c.tp > 1 ? std::vector<int>{1, 3} : std::vector<int>{0}) {
      SCOPED_TRACE("zero " + std::to_string(zero));
      expect_same_losses(losses(MPI_COMM_WORLD, {kv, sp, "--parallel.tp=" + std::to_string(c.tp),
                                                 "--parallel.dp=0", "--parallel.zero=" + std::to_string(zero)}),
                         ref);
    }
  }
}

TEST(TensorParallel, ReplicatedTensorsStayIdenticalAndPayloadIsMegatrons) {
  const int n = trellis::testing::world_size();
  if (n == 1) GTEST_SKIP() << "needs a tensor group";
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "plain");
    Trainer* t = nullptr;
    losses(MPI_COMM_WORLD, {"--parallel.tp=" + std::to_string(n), "--parallel.dp=1", "--train.steps=3",
                            std::string("--parallel.sequence_parallel=") + (sp ? "true" : "false")},
           &t);
    // Every replicated tensor holds the same bits on every tp rank.
    std::vector<float> params = t->params().gather_parameters();
    for (const Unit& r : t->model().table().replicated_ranges()) {
      std::vector<float> lo(params.begin() + r.begin, params.begin() + r.end), hi = lo;
      MPI_Allreduce(MPI_IN_PLACE, lo.data(), int(lo.size()), MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, hi.data(), int(hi.size()), MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
      EXPECT_EQ(lo, hi) << "replicated range at " << r.begin;
    }
    // Megatron's volume per micro-batch, N = B·T rows, all-reduce of n counted as 2n: without
    // sequence parallelism four all-reduces of N·C per layer (two forward, two backward), one for
    // the embedding and one for the LM head's input gradient, and the loss's max and sums (3N).
    // With it each all-reduce is a reduce-scatter plus an all-gather (the same volume), and
    // backward gathers each LayerNorm output again instead of keeping it (2 N·C per layer), and the
    // LM head's input and the embedding's gradient are gathered too (3 N·C): 10 L + 5 N·C in all.
    const double L = 2, N = 4 * 8, C = 32, micro = 8 / 4;
    const double per_micro = sp ? (10 * L + 5) * N * C + 6 * N : (4 * L + 2) * 2 * N * C + 6 * N;
    const int64_t steps = 3;
    // With sequence parallelism the replicated gradients are summed over tp once per step.
    double replicated = 0;
    for (const Unit& r : t->model().table().replicated_ranges()) replicated += double(r.end - r.begin);
    const double per_step = micro * per_micro + (sp ? 2 * replicated : 0) + 2;  // + the norm
    EXPECT_EQ(t->tp_comm().stats().payload_values, steps * per_step);
    delete t;
  }
}
