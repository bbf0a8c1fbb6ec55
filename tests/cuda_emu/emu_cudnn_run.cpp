// The emulated cuDNN's interpreter of operation graphs (emu_cudnn_lib.cpp says what it checks):
// each operation as cuDNN's documentation defines it, on the tensors as emu_cudnn.hpp holds them.
#include <algorithm>
#include <set>

#include "emu_cudnn.hpp"

namespace emu_cudnn {

std::string run(const Desc* g, const std::map<int64_t, void*>& pointers, void* workspace) {
  std::map<const Desc*, Tensor> tensors;
  auto tensor = [&](const Desc* d) -> Tensor& {
    auto it = tensors.find(d);
    if (it != tensors.end()) return it->second;
    Tensor t = describe(d);
    if (!t.is_virtual) t.memory = static_cast<char*>(pointers.at(uid(d)));
    return tensors.emplace(d, t).first->second;
  };
  auto output = [&](const Desc* d) -> Tensor& {
    Tensor& t = tensor(d);
    if (t.is_virtual && !t.held) {
      int64_t size = 1;
      for (int k = 0; k < 4; ++k) size += (t.dims[k] - 1) * t.strides[k];
      t.held = std::make_shared<std::vector<double>>(size_t(size), NAN);
    }
    return t;
  };
  std::memset(workspace, 0xa5, kEngineWorkspace);  // the engine's own: no one else's
  std::set<const Desc*> outputs;
  for (void* p : values<void*>(g, CUDNN_ATTR_OPERATIONGRAPH_OPS)) {
    const Desc* op = static_cast<Desc*>(p);
    std::vector<const Desc*> in, out;
    operands(op, in, out);
    outputs.insert(out[0]);
    if (op->type == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR) {
      const Tensor& x = tensor(in[0]);
      Tensor& y = tensor(out[0]);
      y.held = x.held, y.memory = x.memory, y.stored = x.stored;  // the same memory
      continue;
    }
    Tensor& y = output(out[0]);
    if (op->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR) {
      const Tensor &a = tensor(in[0]), &b = tensor(in[1]);
      each(y.dims, [&](const Index& i) {
        Index ia = broadcast(i, y.dims, a.dims), ib = broadcast(i, y.dims, b.dims);
        double sum = 0;
        for (int64_t k = 0; k < a.dims[3]; ++k) {
          ia[3] = k, ib[2] = k;
          ia[2] = i[2], ib[3] = i[3];
          sum += a.get(ia) * b.get(ib);
        }
        y.set(i, sum);
      });
    } else if (op->type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR) {
      const Tensor& x = tensor(in[0]);
      const auto mode = value<cudnnReduceTensorOp_t>(child(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC),
                                                     CUDNN_ATTR_REDUCTION_OPERATOR);
      int64_t size = 1;  // y's offsets
      for (int k = 0; k < 4; ++k) size += (y.dims[k] - 1) * y.strides[k];
      std::vector<double> acc(size_t(size), mode == CUDNN_REDUCE_TENSOR_MAX ? -INFINITY : 0.0);
      each(x.dims, [&](const Index& i) {
        double& a = acc[size_t(y.offset(broadcast(i, x.dims, y.dims)))];
        const double v = x.get(i);
        a = mode == CUDNN_REDUCE_TENSOR_MAX ? std::max(a, v) : a + v;
      });
      each(y.dims, [&](const Index& i) { y.set(i, acc[size_t(y.offset(i))]); });
    } else {  // pointwise
      const Desc* pw = child(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR);
      const auto mode = value<cudnnPointwiseMode_t>(pw, CUDNN_ATTR_POINTWISE_MODE);
      const int64_t axis = value<int64_t>(pw, CUDNN_ATTR_POINTWISE_AXIS);
      const Tensor& x = tensor(in[0]);
      const Tensor* b = in.size() > 1 ? &tensor(in[1]) : nullptr;
      const Tensor* t = in.size() > 2 ? &tensor(in[2]) : nullptr;
      each(y.dims, [&](const Index& i) {
        const double xv =
            mode == CUDNN_POINTWISE_GEN_INDEX ? 0 : x.get(broadcast(i, y.dims, x.dims));
        const double bv = b ? b->get(broadcast(i, y.dims, b->dims)) : 0;
        double v = NAN;
        switch (mode) {
          case CUDNN_POINTWISE_ADD:
            v = xv + bv;
            break;
          case CUDNN_POINTWISE_SUB:
            v = xv - bv;
            break;
          case CUDNN_POINTWISE_MUL:
            v = xv * bv;
            break;
          case CUDNN_POINTWISE_DIV:
            v = xv / bv;
            break;
          case CUDNN_POINTWISE_EXP:
            v = std::exp(xv);
            break;
          case CUDNN_POINTWISE_LOG:
            v = std::log(xv);
            break;
          case CUDNN_POINTWISE_IDENTITY:
            v = xv;
            break;
          case CUDNN_POINTWISE_GEN_INDEX:
            v = double(i[axis]);
            break;
          case CUDNN_POINTWISE_CMP_GE:
            v = xv >= bv;
            break;
          case CUDNN_POINTWISE_BINARY_SELECT:
            v = t->get(broadcast(i, y.dims, t->dims)) != 0 ? xv : bv;
            break;
          default:
            break;
        }
        y.set(i, v);
      });
    }
  }
  if (fault_mode() == "1")
    for (const Desc* d : outputs) {
      Tensor& t = tensor(d);
      if (!t.is_virtual) each(t.dims, [&](const Index& i) { t.set(i, 1.5 * t.get(i)); });
    }
  return "";
}

}  // namespace emu_cudnn
