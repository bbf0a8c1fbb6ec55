// The bf16 defaults of the Backend's kernels: each bf16 tensor widened to fp32 scratch, the fp32
// kernel, the bf16 outputs rounded back (backend.hpp). This is the whole bf16 path of the CPU
// backend and the fallback of any bf16 kernel cuda does not have; what it computes is what a bf16
// kernel computing in fp32 computes: inputs read as their fp32 values, outputs rounded once.
#include <algorithm>

#include "backend/backend.hpp"
#include "core/error.hpp"

namespace trellis {

// ---- scratch ----

namespace {
constexpr size_t kWidenAlign = 64;
size_t aligned(size_t bytes) { return (bytes + kWidenAlign - 1) / kWidenAlign * kWidenAlign; }
}  // namespace

float* Backend::take_widening(size_t bytes) {
  bytes = aligned(std::max<size_t>(bytes, 1));
  // The first slice of an outermost call: grow the arena first if an earlier call outgrew it
  // (here, not when that call ended: an allocation that fails must throw from a kernel call,
  // never from a destructor).
  if (widen_depth_ == 1 && widen_used_ == 0 && widen_grow_to_ > widen_arena_.bytes()) {
    widen_arena_.reset();
    widen_arena_ = Buffer(MemKind::Scratch, widen_grow_to_, allocator());
  }
  widen_call_peak_ += bytes;
  if (widen_used_ + bytes <= widen_arena_.bytes()) {
    float* p = reinterpret_cast<float*>(static_cast<char*>(widen_arena_.data()) + widen_used_);
    widen_used_ += bytes;
    return p;
  }
  widen_overflow_.emplace_back(MemKind::Scratch, bytes, allocator());
  return widen_overflow_.back().f32();
}

void Backend::end_widening(size_t mark) noexcept {
  widen_used_ = mark;
  if (--widen_depth_ > 0) return;  // a nested call: its overflow lives until the outermost ends
  if (!widen_overflow_.empty()) {
    // The call did not fit: free its overflow buffers and the old arena (a device backend frees
    // in stream order: kernels still reading them finish first; the CPU's have finished), and
    // let the next call allocate one arena of this call's total.
    widen_overflow_.clear();
    widen_arena_.reset();
    widen_grow_to_ = std::max(widen_grow_to_, widen_call_peak_);
  }
  widen_call_peak_ = 0;
}

void Backend::reserve_widening(size_t bytes) {
  if (widen_depth_ != 0 || bytes <= widen_arena_.bytes()) return;
  widen_arena_.reset();
  widen_arena_ = Buffer(MemKind::Scratch, bytes, allocator());
  widen_grow_to_ = std::max(widen_grow_to_, bytes);
}

Backend::Widened::~Widened() { be_.end_widening(mark_); }

float* Backend::Widened::widen(const void* tensor, int64_t n, bool copy_in, bool output) {
  for (Entry& e : entries_) {
    if (e.tensor != tensor) continue;
    TRELLIS_CHECK(e.n == n, "one bf16 tensor passed with two sizes (%lld, %lld)", (long long)e.n,
                  (long long)n);
    e.output = e.output || output;
    return e.widened;
  }
  float* f = be_.take_widening(size_t(n) * sizeof(float));
  if (copy_in) be_.from_bf16(f, static_cast<const bf16_t*>(tensor), n);
  entries_.push_back({tensor, n, f, output});
  return f;
}

const float* Backend::Widened::in(CPtr p, int64_t n) {
  if (!p.data || p.dtype == DType::f32) return p.f32();
  return widen(p.data, n, true, false);
}

float* Backend::Widened::out(Ptr p, int64_t n, bool reads_it) {
  if (!p.data || p.dtype == DType::f32) return p.f32();
  return widen(p.data, n, reads_it, true);
}

void Backend::Widened::finish() {
  for (const Entry& e : entries_)
    if (e.output) be_.to_bf16(static_cast<bf16_t*>(const_cast<void*>(e.tensor)), e.widened, e.n);
}

// ---- the kernels, widened. Sizes as in backend.hpp. Inputs are widened before outputs are
//      handed out (an output may alias an input: it then shares its widened copy). ----

void Backend::embedding_forward_bf16(Ptr out, const int32_t* tokens, CPtr wte, int N, int C,
                                     int vocab_begin, int vocab_count) {
  Widened w(*this);
  const float* table = w.in(wte, int64_t(vocab_count) * C);
  embedding_forward_f32(w.out(out, int64_t(N) * C), tokens, table, N, C, vocab_begin, vocab_count);
  w.finish();
}

void Backend::embedding_backward_bf16(float* dwte, CPtr dout, const int32_t* tokens, int N, int C,
                                      int vocab_begin, int vocab_count) {
  Widened w(*this);
  embedding_backward_f32(dwte, w.in(dout, int64_t(N) * C), tokens, N, C, vocab_begin, vocab_count);
}

void Backend::position_forward_bf16(Ptr out, CPtr wpe, int rows, int T, int C, int first_row) {
  Widened w(*this);
  const float* table = w.in(wpe, int64_t(T) * C);
  position_forward_f32(w.out(out, int64_t(rows) * C, true), table, rows, T, C, first_row);
  w.finish();
}

void Backend::position_backward_bf16(float* dwpe, CPtr dout, int rows, int T, int C,
                                     int first_row) {
  Widened w(*this);
  position_backward_f32(dwpe, w.in(dout, int64_t(rows) * C), rows, T, C, first_row);
}

void Backend::layernorm_forward_bf16(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight,
                                     CPtr bias, int N, int C) {
  Widened w(*this);
  const float* x = w.in(inp, int64_t(N) * C);
  const float* g = w.in(weight, C);
  const float* b = w.in(bias, C);
  layernorm_forward_f32(w.out(out, int64_t(N) * C), mean, rstd, x, g, b, N, C);
  w.finish();
}

void Backend::residual_layernorm_forward_bf16(Ptr res, Ptr out, float* mean, float* rstd, CPtr a,
                                              CPtr b, CPtr weight, CPtr bias, int N, int C) {
  const int64_t n = int64_t(N) * C;
  Widened w(*this);
  const float* x = w.in(a, n);
  const float* y = w.in(b, n);
  const float* g = w.in(weight, C);
  const float* beta = w.in(bias, C);
  float* r = w.out(res, n);
  add_f32(r, x, y, n);
  // The norm reads the sum as stored: with a bf16 res, rounded first (the fused fp32 kernel
  // would norm the unrounded sum).
  if (!res.is_f32()) {
    to_bf16(res.bf16(), r, n);
    from_bf16(r, res.bf16(), n);
  }
  layernorm_forward_f32(w.out(out, n), mean, rstd, r, g, beta, N, C);
  w.finish();
}

void Backend::layernorm_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                      CPtr weight, const float* mean, const float* rstd, int N,
                                      int C) {
  const int64_t n = int64_t(N) * C;
  Widened w(*this);
  const float* d = w.in(dout, n);
  const float* x = w.in(inp, n);
  const float* g = w.in(weight, C);
  layernorm_backward_f32(w.out(dinp, n, true), dweight, dbias, d, x, g, mean, rstd, N, C);
  w.finish();
}

