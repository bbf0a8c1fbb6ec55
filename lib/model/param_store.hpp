// Where the model's parameters and gradients live while it runs. The model works unit by unit —
// unit 0 the embeddings, unit 1+l block l, the last unit the final LayerNorm (ParamTable::units) —
// and asks the store for each unit's memory just before it needs it. A plain store keeps every
// unit resident; ZeRO (lib/parallel/) gathers sharded parameters on acquire, frees them on
// release, and starts a bucket's gradient reduction once the units in it are released.
#pragma once
#include <cstdint>

#include "core/dtype.hpp"

namespace trellis {

class ParamStore {
 public:
  virtual ~ParamStore() = default;
  /// The unit's parameters as the model reads them, (end − begin) values of the run's type (fp32,
  /// or the bf16 copy of the fp32 master weights in a bf16 run) starting at the unit's first
  /// element. Valid until release_params(unit).
  virtual CPtr acquire_params(int unit) = 0;
  virtual void release_params(int unit) = 0;
  /// A hint: the unit will be acquired next (ZeRO-3 starts gathering it now).
  virtual void prefetch_params(int unit) { (void)unit; }
  /// The unit's gradient buffer, (end − begin) floats (fp32 in any run); the model accumulates
  /// (+=) into it.
  virtual float* acquire_grads(int unit) = 0;
  /// The unit's gradient for this micro-batch is complete.
  virtual void release_grads(int unit) = 0;
};

}  // namespace trellis

#include "core/memory.hpp"
#include "model/params.hpp"

namespace trellis {

/// Every parameter and gradient resident in two flat fp32 buffers in host memory: one device, no
/// sharding (tests, generation).
class ResidentParams : public ParamStore {
 public:
  explicit ResidentParams(const ParamTable& table);
  CPtr acquire_params(int unit) override { return params() + table_.units[unit].begin; }
  void release_params(int) override {}
  float* acquire_grads(int unit) override { return grads() + table_.units[unit].begin; }
  void release_grads(int) override {}

  float* params() { return params_.f32(); }  // (P) flat, ParamTable order
  float* grads() { return grads_.f32(); }    // (P)
  void zero_grads();

 private:
  const ParamTable& table_;
  Buffer params_, grads_;  // (P) fp32 each, flat in ParamTable order
};

}  // namespace trellis
