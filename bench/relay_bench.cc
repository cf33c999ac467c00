// The relay's cost, side by side in one run: the same FUSE server (fkserve's passthrough of a
// tmpfs directory, in a process of its own) on the kernel's connection directly, and behind the
// relay (agent/fkserve/relay) on a SOCK_SEQPACKET socket, as `fkserve launch` runs programs.
//
// Each pair also runs a third time behind a bare forwarder (Arg 2): two threads that copy each
// message between the connection and the socket with blocking read/send and recv/write, no
// ring, no state, no journal. It is the floor of any relay built on a second process's socket:
// what the relay's own work costs is relayed − bare; what the extra hop costs is bare − direct.
//
//   BM_SeqRead/<direct|relayed|bare>  64 MiB in 1 MiB reads, page cache dropped first (bytes/s)
//   BM_SeqWrite/<...>                64 MiB in 1 MiB writes + fsync (bytes/s)
//   BM_Stat/<...>                    statx with AT_STATX_FORCE_SYNC (a GETATTR each)
//   BM_CreateUnlink/<...>            create, close, unlink
//   BM_InterleavedRatios/<op>        the four above, the modes interleaved in slices: ratios
//   BM_RestartToFirstAnswer          kill -9 of the server under a reader; the relay's own
//                                    measure from the new instance's start to its first answer
//                                    (p50/p99 counters)
//   BM_NodeTableBytesPer100kNodes    heap the relay's node table holds for 100k nodes
//   BM_JournalBytesPer100kNodes      the relay state's memfd bytes for the same nodes, and the
//                                    cost of a node's record
//
// Needs root (a private mount namespace, /dev/fuse). Compare the pairs as ratios.
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/fuse.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/passthrough.h"
#include "agent/fkserve/relay/node_table.h"
#include "agent/fkserve/relay/relay.h"
#include "agent/fkserve/relay/relay_state.h"
#include "agent/fuse/fuse_mount.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

constexpr size_t kFileBytes = 64 << 20;
constexpr size_t kChunk = 1 << 20;

enum Mode { kDirect = 0, kRelayed = 1, kBare = 2 };
const char* Label(int64_t mode) { return mode == kDirect ? "direct" : mode == kRelayed ? "relayed" : "bare"; }

// The least a relay can do: the kernel's messages to the socket and back, each one a blocking
// read and a send (or a recv and a write), on two threads. Only the INIT reply is touched: its
// max_write and max_pages are fitted to one socket message, as the relay fits them.
class BareForwarder {
 public:
  BareForwarder(int kernel_fd, UniqueFd socket) : kernel_(kernel_fd), socket_(std::move(socket)) {
    down_ = std::thread([this] {
      std::vector<char> buf(kMessage);
      for (ssize_t n; (n = read(kernel_, buf.data(), buf.size())) > 0 || (n < 0 && errno == EINTR);) {
        if (n > 0 && send(socket_.get(), buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) < 0) break;
      }
    });
    up_ = std::thread([this] {
      std::vector<char> buf(kMessage);
      bool init = true;
      for (ssize_t n; (n = recv(socket_.get(), buf.data(), buf.size(), 0)) > 0;) {
        if (init && static_cast<size_t>(n) >= sizeof(fuse_out_header) + 30) {  // the first reply is INIT's
          char* out = buf.data() + sizeof(fuse_out_header);
          uint32_t max_write;
          memcpy(&max_write, out + 20, 4);
          max_write = std::min<uint32_t>(max_write, kMessage - 4096 * 2);
          memcpy(out + 20, &max_write, 4);
          const uint16_t pages = max_write / 4096;
          memcpy(out + 28, &pages, 2);
          init = false;
        }
        if (write(kernel_, buf.data(), static_cast<size_t>(n)) < 0 && errno == ENODEV) break;
      }
    });
  }
  ~BareForwarder() {
    shutdown(socket_.get(), SHUT_RDWR);
    up_.join();
    down_.join();  // ends with the connection (the mount is gone first)
  }

 private:
  static constexpr size_t kMessage = (1 << 20) + 8192;
  const int kernel_;
  UniqueFd socket_;
  std::thread down_, up_;
};

