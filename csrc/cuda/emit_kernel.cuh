// The emit op's CUDA kernel: raw pointers in, one frame written into a mapped ring segment.
// CUDA C++ only, private to csrc/cuda/emit_cuda.cu (the launcher) beside it; the build cache
// key (aiospec/ops/_build.py) covers the headers next to each source as well as include/.
//
// One launch per frame, a block per `rows_per_block` rows; on sm_90 and later a programmatic
// dependent launch (AIOSPEC_PDL below): the kernel waits for the kernels before it before it
// loads anything, and lets the next one launch once its inputs are read. In one of two ways:
//   * the exchange (`exchange`: one block, or several with the sampled_pos encoding, launched
//     cooperatively so that all are resident): each block checks its own rows (emit.h's
//     structural checks, a thread a row; the smallest error key and the records' count bounds
//     by warp reductions), counts its records, tokens, draft ids and its own
//     tokens' exceptions (2 to 8 lanes a token, sampled_pos_group, the positions kept in shared
//     memory for the columns), publishes the counts in device scratch, waits until every
//     block has (a release/acquire counter), then reads them all: the totals, the counts
//     before its rows and the smallest error key. One block exchanges nothing.
//   * otherwise (frames of several blocks without sampled_pos, or a device without
//     cooperative launches) nothing passes between blocks before the end, and no block ever
//     waits for another: every block runs emit.h's structural row checks (counts, flags, handles, logprob
//     offsets, positions: aiospec_check_row with the id checks switched off) and sums the
//     records, tokens and draft ids over all rows, with the smallest and largest count of
//     the records (payload version 2 omits the offset columns when the counts are uniform),
//     which gives every block the same layout and the same frame position (from the head in
//     device memory).
//     With the sampled_pos encoding (logprobs, 1 <= k <= 255) the layout also needs the
//     number of exceptions (tokens not found in their top-k), and each block the number
//     before its rows. A small step (at most kInlineTokens tokens, emit_cuda.cu) has them
//     counted by every block in its row checks (emit.h's aiospec_row_exceptions). A larger
//     one gets a pre-pass on the same stream (`exceptions_kernel`) that evaluates
//     aiospec_sampled_pos once per token and writes each row's exceptions into device
//     scratch; every block adds them up with the other counts of its row checks (one load a
//     row; the kernel boundary orders the scratch, no block waits for another).
// Then, either way:
//   * each block prefix-sums its own rows, so its slice of every column is contiguous and a
//     warp's stores to host memory coalesce; with sampled_pos a block scan over its tokens
//     gives each exception its index;
//   * every block checks for space against the slowest reader on its own (the tails are
//     read from the mapped control page only when the cached lower bound says the ring may
//     be full; a bounded wait on %globaltimer); a block that runs out of time writes nothing
//     and marks the frame lost;
//   * block 0 writes the PAD frame when the frame does not fit before the end of the data
//     area, the msgpack header (its last warp, a lane a field), the position word and every
//     padding word; each block writes
//     its rows' columns and checks their int64 ids;
//   * the last block to finish (threadfence reduction on a device counter) publishes: zero
//     the next header, release-store the 8-byte commit word at system scope, then the
//     counters and, release-stored too, the head (a reader takes a head past a commit word
//     that still reads 0 for a wiped frame: the head must never be seen first).
// An error (the first in emit.h's order: smallest aiospec_error_order key, details recomputed
// with aiospec_check_row) or a ring that stayed full means no commit: the error goes to a
// word in mapped host memory and frames_lost rises, in the control page too.
//
// Only plain loads and stores touch host memory: the GPU this runs on cannot do atomics on
// it (hostNativeAtomicSupported = 0). Atomics and counters live in device memory.
#ifndef AIOSPEC_CUDA_EMIT_KERNEL_CUH_
#define AIOSPEC_CUDA_EMIT_KERNEL_CUH_

#ifndef __CUDACC__
#error "emit_kernel.cuh is CUDA C++: compile with nvcc"
#endif

#include <cuda_runtime.h>
#include <stdint.h>

#include "aiospec/emit.h"
#include "aiospec/emit_cuda.h"
#include "aiospec/layout.h"

// Measurement switches (scripts/gpu_check.sh "variants"; docs/benchmarks.md has the numbers).
// AIOSPEC_FENCE_MODE, where the system-scope ordering is paid:
//   2 (default) the threadfence-reduction pattern: each block, after its barrier, fences at
//     gpu scope and counts itself done; the last block's commit is a release store at system
//     scope, which carries every block's stores with it (release cumulativity of the PTX
//     memory model: they precede it in causality order through the barrier and the counter).
//     The PAD frame has its own system fence before its commit.
//   1 block: as 2, with a system-scope fence per block before it counts itself done.
//   0 strict: every thread fences at system scope after its stores, and the last block
//     fences before and after the commit as well.
//   3 none: no fences and a plain commit store; a lower bound, not a correct protocol.
// AIOSPEC_THREADS: threads per block.
// AIOSPEC_SPECIALIZE, which kernel the launcher takes (emit_kernel's template arguments):
//   1 (default) the one specialized for the frame's path without the sampled_pos encoding, the
//   one that decides at run time with it (the specialized one measured slower there, back to
//   back: docs/benchmarks.md); 2 the specialized one for every frame; 0 the one that decides
//   at run time for every frame (one kernel holding every path, as before the instantiations).
#ifndef AIOSPEC_SPECIALIZE
#define AIOSPEC_SPECIALIZE 1
#endif
// AIOSPEC_PDL, programmatic dependent launch (sm_90 and later; the launcher sets the launch
// attribute only on such devices, and without it both instructions do nothing):
//   1 (default) the kernel waits for the kernels before it (griddepcontrol.wait) before its
//     first load of anything they wrote, so its launch and entry overlap their end; the
//     committing block lets the next kernel launch once it has read its last input, before
//     its commit (a kernel that overwrites this step's inputs without waiting still cannot
//     change what the frame holds);
//   2 as 1, the next kernel let launch right after the wait: a measurement of the most the
//     overlap gives, correct only when what comes next waits;
//   0 off: no wait, no trigger (the launcher then sets no attribute either).
#ifndef AIOSPEC_PDL
#define AIOSPEC_PDL 1
#endif
// AIOSPEC_WARP_COUNTS, how the exchange path gathers its rows' smallest error key and the
// records' count bounds: 1 (default) a warp reduction, one shared store a warp, folded by
// thread 0 after the scan; 0 shared atomics from every row's thread on one word each (which
// also needs a barrier after their initialization).
#ifndef AIOSPEC_WARP_COUNTS
#define AIOSPEC_WARP_COUNTS 1
#endif
// AIOSPEC_HEADER_WARP, who encodes the msgpack header: 1 (default) block 0's last warp, a
// lane a field at its fixed offset; 0 one lane with emit.h's serial encoder.
#ifndef AIOSPEC_HEADER_WARP
#define AIOSPEC_HEADER_WARP 1
#endif
#ifndef AIOSPEC_FENCE_MODE
#define AIOSPEC_FENCE_MODE 2
#endif
// AIOSPEC_POS_LANES, the lanes a token of the exchange path's sampled_pos count: 0 (default) 8,
// 4 or 2, the most that leave one pass over the block's tokens; 2, 4 or 8 fixed.
#ifndef AIOSPEC_POS_LANES
#define AIOSPEC_POS_LANES 0
#endif
// AIOSPEC_EMPTY=1: the kernel returns right after its wait, writing nothing: the floor of this
// kernel's own launch (its arguments, block size and launch attributes), not an emit.
#ifndef AIOSPEC_EMPTY
#define AIOSPEC_EMPTY 0
#endif
// AIOSPEC_WARP_GATHER, who reads the exchange's counts of every block: 1 (default) warp 0,
// folding them with shuffles, 32 blocks a round; 2 as 1 up to 32 blocks, past them a warp for
// each 32 blocks (one round each up to 256), the warps' sums folded from shared memory after
// a barrier (1 us faster at 125 and 128 blocks, 0.4-0.8 us slower at 32 or fewer:
// docs/benchmarks.md, "Past 32 blocks"); 0 every thread a block, with shared atomics and
// block-wide sums.
#ifndef AIOSPEC_WARP_GATHER
#define AIOSPEC_WARP_GATHER 1
#endif
// AIOSPEC_NO_COLUMNS (measurement only, the frames are not the CPU writer's): 1 leaves out
// every store of the rows' columns, 2 only those of the one-byte columns (flags, sampled_pos).
#ifndef AIOSPEC_NO_COLUMNS
#define AIOSPEC_NO_COLUMNS 0
#endif
#ifndef AIOSPEC_THREADS
#define AIOSPEC_THREADS 256
#endif
// AIOSPEC_PHASES: thread 0 of block 0 (phases 9 = entry, 0-6) and the committing thread (7, 8) store
// clock64() at each phase boundary into aiospec_cuda_phase_clock (emit_cuda.cu), where the
// driver's "phases" mode reads them; meaningful for one-block frames (one SM's clock). Thread 0
// of every block also stores, into aiospec_cuda_block_clock: its %globaltimer after the wait,
// its cycles from there to the end of its row checks, to the end of its exceptions' count and
// out of the exchange's wait, its %globaltimer then, its SM and the grid's size (the driver's
// "coldone" mode).
#ifdef AIOSPEC_PHASES
__device__ unsigned long long aiospec_cuda_phase_clock[16];
namespace aiospec {
namespace cuda {
constexpr unsigned kBlockClocks = 264;  // rows of aiospec_cuda_block_clock: emit_cuda.cu's kMaxBlocks
}  // namespace cuda
}  // namespace aiospec
__device__ unsigned long long aiospec_cuda_block_clock[aiospec::cuda::kBlockClocks][7];
#define AIOSPEC_BCLOCK(q, v)                                                                       \
  do {                                                                                             \
    if (threadIdx.x == 0 && blockIdx.x < aiospec::cuda::kBlockClocks) aiospec_cuda_block_clock[blockIdx.x][q] = (v); \
  } while (0)
