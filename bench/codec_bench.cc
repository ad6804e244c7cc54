// Throughput of the CPU codec against memcpy of the same bytes, in one run.
//
// Qwen3-8B geometry (8 KV heads x 128, 36 layers, K and V, BF16), 64-token blocks. Rows are
// gathered from (encode) or scattered into (decode) a pool of per-layer [slots, heads, dim]
// buffers in shuffled order, as a SGLang backup/restore would. The working set (~300 MiB of
// BF16 per pass) is far beyond the L3 cache, so every benchmark streams from and to DRAM.
// Rates count the BF16 bytes (2 per element) for every benchmark, memcpy included.
//
// Two memcpy baselines: "memcpy rows" copies the same gathered rows (2,048-byte memcpy calls,
// the access pattern of the codec and of CODEC_RAW) and is the one the ratios use; "memcpy flat"
// copies the same number of bytes in large contiguous chunks (sequential, and glibc uses
// non-temporal stores at this size), an upper bound no gather reaches.
//
// The "huge" rows (BM_MemcpyRowsHuge, BM_EncodeHuge, BM_DecodeHuge; one thread) run the same
// jobs on a copy of the pool whose buffers are collapsed into 2 MiB transparent huge pages
// (MADV_HUGEPAGE + MADV_COLLAPSE on the anonymous memory): the gather's cost without one TLB
// miss per 2,048-byte row. Their label says how much of the copy the kernel made huge.
// The "hugetlb" rows (BM_MemcpyRowsHugetlb, BM_EncodeHugetlb, BM_DecodeHugetlb; one thread) run
// them on a copy in a hugetlb memfd (MFD_HUGETLB), the pages a client's KV memfd gets with
// huge_pages=auto where the hugetlb pool holds it; they report an error when it cannot (no
// vm.nr_hugepages reserved).
//
// At the end the medians over repetitions are printed with the ratios the design targets:
// encode and decode each >= 0.8x single-thread memcpy (docs/design.md "Targets").
//   codec_bench --benchmark_repetitions=5
// --target=NAME runs the codec on one Highway target this machine supports (AVX2, SSE4, ...:
// what a host without AVX-512 would run) instead of the best one.
//   codec_bench --target=AVX2 --benchmark_filter=Int4Hadamard
#include <benchmark/benchmark.h>
#include <hwy/targets.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "codec_cpu.h"
#include "codec_reference.h"
#include "codec_test_util.h"
#include "thread_pool.h"

namespace hiqcache::kernels {
namespace {

using testutil::BlockSet;
using testutil::KvPool;

constexpr uint32_t kPoolSlots = 3072;
constexpr uint32_t kBlocks = 32;
constexpr uint32_t kBlockTokens = 64;
// The scalar reference is ~10x slower; a smaller (still DRAM-sized) job keeps the run short.
constexpr uint32_t kReferenceBlocks = 8;

// Qwen3's RoPE base (rope_theta), for the codec that turns keys by it (INT5 allot).
constexpr double kQwen3RopeTheta = 1e6;

BlockLayout Qwen3Layout(CodecKind codec) {
  BlockLayout lay;
  lay.row.num_heads = 8;
  lay.row.head_dim = 128;
  lay.row.dtype = DType::kBF16;
  lay.row.codec = codec;
  if (lay.row.IsAllot()) lay.row.rope_theta = kQwen3RopeTheta;
  lay.num_layers = 36;
  lay.kv_planes = 2;
  lay.block_tokens = kBlockTokens;
  return lay;
}

unsigned AllThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

// The pool's shape with its rows on 64-byte boundaries, as an engine's KV buffers have them (a
// std::vector of this size starts 16 bytes into its own mapping with glibc; main fixes the mmap
// threshold so that every buffer of this size gets one): the offset that aligns such storage.
KvPool::Shape AlignedPoolShape() {
  const BlockLayout lay = Qwen3Layout(CodecKind::kInt8PerHead);
  KvPool::Shape shape = KvPool::ShapeOf(lay, kPoolSlots, testutil::ViewKind::kContiguous);
  const size_t bytes = shape.plane_offset * lay.kv_planes + 128;
  std::vector<uint8_t> probe(bytes);
  shape.base_offset = (64 - reinterpret_cast<uintptr_t>(probe.data()) % 64) % 64;
  shape.buffer_bytes = bytes;
  return shape;
}

struct BenchData {
  BenchData()
      : pool(Qwen3Layout(CodecKind::kInt8PerHead), kPoolSlots, AlignedPoolShape()),
        encoded(Qwen3Layout(CodecKind::kInt8PerHead), kBlocks, 1),  // nonzero: touch every page
        raw(Qwen3Layout(CodecKind::kRaw), kBlocks, 1) {
    // Gaussian BF16 values with a per-head sigma, copied from a table (generating ~200M values
    // one by one would dominate the run).
    testutil::Rng rng(42);
    std::vector<uint16_t> table(1 << 20);
    for (size_t i = 0; i < table.size(); i += 128) {
      testutil::GenHead(testutil::InputClass::kGaussian, DType::kBF16, rng, table.data() + i, 128);
    }
    pool.ForEachHead([&](uint32_t, uint32_t, uint32_t, uint32_t, uint16_t* x) {
      std::memcpy(x, table.data() + rng.Below(static_cast<uint32_t>(table.size() - 128)), 256);
    });
    rows = testutil::RandomRows(kPoolSlots, static_cast<size_t>(kBlocks) * kBlockTokens, rng);
  }

