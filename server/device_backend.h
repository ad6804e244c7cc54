// DeviceBackend: where an engine's KV buffers and completion events live (HOST shared memory or
// CUDA device memory), and how codec work on them is executed and signalled.
//
// Bind() opens the buffers and events of a validated registration and resolves its views into
// kernels::LayerViews; the returned PoolBinding executes backup and restore tasks. Implementations:
// HostBackend (POSIX shm buffers, shm counter events, CPU codec) and, when built with CUDA, the
// CUDA backend. Thread-safety: Bind may be called concurrently; a PoolBinding's Run* calls are
// issued one at a time (the transfer engine serializes each pool's work), Signal from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hiqcache/status.h"
#include "record_format.h"
#include "requests.h"
#include "tensor_view.h"

namespace hiqcache::server {

struct BackupTask {
  uint64_t ticket = 0;
  // When the transfer engine first tried the task: the wait_event timeout counts from here.
  std::chrono::steady_clock::time_point first_try{};
  int32_t wait_event = -1;
  uint64_t wait_value = 1;
  int32_t done_event = -1;
  std::vector<uint32_t> rows;       // block_tokens per block, block-major
  std::vector<uint8_t*> payloads;   // one per block: where its encoded payload goes
  // Called once the payloads are written (before the done event is signalled), with one flag
  // per block (1 = held NaN/Inf, not to be published) or with the error that stopped the work.
  std::function<void(const std::vector<uint8_t>& nonfinite, const Status&)> on_written;
  // Out, optional: XXH3-64 of each block's payload, filled before on_written by backends that
  // can hash in parallel while the bytes are fresh (HOST); left empty, the core hashes them.
  std::vector<uint64_t> checksums;
  // Backends that signal on the device (SignalsOnDevice) call this once the work and its event
  // records are enqueued, before waiting for completion; may be empty.
  std::function<void()> on_enqueued;
};

struct RestoreTask {
  uint64_t ticket = 0;
  std::chrono::steady_clock::time_point first_try{};
  int32_t wait_event = -1;
  uint64_t wait_value = 1;
  int32_t layer_event_base = -1;
  int32_t done_event = -1;
  std::vector<uint32_t> rows;
  std::vector<const uint8_t*> payloads;
  std::function<void()> on_enqueued;  // as in BackupTask
};

class PoolBinding {
 public:
  virtual ~PoolBinding() = default;
  virtual uint32_t event_count() const = 0;
  // Smallest num_rows over every view: a valid row index is below it.
  virtual uint32_t num_rows() const = 0;
  // Runs the task to completion: waits for wait_event, encodes, calls on_written, signals
  // done_event. Returns the error that stopped it, if any (on_written has then been called).
  virtual Status RunBackup(BackupTask& task) = 0;
  // Waits for wait_event, decodes layer by layer, signalling layer_event_base + l after each
  // layer and done_event after the last.
  virtual Status RunRestore(RestoreTask& task) = 0;
  // Marks `event` complete for `ticket` (used when work ends early, e.g. nothing to restore).
  virtual void Signal(int32_t event, uint64_t ticket) = 0;
  // Tickets of this pool start above this value. HOST: the largest value already in the event
  // slots, so that a client re-registering with slots from an earlier daemon never sees a slot
  // that is already past a new ticket.
  virtual uint64_t TicketFloor() const { return 0; }
  // True when completion events are recorded on a device stream (CUDA): an asynchronous request
  // is then answered only after its events are recorded (on_enqueued), so that an engine whose
  // stream waits on them right after the answer waits for this work, not an earlier record.
  // HOST events carry tickets and are answered as soon as the work is queued.
  virtual bool SignalsOnDevice() const { return false; }
  // Whether a task waiting for `event` >= `value` (first tried at `first_try`) may run now
  // without blocking: its event came, it timed out, or the pool was cancelled. Backends whose
  // waits are enqueued on a device stream (CUDA) never block the host and answer true.
  virtual bool WaitSatisfied(int32_t event, uint64_t value,
                             std::chrono::steady_clock::time_point first_try) {
    (void)event;
    (void)value;
    (void)first_try;
    return true;
  }
  // The pool was released (ReleasePool, or its process exited): a task waiting for one of its
  // events, which may never come, stops waiting and fails, so that it drops its pins and frees
  // its worker now. Called from any thread; tasks without a wait still run.
  virtual void Cancel() {}
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const char* name() const = 0;
  // REQUIRES: `spec` passed ValidateRegistration. Opens everything or nothing.
  virtual StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& spec,
                                                      const kernels::BlockLayout& layout) = 0;
};

}  // namespace hiqcache::server
