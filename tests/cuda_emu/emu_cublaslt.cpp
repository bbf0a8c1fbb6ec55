// The emulated GPU's cuBLASLt (cuda_emu.hpp): the matmul the backend plans and runs, with the
// semantics cublasLt.h documents for the attributes it sets. Column-major, as cuBLAS:
//   D (m,n) = epilogue(alpha · op(A) (m,k) · op(B) (k,n) + beta · C + bias),
// bias one value per row of D; GELU_AUX(_BIAS) stores its input (the sum) in aux and GELU of it in
// D; DGELU stores the sum times GELU'(aux) (GELU: the tanh form); DGELU_BGRAD does as DGELU and
// writes D's bias gradient — Σ over n of those products in fp32, before D's rounding, in column
// order, one value per row of D — to the bias pointer; BGRADB leaves D as DEFAULT does and writes
// B's bias gradient — Σ over k of op(B) (k,n), in k order, one value per column of D, of B's
// values as stored (TF32 rounds only the product's operands) — to the bias pointer (both alpha 1
// only: whether alpha scales them, this emulation does not guess). Inputs fp32 or bf16, C/D fp32 or
// bf16, fp32 accumulation (TF32 compute rounds fp32 inputs to 10 mantissa bits first). A call whose
// descriptors disagree, or that names an attribute this emulation does not know, is refused —
// loudly, on stderr — rather than guessed at.
//
// What the real library may refuse where this one would not, for tests of the backend's other
// ways (TRELLIS_EMU_LT_REFUSE, a comma-separated list, read at each call): `fp32-bias` — no
// algorithm for the BIAS epilogue on an fp32 D; `out-of-place` — no algorithm writes D apart from
// C (CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT 0, and a call with C ≠ D is refused);
// `out-of-place-first` — the heuristic's first cannot, the others can; `alloc-once` — the
// process's first heuristic call fails as if kernels could not be loaded for want of memory;
// `dgelu-bgrad` — no algorithm for DGELU_BGRAD (as for an fp32 bias gradient beside a bf16 D,
// which cublasLt.h does not promise); `dgelu-bgrad-dtype` — DGELU_BGRAD taken, but its bias
// gradient written in D's type whatever CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE says (what
// cublasLt.h's "the same type as the output elements" could mean).
#include <cblas.h>
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "emu_internal.hpp"

struct cublasLtContext {
  int id;
};

namespace {

struct Desc {
  cublasComputeType_t compute;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int bias_type = -1;  // -1: D's type
  void* aux = nullptr;
  int64_t aux_ld = 0;
};
struct Layout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
static_assert(sizeof(Desc) <= sizeof(cublasLtMatmulDescOpaque_t));
static_assert(sizeof(Layout) <= sizeof(cublasLtMatrixLayoutOpaque_t));

Desc& desc(cublasLtMatmulDesc_t d) { return *reinterpret_cast<Desc*>(d->data); }
Layout& layout(cublasLtMatrixLayout_t l) { return *reinterpret_cast<Layout*>(l->data); }

cublasStatus_t refuse(const char* what) {
  std::fprintf(stderr, "emulated cuBLASLt: %s\n", what);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

// Whether TRELLIS_EMU_LT_REFUSE names `what`.
bool refusing(const char* what) {
  const char* env = std::getenv("TRELLIS_EMU_LT_REFUSE");
  if (!env) return false;
  const std::string list = std::string(",") + env + ",";
  return list.find(std::string(",") + what + ",") != std::string::npos;
}
// Whether the "algorithm" (its index in the heuristic's answer) writes D apart from C.
bool writes_apart(const cublasLtMatmulAlgo_t& algo) {
  return !refusing("out-of-place") && !(refusing("out-of-place-first") && algo.data[0] == 0);
}

template <typename T>
bool read(const void* buf, size_t bytes, T* out) {
  if (bytes != sizeof(T)) return false;
  std::memcpy(out, buf, sizeof(T));
  return true;
}

float load(const void* p, cudaDataType t, int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
void store(void* p, cudaDataType t, int64_t i, float v) {
  if (t == CUDA_R_32F)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}
bool supported(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16BF; }
size_t bytes_of(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

float tf32(float x) {  // round to nearest even at 10 mantissa bits
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7f800000u) != 0x7f800000u) b = (b + 0xfffu + ((b >> 13) & 1u)) & ~0x1fffu;
  std::memcpy(&x, &b, 4);
  return x;
}

constexpr float kGeluS = 0.7978845608028654f;  // √(2/π)
float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(kGeluS * (x + 0.044715f * x * x * x))); }
float dgelu(float x) {
  const float u = kGeluS * (x + 0.044715f * x * x * x), t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
}

