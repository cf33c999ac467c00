// A tiny libfuse3 low-level server for tests: a root directory holding one file, "hello", whose
// content is given. Serves an already-mounted /dev/fuse fd (as the reference server will) on its
// own thread until the connection ends (unmount or abort).
#pragma once

#include <string>
#include <thread>

struct fuse_session;

namespace fusekeeper {

class HelloFuseServer {
 public:
  // Takes ownership of fuse_fd (libfuse closes it).
  HelloFuseServer(int fuse_fd, std::string content);
  ~HelloFuseServer();  // waits for the session loop: end the connection first
  const std::string& content() const { return content_; }

 private:
  std::string content_;
  fuse_session* session_ = nullptr;
  std::thread thread_;
};

}  // namespace fusekeeper
