// Host side of the CUDA emit path: the producer object behind emit_cuda.h's C ABI.
//
// The ring is mapped and validated by aiospec::RingProducer (ring.h), which also owns the
// producer's liveness words, reader eviction and the bells. This file registers the mapping
// with CUDA once, keeps the device state, launches the kernel of emit_kernel.cuh (beside it) and reads
// the mapped error word. A small thread does the liveness work (heartbeat, evicting dead or
// silent readers that block the ring) so that a kernel waiting for space is released even
// while the host thread waits on that kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "aiospec/emit.h"
#include "aiospec/emit_cuda.h"
#include "aiospec/layout.h"
#include "aiospec/ring.h"
#include "emit_kernel.cuh"

namespace {

using aiospec::cuda::Mapped;
using aiospec::cuda::RingRef;
using aiospec::cuda::State;

constexpr int kDefaultRowsPerBlock = 8;
constexpr int kMaxRowsPerBlock = aiospec::cuda::kThreads / 2;
// emit_kernel's dynamic shared memory: this many int64 arrays of rows_per_block + 1
constexpr size_t kSharedRows = 4;
// Every block reads every row's counts, so past this many blocks the rows per block grow.
constexpr long long kMaxBlocks = 264;
// The exchange of several blocks (the sampled_pos encoding) takes at least this many blocks
// where the rows allow, fewer rows a block than rows_per_block if need be: on an H200 a
// cooperative grid of 2, 8 or 16 blocks took 24-30 us for 64 or 128 rows x 6 tokens x top-5,
// the same rows in 32 blocks 15-17 us, every block's own work alike (docs/benchmarks.md,
// "Small exchange grids"). That was the block-wide gather's divergent shuffles, since
// replaced by warp 0's gather ("The exchange's slow mode, found and removed"). Measured again on
// that gather (the `minx1` variant, "Past 32 blocks, and the exchange's grid size"), the rule
// still pays for rows of several tokens with a top-20 (2 us at 32 x 6 x 20), and costs about
// 0.5 us where its floor division makes 33 to 63 blocks (200 x 1 x 20: 34).
#ifndef AIOSPEC_MIN_EXCHANGE_BLOCKS
#define AIOSPEC_MIN_EXCHANGE_BLOCKS 32
#endif
constexpr long long kMinExchangeBlocks = AIOSPEC_MIN_EXCHANGE_BLOCKS;
// A frame that cannot exceed this many bytes is written by one block: it commits without the
// blocks' counter and the state read back after it (docs/benchmarks.md, "Where the fixed cost
// goes"); past it, more blocks move the bytes faster than those round trips cost.
#ifndef AIOSPEC_SOLO_BYTES
#define AIOSPEC_SOLO_BYTES 16384
#endif
constexpr long long kSoloBytes = AIOSPEC_SOLO_BYTES;
// With the sampled_pos encoding, a step of at most this many tokens (rows x max_tokens, and
// at most kInlineMaxTokens a row) has its exceptions counted by every block of emit_kernel
// in its row checks, instead of by exceptions_kernel before it: for small steps the second
// launch costs more than the redundant count (docs/benchmarks.md).
#ifndef AIOSPEC_INLINE_TOKENS
#define AIOSPEC_INLINE_TOKENS 1024
#endif
constexpr long long kInlineTokens = AIOSPEC_INLINE_TOKENS;
constexpr long long kInlineMaxTokens = 8;
// The blocks of a frame exchange their counts (emit_kernel.cuh) instead of each checking and
// counting every row; 0 builds the kernel path where no block waits for another, for
// measurement (docs/benchmarks.md) and for devices without cooperative launches.
#ifndef AIOSPEC_EXCHANGE
#define AIOSPEC_EXCHANGE 1
#endif
constexpr bool kExchange = AIOSPEC_EXCHANGE != 0;
// AIOSPEC_COOP=0 (measurement only): the exchange launched without the cooperative attribute,
// correct only while the grid fits the idle device at once.
#ifndef AIOSPEC_COOP
#define AIOSPEC_COOP 1
#endif
// AIOSPEC_DEVICE_RING=1 (measurement only): the frames' bytes go to device memory instead of
// the ring's host memory, the stores' cost without the link.
#ifndef AIOSPEC_DEVICE_RING
#define AIOSPEC_DEVICE_RING 0
#endif
constexpr bool kPdl = AIOSPEC_PDL != 0;  // emit_kernel.cuh

// The emit kernel of a frame's path (emit_kernel.cuh, AIOSPEC_SPECIALIZE).
using EmitKernel = void (*)(aiospec_emit_args, aiospec::cuda::RingRef, aiospec::cuda::State*, aiospec::cuda::Mapped*,
                            const uint64_t*, const int*, aiospec::cuda::Part*, int, int, int);
EmitKernel emit_kernel_for(bool exchange, bool sampled) {
  using aiospec::cuda::emit_kernel;
  using aiospec::cuda::kAtRunTime;
#if AIOSPEC_SPECIALIZE == 0
  (void)exchange, (void)sampled;
  return emit_kernel<kAtRunTime, kAtRunTime>;
#elif AIOSPEC_SPECIALIZE == 2
  if (exchange) return sampled ? emit_kernel<1, 1> : emit_kernel<1, 0>;
  return sampled ? emit_kernel<0, 1> : emit_kernel<0, 0>;
#else
  if (sampled) return emit_kernel<kAtRunTime, kAtRunTime>;
  return exchange ? emit_kernel<1, 0> : emit_kernel<0, 0>;
#endif
}

// The largest frame these inputs can make (every row a record, every token and draft id
// live): the bytes of each column's elements plus the header and the padding words.
long long frame_bound(const aiospec_emit_args* a) {
  const long long rows = a->rows;
  const long long per_token = 4 + (aiospec_has_logprobs(a) ? 8 + 8 * (long long)aiospec_frame_k(a) : 0);
  const long long per_row = 8 + 4 + 8 + a->max_tokens * per_token + (a->draft_ids != nullptr ? 4 * a->max_draft : 0);
  return rows * per_row + AIOSPEC_FRAME_HEADER + AIOSPEC_HEADER_SPACE + 8 * AIOSPEC_NUM_COLUMNS + AIOSPEC_FRAME_ALIGN + 64;
}

void put_error(char* buf, size_t size, const std::string& msg) {
  if (buf == nullptr || size == 0) return;
  std::snprintf(buf, size, "%s", msg.c_str());
}

std::string cuda_msg(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) {
      status_ = cudaSetDevice(device);
    } else {
      prev_ = -1;
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace

struct aiospec_cuda_producer {
  aiospec_cuda_options opts{};
  std::unique_ptr<aiospec::RingProducer> ring;
  std::mutex mu;  // the ring's bells and reader slots: caller, host callbacks, liveness thread
  uint8_t* host_base = nullptr;
  bool registered = false;
  RingRef ref{};
  State* st = nullptr;
  int* xcnt = nullptr;  // exceptions_kernel's count per row: max_rows entries
  aiospec::cuda::Part* part = nullptr;  // the exchange: kMaxBlocks blocks' counts
  long long max_blocks = 0;  // the most blocks resident at once (cooperative launch), <= kMaxBlocks
  bool exchange = false;  // multi-block frames through the exchange (cooperative launches work)
  bool pdl = false;  // launches with programmatic stream serialization (sm_90 and later)
  Mapped* mh = nullptr;  // host view of the error word
  Mapped* md = nullptr;  // device view
  aiospec_error last{};
  uint64_t reported = 0;
  uint64_t emits = 0;
  std::thread live;
  std::mutex live_mu;
  std::condition_variable live_cv;
  bool stop = false;

  void liveness() {
    std::lock_guard<std::mutex> lock(mu);
    if (ring == nullptr || ring->closed()) return;
    ring->heartbeat();
    // A reader blocks the next frame once its tail is below head + (PAD + frame + next
    // header) - capacity; only such readers may be evicted (wire-format section 6).
    const uint64_t head = aiospec::load_acquire(ring->map().ctl64(AIOSPEC_OFF_HEAD));
    const uint64_t reach = head + 2 * uint64_t(ring->max_record()) + AIOSPEC_FRAME_HEADER;
    if (reach > ring->capacity()) ring->evict_blocking(reach - ring->capacity());
  }

  int notify() {
    std::lock_guard<std::mutex> lock(mu);
    if (ring == nullptr || ring->closed()) return 0;
    ring->heartbeat();
    return ring->notify();
  }

  void release() {
    if (live.joinable()) {
      {
        std::lock_guard<std::mutex> lock(live_mu);
        stop = true;
      }
      live_cv.notify_all();
      live.join();
    }
    {
      DeviceGuard guard(opts.device);
      cudaDeviceSynchronize();  // no kernel of ours may still write into the segment
      if (registered) cudaHostUnregister(host_base);
      registered = false;
      if (st != nullptr) cudaFree(st);
      if (xcnt != nullptr) cudaFree(xcnt);
      if (part != nullptr) cudaFree(part);
      part = nullptr;
      if (mh != nullptr) cudaFreeHost(mh);
      st = nullptr;
      xcnt = nullptr;
      mh = md = nullptr;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (ring != nullptr) ring->close(true);
    ring.reset();
  }
};

namespace {

void CUDART_CB notify_callback(void* arg) { static_cast<aiospec_cuda_producer*>(arg)->notify(); }

std::string describe_laggards(aiospec_cuda_producer* p, uint64_t needed_tail, uint64_t head) {
  std::string out;
  const aiospec::RingMap& m = p->ring->map();
  for (uint32_t s = 0; s < m.max_readers; ++s) {
    if (aiospec::load_acquire(m.rd32(s, AIOSPEC_RD_STATE)) != AIOSPEC_READER_ACTIVE) continue;
    const uint64_t tail = aiospec::load_acquire(m.rd64(s, AIOSPEC_RD_TAIL));
    if (tail >= needed_tail) continue;
    if (!out.empty()) out += ", ";
    out += "slot " + std::to_string(s) + " (pid " + std::to_string(aiospec::load_relaxed(m.rd32(s, AIOSPEC_RD_PID))) +
           ", lag " + std::to_string(head > tail ? head - tail : 0) + " bytes)";
  }
  return out.empty() ? "none (they caught up)" : out;
}

}  // namespace

extern "C" {

void aiospec_cuda_default_options(aiospec_cuda_options* o) {
  std::memset(o, 0, sizeof *o);
  o->device = 0;
  o->rows_per_block = kDefaultRowsPerBlock;
  o->max_rows = 4096;
  o->timeout_s = 5.0;
  o->reader_timeout_s = 0.0;
  o->liveness_s = 0.05;
  o->host_notify = 0;
  o->check_pids = 1;
}

int32_t aiospec_cuda_abi_version(void) { return AIOSPEC_CUDA_ABI_VERSION; }

const char* aiospec_cuda_error_string(int32_t status) { return cudaGetErrorString(cudaError_t(status)); }

int aiospec_cuda_device_ok(int32_t device, char* err, size_t errlen) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    put_error(err, errlen, cuda_msg("cudaGetDeviceCount", e));
    return 0;
  }
  if (device < 0 || device >= count) {
    put_error(err, errlen,
              "device = " + std::to_string(device) + ": expected 0.." + std::to_string(count - 1) + " (CUDA devices)");
    return 0;
  }
  int supported = 0;
  e = cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterSupported, device);
  if (e != cudaSuccess) {
    put_error(err, errlen, cuda_msg("cudaDeviceGetAttribute(HostRegisterSupported)", e));
    return 0;
  }
  if (!supported) {
    put_error(err, errlen, "device " + std::to_string(device) + " cannot map host memory (cudaHostRegister unsupported)");
    return 0;
  }
  return 1;
}

int32_t aiospec_cuda_pointer_device(const void* ptr) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device : -1;
}

