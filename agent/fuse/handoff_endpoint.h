// HandoffEndpoint: the agent's side of the fd handoff for one FUSE volume, on the loop's ring.
//
// It owns a listening SOCK_SEQPACKET socket and a dup of the volume's /dev/fuse fd (kept for as
// long as the volume is mounted: the connection stays alive while any fd to it is open, which the
// recovery work builds on). Each connection is accepted on the ring; the peer's uid is checked
// (SO_PEERCRED); the MountConfig and the fd are sent with IORING_OP_SENDMSG; the server's reply is
// read with IORING_OP_RECVMSG under a deadline. Nothing blocks the loop, and many endpoints wait at
// once without affecting each other or any RPC.
//
// While a server serves the volume, further connections get a refusal (no fd). The serving
// server's connection stays open: when it ends (a final message, or a close because the server
// exited or was killed), on_server_gone reports it and the endpoint waits for the next server,
// which is offered the same, still live connection ("live", with the first server's FUSE_INIT
// record; see handoff_protocol.h). A server that cannot adopt it asks for a fresh one: its
// connection is parked and on_fresh_requested fires; the owner mounts a fresh connection and
// calls ReplaceConnection, which offers it to every parked server. The kept fd is also watched
// (POLLERR through the ring): a connection the kernel aborted fires on_connection_aborted, and
// servers arriving until ReplaceConnection are parked. Peers that close early, send garbage, or
// never answer get their connection closed and are reported; the endpoint keeps listening.
#pragma once

#include <sys/types.h>

#include <deque>
#include <memory>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/base/unique_fd.h"
#include "agent/fuse/handoff_io.h"
#include "agent/fuse/handoff_policy.h"
#include "agent/fuse/handoff_protocol.h"
#include "agent/loop/lifetime.h"
#include "agent/loop/loop.h"
#include "agent/loop/timer.h"
#include "agent/fuse/backing_broker.h"

namespace fusekeeper {

struct HandoffOptions {
  // How long a connected server has to answer after receiving the fd.
  absl::Duration reply_timeout = absl::Seconds(10);
  // If set, only this uid may receive the fd (root always may).
  std::optional<uid_t> peer_uid;
  // Started without a connection (the agent restarted): how long a connecting server has to
  // re-deposit the volume's connection (handoff_protocol.h) before it is taken to be waiting for
  // a fresh one; and the connection (the mount's device minor) a re-deposited fd must be on.
  absl::Duration redeposit_wait = absl::Seconds(1);
  std::optional<uint32_t> expected_connection;
  // Started without a connection: a server pod's server (AddListener) with nothing to re-deposit
  // waits this long on standby for another pod's server to re-deposit before it gets a fresh one.
  absl::Duration standby_redeposit_wait = absl::Seconds(10);
  // A server pod's server (AddListener) is told it may drain this long (MountConfig::drain_ms):
  // asked to stop, it serves on until a successor waits on standby. Zero: no draining.
  absl::Duration drain_wait = absl::ZeroDuration();
  // Registers the serving server's passthrough backing files (handoff_backing.cc); null: such
  // requests are refused.
  BackingBroker* broker = nullptr;
  // Per serving server: backing ids held at once, and requests in flight.
  int max_backing_ids = 4096;
  int max_backing_in_flight = 64;
};

class HandoffEndpoint {
 public:
  // Destroying a handle stops the endpoint and retires it: it is freed (from a posted callback)
  // once none of its ring operations or broker answers is pending. From any thread.
  struct Retire {
    void operator()(HandoffEndpoint* endpoint) const;
  };
  using Ptr = std::unique_ptr<HandoffEndpoint, Retire>;

