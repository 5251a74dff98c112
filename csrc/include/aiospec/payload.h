// The layout of a frame's payload: the C half of aiospec's payload definition.
//
// aiospec/_payload_layout.py is the Python half; tests/test_layout.py compiles
// csrc/tools/layout_dump.c against this header and checks every constant against Python.
// docs/wire-format.md ("Payload") explains the fields. The ring that carries the payload
// (segment, control page, frame header) is shm's: shm/include/shm/layout.h. Plain C.
#ifndef AIOSPEC_PAYLOAD_H_
#define AIOSPEC_PAYLOAD_H_

#define AIOSPEC_PAYLOAD_VERSION 2
#define AIOSPEC_HEADER_FIELDS 28
#define AIOSPEC_HEADER_LEN 147
#define AIOSPEC_HEADER_SPACE 152
#define AIOSPEC_COLUMN_ALIGN 8
#define AIOSPEC_KIND_TARGET 0
#define AIOSPEC_KIND_DRAFT 1
#define AIOSPEC_KIND_PROMPT 2
#define AIOSPEC_FRAME_HAS_LOGPROBS 1
#define AIOSPEC_FRAME_UNIFORM_TOKENS 2
#define AIOSPEC_FRAME_UNIFORM_DRAFTS 4
#define AIOSPEC_FRAME_LOGPROBS_PROCESSED 8
#define AIOSPEC_FRAME_FLAGS_MASK 15
#define AIOSPEC_FLAG_FIRST_TOKEN 1
#define AIOSPEC_FLAG_FINISHED 2
#define AIOSPEC_FLAG_PREEMPTED 4
#define AIOSPEC_FLAG_RECOVERY_STOP 8
#define AIOSPEC_FLAG_ABORTED 16
#define AIOSPEC_FLAG_DRAFT 32
#define AIOSPEC_FLAG_PROMPT 64
#define AIOSPEC_FLAG_MASK 127
#define AIOSPEC_HF_VERSION 0
#define AIOSPEC_HF_PRODUCER 1
#define AIOSPEC_HF_STEP 2
#define AIOSPEC_HF_KIND 3
#define AIOSPEC_HF_FFLAGS 4
#define AIOSPEC_HF_K 5
#define AIOSPEC_HF_R 6
#define AIOSPEC_HF_T 7
#define AIOSPEC_HF_D 8
#define AIOSPEC_HF_E 9
#define AIOSPEC_HF_NT 10
#define AIOSPEC_HF_ND 11
#define AIOSPEC_HF_COLUMNS 12
#define AIOSPEC_HF_PAYLOAD_LEN 27
#define AIOSPEC_NUM_COLUMNS 15
#define AIOSPEC_MAX_TOPK 1024
#define AIOSPEC_SAMPLED_POS_MAX_K 255
#define AIOSPEC_SAMPLED_EXCEPTION 255

// X-macro over every constant above, for tools that print or check the layout.
#define AIOSPEC_PAYLOAD_CONSTANTS(X) \
  X(PAYLOAD_VERSION) \
  X(HEADER_FIELDS) \
  X(HEADER_LEN) \
  X(HEADER_SPACE) \
  X(COLUMN_ALIGN) \
  X(KIND_TARGET) \
  X(KIND_DRAFT) \
  X(KIND_PROMPT) \
  X(FRAME_HAS_LOGPROBS) \
  X(FRAME_UNIFORM_TOKENS) \
  X(FRAME_UNIFORM_DRAFTS) \
  X(FRAME_LOGPROBS_PROCESSED) \
  X(FRAME_FLAGS_MASK) \
  X(FLAG_FIRST_TOKEN) \
  X(FLAG_FINISHED) \
  X(FLAG_PREEMPTED) \
  X(FLAG_RECOVERY_STOP) \
  X(FLAG_ABORTED) \
  X(FLAG_DRAFT) \
  X(FLAG_PROMPT) \
  X(FLAG_MASK) \
  X(HF_VERSION) \
  X(HF_PRODUCER) \
  X(HF_STEP) \
  X(HF_KIND) \
  X(HF_FFLAGS) \
  X(HF_K) \
  X(HF_R) \
  X(HF_T) \
  X(HF_D) \
  X(HF_E) \
  X(HF_NT) \
  X(HF_ND) \
  X(HF_COLUMNS) \
  X(HF_PAYLOAD_LEN) \
  X(NUM_COLUMNS) \
  X(MAX_TOPK) \
  X(SAMPLED_POS_MAX_K) \
  X(SAMPLED_EXCEPTION)

#endif  // AIOSPEC_PAYLOAD_H_
