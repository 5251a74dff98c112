// shm._native: the paths of shm/_producer.py and shm/_reader.py where interpreted Python is
// the latency.
//
// reserve() and commit() are a producer's frame (commit also rings the bells of sleeping
// readers); sleep() is a reader's announce / re-check / block / drain; poll() collects committed
// frames. They run right after a core wakes from idle, when every cache line the interpreter
// touches is a miss: in C they touch a handful of lines instead of hundreds. The Python code in
// shm/_producer.py and shm/_reader.py does the same steps (and is used when this module is not
// built); docs/wire-format.md sections 3 to 5 are the protocol. Stateless: every call takes the segment
// as a buffer and validates the offsets it derives from it.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shm/layout.h"

// Bumped whenever a signature or a semantic changes: shm/_sys.py ignores a stale build.
#define SHM_NATIVE_ABI 4

static inline uint64_t ld64(const uint8_t* base, size_t off) {
  return __atomic_load_n((const uint64_t*)(base + off), __ATOMIC_ACQUIRE);
}
static inline uint32_t ld32(const uint8_t* base, size_t off) {
  return __atomic_load_n((const uint32_t*)(base + off), __ATOMIC_ACQUIRE);
}
static inline void st64(uint8_t* base, size_t off, uint64_t v) {
  __atomic_store_n((uint64_t*)(base + off), v, __ATOMIC_RELEASE);
}
static inline void st32(uint8_t* base, size_t off, uint32_t v) {
  __atomic_store_n((uint32_t*)(base + off), v, __ATOMIC_RELEASE);
}

static uint64_t monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // what time.monotonic_ns() reads
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// shm.CorruptControl, looked up once at import: a control word that changed under us is typed.
static PyObject* corrupt_control = NULL;

// Maps the segment and checks that the control page's capacity is still the one the mapping
// was made for (control page + data area = the whole buffer): any other value is corrupt.
static int get_segment(PyObject* obj, Py_buffer* view, uint64_t* capacity) {
  if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
  const uint8_t* base = (const uint8_t*)view->buf;
  if (view->len < SHM_CONTROL_SIZE || ((uintptr_t)base & 7)) {
    PyErr_Format(PyExc_ValueError, "segment: %zd bytes: expected an 8-byte aligned mapping of at least %d bytes",
                 view->len, SHM_CONTROL_SIZE);
    PyBuffer_Release(view);
    return -1;
  }
  const uint64_t cap = ld64(base, SHM_OFF_CAPACITY);
  if (cap < SHM_MIN_CAPACITY || (cap & (cap - 1)) || cap != (uint64_t)view->len - SHM_CONTROL_SIZE) {
    PyErr_Format(corrupt_control, "segment: capacity word %llu, expected %zd (the data area of the %zd-byte mapping)",
                 (unsigned long long)cap, view->len - SHM_CONTROL_SIZE, view->len);
    PyBuffer_Release(view);
    return -1;
  }
  *capacity = cap;
  return 0;
}

static int get_u64(PyObject* obj, const char* what, uint64_t* out) {
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s = %R: expected a non-negative int below 2**64", what, obj);
    return -1;
  }
  *out = v;
  return 0;
}

