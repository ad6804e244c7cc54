#include "fake_device.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "codec_reference.h"
#include "rope_turn.h"

namespace hiqcache::server::testing {

struct FakeDevice::Record {
  uint64_t id = 0;
  bool done = false;
  VClock vc;  // what the record captures
};

struct FakeDevice::Event {
  bool destroyed = false;
  std::shared_ptr<Record> latest;
};

struct FakeDevice::Op {
  Call kind = Call::kCopy;
  uint64_t seq = 0;
  uint64_t own = 0;
  VClock vc;
  int device = 0;
  std::vector<Copy> copies;
  kernels::EncodeJob enc;
  kernels::DecodeJob dec;
  uint32_t first = 0, count = 0;
  std::shared_ptr<Record> record;  // kRecord: completes it; kWait: waits for it (may be null)
  uint64_t* slot = nullptr;        // kWriteValue: where `value` is stored
  uint64_t value = 0;
  bool fail = false;  // fails when it runs (sticky)
};

struct FakeDevice::Stream {
  int id = 0;
  int device = 0;
  Priority priority = Priority::kLow;
  bool destroyed = false;
  uint64_t count = 0;
  VClock tail;
  std::deque<Op> ops;
};

struct FakeDevice::Buffer {
  std::string handle;
  uint8_t* data = nullptr;
  size_t bytes = 0;
  int device = 0;
  int opens = 0;
};

namespace {

std::string HandleOf(const char* kind, uint64_t id) {
  std::string h(64, '\0');
  std::snprintf(h.data(), h.size(), "%s:%llu", kind, static_cast<unsigned long long>(id));
  return h;
}

const char* CallName(FakeDevice::Call c) {
  static const char* kNames[] = {
      "CreateStream",  "CreateEvent", "RecordEvent",  "StreamWaitEvent", "QueryEvent",
      "OpenIpcBuffer", "AllocDevice", "AllocPinned",  "RegisterHost",    "Copy",
      "Encode",        "Decode",      "WriteValue64", "SynchronizeEvent"};
  return kNames[static_cast<int>(c)];
}

}  // namespace

FakeDevice::FakeDevice(int devices) : devices_(devices) {
  runner_ = std::thread([this] {
    MutexLock lock(&mu_);
    for (;;) {
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || auto_run_; });
      if (stop_) return;
      // Nothing ran: sleeps until notified, or 5 ms at most.
      if (RunReadyLocked() == 0) {
        cv_.WaitUntil(&mu_, std::chrono::steady_clock::now() + std::chrono::milliseconds(5));
      }
    }
  });
}

FakeDevice::~FakeDevice() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  runner_.join();
  for (const Alloc& a : allocs_) std::free(a.data);
}

void FakeDevice::Join(VClock* into, const VClock& from) {
  if (into->size() < from.size()) into->resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) (*into)[i] = std::max((*into)[i], from[i]);
}

void FakeDevice::ViolationLocked(std::string what) { violations_.push_back(std::move(what)); }

// --- the engine's side -------------------------------------------------------------------------

std::string FakeDevice::ExportBuffer(uint8_t* data, size_t bytes, int device) {
  MutexLock lock(&mu_);
  auto b = std::make_unique<Buffer>();
  b->handle = HandleOf("FAKEBUF", buffers_.size() + 1);
  b->data = data;
  b->bytes = bytes;
  b->device = device;
  std::string h = b->handle;
  buffers_[h] = std::move(b);
  return h;
}

std::vector<std::pair<uint64_t*, uint64_t>> FakeDevice::SlotStores() {
  MutexLock lock(&mu_);
  return slot_stores_;
}

bool FakeDevice::BufferOpen(const std::string& buffer) {
  MutexLock lock(&mu_);
  return buffers_.at(buffer)->opens > 0;
}

