// CUDA backend: the GEMMs (cuBLASLt: plans per shape, type and alignment; bias, GELU and
// bias-gradient epilogues), in fp32 and on bf16 tensors (fp32 accumulation); the linear layers
// built on them are in cuda_linear.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>

#include "backend/cuda/cuda_backend.cuh"
#include "core/error.hpp"

namespace trellis {

// D (m,n) column-major, ld ldd, += bias (m) down each column: for an fp32 bias the cuBLASLt
// epilogue cannot read (unaligned) or has no algorithm for. (A bf16 one is copied to aligned
// scratch instead: adding it to the rounded GEMM output would round twice.)
__global__ void add_bias_kernel(float* d, const float* bias, int m, int n, int ldd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(m) * n;
       i += int64_t(gridDim.x) * blockDim.x)
    d[i / m * ldd + i % m] += bias[i % m];
}

// ---- GEMMs (cuBLASLt, column-major as BLAS; row-major tensors are their transposes) ----

// The largest power of two (at most 256) that divides the address.
static int alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 2 && a % align != 0) align /= 2;
  return align;
}

static cudaDataType_t cuda_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }


CudaBackend::GemmPlan& CudaBackend::plan(const GemmKey& key, const void* bias, const void* aux) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  const auto [ta, tb, m, n, k, lda, ldb, ldd, epi, align_a, align_b, align_d, align_bias, align_aux,
              in_t, out_t] = key;
  (void)align_bias, (void)align_aux;  // the heuristic reads them from the pointers themselves
  const DType in = DType(in_t), out = DType(out_t);
  GemmPlan p;
  p.epi = epi;
  p.flops = 2.0 * m * n * k;
  p.m = m, p.n = n, p.ldd = ldd;
  p.d_bytes = (size_t(ldd) * (n - 1) + m) * (out == DType::f32 ? 4 : 2);  // (column-major)
  // bf16 A/B with fp32 or bf16 C/D, CUBLAS_COMPUTE_32F, scale CUDA_R_32F are cublasLtMatmul's
  // supported combinations (fp32 accumulation). TF32 only means something for fp32 inputs.
  const cublasComputeType_t compute =
      in == DType::f32 && tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  TRELLIS_LT(cuda::lt().MatmulDescCreate(&p.desc, compute, CUDA_R_32F));
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  // The epilogue. A bias is added along the columns (fused, no pass); its type defaults to D's
  // (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cublasLt.h: "bias or bias gradient"), as the GELU's
  // auxiliary matrix (GELU's input) does (..._EPILOGUE_AUX_DATA_TYPE), which has D's shape: ld =
  // D's, a multiple of 8. BGRADB writes the bias gradient of B (its sums over k) there instead,
  // DGELU_BGRAD that of D (its sums over n).
  const cublasLtEpilogue_t lt_epi = epi == Epilogue::bias            ? CUBLASLT_EPILOGUE_BIAS
                                    : epi == Epilogue::gelu_aux      ? CUBLASLT_EPILOGUE_GELU_AUX
                                    : epi == Epilogue::gelu_aux_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                    : epi == Epilogue::dgelu         ? CUBLASLT_EPILOGUE_DGELU
                                    : epi == Epilogue::bgradb        ? CUBLASLT_EPILOGUE_BGRADB
                                    : epi == Epilogue::dgelu_bgrad   ? CUBLASLT_EPILOGUE_DGELU_BGRAD
                                                                     : CUBLASLT_EPILOGUE_DEFAULT;
  TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt_epi, sizeof(lt_epi)));
  // A bias gradient is an fp32 sum, as every gradient here: beside a bf16 D (DGELU_BGRAD's dpre)
  // it is asked for in fp32, not in D's type (cublasLt.h: "the same type as the output elements"
  // by default). Where cuBLASLt has no algorithm for that, the plan is not found and the column
  // sums take over — a bias gradient rounded to bf16 is not what the CPU and every other path
  // here give.
  if (epi == Epilogue::dgelu_bgrad || epi == Epilogue::bgradb) {
    const int32_t bias_type = CUDA_R_32F;
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                              &bias_type, sizeof(bias_type)));
  }
  // The heuristic reads the bias's and aux's alignment from the pointers (cublasLt.h): set them
  // before it runs; run() points them at each call's buffers, of the same alignment (the key).
  if (bias)
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                              sizeof(bias)));
  if (aux) {
    const int64_t ld_aux = ldd;
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld_aux,
                                              sizeof(ld_aux)));
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                              &aux, sizeof(aux)));
  }
  // Stored shapes: op(A) is (m,k), so A is (k,m) when transposed; likewise B.
  TRELLIS_LT(cuda::lt().MatrixLayoutCreate(&p.a, cuda_type(in), ta ? k : m, ta ? m : k, lda));
  TRELLIS_LT(cuda::lt().MatrixLayoutCreate(&p.b, cuda_type(in), tb ? n : k, tb ? k : n, ldb));
  TRELLIS_LT(cuda::lt().MatrixLayoutCreate(&p.d, cuda_type(out), m, n, ldd));
  cublasLtMatmulPreference_t pref;
  TRELLIS_LT(cuda::lt().MatmulPreferenceCreate(&pref));
  TRELLIS_LT(cuda::lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace_bytes_, sizeof(workspace_bytes_)));
  // cuBLASLt assumes 256-byte aligned pointers unless told otherwise; a tensor inside the flat
  // parameter buffer may sit at any element offset.
  const uint32_t aligns[3] = {uint32_t(align_a), uint32_t(align_b), uint32_t(align_d)};
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
  for (int i = 0; i < 3; ++i)
    TRELLIS_LT(cuda::lt().MatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof(uint32_t)));
  // C is D (in place, beta = 1 accumulates), or a residual apart from it: D's alignment is then
  // the lesser of the two (gemm).
  TRELLIS_LT(cuda::lt().MatmulPreferenceSetAttribute(pref, align_attrs[3], &aligns[2], sizeof(uint32_t)));
  // A split-K algorithm may add its parts in D's type (reduction schemes INPLACE, OUTPUT_TYPE):
  // for a bf16 D each part would be rounded before the bias, the residual or the GELU meet it —
  // not the one rounding of the fp32 sum that the CPU and every other path here give. A bf16 D
  // takes algorithms that do not split k, or add the parts in fp32.
  if (out != DType::f32) {
    const uint32_t schemes =
        CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    TRELLIS_LT(cuda::lt().MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  }
  // The heuristic's best few: its first runs; the others are there to time (TRELLIS_GEMM_TUNE=1)
  // and for a C apart from D where the first cannot write D apart (out_of_place_algo).
  cublasLtMatmulHeuristicResult_t results[GemmPlan::kMaxCandidates] = {};
  int found = 0;
  const auto ask = [&] {
    found = 0;
    return cuda::lt().MatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.d, p.d, pref,
                                          GemmPlan::kMaxCandidates, results, &found);
  };
  // A combination cuBLASLt does not support may answer "not supported" rather than no result.
  cublasStatus_t status = ask();
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) {
    // The heuristic "may load some kernels ... which may fail when there is no available GPU
    // memory" (cuBLASLt's documentation), and this backend's pool keeps what was freed: give it
    // back to the device and ask once more.
    cudaMemPool_t pool;
    TRELLIS_CUDA(cudaStreamSynchronize(stream_));
    TRELLIS_CUDA(cudaDeviceGetDefaultMemPool(&pool, device_));
    TRELLIS_CUDA(cudaMemPoolTrimTo(pool, 0));
    status = ask();
  }
  cuda::lt().MatmulPreferenceDestroy(pref);
  // GELU and the bias gradient have another way, as has an fp32 bias (gemm adds it itself).
  const bool optional = epi != Epilogue::none && (epi != Epilogue::bias || out == DType::f32);
  // A fused epilogue that has another way cuBLASLt cannot do here (no algorithm, "not
  // supported", or any other refusal): the caller takes the unfused way and the plan is kept as
  // such; anything but "not supported" or no algorithm is said once on stderr (a fused path that
  // has never run on a GPU must not stop a run). Otherwise every error is one.
  if (!optional) TRELLIS_LT(status);
  if (status != CUBLAS_STATUS_SUCCESS) {
    if (status != CUBLAS_STATUS_NOT_SUPPORTED)
      epilogue_failed(epi, status, "choosing an algorithm");
    found = 0;
  }
  // The results' other fields mean something only where their state is success.
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) p.candidates[p.ncandidates++] = results[i].algo;
  p.found = p.ncandidates > 0;
  if (p.found) p.algo = p.candidates[0];
  if (!p.found && !optional)
    throw std::runtime_error("cuBLASLt found no algorithm for a " + std::to_string(m) + "x" +
                             std::to_string(n) + "x" + std::to_string(k) + " GEMM of " +
                             dtype_name(in) + " inputs and " + dtype_name(out) + " output");
  return plans_.emplace(key, p).first->second;
}