// reserve(segment, n, head, min_tail, max_record) -> memoryview | None
//
// The producer's common case of reserve() (section 3): the ring's head is still ``head`` (no
// other writer since) and the 16 header bytes there are zero (no committed frame to overwrite),
// the frame fits before the end of the data area (no PAD) and there is room above ``min_tail``
// for it and the next frame's header. Returns the writable payload slice of ``segment``; None
// for every other case, which the Python path handles (it waits, pads, adopts the head or
// raises with the full explanation).
static PyObject* native_reserve(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "reserve() takes 5 arguments (%zd given)", nargs);
    return NULL;
  }
  uint64_t n, head, min_tail, max_record;
  if (!PyLong_CheckExact(args[1]) || get_u64(args[1], "n", &n) < 0) {
    PyErr_Clear();
    Py_RETURN_NONE;  // not a plain non-negative int: the Python path says what is wrong
  }
  if (get_u64(args[2], "head", &head) < 0 || get_u64(args[3], "min_tail", &min_tail) < 0 ||
      get_u64(args[4], "max_record", &max_record) < 0)
    return NULL;
  Py_buffer seg;
  uint64_t cap;
  if (get_segment(args[0], &seg, &cap) < 0) return NULL;
  const uint8_t* base = (const uint8_t*)seg.buf;
  const uint64_t size = (SHM_FRAME_HEADER + n + SHM_FRAME_ALIGN - 1) & ~(uint64_t)(SHM_FRAME_ALIGN - 1);
  const uint64_t off = head & (cap - 1);
  const size_t at = SHM_CONTROL_SIZE + off;
  const int fast = n <= max_record && size <= max_record && ld64(base, SHM_OFF_HEAD) == head &&
                   ld64(base, at + SHM_FH_POSITION) == 0 && ld64(base, at + SHM_FH_COMMIT) == 0 &&
                   size <= cap - off && head >= min_tail && head - min_tail + size + SHM_FRAME_HEADER <= cap;
  PyBuffer_Release(&seg);
  if (!fast) Py_RETURN_NONE;
  const Py_ssize_t start = (Py_ssize_t)(SHM_CONTROL_SIZE + off + SHM_FRAME_HEADER);
  return PySequence_GetSlice(args[0], start, start + (Py_ssize_t)n);
}

// commit(segment, pos, n, ftype, bells) -> int
//
// Publishes the frame reserved at position ``pos`` with an ``n``-byte payload (section 3: the
// position word, the next frame's header zeroed, then the commit word last, then the head).
// For a DATA frame it also counts the frame, refreshes the producer heartbeat and, after a full
// fence (store(commit) -> load(sleeping), paired with the reader's sleep), rings the bell of
// every active sleeping reader whose descriptor ``bells`` holds: a buffer of int64 pairs
// (generation, fd) per slot, fd -1 for none. Returns the bitmask of sleeping slots it could not
// ring (no descriptor for the slot's current generation, or a write error other than a full
// FIFO): the caller opens or drops those bells.
static PyObject* native_commit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "commit() takes 5 arguments (%zd given)", nargs);
    return NULL;
  }
  uint64_t pos, n, ftype;
  if (get_u64(args[1], "pos", &pos) < 0 || get_u64(args[2], "n", &n) < 0 || get_u64(args[3], "ftype", &ftype) < 0)
    return NULL;
  if (ftype != SHM_FRAME_DATA && ftype != SHM_FRAME_PAD) {
    PyErr_Format(PyExc_ValueError, "ftype = %llu: expected %d (DATA) or %d (PAD)", (unsigned long long)ftype,
                 SHM_FRAME_DATA, SHM_FRAME_PAD);
    return NULL;
  }
  Py_buffer seg;
  uint64_t cap;
  if (get_segment(args[0], &seg, &cap) < 0) return NULL;
  uint8_t* base = (uint8_t*)seg.buf;
  const uint64_t mask = cap - 1;
  const uint64_t size = (SHM_FRAME_HEADER + n + SHM_FRAME_ALIGN - 1) & ~(uint64_t)(SHM_FRAME_ALIGN - 1);
  if (n > cap || size > cap - (pos & mask)) {
    PyBuffer_Release(&seg);
    PyErr_Format(PyExc_ValueError, "n = %llu at position %llu: the frame does not fit the %llu-byte data area",
                 (unsigned long long)n, (unsigned long long)pos, (unsigned long long)cap);
    return NULL;
  }
  const size_t here = SHM_CONTROL_SIZE + (pos & mask);
  const size_t next = SHM_CONTROL_SIZE + ((pos + size) & mask);
  // step 5: zeros from the payload's end to the frame's 64-byte boundary (a PAD has no payload)
  if (ftype == SHM_FRAME_DATA) memset(base + here + SHM_FRAME_HEADER + n, 0, size - SHM_FRAME_HEADER - n);
  st64(base, here + SHM_FH_POSITION, pos);
  st64(base, next + SHM_FH_POSITION, 0);
  st64(base, next + SHM_FH_COMMIT, 0);
  // release: the payload, the position and the zeroed next header before the commit word
  st64(base, here + SHM_FH_COMMIT, (SHM_FRAME_HEADER + n) | (ftype << 32));
  st64(base, SHM_OFF_HEAD, pos + size);
  if (ftype == SHM_FRAME_PAD) {
    PyBuffer_Release(&seg);
    return PyLong_FromLong(0);
  }
  st64(base, SHM_OFF_FRAMES_WRITTEN, ld64(base, SHM_OFF_FRAMES_WRITTEN) + 1);
  st64(base, SHM_OFF_BYTES_WRITTEN, ld64(base, SHM_OFF_BYTES_WRITTEN) + n);
  st64(base, SHM_OFF_HEARTBEAT_NS, monotonic_ns());
  __atomic_thread_fence(__ATOMIC_SEQ_CST);

  uint32_t readers = ld32(base, SHM_OFF_MAX_READERS);
  if (readers > SHM_MAX_READERS) readers = SHM_MAX_READERS;
  unsigned long need = 0;
  Py_buffer tab = {0};
  int have_tab = 0;
  for (uint32_t s = 0; s < readers; ++s) {
    const size_t slot = SHM_READERS_BASE + (size_t)s * SHM_READER_STRIDE;
    if (ld32(base, slot + SHM_RD_STATE) != SHM_READER_ACTIVE || ld32(base, slot + SHM_RD_SLEEPING) == 0)
      continue;
    if (!have_tab) {
      if (PyObject_GetBuffer(args[4], &tab, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&seg);
        return NULL;
      }
      have_tab = 1;
    }
    const int64_t* bells = (const int64_t*)tab.buf;
    if ((Py_ssize_t)(2 * (s + 1) * sizeof(int64_t)) > tab.len ||
        bells[2 * s] != (int64_t)ld32(base, slot + SHM_RD_GENERATION) || bells[2 * s + 1] < 0) {
      need |= 1ul << s;
      continue;
    }
    // a full FIFO (EAGAIN) means earlier rings are still unread: the reader is due anyway
    if (write((int)bells[2 * s + 1], "\x01", 1) < 0 && errno != EAGAIN) need |= 1ul << s;
  }
  if (have_tab) PyBuffer_Release(&tab);
  PyBuffer_Release(&seg);
  return PyLong_FromUnsignedLong(need);
}