  struct Events {
    // A server accepted the volume (its reply said ok). Loop thread.
    absl::AnyInvocable<void(const HandoffReply& reply, pid_t server_pid)> on_served;
    // A connection failed (peer refused, garbage, timeout, wrong uid...). Loop thread.
    absl::AnyInvocable<void(const absl::Status& why)> on_connection_error;
    // The server that took the volume stopped serving: it sent its final message (`why` holds
    // its words) or its connection closed (it exited or was killed). Loop thread.
    absl::AnyInvocable<void(const absl::Status& why)> on_server_gone;
    // The serving server reports something without stopping (HandoffReply::notice). Loop thread.
    absl::AnyInvocable<void(const HandoffReply& notice)> on_server_notice;
    // The serving server's first passthrough registration that was refused (once per server):
    // its opens of such files are served the ordinary way, slower.
    absl::AnyInvocable<void(const std::string& why)> on_backing_refused;
    // A server cannot adopt the live connection and waits for a fresh one. Loop thread.
    absl::AnyInvocable<void()> on_fresh_requested;
    // The kept connection was aborted (fusectl abort, or the kernel gave up on it). Loop thread.
    absl::AnyInvocable<void()> on_connection_aborted;
    // A server arrived on listener `tag` and waits on standby (AddListener). Loop thread.
    absl::AnyInvocable<void(const std::string& tag)> on_standby;
    // The serving server was asked to stop and serves on until a successor waits (draining).
    // Loop thread.
    absl::AnyInvocable<void()> on_draining;
  };

  // Blocking (BlockingPool): creates the listening socket as `name` inside the directory
  // `dir_fd`. Binding goes through /proc/self/fd/<dir_fd>/<name>, so the directory's own path
  // may be of any length (sun_path holds 108 bytes) and no symlink is followed to reach it. The
  // socket file is made mode 0600 and owned by owner_uid:owner_gid (the server's user).
  // The socket is made under a temporary name first (TempSocketName) and renamed into place;
  // temporary names of `name` that an earlier, killed agent left are removed first. The caller
  // must be the only agent using the directory (the agent holds <state_dir>/agent.lock), so no
  // live process is making one of them.
  static absl::StatusOr<UniqueFd> ListenBlocking(int dir_fd, const std::string& name,
                                                 uid_t owner_uid, gid_t owner_gid);
  // The temporary name ListenBlocking gives socket `name` in process `pid`: ".<name>.<pid>.tmp".
  static std::string TempSocketName(const std::string& name, pid_t pid);
  // Blocking. Removes the socket `name` in `dir_fd` and every temporary name of it (any pid):
  // what tearing a volume down leaves nothing of. Only sockets are removed.
  static void RemoveSocketBlocking(int dir_fd, const std::string& name);
  // Blocking. Removes every temporary socket name (of any socket) in `dir_fd` that a process
  // other than this one made: at start-up, in a directory only this agent makes sockets in,
  // they are what a killed agent left. Returns how many were removed.
  static int RemoveStaleTempSocketsBlocking(int dir_fd);

  // Loop thread. `fuse_fd` is the endpoint's own dup of the connection; invalid: there is none
  // (the agent restarted): a serving server may re-deposit it; other servers that connect are
  // parked and on_fresh_requested fires.
  static Ptr Start(Loop& loop, UniqueFd listen_fd, UniqueFd fuse_fd, MountConfig config, HandoffOptions options,
                   Events events);

  // Loop thread. Stops accepting and closes the listening socket; connections in flight are
  // cancelled. The fuse fd is released (closed) with the endpoint, when its handle is gone and
  // the last in-flight operation has finished.
  void Stop();

  // Loop thread. One more listening socket, named `tag` (a server pod's, in its emptyDir): a
  // server that connects on it while another serves is not refused but waits on standby, and is
  // offered the live connection the moment the serving server stops (a roll: the new pod's
  // server waits, the old pod is deleted, and no request sees an error). Replaces a listener of
  // the same tag.
  void AddListener(UniqueFd listen_fd, const std::string& tag);
  // Loop thread. Closes the listener named `tag` and drops the servers waiting from it.
  void RemoveListener(const std::string& tag);
  // Whether a server that came through listener `tag` serves or waits on standby now.
  bool HasServerFrom(const std::string& tag) const;
  size_t standby() const { return standby_.size(); }

