// Self-checking driver of the CUDA emit path, small enough to run under compute-sanitizer.
//
// It creates a ring segment itself (the same control page shm.Ring.create writes), plays a
// reader in slot 0, and checks against the CPU writer (csrc/cpu/emit_cpu.cc, itself tested
// byte for byte against the Python reference encoder):
//   frames   random batches (0..989 rows, 1..6 tokens, k 0/5/20, int32/int64, drafts,
//            flags, draft and prompt kinds, tokens sampled from their top-k or not: the
//            sampled_pos encoding with its exceptions) across many wrap-arounds: payload
//            bytes identical, padding zero, next header zeroed, counters right;
//   errors   random corruptions of valid inputs: the device reports exactly the error the
//            CPU writer reports first (code, argument, row, column, value, bounds), commits
//            nothing, counts a lost frame;
//   pad_error an invalid id found after a PAD was committed: the PAD stands, the header at the
//            new head is zero;
//   full     a reader that does not read: a bounded wait, then "ring full" and a lost frame;
//            once the reader catches up, frames flow again;
//   graph    one emit captured in a CUDA graph (the step read from device memory) replayed;
//   order    a reader on the host following the frontier as the kernels commit (section 3 of
//            docs/wire-format.md): a head past a commit word that still reads 0 is a
//            "wiped" frame to every reader, so the head must never become visible first.
// Build: nvcc -arch=sm_90 -std=c++17 -Icsrc/include csrc/cuda/tools/emit_check.cu
//        csrc/cuda/emit_cuda.cu csrc/cpu/emit_cpu.cc -o emit_check
// Exit status 0 when every check passed; prints one line per scenario.
// Timing modes (no checks against the CPU writer): `time [RPB...]`, `roofline [RPB]` (frames of
// about 2 KB to 1 MB, for scripts/bench_roofline.py), `shapes RPB R T K...`, `cold`, `coldone`,
// `one` (see main).
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "aiospec/emit.h"
#include "aiospec/emit_cpu.h"
#include "aiospec/emit_cuda.h"
#include "aiospec/layout.h"

#ifdef AIOSPEC_PHASES
extern "C" int aiospec_cuda_phases(unsigned long long* out);
extern "C" int aiospec_cuda_block_clocks(unsigned long long* out);
#endif

namespace {

int g_failures = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                   \
      std::fprintf(stderr, "\n");                          \
      ++g_failures;                                        \
    }                                                      \
  } while (0)

#define CUDA_OK(expr)                                                                       \
  do {                                                                                      \
    cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

// A ring segment with the control page shm.Ring.create writes, and reader slot 0 ours.
struct Segment {
  std::string name;
  uint8_t* base = nullptr;
  uint64_t size = 0, capacity = 0;
  uint64_t tail = 0;

  Segment(uint64_t cap, uint32_t max_record, const char* tag) {
    name = std::string("aiospec-check-") + tag + "-" + std::to_string(getpid());
    capacity = cap;
    size = AIOSPEC_CONTROL_SIZE + cap;
    const std::string path = "/dev/shm/" + name;
    unlink(path.c_str());
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, off_t(size)) != 0) {
      std::perror("segment");
      std::exit(2);
    }
    base = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    u32(AIOSPEC_OFF_VERSION) = AIOSPEC_VERSION;
    u32(AIOSPEC_OFF_CONTROL_SIZE) = AIOSPEC_CONTROL_SIZE;
    u64(AIOSPEC_OFF_CAPACITY) = cap;
    u32(AIOSPEC_OFF_MAX_RECORD) = max_record;
    u32(AIOSPEC_OFF_MAX_READERS) = 4;
    u32(AIOSPEC_OFF_FRAME_ALIGN) = AIOSPEC_FRAME_ALIGN;
    u32(AIOSPEC_OFF_CREATOR_PID) = uint32_t(getpid());
    u64(AIOSPEC_OFF_MAGIC) = AIOSPEC_MAGIC;
    // reader slot 0: this process, at position 0
    slot32(AIOSPEC_RD_PID) = uint32_t(getpid());
    slot64(AIOSPEC_RD_TAIL) = 0;
    slot32(AIOSPEC_RD_GENERATION) = 1;
    slot32(AIOSPEC_RD_STATE) = AIOSPEC_READER_ACTIVE;
  }
  ~Segment() {
    munmap(base, size);
    unlink(("/dev/shm/" + name).c_str());
  }
  uint64_t& u64(size_t off) { return *reinterpret_cast<uint64_t*>(base + off); }
  uint32_t& u32(size_t off) { return *reinterpret_cast<uint32_t*>(base + off); }
  uint64_t& slot64(size_t off) { return u64(AIOSPEC_READERS_BASE + off); }
  uint32_t& slot32(size_t off) { return u32(AIOSPEC_READERS_BASE + off); }
  uint8_t* at(uint64_t pos) { return base + AIOSPEC_CONTROL_SIZE + (pos & (capacity - 1)); }
  uint64_t u64_at(uint64_t pos) { return __atomic_load_n(reinterpret_cast<uint64_t*>(at(pos)), __ATOMIC_ACQUIRE); }
  uint64_t commit_at(uint64_t pos) { return __atomic_load_n(reinterpret_cast<uint64_t*>(at(pos) + 8), __ATOMIC_ACQUIRE); }

  // Reads the next DATA frame at our tail (skipping PAD), advances the tail. Empty if none.
  // `last`: no later frame was written yet, so the next header must read "not committed".
  std::vector<uint8_t> read_frame(bool last = false) {
    for (;;) {
      const uint64_t c = commit_at(tail);
      if (c == 0) return {};
      const uint64_t len = c & 0xFFFFFFFFull, type = c >> 32;
      const uint64_t sz = (len + 63) & ~uint64_t(63);
      CHECK(*reinterpret_cast<uint64_t*>(at(tail)) == tail, "position word at %" PRIu64, tail);
      if (type == AIOSPEC_FRAME_PAD) {
        CHECK(((tail + sz) & (capacity - 1)) == 0, "PAD at %" PRIu64 " does not end the data area", tail);
        tail += sz;
        continue;
      }
      CHECK(type == AIOSPEC_FRAME_DATA, "frame type %" PRIu64, type);
      std::vector<uint8_t> out(at(tail) + 16, at(tail) + len);
      for (uint64_t b = len; b < sz; ++b) CHECK(at(tail)[b] == 0, "alignment byte %" PRIu64 " not zero", b);
      tail += sz;
      if (last) CHECK(commit_at(tail) == 0, "next header at %" PRIu64 " not zeroed", tail);
      slot64(AIOSPEC_RD_TAIL) = tail;
      return out;
    }
  }
};

// One step's inputs, host copies and device copies.
struct Inputs {
  int64_t rows = 0, W = 1, Wd = 0, N = 0, width = 1;
  int k = -1;
  bool i64 = true, lp = true, drafts = false, flags = true, processed = false;
  uint32_t kind = 0;
  std::vector<int64_t> handles;
  std::vector<int64_t> tok64, dr64, lpid64, rank64, pos64;
  std::vector<int32_t> tok32, dr32, lpid32, rank32, pos32;
  std::vector<int32_t> nt, nd, fl, lpo;
  std::vector<float> lpv;
  std::vector<void*> dev;

