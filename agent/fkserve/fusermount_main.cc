// fkserve-fusermount: the fusermount (and fusermount3) a program run by `fkserve launch` finds
// (fusermount.h says why and how). A static binary with nothing but libc, so that it runs in any
// image it is copied into. It asks the launcher's FusermountService for the volume's connection
// and hands it to the FUSE library on _FUSE_COMMFD, as the real fusermount hands over the one it
// mounted; `-u` unmounts nothing.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "agent/base/fd_passing.h"
#include "agent/fkserve/fusermount_protocol.h"

namespace fusekeeper {
namespace {

int Refuse(const std::string& why) {
  fprintf(stderr, "fusermount (fkserve): %s\n", why.c_str());
  return 1;
}

int EnvFd(const char* name) {
  const char* text = getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  char* end = nullptr;
  const long fd = strtol(text, &end, 10);
  if (*end != '\0' || fd < 0 || fd > INT_MAX || fcntl(static_cast<int>(fd), F_GETFD) < 0) return -1;
  return static_cast<int>(fd);
}

// The launcher's socket beside the bin directory holding `link` ("" if there is none).
std::string Beside(const std::string& link) {
  const size_t bin = link.rfind('/');
  if (bin == std::string::npos || bin == 0) return "";
  const size_t dir = link.rfind('/', bin - 1);
  if (dir == std::string::npos) return "";
  const std::string sock = link.substr(0, dir) + "/fusermount.sock";
  struct stat st;
  return stat(sock.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) ? sock : "";
}

// Where the launcher answers: $FKSERVE_FUSERMOUNT_SOCKET, or, for a program that runs its
// fusermount with an environment of its own (go-fuse passes only _FUSE_COMMFD), beside the bin
// directory this link is in (found from argv[0], or on $PATH).
std::string ServiceSocket(const char* argv0) {
  if (const char* env = getenv(kServiceSocketEnv); env != nullptr && env[0] != '\0') return env;
  const std::string self = argv0 != nullptr ? argv0 : "";
  if (self.find('/') != std::string::npos) return Beside(self);
  const char* path = getenv("PATH");
  std::string dirs = path != nullptr ? path : "";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string d = dirs.substr(start, end - start);
    start = end + 1;
    if (d.empty()) continue;
    const std::string candidate = d + "/" + self;
    if (access(candidate.c_str(), X_OK) != 0) continue;
    if (std::string sock = Beside(candidate); !sock.empty()) return sock;
  }
  return "";
}

int Main(int argc, char** argv) {
  std::vector<std::string> options;
  std::string mountpoint;
  bool unmount = false, quiet = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-u") {
      unmount = true;
    } else if (a == "-q") {
      quiet = true;
    } else if (a == "-z" || a == "--auto-unmount") {
      // -z: lazy unmount; --auto-unmount: unmount when the program dies. The agent owns the
      // mount either way.
    } else if (a == "-o" && i + 1 < argc) {
      options.push_back(argv[++i]);
    } else if (a.compare(0, 2, "-o") == 0 && a.size() > 2) {
      options.push_back(a.substr(2));
    } else if (a == "-V" || a == "--version") {
      printf("fusermount (fkserve): hands over the volume's FUSE connection instead of mounting\n");
      return 0;
    } else if (a == "-h" || a == "--help") {
      printf("fusermount (fkserve) [-o options] [--] mountpoint | -u [-q] [-z] [--] mountpoint\n");
      return 0;
    } else if (a == "--") {
      if (i + 1 < argc) mountpoint = argv[++i];
    } else if (!a.empty() && a[0] != '-') {
      mountpoint = a;
    } else {
      return Refuse("unknown argument '" + a + "'");
    }
  }
  if (unmount) {
    // The program ends its session: the mount is the agent's, and stays for the next server.
    if (!quiet) fprintf(stderr, "fusermount (fkserve): not unmounting %s: the volume's mount is the agent's\n",
                        mountpoint.c_str());
    return 0;
  }
  if (mountpoint.empty()) return Refuse("no mountpoint given");
  const int commfd = EnvFd("_FUSE_COMMFD");
  int type = 0;
  socklen_t type_len = sizeof(type);
  if (commfd < 0 || getsockopt(commfd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0) {
    return Refuse("_FUSE_COMMFD is not set to an open socket: not called by a FUSE library");
  }
  const std::string service = ServiceSocket(argv[0]);
  if (service.empty()) {
    return Refuse(std::string("no launcher to ask: ") + kServiceSocketEnv +
                  " is not set and this fusermount is not in a launcher's directory; run the program under "
                  "`fkserve launch`");
  }
  fusekeeper::UniqueFd service_sock = fusekeeper::ConnectSeqpacket(service);
  if (!service_sock.valid()) {
    if (errno == ENAMETOOLONG) return Refuse(service + " is too long a socket path");
    return Refuse("cannot reach the launcher at " + service + ": " + strerror(errno));
  }
  const int sock = service_sock.get();
  char real[PATH_MAX];
  const std::string where = realpath(mountpoint.c_str(), real) != nullptr ? real : mountpoint;
  std::string joined;
  for (const std::string& o : options) joined += (joined.empty() ? "" : ",") + o;
  std::string reply;
  int fuse_fd = -1;
  if (!SendWithFd(sock, "mount\n" + where + "\n" + joined, -1) || !ReceiveWithFd(sock, &reply, &fuse_fd)) {
    return Refuse(std::string("asking the launcher for the connection: ") + strerror(errno));
  }
  service_sock.Reset();
  if (fuse_fd < 0) return Refuse(reply);
  // The handover, as fusermount does it: one data byte and the fd.
  if (!SendWithFd(commfd, std::string(1, '\0'), fuse_fd)) {
    return Refuse(std::string("handing over the connection on _FUSE_COMMFD: ") + strerror(errno));
  }
  close(fuse_fd);
  if (!quiet) fprintf(stderr, "fusermount (fkserve): %s\n", reply.c_str());
  return 0;
}

}  // namespace
}  // namespace fusekeeper

int main(int argc, char** argv) { return fusekeeper::Main(argc, argv); }
