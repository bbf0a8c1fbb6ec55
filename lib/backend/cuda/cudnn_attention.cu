// cuDNN's fused attention through its backend API (cudnn_attention.cuh says what and why).
//
// The graphs are the ones cuDNN's own frontend builds for scaled dot-product attention
// (its composite SDPA nodes), since the fused-attention engines recognise those: the forward
// S = Q·Kᵀ, scaled, masked (row index ≥ column index keeps), softmax with its statistics
// (max + ln Σ exp), P·V; the backward the same scores, P = exp(S − lse), dV = Pᵀ·dO,
// dP = dO·Vᵀ, dS = P·(dP − Σ dO·O)·scale, dK = dSᵀ·Q, dQ = dS·K, with grouped heads' dK and dV
// summed over their query heads by a reduction. Kᵀ and Vᵀ are the packed tensor read with their
// last two strides swapped; Pᵀ and dSᵀ reshapes. The backward's Σ dO·O and its dQ accumulator
// are fp32 tensors of ours in the workspace, dense, as the engines require.
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <vector>

#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/cudnn_attention.cuh"

#if __has_include(<cudnn_graph.h>)
#include "backend/cuda/cudnn_graph.cuh"
#include "core/shared_library.hpp"

namespace trellis::cuda {

namespace cudnn_backend {

const CudnnApi& cudnn() {
  static const CudnnApi api = [] {
    CudnnApi a{};
    const char* env = std::getenv("TRELLIS_CUDNN_LIBRARY");
    // libcudnn_graph.so.9 holds the backend API: the libcudnn.so.9 shim would load it lazily,
    // and abort where it cannot.
    a.file = env && *env ? env : "libcudnn_graph.so.9";
    SharedLibrary lib(a.file, "cuDNN 9");
    auto get = [&](auto& fn, const char* name) { lib.get(fn, name); };
    get(a.GetVersion, "cudnnGetVersion");
    get(a.GetCudartVersion, "cudnnGetCudartVersion");
    get(a.GetErrorString, "cudnnGetErrorString");
    get(a.GetLastErrorString, "cudnnGetLastErrorString");
    get(a.Create, "cudnnCreate");
    get(a.Destroy, "cudnnDestroy");
    get(a.SetStream, "cudnnSetStream");
    get(a.CreateDescriptor, "cudnnBackendCreateDescriptor");
    get(a.DestroyDescriptor, "cudnnBackendDestroyDescriptor");
    get(a.Finalize, "cudnnBackendFinalize");
    get(a.SetAttribute, "cudnnBackendSetAttribute");
    get(a.GetAttribute, "cudnnBackendGetAttribute");
    get(a.Execute, "cudnnBackendExecute");
    a.error = lib.finish();
    return a;
  }();
  return api;
}

void check(cudnnStatus_t status, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  std::string msg = std::string("cuDNN: ") + what + ": " + cudnn().GetErrorString(status);
  char last[512] = "";
  cudnn().GetLastErrorString(last, sizeof(last));
  if (last[0]) msg += std::string(" (") + last + ")";
  throw std::runtime_error(msg);
}

}  // namespace cudnn_backend

using namespace cudnn_backend;  // (Desc, Graph, cudnn(), check())

namespace {

// The non-virtual tensors' unique ids (the variant pack's), under the virtual ones'.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kOne,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
};
static_assert(kDQAccum < Graph::kFirstVirtualUid);

int64_t round_up(int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

// One pass: its graph and the plans of its engine configurations — the heuristics' first that
// builds, or (tuning) each that builds, timed against one another at the first call.
struct CudnnAttention::Plan {
  std::unique_ptr<Graph> graph;  // what the plans refer to, alive as long as they
  std::vector<Graph::Built> built;
  size_t chosen = 0;
  std::vector<float> ms;  // each one's time, where they were timed
  int64_t workspace() const {  // the engines' own: the largest (any of them may run)
    int64_t w = 0;
    for (const Graph::Built& b : built) w = std::max(w, b.workspace);
    return w;
  }
};

struct CudnnAttention::Passes {
  Plan forward, backward;
  int64_t dq_accum_bytes = 0, softmax_sum_bytes = 0;  // ours, ahead of the backward engine's
};

namespace {

// The packed tensor's views and the strides of the rest, (batch, head, row, column).
struct Layout {
  AttentionShape s;
  int64_t W() const { return int64_t(s.H + 2 * s.KV) * s.hd; }
  Dims heads(int n) const { return {s.B, n, s.T, s.hd}; }      // (B,n,T,hd)
  Dims heads_t(int n) const { return {s.B, n, s.hd, s.T}; }    // (B,n,hd,T)
  Dims packed() const { return {s.T * W(), s.hd, W(), 1}; }    // a view of qkv
  Dims packed_t() const { return {s.T * W(), s.hd, 1, W()}; }  // the same, transposed
  Dims rows() const { return {s.T * int64_t(s.H) * s.hd, s.hd, int64_t(s.H) * s.hd, 1}; }  // out
  Dims scores() const { return {s.B, s.H, s.T, s.T}; }  // (B,H,T,T)
  Dims scores_dense() const { return {int64_t(s.H) * s.T * s.T, int64_t(s.T) * s.T, s.T, 1}; }
  Dims scores_t() const { return {int64_t(s.H) * s.T * s.T, int64_t(s.T) * s.T, 1, s.T}; }
  Dims per_row() const { return {s.B, s.H, s.T, 1}; }  // (B,H,T,1)
  Dims per_row_dense() const { return {int64_t(s.H) * s.T, s.T, 1, 1}; }
  Dims full_dense() const {  // (B,H,T,hd) packed
    return {int64_t(s.H) * s.T * s.hd, int64_t(s.T) * s.hd, s.hd, 1};
  }
};

/// The causal mask on scores `s` (FLOAT, (B,H,T,T)): where the row index is below the column
/// index, -inf (cuDNN before 9.10: the lowest float). Returns the masked scores.
const Desc& causal_mask(Graph& g, const Layout& l, const Desc& s, const Desc& neg_inf) {
  const Desc& row = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_INT32);
  const Desc& col = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_INT32);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, row, CUDNN_DATA_INT32, nullptr, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, col, CUDNN_DATA_INT32, nullptr, 3);
  const Desc& keep = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, keep, CUDNN_DATA_BOOLEAN);
  const Desc& masked = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &neg_inf, masked, CUDNN_DATA_FLOAT, &keep);
  return masked;
}

