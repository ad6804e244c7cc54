// CacheCore's restore requests: validation against the pool, the quota charge, the split into
// sub-tasks on the pool's strand, each sub-task's step, and the reply (cache_core.h).
#include <algorithm>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/cache_core.h"
#include "core/cache_core_internal.h"
#include "hiqcache/log.h"

namespace hiqcache::server {

void CacheCore::Restore(TransferSpec spec, RestoreDone done) {
  try {
    RestoreImpl(std::move(spec), &done);
  } catch (const std::bad_alloc&) {
    if (done) done(OutOfMemory("Restore"));
  }
}

void CacheCore::RestoreImpl(TransferSpec spec, RestoreDone* done) {
  // Also refuses a restore that names a row twice: its cost is bounded by the rows it writes.
  auto found = PoolForTransfer(spec, /*restore=*/true);
  if (!found.ok()) return (*done)(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();

  auto req = std::make_shared<RestoreRequest>();
  req->pool = pool;
  std::vector<BlockKey> keys = KeysOf(spec.blocks, spec.blocks.size());
  {
    // A key named twice is restored once: the leading run ends before its second occurrence
    // (the engine recomputes the rest, as for a missing block).
    std::unordered_set<BlockKey, BlockKeyHash> seen;
    seen.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!seen.insert(keys[i]).second) {
        keys.resize(i);
        break;
      }
    }
  }
  req->device = pool->binding->SignalsOnDevice();
  req->sync = spec.sync;
  const uint64_t per_block = InputBlockBytes(pool->layout);
  req->pending_bytes = SaturatingMul(keys.size(), per_block);
  req->pins.reserve(keys.size());
  req->reply = std::make_shared<RestoreDone>();
  Pool::InFlight touches = pool->Touches(/*restore=*/true, spec);
  if (Status st = Admit(*req, spec.pool_id); !st.ok()) return (*done)(st);
  std::vector<TransferEngine::StepTask> steps;
  try {
    // Pinned on arrival: the answer says how many leading blocks will be restored.
    req->pins = store_->PinReads(pool->ns->id, keys);
    if (options_.l3 != nullptr && req->pins.size() < keys.size()) {
      // The blocks after the pool's run come from L3 into the pool, then are restored from the
      // pool as any other block (same tasks, same events).
      const size_t have = req->pins.size();
      const std::span<const BlockKey> rest = std::span<const BlockKey>(keys).subspan(have);
      if (PromoteFromL3(*pool, rest) > 0) {
        std::vector<BlockStore::ReadPin> more = store_->PinReads(pool->ns->id, rest);
        req->pins.insert(req->pins.end(), more.begin(), more.end());
      }
    }
    const uint64_t pinned_bytes = SaturatingMul(req->pins.size(), per_block);
    quotas_.UnchargePending(pool->client, req->pending_bytes - pinned_bytes);
    req->pending_bytes = pinned_bytes;
    // A device takes the request as one task. HOST sub-tasks go layer-major where the engine
    // waits layer by layer, so that its forward pass starts on layer 0 while later layers decode.
    const uint32_t layers = pool->layout.num_layers;
    const size_t n = req->pins.size();
    if (req->device) {
      req->chunks = {{0, n, 0, layers}};
    } else if (spec.layer_event_base >= 0) {
      req->chunks = LayerMajorPieces(n, layers, per_block / std::max<uint32_t>(1, layers),
                                     options_.transfer_chunk_bytes, options_.transfer_chunk_blocks);
    } else {
      for (const auto& [b, e] : Ranges(n, ChunkBlocks(pool->layout))) {
        req->chunks.push_back({b, e, 0, layers});
      }
    }
    steps.reserve(req->chunks.size());
    for (size_t c = 0; c < req->chunks.size(); ++c) {
      steps.push_back([this, req, c, task = std::shared_ptr<RestoreTask>()]() mutable {
        return RestoreStep(req, c, &task);
      });
    }
  } catch (const std::bad_alloc&) {
    for (const auto& p : req->pins) store_->Unpin(p.handle);
    quotas_.UnchargePending(pool->client, req->pending_bytes);
    pool->EndTask();
    return (*done)(OutOfMemory("Restore"));
  }
  req->result.restored_blocks = static_cast<uint32_t>(req->pins.size());
  *req->reply = std::move(*done);
  req->spec = std::move(spec);
  if (!PostRequest(*req, pool->restore_strand, std::move(touches), std::move(steps), "Restore")) {
    for (const auto& p : req->pins) store_->Unpin(p.handle);
  }
}

