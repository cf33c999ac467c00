// FUSE passthrough brokered for `fkserve serve` (issue 30), side by side in one run with the
// native directory: the same tmpfs directory read and written directly (native), through a FUSE
// mount served by fkserve's passthrough with every open registered as a backing file
// (passthrough), the same with the export's extended attributes off (passthrough_noxattrs:
// fkserve serve --xattrs=false), and through the same server without passthrough (plain). The rounds rotate the order of
// the three; each figure is the median over rounds of the ratio to native measured beside it.
//
// The broker here is a thread of this process doing FUSE_DEV_IOC_BACKING_OPEN as root on the
// server's requests (the agent's BackingBroker does it as the server's user, from a thread of its
// own; the kernel's read and write paths are the same). Needs root (a private mount namespace).
//
//   bazel run -c opt //bench:passthrough_bench
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <linux/capability.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/base/fd_passing.h"
#include "agent/fkserve/backing_client.h"
#include "agent/fkserve/backing_table.h"
#include "agent/fkserve/passthrough.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/fuse/passthrough_abi.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

constexpr size_t kFileBytes = 64 << 20;
constexpr size_t kChunk = 1 << 20;
constexpr int kRounds = 5;

// The agent's part, reduced to its ioctls: registers the files the server sends, answers.
void Broker(int fuse_fd, UniqueFd sock) {
  char buf[4096];
  while (true) {
    std::vector<UniqueFd> fds;
    int flags = 0;
    bool other_control = false;
    const ssize_t n = ReceiveWithFds(sock.get(), buf, sizeof(buf), &fds, &flags, &other_control);
    if (n <= 0) return;
    auto req = DecodeBackingRequest(absl::string_view(buf, static_cast<size_t>(n)));
    if (!req.ok() || !req->has_value()) continue;
    BackingReply reply{(*req)->id, 0, ""};
    if ((*req)->open && fds.size() == 1) {
      FuseBackingMap map{fds[0].get(), 0, 0};
      const int id = ioctl(fuse_fd, kFuseDevIocBackingOpen, &map);
      if (id > 0) reply.backing_id = id; else reply.error = strerror(errno);
    } else if (!(*req)->open) {
      uint32_t id = static_cast<uint32_t>((*req)->backing_id);
      if (ioctl(fuse_fd, kFuseDevIocBackingClose, &id) != 0) reply.error = strerror(errno);
    }
    const std::string out = EncodeBackingReply(reply);
    (void)!send(sock.get(), out.data(), out.size(), MSG_NOSIGNAL);
  }
}

