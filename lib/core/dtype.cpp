#include "core/dtype.hpp"

#include <stdexcept>
#include <string>

namespace trellis {

const char* dtype_name(DType t) { return t == DType::f32 ? "fp32" : "bf16"; }

namespace {
// A null pointer is any type's: optional arguments (a bias) pass as null.
[[noreturn]] void wrong_type(DType have, DType want) {
  throw std::logic_error(std::string("a ") + dtype_name(have) + " buffer where a " +
                         dtype_name(want) + " one was expected");
}
}  // namespace

float* Ptr::f32() const {
  if (data && dtype != DType::f32) wrong_type(dtype, DType::f32);
  return static_cast<float*>(data);
}
bf16_t* Ptr::bf16() const {
  if (data && dtype != DType::bf16) wrong_type(dtype, DType::bf16);
  return static_cast<bf16_t*>(data);
}
const float* CPtr::f32() const {
  if (data && dtype != DType::f32) wrong_type(dtype, DType::f32);
  return static_cast<const float*>(data);
}
const bf16_t* CPtr::bf16() const {
  if (data && dtype != DType::bf16) wrong_type(dtype, DType::bf16);
  return static_cast<const bf16_t*>(data);
}

}  // namespace trellis
