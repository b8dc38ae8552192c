// observe/nvml.cc — Nvml (nvml.h): NVML's entry points resolved with dlsym.
#include "observe/nvml.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace troupe::observe {

namespace {

// NVML's C ABI (nvml.h, stable across drivers): handles are opaque pointers, every call
// returns nvmlReturn_t (0: success).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
using nvmlEventSet_t = void*;
constexpr nvmlReturn_t kSuccess = 0;
constexpr unsigned kClockSm = 1;                  // NVML_CLOCK_SM
constexpr unsigned kTemperatureGpu = 0;           // NVML_TEMPERATURE_GPU
constexpr unsigned kEccCorrected = 0;             // NVML_MEMORY_ERROR_TYPE_CORRECTED
constexpr unsigned kEccUncorrected = 1;           // NVML_MEMORY_ERROR_TYPE_UNCORRECTED
constexpr unsigned kVolatileEcc = 0;              // NVML_VOLATILE_ECC
constexpr unsigned kPcieTx = 0, kPcieRx = 1;      // NVML_PCIE_UTIL_TX_BYTES / RX_BYTES (KB/s)
constexpr unsigned long long kXidCritical = 0x8;  // nvmlEventTypeXidCriticalError
constexpr unsigned kFieldNvlinkTx = 138,
                   kFieldNvlinkRx = 139;  // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX (KiB)
constexpr unsigned kAllLinks = 0xffffffffu;

struct nvmlUtilization_t {
  unsigned gpu;
  unsigned memory;
};
struct nvmlMemory_t {
  unsigned long long total, free, used;
};
struct nvmlEventData_t {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned gpuInstanceId;
  unsigned computeInstanceId;
};
struct nvmlFieldValue_t {
  unsigned fieldId;
  unsigned scopeId;
  long long timestamp;
  long long latencyUsec;
  int valueType;
  nvmlReturn_t nvmlReturn;
  unsigned long long value;  // nvmlValue_t: a union of 8 bytes; these fields are unsigned long long
};
static_assert(sizeof(nvmlFieldValue_t) == 40);

}  // namespace

struct Nvml::Api {
  nvmlReturn_t (*init)();
  nvmlReturn_t (*shutdown)();
  const char* (*error_string)(nvmlReturn_t);
  nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t*);
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*);
  nvmlReturn_t (*by_uuid)(const char*, nvmlDevice_t*);
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned);
  nvmlReturn_t (*clock)(nvmlDevice_t, unsigned, unsigned*);
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned*);
  nvmlReturn_t (*temperature)(nvmlDevice_t, unsigned, unsigned*);
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*);
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*);
  nvmlReturn_t (*ecc)(nvmlDevice_t, unsigned, unsigned, unsigned long long*);
  nvmlReturn_t (*pcie)(nvmlDevice_t, unsigned, unsigned*);
  nvmlReturn_t (*throttle)(nvmlDevice_t, unsigned long long*);
  nvmlReturn_t (*fields)(nvmlDevice_t, int, nvmlFieldValue_t*);
  nvmlReturn_t (*event_set_create)(nvmlEventSet_t*);
  nvmlReturn_t (*event_set_free)(nvmlEventSet_t);
  nvmlReturn_t (*register_events)(nvmlDevice_t, unsigned long long, nvmlEventSet_t);
  nvmlReturn_t (*event_wait)(nvmlEventSet_t, nvmlEventData_t*, unsigned);
};