// sleep(segment, slot, cursor, fd, timeout_ms) -> bool
//
// A reader's sleep (section 5): set the slot's sleeping flag, full fence (store(sleeping) ->
// load(commit), paired with commit), and unless the frame at ``cursor`` is already committed,
// block in poll() on the bell ``fd`` for up to ``timeout_ms`` (negative: forever) with the GIL
// released; then clear the flag, refresh the reader heartbeat and drain the bell. Returns True
// when a frame (or PAD) is readable at ``cursor``, or the head is past it (a wiped commit word
// that poll() reports). A signal that interrupts the wait runs its
// Python handler here, so Ctrl-C is not deferred to the end of the timeout.
static PyObject* native_sleep(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "sleep() takes 5 arguments (%zd given)", nargs);
    return NULL;
  }
  uint64_t slot, cursor;
  if (get_u64(args[1], "slot", &slot) < 0 || get_u64(args[2], "cursor", &cursor) < 0) return NULL;
  const long fd_l = PyLong_AsLong(args[3]);
  if (fd_l == -1 && PyErr_Occurred()) return NULL;
  const long timeout_ms = PyLong_AsLong(args[4]);
  if (timeout_ms == -1 && PyErr_Occurred()) return NULL;
  if (fd_l < 0 || fd_l > INT32_MAX || slot >= SHM_MAX_READERS || timeout_ms > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "sleep: slot %llu, fd %ld, timeout_ms %ld: expected slot < %d, fd >= 0, "
                 "timeout_ms <= %d", (unsigned long long)slot, fd_l, timeout_ms, SHM_MAX_READERS, INT32_MAX);
    return NULL;
  }
  const int fd = (int)fd_l;
  Py_buffer seg;
  uint64_t cap;
  if (get_segment(args[0], &seg, &cap) < 0) return NULL;
  uint8_t* base = (uint8_t*)seg.buf;
  const size_t rd = SHM_READERS_BASE + (size_t)slot * SHM_READER_STRIDE;
  const size_t commit = SHM_CONTROL_SIZE + (cursor & (cap - 1)) + SHM_FH_COMMIT;

  st32(base, rd + SHM_RD_SLEEPING, 1);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  int interrupted = 0;
  // a head past the cursor is readable too: poll() then finds the frame, or says it is corrupt
  if (ld64(base, commit) == 0 && ld64(base, SHM_OFF_HEAD) <= cursor) {
    struct pollfd p = {fd, POLLIN, 0};
    int rc;
    // the buffer export keeps the mapping alive (mmap.close() refuses) while the GIL is away
    Py_BEGIN_ALLOW_THREADS
    rc = poll(&p, 1, timeout_ms < 0 ? -1 : (int)timeout_ms);
    Py_END_ALLOW_THREADS
    interrupted = rc < 0 && errno == EINTR;
  }
  st32(base, rd + SHM_RD_SLEEPING, 0);
  st64(base, rd + SHM_RD_HEARTBEAT_NS, monotonic_ns());
  char sink[4096];
  while (read(fd, sink, sizeof sink) == (ssize_t)sizeof sink) {
  }
  const int ready = ld64(base, commit) != 0 || ld64(base, SHM_OFF_HEAD) > cursor;
  PyBuffer_Release(&seg);
  if (interrupted && PyErr_CheckSignals() < 0) return NULL;
  return PyBool_FromLong(ready);
}

