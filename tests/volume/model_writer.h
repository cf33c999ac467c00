// A writer that knows what every file it writes must hold, for restart tests (issue 27): from a
// container-like pod view (PodApp), seeded, it holds files open and changes them at random —
// pwrite of 1 B to 256 KiB at random offsets (holes included), O_APPEND appends, ftruncate shorter
// and longer, fsync, rename of a held file — and preads random ranges of them, each checked
// against its model of the file; plus a file opened by name, pwritten, fsynced half the time and
// closed. Every result is reported:
//   "-W…": a read that returned bytes the model never had (silent corruption: never allowed);
//   "-E…": an fsync or close that failed with EIO (the honest way to report lost data: the
//          writer then reads the file whole and takes that as its model, as an app that was told
//          would have to);
//   "-X…": any other failure.
// Verify ('v') fsyncs the held files, then reads every file fresh by name (O_DIRECT where the file
// system takes it) and compares; Stop ('q') closes the held files (errors reported), verifies and
// ends.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include "tests/volume/pod_app.h"

namespace fusekeeper {

class ModelWriter {
 public:
  struct Options {
    // ftruncate longer too (and pwrite past the end, leaving holes), not only shorter.
    bool extend = true;
    // rename held files.
    bool rename = true;
    // ftruncate held files.
    bool truncate = true;
  };
  ModelWriter(const std::string& target, const std::string& view_dir, uid_t uid, uint32_t seed, Options options)
      : app_(target, view_dir, uid, [seed, options](const std::string& v, int out) { Run(v, seed, options, out); }) {}

  bool WaitForSteps(int64_t n) { return app_.WaitForSteps(n); }
  // Blocking: every file read fresh and compared with the model (the writer goes on).
  bool Verify() { return app_.Ask('v', std::chrono::seconds(60)); }
  // Blocking: the held files closed, verified, the writer ended.
  bool Stop() { return app_.Ask('q', std::chrono::seconds(60)); }
  int64_t steps() { return app_.steps(); }
  std::vector<std::string> errors() { return app_.errors(); }
  // Reports of a kind: 'W', 'E', 'X'.
  int64_t Count(char kind) { return app_.errors_of_kind(kind); }
  size_t error_count() { return app_.error_count(); }

 private:
  struct File {
    std::string name;
    int fd = -1;
    std::string model;
    bool append = false;
  };
  static constexpr size_t kMaxFileBytes = 4 << 20;

  static std::string Describe(const File& f) { return f.name + " (" + std::to_string(f.model.size()) + " B)"; }

