// Real FUSE programs under `fkserve launch`, side by side in one run, four ways each:
//   direct      --direct: the program holds the kernel's connection, no relay (no restarts)
//   in-program  the default: the relay's core runs inside the program (relay/in_program.h)
//   hop         --in_program=false: the relay in the launcher, the program on a socket
//   hop-epoll   the hop under a seccomp filter that refuses io_uring (the runtimes' default
//               profiles); fkserve's loop waits with epoll either way (launcher.cc says why),
//               so this way checks that the filter costs nothing
// (gocryptfs, a Go program, makes its own system calls: its default way is the hop too.)
// Each program serves four mounts of one backing store at once (one per way), each mounted by
// a HandoffEndpoint as the agent mounts volumes, with fkserve as a child process. sshfs talks
// to an sshd of its own, s3fs to s3rver (tests/testing/program_servers.h). The measures run
// interleaved (way by way, 5 rounds, each round starting with another way) and each way's figure
// is the median over the rounds of its ratio to direct in the same round:
//   read    64 MiB sequentially in 1 MiB reads, the file's page cache dropped first
//   write   16 MiB in 1 MiB writes + fsync
//   stat    statx(AT_STATX_FORCE_SYNC): a GETATTR each
//   create  create + close + unlink
//   rand4k  4 KiB preads at random offsets, each range's page cache dropped first
// Counters per program: <measure>_inprog, <measure>_hop and <measure>_hopepoll (ratios to
// direct), and <measure>_direct (operations or MB per second). Then, per relayed way, kill -9 of
// the program 20 times, interleaved: restart_p50_ms_<way> and restart_p99_ms_<way>, from the
// kill to the answer of a statx the reader issued at once (what a pod waits); and each
// launcher's resident memory after all that, rss_kb_<way> (direct: the launcher only waits).
// Programs not installed are skipped (scripts/setup.sh installs them). Needs root (a private
// mount namespace, /dev/fuse).
#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "agent/fuse/fuse_mount.h"
#include "agent/fuse/handoff_endpoint.h"
#include "agent/loop/loop.h"
#include "benchmark/benchmark.h"
#include "glog/logging.h"
#include "tests/testing/no_io_uring.h"
#include "tests/testing/program_servers.h"
#include "tests/testing/running_loop.h"
#include "tests/testing/subprocess.h"

