#include "agent/base/fd_limit.h"

#include <errno.h>

#include <cstring>

namespace fusekeeper {

FdLimit RaiseFdLimit(std::string* said) {
  FdLimit l;
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) {
    *said = std::string("getrlimit(RLIMIT_NOFILE): ") + std::strerror(errno);
    return l;
  }
  l.soft_before = l.soft = r.rlim_cur;
  l.hard = r.rlim_max;
  if (r.rlim_cur >= r.rlim_max) {
    *said = "open-file limit " + std::to_string(r.rlim_cur) + " (soft = hard)";
    return l;
  }
  rlimit raised = r;
  raised.rlim_cur = r.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    *said = "cannot raise the open-file soft limit " + std::to_string(r.rlim_cur) + " to its hard limit " +
            std::to_string(r.rlim_max) + ": " + std::strerror(errno);
    return l;
  }
  l.soft = raised.rlim_cur;
  *said = "open-file soft limit raised from " + std::to_string(r.rlim_cur) + " to " + std::to_string(r.rlim_max);
  return l;
}

void RestoreFdLimitForExec(rlim_t soft) {
  rlimit r{};
  if (soft == 0 || getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == soft) return;
  r.rlim_cur = soft;
  setrlimit(RLIMIT_NOFILE, &r);
}

}  // namespace fusekeeper
