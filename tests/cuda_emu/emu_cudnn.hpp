// The emulated cuDNN's descriptors and tensors (emu_cudnn_lib.cpp says what it is): shared by its
// backend API (emu_cudnn_lib.cpp) and its interpreter of operation graphs (emu_cudnn_run.cpp).
#pragma once
#include <cudnn_graph.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace emu_cudnn {

struct Attr {
  cudnnBackendAttributeType_t type;
  int64_t n;
  std::vector<char> bytes;
};

struct Desc {
  cudnnBackendDescriptorType_t type;
  std::map<int, Attr> attrs;
  bool finalized = false;
  Desc* graph = nullptr;  // an engine configuration's or plan's operation graph
  bool broken = false;    // an engine configuration whose plan does not build (fault 5)
  bool fails = false;     // a configuration or plan that builds but fails to run (fault 6)
};

/// TRELLIS_EMU_CUDNN_ENGINES: how many engine configurations the heuristics offer for a graph,
/// all of which build and compute alike (default 1), for the tuning that times them.
inline int64_t engine_count() {
  const char* n = std::getenv("TRELLIS_EMU_CUDNN_ENGINES");
  return n && std::atoi(n) > 0 ? std::atoi(n) : 1;
}

inline std::string fault_mode() {
  const char* f = std::getenv("TRELLIS_EMU_CUDNN_FAULT");
  return f ? f : "";
}

constexpr int64_t kEngineWorkspace = 4096;  // what the emulated engine asks for, and scribbles on

// ---- reading descriptors ----
inline const Attr* find(const Desc* d, int name) {
  auto it = d->attrs.find(name);
  return it == d->attrs.end() ? nullptr : &it->second;
}
template <typename T>
std::vector<T> values(const Desc* d, int name) {
  const Attr* a = find(d, name);
  if (!a) return {};
  std::vector<T> v(size_t(a->n));
  std::memcpy(v.data(), a->bytes.data(), a->bytes.size());
  return v;
}
template <typename T>
T value(const Desc* d, int name, T otherwise = T{}) {
  const Attr* a = find(d, name);
  if (!a || a->bytes.size() < sizeof(T)) return otherwise;
  T v;
  std::memcpy(&v, a->bytes.data(), sizeof(T));
  return v;
}
inline Desc* child(const Desc* d, int name) { return static_cast<Desc*>(value<void*>(d, name)); }

// ---- tensors as the interpreter holds them ----
using Index = std::array<int64_t, 4>;

struct Tensor {
  const Desc* d = nullptr;
  Index dims{}, strides{};
  cudnnDataType_t type = CUDNN_DATA_FLOAT;    // declared
  cudnnDataType_t stored = CUDNN_DATA_FLOAT;  // the memory's (a reshape reads another's)
  bool is_virtual = false;
  char* memory = nullptr;                     // non-virtual: the variant pack's address
  std::shared_ptr<std::vector<double>> held;  // virtual: the interpreter's

  int64_t offset(const Index& i) const {
    return i[0] * strides[0] + i[1] * strides[1] + i[2] * strides[2] + i[3] * strides[3];
  }
  static double round_to(cudnnDataType_t t, double v) {
    switch (t) {
      case CUDNN_DATA_FLOAT:
        return double(float(v));
      case CUDNN_DATA_BFLOAT16: {
        const float f = float(v);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        if ((b & 0x7fffffffu) <= 0x7f800000u) b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
        float r;
        std::memcpy(&r, &b, 4);
        return r;
      }
      case CUDNN_DATA_INT32:
        return std::trunc(v);
      case CUDNN_DATA_BOOLEAN:
        return v != 0 ? 1 : 0;
      default:
        return v;
    }
  }
  double get(const Index& i) const {
    const int64_t o = offset(i);
    double v;
    if (held) {
      v = (*held)[size_t(o)];
    } else if (stored == CUDNN_DATA_BFLOAT16) {
      uint16_t h;
      std::memcpy(&h, memory + 2 * o, 2);
      const uint32_t b = uint32_t(h) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      v = f;
    } else if (stored == CUDNN_DATA_FLOAT) {
      float f;
      std::memcpy(&f, memory + 4 * o, 4);
      v = f;
    } else {
      v = NAN;
    }
    return round_to(type, v);
  }
  void set(const Index& i, double v) {
    v = round_to(type, v);
    const int64_t o = offset(i);
    if (held) {
      (*held)[size_t(o)] = v;
    } else if (type == CUDNN_DATA_BFLOAT16) {
      const float f = float(v);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      const uint16_t h = uint16_t(b >> 16);  // already rounded
      std::memcpy(memory + 2 * o, &h, 2);
    } else {
      const float f = float(v);
      std::memcpy(memory + 4 * o, &f, 4);
    }
  }
};

