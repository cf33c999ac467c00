// The process's open-file limit. Container runtimes give a container a low soft limit and a high
// hard one (containerd 2.x: 1024 soft): a node agent holding two fds per FUSE volume (the
// connection and its handoff socket) runs out near 500 volumes at the soft limit. The soft limit
// is raised to the hard one at start, and given back as it was to programs we start: a program
// that uses select(2) breaks on fds at 1024 and above.
#pragma once

#include <sys/resource.h>

#include <string>

namespace fusekeeper {

struct FdLimit {
  rlim_t soft_before = 0;  // as the process was started with it
  rlim_t soft = 0;         // now
  rlim_t hard = 0;
};

// Raises the soft limit to the hard limit. `said`: one line for the log saying what was done
// (or why nothing could be).
FdLimit RaiseFdLimit(std::string* said);

// In a child between fork and exec (async-signal-safe): the soft limit back to `soft`.
void RestoreFdLimitForExec(rlim_t soft);

}  // namespace fusekeeper
