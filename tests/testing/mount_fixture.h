// A tmpfs mounted on a fresh /tmp directory (inside the test's private mount namespace), with
// helpers to ask the kernel what is mounted where.
#pragma once

#include <sys/mount.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "agent/mount/mountinfo.h"
#include "gtest/gtest.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {

class TmpfsDir {
 public:
  TmpfsDir() {
    EXPECT_EQ(mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "mode=0755"), 0) << strerror(errno);
  }
  ~TmpfsDir() { umount2(dir_.path().c_str(), MNT_DETACH); }
  const std::string& path() const { return dir_.path(); }

 private:
  ShortTempDir dir_;
};

inline MountTable ReadMountTable() {
  std::ifstream in("/proc/self/mountinfo");
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = MountTable::Parse(ss.str());
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

inline int MountCountAt(const std::string& path) {
  return static_cast<int>(ReadMountTable().FindAll(path).size());
}

}  // namespace fusekeeper
