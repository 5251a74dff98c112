/* The emit op's shared core: argument block, error word, validation, frame layout and the
 * msgpack header writer.
 *
 * One decoding step of one producer becomes one frame (docs/emit-op.md). The CPU writer
 * (csrc/cpu/emit_cpu.cc) and the CUDA kernel (csrc/cuda/) both include this header, so the
 * checks, the order in which they run, the column layout and the header bytes exist once.
 * Plain C (C99 / C++ / CUDA); functions marked AIOSPEC_HD compile for host and device.
 *
 * Byte identity: a frame built from these helpers is byte-identical to the Python reference
 * encoder aiospec._codec.encode_frame given the same records (tests/test_ops_*.py prove it).
 */
#ifndef AIOSPEC_EMIT_H_
#define AIOSPEC_EMIT_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "aiospec/layout.h"

#ifdef __CUDACC__
#define AIOSPEC_HD static __host__ __device__ __forceinline__
#else
#define AIOSPEC_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever aiospec_emit_args, aiospec_error or an exported C function changes. */
#define AIOSPEC_EMIT_ABI_VERSION 3

/* ---- arguments ---------------------------------------------------------------------------
 * All pointers address the same memory space (host for the CPU writer, device for CUDA).
 * 1-D inputs are contiguous; a 2-D input's columns are contiguous and its rows lie
 * `*_stride` elements apart (a column slice such as x[:, :1] of a [B, 2] tensor has stride 2),
 * or exactly its width apart when the stride is 0 (a C-contiguous tensor). Strides may be
 * negative (rows in reverse order in memory). "i64" flags select int64 (1) or int32 (0)
 * elements. Rows are in the worker's current order; every row carries its own handle, so no
 * reordering is undone.
 */
typedef struct aiospec_emit_args {
  int64_t rows;                  /* B: batch rows, >= 0 */
  const int64_t* handles;        /* [B] request handle; >= 0 on every row that makes a record */
  const void* token_ids;         /* [B, max_tokens] sampled / accepted token ids */
  int32_t token_ids_i64;         /* token_ids element type: 1 = int64, 0 = int32 */
  int64_t max_tokens;            /* W: columns of token_ids, >= 0 */
  const int32_t* num_tokens;     /* [B] tokens emitted per row, 0..W (FastDeploy accept_num) */
  const int32_t* flags;          /* [B] record flags within AIOSPEC_FLAG_MASK, or NULL (all 0) */
  const void* draft_ids;         /* [B, max_draft] ids carried with the record (never output
                                    tokens), or NULL; requires num_draft */
  int32_t draft_ids_i64;         /* draft_ids element type */
  int64_t max_draft;             /* Wd: columns of draft_ids, >= 0 (ignored without draft_ids) */
  const int32_t* num_draft;      /* [B] draft ids per row, 0..Wd, or NULL; requires draft_ids */
  const void* lp_ids;            /* [N, lp_width]: column 0 the sampled token (not emitted:
                                    the token comes from token_ids), then the top-k ids; or
                                    NULL = no logprobs (then lp_values, lp_ranks, lp_offsets
                                    must be NULL too) */
  int32_t lp_ids_i64;            /* lp_ids element type */
  const float* lp_values;        /* [N, lp_width] logprobs, same columns as lp_ids */
  const void* lp_ranks;          /* [N] 1-based rank of the sampled token */
  int32_t lp_ranks_i64;          /* lp_ranks element type */
  const int32_t* lp_offsets;     /* [B + 1] row i's logprob rows are lp_offsets[i] ..
                                    lp_offsets[i+1]; the record takes the first num_tokens[i] */
  int64_t lp_rows;               /* N: rows of lp_ids / lp_values / lp_ranks, >= 0 */
  int64_t lp_width;              /* columns of lp_ids / lp_values (k_max + 1), >= 1 */
  int32_t k;                     /* top-k columns to emit, 0..lp_width-1 (and <= MAX_TOPK);
                                    -1 = lp_width - 1. Ignored without logprobs. */
  uint32_t kind;                 /* AIOSPEC_KIND_TARGET / _DRAFT / _PROMPT; the kind sets the
                                    DRAFT / PROMPT flag of every record (those two bits of
                                    `flags` are ignored) */
  uint32_t producer;             /* producer id written to the frame header */
  uint64_t step;                 /* decoding step written to the frame header */
  int64_t token_ids_stride;      /* elements from one row of token_ids to the next; 0 = max_tokens */
  int64_t draft_ids_stride;      /* the same for draft_ids; 0 = max_draft */
  int64_t lp_ids_stride;         /* the same for lp_ids; 0 = lp_width */
  int64_t lp_values_stride;      /* the same for lp_values; 0 = lp_width */
  const void* positions;         /* [B] prompt position of each row's first token, 0..INT32_MAX
                                    on rows that make a record; required when kind is
                                    AIOSPEC_KIND_PROMPT, NULL otherwise */
  int32_t positions_i64;         /* positions element type */
  int32_t logprobs_processed;    /* 1: the logprobs are of the distribution sampled from (after
                                    temperature, biases, penalties), not of the raw logits;
                                    sets AIOSPEC_FRAME_LOGPROBS_PROCESSED (with logprobs only) */
} aiospec_emit_args;

