// The ring protocol for native producers (C++ host code, header-only).
//
// docs/wire-format.md is the specification; the section numbers below refer to it, and
// shm/_segment.py, _producer.py and _reader.py implement the same protocol in Python (readers,
// and a producer). This header lets the CPU emit writer and the CUDA host code produce into a ring
// that Python created: map it by name, validate the control page (section 2), reserve and
// commit frames (section 3), evict dead readers (section 6), ring the bells (section 5), keep
// the liveness words (section 7).
//
// Shared words are accessed with __atomic builtins (C++17 has no std::atomic_ref); each is an
// aligned 4- or 8-byte word, so these are the single loads/stores the protocol requires.
// Not thread-safe: one producer, used by one thread at a time.
#ifndef AIOSPEC_RING_H_
#define AIOSPEC_RING_H_

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "aiospec/layout.h"

namespace aiospec {

// ---- errors ---------------------------------------------------------------------------------

enum class RingErrc : int {
  bad_segment = 1,  // the control page does not describe a ring we can write (shm.BadSegment)
  ring_full = 2,    // no room within the timeout; message names the lagging readers (shm.RingFull)
  closed = 3,       // this producer was closed, or the slot lock stayed held past its bound (shm.RingError)
  os = 4,           // a system call failed; errno in .err (OSError)
  invalid = 5,      // a bad argument to the ring API itself (ValueError)
  busy = 6,         // another live process holds the producer claim (shm.ProducerBusy)
};

class RingError : public std::runtime_error {
 public:
  RingError(RingErrc c, const std::string& what, int e = 0) : std::runtime_error(what), code(c), err(e) {}
  RingErrc code;
  int err;
};

// ---- small helpers ----------------------------------------------------------------------------

inline uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// A double as Python's repr() prints it ("5.0", "0.25"), so native and Python messages agree.
inline std::string py_float(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf - 3, v);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

// True unless pid has exited; a zombie counts as exited (same rule as shm/_sys.py).
inline bool pid_alive(uint32_t pid) {
  if (pid == 0) return false;
  if (kill(pid_t(pid), 0) != 0) return errno == EPERM;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) return true;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf, f);
  std::fclose(f);
  // the state letter follows the parenthesised command name, which may contain ')'
  for (size_t i = n; i-- > 0;) {
    if (buf[i] == ')') return i + 2 >= n || (buf[i + 2] != 'Z' && buf[i + 2] != 'X');
  }
  return true;
}

// Inode of this process's pid namespace (0: unknown), as shm/_sys.py records it.
inline uint64_t own_pidns() {
  struct stat st;
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return uint64_t(st.st_ino);
}

// 1 alive, 0 dead (zombies included), -1 unknown: the pid was recorded by a process of another
// pid namespace, which this one cannot check (same rule as shm/_sys.py pid_state).
inline int pid_state(uint32_t pid, uint64_t pidns) {
  const uint64_t mine = own_pidns();
  if (pidns != 0 && mine != 0 && pidns != mine) return -1;
  return pid_alive(pid) ? 1 : 0;
}

// A claim held from another pid namespace is taken over once its heartbeat is this old
// (shm/_segment.py CLAIM_STALE_S).
constexpr double kClaimStaleS = 10.0;

// The longest wait for the slot lock where a caller must have it (shm/_segment.py
// SLOT_LOCK_TIMEOUT): any process that can open the segment can flock it, so no wait for it
// is unbounded.
constexpr double kSlotLockTimeoutS = 5.0;

// Who holds the flock of the file open at fd, from /proc/locks: "pid N", or "another process"
// where that cannot be read (same rule as shm/_segment.py lock_holder).
inline std::string lock_holder(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "another process";
  FILE* f = std::fopen("/proc/locks", "re");
  if (f == nullptr) return "another process";
  std::string who = "another process";
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    // "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; waiters have a "->" field
    if (std::strstr(line, "->") != nullptr) continue;
    char kind[16], adv[16], mode[16], dev_ino[64];
    unsigned long pid = 0;
    if (std::sscanf(line, "%*s %15s %15s %15s %lu %63s", kind, adv, mode, &pid, dev_ino) != 5) continue;
    if (std::strcmp(kind, "FLOCK") != 0) continue;
    const char* colon = std::strrchr(dev_ino, ':');
    if (colon != nullptr && std::strtoull(colon + 1, nullptr, 10) == uint64_t(st.st_ino)) {
      who = "pid " + std::to_string(pid);
      break;
    }
  }
  std::fclose(f);
  return who;
}

