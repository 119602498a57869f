/* ember core: break-reason names, the compilation arena, arena-backed arrays, interned names.
 * Invariant: an arena is only ever freed whole; held PyObject references die with it. */
#include "core/em_core.h"

#if EM_PY313
#include "internal/pycore_dict.h" /* struct _dictvalues: is a split dict's storage its object's? */
#endif

#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *const break_names[] = {
#define EM_BREAK_NAME(name, text) #name,
    EM_BREAK_REASONS(EM_BREAK_NAME)
#undef EM_BREAK_NAME
};
static const char *const break_texts[] = {
#define EM_BREAK_TEXT(name, text) text,
    EM_BREAK_REASONS(EM_BREAK_TEXT)
#undef EM_BREAK_TEXT
};

const char *em_break_name(EmBreak b) { return (unsigned)b < EM_BREAK__COUNT ? break_names[b] : "?"; }
const char *em_break_text(EmBreak b) { return (unsigned)b < EM_BREAK__COUNT ? break_texts[b] : "?"; }

/* A bump allocator over a chain of blocks (QBE/LuaJIT style): allocation is a pointer bump,
 * freeing is one walk over the chain. Large requests get a block of their own. */
typedef struct ArenaBlock {
    struct ArenaBlock *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
} ArenaBlock;

struct EmArena {
    ArenaBlock *head;
    PyObject **held;
    size_t nheld, capheld;
};

enum { ARENA_BLOCK = 64 * 1024 };

EmArena *em_arena_new(void) { return calloc(1, sizeof(EmArena)); }

void em_arena_free(EmArena *a) {
    if (!a) return;
    for (size_t i = 0; i < a->nheld; i++) Py_DECREF(a->held[i]);
    free(a->held);
    for (ArenaBlock *b = a->head, *n; b; b = n) {
        n = b->next;
        free(b);
    }
    free(a);
}

void *em_arena_alloc(EmArena *a, size_t size) {
    size = (size + 15) & ~(size_t)15;
    ArenaBlock *b = a->head;
    if (!b || b->size - b->used < size) {
        size_t bs = size > ARENA_BLOCK / 4 ? size : ARENA_BLOCK;
        ArenaBlock *nb = malloc(sizeof(ArenaBlock) + bs);
        if (!nb) return NULL;
        nb->used = 0;
        nb->size = bs;
        if (b && bs != ARENA_BLOCK) { /* keep the current block as the bump target */
            nb->next = b->next;
            b->next = nb;
        } else {
            nb->next = b;
            a->head = nb;
        }
        b = nb;
    }
    void *p = b->data + b->used;
    b->used += size;
    memset(p, 0, size);
    return p;
}

void *em_arena_realloc(EmArena *a, void *p, size_t old_size, size_t new_size) {
    if (new_size <= old_size) return p;
    void *q = em_arena_alloc(a, new_size);
    if (q && p && old_size) memcpy(q, p, old_size);
    return q;
}

char *em_arena_strdup(EmArena *a, const char *s) {
    size_t n = strlen(s) + 1;
    char *p = em_arena_alloc(a, n);
    if (p) memcpy(p, s, n);
    return p;
}

PyObject *em_arena_hold_steal(EmArena *a, PyObject *obj) {
    if (!obj) return NULL;
    if (a->nheld == a->capheld) {
        size_t cap = a->capheld ? a->capheld * 2 : 64;
        PyObject **h = realloc(a->held, cap * sizeof(PyObject *));
        if (!h) {
            Py_DECREF(obj);
            return NULL;
        }
        a->held = h;
        a->capheld = cap;
    }
    a->held[a->nheld++] = obj;
    return obj;
}

PyObject *em_arena_hold(EmArena *a, PyObject *obj) {
    if (!obj) return NULL;
    return em_arena_hold_steal(a, Py_NewRef(obj));
}

