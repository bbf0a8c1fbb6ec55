// The emulated GPU's cuDNN (build/emu/libcudnn-emu.so, which the emulated build's cuDNN attention
// opens in place of libcudnn_graph.so.9): the backend API's functions that
// lib/backend/cuda/cudnn_attention.cu calls, with an interpreter of the operation graphs it
// builds, on the emulated device memory (host memory).
//
// It is not cuDNN: whether cuDNN's fused-attention engines recognise a graph only a GPU can say.
// What it checks is the rest — that every attribute is set with the type cuDNN's documentation
// gives it, that descriptors are finalized before use, that the shapes of every operation agree,
// that each virtual tensor has one producer ahead of its readers, that every non-virtual tensor
// has an address in the variant pack — and what the graph computes: each operation as the
// documentation defines it (matmul batched with broadcast heads, pointwise with broadcast,
// reductions over the dimensions where the output is smaller, reshape as the same memory under
// other strides), intermediates held in double and rounded to their declared type where they
// are read or written, so that the fp32 kernels can judge the result.
//
// TRELLIS_EMU_CUDNN_VERSION: the version it claims (default 9.19.0). TRELLIS_EMU_CUDNN_FAULT: 1
// scales every non-virtual output by 1.5 (a wrong engine: the check must refuse it); 2 offers no
// engine for any graph (the run must go on without cuDNN); 3 offers none for a backward that
// masks the scores after subtracting the statistics (as cuDNN's frontend does now), as engines
// of 2024 might not: the other spelling must be tried; 4 offers engines only in the fallback
// list (CUDNN_HEUR_MODE_FALLBACK), none in mode A; 5 offers two, the first of which fails to
// build an execution plan (the next must be taken); 6 offers two, the first of which builds but
// fails to run (tuning, which runs each, must take the other). TRELLIS_EMU_CUDNN_ENGINES: how
// many engine configurations it offers otherwise (1; every one builds and computes alike).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "emu_cudnn.hpp"

using namespace emu_cudnn;

