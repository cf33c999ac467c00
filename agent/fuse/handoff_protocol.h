// The fd handoff protocol between the agent and a FUSE server, version 1.
//
// Transport: a Unix SOCK_SEQPACKET socket the agent listens on. The server connects; the agent
// sends ONE message: the JSON MountConfig below, with the /dev/fuse fd attached as SCM_RIGHTS.
// The server answers with ONE message: the JSON HandoffReply. Message boundaries are kept by the
// socket type, so no framing is needed; each message is at most kMaxHandoffMessageBytes.
//
//   agent → server  {"version":1,"volume_id":"v","read_only":false,"uid":0,"gid":0,
//                    "mount_group":1000,"mount_options":["..."],"volume_context":{"k":"v"},
//                    "secrets":{}}                                  + SCM_RIGHTS [fuse fd]
//   server → agent  {"version":1,"ok":true,"server":"fkserve 0.1.0","init":"<hex>"}
//                or {"version":1,"ok":true,"server":"fkserve 0.1.0","relayed":true}   (fkserve launch)
//                or {"version":1,"ok":false,"error":"what went wrong"}
//                or {"version":1,"ok":false,"fresh":true,"error":"cannot adopt a live connection"}
//
// Restarts (recovery). The agent keeps its own dup of the connection, so a server that dies does
// not take the mount with it: requests wait in the kernel. When a server connects to a volume
// whose connection an earlier server already initialised, the config says "live":true and
// carries "init": the FUSE_INIT request (hex of the bytes read from /dev/fuse) the first server
// reported in its ok reply. A server that can adopt a live connection replays that INIT to its
// FUSE library instead of waiting for one (the kernel sends INIT once per connection), then asks
// the kernel to resend requests the dead server had read but not answered (FUSE_NOTIFY_RESEND,
// Linux 6.9+). Node ids and file handles it did not issue must be resolved or answered with
// ESTALE. A server that cannot adopt answers "fresh":true and keeps the connection open: the
// agent mounts a fresh connection, re-binds every pod target, and sends a new config (live:false)
// with the new fd on the same connection. Servers should report "init" so that their successors
// can adopt.
//
// After an ok reply the server keeps the connection open for as long as it serves. When it stops
// it may send one final HandoffReply (ok:true for a clean stop, ok:false with the reason, e.g. a
// launched program's exit status) and close; a close without a message means the same (e.g. the
// server was killed). The agent learns from this that the volume has no server any more.
//
// Agent restarts (re-deposit). The agent's dup of a connection dies with the agent, so after a
// restart it holds no fd for volumes that are still served. A serving server that sees its
// handoff connection close without being told to stop (the agent went away) reconnects to the
// same socket once the agent listens again, and speaks first: one HandoffReply with
// "redeposit":true (ok:true, and the connection's "init" if it has it) and a dup of its
// /dev/fuse fd attached as SCM_RIGHTS. The agent checks that the fd is /dev/fuse and belongs to
// the volume's mount (/proc/self/fdinfo "fuse_connection", Linux 6.x), keeps it as the kept
// connection, and treats that connection as the serving one (its close means the server is
// gone). It answers nothing on success; a refusal (below) means the fd was not accepted, and the
// server should stop trying. A server that connects to a restarted agent without re-depositing
// (a v1 server, or one that serves nothing yet) simply waits for its config, as before: after a
// short wait the agent treats it as asking for a fresh connection.
//
//   server → agent  {"version":1,"ok":true,"redeposit":true,"server":"...","init":"<hex>"}
//                                                                   + SCM_RIGHTS [fuse fd]
//
// Instead of a config, the agent may send a refusal, {"version":1,"error":"why"} with no fd (e.g.
// the volume is already served by another connection); DecodeMountConfig reports it as
// FAILED_PRECONDITION with the agent's words.
//
// Relay state (fkserve launch, relayed). A relay keeps what the kernel knows of a relayed
// connection (node ids, open handles, writes not yet synced) in a memfd journal so that a
// launcher of its own can outlive it (agent/fkserve/relay/relay_state.h). It deposits that memfd
// with the agent: its ok reply (and its re-deposits, after the fuse fd) says "relay_state":true
// and carries the memfd as the last SCM_RIGHTS fd. The agent keeps it beside the kept connection
// (never reading it) and offers it to the next server of the same connection: a live config with
// "relay_state":true carries it as a second fd after the connection. A server that cannot use it
// closes it. A fresh connection drops it. `fkserve serve` deposits its passthrough table the same
// way (agent/fkserve/backing_table.h): the backing ids a server registered outlive it when it
// deposited one, so that its successor can name them.
//
//   server → agent  {"version":1,"ok":true,"server":"...","relayed":true,"relay_state":true}
//                                                                   + SCM_RIGHTS [state memfd]
//   agent → server  {..., "live":true,"init":"","relay_state":true} + SCM_RIGHTS [fuse fd, state memfd]
//
// Draining (server pods). A config with "drain_ms":N (N > 0) goes to a server the agent runs as a
// pod and can make a successor for. Asked to stop (SIGTERM: its pod deleted, evicted or rolled),
// such a server serves on and says so on its connection; the agent makes the successor, and once
// that one's server waits on standby, asks the draining server to stop; it stops (sending its
// final reply) and the successor takes the live connection over. After N ms it stops anyway.
//
//   server → agent  {"version":1,"ok":true,"draining":true,"server":"..."}
//   agent → server  {"version":1,"stop":true}
//
// A draining server's re-deposit to a restarted agent says "draining":true as well.
//
// Unknown fields are ignored (forward compatible); a different major version is refused. Secrets
// travel only for volumes that ask for them (volume_context "fusekeeper.io/pass-secrets":"true").
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "agent/base/fd_passing.h"  // TakeReceivedFds, for the ring's receives
#include "agent/base/unique_fd.h"

