// Whether a launched program is working: the CPU time and the bytes read and written of its
// processes. A program with a request in flight that sends nothing is hung only if it also does
// nothing: one uploading a large file at FLUSH, or compressing, or walking a remote tree, spends
// CPU or moves bytes (rchar and wchar count sockets and pipes as well as files); a stopped or
// deadlocked one does neither.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <set>

namespace fusekeeper {

struct WorkSample {
  uint64_t cpu_ticks = 0;  // utime + stime, in clock ticks (sysconf(_SC_CLK_TCK))
  uint64_t io_bytes = 0;   // rchar + wchar
};

// Blocking (reads /proc; a process that has gone counts nothing). The sum over `pids`.
WorkSample SampleWork(const std::set<pid_t>& pids);

// Whether `now` shows work since `before`, `elapsed` apart: CPU time of at least a tenth of one
// CPU over it, or any bytes read or written.
bool Progressed(const WorkSample& before, const WorkSample& now, std::chrono::nanoseconds elapsed);

}  // namespace fusekeeper
