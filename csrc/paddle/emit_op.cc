// Paddle custom ops of the emit op: a thin binding, no logic of its own.
//
//   aiospec_emit(handles, token_ids, num_tokens, flags?, draft_ids?, num_draft?, lp_ids?,
//                lp_values?, lp_ranks?, lp_offsets?; ring, meta, step, kind, producer, k, timeout)
//     one decoding step -> one frame into ring /dev/shm/<ring>. CPU tensors go through the
//     CPU writer (csrc/cpu/emit_cpu.cc); CUDA tensors (built with PADDLE_WITH_CUDA) through
//     the framework-free CUDA launcher of emit_cuda.h on the tensors' stream.
//   aiospec_ring_control(x; ring, action)   action "notify": ring sleeping readers' bells;
//     "close": mark the producer closed and drop it from the cache.
//
// Producers live in a process-wide cache keyed by ring name (and device), reopened when the
// name now points to a different segment (a restarted owner). Both ops pass their first input
// through in place (FastDeploy's save_output convention), so nothing is allocated per call.
// Errors are thrown with a "[aiospec:<kind>] " prefix that aiospec/ops/_paddle.py turns back
// into EmitError / RingFull / BadSegment / RingError.
#include <sys/stat.h>

#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "aiospec/emit_cpu.h"
#include "aiospec/ring.h"
#include "paddle/extension.h"

#ifdef PADDLE_WITH_CUDA
#include "aiospec/emit_cuda.h"
#endif