// poll(segment, view, cursor, max_frames, max_record, slot, generation) -> (frames, cursor, problem)
//
// A reader's poll (section 4): up to ``max_frames`` committed DATA payloads from ``cursor`` on,
// as slices of ``view`` (a read-only memoryview of the same mapping), PAD frames skipped. ``problem`` is
// None; or 1 when slot ``slot`` no longer belongs to this reader (``generation``): nothing is
// read then; or the description of the corrupt frame at the returned cursor, after the good
// frames before it. Refreshes the reader heartbeat when it returns frames.
static PyObject* native_poll(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "poll() takes 7 arguments (%zd given)", nargs);
    return NULL;
  }
  uint64_t pos, max_frames, max_record, slot, gen;
  if (get_u64(args[2], "cursor", &pos) < 0 || get_u64(args[3], "max_frames", &max_frames) < 0 ||
      get_u64(args[4], "max_record", &max_record) < 0 || get_u64(args[5], "slot", &slot) < 0 ||
      get_u64(args[6], "generation", &gen) < 0)
    return NULL;
  if (!PyMemoryView_Check(args[1])) {
    PyErr_Format(PyExc_TypeError, "poll: view = %R: expected a memoryview of the segment", args[1]);
    return NULL;
  }
  if (slot >= SHM_MAX_READERS) {
    PyErr_Format(PyExc_ValueError, "poll: slot %llu: expected < %d", (unsigned long long)slot, SHM_MAX_READERS);
    return NULL;
  }
  Py_buffer seg;
  uint64_t cap;
  if (get_segment(args[0], &seg, &cap) < 0) return NULL;
  const Py_buffer* shown = PyMemoryView_GET_BUFFER(args[1]);
  if (shown->buf != seg.buf || shown->len != seg.len) {
    PyBuffer_Release(&seg);
    PyErr_SetString(PyExc_ValueError, "poll: view must cover the same mapping as segment");
    return NULL;
  }
  uint8_t* base = (uint8_t*)seg.buf;
  const size_t rd = SHM_READERS_BASE + (size_t)slot * SHM_READER_STRIDE;
  if (ld32(base, rd + SHM_RD_STATE) != SHM_READER_ACTIVE || ld32(base, rd + SHM_RD_GENERATION) != gen) {
    PyBuffer_Release(&seg);
    return Py_BuildValue("(NKi)", PyList_New(0), (unsigned long long)pos, 1);
  }
  PyObject* frames = PyList_New(0);
  if (frames == NULL) {
    PyBuffer_Release(&seg);
    return NULL;
  }
  char bad[160] = {0};
  const uint64_t mask = cap - 1;
  while ((uint64_t)PyList_GET_SIZE(frames) < max_frames) {
    const uint64_t off = pos & mask;
    const size_t at = SHM_CONTROL_SIZE + off;
    uint64_t commit = ld64(base, at + SHM_FH_COMMIT);  // acquire: the frame after it
    if (commit == 0) {
      // The head is stored after the commit word: a head past ``pos`` with the commit word
      // still 0 on a second look means the word was wiped, not that the frame is on its way.
      const uint64_t head = ld64(base, SHM_OFF_HEAD);
      commit = ld64(base, at + SHM_FH_COMMIT);
      if (commit == 0) {
        if (head > pos)
          snprintf(bad, sizeof bad, "commit word 0 below the head %llu (a committed frame was wiped)",
                   (unsigned long long)head);
        break;
      }
    }
    const uint64_t length = commit & 0xFFFFFFFFull, ftype = commit >> 32;
    const uint64_t size = (length + SHM_FRAME_ALIGN - 1) & ~(uint64_t)(SHM_FRAME_ALIGN - 1);
    if ((ftype != SHM_FRAME_DATA && ftype != SHM_FRAME_PAD) || length < SHM_FRAME_HEADER ||
        size > cap - off) {
      snprintf(bad, sizeof bad, "commit word 0x%016llx (length %llu, type %llu)", (unsigned long long)commit,
               (unsigned long long)length, (unsigned long long)ftype);
      break;
    }
    if (ftype == SHM_FRAME_PAD && length != cap - off) {
      snprintf(bad, sizeof bad, "PAD frame of length %llu, expected %llu (the rest of the data area)",
               (unsigned long long)length, (unsigned long long)(cap - off));
      break;
    }
    if (ftype == SHM_FRAME_DATA && size > max_record) {
      snprintf(bad, sizeof bad, "length %llu exceeds max_record %llu", (unsigned long long)length,
               (unsigned long long)max_record);
      break;
    }
    const uint64_t stamp = ld64(base, at + SHM_FH_POSITION);
    if (stamp != pos) {
      snprintf(bad, sizeof bad, "position field %llu (stale or torn frame)", (unsigned long long)stamp);
      break;
    }
    if (ftype == SHM_FRAME_DATA) {
      PyObject* view = PySequence_GetSlice(args[1], (Py_ssize_t)(at + SHM_FRAME_HEADER), (Py_ssize_t)(at + length));
      if (view == NULL || PyList_Append(frames, view) < 0) {
        Py_XDECREF(view);
        Py_DECREF(frames);
        PyBuffer_Release(&seg);
        return NULL;
      }
      Py_DECREF(view);
    }
    pos += size;
  }
  if (PyList_GET_SIZE(frames)) st64(base, rd + SHM_RD_HEARTBEAT_NS, monotonic_ns());
  PyBuffer_Release(&seg);
  if (bad[0]) return Py_BuildValue("(NKs)", frames, (unsigned long long)pos, bad);
  return Py_BuildValue("(NKO)", frames, (unsigned long long)pos, Py_None);
}

