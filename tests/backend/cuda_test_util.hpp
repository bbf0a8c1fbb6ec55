// Shared by the CUDA kernel tests — test_cuda_kernels.cpp and test_cuda_gemm.cpp (fp32, and the
// GEMMs' mixed cases), test_cuda_bf16_*.cpp (every kernel on bf16 tensors) and the rest of
// test_cuda_*.cpp: host bf16 helpers, how a GPU's bf16 outputs are judged against the CPU's, and
// the fixture (a GPU and a CPU backend, device copies).
//
// Every CUDA kernel against the CPU backend on fresh random inputs. Built where nvcc exists; each
// test skips when no CUDA device is present (cudaGetDeviceCount reports none). Each test prints
// what it measured.
//
// fp32 tensors: fp32 storage and arithmetic on both sides, so only the order of summation
// differs. Relative error bounds |gpu − cpu| ≤ rtol·max(|cpu|, 1% of the tensor's largest |value|):
//   GEMMs (cuBLASLt, fp32 compute)       1e-4;  with TRELLIS_TF32=1 (10-bit mantissa)  2e-2
//   attention out / dqkv                 1e-4 / 1e-3 (online softmax vs two-pass)
//   layer norm, GELU, element-wise       1e-5
//   layer norm dweight / dbias           1e-4 (column sums over rows in another order)
//   cross-entropy losses / dlogits       1e-5
//   sum of squares (double accumulate)   1e-10
//   AdamW                                1e-5
// bf16 tensors (system.precision = bf16: activations and the weights the model reads bf16;
// gradients of parameters, mean/rstd, attention's logsumexp and losses fp32; every kernel computes
// in fp32 and rounds each bf16 output once, to nearest even). Both backends get the same inputs,
// random values rounded to bf16, in bf16 buffers: the GPU runs its bf16 kernels, the CPU its
// widening default — the fp32 kernel on the widened values, outputs rounded once, bit for bit
// (tests/backend/test_bf16_kernels.cpp) — which is the reference. Bounds:
//   fp32 outputs: the fp32 bounds above; for bf16 GEMMs 5e-4 (a product of two bf16 values is
//     exact in fp32 and both sides accumulate in fp32, so only the order of summation and the
//     tensor cores' accumulation differ; the bf16-operand GEMMs of before met 5e-4 on an H200).
//   bf16 outputs: the two sides round fp32 values that differ by the fp32 kernel's error e.
//     Rounding is monotonic, so they agree, or differ by one bf16 unit (at most 2⁻⁷·|value|: 8
//     significant bits) where e straddles a rounding boundary. Per entry |gpu − cpu| ≤ (2⁻⁷ +
//     rtol)·max(|cpu|, 1% of the largest), rtol the fp32 bound; ‖gpu − cpu‖₂ ≤ 2⁻⁸·‖cpu‖₂; and
//     at most 10% of the entries differ at all: an entry differs with probability about e / one
//     unit, under 2% even for e ≈ 1e-4 (a GEMM's worst), whereas a kernel that rounded twice or
//     truncated changes 25–50% of them. Where both sides do the same single fp32 operation (a
//     copy, one addition), the bits are equal.
//   The tensor-core attention rounds P and dS to bf16 inside: see Bf16AttentionOnTensorCores.
#pragma once
#ifdef TRELLIS_HAVE_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "core/bf16.hpp"
#include "backend/cuda/cuda_factory.hpp"
#include "backend_test_util.hpp"
#include "core/error.hpp"

using namespace trellis;
using trellis::test::expect_close;
using trellis::test::random_vec;
using trellis::test::relative_l2;

namespace {

// ---- bf16 tensors on the host, and how the GPU's are judged against the CPU's ----

using Bits = std::vector<bf16_t>;  // a bf16 tensor on the host

/// x rounded to bf16 (nearest even: core/bf16.hpp).
inline Bits bits_of(const std::vector<float>& x) {
  Bits b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i].bits = float_to_bf16_bits(x[i]);
  return b;
}
inline std::vector<float> widen(const Bits& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_bits_to_float(b[i].bits);
  return x;
}
/// Random values rounded to bf16: the inputs both backends get.
inline Bits bf16_random(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return bits_of(random_vec(n, seed, lo, hi));
}
/// Quiet NaNs: what an output holds before a kernel that overwrites it, so that an entry it
/// skips fails every comparison.
constexpr uint16_t kNaN16 = 0x7FC0;
inline Bits bf16_nan(size_t n) { return Bits(n, bf16_t{kNaN16}); }
/// The tensor from its second element on (the first: the poison before an unaligned start).
template <class T>
std::vector<T> tail(const std::vector<T>& v) {
  return std::vector<T>(v.begin() + 1, v.end());
}

