// cuDNN's backend API as the fused attention (cudnn_attention.cu) uses it: the library, opened at
// run time (libcudnn_graph.so.9, or TRELLIS_CUDNN_LIBRARY); descriptors that destroy themselves
// and say which call failed and why; and a Graph that builds an operation graph (tensors,
// pointwise, matmul, reduction and reshape operations) and the execution plan of the first engine
// configuration cuDNN's heuristics offer that builds (or of each, to be timed). Only for files
// that have <cudnn_graph.h>.
#pragma once
#include <cudnn_graph.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda::cudnn_backend {

/// The cuDNN functions used here, from libcudnn_graph.so.9 (or TRELLIS_CUDNN_LIBRARY).
struct CudnnApi {
  size_t (*GetVersion)();
  size_t (*GetCudartVersion)();
  const char* (*GetErrorString)(cudnnStatus_t);
  void (*GetLastErrorString)(char*, size_t);
  cudnnStatus_t (*Create)(cudnnHandle_t*);
  cudnnStatus_t (*Destroy)(cudnnHandle_t);
  cudnnStatus_t (*SetStream)(cudnnHandle_t, cudaStream_t);
  cudnnStatus_t (*CreateDescriptor)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*);
  cudnnStatus_t (*DestroyDescriptor)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*Finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*SetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                cudnnBackendAttributeType_t, int64_t, const void*);
  cudnnStatus_t (*GetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                cudnnBackendAttributeType_t, int64_t, int64_t*, void*);
  cudnnStatus_t (*Execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
  std::string file, error;  // error: why it could not be loaded
};

/// The library, loaded at the first call: libcudnn_graph.so.9, or TRELLIS_CUDNN_LIBRARY
/// (cudnn_attention.cu; a .cu file, which the emulated build rewrites to open its own cuDNN).
const CudnnApi& cudnn();

/// Throws where a cuDNN call failed, naming the call and what cuDNN said of it.
void check(cudnnStatus_t status, const char* what);