int aiospec_cuda_producer_create(const char* ring_name, const aiospec_cuda_options* opts,
                                 aiospec_cuda_producer** out, char* err, size_t errlen) {
  if (out == nullptr || ring_name == nullptr) {
    put_error(err, errlen, "ring_name and out: required");
    return -1;
  }
  *out = nullptr;
  aiospec_cuda_options o;
  if (opts != nullptr) {
    o = *opts;
  } else {
    aiospec_cuda_default_options(&o);
  }
  if (o.rows_per_block == 0) o.rows_per_block = kDefaultRowsPerBlock;
  if (o.max_rows < 0 || o.max_rows > INT32_MAX - 1) {
    put_error(err, errlen, "max_rows = " + std::to_string(o.max_rows) + ": expected 0.." + std::to_string(INT32_MAX - 1));
    return -1;
  }
  if (o.rows_per_block < 1 || o.rows_per_block > kMaxRowsPerBlock) {
    put_error(err, errlen, "rows_per_block = " + std::to_string(o.rows_per_block) + ": expected 1.." +
                               std::to_string(kMaxRowsPerBlock));
    return -1;
  }
  if (!(o.timeout_s >= 0) || o.timeout_s > 1e6) {
    put_error(err, errlen, "timeout = " + aiospec::py_float(o.timeout_s) + ": expected 0..1000000 seconds");
    return -1;
  }
  if (!aiospec_cuda_device_ok(o.device, err, errlen)) return -1;

  auto p = std::make_unique<aiospec_cuda_producer>();
  p->opts = o;
  try {
    aiospec::ProducerOptions ro;
    ro.reader_timeout = o.reader_timeout_s > 0 ? o.reader_timeout_s : -1.0;
    ro.check_pids = o.check_pids != 0;
    p->ring = std::make_unique<aiospec::RingProducer>(ring_name, ro);
  } catch (const std::exception& ex) {
    put_error(err, errlen, ex.what());
    return -1;
  }
  const aiospec::RingMap& m = p->ring->map();
  DeviceGuard guard(o.device);
  if (guard.status() != cudaSuccess) {
    put_error(err, errlen, cuda_msg("cudaSetDevice", guard.status()));
    p->release();
    return -1;
  }
  auto fail = [&](const char* what, cudaError_t e) {
    put_error(err, errlen, cuda_msg(what, e));
    cudaGetLastError();
    p->release();
    return -1;
  };
  // Once, on the whole page-aligned segment; the mapping stays cacheable (never WC) because
  // readers on the CPU poll it.
  p->host_base = m.base;
  cudaError_t e = cudaHostRegister(m.base, m.size, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) return fail("cudaHostRegister(ring segment)", e);
  p->registered = true;
  void* dev = nullptr;
  e = cudaHostGetDevicePointer(&dev, m.base, 0);
  if (e != cudaSuccess) return fail("cudaHostGetDevicePointer(ring segment)", e);
  p->ref.ctl = static_cast<uint8_t*>(dev);
  p->ref.data = p->ref.ctl + AIOSPEC_CONTROL_SIZE;
#if AIOSPEC_DEVICE_RING
  // measurement only: the frames go to device memory that no reader sees (the control page,
  // the head among it, stays in host memory); never freed
  e = cudaMalloc(reinterpret_cast<void**>(&p->ref.data), m.capacity);
  if (e != cudaSuccess) return fail("cudaMalloc(AIOSPEC_DEVICE_RING)", e);
#endif
  p->ref.capacity = m.capacity;
  p->ref.mask = m.mask;
  p->ref.max_record = m.max_record;
  p->ref.max_readers = m.max_readers;
  p->ref.timeout_ns = uint64_t(o.timeout_s * 1e9);

  e = cudaMalloc(&p->st, sizeof(State));
  if (e != cudaSuccess) return fail("cudaMalloc(producer state)", e);
  // sized for the largest batch once, so an emit never allocates (graph capture, no syncs)
  e = cudaMalloc(&p->xcnt, sizeof(int) * (size_t(o.max_rows) + 1));
  if (e != cudaSuccess) return fail("cudaMalloc(exception counts)", e);
  e = cudaMalloc(&p->part, sizeof(aiospec::cuda::Part) * size_t(kMaxBlocks));
  if (e != cudaSuccess) return fail("cudaMalloc(block counts)", e);
  {
    // the exchange waits for every block of a frame, so all of them must be resident at once:
    // the launch is cooperative (it waits for room rather than deadlock), with at most as many
    // blocks as the device holds; without cooperative launches the kernel takes the path where
    // no block waits for another
    int coop = 0, sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, o.device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, o.device);
    const size_t shmem_max = sizeof(long long) * kSharedRows * size_t(kMaxRowsPerBlock + 1);
    // (the kernel launched cooperatively with several blocks: the exchange with sampled_pos)
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, emit_kernel_for(true, true), aiospec::cuda::kThreads,
                                                      shmem_max) != cudaSuccess) {
      per_sm = 0;
      cudaGetLastError();
    }
    p->max_blocks = std::min<long long>(kMaxBlocks, (long long)per_sm * sms);
    p->exchange = kExchange && coop != 0 && p->max_blocks >= 2;
    if (!p->exchange) p->max_blocks = kMaxBlocks;
    // programmatic dependent launch (emit_kernel.cuh, AIOSPEC_PDL): the kernel's launch and
    // entry overlap the end of the step's last kernel; Hopper and later, with a runtime and a
    // driver of CUDA 12.3 or later (stream capture of such launches into graphs)
    int major = 0, runtime = 0, driver = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, o.device);
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    // AIOSPEC_CUDA_PDL=0 launches without it (to measure what it gives, or for a driver that
    // mishandles it)
    const char* env = std::getenv("AIOSPEC_CUDA_PDL");
    p->pdl = kPdl && major >= 9 && runtime >= 12030 && driver >= 12030 &&
             !(env != nullptr && std::strcmp(env, "0") == 0);
  }
  e = cudaHostAlloc(&p->mh, sizeof(Mapped), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) return fail("cudaHostAlloc(error word)", e);
  std::memset(static_cast<void*>(p->mh), 0, sizeof(Mapped));
  e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&p->md), p->mh, 0);
  if (e != cudaSuccess) return fail("cudaHostGetDevicePointer(error word)", e);

  State init;
  std::memset(static_cast<void*>(&init), 0, sizeof init);
  init.head = aiospec::load_acquire(m.ctl64(AIOSPEC_OFF_HEAD));
  init.tail_cache = 0;  // a valid lower bound; the first frame that needs it rescans
  init.frames_written = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN));
  init.bytes_written = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_BYTES_WRITTEN));
  init.frames_lost = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_FRAMES_LOST));
  init.key = aiospec::cuda::kNoError;
  e = cudaMemcpy(p->st, &init, sizeof init, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) return fail("cudaMemcpy(producer state)", e);

  if (o.liveness_s > 0) {
    aiospec_cuda_producer* raw = p.get();
    const auto period = std::chrono::duration<double>(o.liveness_s);
    p->live = std::thread([raw, period] {
      std::unique_lock<std::mutex> lock(raw->live_mu);
      while (!raw->live_cv.wait_for(lock, period, [raw] { return raw->stop; })) {
        lock.unlock();
        try {
          raw->liveness();
        } catch (...) {
          // a failing flock or a vanished bell must not end the process; retry next period
        }
        lock.lock();
      }
    });
  }
  *out = p.release();
  return 0;
}