// Takes the slot lock (flock) of fd, waiting up to timeout seconds (0: one try); false when
// another process held it all that time.
inline bool lock_slots(int fd, double timeout) {
  const uint64_t deadline = monotonic_ns() + uint64_t(timeout > 0 ? timeout * 1e9 : 0);
  long delay_ns = 100000;
  for (;;) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    const uint64_t now = monotonic_ns();
    if (now >= deadline) return false;
    const uint64_t left = deadline - now;
    struct timespec ts = {0, long(std::min<uint64_t>(uint64_t(delay_ns), left))};
    nanosleep(&ts, nullptr);
    delay_ns = std::min(2 * delay_ns, 10000000L);
  }
}

// The age of a heartbeat word as one observer sees it (shm/_sys.py BeatAge): a beat from the
// future (a scribbled word, a writer whose clock is offset) is aged from when this observer
// first saw it, so a word that stops changing goes stale either way.
struct BeatAge {
  uint64_t beat = ~uint64_t(0);
  uint64_t seen = 0;
  uint64_t age_ns(uint64_t b, uint64_t now) {
    if (b <= now) return now - b;
    if (b != beat) beat = b, seen = now;
    return now - seen;
  }
};

// Same rule as shm/_segment.py: 1..200 of [A-Za-z0-9._-], not starting with '.', no ".bell".
inline bool valid_ring_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name[0] == '.') return false;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-';
    if (!ok) return false;
  }
  return name.find(".bell") == std::string::npos;
}

inline std::string segment_path(const std::string& name) { return "/dev/shm/" + name; }
inline std::string bell_path(const std::string& name, uint32_t slot) {
  return "/dev/shm/" + name + ".bell" + std::to_string(slot);
}

