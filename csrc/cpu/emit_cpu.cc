// The CPU emit writer: validates one decoding step, reserves its frame in the ring and
// writes the payload in place (no intermediate buffer), then commits.
//
// The checks, their order, the layout and the header come from emit.h, shared with the CUDA
// kernel; this file only walks the rows once more to gather the columns. The output is
// byte-identical to aiospec._codec.encode_frame (tests/test_ops_cpu.py).
#include "aiospec/emit_cpu.h"

#include <cstring>

namespace aiospec {

std::string format_error(const aiospec_error& e) {
  char buf[512];
  aiospec_format_error(&e, buf, sizeof buf);
  return buf;
}

EmitError::EmitError(const aiospec_error& e) : std::invalid_argument(format_error(e)), error(e) {}

int emit_validate(const aiospec_emit_args& a, uint64_t max_record, aiospec_frame_layout* lay, aiospec_error* err) {
  if (aiospec_check_args(&a, err) != AIOSPEC_E_OK) return err->code;
  uint64_t r = 0, t = 0, d = 0;
  for (int64_t i = 0; i < a.rows; ++i) {
    if (aiospec_check_row(&a, i, err) != AIOSPEC_E_OK) return err->code;
    if (!aiospec_row_has_record(&a, i)) continue;
    ++r;
    t += uint64_t(a.num_tokens[i]);
    if (a.num_draft != nullptr) d += uint64_t(a.num_draft[i]);
  }
  // the largest frame a u32 length field can describe; a ring's max_record is below it
  const uint64_t limit = max_record != 0 ? max_record : 0xFFFFFFC0ull;
  const uint32_t k = aiospec_frame_k(&a);
  if (r > 0xFFFFFFFFull || t > 0xFFFFFFFFull || d > 0xFFFFFFFFull) {
    return aiospec_set_error(err, AIOSPEC_E_FRAME_SIZE, AIOSPEC_ARG_FRAME, -1, -1, INT64_MAX, 0, int64_t(limit), -1);
  }
  aiospec_compute_layout(r, t, d, k, aiospec_has_logprobs(&a), lay);
  if (lay->frame_size > limit) {
    return aiospec_set_error(err, AIOSPEC_E_FRAME_SIZE, AIOSPEC_ARG_FRAME, -1, -1, int64_t(lay->frame_size), 0,
                             int64_t(limit), -1);
  }
  return aiospec_set_error(err, AIOSPEC_E_OK, 0, -1, -1, 0, 0, 0, -1);
}

namespace {

// Stores through memcpy: aiospec_emit_build may target a caller's unaligned buffer.
template <class T>
inline void put(uint8_t* col, uint64_t i, T v) {
  std::memcpy(col + i * sizeof(T), &v, sizeof(T));
}

inline void copy_ids(uint8_t* col, uint64_t at, const void* src, int32_t is_i64, int64_t base, int64_t n) {
  if (!is_i64) {
    std::memcpy(col + at * 4, static_cast<const int32_t*>(src) + base, size_t(n) * 4);
    return;
  }
  const int64_t* s = static_cast<const int64_t*>(src) + base;
  for (int64_t j = 0; j < n; ++j) put<int32_t>(col, at + uint64_t(j), int32_t(s[j]));
}

}  // namespace

void emit_write_payload(const aiospec_emit_args& a, const aiospec_frame_layout& lay, uint8_t* dst) {
  aiospec_write_header(dst, &lay, a.producer, a.step, a.kind);
  uint8_t* col[AIOSPEC_NUM_COLUMNS];
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) col[c] = lay.off[c] != 0 ? dst + lay.off[c] : nullptr;
  const bool has_lp = lay.fflags & AIOSPEC_FRAME_HAS_LOGPROBS;
  const bool has_draft = lay.d > 0;
  const uint64_t k = lay.k;
  uint64_t rec = 0, tok = 0, dr = 0;
  put<int32_t>(col[AIOSPEC_COL_TOKEN_OFFSETS], 0, 0);
  if (has_draft) put<int32_t>(col[AIOSPEC_COL_DRAFT_OFFSETS], 0, 0);
  for (int64_t i = 0; i < a.rows; ++i) {
    if (!aiospec_row_has_record(&a, i)) continue;
    put<uint64_t>(col[AIOSPEC_COL_HANDLES], rec, uint64_t(a.handles[i]));
    put<uint32_t>(col[AIOSPEC_COL_FLAGS], rec, aiospec_row_flags(&a, i));
    const int64_t nt = a.num_tokens[i];
    copy_ids(col[AIOSPEC_COL_TOKEN_IDS], tok, a.token_ids, a.token_ids_i64, aiospec_token_row(&a, i), nt);
    if (has_lp) {
      const int64_t lp0 = a.lp_offsets[i];
      for (int64_t j = 0; j < nt; ++j) {
        const int64_t r = lp0 + j;
        const float* vals = a.lp_values + aiospec_lp_values_row(&a, r);
        put<float>(col[AIOSPEC_COL_LOGPROBS], tok + uint64_t(j), vals[0]);
        put<int32_t>(col[AIOSPEC_COL_RANKS], tok + uint64_t(j), int32_t(aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, r)));
        if (k > 0) {
          const uint64_t at = (tok + uint64_t(j)) * k;
          copy_ids(col[AIOSPEC_COL_TOPK_IDS], at, a.lp_ids, a.lp_ids_i64, aiospec_lp_ids_row(&a, r) + 1, int64_t(k));
          std::memcpy(col[AIOSPEC_COL_TOPK_LOGPROBS] + at * 4, vals + 1, k * 4);
        }
      }
    }
    tok += uint64_t(nt);
    put<int32_t>(col[AIOSPEC_COL_TOKEN_OFFSETS], rec + 1, int32_t(tok));
    if (has_draft) {
      const int64_t nd = a.num_draft[i];
      copy_ids(col[AIOSPEC_COL_DRAFT_IDS], dr, a.draft_ids, a.draft_ids_i64, aiospec_draft_row(&a, i), nd);
      dr += uint64_t(nd);
      put<int32_t>(col[AIOSPEC_COL_DRAFT_OFFSETS], rec + 1, int32_t(dr));
    }
    ++rec;
  }
  // zero the alignment padding after each column (the ring's bytes are from earlier laps)
  const uint64_t counts[AIOSPEC_NUM_COLUMNS] = {lay.r, lay.r, lay.r + 1, lay.t, lay.r + 1,
                                                lay.d, lay.t, lay.t, lay.t * k, lay.t * k};
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) {
    if (lay.off[c] == 0) continue;
    const uint64_t end = lay.off[c] + counts[c] * (c == AIOSPEC_COL_HANDLES ? 8 : 4);
    uint64_t next = lay.payload_len;
    for (int n = c + 1; n < AIOSPEC_NUM_COLUMNS; ++n) {
      if (lay.off[n] != 0) {
        next = lay.off[n];
        break;
      }
    }
    std::memset(dst + end, 0, next - end);
  }
}

uint64_t emit_cpu(RingProducer& ring, const aiospec_emit_args& a, double timeout) {
  aiospec_frame_layout lay;
  aiospec_error err;
  if (emit_validate(a, ring.max_record(), &lay, &err) != AIOSPEC_E_OK) throw EmitError(err);
  uint8_t* dst = ring.reserve(lay.payload_len, timeout);
  emit_write_payload(a, lay, dst);
  return ring.commit(lay.payload_len);
}

}  // namespace aiospec