  // Loop thread. A fresh connection (after on_fresh_requested or on_connection_aborted): kept
  // from now on and offered, not live, to parked servers and the next ones to connect.
  void ReplaceConnection(UniqueFd fuse_fd);

  // Loop thread. The agent itself is about to abort the kept connection (a repair replacing a
  // dead one, a handoff timeout): when the abort is seen it is logged as that act, not warned
  // about as news. Until the next ReplaceConnection.
  void ExpectAbort() { abort_expected_ = true; }

  // Some server has taken the volume since the connection was (re)made.
  bool served() const { return policy_.served(); }
  // A server is serving right now.
  bool serving() const { return policy_.serving(); }
  // The kept connection was aborted and not yet replaced.
  bool aborted() const { return policy_.aborted(); }
  // Servers that took the volume over an already live connection.
  int adoptions() const { return adoptions_; }
  // Draining servers asked to stop because a successor waited.
  int relieved() const { return relieved_; }
  // The server that was serving has gone (see Events::on_server_gone).
  bool server_gone() const { return policy_.server_gone(); }
  // Started without a connection and nothing re-deposited or replaced it yet.
  bool awaiting_redeposit() const { return policy_.awaiting_redeposit(); }
  // Connections servers re-deposited after an agent restart.
  int redeposits() const { return redeposits_; }
  int fuse_fd() const { return fuse_fd_.get(); }
  // Ring operations and broker answers pending (ForTest: the endpoint is freed after they end).
  int pending_for_test() const { return pending_.count(); }
  // The relay state a serving launcher deposited (handoff_protocol.h), kept for its successor.
  bool has_relay_state() const { return relay_state_.valid(); }
  int connections_handled() const { return connections_; }
  // Passthrough backing files registered for its servers, and requests refused.
  int64_t backing_opened() const { return backing_opened_; }
  int64_t backing_refused() const { return backing_refused_; }
  // Backing ids registered on the kept connection that this agent knows of.
  size_t backing_files_held() const { return backing_ids_.size(); }

