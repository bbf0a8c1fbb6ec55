// A fake device for tests without a GPU: a backend that runs the CPU kernels but hands out
// "device" pointers the host cannot dereference (host memory shifted far above any mapping: any
// host read or write through one faults). Every kernel call and every copy shifts its pointers
// back. Code that trains on it touches device memory only through the Backend — as the CUDA
// backend needs. Its staged device link (fake_staged_link) moves device buffers between ranks
// through the same un-shifting copies, so MPI tests can run every layout on it.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <vector>

#include "backend/cpu/cpu_backend.hpp"
#include "comm/staged_link.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "train/trainer.hpp"

namespace trellis::testing {

// 2^55 added to a user-space address gives a non-canonical one on x86-64 with 48-bit addresses,
// and an unmapped one with 57-bit addresses or on arm64 (outside the top byte, which arm64 may
// ignore): dereferencing it faults.
constexpr uintptr_t kShift = uintptr_t(1) << 55;

inline bool is_shifted(const void* p) { return reinterpret_cast<uintptr_t>(p) >= kShift; }

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

inline ShiftedAllocator& shifted_allocator() {
  static ShiftedAllocator shifted;
  return shifted;
}

class FakeDeviceBackend : public Backend {
 public:
  std::string name() const override { return "fake-device"; }
  void set_threads(int threads) override { cpu_.set_threads(threads); }
  Allocator* allocator() override { return &shifted_allocator(); }
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
  bool is_device_pointer(const void* p) const override { return is_shifted(p); }

  void attention_cached(float* out, float* kc, float* vc, const float* qkv, int M, int p0, int H,
                        int KV, int hd) override {
    cpu_.attention_cached(real(out), real(kc), real(vc), real(qkv), M, p0, H, KV, hd);
  }
  void scale(float* x, float s, int64_t n) override { cpu_.scale(real(x), s, n); }
  double sum_squares(const float* x, int64_t n) override { return cpu_.sum_squares(real(x), n); }
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2,
             float eps, float wd, float bc1, float bc2, float gs) override {
    cpu_.adamw(real(p), real(g), real(m), real(v), n, lr, b1, b2, eps, wd, bc1, bc2, gs);
  }

