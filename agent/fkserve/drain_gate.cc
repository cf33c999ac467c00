#include "agent/fkserve/drain_gate.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace fusekeeper {
namespace {

volatile sig_atomic_t held = 0;
int pipe_fds[2] = {-1, -1};
struct sigaction saved {};
pthread_t serving_thread;
std::atomic<bool> armed{false};
std::atomic<bool> released{false};

void Hold(int) {
  const int saved_errno = errno;
  held = 1;
  const char c = 1;
  (void)!write(pipe_fds[1], &c, 1);  // async-signal-safe; a full pipe is readable already
  errno = saved_errno;
}

}  // namespace

bool ArmDrainGate() {
  if (armed) return true;
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  serving_thread = pthread_self();
  struct sigaction sa {};
  sa.sa_handler = Hold;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // the serving thread's wait goes on
  if (sigaction(SIGTERM, &sa, &saved) != 0) return false;
  armed = true;
  return true;
}

bool DrainHeld() { return held != 0; }
int DrainGateFd() { return armed ? pipe_fds[0] : -1; }

void ReleaseDrainGate() {
  if (!armed || released.exchange(true)) return;
  sigaction(SIGTERM, &saved, nullptr);
  pthread_kill(serving_thread, SIGTERM);
}

}  // namespace fusekeeper