  size_t BF16Bytes(uint32_t blocks) const {
    return static_cast<size_t>(blocks) * pool.layout().num_layers * pool.layout().kv_planes *
           kBlockTokens * pool.row_format().InputRowBytes();
  }
  // The INT8 job, or another codec's: RAW into `raw`, FP8 (INT8's row size) and INT4 (smaller
  // rows) into `encoded`, which every decode benchmark therefore encodes itself before timing.
  EncodeJob Encode(uint32_t blocks, CodecKind codec = CodecKind::kInt8PerHead) {
    EncodeJob job =
        testutil::MakeEncodeJob(pool, rows, codec == CodecKind::kRaw ? raw : encoded, nonfinite);
    job.layout.row.codec = codec;
    job.layout.row.rope_theta = job.layout.row.IsAllot() ? kQwen3RopeTheta : 0.0;
    job.num_blocks = blocks;
    return job;
  }
  DecodeJob Decode(uint32_t blocks, CodecKind codec = CodecKind::kInt8PerHead) {
    DecodeJob job = testutil::MakeDecodeJob(pool, rows, codec == CodecKind::kRaw ? raw : encoded);
    job.layout.row.codec = codec;
    job.layout.row.rope_theta = job.layout.row.IsAllot() ? kQwen3RopeTheta : 0.0;
    job.num_blocks = blocks;
    return job;
  }