uint64_t FakeDevice::KernelsTouching(const std::string& buffer) {
  MutexLock lock(&mu_);
  // Counted at enqueue (below) would need the views then; recount over the log and queues.
  uint64_t n = 0;
  const Buffer* want = buffers_.at(buffer).get();
  for (auto& s : streams_) {
    for (const Op& op : s->ops) {
      if (op.kind != Call::kEncode && op.kind != Call::kDecode) continue;
      for (const Buffer* b : KernelBuffersLocked(op)) n += b == want ? 1 : 0;
    }
  }
  auto it = kernels_run_.find(want);  // executed kernels
  return n + (it != kernels_run_.end() ? it->second : 0);
}

// --- progress ----------------------------------------------------------------------------------

void FakeDevice::SetAutoRun(bool on) {
  {
    MutexLock lock(&mu_);
    auto_run_ = on;
  }
  cv_.NotifyAll();
}

bool FakeDevice::RunnableLocked(const Stream& s) const {
  if (s.ops.empty()) return false;
  const Op& op = s.ops.front();
  if (op.kind == Call::kWait) return op.record == nullptr || op.record->done;
  return true;
}

size_t FakeDevice::RunReady() {
  MutexLock lock(&mu_);
  return RunReadyLocked();
}

size_t FakeDevice::RunReadyAt(Priority priority) {
  MutexLock lock(&mu_);
  return RunReadyLocked(&priority);
}

size_t FakeDevice::RunReadyLocked(const Priority* only) {
  size_t ran = 0;
  for (;;) {
    // The most recently enqueued runnable operation first: adversarial for missing waits.
    Stream* pick = nullptr;
    for (auto& s : streams_) {
      if (only != nullptr && s->priority != *only) continue;
      if (RunnableLocked(*s) && (pick == nullptr || s->ops.front().seq > pick->ops.front().seq)) {
        pick = s.get();
      }
    }
    if (pick == nullptr) return ran;
    ExecuteLocked(pick);
    ++ran;
  }
}

size_t FakeDevice::PendingOps() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (auto& s : streams_) n += s->ops.size();
  return n;
}

const FakeDevice::Buffer* FakeDevice::BufferAtLocked(const uint8_t* p) const {
  for (const auto& [h, b] : buffers_) {
    if (p >= b->data && p < b->data + b->bytes) return b.get();
  }
  return nullptr;
}

std::vector<const FakeDevice::Buffer*> FakeDevice::KernelBuffersLocked(const Op& op) {
  std::vector<const Buffer*> out;
  const kernels::BlockLayout& lay = op.kind == Call::kEncode ? op.enc.layout : op.dec.layout;
  const kernels::LayerViews* layers = op.kind == Call::kEncode ? op.enc.layers : op.dec.layers;
  const uint32_t first = op.kind == Call::kEncode ? 0 : op.first;
  const uint32_t count = op.kind == Call::kEncode ? lay.num_layers : op.count;
  for (uint32_t l = first; l < first + count; ++l) {
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      const Buffer* b = BufferAtLocked(layers[l].planes[p].base);
      if (b != nullptr && std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
    }
  }
  return out;
}

// The reference kernels the fake runs compute their own angles; a GPU's read the job's table
// (EncodeJob::rope), so a job of a codec that has one must carry the layout's.
void FakeDevice::CheckRopeLocked(const kernels::BlockLayout& lay, const float* rope, const Op& op) {
  const size_t floats = kernels::RopeTableFloats(lay);
  if (floats == 0) return;
  const std::vector<float> want = kernels::RopeTable(lay.row, lay.block_tokens);
  if (rope == nullptr || std::memcmp(rope, want.data(), floats * sizeof(float)) != 0) {
    ViolationLocked(std::string(CallName(op.kind)) + " #" + std::to_string(op.seq) +
                    ": job.rope does not hold the layout's RoPE table");
  }
}

