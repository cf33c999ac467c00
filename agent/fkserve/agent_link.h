// AgentLink: a serving FUSE server's side of the handoff connection, after the handoff.
//
// The connection stays open while the server serves (handoff_protocol.h): its end tells the agent
// that the server stopped. The reverse matters too: when the *agent* goes away (a DaemonSet
// rollout, kill -9), its dup of the FUSE connection dies with it, and the restarted agent could
// only give the next server a fresh connection, which running containers then have to be
// repaired onto. So the link watches the connection on a thread of its own; when the agent's
// end closes without a word, it reconnects to the socket once the agent listens again and
// re-deposits a dup of the connection with its FUSE_INIT record. A refusal ends the attempts.
//
// A server pod's server (MountConfig::drain_ms) drains: with the drain gate armed (drain_gate.h)
// a SIGTERM is held; the link tells the agent it is draining, and releases the signal — the
// server then stops as it would have — when the agent's stop request comes (a successor waits)
// or the drain time is up, whichever is first.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "agent/base/unique_fd.h"
#include "agent/fkserve/handoff_client.h"
#include "agent/fuse/handoff_protocol.h"

namespace fusekeeper {

class AgentLink {
 public:
  // `sock`: the handoff connection the volume was received on; `fuse_dup`: a dup of the
  // connection's /dev/fuse fd; `init`: its FUSE_INIT request ("" if this server never saw it);
  // `socket_path`/`agent_uid`: where and whom to reconnect to.
  AgentLink(UniqueFd sock, UniqueFd fuse_dup, std::string init, std::string socket_path, uid_t agent_uid);
  ~AgentLink();
  // The server relays the connection (HandoffReply::relayed): said again when re-depositing.
  // Before Start().
  void set_relayed(bool relayed) { relayed_ = relayed; }
  // The relay's state memfd (a dup), re-deposited with the connection. Before Start().
  void set_relay_state(UniqueFd state) { relay_state_ = std::move(state); }
  // From the serving thread, after its mode installed its stop handlers, before Start(): `ms` > 0
  // arms the drain gate (drain_gate.h) and drains for at most `ms` once a SIGTERM is held. A gate
  // that cannot be armed is said, and stop signals then act at once.
  void set_drain_ms(int64_t ms);
  // Starts watching (a thread).
  void Start();
  // Sends the final HandoffReply on the current connection and stops watching. Any thread.
  void Report(bool ok, const std::string& error);
  // Tells the agent something without stopping (HandoffReply::notice): it becomes an Event on the
  // volume. Any thread; dropped if there is no connection to the agent right now.
  void Notice(const std::string& text, int64_t restart_ms = -1);

 private:
  void Run();
  // Blocking: connects and re-deposits; returns the new connection, or an invalid fd if it gave up.
  UniqueFd Redeposit();
  // Sends `r` (named) on the current connection, if there is one; a failure is printed (`what`).
  void Send(const HandoffReply& r, const char* what);
  // Starts draining once a SIGTERM is held; releases it when the drain time is up.
  void CheckDrain();
  // The serving thread's stop, once: the held SIGTERM is released.
  void StopServing(const char* why);

  const std::string init_, socket_path_;
  const uid_t agent_uid_;
  bool relayed_ = false;
  int64_t drain_ms_ = 0;
  bool draining_ = false, stop_released_ = false;  // the link thread's
  std::chrono::steady_clock::time_point drain_deadline_;
  UniqueFd fuse_dup_;
  UniqueFd relay_state_;
  std::mutex mu_;
  UniqueFd sock_;  // guarded by mu_
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace fusekeeper