namespace {

[[noreturn]] void fail(const char* kind, const std::string& message) {
  PD_THROW("[aiospec:" + std::string(kind) + "] " + message);
}

// An input error: the tag carries the error's fields (code, arg, row, col, value, lo, hi), so
// the EmitError raised in Python has them as the C++ writer's and the reference's have.
[[noreturn]] void fail_emit(const aiospec_error& e) {
  std::ostringstream tag;
  tag << "[aiospec:emit:" << e.code << ',' << e.arg << ',' << e.row << ',' << e.col << ',' << e.value << ','
      << e.lo << ',' << e.hi << "] " << aiospec::format_error(e);
  PD_THROW(tag.str());
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

std::string dtype_str(paddle::DataType t) {
  switch (t) {
    case paddle::DataType::INT32: return "int32";
    case paddle::DataType::INT64: return "int64";
    case paddle::DataType::FLOAT32: return "float32";
    case paddle::DataType::FLOAT64: return "float64";
    case paddle::DataType::UINT8: return "uint8";
    case paddle::DataType::INT8: return "int8";
    case paddle::DataType::INT16: return "int16";
    case paddle::DataType::FLOAT16: return "float16";
    case paddle::DataType::BFLOAT16: return "bfloat16";
    case paddle::DataType::BOOL: return "bool";
    default: return "unsupported";
  }
}

// What the checks need of one input. Paddle drops an optional input that has no elements
// (it reaches the kernel as absent), so the Python wrapper also sends each optional input's
// presence, shape and dtype in the `meta` attribute; an absent-but-present input is an empty
// tensor described by that.
struct Desc {
  const char* name = "";
  bool present = false;
  std::vector<int64_t> shape;
  paddle::DataType dtype = paddle::DataType::UNDEFINED;
  const void* data = nullptr;
  std::string place;
  bool contiguous = true;
};

// Never dereferenced (a tensor without elements has none to read) but not NULL, which
// emit.h reads as "not given".
const int64_t kEmpty[2] = {0, 0};

std::string where(const paddle::Tensor& t) {
  return t.is_cpu() ? "cpu" : t.is_gpu() ? "cuda:" + std::to_string(t.place().GetDeviceId()) : "unsupported";
}

Desc describe(const paddle::Tensor& t, const char* name) {
  Desc d;
  d.name = name;
  d.present = true;
  d.shape = t.shape();
  d.dtype = t.dtype();
  d.place = where(t);
  d.contiguous = t.is_dense_tensor() && t.is_contiguous();
  d.data = t.numel() == 0 ? static_cast<const void*>(kEmpty) : t.data();
  return d;
}

constexpr int kMetaFields = 5;  // present, ndim, dim0, dim1, dtype code (1 i32, 2 i64, 3 f32, 0 other)

Desc describe(const paddle::optional<paddle::Tensor>& t, const char* name, const std::vector<int64_t>& meta,
              int index, const std::string& place) {
  if (t) return describe(*t, name);
  Desc d;
  d.name = name;
  const size_t at = size_t(index) * kMetaFields;
  if (meta.size() < at + kMetaFields || meta[at] == 0) return d;
  d.present = true;
  d.shape.assign(size_t(meta[at + 1] < 0 ? 0 : meta[at + 1]), 0);  // dims past the second: only the rank matters
  for (size_t i = 0; i < d.shape.size() && i < 2; ++i) d.shape[i] = meta[at + 2 + i];
  const int64_t code = meta[at + 4];
  d.dtype = code == 1   ? paddle::DataType::INT32
            : code == 2 ? paddle::DataType::INT64
            : code == 3 ? paddle::DataType::FLOAT32
                        : paddle::DataType::UNDEFINED;
  d.data = kEmpty;
  d.place = place;
  return d;
}

// The same checks and messages as aiospec/ops/_inputs.py (_check).
void check(const Desc& t, size_t ndim, bool allow_i32, bool allow_i64, bool allow_f32, int64_t lead) {
  const std::string name = t.name;
  if (t.shape.size() != ndim) {
    fail("emit", name + ": expected a " + std::to_string(ndim) + "-D tensor, got shape " + shape_str(t.shape));
  }
  const bool ok = (allow_i32 && t.dtype == paddle::DataType::INT32) ||
                  (allow_i64 && t.dtype == paddle::DataType::INT64) ||
                  (allow_f32 && t.dtype == paddle::DataType::FLOAT32);
  if (!ok) {
    std::string want = allow_f32 ? "float32" : allow_i32 && allow_i64 ? "int32 or int64" : allow_i64 ? "int64" : "int32";
    fail("emit", name + ": expected dtype " + want + ", got " + dtype_str(t.dtype));
  }
  if (lead >= 0 && t.shape[0] != lead) {
    fail("emit", name + ": expected shape " +
                     (ndim == 1 ? "[" + std::to_string(lead) + "]" : "[" + std::to_string(lead) + ", *]") +
                     ", got " + shape_str(t.shape));
  }
  if (!t.contiguous) fail("emit", name + ": expected a C-contiguous tensor");
}

// Fills the emit.h argument block from the inputs after the framework-level checks.
aiospec_emit_args make_args(const paddle::Tensor& handles_t, const paddle::Tensor& token_ids_t,
                            const paddle::Tensor& num_tokens_t, const paddle::optional<paddle::Tensor>& flags_t,
                            const paddle::optional<paddle::Tensor>& draft_ids_t,
                            const paddle::optional<paddle::Tensor>& num_draft_t,
                            const paddle::optional<paddle::Tensor>& lp_ids_t,
                            const paddle::optional<paddle::Tensor>& lp_values_t,
                            const paddle::optional<paddle::Tensor>& lp_ranks_t,
                            const paddle::optional<paddle::Tensor>& lp_offsets_t, const std::vector<int64_t>& meta,
                            int64_t step, int64_t kind, int64_t producer, int64_t k) {
  const Desc handles = describe(handles_t, "handles");
  const Desc token_ids = describe(token_ids_t, "token_ids");
  const Desc num_tokens = describe(num_tokens_t, "num_tokens");
  const std::string& place = handles.place;
  const Desc flags = describe(flags_t, "flags", meta, 0, place);
  const Desc draft_ids = describe(draft_ids_t, "draft_ids", meta, 1, place);
  const Desc num_draft = describe(num_draft_t, "num_draft", meta, 2, place);
  const Desc lp_ids = describe(lp_ids_t, "lp_ids", meta, 3, place);
  const Desc lp_values = describe(lp_values_t, "lp_values", meta, 4, place);
  const Desc lp_ranks = describe(lp_ranks_t, "lp_ranks", meta, 5, place);
  const Desc lp_offsets = describe(lp_offsets_t, "lp_offsets", meta, 6, place);

  // presence first, in emit.h's order and words
  const Desc* lp[4] = {&lp_ids, &lp_values, &lp_ranks, &lp_offsets};
  int first = -1;
  for (int i = 0; i < 4; ++i) {
    if (lp[i]->present && first < 0) first = i;
  }
  if (first >= 0) {
    for (int i = 0; i < 4; ++i) {
      if (!lp[i]->present) fail("emit", std::string(lp[i]->name) + ": required when " + lp[first]->name + " is given");
    }
  }
  if (draft_ids.present && !num_draft.present) fail("emit", "num_draft: required when draft_ids is given");
  if (num_draft.present && !draft_ids.present) fail("emit", "draft_ids: required when num_draft is given");

  check(handles, 1, false, true, false, -1);
  const int64_t rows = handles.shape[0];
  check(token_ids, 2, true, true, false, rows);
  check(num_tokens, 1, true, false, false, rows);
  if (flags.present) check(flags, 1, true, false, false, rows);
  if (draft_ids.present) {
    check(draft_ids, 2, true, true, false, rows);
    check(num_draft, 1, true, false, false, rows);
  }
  int64_t n = 0, width = 0;
  if (first >= 0) {
    check(lp_ids, 2, true, true, false, -1);
    n = lp_ids.shape[0];
    width = lp_ids.shape[1];
    if (width < 1) {
      fail("emit", "lp_ids: expected at least 1 column (the sampled token), got shape " + shape_str({n, 0}));
    }
    check(lp_values, 2, false, false, true, -1);
    if (lp_values.shape != std::vector<int64_t>{n, width}) {
      fail("emit", "lp_values: expected shape " + shape_str({n, width}) + ", got " + shape_str(lp_values.shape));
    }
    check(lp_ranks, 1, true, true, false, n);
    check(lp_offsets, 1, true, false, false, rows + 1);
  }
  for (const Desc* d : {&token_ids, &num_tokens, &flags, &draft_ids, &num_draft, &lp_ids, &lp_values, &lp_ranks,
                        &lp_offsets}) {
    if (d->present && d->place != place) {
      fail("emit", std::string(d->name) + ": on " + d->place + ", expected " + place + " like handles");
    }
  }
  if (producer < 0 || producer > 0xFFFFFFFFll) {
    fail("emit", "producer = " + std::to_string(producer) + ": expected an integer in 0..4294967295");
  }

  aiospec_emit_args a{};
  a.rows = rows;
  a.handles = static_cast<const int64_t*>(handles.data);
  a.token_ids = token_ids.data;
  a.token_ids_i64 = token_ids.dtype == paddle::DataType::INT64;
  a.max_tokens = token_ids.shape[1];
  a.num_tokens = static_cast<const int32_t*>(num_tokens.data);
  a.flags = flags.present ? static_cast<const int32_t*>(flags.data) : nullptr;
  if (draft_ids.present) {
    a.draft_ids = draft_ids.data;
    a.draft_ids_i64 = draft_ids.dtype == paddle::DataType::INT64;
    a.max_draft = draft_ids.shape[1];
    a.num_draft = static_cast<const int32_t*>(num_draft.data);
  }
  if (first >= 0) {
    a.lp_ids = lp_ids.data;
    a.lp_ids_i64 = lp_ids.dtype == paddle::DataType::INT64;
    a.lp_values = static_cast<const float*>(lp_values.data);
    a.lp_ranks = lp_ranks.data;
    a.lp_ranks_i64 = lp_ranks.dtype == paddle::DataType::INT64;
    a.lp_offsets = static_cast<const int32_t*>(lp_offsets.data);
    a.lp_rows = n;
    a.lp_width = width;
  }
  // k and kind go to emit.h's checks as given (out-of-range values saturate to rejected ones)
  a.k = k < -1 ? -2 : k > 0x7FFFFFFF ? 0x7FFFFFFF : int32_t(k);
  a.kind = kind < 0 || kind > 0xFFFFFFFFll ? 0xFFFFFFFFu : uint32_t(kind);
  a.producer = uint32_t(producer);
  a.step = uint64_t(step);  // the attribute is int64: it carries the u64 step's bit pattern
  // one word after the optional inputs' descriptions: bit 0 = logprobs_processed
  const size_t options = size_t(7 * kMetaFields);
  a.logprobs_processed = meta.size() > options ? int32_t(meta[options] & 1) : 0;
  aiospec_error err;
  if (aiospec_check_args(&a, &err) != AIOSPEC_E_OK) fail_emit(err);
  return a;
}

// -- producer cache -------------------------------------------------------------------------

std::mutex g_mu;

struct CpuEntry {
  std::unique_ptr<aiospec::RingProducer> producer;
  dev_t dev = 0;
  ino_t ino = 0;
};
std::map<std::string, CpuEntry> g_cpu;

bool same_file(const std::string& name, dev_t dev, ino_t ino) {
  struct stat st;
  return stat(aiospec::segment_path(name).c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

[[noreturn]] void rethrow_ring(const aiospec::RingError& e) {
  switch (e.code) {
    case aiospec::RingErrc::ring_full: fail("ring_full", e.what());
    case aiospec::RingErrc::bad_segment: fail("bad_segment", e.what());
    case aiospec::RingErrc::os: fail("os", std::to_string(e.err) + " " + e.what());
    case aiospec::RingErrc::invalid: fail("invalid", e.what());
    default: fail("ring", e.what());
  }
}

aiospec::RingProducer& cpu_producer(const std::string& ring) {
  auto it = g_cpu.find(ring);
  if (it != g_cpu.end() && !same_file(ring, it->second.dev, it->second.ino)) {
    it->second.producer->close(false);  // the name points to a new segment now
    g_cpu.erase(it);
    it = g_cpu.end();
  }
  if (it == g_cpu.end()) {
    CpuEntry e;
    try {
      e.producer = std::make_unique<aiospec::RingProducer>(ring);
    } catch (const aiospec::RingError& err) {
      rethrow_ring(err);
    }
    struct stat st;
    if (fstat(e.producer->map().fd, &st) == 0) {
      e.dev = st.st_dev;
      e.ino = st.st_ino;
    }
    it = g_cpu.emplace(ring, std::move(e)).first;
  }
  return *it->second.producer;
}

#ifdef PADDLE_WITH_CUDA
struct CudaEntry {
  aiospec_cuda_producer* producer = nullptr;
  dev_t dev = 0;
  ino_t ino = 0;
};
std::map<std::pair<std::string, int>, CudaEntry> g_cuda;

aiospec_cuda_producer* cuda_producer(const std::string& ring, int device, double timeout) {
  auto key = std::make_pair(ring, device);
  auto it = g_cuda.find(key);
  if (it != g_cuda.end() && !same_file(ring, it->second.dev, it->second.ino)) {
    aiospec_cuda_producer_destroy(it->second.producer);
    g_cuda.erase(it);
    it = g_cuda.end();
  }
  if (it == g_cuda.end()) {
    aiospec_cuda_options o;
    aiospec_cuda_default_options(&o);
    o.device = device;
    o.timeout_s = timeout;
    char msg[1024];
    CudaEntry e;
    if (aiospec_cuda_producer_create(ring.c_str(), &o, &e.producer, msg, sizeof msg) != 0) fail("ring", msg);
    struct stat st;
    if (stat(aiospec::segment_path(ring).c_str(), &st) == 0) {
      e.dev = st.st_dev;
      e.ino = st.st_ino;
    }
    it = g_cuda.emplace(key, e).first;
  }
  return it->second.producer;
}

[[noreturn]] void fail_cuda(aiospec_cuda_producer* p, const aiospec_error& e) {
  char msg[1024];
  aiospec_cuda_format_error(p, &e, msg, sizeof msg);
  fail(e.code == AIOSPEC_E_RING_FULL ? "ring_full" : "emit", msg);
}
#endif

}  // namespace

void AiospecEmit(const paddle::Tensor& handles, const paddle::Tensor& token_ids, const paddle::Tensor& num_tokens,
                 const paddle::optional<paddle::Tensor>& flags, const paddle::optional<paddle::Tensor>& draft_ids,
                 const paddle::optional<paddle::Tensor>& num_draft, const paddle::optional<paddle::Tensor>& lp_ids,
                 const paddle::optional<paddle::Tensor>& lp_values, const paddle::optional<paddle::Tensor>& lp_ranks,
                 const paddle::optional<paddle::Tensor>& lp_offsets, const std::string& ring,
                 const std::vector<int64_t>& meta, int64_t step, int64_t kind, int64_t producer, int64_t k,
                 double timeout) {
  const aiospec_emit_args a = make_args(handles, token_ids, num_tokens, flags, draft_ids, num_draft, lp_ids,
                                        lp_values, lp_ranks, lp_offsets, meta, step, kind, producer, k);
  std::lock_guard<std::mutex> lock(g_mu);
  if (handles.is_cpu()) {
    aiospec::RingProducer& p = cpu_producer(ring);
    try {
      aiospec::emit_cpu(p, a, double(timeout));
    } catch (const aiospec::EmitError& e) {
      fail_emit(e.error);
    } catch (const aiospec::RingError& e) {
      rethrow_ring(e);
    }
    return;
  }
#ifdef PADDLE_WITH_CUDA
  if (handles.is_gpu()) {
    aiospec_cuda_producer* p = cuda_producer(ring, handles.place().GetDeviceId(), double(timeout));
    aiospec_error err;
    if (aiospec_cuda_check(p, &err, nullptr)) fail_cuda(p, err);  // an earlier step's error
    const cudaError_t st = aiospec_cuda_emit(p, &a, handles.stream());
    if (st == cudaErrorInvalidValue) {
      aiospec_cuda_last_error(p, &err);
      if (err.code != AIOSPEC_E_OK) fail_cuda(p, err);
    }
    if (st != cudaSuccess) fail("cuda", std::string("launching the emit kernels: ") + cudaGetErrorString(st));
    return;
  }
#endif
  fail("emit", "handles: on " + where(handles) + ", expected cpu" +
#ifdef PADDLE_WITH_CUDA
                   " or cuda" +
#endif
                   std::string(" memory"));
}

void AiospecRingControl(const paddle::Tensor& x, const std::string& ring, const std::string& action) {
  (void)x;
  std::lock_guard<std::mutex> lock(g_mu);
  if (action == "notify") {
    auto it = g_cpu.find(ring);
    if (it != g_cpu.end()) it->second.producer->notify();
#ifdef PADDLE_WITH_CUDA
    for (auto& kv : g_cuda) {
      if (kv.first.first == ring) aiospec_cuda_notify(kv.second.producer);
    }
#endif
    return;
  }
  if (action == "close") {
    auto it = g_cpu.find(ring);
    if (it != g_cpu.end()) {
      it->second.producer->close(true);
      g_cpu.erase(it);
    }
#ifdef PADDLE_WITH_CUDA
    for (auto kv = g_cuda.begin(); kv != g_cuda.end();) {
      if (kv->first.first == ring) {
        aiospec_cuda_producer_destroy(kv->second.producer);
        kv = g_cuda.erase(kv);
      } else {
        ++kv;
      }
    }
#endif
    return;
  }
  fail("invalid", "action = '" + action + "': expected 'notify' or 'close'");
}

PD_BUILD_OP(aiospec_emit)
    .Inputs({"handles", "token_ids", "num_tokens", paddle::Optional("flags"), paddle::Optional("draft_ids"),
             paddle::Optional("num_draft"), paddle::Optional("lp_ids"), paddle::Optional("lp_values"),
             paddle::Optional("lp_ranks"), paddle::Optional("lp_offsets")})
    .Outputs({"handles_out"})
    .SetInplaceMap({{"handles", "handles_out"}})
    .Attrs({"ring: std::string", "meta: std::vector<int64_t>", "step: int64_t", "kind: int64_t",
            "producer: int64_t", "k: int64_t", "timeout: double"})
    .SetKernelFn(PD_KERNEL(AiospecEmit));

PD_BUILD_OP(aiospec_ring_control)
    .Inputs({"x"})
    .Outputs({"x_out"})
    .SetInplaceMap({{"x", "x_out"}})
    .Attrs({"ring: std::string", "action: std::string"})
    .SetKernelFn(PD_KERNEL(AiospecRingControl));