  ~Inputs() { free_dev(); }
  void free_dev() {
    for (void* p : dev) cudaFree(p);
    dev.clear();
  }
  template <class T>
  const T* up(const std::vector<T>& v) {
    if (v.empty()) return nullptr;
    void* p = nullptr;
    CUDA_OK(cudaMalloc(&p, v.size() * sizeof(T)));  // exact sizes: memcheck sees any overrun
    CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    dev.push_back(p);
    return static_cast<const T*>(p);
  }
  aiospec_emit_args host_args(uint64_t step) const { return make(step, nullptr); }
  aiospec_emit_args device_args(uint64_t step) {
    free_dev();
    return make(step, this);
  }

 private:
  aiospec_emit_args make(uint64_t step, Inputs* d) const {
    auto pick = [&](const auto& v) -> const void* {
      if (v.empty()) return nullptr;
      return d != nullptr ? static_cast<const void*>(d->up(v)) : static_cast<const void*>(v.data());
    };
    aiospec_emit_args a;
    std::memset(&a, 0, sizeof a);
    a.rows = rows;
    a.handles = static_cast<const int64_t*>(pick(handles));
    a.token_ids = i64 ? pick(tok64) : pick(tok32);
    a.token_ids_i64 = i64;
    a.max_tokens = W;
    a.num_tokens = static_cast<const int32_t*>(pick(nt));
    a.flags = flags ? static_cast<const int32_t*>(pick(fl)) : nullptr;
    if (drafts) {
      a.draft_ids = i64 ? pick(dr64) : pick(dr32);
      a.draft_ids_i64 = i64;
      a.max_draft = Wd;
      a.num_draft = static_cast<const int32_t*>(pick(nd));
    }
    if (lp) {
      a.lp_ids = i64 ? pick(lpid64) : pick(lpid32);
      a.lp_ids_i64 = i64;
      a.lp_values = static_cast<const float*>(pick(lpv));
      a.lp_ranks = i64 ? pick(rank64) : pick(rank32);
      a.lp_ranks_i64 = i64;
      a.lp_offsets = static_cast<const int32_t*>(pick(lpo));
      a.lp_rows = N;
      a.lp_width = width;
      a.k = k;
    }
    a.kind = kind;
    if (kind == AIOSPEC_KIND_PROMPT) {
      a.positions = i64 ? pick(pos64) : pick(pos32);
      a.positions_i64 = i64;
    }
    a.logprobs_processed = processed;
    a.producer = 7;
    a.step = step;
    return a;
  }
};

// Some rows are never empty-valued: zero-sized inputs still get one element so that the
// device pointers are not NULL (a NULL means "absent" to the op).
Inputs random_inputs(std::mt19937_64& rng, int64_t rows, int64_t W, int k_max, bool i64) {
  Inputs in;
  std::uniform_int_distribution<int> coin(0, 1);
  in.rows = rows;
  in.W = W;
  in.i64 = i64;
  in.lp = k_max >= 0;
  in.width = in.lp ? k_max + 1 : 1;
  in.k = in.lp ? int(std::uniform_int_distribution<int>(0, k_max)(rng)) : -1;
  if (in.lp && coin(rng)) in.k = -1;  // default: width - 1
  in.drafts = coin(rng);
  in.flags = coin(rng);
  const int kind_draw = std::uniform_int_distribution<int>(0, 7)(rng);
  in.kind = kind_draw == 0 ? AIOSPEC_KIND_DRAFT : kind_draw == 1 ? AIOSPEC_KIND_PROMPT : AIOSPEC_KIND_TARGET;
  in.processed = coin(rng);
  in.Wd = in.drafts ? 2 : 0;
  std::uniform_int_distribution<int32_t> tok(0, 150000);
  in.handles.resize(size_t(std::max<int64_t>(rows, 1)));
  in.nt.resize(in.handles.size());
  in.nd.resize(in.handles.size());
  in.fl.resize(in.handles.size());
  in.pos64.resize(in.handles.size());
  for (int64_t i = 0; i < rows; ++i) {
    in.handles[i] = int64_t(rng() >> 2);
    in.pos64[i] = int64_t(rng() >> 44);
    in.nt[i] = int32_t(std::uniform_int_distribution<int64_t>(0, W)(rng));
    in.nd[i] = in.drafts ? int32_t(std::uniform_int_distribution<int64_t>(0, in.Wd)(rng)) : 0;
    const int r = std::uniform_int_distribution<int>(0, 9)(rng);
    in.fl[i] = r == 0 ? AIOSPEC_FLAG_FINISHED : r == 1 ? AIOSPEC_FLAG_PREEMPTED : r == 2 ? AIOSPEC_FLAG_FIRST_TOKEN : 0;
  }
  const size_t ntok = size_t(std::max<int64_t>(rows * W, 1)), ndr = size_t(std::max<int64_t>(rows * in.Wd, 1));
  in.tok64.resize(ntok);
  in.dr64.resize(ndr);
  for (auto& v : in.tok64) v = tok(rng);
  for (auto& v : in.dr64) v = tok(rng);
  // logprob rows: each row owns num_tokens[i] + a random slack of 0..2 rows
  in.lpo.assign(size_t(rows + 1), 0);
  for (int64_t i = 0; i < rows; ++i)
    in.lpo[i + 1] = in.lpo[i] + in.nt[i] + int32_t(std::uniform_int_distribution<int>(0, 2)(rng));
  in.N = in.lpo[rows];
  const size_t nlp = size_t(std::max<int64_t>(in.N, 1));
  in.lpid64.resize(nlp * size_t(in.width));
  in.lpv.resize(nlp * size_t(in.width));
  in.rank64.resize(nlp);
  std::normal_distribution<float> val(-3.f, 2.f);
  for (auto& v : in.lpid64) v = tok(rng);
  for (auto& v : in.lpv) v = val(rng);
  for (auto& v : in.rank64) v = int64_t(std::uniform_int_distribution<int>(1, 40)(rng));
  // most tokens as a sampler gives them: in their top-k with the same logprob and the rank
  // the top-k implies (sampled_pos); the others exceptions (absent, or a rank that disagrees)
  const int k_eff = in.k < 0 ? int(in.width - 1) : in.k;
  for (int64_t i = 0; in.lp && k_eff > 0 && i < rows; ++i) {
    for (int64_t j = 0; j < in.nt[i]; ++j) {
      const int r = std::uniform_int_distribution<int>(0, 9)(rng);
      if (r == 9) continue;
      const size_t lr = size_t(in.lpo[i] + j), w = size_t(in.width);
      const size_t c = size_t(std::uniform_int_distribution<int>(1, k_eff)(rng));
      const int64_t t = in.tok64[size_t(i * W + j)];
      in.lpid64[lr * w] = in.lpid64[lr * w + c] = t;
      in.lpv[lr * w] = in.lpv[lr * w + c];
      int64_t count = 0;
      for (int q = 1; q <= k_eff; ++q) count += in.lpv[lr * w + size_t(q)] >= in.lpv[lr * w];
      in.rank64[lr] = count + (r == 8 ? 1 : 0);
    }
  }
  if (!in.lp) in.N = 0;
  if (!i64) {
    in.tok32.assign(in.tok64.begin(), in.tok64.end());
    in.dr32.assign(in.dr64.begin(), in.dr64.end());
    in.lpid32.assign(in.lpid64.begin(), in.lpid64.end());
    in.rank32.assign(in.rank64.begin(), in.rank64.end());
    in.pos32.assign(in.pos64.begin(), in.pos64.end());
  }
  return in;
}

