#include "agent/volume/claim_queue.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

ClaimQueue::Claim& ClaimQueue::Claim::operator=(Claim&& other) noexcept {
  if (this == &other) return *this;
  Release();
  state_ = std::move(other.state_);
  volume_id_ = std::move(other.volume_id_);
  target_ = std::move(other.target_);
  held_ = std::exchange(other.held_, false);
  return *this;
}

void ClaimQueue::Claim::Release() {
  if (!std::exchange(held_, false)) return;
  if (auto state = state_.lock()) state->Release(state, volume_id_, target_);
  state_.reset();
}

ClaimQueue::ClaimQueue(Loop& loop, Options options) : state_(std::make_shared<State>()) {
  state_->loop = &loop;
  state_->options = options;
}

ClaimQueue::~ClaimQueue() {
  for (auto& [id, queue] : state_->waiters) {
    for (auto& w : queue) w->timer.Cancel();
  }
}

bool ClaimQueue::State::Free(const std::string& volume_id, const std::string& target) const {
  auto it = held.find(volume_id);
  if (it == held.end()) return true;
  if (it->second.whole) return false;
  return !target.empty() && it->second.targets.count(target) == 0;
}

bool ClaimQueue::State::ConflictWaits(const std::string& volume_id, const std::string& target) const {
  auto it = waiters.find(volume_id);
  if (it == waiters.end()) return false;
  for (const auto& w : it->second) {
    if (w->target.empty() || target.empty() || w->target == target) return true;
  }
  return false;
}

ClaimQueue::Claim ClaimQueue::State::Take(const std::shared_ptr<State>& self, const std::string& volume_id,
                                          const std::string& target) {
  Claims& c = held[volume_id];
  if (target.empty()) {
    c.whole = true;
  } else {
    c.targets.insert(target);
  }
  Claim claim;
  claim.state_ = self;
  claim.volume_id_ = volume_id;
  claim.target_ = target;
  claim.held_ = true;
  return claim;
}

void ClaimQueue::State::Release(const std::shared_ptr<State>& self, const std::string& volume_id,
                                const std::string& target) {
  auto c = held.find(volume_id);
  if (c != held.end()) {
    if (target.empty()) {
      c->second.whole = false;
    } else {
      c->second.targets.erase(target);
    }
    if (!c->second.whole && c->second.targets.empty()) held.erase(c);
  }
  GrantWaiting(self, volume_id);
}

void ClaimQueue::State::GrantWaiting(const std::shared_ptr<State>& self, const std::string& volume_id) {
  auto it = waiters.find(volume_id);
  if (it == waiters.end()) return;
  // The claims are taken now, so nobody can slip in before the waiters run; they run after the
  // current callback (whoever released the claim finishes first).
  std::vector<std::pair<std::shared_ptr<Waiter>, std::shared_ptr<Claim>>> granted;
  auto& queue = it->second;
  while (!queue.empty() && Free(volume_id, queue.front()->target)) {
    std::shared_ptr<Waiter> next = std::move(queue.front());
    queue.pop_front();
    next->timer.Cancel();
    auto claim = std::make_shared<Claim>(Take(self, volume_id, next->target));
    granted.emplace_back(std::move(next), std::move(claim));
  }
  if (queue.empty()) waiters.erase(it);
  // Posted only once the queue is consistent: a Post that fails (the loop is stopping) drops its
  // callback, and the claim in it is released right here, re-entering this function.
  for (auto& [next, claim] : granted) {
    if (!loop->Post([next = next, claim = claim]() mutable { next->granted(std::move(*claim)); })) {
      claim.reset();
      next->refused(absl::UnavailableError("fusekeeper is shutting down"));
    }
  }
}

ClaimQueue::Claim ClaimQueue::TryAcquire(const std::string& volume_id, const std::string& target) {
  if (!state_->Free(volume_id, target) || state_->ConflictWaits(volume_id, target)) return Claim();
  return state_->Take(state_, volume_id, target);
}

void ClaimQueue::Acquire(const std::string& volume_id, const std::string& target, Granted granted,
                         Refused refused) {
  if (Claim now = TryAcquire(volume_id, target)) return granted(std::move(now));
  auto& queue = state_->waiters[volume_id];
  if (static_cast<int>(queue.size()) >= state_->options.max_queued_per_volume) {
    const size_t n = queue.size();
    return refused(absl::ResourceExhaustedError(
        absl::StrCat(n, " RPCs already wait for volume ", volume_id, "; retry later")));
  }
  auto w = std::make_shared<Waiter>(*state_->loop);
  w->target = target;
  w->granted = std::move(granted);
  w->refused = std::move(refused);
  w->since = absl::Now();
  std::weak_ptr<State> weak = state_;
  w->timer.Arm(
      absl::ToChronoNanoseconds(state_->options.max_wait), [weak, volume_id, raw = w.get()] {
        auto state = weak.lock();
        if (!state) return;
        auto it = state->waiters.find(volume_id);
        if (it == state->waiters.end()) return;
        auto& q = it->second;
        for (auto i = q.begin(); i != q.end(); ++i) {
          if (i->get() != raw) continue;
          std::shared_ptr<Waiter> gone = std::move(*i);
          q.erase(i);
          if (q.empty()) state->waiters.erase(it);
          // Waiters behind it that waited only because it was ahead may go now.
          state->GrantWaiting(state, volume_id);
          gone->refused(absl::AbortedError(absl::StrCat(
              "waited ", absl::FormatDuration(absl::Trunc(absl::Now() - gone->since, absl::Milliseconds(1))),
              " for an operation on volume ", volume_id, " (an RPC or a repair) that has not finished; retry")));
          return;
        }
      });
  queue.push_back(std::move(w));
}

bool ClaimQueue::Busy(const std::string& volume_id) const { return state_->held.count(volume_id) > 0; }

size_t ClaimQueue::waiting(const std::string& volume_id) const {
  auto it = state_->waiters.find(volume_id);
  return it == state_->waiters.end() ? 0 : it->second.size();
}

}  // namespace fusekeeper