__device__ __forceinline__ unsigned aiospec_smid() {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
// Slots 14 and 15: the SM + 1 (0: not stored) of the committing thread (phases 7, 8) and of
// block 0 (entry): clock64() is an SM's own counter, so phases 7 and 8 compare with the entry
// only on one SM.
#define AIOSPEC_PHASE(n)                                                                         \
  do {                                                                                           \
    if ((n) == 7 || (n) == 8 || (blockIdx.x == 0 && threadIdx.x == 0)) aiospec_cuda_phase_clock[n] = clock64(); \
    if ((n) == 7) aiospec_cuda_phase_clock[14] = aiospec_smid() + 1ull;                          \
    if ((n) == 9 && blockIdx.x == 0 && threadIdx.x == 0) aiospec_cuda_phase_clock[15] = aiospec_smid() + 1ull; \
  } while (0)
#else
#define AIOSPEC_PHASE(n) \
  do {                   \
  } while (0)
#define AIOSPEC_BCLOCK(q, v) \
  do {                       \
  } while (0)
#endif

namespace aiospec {
namespace cuda {

constexpr int kThreads = AIOSPEC_THREADS;
constexpr int kPosCache = 4096;  // the exchange path keeps up to this many tokens' sampled_pos
constexpr uint64_t kNoError = ~0ull;
constexpr uint64_t kFrameSizeKey = ~0ull - 1;  // aiospec_error_order of E_FRAME_SIZE

// Where the ring is, as the device sees it (the registered mapping), and its geometry.
struct RingRef {
  uint8_t* ctl;  // control page
  uint8_t* data;  // data area = ctl + CONTROL_SIZE
  uint64_t capacity;
  uint64_t mask;
  uint64_t max_record;
  uint32_t max_readers;
  uint64_t timeout_ns;  // back-pressure wait before "ring full"
};

// Producer state in device memory; zeroed by the host, then head and counters copied from
// the control page. The per-frame words are reset by the last block of each launch.
struct State {
  unsigned long long head;
  unsigned long long tail_cache;  // a lower bound of every active reader's tail
  unsigned long long frames_written;
  unsigned long long bytes_written;
  unsigned long long frames_lost;
  unsigned long long errors;  // errors seen
  unsigned long long published;  // errors published to the mapped word
  // per frame
  unsigned long long key;  // smallest id-check error key (atomicMin)
  unsigned long long needed_tail;  // ring full: where the slowest tail had to be
  unsigned int blocks_done;  // threadfence reduction
  unsigned int full;  // a block ran out of time waiting for space
  unsigned int pad_done;  // block 0 committed a PAD frame
  unsigned int pos_written;  // block 0 stored the frame's position word (cleared if no commit)
  unsigned int arrived;  // blocks that published their partial counts (the exchange)
};

// One block's counts over its own rows, published for the others (the exchange path).
struct alignas(64) Part {
  long long r, t, d, e;  // records, tokens, draft ids, exceptions
  int nt_min, nt_max, nd_min, nd_max;  // token / draft counts of the records
  unsigned long long key;  // smallest structural error key (kNoError: none)
};

// The error word in mapped (pinned) host memory. The device publishes an error only when
// the host has acknowledged the previous one, so the host always reads a whole record.
struct alignas(128) Mapped {
  volatile unsigned long long seq;  // device: errors published
  volatile unsigned long long errors;  // device: errors seen (published or not)
  volatile unsigned long long step;  // device: step of the published error
  unsigned long long pad0[13];
  volatile unsigned long long ack;  // host: errors reported
  unsigned long long pad1[15];
  aiospec_error err;  // device: the published error
};

// ---- helpers ---------------------------------------------------------------------------------

__device__ __forceinline__ void st_u64(uint8_t* p, uint64_t v) { *reinterpret_cast<volatile uint64_t*>(p) = v; }
__device__ __forceinline__ void st_u32(uint8_t* p, uint32_t v) { *reinterpret_cast<volatile uint32_t*>(p) = v; }
__device__ __forceinline__ void st_u8(uint8_t* p, uint8_t v) { *reinterpret_cast<volatile uint8_t*>(p) = v; }

__device__ __forceinline__ void st_release_sys_u64(uint8_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The control page's head, after a commit word: released at system scope, so that no reader
// sees it before that word. Plain stores to host memory at different addresses reach it in
// any order (they leave through different L2 slices): a head stored plainly after the commit
// was measured to arrive first.
__device__ __forceinline__ void st_head(const RingRef& ring, uint64_t v) {
#if AIOSPEC_FENCE_MODE == 3
  st_u64(ring.ctl + AIOSPEC_OFF_HEAD, v);
#else
  st_release_sys_u64(ring.ctl + AIOSPEC_OFF_HEAD, v);
#endif
}
__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const unsigned int* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint8_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}
// Into L1 without a register waiting for it: the checks' loads, each behind a branch on the
// one before, then hit L1 instead of making one round trip to L2 / HBM each.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ void prefetch_row(const aiospec_emit_args& a, int64_t i) {
  prefetch_l1(a.num_tokens + i);
  prefetch_l1(a.handles + i);
  if (a.flags != nullptr) prefetch_l1(a.flags + i);
  if (a.num_draft != nullptr) prefetch_l1(a.num_draft + i);
  if (a.lp_offsets != nullptr) {
    prefetch_l1(a.lp_offsets + i);
    prefetch_l1(a.lp_offsets + i + 1);
  }
  const int64_t tw = a.token_ids_i64 ? 8 : 4;
  const uint8_t* tok = static_cast<const uint8_t*>(a.token_ids) + aiospec_token_row(&a, i) * tw;
  if (a.max_tokens > 0) prefetch_l1(tok);
}

// griddepcontrol (PTX ISA 7.8, sm_90): wait returns once every kernel this grid depends on
// has completed and its memory is visible; launch_dependents lets the next grid launch once
// every block of this one has issued it or exited. No-ops in a grid launched without the
// programmatic stream serialization attribute.
__device__ __forceinline__ void pdl_wait() {
#if AIOSPEC_PDL != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if AIOSPEC_PDL != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t warp_min_u64(uint64_t v) {
  for (int s = 16; s > 0; s >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, s);
    v = o < v ? o : v;
  }
  return v;
}

// Warp-wide min / max of an int (every lane calls it): one REDUX on sm_80 and later.
__device__ __forceinline__ int warp_min_i32(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(0xffffffffu, v);
#else
  for (int s = 16; s > 0; s >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, s));
  return v;
#endif
}
__device__ __forceinline__ int warp_max_i32(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  for (int s = 16; s > 0; s >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, s));
  return v;
#endif
}

__device__ __forceinline__ unsigned long long min_key(unsigned long long a, uint64_t b) {
  return b < a ? (unsigned long long)b : a;
}

// Row of an error key made by aiospec_error_order (1 + (brow << 33 | check << 29 | sub)).
__device__ __forceinline__ int64_t key_row(uint64_t key) { return int64_t(((key - 1) >> 33) & 0x3FFFFFFFull); }

__device__ __forceinline__ uint64_t id_error_key(int64_t brow, int32_t check, int64_t elem) {
  aiospec_error e;
  aiospec_set_error(&e, AIOSPEC_E_ID, AIOSPEC_ARG_NONE, check == AIOSPEC_CHECK_LP ? elem : brow,
                    check == AIOSPEC_CHECK_LP ? -1 : elem, 0, 0, 0, check);
  e.brow = int32_t(brow);
  return aiospec_error_order(&e);
}