TransferEngine::StepResult CacheCore::RestoreStep(const std::shared_ptr<RestoreRequest>& req,
                                                  size_t c, std::shared_ptr<RestoreTask>* slot) {
  Pool& pool = *req->pool;
  const bool last = c + 1 == req->chunks.size();
  const TransferSpec& spec = req->spec;
  const RestorePiece piece = req->chunks[c];
  const size_t b = piece.begin, e = piece.end;
  // Whether this sub-task writes the last layer of its blocks (they are restored when it ends),
  // and whether it writes the last blocks of its layers (their events may go out).
  const bool ends_blocks = piece.end_layer == pool.layout.num_layers;
  const bool ends_layers = e == req->pins.size();
  // Drops the pins of this sub-task's blocks once: the device has finished reading those
  // payloads (or never will), so they may be evicted from now on.
  auto unpin = [this, req, b, e] {
    for (size_t j = b; j < e; ++j) {
      if (req->pins[j].handle != nullptr) store_->Unpin(req->pins[j].handle);
      req->pins[j].handle = nullptr;
    }
  };
  try {
    if (WaitsToStart(*req, c, *slot == nullptr)) return TransferEngine::StepResult::kNotReady;
    if (*slot == nullptr) {
      auto task = std::make_shared<RestoreTask>();
      task->ticket = req->result.ticket;
      task->caller_deadline = spec.deadline;
      task->defer = DeferOnStrand(pool.restore_strand);
      if (!req->error.ok()) {
        // An earlier sub-task failed: the rest write nothing; the last one still releases the
        // layer events not yet signalled and done_event, with the failure bit (a layer that
        // went out whole stays so: the engine may have read it already).
        unpin();
        if (!last) return TransferEngine::StepResult::kDone;
        if (spec.done_event < 0 && spec.layer_event_base < 0) {
          FinishRestore(req);
          return TransferEngine::StepResult::kDone;
        }
        task->wait_event = ProbeEvent(spec);
        task->wait_value = kNeverValue;
        task->first_try = LongAgo();
        task->first_layer = req->layers_signalled;
        task->layer_event_base = spec.layer_event_base;
        task->done_event = spec.done_event;
        task->on_complete = [this, req](const Status&) { FinishRestore(req); };
      } else {
        // The first sub-task waits for wait_event; a layer's event goes out with the sub-task
        // that writes its last blocks (in order on the strand: every earlier one is done), and
        // done_event with the last.
        task->wait_event = c == 0 ? spec.wait_event : -1;
        task->wait_value = spec.wait_value;
        task->first_layer = piece.first_layer;
        task->end_layer = piece.end_layer;
        task->layer_event_base = ends_layers ? spec.layer_event_base : -1;
        task->done_event = last ? spec.done_event : -1;
        task->payloads.reserve(e - b);
        task->rows.reserve((e - b) * pool.layout.block_tokens);
        for (size_t j = b; j < e; ++j) {
          task->payloads.push_back(req->pins[j].payload);
          task->rows.insert(task->rows.end(), spec.blocks[j].rows.begin(),
                            spec.blocks[j].rows.end());
        }
        task->on_complete = [this, req, unpin, last, ends_blocks, n = e - b,
                             t = task.get()](const Status& run) {
          if (t->layer_event_base >= 0) {
            req->layers_signalled = std::max(req->layers_signalled, t->layers_signalled);
          }
          if (!run.ok() || ends_blocks) unpin();
          if (!run.ok()) {
            if (req->error.ok()) req->error = run;
          } else if (ends_blocks) {
            req->restored += n;
          }
          if (last) FinishRestore(req);
        };
      }
      *slot = std::move(task);
    }
    std::shared_ptr<RestoreTask> task = *slot;
    return StepOf(pool.binding->StartRestore(task));
  } catch (const std::exception& ex) {
    Status threw = TaskThrew("Restore", pool.id, req->result.ticket, ex);
    if (req->error.ok()) req->error = threw;
    unpin();
    if (last) FinishRestore(req);
    return TransferEngine::StepResult::kDone;
  }
}

void CacheCore::FinishRestore(const std::shared_ptr<RestoreRequest>& req) {
  if (req->finished) return;
  req->finished = true;
  Pool& pool = *req->pool;
  const Status& run = req->error;
  // Pins of sub-tasks that never ran (an exception) go now.
  for (auto& p : req->pins) {
    if (p.handle != nullptr) store_->Unpin(p.handle);
    p.handle = nullptr;
  }
  CoreObserver* observer = options_.observer;
  if (observer != nullptr && !req->pins.empty()) {
    observer->OnTransfer(SampleOf(*pool.ns, pool.layout, /*restore=*/true, req->pins.size(),
                                  std::chrono::steady_clock::now() - req->started, run.ok()));
  }
  pool.restores.fetch_add(req->restored, std::memory_order_relaxed);
  EndRequest(*req, "restore");
}

}  // namespace hiqcache::server
