// The signals that ask fkserve to stop (kubelet's SIGTERM, and SIGINT, SIGHUP), and how its
// threads share them: only the main thread takes them, so that they interrupt its blocking
// wait (the serving read, the launcher's waitpid); helper threads are started with them blocked.
// As PID 1 of a container fkserve needs its own handlers: it would ignore them otherwise.
#pragma once

#include <signal.h>

#include <thread>
#include <utility>

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

// A thread that never takes a stop signal (it inherits the mask it is started with).
template <typename F>
std::thread StartWithoutStopSignals(F&& fn) {
  sigset_t stop, old;
  sigemptyset(&stop);
  for (int sig : kStopSignals) sigaddset(&stop, sig);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  std::thread t(std::forward<F>(fn));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return t;
}

}  // namespace fusekeeper