// Smallest tail over active reader slots, clamped to head (head when none). Whole warp.
__device__ uint64_t scan_min_tail(const RingRef& ring, uint64_t head) {
  const uint32_t lane = threadIdx.x & 31;
  uint64_t t = head;
  if (lane < ring.max_readers) {
    const uint8_t* slot = ring.ctl + AIOSPEC_READERS_BASE + size_t(lane) * AIOSPEC_READER_STRIDE;
    if (ld_acquire_sys_u32(slot + AIOSPEC_RD_STATE) == AIOSPEC_READER_ACTIVE) {
      const uint64_t v = ld_volatile_u64(slot + AIOSPEC_RD_TAIL);
      t = v < head ? v : head;
    }
  }
  return warp_min_u64(t);
}

// Records / tokens / draft ids / exceptions of one row (zero for rows past the first failing
// one). row_counts leaves e at 0: the exceptions are counted apart (inline or by
// exceptions_kernel).
struct Triple {
  long long r, t, d, e;
};

__device__ __forceinline__ Triple row_counts(const aiospec_emit_args& a, int64_t i) {
  return Triple{aiospec_row_has_record(&a, i) ? 1 : 0, a.num_tokens[i], a.num_draft != nullptr ? a.num_draft[i] : 0,
                0};
}

__device__ __forceinline__ Triple warp_sum(Triple v) {
  for (int s = 16; s > 0; s >>= 1) {
    v.r += __shfl_xor_sync(0xffffffffu, v.r, s);
    v.t += __shfl_xor_sync(0xffffffffu, v.t, s);
    v.d += __shfl_xor_sync(0xffffffffu, v.d, s);
    v.e += __shfl_xor_sync(0xffffffffu, v.e, s);
  }
  return v;
}

// The exchange's gather: block b's published counts added to the totals (and to `before`
// when b is ahead of this block), its error key and count bounds folded in.
__device__ __forceinline__ void fold_part(const Part* part, int b, Triple& total, Triple& before,
                                          unsigned long long& key, int& nt_min, int& nt_max, int& nd_min,
                                          int& nd_max) {
  const Part* q = part + b;
  const Triple c{__ldcg(&q->r), __ldcg(&q->t), __ldcg(&q->d), __ldcg(&q->e)};
  total.r += c.r, total.t += c.t, total.d += c.d, total.e += c.e;
  if (b < int(blockIdx.x)) before.r += c.r, before.t += c.t, before.d += c.d, before.e += c.e;
  key = min_key(key, __ldcg(&q->key));
  nt_min = min(nt_min, __ldcg(&q->nt_min)), nt_max = max(nt_max, __ldcg(&q->nt_max));
  nd_min = min(nd_min, __ldcg(&q->nd_min)), nd_max = max(nd_max, __ldcg(&q->nd_max));
}

// Block-wide sums of two triples; every thread gets the results.
__device__ __forceinline__ void block_sum2(Triple& x, Triple& y) {
  __shared__ Triple part[2][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  y = warp_sum(y);
  if (lane == 0) {
    part[0][warp] = x;
    part[1][warp] = y;
  }
  __syncthreads();
  x = y = Triple{0, 0, 0, 0};
  for (int w = 0; w < kThreads / 32; ++w) {
    x.r += part[0][w].r;
    x.t += part[0][w].t;
    x.d += part[0][w].d;
    x.e += part[0][w].e;
    y.r += part[1][w].r;
    y.t += part[1][w].t;
    y.d += part[1][w].d;
    y.e += part[1][w].e;
  }
  __syncthreads();  // part is reused by the next call
}

// Exclusive block-wide prefix sums of one triple per thread (r, t, d; e is not scanned).
__device__ __forceinline__ Triple block_exclusive_scan(Triple v) {
  __shared__ Triple warp_incl[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Triple inc = v;
  for (int s = 1; s < 32; s <<= 1) {
    const long long r = __shfl_up_sync(0xffffffffu, inc.r, s);
    const long long t = __shfl_up_sync(0xffffffffu, inc.t, s);
    const long long d = __shfl_up_sync(0xffffffffu, inc.d, s);
    if (lane >= s) {
      inc.r += r;
      inc.t += t;
      inc.d += d;
    }
  }
  if (lane == 31) warp_incl[warp] = inc;
  __syncthreads();
  Triple before{0, 0, 0, 0};
  for (int w = 0; w < warp; ++w) {
    before.r += warp_incl[w].r;
    before.t += warp_incl[w].t;
    before.d += warp_incl[w].d;
  }
  __syncthreads();
  return Triple{before.r + inc.r - v.r, before.t + inc.t - v.t, before.d + inc.d - v.d, 0};
}

// Exclusive block-wide prefix sum of one int per thread; *total gets the block's sum.
__device__ __forceinline__ int block_exclusive_scan_int(int v, int* total) {
  __shared__ int warp_incl[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inc = v;
  for (int s = 1; s < 32; s <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, inc, s);
    if (lane >= s) inc += o;
  }
  if (lane == 31) warp_incl[warp] = inc;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += warp_incl[w];
    sum += warp_incl[w];
  }
  __syncthreads();
  *total = sum;
  return before + inc - v;
}

// Largest li in [0, n) with off[li] <= e (off non-decreasing, off[0] <= e < off[n]).
__device__ __forceinline__ int find_row(const long long* off, int n, long long e) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= e) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// emit.h's aiospec_sampled_pos with G lanes a token (G = 2, 4 or 8, a group's lanes
// consecutive and aligned): lane `sub` of a group takes columns sub, sub + G, ... of the
// top-k, loading kPosLoads of them (values and ids) before it compares any, so a group reads
// up to G * kPosLoads columns in one round trip to memory where one thread makes k / 4. The
// same function: the number of values at or above the sampled logprob against the rank, and
// the first column with the same id and bits; each lane counts and matches its own columns,
// the group sums the counts and takes the smallest column with shuffles. Every lane of the
// warp calls it; `active` says whether this lane's group has a token.
constexpr int kPosLoads = 8;
template <int G>
__device__ __forceinline__ uint32_t sampled_pos_group(const aiospec_emit_args& a, bool active, int64_t lr, int64_t tok,
                                                      int64_t rank, uint32_t k) {
  static_assert(G == 2 || G == 4 || G == 8, "a group is 2, 4 or 8 lanes");
  const uint32_t sub = threadIdx.x & (G - 1);
  const float* vals = a.lp_values + (active ? aiospec_lp_values_row(&a, lr) : 0);
  const int64_t base = active ? aiospec_lp_ids_row(&a, lr) + 1 : 0;
  const float lp = active ? vals[0] : 0.f;
  const uint32_t bits = aiospec_float_bits(lp);
  const uint32_t kk = active ? k : 0u;
  uint32_t count = 0, first = AIOSPEC_SAMPLED_EXCEPTION;
  for (uint32_t j0 = sub; j0 < kk; j0 += G * kPosLoads) {
    float v[kPosLoads];
    int64_t id[kPosLoads];
#pragma unroll
    for (int q = 0; q < kPosLoads; ++q) {
      const uint32_t j = j0 + uint32_t(q * G);
      v[q] = 0.f;
      id[q] = 0;
      if (j < kk) {
        v[q] = vals[1 + j];
        id[q] = aiospec_load_int(a.lp_ids, a.lp_ids_i64, base + j);
      }
    }
#pragma unroll
    for (int q = 0; q < kPosLoads; ++q) {
      const uint32_t j = j0 + uint32_t(q * G);
      if (j < kk) {
        count += v[q] >= lp;
        // a lane's columns rise with q and j0: its first match is its smallest
        if (first == AIOSPEC_SAMPLED_EXCEPTION && id[q] == tok && aiospec_float_bits(v[q]) == bits) first = j;
      }
    }
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) {  // xor below G stays within the group
    count += __shfl_xor_sync(0xffffffffu, count, o);
    first = min(first, __shfl_xor_sync(0xffffffffu, first, o));  // the exception (255) above every column
  }
  return int64_t(count) == rank ? first : AIOSPEC_SAMPLED_EXCEPTION;
}

// The exchange path's count of its block's exceptions, G lanes a token (sampled_pos_group):
// tokens [0, nt) of the block's rows (s_tok: their exclusive scan; s_lp: their logprob rows),
// each token's sampled_pos kept in s_p for the columns. kThreads / G tokens a pass.
template <int G>
__device__ long long block_exceptions(const aiospec_emit_args& a, const long long* s_tok, const long long* s_lp, int n,
                                      int64_t row0, uint32_t k, uint8_t* s_p) {
  const long long nt = s_tok[n];
  const int tid = threadIdx.x;
  const bool lead = (tid & (G - 1)) == 0;
  long long x = 0;
  for (long long c0 = 0; c0 < nt; c0 += kThreads / G) {
    const long long e = c0 + tid / G;
    const bool active = e < nt;
    int64_t lr = 0, tok = 0, rank = 0;
    if (active) {
      const int li = find_row(s_tok, n, e);
      const int64_t j = e - s_tok[li];
      lr = s_lp[li] + j;
      tok = aiospec_token(&a, row0 + li, j);
      rank = aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, lr);
    }
    const uint32_t pos = sampled_pos_group<G>(a, active, lr, tok, rank, k);
    if (active && lead && e < kPosCache) s_p[e] = uint8_t(pos);
    x += __syncthreads_count(active && lead && pos == AIOSPEC_SAMPLED_EXCEPTION);
  }
  return x;
}