  KvPool pool;
  BlockSet encoded;
  BlockSet raw;
  std::vector<uint32_t> rows;
  uint8_t nonfinite[kBlocks] = {};
};

BenchData& Data() {
  static BenchData* data = new BenchData();
  return *data;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

// Asks for 2 MiB pages under [p, p + bytes) (its 2 MiB-aligned part); returns the bytes
// collapsed into huge pages.
size_t CollapseToHugePages(uint8_t* p, size_t bytes) {
  constexpr uintptr_t kHuge = 2 << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end <= begin) return 0;
  void* a = reinterpret_cast<void*>(begin);
  if (madvise(a, end - begin, MADV_HUGEPAGE) != 0) return 0;
  return madvise(a, end - begin, MADV_COLLAPSE) == 0 ? end - begin : 0;
}

// A copy of Data()'s pool in transparent huge pages (as far as the kernel gives them), with the
// same rows and its own blocks.
struct HugeData {
  HugeData()
      : pool(Qwen3Layout(CodecKind::kInt8PerHead), kPoolSlots, AlignedPoolShape()),
        encoded(Qwen3Layout(CodecKind::kInt8PerHead), kBlocks, 1),
        raw(Qwen3Layout(CodecKind::kRaw), kBlocks, 1) {
    BenchData& d = Data();
    size_t total = 0;
    for (uint32_t l = 0; l < pool.layout().num_layers; ++l) {
      std::memcpy(pool.buffer(l).data(), d.pool.buffer(l).data(), pool.buffer(l).size());
      huge_bytes += CollapseToHugePages(pool.buffer(l).data(), pool.buffer(l).size());
      total += pool.buffer(l).size();
    }
    label = std::to_string(huge_bytes * 100 / std::max<size_t>(1, total)) + "% in 2 MiB pages";
  }
  KvPool pool;
  BlockSet encoded;
  BlockSet raw;
  size_t huge_bytes = 0;
  std::string label;
  uint8_t nonfinite[kBlocks] = {};
};

HugeData& Huge() {
  static HugeData* data = new HugeData();
  return *data;
}

// A copy of Data()'s pool in one hugetlb memfd (a region per layer, rows at the same 64-byte
// alignment), with its own blocks; !ok() when the hugetlb pool cannot hold it.
struct HugetlbData {
  HugetlbData()
      : encoded(Qwen3Layout(CodecKind::kInt8PerHead), kBlocks, 1),
        raw(Qwen3Layout(CodecKind::kRaw), kBlocks, 1) {
    BenchData& d = Data();
    const uint32_t layers = d.pool.layout().num_layers;
    const size_t region = (d.pool.buffer(0).size() + 64 + 4095) / 4096 * 4096;
    const int fd = memfd_create("hiq-codec-bench", MFD_CLOEXEC | MFD_HUGETLB);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
      if (fd >= 0) close(fd);
      return;
    }
    const size_t page = static_cast<size_t>(st.st_blksize);
    bytes = (region * layers + page - 1) / page * page;
    void* p = ftruncate(fd, static_cast<off_t>(bytes)) == 0
                  ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    close(fd);  // the mapping keeps the object
    if (p == MAP_FAILED) return;
    base = static_cast<uint8_t*>(p);
    // ViewsAt adds the shape's base_offset, chosen for a std::vector's start: shift the region's
    // start so that rows land on 64-byte boundaries.
    const size_t shift = (64 - d.pool.shape().base_offset % 64) % 64;
    for (uint32_t l = 0; l < layers; ++l) {
      uint8_t* at = base + l * region + shift;
      std::memcpy(at, d.pool.buffer(l).data(), d.pool.buffer(l).size());
      views.push_back(d.pool.ViewsAt(l, at));
    }
  }
  bool ok() const { return base != nullptr; }
  uint8_t* base = nullptr;
  size_t bytes = 0;
  std::vector<LayerViews> views;
  BlockSet encoded;
  BlockSet raw;
  uint8_t nonfinite[kBlocks] = {};
};

HugetlbData& Hugetlb() {
  static HugetlbData* data = new HugetlbData();
  return *data;
}

// memcpy of the same rows the codec gathers (d.rows of the buffers `views` describe, d.pool's
// layout), into the same [layer][plane][token] block order of `raw` (what CODEC_RAW does), one
// 2,048-byte row per call.
void MemcpyRows(ThreadPool& tp, BenchData& d, const LayerViews* views, BlockSet& raw) {
  const BlockLayout& lay = d.pool.layout();
  const size_t row_bytes = lay.row.InputRowBytes();
  tp.ParallelFor(static_cast<size_t>(kBlocks) * lay.num_layers, [&](size_t item) {
    const uint32_t b = static_cast<uint32_t>(item / lay.num_layers);
    const uint32_t l = static_cast<uint32_t>(item % lay.num_layers);
    const uint32_t* rows = d.rows.data() + static_cast<size_t>(b) * kBlockTokens;
    uint8_t* dst =
        raw[b].data() + static_cast<size_t>(l) * lay.kv_planes * kBlockTokens * row_bytes;
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      const StridedView& v = views[l].planes[p];
      for (uint32_t t = 0; t < kBlockTokens; ++t) {
        std::memcpy(dst, v.Head(rows[t], 0), row_bytes);
        dst += row_bytes;
      }
    }
  });
}