namespace fusekeeper {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kReadBytes = 64 << 20;
constexpr size_t kWriteBytes = 16 << 20;
constexpr size_t kChunk = 1 << 20;
constexpr int kRounds = 5;
// The programs run unprivileged, as in a pod (as root, libfuse would mount by itself).
constexpr uid_t kServerUid = 65534;

struct Program {
  const char* name;
  const char* binary;
  // $W: the work directory; $W/src: the backing directory (holds data.bin); $PORT, $S3RVER: as in
  // program_servers.h; {mountpoint}/{fd}: the launcher's.
  const char* setup;
  std::vector<std::string> args;
  bool writable;
  // Its store starts empty (encrypted, or an S3 bucket): data.bin is written through the direct
  // mount first.
  bool fill_through_volume = false;
  // Its own server, run as root for the program's length, and the line that says it listens.
  const char* server = "";
  const char* server_ready = "";
};

const Program kPrograms[] = {
    {"bindfs", "/usr/bin/bindfs", "", {"bindfs", "-f", "$W/src", "{mountpoint}"}, true},
    {"fuse-overlayfs", "/usr/bin/fuse-overlayfs", "mkdir -p $W/upper $W/work",
     {"fuse-overlayfs", "-f", "-o", "lowerdir=$W/src,upperdir=$W/upper,workdir=$W/work", "{mountpoint}"}, true},
    {"fuse-overlayfs-fd", "/usr/bin/fuse-overlayfs", "mkdir -p $W/upper $W/work",
     {"fuse-overlayfs", "-f", "-o", "lowerdir=$W/src,upperdir=$W/upper,workdir=$W/work", "/dev/fd/{fd}"}, true},
    {"squashfuse_ll", "/usr/bin/squashfuse_ll", "mksquashfs $W/src $W/img.sqfs -quiet -noappend >/dev/null",
     {"squashfuse_ll", "-f", "$W/img.sqfs", "/dev/fd/{fd}"}, false},
    {"unionfs-fuse", "/usr/bin/unionfs-fuse", "",
     {"unionfs-fuse", "-f", "-o", "cow", "$W/src=RW", "{mountpoint}"}, true},
    {"sshfs", "/usr/bin/sshfs", kSshdSetup, {SSHFS_ARGS, "-f"}, true, false, kSshd, kSshdReady},
    // One PUT per file: s3rver fails s3fs's multipart upload of the 64 MiB file (EIO).
    {"s3fs", "/usr/bin/s3fs", kS3fsSetup,
     {"s3fs", "-f", "demo", "{mountpoint}", "-o", kS3fsOptions, "-o", "nomultipart"}, true, true, kS3rverServer,
     kS3rverReady},
    {"gocryptfs", "/usr/bin/gocryptfs",
     "mkdir -p $W/cipher && echo pw > $W/pass && gocryptfs -q -init -passfile $W/pass $W/cipher",
     {"gocryptfs", "-fg", "-q", "-passfile", "$W/pass", "$W/cipher", "/dev/fd/{fd}"}, true, true},
};

enum Way { kDirect = 0, kInProgram = 1, kHop = 2, kHopEpoll = 3 };
constexpr int kWays[] = {kDirect, kInProgram, kHop, kHopEpoll};
const char* WayName(int w) {
  return w == kDirect ? "direct" : w == kInProgram ? "in-program" : w == kHop ? "hop" : "hop-epoll";
}
const char* WayCounter(int w) {
  return w == kDirect ? "direct" : w == kInProgram ? "inprog" : w == kHop ? "hop" : "hopepoll";
}

// One mount served by one launcher.
struct Served {
  std::string mnt, sockdir;
  std::shared_ptr<HandoffEndpoint> endpoint;
  std::unique_ptr<Subprocess> server;
};

bool Shell(const std::string& cmd) { return std::system(cmd.c_str()) == 0; }

class Bench {
 public:
  explicit Bench(std::string root) : root_(std::move(root)) {}
  ~Bench() {
    for (auto& s : served_) {
      umount2(s.mnt.c_str(), MNT_DETACH);
      if (s.endpoint) lt_.RunAndWait([&] { s.endpoint->Stop(); });
      s.endpoint.reset();
      s.server.reset();
    }
  }

