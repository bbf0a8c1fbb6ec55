// Element types, and pointers that carry theirs. A run in system.precision = bf16 keeps its
// activations and the parameters its model reads in bf16 (half the bytes), while gradients, the
// fp32 master weights, AdamW's state, layer norm's statistics and the losses stay fp32: one
// buffer of the model can be either type, decided when the run starts. Ptr and CPtr say which at
// run time, so that the model's code is written once and each kernel checks what it is handed.
//
// A float* converts to a Ptr (dtype f32) without a cast, so fp32 callers (the decoder, tests,
// the optimizer) read as before.
#pragma once
#include <cstddef>
#include <cstdint>

namespace trellis {

enum class DType : uint8_t { f32, bf16 };
constexpr size_t dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }
const char* dtype_name(DType t);  // "fp32" | "bf16"

/// One bf16 value as stored: the upper 16 bits of an fp32 (core/bf16.hpp converts). Same size
/// and alignment as CUDA's __nv_bfloat16, which the CUDA backend reinterprets it as.
struct bf16_t {
  uint16_t bits;
};

/// A pointer into a backend's memory (device memory for cuda) with the type of its elements.
struct Ptr {
  void* data = nullptr;
  DType dtype = DType::f32;

  Ptr() = default;
  Ptr(std::nullptr_t) {}
  Ptr(float* p) : data(p) {}
  Ptr(bf16_t* p) : data(p), dtype(DType::bf16) {}
  Ptr(void* p, DType t) : data(p), dtype(t) {}

  /// The pointer `i` elements on.
  Ptr at(int64_t i) const {
    return {data ? static_cast<char*>(data) + i * int64_t(dtype_bytes(dtype)) : nullptr, dtype};
  }
  /// Bytes of `n` elements.
  size_t bytes(int64_t n) const { return size_t(n) * dtype_bytes(dtype); }
  bool is_f32() const { return dtype == DType::f32; }
  /// The pointer as what it is; std::logic_error if it is the other type (a programming error).
  float* f32() const;
  bf16_t* bf16() const;
  explicit operator bool() const { return data != nullptr; }
};

/// The same for memory that is only read.
struct CPtr {
  const void* data = nullptr;
  DType dtype = DType::f32;

  CPtr() = default;
  CPtr(std::nullptr_t) {}
  CPtr(const float* p) : data(p) {}
  CPtr(const bf16_t* p) : data(p), dtype(DType::bf16) {}
  CPtr(const void* p, DType t) : data(p), dtype(t) {}
  CPtr(Ptr p) : data(p.data), dtype(p.dtype) {}

  CPtr at(int64_t i) const {
    return {data ? static_cast<const char*>(data) + i * int64_t(dtype_bytes(dtype)) : nullptr,
            dtype};
  }
  size_t bytes(int64_t n) const { return size_t(n) * dtype_bytes(dtype); }
  bool is_f32() const { return dtype == DType::f32; }
  const float* f32() const;
  const bf16_t* bf16() const;
  explicit operator bool() const { return data != nullptr; }
};

inline bool operator==(CPtr a, CPtr b) { return a.data == b.data && a.dtype == b.dtype; }

}  // namespace trellis