// The 1-thread gather, encode and decode of d.rows on a copy of the pool's buffers (`views`: on
// transparent or hugetlb huge pages), into that copy's own blocks.
void MemcpyRowsOn(benchmark::State& state, const LayerViews* views, BlockSet& raw) {
  BenchData& d = Data();
  ThreadPool tp(1);
  for (auto _ : state) {
    MemcpyRows(tp, d, views, raw);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
}

EncodeJob EncodeJobOn(const LayerViews* views, BlockSet& encoded, uint8_t* nonfinite) {
  BenchData& d = Data();
  EncodeJob job = testutil::MakeEncodeJob(d.pool, d.rows, encoded, nonfinite);
  job.layers = views;
  job.num_blocks = kBlocks;
  return job;
}

void EncodeOn(benchmark::State& state, const LayerViews* views, BlockSet& encoded,
              uint8_t* nonfinite) {
  CpuCodec codec(1);
  const EncodeJob job = EncodeJobOn(views, encoded, nonfinite);
  for (auto _ : state) {
    codec.Encode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * Data().BF16Bytes(kBlocks)));
}

void DecodeOn(benchmark::State& state, const LayerViews* views, BlockSet& encoded,
              uint8_t* nonfinite) {
  BenchData& d = Data();
  CpuCodec codec(1);
  codec.Encode(EncodeJobOn(views, encoded, nonfinite));
  DecodeJob job = testutil::MakeDecodeJob(d.pool, d.rows, encoded);
  job.layers = views;
  job.num_blocks = kBlocks;
  for (auto _ : state) {
    codec.Decode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
}

void BM_MemcpyRowsHuge(benchmark::State& state) {
  HugeData& h = Huge();
  MemcpyRowsOn(state, h.pool.views(), h.raw);
  state.SetLabel(h.label);
}

void BM_EncodeHuge(benchmark::State& state) {
  HugeData& h = Huge();
  EncodeOn(state, h.pool.views(), h.encoded, h.nonfinite);
  state.SetLabel(h.label);
}

void BM_DecodeHuge(benchmark::State& state) {
  HugeData& h = Huge();
  DecodeOn(state, h.pool.views(), h.encoded, h.nonfinite);
  state.SetLabel(h.label);
}

void BM_MemcpyRowsHugetlb(benchmark::State& state) {
  HugetlbData& h = Hugetlb();
  if (!h.ok()) return state.SkipWithError("no hugetlb pages (vm.nr_hugepages)");
  MemcpyRowsOn(state, h.views.data(), h.raw);
}

void BM_EncodeHugetlb(benchmark::State& state) {
  HugetlbData& h = Hugetlb();
  if (!h.ok()) return state.SkipWithError("no hugetlb pages (vm.nr_hugepages)");
  EncodeOn(state, h.views.data(), h.encoded, h.nonfinite);
}

void BM_DecodeHugetlb(benchmark::State& state) {
  HugetlbData& h = Hugetlb();
  if (!h.ok()) return state.SkipWithError("no hugetlb pages (vm.nr_hugepages)");
  DecodeOn(state, h.views.data(), h.encoded, h.nonfinite);
}

void BM_MemcpyRows(benchmark::State& state) {
  BenchData& d = Data();
  ThreadPool tp(static_cast<unsigned>(state.range(0)));
  for (auto _ : state) {
    MemcpyRows(tp, d, d.pool.views(), d.raw);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
}

// One large memcpy per layer of the same total size: plain streaming bandwidth (glibc switches
// to non-temporal stores at this size).
void BM_MemcpyFlat(benchmark::State& state) {
  BenchData& d = Data();
  const size_t total = d.BF16Bytes(kBlocks);
  const uint32_t layers = d.pool.layout().num_layers;
  const size_t chunk = total / layers;
  for (auto _ : state) {
    for (uint32_t l = 0; l < layers; ++l) {
      // A chunk (one layer's share) fits one RAW block; layers past kBlocks reuse the first ones.
      uint8_t* dst = d.raw[l % kBlocks].data();
      std::memcpy(dst, d.pool.buffer(l).data(), chunk);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * chunk * layers));
}

void BM_Encode(benchmark::State& state) {
  BenchData& d = Data();
  CpuCodec codec(static_cast<unsigned>(state.range(0)));
  const EncodeJob job = d.Encode(kBlocks);
  for (auto _ : state) {
    codec.Encode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
  state.SetLabel(CpuCodec::TargetName());
}

void BM_Decode(benchmark::State& state) {
  BenchData& d = Data();
  CpuCodec codec(static_cast<unsigned>(state.range(0)));
  codec.Encode(d.Encode(kBlocks));
  const DecodeJob job = d.Decode(kBlocks);
  for (auto _ : state) {
    codec.Decode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
  state.SetLabel(CpuCodec::TargetName());
}

// The other codecs through the same executor: RAW (the bit-exact control: a copy of the gathered
// rows into the block layout), FP8 E4M3 (INT8's row format, other arithmetic) and INT4 (groups
// of 32, 576-byte rows for 8x128); the formats stored per plane, INT4 KIVI, INT4 Hadamard and
// INT5 allot (keys turned by Qwen3's rope).
void BM_EncodeCodec(benchmark::State& state, CodecKind codec) {
  BenchData& d = Data();
  CpuCodec codec_threads(static_cast<unsigned>(state.range(0)));
  const EncodeJob job = d.Encode(kBlocks, codec);
  for (auto _ : state) {
    codec_threads.Encode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
  state.SetLabel(CpuCodec::TargetName());
}

void BM_DecodeCodec(benchmark::State& state, CodecKind codec) {
  BenchData& d = Data();
  CpuCodec codec_threads(static_cast<unsigned>(state.range(0)));
  codec_threads.Encode(d.Encode(kBlocks, codec));
  const DecodeJob job = d.Decode(kBlocks, codec);
  for (auto _ : state) {
    codec_threads.Decode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kBlocks)));
  state.SetLabel(CpuCodec::TargetName());
}

// What the daemon runs per HOST sub-task at its default size (16 MiB of input = one Qwen3-8B
// block): one block per call, a different one each time (DRAM-sized as above). by_layer:1
// decodes layer by layer (DecodeLayer, the request's last sub-task, which signals layer events),
// by_layer:0 in one call (Decode, every other sub-task); the encode is one Encode call.
void BM_DecodeOneBlock(benchmark::State& state) {
  BenchData& d = Data();
  CpuCodec codec(static_cast<unsigned>(state.range(0)));
  const bool by_layer = state.range(1) != 0;
  codec.Encode(d.Encode(kBlocks));
  DecodeJob job = d.Decode(1);
  uint32_t b = 0;
  for (auto _ : state) {
    job.blocks = d.encoded.ptrs() + b;
    job.rows = d.rows.data() + static_cast<size_t>(b) * kBlockTokens;
    if (by_layer) {
      for (uint32_t l = 0; l < job.layout.num_layers; ++l) codec.DecodeLayer(job, l);
    } else {
      codec.Decode(job);
    }
    benchmark::ClobberMemory();
    b = (b + 1) % kBlocks;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(1)));
}

void BM_EncodeOneBlock(benchmark::State& state) {
  BenchData& d = Data();
  CpuCodec codec(static_cast<unsigned>(state.range(0)));
  EncodeJob job = d.Encode(1);
  uint32_t b = 0;
  for (auto _ : state) {
    job.blocks = d.encoded.ptrs() + b;
    job.rows = d.rows.data() + static_cast<size_t>(b) * kBlockTokens;
    job.nonfinite = d.nonfinite + b;
    codec.Encode(job);
    benchmark::ClobberMemory();
    b = (b + 1) % kBlocks;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(1)));
}

void BM_EncodeReference(benchmark::State& state) {
  BenchData& d = Data();
  const EncodeJob job = d.Encode(kReferenceBlocks);
  for (auto _ : state) {
    EncodeBlocksReference(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kReferenceBlocks)));
}

