// hiqcache::Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with clang's
// thread-safety annotations (hiqcache/thread_annotations.h), which libstdc++'s types lack.
//
//   mutable Mutex mu_;
//   int count_ GUARDED_BY(mu_) = 0;
//   CondVar changed_;
//   ...
//   MutexLock lock(&mu_);
//   changed_.Wait(&mu_, [this]() REQUIRES(mu_) { return count_ > 0; });
//
// Each is the standard type underneath, with its semantics unchanged: a CondVar waits on the
// Mutex's std::mutex through a std::condition_variable (spurious wake-ups and all; the forms
// with a predicate loop as the standard ones do). A predicate that reads guarded members says
// REQUIRES(mu_): the analysis checks a lambda's body as a function of its own. Thread-safety: a
// Mutex and a CondVar are shared between threads; a MutexLock belongs to one.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "hiqcache/thread_annotations.h"

namespace hiqcache {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Takes the mutex if it is free; true when taken.
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction, as std::unique_lock: Unlock() and Lock() give it
// back and take it again inside the scope; the destructor releases it only if held.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // REQUIRES: held.
  void Unlock() RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  // REQUIRES: not held.
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A std::condition_variable whose waits name the held Mutex.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

  // Gives `mu` back, sleeps until notified (or woken spuriously) and takes `mu` again.
  void Wait(Mutex* mu) REQUIRES(*mu) {
    Adopted lock(mu);
    cv_.wait(lock.lock);
  }
  // As Wait, or until `deadline`: std::cv_status::timeout when it passed.
  template <class Clock, class Duration>
  std::cv_status WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      REQUIRES(*mu) {
    Adopted lock(mu);
    return cv_.wait_until(lock.lock, deadline);
  }
  // Sleeps until `pred()` holds (tested first, with `mu` held).
  template <class Predicate>
  void Wait(Mutex* mu, Predicate pred) REQUIRES(*mu) NO_THREAD_SAFETY_ANALYSIS {
    // Not analysed: the predicate's REQUIRES names the caller's mutex, which is `*mu`.
    Adopted lock(mu);
    cv_.wait(lock.lock, std::move(pred));
  }
  // Sleeps until `pred()` holds or `timeout` passed; returns `pred()` as last tested.
  template <class Rep, class Period, class Predicate>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout, Predicate pred)
      REQUIRES(*mu) NO_THREAD_SAFETY_ANALYSIS {
    // Not analysed: as Wait with a predicate.
    Adopted lock(mu);
    return cv_.wait_for(lock.lock, timeout, std::move(pred));
  }

 private:
  // The caller's hold of `mu` as a std::unique_lock for the wait; the hold stays the caller's.
  struct Adopted {
    explicit Adopted(Mutex* mu) : lock(mu->mu_, std::adopt_lock) {}
    ~Adopted() { lock.release(); }
    std::unique_lock<std::mutex> lock;
  };

  std::condition_variable cv_;
};

}  // namespace hiqcache