/* ---- errors ------------------------------------------------------------------------------
 * One struct describes every validation failure; aiospec_format_error turns it into the same
 * message the Python reference raises (aiospec/ops/_errors.py mirrors the formats). It is
 * also the CUDA path's device-side error word: code 0 = ok.
 *
 * Order: when several inputs are wrong the reported error is the FIRST in this order:
 *   1. aiospec_check_args (scalars, in the order of the code below), row = -1;
 *   2. rows ascending; within a row the checks of aiospec_check_row in code order
 *      (AIOSPEC_CHECK_* ordinals), element index ascending within one check;
 *   3. the frame size (AIOSPEC_E_FRAME_SIZE).
 * A parallel checker reproduces it by keeping the error with the smallest
 * aiospec_error_order() key (e.g. atomicMin on the key, then a second pass to fill it in).
 */
enum aiospec_error_code {
  AIOSPEC_E_OK = 0,
  AIOSPEC_E_MISSING = 1,    /* arg is NULL but `value` (an AIOSPEC_ARG_*) requires it */
  AIOSPEC_E_DIM = 2,        /* scalar `arg` = value: expected lo..hi */
  AIOSPEC_E_KIND = 3,       /* kind = value: expected 0..1 */
  AIOSPEC_E_K = 4,          /* k = value (resolved: -1 = lp_width - 1): expected 0..hi */
  AIOSPEC_E_COUNT = 5,      /* num_tokens / num_draft [row] = value: expected 0..hi */
  AIOSPEC_E_FLAGS = 6,      /* flags[row] = value: bits outside AIOSPEC_FLAG_MASK */
  AIOSPEC_E_HANDLE = 7,     /* handles[row] = value < 0 on a row that makes a record */
  AIOSPEC_E_OFFSET = 8,     /* lp_offsets[row] = value: expected lo..hi */
  AIOSPEC_E_SPAN = 9,       /* lp_offsets[row+1] - lp_offsets[row] = value < lo = num_tokens */
  AIOSPEC_E_ID = 10,        /* arg[row(, col)] = value does not fit int32 */
  AIOSPEC_E_FRAME_SIZE = 11, /* the frame needs value bytes, the ring takes hi (max_record) */
  AIOSPEC_E_POSITIONS = 12,  /* positions given without kind = prompt, or missing with it (value = kind) */
  AIOSPEC_E_POSITION = 13    /* positions[row] = value: expected lo..hi */
};

enum aiospec_arg {
  AIOSPEC_ARG_NONE = 0,
  AIOSPEC_ARG_ROWS = 1,
  AIOSPEC_ARG_HANDLES = 2,
  AIOSPEC_ARG_TOKEN_IDS = 3,
  AIOSPEC_ARG_MAX_TOKENS = 4,
  AIOSPEC_ARG_NUM_TOKENS = 5,
  AIOSPEC_ARG_FLAGS = 6,
  AIOSPEC_ARG_DRAFT_IDS = 7,
  AIOSPEC_ARG_MAX_DRAFT = 8,
  AIOSPEC_ARG_NUM_DRAFT = 9,
  AIOSPEC_ARG_LP_IDS = 10,
  AIOSPEC_ARG_LP_VALUES = 11,
  AIOSPEC_ARG_LP_RANKS = 12,
  AIOSPEC_ARG_LP_OFFSETS = 13,
  AIOSPEC_ARG_LP_ROWS = 14,
  AIOSPEC_ARG_LP_WIDTH = 15,
  AIOSPEC_ARG_K = 16,
  AIOSPEC_ARG_KIND = 17,
  AIOSPEC_ARG_FRAME = 18,
  AIOSPEC_ARG_POSITIONS = 19
};

/* Per-row check ordinals (the order aiospec_check_row runs them). */
enum aiospec_row_check {
  AIOSPEC_CHECK_NUM_TOKENS = 0,
  AIOSPEC_CHECK_NUM_DRAFT = 1,
  AIOSPEC_CHECK_FLAGS = 2,
  AIOSPEC_CHECK_HANDLE = 3,
  AIOSPEC_CHECK_LP_OFFSETS = 4,
  AIOSPEC_CHECK_LP_SPAN = 5,
  AIOSPEC_CHECK_POSITIONS = 6,
  /* the element checks come last: the CUDA kernel runs them where it copies the elements */
  AIOSPEC_CHECK_TOKEN_IDS = 7,
  AIOSPEC_CHECK_DRAFT_IDS = 8,
  AIOSPEC_CHECK_LP = 9 /* lp_ranks[r] then lp_ids[r, 1..k], r ascending */
};

typedef struct aiospec_error {
  int32_t code;   /* AIOSPEC_E_*; 0 = ok */
  int32_t arg;    /* AIOSPEC_ARG_*: which input */
  int64_t row;    /* element row (batch row, or logprob row for lp_ids / lp_ranks); -1 = scalar */
  int64_t col;    /* element column for 2-D inputs; -1 = none */
  int64_t value;  /* the offending value */
  int64_t lo;     /* smallest accepted value (E_SPAN: num_tokens[row]) */
  int64_t hi;     /* largest accepted value */
  int32_t check;  /* AIOSPEC_CHECK_* for row errors, -1 otherwise (ordering only) */
  int32_t brow;   /* batch row whose check failed, -1 for scalar checks (ordering only) */
} aiospec_error;