void aiospec_cuda_producer_destroy(aiospec_cuda_producer* p) {
  if (p == nullptr) return;
  try {
    p->release();
  } catch (...) {
  }
  delete p;
}

cudaError_t aiospec_cuda_emit_ex(aiospec_cuda_producer* p, const aiospec_emit_args* args, const uint64_t* step_dev,
                                 cudaStream_t stream) {
  if (p == nullptr || args == nullptr || p->ring == nullptr) return cudaErrorInvalidValue;
  aiospec_set_error(&p->last, AIOSPEC_E_OK, 0, -1, -1, 0, 0, 0, -1);
  aiospec_error e;
  if (aiospec_check_args(args, &e) != AIOSPEC_E_OK) {
    p->last = e;
    return cudaErrorInvalidValue;
  }
  if (args->rows > p->opts.max_rows) {
    aiospec_set_error(&p->last, AIOSPEC_E_MAX_ROWS, AIOSPEC_ARG_ROWS, -1, -1, args->rows, 0, p->opts.max_rows, -1);
    return cudaErrorInvalidValue;
  }
  DeviceGuard guard(p->opts.device);
  if (guard.status() != cudaSuccess) return guard.status();
  long long rpb = p->opts.rows_per_block;
  const long long max_blocks = p->max_blocks;
  const bool sampled = aiospec_uses_sampled_pos(aiospec_frame_k(args), aiospec_has_logprobs(args));
  const bool solo_frame = args->rows <= kMaxRowsPerBlock && frame_bound(args) <= kSoloBytes;
  // the exchange of several blocks: fewer rows a block where that makes kMinExchangeBlocks
  if (!solo_frame && sampled && p->exchange && args->rows / kMinExchangeBlocks < rpb) {
    rpb = std::max<long long>(1, args->rows / kMinExchangeBlocks);
  }
  if ((args->rows + rpb - 1) / rpb > max_blocks) rpb = (args->rows + max_blocks - 1) / max_blocks;
  if (solo_frame) rpb = args->rows > 0 ? args->rows : 1;
  if (rpb > kMaxRowsPerBlock) rpb = kMaxRowsPerBlock;
  const long long blocks = args->rows > 0 ? (args->rows + rpb - 1) / rpb : 1;
  const size_t shmem = sizeof(long long) * kSharedRows * size_t(rpb + 1);
  // One block always takes the exchange path (with nothing to exchange). Several take it for
  // the sampled_pos encoding, where each block counting every token's exceptions (or the
  // pre-pass) costs more than the exchange's wait; without it every block checking every row
  // is cheaper than the wait (docs/benchmarks.md).
  bool exchange = blocks == 1 || (sampled && p->exchange && blocks <= p->max_blocks);
  // emit_kernel through cudaLaunchKernelEx: cooperative (the exchange of several blocks) and
  // programmatic stream serialization (p->pdl), either, both or neither
  auto launch = [&](bool cooperative, int inline_x, bool through_exchange) {
    const EmitKernel kernel = emit_kernel_for(through_exchange, sampled);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(unsigned(aiospec::cuda::kThreads));
    cfg.dynamicSmemBytes = shmem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    for (;;) {
      unsigned n = 0;
      if (cooperative && AIOSPEC_COOP) {
        attr[n].id = cudaLaunchAttributeCooperative;
        attr[n++].val.cooperative = 1;
      }
      if (p->pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n++].val.programmaticStreamSerializationAllowed = 1;
      }
      cfg.attrs = attr;
      cfg.numAttrs = n;
      const cudaError_t rc = cudaLaunchKernelEx(&cfg, kernel, *args, p->ref, p->st, p->md, step_dev,
                                                static_cast<const int*>(p->xcnt), p->part, int(rpb), inline_x,
                                                int(through_exchange));
      if (rc == cudaSuccess) return rc;
      cudaGetLastError();  // not left for the caller's next launch check
      if ((rc != cudaErrorNotSupported && rc != cudaErrorInvalidValue) || !p->pdl) return rc;
      // a driver that takes the kernel but not the attribute (or not beside a cooperative
      // launch): this producer launches without it from now on
      p->pdl = false;
    }
  };
  cudaError_t status = cudaSuccess;
  if (exchange && blocks > 1) {
    status = launch(true, 0, true);
    if (status == cudaErrorCooperativeLaunchTooLarge || status == cudaErrorNotSupported ||
        status == cudaErrorNotPermitted) {
      // the device holds fewer blocks at once than it reported (an MPS share, a partition):
      // this producer takes the path where no block waits for another from now on
      cudaGetLastError();
      p->exchange = false;
      exchange = false;
      status = cudaSuccess;
    }
  }
  if (!exchange || blocks == 1) {
    bool inline_x = false;
    if (!exchange && sampled) {
      inline_x = args->max_tokens <= kInlineMaxTokens && args->rows * args->max_tokens <= kInlineTokens;
      if (!inline_x) {
        // the step's exceptions, counted once for all blocks (emit_kernel.cuh)
        const long long pre_blocks = (args->rows + aiospec::cuda::kPreRows - 1) / aiospec::cuda::kPreRows;
        if (pre_blocks > 0) {
          aiospec::cuda::exceptions_kernel<<<unsigned(pre_blocks), aiospec::cuda::kPreThreads, 0, stream>>>(*args,
                                                                                                           p->xcnt);
        }
        const cudaError_t pre = cudaGetLastError();
        if (pre != cudaSuccess) return pre;
      }
    }
    status = launch(false, int(inline_x), exchange);
  }
  if (status == cudaSuccess && p->opts.host_notify) status = cudaLaunchHostFunc(stream, notify_callback, p);
  if (status == cudaSuccess) ++p->emits;
  return status;
}

