// Other people's FUSE programs for the end-to-end tests: how each is installed, set up, launched
// and served (its own server: sshd, an S3 endpoint), and the fixture that prepares one, starts it
// through `fkserve launch`, and kills every process of it.
#pragma once

#include <dirent.h>

#include <cstdlib>
#include <functional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/testing/program_servers.h"
#include "tests/volume/fuse_fixture.h"

namespace fusekeeper {

struct Program {
  const char* name;
  const char* binary;  // must be installed
  // Run as root before the program, with $W the work dir (readable by the server's uid after)
  // and $SRC a directory holding hello.txt.
  const char* setup;
  std::vector<std::string> args;  // $W replaced; {mountpoint} by the launcher
  bool writable;
  // Starts empty (an encrypted store): hello.txt is written through the volume first.
  bool starts_empty = false;
  // Why it cannot work here at all (printed as the skip reason), or "".
  const char* cannot = "";
  // What the agent must post as a FuseServerNotice (options the program asked for and did not
  // get), or "".
  const char* notice = "";
  // The program's own server (sshd, an S3 endpoint), run as root for the test's length with $W
  // and $PORT, and the line on its stderr that says it listens.
  const char* server = "";
  const char* server_ready = "";
};

// FUSEKEEPER_RELAY_HOP=1: the relay stays in the launcher for every program (fkserve launch
// --in_program=false), so that every relayed test runs in the other mode too.
inline bool RelayHopRequested() {
  const char* env = getenv("FUSEKEEPER_RELAY_HOP");
  return env != nullptr && env[0] == '1';
}

// Whether the relay's core runs inside this program (relay/in_program.h): it reads its
// connection through libc, where the preload library sees it. Go programs make their own system
// calls: they are relayed by the launcher.
inline bool CoreRunsInProgram(const std::string& name) {
  if (RelayHopRequested()) return false;
  return name.rfind("gocryptfs", 0) != 0 && name.rfind("rclone", 0) != 0;
}
inline constexpr char kInProgramLine[] = "reads the kernel's connection itself";

// gtest prints a parameter that fails: its name, not its bytes.
inline void PrintTo(const Program& p, std::ostream* os) { *os << p.name; }

inline std::string ProgramName(const ::testing::TestParamInfo<Program>& info) {
  return absl::StrReplaceAll(info.param.name, {{"-", "_"}, {" ", "_"}});
}

inline const Program kPrograms[] = {
    {"bindfs", "/usr/bin/bindfs", "", {"bindfs", "$W/src", "{mountpoint}"}, true},
    {"bindfs-foreground", "/usr/bin/bindfs", "", {"bindfs", "-f", "$W/src", "{mountpoint}"}, true},
    {"bindfs-asks-ro", "/usr/bin/bindfs", "", {"bindfs", "-o", "ro", "$W/src", "{mountpoint}"}, false, false, "",
     "FuseServerNotice: volume prog: its FUSE server reports: bindfs: fusermount options not applied: ro (the agent "
     "mounted the volume read-write)"},
    {"fuse-zip", "/usr/bin/fuse-zip", "cd $W/src && zip -q ../a.zip hello.txt", {"fuse-zip", "-r", "$W/a.zip", "{mountpoint}"},
     false},
    {"unionfs-fuse", "/usr/bin/unionfs-fuse", "mkdir -p $W/upper",
     {"unionfs-fuse", "-o", "cow", "$W/upper=RW:$W/src=RO", "{mountpoint}"}, true},
    {"archivemount", "/usr/bin/archivemount", "tar -C $W/src -cf $W/a.tar hello.txt",
     {"archivemount", "-o", "readonly", "$W/a.tar", "{mountpoint}"}, false},
    {"fuse2fs", "/usr/bin/fuse2fs", "mke2fs -q -t ext4 -d $W/src $W/fs.img 8M",
     {"fuse2fs", "-o", "ro,fakeroot", "$W/fs.img", "{mountpoint}"}, false},
    // Writable: fuse2fs writes through libext2fs's cache of its image (durability.h: at reply
    // is what `auto` assumes; the model-checking writer tells whether that holds).
    {"fuse2fs-rw", "/usr/bin/fuse2fs", "mke2fs -q -t ext4 -E root_owner=65534:65534 -d $W/src $W/fs.img 64M",
     {"fuse2fs", "-f", "-o", "fakeroot", "$W/fs.img", "{mountpoint}"}, true},
    {"squashfuse", "/usr/bin/squashfuse", "mksquashfs $W/src $W/sq.img -quiet -no-progress",
     {"squashfuse", "$W/sq.img", "{mountpoint}"}, false},
    {"squashfuse_ll", "/usr/bin/squashfuse_ll", "mksquashfs $W/src $W/sq.img -quiet -no-progress",
     {"squashfuse_ll", "-f", "$W/sq.img", "{mountpoint}"}, false},
    {"fuse-overlayfs", "/usr/bin/fuse-overlayfs", "mkdir -p $W/upper $W/work",
     {"fuse-overlayfs", "-f", "-o", "lowerdir=$W/src,upperdir=$W/upper,workdir=$W/work", "{mountpoint}"}, true},
    // go-fuse takes /dev/fd/N natively; given a directory it checks the mount is there itself.
    {"rclone-mount2", "/usr/bin/rclone", "",
     {"rclone", "--config", "/dev/null", "mount2", "$W/src", "/dev/fd/{fd}"}, true},
    {"gocryptfs", "/usr/bin/gocryptfs",
     "mkdir $W/cipher && echo secret > $W/pw && chown -R 65534 $W && "
     "setpriv --reuid=65534 --regid=65534 --clear-groups gocryptfs -q -init -passfile $W/pw $W/cipher",
     {"gocryptfs", "-q", "-fg", "-passfile", "$W/pw", "$W/cipher", "/dev/fd/{fd}"}, true, true},
    {"rclone-mount", "/usr/bin/rclone", "", {"rclone", "--config", "/dev/null", "mount", "$W/src", "{mountpoint}"},
     true},
    // With a write cache (what random writes and read-write opens need): files are uploaded after
    // close, from a cache directory that outlives a kill.
    {"rclone-mount-cache", "/usr/bin/rclone", "mkdir -p $W/cache",
     {"rclone", "--config", "/dev/null", "--cache-dir", "$W/cache", "--vfs-cache-mode", "writes", "mount", "$W/src",
      "{mountpoint}"},
     true},
    {"rclone-mount2-cache", "/usr/bin/rclone", "mkdir -p $W/cache",
     {"rclone", "--config", "/dev/null", "--cache-dir", "$W/cache", "--vfs-cache-mode", "writes", "mount2", "$W/src",
      "/dev/fd/{fd}"},
     true},
    {"sshfs", "/usr/bin/sshfs", kSshdSetup, {SSHFS_ARGS}, true, false, "", "", kSshd, kSshdReady},
    {"sshfs-foreground", "/usr/bin/sshfs", kSshdSetup, {SSHFS_ARGS, "-f"}, true, false, "", "", kSshd, kSshdReady},
    {"s3fs", "/usr/bin/s3fs", kS3fsSetup, {"s3fs", "demo", "{mountpoint}", "-o", kS3fsOptions}, true, true, "", "",
     kS3rverServer, kS3rverReady},
    {"s3fs-foreground", "/usr/bin/s3fs", kS3fsSetup, {"s3fs", "-f", "demo", "{mountpoint}", "-o", kS3fsOptions}, true,
     true, "", "", kS3rverServer, kS3rverReady},
    {"encfs", "/usr/bin/encfs", "mkdir $W/raw && echo secret > $W/pw",
     {"encfs", "-f", "--standard", "--extpass=cat $W/pw", "$W/raw", "{mountpoint}"}, true, true},
    {"ntfs-3g", "/usr/bin/ntfs-3g",
     "truncate -s 8M $W/ntfs.img && mkntfs -q -F -f $W/ntfs.img && ntfscp -q $W/ntfs.img $W/src/hello.txt hello.txt",
     {"ntfs-3g", "-o", "ro", "$W/ntfs.img", "{mountpoint}"}, false, false,
     "ntfs-3g's built-in FUSE (fuse-lite) mounts only with root privileges (Debian installs it setuid root) and "
     "never asks fusermount: 'User doesn't have privilege to mount'"},
};

class ProgramsE2ETest : public FuseE2ETest, public ::testing::WithParamInterface<Program> {
 protected:
  bool WaitForAgentLog(const std::string& what) {
    return agent_->WaitForStderr(what, 1, std::chrono::duration_cast<std::chrono::milliseconds>(kTestDeadline));
  }
  // Writes `content` to `path` as an app whose uid owns the files (the server's), then reads it
  // back; returns what was read ("" and a failure if the write failed or hung).
  std::string WriteAsServerUid(const std::string& path, const std::string& content) {
    std::ofstream(root_.path() + "/content") << content;
    Subprocess writer({"/bin/sh", "-c", "cat " + root_.path() + "/content > " + path + " && cat " + path + " >&2"}, {},
                      [] {
                        if (setresgid(kServerUid, kServerUid, kServerUid) != 0 ||
                            setresuid(kServerUid, kServerUid, kServerUid) != 0) {
                          _exit(99);
                        }
                      });
    auto st = writer.Wait(std::chrono::milliseconds(20000));
    EXPECT_TRUE(st.has_value() && *st == 0) << "writing " << path << ": " << writer.Stderr();
    return st.has_value() && *st == 0 ? writer.Stderr() : "";
  }