// ---- the sampled_pos pre-pass ----------------------------------------------------------------

constexpr int kPreThreads = 256;
constexpr int kPreRows = 32;  // rows per block: a warp checks them, the block shares their tokens
static_assert(kPreRows == 32, "exceptions_kernel scans its rows' counts in one warp");

// Launched before emit_kernel on the same stream when the step uses the sampled_pos encoding:
// xcnt[i] = the exceptions of row i (aiospec_sampled_pos once per token of the step). A block
// per kPreRows rows, token-parallel inside it: a scan of the rows' token counts maps each
// token to its row (a long prompt row is spread over the block like many short rows), a
// shared counter per row. A row that fails its structural checks gets 0 and is not followed
// (its inputs may not be safe to read): emit_kernel then reports the error and never uses
// the counts.
__global__ void __launch_bounds__(kPreThreads) exceptions_kernel(aiospec_emit_args a, int* xcnt) {
  __shared__ long long s_off[kPreRows + 1];
  __shared__ int s_cnt[kPreRows];
  const int tid = threadIdx.x;
  const int64_t c0 = int64_t(blockIdx.x) * kPreRows;
  const int n = a.rows - c0 < kPreRows ? int(a.rows - c0) : kPreRows;
  if (tid < 32) {
    aiospec_emit_args sa = a;  // the structural checks only, as emit_kernel's step 1
    sa.token_ids_i64 = 0;
    sa.draft_ids_i64 = 0;
    sa.lp_ids_i64 = 0;
    sa.lp_ranks_i64 = 0;
    long long nt = 0;
    if (tid < n) {
      aiospec_error e;
      if (aiospec_check_row(&sa, c0 + tid, &e) == AIOSPEC_E_OK) nt = a.num_tokens[c0 + tid];
    }
    long long inc = nt;
    for (int s = 1; s < 32; s <<= 1) {
      const long long o = __shfl_up_sync(0xffffffffu, inc, s);
      if (tid >= s) inc += o;
    }
    s_off[tid] = inc - nt;
    if (tid == 31) s_off[kPreRows] = inc;
    s_cnt[tid] = 0;
  }
  __syncthreads();
  const uint32_t k = aiospec_frame_k(&a);
  const long long end = s_off[kPreRows];
  for (long long e = tid; e < end; e += kPreThreads) {
    const int li = find_row(s_off, n, e);
    const int64_t row = c0 + li;
    const int64_t j = e - s_off[li];
    const int64_t lr = int64_t(a.lp_offsets[row]) + j;
    const uint32_t pos = aiospec_sampled_pos(&a, lr, aiospec_token(&a, row, j),
                                             aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, lr), k);
    if (pos == AIOSPEC_SAMPLED_EXCEPTION) atomicAdd(&s_cnt[li], 1);
  }
  __syncthreads();
  if (tid < n) xcnt[c0 + tid] = s_cnt[tid];
}

// One thread: count the failure, publish it to the host if the host took the last one.
__device__ void report_error(const aiospec_error& e, const RingRef& ring, State* st, Mapped* m, uint64_t step) {
  st->frames_lost += 1;
  st->errors += 1;
  st_u64(ring.ctl + AIOSPEC_OFF_FRAMES_LOST, st->frames_lost);
  if (st->published == m->ack) {
    m->step = step;
    m->err.code = e.code;
    m->err.arg = e.arg;
    m->err.row = e.row;
    m->err.col = e.col;
    m->err.value = e.value;
    m->err.lo = e.lo;
    m->err.hi = e.hi;
    m->err.check = e.check;
    m->err.brow = e.brow;
    __threadfence_system();
    st->published += 1;
    m->seq = st->published;
  }
  m->errors = st->errors;
  __threadfence_system();
}

// ---- block 0's frame-wide words ---------------------------------------------------------------

// Besides its rows, block 0 writes the words of the frame no row owns, one task per range of
// threads (disjoint, so they run side by side); the msgpack header is the last warp's.
namespace block0 {
// (the msgpack header: block 0's last warp, see step 4 of the kernel)
// the frame's absolute position (readers use it to detect a frame from an earlier lap)
constexpr int kPositionWord = 32;
// token_offsets[R] = T and draft_offsets[R] = D: the offset columns' last entries
constexpr int kTokenOffsetsEnd = 33;
constexpr int kDraftOffsetsEnd = 34;
// [kColumnPads, + NUM_COLUMNS): the zero word after a 4-byte column with an odd count
constexpr int kColumnPads = 64;
// [kAlignTail, + kAlignTailWords): the frame's alignment tail [16 + payload_len, frame_size)
constexpr int kAlignTail = 96;
constexpr int kAlignTailWords = AIOSPEC_FRAME_ALIGN / 8;

static_assert(AIOSPEC_HEADER_SPACE / 8 <= 32, "the header warp stores a word a lane");
static_assert(kColumnPads + AIOSPEC_NUM_COLUMNS <= kAlignTail, "column pads overlap the tail");
static_assert(kAlignTail + kAlignTailWords <= kThreads, "block 0's tasks need more threads");

// emit.h's aiospec_write_header with a lane a field, the same bytes (the driver compares every
// frame with the CPU writer's): every field is 0xce and a big-endian u32 (5 bytes), but the
// step, 0xcf and a u64 (9 bytes), after the 3-byte array16 prefix; then zeros to HEADER_SPACE.
constexpr int kHeaderEnd = 3 + 5 * AIOSPEC_HEADER_FIELDS + 4;  // 147 bytes, then zeros
static_assert(kHeaderEnd <= AIOSPEC_HEADER_SPACE, "the header outgrew its space");
static_assert(AIOSPEC_HEADER_FIELDS < 32 && AIOSPEC_HF_PAYLOAD_LEN == AIOSPEC_HF_COLUMNS + AIOSPEC_NUM_COLUMNS,
              "a lane a field: the fields below");
__device__ __forceinline__ void write_header_lanes(uint8_t* dst, const aiospec_frame_layout& lay, uint32_t producer,
                                                   uint64_t step, uint32_t kind, int lane) {
  if (lane < AIOSPEC_HEADER_FIELDS) {
    uint32_t v;
    switch (lane) {
      case AIOSPEC_HF_VERSION: v = AIOSPEC_PAYLOAD_VERSION; break;
      case AIOSPEC_HF_PRODUCER: v = producer; break;
      case AIOSPEC_HF_STEP: v = 0; break;
      case AIOSPEC_HF_KIND: v = kind; break;
      case AIOSPEC_HF_FFLAGS: v = lay.fflags; break;
      case AIOSPEC_HF_K: v = lay.k; break;
      case AIOSPEC_HF_R: v = uint32_t(lay.r); break;
      case AIOSPEC_HF_T: v = uint32_t(lay.t); break;
      case AIOSPEC_HF_D: v = uint32_t(lay.d); break;
      case AIOSPEC_HF_E: v = uint32_t(lay.e); break;
      case AIOSPEC_HF_NT: v = lay.nt; break;
      case AIOSPEC_HF_ND: v = lay.nd; break;
      case AIOSPEC_HF_PAYLOAD_LEN: v = uint32_t(lay.payload_len); break;
      default:
        // a mask per column, not lay.off[lane - ...]: an index known only at run time (or a
        // branch the compiler folds back into one) puts the whole layout on the stack, in
        // local memory, for every thread of the kernel
        v = 0;
#pragma unroll
        for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) {
          v |= uint32_t(lay.off[c]) & (0u - uint32_t(lane - AIOSPEC_HF_COLUMNS == c));
        }
        break;
    }
    uint8_t* q = dst + 3 + 5 * lane + (lane > AIOSPEC_HF_STEP ? 4 : 0);
    if (lane == AIOSPEC_HF_STEP) {
      q[0] = 0xcf;
      aiospec_put_be32(q + 1, uint32_t(step >> 32));
      aiospec_put_be32(q + 5, uint32_t(step));
    } else {
      q[0] = 0xce;
      aiospec_put_be32(q + 1, v);
    }
  } else if (lane == 31) {
    dst[0] = 0xdc;
    dst[1] = 0x00;
    dst[2] = AIOSPEC_HEADER_FIELDS;
    for (int b = kHeaderEnd; b < AIOSPEC_HEADER_SPACE; ++b) dst[b] = 0;
  }
}