cudaError_t aiospec_cuda_emit(aiospec_cuda_producer* p, const aiospec_emit_args* args, cudaStream_t stream) {
  return aiospec_cuda_emit_ex(p, args, nullptr, stream);
}

const void* aiospec_cuda_placeholder(const aiospec_cuda_producer* p) { return p != nullptr ? p->st : nullptr; }

void aiospec_cuda_last_error(const aiospec_cuda_producer* p, aiospec_error* out) {
  if (p != nullptr && out != nullptr) *out = p->last;
}

int aiospec_cuda_check(aiospec_cuda_producer* p, aiospec_error* out, uint64_t* step) {
  if (p == nullptr || p->mh == nullptr) return 0;
  const uint64_t seq = __atomic_load_n(const_cast<unsigned long long*>(&p->mh->seq), __ATOMIC_ACQUIRE);
  if (seq == p->reported) return 0;
  if (out != nullptr) {
    const aiospec_error& src = p->mh->err;
    std::memcpy(out, &src, sizeof *out);
  }
  if (step != nullptr) *step = p->mh->step;
  p->reported = seq;
  __atomic_store_n(const_cast<unsigned long long*>(&p->mh->ack), (unsigned long long)seq, __ATOMIC_RELEASE);
  return 1;
}

#ifdef AIOSPEC_PHASES
// Measurement builds only (emit_kernel.cuh): the last emit's phase clocks.
int aiospec_cuda_phases(unsigned long long* out) {
  // read, then zeroed: a clock the next emit does not store (a phase its path skips) reads 0
  const cudaError_t rc = cudaMemcpyFromSymbol(out, aiospec_cuda_phase_clock, 16 * sizeof(unsigned long long));
  if (rc != cudaSuccess) return int(rc);
  static const unsigned long long zero[16] = {};
  return int(cudaMemcpyToSymbol(aiospec_cuda_phase_clock, zero, sizeof zero));
}
// and every block's clocks (kBlockClocks x 7 words)
static_assert(kMaxBlocks <= aiospec::cuda::kBlockClocks, "a clock row for every block the launcher makes");
extern "C" int aiospec_cuda_block_clocks(unsigned long long* out) {
  return int(cudaMemcpyFromSymbol(out, aiospec_cuda_block_clock, sizeof aiospec_cuda_block_clock));
}
#endif

