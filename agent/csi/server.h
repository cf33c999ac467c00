// CsiServer: the gRPC server kubelet talks to, on a Unix socket with mode 0660.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/csi/endpoint.h"
#include "agent/csi/identity_service.h"
#include "agent/csi/node_service.h"
#include "agent/csi/rpc.h"
#include "agent/loop/loop.h"

namespace fusekeeper {

struct CsiServerOptions {
  std::string endpoint;  // unix:///path/csi.sock
  IdentityOptions identity;
  NodeOptions node;
  RpcDispatcher::Observer rpc_observer;  // per finished RPC (metrics); may be empty
};

class CsiServer {
 public:
  // Main thread, before or while the loop runs (blocks briefly: stale-socket probe, bind).
  // Fails with a clear message for a bad endpoint, a live agent already on the socket, or a
  // non-socket file at the path.
  // `volumes` may be null (RPC-layer tests); otherwise it must outlive the server.
  static absl::StatusOr<std::unique_ptr<CsiServer>> Start(Loop& loop, CsiServerOptions options,
                                                          VolumeManager* volumes = nullptr);
  ~CsiServer();

  const std::string& socket_path() const { return socket_path_; }

  // Any thread, non-blocking: new RPCs get UNAVAILABLE and Probe reports not ready.
  void BeginDraining() { dispatcher_.BeginDraining(); }

  // Blocks; never on the loop thread (in-flight RPCs finish on the loop, which must keep
  // running). Waits up to grace for in-flight RPCs, cancels what remains, stops listening and
  // removes the socket file if it is still ours.
  void Shutdown(absl::Duration grace);

  bool AwaitInFlightRpcsForTest(int n, absl::Duration timeout) {
    return dispatcher_.AwaitInFlightForTest(n, timeout);
  }

 private:
  CsiServer(Loop& loop, CsiServerOptions options, std::string socket_path, VolumeManager* volumes);

  Loop& loop_;
  std::string socket_path_;
  SocketFileId socket_id_;
  RpcDispatcher dispatcher_;
  IdentityService identity_;
  NodeService node_;
  std::unique_ptr<grpc::Server> server_;
  bool shut_down_ = false;
};

}  // namespace fusekeeper