  // Mounts one way of `p` on a fresh directory and starts its launcher. Empty: serving.
  std::string Start(const Program& p, int way, const std::string& w, const std::string& port) {
    Served s;
    s.mnt = absl::StrCat(root_, "/mnt-", WayName(way));
    s.sockdir = absl::StrCat(root_, "/sock-", WayName(way));
    fs::create_directories(s.mnt);
    fs::create_directories(s.sockdir);
    auto dev = OpenFuseDeviceBlocking();
    if (!dev.ok()) return dev.status().ToString();
    UniqueFd target(open(s.mnt.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (auto m = MountFuseBlocking(dev->get(), target.get(), s.mnt,
                                   {.source = p.name, .user_id = kServerUid, .group_id = kServerUid});
        !m.ok()) {
      return m.ToString();
    }
    UniqueFd dir(open(s.sockdir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    auto listen = HandoffEndpoint::ListenBlocking(dir.get(), "s", kServerUid, kServerUid);
    chmod(s.sockdir.c_str(), 0755);
    if (!listen.ok()) return listen.status().ToString();
    auto served = std::make_shared<std::promise<void>>();
    lt_.RunAndWait([&] {
      HandoffEndpoint::Events events;
      events.on_served = [served](const HandoffReply&, pid_t) { served->set_value(); };
      MountConfig config;
      config.volume_id = absl::StrCat("bench-", WayName(way));
      s.endpoint = HandoffEndpoint::Start(lt_.loop(), std::move(*listen), std::move(*dev), config, {}, std::move(events));
    });
    // Runfiles live under /root (0700): the unprivileged launcher runs a copy, its preload library
    // and fusermount beside it.
    for (const char* f : {"fkserve", "libfkserve_preload.so", "fkserve-fusermount"}) {
      fs::copy_file(RunfilePath(std::string("agent/fkserve/") + f), root_ + "/" + f, fs::copy_options::skip_existing);
      chmod((root_ + "/" + f).c_str(), 0755);
    }
    // Restarted at once however young it dies (the restart measure kills it 20 times).
    std::vector<std::string> cmd = {root_ + "/fkserve", "--socket=" + s.sockdir + "/s", "--work_dir=" + root_,
                                    "--restart_window_ms=0"};
    if (way == kDirect) cmd.push_back("--direct");
    if (way == kHop || way == kHopEpoll) cmd.push_back("--in_program=false");
    cmd.insert(cmd.end(), {"launch", "--"});
    for (const std::string& a : p.args) cmd.push_back(Expand(a, w, port));
    const bool no_ring = way == kHopEpoll;
    s.server = std::make_unique<Subprocess>(cmd, std::vector<std::string>{}, [no_ring] {
      if (setresgid(kServerUid, kServerUid, kServerUid) != 0 || setresuid(kServerUid, kServerUid, kServerUid) != 0) _exit(99);
      if (no_ring && !RefuseIoUring()) _exit(98);
    });
    if (served->get_future().wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      return absl::StrCat(p.name, " ", WayName(way), " never served: ", s.server->Stderr());
    }
    // The first answer (FUSE_INIT, a GETATTR) before any measure: stat waits for it.
    // (Bounded: a program that mounted something else would leave it waiting.)
    struct stat st;
    auto result = std::make_shared<std::promise<int>>();
    auto answered = result->get_future();
    std::thread([result, mnt = s.mnt] {
      struct stat st;
      result->set_value(stat(mnt.c_str(), &st) == 0 ? 0 : errno);
    }).detach();
    if (answered.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      return absl::StrCat(p.name, " ", WayName(way), ": its mount does not answer: ", s.server->Stderr());
    }
    if (int e = answered.get(); e != 0) return absl::StrCat(p.name, " ", WayName(way), ": ", strerror(e));
    (void)st;
    // Go programs make their own system calls: the default way is the hop for them.
    const bool go = std::string(p.name) == "gocryptfs";
    if (way == kInProgram && !go && s.server->CountInStderr("reads the kernel's connection itself") == 0) {
      return absl::StrCat(p.name, ": the relay's core did not enter it: ", s.server->Stderr());
    }
    if (way == kHopEpoll && s.server->CountInStderr("waiting with epoll") == 0) {
      return absl::StrCat(p.name, ": the hop did not wait with epoll: ", s.server->Stderr());
    }
    served_.push_back(std::move(s));
    return "";
  }
  const std::string& mnt(int way) const { return served_[way].mnt; }
  pid_t launcher(int way) const { return served_[way].server->pid(); }

  static std::string Expand(const std::string& text, const std::string& w, const std::string& port) {
    return absl::StrReplaceAll(text, {{"$W", w}, {"$PORT", port}, {"$S3RVER", kS3rver}});
  }

 private:
  std::string root_;
  RunningLoop lt_;  // the agent's side of the mounts
  std::vector<Served> served_;
};

// One slice of one measure on `mnt`: (work done, seconds).
using Measure = std::pair<double, double> (*)(const std::string& mnt, const std::string& tag);

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::pair<double, double> SeqRead(const std::string& mnt, const std::string&) {
  int fd = open((mnt + "/data.bin").c_str(), O_RDONLY | O_CLOEXEC);
  CHECK_GE(fd, 0) << mnt;
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  std::vector<char> buf(kChunk);
  size_t got = 0;
  const auto t = Clock::now();
  for (ssize_t n; (n = read(fd, buf.data(), buf.size())) > 0;) got += static_cast<size_t>(n);
  const double s = Since(t);
  close(fd);
  CHECK_EQ(got, kReadBytes);
  return {got / 1e6, s};
}

std::pair<double, double> SeqWrite(const std::string& mnt, const std::string& tag) {
  const std::string path = mnt + "/w-" + tag;
  std::vector<char> buf(kChunk, 'w');
  const auto t = Clock::now();
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK_GE(fd, 0) << path << ": " << strerror(errno);
  for (size_t done = 0; done < kWriteBytes; done += kChunk) CHECK_EQ(write(fd, buf.data(), kChunk), (ssize_t)kChunk);
  CHECK_EQ(fsync(fd), 0);
  close(fd);
  const double s = Since(t);
  unlink(path.c_str());
  return {kWriteBytes / 1e6, s};
}

std::pair<double, double> Stat(const std::string& mnt, const std::string&) {
  const std::string path = mnt + "/data.bin";
  const int n = 2000;
  const auto t = Clock::now();
  for (int i = 0; i < n; ++i) {
    struct statx stx;
    CHECK_EQ(statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0);
  }
  return {static_cast<double>(n), Since(t)};
}

std::pair<double, double> CreateUnlink(const std::string& mnt, const std::string& tag) {
  const int n = 300;
  const auto t = Clock::now();
  for (int i = 0; i < n; ++i) {
    const std::string path = absl::StrCat(mnt, "/c-", tag, "-", i);
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    CHECK_GE(fd, 0) << path << ": " << strerror(errno);
    close(fd);
    CHECK_EQ(unlink(path.c_str()), 0);
  }
  return {static_cast<double>(n), Since(t)};
}

std::pair<double, double> RandRead(const std::string& mnt, const std::string& tag) {
  int fd = open((mnt + "/data.bin").c_str(), O_RDONLY | O_CLOEXEC);
  CHECK_GE(fd, 0);
  std::mt19937_64 rng(std::hash<std::string>()(tag));
  char buf[4096];
  const int n = 1000;
  const auto t = Clock::now();
  for (int i = 0; i < n; ++i) {
    const off_t off = static_cast<off_t>(rng() % (kReadBytes / 4096)) * 4096;
    posix_fadvise(fd, off, 4096, POSIX_FADV_DONTNEED);
    CHECK_EQ(pread(fd, buf, sizeof(buf), off), 4096);
  }
  const double s = Since(t);
  close(fd);
  return {static_cast<double>(n), s};
}

struct Named {
  const char* name;
  Measure fn;
  bool writes;
};
const Named kMeasures[] = {{"read", SeqRead, false},
                           {"write", SeqWrite, true},
                           {"stat", Stat, false},
                           {"create", CreateUnlink, true},
                           {"rand4k", RandRead, false}};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The launcher's children: the program (or what it daemonized into).
std::vector<pid_t> ProgramProcesses(pid_t launcher) {
  std::vector<pid_t> out;
  for (const auto& t : fs::directory_iterator(absl::StrCat("/proc/", launcher, "/task"))) {
    std::ifstream in(t.path().string() + "/children");
    for (pid_t p; in >> p;) out.push_back(p);
  }
  return out;
}

// kill -9 of the program `launcher` runs, then a statx at once: the time until it is answered
// (by the next instance), in ms.
double KillAndTimeFirstAnswer(pid_t launcher, const std::string& mnt) {
  const std::vector<pid_t> procs = ProgramProcesses(launcher);
  CHECK(!procs.empty()) << "no program under launcher " << launcher;
  const std::string path = mnt + "/data.bin";
  const auto t = Clock::now();
  for (pid_t p : procs) kill(p, SIGKILL);
  struct statx stx;
  CHECK_EQ(statx(AT_FDCWD, path.c_str(), AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, &stx), 0) << strerror(errno);
  return Since(t) * 1000;
}

double Percentile(std::vector<double> v, int pct) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, v.size() * pct / 100)];
}

long RssKb(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

constexpr int kRestarts = 20;

void BM_Program(benchmark::State& state, const Program* p) {
  if (access(p->binary, X_OK) != 0) {
    state.SkipWithError(absl::StrCat(p->binary, " is not installed").c_str());
    return;
  }
  if (absl::StrContains(p->server, "$S3RVER") && access(kS3rver, X_OK) != 0) {
    state.SkipWithError(absl::StrCat(kS3rver, " is not installed").c_str());
    return;
  }
  for (auto _ : state) {
    char templ[] = "/tmp/fk-progbench-XXXXXX";
    CHECK(mkdtemp(templ) != nullptr);
    const std::string root = templ;
    CHECK_EQ(mount("tmpfs", root.c_str(), "tmpfs", 0, "size=1g"), 0);
    const std::string w = root + "/w", src = w + "/src";
    const std::string port = std::to_string(20000 + getpid() % 20000);
    fs::create_directories(src);
    if (!p->fill_through_volume) {
      std::ofstream out(src + "/data.bin", std::ios::binary);
      std::mt19937_64 rng(1);
      std::vector<uint64_t> block(kChunk / 8);
      for (size_t done = 0; done < kReadBytes; done += kChunk) {
        for (auto& x : block) x = rng();
        out.write(reinterpret_cast<const char*>(block.data()), kChunk);
      }
    }
    chmod(root.c_str(), 0755);
    std::string err;
    if (p->setup[0] != '\0' && !Shell(Bench::Expand(p->setup, w, port))) err = absl::StrCat(p->name, ": setup failed");
    if (err.empty() && !Shell(absl::StrCat("chown -R ", kServerUid, ":", kServerUid, " ", w))) err = "chown";
    std::unique_ptr<Subprocess> server;
    if (err.empty() && p->server[0] != '\0') {
      server = std::make_unique<Subprocess>(std::vector<std::string>{"/bin/sh", "-c", Bench::Expand(p->server, w, port)});
      if (!server->WaitForStderr(p->server_ready, 1, std::chrono::milliseconds(20000))) {
        err = absl::StrCat(p->name, ": its server did not start: ", server->Stderr());
      }
    }
    std::map<std::string, std::vector<double>> rate[4];
    std::vector<double> restart_ms[4];
    long rss_kb[4] = {0, 0, 0, 0};
    {
      Bench b(root);
      for (int way : kWays) {
        if (err.empty()) err = b.Start(*p, way, w, port);
        if (!err.empty()) break;
        if (way == kDirect && p->fill_through_volume) {
          // Written as the server's user, as a pod of it would.
          const std::string cmd = absl::StrCat("head -c ", kReadBytes, " /dev/urandom > ", b.mnt(kDirect), "/data.bin");
          if (!Shell(absl::StrCat("setpriv --reuid=", kServerUid, " --regid=", kServerUid, " --clear-groups sh -c '",
                                  cmd, "'"))) {
            err = "writing data.bin through the volume";
          }
        }
      }
      struct stat st;
      if (err.empty() && stat((b.mnt(kHop) + "/data.bin").c_str(), &st) != 0) err = "no data.bin in the volume";
      if (err.empty()) {
        // As the server's user, as a pod of it would (a program that is not root cannot make
        // root's files: fuse-overlayfs).
        setfsgid(kServerUid);
        setfsuid(kServerUid);
        for (int round = 0; round < kRounds; ++round) {
          for (const Named& m : kMeasures) {
            if (m.writes && !p->writable) continue;
            // Each round starts with another way: none always runs first (or right after
            // direct), which on this VM biased a way by up to 0.2.
            for (int i = 0; i < 4; ++i) {
              const int way = kWays[(round + i) % 4];
              const auto [work, secs] = m.fn(b.mnt(way), absl::StrCat(WayName(way), round));
              rate[way][m.name].push_back(work / secs);
            }
          }
        }
        for (int i = 0; i < kRestarts; ++i) {
          for (int way : {kInProgram, kHop, kHopEpoll}) {
            restart_ms[way].push_back(KillAndTimeFirstAnswer(b.launcher(way), b.mnt(way)));
          }
        }
        setfsuid(0);
        setfsgid(0);
        for (int way : kWays) rss_kb[way] = RssKb(b.launcher(way));
      }
    }
    server.reset();
    umount2(root.c_str(), MNT_DETACH);
    rmdir(root.c_str());
    if (!err.empty()) {
      state.SkipWithError(err.c_str());
      return;
    }
    for (const Named& m : kMeasures) {
      if (m.writes && !p->writable) continue;
      const std::vector<double>& direct = rate[kDirect][m.name];
      state.counters[absl::StrCat(m.name, "_direct")] = Median(direct);
      // The median of each round's ratio: a way against direct measured beside it, so that the
      // VM's drift between rounds cancels out.
      for (int way : {kInProgram, kHop, kHopEpoll}) {
        std::vector<double> ratios;
        for (size_t r = 0; r < direct.size() && r < rate[way][m.name].size(); ++r) {
          ratios.push_back(rate[way][m.name][r] / direct[r]);
        }
        state.counters[absl::StrCat(m.name, "_", WayCounter(way))] = Median(ratios);
      }
    }
    for (int way : {kInProgram, kHop, kHopEpoll}) {
      state.counters[absl::StrCat("restart_p50_ms_", WayCounter(way))] = Percentile(restart_ms[way], 50);
      state.counters[absl::StrCat("restart_p99_ms_", WayCounter(way))] = Percentile(restart_ms[way], 99);
    }
    for (int way : kWays) state.counters[absl::StrCat("rss_kb_", WayCounter(way))] = static_cast<double>(rss_kb[way]);
  }
}

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    fprintf(stderr, "programs_bench needs root (a private mount namespace): %s\n", strerror(errno));
    return 1;
  }
  for (const auto& p : fusekeeper::kPrograms) {
    benchmark::RegisterBenchmark(absl::StrCat("BM_Program/", p.name).c_str(), fusekeeper::BM_Program, &p)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