// Corrupts one thing of a valid batch (rows > 0) the op must reject.
void corrupt(std::mt19937_64& rng, Inputs& in) {
  const int64_t i = std::uniform_int_distribution<int64_t>(0, in.rows - 1)(rng);
  switch (std::uniform_int_distribution<int>(0, 10)(rng)) {
    case 0: in.nt[i] = int32_t(in.W + 1); break;
    case 1: in.nt[i] = -1; break;
    case 2: if (in.drafts) in.nd[i] = int32_t(in.Wd + 3); else in.nt[i] = int32_t(in.W + 7); break;
    case 3: if (in.flags) in.fl[i] = 128 | AIOSPEC_FLAG_FINISHED; else in.nt[i] = -5; break;
    case 10:  // a negative or (int64) too large prompt position on a row with a record
      if (in.kind == AIOSPEC_KIND_PROMPT && in.nt[i] > 0) {
        const int64_t bad = in.i64 && (rng() & 1) ? int64_t(1) << 31 : -7;
        in.pos64[size_t(i)] = bad;
        if (!in.i64) in.pos32[size_t(i)] = int32_t(bad);
      } else {
        in.nt[i] = int32_t(in.W + 5);
      }
      break;
    case 4: in.handles[i] = -3; in.nt[i] = int32_t(in.W); break;
    case 5: if (in.lp) in.lpo[i + 1] = int32_t(in.N + 2); else in.nt[i] = -2; break;
    case 6: if (in.lp) { in.lpo[i] = in.lpo[i + 1] + 1; } else in.nt[i] = -2; break;
    case 7: if (in.lp) { in.nt[i] = int32_t(in.W); in.lpo[i + 1] = in.lpo[i]; } else in.nt[i] = -9; break;
    case 8:
      if (in.i64 && in.nt[i] > 0 && in.nt[i] <= in.W) in.tok64[size_t(i * in.W + in.nt[i] - 1)] = int64_t(1) << 40;
      else in.nt[i] = int32_t(in.W + 2);
      break;
    default:
      if (in.i64 && in.lp && in.nt[i] > 0 && in.lpo[i] >= 0 && in.lpo[i] < in.N) {
        const int64_t r = in.lpo[i];
        if (std::uniform_int_distribution<int>(0, 1)(rng)) in.rank64[size_t(r)] = -(int64_t(1) << 35);
        else in.lpid64[size_t(r * in.width + in.width - 1)] = int64_t(1) << 33;
      } else {
        in.nt[i] = int32_t(in.W + 4);
      }
  }
}

aiospec_cuda_producer* make_producer(const Segment& seg, double timeout) {
  aiospec_cuda_options o;
  aiospec_cuda_default_options(&o);
  o.max_rows = 2048;
  o.timeout_s = timeout;
  o.liveness_s = 0;  // no thread: this driver is the only actor
  aiospec_cuda_producer* p = nullptr;
  char err[512];
  if (aiospec_cuda_producer_create(seg.name.c_str(), &o, &p, err, sizeof err) != 0) {
    std::fprintf(stderr, "producer_create: %s\n", err);
    std::exit(2);
  }
  return p;
}

uint64_t lost(Segment& s) { return __atomic_load_n(&s.u64(AIOSPEC_OFF_FRAMES_LOST), __ATOMIC_ACQUIRE); }

void scenario_frames(std::mt19937_64& rng, int iters) {
  Segment seg(8u << 20, 2u << 20, "frames");
  aiospec_cuda_producer* p = make_producer(seg, 5.0);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  // 1500 rows: many blocks of the exceptions pre-pass and of the kernel
  const int64_t sizes[] = {0, 1, 19, 99, 989, 1500};
  const int ks[] = {-1, 0, 5, 20};
  uint64_t frames = 0, pads = 0, bytes = 0;
  for (int it = 0; it < iters; ++it) {
    const int64_t rows = it < 24 ? sizes[it % 6] : std::uniform_int_distribution<int64_t>(0, 300)(rng);
    const int64_t W = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const int kmax = ks[std::uniform_int_distribution<int>(0, 3)(rng)];
    Inputs in = random_inputs(rng, rows, W, kmax, std::uniform_int_distribution<int>(0, 1)(rng));
    const uint64_t step = 1000 + uint64_t(it);
    aiospec_emit_args ha = in.host_args(step);
    aiospec_frame_layout lay;
    aiospec_error err;
    if (aiospec::emit_validate(ha, seg.u32(AIOSPEC_OFF_MAX_RECORD), &lay, &err) != AIOSPEC_E_OK) {
      CHECK(false, "generated inputs invalid: %s", aiospec::format_error(err).c_str());
      continue;
    }
    std::vector<uint8_t> want(lay.payload_len);
    aiospec::emit_write_payload(ha, lay, want.data());
    const uint64_t head0 = seg.u64(AIOSPEC_OFF_HEAD);
    aiospec_emit_args da = in.device_args(step);
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    aiospec_error e;
    CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "unexpected device error %d", e.code);
    const uint64_t before = seg.tail;
    std::vector<uint8_t> got = seg.read_frame(true);
    if (seg.tail - before > lay.frame_size) ++pads;
    CHECK(got.size() == want.size(), "frame %d: %zu bytes, expected %zu", it, got.size(), want.size());
    if (got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size()) != 0) {
      size_t b = 0;
      while (got[b] == want[b]) ++b;
      CHECK(false, "frame %d (rows %" PRId64 ", W %" PRId64 ", k %d): first differing byte %zu", it, rows, W, in.k, b);
    }
    CHECK(seg.u64(AIOSPEC_OFF_HEAD) == seg.tail, "head %" PRIu64 " != reader tail %" PRIu64,
          seg.u64(AIOSPEC_OFF_HEAD), seg.tail);
    CHECK(seg.u64(AIOSPEC_OFF_HEAD) > head0, "head did not move");
    ++frames;
    bytes += lay.payload_len;
  }
  CHECK(seg.u64(AIOSPEC_OFF_FRAMES_WRITTEN) == frames, "frames_written %" PRIu64 " != %" PRIu64,
        seg.u64(AIOSPEC_OFF_FRAMES_WRITTEN), frames);
  CHECK(seg.u64(AIOSPEC_OFF_BYTES_WRITTEN) == bytes, "bytes_written mismatch");
  CHECK(lost(seg) == 0, "frames lost");
  std::printf("frames: %" PRIu64 " frames byte-identical to the CPU writer, %" PRIu64 " wraps, %.1f laps\n", frames,
              pads, double(seg.tail) / double(seg.capacity));
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

