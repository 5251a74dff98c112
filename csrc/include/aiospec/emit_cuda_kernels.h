// The emit op's CUDA kernels: raw pointers in, one frame written into a mapped ring segment.
// CUDA C++ only (included by csrc/cuda/emit_cuda.cu, the launcher); it lives beside the other
// headers so that the build cache key (every header under include/) covers it.
//
// Two kernels per frame, launched back to back on the caller's stream:
//   plan (one block): validates the counts and offsets of every row (aiospec_check_row from
//     emit.h with the id checks switched off), prefix-sums the records / tokens / draft ids
//     of the rows, lays the frame out, reserves ring space against the slowest reader (a
//     bounded wait), writes the PAD frame, the msgpack header and every padding word;
//   columns (a block per rows_per_block rows): checks the int64 ids of its rows and writes
//     the columns, each block's slice of each column being contiguous, so a warp's stores to
//     host memory coalesce; the last block to finish (threadfence reduction) publishes: zero
//     the next header, system fence, the 8-byte commit word, then head and counters.
// Any error (first in emit.h's order: smallest aiospec_error_order key) means nothing is
// committed: the error goes to a word in mapped host memory, frames_lost rises.
//
// Only plain loads and stores touch host memory: the GPU this runs on cannot do atomics on
// it (hostNativeAtomicSupported = 0). Atomics and counters live in device memory.
#ifndef AIOSPEC_EMIT_CUDA_KERNELS_H_
#define AIOSPEC_EMIT_CUDA_KERNELS_H_

#ifndef __CUDACC__
#error "aiospec/emit_cuda_kernels.h is CUDA C++: compile with nvcc"
#endif

#include <cuda_runtime.h>
#include <stdint.h>

#include "aiospec/emit.h"
#include "aiospec/emit_cuda.h"
#include "aiospec/layout.h"

// Measurement switches (scripts/gpu_check.sh "variants" builds the driver with each; the
// defaults are the shipped protocol, docs/benchmarks.md has the numbers behind them).
// AIOSPEC_FENCE_MODE: where the system-scope ordering is paid.
//   0 strict: every writing thread fences at system scope, the last block fences again
//             before and after the commit;
//   1 block:  one system fence per column block (after its barrier), then the last block's
//             release store of the commit word; the plan kernel's stores are ordered by the
//             kernel boundary and that release (PAD frames keep their own fence);
//   2 gpu:    as 1 with gpu-scope fences per block, the commit's st.release.sys alone
//             carrying the stores to system scope (cumulativity);
//   3 none:   no fences, a plain commit store: a lower bound for measurement, not correct.
// AIOSPEC_PDL: 1 launches the column kernel with programmatic dependent launch, so that its
// blocks are scheduled while the plan kernel runs and wait in griddepcontrol.wait.
#ifndef AIOSPEC_FENCE_MODE
#define AIOSPEC_FENCE_MODE 0
#endif
#ifndef AIOSPEC_PDL
#define AIOSPEC_PDL 0
#endif

