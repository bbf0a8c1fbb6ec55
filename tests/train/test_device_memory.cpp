// The trainer never touches the backend's memory from the host, checked without a GPU: a backend
// that runs the CPU kernels but hands out "device" pointers the host cannot dereference (host
// memory shifted far above any mapping: any host read or write through one faults). Every
// kernel call shifts its pointers back. Training, recomputation and a checkpoint round trip on it
// must give bitwise the CPU backend's losses — so the model, the ZeRO store, AdamW and the
// checkpoints reach device memory only through the Backend's copies, as the CUDA backend needs.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "backend/cpu/cpu_backend.hpp"
#include "config/config.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

// 2^55 added to a user-space address gives a non-canonical one on x86-64 with 48-bit addresses,
// and an unmapped one with 57-bit addresses or on arm64 (outside the top byte, which arm64 may
// ignore): dereferencing it faults.
constexpr uintptr_t kShift = uintptr_t(1) << 55;

template <class T>
T* real(T* p) {
  return p ? reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) - kShift) : nullptr;
}

class ShiftedAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = host_allocator().allocate(bytes);
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + kShift);
  }
  void release(void* p) override { host_allocator().release(real(p)); }
  bool device() const override { return true; }
};

class FakeDeviceBackend : public Backend {
 public:
  std::string name() const override { return "fake-device"; }
  void set_threads(int threads) override { cpu_.set_threads(threads); }
  Allocator* allocator() override {
    static ShiftedAllocator shifted;
    return &shifted;
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    Backend::copy_from_host(real(dst), host_src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    Backend::copy_to_host(host_dst, real(src), bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    Backend::copy(real(dst), real(src), bytes);
  }
  void zero(void* dst, size_t bytes) override { Backend::zero(real(dst), bytes); }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int N, int C,
                         int vb, int vc) override {
    cpu_.embedding_forward(real(out), real(tokens), real(wte), N, C, vb, vc);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int N, int C,
                          int vb, int vc) override {
    cpu_.embedding_backward(real(dwte), real(dout), real(tokens), N, C, vb, vc);
  }
  void position_forward(float* out, const float* wpe, int rows, int T, int C, int r0) override {
    cpu_.position_forward(real(out), real(wpe), rows, T, C, r0);
  }
  void position_backward(float* dwpe, const float* dout, int rows, int T, int C, int r0) override {
    cpu_.position_backward(real(dwpe), real(dout), rows, T, C, r0);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                         const float* b, int N, int C) override {
    cpu_.layernorm_forward(real(out), real(mean), real(rstd), real(inp), real(w), real(b), N, C);
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                          const float* w, const float* mean, const float* rstd, int N,
                          int C) override {
    cpu_.layernorm_backward(real(dinp), real(dw), real(db), real(dout), real(inp), real(w),
                            real(mean), real(rstd), N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* w, const float* b, int N, int C,
                      int OC) override {
    cpu_.matmul_forward(real(out), real(inp), real(w), real(b), N, C, OC);
  }
  void matmul_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                       const float* w, int N, int C, int OC) override {
    cpu_.matmul_backward(real(dinp), real(dw), real(db), real(dout), real(inp), real(w), N, C, OC);
  }
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int H, int KV,
                         int hd) override {
    cpu_.attention_forward(real(out), real(att), real(qkv), B, T, H, KV, hd);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                          const float* att, int B, int T, int H, int KV, int hd) override {
    cpu_.attention_backward(real(dqkv), real(dout), real(qkv), real(out), real(att), B, T, H, KV,
                            hd);
  }
  void attention_cached(float* out, float* kc, float* vc, const float* qkv, int M, int p0, int H,
                        int KV, int hd) override {
    cpu_.attention_cached(real(out), real(kc), real(vc), real(qkv), M, p0, H, KV, hd);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override {
    cpu_.gelu_forward(real(out), real(inp), n);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    cpu_.gelu_backward(real(dinp), real(inp), real(dout), n);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override {
    cpu_.add(real(out), real(a), real(b), n);
  }
  void scale(float* x, float s, int64_t n) override { cpu_.scale(real(x), s, n); }
  void crossentropy_max(const float* logits, float* row_max, int N, int V, int valid) override {
    cpu_.crossentropy_max(real(logits), real(row_max), N, V, valid);
  }
  void crossentropy_sums(const float* logits, const int32_t* targets, const float* row_max,
                         float* sumexp, float* target_logit, int N, int V, int valid,
                         int vb) override {
    cpu_.crossentropy_sums(real(logits), real(targets), real(row_max), real(sumexp),
                           real(target_logit), N, V, valid, vb);
  }
  void crossentropy_finish(float* logits, float* losses, const int32_t* targets,
                           const float* row_max, const float* sumexp, const float* target_logit,
                           int N, int V, int valid, int vb, float dloss) override {
    cpu_.crossentropy_finish(real(logits), real(losses), real(targets), real(row_max),
                             real(sumexp), real(target_logit), N, V, valid, vb, dloss);
  }
  double sum_squares(const float* x, int64_t n) override { return cpu_.sum_squares(real(x), n); }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2,
             float eps, float wd, float bc1, float bc2, float gs) override {
    cpu_.adamw(real(p), real(g), real(m), real(v), n, lr, b1, b2, eps, wd, bc1, bc2, gs);
  }

 private:
  CpuBackend cpu_;
};

const char* kDeck = R"(
[model]
layers = 2
d_model = 32
heads = 4
kv_heads = 2
seq_len = 16
vocab = 29
[train]
steps = 8
global_batch = 8
micro_batch = 4
lr = 1e-2
warmup_steps = 2
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

fs::path scratch_dir() {
  return fs::temp_directory_path() / ("trellis-test-device-memory-" + std::to_string(::getpid()));
}

std::vector<double> losses(bool fake_device, std::vector<std::string> overrides,
                           bool checkpoints = false) {
  fs::create_directories(scratch_dir());
  const fs::path deck = scratch_dir() / "tiny.deck";
  std::ofstream(deck) << kDeck;
  Config cfg = load_config(deck.string(), overrides, 1);
  Trainer t(cfg, MPI_COMM_SELF, fake_device ? std::make_unique<FakeDeviceBackend>() : nullptr);
  t.set_quiet(true);
  t.set_checkpointing(checkpoints);
  t.run();
  std::vector<double> l;
  for (const auto& r : t.history()) l.push_back(r.loss);
  return l;
}

class DeviceMemory : public ::testing::Test {
 protected:
  void TearDown() override { fs::remove_all(scratch_dir()); }
};

TEST_F(DeviceMemory, TheShiftedPointersReallyFault) {
  FakeDeviceBackend be;
  Buffer b(MemKind::Scratch, 64, be.allocator());
  EXPECT_DEATH({ static_cast<volatile float*>(b.f32())[0] = 1.0f; }, "");
}

TEST_F(DeviceMemory, TrainingTouchesDeviceMemoryOnlyThroughTheBackend) {
  for (const char* recompute : {"none", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    const std::string r = std::string("--train.recompute=") + recompute;
    EXPECT_EQ(losses(true, {r}), losses(false, {r}));
  }
}

TEST_F(DeviceMemory, CheckpointsGoThroughTheBackendBothWays) {
  // A constant learning rate after warmup: the schedule then does not depend on train.steps.
  const std::string dir = "--checkpoint.dir=" + (scratch_dir() / "ckpt").string();
  const std::string constant = "--train.decay=constant";
  const auto whole = losses(false, {constant});
  // Steps 1-4 on the fake device (checkpoint at 4), then 5-8 from it, on the fake device again.
  losses(true, {dir, constant, "--train.steps=4"}, true);
  const auto resumed = losses(true, {dir, constant}, true);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[4 + i]) << "step " << 5 + i;
}

}  // namespace