std::vector<FakeDevice::Access> FakeDevice::AccessesLocked(const Op& op) {
  std::vector<Access> out;
  auto add = [&](const void* p, size_t n, bool write) {
    if (p == nullptr || n == 0) return;
    const uint8_t* lo = static_cast<const uint8_t*>(p);
    out.push_back({lo, lo + n, write, 0, op.own, op.seq, op.kind});
  };
  // The engine rows a kernel touches: per layer and plane, each run of consecutive row indices
  // as one range (from its first row's first head to its last row's last head).
  auto add_rows = [&](const kernels::BlockLayout& lay, const kernels::LayerViews* layers,
                      const uint32_t* rows, uint32_t num_blocks, uint32_t first, uint32_t count,
                      bool write) {
    std::vector<uint32_t> r(rows, rows + size_t{num_blocks} * lay.block_tokens);
    std::sort(r.begin(), r.end());
    r.erase(std::unique(r.begin(), r.end()), r.end());
    const uint64_t head_bytes = uint64_t{lay.row.head_dim} * 2;
    for (uint32_t l = first; l < first + count; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        const kernels::StridedView& v = layers[l].planes[p];
        const uint64_t row_bytes = (lay.row.num_heads - 1) * v.head_stride + head_bytes;
        for (size_t i = 0; i < r.size();) {
          size_t j = i + 1;
          while (j < r.size() && r[j] == r[j - 1] + 1 && v.page_rows == 0) ++j;
          const uint8_t* lo = v.base + v.RowOffset(r[i]);
          const uint8_t* hi = v.base + v.RowOffset(r[j - 1]) + row_bytes;
          add(lo, static_cast<size_t>(hi - lo), write);
          i = j;
        }
      }
    }
  };
  switch (op.kind) {
    case Call::kCopy:
      for (const Copy& c : op.copies) {
        add(c.src, c.bytes, false);
        add(c.dst, c.bytes, true);
      }
      break;
    case Call::kEncode: {
      const kernels::EncodeJob& j = op.enc;
      add(j.layers, j.layout.num_layers * sizeof(kernels::LayerViews), false);
      add(j.rows, size_t{j.num_blocks} * j.layout.block_tokens * 4, false);
      add(j.blocks, size_t{j.num_blocks} * sizeof(uint8_t*), false);
      add_rows(j.layout, j.layers, j.rows, j.num_blocks, 0, j.layout.num_layers, false);
      for (uint32_t b = 0; b < j.num_blocks; ++b) add(j.blocks[b], j.layout.BlockBytes(), true);
      add(j.nonfinite, j.num_blocks, true);
      add(j.rope, kernels::RopeTableFloats(j.layout) * sizeof(float), false);
      break;
    }
    case Call::kDecode: {
      const kernels::DecodeJob& j = op.dec;
      add(j.layers, (op.first + op.count) * sizeof(kernels::LayerViews), false);
      add(j.rows, size_t{j.num_blocks} * j.layout.block_tokens * 4, false);
      add(j.blocks, size_t{j.num_blocks} * sizeof(uint8_t*), false);
      for (uint32_t b = 0; b < j.num_blocks; ++b) {
        add(j.blocks[b] + op.first * j.layout.LayerBytes(), op.count * j.layout.LayerBytes(),
            false);
      }
      add_rows(j.layout, j.layers, j.rows, j.num_blocks, op.first, op.count, true);
      add(j.rope, kernels::RopeTableFloats(j.layout) * sizeof(float), false);
      break;
    }
    case Call::kWriteValue:
      add(op.slot, sizeof(uint64_t), true);
      break;
    default:
      break;
  }
  return out;
}

