// DeviceBackend: the core's interface to where an engine's KV buffers and completion events live
// (HOST shared memory or CUDA device memory), and how codec work on them is executed and
// signalled. The interface is the core's; its implementations are in server/backends/. Both signal
// completion through the engine's ticket slots (ticket_slots.h).
//
// Bind() opens the buffers and events of a validated registration and resolves its views into
// kernels::LayerViews; the returned PoolBinding executes backup and restore tasks. Implementations:
// HostBackend (POSIX shm buffers, shm counter events, CPU codec) and CudaBackend (CUDA IPC
// buffers and events, codec kernels on the daemon's streams, completion observed by a thread per
// device: cuda_backend.h).
//
// A task's life (both kinds):
//   Start*(task)        on a transfer worker, one task of a pool and direction at a time (see
//                       Thread-safety). Answers kNotReady
//                       (nothing done, try again later: the wait_event slot has not reached
//                       wait_value yet, no CUDA staging free), kCompleted (done, on_complete
//                       already called), or kPending (the device has the work; the worker is
//                       free).
//   defer(work)         CUDA: called by a completion thread of the pool once the device finished;
//                       `work` must then run on a worker (it ends the task: on_written,
//                       on_complete). The caller keeps the pool's next task of the same
//                       direction waiting until then.
//   on_written(..)      backup: the payloads are final (or the error that stopped the work).
//   on_complete(st)     last, exactly once: the task's outcome.
// Thread-safety: Bind may be called concurrently. A PoolBinding's StartBackup calls are issued one
// at a time, each after the previous backup completed, and so are its StartRestore calls; when
// SignalsOnDevice() a StartBackup may run concurrently with a StartRestore (the core gives such a
// pool a strand per direction, docs/design.md "Completion: ticket slots"), else every Start* call
// of a pool follows the completion of the one before. Cancel and Close from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/fault_budget.h"
#include "core/requests.h"
#include "hiqcache/status.h"
#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::server {

enum class StartResult { kNotReady, kCompleted, kPending };

// Callbacks shared by both task kinds (see the header comment).
struct TaskHooks {
  std::function<void(std::function<void()>)> defer;
  std::function<void(const Status&)> on_complete;
  // The request's caller gives up then (its gRPC deadline): a task that has not started by then
  // fails with DEADLINE_EXCEEDED without touching the engine's memory (its slots get the failed
  // bit). max() = no deadline.
  CallerDeadline caller_deadline = CallerDeadline::max();
};

struct BackupTask : TaskHooks {
  uint64_t ticket = 0;
  // When the transfer engine first tried the task: the wait_event timeout counts from here.
  std::chrono::steady_clock::time_point first_try{};
  int32_t wait_event = -1;
  uint64_t wait_value = 1;
  int32_t done_event = -1;
  std::vector<uint32_t> rows;      // block_tokens per block, block-major
  std::vector<uint8_t*> payloads;  // one per block: where its encoded payload goes
  // Called once the payloads are final (HOST: before the done event is signalled), with one flag
  // per block (1 = held NaN/Inf, not to be published) or with the error that stopped the work.
  std::function<void(const std::vector<uint8_t>& nonfinite, const Status&)> on_written;
  // Out, optional: XXH3-64 of each block's payload, filled before on_written by backends that
  // can hash in parallel while the bytes are fresh (HOST); left empty, the core hashes them.
  std::vector<uint64_t> checksums;
};

struct RestoreTask : TaskHooks {
  uint64_t ticket = 0;
  std::chrono::steady_clock::time_point first_try{};
  int32_t wait_event = -1;
  uint64_t wait_value = 1;
  // Signalled for each layer of [first_layer, end_layer) once written; on a failure, every layer
  // from the first not yet signalled to the pool's last gets the failure bit.
  int32_t layer_event_base = -1;
  int32_t done_event = -1;
  // The layers this task writes (HOST: a sub-task of a layer-major restore); end_layer 0 = every
  // layer. A device task (SignalsOnDevice) always writes every layer.
  uint32_t first_layer = 0;
  uint32_t end_layer = 0;
  std::vector<uint32_t> rows;
  std::vector<const uint8_t*> payloads;
  // Out (HOST), before on_complete: every layer below it has its event without the failure bit
  // (as far as this task knows: from first_layer on, those it signalled).
  uint32_t layers_signalled = 0;
};

class PoolBinding {
 public:
  virtual ~PoolBinding() = default;
  virtual uint32_t event_count() const = 0;
  // Smallest num_rows over every view: a valid row index is below it.
  virtual uint32_t num_rows() const = 0;
  // Waits for wait_event (by answering kNotReady until its slot reached wait_value), encodes, calls
  // on_written, signals done_event, then on_complete. An error fails the task (on_written and
  // on_complete see it); it still signals done_event, so no engine hangs.
  virtual StartResult StartBackup(const std::shared_ptr<BackupTask>& task) = 0;
  // Waits for wait_event, decodes layer by layer (HOST: the task's layers), signalling
  // layer_event_base + l after each layer and done_event after the last. On error every layer
  // slot from the first not yet signalled and done_event still get the ticket, with the failed
  // bit, and on_complete reports the error: the rows hold garbage.
  virtual StartResult StartRestore(const std::shared_ptr<RestoreTask>& task) = 0;
  // Tickets of this pool start above this value. HOST: the largest value already in the event
  // slots, so that a client re-registering with slots from an earlier daemon never sees a slot
  // that is already past a new ticket.
  virtual uint64_t TicketFloor() const { return 0; }
  // Bytes of the client's memory this binding faulted in on the client's account (charged to
  // its FaultBudget). Any thread.
  virtual uint64_t FaultedBytes() const { return 0; }
  // True when a request's work goes to a device as one task (CUDA: the device chunks it through
  // staging) rather than in CPU-sized sub-tasks (HOST).
  virtual bool SignalsOnDevice() const { return false; }
  // OK while the binding can run tasks; else the error every later task of the pool fails with,
  // for good (HOST: the client's shared memory shrank under the daemon, FAILED_PRECONDITION
  // naming the buffer). The core may answer a request with it before queueing anything, so that
  // an asynchronous request on a failed pool is refused instead of answered as queued. Any thread.
  virtual Status Failure() const { return Status::Ok(); }
  // The pool was released (ReleasePool, or its process exited). HOST: a task waiting for one of
  // its events, which may never come, stops waiting and fails (its events get the failure bit),
  // so that it drops its pins and frees its worker now; tasks without a wait still run. CUDA:
  // tasks started from now on fail with CANCELLED without touching the engine's buffers or
  // events; work already on the device completes. Any thread.
  virtual void Cancel() {}
  // REQUIRES: Cancel was called and no task is pending (every on_complete has returned).
  // Closes the engine's mappings and events and the binding's device resources now, instead of
  // at destruction. Idempotent; never waits for device work.
  virtual void Close() {}
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const char* name() const = 0;
  // REQUIRES: `spec` passed ValidateRegistration. Opens everything or nothing.
  // `fault_budget`: the client's budget for memory the daemon faults in on its behalf
  // (fault_budget.h); null: none is counted. Backends that touch client shared memory from the
  // CPU charge it; a binding gives its charges back when destroyed.
  virtual StatusOr<std::unique_ptr<PoolBinding>> Bind(
      const RegisterSpec& spec, const kernels::BlockLayout& layout,
      std::shared_ptr<FaultBudget> fault_budget) = 0;
  // Device memory this backend holds for staging and job arrays (GetStats), in bytes.
  virtual uint64_t StagingDeviceBytes() const { return 0; }
};

}  // namespace hiqcache::server
