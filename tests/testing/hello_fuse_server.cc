#define FUSE_USE_VERSION 35
#include "tests/testing/hello_fuse_server.h"

#include <chrono>
#include <errno.h>
#include <fuse_lowlevel.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

constexpr fuse_ino_t kHelloIno = 2;

const std::string& Content(fuse_req_t req) {
  return static_cast<HelloFuseServer*>(fuse_req_userdata(req))->content();
}

void Stat(fuse_ino_t ino, size_t size, struct stat* st) {
  memset(st, 0, sizeof(*st));
  st->st_ino = ino;
  if (ino == FUSE_ROOT_ID) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
  } else {
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(size);
  }
}

void Lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (parent != FUSE_ROOT_ID || strcmp(name, "hello") != 0) return (void)fuse_reply_err(req, ENOENT);
  fuse_entry_param e{};
  e.ino = kHelloIno;
  e.attr_timeout = 1.0;
  e.entry_timeout = 1.0;
  Stat(kHelloIno, Content(req).size(), &e.attr);
  fuse_reply_entry(req, &e);
}

void GetAttr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  if (ino != FUSE_ROOT_ID && ino != kHelloIno) return (void)fuse_reply_err(req, ENOENT);
  struct stat st;
  Stat(ino, Content(req).size(), &st);
  fuse_reply_attr(req, &st, 1.0);
}

void Open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  if (ino != kHelloIno) return (void)fuse_reply_err(req, EISDIR);
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return (void)fuse_reply_err(req, EACCES);
  fuse_reply_open(req, fi);
}

void Read(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info*) {
  auto* server = static_cast<HelloFuseServer*>(fuse_req_userdata(req));
  const std::string& c = server->content();
  if (server->read_work_ms() > 0 && off == 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(server->read_work_ms());
    volatile uint64_t spin = 0;
    while (std::chrono::steady_clock::now() < until) ++spin;
  }
  if (static_cast<size_t>(off) >= c.size()) return (void)fuse_reply_buf(req, nullptr, 0);
  const size_t n = std::min(size, c.size() - static_cast<size_t>(off));
  if (server->content_fd() < 0) return (void)fuse_reply_buf(req, c.data() + off, n);
  // From a file: libfuse splices it into a pipe and the pipe into the connection.
  fuse_bufvec buf = FUSE_BUFVEC_INIT(n);
  buf.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  buf.buf[0].fd = server->content_fd();
  buf.buf[0].pos = off;
  fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

void Init(void* userdata, fuse_conn_info* conn) {
  if (static_cast<HelloFuseServer*>(userdata)->content_fd() < 0) return;
  // libfuse offers splice whatever the kernel's INIT says (as fuse-overlayfs asks for it).
  conn->want |= FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE;
}

}  // namespace

HelloFuseServer::HelloFuseServer(int fuse_fd, std::string content, int read_work_ms)
    : content_(std::move(content)), read_work_ms_(read_work_ms) {
  if (content_.rfind(kSpliceContent, 0) == 0) {
    content_ = SplicedContent(std::stoul(content_.substr(strlen(kSpliceContent))));
    content_fd_ = memfd_create("hello-content", MFD_CLOEXEC);
    CHECK_GE(content_fd_, 0);
    CHECK_EQ(write(content_fd_, content_.data(), content_.size()), static_cast<ssize_t>(content_.size()));
  }
  static fuse_lowlevel_ops ops = [] {
    fuse_lowlevel_ops o{};
    o.init = Init;
    o.lookup = Lookup;
    o.getattr = GetAttr;
    o.open = Open;
    o.read = Read;
    return o;
  }();
  char arg0[] = "hello-fuse";
  char* argv[] = {arg0, nullptr};
  fuse_args args = FUSE_ARGS_INIT(1, argv);
  session_ = fuse_session_new(&args, &ops, sizeof(ops), this);
  fuse_opt_free_args(&args);
  CHECK(session_ != nullptr);
  // libfuse 3.3+ treats /dev/fd/N as "already mounted, serve this fd".
  CHECK_EQ(fuse_session_mount(session_, absl::StrCat("/dev/fd/", fuse_fd).c_str()), 0);
  thread_ = std::thread([this] { fuse_session_loop(session_); });
}

HelloFuseServer::~HelloFuseServer() {
  thread_.join();
  fuse_session_destroy(session_);
  if (content_fd_ >= 0) close(content_fd_);
}

std::string SplicedContent(size_t bytes) {
  std::string out(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<char>('a' + (i * 7 + i / 4096) % 26);
  return out;
}

}  // namespace fusekeeper
