// A tiny libfuse3 low-level server for tests: a root directory holding one file, "hello", whose
// content is given. Serves an already-mounted /dev/fuse fd (as the reference server will) on its
// own thread until the connection ends (unmount or abort).
#pragma once

#include <string>
#include <thread>

struct fuse_session;

namespace fusekeeper {

// Content "splice:<bytes>": SplicedContent(bytes), served from a memfd with libfuse's splice of
// READ replies (FUSE_CAP_SPLICE_WRITE), as fuse-overlayfs serves its files.
inline constexpr char kSpliceContent[] = "splice:";
std::string SplicedContent(size_t bytes);

class HelloFuseServer {
 public:
  // Takes ownership of fuse_fd (libfuse closes it). `read_work_ms` > 0: each READ at offset 0
  // first keeps a CPU busy that long (a program working on a long request, as an upload).
  HelloFuseServer(int fuse_fd, std::string content, int read_work_ms = 0);
  ~HelloFuseServer();  // waits for the session loop: end the connection first
  const std::string& content() const { return content_; }
  int content_fd() const { return content_fd_; }  // -1: replies from memory
  int read_work_ms() const { return read_work_ms_; }

 private:
  std::string content_;
  int content_fd_ = -1;
  int read_work_ms_ = 0;
  fuse_session* session_ = nullptr;
  std::thread thread_;
};

}  // namespace fusekeeper