namespace {

thread_local std::string last_error;

cudnnStatus_t fail(cudnnStatus_t status, const std::string& why) {
  last_error = why;
  return status;
}

size_t element_bytes(cudnnBackendAttributeType_t t) {
  switch (t) {
    case CUDNN_TYPE_HANDLE:
    case CUDNN_TYPE_VOID_PTR:
    case CUDNN_TYPE_BACKEND_DESCRIPTOR:
      return sizeof(void*);
    case CUDNN_TYPE_BOOLEAN:
      return sizeof(bool);
    case CUDNN_TYPE_INT64:
    case CUDNN_TYPE_DOUBLE:
      return 8;
    case CUDNN_TYPE_FLOAT:
      return 4;
    case CUDNN_TYPE_DATA_TYPE:
    case CUDNN_TYPE_HEUR_MODE:
    case CUDNN_TYPE_POINTWISE_MODE:
    case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE:
      return sizeof(int);
    default:
      return 0;
  }
}

// The type cuDNN's documentation gives each attribute the attention graphs use.
const std::map<int, cudnnBackendAttributeType_t>& attribute_types() {
  static const std::map<int, cudnnBackendAttributeType_t> types = {
      {CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE},
      {CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN},
      {CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN},
      {CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE},
      {CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE},
      {CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT},
      {CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT},
      {CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE},
      {CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE},
      {CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE},
      {CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE},
      {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE},
      {CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE},
      {CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE},
      {CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR},
      {CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64},
      {CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR},
      {CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR},
  };
  return types;
}

// Required attributes at finalize, by descriptor type.
std::string missing(const Desc* d) {
  std::vector<int> need;
  switch (d->type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
      need = {CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_ATTR_TENSOR_STRIDES,
              CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT};
      break;
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
      need = {CUDNN_ATTR_POINTWISE_MODE};
      break;
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
      need = {CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
              CUDNN_ATTR_OPERATION_POINTWISE_YDESC};
      break;
    case CUDNN_BACKEND_MATMUL_DESCRIPTOR:
      need = {CUDNN_ATTR_MATMUL_COMP_TYPE};
      break;
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
      need = {CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_ATTR_OPERATION_MATMUL_BDESC,
              CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_ATTR_OPERATION_MATMUL_DESC};
      break;
    case CUDNN_BACKEND_REDUCTION_DESCRIPTOR:
      need = {CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_ATTR_REDUCTION_COMP_TYPE};
      break;
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
      need = {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
              CUDNN_ATTR_OPERATION_REDUCTION_DESC};
      break;
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR:
      need = {CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_ATTR_OPERATION_RESHAPE_YDESC};
      break;
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
      need = {CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_ATTR_OPERATIONGRAPH_OPS};
      break;
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
      need = {CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_ATTR_ENGINEHEUR_MODE};
      break;
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
      need = {CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG};
      break;
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
      need = {CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
              CUDNN_ATTR_VARIANT_PACK_WORKSPACE};
      break;
    default:
      break;
  }
  for (int n : need)
    if (!find(d, n)) return "attribute " + std::to_string(n) + " not set";
  for (const auto& [name, a] : d->attrs)  // descriptors it refers to are finalized
    if (a.type == CUDNN_TYPE_BACKEND_DESCRIPTOR && name != CUDNN_ATTR_ENGINEHEUR_RESULTS)
      for (void* p : values<void*>(d, name))
        if (!p || !static_cast<Desc*>(p)->finalized)
          return "attribute " + std::to_string(name) + " refers to a descriptor not finalized";
  return "";
}

bool is_binary(cudnnPointwiseMode_t m) {
  return m == CUDNN_POINTWISE_ADD || m == CUDNN_POINTWISE_SUB || m == CUDNN_POINTWISE_MUL ||
         m == CUDNN_POINTWISE_DIV || m == CUDNN_POINTWISE_CMP_GE ||
         m == CUDNN_POINTWISE_BINARY_SELECT;
}

// An operation's shapes and modes, checked at its finalize.
std::string check_operation(const Desc* op) {
  std::vector<const Desc*> in, out;
  operands(op, in, out);
  switch (op->type) {
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: {
      const Desc* pw = child(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR);
      const auto mode = value<cudnnPointwiseMode_t>(pw, CUDNN_ATTR_POINTWISE_MODE);
      const bool binary = is_binary(mode);
      if (binary != bool(child(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC)))
        return "pointwise mode " + std::to_string(mode) + (binary ? " needs" : " takes no") +
               " BDESC";
      if ((mode == CUDNN_POINTWISE_BINARY_SELECT) !=
          bool(child(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC)))
        return "TDESC goes with BINARY_SELECT only";
      if (mode == CUDNN_POINTWISE_GEN_INDEX && !find(pw, CUDNN_ATTR_POINTWISE_AXIS))
        return "GEN_INDEX without an axis";
      for (int alpha :
           {CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2})
        if (value<float>(op, alpha, 1.0f) != 1.0f) return "the emulator takes alpha 1 only";
      const Index y = describe(out[0]).dims;
      for (const Desc* t : in)
        if (!broadcasts(y, describe(t).dims)) return "a pointwise input does not broadcast to Y";
      return "";
    }
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: {
      const Index a = describe(in[0]).dims, b = describe(in[1]).dims, c = describe(out[0]).dims;
      if (a[2] != c[2] || b[3] != c[3] || a[3] != b[2]) return "matmul shapes disagree";
      for (int k = 0; k < 2; ++k)
        if (c[k] % a[k] != 0 || c[k] % b[k] != 0) return "matmul batches do not broadcast";
      return "";
    }
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
      return broadcasts(describe(in[0]).dims, describe(out[0]).dims)
                 ? ""
                 : "a reduction's Y must divide X in every dimension";
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: {
      const Index x = describe(in[0]).dims, y = describe(out[0]).dims;
      return x[0] * x[1] * x[2] * x[3] == y[0] * y[1] * y[2] * y[3] ? ""
                                                                    : "a reshape changes the size";
    }
    default:
      return "";
  }
}

// A graph's operations: unique ids unique, each virtual tensor written once, before it is read.
std::string check_graph(const Desc* g) {
  std::map<int64_t, const Desc*> by_uid;
  std::set<const Desc*> written;
  for (void* p : values<void*>(g, CUDNN_ATTR_OPERATIONGRAPH_OPS)) {
    const Desc* op = static_cast<Desc*>(p);
    std::vector<const Desc*> in, out;
    operands(op, in, out);
    for (const Desc* t : in) {
      if (value<bool>(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL) && !written.count(t))
        return "virtual tensor " + std::to_string(uid(t)) + " read before it is written";
    }
    for (const Desc* t : out)
      if (!written.insert(t).second) return "tensor " + std::to_string(uid(t)) + " written twice";
    for (const Desc* t : in) out.push_back(t);
    for (const Desc* t : out) {
      auto [it, fresh] = by_uid.emplace(uid(t), t);
      if (!fresh && it->second != t)
        return "unique id " + std::to_string(uid(t)) + " on two tensor descriptors";
    }
  }
  return "";
}

// Whether the graph's causal mask (its BINARY_SELECT) takes scores made by a subtraction: the
// backward as cuDNN's frontend spells it now, which fault 3's engines do not know.
bool masks_after_a_sub(const Desc* g) {
  std::map<const Desc*, const Desc*> producer;  // tensor → the operation writing it
  const std::vector<void*> ops = values<void*>(g, CUDNN_ATTR_OPERATIONGRAPH_OPS);
  for (void* p : ops) {
    std::vector<const Desc*> in, out;
    operands(static_cast<Desc*>(p), in, out);
    for (const Desc* t : out) producer[t] = static_cast<Desc*>(p);
  }
  auto mode = [](const Desc* op) {
    if (!op || op->type != CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)
      return cudnnPointwiseMode_t(-1);
    return value<cudnnPointwiseMode_t>(child(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR),
                                       CUDNN_ATTR_POINTWISE_MODE);
  };
  for (void* p : ops) {
    const Desc* op = static_cast<Desc*>(p);
    if (mode(op) != CUDNN_POINTWISE_BINARY_SELECT) continue;
    auto it = producer.find(child(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC));
    if (it != producer.end() && mode(it->second) == CUDNN_POINTWISE_SUB) return true;
  }
  return false;
}

cudnnStatus_t finalize(Desc* d) {
  if (std::string why = missing(d); !why.empty()) return fail(CUDNN_STATUS_BAD_PARAM, why);
  if (d->type == CUDNN_BACKEND_TENSOR_DESCRIPTOR) {
    const auto dims = values<int64_t>(d, CUDNN_ATTR_TENSOR_DIMENSIONS);
    const auto strides = values<int64_t>(d, CUDNN_ATTR_TENSOR_STRIDES);
    if (dims.size() != 4 || strides.size() != 4)
      return fail(CUDNN_STATUS_BAD_PARAM, "the emulator takes 4-dimensional tensors only");
    for (int k = 0; k < 4; ++k)
      if (dims[k] < 1 || strides[k] < 1)
        return fail(CUDNN_STATUS_BAD_PARAM, "dims and strides ≥ 1");
  }
  std::string why;
  if (d->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR ||
      d->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR ||
      d->type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR ||
      d->type == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)
    why = check_operation(d);
  if (d->type == CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR) why = check_graph(d);
  if (d->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR) {
    const Desc* config = child(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG);
    if (config->broken)
      return fail(CUDNN_STATUS_NOT_SUPPORTED, "this engine configuration does not build (fault 5)");
    d->graph = config->graph;
    d->fails = config->fails;
  }
  if (!why.empty()) return fail(CUDNN_STATUS_BAD_PARAM, why);
  d->finalized = true;
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

// 9.19.0 unless TRELLIS_EMU_CUDNN_VERSION says another (9.13.0: 91300).
size_t cudnnGetCudartVersion() { return CUDART_VERSION; }  // (the emulator's: this build's)

size_t cudnnGetVersion() {
  const char* v = std::getenv("TRELLIS_EMU_CUDNN_VERSION");
  return v && *v ? size_t(std::atol(v)) : 91900;
}

const char* cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS:
      return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_BAD_PARAM:
      return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED:
      return "CUDNN_STATUS_NOT_SUPPORTED";
    default:
      return "CUDNN_STATUS (emulated)";
  }
}