/// One backend descriptor, destroyed with it.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnn().CreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
  }
  ~Desc() {
    if (d_) cudnn().DestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t n,
            const void* values) {
    check(cudnn().SetAttribute(d_, name, type, n, values), "cudnnBackendSetAttribute");
    return *this;
  }
  Desc& set(cudnnBackendAttributeName_t name, const Desc& d) {
    cudnnBackendDescriptor_t v = d.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }
  Desc& set(cudnnBackendAttributeName_t name, cudnnDataType_t v) {
    return set(name, CUDNN_TYPE_DATA_TYPE, 1, &v);
  }
  Desc& set(cudnnBackendAttributeName_t name, int64_t v) {
    return set(name, CUDNN_TYPE_INT64, 1, &v);
  }
  Desc& finalize(const char* what) {
    check(cudnn().Finalize(d_), what);
    return *this;
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

/// A graph under construction: its tensors and operations, kept alive as long as its plan.
class Graph {
 public:
  static constexpr int64_t kFirstVirtualUid = 100;  // (the caller's tensors: uids under it)

  explicit Graph(cudnnHandle_t handle) : handle_(handle) {}

  /// A tensor; uid 0 makes it virtual (an intermediate the engine keeps to itself).
  const Desc& tensor(const Dims& dims, const Dims& strides, cudnnDataType_t type, int64_t uid = 0,
                     bool by_value = false) {
    Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const bool is_virtual = uid == 0;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, is_virtual ? next_virtual_++ : uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, int64_t(16));
    if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &kTrue);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &kTrue);
    return t.finalize("a tensor descriptor");
  }
  /// A float passed by value (its address in the variant pack is a host address).
  const Desc& scalar(int64_t uid) {
    return tensor({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, uid, true);
  }

  /// y = mode(x[, b][, t]); GEN_INDEX takes an axis.
  void pointwise(cudnnPointwiseMode_t mode, const Desc& x, const Desc* b, const Desc& y,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, const Desc* t = nullptr,
                 int64_t axis = -1) {
    Desc& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, precision);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw.finalize("a pointwise descriptor");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    ops_.push_back(&op.finalize("a pointwise operation"));
  }
  /// c = a·b over the last two dimensions, batched over the first two (b's heads broadcast
  /// over a's where fewer: grouped heads).
  void matmul(const Desc& a, const Desc& b, const Desc& c) {
    Desc& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    // (no CUDNN_ATTR_MATMUL_PADDING_VALUE: cuDNN's frontend sets it only with a padding mask,
    // and an engine may take a padded product for that graph)
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT).finalize("a matmul descriptor");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    ops_.push_back(&op.finalize("a matmul operation"));
  }
  /// y = the max or sum of x over the dimensions where y is smaller.
  void reduction(cudnnReduceTensorOp_t mode, const Desc& x, const Desc& y) {
    Desc& r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode)
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT)
        .finalize("a reduction descriptor");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
    ops_.push_back(&op.finalize("a reduction operation"));
  }
  /// y: x's elements under y's dimensions and strides (a transpose, without moving data).
  void reshape(const Desc& x, const Desc& y) {
    Desc& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    ops_.push_back(&op.finalize("a reshape operation"));
  }

  /// The engine configurations cuDNN's heuristics in `mode` offer for `graph`, best first.
  std::vector<std::unique_ptr<Desc>> engine_configs(const Desc& graph, cudnnBackendHeurMode_t mode) {
    Desc& heur = keep(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
        .finalize("the engine heuristics");
    int64_t n = 0;
    check(cudnn().GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr),
          "the heuristics' count");
    std::vector<std::unique_ptr<Desc>> configs;
    std::vector<cudnnBackendDescriptor_t> handles;
    for (int64_t i = 0; i < n; ++i) {
      configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      handles.push_back(configs.back()->get());
    }
    if (n > 0)
      check(cudnn().GetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, handles.data()),
            "the heuristics' results");
    configs.resize(size_t(std::max<int64_t>(n, 0)));
    return configs;
  }

  /// One execution plan of the graph: its engine's workspace and which of the heuristics'
  /// configurations it runs, of how many ("mode A #0 of 2").
  struct Built {
    std::unique_ptr<Desc> plan;
    int64_t workspace = 0;
    std::string choice;
  };

  /// The operation graph, the heuristics' engine configurations, and the plan of the first that
  /// builds — or, with `every`, of each that builds (to be timed against one another): mode A's,
  /// or the fallback list's where none of those builds.
  std::vector<Built> plans(bool every) {
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const Desc* op : ops_) ops.push_back(op->get());
    Desc& graph = keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_)
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops.size()),
             ops.data())
        .finalize("the operation graph");
    // The heuristics' configurations (mode A, as cuDNN's frontend asks), then the fallback
    // list where none of those builds; each configuration's error kept for the message.
    std::vector<Built> built;
    std::string errors;
    int64_t tried = 0;
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "mode A" : "fallback";
      std::vector<std::unique_ptr<Desc>> configs;
      try {
        configs = engine_configs(graph, mode);
      } catch (const std::runtime_error& e) {
        errors += std::string(errors.empty() ? "" : "; ") + mode_name + ": " + e.what();
        continue;
      }
      for (size_t i = 0; i < configs.size(); ++i, ++tried) {
        auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        try {
          plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_)
              .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *configs[i])
              .finalize("the execution plan");
          Built b{std::move(plan), 0,
                  std::string(mode_name) + " #" + std::to_string(i) + " of " +
                      std::to_string(configs.size())};
          int64_t count = 0;
          check(cudnn().GetAttribute(b.plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &count, &b.workspace),
                "the plan's workspace size");
          configs_.push_back(std::move(configs[i]));  // kept with the plan, as the frontend does
          built.push_back(std::move(b));
          if (!every) return built;
        } catch (const std::runtime_error& e) {  // the next configuration may build
          if (errors.find(e.what()) == std::string::npos)  // (each reason once)
            errors += std::string(errors.empty() ? "" : "; ") + mode_name + " #" +
                      std::to_string(i) + ": " + e.what();
        }
      }
      if (!built.empty()) return built;
    }
    if (tried == 0)
      throw std::runtime_error(
          "cuDNN: no engine for the graph (its attention engines are compiled at run time: is "
          "libnvrtc.so." + std::to_string(CUDART_VERSION / 1000) + " on the library path?)" +
          (errors.empty() ? "" : " (" + errors + ")"));
    throw std::runtime_error(std::to_string(tried) + " engine configuration(s), none built: " +
                             errors);
  }

 private:
  Desc& keep(cudnnBackendDescriptorType_t type) { return descs_.emplace_back(type); }
  static constexpr bool kTrue = true;
  cudnnHandle_t handle_;
  std::deque<Desc> descs_;
  std::vector<std::unique_ptr<Desc>> configs_;  // the engine configurations of the plans
  std::vector<const Desc*> ops_;
  int64_t next_virtual_ = kFirstVirtualUid;
};

}  // namespace trellis::cuda::cudnn_backend
