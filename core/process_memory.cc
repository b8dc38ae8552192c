// core/process_memory.cc — the process's peak resident memory from /proc/self/status.
#include "core/process_memory.h"

#include <cstdio>
#include <cstring>

namespace troupe {

int64_t peak_resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    // "VmHWM:     123456 kB"
    if (std::strncmp(line, "VmHWM:", 6) == 0) {
      if (std::sscanf(line + 6, "%lld", &kib) != 1) kib = -1;
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : static_cast<int64_t>(kib) * 1024;
}

}  // namespace troupe
