// ClaimQueue on a real loop: exclusion, FIFO, bounds, and the invariant that a volume's queue
// never stands still while nothing holds a claim on it, under random mixes of outcomes (a
// waiter whose turn comes may be refused at once, finish later, or a repair may try in between).
#include "agent/volume/claim_queue.h"

#include <future>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/loop_thread.h"

namespace fusekeeper {
namespace {

bool Conflict(const std::string& a, const std::string& b) { return a.empty() || b.empty() || a == b; }

TEST(ClaimQueueTest, AWaiterThatDropsItsClaimAtOncePassesTheTurnOn) {
  LoopThread lt;
  std::unique_ptr<ClaimQueue> q;
  std::promise<void> third_ran;
  ClaimQueue::Claim first;
  lt.RunOnLoop([&] {
    q = std::make_unique<ClaimQueue>(lt.loop(), ClaimQueue::Options{});
    first = q->TryAcquire("v", "a");
    ASSERT_TRUE(first);
    // A whole-volume waiter that will be refused when its turn comes (it drops the claim).
    q->Acquire("v", "", [](ClaimQueue::Claim) {}, [](absl::Status s) { ADD_FAILURE() << s; });
    // A target waiter behind it.
    q->Acquire("v", "b", [&](ClaimQueue::Claim) { third_ran.set_value(); },
               [](absl::Status s) { ADD_FAILURE() << s; });
    EXPECT_EQ(q->waiting("v"), 2u);
    first.Release();
  });
  ASSERT_EQ(third_ran.get_future().wait_for(kTestDeadline), std::future_status::ready);
  lt.RunOnLoop([&] {
    EXPECT_FALSE(q->Busy("v"));
    EXPECT_EQ(q->waiting("v"), 0u);
    q.reset();
  });
}

// A waiter that gives up (max_wait) lets those behind it that waited only for it go ahead.
TEST(ClaimQueueTest, AWaiterThatTimesOutLetsThoseBehindItGo) {
  LoopThread lt;
  std::unique_ptr<ClaimQueue> q;
  ClaimQueue::Claim held;
  std::promise<absl::Status> whole_refused;
  std::promise<void> other_target_ran;
  lt.RunOnLoop([&] {
    q = std::make_unique<ClaimQueue>(lt.loop(), ClaimQueue::Options{.max_wait = absl::Milliseconds(50)});
    held = q->TryAcquire("v", "a");  // held throughout
    q->Acquire("v", "", [](ClaimQueue::Claim) { ADD_FAILURE() << "granted while a is held"; },
               [&](absl::Status s) { whole_refused.set_value(s); });
    q->Acquire("v", "b", [&](ClaimQueue::Claim) { other_target_ran.set_value(); },
               [](absl::Status s) { ADD_FAILURE() << s; });
  });
  auto refused = whole_refused.get_future();
  ASSERT_EQ(refused.wait_for(kTestDeadline), std::future_status::ready);
  absl::Status s = refused.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("operation on volume v"), std::string::npos) << s;
  ASSERT_EQ(other_target_ran.get_future().wait_for(kTestDeadline), std::future_status::ready)
      << "b waited only because the whole-volume waiter was ahead of it";
  lt.RunOnLoop([&] {
    held.Release();
    q.reset();
  });
}

TEST(ClaimQueueTest, ClaimsOutlivingTheQueueEndQuietly) {
  LoopThread lt;
  lt.RunOnLoop([&] {
    auto q = std::make_unique<ClaimQueue>(lt.loop(), ClaimQueue::Options{});
    ClaimQueue::Claim c = q->TryAcquire("v", "");
    ASSERT_TRUE(c);
    q->Acquire("v", "", [](ClaimQueue::Claim) { ADD_FAILURE() << "granted after the queue is gone"; },
               [](absl::Status) {});
    q.reset();
    c.Release();  // no grant, no crash
    EXPECT_FALSE(c);
  });
  lt.RunOnLoop([] {});
}

// The property test. Each step is one loop callback; grants are posted by the queue and so run
// between steps, as they do in the agent.
class RandomMix {
 public:
  RandomMix(Loop& loop, uint32_t seed, ClaimQueue::Options options)
      : loop_(loop), rng_(seed), q_(loop, options) {}

  // Loop thread. Runs `steps` random steps, then releases everything and waits for the queue
  // to drain; `done` gets the first violation found ("" if none).
  void Run(int steps, std::function<void(std::string)> done) {
    steps_left_ = steps;
    done_ = std::move(done);
    loop_.Post([this] { Step(); });
  }

  int granted() const { return granted_; }
  int refused_full() const { return refused_full_; }
  int dropped_at_once() const { return dropped_at_once_; }
  int repairs() const { return repairs_; }

 private:
  struct Request {
    int seq;
    std::string volume, target;
    enum { kWaiting, kHeld, kDone } state = kWaiting;
  };
  struct Held {
    int seq;  // -1: a repair's TryAcquire
    std::string volume, target;
    ClaimQueue::Claim claim;
  };

  void Fail(const std::string& why) {
    if (failure_.empty()) failure_ = why;
  }

  // Mutual exclusion, checked against the claims the test holds.
  void CheckExclusive(const std::string& volume, const std::string& target, int seq) {
    for (const auto& h : held_) {
      if (h.volume == volume && Conflict(h.target, target)) {
        Fail("request " + std::to_string(seq) + " (" + volume + "/" + target + ") granted while " +
             std::to_string(h.seq) + " (" + h.volume + "/" + h.target + ") holds a conflicting claim");
      }
    }
  }

