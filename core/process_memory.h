// core/process_memory.h — defines peak_resident_bytes(): the calling process's
// high-water mark of resident memory (host RAM), which training reports per rank so that
// what a layout costs each process can be read from its metrics.
#pragma once

#include <cstdint>

namespace troupe {

// The most resident memory this process has held since it started (Linux: VmHWM of
// /proc/self/status, which counts only this program image: a forked child's copy of its
// parent before exec is not included). -1 where the figure cannot be read. Any thread may
// call it; it reads one small file.
int64_t peak_resident_bytes();

}  // namespace troupe