  // Reads the whole of `path` (O_DIRECT if the file system takes it); false on an error.
  static bool ReadWhole(const std::string& path, std::string* got) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd < 0 && errno == EINVAL) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    void* mem = nullptr;
    if (posix_memalign(&mem, 4096, 1 << 20) != 0) abort();
    got->clear();
    ssize_t n;
    while ((n = read(fd, mem, 1 << 20)) > 0) got->append(static_cast<char*>(mem), static_cast<size_t>(n));
    free(mem);
    const bool ok = n == 0;
    return close(fd) == 0 && ok;
  }

  static std::string FirstDifference(const std::string& got, const std::string& want) {
    size_t at = 0;
    while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
    return "got " + std::to_string(got.size()) + " bytes, want " + std::to_string(want.size()) +
           (at < std::min(got.size(), want.size()) || got.size() != want.size()
                ? ", first difference at " + std::to_string(at)
                : "");
  }

  [[noreturn]] static void Run(const std::string& v, uint32_t seed, const Options& options, int out) {
    std::mt19937 rng(seed);
    std::vector<File> held(3);
    held[0].name = "h0.bin";
    held[1].name = "h1.bin";
    held[2].name = "a.log";
    held[2].append = true;
    for (File& f : held) {
      f.fd = open((v + "/" + f.name).c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (f.append ? O_APPEND : 0), 0644);
      if (f.fd < 0) PodApp::Report(out, PodApp::Err("X open " + f.name)), _exit(1);
    }
    File byname;
    byname.name = "o.bin";
    std::vector<char> buf;
    auto fill = [&](size_t len) {
      std::string d(len, '\0');
      const uint32_t base = rng();
      for (size_t i = 0; i < len; ++i) d[i] = static_cast<char>((base + i * 131 + i / 4096) & 0xff);
      return d;
    };
    auto size_of_write = [&] { return static_cast<size_t>(1 + rng() % (1u << (rng() % 19))); };  // 1 B - 256 KiB
    // An fsync or close that failed: honest, if EIO; the app reads what is there and goes on.
    auto failed = [&](File& f, const std::string& what) {
      const int e = errno;
      PodApp::Report(out, PodApp::Err(std::string(e == EIO ? "E " : "X ") + what + " " + Describe(f)));
      std::string got;
      if (ReadWhole(v + "/" + f.name, &got)) f.model = got;
    };
    auto apply_write = [](std::string* m, size_t off, const std::string& d) {
      if (m->size() < off + d.size()) m->resize(off + d.size());
      m->replace(off, d.size(), d);
    };
    auto verify = [&](bool held_open) {
      // An app that has to know what its files hold asks first: an fsync that fails (EIO) is
      // how it learns that some of what it wrote is gone (then it takes what the file holds).
      for (File& f : held) {
        if (held_open && fsync(f.fd) != 0) failed(f, "fsync before verify");
      }
      bool ok = true;
      std::vector<File*> files = {&held[0], &held[1], &held[2]};
      if (!byname.name.empty() && byname.fd == -2) files.push_back(&byname);  // made at least once
      for (File* f : files) {
        std::string got;
        if (!ReadWhole(v + "/" + f->name, &got)) {
          PodApp::Report(out, PodApp::Err("X verify: read " + f->name));
          ok = false;
        } else if (got != f->model) {
          PodApp::Report(out, "-W verify: " + f->name + ": " + FirstDifference(got, f->model));
          ok = false;
        }
      }
      return ok;
    };
    for (uint64_t k = 0;; ++k) {
      for (int op = 0; op < 6; ++op) {
        File& f = held[rng() % 2];
        switch (rng() % 10) {
          case 0:
          case 1:
          case 2: {  // pwrite, holes included
            if (f.model.size() > kMaxFileBytes) break;
            const size_t off = rng() % (f.model.size() + (options.extend ? 65536 : 1));
            const std::string d = fill(size_of_write());
            if (pwrite(f.fd, d.data(), d.size(), static_cast<off_t>(off)) != static_cast<ssize_t>(d.size())) {
              PodApp::Report(out, PodApp::Err("X pwrite " + Describe(f)));
            } else {
              apply_write(&f.model, off, d);
            }
            break;
          }
          case 3: {  // O_APPEND
            File& a = held[2];
            if (a.model.size() > kMaxFileBytes) break;
            const std::string d = fill(1 + rng() % 4096);
            if (write(a.fd, d.data(), d.size()) != static_cast<ssize_t>(d.size())) {
              PodApp::Report(out, PodApp::Err("X append " + Describe(a)));
            } else {
              a.model += d;
            }
            break;
          }
          case 4: {  // ftruncate, shorter or longer
            if (!options.truncate) break;
            const size_t to = rng() % (options.extend ? f.model.size() * 2 + 4096 : f.model.size() + 1);
            if (ftruncate(f.fd, static_cast<off_t>(to)) != 0) {
              PodApp::Report(out, PodApp::Err("X ftruncate " + Describe(f)));
            } else {
              f.model.resize(to);
            }
            break;
          }
          case 5: {  // fsync
            File& s = held[rng() % 3];
            if (fsync(s.fd) != 0) failed(s, "fsync");
            break;
          }
          case 6: {  // rename of a held file
            if (!options.rename) break;
            const std::string to = "mv-" + std::to_string(k) + "-" + std::to_string(op) + ".bin";
            if (rename((v + "/" + f.name).c_str(), (v + "/" + to).c_str()) != 0) {
              PodApp::Report(out, PodApp::Err("X rename " + f.name));
            } else {
              f.name = to;
            }
            break;
          }
          case 7:
          case 8: {  // pread of a random range, checked
            File& r = held[rng() % 3];
            const size_t off = rng() % (r.model.size() + 1024);
            const size_t len = size_of_write();
            buf.resize(len);
            const ssize_t n = pread(r.fd, buf.data(), len, static_cast<off_t>(off));
            const std::string want = off >= r.model.size() ? "" : r.model.substr(off, len);
            if (n < 0) {
              PodApp::Report(out, PodApp::Err("X pread " + Describe(r)));
            } else if (std::string(buf.data(), static_cast<size_t>(n)) != want) {
              // Past the page cache: what the server itself answers now.
              std::string whole;
              const std::string server = !ReadWhole(v + "/" + r.name, &whole) ? "unreadable"
                                         : whole == r.model                  ? "right"
                                                                             : "wrong, " + FirstDifference(whole, r.model);
              PodApp::Report(out, "-W pread " + Describe(r) + " [" + std::to_string(off) + ", +" + std::to_string(len) +
                                      "): " + FirstDifference(std::string(buf.data(), static_cast<size_t>(n)), want) +
                                      " (step " + std::to_string(k) + "; the file read whole now: " + server + ")");
            }
            break;
          }
          case 9: {  // a file opened by name, written, fsynced half the time, closed
            const int fd = open((v + "/" + byname.name).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
            if (fd < 0) {
              PodApp::Report(out, PodApp::Err("X open " + byname.name));
              break;
            }
            byname.fd = -2;
            const size_t off = rng() % (byname.model.size() + 4096);
            const std::string d = fill(size_of_write() % 65536 + 1);
            if (byname.model.size() <= kMaxFileBytes &&
                pwrite(fd, d.data(), d.size(), static_cast<off_t>(off)) == static_cast<ssize_t>(d.size())) {
              apply_write(&byname.model, off, d);
            }
            if (rng() % 2 == 0 && fsync(fd) != 0) failed(byname, "fsync");
            if (close(fd) != 0) failed(byname, "close");
            break;
          }
        }
      }
      PodApp::Report(out, "+");
      switch (PodApp::NextCommand(out)) {
        case 'v':
          PodApp::Report(out, verify(/*held_open=*/true) ? "=ok" : "=failed");
          break;
        case 'q': {
          bool ok = true;
          for (File& f : held) {
            if (close(f.fd) != 0) {
              failed(f, "close");
              ok = false;
            }
          }
          ok = verify(/*held_open=*/false) && ok;
          PodApp::Report(out, ok ? "=ok" : "=failed");
          _exit(0);
        }
        default:
          break;
      }
    }
  }

  PodApp app_;
};

}  // namespace fusekeeper
