// The relay's cost, side by side in one run: the same FUSE server (fkserve's passthrough of a
// tmpfs directory, in a process of its own) on the kernel's connection directly, and behind the
// relay (agent/fkserve/relay) on a SOCK_SEQPACKET socket, as `fkserve launch` runs programs.
//
//   BM_SeqRead/<direct|relayed>      64 MiB in 1 MiB reads, page cache dropped first (bytes/s)
//   BM_SeqWrite/<direct|relayed>     64 MiB in 1 MiB writes + fsync (bytes/s)
//   BM_Stat/<direct|relayed>         statx with AT_STATX_FORCE_SYNC (a GETATTR each)
//   BM_CreateUnlink/<direct|relayed> create, close, unlink
//   BM_RestartToFirstAnswer          kill -9 of the server under a reader; the relay's own
//                                    measure from the new instance's start to its first answer
//                                    (p50/p99 counters)
//   BM_NodeTableBytesPer100kNodes    heap the relay's node table holds for 100k nodes
//
// Needs root (a private mount namespace, /dev/fuse). Compare the pairs as ratios.
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/passthrough.h"
#include "agent/fkserve/relay/node_table.h"
#include "agent/fkserve/relay/relay.h"
#include "agent/fuse/fuse_mount.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

constexpr size_t kFileBytes = 64 << 20;
constexpr size_t kChunk = 1 << 20;

