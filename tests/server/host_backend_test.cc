// HostBackend::Bind and its bindings, without the core: which client objects are accepted (fds
// and names; owner, access mode, file type, size, the daemon's own pool), how event slots are
// adopted (tickets never reach the failure bit), and what a task does when the client truncates
// its KV or event object under the daemon (the SIGBUS guard: the task fails, nothing committed,
// the binding fails for good, the process lives).
#include "backends/host_backend.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "codec_cpu.h"
#include "core/registration.h"
#include "huge_pages.h"
#include "register_spec_util.h"

namespace hiqcache::server {
namespace {

constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 64, kBlockTokens = 4, kRows = 32;
constexpr uint64_t kRowBytes = uint64_t{kHeads} * kDim * 2;
constexpr uint64_t kPlaneBytes = uint64_t{kLayers} * kRows * kRowBytes;
constexpr uint32_t kSlots = 8;

// A client's object: a POSIX shm object (by name) or a memfd, mapped here as the client has it.
class ClientObject {
 public:
  static std::unique_ptr<ClientObject> Shm(const std::string& tag, size_t bytes) {
    static std::atomic<int> n{0};
    auto o = std::unique_ptr<ClientObject>(new ClientObject(bytes));
    o->name_ = "/hiq-host-backend-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++) +
               "-" + tag;
    ::shm_unlink(o->name_.c_str());
    o->fd_ = ::shm_open(o->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    o->Init();
    return o;
  }
  // A hugetlbfs memfd of `bytes` rounded up to whole huge pages; !ok() when the hugetlb pool
  // cannot reserve them.
  static std::unique_ptr<ClientObject> Hugetlb(size_t bytes) {
    const size_t page = machine::HugePageBytes();
    if (page == 0) return std::unique_ptr<ClientObject>(new ClientObject(0));
    auto o = std::unique_ptr<ClientObject>(new ClientObject((bytes + page - 1) / page * page));
    o->fd_ = ::memfd_create("hiq-host-backend-test-hugetlb", MFD_CLOEXEC | MFD_HUGETLB);
    o->Init();
    return o;
  }
  static std::unique_ptr<ClientObject> Memfd(size_t bytes, unsigned seals = 0) {
    auto o = std::unique_ptr<ClientObject>(new ClientObject(bytes));
    o->fd_ = ::memfd_create("hiq-host-backend-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    o->Init();
    if (seals != 0) ::fcntl(o->fd_, F_ADD_SEALS, seals);
    return o;
  }
  ~ClientObject() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
    if (!name_.empty()) ::shm_unlink(name_.c_str());
  }
  bool ok() const { return data_ != nullptr; }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }
  size_t size() const { return bytes_; }
  uint8_t* data() const { return data_; }
  bool Truncate(size_t bytes) const { return ::ftruncate(fd_, static_cast<off_t>(bytes)) == 0; }
  std::atomic_ref<uint64_t> Slot(uint32_t i) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(data_ + 64 * i));
  }

 private:
  explicit ClientObject(size_t bytes) : bytes_(bytes) {}
  void Init() {
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) return;
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) data_ = static_cast<uint8_t*>(p);
  }
  std::string name_;
  int fd_ = -1;
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

BufferSpec ByName(const ClientObject& o) {
  BufferSpec b;
  b.has_host_shm_name = true;
  b.host_shm_name = o.name();
  b.size_bytes = o.size();
  return b;
}

BufferSpec ByFd(int fd, size_t bytes, uint64_t id = 7) {
  BufferSpec b;
  b.has_host_fd = true;
  b.host_fd_id = id;
  b.fd = fd;
  b.size_bytes = bytes;
  return b;
}

class HostBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // As the daemon does: mappings keep a descriptor, so tasks take the fstat path
    // (ShmMapping::FullyAllocated) where every page is there, the probe elsewhere.
    ShmMapping::SetKeptDescriptors(64);
    codec_ = std::make_unique<kernels::CpuCodec>(2);
    backend_ = std::make_unique<HostBackend>(codec_.get(), std::chrono::milliseconds(500));
    k_ = ClientObject::Memfd(kPlaneBytes);
    v_ = ClientObject::Memfd(kPlaneBytes);
    events_ = ClientObject::Memfd(64 * kSlots);
    ASSERT_TRUE(k_->ok() && v_->ok() && events_->ok());
    for (size_t i = 0; i < kPlaneBytes / 2; ++i) {  // small finite BF16 values
      reinterpret_cast<uint16_t*>(k_->data())[i] = 0x3F80 + (i % 64);
      reinterpret_cast<uint16_t*>(v_->data())[i] = 0xBF80 + (i % 64);
    }
  }
  void TearDown() override { ShmMapping::SetKeptDescriptors(0); }

  // Buffers k_ and v_ and the event object, all by fd.
  RegisterSpec Spec() const {
    RegisterSpec s = testing::BaseSpec("test/host", kLayers, kHeads, kDim, kBlockTokens);
    s.buffers = {ByFd(k_->fd(), k_->size(), 1), ByFd(v_->fd(), v_->size(), 2)};
    testing::AddLayerMajorLayers(&s, kRows, kRowBytes);
    s.events.host_fd_id = 3;
    s.events.fd = events_->fd();
    s.events.count = kSlots;
    return s;
  }

  // The layout of this geometry, from a twin of `s` naming its objects (the validation of fd
  // ids belongs to the registration, not to this test).
  static StatusOr<kernels::BlockLayout> Layout(RegisterSpec s) {
    for (BufferSpec& b : s.buffers) {
      b.has_host_shm_name = true;
      b.host_shm_name = "/layout-only";
    }
    s.events.host_shm_name = "/layout-only";
    HIQ_ASSIGN_OR_RETURN(auto reg, ValidateRegistration(s, Limits{}, 1ull << 30));
    return reg.layout;
  }

  StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& s,
                                              std::shared_ptr<FaultBudget> budget = nullptr) {
    HIQ_ASSIGN_OR_RETURN(kernels::BlockLayout layout, Layout(s));
    return backend_->Bind(s, layout, std::move(budget));
  }

  // One backup task of `blocks` blocks (rows 0..) into payloads of this test.
  std::shared_ptr<BackupTask> BackupTask_(uint32_t blocks, uint64_t ticket, int32_t done_event,
                                          Status* outcome, Status* written) {
    auto t = std::make_shared<BackupTask>();
    t->ticket = ticket;
    t->done_event = done_event;
    payload_.assign(size_t{blocks} * BlockBytes(), 0);
    for (uint32_t b = 0; b < blocks; ++b) {
      t->payloads.push_back(payload_.data() + size_t{b} * BlockBytes());
      for (uint32_t i = 0; i < kBlockTokens; ++i) t->rows.push_back(b * kBlockTokens + i);
    }
    t->on_written = [written](const std::vector<uint8_t>&, const Status& st) { *written = st; };
    t->on_complete = [outcome](const Status& st) { *outcome = st; };
    return t;
  }

  std::shared_ptr<RestoreTask> RestoreTask_(uint32_t blocks, uint64_t ticket, int32_t base,
                                            int32_t done_event, Status* outcome) {
    auto t = std::make_shared<RestoreTask>();
    t->ticket = ticket;
    t->layer_event_base = base;
    t->done_event = done_event;
    for (uint32_t b = 0; b < blocks; ++b) {
      t->payloads.push_back(payload_.data() + size_t{b} * BlockBytes());
      for (uint32_t i = 0; i < kBlockTokens; ++i) t->rows.push_back(b * kBlockTokens + i);
    }
    t->on_complete = [outcome](const Status& st) { *outcome = st; };
    return t;
  }

  size_t BlockBytes() const {
    auto layout = Layout(Spec());
    return layout.ok() ? layout->BlockBytes() : 0;
  }

  std::unique_ptr<kernels::CpuCodec> codec_;
  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<ClientObject> k_, v_, events_;
  std::vector<uint8_t> payload_;
};

bool Has(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

// Bytes the object behind `fd` has allocated (what faults put there).
uint64_t AllocatedBytes(int fd) {
  struct stat st;
  return ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : ~uint64_t{0};
}

// Pages the daemon faults in on a client's behalf are charged to the client's FaultBudget: a
// pool lent memory it never wrote, so each page the backup reads (and the done slot it signals)
// is allocated by the daemon's access, and counted once; the charges go back with the binding.
TEST_F(HostBackendTest, PagesFaultedForTheClientAreChargedOnce) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  k_ = ClientObject::Memfd(kPlaneBytes);  // never written: holes
  v_ = ClientObject::Memfd(kPlaneBytes);
  events_ = ClientObject::Memfd(64 * kSlots);
  ASSERT_TRUE(k_->ok() && v_->ok() && events_->ok());
  auto budget = std::make_shared<FaultBudget>(1 << 20);
  auto b = Bind(Spec(), budget);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  Status outcome, written;
  // 2 blocks = rows 0..7 (2 KiB) of each of 2 layers, in K and in V: one page each (layers lie
  // kRows rows apart), and the page of slot 0.
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(AllocatedBytes(k_->fd()), 2 * page) << "the daemon's reads fault in the holes";
  EXPECT_EQ(budget->charged(), 5 * page);
  EXPECT_EQ((*b)->FaultedBytes(), 5 * page);
  // Resident now: the same work charges nothing more.
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 2, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(budget->charged(), 5 * page);
  b->reset();
  EXPECT_EQ(budget->charged(), 0u) << "a released pool gives its charges back";
}