AIOSPEC_HD const char* aiospec_arg_name(int32_t arg) {
  switch (arg) {
    case AIOSPEC_ARG_ROWS: return "rows";
    case AIOSPEC_ARG_HANDLES: return "handles";
    case AIOSPEC_ARG_TOKEN_IDS: return "token_ids";
    case AIOSPEC_ARG_MAX_TOKENS: return "max_tokens";
    case AIOSPEC_ARG_NUM_TOKENS: return "num_tokens";
    case AIOSPEC_ARG_FLAGS: return "flags";
    case AIOSPEC_ARG_DRAFT_IDS: return "draft_ids";
    case AIOSPEC_ARG_MAX_DRAFT: return "max_draft";
    case AIOSPEC_ARG_NUM_DRAFT: return "num_draft";
    case AIOSPEC_ARG_LP_IDS: return "lp_ids";
    case AIOSPEC_ARG_LP_VALUES: return "lp_values";
    case AIOSPEC_ARG_LP_RANKS: return "lp_ranks";
    case AIOSPEC_ARG_LP_OFFSETS: return "lp_offsets";
    case AIOSPEC_ARG_LP_ROWS: return "lp_rows";
    case AIOSPEC_ARG_LP_WIDTH: return "lp_width";
    case AIOSPEC_ARG_K: return "k";
    case AIOSPEC_ARG_KIND: return "kind";
    case AIOSPEC_ARG_FRAME: return "frame";
    case AIOSPEC_ARG_POSITIONS: return "positions";
    default: return "?";
  }
}

/* Sort key of an error (smaller = reported first); see "Order" above. Packs the batch row
 * (30 bits), the check (4) and the element index (29), saturating, which is exact for every
 * batch this op can carry (rows and elements beyond 2^29 cannot fit a frame anyway). */
AIOSPEC_HD uint64_t aiospec_error_order(const aiospec_error* e) {
  if (e->code == AIOSPEC_E_OK) return UINT64_MAX;
  if (e->brow < 0 || e->check < 0) return e->code == AIOSPEC_E_FRAME_SIZE ? UINT64_MAX - 1 : 0;
  uint64_t brow = (uint64_t)e->brow;
  int64_t elem = e->check == AIOSPEC_CHECK_LP ? e->row : e->col;
  uint64_t sub = elem < 0 ? 0 : (uint64_t)elem;
  if (brow > 0x3FFFFFFFull) brow = 0x3FFFFFFFull;
  if (sub > 0x1FFFFFFFull) sub = 0x1FFFFFFFull;
  return 1 + ((brow << 33) | ((uint64_t)e->check << 29) | sub);
}

AIOSPEC_HD int aiospec_set_error(aiospec_error* e, int32_t code, int32_t arg, int64_t row, int64_t col,
                                 int64_t value, int64_t lo, int64_t hi, int32_t check) {
  e->code = code;
  e->arg = arg;
  e->row = row;
  e->col = col;
  e->value = value;
  e->lo = lo;
  e->hi = hi;
  e->check = check;
  e->brow = check < 0 ? -1 : (int32_t)row;
  return code;
}

/* ---- element access ------------------------------------------------------------------- */

AIOSPEC_HD int64_t aiospec_load_int(const void* p, int32_t is_i64, int64_t i) {
  return is_i64 ? ((const int64_t*)p)[i] : (int64_t)((const int32_t*)p)[i];
}

/* Elements between consecutive rows of a 2-D input: its stride, or its width when 0. */
AIOSPEC_HD int64_t aiospec_row_stride(int64_t stride, int64_t width) { return stride != 0 ? stride : width; }

/* Element offsets of row i of each 2-D input. */
AIOSPEC_HD int64_t aiospec_token_row(const aiospec_emit_args* a, int64_t i) {
  return i * aiospec_row_stride(a->token_ids_stride, a->max_tokens);
}
AIOSPEC_HD int64_t aiospec_draft_row(const aiospec_emit_args* a, int64_t i) {
  return i * aiospec_row_stride(a->draft_ids_stride, a->max_draft);
}
AIOSPEC_HD int64_t aiospec_lp_ids_row(const aiospec_emit_args* a, int64_t r) {
  return r * aiospec_row_stride(a->lp_ids_stride, a->lp_width);
}
AIOSPEC_HD int64_t aiospec_lp_values_row(const aiospec_emit_args* a, int64_t r) {
  return r * aiospec_row_stride(a->lp_values_stride, a->lp_width);
}

AIOSPEC_HD int aiospec_fits_i32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

AIOSPEC_HD int aiospec_has_logprobs(const aiospec_emit_args* a) { return a->lp_ids != NULL; }

/* The k a frame carries: 0 without logprobs, else the resolved k (call after check_args). */
AIOSPEC_HD uint32_t aiospec_frame_k(const aiospec_emit_args* a) {
  if (!aiospec_has_logprobs(a)) return 0;
  return (uint32_t)(a->k < 0 ? a->lp_width - 1 : a->k);
}

/* Does row i make a record? Any token, any flag or any draft id. */
AIOSPEC_HD int aiospec_row_has_record(const aiospec_emit_args* a, int64_t i) {
  return a->num_tokens[i] > 0 || (a->flags != NULL && a->flags[i] != 0) ||
         (a->num_draft != NULL && a->num_draft[i] > 0);
}

/* A record's flags: the row's, with the DRAFT / PROMPT bits the frame's kind gives. */
AIOSPEC_HD uint32_t aiospec_row_flags(const aiospec_emit_args* a, int64_t i) {
  uint32_t f = a->flags != NULL ? (uint32_t)a->flags[i] : 0u;
  f &= ~(uint32_t)(AIOSPEC_FLAG_DRAFT | AIOSPEC_FLAG_PROMPT);
  if (a->kind == AIOSPEC_KIND_DRAFT) f |= AIOSPEC_FLAG_DRAFT;
  if (a->kind == AIOSPEC_KIND_PROMPT) f |= AIOSPEC_FLAG_PROMPT;
  return f;
}

/* ---- sampled_pos (payload version 2) ------------------------------------------------------
 * With logprobs and 1 <= k <= 255 a frame stores each token as its column in the top-k: the
 * first j < k with lp_ids[r, 1 + j] == token, lp_values[r, 1 + j] of the same bits as
 * lp_values[r, 0], and rank == the number of j' < k with lp_values[r, 1 + j'] >= lp_values[r, 0];
 * AIOSPEC_SAMPLED_EXCEPTION where there is none (the token goes to the exception columns).
 * The same rule as aiospec._codec.sampled_positions. */
