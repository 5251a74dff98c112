// The CPU emit writer (csrc/cpu/emit_cpu.cc): C++ API used by the C ABI and the Paddle op.
#ifndef AIOSPEC_EMIT_CPU_H_
#define AIOSPEC_EMIT_CPU_H_

#include <cstdint>
#include <stdexcept>
#include <string>

#include "aiospec/emit.h"
#include "aiospec/ring.h"

namespace aiospec {

// Invalid inputs: the message is aiospec_format_error's, `error` has the fields.
class EmitError : public std::invalid_argument {
 public:
  explicit EmitError(const aiospec_error& e);
  aiospec_error error;
};

std::string format_error(const aiospec_error& e);

// Runs every check (emit.h order) and computes the layout; max_record 0 = no size limit.
// Returns AIOSPEC_E_OK or the first error's code (filled into *err).
int emit_validate(const aiospec_emit_args& a, uint64_t max_record, aiospec_frame_layout* lay, aiospec_error* err);

// Writes the payload of a validated call into dst (lay.payload_len bytes, padding zeroed).
void emit_write_payload(const aiospec_emit_args& a, const aiospec_frame_layout& lay, uint8_t* dst);

// Validates (throws EmitError; nothing written), reserves in the ring (throws RingError),
// writes the payload in place and commits. Returns the frame's position.
uint64_t emit_cpu(RingProducer& ring, const aiospec_emit_args& a, double timeout);

}  // namespace aiospec

#endif  // AIOSPEC_EMIT_CPU_H_
