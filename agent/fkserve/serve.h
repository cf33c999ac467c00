// `fkserve serve`: the built-in passthrough (passthrough.h) on the connection the agent handed
// over. libfuse's session runs on a thread; the process's one loop (epoll, as the launcher's) on
// the calling thread, with the agent link (agent_link.h: re-deposits, a server pod's drain) and
// the stop signals (signalfd). A stop ends the session through an eventfd its reads poll on.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/handoff_client.h"

namespace fusekeeper {

struct ServeOptions {
  std::string root;         // the directory to export
  bool passthrough = true;  // PassthroughOptions::backing, brokered by the agent (--passthrough)
  bool xattrs = true;       // PassthroughOptions::xattrs
  std::string socket_path;  // the handoff socket (for re-deposits)
  uid_t agent_uid = 0;
  std::function<void(bool)> mark_ready;  // serving starts (true) / ends (false)
};

// Answers the handoff on `sock` (a root it cannot see, or a connection with no FUSE_INIT, is
// reported to the agent) and serves until the connection ends or a stop.
Served Serve(UniqueFd sock, Handoff handoff, const ServeOptions& options);

}  // namespace fusekeeper
