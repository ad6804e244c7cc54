// FakeDevice: a DeviceApi whose "GPU" is host memory and whose streams complete only when the
// test lets them: the seam on which the CUDA backend's scheduling runs in CI (no GPU needed).
//
// Model (the CUDA runtime's semantics, device_api.h): each stream is a FIFO of operations
// (copies, encode/decode kernels, event records, event waits). RecordEvent makes the record the
// event's most recent one at the time of the call; StreamWaitEvent captures the most recent
// record at the time of the call (none: no wait); QueryEvent reports on the most recent record;
// SynchronizeEvent blocks the calling thread until the most recent record at the time of the call
// ran (none: returns at once) and fails once the context is lost.
// An operation runs once it is first in its stream and, for a wait, once the captured record
// completed. RunReady() runs every runnable operation, in an adversarial order (the most recently
// enqueued runnable operation first, so that whatever the host did not order is reordered);
// SetAutoRun(true) runs them on a thread as they become runnable. Copies move bytes; kernels run
// the scalar reference codec (codec_reference.h) on the job, so data round trips are real.
//
// The engine's side is played by the test: ExportBuffer gives IPC handles; its ticket slots are
// host memory the backend registers (RegisterHost) and the fake's WriteValue64 stores into when
// the store reaches the front of its stream (SlotStores lists them).
//
// Checks, reported by Violations():
//   - races: two operations touching overlapping memory (one writing; a kernel touches the rows
//     of the engine's buffers its job names) that no stream order,
//     event wait or host-observed completion orders (vector clocks): e.g. a staging slab reused
//     while a queued copy still reads it;
//   - use after close/free: an operation touching a closed IPC buffer or freed memory, or an
//     IPC buffer closed while queued work still uses it, or a destroyed event used;
//   - copies from or to pageable host memory, or across two host registrations;
//   - a WriteValue64 to memory that is not registered or not 8-byte aligned;
//   - a kernel of a codec with a RoPE table (the allot codecs) whose job.rope does not hold the
//     layout's (the table is also a range the kernel reads, for the two checks above).
// Faults: FailCall makes the n-th next call of a kind fail (a kDataLoss failure is sticky: the
// context is lost and every later call fails too); FailExecution makes an operation fail when it
// runs (sticky: later queries report kDataLoss).
// Thread-safe (one mutex; operations run under it).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/device_api.h"
#include "hiqcache/mutex.h"
#include "hiqcache/thread_annotations.h"

namespace hiqcache::server::testing {

class FakeDevice : public DeviceApi {
 public:
  enum class Call {
    kCreateStream,
    kCreateEvent,
    kRecord,
    kWait,
    kQuery,
    kOpenIpcBuffer,
    kAllocDevice,
    kAllocPinned,
    kRegisterHost,
    kCopy,
    kEncode,
    kDecode,
    kWriteValue,
    kSynchronize,
    kCount
  };

  explicit FakeDevice(int devices = 1);
  ~FakeDevice() override;
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;

  // --- the engine's side ---
  // `data` (host memory the test owns, `bytes` long) as an allocation of `device`.
  std::string ExportBuffer(uint8_t* data, size_t bytes, int device);
  // The slot stores (WriteValue64) that ran, in the order they ran: (slot, value).
  std::vector<std::pair<uint64_t*, uint64_t>> SlotStores();
  // Whether the daemon currently has `buffer` open.
  bool BufferOpen(const std::string& buffer);
  // Kernels enqueued so far whose views lie in `buffer` (read from the views they point to).
  uint64_t KernelsTouching(const std::string& buffer);

  // --- progress ---
  void SetAutoRun(bool on);
  // Runs every runnable operation; returns how many ran.
  size_t RunReady();
  size_t PendingOps();

  // --- faults ---
  void FailCall(Call call, Status status, uint32_t skip = 0);
  void FailExecution(Call call, uint32_t skip = 0);

  // --- observation ---
  std::vector<std::string> Violations();
  // API calls of a kind made so far (failed ones included).
  uint64_t Called(Call call);
  // Threads blocked in SynchronizeEvent now.
  size_t BlockedSyncs();
  uint64_t Enqueued(Call call);
  // Single copies (DMAs) enqueued so far: each entry of every CopyAsync call.
  uint64_t EnqueuedCopies();
  // Operations of a kind enqueued so far on streams of `priority`.
  uint64_t EnqueuedAt(Call call, Priority priority);
  // Runs every runnable operation of streams of `priority` only (as RunReady); returns how many
  // ran.
  size_t RunReadyAt(Priority priority);
  uint64_t Executed(Call call);
  uint64_t AllocCalls();
  size_t OpenIpcBuffers();
  size_t LiveStreams();
  std::vector<std::pair<uint8_t*, size_t>> Registered();

