// Relay (relay.h) on a real FUSE connection: the relay's loop thread must never block, whatever
// the traffic. Bug seen in relay_bench: under a stream of GETATTRs the relayed mount stopped
// answering, its loop thread ("fk-loop") asleep in fuse_dev_do_read. io_uring runs a READ inline
// in the submitting thread when the file polls readable (/dev/fuse has no FMODE_NOWAIT, and its
// read ignores IOCB_NOWAIT): when one of the relay's other reads, parked in an io-wq worker, takes
// that request first, the inline read sleeps in the loop thread, and nothing the program answers
// reaches the kernel any more. With the relay's reads as they were (io_uring READs), this test
// stalled in 2 of 4 runs, fk-loop in fuse_dev_do_read. Needs root (a private mount namespace,
// /dev/fuse, /sys/fs/fuse/connections to unblock a stall).
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <dirent.h>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/passthrough.h"
#include "agent/fkserve/relay/relay.h"
#include "agent/fuse/fuse_mount.h"
#include "gtest/gtest.h"
#include "tests/testing/mount_fixture.h"

namespace fusekeeper {
namespace {

// What each thread of this process is asleep in (for the failure message).
std::string ThreadStates() {
  std::string out;
  DIR* d = opendir("/proc/self/task");
  while (dirent* t = d != nullptr ? readdir(d) : nullptr) {
    if (t->d_name[0] == '.') continue;
    std::string comm, wchan;
    std::ifstream(absl::StrCat("/proc/self/task/", t->d_name, "/comm")) >> comm;
    std::ifstream(absl::StrCat("/proc/self/task/", t->d_name, "/wchan")) >> wchan;
    absl::StrAppend(&out, comm, ":", wchan, " ");
  }
  if (d != nullptr) closedir(d);
  return out;
}

TEST(RelayIoTest, TheLoopKeepsAnsweringAStreamOfRequests) {
  TmpfsDir root, mnt;
  auto dev = OpenFuseDeviceBlocking();
  ASSERT_TRUE(dev.ok()) << dev.status();
  UniqueFd target(open(mnt.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(MountFuseBlocking(dev->get(), target.get(), mnt.path(), FuseMountOptions{}).ok());
  auto relay = relay::Relay::Start(dev->get(), {});
  ASSERT_TRUE(relay.ok()) << relay.status();
  auto sock = (*relay)->NewInstanceSocket();
  ASSERT_TRUE(sock.ok());
  { std::ofstream(root.path() + "/f") << "x"; }
  const pid_t server = fork();
  ASSERT_GE(server, 0);
  if (server == 0) {
    auto init = ReadInitRequest(sock->get(), 10000);
    if (!init.ok()) _exit(3);
    PassthroughOptions o;
    o.root = root.path();
    o.init_request = *init;
    _exit(ServePassthrough(dup(sock->get()), o).ok() ? 0 : 5);
  }
  // GETATTRs (forced past the attribute cache), each answered before the next, as relay_bench's
  // BM_Stat does (where the stall was seen: 3 of 5 runs before the fix, 0 of 14 after).
  constexpr int kPerThread = 30000;
  std::atomic<int> done{0}, failed{0};
  std::vector<std::thread> apps;
  const std::string file = mnt.path() + "/f";
  for (int t = 0; t < 1; ++t) {
    apps.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        struct statx stx;
        if (statx(AT_FDCWD, file.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx) != 0) ++failed;
        ++done;
      }
    });
  }
  // Progress, not speed: the count must keep moving (a stall of 10 s is a relay that stopped).
  int last = -1;
  bool stalled = false;
  std::string states;
  for (auto since = std::chrono::steady_clock::now(); done < kPerThread;) {
    std::this_thread::yield();
    if (done != last) {
      last = done;
      since = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - since > std::chrono::seconds(10)) {
      stalled = true;
      states = ThreadStates();
      // Unblock everything: abort the connection (its device minor names it). fusectl may not be
      // mounted yet (this is the test's own mount namespace).
      mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, nullptr);
      std::ifstream in("/proc/self/mountinfo");
      for (std::string line; std::getline(in, line);) {
        if (line.find(" " + mnt.path() + " ") == std::string::npos || line.find("fuse") == std::string::npos) continue;
        const size_t colon = line.find(':');
        const std::string minor = line.substr(colon + 1, line.find(' ', colon) - colon - 1);
        std::ofstream(absl::StrCat("/sys/fs/fuse/connections/", minor, "/abort")) << 1;
      }
      break;
    }
  }
  for (auto& t : apps) t.join();
  EXPECT_FALSE(stalled) << "the relayed mount stopped answering after " << last
                        << " GETATTRs; threads: " << states;
  EXPECT_EQ(failed.load(), 0);
  umount2(mnt.path().c_str(), MNT_DETACH);
  kill(server, SIGKILL);
  waitpid(server, nullptr, 0);
  (*relay)->Stop();
}

}  // namespace
}  // namespace fusekeeper