void cudnnGetLastErrorString(char* message, size_t max_size) {
  if (max_size == 0) return;
  std::snprintf(message, max_size, "%s", last_error.c_str());
  last_error.clear();
}

cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
  static int the_handle;
  *handle = reinterpret_cast<cudnnHandle_t>(&the_handle);
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t) { return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnSetStream(cudnnHandle_t, cudaStream_t) { return CUDNN_STATUS_SUCCESS; }

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type,
                                           cudnnBackendDescriptor_t* d) {
  *d = reinterpret_cast<cudnnBackendDescriptor_t>(new Desc{type, {}, false, nullptr});
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
  delete reinterpret_cast<Desc*>(d);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t desc,
                                       cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t n,
                                       const void* elements) {
  Desc* d = reinterpret_cast<Desc*>(desc);
  if (d->finalized) return fail(CUDNN_STATUS_BAD_PARAM, "set on a finalized descriptor");
  const auto& types = attribute_types();
  auto it = types.find(name);
  if (it == types.end())
    return fail(CUDNN_STATUS_NOT_SUPPORTED, "attribute " + std::to_string(name) + " not emulated");
  if (it->second != type)
    return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "attribute " + std::to_string(name) +
                                                           " given type " + std::to_string(type) +
                                                           ", takes " + std::to_string(it->second));
  if (n < 1 || !elements) return fail(CUDNN_STATUS_BAD_PARAM, "no elements");
  Attr a{type, n, std::vector<char>(size_t(n) * element_bytes(type))};
  std::memcpy(a.bytes.data(), elements, a.bytes.size());
  d->attrs[name] = std::move(a);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const desc,
                                       cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t requested,
                                       int64_t* count, void* elements) {
  Desc* d = reinterpret_cast<Desc*>(desc);
  if (!d->finalized) return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "get before finalize");
  if (d->type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR && name == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR) return fail(CUDNN_STATUS_BAD_PARAM, "results type");
    const std::string fault = fault_mode();
    const Desc* graph = child(d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH);
    const bool mode_a = value<cudnnBackendHeurMode_t>(d, CUDNN_ATTR_ENGINEHEUR_MODE) == CUDNN_HEUR_MODE_A;
    const int64_t engines = fault == "2" || (fault == "3" && masks_after_a_sub(graph)) ||
                                    (fault == "4" && mode_a)
                                ? 0
                            : fault == "5" || fault == "6" ? 2  // (the first does not build/run)
                                                           : engine_count();
    *count = requested == 0 ? engines : std::min(engines, requested);
    for (int64_t i = 0; i < std::min(requested, engines); ++i) {
      Desc* cfg = static_cast<Desc**>(elements)[i];
      if (cfg->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)
        return fail(CUDNN_STATUS_BAD_PARAM, "results into a descriptor of another type");
      cfg->graph = child(d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH);
      cfg->broken = fault == "5" && i == 0;
      cfg->fails = fault == "6" && i == 0;
      cfg->finalized = true;
    }
    return CUDNN_STATUS_SUCCESS;
  }
  if (d->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR &&
      name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) {
    if (type != CUDNN_TYPE_INT64 || requested < 1) return fail(CUDNN_STATUS_BAD_PARAM, "size type");
    *count = 1;
    *static_cast<int64_t*>(elements) = kEngineWorkspace;
    return CUDNN_STATUS_SUCCESS;
  }
  return fail(CUDNN_STATUS_NOT_SUPPORTED, "attribute " + std::to_string(name) + " not emulated");
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d) {
  return finalize(reinterpret_cast<Desc*>(d));
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t, cudnnBackendDescriptor_t plan_desc,
                                  cudnnBackendDescriptor_t pack_desc) {
  const Desc* plan = reinterpret_cast<Desc*>(plan_desc);
  const Desc* pack = reinterpret_cast<Desc*>(pack_desc);
  if (!plan->finalized || !pack->finalized || plan->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)
    return fail(CUDNN_STATUS_BAD_PARAM, "execute takes a finalized plan and variant pack");
  if (plan->fails) return fail(CUDNN_STATUS_EXECUTION_FAILED, "this plan does not run (fault 6)");
  const auto uids = values<int64_t>(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
  const auto pointers = values<void*>(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
  if (uids.size() != pointers.size()) return fail(CUDNN_STATUS_BAD_PARAM, "ids and pointers");
  std::map<int64_t, void*> at;
  for (size_t i = 0; i < uids.size(); ++i) at[uids[i]] = pointers[i];
  for (void* p : values<void*>(plan->graph, CUDNN_ATTR_OPERATIONGRAPH_OPS)) {
    std::vector<const Desc*> in, out;
    operands(static_cast<Desc*>(p), in, out);
    for (const Desc* t : in) out.push_back(t);
    for (const Desc* t : out) {
      if (value<bool>(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL)) continue;
      auto it = at.find(uid(t));
      if (it == at.end() || !it->second)
        return fail(CUDNN_STATUS_BAD_PARAM, "no address for tensor " + std::to_string(uid(t)));
      if (!value<bool>(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE) &&
          reinterpret_cast<uintptr_t>(it->second) % 16 != 0)
        return fail(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER,
                    "tensor " + std::to_string(uid(t)) + " not 16-byte aligned");
    }
  }
  void* workspace = value<void*>(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE);
  const std::string why = run(plan->graph, at, workspace);
  return why.empty() ? CUDNN_STATUS_SUCCESS : fail(CUDNN_STATUS_BAD_PARAM, why);
}

}  // extern "C"
