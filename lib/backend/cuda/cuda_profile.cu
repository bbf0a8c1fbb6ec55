// CUDA backend: the profile (TRELLIS_CUDA_PROFILE: device time per kernel class and per GEMM
// shape, from events around each call) and the timed ways of kernels with several ways to the
// same bits (kernel_ways.hpp), with the report that shows both.
#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"
#include "core/log.hpp"

namespace trellis {

// ---- profile: events around each call, added up per class ----

cudaEvent_t CudaBackend::take_event() {
  if (free_events_.empty()) {
    cudaEvent_t e;
    TRELLIS_CUDA(cudaEventCreate(&e));
    return e;
  }
  cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

void CudaBackend::push_pending(const PendingTime& t) {
  pending_.push_back(t);
  // Bounded: resolving waits for every pending interval, the one just recorded too (the stream
  // drains once in 4096 calls).
  if (pending_.size() > 4096) resolve_profile();
}

void CudaBackend::resolve_profile() {
  for (const PendingTime& p : pending_) {
    TRELLIS_CUDA(cudaEventSynchronize(p.stop));
    float ms = 0;
    TRELLIS_CUDA(cudaEventElapsedTime(&ms, p.start, p.stop));
    if (p.plan) {
      p.plan->profile_ms += ms;
      ++p.plan->profile_calls;
    } else {
      class_ms_[p.cls] += ms;
      ++class_calls_[p.cls];
    }
    free_events_.push_back(p.start);
    free_events_.push_back(p.stop);
  }
  pending_.clear();
}

void CudaBackend::reset_profile() {
  if (!profiling_) return;
  resolve_profile();
  std::fill(std::begin(class_ms_), std::end(class_ms_), 0.0);
  std::fill(std::begin(class_flops_), std::end(class_flops_), 0.0);
  std::fill(std::begin(class_bytes_), std::end(class_bytes_), 0.0);
  std::fill(std::begin(class_calls_), std::end(class_calls_), int64_t(0));
  for (auto& [key, p] : plans_) p.profile_ms = 0, p.profile_calls = 0;
  tuning_ms_ = 0;
  // (the counts of fused and cached calls too, so that they count the calls the table times)
  gelu_fused_ = gelu_unfused_ = bgrad_fused_ = bgrad_unfused_ = 0;
  dgelu_bgrad_fused_ = dgelu_bgrad_unfused_ = 0;
  loss_rows_cached_ = loss_rows_uncached_ = loss_rows_pipelined_ = 0;
}

cudaEvent_t CudaBackend::record_event() {
  cudaEvent_t e = take_event();
  // (unchecked: destructors record too; a failed record shows at the next call that checks)
  cudaEventRecord(e, stream_);
  return e;
}

CudaBackend::Profiled::Profiled(CudaBackend& be, KernelClass cls) : be_(be), cls_(cls) {
  if (be_.profiling()) start_ = be_.record_event();
}

CudaBackend::Profiled::~Profiled() {
  if (start_) be_.push_pending({cls_, start_, be_.record_event()});
}

// ---- kernels' ways to the same bits, timed (kernel_ways.hpp) ----

CudaBackend::WayTrial::WayTrial(CudaBackend& be, const char* kernel, int rows, int cols,
                                const char* const* names, const cuda::WaySet& ways)
    : be_(be) {
  pick_.way = ways[0];
  if (!be_.time_ways_ || ways.size() < 2) return;
  be_.resolve_way_times();
  pick_ = be_.ways_.pick(kernel, rows, cols, names, ways);
  exceptions_ = std::uncaught_exceptions();
  if (pick_.timed) start_ = be_.record_event();
}

CudaBackend::WayTrial::~WayTrial() {
  if (!start_) return;
  if (std::uncaught_exceptions() > exceptions_)  // (the launch failed: no time to keep)
    be_.free_events_.push_back(start_);
  else
    be_.way_times_.push_back({pick_.slot, pick_.index, start_, be_.record_event()});
}

void CudaBackend::resolve_way_times() {
  if (way_times_.empty()) return;
  // (every finished pair's events go back to the pool, and a failure is thrown only once the
  // list holds just the pairs still pending: none is given back twice)
  std::vector<WayTime> pending;
  cudaError_t failed = cudaSuccess;
  for (const WayTime& t : way_times_) {
    cudaError_t e = failed == cudaSuccess ? cudaEventQuery(t.stop) : cudaErrorNotReady;
    if (e == cudaErrorNotReady) {  // (the device behind the host: timed at a later call)
      cuda::forget_not_ready();
      pending.push_back(t);
      continue;
    }
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, t.start, t.stop);
    free_events_.push_back(t.start);
    free_events_.push_back(t.stop);
    if (e == cudaSuccess)
      ways_.record(t.slot, t.index, ms);
    else
      failed = e;
  }
  way_times_ = std::move(pending);
  TRELLIS_CUDA(failed);
}

std::string CudaBackend::gemm_shapes_report() const {
  // Plans of the same shape, operations, epilogue and types (apart only in their pointers'
  // alignments) add up into one row.
  struct Row {
    double ms = 0, flops = 0;
    int64_t calls = 0;
  };
  static const char* const epilogues[] = {"none",  "bias",   "GELU aux",        "bias, GELU aux",
                                          "dGELU", "BGRADB", "dGELU, bias grad"};
  static_assert(std::size(epilogues) == size_t(Epilogue::dgelu_bgrad) + 1, "a name per Epilogue");
  std::map<std::array<std::string, 3>, Row> by_shape;  // (shape and ops, epilogue, types)
  double total = 0;
  char buf[3][64];
  for (const auto& [key, p] : plans_) {
    if (p.profile_calls == 0) continue;
    // (GemmKey: trans_a, trans_b, m, n, k, ..., epilogue (8), ..., DType of A and B (14), of D)
    std::snprintf(buf[0], sizeof buf[0], "%dx%dx%d %c%c", std::get<2>(key), std::get<3>(key),
                  std::get<4>(key), std::get<0>(key) ? 'T' : 'N', std::get<1>(key) ? 'T' : 'N');
    std::snprintf(buf[1], sizeof buf[1], "%s -> %s", dtype_name(DType(std::get<14>(key))),
                  dtype_name(DType(std::get<15>(key))));
    Row& r = by_shape[{buf[0], epilogues[int(std::get<8>(key))], buf[1]}];
    r.ms += p.profile_ms;
    r.calls += p.profile_calls;
    r.flops += p.flops * double(p.profile_calls);
    total += p.profile_ms;
  }
  if (by_shape.empty()) return "";
  std::vector<std::pair<const std::array<std::string, 3>*, const Row*>> sorted;
  for (const auto& [label, r] : by_shape) sorted.emplace_back(&label, &r);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second->ms > b.second->ms; });
  std::vector<std::vector<std::string>> rows;
  for (size_t i = 0; i < sorted.size() && i < 16; ++i) {
    const auto& [label, r] = sorted[i];
    std::snprintf(buf[0], sizeof buf[0], "%lld", (long long)r->calls);
    std::snprintf(buf[1], sizeof buf[1], "%.1f (%.1f%%)", r->ms,
                  total > 0 ? 100 * r->ms / total : 0.0);
    std::snprintf(buf[2], sizeof buf[2], "%.0f",
                  r->ms > 0 ? r->flops / (r->ms * 1e-3) / 1e12 : 0.0);
    rows.push_back({(*label)[0], (*label)[1], (*label)[2], buf[0], buf[1], buf[2]});
  }
  // (m, n, k as cuBLASLt takes them, column-major: a linear layer's out (N,OC) is D (OC x N) with
  // k = its input width; N/T: op of A, of B)
  return format_table("GEMMs by shape, longest first (TRELLIS_CUDA_PROFILE=1: cublasLtMatmul "
                      "alone; m x n x k column-major, as cuBLASLt)",
                      {"m x n x k, ops", "epilogue", "types", "calls", "ms (share)", "TFLOP/s"},
                      rows);
}

