#include "agent/fuse/backing_broker.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "agent/base/status.h"
#include "agent/fuse/handoff_protocol.h"  // kRefusalNotNegotiated
#include "agent/fuse/passthrough_abi.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

// This thread only, for good: the identity's ids and groups, and CAP_SYS_ADMIN alone (effective
// and permitted), which FUSE_DEV_IOC_BACKING_OPEN needs.
absl::Status BecomeOnThisThread(const ServerIdentity& who) {
  if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0) return ErrnoStatus(errno, "prctl PR_SET_KEEPCAPS");
  if (syscall(SYS_setgroups, who.groups.size(), who.groups.data()) != 0) return ErrnoStatus(errno, "setgroups");
  if (syscall(SYS_setresgid, who.gid, who.gid, who.gid) != 0) return ErrnoStatus(errno, "setresgid");
  if (syscall(SYS_setresuid, who.uid, who.uid, who.uid) != 0) return ErrnoStatus(errno, "setresuid");
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  data[CAP_TO_INDEX(CAP_SYS_ADMIN)].effective = CAP_TO_MASK(CAP_SYS_ADMIN);
  data[CAP_TO_INDEX(CAP_SYS_ADMIN)].permitted = CAP_TO_MASK(CAP_SYS_ADMIN);
  if (syscall(SYS_capset, &header, data) != 0) return ErrnoStatus(errno, "capset CAP_SYS_ADMIN");
  return absl::OkStatus();
}

// On an identity thread: whether the server's identity may open `fd`'s file with its access mode.
absl::Status CheckServerMayOpen(int fd) {
  // Opened again through /proc as this thread (the server's identity): the kernel's own check of
  // the file's permissions, as it will make when it opens the backing file for each user.
  const int flags = fcntl(fd, F_GETFL);
  const int mode = flags & O_ACCMODE;
  UniqueFd again(open(absl::StrCat("/proc/self/fd/", fd).c_str(), mode | O_CLOEXEC | O_NOCTTY));
  if (!again) {
    const absl::Status s = ErrnoStatus(errno, "opening the file as the server's user");
    return absl::PermissionDeniedError(absl::StrCat(s.message(), ": the server could not open it itself"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ServerIdentity> PeerIdentity(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return ErrnoStatus(errno, "SO_PEERCRED");
  ServerIdentity who{cred.uid, cred.gid, {}};
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0) {
    if (errno != ERANGE) return ErrnoStatus(errno, "SO_PEERGROUPS");
    groups.resize(glen / sizeof(gid_t));
    if (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0) {
      return ErrnoStatus(errno, "SO_PEERGROUPS");
    }
  }
  groups.resize(glen / sizeof(gid_t));
  who.groups = std::move(groups);
  return who;
}

absl::Status CheckBackingFile(int fd) {
  const int fl = fcntl(fd, F_GETFL);
  if (fl < 0) return ErrnoStatus(errno, "fcntl F_GETFL on the file sent");
  if ((fl & O_PATH) != 0) return absl::InvalidArgumentError("the file was opened with O_PATH: it cannot be read");
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat of the file sent");
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("not a regular file (mode ", absl::Hex(st.st_mode & S_IFMT),
                                                   "): only regular files can back a passthrough open"));
  }
  return absl::OkStatus();
}

// One identity's thread: it becomes the identity once, then runs calls in order.
class BackingBroker::Worker {
 public:
  explicit Worker(const ServerIdentity& who) : who_(who), thread_([this] { Run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Submit(absl::AnyInvocable<void(const absl::Status& became)> call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(call));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    pthread_setname_np(pthread_self(), "fk-backing");
    const absl::Status became = BecomeOnThisThread(who_);
    LOG_IF(ERROR, !became.ok()) << "passthrough broker for uid " << who_.uid << ": " << became;
    while (true) {
      absl::AnyInvocable<void(const absl::Status&)> call;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        call = std::move(queue_.front());
        queue_.pop_front();
      }
      call(became);
    }
  }

  const ServerIdentity who_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<absl::AnyInvocable<void(const absl::Status&)>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

BackingBroker::BackingBroker(Loop& loop) : loop_(loop) {}
BackingBroker::~BackingBroker() = default;

BackingBroker::Worker& BackingBroker::WorkerFor(const ServerIdentity& who) {
  auto& w = workers_[who];
  if (w == nullptr) w = std::make_unique<Worker>(who);
  return *w;
}

void BackingBroker::Open(int conn, UniqueFd file, const ServerIdentity& who,
                         absl::AnyInvocable<void(absl::StatusOr<int32_t>)> done) {
  if (absl::Status s = CheckBackingFile(file.get()); !s.ok()) {
    ++stats_->refused;
    return done(s);
  }
  UniqueFd dup(fcntl(conn, F_DUPFD_CLOEXEC, 3));
  if (!dup) {
    ++stats_->refused;
    return done(ErrnoStatus(errno, "dup of the connection"));
  }
  WorkerFor(who).Submit([this, conn = std::move(dup), file = std::move(file),
                         done = std::move(done)](const absl::Status& became) mutable {
    // (A StatusOr cannot hold an OK status: the thread's failure to become the identity, else
    // the ioctl's outcome.)
    absl::StatusOr<int32_t> result = absl::InternalError("not run");
    if (!became.ok()) {
      result = became;
    } else if (absl::Status may = CheckServerMayOpen(file.get()); !may.ok()) {
      result = may;
    } else {
      FuseBackingMap map{file.get(), 0, 0};
      const int id = ioctl(conn.get(), kFuseDevIocBackingOpen, &map);
      if (id > 0) {
        result = id;
      } else {
        const int e = id < 0 ? errno : EIO;
        const absl::Status s = ErrnoStatus(e, "FUSE_DEV_IOC_BACKING_OPEN");
        result = absl::Status(s.code(), absl::StrCat(s.message(),
                                                     e == EPERM   ? absl::StrCat(" (", kRefusalNotNegotiated, ")")
                                                     : e == ELOOP ? " (the file is on a stacked file system)"
                                                                  : ""));
      }
    }
    conn.Reset();
    file.Reset();
    loop_.Post([stats = stats_, done = std::move(done), result = std::move(result)]() mutable {
      ++(result.ok() ? stats->registered : stats->refused);
      done(std::move(result));
    });
  });
}

void BackingBroker::Close(int conn, int32_t id, const ServerIdentity& who, absl::AnyInvocable<void(absl::Status)> done) {
  UniqueFd dup(fcntl(conn, F_DUPFD_CLOEXEC, 3));
  if (!dup) {
    if (done) done(ErrnoStatus(errno, "dup of the connection"));
    return;
  }
  WorkerFor(who).Submit([this, conn = std::move(dup), id, done = std::move(done)](const absl::Status& became) mutable {
    absl::Status result = became;
    uint32_t backing = static_cast<uint32_t>(id);
    if (became.ok() && ioctl(conn.get(), kFuseDevIocBackingClose, &backing) != 0) {
      result = ErrnoStatus(errno, "FUSE_DEV_IOC_BACKING_CLOSE");
    }
    conn.Reset();
    loop_.Post([stats = stats_, done = std::move(done), result = std::move(result)]() mutable {
      if (result.ok()) ++stats->closed;
      if (done) done(std::move(result));
    });
  });
}

}  // namespace fusekeeper
