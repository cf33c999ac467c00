// The signals that ask fkserve to stop: kubelet's SIGTERM, and SIGINT, SIGHUP. fkserve's modes
// take them from a signalfd on their loop (agent/loop/signals.h), blocked in every thread; a
// launched program gets them back with their default action.
#pragma once

#include <signal.h>

namespace fusekeeper {

inline constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGHUP};

// Installs `handler` for every stop signal; `restart`: SA_RESTART (a wait goes on after it).
inline void HandleStopSignals(void (*handler)(int), bool restart) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = restart ? SA_RESTART : 0;
  for (int sig : kStopSignals) sigaction(sig, &sa, nullptr);
}

}  // namespace fusekeeper
