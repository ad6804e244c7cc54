// The SIMD CPU executor of the codecs (Highway, runtime dispatch to the best target the CPU has).
//
// Gathers rows by index from strided views and encodes them into block payloads, and the reverse,
// spread over a ThreadPool. Produces exactly the bytes of the scalar reference (codec_reference.h).
// Thread-safe: a CpuCodec may be shared; calls on it from different threads are serialized by
// its pool.
#pragma once

#include <functional>
#include <memory>

#include "codec_job.h"
#include "thread_pool.h"

namespace hiqcache::kernels {

class CpuCodec {
 public:
  // threads = 0 picks std::thread::hardware_concurrency().
  explicit CpuCodec(unsigned threads);

  unsigned threads() const { return pool_->threads(); }
  void Encode(const EncodeJob& job);
  void DecodeLayer(const DecodeJob& job, uint32_t layer);
  void Decode(const DecodeJob& job);
  // Runs fn(i) for i in [0, n) on the codec's threads (e.g. checksums of the blocks just encoded).
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn) { pool_->ParallelFor(n, fn); }

  // The Highway target chosen for this CPU, e.g. "AVX3_ZEN4".
  static const char* TargetName();

 private:
  std::unique_ptr<ThreadPool> pool_;
};

// Single-row entry points of the SIMD executor (used by CpuCodec and by tests). REQUIRES: heads
// not split (view.dim_run == 0); CpuCodec's jobs take split views too.
bool EncodeRowSimd(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst);
void DecodeRowSimd(const RowFormat& fmt, const uint8_t* src, const StridedView& view, uint32_t row);

// Planes whose first row (token 0 of a block) is an INT8 row (INT4 Hadamard, the allot codecs):
// that row through the row executor, then `rest()` for rows 1..num_rows-1 (false when one was NaN,
// Inf or out of the codec's range); decode: rest(begin, rows) for rows [begin, end), begin >= 1.
template <class Rest>
bool EncodeAfterInt8RowSimd(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                            uint32_t num_rows, uint8_t* dst, const Rest& rest) {
  if (num_rows == 0) return true;
  if (!EncodeRowSimd(fmt.FirstRowFormat(), view, rows[0], dst)) return false;
  return num_rows == 1 || rest();
}

template <class Rest>
void DecodeAfterInt8RowSimd(const RowFormat& fmt, const uint8_t* src, uint32_t begin, uint32_t end,
                            const StridedView& view, const uint32_t* rows, const Rest& rest) {
  if (begin == 0 && end > 0) {
    DecodeRowSimd(fmt.FirstRowFormat(), src, view, rows[0]);
    ++begin;
    ++rows;
  }
  if (begin < end) rest(begin, rows);
}

}  // namespace hiqcache::kernels
