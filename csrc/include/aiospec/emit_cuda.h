/* The emit op's CUDA path: a framework-free producer that writes frames straight from the GPU.
 *
 * A producer maps one ring segment, registers it with CUDA once (cudaHostRegister, mapped)
 * and keeps its state (head, cached slowest tail, counters) in device memory and its error
 * word in mapped host memory. aiospec_cuda_emit enqueues one kernel on a stream (two with the
 * sampled_pos encoding: a one-block pass counts the exceptions first) and returns:
 * no host synchronization and no allocation per call, so a step can be captured in a CUDA
 * graph (csrc/cuda/emit_kernel.cuh describes the kernel).
 * Input errors found on the device (counts, offsets, ids; same checks and order as
 * aiospec_check_row in emit.h) and a ring that stays full past the timeout are reported
 * through an error word in mapped host memory, which aiospec_cuda_check reads without
 * synchronizing; the frame is then not written and the ring's frames_lost counter rises.
 *
 * Calls on one producer must be ordered on the GPU (one stream, or streams the caller
 * orders): the producer state is not shared between concurrently running emits.
 * Plain C header; bindings: aiospec/ops/_cuda.py (ctypes) and the Paddle op's GPU kernel.
 */
#ifndef AIOSPEC_EMIT_CUDA_H_
#define AIOSPEC_EMIT_CUDA_H_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "aiospec/emit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct or a function below changes. */
#define AIOSPEC_CUDA_ABI_VERSION 4

/* Error codes of the CUDA path beyond emit.h's AIOSPEC_E_* (same aiospec_error struct). */
enum aiospec_cuda_error_code {
  /* the ring had no room for a frame within the producer's timeout: value = the frame's size
   * in bytes (header included), lo = the tail every active reader had to reach for it to
   * fit (head + the PAD before it, the frame and the next header - capacity), hi = the head
   * (the position where the frame, or its PAD, would have started); the lagging readers are
   * those with a tail below lo, each lagging hi - tail bytes (aiospec_cuda_format_error
   * names them) */
  AIOSPEC_E_RING_FULL = 64,
  /* rows = value exceeds the producer's max_rows = hi */
  AIOSPEC_E_MAX_ROWS = 65
};

typedef struct aiospec_cuda_producer aiospec_cuda_producer;

typedef struct aiospec_cuda_options {
  int32_t device;            /* CUDA device ordinal the kernels run on */
  int32_t rows_per_block;    /* rows per thread block, 1..128; 0 = default (8); grows for
                                batches past 264 blocks (every block reads every row's counts) */
  int64_t max_rows;          /* the largest batch (rows) an emit may carry */
  double timeout_s;          /* device-side wait for ring space before "ring full"; >= 0 */
  double reader_timeout_s;   /* evict readers silent for longer (<= 0: only dead pids) */
  double liveness_s;         /* at most one host liveness pass (heartbeat, eviction) per this */
  int32_t host_notify;       /* 1: cudaLaunchHostFunc after each emit rings sleeping readers */
  int32_t check_pids;        /* 1: evict readers whose process is gone */
} aiospec_cuda_options;

/* Fills `o` with the defaults (device 0, 8 rows per block, max_rows 4096, timeout 5 s, no
 * reader timeout, liveness every 50 ms, no host notify, check pids). */
void aiospec_cuda_default_options(aiospec_cuda_options* o);

/* Attaches to the ring `ring_name` (in /dev/shm) and becomes its producer. Returns 0 and sets
 * *out, or -1 with a message in err (NUL-terminated, at most errlen bytes). */
int aiospec_cuda_producer_create(const char* ring_name, const aiospec_cuda_options* opts,
                                 aiospec_cuda_producer** out, char* err, size_t errlen);

/* Waits for the producer's last emit to finish, unregisters and unmaps the segment, frees the
 * device state. The ring stays open for its owner. NULL is ignored. */
void aiospec_cuda_producer_destroy(aiospec_cuda_producer* p);

