#include "agent/loop/blocking_pool.h"

#include <pthread.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace fusekeeper {

BlockingPool::BlockingPool(Loop& loop, const BlockingPoolOptions& options)
    : loop_(loop), state_(std::make_shared<State>()) {
  CHECK_GT(options.threads, 0);
  state_->loop = &loop;
  state_->max_queued = options.max_queued;
  state_->min_threads = options.threads;
  state_->max_threads = std::max(options.threads, options.max_threads);
  state_->idle_exit = options.idle_exit;
  threads_.reserve(options.threads);
  std::lock_guard<std::mutex> lock(state_->mu);
  for (int i = 0; i < options.threads; ++i) {
    const int id = state_->next_worker_id++;
    state_->running_reason[id] = "";
    ++state_->workers;
    threads_.emplace_back(&BlockingPool::Worker, state_, id, /*elastic=*/false);
    pthread_setname_np(threads_.back().native_handle(), absl::StrCat("fk-pool-", id).c_str());
  }
}

BlockingPool::~BlockingPool() {
  // Shutdown CHECKs it is off the loop thread; at destruction with no grace it never waits.
  BeginShutdown();
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->closed = true;
  for (size_t i = 0; i < threads_.size(); ++i) {
    if (threads_[i].joinable()) threads_[i].detach();
  }
}

absl::Status BlockingPool::Submit(std::string reason, absl::AnyInvocable<void()> work,
                                  absl::AnyInvocable<void(absl::Status)> done) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.shutting_down) {
      return absl::FailedPreconditionError(
          absl::StrCat("blocking pool is shutting down; not running ", reason));
    }
    if (s.queue.size() >= s.max_queued) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "blocking pool queue full (", s.max_queued, " waiting); not running ", reason));
    }
    s.queue.push_back(Item{std::move(reason), std::move(work), std::move(done)});
    ++s.outstanding;
    // Every worker busy (perhaps hung): an elastic pool starts another one.
    if (s.idle_workers < static_cast<int>(s.queue.size()) && s.workers < s.max_threads) {
      const int id = s.next_worker_id++;
      s.running_reason[id] = "";
      ++s.workers;
      std::thread(&BlockingPool::Worker, state_, id, /*elastic=*/true).detach();
    }
  }
  s.cv.notify_one();
  return absl::OkStatus();
}

void BlockingPool::Worker(std::shared_ptr<State> state, int id, bool elastic) {
  if (elastic) pthread_setname_np(pthread_self(), absl::StrCat("fk-pool-", id).c_str());
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mu);
  auto exit_worker = [&s, id] {
    --s.workers;
    s.running_reason.erase(id);
  };
  while (true) {
    ++s.idle_workers;
    bool have_work;
    if (elastic) {
      have_work = s.cv.wait_for(lock, absl::ToChronoNanoseconds(s.idle_exit),
                                [&s] { return s.shutting_down || !s.queue.empty(); });
    } else {
      s.cv.wait(lock, [&s] { return s.shutting_down || !s.queue.empty(); });
      have_work = true;
    }
    --s.idle_workers;
    // Shutting down with nothing left (cancelled items were taken off the queue), or an extra
    // worker that has been idle long enough.
    if (s.queue.empty() && (s.shutting_down || (!have_work && s.workers > s.min_threads))) {
      return exit_worker();
    }
    if (s.queue.empty()) continue;
    Item item = std::move(s.queue.front());
    s.queue.pop_front();
    s.running_reason[id] = item.reason;
    lock.unlock();
    item.work();
    item.work = nullptr;  // release captures off the loop thread
    lock.lock();
    if (s.closed) return exit_worker();  // abandoned: the loop may be gone
    s.loop->Post([done = std::move(item.done)]() mutable { done(absl::OkStatus()); });
    s.running_reason[id].clear();
    --s.outstanding;
    s.idle_cv.notify_all();
  }
}

void BlockingPool::BeginShutdown() {
  State& s = *state_;
  std::deque<Item> cancelled;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.shutting_down) return;
    s.shutting_down = true;
    cancelled.swap(s.queue);
    s.outstanding -= cancelled.size();
  }
  s.cv.notify_all();
  for (Item& item : cancelled) {
    loop_.Post([reason = std::move(item.reason), done = std::move(item.done)]() mutable {
      done(absl::CancelledError(absl::StrCat(reason, " cancelled: agent shutting down")));
    });
  }
}

int BlockingPool::Shutdown(absl::Duration grace) {
  CHECK(!loop_.IsLoopThread()) << "BlockingPool::Shutdown blocks; call it off the loop thread";
  BeginShutdown();
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.idle_cv.wait_for(lock, absl::ToChronoNanoseconds(grace), [&s] { return s.outstanding == 0; });
  s.closed = true;
  int abandoned = 0;
  for (const auto& [id, reason] : s.running_reason) {
    if (!reason.empty()) {
      LOG(WARNING) << "blocking pool thread " << id << " still running '" << reason
                   << "' at shutdown; abandoning it";
      ++abandoned;
    }
  }
  // The fixed workers have ids 0..threads-1; the busy ones are detached, the rest joined.
  std::vector<std::thread*> to_join;
  for (size_t i = 0; i < threads_.size(); ++i) {
    if (!threads_[i].joinable()) continue;
    auto it = s.running_reason.find(static_cast<int>(i));
    if (it == s.running_reason.end() || it->second.empty()) {
      to_join.push_back(&threads_[i]);
    } else {
      threads_[i].detach();
    }
  }
  lock.unlock();
  for (std::thread* t : to_join) t->join();
  return abandoned;
}

size_t BlockingPool::outstanding() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->outstanding;
}

}  // namespace fusekeeper
