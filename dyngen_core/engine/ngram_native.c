/* The n-gram index of `dyngen_core.engine.speculation.NgramIndex`, compiled: the same keys,
 * the same table contents and so the same drafts, with an open-addressing table in place of a
 * dictionary of Python ints. Built on first use by `engine/ngram_native.py`.
 *
 * Keys: an n-gram's tokens, TOKEN_BITS bits each (token + 1), the newest lowest; the key of
 * the max_n-gram ending at a position holds every shorter suffix's key in its low bits. A slot
 * is one 128-bit word, the key above the value (the position after the n-gram's latest
 * occurrence, 32 bits), so that a lookup touches one cache line. Key 0 (the empty n-gram,
 * stored by the Python index at position 0 and never looked up) marks an empty slot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef unsigned __int128 u128;

#define TOKEN_BITS 21
#define TAIL 4
#define MAX_N 4 /* 4 * TOKEN_BITS = 84 bits, above a 32-bit value */
#define MIN_CAPACITY 64

typedef struct NgramIndexObject {
    PyObject_HEAD
    int max_n, min_n, n_masks;
    u128 masks[MAX_N]; /* longest first */
    u128 *slots; /* key << 32 | value; 0: empty */
    Py_ssize_t capacity, count; /* capacity: a power of two, or 0 before the first store */
    Py_ssize_t indexed;
    u128 key; /* the key of the max_n-gram ending at `indexed` (not in the table) */
    long tail[TAIL]; /* the last tokens indexed, to notice a rewind */
    int tail_length;
    struct NgramIndexObject *base;
} NgramIndexObject;

static PyTypeObject NgramIndexType;

