// aiospec._speedups: the join of a chat chunk's logprobs JSON (aiospec/openai/_logprobs.py).
//
// ChatLogprobsFormatter.format_json builds `{"content":[...]}` from JSON pieces encoded once per
// token id (the `_Fragments` maps of a tokenizer's `_TokenCache`) and the floats that msgspec
// encoded for the chunk. In Python that join is a dozen list slice assignments and a bytes join
// per chunk; here it is one pass over the ids that looks the pieces up and one copy into the
// result. The output is byte for byte the Python path's (tests/test_speedups.py compares them).
// Stateless; every buffer, shape and piece is checked before use.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

// Bumped whenever a signature or a semantic changes: aiospec/openai/_logprobs.py ignores a stale build.
#define SPEEDUPS_ABI 1

typedef struct {
  const char* p;
  Py_ssize_t n;
} span;

// An int32 buffer of `ndim` dimensions (any strides), named `name` in errors.
static int get_i32(PyObject* obj, Py_buffer* view, int ndim, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s is %.100s: expected an int32 array", name, Py_TYPE(obj)->tp_name);
    return -1;
  }
  const char* f = view->format ? view->format : "B";
  size_t fl = strlen(f);
  int native = fl == 1 || (fl == 2 && (f[0] == '@' || f[0] == '=' || f[0] == '<'));
  if (view->ndim != ndim || view->itemsize != 4 || !native || f[fl - 1] != 'i') {
    PyErr_Format(PyExc_ValueError, "%s has format %s, %d dimension(s): expected int32 with %d", name, f,
                 view->ndim, ndim);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

static inline int32_t at1(const Py_buffer* v, Py_ssize_t i) {
  return *(const int32_t*)((const char*)v->buf + i * v->strides[0]);
}
static inline int32_t at2(const Py_buffer* v, Py_ssize_t i, Py_ssize_t j) {
  return *(const int32_t*)((const char*)v->buf + i * v->strides[0] + j * v->strides[1]);
}

// map[key] as a new reference to bytes; a miss goes through the map's __missing__.
static PyObject* piece(PyObject* map, PyObject* key, const char* name) {
  PyObject* v = PyDict_GetItemWithError(map, key);
  if (v != NULL) {
    Py_INCREF(v);
  } else {
    if (PyErr_Occurred()) return NULL;
    v = PyObject_GetItem(map, key);
    if (v == NULL) return NULL;
  }
  if (!PyBytes_Check(v)) {
    PyErr_Format(PyExc_TypeError, "%s[%R] is %.100s: expected bytes", name, key, Py_TYPE(v)->tp_name);
    Py_DECREF(v);
    return NULL;
  }
  return v;
}

// head[id] and tail[id] into *h and *t, their references into held[0..1].
static int pair(PyObject* head, PyObject* tail, const char* tail_name, int32_t id, span* h, span* t,
                PyObject** held) {
  PyObject* key = PyLong_FromLong(id);
  if (key == NULL) return -1;
  PyObject* a = piece(head, key, "head");
  PyObject* b = a ? piece(tail, key, tail_name) : NULL;
  Py_DECREF(key);
  if (b == NULL) {
    Py_XDECREF(a);
    return -1;
  }
  held[0] = a;
  held[1] = b;
  *h = (span){PyBytes_AS_STRING(a), PyBytes_GET_SIZE(a)};
  *t = (span){PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b)};
  return 0;
}

static const char OPEN[] = "{\"content\":[";
static const char CLOSE[] = "]}";