 private:
  struct Connection;
  HandoffEndpoint(Loop& loop, UniqueFd fuse_fd, MountConfig config, HandoffOptions options, Events events);
  ~HandoffEndpoint();
  // Frees `doomed` after the current callback has returned: nothing is destroyed from inside its
  // own callback.
  void ReleaseLater(std::unique_ptr<Connection> doomed);
  // A closed listener whose last accept has come back: freed after the current callback.
  void ListenerEnded(HandoffListener* l);
  void OnAccepted(UniqueFd fd, const std::string& tag);
  // A server whose uid has been checked: on standby (a server pod's, while another pod's serves),
  // refused (while one serves), or admitted.
  void Route(Connection* c);
  // Routes the servers that arrived while the serving one's end was on its way (Route).
  void RouteAwaitingEnd();
  // What to do with a server nobody else serves before: offer, park, or wait for a re-deposit.
  void Admit(Connection* c);
  // A passthrough request of the serving server (handoff_backing.cc): answered on its connection.
  void OnBackingRequest(Connection* c, const BackingRequest& req, std::vector<UniqueFd> fds);
  void ReplyBacking(Connection* c, const BackingReply& reply);
  // Who the server at the other end of c is (its socket's peer credentials), once.
  absl::Status KnowIdentity(Connection* c);
  // A refusal of c's request: counted, logged, answered, and the first one of c reported.
  void RefuseBacking(Connection* c, uint64_t id, const std::string& why);
  // The serving server c stopped: the backing ids registered on the connection are kept for its
  // successor if c deposited a state (fkserve's table of them), else closed (nobody could name
  // them again; open files keep their own reference).
  void ServerLeftBackingIds(Connection* c);
  // Closes every backing id registered on the connection, as `who`.
  void CloseBackingIds(const ServerIdentity& who, const char* why);
  // Keeps c waiting on standby (at most four: the oldest goes).
  void ToStandby(Connection* c);
  // The serving server c says it drains (asked to stop, it serves on): on_draining, and it is
  // asked to stop at once if a successor already waits.
  void MarkDraining(Connection* c);
  // A draining serving server is asked to stop once a server waits on standby to take over.
  void RelieveDrainer();
  // The serving server has gone: the first standby server still connected takes over.
  void PromoteStandby();
  void SendOffer(Connection* c, bool refuse, std::string why);
  void OnSent(Connection* c, int32_t res, const std::string& why);
  // The server's answer to an offer.
  void OnReply(Connection* c, HandoffPeer::Received got);
  // Without a connection: waits briefly for the server to re-deposit one.
  void AwaitRedeposit(Connection* c);
  void OnRedeposit(Connection* c, HandoffPeer::Received got);
  // A server pod's server with nothing to re-deposit, or another server: it waits (standby or
  // parked) for the serving server to re-deposit, or for a fresh connection.
  void NothingRedeposited(Connection* c);
  // Why a re-deposited fd cannot be taken (empty: it can).
  std::string CheckRedeposited(int fd) const;
  void Finish(Connection* c, absl::Status status, std::optional<HandoffReply> reply);
  // Receives the serving server's next message (kept open while it serves, until it ends).
  void WatchServer(Connection* c);
  void OnServerMessage(Connection* c, HandoffPeer::Received got);
  // The serving (or an earlier) server c ended, for `why`.
  void ServerEnded(Connection* c, const absl::Status& why);
  // The kept connection was aborted (the abort watch).
  void OnAborted();
  // Keeps a server's relay state memfd (handoff_protocol.h) for the next server of the connection.
  void KeepRelayState(Connection* c, UniqueFd fd);
  // Removes c from the in-flight list, handing over its ownership.
  std::unique_ptr<Connection> TakeConnection(Connection* c);

  Loop& loop_;
  PendingWork pending_;  // first: every operation of the members below counts in it
  UniqueFd fuse_fd_;
  const MountConfig config_;
  const HandoffOptions options_;
  Events events_;
  AbortWatch abort_watch_;
  std::string init_record_;  // the FUSE_INIT the first server of this connection reported
  // The main listening socket (tag "") and AddListener's; closed ones until their accept ends.
  std::vector<std::unique_ptr<HandoffListener>> listeners_;
  std::deque<std::unique_ptr<Connection>> standby_;  // servers waiting for the serving one to stop
  Timer standby_fallback_;  // a server on standby gets a fresh connection if nobody re-deposits
  UniqueFd relay_state_;     // the relay state memfd its server deposited (never read here)
  std::vector<std::unique_ptr<Connection>> parked_;  // servers waiting for a fresh connection
  std::vector<std::unique_ptr<Connection>> awaiting_end_;  // servers waiting for the serving one's end
  std::vector<std::unique_ptr<Connection>> connections_in_flight_;
  Connection* serving_connection_ = nullptr;  // the current server's (watched) connection
  HandoffPolicy policy_;  // where servers go, and the state that decides it
  bool abort_expected_ = false;
  int adoptions_ = 0;
  int64_t backing_opened_ = 0, backing_refused_ = 0;
  // The backing ids registered on the kept connection, by any of its servers; they outlive a
  // server whose state (a table naming them) the agent keeps. Not complete after a re-deposit:
  // what servers registered before the agent restarted is unknown here. The generation changes
  // with the connection, so a registration that comes back for an earlier one is not counted.
  std::set<int32_t> backing_ids_;
  bool backing_ids_complete_ = true;
  uint64_t connection_generation_ = 0;
  int relieved_ = 0;
  int redeposits_ = 0;
  int connections_ = 0;
};

}  // namespace fusekeeper
