// The kernels on bf16 tensors through the Backend's widening default (backend_bf16.cpp), which is
// the CPU backend's whole bf16 path and the fallback of cuda's: every call must give exactly what
// the fp32 kernel gives on the bf16 values widened, with each bf16 output rounded once (to
// nearest even) — bit for bit, whatever the kernel. Also: outputs that accumulate (+=) read their
// old bf16 values, tensors passed twice (in place) share one widened copy, a mix of fp32 and bf16
// tensors works, fp32 outputs (gradients, statistics) stay fp32, and a tensor of the wrong type is
// a programming error.
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>

#include "core/bf16.hpp"
#include "backend/cpu/cpu_backend.hpp"
#include "backend_test_util.hpp"

namespace trellis::test {
namespace {

/// A bf16 tensor on the host and the fp32 values it holds (for the reference call).
struct Bf16Vec {
  std::vector<bf16_t> bits;
  explicit Bf16Vec(const std::vector<float>& x) : bits(x.size()) {
    for (size_t i = 0; i < x.size(); ++i) bits[i].bits = float_to_bf16_bits(x[i]);
  }
  std::vector<float> widened() const {
    std::vector<float> f(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) f[i] = bf16_bits_to_float(bits[i].bits);
    return f;
  }
  Ptr ptr() { return bits.data(); }
};

/// The fp32 values rounded to bf16 bits (what a bf16 output must hold).
std::vector<uint16_t> rounded_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16_bits(x[i]);
  return b;
}
std::vector<uint16_t> bits_of(const Bf16Vec& v) {
  std::vector<uint16_t> b(v.bits.size());
  for (size_t i = 0; i < b.size(); ++i) b[i] = v.bits[i].bits;
  return b;
}

/// Random values already representable in bf16 (so fp32 reference inputs equal the bf16 ones).
std::vector<float> bf16_values(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return round_to_bf16(random_vec(n, seed, lo, hi));
}

class Bf16Kernels : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST_F(Bf16Kernels, MatmulForwardIsTheFp32KernelOnWidenedValuesRoundedOnce) {
  const int N = 37, C = 24, OC = 19;
  const auto x = bf16_values(N * C, 1), w = bf16_values(OC * C, 2), b = bf16_values(OC, 3);
  Bf16Vec X(x), W(w), B(b), Y(std::vector<float>(N * OC, 0.0f));
  be->matmul_forward(Y.ptr(), X.ptr(), W.ptr(), B.ptr(), N, C, OC);
  std::vector<float> ref(N * OC);
  be->matmul_forward(ref.data(), x.data(), w.data(), b.data(), N, C, OC);
  EXPECT_EQ(bits_of(Y), rounded_bits(ref));
  // The rounding really happened: some fp32 result is not a bf16 value.
  EXPECT_NE(round_to_bf16(ref), ref);
}

TEST_F(Bf16Kernels, MatmulBackwardKeepsFp32GradientsAndRoundsDinp) {
  const int N = 21, C = 16, OC = 12;
  const auto dout = bf16_values(N * OC, 4), x = bf16_values(N * C, 5), w = bf16_values(OC * C, 6);
  const auto dw0 = random_vec(OC * C, 7), db0 = random_vec(OC, 8);  // fp32, accumulated into
  Bf16Vec D(dout), X(x), W(w), DX(std::vector<float>(N * C, 0.0f));
  std::vector<float> dw = dw0, db = db0, dw_ref = dw0, db_ref = db0, dx_ref(N * C);
  be->matmul_backward(DX.ptr(), dw.data(), db.data(), D.ptr(), X.ptr(), W.ptr(), N, C, OC);
  be->matmul_backward(dx_ref.data(), dw_ref.data(), db_ref.data(), dout.data(), x.data(), w.data(),
                      N, C, OC);
  EXPECT_EQ(bits_of(DX), rounded_bits(dx_ref));
  EXPECT_EQ(dw, dw_ref);  // fp32 outputs: the same bits, not rounded
  EXPECT_EQ(db, db_ref);
}

TEST_F(Bf16Kernels, MatmulWithGeluBothWays) {
  const int N = 18, C = 16, OC = 40;
  const auto x = bf16_values(N * C, 9), w = bf16_values(OC * C, 10), b = bf16_values(OC, 11);
  Bf16Vec X(x), W(w), B(b), PRE(std::vector<float>(N * OC)), OUT(std::vector<float>(N * OC));
  be->matmul_gelu_forward(PRE.ptr(), OUT.ptr(), X.ptr(), W.ptr(), B.ptr(), N, C, OC);
  std::vector<float> pre(N * OC), out(N * OC);
  be->matmul_gelu_forward(pre.data(), out.data(), x.data(), w.data(), b.data(), N, C, OC);
  EXPECT_EQ(bits_of(PRE), rounded_bits(pre));
  EXPECT_EQ(bits_of(OUT), rounded_bits(out));  // gelu of the unrounded pre-activation

  // Backward of the layer after it: inp = gelu(pre) (N,OC) → (N,C2).
  const int C2 = 8;
  const auto dout = bf16_values(N * C2, 12), w2 = bf16_values(C2 * OC, 13);
  const auto g = OUT.widened(), p = PRE.widened();
  Bf16Vec D(dout), W2(w2), DPRE(std::vector<float>(N * OC)), SCR(std::vector<float>(N * OC));
  std::vector<float> dw(C2 * OC, 0.f), db(C2, 0.f), dw_ref = dw, db_ref = db;
  // (the CPU leaves dpre's column sums to the caller: dbias_pre untouched, false)
  std::vector<float> dbp(OC, 0.5f);
  EXPECT_FALSE(be->matmul_backward_gelu(DPRE.ptr(), SCR.ptr(), dw.data(), db.data(), dbp.data(),
                                        D.ptr(), OUT.ptr(), PRE.ptr(), W2.ptr(), N, OC, C2));
  std::vector<float> dpre(N * OC), scratch(N * OC);
  be->matmul_backward_gelu(dpre.data(), scratch.data(), dw_ref.data(), db_ref.data(), nullptr,
                           dout.data(), g.data(), p.data(), w2.data(), N, OC, C2);
  EXPECT_EQ(bits_of(DPRE), rounded_bits(dpre));
  EXPECT_EQ(dw, dw_ref);
  EXPECT_EQ(db, db_ref);
  EXPECT_EQ(dbp, std::vector<float>(OC, 0.5f));
}

TEST_F(Bf16Kernels, LayerNormForwardBackwardAndTheFusedResidual) {
  const int N = 13, C = 40;
  const auto x = bf16_values(N * C, 14, -2, 2), w = bf16_values(C, 15), b = bf16_values(C, 16);
  Bf16Vec X(x), W(w), B(b), OUT(std::vector<float>(N * C));
  std::vector<float> mean(N), rstd(N), mean_ref(N), rstd_ref(N), out(N * C);
  be->layernorm_forward(OUT.ptr(), mean.data(), rstd.data(), X.ptr(), W.ptr(), B.ptr(), N, C);
  be->layernorm_forward(out.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), b.data(),
                        N, C);
  EXPECT_EQ(bits_of(OUT), rounded_bits(out));
  EXPECT_EQ(mean, mean_ref);  // statistics fp32
  EXPECT_EQ(rstd, rstd_ref);

