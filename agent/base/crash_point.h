// Crash points for tests of kill -9 at precise steps: when the environment variable
// FUSEKEEPER_CRASH_AT names a point the process reaches, it sends itself SIGKILL there, exactly
// as an outside kill -9 would at that instant. Unset (always, in production) it costs one
// comparison against a string read once.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>

namespace fusekeeper {

inline void CrashPoint(const char* name) {
  static const char* const armed = getenv("FUSEKEEPER_CRASH_AT");
  if (armed != nullptr && std::strcmp(armed, name) == 0) kill(getpid(), SIGKILL);
}

}  // namespace fusekeeper