// Over the budget a task touches none of the client's rows: the backup fails with the quota's
// name, the rows stay holes, the done slot gets the failure bit; resident rows still work.
TEST_F(HostBackendTest, RowsBeyondTheBudgetAreNotTouched) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  k_ = ClientObject::Memfd(kPlaneBytes);
  ASSERT_TRUE(k_->ok());
  events_->Slot(0).store(0);  // the slots' page is the client's (resident)
  auto budget = std::make_shared<FaultBudget>(page);
  auto b = Bind(Spec(), budget);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kResourceExhausted) << outcome.ToString();
  EXPECT_TRUE(Has(outcome, "max_faulted_bytes_per_client")) << outcome.ToString();
  EXPECT_EQ(written.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(AllocatedBytes(k_->fd()), 0u) << "nothing of the refused rows was faulted in";
  EXPECT_EQ(budget->charged(), 0u);
  EXPECT_EQ(events_->Slot(0).load(), 1u | kHostEventFailedBit);
  // A restore into those rows is refused the same way; its layer slots get the failure bit.
  payload_.assign(2 * BlockBytes(), 0);
  ASSERT_EQ((*b)->StartRestore(RestoreTask_(2, 2, 2, 1, &outcome)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kResourceExhausted) << outcome.ToString();
  EXPECT_EQ(events_->Slot(2).load(), 2u | kHostEventFailedBit);
  EXPECT_EQ(AllocatedBytes(k_->fd()), 0u);
  // The client writes its memory: the pool works again.
  std::memset(k_->data(), 0, kPlaneBytes);
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 3, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(budget->charged(), 0u);
}

// Holes punched after registration (FALLOC_FL_PUNCH_HOLE, which F_SEAL_SHRINK does not stop)
// are charged again when the daemon faults them back in.
TEST_F(HostBackendTest, PunchedHolesAreChargedAgain) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  events_->Slot(0).store(0);
  auto budget = std::make_shared<FaultBudget>(1 << 20);
  auto b = Bind(Spec(), budget);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(budget->charged(), 0u) << "the client's own written memory costs nothing";
  ASSERT_EQ(::fallocate(k_->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(kPlaneBytes)),
            0);
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 2, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(budget->charged(), 2 * page);
}

// FullyAllocated: one fstat answers whether any page of a shmem object sealed against growing is
// missing (never written, hole-punched), for mappings within the daemon's budget of kept
// descriptors; every other mapping answers false (its tasks ask mincore). An object that may grow
// never answers true: fallocate past its end (FALLOC_FL_KEEP_SIZE) adds pages st_blocks counts
// while a hole stays before the end. A mapping gives its descriptor back when it goes.
TEST_F(HostBackendTest, FullyAllocatedFollowsTheObjectsPages) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // A whole largest shmem folio (2 MiB on x86: 512 pages): no folio reaches past the end.
  const size_t size = ShmMapping::ShmemLargestFolioBytes();
  if (size == 0 || size > (64u << 20)) GTEST_SKIP() << "shmem folios of " << size << " bytes";
  auto written = ClientObject::Memfd(size, F_SEAL_GROW | F_SEAL_SHRINK);
  auto sparse = ClientObject::Memfd(size, F_SEAL_GROW | F_SEAL_SHRINK);
  auto growable = ClientObject::Memfd(size, F_SEAL_SHRINK);
  ASSERT_TRUE(written->ok() && sparse->ok() && growable->ok());
  std::memset(written->data(), 1, size);
  std::memset(sparse->data(), 1, size - page);  // the last page never written
  std::memset(growable->data(), 1, size);

  ShmMapping::SetKeptDescriptors(2);
  auto w = ShmMapping::FromFd(written->fd(), size, "w");
  auto sp = ShmMapping::FromFd(sparse->fd(), size, "s");
  auto over = ShmMapping::FromFd(written->fd(), size, "o");  // beyond the budget of 2
  ASSERT_TRUE(w.ok() && sp.ok() && over.ok());
  EXPECT_TRUE((*w)->FullyAllocated());
  EXPECT_FALSE((*sp)->FullyAllocated());
  EXPECT_FALSE((*over)->FullyAllocated()) << "no descriptor kept: the probe decides";

  // A hole punched, then written again.
  ASSERT_EQ(::fallocate(written->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(page), static_cast<off_t>(page)),
            0);
  EXPECT_FALSE((*w)->FullyAllocated());
  std::memset(written->data() + page, 2, page);
  EXPECT_TRUE((*w)->FullyAllocated());
  // Sealed against growing, nothing is allocated past the end.
  EXPECT_NE(::fallocate(written->fd(), FALLOC_FL_KEEP_SIZE, static_cast<off_t>(size),
                        static_cast<off_t>(size)),
            0);

  // An object that may grow: never, even written in full; pages allocated past its end would
  // otherwise hide a hole punched before it.
  sp->reset();  // its descriptor goes back
  ShmMapping::SetKeptDescriptors(3);
  auto g = ShmMapping::FromFd(growable->fd(), size, "g");
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE((*g)->FullyAllocated());
  ASSERT_EQ(::fallocate(growable->fd(), FALLOC_FL_KEEP_SIZE, static_cast<off_t>(size),
                        static_cast<off_t>(size)),
            0);
  ASSERT_EQ(::fallocate(growable->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(page)),
            0);
  EXPECT_GE(AllocatedBytes(growable->fd()), size) << "st_blocks alone would miss the hole";
  EXPECT_FALSE((*g)->FullyAllocated());

  // The descriptors go back with their mappings (the one the sparse object's mapping gave back
  // serves a new mapping); budget 0 keeps none.
  auto again = ShmMapping::FromFd(written->fd(), size, "a");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->FullyAllocated());
  // Event slots keep none: nothing asks them.
  auto events = ShmMapping::FromFd(written->fd(), size, "e", {}, ShmMapping::Holds::kEventSlots);
  ASSERT_TRUE(events.ok());
  EXPECT_FALSE((*events)->FullyAllocated());
  ShmMapping::SetKeptDescriptors(0);
  auto none = ShmMapping::FromFd(written->fd(), size, "n");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE((*none)->FullyAllocated());
}