void scenario_errors(std::mt19937_64& rng, int iters) {
  Segment seg(8u << 20, 2u << 20, "errors");
  aiospec_cuda_producer* p = make_producer(seg, 5.0);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  {
    // one valid frame first: a frame's position word at a head past 0 is not 0, so a position
    // word left behind by an invalid frame shows below
    Inputs in = random_inputs(rng, 8, 2, 5, 1);
    aiospec_emit_args da = in.device_args(0);
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CHECK(!seg.read_frame().empty(), "no frame for the valid first emit");
  }
  int matched = 0;
  for (int it = 0; it < iters; ++it) {
    const int64_t rows = std::uniform_int_distribution<int64_t>(1, 200)(rng);
    Inputs in = random_inputs(rng, rows, std::uniform_int_distribution<int64_t>(1, 6)(rng), it % 2 ? 5 : 20,
                              std::uniform_int_distribution<int>(0, 3)(rng) != 0);
    const int n = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int c = 0; c < n; ++c) corrupt(rng, in);
    aiospec_emit_args ha = in.host_args(uint64_t(it));
    aiospec_frame_layout lay;
    aiospec_error want;
    const int code = aiospec::emit_validate(ha, seg.u32(AIOSPEC_OFF_MAX_RECORD), &lay, &want);
    const uint64_t head0 = seg.u64(AIOSPEC_OFF_HEAD), lost0 = lost(seg);
    aiospec_emit_args da = in.device_args(uint64_t(it));
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    aiospec_error got;
    uint64_t step = 0;
    const int reported = aiospec_cuda_check(p, &got, &step);
    if (code == AIOSPEC_E_OK) {  // the corruption happened to be harmless (e.g. slack rows)
      CHECK(reported == 0, "device error %d on valid input", got.code);
      seg.read_frame();
      continue;
    }
    CHECK(reported == 1, "iteration %d: no device error, expected %s", it, aiospec::format_error(want).c_str());
    if (reported != 1) continue;
    const bool same = got.code == want.code && got.arg == want.arg && got.row == want.row && got.col == want.col &&
                      got.value == want.value && got.lo == want.lo && got.hi == want.hi;
    CHECK(same, "iteration %d: device says '%s', CPU says '%s'", it, aiospec::format_error(got).c_str(),
          aiospec::format_error(want).c_str());
    CHECK(step == uint64_t(it), "error step %" PRIu64 ", expected %d", step, it);
    CHECK(seg.u64(AIOSPEC_OFF_HEAD) == head0, "head moved on an invalid frame");
    CHECK(seg.commit_at(head0) == 0, "a frame was committed for invalid input");
    // every writer leaves the 16 header bytes at the head zero (docs/wire-format.md, section 3;
    // another writer of the ring refuses to write past a header that is not)
    CHECK(seg.u64_at(head0) == 0, "iteration %d: the position word at the head %" PRIu64 " is %" PRIu64
          " after an invalid frame", it, head0, seg.u64_at(head0));
    CHECK(lost(seg) == lost0 + 1, "frames_lost did not rise");
    matched += same;
  }
  // frame too large for the ring
  {
    Segment small(1u << 16, 8192, "small");
    aiospec_cuda_producer* q = make_producer(small, 5.0);
    Inputs in = random_inputs(rng, 300, 6, 20, true);
    for (auto& v : in.nt) v = 6;
    in.lpo.assign(size_t(in.rows + 1), 0);
    for (int64_t i = 0; i < in.rows; ++i) in.lpo[i + 1] = in.lpo[i] + 6;
    in.N = in.lpo[in.rows];
    in.lpid64.resize(size_t(in.N * in.width));
    in.lpv.resize(size_t(in.N * in.width));
    in.rank64.resize(size_t(in.N), 1);
    aiospec_emit_args ha = in.host_args(5);
    aiospec_frame_layout lay;
    aiospec_error want, got;
    CHECK(aiospec::emit_validate(ha, 8192, &lay, &want) == AIOSPEC_E_FRAME_SIZE, "expected a frame-size error");
    aiospec_emit_args da = in.device_args(5);
    CUDA_OK(aiospec_cuda_emit(q, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CHECK(aiospec_cuda_check(q, &got, nullptr) == 1 && got.code == AIOSPEC_E_FRAME_SIZE && got.value == want.value &&
              got.hi == want.hi,
          "frame-size error: got code %d value %" PRId64, got.code, got.value);
    aiospec_cuda_producer_destroy(q);
  }
  // host-side errors: scalar arguments and rows beyond max_rows launch nothing
  {
    Inputs in = random_inputs(rng, 4, 2, 5, true);
    aiospec_emit_args da = in.device_args(1);
    da.k = 9;
    CHECK(aiospec_cuda_emit(p, &da, s) == cudaErrorInvalidValue, "k = 9 accepted");
    aiospec_error e;
    aiospec_cuda_last_error(p, &e);
    CHECK(e.code == AIOSPEC_E_K, "host error code %d, expected E_K", e.code);
    da.k = 2;
    da.rows = 5000;
    CHECK(aiospec_cuda_emit(p, &da, s) == cudaErrorInvalidValue, "rows beyond max_rows accepted");
    aiospec_cuda_last_error(p, &e);
    CHECK(e.code == AIOSPEC_E_MAX_ROWS, "host error code %d, expected E_MAX_ROWS", e.code);
  }
  std::printf("errors: %d corrupted batches reported exactly as the CPU writer reports them\n", matched);
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

// An invalid token id (found while the kernel copies the ids, after block 0 committed a PAD
// frame and stored the frame's position word at the next lap's start): the PAD stands, the
// frame is not committed, and the 16 header bytes at the new head are zero again. One
// block (a small frame) and an exchange of several blocks (top-20).
void scenario_pad_error(std::mt19937_64& rng) {
  const int64_t shapes[][3] = {{8, 1, 5}, {64, 6, 20}};
  int checked = 0;
  for (const auto& sh : shapes) {
    Segment seg(1u << 20, 256u << 10, "paderr");
    aiospec_cuda_producer* p = make_producer(seg, 5.0);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    Inputs bad;
    int64_t row = -1;
    while (row < 0) {  // i64 inputs with a token to corrupt
      bad = random_inputs(rng, sh[0], sh[1], int(sh[2]), true);
      bad.k = -1;  // every top-k column: the second shape takes the exchange of several blocks
      for (int64_t i = 0; i < bad.rows && row < 0; ++i) {
        if (bad.nt[size_t(i)] > 0) row = i;
      }
    }
    aiospec_frame_layout lay;
    aiospec_error want;
    CHECK(aiospec::emit_validate(bad.host_args(0), 256u << 10, &lay, &want) == AIOSPEC_E_OK, "pad_error inputs");
    bad.tok64[size_t(row * bad.W)] = int64_t(1) << 40;  // its first token
    aiospec_frame_layout unused;
    CHECK(aiospec::emit_validate(bad.host_args(0), 256u << 10, &unused, &want) == AIOSPEC_E_ID,
          "pad_error: no id error");
    // valid frames until the rest of the data area is too short for the invalid one (the
    // corrupt token is an exception more, so its frame is no smaller than `lay`): each the
    // largest of four fillers that fits without a PAD, so that a few dozen emits fill the
    // ring (the sanitizers run this too); the smallest is no larger than the invalid frame
    const int64_t tiers[][3] = {{64, 6, 20}, {16, 4, 5}, {4, 2, 5}, {1, 1, -1}};
    Inputs fill[4];
    uint64_t fill_size[4] = {UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX};
    for (int t = 0; t < 4; ++t) {
      for (int tries = 0; tries < 1000; ++tries) {
        fill[t] = random_inputs(rng, tiers[t][0], tiers[t][1], int(tiers[t][2]), false);
        aiospec_frame_layout fl;
        aiospec_error fe;
        if (aiospec::emit_validate(fill[t].host_args(0), 256u << 10, &fl, &fe) != AIOSPEC_E_OK) continue;
        fill_size[t] = fl.frame_size;
        if (t < 3 || fill_size[t] <= lay.frame_size) break;
      }
    }
    CHECK(fill_size[3] <= lay.frame_size, "pad_error: no filler smaller than the invalid frame");
    for (int it = 0; it < 10000; ++it) {
      const uint64_t rest = seg.capacity - (seg.u64(AIOSPEC_OFF_HEAD) & (seg.capacity - 1));
      if (rest < lay.frame_size) break;
      int t = 0;
      while (t < 4 && fill_size[t] > rest) ++t;
      if (t == 4) break;
      aiospec_emit_args da = fill[t].device_args(uint64_t(it));
      CUDA_OK(aiospec_cuda_emit(p, &da, s));
      CUDA_OK(cudaStreamSynchronize(s));
      CHECK(!seg.read_frame().empty(), "pad_error: no frame for a valid emit");
    }
    const uint64_t head0 = seg.u64(AIOSPEC_OFF_HEAD), lost0 = lost(seg);
    const uint64_t lap = (head0 | (seg.capacity - 1)) + 1;  // the next lap's start
    aiospec_emit_args da = bad.device_args(1);
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    aiospec_error got;
    CHECK(aiospec_cuda_check(p, &got, nullptr) == 1 && got.code == AIOSPEC_E_ID, "pad_error: device error %d, expected E_ID",
          got.code);
    CHECK(seg.u64(AIOSPEC_OFF_HEAD) == lap, "pad_error: head %" PRIu64 ", expected %" PRIu64 " past the PAD",
          seg.u64(AIOSPEC_OFF_HEAD), lap);
    CHECK(seg.commit_at(lap) == 0 && seg.u64_at(lap) == 0, "pad_error (%" PRId64 " rows): the header at the head %" PRIu64
          " is %" PRIu64 " / %" PRIu64 ", expected zero", sh[0], lap, seg.u64_at(lap), seg.commit_at(lap));
    CHECK(lost(seg) == lost0 + 1, "pad_error: frames_lost did not rise");
    checked += seg.u64(AIOSPEC_OFF_HEAD) == lap;
    aiospec_cuda_producer_destroy(p);
    CUDA_OK(cudaStreamDestroy(s));
  }
  std::printf("pad_error: %d invalid frame(s) after a PAD, the header at the head zero\n", checked);
}

void scenario_full(std::mt19937_64& rng) {
  Segment seg(1u << 16, 8192, "full");
  aiospec_cuda_producer* p = make_producer(seg, 0.02);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  Inputs in = random_inputs(rng, 40, 2, 5, false);
  for (auto& v : in.nt) v = 2;
  for (int64_t i = 0; i <= in.rows; ++i) in.lpo[size_t(i)] = int32_t(2 * i);
  in.N = 2 * in.rows;
  // the logprob columns follow the new offsets: N rows (exact sizes, for memcheck)
  in.lpid64.resize(size_t(in.N * in.width), 1);
  in.lpv.resize(size_t(in.N * in.width), -1.f);
  in.rank64.resize(size_t(in.N), 1);
  in.lpid32.assign(in.lpid64.begin(), in.lpid64.end());
  in.rank32.assign(in.rank64.begin(), in.rank64.end());
  aiospec_emit_args da = in.device_args(0);
  int ok = 0;
  aiospec_error e;
  int reported = 0;
  for (int i = 0; i < 64 && !reported; ++i) {  // the reader never reads: the ring fills up
    da.step = uint64_t(i);
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamSynchronize(s));
    reported = aiospec_cuda_check(p, &e, nullptr);
    ok += !reported;
  }
  CHECK(reported && e.code == AIOSPEC_E_RING_FULL, "no ring-full error after %d frames", ok);
  CHECK(lost(seg) == 1, "frames_lost %" PRIu64 ", expected 1", lost(seg));
  // the error word as emit_cuda.h documents it: value = frame bytes, lo = the tail needed, hi = head
  CHECK(uint64_t(e.hi) == seg.u64(AIOSPEC_OFF_HEAD), "ring-full hi %lld, expected the head %" PRIu64,
        (long long)e.hi, seg.u64(AIOSPEC_OFF_HEAD));
  CHECK(e.lo > 0 && uint64_t(e.hi - e.lo) + uint64_t(e.value) + AIOSPEC_FRAME_HEADER <= seg.capacity,
        "ring-full lo %lld: not head + frame + next header - capacity (value %lld)", (long long)e.lo,
        (long long)e.value);
  char msg[512];
  aiospec_cuda_format_error(p, &e, msg, sizeof msg);
  CHECK(std::strstr(msg, "slot 0 (pid ") != nullptr, "ring-full message does not name the reader: %s", msg);
  int read = 0;
  while (!seg.read_frame().empty()) ++read;
  CHECK(read == ok, "reader saw %d frames, %d were written", read, ok);
  CUDA_OK(aiospec_cuda_emit(p, &da, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "error after the reader caught up");
  CHECK(!seg.read_frame().empty(), "no frame after the reader caught up");
  std::printf("full: %d frames, then \"%s\"; frames flow again once the reader reads\n", ok, msg);
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

__global__ void bump(uint64_t* step) { *step += 1; }

void scenario_graph(std::mt19937_64& rng) {
  Segment seg(4u << 20, 1u << 20, "graph");
  aiospec_cuda_producer* p = make_producer(seg, 5.0);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  Inputs in = random_inputs(rng, 64, 4, 20, true);
  aiospec_emit_args da = in.device_args(0);
  uint64_t* step = nullptr;
  CUDA_OK(cudaMalloc(&step, 8));
  CUDA_OK(cudaMemset(step, 0, 8));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  bump<<<1, 1, 0, s>>>(step);
  CUDA_OK(aiospec_cuda_emit_ex(p, &da, step, s));
  CUDA_OK(cudaStreamEndCapture(s, &g));
  CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
  const int replays = 50;
  for (int i = 0; i < replays; ++i) CUDA_OK(cudaGraphLaunch(ge, s));
  CUDA_OK(cudaStreamSynchronize(s));
  int seen = 0;
  for (;;) {
    std::vector<uint8_t> f = seg.read_frame();
    if (f.empty()) break;
    ++seen;
    // element 2 of the msgpack array (after dc 00 1c, ce+u32, ce+u32) is cf + be64 step
    uint64_t st = 0;
    for (int b = 0; b < 8; ++b) st = st << 8 | f[14 + b];
    CHECK(f[13] == 0xcf && st == uint64_t(seen), "replay %d carries step %" PRIu64, seen, st);
  }
  CHECK(seen == replays, "read %d frames after %d replays", seen, replays);
  std::printf("graph: %d replays of a captured emit, %d frames with steps 1..%d\n", replays, seen, replays);
  CUDA_OK(cudaGraphExecDestroy(ge));
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaFree(step));
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

__global__ void spin(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void empty_kernel() {}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : double(v[v.size() / 2]);
}

// A timing batch: every row `tokens` tokens, no drafts, no flags; k < 0: no logprobs.
// `spread`: the sampled token sits at column 1 + (its index % k) of its top-k with the rank
// that implies, as top-k sampling hands them over (no exceptions, but a search per token);
// `spread` 2: every token an exception (its rank above k, as bench_emit.py's random inputs);
// otherwise it is the top-1 alternative.
Inputs timing_inputs(std::mt19937_64& rng, int64_t rows, int64_t tokens, int64_t k, int spread = 0) {
  Inputs in = random_inputs(rng, rows, tokens, k < 0 ? -1 : int(k), true);
  for (auto& v : in.nt) v = int32_t(tokens);
  for (auto& v : in.fl) v = 0;
  in.drafts = false;
  if (in.lp) {
    in.k = int(k);
    for (int64_t i = 0; i <= in.rows; ++i) in.lpo[size_t(i)] = int32_t(i * tokens);
    in.N = in.rows * tokens;
    in.lpid64.resize(size_t(in.N * in.width));
    in.lpv.resize(size_t(in.N * in.width));
    in.rank64.assign(size_t(in.N), 1);
    // as a sampler hands them over: the sampled token is the top-1 alternative (rank 1), so
    // a frame with a top-k carries its position, no exceptions
    for (int64_t i = 0; i < in.rows; ++i) {
      for (int64_t j = 0; j < tokens; ++j) {
        const size_t r = size_t(i * tokens + j) * size_t(in.width);
        const int64_t tok = in.tok64[size_t(i * in.W + j)];
        for (int64_t c = 0; c < in.width; ++c) {
          in.lpid64[r + size_t(c)] = c <= 1 ? tok : 1000 + c;
          in.lpv[r + size_t(c)] = c <= 1 ? -0.1f : -0.1f - float(c);
        }
        if (spread == 2) in.rank64[size_t(i * tokens + j)] = k + 7;
        if (spread == 1 && k > 1) {
          const int64_t c = 1 + (i * tokens + j) % k;
          in.lpid64[r + 1] = 1001;
          in.lpv[r + 1] = -0.1f;
          in.lpid64[r + size_t(c)] = tok;
          in.lpv[r + size_t(c)] = -0.1f - float(c == 1 ? 0 : c);
          in.lpv[r] = in.lpv[r + size_t(c)];
          in.rank64[size_t(i * tokens + j)] = c;
        }
      }
    }
  }
  in.kind = AIOSPEC_KIND_TARGET;
  in.processed = false;
  return in;
}

// A producer for the timing modes (no liveness thread); the driver exits if it cannot be made.
aiospec_cuda_producer* timing_producer(const Segment& seg, int64_t max_rows, int rpb) {
  aiospec_cuda_options o;
  aiospec_cuda_default_options(&o);
  o.max_rows = max_rows;
  if (rpb > 0) o.rows_per_block = rpb;
  o.liveness_s = 0;
  aiospec_cuda_producer* p = nullptr;
  char err[512];
  if (aiospec_cuda_producer_create(seg.name.c_str(), &o, &p, err, sizeof err) != 0) {
    std::fprintf(stderr, "producer_create: %s\n", err);
    std::exit(2);
  }
  return p;
}

#ifdef AIOSPEC_PHASES
// The kernel's phase clocks (AIOSPEC_PHASES builds): each emit's cycles from the kernel's entry
// to every phase boundary, printed as the median per phase.
struct PhaseClocks {
  // 0-8 the phases, 10-13 inside the exchange's end (9 is the entry)
  std::vector<std::vector<double>> ph = std::vector<std::vector<double>>(14);
  // A clock the emit did not store reads 0 (aiospec_cuda_phases zeroes them), and p7, p8 (the
  // committing thread's) count on another SM's clock when its block ran elsewhere than block 0
  // (slots 14 and 15, the two SMs): neither is a phase of this emit; one with no sample prints "-".
  void add() {  // after an emit has finished
    unsigned long long c[16];
    CUDA_OK(cudaError_t(aiospec_cuda_phases(c)));
    for (int q = 0; q <= 13; ++q) {
      const bool other_sm = (q == 7 || q == 8) && c[14] != c[15];
      if (q != 9 && c[q] != 0 && c[q] >= c[9] && !other_sm) ph[size_t(q)].push_back(double(c[q] - c[9]));
    }
  }
  void print() {
    for (int q = 0; q <= 13; ++q) {
      std::vector<double>& v = ph[size_t(q)];
      if (q == 9) continue;
      if (v.empty()) {
        std::printf(" p%d=-", q);
        continue;
      }
      std::sort(v.begin(), v.end());
      std::printf(" p%d=%.0f", q, v[v.size() / 2]);
    }
  }
};
#endif

void one_config(int64_t rows, int64_t tokens, int64_t k, int n) {
  std::mt19937_64 rng(7);
  Segment seg(64u << 20, 8u << 20, "one");
  seg.slot32(AIOSPEC_RD_STATE) = AIOSPEC_READER_FREE;
  aiospec_cuda_producer* p = timing_producer(seg, 4096, 0);
  Inputs in = timing_inputs(rng, rows, tokens, k);
  aiospec_emit_args da = in.device_args(0);
#ifdef AIOSPEC_PHASES
  // each emit alone (the GPU otherwise idle), the clock of every phase boundary against the
  // kernel's entry; the median over the emits
  PhaseClocks ph;
  for (int i = 0; i < n; ++i) {
    CUDA_OK(aiospec_cuda_emit(p, &da, 0));
    CUDA_OK(cudaDeviceSynchronize());
    ph.add();
  }
  std::printf("phases rows=%lld tokens=%lld k=%lld cycles_from_entry", (long long)rows, (long long)tokens, (long long)k);
  ph.print();
  std::printf("\n");
#else
  for (int i = 0; i < n; ++i) CUDA_OK(aiospec_cuda_emit(p, &da, 0));
#endif
  CUDA_OK(cudaDeviceSynchronize());
  aiospec_error e;
  CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "device error: %d", e.code);
  std::printf("one rows=%lld tokens=%lld k=%lld emits=%d\n", (long long)rows, (long long)tokens, (long long)k, n);
  aiospec_cuda_producer_destroy(p);
}

// The batches of `time` (k < 0: no logprobs) and of `roofline`: frames from about 2 KB to
// 1 MB, every token with its top-20 (about 160 bytes a token), as the roofline's sizes.
using Batch = std::array<int64_t, 3>;
const std::vector<Batch> kTimeBatches = {{64, 1, -1}, {64, 6, 0},   {256, 1, 0},   {256, 6, 0},
                                         {256, 6, 5}, {256, 6, 20}, {1024, 1, -1}, {1024, 6, 20}};
const std::vector<Batch> kRooflineBatches = {{64, 1, -1}, {12, 1, 20},  {48, 1, 20},  {200, 1, 20}, {400, 1, 20},
                                             {800, 1, 20}, {256, 6, 20}, {512, 6, 20}, {1024, 6, 20}};

// GPU time per emit with CUDA events (the stream held by a spinning kernel while the launches
// queue, so host launch time stays out), and per replay of a graph of one captured emit.
// No reader: nothing waits for space. Each line starts with `tag`.
void time_emits(std::mt19937_64& rng, int rpb, const std::vector<Batch>& configs = kTimeBatches,
                const char* tag = "time") {
  Segment seg(64u << 20, 8u << 20, "time");
  seg.slot32(AIOSPEC_RD_STATE) = AIOSPEC_READER_FREE;
  aiospec_cuda_producer* p = timing_producer(seg, 1024, rpb);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  cudaEvent_t ev[50];
  for (auto& e : ev) CUDA_OK(cudaEventCreate(&e));
  {  // the floor: two empty kernels back to back
    std::vector<float> t;
    for (int round = 0; round < 8; ++round) {
      spin<<<1, 1, 0, s>>>(2000000);
      for (int i = 0; i < 25; ++i) {
        CUDA_OK(cudaEventRecord(ev[2 * i], s));
        empty_kernel<<<1, 32, 0, s>>>();
        empty_kernel<<<1, 32, 0, s>>>();
        CUDA_OK(cudaEventRecord(ev[2 * i + 1], s));
      }
      CUDA_OK(cudaStreamSynchronize(s));
      for (int i = 0; i < 25; ++i) {
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        t.push_back(ms * 1000.f);
      }
    }
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < 2000; ++i) empty_kernel<<<1, 32, 0, s>>>();
    CUDA_OK(cudaEventRecord(ev[1], s));
    CUDA_OK(cudaStreamSynchronize(s));
    float ms;
    CUDA_OK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    std::printf("%s two-empty-kernels gpu_us=%.2f empty_b2b_us=%.2f\n", tag, median(t), ms * 1000.0 / 2000);
  }
  for (const auto& c : configs) {
    Inputs in = timing_inputs(rng, c[0], c[1], c[2]);
    aiospec_emit_args da = in.device_args(0);
    aiospec_frame_layout lay;
    aiospec_error e;
    aiospec_emit_args ha = in.host_args(0);
    CHECK(aiospec::emit_validate(ha, 8u << 20, &lay, &e) == AIOSPEC_E_OK, "timing inputs invalid");
    for (int i = 0; i < 20; ++i) CUDA_OK(aiospec_cuda_emit(p, &da, s));
    std::vector<float> t;
    for (int round = 0; round < 8; ++round) {
      spin<<<1, 1, 0, s>>>(2000000);
      for (int i = 0; i < 25; ++i) {
        CUDA_OK(cudaEventRecord(ev[2 * i], s));
        CUDA_OK(aiospec_cuda_emit(p, &da, s));
        CUDA_OK(cudaEventRecord(ev[2 * i + 1], s));
      }
      CUDA_OK(cudaStreamSynchronize(s));
      for (int i = 0; i < 25; ++i) {
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        t.push_back(ms * 1000.f);
      }
    }
    // back to back: what an emit adds to a busy stream (its launch hidden behind the work before)
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < 200; ++i) CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaEventRecord(ev[1], s));
    CUDA_OK(cudaStreamSynchronize(s));
    float b2b_ms;
    CUDA_OK(cudaEventElapsedTime(&b2b_ms, ev[0], ev[1]));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CUDA_OK(aiospec_cuda_emit(p, &da, s));
    CUDA_OK(cudaStreamEndCapture(s, &g));
    CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 10; ++i) CUDA_OK(cudaGraphLaunch(ge, s));
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < 200; ++i) CUDA_OK(cudaGraphLaunch(ge, s));
    CUDA_OK(cudaEventRecord(ev[1], s));
    CUDA_OK(cudaStreamSynchronize(s));
    float ms;
    CUDA_OK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    CUDA_OK(cudaGraphExecDestroy(ge));
    CUDA_OK(cudaGraphDestroy(g));
    CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "device error while timing: %d", e.code);
    std::printf("%s rows=%lld tokens=%lld k=%lld rpb=%d frame_bytes=%llu gpu_us=%.2f b2b_us=%.2f graph_us=%.2f\n", tag,
                (long long)c[0], (long long)c[1], (long long)c[2], rpb, (unsigned long long)lay.frame_size, median(t),
                b2b_ms * 1000.0 / 200, ms * 1000.0 / 200);
  }
  for (auto& e : ev) CUDA_OK(cudaEventDestroy(e));
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