static inline size_t slot_of(u128 key, size_t mask) {
    uint64_t x = (uint64_t)key ^ ((uint64_t)(key >> 64) * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ULL;
    x ^= x >> 32;
    return (size_t)x & mask;
}

static inline u128 key_of_slot(u128 slot) { return slot >> 32; }

static int32_t table_get(const NgramIndexObject *self, u128 key) {
    if (!self->capacity)
        return -1;
    size_t mask = (size_t)self->capacity - 1, i = slot_of(key, mask);
    for (;;) {
        u128 slot = self->slots[i];
        if (key_of_slot(slot) == key)
            return (int32_t)(uint32_t)slot;
        if (!slot)
            return -1;
        i = (i + 1) & mask;
    }
}

static int table_grow(NgramIndexObject *self) {
    Py_ssize_t capacity = self->capacity ? 2 * self->capacity : MIN_CAPACITY;
    u128 *slots = PyMem_Calloc((size_t)capacity, sizeof(u128));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = (size_t)capacity - 1;
    for (Py_ssize_t j = 0; j < self->capacity; j++) {
        u128 slot = self->slots[j];
        if (!slot)
            continue;
        size_t i = slot_of(key_of_slot(slot), mask);
        while (slots[i])
            i = (i + 1) & mask;
        slots[i] = slot;
    }
    PyMem_Free(self->slots);
    self->slots = slots;
    self->capacity = capacity;
    return 0;
}

/* Map `key` to `value`; -1 with MemoryError set when the table cannot grow. */
static int table_put(NgramIndexObject *self, u128 key, int32_t value) {
    if (2 * (self->count + 1) > self->capacity && table_grow(self) < 0)
        return -1;
    size_t mask = (size_t)self->capacity - 1, i = slot_of(key, mask);
    u128 entry = (key << 32) | (uint32_t)value;
    for (;;) {
        u128 slot = self->slots[i];
        if (!slot || key_of_slot(slot) == key) {
            self->count += !slot;
            self->slots[i] = entry;
            return 0;
        }
        i = (i + 1) & mask;
    }
}

static void forget_all(NgramIndexObject *self) {
    if (self->capacity)
        memset(self->slots, 0, (size_t)self->capacity * sizeof(u128));
    self->count = 0;
    self->indexed = 0;
    self->key = 0;
    self->tail_length = 0;
    Py_CLEAR(self->base);
}

static int token_at(PyObject *const *items, Py_ssize_t i, long *token) {
    *token = PyLong_AsLong(items[i]);
    return (*token == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int NgramIndex_init(NgramIndexObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"max_n", "min_n", "base", NULL};
    int max_n = 4, min_n = 1;
    PyObject *base = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|iiO", names, &max_n, &min_n, &base))
        return -1;
    if (!(1 <= min_n && min_n <= max_n)) {
        PyErr_Format(PyExc_ValueError,
                     "n-gram sizes must satisfy 1 <= min_n <= max_n; got min_n=%d, max_n=%d",
                     min_n, max_n);
        return -1;
    }
    if (max_n > MAX_N) {
        PyErr_Format(PyExc_ValueError, "the compiled n-gram index looks up at most %d tokens, "
                     "not max_n=%d", MAX_N, max_n);
        return -1;
    }
    NgramIndexObject *base_index = NULL;
    if (base != Py_None) {
        if (!PyObject_TypeCheck(base, &NgramIndexType)) {
            PyErr_SetString(PyExc_TypeError, "base must be a compiled NgramIndex");
            return -1;
        }
        base_index = (NgramIndexObject *)base;
        if (base_index->max_n != max_n || base_index->min_n != min_n) {
            PyErr_Format(PyExc_ValueError, "a base index must look up the same n-gram sizes: "
                         "its (%d, %d) against (%d, %d)", base_index->max_n,
                         base_index->min_n, max_n, min_n);
            return -1;
        }
    }
    forget_all(self);
    self->max_n = max_n;
    self->min_n = min_n;
    self->n_masks = max_n - min_n + 1;
    for (int n = max_n, j = 0; n >= min_n; n--, j++)
        self->masks[j] = (((u128)1) << (TOKEN_BITS * n)) - 1;
    if (base_index) {
        Py_INCREF(base_index);
        self->base = base_index;
        self->indexed = base_index->indexed;
        self->key = base_index->key;
        self->tail_length = base_index->tail_length;
        memcpy(self->tail, base_index->tail, sizeof(self->tail));
    }
    return 0;
}

static void NgramIndex_dealloc(NgramIndexObject *self) {
    PyMem_Free(self->slots);
    Py_XDECREF(self->base);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Whether history[indexed - tail_length : indexed] is the tail indexed last. */
static int tail_matches(NgramIndexObject *self, PyObject *const *items, int *matches) {
    Py_ssize_t first = self->indexed - self->tail_length;
    for (int j = 0; j < self->tail_length; j++) {
        long token;
        if (token_at(items, first + j, &token) < 0)
            return -1;
        if (token != self->tail[j]) {
            *matches = 0;
            return 0;
        }
    }
    *matches = 1;
    return 0;
}

/* The table entries a sync stores (slot words, in order), gathered for several indexes before
 * any is stored, so that their cache lines are fetched together. */
typedef struct {
    u128 *entries;
    Py_ssize_t used, capacity;
} Scratch;

static int scratch_reserve(Scratch *scratch, Py_ssize_t more) {
    Py_ssize_t need = scratch->used + more;
    if (need <= scratch->capacity)
        return 0;
    Py_ssize_t capacity = scratch->capacity ? scratch->capacity : 1024;
    while (capacity < need)
        capacity *= 2;
    u128 *entries = PyMem_Realloc(scratch->entries, (size_t)capacity * sizeof(u128));
    if (!entries) {
        PyErr_NoMemory();
        return -1;
    }
    scratch->entries = entries;
    scratch->capacity = capacity;
    return 0;
}

/* What a sync will leave: its entries (scratch->entries[first : first + count]) and the state
 * after them. */
typedef struct {
    Py_ssize_t first, count, indexed;
    u128 key;
    long tail[TAIL];
    int tail_length;
} SyncPlan;

/* The first half of a sync: start over after a rewind, read the tokens appended since the last
 * sync, gather their entries, grow the table for them and prefetch their slots. -1 on error
 * (a token out of range resets the index, as the Python index does). */
static int sync_plan(NgramIndexObject *self, PyObject *const *items, Py_ssize_t length,
                     Scratch *scratch, SyncPlan *plan) {
    int matches = 0;
    if (length >= self->indexed && tail_matches(self, items, &matches) < 0)
        return -1;
    if (!matches)
        forget_all(self);
    if (length > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a history of 2**31 tokens or more");
        return -1;
    }
    plan->first = scratch->used;
    plan->count = 0;
    plan->indexed = self->indexed;
    plan->key = self->key;
    plan->tail_length = self->tail_length;
    memcpy(plan->tail, self->tail, sizeof(plan->tail));
    Py_ssize_t fresh = length - self->indexed;
    if (fresh <= 0)
        return 0;
    if (scratch_reserve(scratch, fresh * self->n_masks) < 0)
        return -1;
    const long limit = (1L << TOKEN_BITS) - 1;
    const u128 full = self->masks[0];
    u128 key = self->key, *entries = scratch->entries + scratch->used;
    Py_ssize_t count = 0;
    for (Py_ssize_t end = self->indexed; end < length; end++) {
        for (int j = 0; j < self->n_masks; j++) {
            u128 k = key & self->masks[j];
            if (k)
                entries[count++] = (k << 32) | (uint32_t)end;
        }
        long token;
        if (token_at(items, end, &token) < 0)
            return -1;
        if (token < 0 || token >= limit) {
            forget_all(self);
            PyErr_Format(PyExc_ValueError, "token id %ld at position %zd is outside the n-gram "
                         "index's range [0, %ld)", token, end, limit);
            return -1;
        }
        key = ((key << TOKEN_BITS) | (u128)(token + 1)) & full;
    }
    while (2 * (self->count + count) > self->capacity)
        if (table_grow(self) < 0)
            return -1;
    size_t mask = (size_t)self->capacity - 1;
    for (Py_ssize_t i = 0; i < count; i++)
        __builtin_prefetch(&self->slots[slot_of(key_of_slot(entries[i]), mask)], 1);
    scratch->used += count;
    plan->count = count;
    plan->indexed = length;
    plan->key = key;
    plan->tail_length = length < TAIL ? (int)length : TAIL;
    for (int j = 0; j < plan->tail_length; j++)
        if (token_at(items, length - plan->tail_length + j, &plan->tail[j]) < 0)
            return -1;
    return 0;
}

/* The second half: store the entries (the table has room for them) and take the new state. */
static int sync_commit(NgramIndexObject *self, const Scratch *scratch, const SyncPlan *plan) {
    const u128 *entries = scratch->entries + plan->first;
    for (Py_ssize_t i = 0; i < plan->count; i++)
        if (table_put(self, key_of_slot(entries[i]), (int32_t)(uint32_t)entries[i]) < 0)
            return -1;
    self->indexed = plan->indexed;
    self->key = plan->key;
    self->tail_length = plan->tail_length;
    memcpy(self->tail, plan->tail, sizeof(self->tail));
    return 0;
}

static PyObject *NgramIndex_sync(NgramIndexObject *self, PyObject *history) {
    PyObject *seq = PySequence_Fast(history, "history must be a sequence of token ids");
    if (!seq)
        return NULL;
    Scratch scratch = {NULL, 0, 0};
    SyncPlan plan;
    int failed = sync_plan(self, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq),
                           &scratch, &plan) < 0 || sync_commit(self, &scratch, &plan) < 0;
    PyMem_Free(scratch.entries);
    Py_DECREF(seq);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static void prefetch_lookup(const NgramIndexObject *self, u128 key) {
    if (self->capacity)
        __builtin_prefetch(&self->slots[slot_of(key & self->masks[0],
                                                (size_t)self->capacity - 1)], 0);
}

/* Up to k draft tokens after the history `items` (a new list; see NgramIndex.propose). */
static PyObject *propose(NgramIndexObject *self, PyObject *const *items, Py_ssize_t length,
                         Py_ssize_t k) {
    if (k <= 0 || length < self->min_n)
        return PyList_New(0);
    u128 key = self->key;
    if (length != self->indexed) { /* the key of the last max_n tokens */
        key = 0;
        Py_ssize_t first = length > self->max_n ? length - self->max_n : 0;
        for (Py_ssize_t i = first; i < length; i++) {
            long token;
            if (token_at(items, i, &token) < 0)
                return NULL;
            key = (key << TOKEN_BITS) | (u128)(token + 1);
        }
    }
    for (int j = 0; j < self->n_masks; j++) {
        u128 k_j = key & self->masks[j];
        int32_t start = table_get(self, k_j);
        if (start < 0 && self->base)
            start = table_get(self->base, k_j);
        if (start < 0)
            continue;
        /* Past the end, the continuation repeats with period length - start. */
        Py_ssize_t period = length - start;
        if (period <= 0)
            break;
        PyObject *out = PyList_New(k);
        if (!out)
            return NULL;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *token = items[start + (i < period ? i : i % period)];
            Py_INCREF(token);
            PyList_SET_ITEM(out, i, token);
        }
        return out;
    }
    return PyList_New(0);
}

static PyObject *NgramIndex_propose(NgramIndexObject *self, PyObject *const *args,
                                    Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "propose(history, k) takes two arguments");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "history must be a sequence of token ids");
    if (!seq)
        return NULL;
    PyObject *out = propose(self, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), k);
    Py_DECREF(seq);
    return out;
}

