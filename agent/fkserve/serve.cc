#include "agent/fkserve/serve.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/fkserve/agent_link.h"
#include "agent/fkserve/backing_client.h"
#include "agent/fkserve/backing_table.h"
#include "agent/fkserve/passthrough.h"
#include "agent/loop/loop.h"
#include "agent/loop/signals.h"

namespace fusekeeper {
namespace {

int Fail(int code, const std::string& message) {
  fprintf(stderr, "fkserve: %s\n", message.c_str());
  return code;
}

// Passthrough's table of open handles (backing_table.h): the one the connection's earlier server
// deposited with the agent, or (`create`) a new one. Null (passthrough off) if there is none.
std::unique_ptr<BackingTable> PassthroughTable(Handoff* handoff, bool create) {
  if (handoff->relay_state.valid()) {
    auto adopted = BackingTable::Adopt(std::move(handoff->relay_state));
    if (adopted.ok()) {
      fprintf(stderr, "fkserve: passthrough: carrying on from the table of the last server (%zu open handle(s), %zu "
              "backing file(s))\n", (*adopted)->handles(), (*adopted)->ids());
      return std::move(*adopted);
    }
    fprintf(stderr, "fkserve: passthrough: the state the agent kept is not ours (%s)%s\n",
            std::string(adopted.status().message()).c_str(), create ? "; starting a new table" : "");
  }
  if (!create) return nullptr;
  auto table = BackingTable::Create();
  if (table.ok()) return std::move(*table);
  fprintf(stderr, "fkserve: passthrough off: %s\n", std::string(table.status().message()).c_str());
  return nullptr;
}

// The table, and `options` told of it and of `backing`. With passthrough off, a live connection's
// table is still carried on: files its predecessor left open in passthrough must be opened again
// with their backing file (another way: EIO), and closed when their last handle goes; this server
// registers none itself.
std::unique_ptr<BackingTable> WirePassthrough(Handoff* handoff, bool on, BackingClient* backing,
                                              PassthroughOptions* options) {
  std::unique_ptr<BackingTable> table = PassthroughTable(handoff, on);
  if (!table) return nullptr;
  options->backing = backing;
  options->backing_table = table.get();
  options->register_backing = on;
  if (!on) {
    fprintf(stderr, "fkserve: passthrough off; files the last server left open in passthrough are opened with their "
            "backing files until they are closed\n");
  }
  return table;
}

}  // namespace

Served Serve(UniqueFd sock, Handoff handoff, const ServeOptions& o) {
  PassthroughOptions options;
  options.root = o.root;
  options.read_only = handoff.config.read_only;
  options.mount_group = handoff.config.mount_group;
  options.xattrs = o.xattrs;
  struct stat root_st;
  if (stat(o.root.c_str(), &root_st) != 0 || !S_ISDIR(root_st.st_mode)) {
    ReplyToAgent(sock.get(), false, absl::StrCat("export root ", o.root, " is not a directory this server can see"));
    return {Fail(5, absl::StrCat("--root ", o.root, " is not a directory"))};
  }
  if (handoff.config.live) {
    options.init_request = handoff.config.init;
    options.live = true;
  } else {
    // Read the INIT now, to report it: a successor adopting this connection replays it.
    auto init = ReadInitRequest(handoff.fuse.get(), 10000);
    if (!init.ok()) {
      ReplyToAgent(sock.get(), false, std::string(init.status().message()));
      return {Fail(5, std::string(init.status().message()))};
    }
    options.init_request = std::move(*init);
  }
  // Passthrough's table goes to the agent with the reply (as a relay's state): kept there for the
  // next server of this connection.
  BackingClient backing;
  std::unique_ptr<BackingTable> table = WirePassthrough(&handoff, o.passthrough, &backing, &options);
  ReplyToAgent(sock.get(), true, "", false, handoff.config.live ? "" : options.init_request, false,
               table ? table->fd() : -1);
  BlockSignals({SIGTERM, SIGINT, SIGHUP});
  // epoll, never the ring: its polls would keep the agent's socket open past a kill -9 (launcher.cc).
  auto loop = Loop::Create({.epoll_only = "fkserve's loop, so that a killed server's sockets close at once"});
  if (!loop.ok()) {
    ReplyToAgent(sock.get(), false, absl::StrCat("cannot make an event loop: ", loop.status().message()));
    return {Fail(5, std::string(loop.status().message()))};
  }
  UniqueFd stop(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  bool stopped = false;  // asked to stop (a signal, the agent): not the connection's end
  auto stop_serving = [&stop, &stopped] {
    stopped = true;
    const uint64_t one = 1;
    (void)!write(stop.get(), &one, sizeof(one));
  };
  options.stop_fd = stop.get();
  // The connection stays open while we serve (and is re-deposited with a restarted agent); its
  // end (and why) is reported to the agent.
  AgentLink link(**loop, std::move(sock), UniqueFd(fcntl(handoff.fuse.get(), F_DUPFD_CLOEXEC, 3)),
                             options.init_request, o.socket_path, o.agent_uid);
  // A server pod's server drains: asked to stop, it serves on until the agent's successor waits.
  link.set_drain_ms(handoff.config.drain_ms);
  link.set_on_stop([&](const std::string&) { stop_serving(); });
  if (table) {
    link.set_backing_client(&backing);
    link.set_relay_state(UniqueFd(fcntl(table->fd(), F_DUPFD_CLOEXEC, 3)));
  }
  auto signals = SignalWatcher::Create(**loop, {SIGTERM, SIGINT, SIGHUP}, [&](int sig) {
    if (sig == SIGTERM && link.HoldStop()) return;
    stop_serving();
  });
  if (!signals.ok()) return {Fail(5, std::string(signals.status().message()))};
  link.Start();
  if (o.mark_ready) o.mark_ready(true);
  absl::Status s;
  std::thread session([&] {
    s = ServePassthrough(handoff.fuse.Release(), options);
    (*loop)->Stop();
  });
  (*loop)->Run();
  session.join();
  if (o.mark_ready) o.mark_ready(false);
  link.Report(s.ok(), s.ok() ? "" : std::string(s.message()));
  if (backing.opened() > 0) {
    fprintf(stderr, "fkserve: %lld open(s) passed through to their backing files\n",
            static_cast<long long>(backing.opened()));
  }
  if (!s.ok()) return {Fail(5, std::string(s.message()))};
  return {0, !stopped};
}


}  // namespace fusekeeper