__global__ void flush_l2(uint4* p, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(unsigned(i), 1u, 2u, 3u);
}

// GPU time of one emit that finds the caches as a model's forward pass leaves them: before
// each emit a kernel overwrites 256 MiB (five times the H200's L2), which also evicts the
// emit's instructions and inputs. Events around the emit alone; "warm" is the same emit
// right after another one. Under AIOSPEC_PHASES the kernel's phase clocks, cold. ``rpb`` rows
// per block (0: the producer's default).
void cold_emits(int n, int rpb, const int64_t (*only)[4] = nullptr) {
  std::mt19937_64 rng(11);
  Segment seg(64u << 20, 8u << 20, "cold");
  seg.slot32(AIOSPEC_RD_STATE) = AIOSPEC_READER_FREE;
  aiospec_cuda_producer* p = timing_producer(seg, 1024, rpb);
  const size_t flush_n = (size_t(256) << 20) / sizeof(uint4);
  uint4* junk = nullptr;
  CUDA_OK(cudaMalloc(&junk, flush_n * sizeof(uint4)));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  const int64_t configs[][4] = {{64, 1, -1, 0},   {64, 1, 20, 1},  {256, 1, 20, 0}, {256, 1, 20, 1},
                                {1024, 1, 20, 1}, {256, 6, 20, 1}, {1024, 6, 20, 1}, {1024, 1, -1, 0}};
  for (size_t q = 0; q < (only != nullptr ? 1 : sizeof configs / sizeof configs[0]); ++q) {
    const int64_t* c = only != nullptr ? *only : configs[q];
    Inputs in = timing_inputs(rng, c[0], c[1], c[2], int(c[3]));
    aiospec_emit_args da = in.device_args(0);
    aiospec_frame_layout lay;
    aiospec_error e;
    aiospec_emit_args ha = in.host_args(0);
    CHECK(aiospec::emit_validate(ha, 8u << 20, &lay, &e) == AIOSPEC_E_OK, "cold inputs invalid");
    std::vector<float> cold, warm;
#ifdef AIOSPEC_PHASES
    PhaseClocks ph;
#endif
    for (int i = 0; i < n; ++i) {
      for (int pass = 0; pass < 2; ++pass) {
        if (pass == 0) flush_l2<<<1024, 256, 0, s>>>(junk, flush_n);
        CUDA_OK(cudaEventRecord(e0, s));
        CUDA_OK(aiospec_cuda_emit(p, &da, s));
        CUDA_OK(cudaEventRecord(e1, s));
        CUDA_OK(cudaStreamSynchronize(s));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        (pass == 0 ? cold : warm).push_back(ms * 1000.f);
#ifdef AIOSPEC_PHASES
        if (pass == 0) ph.add();
        if (pass == 0 && only != nullptr && i == n - 1) {
          // every block of the last cold emit: its SM, its start against the first block's, its
          // cycles to the end of its row checks, of its count and of the exchange's wait
          static unsigned long long bc[264][7];
          CUDA_OK(cudaError_t(aiospec_cuda_block_clocks(&bc[0][0])));
          const int nb = int(std::min<unsigned long long>(bc[0][6], 264));
          unsigned long long t0 = ~0ull;
          for (int b = 0; b < nb; ++b) t0 = std::min(t0, bc[b][0]);
          for (int b = 0; b < nb; ++b)
            std::printf("block %d/%d sm=%llu entry_ns=%llu checks_cyc=%llu count_cyc=%llu barrier_out_cyc=%llu out_ns=%llu\n",
                        b, nb, bc[b][5], bc[b][0] - t0, bc[b][1], bc[b][2], bc[b][3], bc[b][4] - t0);
        }
#endif
      }
    }
    CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "device error while timing: %d", e.code);
    std::printf("cold rows=%lld tokens=%lld k=%lld spread=%lld rpb=%d frame_bytes=%llu cold_us=%.2f warm_us=%.2f",
                (long long)c[0], (long long)c[1], (long long)c[2], (long long)c[3], rpb,
                (unsigned long long)lay.frame_size, median(cold), median(warm));
#ifdef AIOSPEC_PHASES
    std::printf(" cold_cycles_from_entry");
    ph.print();
#endif
    std::printf("\n");
  }
  CUDA_OK(cudaFree(junk));
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