void FakeDevice::ExecuteLocked(Stream* s) {
  Op op = std::move(s->ops.front());
  s->ops.pop_front();
  if (op.fail) {
    lost_ = DataLoss(std::string("fake device: ") + CallName(op.kind) +
                     " failed on the device (illegal address)");
    cv_.NotifyAll();  // SynchronizeEvent waiters
  }
  if (!lost_.ok()) {
    // A lost context runs nothing; records never complete (queries fail instead).
    return;
  }
  std::vector<Access> acc = AccessesLocked(op);
  for (Access& a : acc) a.stream = s->id;
  for (const Access& a : acc) {
    for (const auto& [lo, hi] : dead_ranges_) {
      if (a.lo < hi && lo < a.hi) {
        ViolationLocked(std::string(CallName(op.kind)) + " #" + std::to_string(op.seq) +
                        " touches closed or freed memory");
      }
    }
    for (const Access& b : log_) {
      if (b.stream == a.stream || !(a.write || b.write) || !(a.lo < b.hi && b.lo < a.hi)) continue;
      const uint64_t known = static_cast<size_t>(b.stream) < op.vc.size() ? op.vc[b.stream] : 0;
      if (known < b.own) {
        ViolationLocked(std::string("race: ") + CallName(op.kind) + " #" + std::to_string(op.seq) +
                        " (stream " + std::to_string(a.stream) + ", " +
                        (a.write ? "writes" : "reads") + ") and " + CallName(b.kind) + " #" +
                        std::to_string(b.seq) + " (stream " + std::to_string(b.stream) + ", " +
                        (b.write ? "writes" : "reads") + ") overlap with no order between them");
      }
    }
  }
  switch (op.kind) {
    case Call::kCopy:
      for (const Copy& c : op.copies) std::memmove(c.dst, c.src, c.bytes);
      break;
    case Call::kEncode:
      CheckRopeLocked(op.enc.layout, op.enc.rope, op);
      kernels::EncodeBlocksReference(op.enc);
      break;
    case Call::kDecode:
      CheckRopeLocked(op.dec.layout, op.dec.rope, op);
      for (uint32_t l = op.first; l < op.first + op.count; ++l) {
        kernels::DecodeLayerReference(op.dec, l);
      }
      break;
    case Call::kRecord:
      op.record->done = true;
      cv_.NotifyAll();  // SynchronizeEvent waiters
      break;
    case Call::kWriteValue:
      std::atomic_ref<uint64_t>(*op.slot).store(op.value, std::memory_order_release);
      slot_stores_.emplace_back(op.slot, op.value);
      break;
    default:
      break;
  }
  executed_[static_cast<int>(op.kind)] += 1;
  if (op.kind == Call::kEncode || op.kind == Call::kDecode) {
    for (const Buffer* b : KernelBuffersLocked(op)) kernels_run_[b] += 1;
  }
  log_.insert(log_.end(), acc.begin(), acc.end());
}

// --- faults and observation --------------------------------------------------------------------

void FakeDevice::FailCall(Call call, Status status, uint32_t skip) {
  MutexLock lock(&mu_);
  faults_.push_back({call, std::move(status), skip, false});
}

void FakeDevice::FailExecution(Call call, uint32_t skip) {
  MutexLock lock(&mu_);
  faults_.push_back({call, Status::Ok(), skip, true});
}

Status FakeDevice::InjectedLocked(Call call) {
  called_[static_cast<int>(call)] += 1;
  if (!lost_.ok()) return lost_;
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->call != call || it->on_execute) continue;
    if (it->skip > 0) {
      --it->skip;
      return Status::Ok();
    }
    Status st = it->status;
    faults_.erase(it);
    if (IsStickyDeviceError(st)) lost_ = st;
    return st;
  }
  return Status::Ok();
}

std::vector<std::string> FakeDevice::Violations() {
  MutexLock lock(&mu_);
  return violations_;
}

uint64_t FakeDevice::Called(Call call) {
  MutexLock lock(&mu_);
  return called_[static_cast<int>(call)];
}

size_t FakeDevice::BlockedSyncs() {
  MutexLock lock(&mu_);
  return blocked_syncs_;
}

uint64_t FakeDevice::Enqueued(Call call) {
  MutexLock lock(&mu_);
  return enqueued_[static_cast<int>(call)];
}

uint64_t FakeDevice::EnqueuedCopies() {
  MutexLock lock(&mu_);
  return copies_enqueued_;
}