// One mounted connection served by a passthrough in a child process: directly, relayed, or
// behind the bare forwarder.
class Served {
 public:
  explicit Served(int mode) : relayed_(mode == kRelayed), bare_(mode == kBare) {
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
    bare_forwarder_.reset();
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
    } else if (bare_) {
      int pair[2];
      CHECK_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
      for (int fd : pair) {
        int bytes = 4 << 20;  // as the relay asks (net.core.wmem_max caps it)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
      }
      theirs = UniqueFd(pair[1]);
      conn = theirs.get();
      bare_forwarder_ = std::make_unique<BareForwarder>(fuse_.get(), UniqueFd(pair[0]));
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
      o.live = !relayed_ && !bare_ && spawned_;
      _exit(ServePassthrough(dup(conn), o).ok() ? 0 : 5);
    }
    spawned_ = true;
  }

  const bool relayed_, bare_;
  std::string dir_, root_, mnt_;
  UniqueFd fuse_;
  std::unique_ptr<relay::Relay> relay_;
  std::unique_ptr<BareForwarder> bare_forwarder_;
  pid_t child_ = -1;
  bool spawned_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::chrono::nanoseconds> restarts_;
};

std::unique_ptr<Served> served[3];
Served& Get(int64_t mode) {
  if (!served[mode]) served[mode] = std::make_unique<Served>(static_cast<int>(mode));
  return *served[mode];
}