// One mounted connection served by a passthrough in a child process, directly or relayed.
class Served {
 public:
  explicit Served(bool relayed) : relayed_(relayed) {
    char tmpl[] = "/tmp/fk-relay-bench-XXXXXX";
    CHECK(mkdtemp(tmpl) != nullptr);
    dir_ = tmpl;
    root_ = dir_ + "/root";
    mnt_ = dir_ + "/mnt";
    mkdir(root_.c_str(), 0755);
    mkdir(mnt_.c_str(), 0755);
    CHECK_EQ(mount("tmpfs", root_.c_str(), "tmpfs", 0, "size=512m"), 0);
    auto dev = OpenFuseDeviceBlocking();
    CHECK(dev.ok()) << dev.status();
    fuse_ = std::move(*dev);
    UniqueFd target(open(mnt_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    CHECK(MountFuseBlocking(fuse_.get(), target.get(), mnt_, FuseMountOptions{}).ok());
    if (relayed_) {
      relay::RelayCallbacks cb;
      cb.first_answer = [this](std::chrono::nanoseconds took, const relay::RelayStats& st) {
        std::lock_guard<std::mutex> lock(mu_);
        if (st.instances > 1) restarts_.push_back(took);
        cv_.notify_all();
      };
      auto r = relay::Relay::Start(fuse_.get(), std::move(cb));
      CHECK(r.ok()) << r.status();
      relay_ = std::move(*r);
    }
    Spawn();
  }
  ~Served() {
    umount2(mnt_.c_str(), MNT_DETACH);
    if (child_ > 0) {
      kill(child_, SIGKILL);
      waitpid(child_, nullptr, 0);
    }
    relay_.reset();
    umount2(root_.c_str(), MNT_DETACH);
    std::system(("rm -rf " + dir_).c_str());
  }
  // kill -9 of the server and a new one started at once; blocking until it has answered.
  std::chrono::nanoseconds Restart() {
    kill(child_, SIGKILL);
    waitpid(child_, nullptr, 0);
    size_t before;
    {
      std::lock_guard<std::mutex> lock(mu_);
      before = restarts_.size();
    }
    Spawn();
    // A request so that there is something to answer (not from the attribute cache).
    struct statx stx;
    CHECK_EQ(statx(AT_FDCWD, (mnt_ + "/probe").c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return restarts_.size() > before; });
    return restarts_.back();
  }
  const std::string& mnt() const { return mnt_; }

 private:
  void Spawn() {
    int conn = fuse_.get();
    UniqueFd theirs;
    if (relayed_) {
      auto s = relay_->NewInstanceSocket();
      CHECK(s.ok());
      theirs = std::move(*s);
      conn = theirs.get();
    }
    child_ = fork();
    CHECK_GE(child_, 0);
    if (child_ == 0) {
      auto init = ReadInitRequest(conn, 10000);
      if (!init.ok()) _exit(3);
      PassthroughOptions o;
      o.root = root_;
      o.init_request = *init;
      // Directly, a second server on a served connection adopts it (live); relayed, every
      // instance answers its own INIT.
      o.live = !relayed_ && spawned_;
      _exit(ServePassthrough(dup(conn), o).ok() ? 0 : 5);
    }
    spawned_ = true;
    if (relayed_) return;
    // Directly, the first INIT is read by the child; nothing more to do.
  }

  const bool relayed_;
  std::string dir_, root_, mnt_;
  UniqueFd fuse_;
  std::unique_ptr<relay::Relay> relay_;
  pid_t child_ = -1;
  bool spawned_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::chrono::nanoseconds> restarts_;
};

std::unique_ptr<Served> served[2];
Served& Get(bool relayed) {
  if (!served[relayed]) served[relayed] = std::make_unique<Served>(relayed);
  return *served[relayed];
}

void BM_SeqRead(benchmark::State& state) {
  Served& s = Get(state.range(0) != 0);
  const std::string path = s.mnt() + "/seq-read";
  {
    std::string chunk(kChunk, 'r');
    std::ofstream out(path, std::ios::binary);
    for (size_t i = 0; i < kFileBytes / kChunk; ++i) out << chunk;
  }
  std::vector<char> buf(kChunk);
  for (auto _ : state) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    size_t total = 0;
    for (ssize_t n; (n = read(fd, buf.data(), buf.size())) > 0;) total += static_cast<size_t>(n);
    close(fd);
    CHECK_EQ(total, kFileBytes);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFileBytes));
  state.SetLabel(state.range(0) ? "relayed" : "direct");
}
BENCHMARK(BM_SeqRead)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SeqWrite(benchmark::State& state) {
  Served& s = Get(state.range(0) != 0);
  const std::string path = s.mnt() + "/seq-write";
  std::vector<char> buf(kChunk, 'w');
  for (auto _ : state) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    for (size_t i = 0; i < kFileBytes / kChunk; ++i) CHECK_EQ(write(fd, buf.data(), buf.size()), (ssize_t)kChunk);
    CHECK_EQ(fsync(fd), 0);
    close(fd);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFileBytes));
  state.SetLabel(state.range(0) ? "relayed" : "direct");
}
BENCHMARK(BM_SeqWrite)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Stat(benchmark::State& state) {
  Served& s = Get(state.range(0) != 0);
  const std::string path = s.mnt() + "/stat-me";
  std::ofstream(path) << "x";
  for (auto _ : state) {
    struct statx stx;
    CHECK_EQ(statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(state.range(0) ? "relayed" : "direct");
}
BENCHMARK(BM_Stat)->Arg(0)->Arg(1)->UseRealTime();

void BM_CreateUnlink(benchmark::State& state) {
  Served& s = Get(state.range(0) != 0);
  int i = 0;
  for (auto _ : state) {
    const std::string path = absl::StrCat(s.mnt(), "/f", i++);
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    CHECK_GE(fd, 0);
    close(fd);
    CHECK_EQ(unlink(path.c_str()), 0);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(state.range(0) ? "relayed" : "direct");
}
BENCHMARK(BM_CreateUnlink)->Arg(0)->Arg(1)->UseRealTime();

void BM_RestartToFirstAnswer(benchmark::State& state) {
  Served& s = Get(true);
  std::ofstream(s.mnt() + "/probe") << "p";
  std::vector<double> ms;
  for (auto _ : state) ms.push_back(std::chrono::duration<double, std::milli>(s.Restart()).count());
  std::sort(ms.begin(), ms.end());
  state.counters["p50_ms"] = ms[ms.size() / 2];
  state.counters["p99_ms"] = ms[std::min(ms.size() - 1, ms.size() * 99 / 100)];
}
BENCHMARK(BM_RestartToFirstAnswer)->Iterations(100)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_NodeTableBytesPer100kNodes(benchmark::State& state) {
  for (auto _ : state) {
    const size_t before = mallinfo2().uordblks;
    auto* t = new relay::NodeTable();
    // 100 directories of 1000 files, with names as long as typical file names.
    for (uint64_t d = 0; d < 100; ++d) {
      const uint64_t dir = t->AddKernelEntry(relay::kRootId, absl::StrCat("directory-", d), 1000000 + d);
      for (uint64_t f = 0; f < 1000; ++f) t->AddKernelEntry(dir, absl::StrCat("file-name-", f, ".dat"), d * 1000 + f + 2);
    }
    state.counters["bytes_per_100k_nodes"] = static_cast<double>(mallinfo2().uordblks - before);
    delete t;
  }
}
BENCHMARK(BM_NodeTableBytesPer100kNodes)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  PCHECK(unshare(CLONE_NEWNS) == 0) << "relay_bench needs root";
  PCHECK(mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  for (auto& s : fusekeeper::served) s.reset();  // unmounts, and ends the servers
  return 0;
}