// Frames emitted back to back while this thread reads at the frontier, as a reader in another
// process does: at a commit word of 0 it loads the head (acquire) and the commit word again; 0
// with the head past it is what docs/wire-format.md calls a wiped frame. Each path of the
// kernel: one block, several blocks without and with the exchange. Not Segment::read_frame:
// its payload copy (up to 268 KB a frame) would leave the reader behind the frontier.
void scenario_order(std::mt19937_64& rng, int rounds) {
  Segment seg(64u << 20, 8u << 20, "order");
  aiospec_cuda_producer* p = timing_producer(seg, 1024, 0);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  const int64_t configs[][3] = {{64, 1, -1}, {1024, 6, -1}, {1024, 6, 0}, {1024, 1, 20}, {256, 6, 20}};
  uint64_t frames = 0, early = 0;
  for (const auto& c : configs) {
    Inputs in = timing_inputs(rng, c[0], c[1], c[2]);
    aiospec_emit_args da = in.device_args(0);
    for (int round = 0; round < rounds; ++round) {
      const int n = 200;
      for (int i = 0; i < n; ++i) CUDA_OK(aiospec_cuda_emit(p, &da, s));
      uint64_t last_bad = ~uint64_t(0);
      // 20 s without a frame (not for the whole round: under racecheck 200 emits of the
      // larger batches take longer than that)
      const auto patience = std::chrono::seconds(20);
      auto deadline = std::chrono::steady_clock::now() + patience;
      for (int got = 0; got < n;) {
        uint64_t cw = seg.commit_at(seg.tail);
        if (cw == 0) {
          const uint64_t h = __atomic_load_n(&seg.u64(AIOSPEC_OFF_HEAD), __ATOMIC_ACQUIRE);
          cw = seg.commit_at(seg.tail);
          if (cw == 0) {
            if (h > seg.tail && seg.tail != last_bad) {
              ++early;
              last_bad = seg.tail;
            }
            if (std::chrono::steady_clock::now() > deadline) {
              CHECK(false, "order: frame at %" PRIu64 " never committed (head %" PRIu64 ")", seg.tail, h);
              break;
            }
            continue;
          }
        }
        const uint64_t sz = ((cw & 0xFFFFFFFFull) + 63) & ~uint64_t(63);
        if ((cw >> 32) == AIOSPEC_FRAME_DATA) ++got, ++frames;
        seg.tail += sz;
        __atomic_store_n(&seg.slot64(AIOSPEC_RD_TAIL), seg.tail, __ATOMIC_RELEASE);
        deadline = std::chrono::steady_clock::now() + patience;
      }
      CUDA_OK(cudaStreamSynchronize(s));
    }
  }
  aiospec_error e;
  CHECK(aiospec_cuda_check(p, &e, nullptr) == 0, "order: device error %d", e.code);
  CHECK(early == 0, "order: the head was visible before the commit word at %" PRIu64 " of %" PRIu64 " frames",
        early, frames);
  std::printf("order: %" PRIu64 " frames read at the frontier, head before commit %" PRIu64 " times\n", frames, early);
  aiospec_cuda_producer_destroy(p);
  CUDA_OK(cudaStreamDestroy(s));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "cold") == 0) {
    // cold [N [RPB...]]: N emits per batch, once per rows-per-block value (default: the producer's)
    const int n = argc > 2 ? std::atoi(argv[2]) : 41;
    if (argc <= 3) cold_emits(n, 0);
    for (int i = 3; i < argc; ++i) cold_emits(n, std::atoi(argv[i]));
    return 0;
  }
  if (argc >= 7 && std::strcmp(argv[1], "coldone") == 0) {
    // coldone R T K SPREAD N [RPB]: cold and warm GPU time of one batch (SPREAD 2: every token
    // an exception), N emits
    const int64_t c[1][4] = {{std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5])}};
    cold_emits(std::atoi(argv[6]), argc > 7 ? std::atoi(argv[7]) : 0, c);
    return g_failures ? 1 : 0;
  }
  if (argc == 6 && std::strcmp(argv[1], "one") == 0) {
    // one R T K N: N emits of one timing batch, nothing timed (for Nsight Compute)
    one_config(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoi(argv[5]));
    return g_failures ? 1 : 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "roofline") == 0) {
    // roofline [RPB]: the GPU time of frames from about 2 KB to 1 MB (scripts/bench_roofline.py
    // sets each against the bare probe at the same size and the link)
    std::mt19937_64 rng(7);
    time_emits(rng, argc > 2 ? std::atoi(argv[2]) : 0, kRooflineBatches, "roofline");
    std::fflush(stdout);
    return g_failures ? 1 : 0;
  }
  if (argc >= 6 && std::strcmp(argv[1], "shapes") == 0) {
    // shapes RPB R T K [R T K ...]: `time`'s measurement of the given batches (K < 0: no
    // logprobs; RPB 0: the producer's default)
    std::vector<Batch> b;
    for (int i = 3; i + 2 < argc; i += 3) b.push_back({std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoll(argv[i + 2])});
    std::mt19937_64 rng(7);
    time_emits(rng, std::atoi(argv[2]), b, "shapes");
    std::fflush(stdout);
    return g_failures ? 1 : 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "time") == 0) {
    std::mt19937_64 rng(7);
    for (int i = 2; i < argc; ++i) time_emits(rng, std::atoi(argv[i]));
    if (argc == 2) time_emits(rng, 8);
    std::fflush(stdout);
    return g_failures ? 1 : 0;
  }
  int iters = argc > 1 ? std::atoi(argv[1]) : 120;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20261129ull);
  char err[256];
  if (!aiospec_cuda_device_ok(0, err, sizeof err)) {
    std::fprintf(stderr, "no usable device: %s\n", err);
    return 2;
  }
  scenario_frames(rng, iters);
  scenario_errors(rng, iters);
  scenario_pad_error(rng);
  scenario_full(rng);
  scenario_graph(rng);
  scenario_order(rng, iters >= 100 ? 12 : 1);  // fewer under the sanitizers
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