void BM_DecodeReference(benchmark::State& state) {
  BenchData& d = Data();
  EncodeBlocksReference(d.Encode(kReferenceBlocks));
  const DecodeJob job = d.Decode(kReferenceBlocks);
  for (auto _ : state) {
    DecodeBlocksReference(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d.BF16Bytes(kReferenceBlocks)));
}

// The same codec on a working set that fits in L2 (2 layers, 4 blocks from 256 slots): the
// compute cost alone, for diagnosing whether the DRAM-sized runs are memory- or compute-bound.
struct HotData {
  HotData() : pool(HotLayout(), 256, testutil::ViewKind::kContiguous), encoded(HotLayout(), 4, 1) {
    pool.Fill(testutil::InputClass::kGaussian, 3);
    testutil::Rng rng(3);
    rows = testutil::RandomRows(256, 4 * kBlockTokens, rng);
  }
  static BlockLayout HotLayout() {
    BlockLayout lay = Qwen3Layout(CodecKind::kInt8PerHead);
    lay.num_layers = 1;
    return lay;
  }
  KvPool pool;
  BlockSet encoded;
  std::vector<uint32_t> rows;
};

void BM_EncodeHot(benchmark::State& state) {
  static HotData* d = new HotData();
  CpuCodec codec(1);
  const EncodeJob job = testutil::MakeEncodeJob(d->pool, d->rows, d->encoded, nullptr);
  for (auto _ : state) {
    codec.Encode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d->rows.size() * 2 *
                                               d->pool.row_format().InputRowBytes()));
}