void CudaBackend::warn_once(int what, const char* message) {
  if (warned_[what]) return;
  warned_[what] = true;
  std::fprintf(stderr, "trellis: warning: %s\n", message);
}

/// Whether an algorithm writes D apart from C (a residual C ≠ D).
static bool writes_apart(const cublasLtMatmulAlgo_t& algo) {
  int32_t yes = 0;
  size_t written = 0;
  return cuda::lt().MatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT,
                                           &yes, sizeof(yes), &written) == CUBLAS_STATUS_SUCCESS &&
         yes != 0;
}

const cublasLtMatmulAlgo_t* CudaBackend::out_of_place_algo(GemmPlan& p) {
  if (p.apart_state == 0) {
    p.apart_state = 2;
    if (writes_apart(p.algo)) {
      p.algo_apart = p.algo, p.apart_state = 1;
    } else {
      for (int i = 0; i < p.ncandidates && p.apart_state == 2; ++i)
        if (writes_apart(p.candidates[i])) p.algo_apart = p.candidates[i], p.apart_state = 1;
    }
    if (p.apart_state == 2)
      warn_once(kWarnInPlace,
                "cuBLASLt offered no algorithm that writes a GEMM's output apart from its C (the "
                "residual): the residual is copied into the output first");
  }
  return p.apart_state == 1 ? &p.algo_apart : nullptr;
}

