// An application in a pod that holds files open on its volume, for restart tests: in a process of
// its own, from a container-like view of the pod's target (EnterPodView), it keeps
//  - seq.bin open and reads it sequentially (64 KiB at a time, page cache dropped each time so
//    that every read reaches the FUSE server), checking every byte;
//  - seq.bin mapped, and reads a byte from a page it has just dropped (a page fault through FUSE);
//  - dir/ open, reading a few entries per step (a listing in progress), checking each pass
//    lists every name exactly once;
//  - its working directory inside the volume (sub/), opening rel.txt by a relative path;
//  - writable volumes: log.txt open O_APPEND (a line per step, fsync), data.bin open O_RDWR
//    (a 4 KiB block rewritten per step, fsync); Finish() checks both byte for byte.
// Every failure is reported with the operation and errno; nothing here sleeps to synchronise.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/volume/pod_app.h"
#include "tests/volume/pod_reader.h"

namespace fusekeeper {

class PodWorkload {
 public:
  static constexpr size_t kSeqBytes = 1 << 20;
  static constexpr int kDirEntries = 300;

  static char SeqByte(size_t i) { return static_cast<char>((i * 7 + i / 4096) & 0xff); }
  // What the test creates in the volume (through the host's path of the target, or in the image
  // the program serves) before the workload starts.
  static void CreateFiles(const std::string& dir) {
    std::string seq(kSeqBytes, '\0');
    for (size_t i = 0; i < kSeqBytes; ++i) seq[i] = SeqByte(i);
    std::ofstream(dir + "/seq.bin", std::ios::binary) << seq;
    mkdir((dir + "/dir").c_str(), 0755);
    for (int i = 0; i < kDirEntries; ++i) std::ofstream(dir + "/dir/entry-" + std::to_string(i));
    mkdir((dir + "/sub").c_str(), 0755);
    std::ofstream(dir + "/sub/rel.txt") << "relative\n";
  }

  // `uid`: who the app runs as once its view is made (an unprivileged program cannot give files
  // to root).
  PodWorkload(const std::string& target, const std::string& view_dir, bool writable, uid_t uid)
      : app_(target, view_dir, uid, [writable](const std::string& v, int out) { Run(v, writable, out); }) {}

  // Blocking: until `n` more steps have completed (false if the deadline passed first).
  bool WaitForSteps(int64_t n) { return app_.WaitForSteps(n); }
  // Blocking: stops the workload, which checks what it wrote, byte for byte.
  bool Finish() { return app_.Ask('s'); }
  int64_t steps() { return app_.steps(); }
  std::vector<std::string> errors() { return app_.errors(); }

 private:
  static void Report(int out, const std::string& m) { PodApp::Report(out, m); }
  static std::string Err(const std::string& what) { return PodApp::Err(what); }