// With every page of the buffers there, a task charges nothing whichever way it asks; a hole
// punched in one buffer sends the next task back to the probe, which charges what it faults in.
TEST_F(HostBackendTest, WholeBuffersSkipTheProbeUntilAHoleAppears) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  // Buffers as the client libraries make them: memfds sealed against growing and shrinking, here
  // of a whole largest shmem folio each, every page written.
  const size_t size = ShmMapping::ShmemLargestFolioBytes();
  if (size == 0 || size > (64u << 20)) GTEST_SKIP() << "shmem folios of " << size << " bytes";
  for (auto* o : {&k_, &v_}) {
    *o = ClientObject::Memfd(size, F_SEAL_GROW | F_SEAL_SHRINK);
    ASSERT_TRUE((*o)->ok());
    std::memset((*o)->data(), 0, size);
  }
  for (size_t i = 0; i < kPlaneBytes / 2; ++i) {
    reinterpret_cast<uint16_t*>(k_->data())[i] = 0x3F80 + (i % 64);
    reinterpret_cast<uint16_t*>(v_->data())[i] = 0xBF80 + (i % 64);
  }
  auto budget = std::make_shared<FaultBudget>(1 << 20);
  auto b = Bind(Spec(), budget);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, -1, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  for (uint64_t t = 2; t <= 4; ++t) {
    ASSERT_EQ((*b)->StartRestore(RestoreTask_(2, t, -1, -1, &outcome)), StartResult::kCompleted);
    ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  }
  EXPECT_EQ(budget->charged(), 0u);
  ASSERT_EQ(::fallocate(v_->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(page)),
            0);
  ASSERT_EQ((*b)->StartRestore(RestoreTask_(2, 5, -1, -1, &outcome)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(budget->charged(), page) << "the punched page, faulted back by the restore's writes";
}

// A backup's block checksums (what the pool headers get) are the XXH3-64 of each payload as
// written, for sub-tasks of one block and of several: the codec's threads hash each block's
// layers in order while they encode the rest, and every block is hashed in full.
TEST_F(HostBackendTest, BackupChecksumsAreTheXxh3OfThePayloads) {
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  uint64_t ticket = 1;
  for (uint32_t blocks : {1u, 3u, kRows / kBlockTokens}) {
    for (int rep = 0; rep < 20; ++rep) {
      Status outcome, written;
      auto task = BackupTask_(blocks, ticket++, -1, &outcome, &written);
      ASSERT_EQ((*b)->StartBackup(task), StartResult::kCompleted);
      ASSERT_TRUE(outcome.ok()) << outcome.ToString();
      ASSERT_EQ(task->checksums.size(), blocks);
      for (uint32_t i = 0; i < blocks; ++i) {
        ASSERT_EQ(task->checksums[i], XXH3_64bits(task->payloads[i], BlockBytes()))
            << blocks << " blocks, block " << i << ", rep " << rep;
      }
    }
  }
}

TEST_F(HostBackendTest, BuffersAndEventsByFd) {
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*b)->event_count(), kSlots);
  EXPECT_EQ((*b)->num_rows(), kRows);
  // The fds are borrowed: still open, and the mapping outlives them.
  EXPECT_GE(::fcntl(k_->fd(), F_GETFD), 0);
  Status outcome, written;

  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_EQ(events_->Slot(0).load(), 1u);
}

TEST_F(HostBackendTest, MappingRecordsShrinkSeal) {
  auto sealed = ClientObject::Memfd(8192, F_SEAL_SHRINK | F_SEAL_SEAL);
  auto open = ClientObject::Memfd(8192);
  ASSERT_TRUE(sealed->ok() && open->ok());
  auto a = ShmMapping::FromFd(sealed->fd(), 8192, "f");
  auto c = ShmMapping::FromFd(open->fd(), 8192, "f");
  ASSERT_TRUE(a.ok() && c.ok());
  EXPECT_TRUE((*a)->sealed());
  EXPECT_FALSE((*c)->sealed());
  EXPECT_FALSE(sealed->Truncate(0));  // what the seal is for
}