void CudaBackend::epilogue_failed(Epilogue epi, cublasStatus_t status, const char* when) {
  const bool bgrad = epi == Epilogue::bgradb, bias = epi == Epilogue::bias,
             dgelu_bgrad = epi == Epilogue::dgelu_bgrad;
  char message[256];
  std::snprintf(message, sizeof message,
                "cuBLASLt refused the %s epilogue while %s (status %d); %s",
                bgrad         ? "bias-gradient (BGRADB)"
                : dgelu_bgrad ? "GELU and bias-gradient (DGELU_BGRAD)"
                : bias        ? "fp32 bias"
                              : "GELU",
                when, int(status),
                bgrad         ? "bias gradients are column sums of their own"
                : dgelu_bgrad ? "the MLP's first bias gradients are column sums of their own"
                : bias        ? "the bias is added by a kernel of its own"
                              : "the MLP's GELU runs as kernels of its own");
  // (the GELU epilogues without a bias gradient share one warning)
  warn_once(bgrad || dgelu_bgrad || bias ? int(epi) : int(Epilogue::gelu_aux), message);
}

void CudaBackend::tune(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr C) {
  p.tuned = true;
  if (p.ncandidates < 2) return;
  // With beta ≠ 0 and C = D, D is an input too: kept aside, put back before each trial and at the
  // end.
  void* saved = nullptr;
  if (!C) C = D;
  if (beta != 0.0f && C.data == D.data) {
    TRELLIS_CUDA(cudaMallocAsync(&saved, p.d_bytes, stream_));
    TRELLIS_CUDA(cudaMemcpyAsync(saved, D.data, p.d_bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  cudaEvent_t start, stop;
  TRELLIS_CUDA(cudaEventCreate(&start));
  TRELLIS_CUDA(cudaEventCreate(&stop));
  const float alpha = 1.0f;
  float best = 0;
  for (int i = 0; i < p.ncandidates; ++i) {
    // (C apart from D: a candidate that cannot write D apart is not a choice, and might write a
    // wrong D without refusing)
    if (C.data != D.data && !writes_apart(p.candidates[i])) continue;
    float total = 0;  // two timed runs after one to warm up
    bool ok = true;
    for (int rep = 0; rep < 3 && ok; ++rep) {
      if (saved)
        TRELLIS_CUDA(cudaMemcpyAsync(D.data, saved, p.d_bytes, cudaMemcpyDeviceToDevice, stream_));
      TRELLIS_CUDA(cudaEventRecord(start, stream_));
      ok = cuda::lt().Matmul(lt_, p.desc, &alpha, A.data, p.a, B.data, p.b, &beta, C.data, p.d, D.data,
                          p.d, &p.candidates[i], workspace_, workspace_bytes_,
                          stream_) == CUBLAS_STATUS_SUCCESS;
      TRELLIS_CUDA(cudaEventRecord(stop, stream_));
      TRELLIS_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      TRELLIS_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (profiling()) tuning_ms_ += ms;  // (left out of the profile's GEMM row)
      if (rep > 0) total += ms;
    }
    if (!ok) continue;  // (a candidate this configuration refuses: not a choice)
    if (i == 0) p.first_ms = total / 2;
    // Another candidate only where it is clearly faster than the heuristic's first: a few
    // percent of timing noise should not change the algorithm (and the last bits) run to run.
    if (best == 0 || total / 2 < (p.chosen == 0 ? 0.97f : 1.0f) * best)
      best = total / 2, p.chosen = i;
  }
  if (best > 0) p.algo = p.candidates[p.chosen], p.chosen_ms = best;
  if (p.first_ms == 0) p.first_ms = best;  // (the first refused: judged against the chosen)
  if (saved) {
    TRELLIS_CUDA(cudaMemcpyAsync(D.data, saved, p.d_bytes, cudaMemcpyDeviceToDevice, stream_));
    TRELLIS_CUDA(cudaFreeAsync(saved, stream_));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

cublasStatus_t CudaBackend::matmul(GemmPlan& p, const void* A, const void* B, float beta,
                                   const void* C, void* D, const cublasLtMatmulAlgo_t* algo) {
  const float alpha = 1.0f;
  // (profiling: this plan's own time, for the per-shape table; the records unchecked, as
  // ~Profiled's: a failed one shows at the next checked call, and no event is lost)
  cudaEvent_t start = profiling() ? take_event() : nullptr;
  if (start) cudaEventRecord(start, stream_);
  const cublasStatus_t status = cuda::lt().Matmul(lt_, p.desc, &alpha, A, p.a, B, p.b, &beta, C, p.d,
                                               D, p.d, algo, workspace_, workspace_bytes_, stream_);
  if (start) {
    cudaEvent_t stop = take_event();
    cudaEventRecord(stop, stream_);
    if (status == CUBLAS_STATUS_SUCCESS)
      push_pending({kGemm, start, stop, &p});
    else
      free_events_.push_back(start), free_events_.push_back(stop);
  }
  return status;
}

bool CudaBackend::try_run(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr bias, CPtr aux) {
  if (bias && cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias.data,
                                             sizeof(bias.data)) != CUBLAS_STATUS_SUCCESS)
    return false;
  if (aux && cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                            &aux.data, sizeof(aux.data)) != CUBLAS_STATUS_SUCCESS)
    return false;
  if (tune_gemms_ && !p.tuned) tune(p, A, B, D, beta, CPtr());
  ++p.calls;
  // cublasLtMatmul checks its arguments before it launches anything: a refusal leaves D as it was.
  const cublasStatus_t status = matmul(p, A.data, B.data, beta, D.data, D.data, &p.algo);
  if (status == CUBLAS_STATUS_SUCCESS) {
    add_work(kGemm, p.flops, 0);
    return true;
  }
  epilogue_failed(p.epi, status, "running");
  p.found = false;  // not again
  return false;
}

void CudaBackend::run(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr bias, CPtr aux,
                      CPtr C) {
  if (bias)
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias.data,
                                              sizeof(bias.data)));
  if (aux)
    TRELLIS_LT(cuda::lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                              &aux.data, sizeof(aux.data)));
  if (tune_gemms_ && !p.tuned) tune(p, A, B, D, beta, C);
  ++p.calls;
  const cublasLtMatmulAlgo_t* algo = &p.algo;
  if (C && C.data != D.data) {  // not every algorithm writes D apart from C
    algo = out_of_place_algo(p);
    if (!algo) {
      // C into D (m rows of each of n columns, ldd apart: the gaps are not D's), then in place.
      const size_t es = dtype_bytes(D.dtype);
      TRELLIS_CUDA(cudaMemcpy2DAsync(D.data, size_t(p.ldd) * es, C.data, size_t(p.ldd) * es,
                                     size_t(p.m) * es, size_t(p.n), cudaMemcpyDeviceToDevice,
                                     stream_));
      C = CPtr(D.data, D.dtype);
      algo = &p.algo;
    }
  }
  TRELLIS_LT(matmul(p, A.data, B.data, beta, C ? C.data : D.data, D.data, algo));
  add_work(kGemm, p.flops, 0);
}

