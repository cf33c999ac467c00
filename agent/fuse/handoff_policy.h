// HandoffPolicy: what the handoff endpoint (handoff_endpoint.h) does with each server that
// connects, and how one volume's handoff state moves. No sockets, no ring, no timers: the
// endpoint does the I/O and tells the policy what happened; the policy says where a server goes.
//
// The state, explicitly:
//  - the kept connection: held (fresh, or live once a server served it), awaiting a re-deposit
//    (the agent restarted without it: the serving server may hand it back), or aborted (until
//    the owner mounts a fresh one and replaces it);
//  - whether a server serves it now, has served it since it was (re)made, and has gone;
//  - stopped, for good.
#pragma once

#include <optional>
#include <string>

namespace fusekeeper {

class HandoffPolicy {
 public:
  enum class Kept { kHeld, kAwaitingRedeposit, kAborted };
  // Where a server that connected (its uid checked) goes.
  enum class Route {
    kStandby,  // a server pod's, while another pod's serves: it waits to take over
    kRefuse,   // one serves already
    kAdmit,    // nobody serves: Admission says how
  };
  // What an admitted server gets.
  enum class Admission {
    kAwaitRedeposit,  // the agent restarted: it may be the serving server handing the connection back
    kPark,            // the connection is aborted: it waits for the fresh one
    kOffer,           // it is offered the connection (live if OfferLive())
  };

  // `has_connection`: the endpoint starts with a connection; else an agent restart lost it.
  explicit HandoffPolicy(bool has_connection)
      : kept_(has_connection ? Kept::kHeld : Kept::kAwaitingRedeposit) {}

  // A server arrived on listener `tag` ("": the volume's own socket). `serving_tag`: the serving
  // server's listener, if a server serves.
  Route RouteArrival(const std::string& tag, const std::optional<std::string>& serving_tag) const;
  // A server admitted (nobody serving; or one on standby taking over).
  Admission Admit() const;
  // An offer now hands over a live connection (a server served it since it was made).
  bool OfferLive() const { return served_; }
  // The serving server stopped, or the connection came back: servers on standby may take over.
  bool MayPromoteStandby() const { return !stopped_ && !serving_ && kept_ != Kept::kAwaitingRedeposit; }

  // What happened.
  void Served();       // a server took the volume
  void ServerGone();   // the serving server stopped serving
  void Aborted();      // the kept connection was aborted
  void Replaced();     // a fresh connection replaces the kept one
  void Redeposited();  // a server handed the connection back after an agent restart
  void Stop() { stopped_ = true; }

  Kept kept() const { return kept_; }
  bool stopped() const { return stopped_; }
  bool serving() const { return serving_; }
  bool served() const { return served_; }
  bool server_gone() const { return server_gone_; }
  // No usable connection (aborted, or awaiting a re-deposit).
  bool aborted() const { return kept_ != Kept::kHeld; }
  bool awaiting_redeposit() const { return kept_ == Kept::kAwaitingRedeposit; }

 private:
  Kept kept_;
  bool stopped_ = false;
  bool serving_ = false;
  bool served_ = false;
  bool server_gone_ = false;
};

const char* RouteName(HandoffPolicy::Route r);
const char* AdmissionName(HandoffPolicy::Admission a);

}  // namespace fusekeeper
