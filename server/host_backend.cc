#include "host_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include <xxhash.h>

#include "codec_job.h"
#include "hiqcache/log.h"
#include "registration.h"

namespace hiqcache::server {

StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Open(const std::string& name, uint64_t bytes,
                                                       const std::string& field) {
  std::string path = name.empty() || name[0] != '/' ? "/" + name : name;
  int fd = ::shm_open(path.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return InvalidArgument(field + ": cannot open shared memory '" + path +
                           "': " + std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return InvalidArgument(field + ": cannot stat '" + path + "': " + std::strerror(err));
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    ::close(fd);
    return InvalidArgument(field + ": shared memory '" + path + "' holds " +
                           std::to_string(st.st_size) + " bytes, " + std::to_string(bytes) +
                           " registered");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    return InvalidArgument(field + ": cannot map '" + path + "': " + std::strerror(err));
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(static_cast<uint8_t*>(p), bytes));
}

ShmMapping::~ShmMapping() {
  if (data_ != nullptr && ::munmap(data_, size_) != 0) {
    HIQ_LOG(WARN) << "munmap failed: " << std::strerror(errno);
  }
}

namespace {

class HostBinding : public PoolBinding {
 public:
  HostBinding(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout,
              kernels::BlockLayout layout, std::vector<std::unique_ptr<ShmMapping>> buffers,
              std::unique_ptr<ShmMapping> events, uint32_t event_count,
              std::vector<kernels::LayerViews> views, uint32_t num_rows)
      : codec_(codec),
        wait_timeout_(wait_timeout),
        layout_(layout),
        buffers_(std::move(buffers)),
        events_(std::move(events)),
        event_count_(event_count),
        views_(std::move(views)),
        num_rows_(num_rows) {}

  uint32_t event_count() const override { return event_count_; }
  uint32_t num_rows() const override { return num_rows_; }

  uint64_t TicketFloor() const override {
    uint64_t floor = 0;
    for (uint32_t i = 0; i < event_count_; ++i) {
      floor = std::max(floor, std::atomic_ref<uint64_t>(*Slot(static_cast<int32_t>(i)))
                                      .load(std::memory_order_acquire) &
                                  ~kHostEventFailedBit);
    }
    return floor;
  }

  StartResult StartBackup(const std::shared_ptr<BackupTask>& task) override {
    Status wait = Waited(task->wait_event, task->wait_value, &task->first_try);
    if (wait.code() == StatusCode::kUnavailable) return StartResult::kNotReady;
    Status st = RunBackup(*task, wait);
    task->on_complete(st);
    return StartResult::kCompleted;
  }

  StartResult StartRestore(const std::shared_ptr<RestoreTask>& task) override {
    Status wait = Waited(task->wait_event, task->wait_value, &task->first_try);
    if (wait.code() == StatusCode::kUnavailable) return StartResult::kNotReady;
    Status st = RunRestore(*task, wait);
    task->on_complete(st);
    return StartResult::kCompleted;
  }

  void Cancel() override { cancelled_.store(true, std::memory_order_release); }

  // event_count_ stays: a request racing the release may still validate against it.
  void Close() override {
    buffers_.clear();
    events_.reset();
  }

 private:
  // Where the wait of a task stands, without blocking (CheckWait); stamps its first try.
  Status Waited(int32_t event, uint64_t value, std::chrono::steady_clock::time_point* first_try) {
    if (*first_try == std::chrono::steady_clock::time_point{}) {
      *first_try = std::chrono::steady_clock::now();
    }
    return CheckWait(event, value, *first_try);
  }

  // REQUIRES: the wait settled (`wait` is not UNAVAILABLE).
  Status RunBackup(BackupTask& task, Status st) {
    std::vector<uint8_t> nonfinite(task.payloads.size(), 0);
    if (st.ok()) {
      kernels::EncodeJob job;
      job.layout = layout_;
      job.layers = views_.data();
      job.rows = task.rows.data();
      job.blocks = task.payloads.data();
      job.num_blocks = static_cast<uint32_t>(task.payloads.size());
      job.nonfinite = nonfinite.data();
      codec_->Encode(job);
    }
    if (st.ok() && !task.payloads.empty()) {
      // Block checksums for the pool headers, on the codec's threads.
      const size_t bytes = layout_.BlockBytes();
      task.checksums.assign(task.payloads.size(), 0);
      codec_->ParallelFor(task.payloads.size(), [&](size_t b) {
        if (!nonfinite[b]) task.checksums[b] = XXH3_64bits(task.payloads[b], bytes);
      });
    }
    task.on_written(nonfinite, st);
    SignalValue(task.done_event, task.ticket, !st.ok());
    return st;
  }

  Status RunRestore(RestoreTask& task, Status st) {
    if (st.ok()) {
      kernels::DecodeJob job;
      job.layout = layout_;
      job.layers = views_.data();
      job.rows = task.rows.data();
      job.blocks = task.payloads.data();
      job.num_blocks = static_cast<uint32_t>(task.payloads.size());
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        codec_->DecodeLayer(job, l);
        if (task.layer_event_base >= 0) {
          Signal(task.layer_event_base + static_cast<int32_t>(l), task.ticket);
        }
      }
    } else if (task.layer_event_base >= 0) {
      // Nothing was written: release the waiters (an engine never stalls on us), but with the
      // failure bit, so that they do not take the rows for restored KV.
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        SignalValue(task.layer_event_base + static_cast<int32_t>(l), task.ticket, true);
      }
    }
    SignalValue(task.done_event, task.ticket, !st.ok());
    return st;
  }

  void Signal(int32_t event, uint64_t ticket) { SignalValue(event, ticket, false); }

  // Stores `ticket` (with kHostEventFailedBit when the work failed) unless the slot already holds
  // a later ticket: slots never move backwards, waiters compare with >=.
  void SignalValue(int32_t event, uint64_t ticket, bool failed) {
    if (event < 0 || static_cast<uint32_t>(event) >= event_count_) return;
    std::atomic_ref<uint64_t> slot(*Slot(event));
    const uint64_t value = ticket | (failed ? kHostEventFailedBit : 0);
    uint64_t cur = slot.load(std::memory_order_relaxed);
    while ((cur & ~kHostEventFailedBit) < ticket &&
           !slot.compare_exchange_weak(cur, value, std::memory_order_release,
                                       std::memory_order_relaxed)) {
    }
  }

  // REQUIRES: event < event_count_ (the mapping is open).
  uint64_t* Slot(int32_t event) const {
    return reinterpret_cast<uint64_t*>(events_->data() + 64ull * static_cast<uint32_t>(event));
  }

  // The state of a wait without blocking: OK once the slot holds >= value; CANCELLED once the
  // pool is released; DEADLINE_EXCEEDED once wait_timeout has passed since `first_try`;
  // UNAVAILABLE while still waiting.
  Status CheckWait(int32_t event, uint64_t value,
                   std::chrono::steady_clock::time_point first_try) const {
    if (event < 0) return Status::Ok();
    if (value == 0) value = 1;
    std::atomic_ref<uint64_t> slot(*Slot(event));
    if ((slot.load(std::memory_order_acquire) & ~kHostEventFailedBit) >= value) {
      return Status::Ok();
    }
    if (cancelled_.load(std::memory_order_acquire)) {
      return Status(StatusCode::kCancelled,
                    "wait_event " + std::to_string(event) + ": pool released");
    }
    if (std::chrono::steady_clock::now() - first_try > wait_timeout_) {
      return DeadlineExceeded("wait_event " + std::to_string(event) + " did not reach " +
                              std::to_string(value) + " within " +
                              std::to_string(wait_timeout_.count()) + " ms");
    }
    return Unavailable("waiting");
  }

  kernels::CpuCodec* codec_;
  std::chrono::milliseconds wait_timeout_;
  kernels::BlockLayout layout_;
  std::vector<std::unique_ptr<ShmMapping>> buffers_;
  std::unique_ptr<ShmMapping> events_;
  uint32_t event_count_;
  std::vector<kernels::LayerViews> views_;
  uint32_t num_rows_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

HostBackend::HostBackend(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout)
    : codec_(codec), wait_timeout_(wait_timeout) {}

StatusOr<std::unique_ptr<PoolBinding>> HostBackend::Bind(const RegisterSpec& spec,
                                                         const kernels::BlockLayout& layout) {
  std::vector<std::unique_ptr<ShmMapping>> buffers;
  std::vector<uint8_t*> bases;
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const BufferSpec& b = spec.buffers[i];
    if (!b.has_host_shm_name) {
      return InvalidArgument("buffers[" + std::to_string(i) +
                             "]: a HOST pool needs host_shm_name, not cuda_ipc_handle");
    }
    HIQ_ASSIGN_OR_RETURN(
        auto m, ShmMapping::Open(b.host_shm_name, b.size_bytes,
                                 "buffers[" + std::to_string(i) + "].host_shm_name"));
    bases.push_back(m->data());
    buffers.push_back(std::move(m));
  }
  std::unique_ptr<ShmMapping> events;
  if (spec.events.count > 0) {
    HIQ_ASSIGN_OR_RETURN(events, ShmMapping::Open(spec.events.host_shm_name,
                                                  64ull * spec.events.count,
                                                  "events.host_shm_name"));
  }
  std::vector<kernels::LayerViews> views = ResolveViews(spec, layout, bases);
  uint32_t rows = MinRows(spec);
  return std::unique_ptr<PoolBinding>(new HostBinding(codec_, wait_timeout_, layout,
                                                      std::move(buffers), std::move(events),
                                                      spec.events.count, std::move(views), rows));
}

}  // namespace hiqcache::server