Result<std::unique_ptr<Nvml>> Nvml::open(const std::string& device) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return not_found("NVML: cannot load libnvidia-ml.so.1 ({})", dlerror());
  std::unique_ptr<Nvml> n(new Nvml());
  n->lib_ = lib;
  n->api_ = std::make_unique<Api>();
  Api& a = *n->api_;
  auto sym = [lib](const char* s) { return dlsym(lib, s); };
  auto bind = [&](auto& fn, std::initializer_list<const char*> names) {
    for (const char* s : names) {
      if (void* p = sym(s)) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
        return;
      }
    }
    fn = nullptr;
  };
  bind(a.init, {"nvmlInit_v2", "nvmlInit"});
  bind(a.shutdown, {"nvmlShutdown"});
  bind(a.error_string, {"nvmlErrorString"});
  bind(a.by_index, {"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"});
  bind(a.by_pci, {"nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId"});
  bind(a.by_uuid, {"nvmlDeviceGetHandleByUUID"});
  bind(a.name, {"nvmlDeviceGetName"});
  bind(a.clock, {"nvmlDeviceGetClockInfo"});
  bind(a.power, {"nvmlDeviceGetPowerUsage"});
  bind(a.temperature, {"nvmlDeviceGetTemperature"});
  bind(a.utilization, {"nvmlDeviceGetUtilizationRates"});
  bind(a.memory, {"nvmlDeviceGetMemoryInfo"});
  bind(a.ecc, {"nvmlDeviceGetTotalEccErrors"});
  bind(a.pcie, {"nvmlDeviceGetPcieThroughput"});
  bind(a.throttle, {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"});
  bind(a.fields, {"nvmlDeviceGetFieldValues"});
  bind(a.event_set_create, {"nvmlEventSetCreate"});
  bind(a.event_set_free, {"nvmlEventSetFree"});
  bind(a.register_events, {"nvmlDeviceRegisterEvents"});
  bind(a.event_wait, {"nvmlEventSetWait_v2"});
  if (!a.init || !a.shutdown || !a.by_index) {
    dlclose(lib);
    n->lib_ = nullptr;
    return not_found("NVML: libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetHandleByIndex_v2");
  }
  auto err = [&](nvmlReturn_t r) {
    return a.error_string ? std::string(a.error_string(r)) : fmt::format("NVML error {}", r);
  };
  if (nvmlReturn_t r = a.init(); r != kSuccess) {
    dlclose(lib);
    n->lib_ = nullptr;
    return unavailable("NVML: nvmlInit failed: {}", err(r));
  }
  nvmlDevice_t dev = nullptr;
  nvmlReturn_t r = kSuccess + 1;
  if (device.rfind("GPU-", 0) == 0 || device.rfind("MIG-", 0) == 0) {
    if (a.by_uuid) r = a.by_uuid(device.c_str(), &dev);
  } else if (device.find(':') != std::string::npos) {
    if (a.by_pci) r = a.by_pci(device.c_str(), &dev);
  } else {
    char* end = nullptr;
    const long idx = std::strtol(device.c_str(), &end, 10);
    if (!device.empty() && *end == '\0' && idx >= 0) r = a.by_index(static_cast<unsigned>(idx), &dev);
  }
  if (r != kSuccess) {
    n.reset();  // its destructor shuts NVML down
    return not_found("NVML: no device '{}'{}", device, r == kSuccess + 1 ? "" : ": " + err(r));
  }
  n->device_ = dev;
  char name[96] = {0};
  if (a.name && a.name(dev, name, sizeof name) == kSuccess) n->name_ = name;
  if (a.event_set_create && a.register_events && a.event_wait) {
    nvmlEventSet_t set = nullptr;
    if (a.event_set_create(&set) == kSuccess) {
      if (a.register_events(dev, kXidCritical, set) == kSuccess) {
        n->events_ = set;
      } else if (a.event_set_free) {
        a.event_set_free(set);
      }
    }
  }
  return n;
}

Nvml::~Nvml() {
  if (lib_ == nullptr) return;
  if (events_ && api_->event_set_free) api_->event_set_free(events_);
  api_->shutdown();
  dlclose(lib_);
}

std::vector<Metric> Nvml::sample() {
  std::vector<Metric> out;
  const Api& a = *api_;
  nvmlDevice_t d = device_;
  unsigned u = 0;
  if (a.clock && a.clock(d, kClockSm, &u) == kSuccess) out.push_back({"gpu_sm_clock_mhz", double(u)});
  if (a.power && a.power(d, &u) == kSuccess) out.push_back({"gpu_power_w", double(u) / 1e3});
  if (a.temperature && a.temperature(d, kTemperatureGpu, &u) == kSuccess)
    out.push_back({"gpu_temp_c", double(u)});
  nvmlUtilization_t ut{};
  if (a.utilization && a.utilization(d, &ut) == kSuccess) {
    out.push_back({"gpu_util", ut.gpu / 100.0});
    out.push_back({"gpu_mem_util", ut.memory / 100.0});
  }
  nvmlMemory_t mem{};
  if (a.memory && a.memory(d, &mem) == kSuccess) out.push_back({"gpu_mem_used_bytes", double(mem.used)});
  unsigned long long ecc = 0;
  if (a.ecc && a.ecc(d, kEccCorrected, kVolatileEcc, &ecc) == kSuccess)
    out.push_back({"gpu_ecc_corrected", double(ecc)});
  if (a.ecc && a.ecc(d, kEccUncorrected, kVolatileEcc, &ecc) == kSuccess)
    out.push_back({"gpu_ecc_uncorrected", double(ecc)});
  if (events_) {
    nvmlEventData_t ev{};
    while (a.event_wait(events_, &ev, 0) == kSuccess) {  // 0 ms: only what already happened
      if (ev.eventType & kXidCritical) {
        xid_errors_ += 1;
        last_xid_ = double(ev.eventData);
      }
    }
    out.push_back({"gpu_xid_errors", xid_errors_});
    out.push_back({"gpu_last_xid", last_xid_});
  }
  unsigned long long reasons = 0;
  if (a.throttle && a.throttle(d, &reasons) == kSuccess)
    out.push_back({"gpu_throttle_reasons", double(reasons)});
  if (a.pcie && a.pcie(d, kPcieTx, &u) == kSuccess)
    out.push_back({"gpu_pcie_tx_bytes_per_s", double(u) * 1e3});
  if (a.pcie && a.pcie(d, kPcieRx, &u) == kSuccess)
    out.push_back({"gpu_pcie_rx_bytes_per_s", double(u) * 1e3});
  if (a.fields) {
    nvmlFieldValue_t f[2] = {};
    f[0].fieldId = kFieldNvlinkTx;
    f[1].fieldId = kFieldNvlinkRx;
    f[0].scopeId = f[1].scopeId = kAllLinks;
    const auto now = std::chrono::steady_clock::now();
    if (a.fields(d, 2, f) == kSuccess && f[0].nvmlReturn == kSuccess && f[1].nvmlReturn == kSuccess) {
      if (have_nvlink_prev_) {
        const double dt = std::chrono::duration<double>(now - nvlink_prev_at_).count();
        if (dt > 0) {
          if (f[0].value >= nvlink_prev_[0] && f[1].value >= nvlink_prev_[1]) {
            out.push_back({"gpu_nvlink_tx_bytes_per_s", double(f[0].value - nvlink_prev_[0]) * 1024 / dt});
            out.push_back({"gpu_nvlink_rx_bytes_per_s", double(f[1].value - nvlink_prev_[1]) * 1024 / dt});
          }
        }
      }
      nvlink_prev_[0] = f[0].value;
      nvlink_prev_[1] = f[1].value;
      nvlink_prev_at_ = now;
      have_nvlink_prev_ = true;
    }
  }
  return out;
}

}  // namespace troupe::observe