void BM_DecodeHot(benchmark::State& state) {
  static HotData* d = new HotData();
  CpuCodec codec(1);
  codec.Encode(testutil::MakeEncodeJob(d->pool, d->rows, d->encoded, nullptr));
  const DecodeJob job = testutil::MakeDecodeJob(d->pool, d->rows, d->encoded);
  for (auto _ : state) {
    codec.Decode(job);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * d->rows.size() * 2 *
                                               d->pool.row_format().InputRowBytes()));
}

void ThreadArgs(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1);
  if (AllThreads() > 1) b->Arg(AllThreads());
}

void ThreadAndLayerArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "by_layer"});
  for (int64_t by_layer : {0, 1}) {
    b->Args({1, by_layer});
    if (AllThreads() > 1) b->Args({AllThreads(), by_layer});
  }
}

BENCHMARK(BM_MemcpyFlat)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MemcpyRows)->Apply(ThreadArgs)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Encode)->Apply(ThreadArgs)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Decode)->Apply(ThreadArgs)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Raw, CodecKind::kRaw)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Raw, CodecKind::kRaw)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Fp8, CodecKind::kFp8E4m3PerHead)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Fp8, CodecKind::kFp8E4m3PerHead)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int4, CodecKind::kInt4G32PerHead)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int4, CodecKind::kInt4G32PerHead)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int4Kivi, CodecKind::kInt4Kivi)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int4Kivi, CodecKind::kInt4Kivi)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int4Hadamard, CodecKind::kInt4Hadamard)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int4Hadamard, CodecKind::kInt4Hadamard)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int5Allot, CodecKind::kInt5Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int5Allot, CodecKind::kInt5Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int6Allot, CodecKind::kInt6Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int6Allot, CodecKind::kInt6Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeCodec, Int4Allot, CodecKind::kInt4Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DecodeCodec, Int4Allot, CodecKind::kInt4Allot)
    ->Apply(ThreadArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeOneBlock)->Apply(ThreadArgs)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeOneBlock)
    ->Apply(ThreadAndLayerArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MemcpyRowsHuge)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeHuge)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeHuge)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MemcpyRowsHugetlb)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeHugetlb)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeHugetlb)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeReference)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeReference)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeHot)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeHot)->Unit(benchmark::kMicrosecond);