int em_vec_grow(EmArena *a, void **items, uint32_t *cap, size_t elem, uint32_t need) {
    uint32_t nc = *cap ? *cap : 8;
    while (nc < need) nc *= 2;
    void *p = em_arena_realloc(a, *items, (size_t)*cap * elem, (size_t)nc * elem);
    if (!p) return -1;
    *items = p;
    *cap = nc;
    return 0;
}

/* Interned names for literal C strings. A small open-addressing table keyed by the literal's
 * address; entries are interned (hence shared and long-lived) str objects. ember supports one
 * interpreter (em_module.c declares it), so one process-wide table is per-interpreter state. */
enum { NAME_TABLE = 512 };
static struct {
    const char *key;
    PyObject *str;
} name_table[NAME_TABLE];

PyObject *em_str(const char *literal) {
    size_t h = ((uintptr_t)literal >> 3) & (NAME_TABLE - 1);
    for (size_t i = 0; i < NAME_TABLE; i++, h = (h + 1) & (NAME_TABLE - 1)) {
        if (name_table[h].key == literal) return name_table[h].str;
        if (!name_table[h].key) {
            PyObject *s = PyUnicode_InternFromString(literal);
            if (!s) return NULL;
            name_table[h].key = literal;
            name_table[h].str = s;
            return s;
        }
    }
    PyErr_SetString(PyExc_RuntimeError, "ember: interned-name table is full");
    return NULL;
}

PyObject *em_int64_tuple(int32_t n, const int64_t *v) {
    PyObject *t = PyTuple_New(n);
    for (int32_t i = 0; t && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

PyObject *em_lazy_attr(PyObject **slot, const char *module, const char *attr) {
    if (*slot) return *slot;
    PyObject *m = PyImport_ImportModule(module);
    if (!m) return NULL;
    *slot = PyObject_GetAttrString(m, attr);
    Py_DECREF(m);
    return *slot;
}

PyObject *em_attr_optional(PyObject *obj, PyObject *name) {
    PyObject *r = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyObject_GetOptionalAttr(obj, name, &r) < 0) return NULL;
#else
    if (_PyObject_LookupAttr(obj, name, &r) < 0) return NULL;
#endif
    return r;
}

PyObject *em_config_attr(const char *name) {
    static PyObject *config = NULL;
    PyObject *v = config || em_lazy_attr(&config, "ember._config", "config") ? PyObject_GetAttrString(config, name) : NULL;
    if (!v) PyErr_Clear();
    return v;
}

int em_config_bool(const char *name, int dflt) {
    PyObject *v = em_config_attr(name);
    int t = v ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    if (t < 0) {
        PyErr_Clear();
        return dflt;
    }
    return t;
}

uint32_t em_log_mask = 0;

static const char *const log_topic_names[EM_LOG__COUNT] = {
#define EM_LOG_NAME(name, text) text,
    EM_LOG_TOPICS(EM_LOG_NAME)
#undef EM_LOG_NAME
};

void em_log_emit_steal(uint32_t topic, PyObject *data) {
    static PyObject *emit = NULL; /* ember._logs._emit; one interpreter (em_module.c) */
    PyObject *exc_t, *exc_v, *exc_tb;
    PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
    int bit = 0;
    while (bit < EM_LOG__COUNT && !(topic & (1u << bit))) bit++;
    if (data && bit < EM_LOG__COUNT && em_lazy_attr(&emit, "ember._logs", "_emit")) {
        PyObject *r = PyObject_CallFunction(emit, "sO", log_topic_names[bit], data);
        Py_XDECREF(r);
    }
    if (PyErr_Occurred()) PyErr_WriteUnraisable(NULL);
    Py_XDECREF(data);
    PyErr_Restore(exc_t, exc_v, exc_tb);
}

double em_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int em_dict_values_embedded(PyObject *d) {
#if EM_PY313
    PyDictValues *v = ((PyDictObject *)d)->ma_values;
    return v != NULL && v->embedded;
#else
    EM_UNUSED(d);
    return 0;
#endif
}