TEST_F(HostBackendTest, FdIdWithoutFdIsRefused) {
  RegisterSpec s = Spec();
  s.buffers[1].fd = -1;
  auto b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(b.status(), "buffers[1].host_fd_id")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "names no fd passed on this caller's session"));
  s = Spec();
  s.events.fd = -1;
  b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(Has(b.status(), "events.host_fd_id")) << b.status().ToString();
}

TEST_F(HostBackendTest, FdMustBeReadWriteRegularAndLargeEnough) {
  auto obj = ClientObject::Shm("ro", kPlaneBytes);
  ASSERT_TRUE(obj->ok());
  const int ro = ::shm_open(obj->name().c_str(), O_RDONLY, 0);
  ASSERT_GE(ro, 0);
  RegisterSpec s = Spec();
  s.buffers[0] = ByFd(ro, kPlaneBytes);
  auto b = Bind(s);
  ::close(ro);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kPermissionDenied) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "buffers[0].host_fd_id"));
  EXPECT_TRUE(Has(b.status(), "O_RDWR"));

  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  const int rw = ::open(("/proc/self/fd/" + std::to_string(p[0])).c_str(), O_RDWR);
  s = Spec();
  s.buffers[0] = ByFd(rw >= 0 ? rw : p[0], kPlaneBytes);
  b = Bind(s);
  ::close(p[0]);
  ::close(p[1]);
  if (rw >= 0) ::close(rw);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "buffers[0].host_fd_id"));

  auto small = ClientObject::Memfd(kPlaneBytes / 2);
  s = Spec();
  s.buffers[1] = ByFd(small->fd(), kPlaneBytes);
  b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(b.status(), "buffers[1].host_fd_id")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "registered"));
}

TEST_F(HostBackendTest, DaemonsOwnPoolIsRefusedByNameAndByFd) {
  auto pool = ClientObject::Shm("pool", 1 << 20);  // stands for the daemon's pool object
  ASSERT_TRUE(pool->ok());
  // Before the backend knows its pool, the object is just an object (today's behaviour).
  RegisterSpec s = Spec();
  s.buffers[0] = ByName(*pool);
  s.buffers[0].size_bytes = kPlaneBytes;
  ASSERT_TRUE(Bind(s).ok());

  ASSERT_TRUE(backend_->SetPoolObject(pool->name().substr(1)).ok());
  auto b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(Has(b.status(), "buffers[0].host_shm_name")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "own pool"));

  s = Spec();
  s.buffers[1] = ByFd(pool->fd(), kPlaneBytes);
  b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(Has(b.status(), "buffers[1].host_fd_id")) << b.status().ToString();

  s = Spec();
  s.events.host_fd_id = 0;
  s.events.fd = -1;
  s.events.host_shm_name = pool->name();
  b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(Has(b.status(), "events.host_shm_name")) << b.status().ToString();
  EXPECT_FALSE(backend_->SetPoolObject("/hiq-host-backend-test-no-such-pool").ok());
}

TEST_F(HostBackendTest, NameOwnedByAnotherUidIsRefusedForAnAuthenticatedCaller) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a shm object";
  auto obj = ClientObject::Shm("foreign", kPlaneBytes);
  ASSERT_TRUE(obj->ok());
  ASSERT_EQ(::fchown(obj->fd(), 61001, 61001), 0);
  RegisterSpec s = Spec();
  s.buffers[0] = ByName(*obj);

  s.caller.session = 5;  // authenticated, uid 0: not the owner
  s.caller.uid = 0;
  auto b = Bind(s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(Has(b.status(), "buffers[0].host_shm_name")) << b.status().ToString();
  EXPECT_TRUE(Has(b.status(), "belongs to uid 61001"));

  s.caller.uid = 61001;  // the owner
  EXPECT_TRUE(Bind(s).ok());
  s.caller = Caller{};  // anonymous: today's behaviour, for now
  EXPECT_TRUE(Bind(s).ok());
  // By fd, the fd is the proof of access.
  s.caller.session = 5;
  s.caller.uid = 0;
  s.buffers[0] = ByFd(obj->fd(), kPlaneBytes);
  EXPECT_TRUE(Bind(s).ok());
}

