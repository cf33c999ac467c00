#include "agent/csi/server.h"

#include <sys/stat.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "agent/base/status.h"
#include "glog/logging.h"

namespace fusekeeper {
namespace {

// CSI messages are small (4 KiB maps); refuse anything absurd before it is parsed.
constexpr int kMaxRequestBytes = 1 << 20;

}  // namespace

CsiServer::CsiServer(Loop& loop, CsiServerOptions options, std::string socket_path,
                     VolumeManager* volumes)
    : loop_(loop),
      socket_path_(std::move(socket_path)),
      dispatcher_(loop, options.rpc_observer),
      identity_(loop, dispatcher_, std::move(options.identity)),
      node_(loop, dispatcher_, std::move(options.node), volumes) {}

absl::StatusOr<std::unique_ptr<CsiServer>> CsiServer::Start(Loop& loop, CsiServerOptions options,
                                                             VolumeManager* volumes) {
  absl::StatusOr<std::string> path = ParseUnixEndpoint(options.endpoint);
  if (!path.ok()) return path.status();
  if (absl::Status s = PrepareSocketPath(*path); !s.ok()) return s;

  std::unique_ptr<CsiServer> server(new CsiServer(loop, std::move(options), *path, volumes));
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort("unix:" + *path, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(&server->identity_);
  builder.RegisterService(&server->node_);
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  // The socket is created inside BuildAndStart; the umask makes it 0660 from its first instant
  // (no window where it is world-accessible), the chmod below makes that explicit.
  const mode_t old_umask = umask(0117);
  server->server_ = builder.BuildAndStart();
  umask(old_umask);
  if (server->server_ == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "could not listen on ", *path, ": check that the directory exists and is writable"));
  }
  if (chmod(path->c_str(), 0660) != 0) {
    return ErrnoStatus(errno, "chmod 0660", *path);
  }
  absl::StatusOr<SocketFileId> id = StatSocketFile(*path);
  if (!id.ok()) return id.status();
  server->socket_id_ = *id;
  LOG(INFO) << "CSI server listening on unix://" << *path;
  return server;
}

void CsiServer::Shutdown(absl::Duration grace) {
  CHECK(!loop_.IsLoopThread()) << "CsiServer::Shutdown blocks; call it off the loop thread";
  if (shut_down_) return;
  shut_down_ = true;
  BeginDraining();
  // We wait for our own in-flight RPCs, then stop gRPC with an immediate deadline: given a
  // later deadline, grpc::Server::Shutdown also waits for idle client connections (kubelet keeps
  // one open) to go away, which would make shutdown time depend on clients.
  const absl::Time start = absl::Now();
  if (dispatcher_.WaitIdle(grace) > 0) {
    // grpc::Server::Shutdown waits for every call to be finished, so finish the stragglers
    // ourselves; their loop-side work no longer touches the call once it is finished.
    const int abandoned = dispatcher_.AbandonInFlight();
    LOG(WARNING) << abandoned << " RPCs still in flight after " << grace
                 << "; answered UNAVAILABLE";
  }
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  LOG(INFO) << "CSI server stopped in " << absl::Now() - start;
  if (RemoveSocketIfOurs(socket_path_, socket_id_)) {
    LOG(INFO) << "removed " << socket_path_;
  }
}

CsiServer::~CsiServer() {
  if (!shut_down_ && server_ != nullptr) Shutdown(absl::ZeroDuration());
}

}  // namespace fusekeeper
