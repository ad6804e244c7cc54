#include "transfer_engine.h"

namespace hiqcache::server {

TransferEngine::TransferEngine(unsigned workers) {
  if (workers == 0) workers = 1;
  for (unsigned i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

TransferEngine::~TransferEngine() {
  WaitIdle();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  ready_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<TransferEngine::Strand> TransferEngine::NewStrand() {
  return std::make_shared<Strand>();
}

void TransferEngine::Post(const std::shared_ptr<Strand>& strand, Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    strand->tasks.push_back(std::move(task));
    ++pending_;
    if (strand->scheduled) return;
    strand->scheduled = true;
    ready_.push_back(strand);
  }
  ready_cv_.notify_one();
}

void TransferEngine::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ready_cv_.wait(lock, [&] { return stop_ || !ready_.empty(); });
    if (ready_.empty()) return;  // stop_ and nothing left
    std::shared_ptr<Strand> strand = std::move(ready_.front());
    ready_.pop_front();
    Task task = std::move(strand->tasks.front());
    strand->tasks.pop_front();
    lock.unlock();
    task();
    task = nullptr;
    lock.lock();
    --pending_;
    if (!strand->tasks.empty()) {
      ready_.push_back(std::move(strand));
      ready_cv_.notify_one();
    } else {
      strand->scheduled = false;
    }
    if (pending_ == 0) idle_cv_.notify_all();
  }
}

void TransferEngine::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return pending_ == 0; });
}

size_t TransferEngine::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

}  // namespace hiqcache::server