void Backend::matmul_forward_bf16(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC) {
  Widened w(*this);
  const float* x = w.in(inp, int64_t(N) * C);
  const float* W = w.in(weight, int64_t(OC) * C);
  const float* b = w.in(bias, OC);
  matmul_forward_f32(w.out(out, int64_t(N) * OC), x, W, b, N, C, OC);
  w.finish();
}

void Backend::matmul_residual_forward_bf16(Ptr out, CPtr residual, CPtr inp, CPtr weight,
                                           CPtr bias, int N, int C, int OC) {
  Widened w(*this);  // (out rounded once, from the fp32 sum with the residual)
  const float* r = w.in(residual, int64_t(N) * OC);
  const float* x = w.in(inp, int64_t(N) * C);
  const float* W = w.in(weight, int64_t(OC) * C);
  const float* b = w.in(bias, OC);
  matmul_residual_forward_f32(w.out(out, int64_t(N) * OC), r, x, W, b, N, C, OC);
  w.finish();
}

void Backend::matmul_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                   CPtr weight, int N, int C, int OC) {
  Widened w(*this);
  const float* d = w.in(dout, int64_t(N) * OC);
  const float* x = w.in(inp, int64_t(N) * C);
  const float* W = w.in(weight, int64_t(OC) * C);
  matmul_backward_f32(w.out(dinp, int64_t(N) * C), dweight, dbias, d, x, W, N, C, OC);
  w.finish();
}