void CudaBackend::gemm(bool trans_a, bool trans_b, int m, int n, int k, CPtr A, int lda, CPtr B,
                       int ldb, Ptr D, int ldd, float beta, CPtr bias, CPtr C) {
  TRELLIS_CHECK(A.dtype == B.dtype && (D.is_f32() || D.dtype == A.dtype) &&
                    (!bias || bias.dtype == D.dtype) && (!C || C.dtype == D.dtype),
                "GEMM of %s and %s into %s: unsupported types", dtype_name(A.dtype),
                dtype_name(B.dtype), dtype_name(D.dtype));
  // The plan asks the same alignment of C as of D: the lesser of the two where C is apart.
  const int align_d = C ? std::min(alignment(D.data), alignment(C.data)) : alignment(D.data);
  GemmPlan& p = plan({trans_a, trans_b, m, n, k, lda, ldb, ldd,
                      bias ? Epilogue::bias : Epilogue::none, alignment(A.data), alignment(B.data),
                      align_d, bias ? alignment(bias.data) : 0, 0, int(A.dtype), int(D.dtype)},
                     bias.data);
  if (bias && !p.found) {  // fp32 (plan): no bias epilogue for these operands
    epilogue_failed(Epilogue::bias, CUBLAS_STATUS_NOT_SUPPORTED, "choosing an algorithm");
    gemm(trans_a, trans_b, m, n, k, A, lda, B, ldb, D, ldd, beta, CPtr(), C);
    add_bias(D.f32(), bias.f32(), m, n, ldd);
    return;
  }
  run(p, A, B, D, beta, bias, nullptr, C);
}