TEST_F(HostBackendTest, NamesAreNotFollowedThroughSymlinks) {
  auto obj = ClientObject::Shm("target", kPlaneBytes);
  ASSERT_TRUE(obj->ok());
  const std::string link = obj->name() + "-link";
  ::unlink(("/dev/shm" + link).c_str());
  ASSERT_EQ(::symlink(("/dev/shm" + obj->name()).c_str(), ("/dev/shm" + link).c_str()), 0);
  RegisterSpec s = Spec();
  s.buffers[0] = ByName(*obj);
  s.buffers[0].host_shm_name = link;
  auto b = Bind(s);
  ::unlink(("/dev/shm" + link).c_str());
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(Has(b.status(), "buffers[0].host_shm_name")) << b.status().ToString();
}

TEST_F(HostBackendTest, TicketsNeverReachTheFailureBit) {
  events_->Slot(0).store(41);
  events_->Slot(1).store(50 | kHostEventFailedBit);  // a failed ticket of an earlier daemon
  events_->Slot(2).store(~uint64_t{0});              // garbage: every bit set
  events_->Slot(3).store(kHostEventFailedBit - 1);   // 2^63 - 1: the next would be bit 63
  events_->Slot(4).store(kHostTicketLimit | 7);      // at the limit
  events_->Slot(5).store(kHostEventFailedBit);       // bit 63 alone: ticket part 0
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->TicketFloor(), 50u);
  EXPECT_EQ(events_->Slot(0).load(), 41u);
  EXPECT_EQ(events_->Slot(1).load(), 50u | kHostEventFailedBit);
  EXPECT_EQ(events_->Slot(2).load(), 0u);  // reset
  EXPECT_EQ(events_->Slot(3).load(), 0u);
  EXPECT_EQ(events_->Slot(4).load(), 0u);
  // A success on the reset slot reads as a success.
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(1, 51, 2, &outcome, &written)), StartResult::kCompleted);
  EXPECT_TRUE(outcome.ok());
  EXPECT_EQ(events_->Slot(2).load(), 51u);
  EXPECT_EQ(events_->Slot(2).load() & kHostEventFailedBit, 0u);
}

TEST_F(HostBackendTest, TruncatedKvUnderBackupFailsTheTaskAndTheBinding) {
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE((*b)->Failure().ok());
  ASSERT_TRUE(v_->Truncate(0));
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kFailedPrecondition) << outcome.ToString();
  EXPECT_TRUE(Has(outcome, "buffers[1]: the client's shared memory shrank under the daemon"))
      << outcome.ToString();
  EXPECT_EQ(written.code(), StatusCode::kFailedPrecondition);  // nothing committed
  EXPECT_EQ(events_->Slot(0).load(), 1u | kHostEventFailedBit);
  // What the core answers new requests on this pool with.
  EXPECT_EQ((*b)->Failure().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has((*b)->Failure(), "buffers[1]"));
  // The binding is failed for good: a later task fails the same way, also a restore.
  Status again, again_written;
  (*b)->StartBackup(BackupTask_(1, 2, 0, &again, &again_written));
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(again, "buffers[1]"));
  Status restored;
  (*b)->StartRestore(RestoreTask_(1, 3, 4, 1, &restored));
  EXPECT_EQ(restored.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(events_->Slot(4).load(), 3u | kHostEventFailedBit);
  EXPECT_EQ(events_->Slot(1).load(), 3u | kHostEventFailedBit);
  (*b)->Cancel();
  (*b)->Close();
}

TEST_F(HostBackendTest, TruncatedKvUnderRestoreFailsItsLayersAndDone) {
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok());
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, -1, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok());
  ASSERT_TRUE(k_->Truncate(0));
  Status restored;
  ASSERT_EQ((*b)->StartRestore(RestoreTask_(2, 2, 4, 1, &restored)), StartResult::kCompleted);
  EXPECT_EQ(restored.code(), StatusCode::kFailedPrecondition) << restored.ToString();
  EXPECT_TRUE(Has(restored, "buffers[0]: the client's shared memory shrank"));
  // Layer 0 writes K first: no layer event says success.
  EXPECT_EQ(events_->Slot(4).load(), 2u | kHostEventFailedBit);
  EXPECT_EQ(events_->Slot(5).load(), 2u | kHostEventFailedBit);
  EXPECT_EQ(events_->Slot(1).load(), 2u | kHostEventFailedBit);
}

TEST_F(HostBackendTest, TruncatedEventObjectFailsTheBinding) {
  auto b = Bind(Spec());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(events_->Truncate(0));
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(1, 1, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kFailedPrecondition) << outcome.ToString();
  EXPECT_TRUE(Has(outcome, "events: the client's shared memory shrank")) << outcome.ToString();
  // A task that waits on an event of the truncated object fails at once instead of waiting.
  auto t = BackupTask_(1, 2, -1, &outcome, &written);
  t->wait_event = 3;
  EXPECT_EQ((*b)->StartBackup(t), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kFailedPrecondition);
}

// Mappings of this process (/proc/self/maps) of the object behind `fd` (by inode).
int MappingsOf(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return -1;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms, offset, dev;
    uint64_t inode = 0;
    if (fields >> range >> perms >> offset >> dev >> inode && inode == st.st_ino &&
        line.find("hugetlb") != std::string::npos) {
      ++n;
    }
  }
  return n;
}

