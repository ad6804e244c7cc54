// TicketSlots: an engine's completion slots as both device backends use them (docs/design.md
// "Completion: ticket slots"). Slot i is a little-endian uint64 at byte 64*i of a client's
// shared-memory object, mapped here read-write under the SIGBUS guard (ShmMapping). Bits 0..62
// hold a ticket, bit 63 (kTicketFailedBit) says that work failed and wrote nothing usable. A
// slot never moves backwards: stores compare its ticket part first.
//
// The daemon stores tickets here (HOST: from its CPU threads; CUDA: its streams store them with
// cuStreamWriteValue64 into the page-locked mapping, and the host stores the failed values the
// device cannot) and reads the engine's wait values from here, always from the host, so that no
// daemon stream ever waits on memory an engine controls.
//
// Thread-safety: const methods and Store may be called from any thread (atomic accesses to the
// shared slots); Close only once no task of the pool can run.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "core/requests.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

class ShmMapping;
struct ClientObjectRules;
struct EventsSpec;

// Bit 63 of a slot: the work of the ticket in bits 0..62 failed and wrote nothing (e.g. its
// wait never came). Waiters are released, but must not use the rows.
constexpr uint64_t kTicketFailedBit = 1ull << 63;
// Slot values whose ticket part reaches this are reset at registration: no daemon issues such
// tickets (one per request, from 1), and continuing from one would run tickets into bit 63.
constexpr uint64_t kTicketLimit = 1ull << 62;

class TicketSlots {
 public:
  // No slots.
  TicketSlots();
  // Adopts `count` slots of `mapping` (at least 64 * count bytes): resets slots whose ticket
  // part is at or above kTicketLimit and takes the largest other ticket as floor().
  TicketSlots(std::unique_ptr<ShmMapping> mapping, uint32_t count);
  ~TicketSlots();
  TicketSlots(const TicketSlots&) = delete;
  TicketSlots& operator=(const TicketSlots&) = delete;

  // Maps the slots an EventsSpec names: its fd (host_fd_id) or its shm name, `count` slots.
  // No slots when events.count is 0. Errors name the field.
  static StatusOr<std::unique_ptr<TicketSlots>> Open(const EventsSpec& events,
                                                     const ClientObjectRules& rules);

  // Fixed for the binding's life (requests racing a release validate against it).
  uint32_t count() const { return count_; }
  // The largest ticket the slots held at adoption: a pool's tickets start above it.
  uint64_t floor() const { return floor_; }
  // The first slot's address (slot i at +64*i) and the mapped bytes; null once closed.
  uint8_t* data() const;
  uint64_t bytes() const { return 64ull * count_; }
  // REQUIRES: open, i < count().
  uint64_t* slot(uint32_t i) const;

  // Stores `ticket` (with the failed bit when `failed`) into slot `event` unless it already
  // holds that ticket or a later one. event < 0 or out of range: nothing.
  void Store(int32_t event, uint64_t ticket, bool failed) const;

  // Where a wait stands, without blocking: OK once slot `event` holds >= value (0 means 1; an
  // event < 0 is no wait); CANCELLED once `cancelled`; DEADLINE_EXCEEDED once `timeout` has
  // passed since first_try; nullopt while still waiting.
  std::optional<Status> CheckWait(int32_t event, uint64_t value,
                                  std::chrono::steady_clock::time_point first_try,
                                  std::chrono::milliseconds timeout, bool cancelled) const;

  // A SIGBUS replaced the mapping with zero pages: the client's object shrank.
  bool broken() const;
  // The slots lie in a hugetlbfs object (ShmMapping::hugetlb): every page of it is allocated.
  bool hugetlb() const;
  // The slots' mapping; null when there are no slots or once closed.
  const ShmMapping* mapping() const { return mapping_.get(); }
  void Close();

 private:
  std::unique_ptr<ShmMapping> mapping_;
  uint32_t count_ = 0;
  uint64_t floor_ = 0;
};

// DEADLINE_EXCEEDED when the caller's deadline passed before the work started (nothing of the
// engine's memory is touched then), else OK.
Status CheckCallerDeadline(CallerDeadline deadline, uint64_t ticket);

}  // namespace hiqcache::server