/* Enqueues one frame on `stream`. Host-side argument errors (aiospec_check_args, rows >
 * max_rows) return cudaErrorInvalidValue with the error in aiospec_cuda_last_error and launch
 * nothing; device-side errors surface later through aiospec_cuda_check. */
cudaError_t aiospec_cuda_emit(aiospec_cuda_producer* p, const aiospec_emit_args* args, cudaStream_t stream);

/* As aiospec_cuda_emit, but when step_dev is not NULL the kernel reads the step from that
 * device address when it runs (graph replays advance it on the device). */
cudaError_t aiospec_cuda_emit_ex(aiospec_cuda_producer* p, const aiospec_emit_args* args, const uint64_t* step_dev,
                                 cudaStream_t stream);

/* A valid device address for inputs that are present but empty (a zero-size tensor's data
 * pointer may be NULL, which the op reads as "absent"); never dereferenced. */
const void* aiospec_cuda_placeholder(const aiospec_cuda_producer* p);

/* The host-side error of the last emit call that returned cudaErrorInvalidValue. */
void aiospec_cuda_last_error(const aiospec_cuda_producer* p, aiospec_error* out);

/* Reports the oldest unreported device-side error of kernels that have finished, without
 * synchronizing: returns 1 and fills *out (and *step, the frame's step, when not NULL), or 0.
 * Each error is reported once; errors that happened while one was pending are only counted
 * (aiospec_cuda_stats.errors). Also does the throttled liveness pass. */
int aiospec_cuda_check(aiospec_cuda_producer* p, aiospec_error* out, uint64_t* step);

/* The word aiospec_cuda_check compares with what it reported: device-side errors published so
 * far, in mapped host memory. A caller that reads it before each aiospec_cuda_check may skip
 * the call while it still holds the value read before the last one (a load, no call). */
const volatile uint64_t* aiospec_cuda_error_seq(const aiospec_cuda_producer* p);

/* Formats an error of this path (emit.h's codes and AIOSPEC_E_RING_FULL / _MAX_ROWS). */
int aiospec_cuda_format_error(const aiospec_cuda_producer* p, const aiospec_error* e, char* buf, size_t size);

/* Rings the bell of every sleeping reader (call once frames are known to be visible, e.g.
 * after the step's synchronization); returns how many were rung. Refreshes the heartbeat. */
int aiospec_cuda_notify(aiospec_cuda_producer* p);

typedef struct aiospec_cuda_stats {
  uint64_t head;             /* control page: position past the last committed frame */
  uint64_t frames_written;   /* control page: DATA frames committed */
  uint64_t bytes_written;    /* control page: payload bytes committed */
  uint64_t frames_lost;      /* control page: frames this ring lost (ring full, bad input) */
  uint64_t errors;           /* device-side errors this producer saw */
  uint64_t errors_reported;  /* of which aiospec_cuda_check returned */
  uint64_t emits;            /* emit calls that launched kernels */
  uint64_t capacity;         /* ring data area bytes */
  uint64_t max_record;       /* largest frame, header included */
  int64_t max_rows;
} aiospec_cuda_stats;

/* Counters from mapped memory; no synchronization (they reflect finished kernels). */
void aiospec_cuda_stats_get(const aiospec_cuda_producer* p, aiospec_cuda_stats* out);

/* Runtime checks a caller may want before creating a producer: 1 if `device` can map host
 * memory (cudaDevAttrHostRegisterSupported), else 0 with the reason in err. */
int aiospec_cuda_device_ok(int32_t device, char* err, size_t errlen);

/* The device ordinal owning a device pointer, or -1 (host memory, unknown pointer). */
int32_t aiospec_cuda_pointer_device(const void* ptr);

int32_t aiospec_cuda_abi_version(void);

/* cudaGetErrorString of the runtime this library links (for bindings without their own). */
const char* aiospec_cuda_error_string(int32_t status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* AIOSPEC_EMIT_CUDA_H_ */