// Resident bytes (smaps' Rss) of this process's mappings of the object behind `fd`: the test's
// own (the client's) and the daemon's (the bindings').
uint64_t RssOf(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return 0;
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool ours = false;
  uint64_t kib = 0;
  while (std::getline(smaps, line)) {
    std::istringstream fields(line);
    std::string first;
    fields >> first;
    if (first.find('-') != std::string::npos) {  // a mapping's header: range perms off dev inode
      std::string perms, offset, dev;
      uint64_t inode = 0;
      ours = fields >> perms >> offset >> dev >> inode && inode == st.st_ino;
    } else if (ours && first == "Rss:") {
      uint64_t n = 0;
      fields >> n;
      kib += n;
    }
  }
  return kib * 1024;
}

// The registration-time mapping of a client's resident pages is bounded per client, across its
// pools: the first binding maps all of its buffers, the second what is left of the allowance,
// the third nothing; each gives its part back when it goes.
TEST_F(HostBackendTest, MapAheadIsBoundedPerClientAcrossPools) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t allowance = 2 * kPlaneBytes + 2 * page;  // one pool's buffers and 2 pages
  auto budget = std::make_shared<FaultBudget>(uint64_t{1} << 30, allowance);
  const uint64_t client = RssOf(k_->fd()) + RssOf(v_->fd());
  ASSERT_EQ(client, 2 * kPlaneBytes);  // the client wrote its buffers
  auto first = Bind(Spec(), budget);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(budget->map_ahead(), 2 * kPlaneBytes);
  EXPECT_EQ(RssOf(k_->fd()) + RssOf(v_->fd()) - client, 2 * kPlaneBytes);
  auto second = Bind(Spec(), budget);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto third = Bind(Spec(), budget);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_EQ(budget->map_ahead(), allowance);
  // The daemon's mappings hold exactly the allowance of the client's pages, mapped ahead.
  EXPECT_EQ(RssOf(k_->fd()) + RssOf(v_->fd()) - client, allowance);
  first->reset();
  EXPECT_EQ(budget->map_ahead(), 2 * page);
  second->reset();
  third->reset();
  EXPECT_EQ(budget->map_ahead(), 0u);
  // Without a budget (no quotas) a binding maps its buffers whole.
  auto unbudgeted = Bind(Spec());
  ASSERT_TRUE(unbudgeted.ok()) << unbudgeted.status().ToString();
  EXPECT_EQ(RssOf(k_->fd()) + RssOf(v_->fd()) - client, 2 * kPlaneBytes);
}

#define SKIP_WITHOUT_HUGETLB(object)                                                           \
  if (!(object)->ok()) {                                                                       \
    GTEST_SKIP() << "no free hugetlb pages (vm.nr_hugepages is "                               \
                 << machine::MeminfoField("HugePages_Total") << "): reserve some to run this"; \
  }

// A hugetlbfs buffer registered with a size that is no whole number of huge pages: the daemon
// maps (and unmaps) it in whole huge pages, backs up from it, and charges none of its pages to
// the fault budget although its own page tables have none of them yet (mincore would say "not
// resident"); an object smaller than registered is refused.
TEST_F(HostBackendTest, HugetlbBufferIsMappedInWholePagesAndChargesNothing) {
  auto k = ClientObject::Hugetlb(kPlaneBytes);
  SKIP_WITHOUT_HUGETLB(k);
  std::memcpy(k->data(), k_->data(), kPlaneBytes);  // the client writes its KV
  events_->Slot(0).store(0);                        // and its slots
  RegisterSpec s = Spec();
  s.buffers[0] = ByFd(k->fd(), kPlaneBytes, 1);
  ASSERT_NE(kPlaneBytes % machine::HugePageBytes(), 0u);
  auto budget = std::make_shared<FaultBudget>(1 << 20);
  EXPECT_EQ(MappingsOf(k->fd()), 1);  // the client's
  {
    auto b = Bind(s, budget);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(MappingsOf(k->fd()), 2);
    Status outcome, written;
    ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
    ASSERT_TRUE(outcome.ok()) << outcome.ToString();
    EXPECT_EQ(budget->charged(), 0u) << "hugetlb pages the client wrote were charged";
    const std::vector<uint8_t> from_hugetlb = payload_;

    // The same rows from a plain memfd encode to the same bytes.
    auto plain = Bind(Spec());
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    ASSERT_EQ((*plain)->StartBackup(BackupTask_(2, 2, -1, &outcome, &written)),
              StartResult::kCompleted);
    ASSERT_TRUE(outcome.ok()) << outcome.ToString();
    EXPECT_TRUE(from_hugetlb == payload_);
  }
  EXPECT_EQ(MappingsOf(k->fd()), 1) << "the daemon's mapping outlived its binding";

  s.buffers[0] = ByFd(k->fd(), k->size() + 4096, 1);
  auto larger = Bind(s);
  EXPECT_EQ(larger.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(larger.status(), "buffers[0].host_fd_id")) << larger.status().ToString();
}

