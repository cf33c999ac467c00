#include "agent/volume/state_store.h"

#include <dirent.h>
#include <sys/file.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent/base/crash_point.h"
#include "agent/base/status.h"
#include "agent/base/unique_fd.h"

namespace fusekeeper {
namespace {

constexpr char kSuffix[] = ".state";
constexpr char kTmpMarker[] = ".tmp.";

absl::Status MkdirIfMissing(const std::string& path, mode_t mode) {
  if (mkdir(path.c_str(), mode) != 0 && errno != EEXIST) return ErrnoStatus(errno, "mkdir", path);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path);
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StateStore> StateStore::Open(const std::string& dir, absl::Duration lock_wait) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("--state_dir '", dir, "' must be absolute"));
  }
  // 0711: unprivileged FUSE servers must reach <dir>/sockets (each socket is 0600 and theirs);
  // nobody but root may list anything, and volumes/ itself is 0700.
  if (auto s = MkdirIfMissing(dir, 0711); !s.ok()) return s;
  // Ownership first: a second agent must not touch the first one's files (not even its temp
  // files) before it knows it is alone. The kernel drops the lock when the holder dies.
  const std::string lock_path = dir + "/agent.lock";
  UniqueFd lock(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock) return ErrnoStatus(errno, "open", lock_path);
  const absl::Time give_up = absl::Now() + lock_wait;
  while (flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoStatus(errno, "flock", lock_path);
    if (absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(50));  // start-up only: nothing else runs yet
      continue;
    }
    char pid[32] = {};
    const ssize_t n = pread(lock.get(), pid, sizeof(pid) - 1, 0);
    return absl::FailedPreconditionError(absl::StrCat(
        // A pid means something only in the pid namespace of the agent that wrote it (another
        // container's, perhaps): it is given as what that agent said, not as a pid to act on.
        "another fusekeeper agent", n > 0 ? absl::StrCat(" (pid ", absl::StripAsciiWhitespace(pid), " in its own pid namespace)") : "",
        " holds ", lock_path, ": only one agent may use a state dir"));
  }
  const std::string me = absl::StrCat(getpid(), "\n");
  if (ftruncate(lock.get(), 0) != 0 || pwrite(lock.get(), me.data(), me.size(), 0) < 0) {
    return ErrnoStatus(errno, "writing", lock_path);
  }
  const std::string volumes = dir + "/volumes";
  if (auto s = MkdirIfMissing(volumes, 0700); !s.ok()) return s;
  DIR* d = opendir(volumes.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "opendir", volumes);
  while (dirent* e = readdir(d)) {
    if (absl::StrContains(e->d_name, kTmpMarker)) unlinkat(dirfd(d), e->d_name, 0);
  }
  closedir(d);
  return StateStore(volumes, std::move(lock));
}

struct StateStore::VolumeLocks {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<std::mutex>> by_volume;  // guarded by mu
  std::shared_ptr<std::mutex> For(const std::string& volume_id) {
    std::lock_guard<std::mutex> lock(mu);
    std::shared_ptr<std::mutex> m = by_volume[volume_id].lock();
    if (m == nullptr) {
      m = std::make_shared<std::mutex>();
      by_volume[volume_id] = m;
    }
    // Entries of volumes no one holds go when the map grows: bounded by the volumes in use.
    if (by_volume.size() > 64) {
      for (auto it = by_volume.begin(); it != by_volume.end();) {
        it = it->second.expired() ? by_volume.erase(it) : std::next(it);
      }
    }
    return m;
  }
};

StateStore::StateStore(std::string dir, UniqueFd lock)
    : dir_(std::move(dir)), lock_(std::move(lock)), locks_(std::make_shared<VolumeLocks>()) {}

absl::Status StateStore::SaveTargetBlocking(const state::Volume& volume, const std::string& path) const {
  std::shared_ptr<std::mutex> m = locks_->For(volume.volume_id());
  std::lock_guard<std::mutex> lock(*m);
  const std::string file = FileFor(volume.volume_id());
  UniqueFd fd(open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return SaveBlocking(volume);
    return ErrnoStatus(errno, "opening", file);
  }
  state::Volume saved;
  if (!saved.ParseFromFileDescriptor(fd.get())) return absl::DataLossError(absl::StrCat("unreadable volume state ", file));
  fd.Reset();
  const state::Target* mine = nullptr;
  for (const auto& t : volume.targets()) {
    if (t.path() == path) mine = &t;
  }
  bool placed = false;
  auto* targets = saved.mutable_targets();
  for (int i = 0; i < targets->size();) {
    if (targets->Get(i).path() != path) {
      ++i;
    } else if (mine != nullptr && !placed) {
      *targets->Mutable(i) = *mine;
      placed = true;
      ++i;
    } else {
      targets->DeleteSubrange(i, 1);
    }
  }
  if (mine != nullptr && !placed) *saved.add_targets() = *mine;
  return SaveBlocking(saved);
}

std::string StateStore::FileFor(const std::string& volume_id) const {
  return absl::StrCat(dir_, "/", Sha256Hex(volume_id), kSuffix);
}

absl::Status StateStore::SaveBlocking(const state::Volume& volume) const {
  static std::atomic<uint64_t> counter{0};
  static const pid_t pid = getpid();  // the temp name's owner; one syscall fewer per save
  const std::string final_path = FileFor(volume.volume_id());
  const std::string tmp = absl::StrCat(final_path, kTmpMarker, pid, ".", counter++);
  std::string data;
  if (!volume.SerializeToString(&data)) return absl::InternalError("serialising volume state");
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return ErrnoStatus(errno, "creating", tmp);
  if (auto s = WriteAll(fd.get(), data, tmp); !s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  fd.Reset();
  CrashPoint("state-unnamed");
  if (rename(tmp.c_str(), final_path.c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    return ErrnoStatus(err, "rename onto", final_path);
  }
  return absl::OkStatus();
}

absl::Status StateStore::RemoveBlocking(const std::string& volume_id) const {
  const std::string path = FileFor(volume_id);
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus(errno, "unlink", path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<state::Volume>> StateStore::LoadAllBlocking(
    std::vector<std::string>* problems) const {
  std::vector<state::Volume> out;
  DIR* d = opendir(dir_.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "opendir", dir_);
  std::unique_ptr<DIR, int (*)(DIR*)> dir(d, closedir);  // open while its files are opened
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (absl::EndsWith(name, kSuffix) && !absl::StrContains(name, kTmpMarker)) names.push_back(name);
  }
  for (const std::string& name : names) {
    const std::string path = dir_ + "/" + name;
    UniqueFd fd(openat(dirfd(d), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) {
      const int err = errno;
      if (err == ENOENT) continue;  // removed since the listing
      // Not a state that is wrong, one that cannot be read now (EMFILE, ENOMEM...): kept, and the
      // load fails. Moving it aside would forget a volume that is mounted. ELOOP: a symlink,
      // never one of ours.
      if (err != ELOOP) return ErrnoStatus(err, "open", path);
    }
    state::Volume v;
    bool ok = fd && v.ParseFromFileDescriptor(fd.get()) && !v.volume_id().empty() &&
              FileFor(v.volume_id()) == path;
    if (!ok) {
      problems->push_back(absl::StrCat("unreadable volume state ", path, "; moved aside to .corrupt"));
      rename(path.c_str(), (path + ".corrupt").c_str());
      continue;
    }
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace fusekeeper