AIOSPEC_HD int aiospec_uses_sampled_pos(uint32_t k, int has_logprobs) {
  return has_logprobs && k >= 1 && k <= AIOSPEC_SAMPLED_POS_MAX_K;
}

AIOSPEC_HD uint32_t aiospec_float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* sampled_pos of the token `tok` whose logprob row is `lr` and rank `rank` (k = frame k).
 * One pass with no early exit: no load waits on the result of another, so a GPU thread keeps
 * several in flight (about 2x faster for 20 alternatives on an H200 than counting first and
 * then searching). */
AIOSPEC_HD uint32_t aiospec_sampled_pos(const aiospec_emit_args* a, int64_t lr, int64_t tok, int64_t rank, uint32_t k) {
  const float* vals = a->lp_values + aiospec_lp_values_row(a, lr);
  const float lp = vals[0];
  const uint32_t bits = aiospec_float_bits(lp);
  const int64_t base = aiospec_lp_ids_row(a, lr) + 1;
  int64_t count = 0;
  uint32_t first = AIOSPEC_SAMPLED_EXCEPTION;
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
  for (uint32_t j = 0; j < k; ++j) {
    const float v = vals[1 + j];
    const int64_t id = aiospec_load_int(a->lp_ids, a->lp_ids_i64, base + j);
    count += v >= lp;
    if (first == AIOSPEC_SAMPLED_EXCEPTION && id == tok && aiospec_float_bits(v) == bits) first = j;
  }
  return count == rank ? first : AIOSPEC_SAMPLED_EXCEPTION;
}

/* The id of token j of row i. */
AIOSPEC_HD int64_t aiospec_token(const aiospec_emit_args* a, int64_t i, int64_t j) {
  return aiospec_load_int(a->token_ids, a->token_ids_i64, aiospec_token_row(a, i) + j);
}

/* Exceptions among tokens [j0, j1) of row i (a frame with sampled_pos; row i checked). */
AIOSPEC_HD int64_t aiospec_row_exceptions(const aiospec_emit_args* a, int64_t i, int64_t j0, int64_t j1, uint32_t k) {
  int64_t e = 0;
  const int64_t lp0 = a->lp_offsets[i];
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lr = lp0 + j;
    e += aiospec_sampled_pos(a, lr, aiospec_token(a, i, j), aiospec_load_int(a->lp_ranks, a->lp_ranks_i64, lr), k) ==
         AIOSPEC_SAMPLED_EXCEPTION;
  }
  return e;
}

/* ---- validation ------------------------------------------------------------------------ */

/* Scalar and presence checks; everything aiospec_check_row relies on. */
AIOSPEC_HD int aiospec_check_args(const aiospec_emit_args* a, aiospec_error* e) {
  const int has_lp = a->lp_ids != NULL || a->lp_values != NULL || a->lp_ranks != NULL || a->lp_offsets != NULL;
  aiospec_set_error(e, AIOSPEC_E_OK, 0, -1, -1, 0, 0, 0, -1);
  /* presence: handles, token_ids and num_tokens always; the four logprob inputs together
   * (named after the first one given); draft_ids and num_draft together */
  if (a->handles == NULL) return aiospec_set_error(e, AIOSPEC_E_MISSING, AIOSPEC_ARG_HANDLES, -1, -1, 0, 0, 0, -1);
  if (a->token_ids == NULL)
    return aiospec_set_error(e, AIOSPEC_E_MISSING, AIOSPEC_ARG_TOKEN_IDS, -1, -1, 0, 0, 0, -1);
  if (a->num_tokens == NULL)
    return aiospec_set_error(e, AIOSPEC_E_MISSING, AIOSPEC_ARG_NUM_TOKENS, -1, -1, 0, 0, 0, -1);
  if (has_lp) {
    const void* ptrs[4] = {a->lp_ids, a->lp_values, a->lp_ranks, a->lp_offsets};
    const int32_t names[4] = {AIOSPEC_ARG_LP_IDS, AIOSPEC_ARG_LP_VALUES, AIOSPEC_ARG_LP_RANKS, AIOSPEC_ARG_LP_OFFSETS};
    int32_t first = 0;
    for (int i = 0; i < 4; ++i) {
      if (ptrs[i] != NULL) {
        first = names[i];
        break;
      }
    }
    for (int i = 0; i < 4; ++i) {
      if (ptrs[i] == NULL) return aiospec_set_error(e, AIOSPEC_E_MISSING, names[i], -1, -1, first, 0, 0, -1);
    }
  }
  if (a->draft_ids != NULL && a->num_draft == NULL)
    return aiospec_set_error(e, AIOSPEC_E_MISSING, AIOSPEC_ARG_NUM_DRAFT, -1, -1, AIOSPEC_ARG_DRAFT_IDS, 0, 0, -1);
  if (a->num_draft != NULL && a->draft_ids == NULL)
    return aiospec_set_error(e, AIOSPEC_E_MISSING, AIOSPEC_ARG_DRAFT_IDS, -1, -1, AIOSPEC_ARG_NUM_DRAFT, 0, 0, -1);
  /* dimensions */
  if (a->rows < 0 || a->rows > INT32_MAX)
    return aiospec_set_error(e, AIOSPEC_E_DIM, AIOSPEC_ARG_ROWS, -1, -1, a->rows, 0, INT32_MAX, -1);
  if (a->max_tokens < 0 || a->max_tokens > INT32_MAX)
    return aiospec_set_error(e, AIOSPEC_E_DIM, AIOSPEC_ARG_MAX_TOKENS, -1, -1, a->max_tokens, 0, INT32_MAX, -1);
  if (a->draft_ids != NULL && (a->max_draft < 0 || a->max_draft > INT32_MAX))
    return aiospec_set_error(e, AIOSPEC_E_DIM, AIOSPEC_ARG_MAX_DRAFT, -1, -1, a->max_draft, 0, INT32_MAX, -1);
  if (has_lp) {
    if (a->lp_rows < 0 || a->lp_rows > INT32_MAX)
      return aiospec_set_error(e, AIOSPEC_E_DIM, AIOSPEC_ARG_LP_ROWS, -1, -1, a->lp_rows, 0, INT32_MAX, -1);
    if (a->lp_width < 1 || a->lp_width > INT32_MAX)
      return aiospec_set_error(e, AIOSPEC_E_DIM, AIOSPEC_ARG_LP_WIDTH, -1, -1, a->lp_width, 1, INT32_MAX, -1);
  }
  if (a->kind > AIOSPEC_KIND_PROMPT)
    return aiospec_set_error(e, AIOSPEC_E_KIND, AIOSPEC_ARG_KIND, -1, -1, (int64_t)a->kind, 0, 2, -1);
  if ((a->positions != NULL) != (a->kind == AIOSPEC_KIND_PROMPT))
    return aiospec_set_error(e, AIOSPEC_E_POSITIONS, AIOSPEC_ARG_POSITIONS, -1, -1, (int64_t)a->kind, 0, 0, -1);
  if (has_lp) {
    const int64_t kmax = a->lp_width - 1 < AIOSPEC_MAX_TOPK ? a->lp_width - 1 : AIOSPEC_MAX_TOPK;
    const int64_t k = a->k == -1 ? a->lp_width - 1 : a->k;
    if (k < 0 || k > kmax) return aiospec_set_error(e, AIOSPEC_E_K, AIOSPEC_ARG_K, -1, -1, k, 0, kmax, -1);
  }
  return AIOSPEC_E_OK;
}