// Console output as usual, plus every repetition's BF16 GB/s (from real time) per benchmark.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      // Every repetition, or only the median where --benchmark_report_aggregates_only hides them.
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if ((run.run_type != Run::RT_Iteration && !median) || run.error_occurred) continue;
      // SetBytesProcessed's counter, already divided by the (real, with UseRealTime) time.
      auto it = run.counters.find("bytes_per_second");
      if (it == run.counters.end()) continue;
      const std::string name =
          run.run_name.function_name + (run.run_name.args.empty() ? "" : "/") + run.run_name.args;
      (median ? medians_ : rates_)[name].push_back(it->second.value / 1e9);
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // Median GB/s of benchmark `name` ("BM_Encode/threads:1"), or 0 when it did not run.
  double Median(const std::string& name) const {
    auto find = [&name](const std::map<std::string, std::vector<double>>& m) {
      auto it = m.find(name);
      return it == m.end() ? std::vector<double>{} : it->second;
    };
    std::vector<double> v = find(rates_);
    if (v.empty()) v = find(medians_);
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }

 private:
  std::map<std::string, std::vector<double>> rates_;
  std::map<std::string, std::vector<double>> medians_;  // the aggregates' medians
};

void PrintSummary(const CollectingReporter& rep) {
  const std::string all = "threads:" + std::to_string(AllThreads());
  const double memcpy1 = rep.Median("BM_MemcpyRows/threads:1");
  const double flat1 = rep.Median("BM_MemcpyFlat");
  const double enc1 = rep.Median("BM_Encode/threads:1");
  const double dec1 = rep.Median("BM_Decode/threads:1");
  const double memcpyn = rep.Median("BM_MemcpyRows/" + all);
  const double encn = rep.Median("BM_Encode/" + all);
  const double decn = rep.Median("BM_Decode/" + all);
  const double encr = rep.Median("BM_EncodeReference");
  const double decr = rep.Median("BM_DecodeReference");
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  std::printf(
      "\nMedians, GB/s (1e9 B/s; the table's G/s are GiB/s) of BF16 input (Highway target %s, "
      "%u threads):\n",
      CpuCodec::TargetName(), AllThreads());
  std::printf("  memcpy rows 1T  %7.2f   memcpy flat 1T %7.2f   memcpy rows %uT %7.2f\n", memcpy1,
              flat1, AllThreads(), memcpyn);
  std::printf("  encode 1T       %7.2f   decode 1T      %7.2f   (pool rows %s64-byte aligned)\n",
              enc1, dec1,
              reinterpret_cast<uintptr_t>(Data().pool.view(0, 0).Head(0, 0)) % 64 ? "NOT " : "");
  std::printf("  encode %uT       %7.2f   decode %uT      %7.2f\n", AllThreads(), encn,
              AllThreads(), decn);
  for (const char* c : {"Raw", "Fp8", "Int4"}) {
    const std::string e = std::string("BM_EncodeCodec/") + c + "/";
    const std::string dn = std::string("BM_DecodeCodec/") + c + "/";
    std::printf(
        "  %-4s encode 1T    %7.2f   decode 1T      %7.2f   encode / decode %uT %5.2f / %5.2f\n", c,
        rep.Median(e + "threads:1"), rep.Median(dn + "threads:1"), AllThreads(),
        rep.Median(e + all), rep.Median(dn + all));
  }
  std::printf(
      "  one block per call (a default HOST sub-task): encode 1T %5.2f %uT %5.2f   decode 1T %5.2f "
      "%uT %5.2f   decode by layer 1T %5.2f %uT %5.2f\n",
      rep.Median("BM_EncodeOneBlock/threads:1"), AllThreads(),
      rep.Median("BM_EncodeOneBlock/" + all), rep.Median("BM_DecodeOneBlock/threads:1/by_layer:0"),
      AllThreads(), rep.Median("BM_DecodeOneBlock/" + all + "/by_layer:0"),
      rep.Median("BM_DecodeOneBlock/threads:1/by_layer:1"), AllThreads(),
      rep.Median("BM_DecodeOneBlock/" + all + "/by_layer:1"));
  std::printf("  2 MiB pages (%s): memcpy rows 1T %5.2f   encode 1T %5.2f   decode 1T %5.2f\n",
              Huge().label.c_str(), rep.Median("BM_MemcpyRowsHuge"), rep.Median("BM_EncodeHuge"),
              rep.Median("BM_DecodeHuge"));
  if (Hugetlb().ok()) {
    std::printf("  hugetlb memfd:   memcpy rows 1T %5.2f   encode 1T %5.2f   decode 1T %5.2f\n",
                rep.Median("BM_MemcpyRowsHugetlb"), rep.Median("BM_EncodeHugetlb"),
                rep.Median("BM_DecodeHugetlb"));
  }
  std::printf("  reference encode 1T %5.2f   reference decode 1T %5.2f\n", encr, decr);
  std::printf("  L2-resident (compute only): encode 1T %5.2f   decode 1T %5.2f\n",
              rep.Median("BM_EncodeHot"), rep.Median("BM_DecodeHot"));
  std::printf("encode/memcpy = %.2f\n", ratio(enc1, memcpy1));
  std::printf("decode/memcpy = %.2f\n", ratio(dec1, memcpy1));
  std::printf("encode/memcpy_flat = %.2f\n", ratio(enc1, flat1));
  std::printf("decode/memcpy_flat = %.2f\n", ratio(dec1, flat1));
  std::printf("encode_huge/memcpy_flat = %.2f\n", ratio(rep.Median("BM_EncodeHuge"), flat1));
  std::printf("decode_huge/memcpy_flat = %.2f\n", ratio(rep.Median("BM_DecodeHuge"), flat1));
  if (Hugetlb().ok()) {
    const double rows_hugetlb = rep.Median("BM_MemcpyRowsHugetlb");
    std::printf("encode_hugetlb/memcpy_flat = %.2f   decode_hugetlb/memcpy_flat = %.2f\n",
                ratio(rep.Median("BM_EncodeHugetlb"), flat1),
                ratio(rep.Median("BM_DecodeHugetlb"), flat1));
    std::printf(
        "encode_hugetlb/memcpy_rows_hugetlb = %.2f   decode_hugetlb/memcpy_rows_hugetlb = "
        "%.2f\n",
        ratio(rep.Median("BM_EncodeHugetlb"), rows_hugetlb),
        ratio(rep.Median("BM_DecodeHugetlb"), rows_hugetlb));
  }
  std::printf("encode_%uT/memcpy_%uT = %.2f\n", AllThreads(), AllThreads(), ratio(encn, memcpyn));
  std::printf("decode_%uT/memcpy_%uT = %.2f\n", AllThreads(), AllThreads(), ratio(decn, memcpyn));
  for (const char* c : {"Raw", "Fp8", "Int4"}) {
    const std::string e = std::string("BM_EncodeCodec/") + c + "/threads:1";
    const std::string dn = std::string("BM_DecodeCodec/") + c + "/threads:1";
    std::printf("%s_encode/memcpy = %.2f   %s_decode/memcpy = %.2f   (flat: %.2f / %.2f)\n", c,
                ratio(rep.Median(e), memcpy1), c, ratio(rep.Median(dn), memcpy1),
                ratio(rep.Median(e), flat1), ratio(rep.Median(dn), flat1));
  }
  std::printf("reference_encode/memcpy = %.2f\n", ratio(encr, memcpy1));
  std::printf("reference_decode/memcpy = %.2f\n", ratio(decr, memcpy1));
  std::printf("target: encode/memcpy >= 0.80 and decode/memcpy >= 0.80 (single thread)\n");
}

}  // namespace
}  // namespace hiqcache::kernels

int main(int argc, char** argv) {
  // Every large buffer in its own mapping, at the same offset from a page (see AlignedPoolShape);
  // glibc's dynamic threshold would otherwise move freed sizes onto the heap.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // --target=NAME: the codec on that Highway target (taken out before the benchmark flags).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--target=", 0) != 0) continue;
    const std::string name = arg.substr(9);
    int64_t chosen = 0;
    std::string known;
    for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
      known += std::string(" ") + hwy::TargetName(t);
      if (name == hwy::TargetName(t)) chosen = t;
    }
    if (chosen == 0) {
      std::fprintf(stderr, "codec_bench: --target=%s is not one this machine runs:%s\n",
                   name.c_str(), known.c_str());
      return 1;
    }
    hwy::SetSupportedTargetsForTest(chosen);
    for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
    --argc;
    --i;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  hiqcache::kernels::CollectingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  hiqcache::kernels::PrintSummary(reporter);
  benchmark::Shutdown();
  return 0;
}
