// main() for tests that mount: enters a private mount namespace before any thread exists
// (unshare(CLONE_NEWNS) is refused once the fs struct is shared) and makes everything private,
// so nothing a test mounts is visible to, or propagates into, the host.
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>

#include "gtest/gtest.h"

int main(int argc, char** argv) {
  if (unshare(CLONE_NEWNS) != 0) {
    perror("unshare(CLONE_NEWNS): these tests need root and mount namespaces");
    return 1;
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    perror("making / private");
    return 1;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
