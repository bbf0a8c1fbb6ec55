// CUDA backend: which kernels a bf16 attention call gets, and what the log says of it. In bf16's
// default (TRELLIS_TC_ATTENTION unset): cuDNN's fused attention (cudnn_attention.cu) at each head
// size where it loads and agrees with the fp32 kernels (cuda_attention_check.cu), at the shapes
// it has plans for (TRELLIS_CUDNN=0: never); else the mma.sync kernels (cuda_attention_mma.cu)
// where they agree; else the fp32 kernels (cuda_attention.cu) on widened copies.
// TRELLIS_TC_ATTENTION=1 takes the mma.sync kernels without the check, =0 the fp32 kernels.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <set>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_attention_tc.cuh"
#include "backend/cuda/cuda_backend.cuh"
#include "backend/cuda/cuda_factory.hpp"

namespace trellis {

bool CudaBackend::tc_attention_takes(int hd, std::initializer_list<const void*> pointers) const {
  switch (tc_attention_) {
    case TcAttention::mma:
      return cuda::mma_attention_fits(hd, pointers) &&
             (!tc_attention_checked_ || tc_attention_agrees(hd));
    default:
      return false;
  }
}

bool CudaBackend::tc_attention_agrees(int hd) const {
  auto it = tc_disagreements_.find(hd);
  if (it == tc_disagreements_.end()) {
    std::string why;
    try {
      why = cuda::tc_attention_disagreement(hd, attention_block_rows_, stream_);
    } catch (const std::runtime_error& e) {  // (a kernel that faulted leaves the context unusable)
      throw std::runtime_error(std::string(e.what()) +
                               ", in the check of the tensor-core attention" + " at head size " +
                               std::to_string(hd) + " on device " + std::to_string(device_) +
                               " (TRELLIS_TC_ATTENTION=0 runs bf16 attention on the fp32 kernels"
                               " without it)");
    }
    it = tc_disagreements_.emplace(hd, why).first;
    if (!it->second.empty())
      std::fprintf(stderr,
                   "trellis: warning: on device %d the tensor-core attention at head size %d "
                   "disagrees with the fp32 attention kernels (%s): bf16 attention runs on the "
                   "fp32 kernels, on widened copies, which is slower (TRELLIS_TC_ATTENTION=1 puts "
                   "it on the tensor cores all the same)\n",
                   device_, hd, it->second.c_str());
  }
  return it->second.empty();
}

bool CudaBackend::cudnn_takes(const cuda::AttentionShape& s,
                              std::initializer_list<const void*> pointers) const {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  if (!cudnn_agrees(s.hd)) return false;
  std::string why;
  if (cudnn_->takes(s, why)) return true;
  if (cudnn_refusals_said_.insert(s).second)  // (once a shape: the refusal is kept)
    std::fprintf(stderr,
                 "trellis: warning: %s has no plan for attention at B=%d T=%d H=%d KV=%d hd=%d "
                 "(%s): the mma.sync kernels run it where they agree with the fp32 kernels\n",
                 cudnn_->name().c_str(), s.B, s.T, s.H, s.KV, s.hd, why.c_str());
  return false;
}

bool CudaBackend::cudnn_agrees(int hd) const {
  // Only in bf16's checked default (TRELLIS_TC_ATTENTION unset).
  if (!cudnn_wanted_ || tc_attention_ != TcAttention::mma || !tc_attention_checked_) return false;
  if (!cudnn_opened_) {
    cudnn_opened_ = true;
    cudnn_ = cuda::CudnnAttention::open(stream_, cudnn_deterministic_, cudnn_tune_, cudnn_why_);
  }
  if (!cudnn_) return false;
  auto it = cudnn_disagreements_.find(hd);
  if (it == cudnn_disagreements_.end()) {
    std::string why;
    try {
      why = cuda::cudnn_attention_disagreement(*cudnn_, hd, stream_);
    } catch (const std::runtime_error& e) {  // a fault leaves the context unusable
      throw std::runtime_error(std::string(e.what()) + ", in the check of " + cudnn_->name() +
                               "'s fused attention at head size " + std::to_string(hd) +
                               " on device " + std::to_string(device_) +
                               " (TRELLIS_CUDNN=0 runs without it)");
    }
    it = cudnn_disagreements_.emplace(hd, why).first;
    if (!why.empty())
      std::fprintf(stderr,
                   "trellis: warning: on device %d %s's fused attention at head size %d is not "
                   "used: %s\n",
                   device_, cudnn_->name().c_str(), hd, why.c_str());
  }
  return it->second.empty();
}

std::string CudaBackend::details() const {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_);
  std::string s = "device " + std::to_string(device_) + ", compute capability " +
                  std::to_string(major) + "." + std::to_string(minor) + ", " +
                  std::to_string(sm_count_) + " multiprocessors";
  if (dtype() != DType::bf16) return s;
  s += "; bf16 attention: ";
  switch (tc_attention_) {
    case TcAttention::off:
      return s + "fp32 kernels on widened copies (TRELLIS_TC_ATTENTION=0)";
    case TcAttention::mma:
      break;
  }
  if (!tc_attention_checked_) return s + "tensor cores, mma.sync, unchecked (TRELLIS_TC_ATTENTION)";
  const std::string no_cudnn = !cudnn_wanted_   ? "cuDNN not tried (TRELLIS_CUDNN=0)"
                               : !cudnn_opened_ ? ""
                               : !cudnn_        ? "no cuDNN: " + cudnn_why_
                                                : "";
  std::set<int> sizes;
  for (const auto& [hd, why] : tc_disagreements_) sizes.insert(hd);
  for (const auto& [hd, why] : cudnn_disagreements_) sizes.insert(hd);
  if (sizes.empty()) {
    s += "tensor cores (cuDNN's fused attention, else mma.sync) where they agree with fp32";
  } else {
    std::string sep;
    for (int hd : sizes) {
      const auto fused = cudnn_disagreements_.find(hd);
      const auto mma = tc_disagreements_.find(hd);
      s += sep + "head size " + std::to_string(hd);
      if (fused != cudnn_disagreements_.end() && fused->second.empty())
        s += " on " + cudnn_->name() + "'s fused attention" +
             (cudnn_->deterministic() ? ", its deterministic backward" : "") +
             " (agreed with the fp32 kernels)";
      else if (mma != tc_disagreements_.end() && mma->second.empty())
        s += " on the tensor cores (mma.sync; agreed with the fp32 kernels)";
      else
        s += " on the fp32 kernels (the tensor cores disagreed)";
      sep = ", ";
    }
  }
  if (cudnn_)
    if (const std::string engines = cudnn_->engines(); !engines.empty())
      s += "; cuDNN's engine configurations (the heuristics' choice, of how many): " + engines;
  return no_cudnn.empty() ? s : s + "; " + no_cudnn;
}

Widening CudaBackend::widened_calls(int head_dim) const {
  return cudnn_agrees(head_dim) || tc_attention_takes(head_dim, {}) ? Widening::none
                                                                    : Widening::attention;
}

bool cuda_tc_attention_takes(int hd) { return cuda::mma_attention_fits(hd, {}); }

}  // namespace trellis