/* Every check of batch row i (after aiospec_check_args passed). Touches only row i's
 * elements and the logprob rows row i owns, so rows can be checked in parallel.
 *
 * The structural checks' words are loaded first, side by side, then tested: on a GPU each
 * load behind the branch on the one before is a round trip to memory of its own. Every load
 * is in bounds whatever the others hold (num_tokens, num_draft, flags, handles and positions
 * have a row per batch row, lp_offsets rows + 1). The tests combine without short-circuits, so
 * no load waits for a branch; only a row that fails one runs them again in order, to name the
 * first failing check. */
AIOSPEC_HD int aiospec_check_row(const aiospec_emit_args* a, int64_t i, aiospec_error* e) {
  const int has_lp = a->lp_ids != NULL;
  const int64_t nt = a->num_tokens[i];
  const int64_t nd = a->num_draft != NULL ? a->num_draft[i] : 0;
  const int64_t fl = a->flags != NULL ? a->flags[i] : 0;
  const int64_t h = a->handles[i];
  const int64_t lp0 = has_lp ? a->lp_offsets[i] : 0;
  const int64_t lp1 = has_lp ? a->lp_offsets[i + 1] : 0;
  const int64_t p = a->positions != NULL ? aiospec_load_int(a->positions, a->positions_i64, i) : 0;
  const int record = nt > 0 || fl != 0 || nd > 0;
  const int64_t n = a->lp_rows;
  const int ok = (nt >= 0) & (nt <= a->max_tokens) &
                 ((a->num_draft == NULL) | ((nd >= 0) & (nd <= a->max_draft))) &
                 ((fl & ~(int64_t)AIOSPEC_FLAG_MASK) == 0) & !(record & (h < 0)) &
                 (!has_lp | ((lp0 >= 0) & (lp0 <= n) & (lp1 >= lp0) & (lp1 <= n) & (lp1 - lp0 >= nt))) &
                 !(record & (a->positions != NULL) & ((p < 0) | (p > INT32_MAX)));
  if (!ok) {
    if (nt < 0 || nt > a->max_tokens)
      return aiospec_set_error(e, AIOSPEC_E_COUNT, AIOSPEC_ARG_NUM_TOKENS, i, -1, nt, 0, a->max_tokens,
                               AIOSPEC_CHECK_NUM_TOKENS);
    if (a->num_draft != NULL && (nd < 0 || nd > a->max_draft))
      return aiospec_set_error(e, AIOSPEC_E_COUNT, AIOSPEC_ARG_NUM_DRAFT, i, -1, nd, 0, a->max_draft,
                               AIOSPEC_CHECK_NUM_DRAFT);
    if (fl & ~(int64_t)AIOSPEC_FLAG_MASK)
      return aiospec_set_error(e, AIOSPEC_E_FLAGS, AIOSPEC_ARG_FLAGS, i, -1, fl, 0, AIOSPEC_FLAG_MASK,
                               AIOSPEC_CHECK_FLAGS);
    if (record && h < 0)
      return aiospec_set_error(e, AIOSPEC_E_HANDLE, AIOSPEC_ARG_HANDLES, i, -1, h, 0, INT64_MAX,
                               AIOSPEC_CHECK_HANDLE);
    if (has_lp) {
      /* For i > 0 row i - 1 already reports a bad lp_offsets[i] (with its own lower bound,
       * and first in the order); checking it again here keeps a parallel checker in bounds. */
      if (lp0 < 0 || lp0 > n) {
        aiospec_set_error(e, AIOSPEC_E_OFFSET, AIOSPEC_ARG_LP_OFFSETS, i, -1, lp0, 0, n, AIOSPEC_CHECK_LP_OFFSETS);
        e->brow = (int32_t)i;
        return e->code;
      }
      if (lp1 < lp0 || lp1 > n) {
        aiospec_set_error(e, AIOSPEC_E_OFFSET, AIOSPEC_ARG_LP_OFFSETS, i + 1, -1, lp1, lp0, n,
                          AIOSPEC_CHECK_LP_OFFSETS);
        e->brow = (int32_t)i;
        return e->code;
      }
      if (lp1 - lp0 < nt)
        return aiospec_set_error(e, AIOSPEC_E_SPAN, AIOSPEC_ARG_LP_OFFSETS, i, -1, lp1 - lp0, nt, INT64_MAX,
                                 AIOSPEC_CHECK_LP_SPAN);
    }
    if (record && a->positions != NULL && (p < 0 || p > INT32_MAX))
      return aiospec_set_error(e, AIOSPEC_E_POSITION, AIOSPEC_ARG_POSITIONS, i, -1, p, 0, INT32_MAX,
                               AIOSPEC_CHECK_POSITIONS);
  }
  if (a->token_ids_i64) {
    const int64_t* t = (const int64_t*)a->token_ids + aiospec_token_row(a, i);
    for (int64_t j = 0; j < nt; ++j) {
      if (!aiospec_fits_i32(t[j]))
        return aiospec_set_error(e, AIOSPEC_E_ID, AIOSPEC_ARG_TOKEN_IDS, i, j, t[j], INT32_MIN, INT32_MAX,
                                 AIOSPEC_CHECK_TOKEN_IDS);
    }
  }
  if (nd > 0 && a->draft_ids_i64) {
    const int64_t* t = (const int64_t*)a->draft_ids + aiospec_draft_row(a, i);
    for (int64_t j = 0; j < nd; ++j) {
      if (!aiospec_fits_i32(t[j]))
        return aiospec_set_error(e, AIOSPEC_E_ID, AIOSPEC_ARG_DRAFT_IDS, i, j, t[j], INT32_MIN, INT32_MAX,
                                 AIOSPEC_CHECK_DRAFT_IDS);
    }
  }
  if (a->lp_ids != NULL && (a->lp_ranks_i64 || a->lp_ids_i64)) {
    const int64_t k = (int64_t)aiospec_frame_k(a);
    for (int64_t r = lp0; r < lp0 + nt; ++r) {
      if (a->lp_ranks_i64) {
        const int64_t v = ((const int64_t*)a->lp_ranks)[r];
        if (!aiospec_fits_i32(v)) {
          aiospec_set_error(e, AIOSPEC_E_ID, AIOSPEC_ARG_LP_RANKS, r, -1, v, INT32_MIN, INT32_MAX,
                            AIOSPEC_CHECK_LP);
          e->brow = (int32_t)i;
          return e->code;
        }
      }
      if (a->lp_ids_i64) {
        const int64_t* ids = (const int64_t*)a->lp_ids + aiospec_lp_ids_row(a, r);
        for (int64_t c = 1; c <= k; ++c) {
          if (!aiospec_fits_i32(ids[c])) {
            aiospec_set_error(e, AIOSPEC_E_ID, AIOSPEC_ARG_LP_IDS, r, c, ids[c], INT32_MIN, INT32_MAX,
                              AIOSPEC_CHECK_LP);
            e->brow = (int32_t)i;
            return e->code;
          }
        }
      }
    }
  }
  return AIOSPEC_E_OK;
}

