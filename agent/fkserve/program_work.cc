#include "agent/fkserve/program_work.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace fusekeeper {
namespace {

// utime + stime from /proc/<pid>/stat: fields 14 and 15, counted after the command's closing
// parenthesis (the command itself may hold spaces and parentheses).
uint64_t CpuTicks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  unsigned long long utime = 0, stime = 0;
  // After ") ": state(3) ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime.
  if (sscanf(line.c_str() + close + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) !=
      2) {
    return 0;
  }
  return utime + stime;
}

uint64_t IoBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/io");
  std::string key;
  uint64_t value = 0, sum = 0;
  while (in >> key >> value) {
    if (key == "rchar:" || key == "wchar:") sum += value;
  }
  return sum;
}

}  // namespace

WorkSample SampleWork(const std::set<pid_t>& pids) {
  WorkSample s;
  for (pid_t pid : pids) {
    s.cpu_ticks += CpuTicks(pid);
    s.io_bytes += IoBytes(pid);
  }
  return s;
}

bool Progressed(const WorkSample& before, const WorkSample& now, std::chrono::nanoseconds elapsed) {
  if (now.io_bytes != before.io_bytes) return true;  // (a process that ended lowers the sum: a change too)
  if (now.cpu_ticks <= before.cpu_ticks) return false;
  static const long hz = sysconf(_SC_CLK_TCK);
  const double cpu_s = static_cast<double>(now.cpu_ticks - before.cpu_ticks) / static_cast<double>(hz > 0 ? hz : 100);
  return cpu_s >= 0.1 * std::chrono::duration<double>(elapsed).count();
}

}  // namespace fusekeeper
