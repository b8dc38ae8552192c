// observe/nvml.h — defines Nvml: the GPU health readings of one device from NVML
// (libnvidia-ml.so.1, the driver's library), loaded with dlopen at run time so that a
// build needs no nvml.h and a host without the driver runs without GPU metrics.
//
// Only NVML's stable C entry points are declared here (the _v2 names where NVML has
// them); every reading NVML refuses (NOT_SUPPORTED on a GPU without ECC, no NVLink, ...)
// is left out of the sample rather than reported as 0.
//
// Threading: one Nvml per thread (the sampler's).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "observe/metric.h"

namespace troupe::observe {

class Nvml {
 public:
  // `device`: a UUID ("GPU-8f3c..."), a PCI bus id ("0000:17:00.0") or an NVML index
  // ("3"; NVML numbers devices in PCI order and ignores CUDA_VISIBLE_DEVICES, whose
  // numbers follow CUDA_DEVICE_ORDER: the two agree under CUDA_DEVICE_ORDER=PCI_BUS_ID).
  // An error when the library is missing, NVML does not initialise or the device is not
  // found (the caller says so once and reports no GPU metrics).
  static Result<std::unique_ptr<Nvml>> open(const std::string& device);
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // gpu_* metrics (observe/metric.h); throughput counters are rates since the last call.
  std::vector<Metric> sample();
  const std::string& name() const { return name_; }

 private:
  struct Api;
  Nvml() = default;
  std::unique_ptr<Api> api_;
  void* lib_ = nullptr;
  void* device_ = nullptr;
  void* events_ = nullptr;  // XID event set (absent when NVML refuses it)
  std::string name_;
  double xid_errors_ = 0;
  double last_xid_ = 0;
  bool have_nvlink_prev_ = false;
  unsigned long long nvlink_prev_[2] = {0, 0};
  std::chrono::steady_clock::time_point nvlink_prev_at_;
};

}  // namespace troupe::observe