constexpr double kUnit = 1.0 / 128;  // 2⁻⁷: one bf16 unit in the last place, at most, of |value|

/// How much of expect_close's per-entry bound rtol·max(|want|, 1% of max |want|) the worst entry
/// uses (infinite for a NaN).
template <class A, class B>
double worst_of_bound(const std::vector<A>& got, const std::vector<B>& want, double rtol) {
  double scale = 0.0, worst = 0.0;
  for (auto w : want) scale = std::max(scale, std::fabs(double(w)));
  const double floor = std::max(scale * 1e-2, 1e-12);
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    const double tol = rtol * std::max(std::fabs(double(want[i])), floor);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d / tol);
  }
  return worst;
}

/// fp32 outputs: expect_close's per-entry bound, and what the worst entry used of it.
[[maybe_unused]] void expect_f32(const std::vector<float>& got, const std::vector<float>& want,
                                 double rtol, const char* what) {
  std::printf("  %-38s fp32: worst entry at %.3f of its bound (rtol %.0e)\n", what,
              worst_of_bound(got, want, rtol), rtol);
  expect_close(got, want, rtol, what);
}

struct Bf16Diff {
  double worst;   // of the per-entry bound (2⁻⁷ + rtol)·max(|cpu|, 1% of max)
  double rel_l2;  // ‖gpu − cpu‖₂ / ‖cpu‖₂
  double differ;  // fraction of entries whose bits differ
};
inline Bf16Diff bf16_diff(const Bits& got, const Bits& want, double rtol) {
  const auto g = widen(got), w = widen(want);
  size_t differ = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i)
    differ += got[i].bits != want[i].bits;
  return {worst_of_bound(g, w, kUnit + rtol), relative_l2(g, w),
          double(differ) / double(std::max<size_t>(1, got.size()))};
}
inline void print_bf16(const char* what, const Bf16Diff& d, double rtol, size_t n) {
  std::printf(
      "  %-38s bf16: worst entry at %.3f of its bound (2^-7 + %.0e), rel. L2 %.2e, "
      "%.3f%% of %zu entries differ\n",
      what, d.worst, rtol, d.rel_l2, 100 * d.differ, n);
}

/// bf16 outputs that both sides round once from the same fp32 function: per entry (2⁻⁷ +
/// rtol)·max(|cpu|, 1% of max), relative L2 ≤ 2⁻⁸, at most `max_differ` of the entries off (the
/// file's comment says why).
Bf16Diff expect_bf16(const Bits& got, const Bits& want, double rtol, const char* what,
                     double max_differ = 0.1) {
  const Bf16Diff d = bf16_diff(got, want, rtol);
  print_bf16(what, d, rtol, got.size());
  expect_close(widen(got), widen(want), kUnit + rtol, what);
  EXPECT_LE(d.rel_l2, 1.0 / 256) << what;
  EXPECT_LE(d.differ, max_differ)
      << what << ": more entries differ than one rounding of the same fp32 values explains";
  return d;
}

/// bf16 outputs both sides compute with the same single fp32 operation: the same bits.
inline void expect_same_bits(const Bits& got, const Bits& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i].bits != want[i].bits && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: bits 0x" << std::hex << got[i].bits << ", want 0x"
                    << want[i].bits;
  std::printf("  %-38s bf16: %d of %zu entries differ in their bits (0 expected)\n", what, bad,
              got.size());
  EXPECT_EQ(bad, 0) << what;
}

class CudaKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    gpu = make_backend("cuda");
    cpu = make_backend("cpu");
  }
  /// A device copy of v (kept alive by the fixture).
  template <class T>
  T* up(const std::vector<T>& v) {
    buffers.emplace_back(MemKind::Scratch, sizeof(T) * v.size(), gpu->allocator());
    gpu->copy_from_host(buffers.back().data(), v.data(), sizeof(T) * v.size());
    return static_cast<T*>(buffers.back().data());
  }
  std::vector<float> down(const float* d, size_t n) {
    std::vector<float> h(n);
    gpu->copy_to_host(h.data(), d, sizeof(float) * n);
    return h;
  }
  Bits down_bits(const bf16_t* d, size_t n) {
    Bits h(n);
    gpu->copy_to_host(h.data(), d, sizeof(bf16_t) * n);
    return h;
  }
  /// A new CUDA backend made with these environment variables set (a CudaBackend reads its
  /// TRELLIS_* switches when it is made), the process's values put back after. One CUDA backend
  /// at a time (each has its own stream; device memory is allocated on the newest one's): the old
  /// one and the fixture's device buffers go first. A null value: the variable unset.
  void fresh_gpu(std::initializer_list<std::pair<const char*, const char*>> env) {
    buffers.clear();
    gpu.reset();
    std::vector<std::pair<std::string, std::optional<std::string>>> saved;
    for (auto [name, value] : env) {
      const char* v = std::getenv(name);
      saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      value ? setenv(name, value, 1) : unsetenv(name);
    }
    gpu = make_backend("cuda");
    for (auto& [name, value] : saved)
      value ? setenv(name.c_str(), value->c_str(), 1) : unsetenv(name.c_str());
  }
  struct AttentionShape {
    int B, T, H, KV, hd;
    std::string name() const { return strfmt("B%d T%d H%d KV%d hd%d", B, T, H, KV, hd); }
    size_t qkv_elems() const { return size_t(B) * T * (H + 2 * KV) * hd; }
    size_t out_elems() const { return size_t(B) * T * H * hd; }
  };
  struct AttentionRun {
    std::vector<float> qkv, dout;         // (B,T,(H+2KV)·hd), (B,T,H·hd): the inputs
    std::vector<float> out, state, dqkv;  // (B,T,H·hd), attention_state_elems, like qkv
  };
  /// Attention forward and backward on `be`: on random inputs drawn from `seed`, or on `inputs`'
  /// when given; outputs start as `poison` (9 by default: a value no attention produces here).
  AttentionRun attention_on(Backend& be, const AttentionShape& s, uint32_t seed,
                            const AttentionRun* inputs, float poison = 9.f) {
    const size_t nqkv = size_t(s.B) * s.T * (s.H + 2 * s.KV) * s.hd,
                 nout = size_t(s.B) * s.T * s.H * s.hd,
                 nstate = size_t(be.attention_state_elems(s.B, s.T, s.H));
    AttentionRun r;
    r.qkv = inputs ? inputs->qkv : random_vec(nqkv, seed, -2.f, 2.f);
    r.dout = inputs ? inputs->dout : random_vec(nout, seed + 1);
    r.out.assign(nout, poison);
    r.state.assign(nstate, poison);
    r.dqkv.assign(nqkv, poison);
    if (&be == cpu.get()) {
      be.attention_forward(r.out.data(), r.state.data(), r.qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
      be.attention_backward(r.dqkv.data(), r.dout.data(), r.qkv.data(), r.out.data(),
                            r.state.data(), s.B, s.T, s.H, s.KV, s.hd);
      return r;
    }
    float *d_qkv = up(r.qkv), *d_dout = up(r.dout), *d_out = up(r.out), *d_state = up(r.state),
          *d_dqkv = up(r.dqkv);
    be.attention_forward(d_out, d_state, d_qkv, s.B, s.T, s.H, s.KV, s.hd);
    be.attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_state, s.B, s.T, s.H, s.KV, s.hd);
    r.out = down(d_out, nout);
    r.state = down(d_state, nstate);
    r.dqkv = down(d_dqkv, nqkv);
    return r;
  }
  struct Bf16AttentionRun {
    Bits out, dqkv;            // (B,T,H·hd), (B,T,(H+2KV)·hd)
    std::vector<float> state;  // attention_state_elems (the GPU's: each row's logsumexp, (B,H,T))
  };
  /// bf16 attention on `be`: forward of qkv (B,T,(H+2KV)·hd), then backward of dout (B,T,H·hd)
  /// on the forward's own out (as the model runs them); outputs poisoned with NaN first. On the
  /// GPU every tensor starts `offset` elements into its buffer (to break its alignment).
  Bf16AttentionRun attention_bf16_on(Backend& be, const AttentionShape& s, const Bits& qkv,
                                     const Bits& dout, int offset = 0) {
    const size_t nstate = size_t(be.attention_state_elems(s.B, s.T, s.H));
    Bf16AttentionRun r{bf16_nan(s.out_elems()), bf16_nan(s.qkv_elems()),
                       std::vector<float>(nstate, NAN)};
    if (&be == cpu.get()) {
      be.attention_forward(r.out.data(), r.state.data(), qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
      be.attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.state.data(),
                            s.B, s.T, s.H, s.KV, s.hd);
      return r;
    }
    auto shifted = [&](const Bits& v) {
      Bits x(offset, bf16_t{kNaN16});
      x.insert(x.end(), v.begin(), v.end());
      return up(x) + offset;
    };
    bf16_t *d_qkv = shifted(qkv), *d_dout = shifted(dout), *d_out = shifted(r.out),
           *d_dqkv = shifted(r.dqkv);
    float* d_state = up(r.state);
    be.attention_forward(d_out, d_state, d_qkv, s.B, s.T, s.H, s.KV, s.hd);
    be.attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_state, s.B, s.T, s.H, s.KV, s.hd);
    r.out = down_bits(d_out, s.out_elems());
    r.dqkv = down_bits(d_dqkv, s.qkv_elems());
    r.state = down(d_state, nstate);
    return r;
  }
  /// Each attention row's logsumexp (B,H,T) in double from the values of qkv (B,T,(H+2KV)·hd):
  /// what the GPU keeps as attention's state (the CPU keeps the probabilities).
  static std::vector<double> lse_reference(const std::vector<float>& qkv, const AttentionShape& s) {
    std::vector<double> lse(size_t(s.B) * s.H * s.T);
    const int64_t R = int64_t(s.H + 2 * s.KV) * s.hd;
    for (int b = 0; b < s.B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < s.T; ++t) {
          const float* q = &qkv[(int64_t(b) * s.T + t) * R + int64_t(h) * s.hd];
          std::vector<double> dots(t + 1);
          double mx = -INFINITY, sum = 0.0;
          for (int j = 0; j <= t; ++j) {
            const float* k =
                &qkv[(int64_t(b) * s.T + j) * R + int64_t(s.H + h / (s.H / s.KV)) * s.hd];
            double dot = 0.0;
            for (int d = 0; d < s.hd; ++d) dot += double(q[d]) * k[d];
            dots[j] = dot / std::sqrt(double(s.hd));
            mx = std::max(mx, dots[j]);
          }
          for (double x : dots) sum += std::exp(x - mx);
          lse[(size_t(b) * s.H + h) * s.T + t] = mx + std::log(sum);
        }
    return lse;
  }
  /// dqkv (B,T,(H+2KV)·hd) in double from qkv, dout (B,T,H·hd) and out (B,T,H·hd) as a GPU
  /// computes it: P from the scores and their logsumexp, dS = P∘(dP − D) with D = Σ_d dout·out of
  /// the out it is given — the stored one (bf16 in a bf16 run), as FlashAttention does. (The CPU
  /// keeps P and sums P·dP instead: the unrounded out. In a bf16 run the two differ by what
  /// rounding out moves D, which dP − D, a difference of near values, magnifies: about 2e-3 in
  /// relative L2 on these shapes, single entries by several bf16 units.)
  static std::vector<double> attention_backward_reference(const std::vector<float>& qkv,
                                                          const std::vector<float>& dout,
                                                          const std::vector<float>& out,
                                                          const AttentionShape& s) {
    const std::vector<double> lse = lse_reference(qkv, s);
    const int64_t R = int64_t(s.H + 2 * s.KV) * s.hd, O = int64_t(s.H) * s.hd;
    const double scale = 1.0 / std::sqrt(double(s.hd));
    std::vector<double> dqkv(qkv.size(), 0.0);
    for (int b = 0; b < s.B; ++b)
      for (int h = 0; h < s.H; ++h) {
        const int64_t qc = int64_t(h) * s.hd, g = h / (s.H / s.KV);
        const int64_t kc = int64_t(s.H + g) * s.hd, vc = int64_t(s.H + s.KV + g) * s.hd;
        for (int t = 0; t < s.T; ++t) {
          const int64_t rt = (int64_t(b) * s.T + t) * R, ot = (int64_t(b) * s.T + t) * O + qc;
          double D = 0.0;
          for (int d = 0; d < s.hd; ++d) D += double(dout[ot + d]) * out[ot + d];
          for (int j = 0; j <= t; ++j) {
            const int64_t rj = (int64_t(b) * s.T + j) * R;
            double dot = 0.0, dP = 0.0;
            for (int d = 0; d < s.hd; ++d) {
              dot += double(qkv[rt + qc + d]) * qkv[rj + kc + d];
              dP += double(dout[ot + d]) * qkv[rj + vc + d];
            }
            const double P = std::exp(dot * scale - lse[(size_t(b) * s.H + h) * s.T + t]);
            const double dS = P * (dP - D);
            for (int d = 0; d < s.hd; ++d) {
              dqkv[rt + qc + d] += scale * dS * qkv[rj + kc + d];
              dqkv[rj + kc + d] += scale * dS * qkv[rt + qc + d];
              dqkv[rj + vc + d] += P * dout[ot + d];
            }
          }
        }
      }
    return dqkv;
  }
  /// A bf16 attention run on the fp32 kernels (widened) against the CPU's: out to the fp32 bound
  /// 1e-4 plus one bf16 unit; dqkv to 1e-3 plus one unit against the double reference from the
  /// stored out (attention_backward_reference), and within 1e-2 relative L2 of the CPU's.
  static void expect_widened_attention(const Bf16AttentionRun& got, const Bf16AttentionRun& want,
                                       const Bits& qkv, const Bits& dout, const AttentionShape& s) {
    expect_bf16(got.out, want.out, 1e-4, "out");
    const std::vector<double> ref =
        attention_backward_reference(widen(qkv), widen(dout), widen(got.out), s);
    expect_bf16(got.dqkv, bits_of(std::vector<float>(ref.begin(), ref.end())), 1e-3,
                "dqkv (double, D of the stored out)");
    const Bf16Diff cpu_d = bf16_diff(got.dqkv, want.dqkv, 1e-3);
    print_bf16("dqkv against the CPU's", cpu_d, 1e-3, got.dqkv.size());
    EXPECT_LE(cpu_d.rel_l2, 1e-2) << "dqkv against the CPU's";
  }
  /// The vocab-parallel cross-entropy's three steps on `be` (one rank: no reductions between
  /// them): row_max (N), sums (2,N) (Σexp, then the target's logit), losses (N); logits (N,V)
  /// become dlogits in place unless dloss is 0.
  static void crossentropy_on(Backend& be, Ptr logits, const int32_t* targets, float* row_max,
                              float* sums, float* losses, int N, int V, int valid, int vocab_begin,
                              float dloss) {
    be.crossentropy_max(logits, row_max, N, V, valid);
    be.crossentropy_sums(logits, targets, row_max, sums, sums + N, N, V, valid, vocab_begin);
    be.crossentropy_finish(logits, losses, targets, row_max, sums, sums + N, N, V, valid,
                           vocab_begin, dloss);
  }
  static double gemm_rtol() {
    const char* tf32 = std::getenv("TRELLIS_TF32");
    return tf32 && std::strcmp(tf32, "0") != 0 ? 2e-2 : 1e-4;
  }
  /// dbias: cuBLASLt's BGRADB epilogue sums over N in an order of its own (maybe split over the
  /// GEMM's k, maybe of TF32-rounded values), not the CPU's (the emulated one sums in the CPU's
  /// order): an entry whose terms cancel is off by more than 1e-5 of the tensor's scale.
  static double dbias_rtol() { return gemm_rtol(); }
  std::unique_ptr<Backend> gpu, cpu;
  std::vector<Buffer> buffers;
};

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