 protected:
  void embedding_forward_f32(float* out, const int32_t* tokens, const float* wte, int N, int C,
                             int vb, int vc) override {
    cpu_.embedding_forward(real(out), real(tokens), real(wte), N, C, vb, vc);
  }
  void embedding_backward_f32(float* dwte, const float* dout, const int32_t* tokens, int N, int C,
                              int vb, int vc) override {
    cpu_.embedding_backward(real(dwte), real(dout), real(tokens), N, C, vb, vc);
  }
  void position_forward_f32(float* out, const float* wpe, int rows, int T, int C, int r0) override {
    cpu_.position_forward(real(out), real(wpe), rows, T, C, r0);
  }
  void position_backward_f32(float* dwpe, const float* dout, int rows, int T, int C,
                             int r0) override {
    cpu_.position_backward(real(dwpe), real(dout), rows, T, C, r0);
  }
  void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp, const float* w,
                             const float* b, int N, int C) override {
    cpu_.layernorm_forward(real(out), real(mean), real(rstd), real(inp), real(w), real(b), N, C);
  }
  void layernorm_backward_f32(float* dinp, float* dw, float* db, const float* dout,
                              const float* inp, const float* w, const float* mean,
                              const float* rstd, int N, int C) override {
    cpu_.layernorm_backward(real(dinp), real(dw), real(db), real(dout), real(inp), real(w),
                            real(mean), real(rstd), N, C);
  }
  void matmul_forward_f32(float* out, const float* inp, const float* w, const float* b, int N,
                          int C, int OC) override {
    cpu_.matmul_forward(real(out), real(inp), real(w), real(b), N, C, OC);
  }
  void matmul_residual_forward_f32(float* out, const float* res, const float* inp, const float* w,
                                   const float* b, int N, int C, int OC) override {
    cpu_.matmul_residual_forward(real(out), real(res), real(inp), real(w), real(b), N, C, OC);
  }
  void matmul_backward_f32(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                           const float* w, int N, int C, int OC) override {
    cpu_.matmul_backward(real(dinp), real(dw), real(db), real(dout), real(inp), real(w), N, C, OC);
  }
  void attention_forward_f32(float* out, float* att, const float* qkv, int B, int T, int H, int KV,
                             int hd) override {
    cpu_.attention_forward(real(out), real(att), real(qkv), B, T, H, KV, hd);
  }
  void attention_backward_f32(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* att, int B, int T, int H, int KV, int hd) override {
    cpu_.attention_backward(real(dqkv), real(dout), real(qkv), real(out), real(att), B, T, H, KV,
                            hd);
  }
  void gelu_forward_f32(float* out, const float* inp, int64_t n) override {
    cpu_.gelu_forward(real(out), real(inp), n);
  }
  void gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) override {
    cpu_.gelu_backward(real(dinp), real(inp), real(dout), n);
  }
  void add_f32(float* out, const float* a, const float* b, int64_t n) override {
    cpu_.add(real(out), real(a), real(b), n);
  }
  void crossentropy_max_f32(const float* logits, float* row_max, int N, int V, int valid) override {
    cpu_.crossentropy_max(real(logits), real(row_max), N, V, valid);
  }
  void crossentropy_sums_f32(const float* logits, const int32_t* targets, const float* row_max,
                             float* sumexp, float* target_logit, int N, int V, int valid,
                             int vb) override {
    cpu_.crossentropy_sums(real(logits), real(targets), real(row_max), real(sumexp),
                           real(target_logit), N, V, valid, vb);
  }
  void crossentropy_finish_f32(float* logits, float* losses, const int32_t* targets,
                               const float* row_max, const float* sumexp, const float* target_logit,
                               int N, int V, int valid, int vb, float dloss) override {
    cpu_.crossentropy_finish(real(logits), real(losses), real(targets), real(row_max),
                             real(sumexp), real(target_logit), N, V, valid, vb, dloss);
  }
  // The conversions behind convert() and the bf16 kernels' widening (Backend's defaults), on
  // the un-shifted memory.
  void to_bf16(bf16_t* dst, const float* src, int64_t n) override {
    cpu_.convert(Ptr(real(dst)), CPtr(real(src)), n);
  }
  void from_bf16(float* dst, const bf16_t* src, int64_t n) override {
    cpu_.convert(Ptr(real(dst)), CPtr(real(src)), n);
  }

 private:
  CpuBackend cpu_;
};

/// A staged device link over `comm` whose copies un-shift the fake device's pointers.
inline std::unique_ptr<DeviceLink> fake_staged_link(MPI_Comm comm, const std::string& name) {
  DeviceCopies copies{
      [](void* host, const void* dev, size_t bytes) { std::memcpy(host, real(dev), bytes); },
      [](void* dev, const void* host, size_t bytes) { std::memcpy(real(dev), host, bytes); },
      [](const void* p) { return is_shifted(p); }};
  return std::make_unique<StagedLink>(comm, name, std::move(copies));
}

/// The losses of a quiet run of `cfg` over `comm` (its size dp·tp·pp), on the fake device or the
/// CPU backend; with `checkpoints`, writing and resuming them as checkpoint.* says.
inline std::vector<double> run_losses(const Config& cfg, MPI_Comm comm, bool fake_device,
                                      bool checkpoints = false) {
  Trainer t(cfg, comm, fake_device ? std::make_unique<FakeDeviceBackend>() : nullptr);
  t.set_quiet(true);
  t.set_checkpointing(checkpoints);
  t.run();
  std::vector<double> l;
  for (const auto& r : t.history()) l.push_back(r.loss);
  return l;
}

}  // namespace trellis::testing