/* ---- frame layout ------------------------------------------------------------------------ */

/* AIOSPEC_NUM_COLUMNS (15) is payload.h's; the order is aiospec._payload_layout.COLUMNS */
enum aiospec_column {
  AIOSPEC_COL_HANDLES = 0,
  AIOSPEC_COL_FLAGS = 1,
  AIOSPEC_COL_POSITIONS = 2,
  AIOSPEC_COL_TOKEN_OFFSETS = 3,
  AIOSPEC_COL_TOKEN_IDS = 4,
  AIOSPEC_COL_SAMPLED_POS = 5,
  AIOSPEC_COL_DRAFT_OFFSETS = 6,
  AIOSPEC_COL_DRAFT_IDS = 7,
  AIOSPEC_COL_LOGPROBS = 8,
  AIOSPEC_COL_RANKS = 9,
  AIOSPEC_COL_TOPK_IDS = 10,
  AIOSPEC_COL_TOPK_LOGPROBS = 11,
  AIOSPEC_COL_EXCEPTION_IDS = 12,
  AIOSPEC_COL_EXCEPTION_LOGPROBS = 13,
  AIOSPEC_COL_EXCEPTION_RANKS = 14
};

typedef struct aiospec_frame_layout {
  uint64_t r, t, d, e;                     /* records, tokens, draft ids, exceptions */
  uint32_t k;                              /* top-k columns (0 without logprobs) */
  uint32_t fflags;                         /* AIOSPEC_FRAME_* bits */
  uint32_t nt, nd;                         /* tokens / draft ids per record when uniform, else 0 */
  uint64_t off[AIOSPEC_NUM_COLUMNS];       /* byte offset of each column, 0 = absent */
  uint64_t payload_len;                    /* multiple of 8 */
  uint64_t frame_size;                     /* align(FRAME_HEADER + payload_len, FRAME_ALIGN) */
} aiospec_frame_layout;

AIOSPEC_HD uint64_t aiospec_align(uint64_t n, uint64_t a) { return (n + a - 1) & ~(a - 1); }