/// The forward: out and the statistics (lse) from Q, K, V.
void build_forward(Graph& g, const Layout& l) {
  const AttentionShape& s = l.s;
  const Desc& q = g.tensor(l.heads(s.H), l.packed(), CUDNN_DATA_BFLOAT16, kQ);
  const Desc& kt = g.tensor(l.heads_t(s.KV), l.packed_t(), CUDNN_DATA_BFLOAT16, kK);
  const Desc& v = g.tensor(l.heads(s.KV), l.packed(), CUDNN_DATA_BFLOAT16, kV);
  const Desc& o = g.tensor(l.heads(s.H), l.rows(), CUDNN_DATA_BFLOAT16, kO);
  const Desc& stats = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT, kStats);
  const Desc& scale = g.scalar(kScale);
  const Desc& neg_inf = g.scalar(kNegInf);

  const Desc& s0 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.matmul(q, kt, s0);
  const Desc& s1 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, &scale, s1);
  const Desc& s2 = causal_mask(g, l, s1, neg_inf);
  const Desc& max = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s2, max);
  const Desc& s3 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, s2, &max, s3);
  const Desc& e = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, s3, nullptr, e);
  const Desc& sum = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const Desc& log_sum = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, max, &log_sum, stats);
  const Desc& p = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_BFLOAT16);  // P·V's A: bf16
  g.pointwise(CUDNN_POINTWISE_DIV, e, &sum, p);
  g.matmul(p, v, o);
}