static PyMethodDef methods[] = {
    {"reserve", (PyCFunction)(void (*)(void))native_reserve, METH_FASTCALL,
     "reserve(segment, n, head, min_tail, max_record) -> memoryview | None: the common case of reserve()."},
    {"commit", (PyCFunction)(void (*)(void))native_commit, METH_FASTCALL,
     "commit(segment, pos, n, ftype, bells) -> int: publish a frame, ring sleeping readers; "
     "returns the slots left for the caller to ring."},
    {"sleep", (PyCFunction)(void (*)(void))native_sleep, METH_FASTCALL,
     "sleep(segment, slot, cursor, fd, timeout_ms) -> bool: a reader's sleep on its bell."},
    {"poll", (PyCFunction)(void (*)(void))native_poll, METH_FASTCALL,
     "poll(segment, view, cursor, max_frames, max_record, slot, generation) -> (frames, cursor, problem)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shm._native", "C paths of the shm ring (see shm/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
  PyObject* errors = PyImport_ImportModule("shm._errors");
  if (errors == NULL) return NULL;
  corrupt_control = PyObject_GetAttrString(errors, "CorruptControl");
  Py_DECREF(errors);
  if (corrupt_control == NULL) return NULL;
  PyObject* m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  if (PyModule_AddIntConstant(m, "ABI", SHM_NATIVE_ABI) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
