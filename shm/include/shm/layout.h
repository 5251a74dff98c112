// The ring's binary layout: the C half of shm's one layout definition.
//
// shm/layout.py is the Python half (the same names without the SHM_ prefix);
// tests/test_layout.py compiles csrc/tools/layout_dump.c against this header and checks every
// constant against Python. docs/wire-format.md explains the fields. Everything is
// little-endian; positions are monotonically increasing u64 byte counts masked by
// capacity - 1. Plain C with no includes, so that the CUDA kernel, the CPU writer, shm's own C
// paths and any independent reader can include it. Frames are opaque bytes here: the payload
// layout belongs to aiospec (csrc/include/aiospec/payload.h).
#ifndef SHM_LAYOUT_H_
#define SHM_LAYOUT_H_

#define SHM_MAGIC 0x52434550534F4941ULL
#define SHM_VERSION 2
#define SHM_CONTROL_SIZE 4096
#define SHM_LINE 128
#define SHM_FRAME_ALIGN 64
#define SHM_MIN_CAPACITY 65536
#define SHM_MAX_CAPACITY 1099511627776ULL
#define SHM_MAX_RECORD 4294967232ULL
#define SHM_OFF_MAGIC 0
#define SHM_OFF_VERSION 8
#define SHM_OFF_CONTROL_SIZE 12
#define SHM_OFF_CAPACITY 16
#define SHM_OFF_MAX_RECORD 24
#define SHM_OFF_MAX_READERS 28
#define SHM_OFF_FRAME_ALIGN 32
#define SHM_OFF_CREATOR_PID 36
#define SHM_OFF_EPOCH 40
#define SHM_OFF_CREATED_NS 48
#define SHM_OFF_CREATOR_PIDNS 56
#define SHM_OFF_HEAD 128
#define SHM_OFF_FRAMES_WRITTEN 136
#define SHM_OFF_BYTES_WRITTEN 144
#define SHM_OFF_HEARTBEAT_NS 256
#define SHM_OFF_PRODUCER_STATE 264
#define SHM_OFF_PRODUCER_PID 268
#define SHM_OFF_PRODUCER_EPOCH 272
#define SHM_OFF_PRODUCER_PIDNS 280
#define SHM_OFF_FRAMES_LOST 384
#define SHM_PRODUCER_INIT 0
#define SHM_PRODUCER_LIVE 1
#define SHM_PRODUCER_CLOSED 2
#define SHM_READERS_BASE 1024
#define SHM_READER_STRIDE 128
#define SHM_MAX_READERS 24
#define SHM_RD_STATE 0
#define SHM_RD_PID 4
#define SHM_RD_TAIL 8
#define SHM_RD_HEARTBEAT_NS 16
#define SHM_RD_SLEEPING 24
#define SHM_RD_GENERATION 28
#define SHM_RD_FRAMES_READ 32
#define SHM_RD_PIDNS 40
#define SHM_READER_FREE 0
#define SHM_READER_ACTIVE 1
#define SHM_READER_EVICTED 2
#define SHM_FRAME_HEADER 16
#define SHM_FH_POSITION 0
#define SHM_FH_COMMIT 8
#define SHM_FRAME_DATA 1
#define SHM_FRAME_PAD 2

// X-macro over every constant above, for tools that print or check the layout.
#define SHM_LAYOUT_CONSTANTS(X) \
  X(MAGIC) \
  X(VERSION) \
  X(CONTROL_SIZE) \
  X(LINE) \
  X(FRAME_ALIGN) \
  X(MIN_CAPACITY) \
  X(MAX_CAPACITY) \
  X(MAX_RECORD) \
  X(OFF_MAGIC) \
  X(OFF_VERSION) \
  X(OFF_CONTROL_SIZE) \
  X(OFF_CAPACITY) \
  X(OFF_MAX_RECORD) \
  X(OFF_MAX_READERS) \
  X(OFF_FRAME_ALIGN) \
  X(OFF_CREATOR_PID) \
  X(OFF_EPOCH) \
  X(OFF_CREATED_NS) \
  X(OFF_CREATOR_PIDNS) \
  X(OFF_HEAD) \
  X(OFF_FRAMES_WRITTEN) \
  X(OFF_BYTES_WRITTEN) \
  X(OFF_HEARTBEAT_NS) \
  X(OFF_PRODUCER_STATE) \
  X(OFF_PRODUCER_PID) \
  X(OFF_PRODUCER_EPOCH) \
  X(OFF_PRODUCER_PIDNS) \
  X(OFF_FRAMES_LOST) \
  X(PRODUCER_INIT) \
  X(PRODUCER_LIVE) \
  X(PRODUCER_CLOSED) \
  X(READERS_BASE) \
  X(READER_STRIDE) \
  X(MAX_READERS) \
  X(RD_STATE) \
  X(RD_PID) \
  X(RD_TAIL) \
  X(RD_HEARTBEAT_NS) \
  X(RD_SLEEPING) \
  X(RD_GENERATION) \
  X(RD_FRAMES_READ) \
  X(RD_PIDNS) \
  X(READER_FREE) \
  X(READER_ACTIVE) \
  X(READER_EVICTED) \
  X(FRAME_HEADER) \
  X(FH_POSITION) \
  X(FH_COMMIT) \
  X(FRAME_DATA) \
  X(FRAME_PAD)

#endif  // SHM_LAYOUT_H_