/// The backward: dQ, dK, dV from Q, K, V, O, dO and the statistics. cuDNN's frontend masks the
/// scores after subtracting the statistics; its releases of 2024 masked them before: engines of
/// that time may know only that spelling (`mask_first`), tried where the other finds no engine.
/// `deterministic`: dQ = dS·K written straight to dQ, without the fp32 accumulator — the graph the
/// frontend builds for set_deterministic_algorithm(true), from which the engines take their
/// deterministic kernel (dP in a workspace of their own, about 2·B·H·T² bytes, instead of the key
/// tiles' sums added into the accumulator as they come).
void build_backward(Graph& g, const Layout& l, bool mask_first, bool deterministic) {
  const AttentionShape& s = l.s;
  // d = a·b per query head (B,H,T,hd), summed over each group's query heads where KV < H.
  const auto key_value_gradient = [&](const Desc& a, const Desc& b, const Desc& d) {
    if (s.KV == s.H) return g.matmul(a, b, d);
    const Desc& full = g.tensor(l.heads(s.H), l.full_dense(), CUDNN_DATA_BFLOAT16);
    g.matmul(a, b, full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, d);
  };
  const Desc& q = g.tensor(l.heads(s.H), l.packed(), CUDNN_DATA_BFLOAT16, kQ);
  const Desc& kt = g.tensor(l.heads_t(s.KV), l.packed_t(), CUDNN_DATA_BFLOAT16, kK);
  const Desc& vt = g.tensor(l.heads_t(s.KV), l.packed_t(), CUDNN_DATA_BFLOAT16, kV);
  const Desc& o = g.tensor(l.heads(s.H), l.rows(), CUDNN_DATA_BFLOAT16, kO);
  const Desc& d_o = g.tensor(l.heads(s.H), l.rows(), CUDNN_DATA_BFLOAT16, kDO);
  const Desc& stats = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT, kStats);
  const Desc& dq = g.tensor(l.heads(s.H), l.packed(), CUDNN_DATA_BFLOAT16, kDQ);
  const Desc& dk = g.tensor(l.heads(s.KV), l.packed(), CUDNN_DATA_BFLOAT16, kDK);
  const Desc& dv = g.tensor(l.heads(s.KV), l.packed(), CUDNN_DATA_BFLOAT16, kDV);
  const Desc& scale = g.scalar(kScale);
  const Desc& neg_inf = g.scalar(kNegInf);
  const Desc& one = g.scalar(kOne);
  const Desc& softmax_sum = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT, kSoftmaxSum);

  // Σ dO·O per row.
  const Desc& d_o_o = g.tensor(l.heads(s.H), l.full_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, &o, d_o_o);
  const Desc& row_sum = g.tensor(l.per_row(), l.per_row_dense(), CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o_o, row_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sum, &one, softmax_sum);
  // P = exp(scale·Q·Kᵀ − lse), masked.
  const Desc& s0 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.matmul(q, kt, s0);
  const Desc& s1 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, &scale, s1);
  const Desc* s3 = nullptr;  // masked scores less the statistics
  const Desc& s2 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  if (mask_first) {
    g.pointwise(CUDNN_POINTWISE_SUB, causal_mask(g, l, s1, neg_inf), &stats, s2);
    s3 = &s2;
  } else {
    g.pointwise(CUDNN_POINTWISE_SUB, s1, &stats, s2);
    s3 = &causal_mask(g, l, s2, neg_inf);
  }
  const Desc& p = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, *s3, nullptr, p);
  // dV = Pᵀ·dO (per query head, then summed over a group's heads).
  const Desc& pt = g.tensor(l.scores(), l.scores_t(), CUDNN_DATA_BFLOAT16);
  g.reshape(p, pt);
  key_value_gradient(pt, d_o, dv);
  // dS = P·(dO·Vᵀ − Σ dO·O)·scale.
  const Desc& dp = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.matmul(d_o, vt, dp);
  const Desc& u0 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, &softmax_sum, u0);
  const Desc& u1 = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, u0, &p, u1);
  const Desc& ds = g.tensor(l.scores(), l.scores_dense(), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, u1, &scale, ds);
  // dK = dSᵀ·Q.
  const Desc& dst = g.tensor(l.scores(), l.scores_t(), CUDNN_DATA_BFLOAT16);
  g.reshape(ds, dst);
  key_value_gradient(dst, q, dk);
  // dQ = dS·K, accumulated in fp32, then rounded into dqkv.
  const Desc& k = g.tensor(l.heads(s.KV), l.packed(), CUDNN_DATA_FLOAT);
  g.reshape(kt, k);
  if (deterministic) {
    g.matmul(ds, k, dq);
    return;
  }
  const Desc& dq_accum = g.tensor(l.heads(s.H), l.full_dense(), CUDNN_DATA_FLOAT, kDQAccum);
  g.matmul(ds, k, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, dq);
}

