#include "backends/ticket_slots.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "backends/host_backend.h"
#include "core/requests.h"
#include "hiqcache/log.h"

namespace hiqcache::server {

TicketSlots::TicketSlots() = default;

TicketSlots::TicketSlots(std::unique_ptr<ShmMapping> mapping, uint32_t count)
    : mapping_(std::move(mapping)), count_(mapping_ ? count : 0) {
  uint32_t reset = 0;
  // Only the slots in ranges that hold data: a hole reads as 0 (no ticket), and reading it would
  // allocate a page on the daemon's account for memory the client never wrote.
  static const std::vector<std::pair<uint64_t, uint64_t>> kNone;
  for (const auto& [begin, end] : mapping_ ? mapping_->data_ranges() : kNone) {
    for (uint64_t i = begin / 64; i < count_ && 64 * i < end; ++i) {
      std::atomic_ref<uint64_t> s(*slot(static_cast<uint32_t>(i)));
      uint64_t v = s.load(std::memory_order_acquire);
      while ((v & ~kTicketFailedBit) >= kTicketLimit &&
             !s.compare_exchange_weak(v, 0, std::memory_order_release, std::memory_order_acquire)) {
      }
      if ((v & ~kTicketFailedBit) >= kTicketLimit) {
        ++reset;
        continue;
      }
      floor_ = std::max(floor_, v & ~kTicketFailedBit);
    }
  }
  if (reset > 0) {
    HIQ_LOG(INFO) << "event=ticket_slots_reset slots=" << reset
                  << " (their ticket was at or above 2^62: tickets start above " << floor_ << ")";
  }
}

TicketSlots::~TicketSlots() = default;

StatusOr<std::unique_ptr<TicketSlots>> TicketSlots::Open(const EventsSpec& events,
                                                         const ClientObjectRules& rules) {
  if (events.count == 0) return std::make_unique<TicketSlots>();
  const uint64_t bytes = 64ull * events.count;
  std::unique_ptr<ShmMapping> m;
  if (events.host_fd_id != 0) {
    if (events.fd < 0) {
      return InvalidArgument("events.host_fd_id: " + std::to_string(events.host_fd_id) +
                             " names no fd passed on this caller's session");
    }
    HIQ_ASSIGN_OR_RETURN(m, ShmMapping::FromFd(events.fd, bytes, "events.host_fd_id", rules,
                                               ShmMapping::Holds::kEventSlots));
  } else {
    HIQ_ASSIGN_OR_RETURN(m, ShmMapping::Open(events.host_shm_name, bytes, "events.host_shm_name",
                                             rules, ShmMapping::Holds::kEventSlots));
  }
  return std::make_unique<TicketSlots>(std::move(m), events.count);
}

uint8_t* TicketSlots::data() const { return mapping_ ? mapping_->data() : nullptr; }

uint64_t* TicketSlots::slot(uint32_t i) const {
  return reinterpret_cast<uint64_t*>(mapping_->data() + 64ull * i);
}

void TicketSlots::Store(int32_t event, uint64_t ticket, bool failed) const {
  if (event < 0 || static_cast<uint32_t>(event) >= count_ || !mapping_) return;
  std::atomic_ref<uint64_t> s(*slot(static_cast<uint32_t>(event)));
  const uint64_t value = ticket | (failed ? kTicketFailedBit : 0);
  uint64_t cur = s.load(std::memory_order_relaxed);
  while (
      (cur & ~kTicketFailedBit) < ticket &&
      !s.compare_exchange_weak(cur, value, std::memory_order_release, std::memory_order_relaxed)) {
  }
}

std::optional<Status> TicketSlots::CheckWait(int32_t event, uint64_t value,
                                             std::chrono::steady_clock::time_point first_try,
                                             std::chrono::milliseconds timeout,
                                             bool cancelled) const {
  if (event < 0) return Status::Ok();
  if (value == 0) value = 1;
  if (static_cast<uint32_t>(event) < count_ && mapping_) {
    std::atomic_ref<uint64_t> s(*slot(static_cast<uint32_t>(event)));
    if ((s.load(std::memory_order_acquire) & ~kTicketFailedBit) >= value) return Status::Ok();
  }
  if (cancelled) {
    return Status(StatusCode::kCancelled,
                  "wait_event " + std::to_string(event) + ": pool released");
  }
  if (std::chrono::steady_clock::now() - first_try > timeout) {
    return DeadlineExceeded("wait_event " + std::to_string(event) + " did not reach " +
                            std::to_string(value) + " within " + std::to_string(timeout.count()) +
                            " ms");
  }
  return std::nullopt;
}

bool TicketSlots::broken() const { return mapping_ != nullptr && mapping_->broken(); }

bool TicketSlots::hugetlb() const { return mapping_ != nullptr && mapping_->hugetlb(); }

void TicketSlots::Close() { mapping_.reset(); }

Status CheckCallerDeadline(CallerDeadline deadline, uint64_t ticket) {
  if (deadline == CallerDeadline::max() || std::chrono::steady_clock::now() < deadline) {
    return Status::Ok();
  }
  return DeadlineExceeded("ticket " + std::to_string(ticket) +
                          ": the caller's deadline passed before the work started; nothing of "
                          "its memory was read or written");
}

}  // namespace hiqcache::server