__device__ __forceinline__ void write_frame_words(int tid, const aiospec_frame_layout& lay, uint8_t* frame,
                                                  uint64_t pos) {
  uint8_t* pay = frame + AIOSPEC_FRAME_HEADER;
  if (tid == kPositionWord) st_u64(frame, pos);
  if (tid == kTokenOffsetsEnd && lay.off[AIOSPEC_COL_TOKEN_OFFSETS] != 0) {
    st_u32(pay + lay.off[AIOSPEC_COL_TOKEN_OFFSETS] + 4 * lay.r, uint32_t(lay.t));
  }
  if (tid == kDraftOffsetsEnd && lay.off[AIOSPEC_COL_DRAFT_OFFSETS] != 0) {
    st_u32(pay + lay.off[AIOSPEC_COL_DRAFT_OFFSETS] + 4 * lay.r, uint32_t(lay.d));
  }
  // a column of 4-byte elements with an odd count ends 4 bytes before the next boundary; a
  // column of bytes (flags, sampled_pos) up to 7 bytes before it, in a word whose other bytes
  // its rows' threads store: byte stores, so no word is read back. Thread kColumnPads + c
  // takes column c; unrolled, so that c is a constant (the layout stays in registers).
#pragma unroll
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) {
    if (tid == kColumnPads + c && lay.off[c] != 0) {
      const uint64_t size = aiospec_column_size(c);
      const uint64_t end = lay.off[c] + aiospec_column_count(&lay, c) * size;
      if (size == 1) {
        for (uint64_t b = end; b & 7; ++b) st_u8(pay + b, 0);
      } else if (end & 7) {
        st_u32(pay + end, 0);
      }
    }
  }
  if (tid >= kAlignTail && tid < kAlignTail + kAlignTailWords) {
    const uint64_t w = AIOSPEC_FRAME_HEADER + lay.payload_len + 8 * uint64_t(tid - kAlignTail);
    if (w < lay.frame_size) st_u64(frame + w, 0);
  }
}
}  // namespace block0

// ---- the kernel ---------------------------------------------------------------------------------