namespace aiospec {
namespace cuda {

constexpr int kPlanThreads = 1024;
constexpr int kColumnThreads = 256;
constexpr uint64_t kNoError = ~0ull;
constexpr uint64_t kFrameSizeKey = ~0ull - 1;  // aiospec_error_order of E_FRAME_SIZE

// Where the ring is, as the device sees it (the mapped segment) and its fixed geometry.
struct RingRef {
  uint8_t* ctl;  // control page (device pointer into the registered mapping)
  uint8_t* data;  // data area = ctl + CONTROL_SIZE
  uint64_t capacity;
  uint64_t mask;
  uint64_t max_record;
  uint32_t max_readers;
  uint64_t timeout_ns;  // back-pressure wait before "ring full"
};

// What the plan kernel decided, read by the column kernel.
struct Plan {
  aiospec_frame_layout lay;
  uint64_t pos;  // position of the frame (after any PAD)
  uint64_t step;
  uint64_t key;  // smallest error key the plan kernel found (kNoError: none)
  uint64_t needed_tail;  // ring full: the slowest tail had to reach this position
  uint64_t full_head;  // ring full: the head at that time
  int32_t write;  // 1: space is reserved; write the columns and commit
  int32_t ring_full;
};

// Producer state in device memory; zero-initialised by the host, then head and counters
// copied from the control page.
struct State {
  unsigned long long head;
  unsigned long long tail_cache;  // a lower bound of every active reader's tail
  unsigned long long frames_written;
  unsigned long long bytes_written;
  unsigned long long frames_lost;
  unsigned long long errors;  // errors seen
  unsigned long long published;  // errors published to the mapped word
  unsigned long long b_key;  // smallest error key of the column kernel (atomicMin)
  unsigned int blocks_done;  // column blocks finished (threadfence reduction)
  Plan plan;
};

// The error word in mapped (pinned) host memory. The device publishes an error only when
// the host has acknowledged the previous one, so the host always sees a whole record.
struct alignas(128) Mapped {
  volatile unsigned long long seq;  // device: errors published
  volatile unsigned long long errors;  // device: errors seen (published or not)
  volatile unsigned long long step;  // device: step of the published error
  unsigned long long pad0[13];
  volatile unsigned long long ack;  // host: errors reported
  unsigned long long pad1[15];
  aiospec_error err;  // device: the published error
};

// ---- memory access helpers -------------------------------------------------------------------

__device__ __forceinline__ void st_u64(uint8_t* p, uint64_t v) { *reinterpret_cast<volatile uint64_t*>(p) = v; }
__device__ __forceinline__ void st_u32(uint8_t* p, uint32_t v) { *reinterpret_cast<volatile uint32_t*>(p) = v; }

__device__ __forceinline__ void st_release_sys_u64(uint8_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint8_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
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

// Row of an error key made by aiospec_error_order (1 + (brow << 33 | check << 29 | sub)).
__device__ __forceinline__ int64_t key_row(uint64_t key) { return int64_t(((key - 1) >> 33) & 0x3FFFFFFFull); }

__device__ __forceinline__ unsigned long long min_key(unsigned long long a, uint64_t b) {
  return b < a ? (unsigned long long)b : a;
}

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

// One thread: count the failure, publish it to the host if the host has taken the last one.
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

// ---- kernel 1: plan -------------------------------------------------------------------------

// Exclusive block-wide prefix sums of three counters (records, tokens, draft ids).
struct Triple {
  long long r, t, d;
};

__device__ __forceinline__ Triple block_exclusive_scan(Triple v, Triple* total) {
  __shared__ Triple warp_sums[kPlanThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
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
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    Triple w = lane < kPlanThreads / 32 ? warp_sums[lane] : Triple{0, 0, 0};
    for (int s = 1; s < 32; s <<= 1) {
      const long long r = __shfl_up_sync(0xffffffffu, w.r, s);
      const long long t = __shfl_up_sync(0xffffffffu, w.t, s);
      const long long d = __shfl_up_sync(0xffffffffu, w.d, s);
      if (lane >= s) {
        w.r += r;
        w.t += t;
        w.d += d;
      }
    }
    if (lane < kPlanThreads / 32) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const Triple before = warp > 0 ? warp_sums[warp - 1] : Triple{0, 0, 0};
  *total = warp_sums[kPlanThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return Triple{before.r + inc.r - v.r, before.t + inc.t - v.t, before.d + inc.d - v.d};
}

// scratch: rec_off, tok_off, draft_off, each [stride >= rows + 1] int64, exclusive prefix sums
// over the rows that passed the structural checks (later rows count as empty).
__global__ void __launch_bounds__(kPlanThreads)
    emit_plan_kernel(aiospec_emit_args a, RingRef ring, State* st, long long* scratch, long long stride,
                     const uint64_t* step_dev) {
  __shared__ unsigned long long s_key;
  __shared__ int s_write;
  __shared__ alignas(8) uint8_t s_header[AIOSPEC_HEADER_SPACE];
  __shared__ Plan s_plan;
  const int tid = threadIdx.x;
  const int64_t rows = a.rows;
#if AIOSPEC_PDL
  asm volatile("griddepcontrol.launch_dependents;");  // the column blocks may be scheduled now
#endif
  if (tid == 0) s_key = kNoError;
  __syncthreads();

  // 1. Structural checks (emit.h's checks 0..5): the id checks are switched off here by
  //    declaring every id input int32; the column kernel checks int64 ids where it reads them.
  aiospec_emit_args sa = a;
  sa.token_ids_i64 = 0;
  sa.draft_ids_i64 = 0;
  sa.lp_ids_i64 = 0;
  sa.lp_ranks_i64 = 0;
  for (int64_t i = tid; i < rows; i += kPlanThreads) {
    aiospec_error e;
    if (aiospec_check_row(&sa, i, &e) != AIOSPEC_E_OK) atomicMin(&s_key, (unsigned long long)aiospec_error_order(&e));
  }
  __syncthreads();
  const uint64_t skey = s_key;
  const int64_t live = skey == kNoError ? rows : key_row(skey);  // rows [0, live) passed

  // 2. Prefix sums over the live rows.
  long long* rec_off = scratch;
  long long* tok_off = scratch + stride;
  long long* dr_off = scratch + 2 * stride;
  Triple carry{0, 0, 0};
  for (int64_t base = 0; base < rows; base += kPlanThreads) {
    const int64_t i = base + tid;
    Triple v{0, 0, 0};
    if (i < live) {
      v.t = a.num_tokens[i];
      v.d = a.num_draft != nullptr ? a.num_draft[i] : 0;
      v.r = aiospec_row_has_record(&a, i) ? 1 : 0;
    }
    Triple total;
    const Triple ex = block_exclusive_scan(v, &total);
    if (i < rows) {
      rec_off[i] = carry.r + ex.r;
      tok_off[i] = carry.t + ex.t;
      dr_off[i] = carry.d + ex.d;
    }
    carry.r += total.r;
    carry.t += total.t;
    carry.d += total.d;
  }
  if (tid == 0) {
    rec_off[rows] = carry.r;
    tok_off[rows] = carry.t;
    dr_off[rows] = carry.d;
  }

  // 3. Layout and the frame-size check (after every row check in emit.h's order).
  if (tid == 0) {
    Plan& p = s_plan;
    const int has_lp = aiospec_has_logprobs(&a);
    aiospec_compute_layout(uint64_t(carry.r), uint64_t(carry.t), uint64_t(carry.d), aiospec_frame_k(&a), has_lp,
                           &p.lay);
    p.step = step_dev != nullptr ? *step_dev : a.step;
    p.key = skey;
    p.pos = 0;
    p.needed_tail = 0;
    p.full_head = 0;
    p.ring_full = 0;
    p.write = 0;
    if (skey == kNoError) {
      if (p.lay.frame_size > ring.max_record) {
        p.key = kFrameSizeKey;
      } else {
        p.write = 1;
      }
    }
    s_write = p.write;
  }
  __syncthreads();
  const int reserve = s_write;
  __syncthreads();  // s_write is rewritten below

  // 4. Reserve (warp 0): PAD if the frame does not fit before the end, then wait for the
  //    slowest reader, reading the tails from the mapped control page only when the cached
  //    lower bound says the ring may be full.
  if (reserve && tid < 32) {
    Plan& p = s_plan;
    const uint64_t size = p.lay.frame_size;
    uint64_t head = st->head;
    const uint64_t off = head & ring.mask;
    const uint64_t pad = size > ring.capacity - off ? ring.capacity - off : 0;
    const uint64_t need = pad + size + AIOSPEC_FRAME_HEADER;  // + the next header, zeroed at commit
    bool room = head + need - st->tail_cache <= ring.capacity;
    if (!room) {
      // lane 0's clock decides for the whole warp: the scan needs every lane
      const uint64_t t0 = globaltimer_ns();
      for (;;) {
        const uint64_t min_tail = scan_min_tail(ring, head);
        if (tid == 0) st->tail_cache = min_tail;
        if (head + need - min_tail <= ring.capacity) {
          room = true;
          break;
        }
        const int expired = __shfl_sync(0xffffffffu, int(globaltimer_ns() - t0 >= ring.timeout_ns), 0);
        if (expired) break;
        __nanosleep(2000);
      }
    }
    if (tid == 0) {
      if (!room) {
        p.write = 0;
        p.ring_full = 1;
        p.needed_tail = head + need - ring.capacity;
        p.full_head = head;
      } else {
        if (pad != 0) {
          uint8_t* f = ring.data + off;
          st_u64(f, head);
          st_u64(ring.data, 0);  // the PAD's next header: where this frame goes
          st_u64(ring.data + 8, 0);
          __threadfence_system();
          st_release_sys_u64(f + 8, pad | (uint64_t(AIOSPEC_FRAME_PAD) << 32));
          head += pad;
          st->head = head;
          st_u64(ring.ctl + AIOSPEC_OFF_HEAD, head);
        }
        p.pos = head;
        aiospec_write_header(s_header, &p.lay, a.producer, p.step, a.kind);
      }
      s_write = p.write;
    }
  }
  __syncthreads();

  // 5. Position word, header, the last offset entries and every padding word.
  if (s_write) {
    const Plan& p = s_plan;
    uint8_t* frame = ring.data + (p.pos & ring.mask);
    uint8_t* pay = frame + AIOSPEC_FRAME_HEADER;
    if (tid < AIOSPEC_HEADER_SPACE / 8) st_u64(pay + 8 * tid, reinterpret_cast<const uint64_t*>(s_header)[tid]);
    if (tid == 32) st_u64(frame, p.pos);
    if (tid == 33) st_u32(pay + p.lay.off[AIOSPEC_COL_TOKEN_OFFSETS] + 4 * p.lay.r, uint32_t(p.lay.t));
    if (tid == 34 && p.lay.d > 0) st_u32(pay + p.lay.off[AIOSPEC_COL_DRAFT_OFFSETS] + 4 * p.lay.r, uint32_t(p.lay.d));
    if (tid >= 64 && tid < 64 + AIOSPEC_NUM_COLUMNS) {
      // a column of 4-byte elements with an odd count ends 4 bytes before the next boundary
      const int c = tid - 64;
      const uint64_t counts[AIOSPEC_NUM_COLUMNS] = {
          p.lay.r, p.lay.r, p.lay.r + 1, p.lay.t, p.lay.r + 1, p.lay.d, p.lay.t, p.lay.t,
          p.lay.t * p.lay.k, p.lay.t * p.lay.k};
      if (p.lay.off[c] != 0) {
        const uint64_t end = p.lay.off[c] + counts[c] * (c == AIOSPEC_COL_HANDLES ? 8u : 4u);
        if (end & 7) st_u32(pay + end, 0);
      }
    }
    if (tid >= 96 && tid < 104) {
      // zero the frame's alignment tail [16 + payload_len, frame_size)
      const uint64_t w = AIOSPEC_FRAME_HEADER + p.lay.payload_len + 8 * uint64_t(tid - 96);
      if (w < p.lay.frame_size) st_u64(frame + w, 0);
    }
#if AIOSPEC_FENCE_MODE == 0
    __threadfence_system();
#endif
  }
  if (tid == 0) st->plan = s_plan;
}

// ---- kernel 2: columns and commit ----------------------------------------------------------

// Largest li in [0, n) with off[li] <= e (off non-decreasing, off[0] <= e < off[n]).
__device__ __forceinline__ int find_row(const long long* off, int n, long long e) {
  int lo = 0, hi = n;  // invariant: off[lo] <= e < off[hi]
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

// Last block: pick the first error (or commit the frame) and publish.
__device__ void finish_frame(const aiospec_emit_args& a, const RingRef& ring, State* st, Mapped* m) {
  __threadfence();
  const Plan& p = st->plan;
  const unsigned long long bkey = atomicExch(&st->b_key, (unsigned long long)kNoError);
  st->blocks_done = 0;
  const uint64_t key = p.key < bkey ? p.key : bkey;
  if (key != kNoError) {
    aiospec_error e;
    if (key == kFrameSizeKey) {
      aiospec_set_error(&e, AIOSPEC_E_FRAME_SIZE, AIOSPEC_ARG_FRAME, -1, -1, int64_t(p.lay.frame_size), 0,
                        int64_t(ring.max_record), -1);
    } else if (aiospec_check_row(&a, key_row(key), &e) == AIOSPEC_E_OK) {
      // unreachable: the key came from a failing check of that row
      aiospec_set_error(&e, AIOSPEC_E_DIM, AIOSPEC_ARG_ROWS, key_row(key), -1, 0, 0, 0, -1);
    }
    report_error(e, ring, st, m, p.step);
    return;
  }
  if (p.ring_full) {
    aiospec_error e;
    aiospec_set_error(&e, AIOSPEC_E_RING_FULL, AIOSPEC_ARG_FRAME, -1, -1, int64_t(p.lay.frame_size),
                      int64_t(p.needed_tail), int64_t(p.full_head), -1);
    report_error(e, ring, st, m, p.step);
    return;
  }
  if (!p.write) return;
  const uint64_t size = p.lay.frame_size;
  uint8_t* frame = ring.data + (p.pos & ring.mask);
  uint8_t* next = ring.data + ((p.pos + size) & ring.mask);
  st_u64(next, 0);
  st_u64(next + 8, 0);
  const uint64_t commit = (AIOSPEC_FRAME_HEADER + p.lay.payload_len) | (uint64_t(AIOSPEC_FRAME_DATA) << 32);
#if AIOSPEC_FENCE_MODE == 0
  __threadfence_system();
#endif
#if AIOSPEC_FENCE_MODE == 3
  st_u64(frame + 8, commit);
#else
  st_release_sys_u64(frame + 8, commit);
#endif
  const uint64_t head = p.pos + size;
  st->head = head;
  st->frames_written += 1;
  st->bytes_written += p.lay.payload_len;
  st_u64(ring.ctl + AIOSPEC_OFF_FRAMES_WRITTEN, st->frames_written);
  st_u64(ring.ctl + AIOSPEC_OFF_BYTES_WRITTEN, st->bytes_written);
#if AIOSPEC_FENCE_MODE == 0
  __threadfence_system();
#endif
  st_u64(ring.ctl + AIOSPEC_OFF_HEAD, head);
}

// Dynamic shared memory: 4 * (rows_per_block + 1) int64.
__global__ void __launch_bounds__(kColumnThreads)
    emit_columns_kernel(aiospec_emit_args a, RingRef ring, State* st, const long long* scratch, long long stride,
                        Mapped* m, int rows_per_block) {
  extern __shared__ long long sh[];
  __shared__ unsigned long long s_key;
  __shared__ int s_last;
  const int tid = threadIdx.x;
  const int rpb = rows_per_block;
  long long* s_rec = sh;
  long long* s_tok = sh + (rpb + 1);
  long long* s_dr = sh + 2 * (rpb + 1);
  long long* s_lp = sh + 3 * (rpb + 1);
  const int64_t row0 = int64_t(blockIdx.x) * rpb;
  const int64_t row_end = row0 + rpb < a.rows ? row0 + rpb : a.rows;
  const int n = row_end > row0 ? int(row_end - row0) : 0;
  const Plan& p = st->plan;
  const int write = p.write;
  const aiospec_frame_layout& lay = p.lay;
  const int has_lp = aiospec_has_logprobs(&a);
  const uint32_t k = lay.k;
#if AIOSPEC_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the plan kernel has finished
#endif
  if (tid == 0) s_key = kNoError;
  for (int li = tid; li <= n; li += kColumnThreads) {
    s_rec[li] = scratch[row0 + li];
    s_tok[li] = scratch[stride + row0 + li];
    s_dr[li] = scratch[2 * stride + row0 + li];
    if (has_lp && li < n) s_lp[li] = a.lp_offsets[row0 + li];
  }
  __syncthreads();
  uint8_t* pay = ring.data + (p.pos & ring.mask) + AIOSPEC_FRAME_HEADER;
  unsigned long long key = kNoError;

  // records: handle, flags, token / draft offsets
  if (write) {
    uint64_t* handles = reinterpret_cast<uint64_t*>(pay + lay.off[AIOSPEC_COL_HANDLES]);
    uint32_t* flags = reinterpret_cast<uint32_t*>(pay + lay.off[AIOSPEC_COL_FLAGS]);
    int32_t* toff = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOKEN_OFFSETS]);
    int32_t* doff = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_DRAFT_OFFSETS]);
    for (int li = tid; li < n; li += kColumnThreads) {
      if (s_rec[li + 1] == s_rec[li]) continue;
      const long long r = s_rec[li];
      const int64_t i = row0 + li;
      handles[r] = uint64_t(a.handles[i]);
      flags[r] = aiospec_row_flags(&a, i);
      toff[r] = int32_t(s_tok[li]);
      if (lay.d > 0) doff[r] = int32_t(s_dr[li]);
    }
  }

  // tokens: ids, then the sampled token's logprob and rank
  {
    int32_t* ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOKEN_IDS]);
    float* lps = reinterpret_cast<float*>(pay + lay.off[AIOSPEC_COL_LOGPROBS]);
    int32_t* ranks = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_RANKS]);
    const long long t0 = s_tok[0], t1 = s_tok[n];
    for (long long e = t0 + tid; e < t1; e += kColumnThreads) {
      const int li = find_row(s_tok, n, e);
      const int64_t i = row0 + li;
      const int64_t j = e - s_tok[li];
      const int64_t v = aiospec_load_int(a.token_ids, a.token_ids_i64, i * a.max_tokens + j);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_TOKEN_IDS, j));
      if (write) ids[e] = int32_t(v);
      if (has_lp) {
        const int64_t lr = s_lp[li] + j;
        const int64_t rank = aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, lr);
        if (!aiospec_fits_i32(rank)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_LP, lr));
        if (write) {
          lps[e] = a.lp_values[lr * a.lp_width];
          ranks[e] = int32_t(rank);
        }
      }
    }
  }

  // draft ids
  if (a.draft_ids != nullptr) {
    int32_t* ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_DRAFT_IDS]);
    const long long d0 = s_dr[0], d1 = s_dr[n];
    for (long long e = d0 + tid; e < d1; e += kColumnThreads) {
      const int li = find_row(s_dr, n, e);
      const int64_t i = row0 + li;
      const int64_t j = e - s_dr[li];
      const int64_t v = aiospec_load_int(a.draft_ids, a.draft_ids_i64, i * a.max_draft + j);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(i, AIOSPEC_CHECK_DRAFT_IDS, j));
      if (write) ids[e] = int32_t(v);
    }
  }

  // top-k ids and logprobs: columns 1..k of the token's logprob row
  if (has_lp && k > 0) {
    int32_t* tk_ids = reinterpret_cast<int32_t*>(pay + lay.off[AIOSPEC_COL_TOPK_IDS]);
    float* tk_lps = reinterpret_cast<float*>(pay + lay.off[AIOSPEC_COL_TOPK_LOGPROBS]);
    const long long e0 = s_tok[0] * k, e1 = s_tok[n] * k;
    const bool narrow = e1 < (1ll << 31);
    for (long long e = e0 + tid; e < e1; e += kColumnThreads) {
      const long long t = narrow ? (long long)(uint32_t(e) / k) : e / k;
      const int64_t c = 1 + (e - t * k);
      const int li = find_row(s_tok, n, t);
      const int64_t lr = s_lp[li] + (t - s_tok[li]);
      const int64_t src = lr * a.lp_width + c;
      const int64_t v = aiospec_load_int(a.lp_ids, a.lp_ids_i64, src);
      if (!aiospec_fits_i32(v)) key = min_key(key, id_error_key(row0 + li, AIOSPEC_CHECK_LP, lr));
      if (write) {
        tk_ids[e] = int32_t(v);
        tk_lps[e] = a.lp_values[src];
      }
    }
  }

  if (key != kNoError) atomicMin(&s_key, key);
#if AIOSPEC_FENCE_MODE == 0
  __threadfence_system();  // this thread's stores to the ring before the block counts as done
#endif
  __syncthreads();
  if (tid == 0) {
    if (s_key != kNoError) atomicMin(&st->b_key, s_key);
#if AIOSPEC_FENCE_MODE == 1
    __threadfence_system();  // cumulative over the block's stores (ordered by the barrier)
#else
    __threadfence();
#endif
    s_last = atomicAdd(&st->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (s_last && tid == 0) finish_frame(a, ring, st, m);
}

}  // namespace cuda
}  // namespace aiospec

#endif  // AIOSPEC_EMIT_CUDA_KERNELS_H_