void Backend::matmul_gelu_forward_bf16(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N,
                                       int C, int OC) {
  // Both outputs from the fp32 pre-activation, each rounded once (as a GEMM epilogue would).
  Widened w(*this);
  const float* x = w.in(inp, int64_t(N) * C);
  const float* W = w.in(weight, int64_t(OC) * C);
  const float* b = w.in(bias, OC);
  matmul_gelu_forward_f32(w.out(pre, int64_t(N) * OC), w.out(out, int64_t(N) * OC), x, W, b, N, C,
                          OC);
  w.finish();
}

bool Backend::matmul_backward_gelu_bf16(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                                        float* dbias_pre, CPtr dout, CPtr inp, CPtr pre,
                                        CPtr weight, int N, int C, int OC) {
  const int64_t n = int64_t(N) * C;
  Widened w(*this);
  const float* d = w.in(dout, int64_t(N) * OC);
  const float* x = w.in(inp, n);
  const float* p = w.in(pre, n);
  const float* W = w.in(weight, int64_t(OC) * C);
  // (dbias_pre from the fp32 dpre, where the fp32 kernel sums it: not from dpre as rounded)
  const bool summed = matmul_backward_gelu_f32(w.out(dpre, n), w.out(dinp_scratch, n), dweight,
                                               dbias, dbias_pre, d, x, p, W, N, C, OC);
  w.finish();
  return summed;
}

void Backend::attention_forward_bf16(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV,
                                     int hd) {
  const int64_t rows = int64_t(B) * T;
  Widened w(*this);
  const float* q = w.in(qkv, rows * (H + 2 * KV) * hd);
  attention_forward_f32(w.out(out, rows * H * hd), att, q, B, T, H, KV, hd);
  w.finish();
}

void Backend::attention_backward_bf16(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att,
                                      int B, int T, int H, int KV, int hd) {
  const int64_t rows = int64_t(B) * T;
  Widened w(*this);
  const float* d = w.in(dout, rows * H * hd);
  const float* q = w.in(qkv, rows * (H + 2 * KV) * hd);
  const float* o = w.in(out, rows * H * hd);
  attention_backward_f32(w.out(dqkv, rows * (H + 2 * KV) * hd), d, q, o, att, B, T, H, KV, hd);
  w.finish();
}

void Backend::gelu_forward_bf16(Ptr out, CPtr inp, int64_t n) {
  Widened w(*this);
  const float* x = w.in(inp, n);
  gelu_forward_f32(w.out(out, n), x, n);
  w.finish();
}

void Backend::gelu_backward_bf16(Ptr dinp, CPtr inp, CPtr dout, int64_t n) {
  Widened w(*this);
  const float* x = w.in(inp, n);
  const float* d = w.in(dout, n);
  gelu_backward_f32(w.out(dinp, n), x, d, n);
  w.finish();
}

void Backend::add_bf16(Ptr out, CPtr a, CPtr b, int64_t n) {
  Widened w(*this);
  const float* x = w.in(a, n);
  const float* y = w.in(b, n);
  add_f32(w.out(out, n), x, y, n);
  w.finish();
}

void Backend::crossentropy_max_bf16(CPtr logits, float* row_max, int N, int V, int valid) {
  Widened w(*this);
  crossentropy_max_f32(w.in(logits, int64_t(N) * V), row_max, N, V, valid);
}

void Backend::crossentropy_sums_bf16(CPtr logits, const int32_t* targets, const float* row_max,
                                     float* sumexp, float* target_logit, int N, int V, int valid,
                                     int vocab_begin) {
  Widened w(*this);
  crossentropy_sums_f32(w.in(logits, int64_t(N) * V), targets, row_max, sumexp, target_logit, N, V,
                        valid, vocab_begin);
}

void Backend::crossentropy_finish_bf16(Ptr logits, float* losses, const int32_t* targets,
                                       const float* row_max, const float* sumexp,
                                       const float* target_logit, int N, int V, int valid,
                                       int vocab_begin, float dloss) {
  // In place: the logits are read (the losses), then overwritten by dlogits when dloss ≠ 0.
  Widened w(*this);
  float* l = w.out(logits, int64_t(N) * V, true);
  crossentropy_finish_f32(l, losses, targets, row_max, sumexp, target_logit, N, V, valid,
                          vocab_begin, dloss);
  if (dloss != 0.0f) w.finish();
}

}  // namespace trellis