namespace fusekeeper {

inline constexpr int kHandoffProtocolVersion = 1;
inline constexpr size_t kMaxHandoffMessageBytes = 64 * 1024;

struct MountConfig {
  int version = kHandoffProtocolVersion;
  std::string volume_id;
  bool read_only = false;
  uint32_t uid = 0;                    // owner the server presents files as
  uint32_t gid = 0;
  std::optional<uint32_t> mount_group; // the pod's fsGroup (VOLUME_MOUNT_GROUP)
  std::vector<std::string> mount_options;
  std::map<std::string, std::string> volume_context;
  std::map<std::string, std::string> secrets;
  // The connection was initialised by an earlier server; `init` is its FUSE_INIT request.
  bool live = false;
  std::string init;  // raw bytes (hex on the wire)
  // live: a second fd follows the connection: the relay state the previous server deposited.
  bool relay_state = false;
  // > 0: a server pod's server (the agent makes its successor): asked to stop (SIGTERM), it
  // serves on for at most this long, says "draining", and stops when the agent sends a stop
  // request (a successor waits to take over) — pods then wait for no server at all.
  int64_t drain_ms = 0;
};

struct HandoffReply {
  int version = kHandoffProtocolVersion;
  bool ok = false;
  std::string error;   // when !ok
  std::string server;  // free-form name/version of the server
  bool fresh = false;  // !ok: the server cannot adopt a live connection and asks for a fresh one
  std::string init;    // ok: the FUSE_INIT request the server read (raw bytes; hex on the wire)
  bool redeposit = false;  // ok: a serving server hands its connection back to a restarted agent
  // A serving server's report that does not end serving (e.g. mount options a launched program
  // asked for that were not applied): the agent posts it as an Event and keeps watching.
  std::string notice;
  // ok (and redeposit): the server relays the connection for a program it restarts when it dies
  // (fkserve launch): pods see slower answers across such restarts, not errors.
  bool relayed = false;
  // notice: a relayed program was restarted and answered again this long after its start
  // (-1: the notice is not about a restart).
  int64_t restart_ms = -1;
  // ok (and redeposit): the relay's state memfd is attached (the last fd).
  bool relay_state = false;
  // ok, not the end: the server was asked to stop and serves on until the agent's stop request
  // (MountConfig::drain_ms).
  bool draining = false;
};

// FUSE passthrough brokered by the agent (backing_broker.h), on a serving server's connection:
//   server → agent  {"version":1,"backing_open":<id>} with the file's fd attached: register it as
//                   a backing file of this connection;
//                   {"version":1,"backing_close":<backing id>,"id":<id>}: unregister one;
//   agent → server  {"version":1,"backing_reply":<id>,"backing_id":<n>} or
//                   {"version":1,"backing_reply":<id>,"error":"..."} (a close answers backing_id 0).
// Requests are answered in any order; `id` is the server's, to match them.
struct BackingRequest {
  uint64_t id = 0;
  bool open = false;        // else close
  int32_t backing_id = 0;   // close: which
};
struct BackingReply {
  uint64_t id = 0;
  int32_t backing_id = 0;
  std::string error;  // empty: done
};
// The refusals that cannot change for a connection (the agent brokers nothing; the connection's
// first server did not negotiate passthrough): the agent words them so, and a server that gets
// one stops asking (IsFinalBackingRefusal).
inline constexpr char kRefusalNoBroker[] = "this agent brokers no passthrough";
inline constexpr char kRefusalNotNegotiated[] = "the connection did not negotiate passthrough";
bool IsFinalBackingRefusal(absl::string_view error);
std::string EncodeBackingRequest(const BackingRequest& r);
// nullopt: `json` is not a backing request (another message); an error: a malformed one.
absl::StatusOr<std::optional<BackingRequest>> DecodeBackingRequest(absl::string_view json);
std::string EncodeBackingReply(const BackingReply& r);
absl::StatusOr<std::optional<BackingReply>> DecodeBackingReply(absl::string_view json);

// The agent's stop request to a draining server: {"version":1,"stop":true}.
std::string EncodeStopRequest();
bool IsStopRequest(absl::string_view json);

// Hex codec for the "init" fields; DecodeHex fails on odd length or non-hex characters.
std::string EncodeHex(absl::string_view bytes);
absl::StatusOr<std::string> DecodeHex(absl::string_view hex);

std::string EncodeMountConfig(const MountConfig& config);
std::string EncodeHandoffRefusal(absl::string_view error);
// Strict: INVALID_ARGUMENT naming the problem for malformed JSON, wrong types, a missing
// volume_id, another protocol version, or oversize input. Never crashes on any input.
absl::StatusOr<MountConfig> DecodeMountConfig(absl::string_view json);

std::string EncodeHandoffReply(const HandoffReply& reply);
absl::StatusOr<HandoffReply> DecodeHandoffReply(absl::string_view json);


// Whether `fd` is a memfd (what a relay state must be: the agent keeps nothing else).
bool IsMemfd(int fd);

struct ReceivedMessage {
  std::string payload;
  UniqueFd fd;   // invalid if none was attached
  UniqueFd fd2;  // a second fd (the relay state of a live config), invalid if none
};

// Blocking (server side, tests). Sends one message, with `fd` (and `fd2`) attached if >= 0.
absl::Status SendHandoffMessage(int sock, absl::string_view payload, int fd, int fd2 = -1);
// Blocking. Receives one message. The fds (if any) arrive close-on-exec. More than two fds, other
// control data, or a truncated message → INVALID_ARGUMENT (and every received fd is closed).
// Peer closed → UNAVAILABLE.
absl::StatusOr<ReceivedMessage> ReceiveHandoffMessage(int sock);

}  // namespace fusekeeper