// Dynamic shared memory: 4 * (rows_per_block + 1) int64 (emit_cuda.cu's kSharedRows);
// rows_per_block <= kThreads.
// An instantiation per path (the launcher picks it with the same functions of the arguments):
// Exchange, the exchange path (else every block checks every row; `exchange_rt` when
// kAtRunTime); Sampled, the sampled_pos encoding (aiospec_uses_sampled_pos; from the arguments
// when kAtRunTime). Exchange without Sampled is one block. A specialized kernel holds only its
// own path's code: a small emit spent more than half its warps' time waiting for instructions
// (Nsight Compute: stall "no instruction") in the kernel that held every path.
constexpr int kAtRunTime = 2;
template <int Exchange, int Sampled>
__global__ void __launch_bounds__(kThreads, 2)  // 2 blocks an SM: the cooperative grid's size (launcher)
    emit_kernel(aiospec_emit_args a, RingRef ring, State* st, Mapped* m, const uint64_t* step_dev,
                const int* xcnt, Part* part, int rows_per_block, int inline_x, int exchange_rt) {
  const bool exchange = Exchange == kAtRunTime ? exchange_rt != 0 : Exchange != 0;
  extern __shared__ long long sh[];
  __shared__ unsigned long long s_key, s_idkey, s_needed;
  __shared__ int s_write, s_last, s_full, s_pad, s_posw;
  __shared__ int s_nt_min, s_nt_max, s_nd_min, s_nd_max;  // counts of the records (uniform?)
  __shared__ alignas(8) uint8_t s_header[AIOSPEC_HEADER_SPACE];
  __shared__ uint8_t s_p[kPosCache];  // the exchange path: sampled_pos of this block's tokens
  AIOSPEC_PHASE(9);
  const int tid = threadIdx.x;
  const int rpb = rows_per_block;
  long long* s_rec = sh;
  long long* s_tok = sh + (rpb + 1);
  long long* s_dr = sh + 2 * (rpb + 1);
  long long* s_lp = sh + 3 * (rpb + 1);
  const int64_t rows = a.rows;
  const int64_t row0 = int64_t(blockIdx.x) * rpb;
  const int64_t row_end = row0 + rpb < rows ? row0 + rpb : rows;
  const int n = row_end > row0 ? int(row_end - row0) : 0;
  // nothing the kernels before this one wrote (the step's tensors, the producer state of the
  // last emit) is loaded, or prefetched into L1, before this
  pdl_wait();
  if (AIOSPEC_EMPTY) return;
#ifdef AIOSPEC_PHASES
  const long long c0_ = clock64();
  AIOSPEC_BCLOCK(0, globaltimer_ns());
  AIOSPEC_BCLOCK(5, aiospec_smid());
  AIOSPEC_BCLOCK(6, gridDim.x);
#endif
#if AIOSPEC_PDL == 2
  if (tid == 0) pdl_launch_dependents();
#endif
  if (exchange) {
    if (tid < n) prefetch_row(a, row0 + tid);  // a block reads only its own rows
  } else {
    for (int64_t i = tid; i < rows; i += kThreads) prefetch_row(a, i);
  }
  // issued now, used after the row checks: their latency hides behind that work
  const uint64_t head = st->head;
  const uint64_t tail_cache = tid < 32 ? st->tail_cache : 0;
  // the counters the committing thread adds to (only the last launch changed them)
  const uint64_t frames_written = tid == 0 ? st->frames_written : 0;
  const uint64_t bytes_written = tid == 0 ? st->bytes_written : 0;
  const uint64_t step = step_dev != nullptr ? *step_dev : a.step;
  // one block: the frame is committed by this block alone, with no device-memory round trip
  // between its stores and the commit (no counter, no state read back). The launcher makes
  // this gridDim.x == 1; written from the path so that a specialized kernel knows it at
  // compile time (the exchange without sampled_pos is one block, no exchange is several)
  const uint32_t k = aiospec_frame_k(&a);
  const bool sampled = Sampled == kAtRunTime ? aiospec_uses_sampled_pos(k, aiospec_has_logprobs(&a)) != 0 : Sampled != 0;
  const bool solo = exchange && (!sampled || gridDim.x == 1);
  if (tid == 0) {
    s_key = kNoError;
    s_idkey = kNoError;
    s_full = 0;
    s_pad = 0;
    s_posw = 0;
    s_nt_min = s_nd_min = INT32_MAX;
    s_nt_max = s_nd_max = -1;
  }
  // the row checks' shared atomics need the words initialized (the exchange path with warp
  // reductions has none: its first barrier is the scan's)
  if (!exchange || AIOSPEC_WARP_COUNTS == 0) __syncthreads();
  AIOSPEC_PHASE(0);

  aiospec_emit_args sa = a;  // the structural checks only (the id checks: where ids are copied)
  sa.token_ids_i64 = 0;
  sa.draft_ids_i64 = 0;
  sa.lp_ids_i64 = 0;
  sa.lp_ranks_i64 = 0;
  Triple before{0, 0, 0, 0}, total{0, 0, 0, 0};
  uint64_t skey = kNoError;
  if (exchange) {
    // 1-2 (the exchange). Each block checks and counts its own rows (a thread a row) and its
    // own tokens' exceptions (a thread a token), publishes the counts, waits until every block
    // has (the launch is cooperative: all blocks are resident), then reads them all: the
    // totals and what comes before its rows. One block: no exchange.
    Triple v{0, 0, 0, 0};
    unsigned long long rkey = kNoError;
    int ntl = INT32_MAX, nth = -1, ndl = INT32_MAX, ndh = -1;  // this row's counts, if a record
    if (tid < n) {
      const int64_t i = row0 + tid;
      aiospec_error e;
      if (aiospec_check_row(&sa, i, &e) != AIOSPEC_E_OK) {
        rkey = aiospec_error_order(&e);
      } else {
        v = row_counts(a, i);  // a failing row counts nothing: its counts are not safe to follow
        if (v.r) ntl = nth = int(v.t), ndl = ndh = int(v.d);
      }
      if (aiospec_has_logprobs(&a)) s_lp[tid] = a.lp_offsets[i];
    }
#if AIOSPEC_WARP_COUNTS
    __shared__ unsigned long long s_wkey[kThreads / 32];
    __shared__ int s_wcnt[kThreads / 32][4];
    {
      if (__any_sync(0xffffffffu, rkey != kNoError)) rkey = warp_min_u64(rkey);
      ntl = warp_min_i32(ntl), nth = warp_max_i32(nth);
      ndl = warp_min_i32(ndl), ndh = warp_max_i32(ndh);
      const int w = tid >> 5;
      if ((tid & 31) == 0) {
        s_wkey[w] = rkey;
        s_wcnt[w][0] = ntl, s_wcnt[w][1] = nth, s_wcnt[w][2] = ndl, s_wcnt[w][3] = ndh;
      }
    }
#else
    if (rkey != kNoError) atomicMin(&s_key, rkey);
    if (nth >= 0) {
      atomicMin(&s_nt_min, ntl);
      atomicMax(&s_nt_max, nth);
      atomicMin(&s_nd_min, ndl);
      atomicMax(&s_nd_max, ndh);
    }
#endif
    const Triple ex = block_exclusive_scan(v);  // its barriers publish the warps' values too
    if (tid <= n) {
      s_rec[tid] = ex.r;
      s_tok[tid] = ex.t;
      s_dr[tid] = ex.d;
    }
#if AIOSPEC_WARP_COUNTS
    if (tid == 0) {
      unsigned long long kk = kNoError;
      int c0 = INT32_MAX, c1 = -1, c2 = INT32_MAX, c3 = -1;
      for (int w = 0; w < kThreads / 32; ++w) {
        kk = min_key(kk, s_wkey[w]);
        c0 = min(c0, s_wcnt[w][0]), c1 = max(c1, s_wcnt[w][1]);
        c2 = min(c2, s_wcnt[w][2]), c3 = max(c3, s_wcnt[w][3]);
      }
      s_key = kk;
      s_nt_min = c0, s_nt_max = c1, s_nd_min = c2, s_nd_max = c3;
    }
#endif
    __syncthreads();
    long long own_x = 0;
#ifdef AIOSPEC_PHASES
    AIOSPEC_BCLOCK(1, clock64() - c0_);
#endif
    if (sampled) {
      // as many lanes a token as leave one pass for the block's tokens, 2 at the least
      // (AIOSPEC_POS_LANES fixes it for measurement)
      const long long nt = s_tok[n];
      const int lanes = AIOSPEC_POS_LANES != 0 ? AIOSPEC_POS_LANES : nt <= kThreads / 8 ? 8 : nt <= kThreads / 4 ? 4 : 2;
      own_x = lanes == 8   ? block_exceptions<8>(a, s_tok, s_lp, n, row0, k, s_p)
              : lanes == 4 ? block_exceptions<4>(a, s_tok, s_lp, n, row0, k, s_p)
                           : block_exceptions<2>(a, s_tok, s_lp, n, row0, k, s_p);
    }
    if (solo) {
      skey = s_key;
      total = Triple{s_rec[n], s_tok[n], s_dr[n], own_x};
    } else {
#if !AIOSPEC_WARP_GATHER
      __shared__ unsigned long long s_gkey;
      __shared__ int s_g[4];
#endif
#ifdef AIOSPEC_PHASES
      AIOSPEC_BCLOCK(2, clock64() - c0_);
#endif
      if (tid == 0) {
        Part* mine = part + blockIdx.x;
        mine->r = s_rec[n];
        mine->t = s_tok[n];
        mine->d = s_dr[n];
        mine->e = own_x;
        mine->nt_min = s_nt_min;
        mine->nt_max = s_nt_max;
        mine->nd_min = s_nd_min;
        mine->nd_max = s_nd_max;
        mine->key = s_key;
        // release: this block's counts before its arrival; acquire: every block's after the
        // wait (the barrier below passes them on to the block's other threads)
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(&st->arrived), "r"(1u) : "memory");
        while (ld_acquire_gpu_u32(&st->arrived) < gridDim.x) {
        }
#ifdef AIOSPEC_PHASES
        AIOSPEC_BCLOCK(3, clock64() - c0_);
        AIOSPEC_BCLOCK(4, globaltimer_ns());
#endif
#if !AIOSPEC_WARP_GATHER
        s_gkey = kNoError;
        s_g[0] = s_g[2] = INT32_MAX;
        s_g[1] = s_g[3] = -1;
#endif
      }
#if AIOSPEC_WARP_GATHER
      // Warp 0 alone reads every block's counts and folds them with shuffles; the other
      // warps wait at one barrier. In the gather over the whole block (AIOSPEC_WARP_GATHER=0)
      // a warp that only some lanes used (34, 50 or 100 blocks) could reach block_sum2's
      // shuffles with its lanes apart, and the compiled code then takes its divergent path, a
      // WARPSYNC.COLLECTIVE around each of 80 shuffles: about 9 us a frame (docs/benchmarks.md,
      // "The exchange's slow mode, found and removed").
      // Past 32 blocks (AIOSPEC_WARP_GATHER=2), a warp for each 32 of them (up to 8 warps, each
      // a whole warp in every round, so no warp reaches the shuffles with its lanes apart),
      // folded from shared memory after the barrier; warp 0 alone otherwise.
      constexpr int kWarps = kThreads / 32;
      __shared__ Triple s_wt[2][kWarps];
      __shared__ unsigned long long s_wk[kWarps];
      __shared__ int s_wg[kWarps][4];
      const int nb = int(gridDim.x);
      const int gw = AIOSPEC_WARP_GATHER == 2 && nb > 32 ? min(kWarps, (nb + 31) / 32) : 1;
      if (gw > 1) __syncthreads();  // lane 0's acquire, passed on to the other warps
      if (tid < 32 * gw) {
        if (gw == 1) __syncwarp();  // lane 0's acquire, passed on to the warp's other lanes
        AIOSPEC_PHASE(10);
        const int w = tid >> 5, lane = tid & 31;
        unsigned long long gkey = kNoError;
        int g0 = INT32_MAX, g1 = -1, g2 = INT32_MAX, g3 = -1;
        for (int b0 = 32 * w; b0 < nb; b0 += 32 * gw) {
          const int b = b0 + lane;
          if (b < nb) {
            // L2 loads: another block's stores (its release, our acquire)
            fold_part(part, b, total, before, gkey, g0, g1, g2, g3);
          }
        }
        AIOSPEC_PHASE(11);
        total = warp_sum(total);
        before = warp_sum(before);
        gkey = warp_min_u64(gkey);
        g0 = warp_min_i32(g0), g1 = warp_max_i32(g1);
        g2 = warp_min_i32(g2), g3 = warp_max_i32(g3);
        if (lane == 0) {
          s_wt[0][w] = before;
          s_wt[1][w] = total;
          s_wk[w] = gkey;
          s_wg[w][0] = g0, s_wg[w][1] = g1, s_wg[w][2] = g2, s_wg[w][3] = g3;
        }
        AIOSPEC_PHASE(12);
      }
      __syncthreads();
      AIOSPEC_PHASE(13);
      before = s_wt[0][0];
      total = s_wt[1][0];
      skey = s_wk[0];
      int g0 = s_wg[0][0], g1 = s_wg[0][1], g2 = s_wg[0][2], g3 = s_wg[0][3];
      for (int w = 1; w < gw; ++w) {
        const Triple b2 = s_wt[0][w], t2 = s_wt[1][w];
        before.r += b2.r, before.t += b2.t, before.d += b2.d, before.e += b2.e;
        total.r += t2.r, total.t += t2.t, total.d += t2.d, total.e += t2.e;
        skey = min_key(skey, s_wk[w]);
        g0 = min(g0, s_wg[w][0]), g1 = max(g1, s_wg[w][1]);
        g2 = min(g2, s_wg[w][2]), g3 = max(g3, s_wg[w][3]);
      }
#else
      __syncthreads();
      AIOSPEC_PHASE(10);
      unsigned long long gkey = kNoError;
      int g0 = INT32_MAX, g1 = -1, g2 = INT32_MAX, g3 = -1;
      for (int b = tid; b < int(gridDim.x); b += kThreads) {
        // L2 loads: another block's stores, ordered by the barrier
        fold_part(part, b, total, before, gkey, g0, g1, g2, g3);
      }
      AIOSPEC_PHASE(11);
      if (gkey != kNoError) atomicMin(&s_gkey, gkey);
      if (g1 >= 0) {
        atomicMin(&s_g[0], g0);
        atomicMax(&s_g[1], g1);
        atomicMin(&s_g[2], g2);
        atomicMax(&s_g[3], g3);
      }
      AIOSPEC_PHASE(12);
      block_sum2(before, total);  // its barriers order the shared minima as well
      AIOSPEC_PHASE(13);
      skey = s_gkey;
      g0 = s_g[0], g1 = s_g[1], g2 = s_g[2], g3 = s_g[3];
#endif
      if (tid <= n) {
        s_rec[tid] += before.r;
        s_tok[tid] += before.t;
        s_dr[tid] += before.d;
      }
      if (tid == 0) {
        s_nt_min = g0, s_nt_max = g1;
        s_nd_min = g2, s_nd_max = g3;
      }
      __syncthreads();
    }
    AIOSPEC_PHASE(1);
    AIOSPEC_PHASE(2);
  } else {
  // 1. Structural checks of every row (the id checks are switched off by declaring the id
  //    inputs int32; this block checks the int64 ids of its own rows where it copies them),
  //    and the sums before this block's rows and over all rows, assuming they pass.
  int nt_min = INT32_MAX, nt_max = -1, nd_min = INT32_MAX, nd_max = -1;
  for (int64_t i = tid; i < rows; i += kThreads) {
    // exceptions_kernel's count, issued before the checks (or counted here, below)
    const int xpre = sampled && !inline_x ? xcnt[i] : 0;
    aiospec_error e;
    if (aiospec_check_row(&sa, i, &e) != AIOSPEC_E_OK) {
      atomicMin(&s_key, (unsigned long long)aiospec_error_order(&e));
      continue;
    }
    const Triple v = row_counts(a, i);
    const long long x = sampled && inline_x ? aiospec_row_exceptions(&a, i, 0, v.t, k) : xpre;
    total.r += v.r, total.t += v.t, total.d += v.d, total.e += x;
    if (i < row0) before.r += v.r, before.t += v.t, before.d += v.d, before.e += x;
    if (v.r) {
      nt_min = min(nt_min, int(v.t)), nt_max = max(nt_max, int(v.t));
      nd_min = min(nd_min, int(v.d)), nd_max = max(nd_max, int(v.d));
    }
  }
  if (nt_max >= 0) {
    atomicMin(&s_nt_min, nt_min);
    atomicMax(&s_nt_max, nt_max);
    atomicMin(&s_nd_min, nd_min);
    atomicMax(&s_nd_max, nd_max);
  }
  __syncthreads();
  AIOSPEC_PHASE(1);
  skey = s_key;
  const int64_t live = skey == kNoError ? rows : key_row(skey);  // rows [0, live) passed
  if (skey != kNoError) {
    // an invalid row: count only the rows before it (their ids are still checked, since an
    // id error in an earlier row comes first in emit.h's order); nothing is written, so the
    // uniform counts and the exceptions, which only shape the frame, are not needed
    before = total = Triple{0, 0, 0, 0};
    for (int64_t i = tid; i < live; i += kThreads) {
      const Triple v = row_counts(a, i);
      total.r += v.r, total.t += v.t, total.d += v.d;
      if (i < row0) before.r += v.r, before.t += v.t, before.d += v.d;
    }
  }
  // one block holds every row: its scan below gives the totals, so the block-wide sums are
  // needed only for the exceptions, which every thread added up on its own
  const bool sums = !solo || (skey == kNoError && sampled);
  if (sums) block_sum2(before, total);
  AIOSPEC_PHASE(2);

  // 2. This block's rows: exclusive prefix sums (rows past `live` are empty).
  {
    Triple v{0, 0, 0, 0};
    if (tid < n && row0 + tid < live) v = row_counts(a, row0 + tid);
    const Triple ex = block_exclusive_scan(v);
    if (tid <= n) {
      s_rec[tid] = before.r + ex.r;
      s_tok[tid] = before.t + ex.t;
      s_dr[tid] = before.d + ex.d;
    }
    if (tid < n && aiospec_has_logprobs(&a)) s_lp[tid] = a.lp_offsets[row0 + tid];
    if (!sums) {
      __syncthreads();
      total = Triple{s_rec[n], s_tok[n], s_dr[n], 0};
    }
  }

  }
  AIOSPEC_PHASE(3);
  // 3. Layout, frame position and space (every block reaches the same layout and position).
  aiospec_frame_layout lay;
  const uint32_t fflags = aiospec_frame_flags(&a, uint64_t(total.r), uint64_t(total.d), s_nt_min, s_nt_max,
                                              s_nd_min, s_nd_max);
  aiospec_compute_layout(uint64_t(total.r), uint64_t(total.t), uint64_t(total.d), uint64_t(total.e), k, fflags,
                         total.r > 0 ? uint32_t(s_nt_max) : 0u, total.r > 0 ? uint32_t(s_nd_max) : 0u,
                         a.kind == AIOSPEC_KIND_PROMPT, &lay);
  const uint64_t size = lay.frame_size;
  const bool valid = skey == kNoError && size <= ring.max_record;
  const uint64_t off = head & ring.mask;
  const uint64_t pad = size > ring.capacity - off ? ring.capacity - off : 0;
  const uint64_t pos = head + pad;
  const uint64_t need = pad + size + AIOSPEC_FRAME_HEADER;  // + the next header, zeroed at commit
  if (tid < 32) {
    bool room = !valid || head + need - tail_cache <= ring.capacity;
    if (!room) {
      // lane 0's clock decides for the whole warp: the scan needs every lane
      const uint64_t t0 = globaltimer_ns();
      for (;;) {
        const uint64_t min_tail = scan_min_tail(ring, head);
        if (head + need - min_tail <= ring.capacity) {
          room = true;
          if (tid == 0) st->tail_cache = min_tail;  // racing blocks store valid lower bounds
          break;
        }
        const int expired = __shfl_sync(0xffffffffu, int(globaltimer_ns() - t0 >= ring.timeout_ns), 0);
        if (expired) break;
        __nanosleep(2000);
      }
    }
    if (tid == 0) {
      s_write = valid && room;
      if (valid && !room) {
        s_full = 1;
        s_needed = head + need - ring.capacity;
        if (!solo) {
          st->needed_tail = s_needed;
          atomicExch(&st->full, 1u);
        }
      }
      if (s_write && blockIdx.x == 0) {
        if (pad != 0) {
          uint8_t* f = ring.data + off;
          st_u64(f, head);
          st_u64(ring.data, 0);  // the PAD's next header: where this frame goes
          st_u64(ring.data + 8, 0);
          __threadfence_system();
          st_release_sys_u64(f + 8, pad | (uint64_t(AIOSPEC_FRAME_PAD) << 32));
          s_pad = 1;
          if (!solo) st->pad_done = 1;
        }
      }
    }
  }
  __syncthreads();
  const int write = s_write;
  uint8_t* frame = ring.data + (pos & ring.mask);
  uint8_t* pay = frame + AIOSPEC_FRAME_HEADER;

  AIOSPEC_PHASE(4);
  // 4. Block 0: the frame-wide words (block0::write_frame_words); the header is encoded and
  //    stored by block 0's last warp (a lane a field, then a lane a word) while the other
  //    warps go on with the rows: nothing waits for it before the commit's barrier.
  if (write && blockIdx.x == 0) {
    block0::write_frame_words(tid, lay, frame, pos);
    if (tid == block0::kPositionWord) {
      if (solo) {
        s_posw = 1;
      } else {
        st->pos_written = 1;
      }
    }
    if ((tid >> 5) == kThreads / 32 - 1) {
      const int lane = tid & 31;
#if AIOSPEC_HEADER_WARP
      block0::write_header_lanes(s_header, lay, a.producer, step, a.kind, lane);
#else
      if (lane == 0) aiospec_write_header(s_header, &lay, a.producer, step, a.kind);
#endif
      __syncwarp();
      if (lane < AIOSPEC_HEADER_SPACE / 8) {
        st_u64(pay + 8 * lane, reinterpret_cast<const uint64_t*>(s_header)[lane]);
      }
    }
  }

  // 5. This block's rows: records, then token ids with their logprobs and ranks, draft ids,
  //    top-k ids and logprobs. Int64 ids are checked even when nothing is written.
  // measurement builds (AIOSPEC_NO_COLUMNS) leave out some of these stores
  const int wcol = AIOSPEC_NO_COLUMNS == 1 ? 0 : write;
  const int wbyte = AIOSPEC_NO_COLUMNS != 0 ? 0 : write;
  const int has_lp = aiospec_has_logprobs(&a);
  unsigned long long key = kNoError;
  if (wcol) {
    uint64_t* handles = reinterpret_cast<uint64_t*>(pay + lay.off[AIOSPEC_COL_HANDLES]);
    uint8_t* flags = pay + lay.off[AIOSPEC_COL_FLAGS];
    int32_t* positions = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_POSITIONS]);
    int32_t* toff = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOKEN_OFFSETS]);
    int32_t* doff = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_DRAFT_OFFSETS]);
    const bool has_toff = lay.off[AIOSPEC_COL_TOKEN_OFFSETS] != 0;
    const bool has_doff = lay.off[AIOSPEC_COL_DRAFT_OFFSETS] != 0;
    for (int li = tid; li < n; li += kThreads) {
      if (s_rec[li + 1] == s_rec[li]) continue;
      const long long r = s_rec[li];
      const int64_t i = row0 + li;
      handles[r] = uint64_t(a.handles[i]);
      if (wbyte) flags[r] = uint8_t(aiospec_row_flags(&a, i));
      if (a.positions != nullptr) positions[r] = int32_t(aiospec_load_int(a.positions, a.positions_i64, i));
      if (has_toff) toff[r] = int32_t(s_tok[li]);
      if (has_doff) doff[r] = int32_t(s_dr[li]);
    }
  }
  if (sampled) {
    // sampled_pos: each token's column in its top-k, or an exception whose index (its rank
    // among the step's exceptions) is the exceptions before this block (exceptions_kernel)
    // plus a block scan over this block's tokens, kThreads at a time
    uint8_t* spos = pay + lay.off[AIOSPEC_COL_SAMPLED_POS];
    int32_t* x_ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_EXCEPTION_IDS]);
    float* x_lps = reinterpret_cast<float*>(pay + lay.off[AIOSPEC_COL_EXCEPTION_LOGPROBS]);
    int32_t* x_ranks = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_EXCEPTION_RANKS]);
    const long long t0 = s_tok[0], t1 = s_tok[n];
    long long xbase = before.e;
    for (long long c0 = t0; c0 < t1; c0 += kThreads) {
      const long long e = c0 + tid;
      uint32_t p = 0;
      int64_t v = 0, rank = 0, lr = 0;
      if (e < t1) {
        const int li = find_row(s_tok, n, e);
        const int64_t i = row0 + li;
        const int64_t j = e - s_tok[li];
        lr = s_lp[li] + j;
        v = aiospec_token(&a, i, j);
        rank = aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, lr);
        if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_TOKEN_IDS, j));
        if (!aiospec_fits_i32(rank)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_LP, lr));
        p = exchange && e - t0 < kPosCache ? uint32_t(s_p[e - t0]) : aiospec_sampled_pos(&a, lr, v, rank, k);
      }
      int chunk = 0;
      const int x = block_exclusive_scan_int(e < t1 && p == AIOSPEC_SAMPLED_EXCEPTION, &chunk);
      if (wcol && e < t1) {
        if (wbyte) spos[e] = uint8_t(p);
        if (p == AIOSPEC_SAMPLED_EXCEPTION) {
          const long long xi = xbase + x;
          x_ids[xi] = int32_t(v);
          x_lps[xi] = a.lp_values[aiospec_lp_values_row(&a, lr)];
          x_ranks[xi] = int32_t(rank);
        }
      }
      xbase += chunk;
    }
  } else {
    int32_t* ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOKEN_IDS]);
    float* lps = reinterpret_cast<float*>(pay + lay.off[AIOSPEC_COL_LOGPROBS]);
    int32_t* ranks = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_RANKS]);
    const long long t0 = s_tok[0], t1 = s_tok[n];
    for (long long e = t0 + tid; e < t1; e += kThreads) {
      const int li = find_row(s_tok, n, e);
      const int64_t i = row0 + li;
      const int64_t j = e - s_tok[li];
      const int64_t v = aiospec_load_int(a.token_ids, a.token_ids_i64, aiospec_token_row(&a, i) + j);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_TOKEN_IDS, j));
      if (wcol) ids[e] = int32_t(v);
      if (has_lp) {
        const int64_t lr = s_lp[li] + j;
        const int64_t rank = aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, lr);
        if (!aiospec_fits_i32(rank)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_LP, lr));
        if (wcol) {
          lps[e] = a.lp_values[aiospec_lp_values_row(&a, lr)];
          ranks[e] = int32_t(rank);
        }
      }
    }
  }
  if (a.draft_ids != nullptr) {
    int32_t* ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_DRAFT_IDS]);
    const long long d0 = s_dr[0], d1 = s_dr[n];
    for (long long e = d0 + tid; e < d1; e += kThreads) {
      const int li = find_row(s_dr, n, e);
      const int64_t i = row0 + li;
      const int64_t j = e - s_dr[li];
      const int64_t v = aiospec_load_int(a.draft_ids, a.draft_ids_i64, aiospec_draft_row(&a, i) + j);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_DRAFT_IDS, j));
      if (wcol) ids[e] = int32_t(v);
    }
  }
  if (has_lp && k > 0) {
    int32_t* tk_ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOPK_IDS]);
    float* tk_lps = reinterpret_cast<float*>(pay + lay.off[AIOSPEC_COL_TOPK_LOGPROBS]);
    const long long e0 = s_tok[0] * k, e1 = s_tok[n] * k;
    const bool narrow = e1 < (1ll << 31);
    for (long long e = e0 + tid; e < e1; e += kThreads) {
      const long long t = narrow ? (long long)(uint32_t(e) / k) : e / k;
      const int64_t c = 1 + (e - t * k);
      const int li = find_row(s_tok, n, t);
      const int64_t lr = s_lp[li] + (t - s_tok[li]);
      const int64_t v = aiospec_load_int(a.lp_ids, a.lp_ids_i64, aiospec_lp_ids_row(&a, lr) + c);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(row0 + li, AIOSPEC_CHECK_LP, lr));
      if (wcol) {
        tk_ids[e] = int32_t(v);
        tk_lps[e] = a.lp_values[aiospec_lp_values_row(&a, lr) + c];
      }
    }
  }

  AIOSPEC_PHASE(5);
  // 6. Count this block done; the last one decides (one block: it is the last).
  if (key != kNoError) atomicMin(&s_idkey, key);
