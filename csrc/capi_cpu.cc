// C ABI of the CPU emit library: thin extern "C" wrappers that turn C++ exceptions into
// status codes plus a thread-local last error (capi.h). No logic lives here.
#include "aiospec/capi.h"

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "aiospec/emit_cpu.h"
#include "aiospec/ring.h"

struct aiospec_producer {
  explicit aiospec_producer(const std::string& name, aiospec::ProducerOptions o) : ring(name, o) {}
  aiospec::RingProducer ring;
};

namespace {

struct LastError {
  std::string message;
  int err = 0;
  aiospec_error detail{};
};

thread_local LastError g_last;

int fail(int status, const std::string& message, int err = 0) {
  g_last.message = message;
  g_last.err = err;
  std::memset(&g_last.detail, 0, sizeof g_last.detail);
  g_last.detail.row = g_last.detail.col = -1;
  return status;
}

int ring_status(aiospec::RingErrc c) {
  switch (c) {
    case aiospec::RingErrc::bad_segment: return AIOSPEC_STATUS_BAD_SEGMENT;
    case aiospec::RingErrc::ring_full: return AIOSPEC_STATUS_RING_FULL;
    case aiospec::RingErrc::closed: return AIOSPEC_STATUS_CLOSED;
    case aiospec::RingErrc::os: return AIOSPEC_STATUS_OS;
    case aiospec::RingErrc::invalid: return AIOSPEC_STATUS_INVALID;
    case aiospec::RingErrc::busy: return AIOSPEC_STATUS_BUSY;
  }
  return AIOSPEC_STATUS_INTERNAL;
}

// Runs f, mapping every exception to a status; exceptions never cross the C boundary.
template <class F>
int guarded(F&& f) {
  try {
    f();
    return AIOSPEC_STATUS_OK;
  } catch (const aiospec::EmitError& e) {
    int s = fail(AIOSPEC_STATUS_EMIT, e.what());
    g_last.detail = e.error;
    return s;
  } catch (const aiospec::RingError& e) {
    return fail(ring_status(e.code), e.what(), e.err);
  } catch (const std::bad_alloc&) {
    return fail(AIOSPEC_STATUS_INTERNAL, "out of memory", ENOMEM);
  } catch (const std::exception& e) {
    return fail(AIOSPEC_STATUS_INTERNAL, e.what());
  } catch (...) {
    return fail(AIOSPEC_STATUS_INTERNAL, "unknown C++ exception");
  }
}

int require(const void* p, const char* what) {
  return p != nullptr ? AIOSPEC_STATUS_OK : fail(AIOSPEC_STATUS_INVALID, std::string(what) + ": NULL pointer");
}

}  // namespace

extern "C" {

int32_t aiospec_abi_version(void) { return AIOSPEC_EMIT_ABI_VERSION; }

uint32_t aiospec_layout_version(void) { return (uint32_t(AIOSPEC_VERSION) << 16) | AIOSPEC_PAYLOAD_VERSION; }

int aiospec_producer_open(const char* name, double reader_timeout, int32_t check_pids, aiospec_producer** out) {
  if (int s = require(name, "name")) return s;
  if (int s = require(out, "out")) return s;
  *out = nullptr;
  return guarded([&] {
    aiospec::ProducerOptions o;
    o.reader_timeout = reader_timeout;
    o.check_pids = check_pids != 0;
    *out = new aiospec_producer(name, o);
  });
}

int aiospec_producer_close(aiospec_producer* p, int32_t mark_closed) {
  if (p == nullptr) return AIOSPEC_STATUS_OK;
  int s = guarded([&] { p->ring.close(mark_closed != 0); });
  delete p;
  return s;
}

int aiospec_producer_emit(aiospec_producer* p, const aiospec_emit_args* args, double timeout, uint64_t* position) {
  if (int s = require(p, "producer")) return s;
  if (int s = require(args, "args")) return s;
  return guarded([&] {
    const uint64_t pos = aiospec::emit_cpu(p->ring, *args, timeout);
    if (position != nullptr) *position = pos;
  });
}

int aiospec_producer_notify(aiospec_producer* p, int32_t* rung) {
  if (int s = require(p, "producer")) return s;
  return guarded([&] {
    const int n = p->ring.notify();
    if (rung != nullptr) *rung = n;
  });
}

int aiospec_producer_heartbeat(aiospec_producer* p) {
  if (int s = require(p, "producer")) return s;
  return guarded([&] {
    if (p->ring.closed()) throw aiospec::RingError(aiospec::RingErrc::closed, "heartbeat: the producer is closed");
    p->ring.heartbeat();
  });
}

int aiospec_producer_add_lost(aiospec_producer* p, uint64_t frames) {
  if (int s = require(p, "producer")) return s;
  return guarded([&] {
    if (p->ring.closed()) throw aiospec::RingError(aiospec::RingErrc::closed, "add_lost: the producer is closed");
    p->ring.add_frames_lost(frames);
  });
}

int aiospec_producer_get_info(aiospec_producer* p, aiospec_producer_info* out) {
  if (int s = require(p, "producer")) return s;
  if (int s = require(out, "out")) return s;
  return guarded([&] {
    if (p->ring.closed()) throw aiospec::RingError(aiospec::RingErrc::closed, "info: the producer is closed");
    out->capacity = p->ring.capacity();
    out->max_record = p->ring.max_record();
    out->head = p->ring.head();
    out->frames_written = p->ring.frames_written();
  });
}

int aiospec_emit_validate(const aiospec_emit_args* args, uint64_t max_record, aiospec_frame_layout* layout) {
  if (int s = require(args, "args")) return s;
  if (int s = require(layout, "layout")) return s;
  return guarded([&] {
    aiospec_error err;
    if (aiospec::emit_validate(*args, max_record, layout, &err) != AIOSPEC_E_OK) throw aiospec::EmitError(err);
  });
}

int aiospec_emit_build(const aiospec_emit_args* args, uint64_t max_record, void* dst, uint64_t cap, uint64_t* len) {
  if (int s = require(args, "args")) return s;
  if (int s = require(dst, "dst")) return s;
  return guarded([&] {
    aiospec_frame_layout lay;
    aiospec_error err;
    if (aiospec::emit_validate(*args, max_record, &lay, &err) != AIOSPEC_E_OK) throw aiospec::EmitError(err);
    if (lay.payload_len > cap) {
      throw aiospec::RingError(aiospec::RingErrc::invalid, "dst: " + std::to_string(cap) + " bytes, the payload needs " +
                                                               std::to_string(lay.payload_len));
    }
    aiospec::emit_write_payload(*args, lay, static_cast<uint8_t*>(dst));
    if (len != nullptr) *len = lay.payload_len;
  });
}

const char* aiospec_last_error(void) { return g_last.message.c_str(); }

int32_t aiospec_last_errno(void) { return g_last.err; }

void aiospec_last_error_detail(aiospec_error* out) {
  if (out != nullptr) *out = g_last.detail;
}

int32_t aiospec_error_message(const aiospec_error* e, char* buf, uint64_t size) {
  if (e == nullptr || buf == nullptr || size == 0) return -1;
  return aiospec_format_error(e, buf, size_t(size));
}

}  // extern "C"