/* Bytes per element of column c (u64 handles, u8 flags and sampled_pos, 4 otherwise). */
AIOSPEC_HD uint64_t aiospec_column_size(int c) {
  return c == AIOSPEC_COL_HANDLES ? 8u : (c == AIOSPEC_COL_FLAGS || c == AIOSPEC_COL_SAMPLED_POS) ? 1u : 4u;
}

/* Elements of column c of a frame (0 when absent: check off[c]). */
AIOSPEC_HD uint64_t aiospec_column_count(const aiospec_frame_layout* lay, int c) {
  switch (c) {
    case AIOSPEC_COL_HANDLES: case AIOSPEC_COL_FLAGS: case AIOSPEC_COL_POSITIONS: return lay->r;
    case AIOSPEC_COL_TOKEN_OFFSETS: case AIOSPEC_COL_DRAFT_OFFSETS: return lay->r + 1;
    case AIOSPEC_COL_TOKEN_IDS: case AIOSPEC_COL_SAMPLED_POS: case AIOSPEC_COL_LOGPROBS: case AIOSPEC_COL_RANKS:
      return lay->t;
    case AIOSPEC_COL_DRAFT_IDS: return lay->d;
    case AIOSPEC_COL_TOPK_IDS: case AIOSPEC_COL_TOPK_LOGPROBS: return lay->t * lay->k;
    default: return lay->e;
  }
}

/* Canonical column offsets (docs/wire-format.md section 4), same as _codec.frame_layout.
 * fflags: AIOSPEC_FRAME_HAS_LOGPROBS, _UNIFORM_TOKENS (nt tokens per record), _UNIFORM_DRAFTS
 * (nd draft ids per record; only with d > 0) and _LOGPROBS_PROCESSED, as the writer chose them
 * by the format's rule; e counts only with sampled_pos; prompt: the positions column. */
AIOSPEC_HD void aiospec_compute_layout(uint64_t r, uint64_t t, uint64_t d, uint64_t e, uint32_t k, uint32_t fflags,
                                       uint32_t nt, uint32_t nd, int prompt, aiospec_frame_layout* out) {
  const int has_lp = (fflags & AIOSPEC_FRAME_HAS_LOGPROBS) != 0;
  const int sp = aiospec_uses_sampled_pos(k, has_lp);
  out->r = r;
  out->t = t;
  out->d = d;
  out->k = has_lp ? k : 0;
  out->e = sp ? e : 0;
  out->fflags = fflags;
  out->nt = (fflags & AIOSPEC_FRAME_UNIFORM_TOKENS) ? nt : 0;
  out->nd = (fflags & AIOSPEC_FRAME_UNIFORM_DRAFTS) ? nd : 0;
  const int present[AIOSPEC_NUM_COLUMNS] = {
      1,
      1,
      prompt,
      !(fflags & AIOSPEC_FRAME_UNIFORM_TOKENS),
      !sp,
      sp,
      d > 0 && !(fflags & AIOSPEC_FRAME_UNIFORM_DRAFTS),
      d > 0,
      has_lp && !sp,
      has_lp && !sp,
      has_lp && k > 0,
      has_lp && k > 0,
      sp && e > 0,
      sp && e > 0,
      sp && e > 0,
  };
  uint64_t pos = AIOSPEC_HEADER_SPACE;
  /* unrolled on the device: constant indices keep the layout in registers, not on the stack */
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) {
    if (!present[c]) {
      out->off[c] = 0;
      continue;
    }
    out->off[c] = pos;
    pos = aiospec_align(pos + aiospec_column_count(out, c) * aiospec_column_size(c), AIOSPEC_COLUMN_ALIGN);
  }
  out->payload_len = pos;
  out->frame_size = aiospec_align(AIOSPEC_FRAME_HEADER + pos, AIOSPEC_FRAME_ALIGN);
}

/* The frame flags of a step whose records have counts in [nt_min, nt_max] (tokens) and
 * [nd_min, nd_max] (draft ids), r records (r = 0: uniform), d draft ids in all. */
AIOSPEC_HD uint32_t aiospec_frame_flags(const aiospec_emit_args* a, uint64_t r, uint64_t d, int64_t nt_min,
                                        int64_t nt_max, int64_t nd_min, int64_t nd_max) {
  uint32_t f = 0;
  if (aiospec_has_logprobs(a)) {
    f |= AIOSPEC_FRAME_HAS_LOGPROBS;
    if (a->logprobs_processed) f |= AIOSPEC_FRAME_LOGPROBS_PROCESSED;
  }
  if (r == 0 || nt_min == nt_max) f |= AIOSPEC_FRAME_UNIFORM_TOKENS;
  if (d > 0 && nd_min == nd_max) f |= AIOSPEC_FRAME_UNIFORM_DRAFTS;
  return f;
}

/* ---- msgpack header ---------------------------------------------------------------------- */