std::string CudaBackend::profile_report() {
  if (!profiling_) return "";
  resolve_profile();
  static const char* names[kClasses] = {
      "GEMM (cuBLASLt)", "bf16 conversions", "attention",     "layer norm",    "GELU",
      "add/scale",       "embeddings",       "cross-entropy", "AdamW + norms", "copies/zero"};
  // The GEMM timing trials (TRELLIS_GEMM_TUNE) ran inside their calls' intervals: a row of their
  // own, not the GEMMs' (whose rate they would understate).
  double class_ms[kClasses];
  std::copy(std::begin(class_ms_), std::end(class_ms_), class_ms);
  class_ms[kGemm] = std::max(0.0, class_ms[kGemm] - tuning_ms_);
  double total = 0;
  for (double ms : class_ms) total += ms;
  total += tuning_ms_;
  std::vector<std::vector<std::string>> rows;
  char buf[4][64];
  for (int c = 0; c < kClasses; ++c) {
    if (class_calls_[c] == 0) continue;
    std::snprintf(buf[0], sizeof buf[0], "%.1f", class_ms[c]);
    std::snprintf(buf[1], sizeof buf[1], "%.1f%%", total > 0 ? 100 * class_ms[c] / total : 0.0);
    std::snprintf(buf[2], sizeof buf[2], "%lld", (long long)class_calls_[c]);
    // The rate on the least work: TFLOP/s where the class multiplies, else GB/s.
    const double s = class_ms[c] / 1e3;
    if (s <= 0 || (class_flops_[c] == 0 && class_bytes_[c] == 0))
      std::snprintf(buf[3], sizeof buf[3], "-");
    else if (class_flops_[c] > 0)
      std::snprintf(buf[3], sizeof buf[3], "%.3g TFLOP/s", class_flops_[c] / s / 1e12);
    else
      std::snprintf(buf[3], sizeof buf[3], "%.3g GB/s", class_bytes_[c] / s / 1e9);
    rows.push_back({names[c], buf[0], buf[1], buf[2], buf[3]});
  }
  std::snprintf(buf[0], sizeof buf[0], "%.1f", total);
  rows.push_back({"total", buf[0], "100%", "", ""});
  if (tune_gemms_) {  // what timing the heuristic's candidates changed, weighted by calls
    int tuned = 0, changed = 0;
    double first = 0, chosen = 0;
    for (const auto& [key, p] : plans_) {
      if (!p.tuned || p.ncandidates < 2) continue;
      ++tuned;
      changed += p.chosen != 0;
      first += double(p.calls) * p.first_ms;
      chosen += double(p.calls) * p.chosen_ms;
    }
    std::snprintf(buf[0], sizeof buf[0], "%.1f", tuning_ms_);
    rows.insert(rows.end() - 1, {"GEMM timing trials (TRELLIS_GEMM_TUNE)", buf[0], "", "", ""});
    std::snprintf(buf[0], sizeof buf[0], "%d of %d plans", changed, tuned);
    std::snprintf(buf[1], sizeof buf[1], "%.1f%% of GEMM time",
                  first > 0 ? 100 * (1 - chosen / first) : 0.0);
    rows.push_back({"GEMM algorithms changed by timing", "", "", buf[0], buf[1]});
  }
  if (gelu_fused_ + gelu_unfused_ > 0) {  // (in the GEMM row when fused)
    std::snprintf(buf[0], sizeof buf[0], "%lld of %lld", (long long)gelu_fused_,
                  (long long)(gelu_fused_ + gelu_unfused_));
    rows.push_back({"MLP GELU passes fused into GEMMs", "", "", buf[0], ""});
  }
  if (bgrad_fused_ + bgrad_unfused_ > 0) {  // (in the GEMM row when fused, else column sums)
    std::snprintf(buf[0], sizeof buf[0], "%lld of %lld", (long long)bgrad_fused_,
                  (long long)(bgrad_fused_ + bgrad_unfused_));
    rows.push_back({"bias gradients fused into GEMMs", "", "", buf[0], ""});
  }
  if (dgelu_bgrad_fused_ + dgelu_bgrad_unfused_ > 0) {  // (the MLP's dinp GEMM, DGELU_BGRAD)
    std::snprintf(buf[0], sizeof buf[0], "%lld of %lld", (long long)dgelu_bgrad_fused_,
                  (long long)(dgelu_bgrad_fused_ + dgelu_bgrad_unfused_));
    buf[1][0] = '\0';
    if (dgelu_bgrad_dropped_)  // (the last check's figure; NaN where the sums were not finite)
      std::snprintf(buf[1], sizeof buf[1], "off the column sums (%.1e): dropped",
                    dgelu_bgrad_check_);
    else if (dgelu_bgrad_check_ >= 0)
      std::snprintf(buf[1], sizeof buf[1], "column sums %.1e apart", dgelu_bgrad_check_);
    rows.push_back({"MLP first bias gradients in the DGELU GEMM", "", "", buf[0], buf[1]});
  }
  if (loss_rows_cached_ + loss_rows_uncached_ > 0) {
    std::snprintf(buf[0], sizeof buf[0], "%lld of %lld", (long long)loss_rows_cached_,
                  (long long)(loss_rows_cached_ + loss_rows_uncached_));
    rows.push_back({"cross-entropy calls with rows in shared memory", "", "", buf[0], ""});
    if (loss_rows_pipelined_ > 0) {
      std::snprintf(buf[0], sizeof buf[0], "%lld of %lld", (long long)loss_rows_pipelined_,
                    (long long)loss_rows_cached_);
      rows.push_back({"  of which double-buffered", "", "", buf[0], ""});
    }
  }
  // rate: on the least work — the products' FLOPs, or each input read and each output written
  // once (add_work).
  std::string ways;
  if (time_ways_) {
    resolve_way_times();
    const auto way_rows = ways_.report();
    if (!way_rows.empty())
      ways = format_table("Kernels' ways to the same bits, each timed on this device at each "
                          "shape (least of its calls; every later call takes the fastest)",
                          {"kernel", "rows×columns", "ways (ms)", "chosen"}, way_rows);
  }
  return format_table("CUDA device time per kernel class (TRELLIS_CUDA_PROFILE=1)",
                      {"kernel class", "ms", "share", "calls", "rate on least work"}, rows) +
         gemm_shapes_report() + ways;
}

}  // namespace trellis
