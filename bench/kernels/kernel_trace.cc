// libtroupe_kernel_trace.so — a CUPTI activity tracer loaded into any CUDA program through
// the driver's injection hook, for hosts without Nsight Systems:
//
//   CUDA_INJECTION64_PATH=$BUILD/bench/kernels/libtroupe_kernel_trace.so
//   TROUPE_KERNEL_TRACE=trace.csv train_moe ...   (both set in train_moe's environment)
//
// It records every kernel, memset and memcpy the GPU runs (the kernels of a replayed CUDA
// graph one by one) with its device start and end, and writes them at exit as CSV with
// the columns "Start (ns)","Duration (ns)","Name" (the names demangled), the layout of
// `nsys stats --report cuda_gpu_trace`; bench/kernel_gaps.py reads it. Tracing costs the
// traced program a little time per launch, so its step times are not benchmark figures.
#include <cupti.h>
#include <cxxabi.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  uint64_t start, end;
  std::string name;
};

std::mutex g_mu;
std::vector<Record> g_records;
size_t g_dropped = 0;

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "unknown CUPTI error");
}

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = (status == 0 && d != nullptr) ? d : name;
  std::free(d);
  return out;
}

constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Record> got;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        got.push_back({k->start, k->end, demangle(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        got.push_back({m->start, m->end, "[CUDA memset " + std::to_string(m->bytes) + " B]"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        got.push_back({m->start, m->end, "[CUDA memcpy " + std::to_string(m->bytes) + " B]"});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_dropped += dropped;
  g_records.insert(g_records.end(), got.begin(), got.end());
}

void write_trace() {
  report(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  const char* path = std::getenv("TROUPE_KERNEL_TRACE");
  if (path == nullptr || *path == '\0') path = "kernel_trace.csv";
  std::lock_guard<std::mutex> lock(g_mu);
  std::FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(f, "\"Start (ns)\",\"Duration (ns)\",\"Name\"\n");
  for (const Record& r : g_records) {
    std::string name = r.name;
    for (char& c : name)
      if (c == '"') c = '\'';
    std::fprintf(f, "%llu,%llu,\"%s\"\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end - r.start), name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu records (%zu dropped) in %s\n", g_records.size(), g_dropped, path);
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memsets");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpys");
  std::atexit(write_trace);
  return 1;
}