  // Sets up the program's files and servers; returns why it cannot run here ("" if it can) and
  // its launch arguments. `extra_setup` runs first with $SRC filled (files the program serves).
  std::string Prepare(const Program& prog, std::vector<std::string>* launch_out,
                      const std::function<void(const std::string& src)>& extra_setup = nullptr) {
    if (prog.cannot[0] != '\0') return absl::StrCat(prog.name, " cannot be served unprivileged: ", prog.cannot);
    if (access(prog.binary, X_OK) != 0) return absl::StrCat(prog.binary, " is not installed (scripts/setup.sh installs it)");
    const std::string w = root_.path() + "/work";
    const std::string port = std::to_string(20000 + getpid() % 20000);
    auto expand = [&](const std::string& text) {
      return absl::StrReplaceAll(text, {{"$W", w}, {"$PORT", port}, {"$S3RVER", kS3rver}});
    };
    if (absl::StrContains(prog.server, "$S3RVER") && access(kS3rver, X_OK) != 0) {
      return absl::StrCat(kS3rver, " is not installed (scripts/setup.sh installs s3rver from npm)");
    }
    fs::create_directories(w + "/src");
    const std::string want = std::string("hello from ") + prog.name + "\n";
    { std::ofstream(w + "/src/hello.txt") << want; }
    if (extra_setup) extra_setup(w + "/src");
    if (prog.setup[0] != '\0') {
      const std::string cmd = expand(std::string("set -e; ") + prog.setup);
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    EXPECT_EQ(std::system(("chown -R " + std::to_string(kServerUid) + ":" + std::to_string(kServerUid) + " " + w).c_str()),
              0);
    std::vector<std::string>& launch = *launch_out;
    if (RelayHopRequested()) launch.push_back("--in_program=false");
    launch.insert(launch.end(), {"launch", "--"});
    for (const auto& a : prog.args) launch.push_back(expand(a));
    if (prog.server[0] != '\0') {
      server_ = std::make_unique<Subprocess>(std::vector<std::string>{"/bin/sh", "-c", expand(prog.server)});
      EXPECT_TRUE(server_->WaitForStderr(prog.server_ready, 1, std::chrono::milliseconds(20000))) << server_->Stderr();
    }
    return "";
  }

  std::unique_ptr<Subprocess> server_;  // the program's own server; stopped when the test ends

  // kill -9 of every process of the program `launcher` runs (a daemonized one runs on without its
  // parent); returns once the launcher has restarted it for the `nth` time (false: not in 20 s).
  bool KillProgramAndWaitForRestart(Subprocess* launcher, int nth) {
    const std::string ended = "the relay keeps the connection: restarting it";
    const int ended_before = launcher->CountInStderr(ended);
    std::set<pid_t> killed;
    for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);;) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      for (pid_t p : ProgramProcesses(launcher->pid())) {
        if (killed.insert(p).second) kill(p, SIGKILL);
      }
      // A program that was daemonizing as it was killed may have forked a process after the list
      // was read: the instance has ended only once the launcher says so, and the launcher says
      // it before it starts the next instance. Its words reach us a little later (a pipe and a
      // reader thread): the list is read again only after 2 s without them, long past that delay
      // even under load, so the next instance's processes are never taken for this one's.
      if (!killed.empty() && launcher->WaitForStderr(ended, ended_before + 1, std::chrono::milliseconds(2000))) break;
    }
    return launcher->WaitForStderr(absl::StrCat("(", nth, " restart(s) so far)"), 1, std::chrono::milliseconds(20000));
  }

  // kill -9 of the launcher and every process of its program at once (a container restarted, an
  // image upgraded); once the agent has seen its server go (as kubelet restarts a container only
  // after it ended), a new launcher on `socket`, which must carry on from the relay state the dead
  // one deposited. Returns it; nullptr (and a failure) if any step did not happen in 20 s.
  Subprocess* KillLauncherAndStartAnother(Subprocess* launcher, const std::string& socket,
                                          const std::vector<std::string>& launch) {
    const std::string gone = "the FUSE server closed its connection";
    const int gone_before = agent_->CountInStderr(gone);
    std::set<pid_t> procs = ProgramProcesses(launcher->pid());
    launcher->Signal(SIGKILL);
    for (pid_t p : procs) kill(p, SIGKILL);
    if (!launcher->Wait(std::chrono::milliseconds(20000)).has_value()) {
      ADD_FAILURE() << "the killed launcher did not end";
      return nullptr;
    }
    if (!agent_->WaitForStderr(gone, gone_before + 1, std::chrono::milliseconds(20000))) {
      ADD_FAILURE() << "the agent did not see the launcher go:\n" << agent_->Stderr();
      return nullptr;
    }
    Subprocess* next = StartServer(socket, launch);
    if (!next->WaitForStderr("carrying on from its relay state", 1, std::chrono::milliseconds(20000))) {
      ADD_FAILURE() << "the new launcher did not carry on from the relay state:\n" << next->Stderr() << "\nthe one before:\n"
                    << launcher->Stderr() << agent_->Stderr();
      return nullptr;
    }
    return next;
  }

  // The program's processes: the launcher's children (the program, or what it daemonized into).
  std::set<pid_t> ProgramProcesses(pid_t launcher) {
    std::set<pid_t> out;
    DIR* tasks = opendir(("/proc/" + std::to_string(launcher) + "/task").c_str());
    if (tasks == nullptr) return out;
    while (dirent* t = readdir(tasks)) {
      if (t->d_name[0] == '.') continue;
      std::ifstream in("/proc/" + std::to_string(launcher) + "/task/" + t->d_name + "/children");
      for (pid_t p; in >> p;) out.insert(p);
    }
    closedir(tasks);
    return out;
  }
};

}  // namespace fusekeeper
