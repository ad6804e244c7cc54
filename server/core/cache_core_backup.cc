// CacheCore's backup requests: validation against the pool, the quota charge, the split into
// sub-tasks on the pool's strand, each sub-task's step, and the reply (cache_core.h).

#include <algorithm>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/cache_core.h"
#include "core/cache_core_internal.h"
#include "hiqcache/log.h"
#include "hiqcache/xxh3.h"

namespace hiqcache::server {

void CacheCore::Backup(TransferSpec spec, BackupDone done) {
  try {
    BackupImpl(std::move(spec), &done);
  } catch (const std::bad_alloc&) {
    // Thrown before anything was queued or charged (BackupImpl allocates first), and before
    // `done` was moved from.
    if (done) done(OutOfMemory("Backup"));
  }
}

void CacheCore::BackupImpl(TransferSpec spec, BackupDone* done) {
  auto found = PoolForTransfer(spec, /*restore=*/false);
  if (!found.ok()) return (*done)(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();

  auto req = std::make_shared<BackupRequest>();
  req->pool = pool;
  const size_t n = spec.blocks.size();
  req->keys = KeysOf(spec.blocks, n);
  req->result.results.assign(n, BlockResult::kStored);
  {
    // A key repeated within the request is reserved (and written) once.
    std::unordered_set<BlockKey, BlockKeyHash> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (seen.insert(req->keys[i]).second) {
        req->unique.push_back(i);
      } else {
        req->result.results[i] = BlockResult::kAlreadyPresent;
      }
    }
  }
  req->device = pool->binding->SignalsOnDevice();
  const size_t per_task = req->device ? req->unique.size() : ChunkBlocks(pool->layout);
  if (std::min(per_task, req->unique.size()) > options_.quotas.max_reserved_slots_per_client) {
    return (*done)(ResourceExhausted(
        "blocks: this backup reserves " + std::to_string(req->unique.size()) +
        " pool slots at once, more than the " +
        std::to_string(options_.quotas.max_reserved_slots_per_client) +
        " a client may hold (quota max_reserved_slots_per_client): split the request"));
  }
  if (req->device) {
    req->chunks.emplace_back(0, req->unique.size());
  } else {
    // HOST: the wait for wait_event is a sub-task of its own, so that no slot is reserved before
    // the engine's data is there.
    req->gated = spec.wait_event >= 0;
    if (req->gated) req->chunks.emplace_back(0, 0);
    for (const auto& r : Ranges(req->unique.size(), per_task)) req->chunks.push_back(r);
  }
  req->pending_bytes = SaturatingMul(req->unique.size(), InputBlockBytes(pool->layout));
  req->sync = spec.sync;
  std::vector<TransferEngine::StepTask> steps;
  steps.reserve(req->chunks.size());
  for (size_t c = 0; c < req->chunks.size(); ++c) {
    steps.push_back([this, req, c, task = std::shared_ptr<BackupTask>()]() mutable {
      return BackupStep(req, c, &task);
    });
  }
  req->reply = std::make_shared<BackupDone>();
  Pool::InFlight touches = pool->Touches(/*restore=*/false, spec);

  if (Status st = Admit(*req, spec.pool_id); !st.ok()) return (*done)(st);
  *req->reply = std::move(*done);
  req->spec = std::move(spec);
  // Accepted (async): see cache_core.h (Reservations) for what BLOCK_STORED means here.
  PostRequest(*req, pool->strand, std::move(touches), std::move(steps), "Backup");
}

// The reservations of one backup sub-task, shared by its callbacks.
struct BackupChunkWrites {
  std::vector<BlockStore::WriteReservation> reservations;
  std::vector<size_t> index;  // request index of each reserved block
  bool settled = false;       // committed or aborted
};

TransferEngine::StepResult CacheCore::BackupStep(const std::shared_ptr<BackupRequest>& req,
                                                 size_t c, std::shared_ptr<BackupTask>* slot) {
  Pool& pool = *req->pool;
  const bool last = c + 1 == req->chunks.size();
  const TransferSpec& spec = req->spec;
  std::shared_ptr<BackupChunkWrites> writes;
  try {
    if (WaitsToStart(*req, c, *slot == nullptr)) return TransferEngine::StepResult::kNotReady;
    if (*slot == nullptr) {
      auto task = std::make_shared<BackupTask>();
      task->ticket = req->result.ticket;
      task->caller_deadline = spec.deadline;
      task->defer = DeferOnStrand(pool.strand);
      BackupTask* raw = task.get();
      if (!req->error.ok()) {
        // An earlier sub-task failed: the rest reserve and read nothing; the last one still
        // releases done_event, with the failure bit.
        if (!last) return TransferEngine::StepResult::kDone;
        if (spec.done_event < 0) {
          FinishBackup(req);
          return TransferEngine::StepResult::kDone;
        }
        task->wait_event = ProbeEvent(spec);
        task->wait_value = kNeverValue;
        task->first_try = LongAgo();
        task->done_event = spec.done_event;
        task->on_written = [](const std::vector<uint8_t>&, const Status&) {};
        task->on_complete = [this, req](const Status&) { FinishBackup(req); };
      } else if (req->gated && c == 0) {
        task->wait_event = spec.wait_event;
        task->wait_value = spec.wait_value;
        task->on_written = [](const std::vector<uint8_t>&, const Status&) {};
        task->on_complete = [req](const Status& run) {
          if (!run.ok() && req->error.ok()) req->error = run;
        };
      } else {
        const auto [b, e] = req->chunks[c];
        if (!quotas_.MayReserve(pool.client, e - b)) return TransferEngine::StepResult::kNotReady;
        task->wait_event = req->device ? spec.wait_event : -1;  // HOST: the gate waited
        task->wait_value = spec.wait_value;
        task->done_event = last ? spec.done_event : -1;
        std::vector<BlockKey> keys;
        keys.reserve(e - b);
        for (size_t j = b; j < e; ++j) keys.push_back(req->keys[req->unique[j]]);
        writes = std::make_shared<BackupChunkWrites>();
        writes->index.reserve(e - b);
        task->payloads.reserve(e - b);
        task->rows.reserve((e - b) * pool.layout.block_tokens);
        // Reserved now that the task starts: a backup still waiting holds no slot.
        auto res = store_->ReserveWrites(pool.ns->id, keys);
        for (size_t j = 0; j < res.size(); ++j) {
          const size_t i = req->unique[b + j];
          switch (res[j].outcome) {
            case BlockStore::WriteOutcome::kReserved:
              writes->index.push_back(i);
              writes->reservations.push_back(res[j]);
              task->payloads.push_back(res[j].payload);
              task->rows.insert(task->rows.end(), spec.blocks[i].rows.begin(),
                                spec.blocks[i].rows.end());
              break;
            case BlockStore::WriteOutcome::kPresent:
              req->result.results[i] = BlockResult::kAlreadyPresent;
              break;
            case BlockStore::WriteOutcome::kNoSpace:
              req->result.results[i] = BlockResult::kRejected;
              break;
          }
        }
        const int64_t reserved = static_cast<int64_t>(writes->reservations.size());
        quotas_.AddReserved(pool.client, reserved);
        BlockStore* store = store_;
        const size_t payload_bytes = pool.layout.BlockBytes();
        const uint64_t client = pool.client;
        // The callbacks live in the task: they hold a raw pointer to it, never a reference that
        // would make the task own itself. The backend keeps the task alive while it calls them.
        L3Tier* l3 = options_.l3;
        task->on_written = [this, store, l3, req, writes, payload_bytes, raw, client, reserved](
                               const std::vector<uint8_t>& nonfinite, const Status& st) {
          if (writes->settled) return;
          writes->settled = true;
          const std::vector<uint64_t>& sums = raw->checksums;
          for (size_t j = 0; j < writes->reservations.size(); ++j) {
            const auto& r = writes->reservations[j];
            if (!st.ok() || j >= nonfinite.size() || nonfinite[j]) {
              store->AbortWrite(r.handle, /*rejected=*/st.ok());
              req->result.results[writes->index[j]] = BlockResult::kRejected;
              continue;
            }
            store->CommitWrite(r.handle,
                               j < sums.size() ? sums[j] : XXH3_64bits(r.payload, payload_bytes));
            ++req->moved;
            if (l3 != nullptr) {
              const NamespaceInfo& ns = *req->pool->ns;
              l3->Published(ns.id, ns.hash, payload_bytes, req->keys[writes->index[j]]);
            }
          }
          quotas_.AddReserved(client, -reserved);
        };
        task->on_complete = [this, req, writes, last, raw](const Status& run) {
          if (!writes->settled) {
            // The backend ended the task without on_written: nothing of it is valid.
            raw->on_written(std::vector<uint8_t>(writes->reservations.size(), 0),
                            run.ok() ? Status(StatusCode::kInternal, "no payloads written") : run);
          }
          if (!run.ok() && req->error.ok()) req->error = run;
          if (last) FinishBackup(req);
        };
      }
      *slot = std::move(task);
    }
    std::shared_ptr<BackupTask> task = *slot;
    return StepOf(pool.binding->StartBackup(task));
  } catch (const std::exception& ex) {
    Status threw = TaskThrew("Backup", pool.id, req->result.ticket, ex);
    if (req->error.ok()) req->error = threw;
    if (*slot != nullptr && (*slot)->on_complete) {
      // Settles the sub-task's reservations (and, for the last one, finishes the request).
      std::shared_ptr<BackupTask> task = *slot;
      task->on_complete(req->error);
    } else if (writes != nullptr && !writes->settled) {
      writes->settled = true;
      for (const auto& r : writes->reservations) store_->AbortWrite(r.handle, false);
      quotas_.AddReserved(pool.client, -static_cast<int64_t>(writes->reservations.size()));
    }
    if (last) FinishBackup(req);
    return TransferEngine::StepResult::kDone;
  }
}

void CacheCore::FinishBackup(const std::shared_ptr<BackupRequest>& req) {
  if (req->finished) return;
  req->finished = true;
  Pool& pool = *req->pool;
  const Status& run = req->error;
  CoreObserver* observer = options_.observer;
  if (observer != nullptr && req->moved > 0) {
    observer->OnTransfer(SampleOf(*pool.ns, pool.layout, /*restore=*/false, req->moved,
                                  std::chrono::steady_clock::now() - req->started, run.ok()));
  }
  pool.backups.fetch_add(req->moved, std::memory_order_relaxed);
  EndRequest(*req, "backup");
}

}  // namespace hiqcache::server