void CudaBackend::add_bias(float* d, const float* bias, int m, int n, int ldd) {
  const unsigned blocks = cuda::blocks_for(int64_t(m) * n);
  add_bias_kernel<<<blocks, cuda::kThreads, 0, stream_>>>(d, bias, m, n, ldd);
  TRELLIS_CUDA_LAUNCHED();
}

CudaBackend::GemmPlan* CudaBackend::gelu_plan(Epilogue epi, bool trans_a, bool trans_b, int m,
                                              int n, int k, int lda, int ldb, int ldd, CPtr A,
                                              CPtr B, Ptr D, CPtr bias, CPtr aux) {
  // (k = 1: DGELU's tests in nvmath-python say cuBLAS does not support it; it might not refuse)
  if (!gelu_epilogue_ || ldd % 8 != 0 || k < 2 || alignment(aux.data) < 16 ||
      (bias && alignment(bias.data) < 16))
    return nullptr;
  GemmPlan& p = plan({trans_a, trans_b, m, n, k, lda, ldb, ldd, epi, alignment(A.data),
                      alignment(B.data), alignment(D.data), bias ? alignment(bias.data) : 0,
                      alignment(aux.data), int(A.dtype), int(D.dtype)},
                     bias.data, aux.data);
  return p.found ? &p : nullptr;
}

// ---- the dweight GEMM with its bias gradient (linear_backward's) ----

bool CudaBackend::dweight_with_dbias(float* dweight, float* dbias, CPtr dout, CPtr inp, int N,
                                     int C, int OC) {
  // (OC = 1, D with one column: BGRADB's tests in nvmath-python say cuBLAS does not support it,
  // and it might compute without refusing)
  if (!bgrad_epilogue_ || OC < 2) return false;
  float* sums = static_cast<float*>(scratch(sizeof(float) * OC));  // (OC): written, not added
  GemmPlan& p = plan({false, true, C, OC, N, C, OC, C, Epilogue::bgradb, alignment(inp.data),
                      alignment(dout.data), alignment(dweight), alignment(sums), 0,
                      int(inp.dtype), int(DType::f32)},
                     sums);
  bool ran = false;
  if (p.found) {
    Profiled prof(*this, kGemm);
    ran = try_run(p, inp, dout, Ptr(dweight), 1.0f, CPtr(sums), CPtr());
  }
  ++(ran ? bgrad_fused_ : bgrad_unfused_);
  if (ran) add_f32(dbias, dbias, sums, OC);
  return ran;
}

}  // namespace trellis