AIOSPEC_HD void aiospec_put_be32(uint8_t* p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

/* Writes the HEADER_SPACE (152) bytes at the start of a payload: the 147-byte msgpack
 * array16 of 28 fixed-width integers (docs/wire-format.md section 4) and 5 zero bytes.
 * The caller guarantees payload_len fits u32 (it is <= max_record). */
AIOSPEC_HD void aiospec_write_header(uint8_t* dst, const aiospec_frame_layout* lay, uint32_t producer, uint64_t step,
                                     uint32_t kind) {
  uint32_t v[AIOSPEC_HEADER_FIELDS];
  v[AIOSPEC_HF_VERSION] = AIOSPEC_PAYLOAD_VERSION;
  v[AIOSPEC_HF_PRODUCER] = producer;
  v[AIOSPEC_HF_STEP] = 0; /* written as u64 below */
  v[AIOSPEC_HF_KIND] = kind;
  v[AIOSPEC_HF_FFLAGS] = lay->fflags;
  v[AIOSPEC_HF_K] = lay->k;
  v[AIOSPEC_HF_R] = (uint32_t)lay->r;
  v[AIOSPEC_HF_T] = (uint32_t)lay->t;
  v[AIOSPEC_HF_D] = (uint32_t)lay->d;
  v[AIOSPEC_HF_E] = (uint32_t)lay->e;
  v[AIOSPEC_HF_NT] = lay->nt;
  v[AIOSPEC_HF_ND] = lay->nd;
  for (int c = 0; c < AIOSPEC_NUM_COLUMNS; ++c) v[AIOSPEC_HF_COLUMNS + c] = (uint32_t)lay->off[c];
  v[AIOSPEC_HF_PAYLOAD_LEN] = (uint32_t)lay->payload_len;
  uint8_t* p = dst;
  *p++ = 0xdc;
  *p++ = 0x00;
  *p++ = AIOSPEC_HEADER_FIELDS;
  for (int i = 0; i < AIOSPEC_HEADER_FIELDS; ++i) {
    if (i == AIOSPEC_HF_STEP) {
      *p++ = 0xcf;
      aiospec_put_be32(p, (uint32_t)(step >> 32));
      aiospec_put_be32(p + 4, (uint32_t)step);
      p += 8;
    } else {
      *p++ = 0xce;
      aiospec_put_be32(p, v[i]);
      p += 4;
    }
  }
  while (p < dst + AIOSPEC_HEADER_SPACE) *p++ = 0;
}

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ---- messages (host only) ------------------------------------------------------------------ */
#if !defined(__CUDA_ARCH__)
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Formats `e` into buf (always NUL-terminated); returns the length snprintf reports. The
 * formats are mirrored, character for character, by aiospec/ops/_errors.py. */
static inline int aiospec_format_error(const aiospec_error* e, char* buf, size_t size) {
  const char* name = aiospec_arg_name(e->arg);
  char where[96];
  if (e->row >= 0 && e->col >= 0)
    snprintf(where, sizeof where, "%s[%lld, %lld]", name, (long long)e->row, (long long)e->col);
  else if (e->row >= 0)
    snprintf(where, sizeof where, "%s[%lld]", name, (long long)e->row);
  else
    snprintf(where, sizeof where, "%s", name);
  const long long v = (long long)e->value, lo = (long long)e->lo, hi = (long long)e->hi;
  switch (e->code) {
    case AIOSPEC_E_OK:
      return snprintf(buf, size, "ok");
    case AIOSPEC_E_MISSING:
      if (e->value == AIOSPEC_ARG_NONE) return snprintf(buf, size, "%s: required", name);
      return snprintf(buf, size, "%s: required when %s is given", name, aiospec_arg_name((int32_t)e->value));
    case AIOSPEC_E_DIM:
      return snprintf(buf, size, "%s = %lld: expected %lld..%lld", where, v, lo, hi);
    case AIOSPEC_E_KIND:
      return snprintf(buf, size, "kind = %lld: expected 0 (target), 1 (draft) or 2 (prompt)", v);
    case AIOSPEC_E_K:
      return snprintf(buf, size, "k = %lld: expected 0..%lld (%s)", v, hi,
                      hi == AIOSPEC_MAX_TOPK ? "MAX_TOPK" : "lp_ids width - 1");
    case AIOSPEC_E_COUNT:
      return snprintf(buf, size, "%s = %lld: expected 0..%lld (%s)", where, v, hi,
                      e->arg == AIOSPEC_ARG_NUM_DRAFT ? "max_draft" : "max_tokens");
    case AIOSPEC_E_FLAGS:
      return snprintf(buf, size, "%s = %lld: expected bits within 0x%llx (FLAG_MASK)", where, v, hi);
    case AIOSPEC_E_HANDLE:
      return snprintf(buf, size, "%s = %lld: expected >= 0 (the row makes a record)", where, v);
    case AIOSPEC_E_OFFSET:
      return snprintf(buf, size, "%s = %lld: expected %lld..%lld (non-decreasing, at most lp_rows)", where, v, lo,
                      hi);
    case AIOSPEC_E_SPAN:
      return snprintf(buf, size,
                      "lp_offsets[%lld] - lp_offsets[%lld] = %lld: expected >= %lld (num_tokens[%lld])",
                      (long long)e->row + 1, (long long)e->row, v, lo, (long long)e->row);
    case AIOSPEC_E_ID:
      return snprintf(buf, size, "%s = %lld: expected %lld..%lld (int32)", where, v, lo, hi);
    case AIOSPEC_E_FRAME_SIZE:
      return snprintf(buf, size, "frame = %lld bytes: expected at most %lld (the ring's max_record)", v, hi);
    case AIOSPEC_E_POSITIONS:
      if (e->value == AIOSPEC_KIND_PROMPT) return snprintf(buf, size, "positions: required when kind = 2 (prompt)");
      return snprintf(buf, size,
                      "positions: given with kind = %lld, expected none (only prompt frames, kind = 2, carry positions)", v);
    case AIOSPEC_E_POSITION:
      return snprintf(buf, size, "%s = %lld: expected %lld..%lld (a prompt position)", where, v, lo, hi);
    default:
      return snprintf(buf, size, "unknown error code %d (arg %d)", (int)e->code, (int)e->arg);
  }
}

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* !__CUDA_ARCH__ */

#endif /* AIOSPEC_EMIT_H_ */
