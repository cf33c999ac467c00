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
#include <linux/fuse.h>
#include <sys/uio.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
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

// A FUSE mount at `path` whose connection a Relay keeps; `sock` is the program's end.
struct RelayedMount {
  UniqueFd dev;
  std::unique_ptr<relay::Relay> relay;
  UniqueFd sock;
};
void MountRelayed(const std::string& path, RelayedMount* m) {
  auto dev = OpenFuseDeviceBlocking();
  ASSERT_TRUE(dev.ok()) << dev.status();
  m->dev = std::move(*dev);
  UniqueFd target(open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(MountFuseBlocking(m->dev.get(), target.get(), path, FuseMountOptions{}).ok());
  auto relay = relay::Relay::Start(m->dev.get(), {});
  ASSERT_TRUE(relay.ok()) << relay.status();
  m->relay = std::move(*relay);
  auto sock = m->relay->NewInstanceSocket();
  ASSERT_TRUE(sock.ok());
  m->sock = std::move(*sock);
}

// Aborts every FUSE connection mounted at `mnt` (its device minor names it) so that a stuck test
// ends. fusectl may not be mounted yet in the test's own mount namespace.
void AbortConnectionAt(const std::string& mnt) {
  mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, nullptr);
  std::ifstream in("/proc/self/mountinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.find(" " + mnt + " ") == std::string::npos || line.find("fuse") == std::string::npos) continue;
    const size_t colon = line.find(':');
    const std::string minor = line.substr(colon + 1, line.find(' ', colon) - colon - 1);
    std::ofstream(absl::StrCat("/sys/fs/fuse/connections/", minor, "/abort")) << 1;
  }
}

TEST(RelayIoTest, TheLoopKeepsAnsweringAStreamOfRequests) {
  TmpfsDir root, mnt;
  RelayedMount m;
  MountRelayed(mnt.path(), &m);
  if (HasFatalFailure()) return;
  UniqueFd* sock = &m.sock;
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
      AbortConnectionAt(mnt.path());  // unblock everything
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
  m.relay->Stop();
}


// A program that sends a notification about a directory while a request holding that
// directory's lock waits for its answer — rclone does (an INVAL_ENTRY as it renames). The kernel
// takes the directory's lock in the thread that writes the notification; written from the relay's
// loop, which must also deliver the RENAME's answer, nothing moved again (seen in the
// model-checking writer: fk-loop in fuse_reverse_inval_entry, the app's rename in
// request_wait_answer, until the test's timeout). The program here is a few lines of FUSE that
// answer a RENAME only after notifying.
TEST(RelayIoTest, ANotificationAboutADirectoryARequestHoldsDoesNotStopTheLoop) {
  TmpfsDir mnt;
  RelayedMount m;
  MountRelayed(mnt.path(), &m);
  if (HasFatalFailure()) return;
  UniqueFd* sock = &m.sock;
  const pid_t server = fork();
  ASSERT_GE(server, 0);
  if (server == 0) {
    std::vector<char> buf(1 << 21);
    auto reply = [&](uint64_t unique, int error, const void* body, size_t len) {
      fuse_out_header h{};
      h.len = static_cast<uint32_t>(sizeof(h) + len);
      h.error = error;
      h.unique = unique;
      iovec iov[2] = {{&h, sizeof(h)}, {const_cast<void*>(body), len}};
      (void)!writev(sock->get(), iov, len > 0 ? 2 : 1);
    };
    auto attr = [](uint64_t ino, bool dir) {
      fuse_attr a{};
      a.ino = ino;
      a.mode = dir ? (S_IFDIR | 0755) : (S_IFREG | 0644);
      a.nlink = dir ? 2 : 1;
      return a;
    };
    bool renamed = false;
    for (;;) {
      const ssize_t n = read(sock->get(), buf.data(), buf.size());
      if (n <= 0) _exit(0);
      fuse_in_header in;
      memcpy(&in, buf.data(), sizeof(in));
      const char* body = buf.data() + sizeof(in);
      switch (in.opcode) {
        case FUSE_INIT: {
          fuse_init_out o{};
          o.major = FUSE_KERNEL_VERSION;
          o.minor = 31;
          o.max_write = 65536;
          reply(in.unique, 0, &o, sizeof(o));
          break;
        }
        case FUSE_GETATTR: {
          fuse_attr_out o{};
          o.attr = attr(in.nodeid, in.nodeid == FUSE_ROOT_ID);
          reply(in.unique, 0, &o, sizeof(o));
          break;
        }
        case FUSE_LOOKUP: {
          if (std::string(body) != (renamed ? "b" : "a")) {
            reply(in.unique, -ENOENT, nullptr, 0);
            break;
          }
          fuse_entry_out e{};
          e.nodeid = 2;
          e.attr = attr(2, false);
          reply(in.unique, 0, &e, sizeof(e));
          break;
        }
        case FUSE_RENAME:
        case FUSE_RENAME2: {
          // The notification first, as its own message, then the answer.
          fuse_notify_inval_entry_out inval{};
          inval.parent = FUSE_ROOT_ID;
          inval.namelen = 1;
          char msg[sizeof(fuse_out_header) + sizeof(inval) + 2] = {};
          fuse_out_header h{};
          h.len = sizeof(msg);
          h.error = FUSE_NOTIFY_INVAL_ENTRY;
          memcpy(msg, &h, sizeof(h));
          memcpy(msg + sizeof(h), &inval, sizeof(inval));
          memcpy(msg + sizeof(h) + sizeof(inval), "b", 2);
          (void)!write(sock->get(), msg, sizeof(msg));
          renamed = true;
          reply(in.unique, 0, nullptr, 0);
          break;
        }
        case FUSE_FORGET:
        case FUSE_BATCH_FORGET:
        case FUSE_INTERRUPT:
          break;
        default:
          reply(in.unique, -ENOSYS, nullptr, 0);
      }
    }
  }
  std::atomic<int> result{1};
  std::atomic<bool> done{false};
  std::thread app([&] {
    result = rename((mnt.path() + "/a").c_str(), (mnt.path() + "/b").c_str()) == 0 ? 0 : errno;
    done = true;
  });
  std::string states;
  for (auto since = std::chrono::steady_clock::now(); !done;) {
    std::this_thread::yield();
    if (std::chrono::steady_clock::now() - since > std::chrono::seconds(10)) {
      states = ThreadStates();
      AbortConnectionAt(mnt.path());
      break;
    }
  }
  app.join();
  EXPECT_TRUE(states.empty()) << "the rename waited over 10 s; threads: " << states;
  EXPECT_EQ(result.load(), 0) << strerror(result.load());
  umount2(mnt.path().c_str(), MNT_DETACH);
  kill(server, SIGKILL);
  waitpid(server, nullptr, 0);
  m.relay->Stop();
}

}  // namespace
}  // namespace fusekeeper