// A client lends a hugetlbfs buffer whose pages it reserved (mapped) but never wrote: the daemon
// refuses it at Bind without allocating a page; written, it is served. A page hole-punched after
// Bind fails each task that finds it (FAILED_PRECONDITION naming the buffer, nothing allocated,
// the done event failed), and the pool serves again once the client writes the page back.
TEST_F(HostBackendTest, HugetlbPagesAreNeverAllocatedForTheClient) {
  const uint64_t page = machine::HugePageBytes();
  auto k = ClientObject::Hugetlb(page + kPlaneBytes);  // two huge pages, the rows in the first
  SKIP_WITHOUT_HUGETLB(k);
  ASSERT_EQ(k->size(), 2 * page);
  ASSERT_EQ(AllocatedBytes(k->fd()), 0u);
  events_->Slot(0).store(0);
  RegisterSpec s = Spec();
  s.buffers[0] = ByFd(k->fd(), k->size(), 1);

  auto refused = Bind(s);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition)
      << refused.status().ToString();
  EXPECT_TRUE(Has(refused.status(), "buffers[0].host_fd_id")) << refused.status().ToString();
  EXPECT_TRUE(Has(refused.status(), std::to_string(2 * page) + " of its"))
      << refused.status().ToString();
  EXPECT_TRUE(Has(refused.status(), "not allocated")) << refused.status().ToString();
  EXPECT_EQ(AllocatedBytes(k->fd()), 0u) << "the refused Bind allocated hugetlb pages";
  EXPECT_EQ(MappingsOf(k->fd()), 1);  // the client's only

  std::memcpy(k->data(), k_->data(), kPlaneBytes);  // the client writes its KV
  std::memset(k->data() + page, 0, page);           // and the rest of its object
  ASSERT_EQ(AllocatedBytes(k->fd()), 2 * page);
  auto b = Bind(s);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  const std::vector<uint8_t> stored = payload_;

  // The client punches its second page out (the rows stay in the first).
  ASSERT_EQ(::fallocate(k->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(page), static_cast<off_t>(page)),
            0)
      << std::strerror(errno);
  ASSERT_EQ(AllocatedBytes(k->fd()), page);
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 2, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kFailedPrecondition) << outcome.ToString();
  EXPECT_TRUE(Has(
      outcome, "buffers[0]: the client's hugetlbfs object has " + std::to_string(page) + " of its"))
      << outcome.ToString();
  EXPECT_EQ(written.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(events_->Slot(0).load(), 2u | kHostEventFailedBit);
  Status restored;
  ASSERT_EQ((*b)->StartRestore(RestoreTask_(2, 3, -1, 0, &restored)), StartResult::kCompleted);
  EXPECT_EQ(restored.code(), StatusCode::kFailedPrecondition) << restored.ToString();
  EXPECT_EQ(AllocatedBytes(k->fd()), page) << "a task allocated a hugetlb page for the client";

  // Written back, the page is the client's again and the pool serves.
  std::memset(k->data() + page, 0, page);
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 4, 0, &outcome, &written)), StartResult::kCompleted);
  ASSERT_TRUE(outcome.ok()) << outcome.ToString();
  EXPECT_TRUE(payload_ == stored);
  EXPECT_EQ(events_->Slot(0).load(), 4u);
}

// A client that shrinks an unsealed hugetlbfs buffer under the daemon: the task fails, the
// binding fails for good, the process lives (the SIGBUS guard replaces whole huge pages).
TEST_F(HostBackendTest, TruncatedHugetlbBufferFailsTheBinding) {
  auto k = ClientObject::Hugetlb(kPlaneBytes);
  SKIP_WITHOUT_HUGETLB(k);
  std::memcpy(k->data(), k_->data(), kPlaneBytes);
  RegisterSpec s = Spec();
  s.buffers[0] = ByFd(k->fd(), kPlaneBytes, 1);
  auto b = Bind(s);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE(k->Truncate(0));
  Status outcome, written;
  ASSERT_EQ((*b)->StartBackup(BackupTask_(2, 1, 0, &outcome, &written)), StartResult::kCompleted);
  EXPECT_EQ(outcome.code(), StatusCode::kFailedPrecondition) << outcome.ToString();
  EXPECT_TRUE(Has(outcome, "buffers[0]: the client's shared memory shrank")) << outcome.ToString();
  EXPECT_EQ(written.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(events_->Slot(0).load(), 1u | kHostEventFailedBit);
  b->reset();
  EXPECT_EQ(MappingsOf(k->fd()), 1);
}

}  // namespace
}  // namespace hiqcache::server