#if AIOSPEC_FENCE_MODE == 0
  __threadfence_system();
#endif
  __syncthreads();
  AIOSPEC_PHASE(6);
  unsigned long long idkey;
  unsigned int full, pad_done, pos_written;
  uint64_t needed_tail;
  if (solo) {
    if (tid != 0) return;
#if AIOSPEC_FENCE_MODE == 1
    __threadfence_system();
#endif
    idkey = s_idkey;
    full = s_full;
    pad_done = s_pad;
    pos_written = s_posw;
    needed_tail = s_needed;
  } else {
    if (tid == 0) {
      if (s_idkey != kNoError) atomicMin(&st->key, s_idkey);
#if AIOSPEC_FENCE_MODE >= 2
      __threadfence();
#else
      __threadfence_system();  // the block's stores (ordered by the barrier) at system scope
#endif
      s_last = atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last || tid != 0) return;

    // every other block is done: plain loads (issued together) and stores will do
    __threadfence();
    volatile State* vs = st;
    idkey = vs->key;
    full = vs->full;
    pad_done = vs->pad_done;
    pos_written = vs->pos_written;
    needed_tail = vs->needed_tail;
    vs->key = kNoError;
    vs->full = 0;
    vs->pad_done = 0;
    vs->pos_written = 0;
    vs->blocks_done = 0;
    vs->arrived = 0;  // every block passed the exchange: the next launch starts from 0
  }
  uint64_t first = skey == kNoError && size > ring.max_record ? kFrameSizeKey : skey;
  first = idkey < first ? idkey : first;
  // No commit (an invalid id, found while copying, or a ring that stayed full for a block):
  // the position word block 0 stored goes back to 0, so the 16 header bytes at the head are
  // zero again, as every writer leaves them (another writer of this ring checks them there);
  // before a PAD's head is released, so that no reader sees that head with the word still set.
  if ((first != kNoError || full) && pos_written) st_u64(frame, 0);
  if (pad_done) {
    st->head = pos;
    st_head(ring, pos);
  }
  if (first != kNoError) {
    aiospec_error e;
    if (first == kFrameSizeKey) {
      aiospec_set_error(&e, AIOSPEC_E_FRAME_SIZE, AIOSPEC_ARG_FRAME, -1, -1, int64_t(size), 0,
                        int64_t(ring.max_record), -1);
    } else if (aiospec_check_row(&a, key_row(first), &e) == AIOSPEC_E_OK) {
      // unreachable: the key came from a failing check of that row
      aiospec_set_error(&e, AIOSPEC_E_DIM, AIOSPEC_ARG_ROWS, key_row(first), -1, 0, 0, 0, -1);
    }
    report_error(e, ring, st, m, step);
    return;
  }
  if (full) {
    aiospec_error e;
    aiospec_set_error(&e, AIOSPEC_E_RING_FULL, AIOSPEC_ARG_FRAME, -1, -1, int64_t(size), int64_t(needed_tail),
                      int64_t(head), -1);
    report_error(e, ring, st, m, step);
    return;
  }
  // every input is read (the error paths above read rows again): the next kernel may launch
  // while the commit's system-scope release drains this frame's stores