// A FUSE mount of `root` served by fkserve's passthrough in a child process, with or without
// passthrough.
class Served {
 public:
  Served(const std::string& root, const std::string& mnt, bool passthrough, bool xattrs = true) : mnt_(mnt) {
    mkdir(mnt.c_str(), 0755);
    auto dev = OpenFuseDeviceBlocking();
    CHECK(dev.ok()) << dev.status();
    fuse_ = std::move(*dev);
    UniqueFd target(open(mnt.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    CHECK(MountFuseBlocking(fuse_.get(), target.get(), mnt, FuseMountOptions{}).ok());
    int pair[2];
    CHECK_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
    UniqueFd ours(pair[0]), theirs(pair[1]);
    child_ = fork();
    CHECK_GE(child_, 0);
    if (child_ == 0) {
      auto init = ReadInitRequest(fuse_.get(), 10000);
      if (!init.ok()) _exit(3);
      // As a sidecar's server runs: without CAP_FSETID (it may then say it handles dropping
      // privileges, and the kernel stops asking it before each write: passthrough.cc).
      __user_cap_header_struct ch{_LINUX_CAPABILITY_VERSION_3, 0};
      __user_cap_data_struct cd[2]{};
      if (syscall(SYS_capget, &ch, cd) != 0) _exit(3);
      cd[CAP_FSETID / 32].effective &= ~(1u << (CAP_FSETID % 32));
      if (syscall(SYS_capset, &ch, cd) != 0) _exit(3);
      PassthroughOptions o;
      o.root = root;
      o.init_request = *init;
      o.xattrs = xattrs;
      BackingClient client;
      std::thread replies;
      auto table = BackingTable::Create();
      if (!table.ok()) _exit(3);
      if (passthrough) {
        client.SetSocket(UniqueFd(dup(theirs.get())));
        o.backing = &client;
        o.backing_table = table->get();
        replies = std::thread([&] {
          char buf[4096];
          for (ssize_t n; (n = recv(theirs.get(), buf, sizeof(buf), 0)) > 0;) {
            auto r = DecodeBackingReply(absl::string_view(buf, static_cast<size_t>(n)));
            if (r.ok() && r->has_value()) client.Deliver(**r);
          }
        });
        replies.detach();
      }
      _exit(ServePassthrough(dup(fuse_.get()), o).ok() ? 0 : 5);
    }
    theirs.Reset();
    if (passthrough) broker_ = std::thread(Broker, fuse_.get(), std::move(ours));
  }
  ~Served() {
    umount2(mnt_.c_str(), MNT_DETACH);
    kill(child_, SIGKILL);
    waitpid(child_, nullptr, 0);
    if (broker_.joinable()) broker_.detach();
  }

 private:
  std::string mnt_;
  UniqueFd fuse_;
  pid_t child_ = -1;
  std::thread broker_;
};

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void WriteFile(const std::string& path) {
  std::string chunk(kChunk, 'w');
  const int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  CHECK_GE(fd, 0) << path << ": " << strerror(errno);
  for (size_t i = 0; i < kFileBytes / kChunk; ++i) CHECK_EQ(write(fd, chunk.data(), chunk.size()), static_cast<ssize_t>(kChunk));
  CHECK_EQ(fsync(fd), 0);
  close(fd);
}

void ReadFile(const std::string& path) {
  std::vector<char> buf(kChunk);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK_GE(fd, 0);
  size_t total = 0;
  for (ssize_t n; (n = read(fd, buf.data(), buf.size())) > 0;) total += static_cast<size_t>(n);
  close(fd);
  CHECK_EQ(total, kFileBytes);
}

void MapFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHECK_GE(fd, 0);
  auto* p = static_cast<const char*>(mmap(nullptr, kFileBytes, PROT_READ, MAP_SHARED, fd, 0));
  CHECK(p != MAP_FAILED);
  uint64_t sum = 0;
  for (size_t i = 0; i < kFileBytes; i += 4096) sum += static_cast<unsigned char>(p[i]);
  benchmark::DoNotOptimize(sum);
  munmap(const_cast<char*>(p), kFileBytes);
  close(fd);
}

void Stats(const std::string& dir) {
  struct statx stx;
  for (int i = 0; i < 2000; ++i) CHECK_EQ(statx(AT_FDCWD, (dir + "/seq").c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
}

void Creates(const std::string& dir) {
  for (int i = 0; i < 500; ++i) {
    const std::string p = absl::StrCat(dir, "/c", i);
    const int fd = open(p.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    CHECK_GE(fd, 0);
    close(fd);
    CHECK_EQ(unlink(p.c_str()), 0);
  }
}

void BM_PassthroughVsNative(benchmark::State& state) {
  char tmpl[] = "/tmp/fk-pt-bench-XXXXXX";
  CHECK(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl, root = dir + "/root";
  mkdir(root.c_str(), 0755);
  CHECK_EQ(mount("tmpfs", root.c_str(), "tmpfs", 0, "size=1g"), 0);
  std::vector<std::unique_ptr<Served>> served;  // unmounted before the directory goes
  served.push_back(std::make_unique<Served>(root, dir + "/pt", true));
  served.push_back(std::make_unique<Served>(root, dir + "/pt-nx", true, false));
  served.push_back(std::make_unique<Served>(root, dir + "/plain", false));
  const std::vector<std::pair<std::string, std::string>> ways = {
      {"native", root}, {"passthrough", dir + "/pt"}, {"passthrough_noxattrs", dir + "/pt-nx"}, {"plain", dir + "/plain"}};
  const std::vector<std::pair<std::string, std::function<void(const std::string&)>>> ops = {
      {"seq_read", [](const std::string& d) { ReadFile(d + "/seq"); }},
      {"mmap_read", [](const std::string& d) { MapFile(d + "/seq"); }},
      {"seq_write", [](const std::string& d) { WriteFile(d + "/w"); }},
      {"stat", Stats},
      {"create", Creates},
  };
  WriteFile(root + "/seq");
  std::map<std::string, std::vector<double>> ratios;  // "op/way" → per-round ratio to native
  for (auto _ : state) {
    for (int round = 0; round < kRounds; ++round) {
      for (const auto& [op, fn] : ops) {
        std::map<std::string, double> took;
        for (size_t k = 0; k < ways.size(); ++k) {
          const auto& [way, path] = ways[(k + round) % ways.size()];
          took[way] = Seconds([&, &p = path, &f = fn] { f(p); });
        }
        for (const char* way : {"passthrough", "passthrough_noxattrs", "plain"}) {
          ratios[op + "/" + way].push_back(took["native"] / took[way]);
        }
      }
    }
  }
  for (auto& [name, r] : ratios) {
    std::sort(r.begin(), r.end());
    state.counters[name] = r[r.size() / 2];
  }
  served.clear();
  umount2(root.c_str(), MNT_DETACH);
  std::system(("rm -rf " + dir).c_str());
}
BENCHMARK(BM_PassthroughVsNative)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  PCHECK(unshare(CLONE_NEWNS) == 0) << "passthrough_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