bool has_bias(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_BIAS;
}
bool writes_bias_gradient(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_BGRADB; }
bool writes_d_bias_gradient(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_DGELU_BGRAD; }
bool has_aux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}

// Whether the descriptors describe one product this emulation can run (the checks cuBLASLt makes
// before it picks an algorithm or launches).
cublasStatus_t validate(const Desc& d, const Layout& a, const Layout& b, const Layout& c,
                        const Layout& dl) {
  if (!supported(a.type) || !supported(b.type) || !supported(c.type) || !supported(dl.type))
    return refuse("a matrix type other than fp32 or bf16");
  if (a.type != b.type) return refuse("A and B of different types");
  if (c.type != dl.type || c.rows != dl.rows || c.cols != dl.cols)
    return refuse("C and D of different types or shapes");
  if (d.compute != CUBLAS_COMPUTE_32F && d.compute != CUBLAS_COMPUTE_32F_FAST_TF32)
    return refuse("a compute type other than 32F or 32F_FAST_TF32");
  const uint64_t m = d.trans_a == CUBLAS_OP_N ? a.rows : a.cols;
  const uint64_t k = d.trans_a == CUBLAS_OP_N ? a.cols : a.rows;
  const uint64_t kb = d.trans_b == CUBLAS_OP_N ? b.rows : b.cols;
  const uint64_t n = d.trans_b == CUBLAS_OP_N ? b.cols : b.rows;
  if (k != kb || m != dl.rows || n != dl.cols) {
    std::fprintf(stderr, "emulated cuBLASLt: op(A) %llux%llu, op(B) %llux%llu, D %llux%llu\n",
                 (unsigned long long)m, (unsigned long long)k, (unsigned long long)kb,
                 (unsigned long long)n, (unsigned long long)dl.rows, (unsigned long long)dl.cols);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (const Layout* l : {&a, &b, &c, &dl})
    if (l->ld < int64_t(l->rows) || l->ld < 1) return refuse("a leading dimension below the rows");
  if (has_aux(d.epilogue) && (d.aux_ld < int64_t(dl.rows) || d.aux_ld % 8 != 0))
    return refuse("an epilogue's aux ld below D's rows or not a multiple of 8");
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  *lightHandle = new cublasLtContext{1};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasLtGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS (emulated)";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE (emulated)";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED (emulated)";
    default:
      return "cuBLAS error (emulated)";
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc,
                                        cublasComputeType_t computeType, cudaDataType_t scaleType) {
  if (scaleType != CUDA_R_32F) return refuse("a scale type other than fp32");
  auto* d = new cublasLtMatmulDescOpaque_t{};
  new (d->data) Desc{computeType};
  *matmulDesc = d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete matmulDesc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t sizeInBytes) {
  Desc& d = desc(matmulDesc);
  bool ok = false;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      ok = read(buf, sizeInBytes, &d.trans_a);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      ok = read(buf, sizeInBytes, &d.trans_b);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      ok = read(buf, sizeInBytes, &d.epilogue);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      ok = read(buf, sizeInBytes, &d.bias);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      ok = read(buf, sizeInBytes, &d.bias_type);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      ok = read(buf, sizeInBytes, &d.aux);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      ok = read(buf, sizeInBytes, &d.aux_ld);
      break;
    default:
      return refuse("a matmul attribute this emulation does not know");
  }
  return ok ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  auto* l = new cublasLtMatrixLayoutOpaque_t{};
  new (l->data) Layout{type, rows, cols, ld};
  *matLayout = l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete matLayout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  *pref = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void*, size_t) {
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:  // (nothing here splits k)
      return CUBLAS_STATUS_SUCCESS;
    default:
      return refuse("a preference this emulation does not know");
  }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  *returnAlgoCount = 0;
  if (requestedAlgoCount < 1) return CUBLAS_STATUS_INVALID_VALUE;
  const cublasStatus_t s =
      validate(desc(operationDesc), layout(Adesc), layout(Bdesc), layout(Cdesc), layout(Ddesc));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  static bool failed_once = false;
  if (refusing("alloc-once") && !failed_once) {
    failed_once = true;
    std::fprintf(stderr, "emulated cuBLASLt: the heuristic fails once (alloc-once)\n");
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  if (refusing("fp32-bias") && desc(operationDesc).epilogue == CUBLASLT_EPILOGUE_BIAS &&
      layout(Ddesc).type == CUDA_R_32F)
    return refuse("no algorithm for a bias on an fp32 D (fp32-bias)");
  if (refusing("dgelu-bgrad") && desc(operationDesc).epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD)
    return refuse("no algorithm for DGELU_BGRAD (dgelu-bgrad)");
  // Up to three "algorithms" (as the real one offers several), which compute alike here: a caller
  // that times them (TRELLIS_GEMM_TUNE) may keep any.
  const int n = std::min(requestedAlgoCount, 3);
  for (int i = 0; i < n; ++i) {
    heuristicResultsArray[i] = cublasLtMatmulHeuristicResult_t{};
    heuristicResultsArray[i].algo.data[0] = uint64_t(i);
    heuristicResultsArray[i].state = CUBLAS_STATUS_SUCCESS;
    heuristicResultsArray[i].wavesCount = 1.0f;
  }
  *returnAlgoCount = n;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoCapGetAttribute(const cublasLtMatmulAlgo_t* algo,
                                                 cublasLtMatmulAlgoCapAttributes_t attr, void* buf,
                                                 size_t sizeInBytes, size_t* sizeWritten) {
  if (attr != CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT)
    return refuse("an algorithm capability this emulation does not know");
  if (sizeWritten) *sizeWritten = sizeof(int32_t);
  if (sizeInBytes != sizeof(int32_t) || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  const int32_t yes = writes_apart(*algo) ? 1 : 0;
  std::memcpy(buf, &yes, sizeof(yes));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                              cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                              cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t* algo, void*, size_t,
                              cudaStream_t stream) {
  const Desc& d = desc(computeDesc);
  const Layout &a = layout(Adesc), &b = layout(Bdesc), &c = layout(Cdesc), &dl = layout(Ddesc);
  if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
  const cublasStatus_t s = validate(d, a, b, c, dl);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (C != D && !writes_apart(*algo))
    return refuse("C apart from D for an algorithm that writes in place only");
  const int64_t m = int64_t(dl.rows), n = int64_t(dl.cols);
  const int64_t k = int64_t(d.trans_a == CUBLAS_OP_N ? a.cols : a.rows);
  // Every matrix must lie inside device memory, as the GPU would fault otherwise.
  auto inside = [](const void* p, const Layout& l) {
    return l.cols == 0 || trellis_emu::is_device_range(
                              p, (size_t((l.cols - 1) * l.ld) + l.rows) * bytes_of(l.type));
  };
  const cudaDataType bias_t = d.bias_type < 0 ? dl.type : cudaDataType(d.bias_type);
  if (!supported(bias_t)) return refuse("a bias type other than fp32 or bf16");
  if (!inside(A, a) || !inside(B, b) || !inside(C, c) || !inside(D, dl) ||
      (has_bias(d.epilogue) &&
       (!d.bias || !trellis_emu::is_device_range(d.bias, size_t(m) * bytes_of(bias_t)))) ||
      (writes_bias_gradient(d.epilogue) &&
       (!d.bias || !trellis_emu::is_device_range(d.bias, size_t(n) * bytes_of(bias_t)))) ||
      (writes_d_bias_gradient(d.epilogue) &&
       (!d.bias || !trellis_emu::is_device_range(d.bias, size_t(m) * bytes_of(bias_t)))) ||
      (has_aux(d.epilogue) &&
       (!d.aux || !trellis_emu::is_device_range(
                      d.aux, (size_t((n - 1) * d.aux_ld) + m) * bytes_of(dl.type)))))
    return refuse("a matrix, bias or aux outside device memory");
  trellis_emu::stream_order(stream);
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  if ((writes_bias_gradient(d.epilogue) || writes_d_bias_gradient(d.epilogue)) && al != 1.0f)
    return refuse("a bias-gradient epilogue with alpha other than 1");
  const bool tf = d.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a.type == CUDA_R_32F;
  // op(A) (m,k) and op(B) (k,n) as fp32, row-major copies.
  std::vector<float> opa(size_t(m * k)), opb(size_t(k * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const float v = load(A, a.type, d.trans_a == CUBLAS_OP_N ? i + p * a.ld : p + i * a.ld);
      opa[size_t(i * k + p)] = tf ? tf32(v) : v;
    }
  for (int64_t p = 0; p < k; ++p)
    for (int64_t j = 0; j < n; ++j) {
      const float v = load(B, b.type, d.trans_b == CUBLAS_OP_N ? p + j * b.ld : j + p * b.ld);
      opb[size_t(p * n + j)] = tf ? tf32(v) : v;
    }
  // op(A) · op(B) (m,n), row-major, in fp32 through the host's BLAS (the sums' order is its own,
  // as a GPU's is cuBLASLt's: the backend's tests bound the GEMMs' error, not an order).
  std::vector<float> prod(size_t(m * n));
  std::vector<float> row_sums(writes_d_bias_gradient(d.epilogue) ? size_t(m) : 0, 0.0f);  // (m)
  if (m > 0 && n > 0 && k > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m), int(n), int(k), 1.0f,
                opa.data(), int(k), opb.data(), int(n), 0.0f, prod.data(), int(n));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      const float sum = prod[size_t(i * n + j)];
      float x = al * sum + (be != 0.0f ? be * load(C, c.type, i + j * c.ld) : 0.0f);
      if (has_bias(d.epilogue)) x += load(d.bias, bias_t, i);
      switch (d.epilogue) {
        case CUBLASLT_EPILOGUE_GELU_AUX:
        case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
          store(d.aux, dl.type, i + j * d.aux_ld, x);
          x = gelu(x);
          break;
        case CUBLASLT_EPILOGUE_DGELU:
          x *= dgelu(load(d.aux, dl.type, i + j * d.aux_ld));
          break;
        case CUBLASLT_EPILOGUE_DGELU_BGRAD:
          x *= dgelu(load(d.aux, dl.type, i + j * d.aux_ld));
          row_sums[size_t(i)] += x;
          break;
        case CUBLASLT_EPILOGUE_DEFAULT:
        case CUBLASLT_EPILOGUE_BIAS:
        case CUBLASLT_EPILOGUE_BGRADB:
          break;
        default:
          return refuse("an epilogue this emulation does not know");
      }
      store(D, dl.type, i + j * dl.ld, x);
    }
  const cudaDataType d_bias_t = refusing("dgelu-bgrad-dtype") ? dl.type : bias_t;
  for (int64_t i = 0; i < int64_t(row_sums.size()); ++i)
    store(const_cast<void*>(d.bias), d_bias_t, i, row_sums[size_t(i)]);  // (an output here)
  if (writes_bias_gradient(d.epilogue))  // (of B as stored: no TF32 rounding of the sums' terms)
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t p = 0; p < k; ++p)
        sum += load(B, b.type, d.trans_b == CUBLAS_OP_N ? p + j * b.ld : j + p * b.ld);
      store(const_cast<void*>(d.bias), bias_t, j, sum);  // (an output here)
    }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