void BM_SeqRead(benchmark::State& state) {
  Served& s = Get(state.range(0));
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
  state.SetLabel(Label(state.range(0)));
}
BENCHMARK(BM_SeqRead)->Arg(kDirect)->Arg(kRelayed)->Arg(kBare)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SeqWrite(benchmark::State& state) {
  Served& s = Get(state.range(0));
  const std::string path = s.mnt() + "/seq-write";
  std::vector<char> buf(kChunk, 'w');
  for (auto _ : state) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    for (size_t i = 0; i < kFileBytes / kChunk; ++i) CHECK_EQ(write(fd, buf.data(), buf.size()), (ssize_t)kChunk);
    CHECK_EQ(fsync(fd), 0);
    close(fd);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kFileBytes));
  state.SetLabel(Label(state.range(0)));
}
BENCHMARK(BM_SeqWrite)->Arg(kDirect)->Arg(kRelayed)->Arg(kBare)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Stat(benchmark::State& state) {
  Served& s = Get(state.range(0));
  const std::string path = s.mnt() + "/stat-me";
  std::ofstream(path) << "x";
  for (auto _ : state) {
    struct statx stx;
    CHECK_EQ(statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(Label(state.range(0)));
}
BENCHMARK(BM_Stat)->Arg(kDirect)->Arg(kRelayed)->Arg(kBare)->UseRealTime();

void BM_CreateUnlink(benchmark::State& state) {
  Served& s = Get(state.range(0));
  int i = 0;
  for (auto _ : state) {
    const std::string path = absl::StrCat(s.mnt(), "/f", i++);
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    CHECK_GE(fd, 0);
    close(fd);
    CHECK_EQ(unlink(path.c_str()), 0);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(Label(state.range(0)));
}
BENCHMARK(BM_CreateUnlink)->Arg(kDirect)->Arg(kRelayed)->Arg(kBare)->UseRealTime();

// The same operations with the three modes interleaved in short slices, so that a host whose
// speed drifts during the run (this VM's does, by 2x within minutes) slows each mode alike. The
// counters are each mode's rate over direct's, summed over all slices: these are the ratios to
// report. One iteration is `kRounds` rounds of one slice per mode, in rotating order.
enum Op { kRead = 0, kWrite = 1, kStatOp = 2, kCreate = 3 };
constexpr int kRounds = 15;

// One slice of `op` on `s`: the work units it did.
double Slice(Op op, Served& s, int* counter) {
  const std::string mnt = s.mnt();
  switch (op) {
    case kRead: {
      const std::string path = mnt + "/ratio-read";
      static std::vector<char> buf(kChunk);
      const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      CHECK_GE(fd, 0);
      posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      size_t total = 0;
      for (ssize_t n; (n = read(fd, buf.data(), buf.size())) > 0;) total += static_cast<size_t>(n);
      close(fd);
      CHECK_EQ(total, kFileBytes / 4);
      return 1;
    }
    case kWrite: {
      static const std::vector<char> buf(kChunk, 'w');
      const int fd = open((mnt + "/ratio-write").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      for (size_t i = 0; i < kFileBytes / 4 / kChunk; ++i) CHECK_EQ(write(fd, buf.data(), buf.size()), (ssize_t)kChunk);
      CHECK_EQ(fsync(fd), 0);
      close(fd);
      return 1;
    }
    case kStatOp: {
      const std::string path = mnt + "/ratio-stat";
      for (int i = 0; i < 500; ++i) {
        struct statx stx;
        CHECK_EQ(statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
      }
      return 500;
    }
    case kCreate:
      for (int i = 0; i < 100; ++i) {
        const std::string path = absl::StrCat(mnt, "/r", (*counter)++);
        const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        CHECK_GE(fd, 0);
        close(fd);
        CHECK_EQ(unlink(path.c_str()), 0);
      }
      return 100;
  }
  return 0;
}

void BM_InterleavedRatios(benchmark::State& state) {
  const Op op = static_cast<Op>(state.range(0));
  Served* modes[3] = {&Get(kDirect), &Get(kRelayed), &Get(kBare)};
  for (Served* s : modes) {
    std::ofstream(s->mnt() + "/ratio-stat") << "x";
    std::string chunk(kChunk, 'r');
    std::ofstream out(s->mnt() + "/ratio-read", std::ios::binary);
    for (size_t i = 0; i < kFileBytes / 4 / kChunk; ++i) out << chunk;
  }
  double seconds[3] = {0, 0, 0}, units[3] = {0, 0, 0};
  int counter = 0;
  for (auto _ : state) {
    for (int round = 0; round < kRounds; ++round) {
      for (int k = 0; k < 3; ++k) {
        const int m = (round + k) % 3;
        const auto start = std::chrono::steady_clock::now();
        units[m] += Slice(op, *modes[m], &counter);
        seconds[m] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    }
  }
  const double direct = units[kDirect] / seconds[kDirect];
  state.counters["relayed_over_direct"] = units[kRelayed] / seconds[kRelayed] / direct;
  state.counters["bare_over_direct"] = units[kBare] / seconds[kBare] / direct;
  static const char* names[] = {"seq read 16 MiB", "seq write 16 MiB + fsync", "statx", "create+unlink"};
  state.SetLabel(names[op]);
}
BENCHMARK(BM_InterleavedRatios)->DenseRange(kRead, kCreate)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_RestartToFirstAnswer(benchmark::State& state) {
  Served& s = Get(kRelayed);
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

// The journal's side of the same 100k nodes (relay_state.h): what the launcher's memfd holds,
// and what a record costs the relay (a node's record is written before the kernel learns it).
void BM_JournalBytesPer100kNodes(benchmark::State& state) {
  for (auto _ : state) {
    auto j = relay::StateJournal::Create();
    CHECK(j.ok()) << j.status();
    const auto t = std::chrono::steady_clock::now();
    uint64_t kid = 2;
    for (uint64_t d = 0; d < 100; ++d) {
      const uint64_t dir = 1000000 + d;
      (*j)->Node(dir, {.parent = relay::kRootId, .name = absl::StrCat("directory-", d), .kernel_lookups = 1});
      for (uint64_t f = 0; f < 1000; ++f) {
        (*j)->Node(kid++, {.parent = dir, .name = absl::StrCat("file-name-", f, ".dat"), .kernel_lookups = 1});
      }
      CHECK((*j)->Flush());
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    struct stat st;
    CHECK_EQ(fstat((*j)->fd(), &st), 0);
    state.counters["log_bytes_per_100k_nodes"] = static_cast<double>((*j)->log_bytes());
    state.counters["memfd_bytes_per_100k_nodes"] = static_cast<double>(st.st_blocks) * 512;
    state.counters["ns_per_node_record"] = secs * 1e9 / 100100;
  }
}
BENCHMARK(BM_JournalBytesPer100kNodes)->Iterations(1)->Unit(benchmark::kMillisecond);

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