template <typename F>
void each(const Index& dims, F f) {
  Index i{};
  for (i[0] = 0; i[0] < dims[0]; ++i[0])
    for (i[1] = 0; i[1] < dims[1]; ++i[1])
      for (i[2] = 0; i[2] < dims[2]; ++i[2])
        for (i[3] = 0; i[3] < dims[3]; ++i[3]) f(i);
}

// Where index i of a tensor of dims `to` reads a tensor of dims `from`: the same index, 0 where
// `from` is 1, and i·from/to where `from` divides `to` otherwise (grouped heads).
inline Index broadcast(const Index& i, const Index& to, const Index& from) {
  Index j{};
  for (int k = 0; k < 4; ++k) j[k] = from[k] == 1 ? 0 : i[k] * from[k] / to[k];
  return j;
}
inline bool broadcasts(const Index& to, const Index& from) {
  for (int k = 0; k < 4; ++k)
    if (from[k] != 1 && (from[k] > to[k] || to[k] % from[k] != 0)) return false;
  return true;
}

inline Tensor describe(const Desc* d) {
  Tensor t;
  t.d = d;
  const auto dims = values<int64_t>(d, CUDNN_ATTR_TENSOR_DIMENSIONS);
  const auto strides = values<int64_t>(d, CUDNN_ATTR_TENSOR_STRIDES);
  for (int k = 0; k < 4; ++k) t.dims[k] = dims[k], t.strides[k] = strides[k];
  t.type = t.stored = value<cudnnDataType_t>(d, CUDNN_ATTR_TENSOR_DATA_TYPE);
  t.is_virtual = value<bool>(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL);
  return t;
}

inline int64_t uid(const Desc* d) { return value<int64_t>(d, CUDNN_ATTR_TENSOR_UNIQUE_ID); }

// The tensors an operation reads and writes.
inline void operands(const Desc* op, std::vector<const Desc*>& in, std::vector<const Desc*>& out) {
  auto add = [&](std::vector<const Desc*>& v, int name) {
    if (const Desc* t = child(op, name)) v.push_back(t);
  };
  switch (op->type) {
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
      add(in, CUDNN_ATTR_OPERATION_POINTWISE_XDESC), add(in, CUDNN_ATTR_OPERATION_POINTWISE_BDESC);
      add(in, CUDNN_ATTR_OPERATION_POINTWISE_TDESC), add(out, CUDNN_ATTR_OPERATION_POINTWISE_YDESC);
      break;
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
      add(in, CUDNN_ATTR_OPERATION_MATMUL_ADESC), add(in, CUDNN_ATTR_OPERATION_MATMUL_BDESC);
      add(out, CUDNN_ATTR_OPERATION_MATMUL_CDESC);
      break;
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
      add(in, CUDNN_ATTR_OPERATION_REDUCTION_XDESC), add(out, CUDNN_ATTR_OPERATION_REDUCTION_YDESC);
      break;
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR:
      add(in, CUDNN_ATTR_OPERATION_RESHAPE_XDESC), add(out, CUDNN_ATTR_OPERATION_RESHAPE_YDESC);
      break;
    default:
      break;
  }
}

/// Runs graph g's operations in order on the variant pack's tensors (uid → address); "" or why
/// it could not.
std::string run(const Desc* g, const std::map<int64_t, void*>& pointers, void* workspace);

}  // namespace emu_cudnn