static PyObject *NgramIndex_get_indexed(NgramIndexObject *self, void *closure) {
    return PyLong_FromSsize_t(self->indexed);
}

static PyObject *NgramIndex_get_max_n(NgramIndexObject *self, void *closure) {
    return PyLong_FromLong(self->max_n);
}

static PyObject *NgramIndex_get_min_n(NgramIndexObject *self, void *closure) {
    return PyLong_FromLong(self->min_n);
}

static PyObject *NgramIndex_get_nbytes(NgramIndexObject *self, void *closure) {
    return PyLong_FromSsize_t(self->capacity * (Py_ssize_t)sizeof(u128));
}

static PyMethodDef NgramIndex_methods[] = {
    {"sync", (PyCFunction)NgramIndex_sync, METH_O,
     "Index the tokens appended since the last call (a rewound history afresh)."},
    {"propose", (PyCFunction)(void (*)(void))NgramIndex_propose, METH_FASTCALL,
     "Up to k draft tokens after history (which sync has indexed)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NgramIndex_getset[] = {
    {"indexed", (getter)NgramIndex_get_indexed, NULL, "Leading tokens indexed.", NULL},
    {"max_n", (getter)NgramIndex_get_max_n, NULL, "The longest suffix looked up.", NULL},
    {"min_n", (getter)NgramIndex_get_min_n, NULL, "The shortest suffix looked up.", NULL},
    {"nbytes", (getter)NgramIndex_get_nbytes, NULL, "Bytes of the index's own table.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NgramIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dyngen_ngram_native.NgramIndex",
    .tp_doc = "Prompt-lookup drafts for one job (see dyngen_core.engine.speculation.NgramIndex).",
    .tp_basicsize = sizeof(NgramIndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NgramIndex_init,
    .tp_dealloc = (destructor)NgramIndex_dealloc,
    .tp_methods = NgramIndex_methods,
    .tp_getset = NgramIndex_getset,
};

/* One request of propose_all: its job's index (a new reference; NULL: none yet), its history
 * (a new reference), the draft length and its sync's plan. */
typedef struct {
    NgramIndexObject *index;
    PyObject *history;
    Py_ssize_t length;
    SyncPlan plan;
} Request;

/* The first pass of propose_all: one request's index and history, and its sync's plan (the
 * slots its sync stores and its lookup reads prefetched). */
static int plan_request(PyObject *indexes, PyObject *request, Scratch *scratch, Request *out) {
    if (!PyTuple_Check(request) || PyTuple_GET_SIZE(request) < 4) {
        PyErr_SetString(PyExc_TypeError, "a request is a DraftRequest tuple");
        return -1;
    }
    PyObject *index = PyDict_GetItemWithError(indexes, PyTuple_GET_ITEM(request, 0));
    if (!index)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyObject_TypeCheck(index, &NgramIndexType)) {
        PyErr_SetString(PyExc_TypeError, "indexes must hold compiled NgramIndex objects");
        return -1;
    }
    out->length = PyLong_AsSsize_t(PyTuple_GET_ITEM(request, 3));
    if (out->length == -1 && PyErr_Occurred())
        return -1;
    out->history = PySequence_Fast(PyTuple_GET_ITEM(request, 1),
                                   "history must be a sequence of token ids");
    if (!out->history)
        return -1;
    Py_INCREF(index);
    out->index = (NgramIndexObject *)index;
    if (sync_plan(out->index, PySequence_Fast_ITEMS(out->history),
                  PySequence_Fast_GET_SIZE(out->history), scratch, &out->plan) < 0)
        return -1;
    prefetch_lookup(out->index, out->plan.key);
    return 0;
}

/* The second pass: store the sync, look the draft up, as draft_type((tokens, None)). */
static PyObject *draft_of(PyTypeObject *draft_type, const Scratch *scratch, Request *request) {
    if (sync_commit(request->index, scratch, &request->plan) < 0)
        return NULL;
    PyObject *tokens = propose(request->index, PySequence_Fast_ITEMS(request->history),
                               PySequence_Fast_GET_SIZE(request->history), request->length);
    if (!tokens)
        return NULL;
    PyObject *draft = draft_type->tp_alloc(draft_type, 2);
    if (!draft) {
        Py_DECREF(tokens);
        return NULL;
    }
    PyTuple_SET_ITEM(draft, 0, tokens);
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(draft, 1, Py_None);
    return draft;
}

/* propose_all(indexes, requests, draft_type): see speculation.propose_all. Every request's
 * sync is planned before any is stored, so that the cache misses of the step's table reads and
 * writes overlap; one request per job. */
static PyObject *propose_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyType_Check(args[2]) ||
        !PyType_IsSubtype((PyTypeObject *)args[2], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "propose_all(indexes: dict, requests, draft_type: a tuple type)");
        return NULL;
    }
    PyTypeObject *draft_type = (PyTypeObject *)args[2];
    PyObject *seq = PySequence_Fast(args[1], "requests must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Scratch scratch = {NULL, 0, 0};
    Request *requests = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Request));
    PyObject *out = requests ? PyList_New(count) : PyErr_NoMemory();
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++)
        if (plan_request(args[0], PySequence_Fast_ITEMS(seq)[i], &scratch, &requests[i]) < 0)
            goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *draft = requests[i].index ? draft_of(draft_type, &scratch, &requests[i])
                                            : Py_NewRef(Py_None);
        if (!draft)
            goto fail;
        PyList_SET_ITEM(out, i, draft);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; requests && i < count; i++) {
        Py_XDECREF(requests[i].index);
        Py_XDECREF(requests[i].history);
    }
    PyMem_Free(requests);
    PyMem_Free(scratch.entries);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef module_methods[] = {
    {"propose_all", (PyCFunction)(void (*)(void))propose_all, METH_FASTCALL,
     "Sync and propose for every request whose job has an index (None for the others)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dyngen_ngram_native",
    "The compiled n-gram index (see dyngen_core.engine.ngram_native).", -1, module_methods,
};

PyMODINIT_FUNC PyInit_dyngen_ngram_native(void) {
    if (PyType_Ready(&NgramIndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&NgramIndexType);
    if (PyModule_AddObject(m, "NgramIndex", (PyObject *)&NgramIndexType) < 0) {
        Py_DECREF(&NgramIndexType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_N", MAX_N) < 0 ||
        PyModule_AddIntConstant(m, "TAIL", TAIL) < 0 ||
        PyModule_AddIntConstant(m, "TOKEN_BITS", TOKEN_BITS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