#if AIOSPEC_PDL == 1
  pdl_launch_dependents();
#endif
  uint8_t* next = ring.data + ((pos + size) & ring.mask);
  st_u64(next, 0);
  st_u64(next + 8, 0);
  const uint64_t commit = (AIOSPEC_FRAME_HEADER + lay.payload_len) | (uint64_t(AIOSPEC_FRAME_DATA) << 32);
#if AIOSPEC_FENCE_MODE == 0
  __threadfence_system();
#endif
#if AIOSPEC_FENCE_MODE == 3
  st_u64(frame + 8, commit);
#else
  st_release_sys_u64(frame + 8, commit);
#endif
  AIOSPEC_PHASE(7);
  st->head = pos + size;
  st->frames_written = frames_written + 1;
  st->bytes_written = bytes_written + lay.payload_len;
  st_u64(ring.ctl + AIOSPEC_OFF_FRAMES_WRITTEN, frames_written + 1);
  st_u64(ring.ctl + AIOSPEC_OFF_BYTES_WRITTEN, bytes_written + lay.payload_len);
  st_head(ring, pos + size);
  AIOSPEC_PHASE(8);
}

}  // namespace cuda
}  // namespace aiospec

#endif  // AIOSPEC_CUDA_EMIT_KERNEL_CUH_