template <class T>
inline T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <class T>
inline T load_relaxed(const T* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
template <class T>
inline void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <class T>
inline void store_relaxed(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

// ---- mapping and validation (section 2) ---------------------------------------------------

// A validated read-write mapping of a ring segment. The CUDA host code registers `base`
// (cudaHostRegister) and reads the creator's fields from here.
class RingMap {
 public:
  RingMap() = default;
  RingMap(const RingMap&) = delete;
  RingMap& operator=(const RingMap&) = delete;
  RingMap(RingMap&& o) noexcept { *this = std::move(o); }
  RingMap& operator=(RingMap&& o) noexcept {
    if (this != &o) {
      unmap();
      name = std::move(o.name);
      fd = std::exchange(o.fd, -1);
      base = std::exchange(o.base, nullptr);
      size = o.size;
      capacity = o.capacity;
      mask = o.mask;
      max_record = o.max_record;
      max_readers = o.max_readers;
    }
    return *this;
  }
  ~RingMap() { unmap(); }

  // Opens /dev/shm/<name>, validates the control page exactly as section 2 says, maps it.
  static RingMap open(const std::string& name) {
    if (!valid_ring_name(name)) {
      throw RingError(RingErrc::invalid, "name = '" + name +
                                             "': expected 1..200 characters of [A-Za-z0-9._-], not starting with '.', without '.bell'");
    }
    RingMap m;
    m.name = name;
    auto bad = [&](const std::string& what) { return RingError(RingErrc::bad_segment, "segment " + name + ": " + what); };
    // never through a symlink (/dev/shm is everyone's and a name is no secret); O_NONBLOCK so
    // that a FIFO planted under the name does not block the open
    m.fd = ::open(segment_path(name).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (m.fd < 0) {
      int err = errno;
      if (err == ELOOP) throw bad(segment_path(name) + " is a symlink; refusing it");
      if (err == EISDIR) throw bad(segment_path(name) + " is a directory, not a ring");
      if (err == ENXIO) throw bad(segment_path(name) + " is a socket, not a ring");  // anyone may bind one there
      throw RingError(RingErrc::os, "segment " + name + ": cannot open " + segment_path(name) + ": " + strerror(err),
                      err);
    }
    struct stat st;
    if (fstat(m.fd, &st) != 0) {
      int err = errno;
      throw RingError(RingErrc::os, "segment " + name + ": fstat: " + strerror(err), err);
    }
    // what the library never creates (rings are 0600 regular files, section 1): anyone who may
    // write into such a segment can forge frames and control words
    if (!S_ISREG(st.st_mode)) {
      char mode[16];
      std::snprintf(mode, sizeof mode, "0o%o", unsigned(st.st_mode));
      throw bad(std::string("not a regular file (mode ") + mode + "), not a ring");
    }
    if (st.st_mode & 0077) {
      char mode[16];
      std::snprintf(mode, sizeof mode, "0o%03o", unsigned(st.st_mode & 07777));
      throw bad(std::string("mode ") + mode + " (owner uid " + std::to_string(st.st_uid) +
                "), expected no access for group or others (rings are created 0600); refusing a segment others may "
                "write");
    }
    const uint64_t size = uint64_t(st.st_size);
    if (size < AIOSPEC_CONTROL_SIZE) {
      throw bad(std::to_string(size) + " bytes, expected at least the " + std::to_string(AIOSPEC_CONTROL_SIZE) +
                "-byte control page");
    }
    unsigned char head[64];
    if (pread(m.fd, head, sizeof head, 0) != ssize_t(sizeof head)) throw bad("cannot read the control page");
    auto u64 = [&](size_t off) {
      uint64_t v;
      std::memcpy(&v, head + off, 8);
      return v;
    };
    auto u32 = [&](size_t off) {
      uint32_t v;
      std::memcpy(&v, head + off, 4);
      return v;
    };
    char hex[40];
    if (u64(AIOSPEC_OFF_MAGIC) != AIOSPEC_MAGIC) {
      std::snprintf(hex, sizeof hex, "0x%016llx", (unsigned long long)u64(AIOSPEC_OFF_MAGIC));
      std::string want(hex);
      std::snprintf(hex, sizeof hex, "0x%016llx", (unsigned long long)AIOSPEC_MAGIC);
      throw bad("magic " + want + ", expected " + hex + " (not an aiospec ring)");
    }
    const std::pair<const char*, std::pair<uint32_t, uint32_t>> checks[] = {
        {"version", {u32(AIOSPEC_OFF_VERSION), AIOSPEC_VERSION}},
        {"control_size", {u32(AIOSPEC_OFF_CONTROL_SIZE), AIOSPEC_CONTROL_SIZE}},
        {"frame_align", {u32(AIOSPEC_OFF_FRAME_ALIGN), AIOSPEC_FRAME_ALIGN}},
    };
    for (const auto& c : checks) {
      if (c.second.first != c.second.second) {
        throw bad(std::string(c.first) + " " + std::to_string(c.second.first) + ", expected " +
                  std::to_string(c.second.second));
      }
    }
    const uint64_t cap = u64(AIOSPEC_OFF_CAPACITY);
    if ((cap & (cap - 1)) != 0 || cap < AIOSPEC_MIN_CAPACITY || cap > AIOSPEC_MAX_CAPACITY) {
      throw bad("capacity " + std::to_string(cap) + ", expected a power of two in " +
                std::to_string(AIOSPEC_MIN_CAPACITY) + ".." + std::to_string(AIOSPEC_MAX_CAPACITY));
    }
    if (size != AIOSPEC_CONTROL_SIZE + cap) {
      throw bad(std::to_string(size) + " bytes, expected " + std::to_string(AIOSPEC_CONTROL_SIZE + cap) +
                " for capacity " + std::to_string(cap));
    }
    const uint32_t max_record = u32(AIOSPEC_OFF_MAX_RECORD);
    if (max_record % AIOSPEC_FRAME_ALIGN != 0 || max_record < 2 * AIOSPEC_FRAME_ALIGN || max_record > cap / 2) {
      throw bad("max_record " + std::to_string(max_record) + ", expected a multiple of " +
                std::to_string(AIOSPEC_FRAME_ALIGN) + " in " + std::to_string(2 * AIOSPEC_FRAME_ALIGN) + ".." +
                std::to_string(cap / 2));
    }
    const uint32_t max_readers = u32(AIOSPEC_OFF_MAX_READERS);
    if (max_readers < 1 || max_readers > AIOSPEC_MAX_READERS) {
      throw bad("max_readers " + std::to_string(max_readers) + ", expected 1.." + std::to_string(AIOSPEC_MAX_READERS));
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      if (err == EACCES || err == EPERM) throw bad(std::string("cannot map it read-write (") + strerror(err) + ")");
      throw RingError(RingErrc::os, "segment " + name + ": mmap: " + strerror(err), err);
    }
    m.base = static_cast<uint8_t*>(p);
    m.size = size;
    m.capacity = cap;
    m.mask = cap - 1;
    m.max_record = max_record;
    m.max_readers = max_readers;
    return m;
  }

  void unmap() {
    if (base != nullptr) munmap(base, size);
    if (fd >= 0) ::close(fd);
    base = nullptr;
    fd = -1;
  }

  uint64_t* ctl64(size_t off) const { return reinterpret_cast<uint64_t*>(base + off); }
  uint32_t* ctl32(size_t off) const { return reinterpret_cast<uint32_t*>(base + off); }
  uint64_t* rd64(uint32_t slot, size_t off) const {
    return ctl64(AIOSPEC_READERS_BASE + size_t(slot) * AIOSPEC_READER_STRIDE + off);
  }
  uint32_t* rd32(uint32_t slot, size_t off) const {
    return ctl32(AIOSPEC_READERS_BASE + size_t(slot) * AIOSPEC_READER_STRIDE + off);
  }
  uint8_t* data() const { return base + AIOSPEC_CONTROL_SIZE; }

  std::string name;
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t size = 0;
  uint64_t capacity = 0;
  uint64_t mask = 0;
  uint32_t max_record = 0;
  uint32_t max_readers = 0;
};

// ---- producer ---------------------------------------------------------------------------------

struct ProducerOptions {
  double reader_timeout = -1.0;  // > 0: evict a blocking reader whose heartbeat is older
  bool check_pids = true;        // evict a blocking reader whose process is gone
};

// Positions are u64, but no ring reaches 2**63 (2.9 years of writing at 100 GB/s): a head word
// at or above it is corrupt, never a position to wrap around (shm._sys.POSITION_LIMIT).
constexpr uint64_t kPositionLimit = 1ull << 63;

constexpr const char* kBeyondPositions = "at or above 2**63, which no ring reaches (2.9 years of writing at 100 GB/s)";

class RingProducer {
 public:
  // Maps the ring and becomes its producer: stores this pid, a heartbeat and state live,
  // and continues from the head the previous producer left.
  explicit RingProducer(const std::string& name, ProducerOptions opts = ProducerOptions())
      : map_(RingMap::open(name)), opts_(opts), bells_(map_.max_readers), reader_beats_(map_.max_readers) {
    struct stat st;
    seg_uid_ = fstat(map_.fd, &st) == 0 ? st.st_uid : geteuid();
    claim();
    head_ = load_acquire(map_.ctl64(AIOSPEC_OFF_HEAD));
    if (head_ >= kPositionLimit) {
      throw RingError(RingErrc::bad_segment, "ring " + map_.name + ": head word " + std::to_string(head_) + ": " +
                                                 kBeyondPositions + "; refusing to write");
    }
    min_tail_ = head_;
    frames_written_ = load_relaxed(map_.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN));
    bytes_written_ = load_relaxed(map_.ctl64(AIOSPEC_OFF_BYTES_WRITTEN));
  }

  // Takes the ring's producer claim (section 7): kept when this process holds it, taken over
  // (epoch bumped) when vacant (epoch 0: created for a writer in another process), from a
  // closed ring or from a holder known to be gone, refused (RingErrc::busy, naming the holder)
  // while another live process holds it. Returns the claim's epoch.
  uint64_t claim() {
    const uint32_t me = uint32_t(getpid());
    const uint64_t ns = own_pidns();
    if (!lock_slots(map_.fd, kSlotLockTimeoutS)) {
      throw RingError(RingErrc::closed, "ring " + map_.name + ": the slot lock (flock on the segment) was held by " +
                                            lock_holder(map_.fd) + " for " + py_float(kSlotLockTimeoutS) +
                                            " s; cannot claim the producer");
    }
    const uint32_t state = load_acquire(map_.ctl32(AIOSPEC_OFF_PRODUCER_STATE));
    const uint32_t pid = load_relaxed(map_.ctl32(AIOSPEC_OFF_PRODUCER_PID));
    const uint64_t pidns = load_relaxed(map_.ctl64(AIOSPEC_OFF_PRODUCER_PIDNS));
    uint64_t epoch = load_relaxed(map_.ctl64(AIOSPEC_OFF_PRODUCER_EPOCH));
    const bool vacant = epoch == 0;
    const bool mine = pid == me && (pidns == 0 || pidns == ns) && !vacant;
    if (!mine && !vacant && state == AIOSPEC_PRODUCER_LIVE) {
      int alive = pid_state(pid, pidns);
      if (alive < 0) {
        const uint64_t hb = load_relaxed(map_.ctl64(AIOSPEC_OFF_HEARTBEAT_NS));
        const uint64_t now = monotonic_ns();
        alive = now < hb || double(now - hb) < kClaimStaleS * 1e9;
      }
      if (alive) {
        flock(map_.fd, LOCK_UN);
        throw RingError(RingErrc::busy, "ring " + map_.name + ": producer claim held by pid " + std::to_string(pid) +
                                              " (epoch " + std::to_string(epoch) +
                                              "); one producer writes a ring at a time");
      }
    }
    if (!mine) {
      store_relaxed(map_.ctl64(AIOSPEC_OFF_PRODUCER_EPOCH), ++epoch);
      finish_commits();
    }
    store_relaxed(map_.ctl32(AIOSPEC_OFF_PRODUCER_PID), me);
    store_relaxed(map_.ctl64(AIOSPEC_OFF_PRODUCER_PIDNS), ns);
    heartbeat();
    store_release(map_.ctl32(AIOSPEC_OFF_PRODUCER_STATE), uint32_t(AIOSPEC_PRODUCER_LIVE));
    flock(map_.fd, LOCK_UN);
    return epoch;
  }
  // The previous holder may have died between a frame's commit word and its head store
  // (section 3, steps 6 and 7): the frame is committed (readers may have read it) and the head
  // is behind it, where every later write would find "a committed frame is there". Finishes
  // step 7 for such a frame (a PAD and the frame after it at most), under the slot lock.
  void finish_commits() {
    uint64_t head = load_acquire(map_.ctl64(AIOSPEC_OFF_HEAD));
    for (int i = 0; i < 2; ++i) {
      const uint64_t off = head & map_.mask;
      const uint64_t commit = header_word(head, AIOSPEC_FH_COMMIT);
      if (commit == 0 || header_word(head, AIOSPEC_FH_POSITION) != head) return;
      const uint64_t length = commit & 0xFFFFFFFFull, type = commit >> 32;
      const uint64_t size = (length + AIOSPEC_FRAME_ALIGN - 1) & ~uint64_t(AIOSPEC_FRAME_ALIGN - 1);
      if (type == AIOSPEC_FRAME_PAD) {
        if (length != map_.capacity - off) return;
        head += length;
      } else {
        if (type != AIOSPEC_FRAME_DATA || length < AIOSPEC_FRAME_HEADER || size > map_.max_record ||
            size > map_.capacity - off) {
          return;  // not a frame a writer commits: left for reserve() to refuse
        }
        head += size;
        store_relaxed(map_.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN), load_relaxed(map_.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN)) + 1);
        store_relaxed(map_.ctl64(AIOSPEC_OFF_BYTES_WRITTEN),
                      load_relaxed(map_.ctl64(AIOSPEC_OFF_BYTES_WRITTEN)) + length - AIOSPEC_FRAME_HEADER);
      }
      store_release(map_.ctl64(AIOSPEC_OFF_HEAD), head);
    }
  }

  RingProducer(const RingProducer&) = delete;
  RingProducer& operator=(const RingProducer&) = delete;
  ~RingProducer() { close(true); }

  const RingMap& map() const { return map_; }
  const std::string& name() const { return map_.name; }
  uint64_t capacity() const { return map_.capacity; }
  uint32_t max_record() const { return map_.max_record; }
  uint64_t max_payload() const { return map_.max_record - AIOSPEC_FRAME_HEADER; }
  uint64_t head() const { return head_; }
  uint64_t frames_written() const { return frames_written_; }
  bool closed() const { return closed_; }

  // Reserves room for an n-byte payload (section 3, steps 1-4) and returns where to write
  // it. Waits up to `timeout` seconds (< 0: forever) for the slowest active reader, evicting
  // dead ones, then throws RingErrc::ring_full naming the lagging readers.
  uint8_t* reserve(uint64_t n, double timeout) {
    require_open("reserve");
    if (reserved_) throw RingError(RingErrc::invalid, "reserve: a reservation is pending; commit() it first");
    const uint64_t size = frame_size(n);
    if (size > map_.max_record) {
      throw RingError(RingErrc::invalid, "reserve: n = " + std::to_string(n) + ": a frame of " + std::to_string(size) +
                                             " bytes exceeds max_record = " + std::to_string(map_.max_record));
    }
    check_capacity();
    adopt_head();
    const uint64_t off = head_ & map_.mask;
    const uint64_t pad = size > map_.capacity - off ? map_.capacity - off : 0;
    const uint64_t need = pad + size + AIOSPEC_FRAME_HEADER;  // + the next header, zeroed at commit
    if (head_ + need - min_tail_ > map_.capacity) wait_for_room(need, size, timeout);
    if (pad != 0) publish(head_, pad - AIOSPEC_FRAME_HEADER, AIOSPEC_FRAME_PAD);
    reserved_ = true;
    reserved_n_ = n;
    return map_.data() + (head_ & map_.mask) + AIOSPEC_FRAME_HEADER;
  }

  // Another writer of this ring (a Python Ring.write between two emits) may have committed
  // frames since our last commit: continue after them instead of overwriting them.
  // Only a head those frames explain is adopted (section 3): never one behind ours (that would
  // overwrite unread frames) nor one past the committed frames (readers would stall on it and
  // lose what lies between); an impossible head throws RingErrc::bad_segment (shm's
  // CorruptControl family). Frames of another process mean another claim: claim() refuses.
  //
  // At our own head the 16 header bytes must be zero too (every writer zeroes the header after
  // its frame): a frame committed there means another writer wrote past it and the head word
  // was set back, and writing would overwrite that frame.
  void adopt_head() {
    const uint64_t head = load_acquire(map_.ctl64(AIOSPEC_OFF_HEAD));
    if (head == head_) {
      if (header_at(head)) {
        throw RingError(RingErrc::bad_segment, "ring " + map_.name + ": head word " + std::to_string(head) +
                                                   ": the frame header at the head is not zero (a committed frame "
                                                   "is there); refusing to write");
      }
      return;
    }
    const std::string why = impossible_head(head);
    if (!why.empty()) {
      throw RingError(RingErrc::bad_segment,
                      "ring " + map_.name + ": head word " + std::to_string(head) + ": " + why + "; refusing to write");
    }
    claim();
    head_ = head;
    frames_written_ = load_relaxed(map_.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN));
    bytes_written_ = load_relaxed(map_.ctl64(AIOSPEC_OFF_BYTES_WRITTEN));
  }

  // Whether the 16 header bytes at `pos` are not zero.
  bool header_at(uint64_t pos) const {
    return header_word(pos, AIOSPEC_FH_POSITION) != 0 || header_word(pos, AIOSPEC_FH_COMMIT) != 0;
  }

  // A word of the frame header at position `pos` (AIOSPEC_FH_POSITION or AIOSPEC_FH_COMMIT).
  uint64_t header_word(uint64_t pos, size_t off) const {
    return load_acquire(reinterpret_cast<const uint64_t*>(map_.data() + (pos & map_.mask) + off));
  }

  // Line 0 never changes (section 2): a capacity word other than the one validated at open is
  // corrupt, refused before anything is written (RingErrc::bad_segment; shm's CorruptControl).
  void check_capacity() const {
    const uint64_t cap = load_relaxed(map_.ctl64(AIOSPEC_OFF_CAPACITY));
    if (cap != map_.capacity) {
      throw RingError(RingErrc::bad_segment, "ring " + map_.name + ": capacity word " + std::to_string(cap) +
                                                 ": expected " + std::to_string(map_.capacity) +
                                                 " (the data area of the mapping); refusing to write");
    }
  }

  // Why `head` cannot follow this producer's head, or "" (same rule as shm/_producer.py).
  std::string impossible_head(uint64_t head) const {
    if (head >= kPositionLimit) return kBeyondPositions;
    if (head < head_) return "behind this producer's head " + std::to_string(head_) + " (moved backwards)";
    if (head % AIOSPEC_FRAME_ALIGN != 0) return "not a multiple of " + std::to_string(AIOSPEC_FRAME_ALIGN);
    if (header_at(head)) return "the frame header at the head is not cleared (past the committed frames)";
    if (head - head_ > map_.capacity) return "";  // more than a lap since: our frames are gone
    uint64_t pos = head_;
    while (pos < head) {
      const uint64_t off = pos & map_.mask;
      const uint64_t commit = header_word(pos, AIOSPEC_FH_COMMIT);
      const uint64_t length = commit & 0xFFFFFFFFull;
      const uint64_t size = (length + AIOSPEC_FRAME_ALIGN - 1) & ~uint64_t(AIOSPEC_FRAME_ALIGN - 1);
      if (commit == 0 || length < AIOSPEC_FRAME_HEADER || size > map_.capacity - off ||
          header_word(pos, AIOSPEC_FH_POSITION) != pos) {
        return "no committed frame at position " + std::to_string(pos) + " below it (past the committed frames)";
      }
      pos += size;
    }
    if (pos != head) return "the committed frames end at " + std::to_string(pos);
    return "";
  }

  // Drops a reservation without publishing it (the space is simply reused).
  void abandon() { reserved_ = false; }

  // Publishes the reserved frame with its first n payload bytes (steps 5-8); returns its
  // position. Zero-fills the alignment padding so that equal steps give equal bytes.
  uint64_t commit(uint64_t n) {
    require_open("commit");
    if (!reserved_) throw RingError(RingErrc::invalid, "commit: nothing reserved");
    if (n > reserved_n_) {
      throw RingError(RingErrc::invalid,
                      "commit: n = " + std::to_string(n) + ": expected 0.." + std::to_string(reserved_n_));
    }
    reserved_ = false;
    const uint64_t pos = head_;
    uint8_t* frame = map_.data() + (pos & map_.mask);
    std::memset(frame + AIOSPEC_FRAME_HEADER + n, 0, frame_size(n) - AIOSPEC_FRAME_HEADER - n);
    publish(pos, n, AIOSPEC_FRAME_DATA);
    ++frames_written_;
    bytes_written_ += n;
    store_relaxed(map_.ctl64(AIOSPEC_OFF_FRAMES_WRITTEN), frames_written_);
    store_relaxed(map_.ctl64(AIOSPEC_OFF_BYTES_WRITTEN), bytes_written_);
    heartbeat();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  // store(commit) -> load(sleeping), pairs with the reader
    ring_bells(true);
    return pos;
  }

  // Rings the bell of every sleeping reader; returns how many were rung (section 5).
  int notify() {
    require_open("notify");
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return ring_bells(true);
  }

  void heartbeat() { store_relaxed(map_.ctl64(AIOSPEC_OFF_HEARTBEAT_NS), monotonic_ns()); }

  // Counts frames this producer could not write; readers turn a rise into stream errors.
  void add_frames_lost(uint64_t n) {
    uint64_t* p = map_.ctl64(AIOSPEC_OFF_FRAMES_LOST);
    store_release(p, load_relaxed(p) + n);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    ring_bells(true);
  }

  // Smallest tail over active readers (head when none): the oldest byte still in use.
  uint64_t scan_min_tail() const {
    uint64_t m = head_;
    for (uint32_t s = 0; s < map_.max_readers; ++s) {
      if (load_acquire(map_.rd32(s, AIOSPEC_RD_STATE)) != AIOSPEC_READER_ACTIVE) continue;
      const uint64_t t = load_acquire(map_.rd64(s, AIOSPEC_RD_TAIL));
      if (t < m) m = t;
    }
    return m;
  }

  // Evicts active readers whose tail is below needed_tail and whose process is gone (or
  // whose heartbeat is older than reader_timeout); section 6. Returns how many. The slot lock
  // is tried once: while another process holds it nobody is evicted, and the wait for room
  // tries again on its next round (a lock holder never stretches the producer's timeout).
  int evict_blocking(uint64_t needed_tail) {
    int evicted = 0;
    const uint64_t now = monotonic_ns();
    for (uint32_t s = 0; s < map_.max_readers; ++s) {
      if (load_acquire(map_.rd32(s, AIOSPEC_RD_STATE)) != AIOSPEC_READER_ACTIVE) continue;
      if (load_acquire(map_.rd64(s, AIOSPEC_RD_TAIL)) >= needed_tail) continue;
      const uint32_t pid = load_relaxed(map_.rd32(s, AIOSPEC_RD_PID));
      // a reader in another pid namespace (state -1) is judged by its heartbeat only
      const bool dead = opts_.check_pids && pid_state(pid, load_relaxed(map_.rd64(s, AIOSPEC_RD_PIDNS))) == 0;
      const uint64_t hb = load_relaxed(map_.rd64(s, AIOSPEC_RD_HEARTBEAT_NS));
      const uint64_t age = reader_beats_[s].age_ns(hb, now);
      const bool silent = opts_.reader_timeout > 0 && double(age) > opts_.reader_timeout * 1e9;
      if (!dead && !silent) continue;
      const uint32_t gen = load_acquire(map_.rd32(s, AIOSPEC_RD_GENERATION));
      if (!lock_slots(map_.fd, 0)) return evicted;
      if (load_acquire(map_.rd32(s, AIOSPEC_RD_STATE)) == AIOSPEC_READER_ACTIVE &&
          load_acquire(map_.rd32(s, AIOSPEC_RD_GENERATION)) == gen) {
        store_release(map_.rd32(s, AIOSPEC_RD_STATE), uint32_t(AIOSPEC_READER_EVICTED));
        ++evicted;
      }
      flock(map_.fd, LOCK_UN);
    }
    return evicted;
  }

  // Marks the producer closed (readers drain, then see "producer gone") when mark_closed,
  // wakes every reader, and unmaps. Idempotent.
  void close(bool mark_closed) {
    if (closed_) return;
    if (mark_closed) {
      store_release(map_.ctl32(AIOSPEC_OFF_PRODUCER_STATE), uint32_t(AIOSPEC_PRODUCER_CLOSED));
      heartbeat();
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      ring_bells(false);
    }
    for (uint32_t s = 0; s < bells_.size(); ++s) drop_bell(s);
    closed_ = true;
    map_.unmap();
  }

  static uint64_t frame_size(uint64_t n) {
    return (AIOSPEC_FRAME_HEADER + n + AIOSPEC_FRAME_ALIGN - 1) & ~uint64_t(AIOSPEC_FRAME_ALIGN - 1);
  }

 private:
  void require_open(const char* what) const {
    if (closed_) throw RingError(RingErrc::closed, std::string(what) + ": the producer of ring " + map_.name + " is closed");
  }

  // Section 3 steps 5-7 for a frame whose payload is already in place.
  void publish(uint64_t pos, uint64_t n, uint32_t type) {
    const uint64_t size = frame_size(n);
    uint8_t* data = map_.data();
    uint64_t* hdr = reinterpret_cast<uint64_t*>(data + (pos & map_.mask));
    uint64_t* next = reinterpret_cast<uint64_t*>(data + ((pos + size) & map_.mask));
    store_relaxed(&hdr[0], pos);
    store_relaxed(&next[0], uint64_t(0));
    store_relaxed(&next[1], uint64_t(0));
    store_release(&hdr[1], (AIOSPEC_FRAME_HEADER + n) | (uint64_t(type) << 32));
    head_ = pos + size;
    store_release(map_.ctl64(AIOSPEC_OFF_HEAD), head_);
  }

  void wait_for_room(uint64_t need, uint64_t size, double timeout) {
    const uint64_t start = monotonic_ns();
    uint64_t delay_ns = 0;
    for (;;) {
      heartbeat();  // waiting for room is a sign of life: readers must not take it for death
      min_tail_ = scan_min_tail();
      if (head_ + need - min_tail_ <= map_.capacity) return;
      evict_blocking(head_ + need - map_.capacity);
      min_tail_ = scan_min_tail();
      if (head_ + need - min_tail_ <= map_.capacity) return;
      const uint64_t now = monotonic_ns();
      if (timeout >= 0 && double(now - start) >= timeout * 1e9) {
        throw RingError(RingErrc::ring_full, "ring " + map_.name + ": no room for a " + std::to_string(size) +
                                                 "-byte frame after " + py_float(timeout) +
                                                 " s; lagging reader(s): " +
                                                 describe_laggards(head_ + need - map_.capacity));
      }
      // back off from yielding to sub-millisecond sleeps: a reader is due any moment
      if (delay_ns == 0) {
        sched_yield();
        delay_ns = 20000;
      } else {
        uint64_t d = delay_ns;
        if (timeout >= 0) {
          const double left = timeout * 1e9 - double(now - start);
          if (left < double(d)) d = left > 0 ? uint64_t(left) : 0;
        }
        timespec ts{time_t(d / 1000000000ull), long(d % 1000000000ull)};
        nanosleep(&ts, nullptr);
        delay_ns = delay_ns * 2 > 1000000 ? 1000000 : delay_ns * 2;
      }
    }
  }

  std::string describe_laggards(uint64_t needed_tail) const {
    std::string out;
    for (uint32_t s = 0; s < map_.max_readers; ++s) {
      if (load_acquire(map_.rd32(s, AIOSPEC_RD_STATE)) != AIOSPEC_READER_ACTIVE) continue;
      const uint64_t tail = load_acquire(map_.rd64(s, AIOSPEC_RD_TAIL));
      if (tail >= needed_tail) continue;
      if (!out.empty()) out += ", ";
      out += "slot " + std::to_string(s) + " (pid " + std::to_string(load_relaxed(map_.rd32(s, AIOSPEC_RD_PID))) +
             ", lag " + std::to_string(head_ - tail) + " bytes)";
    }
    return out.empty() ? "none (they caught up)" : out;
  }

  int ring_bells(bool sleepers_only) {
    int rung = 0;
    for (uint32_t s = 0; s < map_.max_readers; ++s) {
      if (load_acquire(map_.rd32(s, AIOSPEC_RD_STATE)) != AIOSPEC_READER_ACTIVE) continue;
      if (sleepers_only && load_acquire(map_.rd32(s, AIOSPEC_RD_SLEEPING)) == 0) continue;
      const int fd = bell_fd(s);
      if (fd < 0) continue;
      const int r = ring_one(fd);
      if (r == 0 || r == EAGAIN) {
        ++rung;  // EAGAIN: the FIFO is full of earlier rings, the reader is due to wake anyway
      } else {
        drop_bell(s);
      }
    }
    return rung;
  }

  // Writes one byte with SIGPIPE blocked: a reader that closed its bell must cost an EPIPE,
  // never the producer process (whose SIGPIPE disposition we do not own).
  static int ring_one(int fd) {
    sigset_t pipe_set, old_set, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
    sigpending(&pending);
    const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
    const char one = 1;
    const ssize_t w = write(fd, &one, 1);
    const int err = w == 1 ? 0 : errno;
    if (err == EPIPE && !was_pending) {
      timespec zero{0, 0};
      sigtimedwait(&pipe_set, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
    return err == EWOULDBLOCK ? EAGAIN : err;
  }

  int bell_fd(uint32_t slot) {
    const uint32_t gen = load_acquire(map_.rd32(slot, AIOSPEC_RD_GENERATION));
    Bell& b = bells_[slot];
    if (b.fd >= 0) {
      if (b.gen == gen) return b.fd;
      drop_bell(slot);
    }
    // Never through a symlink, only a FIFO of this uid or the segment's owner that others cannot
    // open (section 5): anything else was planted, and ringing nothing is the safe answer.
    const int fd = ::open(bell_path(map_.name, slot).c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return -1;  // no reader holds its bell open (it is leaving): nothing to wake
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode) || (st.st_uid != geteuid() && st.st_uid != seg_uid_) ||
        (st.st_mode & 077) != 0) {
      ::close(fd);
      return -1;
    }
    b.fd = fd;
    b.gen = gen;
    return fd;
  }

  void drop_bell(uint32_t slot) {
    Bell& b = bells_[slot];
    if (b.fd >= 0) ::close(b.fd);
    b.fd = -1;
  }

  struct Bell {
    int fd = -1;
    uint32_t gen = 0;
  };

  RingMap map_;
  uid_t seg_uid_ = 0;  // the segment file's owner, who may own the bells too
  ProducerOptions opts_;
  std::vector<Bell> bells_;
  std::vector<BeatAge> reader_beats_;  // per reader slot: its heartbeat's age as this producer sees it
  uint64_t head_ = 0;
  uint64_t min_tail_ = 0;  // a lower bound of every active reader's tail
  uint64_t frames_written_ = 0;
  uint64_t bytes_written_ = 0;
  uint64_t reserved_n_ = 0;
  bool reserved_ = false;
  bool closed_ = false;
};

}  // namespace aiospec

#endif  // AIOSPEC_RING_H_
