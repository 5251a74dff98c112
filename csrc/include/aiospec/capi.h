/* C ABI of the CPU emit library (libaiospec_cpu.so), for ctypes and other foreign callers.
 *
 * Every function returns an AIOSPEC_STATUS_* code; on failure the calling thread's last
 * error (message, errno, and for AIOSPEC_STATUS_EMIT the aiospec_error fields) tells why.
 * aiospec/ops/_cpu.py binds it; aiospec/ops/_abi.py mirrors the structs.
 */
#ifndef AIOSPEC_CAPI_H_
#define AIOSPEC_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#include "aiospec/emit.h"

/* The library is built with -fvisibility=hidden: only these functions are exported. */
#define AIOSPEC_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

enum aiospec_status {
  AIOSPEC_STATUS_OK = 0,
  AIOSPEC_STATUS_EMIT = 1,        /* invalid input; nothing written (aiospec_last_error_detail) */
  AIOSPEC_STATUS_RING_FULL = 2,   /* no room within the timeout; lagging readers named */
  AIOSPEC_STATUS_BAD_SEGMENT = 3, /* the segment is not a ring this library can write */
  AIOSPEC_STATUS_CLOSED = 4,      /* the producer was closed, or the slot lock stayed held past its bound */
  AIOSPEC_STATUS_OS = 5,          /* a system call failed (aiospec_last_errno) */
  AIOSPEC_STATUS_INVALID = 6,     /* a bad argument to this API (NULL producer, bad name) */
  AIOSPEC_STATUS_INTERNAL = 7,    /* unexpected (out of memory, a bug) */
  AIOSPEC_STATUS_BUSY = 8         /* another live process holds the ring's producer claim */
};

typedef struct aiospec_producer aiospec_producer;

typedef struct aiospec_producer_info {
  uint64_t capacity;       /* data area bytes */
  uint64_t max_record;     /* largest frame, header included */
  uint64_t head;           /* position past the last frame this producer committed */
  uint64_t frames_written; /* DATA frames in the ring's counter */
} aiospec_producer_info;

AIOSPEC_API int32_t aiospec_abi_version(void);    /* AIOSPEC_EMIT_ABI_VERSION */
AIOSPEC_API uint32_t aiospec_layout_version(void); /* AIOSPEC_VERSION << 16 | AIOSPEC_PAYLOAD_VERSION */

/* Maps /dev/shm/<name> and becomes its producer. reader_timeout > 0 evicts readers that
 * block the producer and sent no heartbeat for that long; check_pids evicts dead ones. */
AIOSPEC_API int aiospec_producer_open(const char* name, double reader_timeout, int32_t check_pids, aiospec_producer** out);
/* Frees the producer; mark_closed stores producer_state = closed (readers drain, then see
 * "producer gone"). NULL is ignored. */
AIOSPEC_API int aiospec_producer_close(aiospec_producer* p, int32_t mark_closed);
/* Validates, reserves (waiting up to timeout seconds, < 0 forever), writes the frame in
 * place and commits it; *position (may be NULL) gets its ring position. */
AIOSPEC_API int aiospec_producer_emit(aiospec_producer* p, const aiospec_emit_args* args, double timeout, uint64_t* position);
/* Rings the bell of every sleeping reader; *rung (may be NULL) gets how many were rung. */
AIOSPEC_API int aiospec_producer_notify(aiospec_producer* p, int32_t* rung);
/* Stores the producer's heartbeat (monotonic ns) in the control page, for a producer idle
 * between steps (emits refresh it too). AIOSPEC_STATUS_CLOSED after close. */
AIOSPEC_API int aiospec_producer_heartbeat(aiospec_producer* p);
/* Adds `frames` to the ring's frames-lost counter and rings the bells: readers turn the rise
 * into stream errors (for steps the caller could not write). AIOSPEC_STATUS_CLOSED after close. */
AIOSPEC_API int aiospec_producer_add_lost(aiospec_producer* p, uint64_t frames);
/* Fills *out (aiospec_producer_info above). AIOSPEC_STATUS_CLOSED after close. */
AIOSPEC_API int aiospec_producer_get_info(aiospec_producer* p, aiospec_producer_info* out);

/* Validation only (max_record 0 = no size limit): fills *layout on success. */
AIOSPEC_API int aiospec_emit_validate(const aiospec_emit_args* args, uint64_t max_record, aiospec_frame_layout* layout);
/* Validates and writes the payload into dst (cap bytes); *len gets its size. */
AIOSPEC_API int aiospec_emit_build(const aiospec_emit_args* args, uint64_t max_record, void* dst, uint64_t cap, uint64_t* len);

AIOSPEC_API const char* aiospec_last_error(void);             /* this thread's last failure message */
AIOSPEC_API int32_t aiospec_last_errno(void);                 /* its errno (AIOSPEC_STATUS_OS) */
AIOSPEC_API void aiospec_last_error_detail(aiospec_error* out); /* its fields (AIOSPEC_STATUS_EMIT) */
/* aiospec_format_error from emit.h, exported for callers that hold an error word: the
 * message into buf (always NUL-terminated); returns its length as snprintf reports it, or
 * -1 when e or buf is NULL or size is 0. */
AIOSPEC_API int32_t aiospec_error_message(const aiospec_error* e, char* buf, uint64_t size);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* AIOSPEC_CAPI_H_ */