// chat_logprobs(ids, top_ids, n, floats, null_as, head, main, top, top_last, main_bare) -> bytes
static PyObject* chat_logprobs(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError, "chat_logprobs() takes 10 arguments (%zd given)", nargs);
    return NULL;
  }
  Py_ssize_t n = PyLong_AsSsize_t(args[2]);
  if (n == -1 && PyErr_Occurred()) return NULL;
  const char* names[5] = {"head", "main", "top", "top_last", "main_bare"};
  for (int i = 0; i < 5; i++) {
    PyObject* m = args[5 + i];
    int needed = n ? i < 4 : (i == 0 || i == 4);
    if (needed && !PyDict_Check(m)) {
      PyErr_Format(PyExc_TypeError, "%s is %.100s: expected a dict of token id -> bytes", names[i],
                   Py_TYPE(m)->tp_name);
      return NULL;
    }
  }
  Py_buffer ids = {0}, tids = {0}, fl = {0};
  span* pieces = NULL;
  PyObject** held = NULL;
  Py_ssize_t nheld = 0;
  PyObject* out = NULL;
  if (get_i32(args[0], &ids, 1, "ids") < 0) return NULL;
  Py_ssize_t m = ids.shape[0];
  if (m < 1) {
    PyErr_Format(PyExc_ValueError, "ids has %zd elements: expected at least 1", m);
    goto done;
  }
  if (n < 0 || n > 1024) {
    PyErr_Format(PyExc_ValueError, "n = %zd: expected 0..1024", n);
    goto done;
  }
  if (n) {
    if (get_i32(args[1], &tids, 2, "top_ids") < 0) goto done;
    if (tids.shape[0] != m || tids.shape[1] < n) {
      PyErr_Format(PyExc_ValueError, "top_ids has shape (%zd, %zd): expected (%zd, >= %zd)", tids.shape[0],
                   tids.shape[1], m, n);
      goto done;
    }
  }
  if (PyObject_GetBuffer(args[3], &fl, PyBUF_SIMPLE) < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "floats is %.100s: expected bytes (a JSON array)", Py_TYPE(args[3])->tp_name);
    goto done;
  }
  if (!PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) < 1) {
    PyErr_Format(PyExc_TypeError, "null_as is %.100s: expected non-empty bytes (the JSON of a number)",
                 Py_TYPE(args[4])->tp_name);
    goto done;
  }
  // msgspec writes NaN and the infinities as null: those values become null_as
  span floor = {PyBytes_AS_STRING(args[4]), PyBytes_GET_SIZE(args[4])};
  // per position: head, logprob, main; per alternative: head, logprob, top
  Py_ssize_t per = 3 + 3 * n, nf = m * (1 + n);
  if (m > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(span) / per) {
    PyErr_Format(PyExc_ValueError, "ids has %zd elements: too many for n = %zd", m, n);
    goto done;
  }
  pieces = PyMem_Malloc(sizeof(span) * (size_t)(m * per));
  held = PyMem_Malloc(sizeof(PyObject*) * (size_t)(m * 2 * (1 + n)));
  if (pieces == NULL || held == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  // the floats: the values of a JSON array, in order (logprobs, then the top-n's row by row)
  const char* s = fl.buf;
  Py_ssize_t len = fl.len, count = 0, start = 1;
  if (len < 2 || s[0] != '[' || s[len - 1] != ']') {
    PyErr_SetString(PyExc_ValueError, "floats is not a JSON array");
    goto done;
  }
  for (Py_ssize_t i = 1; i < len; i++) {
    if (s[i] != ',' && i != len - 1) continue;
    if (i == start || count == nf) {
      count = -1;
      break;
    }
    span sp = {s + start, i - start};
    if (sp.n == 4 && memcmp(sp.p, "null", 4) == 0) sp = floor;
    if (count < m) {
      pieces[count * per + 1] = sp;
    } else {  // n > 0 here: with n = 0 the loop stops at count == m
      Py_ssize_t r = (count - m) / n, j = (count - m) % n;
      pieces[r * per + 4 + 3 * j] = sp;
    }
    count++;
    start = i + 1;
  }
  if (count != nf) {
    PyErr_Format(PyExc_ValueError, "floats does not hold %zd values (m = %zd positions x (1 + n = %zd))", nf, m, n);
    goto done;
  }
  Py_ssize_t total = 0;
  for (Py_ssize_t i = 0; i < m; i++) {
    span* row = pieces + i * per;
    if (pair(args[5], args[n ? 6 : 9], n ? "main" : "main_bare", at1(&ids, i), row, row + 2, held + nheld) < 0)
      goto done;
    nheld += 2;
    for (Py_ssize_t j = 0; j < n; j++) {
      int last = j == n - 1;
      if (pair(args[5], args[last ? 8 : 7], last ? "top_last" : "top", at2(&tids, i, j), row + 3 + 3 * j,
               row + 5 + 3 * j, held + nheld) < 0)
        goto done;
      nheld += 2;
    }
    for (Py_ssize_t j = 0; j < per; j++) total += row[j].n;
  }
  span* lastp = &pieces[m * per - 1];
  if (lastp->n < 1 || lastp->p[lastp->n - 1] != ',') {
    PyErr_SetString(PyExc_ValueError, "the last piece of the content list does not end with a comma");
    goto done;
  }
  lastp->n -= 1;  // no comma after the last entry
  total -= 1;
  out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof(OPEN) - 1) + total + (Py_ssize_t)(sizeof(CLOSE) - 1));
  if (out == NULL) goto done;
  char* w = PyBytes_AS_STRING(out);
  memcpy(w, OPEN, sizeof(OPEN) - 1);
  w += sizeof(OPEN) - 1;
  for (Py_ssize_t i = 0; i < m * per; i++) {
    memcpy(w, pieces[i].p, (size_t)pieces[i].n);
    w += pieces[i].n;
  }
  memcpy(w, CLOSE, sizeof(CLOSE) - 1);
done:
  for (Py_ssize_t i = 0; i < nheld; i++) Py_DECREF(held[i]);
  PyMem_Free(held);
  PyMem_Free(pieces);
  if (fl.obj != NULL) PyBuffer_Release(&fl);
  if (tids.obj != NULL) PyBuffer_Release(&tids);
  PyBuffer_Release(&ids);
  return out;
}

static PyMethodDef methods[] = {
    {"chat_logprobs", (PyCFunction)(void (*)(void))chat_logprobs, METH_FASTCALL,
     "chat_logprobs(ids, top_ids, n, floats, null_as, head, main, top, top_last, main_bare) -> bytes: "
     "the JSON of a chat chunk's logprobs, joined from pre-encoded pieces."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiospec._speedups", "C joins of aiospec.openai (see aiospec/_speedups.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
  PyObject* m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  if (PyModule_AddIntConstant(m, "ABI", SPEEDUPS_ABI) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
