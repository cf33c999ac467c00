// AgentLink: a serving FUSE server's side of the handoff connection, after the handoff.
//
// The connection stays open while the server serves (handoff_protocol.h): its end tells the agent
// that the server stopped. The reverse matters too: when the *agent* goes away (a DaemonSet
// rollout, kill -9), its dup of the FUSE connection dies with it, and the restarted agent could
// only give the next server a fresh connection, which running containers then have to be
// repaired onto. So the link watches the connection on the server's loop; when the agent's end
// closes without a word, it reconnects to the socket once the agent listens again (attempts on
// a timer, backing off) and re-deposits a dup of the connection with its FUSE_INIT record. A
// refusal ends the attempts.
//
// A server pod's server (MountConfig::drain_ms) drains: asked to stop (SIGTERM: HoldStop), the
// link tells the agent it is draining, and calls the server's stop when the agent's stop request
// comes (a successor waits) or the drain time is up, whichever is first.
//
// Threading: every method on the loop's thread (or before it runs), but Report, which comes after
// the loop's Run has returned.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/backing_client.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/loop/loop.h"
#include "agent/loop/poll_watch.h"
#include "agent/loop/timer.h"

namespace fusekeeper {

class AgentLink {
 public:
  // `sock`: the handoff connection the volume was received on; `fuse_dup`: a dup of the
  // connection's /dev/fuse fd; `init`: its FUSE_INIT request ("" if this server never saw it);
  // `socket_path`/`agent_uid`: where and whom to reconnect to.
  AgentLink(Loop& loop, UniqueFd sock, UniqueFd fuse_dup, std::string init, std::string socket_path,
            uid_t agent_uid);
  ~AgentLink();
  // The server relays the connection (HandoffReply::relayed): said again when re-depositing.
  // Before Start().
  void set_relayed(bool relayed) { relayed_ = relayed; }
  // The relay's state memfd (a dup), re-deposited with the connection. Before Start().
  void set_relay_state(UniqueFd state) { relay_state_ = std::move(state); }
  // `ms` > 0: a stop is held for at most `ms` (HoldStop) while the agent's successor comes.
  void set_drain_ms(int64_t ms) { drain_ms_ = ms; }
  // The server's own stop, called once when a held stop ends (`why` says how).
  void set_on_stop(std::function<void(const std::string& why)> fn) { on_stop_ = std::move(fn); }
  // Passthrough requests go over the link's current connection and their answers come back
  // through it (backing_client.h). Before Start().
  void set_backing_client(BackingClient* client) { backing_ = client; }
  // Starts watching the connection.
  void Start();
  // The link's dup of the connection: whether it has ended shows on it (ConnectionAlive).
  int fuse_fd() const { return fuse_dup_.get(); }
  // A SIGTERM came. With a drain time the link drains and returns true: the stop comes later
  // (set_on_stop). Without one, false: the server stops now.
  bool HoldStop();
  // Sends the final HandoffReply on the current connection (blocking, bounded) and stops
  // watching. After the loop's Run has returned.
  void Report(bool ok, const std::string& error);
  // Tells the agent something without stopping (HandoffReply::notice): it becomes an Event on the
  // volume. Dropped if there is no connection to the agent right now, or it is not reading.
  void Notice(const std::string& text, int64_t restart_ms = -1);

 private:
  void Watch();
  void Readable();
  // One attempt to connect and re-deposit; the next on a timer, backing off, until one works.
  void TryRedeposit();
  // Sends `r` (named) on the current connection, if there is one; a failure is printed (`what`).
  void Send(const HandoffReply& r, const char* what);
  // The held stop ends, once.
  void StopServing(const std::string& why);

  Loop& loop_;
  const std::string init_, socket_path_;
  const uid_t agent_uid_;
  bool relayed_ = false;
  int64_t drain_ms_ = 0;
  bool draining_ = false, stop_released_ = false, given_up_ = false;
  std::function<void(const std::string&)> on_stop_;
  UniqueFd fuse_dup_;
  UniqueFd relay_state_;
  UniqueFd sock_;
  BackingClient* backing_ = nullptr;
  std::unique_ptr<PollWatch> watch_;
  Timer drain_timer_, redeposit_timer_;
  std::chrono::milliseconds backoff_{20};
};

}  // namespace fusekeeper