uint64_t FakeDevice::EnqueuedAt(Call call, Priority priority) {
  MutexLock lock(&mu_);
  const uint64_t high = enqueued_high_[static_cast<int>(call)];
  return priority == Priority::kHigh ? high : enqueued_[static_cast<int>(call)] - high;
}

uint64_t FakeDevice::Executed(Call call) {
  MutexLock lock(&mu_);
  return executed_[static_cast<int>(call)];
}

uint64_t FakeDevice::AllocCalls() {
  MutexLock lock(&mu_);
  return alloc_calls_;
}

size_t FakeDevice::OpenIpcBuffers() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [h, b] : buffers_) n += b->opens;
  return n;
}

size_t FakeDevice::LiveStreams() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& s : streams_) n += s->destroyed ? 0 : 1;
  return n;
}

std::vector<std::pair<uint8_t*, size_t>> FakeDevice::Registered() {
  MutexLock lock(&mu_);
  return registered_;
}

// --- DeviceApi ---------------------------------------------------------------------------------

StatusOr<std::vector<std::string>> FakeDevice::DeviceUuids() {
  std::vector<std::string> out;
  for (int d = 0; d < devices_; ++d) {
    char hex[33];
    std::snprintf(hex, sizeof(hex), "%032x", 0xfa4e0000 + d);
    out.emplace_back(hex);
  }
  return out;
}

FakeDevice::Stream* FakeDevice::StreamLocked(DeviceStream s) {
  auto* stream = static_cast<Stream*>(s.ptr);
  if (stream->destroyed) ViolationLocked("a destroyed stream was used");
  return stream;
}

FakeDevice::Event* FakeDevice::EventLocked(DeviceEvent e, const char* what) {
  auto* ev = static_cast<Event*>(e.ptr);
  if (ev->destroyed) ViolationLocked(std::string(what) + " on a destroyed event");
  return ev;
}

StatusOr<DeviceStream> FakeDevice::CreateStream(int device, Priority priority) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kCreateStream));
  auto s = std::make_unique<Stream>();
  s->id = static_cast<int>(streams_.size()) + 1;
  s->device = device;
  s->priority = priority;
  Stream* raw = s.get();
  streams_.push_back(std::move(s));
  return DeviceStream{raw};
}

void FakeDevice::DestroyStream(int, DeviceStream stream) {
  MutexLock lock(&mu_);
  static_cast<Stream*>(stream.ptr)->destroyed = true;  // queued work still runs
}

StatusOr<DeviceEvent> FakeDevice::CreateEvent(int) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kCreateEvent));
  events_.push_back(std::make_unique<Event>());
  return DeviceEvent{events_.back().get()};
}

void FakeDevice::DestroyEvent(int, DeviceEvent event) {
  MutexLock lock(&mu_);
  auto* ev = static_cast<Event*>(event.ptr);
  if (ev->destroyed) ViolationLocked("an event was destroyed twice");
  ev->destroyed = true;
}

void FakeDevice::EnqueueLocked(Stream* s, Op op) {
  op.seq = ++next_seq_;
  op.device = s->device;
  Join(&op.vc, s->tail);
  Join(&op.vc, host_vc_);
  if (op.kind == Call::kWait && op.record != nullptr) Join(&op.vc, op.record->vc);
  op.own = ++s->count;
  if (op.vc.size() <= static_cast<size_t>(s->id)) op.vc.resize(s->id + 1, 0);
  op.vc[s->id] = op.own;
  s->tail = op.vc;
  if (op.kind == Call::kRecord) op.record->vc = op.vc;
  enqueued_[static_cast<int>(op.kind)] += 1;
  if (s->priority == Priority::kHigh) enqueued_high_[static_cast<int>(op.kind)] += 1;
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->call != op.kind || !it->on_execute) continue;
    if (it->skip > 0) {
      --it->skip;
      continue;
    }
    op.fail = true;
    faults_.erase(it);
    break;
  }
  s->ops.push_back(std::move(op));
  cv_.NotifyAll();
}