/// One execution of `plan` with these tensors (uid, address) and workspace.
void execute(cudnnHandle_t handle, const Desc& plan,
             const std::vector<std::pair<int64_t, const void*>>& tensors, void* workspace) {
  std::vector<int64_t> uids;
  std::vector<void*> pointers;
  for (const auto& [uid, p] : tensors)
    uids.push_back(uid), pointers.push_back(const_cast<void*>(p));
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(pointers.size()),
           pointers.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
      .finalize("the variant pack");
  check(cudnn().Execute(handle, plan.get(), pack.get()), "cudnnBackendExecute");
}

}  // namespace

std::unique_ptr<CudnnAttention> CudnnAttention::open(cudaStream_t stream, bool deterministic,
                                                     bool tune, std::string& why) {
  const CudnnApi& api = cudnn();
  if (!api.error.empty()) return why = api.error, nullptr;
  const long version = long(api.GetVersion());
  const std::string dotted = std::to_string(version / 10000) + "." +
                             std::to_string(version / 100 % 100) + "." +
                             std::to_string(version % 100);
  // The composite graphs' engines with grouped heads need cuDNN 9; 9.10.0 and 9.10.1 gave wrong
  // bf16 attention (cuDNN's frontend refuses them).
  if (version < 90000 || (version >= 91000 && version < 91002))
    return why = "cuDNN " + dotted + " at " + api.file +
                 " (its fused attention needs 9.x, not 9.10.0-1)",
           nullptr;
  // Its attention engines are compiled at run time by the NVRTC of the CUDA it was built for.
  const long cuda_major = long(api.GetCudartVersion()) / 1000;
  if (cuda_major != CUDART_VERSION / 1000)
    return why = "cuDNN " + dotted + " at " + api.file + " is built for CUDA " +
                 std::to_string(cuda_major) + ", this build for CUDA " +
                 std::to_string(CUDART_VERSION / 1000),
           nullptr;
  auto a = std::unique_ptr<CudnnAttention>(new CudnnAttention);
  cudnnHandle_t handle = nullptr;
  try {
    check(api.Create(&handle), "cudnnCreate");
    a->handle_ = handle;
    check(api.SetStream(handle, stream), "cudnnSetStream");
  } catch (const std::runtime_error& e) {
    return why = e.what(), nullptr;
  }
  a->stream_ = stream;
  a->version_ = version;
  a->deterministic_ = deterministic;
  a->tune_ = tune;
  a->name_ = "cuDNN " + dotted + " (" + api.file + ")";
  return a;
}

CudnnAttention::~CudnnAttention() {
  passes_.clear();  // plans before the handle they were built with
  if (handle_) cudnn().Destroy(static_cast<cudnnHandle_t>(handle_));
}

