// PoolSlots: the client library's own mapping of one registered pool's ticket slots (docs/design.md
// "Completion: ticket slots"), with what it needs to release the engine when the daemon dies:
// the highest ticket the daemon answered for the pool and the slots the daemon stores tickets
// into (done_event, layer_event_base + l of the requests sent).
//
// The mapping is of the object the pool's EventPoolSpec names (its host_fd, else its
// host_shm_name opened with the caller's rights), so it shares its pages with the engine's
// HostEventPool or CudaTicketSlots and with the daemon's mapping; it stays valid while this object
// lives, whatever the engine does with its own handle.
//
// Slots the engine writes (wait_event) are never released: a failed value there would satisfy a
// later wait_value before the engine stores it (a wait compares the ticket part only), so a
// restarted daemon could touch rows before they are ready. Nobody waits on them but the daemon.
//
// Thread-safety: every method may be called from any thread (atomic accesses).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

namespace hiqcache::client_internal {

class PoolSlots {
 public:
  // Maps the `events.count` slots `events` names (host_fd, else host_shm_name). Null (no slots)
  // when count is 0 or the spec names no host object; FAILED_PRECONDITION when the object is
  // smaller than count slots; INTERNAL when it cannot be opened or mapped.
  static StatusOr<std::shared_ptr<PoolSlots>> Map(const EventPoolSpec& events);

  ~PoolSlots();
  PoolSlots(const PoolSlots&) = delete;
  PoolSlots& operator=(const PoolSlots&) = delete;

  uint32_t count() const { return count_; }

  // Marks the slots a request names for the daemon to store its ticket into: `done_event` and
  // `layers` slots from `layer_event_base` (negative = none; out of range is ignored). Called
  // before the request is sent, so that a reply followed by the daemon's death is covered.
  void NoteDaemonSlots(int32_t done_event, int32_t layer_event_base, uint32_t layers);
  // Raises the highest ticket the daemon answered to `ticket` (never lowers it).
  void NoteTicket(uint64_t ticket);
  uint64_t highest() const { return highest_.load(std::memory_order_acquire); }

  // Stores `ticket | kEventFailedBit` into every slot marked by NoteDaemonSlots whose ticket part
  // (bits 0..62) is below `ticket`, each with a compare-and-swap in release order, so that no slot
  // is ever lowered. Nothing once Forget was called. Returns how many slots were written.
  // Nothing either when the object shrank below its slots.
  uint32_t FailBelow(uint64_t ticket) const;
  // Zeroes every slot (release stores); nothing when the object shrank below its slots.
  void Reset() const;
  // Whether the object still holds every slot (fstat of the kept descriptor; an object sealed
  // against shrinking always does).
  bool Intact() const;

  // The pool was released: FailBelow writes nothing from now on.
  void Forget() { forgotten_.store(true, std::memory_order_release); }
  bool forgotten() const { return forgotten_.load(std::memory_order_acquire); }

 private:
  PoolSlots(int fd, bool sealed, void* data, size_t bytes, uint32_t count);
  std::atomic_ref<uint64_t> Slot(uint32_t i) const;

  const int fd_;       // owned: a duplicate of host_fd, or the object opened by name
  const bool sealed_;  // F_SEAL_SHRINK was set when mapped
  void* const data_;
  const size_t bytes_;
  const uint32_t count_;
  std::vector<std::atomic<uint64_t>> daemon_slots_;  // bit i % 64 of word i / 64: slot i
  std::atomic<uint64_t> highest_{0};
  std::atomic<bool> forgotten_{false};
};

}  // namespace hiqcache::client_internal
