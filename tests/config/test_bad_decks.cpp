// Every way a deck or command line can be wrong, one row each: the message names the key and
// where it came from (the deck's path, or "command line").
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/config.hpp"
#include "config/config_test.hpp"

using config_test::ConfigTest;
using config_test::kBase;
using trellis::Config;
using trellis::load_config;
using trellis::stage_layers;

namespace {

// One bad deck or command line per row: what is added to the base deck, the overrides, the world
// size, and strings the message must contain.
struct BadCase {
  const char* name;
  const char* deck_extra;
  std::vector<std::string> overrides;
  int world;
  std::vector<std::string> expect;
};

const std::vector<BadCase> kBadCases = {
    // Unknown keys and sections.
    {"deck typo", "[model]\nlayer = 3\n", {}, 1, {"model.layer", "did you mean 'model.layers'"}},
    {"key outside section", "", {}, 1, {}},  // placeholder replaced below
    {"key in wrong section", "[train]\ninit_std = 0.1\n", {}, 1, {"'model.init_std'"}},
    {"cli typo", "", {"--train.step=5"}, 1, {"command line", "train.step", "'train.steps'"}},
    {"deck section typo", "[modle]\nlayers = 3\n", {}, 1, {"[modle]", "did you mean [model]"}},
    {"empty unknown section", "[nonsense]\n", {}, 1, {"[nonsense]"}},
    {"cli section typo", "", {"--trian.steps=5"}, 1, {"command line", "[trian]", "[train]"}},
    {"duplicate key", "[model]\nlayers = 3\n", {}, 1, {"model.layers", "more than once"}},
    {"malformed override",
     "",
     {"--train.steps"},
     1,
     {"command line", "--train.steps", "malformed"}},
    {"override without key", "", {"--=5"}, 1, {"malformed", "--=5"}},
    {"override without section", "", {"--steps=5"}, 1, {"'steps'", "did you mean 'train.steps'"}},
    // Values that do not parse.
    {"int garbage", "", {"--train.steps=abc"}, 1, {"bad value 'abc'", "train.steps", "integer"}},
    {"int trailing", "", {"--train.steps=10x"}, 1, {"'10x'", "train.steps"}},
    {"int exponent", "", {"--train.steps=1e3"}, 1, {"'1e3'", "train.steps"}},
    {"int decimal", "", {"--model.layers=2.0"}, 1, {"'2.0'", "model.layers"}},
    {"int empty", "", {"--model.layers="}, 1, {"model.layers", "integer"}},
    {"hang timeout under a second",
     "",
     {"--system.hang_timeout_s=1e-9"},
     1,
     {"system.hang_timeout_s = 1e-09", "under a second"}},
    {"int overflow", "", {"--model.layers=99999999999"}, 1, {"model.layers", "2147483647"}},
    {"int64 overflow", "", {"--train.steps=99999999999999999999"}, 1, {"train.steps", "at most"}},
    {"negative seed", "", {"--model.seed=-1"}, 1, {"model.seed"}},
    {"negative synthetic seed", "", {"--data.synthetic_seed=-1"}, 1, {"data.synthetic_seed"}},
    {"synthetic seed past 2^64", "", {"--data.synthetic_seed=18446744073709551616"}, 1,
     {"data.synthetic_seed"}},
    {"float garbage", "", {"--train.lr=fast"}, 1, {"'fast'", "train.lr", "number"}},
    {"float nan", "", {"--train.lr=nan"}, 1, {"'nan'", "train.lr"}},
    {"float inf", "", {"--train.lr=inf"}, 1, {"'inf'", "train.lr"}},
    {"float overflow", "", {"--train.lr=1e999"}, 1, {"'1e999'", "train.lr"}},
    {"past fp32", "", {"--train.lr=1e39"}, 1, {"'1e39'", "train.lr", "fp32's largest"}},
    {"past fp32 in a deck", "[train]\nweight_decay = 4e38\n", {}, 1,
     {"train.weight_decay", "fp32's largest"}},
    {"float trailing", "", {"--train.eps=1e-8f"}, 1, {"train.eps"}},
    {"bool", "", {"--parallel.sequence_parallel=maybe"}, 1, {"parallel.sequence_parallel", "true"}},
    {"choice", "", {"--parallel.schedule=zigzag"}, 1, {"parallel.schedule", "gpipe, 1f1b"}},
    {"choice decay", "", {"--train.decay=exp"}, 1, {"train.decay", "cosine"}},
    {"choice source", "", {"--data.source=web"}, 1, {"data.source"}},
    {"choice backend", "", {"--system.backend=tpu"}, 1, {"system.backend"}},
    {"choice precision", "", {"--system.precision=fp16"}, 1, {"system.precision"}},
    {"order short", "", {"--parallel.order=tp-dp"}, 1, {"parallel.order", "permutation"}},
    {"order repeat", "", {"--parallel.order=tp-tp-pp"}, 1, {"parallel.order"}},
    {"resume empty", "", {"--checkpoint.resume="}, 1, {"checkpoint.resume"}},
    // Ranges.
    {"layers", "", {"--model.layers=0"}, 1, {"model.layers", "1..65536"}},
    {"layers past 2^16", "", {"--model.layers=65537"}, 1, {"model.layers", "1..65536"}},
    {"parameters past 2^50", "", {"--model.d_model=1073741824", "--model.heads=1", "--model.d_ff=1"},
     1, {"model.d_model", "more than Trellis counts"}},
    {"d_model", "", {"--model.d_model=0"}, 1, {"model.d_model"}},
    {"heads", "", {"--model.heads=0"}, 1, {"model.heads"}},
    {"kv_heads", "", {"--model.kv_heads=-1"}, 1, {"model.kv_heads", "≥ 0"}},
    {"d_ff", "", {"--model.d_ff=-1"}, 1, {"model.d_ff"}},
    {"seq_len", "", {"--model.seq_len=0"}, 1, {"model.seq_len"}},
    {"vocab", "", {"--model.vocab=1"}, 1, {"model.vocab", "2..1073741824"}},
    {"vocab past 2^30", "", {"--model.vocab=2147483585"}, 1, {"model.vocab", "2..1073741824"}},
    {"init_std", "", {"--model.init_std=0"}, 1, {"model.init_std", "> 0"}},
    {"dp", "", {"--parallel.dp=-1"}, 1, {"parallel.dp"}},
    {"tp", "", {"--parallel.tp=0"}, 1, {"parallel.tp"}},
    {"pp", "", {"--parallel.pp=0"}, 1, {"parallel.pp"}},
    {"zero", "", {"--parallel.zero=4"}, 1, {"parallel.zero", "0..3"}},
    {"virtual_stages", "", {"--parallel.virtual_stages=0"}, 1, {"parallel.virtual_stages"}},
    {"bucket_mb", "", {"--parallel.bucket_mb=0"}, 1, {"parallel.bucket_mb"}},
    {"steps", "", {"--train.steps=0"}, 1, {"train.steps"}},
    {"global_batch", "", {"--train.global_batch=0"}, 1, {"train.global_batch"}},
    {"micro_batch", "", {"--train.micro_batch=0"}, 1, {"train.micro_batch"}},
    {"lr", "", {"--train.lr=0"}, 1, {"train.lr"}},
    {"min_lr", "", {"--train.min_lr=-0.1"}, 1, {"train.min_lr"}},
    {"warmup_steps", "", {"--train.warmup_steps=-1"}, 1, {"train.warmup_steps"}},
    {"weight_decay", "", {"--train.weight_decay=-1"}, 1, {"train.weight_decay"}},
    {"beta1", "", {"--train.beta1=1"}, 1, {"train.beta1", "[0, 1)"}},
    {"beta2", "", {"--train.beta2=-0.5"}, 1, {"train.beta2"}},
    {"eps", "", {"--train.eps=0"}, 1, {"train.eps"}},
    {"grad_clip", "", {"--train.grad_clip=-1"}, 1, {"train.grad_clip"}},
    {"synthetic_tokens",
     "",
     {"--data.synthetic_tokens=1000"},
     1,
     {"data.synthetic_tokens", "1024"}},
    {"synthetic_order", "", {"--data.synthetic_order=0"}, 1, {"data.synthetic_order"}},
    {"synthetic_branching", "", {"--data.synthetic_branching=0"}, 1, {"data.synthetic_branching"}},
    {"synthetic_alpha", "", {"--data.synthetic_alpha=0"}, 1, {"data.synthetic_alpha"}},
    {"ckpt every", "", {"--checkpoint.every=-1"}, 1, {"checkpoint.every"}},
    {"keep", "", {"--checkpoint.keep=0"}, 1, {"checkpoint.keep"}},
    {"log every", "", {"--log.every=0"}, 1, {"log.every"}},
    {"threads", "", {"--system.threads=-1"}, 1, {"system.threads"}},
    {"peak_gflops", "", {"--system.peak_gflops=-1"}, 1, {"system.peak_gflops"}},
    // Consistency between keys.
    {"d_model % heads", "", {"--model.d_model=66"}, 1, {"model.d_model", "model.heads"}},
    {"heads % kv_heads", "", {"--model.kv_heads=3"}, 1, {"model.heads", "model.kv_heads"}},
    {"kv_heads > heads", "", {"--model.kv_heads=8"}, 1, {"model.kv_heads"}},
    {"world mismatch",
     "",
     {"--parallel.dp=2"},
     1,
     {"parallel.dp*tp*pp = 2 but 1 ranks were started"}},
    {"world too big", "", {"--parallel.dp=1"}, 4, {"parallel.dp*tp*pp = 1 but 4 ranks"}},
    {"tp*pp not dividing",
     "",
     {"--parallel.tp=2"},
     1,
     {"parallel.tp", "parallel.pp", "world size 1"}},
    {"tp*pp not dividing 6", "", {"--parallel.tp=4"}, 6, {"parallel.tp*pp = 4", "6"}},
    {"global batch",
     "",
     {"--train.global_batch=5"},
     1,
     {"train.global_batch", "train.micro_batch", "parallel.dp"}},
    {"global batch dp", "", {"--parallel.dp=4"}, 4, {"train.global_batch", "multiple of 8"}},
    {"global batch micro",
     "",
     {"--train.global_batch=12", "--train.micro_batch=8", "--parallel.dp=2"},
     2,
     {"multiple of 16, or train.micro_batch = 6 (the largest that divides global_batch / "
      "parallel.dp = 6)"}},
    {"pp > layers", "", {"--parallel.pp=4"}, 4, {"parallel.pp", "model.layers"}},
    {"heads % tp", "", {"--model.heads=2", "--parallel.tp=4"}, 4, {"model.heads", "parallel.tp"}},
    {"kv_heads vs tp",
     "",
     {"--model.heads=12", "--model.d_model=96", "--model.kv_heads=6", "--parallel.tp=4"},
     4,
     {"model.kv_heads", "parallel.tp"}},
    {"interleaved vs=1",
     "",
     {"--parallel.schedule=interleaved"},
     1,
     {"parallel.schedule", "parallel.virtual_stages"}},
    {"interleaved on one stage",
     "",
     {"--parallel.schedule=interleaved", "--parallel.virtual_stages=2"},
     1,
     {"parallel.schedule = interleaved needs parallel.pp > 1"}},
    {"interleaved layers",
     "",
     {"--parallel.schedule=interleaved", "--parallel.virtual_stages=2", "--parallel.pp=2",
      "--model.layers=6"},
     2,
     {"model.layers", "parallel.pp * parallel.virtual_stages = 4"}},
    {"virtual stages without interleaved",
     "",
     {"--parallel.virtual_stages=2"},
     1,
     {"parallel.virtual_stages", "interleaved"}},
    {"sequence parallel",
     "",
     {"--parallel.sequence_parallel=true", "--parallel.tp=2", "--model.seq_len=33"},
     2,
     {"model.seq_len", "parallel.tp"}},
    {"text needs path", "", {"--data.source=text"}, 1, {"data.source", "data.path"}},
    {"tokens needs path", "", {"--data.source=tokens"}, 1, {"data.path"}},
    {"branching > vocab",
     "",
     {"--data.synthetic_branching=200"},
     1,
     {"data.synthetic_branching", "model.vocab"}},
    {"min_lr > lr", "", {"--train.min_lr=0.01"}, 1, {"train.min_lr", "train.lr"}},
    {"eval of text needs eval.path",
     "",
     {"--data.source=text", "--data.path=train.txt", "--eval.every=10"},
     1,
     {"eval.every = 10", "eval.path", "data.source = text"}},
    {"eval of tokens needs eval.path",
     "",
     {"--data.source=tokens", "--data.path=train_*.bin", "--eval.every=1"},
     1,
     {"eval.path", "glob"}},
    {"eval.path is data.path",
     "",
     {"--data.source=text", "--data.path=a.txt", "--eval.path=a.txt", "--eval.every=5"},
     1,
     {"eval.path", "data.path", "training data"}},
    {"eval.batches 0", "", {"--eval.batches=0"}, 1, {"eval.batches"}},
    {"eval.every negative", "", {"--eval.every=-1"}, 1, {"eval.every"}},
    {"seq_len beyond an int", "", {"--model.seq_len=2147483647"}, 1, {"model.seq_len"}},
    {"micro-batch tokens beyond an int",
     "",
     {"--model.seq_len=16777216", "--train.micro_batch=256", "--train.global_batch=256"},
     1,
     {"train.micro_batch * model.seq_len = 4294967296"}},
    {"held-out sequences beyond an int",
     "",
     {"--eval.every=1", "--eval.batches=2000000000", "--train.global_batch=8",
      "--train.micro_batch=1"},
     1,
     {"eval.batches * train.global_batch = 16000000000"}},
    {"choice precision", "", {"--system.precision=fp16"}, 1, {"system.precision", "bf16"}},
    {"choice grad_reduce", "", {"--system.grad_reduce=fp16"}, 1, {"system.grad_reduce", "fp32"}},
    {"huge d_ff", "", {"--model.d_model=1000000000", "--model.heads=1"}, 1, {"model.d_ff"}},
    // Valid, but not in this build yet.
    {"interleaved, too few micro-batches",
     "",
     {"--parallel.pp=2", "--train.micro_batch=4", "--parallel.schedule=interleaved",
      "--parallel.virtual_stages=2", "--model.layers=4"},
     2,
     {"parallel.schedule = interleaved needs the micro-batches per step", "parallel.pp"}},
    {"stage_layers wrong sum",
     "",
     {"--parallel.pp=2", "--train.micro_batch=1", "--parallel.stage_layers=1,2"},
     2,
     {"parallel.stage_layers", "model.layers"}},
    // A list with an empty item is malformed, even where its counts alone would add up.
    {"stage_layers trailing comma",
     "",
     {"--parallel.pp=2", "--train.micro_batch=1", "--parallel.stage_layers=1,1,"},
     2,
     {"parallel.stage_layers = '1,1,'", "comma-separated list"}},
    {"stage_layers empty item",
     "",
     {"--parallel.pp=2", "--train.micro_batch=1", "--parallel.stage_layers=1,,1"},
     2,
     {"parallel.stage_layers", "comma-separated list"}},
    {"stage_layers signed count",
     "",
     {"--parallel.pp=2", "--train.micro_batch=1", "--parallel.stage_layers=+1,1"},
     2,
     {"parallel.stage_layers", "comma-separated list"}},
    {"d_ff not divisible by tp",
     "",
     {"--parallel.tp=2", "--model.d_ff=33"},
     2,
     {"model.d_ff", "parallel.tp"}},
#ifdef TRELLIS_HAVE_CUDA
#ifndef TRELLIS_HAVE_NCCL
    // Any layout and precision run on cuda; NCCL only where the build found it.
    {"cuda",
     "",
     {"--system.backend=cuda", "--system.device_comm=nccl"},
     1,
     {"system.device_comm = nccl", "NCCL"}},
#endif
#else
    {"cuda", "", {"--system.backend=cuda"}, 1, {"system.backend=cuda: this build has no CUDA"}},
#endif
};

TEST_F(ConfigTest, StageLayersTakeSpacesAroundTheirCounts) {
  const Config c = load_config(write(kBase),
                               {"--model.layers=3", "--parallel.pp=2", "--train.micro_batch=1",
                                "--parallel.stage_layers= 2 , 1 "},
                               2);
  EXPECT_EQ(stage_layers(c.model, c.parallel, 0).first, 0);
  EXPECT_EQ(stage_layers(c.model, c.parallel, 0).end, 2);
  EXPECT_EQ(stage_layers(c.model, c.parallel, 1).first, 2);
  EXPECT_EQ(stage_layers(c.model, c.parallel, 1).end, 3);
}

TEST_F(ConfigTest, BadDecksAndOverrides) {
  ASSERT_GE(kBadCases.size(), 25u);
  for (const auto& c : kBadCases) {
    SCOPED_TRACE(c.name);
    std::string text = std::string(kBase) + c.deck_extra;
    std::vector<std::string> expect = c.expect;
    if (std::string(c.name) == "key outside section") {
      text = "layers = 3\n" + std::string(kBase);
      expect = {"unknown key 'layers'", "model.layers"};
    }
    const std::string deck = write(text);
    const std::string e = error_of(deck, c.overrides, c.world);
    ASSERT_FALSE(e.empty()) << "loaded without error";
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    const std::string where = c.overrides.empty() ? deck : "command line";
    // The unsupported-layout checks see only the Config, so they blame the deck.
    const bool unsupported = std::string(c.name) == "cuda";
    if (!unsupported) {
      EXPECT_EQ(e.rfind(where + (c.overrides.empty() ? "" : ": "), 0), 0u) << e;
    }
    for (const auto& s : expect) EXPECT_NE(e.find(s), std::string::npos) << e << "\n  lacks: " << s;
  }
}

}  // namespace