bool CudnnAttention::takes(const AttentionShape& s, std::string& why) {
  if (passes_.count(s)) return true;
  if (auto it = refused_.find(s); it != refused_.end()) return why = it->second, false;
  if (s.hd % 8 != 0 || s.hd > 128 || s.H % s.KV != 0) {
    why = "head size " + std::to_string(s.hd) + " (cuDNN's fused attention: multiples of 8 to 128)";
  } else if (s.T < 2 || s.B > 65535 || s.H > 65535) {
    // (its backward takes no key sequence of length 1; grid limits past 65535: PyTorch refuses
    // both too)
    why = "sequence length " + std::to_string(s.T) + ", batch " + std::to_string(s.B) + ", " +
          std::to_string(s.H) + " heads (cuDNN's fused attention: T ≥ 2, B and heads ≤ 65535)";
  } else if (version_ < 91501 && s.T % 128 != 0) {
    // Before 9.15.1 the backward read out of bounds where T is not a multiple of 128.
    why = "sequence length " + std::to_string(s.T) +
          " is no multiple of 128, which cuDNN before 9.15.1 needs";
  } else {
    try {
      auto p = std::make_unique<Passes>();
      const Layout l{s};
      const auto handle = static_cast<cudnnHandle_t>(handle_);
      for (bool backward : {false, true}) {
        Plan& plan = backward ? p->backward : p->forward;
        std::string errors;  // each spelling's, where none builds
        for (int spelling = 0; spelling < (backward ? 2 : 1) && plan.built.empty(); ++spelling) {
          plan.graph = std::make_unique<Graph>(handle);
          try {
            backward ? build_backward(*plan.graph, l, spelling == 1, deterministic_)
                     : build_forward(*plan.graph, l);
            plan.built = plan.graph->plans(tune_);
          } catch (const std::runtime_error& e) {
            errors +=
                std::string(errors.empty() ? "" : "; masked before the statistics: ") + e.what();
          }
        }
        if (plan.built.empty())
          throw std::runtime_error((backward ? "backward: " : "forward: ") + errors);
      }
      p->dq_accum_bytes =
          deterministic_ ? 0 : round_up(int64_t(sizeof(float)) * s.B * s.H * s.T * s.hd);
      p->softmax_sum_bytes = round_up(int64_t(sizeof(float)) * s.B * s.H * s.T);
      passes_.emplace(s, std::move(p));
      return true;
    } catch (const std::runtime_error& e) {
      why = e.what();
    }
  }
  refused_.emplace(s, why);
  return false;
}

std::string CudnnAttention::engines() const {
  // "mode A #1 of 2", and where the plans were timed each one's time: "(timed: 1.2, 1.05 ms)".
  const auto chosen_engine = [](const Plan& p) {
    std::string s = p.built[p.chosen].choice;
    char buf[32];
    for (size_t i = 0; i < p.ms.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%.3g", p.ms[i]);
      s += (i == 0 ? " (timed: " : ", ") + std::string(buf) + (i + 1 == p.ms.size() ? " ms)" : "");
    }
    return s;
  };
  std::string all;
  for (const auto& [s, p] : passes_)
    all += std::string(all.empty() ? "" : "; ") + "B " + std::to_string(s.B) + " T " +
           std::to_string(s.T) + " H " + std::to_string(s.H) + "/" + std::to_string(s.KV) +
           " hd " + std::to_string(s.hd) + ": forward " + chosen_engine(p->forward) +
           ", backward " + chosen_engine(p->backward);
  return all;
}

void CudnnAttention::choose(Plan& plan, const std::function<void(size_t)>& run) {
  if (!plan.ms.empty() || plan.built.size() < 2) return;
  // Each plan once to warm up, then twice timed; another than the heuristics' first only where
  // it is at least 3 % faster (as TRELLIS_GEMM_TUNE judges cuBLASLt's).
  cudaEvent_t start, stop;
  TRELLIS_CUDA(cudaEventCreate(&start));
  TRELLIS_CUDA(cudaEventCreate(&stop));
  for (size_t i = 0; i < plan.built.size(); ++i) {
    float ms = INFINITY;  // (a plan that builds but will not run is no choice, not a failure)
    try {
      run(i);
      TRELLIS_CUDA(cudaEventRecord(start, stream_));
      run(i);
      run(i);
      TRELLIS_CUDA(cudaEventRecord(stop, stream_));
      TRELLIS_CUDA(cudaEventSynchronize(stop));
      TRELLIS_CUDA(cudaEventElapsedTime(&ms, start, stop));
      ms /= 2;
    } catch (const std::runtime_error&) {
      ms = INFINITY;
    }
    plan.ms.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (size_t i = 1; i < plan.ms.size(); ++i)
    if (plan.ms[i] < (plan.chosen == 0 ? 0.97f : 1.0f) * plan.ms[plan.chosen]) plan.chosen = i;
}

size_t CudnnAttention::workspace_bytes(const AttentionShape& s) const {
  const Passes& p = *passes_.at(s);
  return size_t(std::max(round_up(p.forward.workspace()), p.dq_accum_bytes + p.softmax_sum_bytes +
                                                               round_up(p.backward.workspace())));
}

namespace {
float neg_inf_for(long version) { return version >= 91000 ? -INFINITY : -FLT_MAX; }
}  // namespace

void CudnnAttention::forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv,
                             const AttentionShape& s, void* workspace) {
  Plan& plan = passes_.at(s)->forward;
  alignas(16) const float scale = 1.0f / std::sqrt(float(s.hd));  // (16: as their descriptors say)
  alignas(16) const float neg_inf = neg_inf_for(version_);
  const int64_t head = s.hd;
  const auto run = [&](size_t i) {  // (every plan writes the same out and lse)
    execute(static_cast<cudnnHandle_t>(handle_), *plan.built[i].plan,
            {{kQ, qkv},
             {kK, qkv + s.H * head},
             {kV, qkv + (s.H + s.KV) * head},
             {kO, out},
             {kStats, lse},
             {kScale, &scale},
             {kNegInf, &neg_inf}},
            workspace);
  };
  choose(plan, run);
  run(plan.chosen);
}