  // --- DeviceApi ---
  StatusOr<std::vector<std::string>> DeviceUuids() override;
  StatusOr<DeviceStream> CreateStream(int device, Priority priority) override;
  void DestroyStream(int device, DeviceStream stream) override;
  StatusOr<DeviceEvent> CreateEvent(int device) override;
  void DestroyEvent(int device, DeviceEvent event) override;
  Status RecordEvent(int device, DeviceEvent event, DeviceStream stream) override;
  Status StreamWaitEvent(int device, DeviceStream stream, DeviceEvent event) override;
  StatusOr<bool> QueryEvent(int device, DeviceEvent event) override;
  StatusOr<DeviceEvent> CreateBlockingEvent(int device) override;
  // Blocks until the most recent record at the time of the call ran (RunReady, or the auto-run
  // thread), or the context is lost (returns the loss), or the fake is destroyed.
  Status SynchronizeEvent(int device, DeviceEvent event) override;
  StatusOr<IpcBuffer> OpenIpcBuffer(int device, std::string_view handle,
                                    uint64_t size_bytes) override;
  void CloseIpcBuffer(int device, uint8_t* data) override;
  StatusOr<uint8_t*> AllocDevice(int device, size_t bytes) override;
  void FreeDevice(int device, uint8_t* data) override;
  StatusOr<uint8_t*> AllocPinned(size_t bytes) override;
  void FreePinned(uint8_t* data) override;
  Status RegisterHost(uint8_t* data, size_t bytes) override;
  void UnregisterHost(uint8_t* data) override;
  Status CopyAsync(int device, std::span<const Copy> copies, DeviceStream stream) override;
  Status LaunchEncode(int device, const kernels::EncodeJob& job, DeviceStream stream) override;
  Status LaunchDecode(int device, const kernels::DecodeJob& job, uint32_t first_layer,
                      uint32_t num_layers, DeviceStream stream) override;
  Status WriteValue64(int device, DeviceStream stream, uint64_t* slot, uint64_t value) override;

 private:
  using VClock = std::vector<uint64_t>;  // per stream id: the last op of it known to happen before
  struct Record;
  struct Event;
  struct Op;
  struct Stream;
  struct Buffer;
  struct Access {
    const uint8_t* lo;
    const uint8_t* hi;
    bool write;
    int stream;
    uint64_t own;  // the op's position in its stream
    uint64_t seq;
    Call kind;
  };

  Status InjectedLocked(Call call) REQUIRES(mu_);
  Stream* StreamLocked(DeviceStream s) REQUIRES(mu_);
  Event* EventLocked(DeviceEvent e, const char* what) REQUIRES(mu_);
  void EnqueueLocked(Stream* s, Op op) REQUIRES(mu_);
  bool RunnableLocked(const Stream& s) const REQUIRES(mu_);
  // Runs runnable operations of every stream (null) or of streams of *only.
  size_t RunReadyLocked(const Priority* only = nullptr) REQUIRES(mu_);
  void ExecuteLocked(Stream* s) REQUIRES(mu_);
  std::vector<Access> AccessesLocked(const Op& op) REQUIRES(mu_);
  void CheckRopeLocked(const kernels::BlockLayout& lay, const float* rope, const Op& op)
      REQUIRES(mu_);
  const Buffer* BufferAtLocked(const uint8_t* p) const REQUIRES(mu_);
  std::vector<const Buffer*> KernelBuffersLocked(const Op& op) REQUIRES(mu_);
  bool HostMemoryOkLocked(const uint8_t* p, size_t n) const REQUIRES(mu_);
  void ViolationLocked(std::string what) REQUIRES(mu_);
  static void Join(VClock* into, const VClock& from);

  const int devices_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::unique_ptr<Stream>> streams_ GUARDED_BY(mu_);  // index = stream id - 1
  std::vector<std::unique_ptr<Event>> events_ GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Buffer>> buffers_ GUARDED_BY(mu_);  // exported, by handle
  struct Alloc {
    uint8_t* data;
    size_t bytes;
    bool pinned;
    bool freed;
  };
  std::vector<Alloc> allocs_ GUARDED_BY(mu_);
  std::vector<std::pair<uint8_t*, size_t>> registered_ GUARDED_BY(mu_);
  // Closed or freed.
  std::vector<std::pair<const uint8_t*, const uint8_t*>> dead_ranges_ GUARDED_BY(mu_);
  std::vector<Access> log_ GUARDED_BY(mu_);  // accesses of executed operations
  // Executed kernels touching each buffer.
  std::map<const Buffer*, uint64_t> kernels_run_ GUARDED_BY(mu_);
  VClock host_vc_ GUARDED_BY(mu_);  // what the host has seen complete
  uint64_t next_seq_ GUARDED_BY(mu_) = 0;
  uint64_t next_record_ GUARDED_BY(mu_) = 0;
  struct Fault {
    Call call;
    Status status;
    uint32_t skip;
    bool on_execute;
  };
  std::vector<Fault> faults_ GUARDED_BY(mu_);
  Status lost_ GUARDED_BY(mu_);  // set once a sticky failure happened: every call fails with it
  std::vector<std::string> violations_ GUARDED_BY(mu_);
  uint64_t enqueued_[static_cast<int>(Call::kCount)] GUARDED_BY(mu_) = {};
  uint64_t executed_[static_cast<int>(Call::kCount)] GUARDED_BY(mu_) = {};
  uint64_t called_[static_cast<int>(Call::kCount)] GUARDED_BY(mu_) = {};
  uint64_t enqueued_high_[static_cast<int>(Call::kCount)] GUARDED_BY(mu_) = {};
  size_t blocked_syncs_ GUARDED_BY(mu_) = 0;
  uint64_t copies_enqueued_ GUARDED_BY(mu_) = 0;
  uint64_t alloc_calls_ GUARDED_BY(mu_) = 0;
  std::vector<std::pair<uint64_t*, uint64_t>> slot_stores_ GUARDED_BY(mu_);
  bool auto_run_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread runner_;
};

}  // namespace hiqcache::server::testing