  void Granted(int seq, ClaimQueue::Claim claim) {
    Request& r = requests_[seq];
    if (r.state != Request::kWaiting) Fail("request " + std::to_string(seq) + " granted twice");
    CheckExclusive(r.volume, r.target, seq);
    for (const auto& [other_seq, other] : requests_) {
      if (other_seq < seq && other.state == Request::kWaiting && other.volume == r.volume &&
          Conflict(other.target, r.target)) {
        Fail("request " + std::to_string(seq) + " overtook the earlier conflicting " + std::to_string(other_seq));
      }
    }
    ++granted_;
    if (std::bernoulli_distribution(0.4)(rng_)) {
      // Refused when its turn came (an unstage of a published volume, a bad path...): the claim
      // is dropped right here.
      r.state = Request::kDone;
      ++dropped_at_once_;
      return;
    }
    r.state = Request::kHeld;
    held_.push_back(Held{seq, r.volume, r.target, std::move(claim)});
  }

  void CheckNoWedge() {
    for (const std::string v : {"a", "b"}) {
      if (q_.waiting(v) > 0 && !q_.Busy(v)) Fail("volume " + v + " has waiters but nobody holds a claim on it");
    }
  }

  void ReleaseOne(size_t i) {
    if (held_[i].seq >= 0) requests_[held_[i].seq].state = Request::kDone;
    held_[i].claim.Release();
    held_.erase(held_.begin() + static_cast<long>(i));
  }

  void Step() {
    CheckNoWedge();
    if (steps_left_-- > 0) {
      const int action = std::uniform_int_distribution<int>(0, 9)(rng_);
      static const char* kVolumes[] = {"a", "b"};
      static const char* kTargets[] = {"", "t1", "t2", "t3"};
      const std::string volume = kVolumes[std::uniform_int_distribution<int>(0, 1)(rng_)];
      if (action < 5) {  // an RPC
        const std::string target = kTargets[std::uniform_int_distribution<int>(0, 3)(rng_)];
        const int seq = next_seq_++;
        requests_[seq] = Request{seq, volume, target};
        q_.Acquire(
            volume, target, [this, seq](ClaimQueue::Claim c) { Granted(seq, std::move(c)); },
            [this, seq](absl::Status s) {
              if (s.code() != absl::StatusCode::kResourceExhausted) Fail("refused: " + s.ToString());
              requests_[seq].state = Request::kDone;
              ++refused_full_;
            });
      } else if (action < 9) {  // an operation finishes
        if (!held_.empty()) ReleaseOne(std::uniform_int_distribution<size_t>(0, held_.size() - 1)(rng_));
      } else {  // a repair tries its luck
        ClaimQueue::Claim c = q_.TryAcquire(volume, "");
        if (c) {
          CheckExclusive(volume, "", -1);
          ++repairs_;
          held_.push_back(Held{-1, volume, "", std::move(c)});
        }
      }
      loop_.Post([this] { Step(); });
      return;
    }
    // Drain: finish whatever holds a claim, until nothing waits.
    if (!held_.empty()) {
      ReleaseOne(0);
      loop_.Post([this] { Step(); });
      return;
    }
    bool pending = false;
    for (const auto& [seq, r] : requests_) pending = pending || r.state != Request::kDone;
    if (pending) {
      if (++idle_drain_steps_ > 1000) {
        Fail("requests never granted although nothing holds a claim");
      } else {
        loop_.Post([this] { Step(); });
        return;
      }
    }
    done_(failure_);
  }

  Loop& loop_;
  std::mt19937 rng_;
  ClaimQueue q_;
  std::map<int, Request> requests_;
  std::vector<Held> held_;
  int next_seq_ = 0, steps_left_ = 0, idle_drain_steps_ = 0;
  int granted_ = 0, refused_full_ = 0, dropped_at_once_ = 0, repairs_ = 0;
  std::string failure_;
  std::function<void(std::string)> done_;
};

TEST(ClaimQueueTest, RandomMixesOfOutcomesKeepExclusionOrderAndProgress) {
  LoopThread lt;
  int total_granted = 0, total_full = 0, total_dropped = 0, total_repairs = 0;
  for (uint32_t seed = 1; seed <= 24; ++seed) {
    std::unique_ptr<RandomMix> mix;
    std::promise<std::string> result;
    // A short queue now and then, so that RESOURCE_EXHAUSTED is part of the mix.
    const ClaimQueue::Options options{.max_queued_per_volume = seed % 4 == 0 ? 3 : 256,
                                      .max_wait = absl::Seconds(600)};
    lt.RunOnLoop([&] {
      mix = std::make_unique<RandomMix>(lt.loop(), seed, options);
      mix->Run(3000, [&](std::string failure) { result.set_value(std::move(failure)); });
    });
    auto f = result.get_future();
    ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready) << "seed " << seed;
    EXPECT_EQ(f.get(), "") << "seed " << seed;
    lt.RunOnLoop([&] {
      total_granted += mix->granted();
      total_full += mix->refused_full();
      total_dropped += mix->dropped_at_once();
      total_repairs += mix->repairs();
      mix.reset();
    });
  }
  // The mix did exercise every outcome.
  EXPECT_GT(total_granted, 1000);
  EXPECT_GT(total_dropped, 100);
  EXPECT_GT(total_full, 0);
  EXPECT_GT(total_repairs, 0);
}

}  // namespace
}  // namespace fusekeeper