void CudnnAttention::backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout,
                              const __nv_bfloat16* qkv, const __nv_bfloat16* out, const float* lse,
                              const AttentionShape& s, void* workspace) {
  Passes& p = *passes_.at(s);
  alignas(16) const float scale = 1.0f / std::sqrt(float(s.hd));  // (16: as their descriptors say)
  alignas(16) const float neg_inf = neg_inf_for(version_);
  alignas(16) const float one = 1.0f;
  const int64_t head = s.hd;
  char* base = static_cast<char*>(workspace);
  void* dq_accum = base;
  void* softmax_sum = base + p.dq_accum_bytes;
  void* engine = base + p.dq_accum_bytes + p.softmax_sum_bytes;
  std::vector<std::pair<int64_t, const void*>> tensors = {{kQ, qkv},
                                                           {kK, qkv + s.H * head},
                                                           {kV, qkv + (s.H + s.KV) * head},
                                                           {kO, out},
                                                           {kDO, dout},
                                                           {kStats, lse},
                                                           {kDQ, dqkv},
                                                           {kDK, dqkv + s.H * head},
                                                           {kDV, dqkv + (s.H + s.KV) * head},
                                                           {kScale, &scale},
                                                           {kNegInf, &neg_inf},
                                                           {kOne, &one},
                                                           {kSoftmaxSum, softmax_sum}};
  if (p.dq_accum_bytes > 0) tensors.push_back({kDQAccum, dq_accum});
  const auto run = [&](size_t i) {  // (every plan overwrites the same dqkv)
    // Before 9.6 the engines added into the accumulator without clearing it first.
    if (p.dq_accum_bytes > 0 && version_ < 90600)
      TRELLIS_CUDA(cudaMemsetAsync(dq_accum, 0, p.dq_accum_bytes, stream_));
    execute(static_cast<cudnnHandle_t>(handle_), *p.backward.built[i].plan, tensors, engine);
  };
  choose(p.backward, run);
  run(p.backward.chosen);
}

}  // namespace trellis::cuda

#else  // built without cuDNN's headers

namespace trellis::cuda {

struct CudnnAttention::Plan {};
struct CudnnAttention::Passes {};

std::unique_ptr<CudnnAttention> CudnnAttention::open(cudaStream_t, bool, bool, std::string& why) {
  why = "built without cuDNN's headers (cudnn_graph.h)";
  return nullptr;
}
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::takes(const AttentionShape&, std::string& why) {
  return why = "built without cuDNN", false;
}
std::string CudnnAttention::engines() const { return ""; }
void CudnnAttention::choose(Plan&, const std::function<void(size_t)>&) {}
size_t CudnnAttention::workspace_bytes(const AttentionShape&) const { return 0; }
void CudnnAttention::forward(__nv_bfloat16*, float*, const __nv_bfloat16*, const AttentionShape&,
                             void*) {}
void CudnnAttention::backward(__nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                              const __nv_bfloat16*, const float*, const AttentionShape&, void*) {}

}  // namespace trellis::cuda

#endif