const volatile uint64_t* aiospec_cuda_error_seq(const aiospec_cuda_producer* p) {
  return p != nullptr && p->mh != nullptr ? reinterpret_cast<const volatile uint64_t*>(&p->mh->seq) : nullptr;
}

int aiospec_cuda_format_error(const aiospec_cuda_producer* p, const aiospec_error* e, char* buf, size_t size) {
  if (e->code == AIOSPEC_E_RING_FULL && p != nullptr && p->ring != nullptr) {
    // the CPU writer's RingFull message (ring.h), with the readers as they lag now
    auto* mp = const_cast<aiospec_cuda_producer*>(p);
    std::lock_guard<std::mutex> lock(mp->mu);
    const std::string msg = "ring " + p->ring->name() + ": no room for a " + std::to_string(e->value) +
                            "-byte frame after " + aiospec::py_float(p->opts.timeout_s) + " s; lagging reader(s): " +
                            describe_laggards(mp, uint64_t(e->lo), uint64_t(e->hi));
    return std::snprintf(buf, size, "%s", msg.c_str());
  }
  if (e->code == AIOSPEC_E_MAX_ROWS) {
    return std::snprintf(buf, size, "rows = %lld: expected 0..%lld (the producer's max_rows)", (long long)e->value,
                         (long long)e->hi);
  }
#ifndef __CUDA_ARCH__  // emit.h declares the formatter for host passes only
  return aiospec_format_error(e, buf, size);
#else
  return 0;
#endif
}

int aiospec_cuda_notify(aiospec_cuda_producer* p) {
  if (p == nullptr) return 0;
  try {
    return p->notify();
  } catch (...) {
    return -1;
  }
}

void aiospec_cuda_stats_get(const aiospec_cuda_producer* p, aiospec_cuda_stats* out) {
  std::memset(out, 0, sizeof *out);
  if (p == nullptr || p->ring == nullptr) return;
  const aiospec::RingMap& m = p->ring->map();
  out->head = aiospec::load_acquire(m.ctl64(AIOSPEC_OFF_HEAD));
  out->frames_written = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN));
  out->bytes_written = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_BYTES_WRITTEN));
  out->frames_lost = aiospec::load_relaxed(m.ctl64(AIOSPEC_OFF_FRAMES_LOST));
  out->errors = p->mh != nullptr ? p->mh->errors : 0;
  out->errors_reported = p->reported;
  out->emits = p->emits;
  out->capacity = m.capacity;
  out->max_record = m.max_record;
  out->max_rows = p->opts.max_rows;
}

}  // extern "C"