Status FakeDevice::RecordEvent(int, DeviceEvent event, DeviceStream stream) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kRecord));
  Event* ev = EventLocked(event, "RecordEvent");
  Op op;
  op.kind = Call::kRecord;
  op.record = std::make_shared<Record>();
  op.record->id = ++next_record_;
  ev->latest = op.record;
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

Status FakeDevice::StreamWaitEvent(int, DeviceStream stream, DeviceEvent event) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kWait));
  Event* ev = EventLocked(event, "StreamWaitEvent");
  Op op;
  op.kind = Call::kWait;
  op.record = ev->latest;  // the most recent record at the time of the call
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

StatusOr<bool> FakeDevice::QueryEvent(int, DeviceEvent event) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kQuery));
  Event* ev = EventLocked(event, "QueryEvent");
  if (ev->latest == nullptr) return true;
  if (!ev->latest->done) return false;
  Join(&host_vc_, ev->latest->vc);  // the host now knows that work completed
  return true;
}

StatusOr<DeviceEvent> FakeDevice::CreateBlockingEvent(int device) { return CreateEvent(device); }

Status FakeDevice::SynchronizeEvent(int, DeviceEvent event) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kSynchronize));
  std::shared_ptr<Record> rec = EventLocked(event, "SynchronizeEvent")->latest;
  if (rec == nullptr) return Status::Ok();
  ++blocked_syncs_;
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return rec->done || !lost_.ok() || stop_; });
  --blocked_syncs_;
  if (!lost_.ok()) return lost_;
  if (!rec->done) return Unavailable("fake device destroyed");
  Join(&host_vc_, rec->vc);  // the host now knows that work completed
  return Status::Ok();
}

StatusOr<DeviceApi::IpcBuffer> FakeDevice::OpenIpcBuffer(int, std::string_view handle,
                                                         uint64_t size_bytes) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kOpenIpcBuffer));
  auto it = buffers_.find(std::string(handle));
  if (it == buffers_.end()) return InvalidArgument("fake: unknown IPC memory handle");
  Buffer* b = it->second.get();
  if (size_bytes > b->bytes) return InvalidArgument("fake: size_bytes exceeds the allocation");
  if (b->opens > 0) return InvalidArgument("fake: handle already open in this process");
  b->opens += 1;
  // Reopened after a close: no longer dead.
  std::erase_if(dead_ranges_, [&](const auto& r) { return r.first == b->data; });
  return IpcBuffer{b->data, b->device};
}

void FakeDevice::CloseIpcBuffer(int, uint8_t* data) {
  MutexLock lock(&mu_);
  const Buffer* found = nullptr;
  for (auto& [h, b] : buffers_) {
    if (b->data == data && b->opens > 0) {
      b->opens -= 1;
      found = b.get();
    }
  }
  if (found == nullptr) {
    ViolationLocked("CloseIpcBuffer of a buffer that is not open");
    return;
  }
  for (auto& s : streams_) {
    for (const Op& op : s->ops) {
      if (op.kind != Call::kEncode && op.kind != Call::kDecode) continue;
      for (const Buffer* b : KernelBuffersLocked(op)) {
        if (b == found) {
          ViolationLocked("IPC buffer closed while a queued " + std::string(CallName(op.kind)) +
                          " #" + std::to_string(op.seq) + " still uses it");
        }
      }
    }
  }
  dead_ranges_.emplace_back(found->data, found->data + found->bytes);
}

StatusOr<uint8_t*> FakeDevice::AllocDevice(int, size_t bytes) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kAllocDevice));
  ++alloc_calls_;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
  std::memset(p, 0xA5, bytes);  // not zeroed, as cudaMalloc
  allocs_.push_back({p, bytes, false, false});
  return p;
}

