// PoolRegion: the daemon's one POSIX shared-memory object holding the L2 pool, mapped
// read-write (Boost.Interprocess shared_memory_object + mapped_region) and pre-faulted in
// parallel so no request pays for a page fault. The daemon is its only writer; clients never
// map it. Move-only RAII; the object itself stays in /dev/shm after the daemon exits so that a
// restarted daemon can reattach (see pool_format.h). Thread-safe after Open.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "hiqcache/status.h"

namespace hiqcache::server {

class PoolRegion {
 public:
  // Creates (or resizes) shm object `name` to `bytes` and maps it. First checks that the
  // filesystem holding POSIX shm objects (/dev/shm) has room for it (CheckShmRoom): a sparse
  // object larger than that maps fine and SIGBUSes on the first write past the free space.
  // The object must be the daemon's own: one owned by another uid (or not a regular file) is
  // refused (FAILED_PRECONDITION naming shm_name); one of ours that group or others may access
  // is replaced by a new, empty 0600 object (its blocks are not reattached: whoever could open
  // it may still write it).
  static StatusOr<std::unique_ptr<PoolRegion>> Open(const std::string& name, uint64_t bytes);
  ~PoolRegion();
  PoolRegion(const PoolRegion&) = delete;
  PoolRegion& operator=(const PoolRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Allocates every page of the object (zeroed where new, values kept where present) with
  // `threads` threads taking 64 MiB steps, so that no write to the pool ever faults a page in or
  // finds the filesystem full: fallocate(2) on the object (no page tables touched: 2-3x faster
  // than faulting the mapping on tmpfs), else a write fault per page (MADV_POPULATE_WRITE, else
  // a write per page). Each step's bytes are added to `*done` when given. Stops early once
  // `*stop` is true (checked between steps: CANCELLED). RESOURCE_EXHAUSTED when the filesystem
  // runs out of room (another object took it since Open checked).
  Status Prefault(unsigned threads, std::atomic<uint64_t>* done = nullptr,
                  const std::atomic<bool>* stop = nullptr);
  // Maps every page of the region into the daemon's page tables (MADV_POPULATE_WRITE, one
  // thread), so that a request's first touch of a page takes no minor fault either. Runs after
  // Prefault, while the daemon serves; stops early once `*stop` is true. Returns the bytes mapped.
  uint64_t MapPages(const std::atomic<bool>* stop = nullptr);

 private:
  struct Impl;
  PoolRegion(std::unique_ptr<Impl> impl, std::string name);
  std::unique_ptr<Impl> impl_;
  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// FAILED_PRECONDITION, naming pool_bytes and the free space, when the filesystem at `shm_dir`
// cannot hold an object `bare_name` (a file in shm_dir) of `bytes` bytes: the pages that object
// already has allocated (a pool being reattached) count as held, the rest must be free
// (statvfs f_bavail). OK when it fits. Open calls it with "/dev/shm".
Status CheckShmRoom(const std::string& shm_dir, const std::string& bare_name, uint64_t bytes);

}  // namespace hiqcache::server
