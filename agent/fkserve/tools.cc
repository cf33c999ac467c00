#include "agent/fkserve/tools.h"

#include <fcntl.h>
#include <link.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fusekeeper {
namespace {

absl::Status Copy(const std::string& from, const std::string& to, mode_t mode) {
  const int in = open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return absl::NotFoundError(absl::StrCat("cannot open ", from, ": ", strerror(errno)));
  const std::string tmp = to + ".tmp";
  const int out = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
  if (out < 0) {
    close(in);
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", tmp, ": ", strerror(errno)));
  }
  char buf[1 << 16];
  ssize_t n;
  bool ok = true;
  while ((n = read(in, buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n < 0) continue;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = write(out, buf + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        ok = false;
        break;
      }
      done += w;
    }
    if (!ok) break;
  }
  ok = ok && n == 0;
  close(in);
  if (close(out) != 0) ok = false;
  fchmodat(AT_FDCWD, tmp.c_str(), mode, 0);
  if (!ok || rename(tmp.c_str(), to.c_str()) != 0) {
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("copying ", from, " to ", to, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

std::string BaseName(const std::string& path) { return path.substr(path.rfind('/') + 1); }

}  // namespace

absl::Status InstallToolsBlocking(const std::string& dir, std::string* loader_name) {
  char self[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return absl::InternalError("cannot read /proc/self/exe");
  const std::string exe(self, static_cast<size_t>(len));
  const std::string beside = exe.substr(0, exe.rfind('/') + 1);
  const std::string lib = dir + "/lib";
  if (mkdir(lib.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot make ", lib, ": ", strerror(errno)));
  }
  if (auto s = Copy(exe, dir + "/fkserve", 0755); !s.ok()) return s;
  for (const char* name : {"fkserve-fusermount", "libfkserve_preload.so"}) {
    if (auto s = Copy(beside + name, absl::StrCat(dir, "/", name), 0755); !s.ok()) return s;
  }
  // Every shared object loaded into this process, by the name it was loaded by (its soname, not
  // the file a symlink leads to): what fkserve needs to run anywhere.
  std::set<std::string> objects;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const char* name = info->dlpi_name;
        if (name != nullptr && name[0] == '/') static_cast<std::set<std::string>*>(data)->insert(name);
        return 0;
      },
      &objects);
  loader_name->clear();
  for (const std::string& path : objects) {
    const std::string name = BaseName(path);
    if (auto s = Copy(path, absl::StrCat(lib, "/", name), 0755); !s.ok()) return s;
    if (absl::StartsWith(name, "ld-linux")) *loader_name = name;
  }
  if (loader_name->empty()) return absl::InternalError("no dynamic loader among fkserve's mappings");
  return absl::OkStatus();
}

}  // namespace fusekeeper
