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
  const uint32_t k = aiospec_frame_k(&a);
  const bool sp = aiospec_uses_sampled_pos(k, aiospec_has_logprobs(&a));
  uint64_t r = 0, t = 0, d = 0, e = 0;
  int64_t nt_min = INT64_MAX, nt_max = -1, nd_min = INT64_MAX, nd_max = -1;
  for (int64_t i = 0; i < a.rows; ++i) {
    if (aiospec_check_row(&a, i, err) != AIOSPEC_E_OK) return err->code;
    if (!aiospec_row_has_record(&a, i)) continue;
    ++r;
    const int64_t nt = a.num_tokens[i];
    const int64_t nd = a.num_draft != nullptr ? a.num_draft[i] : 0;
    t += uint64_t(nt);
    d += uint64_t(nd);
    nt_min = nt < nt_min ? nt : nt_min;
    nt_max = nt > nt_max ? nt : nt_max;
    nd_min = nd < nd_min ? nd : nd_min;
    nd_max = nd > nd_max ? nd : nd_max;
    // the sampled_pos rule decides the exception columns' size, so it runs here, before the
    // frame is reserved, and again where the tokens are written
    if (sp) e += uint64_t(aiospec_row_exceptions(&a, i, 0, nt, k));
  }
  // the largest frame a u32 length field can describe; a ring's max_record is below it
  const uint64_t limit = max_record != 0 ? max_record : 0xFFFFFFC0ull;
  if (r > 0xFFFFFFFFull || t > 0xFFFFFFFFull || d > 0xFFFFFFFFull) {
    return aiospec_set_error(err, AIOSPEC_E_FRAME_SIZE, AIOSPEC_ARG_FRAME, -1, -1, INT64_MAX, 0, int64_t(limit), -1);
  }
  const uint32_t fflags = aiospec_frame_flags(&a, r, d, nt_min, nt_max, nd_min, nd_max);
  aiospec_compute_layout(r, t, d, e, k, fflags, r > 0 ? uint32_t(nt_max) : 0u, r > 0 ? uint32_t(nd_max) : 0u,
                         a.kind == AIOSPEC_KIND_PROMPT, lay);
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
  const bool sp = aiospec_uses_sampled_pos(lay.k, has_lp);
  const bool tok_offsets = col[AIOSPEC_COL_TOKEN_OFFSETS] != nullptr;
  const bool draft_offsets = col[AIOSPEC_COL_DRAFT_OFFSETS] != nullptr;
  const uint64_t k = lay.k;
  uint64_t rec = 0, tok = 0, dr = 0, exc = 0;
  if (tok_offsets) put<int32_t>(col[AIOSPEC_COL_TOKEN_OFFSETS], 0, 0);
  if (draft_offsets) put<int32_t>(col[AIOSPEC_COL_DRAFT_OFFSETS], 0, 0);
  for (int64_t i = 0; i < a.rows; ++i) {
    if (!aiospec_row_has_record(&a, i)) continue;
    put<uint64_t>(col[AIOSPEC_COL_HANDLES], rec, uint64_t(a.handles[i]));
    put<uint8_t>(col[AIOSPEC_COL_FLAGS], rec, uint8_t(aiospec_row_flags(&a, i)));
    if (a.positions != nullptr) {
      put<int32_t>(col[AIOSPEC_COL_POSITIONS], rec, int32_t(aiospec_load_int(a.positions, a.positions_i64, i)));
    }
    const int64_t nt = a.num_tokens[i];
    if (!sp) copy_ids(col[AIOSPEC_COL_TOKEN_IDS], tok, a.token_ids, a.token_ids_i64, aiospec_token_row(&a, i), nt);
    if (has_lp) {
      const int64_t lp0 = a.lp_offsets[i];
      for (int64_t j = 0; j < nt; ++j) {
        const int64_t r = lp0 + j;
        const float* vals = a.lp_values + aiospec_lp_values_row(&a, r);
        const int64_t rank = aiospec_load_int(a.lp_ranks, a.lp_ranks_i64, r);
        if (sp) {
          const int64_t id = aiospec_token(&a, i, j);
          const uint32_t p = aiospec_sampled_pos(&a, r, id, rank, lay.k);
          put<uint8_t>(col[AIOSPEC_COL_SAMPLED_POS], tok + uint64_t(j), uint8_t(p));
          if (p == AIOSPEC_SAMPLED_EXCEPTION) {
            put<int32_t>(col[AIOSPEC_COL_EXCEPTION_IDS], exc, int32_t(id));
            put<float>(col[AIOSPEC_COL_EXCEPTION_LOGPROBS], exc, vals[0]);
            put<int32_t>(col[AIOSPEC_COL_EXCEPTION_RANKS], exc, int32_t(rank));
            ++exc;
          }
        } else {
          put<float>(col[AIOSPEC_COL_LOGPROBS], tok + uint64_t(j), vals[0]);
          put<int32_t>(col[AIOSPEC_COL_RANKS], tok + uint64_t(j), int32_t(rank));
        }
        if (k > 0) {
          const uint64_t at = (tok + uint64_t(j)) * k;
          copy_ids(col[AIOSPEC_COL_TOPK_IDS], at, a.lp_ids, a.lp_ids_i64, aiospec_lp_ids_row(&a, r) + 1, int64_t(k));
          std::memcpy(col[AIOSPEC_COL_TOPK_LOGPROBS] + at * 4, vals + 1, k * 4);
        }
      }
    }
    tok += uint64_t(nt);
    if (tok_offsets) put<int32_t>(col[AIOSPEC_COL_TOKEN_OFFSETS], rec + 1, int32_t(tok));
    if (lay.d > 0) {
      const int64_t nd = a.num_draft[i];
      copy_ids(col[AIOSPEC_COL_DRAFT_IDS], dr, a.draft_ids, a.draft_ids_i64, aiospec_draft_row(&a, i), nd);
      dr += uint64_t(nd);
      if (draft_offsets) put<int32_t>(col[AIOSPEC_COL_DRAFT_OFFSETS], rec + 1, int32_t(dr));
    }
    ++rec;
  }
  // zero the alignment padding after each column (the ring's bytes are from earlier laps)
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) {
    if (lay.off[c] == 0) continue;
    const uint64_t end = lay.off[c] + aiospec_column_count(&lay, c) * aiospec_column_size(c);
    std::memset(dst + end, 0, aiospec_align(end, AIOSPEC_COLUMN_ALIGN) - end);
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