void FakeDevice::FreeDevice(int, uint8_t* data) {
  MutexLock lock(&mu_);
  for (Alloc& a : allocs_) {
    if (a.data == data && !a.freed) {
      a.freed = true;
      dead_ranges_.emplace_back(a.data, a.data + a.bytes);
      for (auto& s : streams_) {
        if (!s->ops.empty() && lost_.ok()) {
          ViolationLocked("device memory freed while work is queued");
        }
      }
      return;
    }
  }
  ViolationLocked("FreeDevice of memory not allocated here");
}

StatusOr<uint8_t*> FakeDevice::AllocPinned(size_t bytes) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kAllocPinned));
  ++alloc_calls_;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
  std::memset(p, 0x5A, bytes);
  allocs_.push_back({p, bytes, true, false});
  return p;
}

void FakeDevice::FreePinned(uint8_t* data) {
  MutexLock lock(&mu_);
  for (Alloc& a : allocs_) {
    if (a.data == data && !a.freed) {
      a.freed = true;
      dead_ranges_.emplace_back(a.data, a.data + a.bytes);
      return;
    }
  }
  ViolationLocked("FreePinned of memory not allocated here");
}

Status FakeDevice::RegisterHost(uint8_t* data, size_t bytes) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kRegisterHost));
  registered_.emplace_back(data, bytes);
  return Status::Ok();
}

void FakeDevice::UnregisterHost(uint8_t* data) {
  MutexLock lock(&mu_);
  std::erase_if(registered_, [&](const auto& r) { return r.first == data; });
}

bool FakeDevice::HostMemoryOkLocked(const uint8_t* p, size_t n) const {
  for (const Alloc& a : allocs_) {
    if (p >= a.data && p + n <= a.data + a.bytes) return true;  // device or pinned memory
  }
  for (const auto& [d, b] : buffers_) {
    if (p >= b->data && p + n <= b->data + b->bytes) return true;  // an engine's device buffer
  }
  for (const auto& [r, len] : registered_) {
    if (p >= r && p + n <= r + len) return true;  // inside one registration
  }
  return false;
}

Status FakeDevice::CopyAsync(int, std::span<const Copy> copies, DeviceStream stream) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kCopy));
  for (const Copy& c : copies) {
    if (!HostMemoryOkLocked(static_cast<const uint8_t*>(c.src), c.bytes) ||
        !HostMemoryOkLocked(static_cast<const uint8_t*>(c.dst), c.bytes)) {
      ViolationLocked("a copy of " + std::to_string(c.bytes) +
                      " bytes touches pageable host memory or spans two registrations");
    }
  }
  Op op;
  op.kind = Call::kCopy;
  op.copies.assign(copies.begin(), copies.end());
  copies_enqueued_ += copies.size();
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

Status FakeDevice::LaunchEncode(int, const kernels::EncodeJob& job, DeviceStream stream) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kEncode));
  Op op;
  op.kind = Call::kEncode;
  op.enc = job;
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

Status FakeDevice::LaunchDecode(int, const kernels::DecodeJob& job, uint32_t first_layer,
                                uint32_t num_layers, DeviceStream stream) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kDecode));
  Op op;
  op.kind = Call::kDecode;
  op.dec = job;
  op.first = first_layer;
  op.count = num_layers;
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

Status FakeDevice::WriteValue64(int, DeviceStream stream, uint64_t* slot, uint64_t value) {
  MutexLock lock(&mu_);
  HIQ_RETURN_IF_ERROR(InjectedLocked(Call::kWriteValue));
  if (reinterpret_cast<uintptr_t>(slot) % 8 != 0) {
    ViolationLocked("WriteValue64 to an address that is not 8-byte aligned");
  }
  bool registered = false;
  const auto* p = reinterpret_cast<const uint8_t*>(slot);
  for (const auto& [r, len] : registered_) registered |= p >= r && p + 8 <= r + len;
  if (!registered) ViolationLocked("WriteValue64 to host memory that is not registered");
  Op op;
  op.kind = Call::kWriteValue;
  op.slot = slot;
  op.value = value;
  EnqueueLocked(StreamLocked(stream), std::move(op));
  return Status::Ok();
}

}  // namespace hiqcache::server::testing