  [[noreturn]] static void Run(const std::string& v, bool writable, int out) {
    const int seq = open((v + "/seq.bin").c_str(), O_RDONLY | O_CLOEXEC);
    if (seq < 0) Report(out, Err("open seq.bin")), _exit(1);
    void* map = mmap(nullptr, kSeqBytes, PROT_READ, MAP_SHARED, seq, 0);
    if (map == MAP_FAILED) Report(out, Err("mmap seq.bin")), _exit(1);
    DIR* dir = opendir((v + "/dir").c_str());
    if (dir == nullptr) Report(out, Err("opendir dir")), _exit(1);
    if (chdir((v + "/sub").c_str()) != 0) Report(out, Err("chdir sub")), _exit(1);
    int log = -1, data = -1;
    std::string log_want, data_want(64 * 4096, '\0');
    if (writable) {
      log = open((v + "/log.txt").c_str(), O_WRONLY | O_APPEND | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      data = open((v + "/data.bin").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (log < 0 || data < 0) Report(out, Err("open log.txt/data.bin")), _exit(1);
    }
    std::set<std::string> listed;
    std::vector<char> buf(64 * 1024);
    for (uint64_t k = 0;; ++k) {
      bool ok = true;
      // Sequential read, checked.
      const size_t off = (k * buf.size()) % kSeqBytes;
      posix_fadvise(seq, 0, 0, POSIX_FADV_DONTNEED);
      const ssize_t n = pread(seq, buf.data(), buf.size(), static_cast<off_t>(off));
      if (n != static_cast<ssize_t>(buf.size())) {
        Report(out, n < 0 ? Err("read seq.bin") : "-read seq.bin: short read");
        ok = false;
      } else {
        for (size_t i = 0; i < buf.size(); ++i) {
          if (buf[i] != SeqByte(off + i)) {
            Report(out, "-read seq.bin: wrong byte at " + std::to_string(off + i));
            ok = false;
            break;
          }
        }
      }
      // A page fault through FUSE.
      const size_t page = ((k * 13) % (kSeqBytes / 4096)) * 4096 + k % 4096;
      madvise(map, kSeqBytes, MADV_DONTNEED);
      posix_fadvise(seq, 0, 0, POSIX_FADV_DONTNEED);
      if (static_cast<const char*>(map)[page] != SeqByte(page)) {
        Report(out, "-mmap read: wrong byte at " + std::to_string(page));
        ok = false;
      }
      // A listing in progress.
      for (int i = 0; i < 7; ++i) {
        errno = 0;
        dirent* e = readdir(dir);
        if (e == nullptr) {
          if (errno != 0) {
            Report(out, Err("readdir"));
            ok = false;
          } else if (listed.size() != kDirEntries) {
            Report(out, "-readdir: a pass listed " + std::to_string(listed.size()) + " names, not " +
                            std::to_string(kDirEntries));
            ok = false;
          }
          listed.clear();
          rewinddir(dir);
          break;
        }
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        if (!listed.insert(name).second) {
          Report(out, "-readdir: " + name + " listed twice in a pass");
          ok = false;
        }
      }
      // The working directory.
      const int rel = open("rel.txt", O_RDONLY | O_CLOEXEC);
      char small[32];
      const ssize_t got = rel < 0 ? -1 : read(rel, small, sizeof(small));
      if (rel < 0 || got != 9 || memcmp(small, "relative\n", 9) != 0) {
        Report(out, rel < 0 ? Err("open rel.txt in the cwd") : "-read rel.txt: wrong content");
        ok = false;
      }
      if (rel >= 0) close(rel);
      if (writable) {
        const std::string line = "line " + std::to_string(k) + "\n";
        if (write(log, line.data(), line.size()) != static_cast<ssize_t>(line.size()) || fsync(log) != 0) {
          Report(out, Err("append+fsync log.txt"));
          ok = false;
        } else {
          log_want += line;
        }
        std::string block(4096, static_cast<char>('a' + k % 26));
        const off_t at = static_cast<off_t>((k % 64) * 4096);
        if (pwrite(data, block.data(), block.size(), at) != 4096 || fsync(data) != 0) {
          Report(out, Err("write+fsync data.bin"));
          ok = false;
        } else {
          data_want.replace(static_cast<size_t>(at), 4096, block);
        }
      }
      if (ok) Report(out, "+");
      if (PodApp::NextCommand(out) != 0) {
        // Finish: what was written reads back byte for byte, through the files held open.
        bool final_ok = true;
        if (writable) {
          std::string got_log;
          const int r = open((v + "/log.txt").c_str(), O_RDONLY | O_CLOEXEC);
          for (ssize_t m; r >= 0 && (m = read(r, buf.data(), buf.size())) > 0;) got_log.append(buf.data(), m);
          if (r >= 0) close(r);
          if (got_log != log_want) {
            size_t at = 0;
            while (at < got_log.size() && at < log_want.size() && got_log[at] == log_want[at]) ++at;
            std::string g = got_log.substr(at, 40), w = log_want.substr(at, 40);
            for (auto& ch : g) if (ch == '\n') ch = '|'; else if (ch == 0) ch = '@';
            for (auto& ch : w) if (ch == '\n') ch = '|'; else if (ch == 0) ch = '@';
            // Past the page cache: what the server itself answers.
            std::string direct = "(O_DIRECT open failed)";
            const int d = open((v + "/log.txt").c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
            if (d >= 0) {
              void* mem = nullptr;
              if (posix_memalign(&mem, 4096, 1 << 16) == 0) {
                const ssize_t n = read(d, mem, 1 << 16);
                direct = n < 0 ? "(O_DIRECT read failed)"
                               : (std::string(static_cast<char*>(mem), static_cast<size_t>(n)) == log_want
                                      ? "the server answers it right (the page cache was stale)"
                                      : "the server answers it wrong too");
                free(mem);
              }
              close(d);
            }
            Report(out, "-finish: log.txt differs (" + std::to_string(got_log.size()) + " bytes, want " +
                            std::to_string(log_want.size()) + ") at " + std::to_string(at) + ": got '" + g + "' want '" +
                            w + "'; " + direct);
            final_ok = false;
          }
          std::string got_data(data_want.size(), '\0');
          posix_fadvise(data, 0, 0, POSIX_FADV_DONTNEED);
          if (k >= 63 && (pread(data, got_data.data(), got_data.size(), 0) != static_cast<ssize_t>(got_data.size()) ||
                          got_data != data_want)) {
            Report(out, "-finish: data.bin differs");
            final_ok = false;
          }
          if (close(log) != 0 || close(data) != 0) {
            Report(out, Err("finish: close"));
            final_ok = false;
          }
        }
        if (munmap(map, kSeqBytes) != 0 || close(seq) != 0 || closedir(dir) != 0) {
          Report(out, Err("finish: close"));
          final_ok = false;
        }
        Report(out, final_ok ? "=ok" : "=failed");
        _exit(0);
      }
    }
  }

  PodApp app_;
};

}  // namespace fusekeeper