  // Backward: dinp accumulates into its old bf16 values.
  const auto dout = bf16_values(N * C, 17), dinp0 = bf16_values(N * C, 18);
  Bf16Vec D(dout), DX(dinp0);
  std::vector<float> dw(C, 0.f), db(C, 0.f), dw_ref = dw, db_ref = db, dx = dinp0;
  be->layernorm_backward(DX.ptr(), dw.data(), db.data(), D.ptr(), X.ptr(), W.ptr(), mean.data(),
                         rstd.data(), N, C);
  be->layernorm_backward(dx.data(), dw_ref.data(), db_ref.data(), dout.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
  EXPECT_EQ(bits_of(DX), rounded_bits(dx));
  EXPECT_EQ(dw, dw_ref);
  EXPECT_EQ(db, db_ref);

  // res = a + b in place of a, then its norm: the norm reads the rounded sum.
  const auto a = bf16_values(N * C, 19), c = bf16_values(N * C, 20);
  Bf16Vec A(a), Cv(c), OUT2(std::vector<float>(N * C));
  be->residual_layernorm_forward(A.ptr(), OUT2.ptr(), mean.data(), rstd.data(), A.ptr(), Cv.ptr(),
                                 W.ptr(), B.ptr(), N, C);
  std::vector<float> sum(N * C), out2(N * C);
  for (int i = 0; i < N * C; ++i) sum[i] = round_to_bf16(a[i] + c[i]);
  be->layernorm_forward(out2.data(), mean_ref.data(), rstd_ref.data(), sum.data(), w.data(),
                        b.data(), N, C);
  EXPECT_EQ(bits_of(A), rounded_bits(sum));
  EXPECT_EQ(bits_of(OUT2), rounded_bits(out2));
  EXPECT_EQ(mean, mean_ref);
}

TEST_F(Bf16Kernels, AttentionBothWays) {
  const int B = 2, T = 9, H = 4, KV = 2, hd = 8, QKV = (H + 2 * KV) * hd;
  const auto qkv = bf16_values(B * T * QKV, 21);
  Bf16Vec Q(qkv), OUT(std::vector<float>(B * T * H * hd));
  const int64_t state = be->attention_state_elems(B, T, H);
  std::vector<float> att(state), att_ref(state), out(B * T * H * hd);
  be->attention_forward(OUT.ptr(), att.data(), Q.ptr(), B, T, H, KV, hd);
  be->attention_forward(out.data(), att_ref.data(), qkv.data(), B, T, H, KV, hd);
  EXPECT_EQ(bits_of(OUT), rounded_bits(out));
  EXPECT_EQ(att, att_ref);

  const auto dout = bf16_values(B * T * H * hd, 22);
  const auto o = OUT.widened();
  Bf16Vec D(dout), DQKV(std::vector<float>(B * T * QKV));
  std::vector<float> dqkv(B * T * QKV);
  be->attention_backward(DQKV.ptr(), D.ptr(), Q.ptr(), OUT.ptr(), att.data(), B, T, H, KV, hd);
  be->attention_backward(dqkv.data(), dout.data(), qkv.data(), o.data(), att.data(), B, T, H, KV,
                         hd);
  EXPECT_EQ(bits_of(DQKV), rounded_bits(dqkv));
}

TEST_F(Bf16Kernels, EmbeddingsAndPositions) {
  const int V = 11, C = 8, N = 12, T = 4;
  const std::vector<int32_t> tokens = {3, 0, 10, 3, 7, 1, 1, 9, 2, 5, 6, 4};
  const auto wte = bf16_values(V * C, 23), wpe = bf16_values(T * C, 24);
  Bf16Vec WTE(wte), WPE(wpe), X(std::vector<float>(N * C));
  be->embedding_forward(X.ptr(), tokens.data(), WTE.ptr(), N, C, 0, V);
  be->position_forward(X.ptr(), WPE.ptr(), N, T, C, 0);  // += into bf16: rounds the sum
  std::vector<float> x(N * C);
  be->embedding_forward(x.data(), tokens.data(), wte.data(), N, C, 0, V);
  be->position_forward(x.data(), wpe.data(), N, T, C, 0);
  EXPECT_EQ(bits_of(X), rounded_bits(x));

  const auto dout = bf16_values(N * C, 25);
  Bf16Vec D(dout);
  std::vector<float> dwte(V * C, 0.f), dwpe(T * C, 0.f), dwte_ref = dwte, dwpe_ref = dwpe;
  be->embedding_backward(dwte.data(), D.ptr(), tokens.data(), N, C, 0, V);
  be->position_backward(dwpe.data(), D.ptr(), N, T, C, 0);
  be->embedding_backward(dwte_ref.data(), dout.data(), tokens.data(), N, C, 0, V);
  be->position_backward(dwpe_ref.data(), dout.data(), N, T, C, 0);
  EXPECT_EQ(dwte, dwte_ref);
  EXPECT_EQ(dwpe, dwpe_ref);
}

TEST_F(Bf16Kernels, CrossEntropyOnBf16LogitsInPlace) {
  const int N = 7, V = 13, valid = 11;
  const auto logits = bf16_values(N * V, 26, -3, 3);
  const std::vector<int32_t> targets = {0, 5, 10, -1, 3, 12, 7};  // -1 ignored; 12 is padding
  Bf16Vec L(logits);
  std::vector<float> ref = logits;
  std::vector<float> mx(N), sums(2 * N), loss(N), mx_ref(N), sums_ref(2 * N), loss_ref(N);
  be->crossentropy_max(L.ptr(), mx.data(), N, V, valid);
  be->crossentropy_sums(L.ptr(), targets.data(), mx.data(), sums.data(), sums.data() + N, N, V,
                        valid, 0);
  be->crossentropy_finish(L.ptr(), loss.data(), targets.data(), mx.data(), sums.data(),
                          sums.data() + N, N, V, valid, 0, 0.25f);
  be->crossentropy_max(ref.data(), mx_ref.data(), N, V, valid);
  be->crossentropy_sums(ref.data(), targets.data(), mx_ref.data(), sums_ref.data(),
                        sums_ref.data() + N, N, V, valid, 0);
  be->crossentropy_finish(ref.data(), loss_ref.data(), targets.data(), mx_ref.data(),
                          sums_ref.data(), sums_ref.data() + N, N, V, valid, 0, 0.25f);
  EXPECT_EQ(mx, mx_ref);
  EXPECT_EQ(sums, sums_ref);
  EXPECT_EQ(loss, loss_ref);                 // fp32 losses
  EXPECT_EQ(bits_of(L), rounded_bits(ref));  // dlogits in place, rounded
}

TEST_F(Bf16Kernels, ElementWiseInPlaceAndMixedTypes) {
  const int64_t n = 1000;
  const auto a = bf16_values(n, 27, -3, 3), b = bf16_values(n, 28);
  // add in place of a
  Bf16Vec A(a), Bv(b);
  be->add(A.ptr(), A.ptr(), Bv.ptr(), n);
  std::vector<float> sum(n);
  for (int64_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
  EXPECT_EQ(bits_of(A), rounded_bits(sum));
  // gelu forward, then its backward in place of dout
  Bf16Vec X(a), G{std::vector<float>(n)}, D(b);
  be->gelu_forward(G.ptr(), X.ptr(), n);
  be->gelu_backward(D.ptr(), X.ptr(), D.ptr(), n);
  std::vector<float> g(n), d(n);
  be->gelu_forward(g.data(), a.data(), n);
  be->gelu_backward(d.data(), a.data(), b.data(), n);
  EXPECT_EQ(bits_of(G), rounded_bits(g));
  EXPECT_EQ(bits_of(D), rounded_bits(d));
  // A mix: fp32 a, bf16 b, bf16 out.
  Bf16Vec OUT{std::vector<float>(n)};
  be->add(OUT.ptr(), a.data(), Bv.ptr(), n);
  EXPECT_EQ(bits_of(OUT), rounded_bits(sum));
}

TEST_F(Bf16Kernels, ConvertRoundsAndWidens) {
  const auto x = random_vec(513, 29, -100, 100);
  std::vector<bf16_t> b(x.size());
  std::vector<float> back(x.size());
  be->convert(Ptr(b.data()), x.data(), int64_t(x.size()));
  be->convert(back.data(), CPtr(b.data()), int64_t(x.size()));
  EXPECT_EQ(back, round_to_bf16(x));
  std::vector<float> copy(x.size());
  be->convert(copy.data(), x.data(), int64_t(x.size()));  // same type: a copy
  EXPECT_EQ(copy, x);
}

// The widening arena: a call that does not fit grows it once, to that call's total, for every
// later call; a reservation holds it from the start; running out of memory inside a widened call
// is a std::bad_alloc from that call (never from a destructor), after which smaller calls work.
namespace {
/// Host memory that refuses any one allocation above `limit` bytes.
class LimitedAllocator : public Allocator {
 public:
  size_t limit = SIZE_MAX;
  void* allocate(size_t bytes) override {
    if (bytes > limit) throw std::bad_alloc();
    return host_allocator().allocate(bytes);
  }
  void release(void* p) override { host_allocator().release(p); }
  bool device() const override { return false; }
};
class LimitedCpu : public CpuBackend {
 public:
  Allocator* allocator() override { return &memory; }
  LimitedAllocator memory;
};

/// out (N,OC) = x · wᵀ on bf16 tensors: widens x, w and out (4·(N·C + OC·C + N·OC) bytes, each
/// slice 64-byte aligned).
size_t widened_matmul(Backend& be, int N, int C, int OC) {
  Bf16Vec X(bf16_values(size_t(N) * C, 1)), W(bf16_values(size_t(OC) * C, 2));
  Bf16Vec Y{std::vector<float>(size_t(N) * OC)};
  be.matmul_forward(Y.ptr(), X.ptr(), W.ptr(), nullptr, N, C, OC);
  auto slice = [](size_t n) { return (4 * n + 63) / 64 * 64; };
  return slice(size_t(N) * C) + slice(size_t(OC) * C) + slice(size_t(N) * OC);
}
}  // namespace

TEST(WideningArena, GrowsOnceToTheLargestCall) {
  CpuBackend be;
  EXPECT_EQ(be.widening_bytes(), 0u);
  const size_t small = widened_matmul(be, 8, 16, 4);
  EXPECT_EQ(be.widening_bytes(), small);
  const size_t big = widened_matmul(be, 64, 32, 48);
  EXPECT_EQ(be.widening_bytes(), big);
  widened_matmul(be, 8, 16, 4);  // fits: no growth
  EXPECT_EQ(be.widening_bytes(), big);
  CpuBackend reserved;
  reserved.reserve_widening(1 << 20);
  widened_matmul(reserved, 64, 32, 48);
  EXPECT_EQ(reserved.widening_bytes(), size_t(1) << 20);
}

TEST(WideningArena, OutOfMemoryInsideACallIsAnExceptionOfThatCall) {
  LimitedCpu be;
  widened_matmul(be, 8, 16, 4);
  be.memory.limit = 4096;  // the next call's slices (and its arena) cannot be had
  EXPECT_THROW(widened_matmul(be, 64, 32, 48), std::bad_alloc);
  // The arena is left consistent: a call that fits in what may still be allocated runs.
  be.memory.limit = SIZE_MAX;
  const size_t small = widened_matmul(be, 8, 16, 4);
  EXPECT_GE(be.widening_bytes(), small);
  const size_t big = widened_matmul(be, 64, 32, 48);
  widened_matmul(be, 64, 32, 48);
  EXPECT_EQ(be.widening_bytes(), big);
}

TEST(TypedPointers, TheWrongTypeIsAProgrammingError) {
  std::vector<bf16_t> b(4);
  std::vector<float> f(4);
  const Ptr pb(b.data()), pf(f.data());
  EXPECT_EQ(pf.f32(), f.data());
  EXPECT_EQ(pb.bf16(), b.data());
  EXPECT_THROW(pb.f32(), std::logic_error);
  EXPECT_THROW(pf.bf16(), std::logic_error);
  EXPECT_EQ(Ptr().f32(), nullptr);  // null: any type's (an absent bias)
  EXPECT_EQ(Ptr(nullptr, DType::bf16).f32(), nullptr);
  EXPECT_EQ(pb.at(3).data, static_cast<void*>(b.data() + 3));
  EXPECT_EQ(pf.at(3).data, static_cast<void*>(f.data() + 3));
  EXPECT_EQ(pb.bytes(5), 10u);
  // One bf16 tensor passed as two arguments of different sizes is a programming error too.
  auto be = make_backend("cpu");
  std::vector<float> mean(2), rstd(2);
  EXPECT_THROW(be->layernorm_forward(Ptr(b.data()), mean.data(), rstd.data(), CPtr(b.data()),
                                     CPtr(b.data()), CPtr(b.data()), 2, 2),
               std::logic_error);
}

}  // namespace
}  // namespace trellis::test
