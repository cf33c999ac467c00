#include "agent/fuse/handoff_policy.h"

#include <optional>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

using Route = HandoffPolicy::Route;
using Admission = HandoffPolicy::Admission;

TEST(HandoffPolicyTest, AServerIsOfferedTheConnectionThenOthersAreRefusedAndAPodsServerWaits) {
  HandoffPolicy p(/*has_connection=*/true);
  EXPECT_EQ(p.RouteArrival("", std::nullopt), Route::kAdmit);
  EXPECT_EQ(p.Admit(), Admission::kOffer);
  EXPECT_FALSE(p.OfferLive()) << "a fresh connection";
  p.Served();
  EXPECT_EQ(p.RouteArrival("", std::string("")), Route::kRefuse);
  EXPECT_EQ(p.RouteArrival("pod-b", std::string("pod-a")), Route::kStandby) << "a roll: the new pod's server waits";
  EXPECT_EQ(p.RouteArrival("pod-a", std::string("pod-a")), Route::kRefuse) << "the same pod twice";
  p.ServerGone();
  EXPECT_TRUE(p.MayPromoteStandby());
  EXPECT_EQ(p.Admit(), Admission::kOffer);
  EXPECT_TRUE(p.OfferLive()) << "the next server adopts the live connection";
}

TEST(HandoffPolicyTest, WithoutAConnectionServersAwaitARedepositAndAnAbortParksThemUntilReplaced) {
  HandoffPolicy p(/*has_connection=*/false);
  EXPECT_TRUE(p.awaiting_redeposit());
  EXPECT_TRUE(p.aborted());
  EXPECT_EQ(p.Admit(), Admission::kAwaitRedeposit);
  EXPECT_FALSE(p.MayPromoteStandby()) << "standby servers wait for the re-deposit";
  p.Redeposited();
  p.Served();
  EXPECT_EQ(p.kept(), HandoffPolicy::Kept::kHeld);
  p.Aborted();
  EXPECT_FALSE(p.serving());
  EXPECT_EQ(p.Admit(), Admission::kPark);
  p.Replaced();
  EXPECT_EQ(p.Admit(), Admission::kOffer);
  EXPECT_FALSE(p.OfferLive());
  EXPECT_FALSE(p.server_gone());
}

// The endpoint's flags before the policy, as a model: every random history of events (in the
// orders the endpoint can report them) routes every arrival as they did, and keeps the
// policy's own promises.
struct OldFlags {
  bool stopped = false, served = false, server_gone = false, serving = false, aborted = false, restored = false;
  explicit OldFlags(bool has_connection) : aborted(!has_connection), restored(!has_connection) {}
};

TEST(HandoffPolicyTest, EveryHistoryRoutesAsTheEndpointsFlagsDidAndKeepsItsPromises) {
  std::mt19937 rng(20261127);
  for (int history = 0; history < 2000; ++history) {
    const bool has_connection = rng() % 2 == 0;
    HandoffPolicy p(has_connection);
    OldFlags f(has_connection);
    for (int step = 0; step < 40; ++step) {
      switch (rng() % 6) {
        case 0:  // a server took the volume: only after an admission offered it, or a re-deposit
          if (f.stopped || f.serving || (f.aborted && !f.restored)) break;
          if (f.restored) {
            p.Redeposited();
            f.restored = f.aborted = false;
          }
          p.Served();
          f.served = f.serving = true;
          f.server_gone = false;
          break;
        case 1:
          if (!f.serving || f.stopped) break;
          p.ServerGone();
          f.server_gone = true;
          f.serving = false;
          break;
        case 2:  // the abort watch runs only with a connection
          if (f.restored || f.stopped) break;
          p.Aborted();
          f.aborted = true;
          f.serving = false;
          break;
        case 3:
          if (f.stopped) break;
          p.Replaced();
          f.aborted = f.restored = f.served = f.serving = f.server_gone = false;
          break;
        case 4:
          if (rng() % 8 != 0) break;
          p.Stop();
          f.stopped = true;
          break;
        default:
          break;
      }
      // Routing, as Route and Admit did with the flags.
      const std::string tag = rng() % 2 ? "" : "pod-a";
      const std::optional<std::string> serving_tag =
          f.serving ? std::optional<std::string>(rng() % 2 ? "" : "pod-b") : std::nullopt;
      Route want = Route::kAdmit;
      if (f.serving && !tag.empty() && (!serving_tag || *serving_tag != tag)) {
        want = Route::kStandby;
      } else if (f.serving) {
        want = Route::kRefuse;
      }
      ASSERT_EQ(RouteName(p.RouteArrival(tag, serving_tag)), std::string(RouteName(want))) << "history " << history;
      const Admission admit = f.restored ? Admission::kAwaitRedeposit : f.aborted ? Admission::kPark : Admission::kOffer;
      ASSERT_EQ(AdmissionName(p.Admit()), std::string(AdmissionName(admit))) << "history " << history;
      ASSERT_EQ(p.OfferLive(), f.served);
      ASSERT_EQ(p.serving(), f.serving);
      ASSERT_EQ(p.server_gone(), f.server_gone);
      ASSERT_EQ(p.aborted(), f.aborted);
      ASSERT_EQ(p.awaiting_redeposit(), f.restored);
      ASSERT_EQ(p.MayPromoteStandby(), !f.stopped && !f.serving && !f.restored);
      // Promises: nobody is offered a connection while one serves; a stopped policy stays so.
      if (p.serving()) ASSERT_NE(p.RouteArrival(tag, serving_tag), Route::kAdmit);
      if (f.stopped) ASSERT_TRUE(p.stopped());
    }
  }
}

}  // namespace
}  // namespace fusekeeper
