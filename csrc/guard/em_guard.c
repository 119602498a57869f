/* guard: the builder (compile time, arena), the compact guard set (malloc) and its evaluation.
 * Invariant: em_guard_check returns 1 only if every leaf passed on values reached from this frame,
 * and it leaves no new reference behind except the fetched values it hands to the caller.
 *
 * Design. The tracer adds sources (paths from the frame) and leaf guards on them to a builder;
 * em_guard_build compacts them into one malloc block (em_guard_impl.h):
 *  - sources nothing uses are dropped; a stable source keeps its compile-time object, so fetching
 *    it costs no path walk and ID / EQUALS guards on it are implied (and dropped): it was reached
 *    through ID-matched objects and version-guarded dicts only (em_guard.h);
 *  - TYPE_MATCH is dropped where ID / EQUALS / LEN / DICT_KEYS / TENSOR_MATCH on the same source
 *    already compare the exact type;
 *  - leaves are sorted by kind (EM_GUARD_KINDS order): dict versions, type versions, ID, TYPE,
 *    EQUALS, LEN, DICT_KEYS, global state, tensor match.
 * em_guard_check resolves sources lazily, each at most once, into a scratch array of new
 * references (a property or __getattr__ met on the way may run arbitrary code, so nothing is held
 * borrowed across it) and releases them before returning.
 *
 * Dict versions. 3.11: PyDictObject.ma_version_tag changes on every mutation (PEP 509). 3.12
 * deprecates the field (PEP 699) but still maintains it, above the low DICT_MAX_WATCHERS (8)
 * bits that now hold the dict's watcher mask (Include/internal/pycore_dict.h,
 * DICT_VERSION_INCREMENT); so 3.12 compares the tag with those bits masked, and in front of that
 * a dict watcher (PyDict_AddWatcher, one for the process: ember supports one interpreter) bumps
 * em_guard_state.dict_epoch on any event of any watched dict. A guard set remembers the epoch at
 * which its dict-version group last passed: unchanged epoch, the whole group passes with one
 * compare. Watched dicts are never unwatched (a stray epoch bump only costs one exact re-check),
 * and are kept alive only as long as a guard set holds them.
 * Tags are a fast path only; a guard means the content the trace read (DESIGN.md, rules learned).
 * A keyed dict leaf (em_guard_dict_key: f_globals read by name) keeps the keys read and the objects
 * they held; a whole leaf (em_guard_dict_version: a hook dict being empty, _modules iterated) keeps
 * every item in order. When the version moved the leaf compares that content and, if it is the
 * same, moves its recorded version forward: rebinding an unrelated global, or a backend adding and
 * removing a global hook while it compiles, costs one re-check. The group's (dict, tag) pairs are
 * packed (GDictSlot) so that the steady state without an epoch skip is one tight loop.
 * Type versions work the same way against a snapshot of what lookup through the MRO resolves to
 * (type_snapshot_matches). */
#include "guard/em_guard_impl.h"
#include "sym/em_sym.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

EmGuardState em_guard_state = {.watcher_id = -1};

/* ---- builder ---- */

typedef struct BSrc {
    EmSrcDesc d;      /* key held by the arena */
    PyObject *value;  /* compile-time value, held by the arena; may be NULL */
    uint64_t hash;
    uint8_t stable;
    int32_t fetch;    /* fetch slot, or -1 */
} BSrc;

typedef struct BLeaf {
    uint8_t kind, sub;
    int32_t src;
    PyObject *obj;    /* as GLeaf.obj; held by the arena */
    PyObject *obj2;   /* DICT_KEYS: the exact type; held by the arena */
    uint64_t tag;
    const void *aux;  /* DICT_VERSION: how (arena string); TENSOR_MATCH: EmTensorMeta (arena) */
    int32_t owner;    /* DICT_VERSION: the source how follows (-1: how is the whole name) */
    uint64_t hash;
    PyObject **kv;    /* DICT_VERSION with sub == 0: key, value pairs read (arena, held by it) */
    uint32_t nkv, capkv; /* pairs */
} BLeaf;

struct GuardBuilder {
    EmArena *a;
    EM_VEC(BSrc) src;
    EM_VEC(BLeaf) leaf;
    EM_VEC(int32_t) fetch;  /* fetch slot -> source */
    int32_t *src_ht, *leaf_ht; /* open addressing, entry = index + 1, 0 = empty */
    uint32_t src_htcap, leaf_htcap;
};

/* Sets SystemError unless an exception is already set (a failed source creation passes -1 on). */
static int bad_arg(const char *what) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_SystemError, "ember guard: %s", what);
    return -1;
}

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdULL;
}

/* Grows an index table to twice its size when it is half full, rehashing from the stored hashes.
 * hashes(i) is read from items with the given stride. 0, or -1 (no exception). */
static int ht_reserve(EmArena *a, int32_t **ht, uint32_t *cap, uint32_t n, const void *items, size_t stride,
                      size_t hash_off) {
    if ((n + 1) * 2 <= *cap) return 0;
    uint32_t nc = *cap ? *cap * 2 : 64;
    int32_t *t = em_arena_alloc(a, sizeof(int32_t) * nc);
    if (!t) return -1;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t h = *(const uint64_t *)((const char *)items + i * stride + hash_off);
        uint32_t j = (uint32_t)h & (nc - 1);
        while (t[j]) j = (j + 1) & (nc - 1);
        t[j] = (int32_t)i + 1;
    }
    *ht = t;
    *cap = nc;
    return 0;
}

/* Identity, or the same exact type and ==, without leaving an exception. */
static int key_equal(PyObject *x, PyObject *y) {
    if (x == y) return 1;
    if (!x || !y || Py_TYPE(x) != Py_TYPE(y)) return 0;
    int r = PyObject_RichCompareBool(x, y, Py_EQ);
    if (r < 0) PyErr_Clear();
    return r == 1;
}

GuardBuilder *em_guard_builder_new(EmArena *a) {
    GuardBuilder *b = em_arena_alloc(a, sizeof(GuardBuilder));
    if (!b) {
        PyErr_NoMemory();
        return NULL;
    }
    b->a = a;
    return b;
}

/* Finds or appends the source (parent, kind, index, key). LOCAL and CLOSURE are identified by
 * index, their key being only the name shown in renderings. */
static GuardSrc src_add(GuardBuilder *b, int32_t parent, SrcKind kind, Py_ssize_t index, PyObject *key,
                        PyObject *value) {
    int by_key = kind != SRC_LOCAL && kind != SRC_CLOSURE && kind != SRC_CELL && kind != SRC_ITEM && kind != SRC_CONST;
    int rooted = kind == SRC_ATTR || kind == SRC_ITEM || kind == SRC_DICT_ITEM || kind == SRC_CONVERT;
    if (!b) return bad_arg("no builder");
    if (rooted ? parent < 0 || (uint32_t)parent >= b->src.n : parent != -1) return bad_arg("bad parent source");
    if (by_key && !key) return bad_arg("source without key");
    if (index < 0 && !by_key) return bad_arg("negative source index");
    uint64_t kh = 0;
    if (by_key) {
        Py_hash_t h = PyObject_Hash(key);
        if (h == -1) { /* an unhashable key: such sources are told apart by identity */
            PyErr_Clear();
            h = (Py_hash_t)(uintptr_t)key;
        }
        kh = (uint64_t)h;
    }
    uint64_t h = mix(mix(mix((uint64_t)(parent + 1), kind), (uint64_t)index), kh);
    if (ht_reserve(b->a, &b->src_ht, &b->src_htcap, b->src.n, b->src.items, sizeof(BSrc), offsetof(BSrc, hash)) < 0)
        goto nomem;
    uint32_t mask = b->src_htcap - 1, j = (uint32_t)h & mask;
    for (; b->src_ht[j]; j = (j + 1) & mask) {
        BSrc *s = &b->src.items[b->src_ht[j] - 1];
        if (s->hash == h && s->d.parent == parent && s->d.kind == kind &&
            s->d.index == index && (!by_key || key_equal(s->d.key, key)))
            return b->src_ht[j] - 1;
    }
    BSrc s = {.d = {.parent = parent, .kind = (uint8_t)kind, .index = index}, .hash = h, .fetch = -1};
    s.d.key = em_arena_hold(b->a, key);
    s.value = em_arena_hold(b->a, value);
    if ((key && !s.d.key) || (value && !s.value)) goto nomem;
    if (b->src.n >= INT32_MAX - 1 || EM_VEC_PUSH(b->a, b->src, s) < 0) goto nomem;
    b->src_ht[j] = (int32_t)b->src.n;
    return (GuardSrc)(b->src.n - 1);
nomem:
    PyErr_NoMemory();
    return -1;
}

GuardSrc em_guard_src_local(GuardBuilder *b, int index, PyObject *name, PyObject *value) {
    return src_add(b, -1, SRC_LOCAL, index, name, value);
}
GuardSrc em_guard_src_global(GuardBuilder *b, PyObject *name, PyObject *value) {
    return src_add(b, -1, SRC_GLOBAL, 0, name, value);
}
GuardSrc em_guard_src_builtin(GuardBuilder *b, PyObject *name, PyObject *value) {
    return src_add(b, -1, SRC_BUILTIN, 0, name, value);
}
GuardSrc em_guard_src_closure(GuardBuilder *b, int index, PyObject *name, PyObject *value) {
    return src_add(b, -1, SRC_CLOSURE, index, name, value);
}
GuardSrc em_guard_src_cell(GuardBuilder *b, int index, PyObject *name, PyObject *cell) {
    return src_add(b, -1, SRC_CELL, index, name, cell);
}
GuardSrc em_guard_src_const(GuardBuilder *b, PyObject *value) {
    PyObject *tn = PyUnicode_FromString(Py_TYPE(value)->tp_name);
    if (!tn) return -1;
    GuardSrc s = src_add(b, -1, SRC_CONST, (Py_ssize_t)((uintptr_t)value & (uintptr_t)PY_SSIZE_T_MAX), tn, value);
    Py_DECREF(tn);
    if (s >= 0) em_guard_src_stable(b, s);
    return s;
}
GuardSrc em_guard_src_attr(GuardBuilder *b, GuardSrc parent, PyObject *name, PyObject *value) {
    return src_add(b, parent, SRC_ATTR, 0, name, value);
}
GuardSrc em_guard_src_item(GuardBuilder *b, GuardSrc parent, Py_ssize_t index, PyObject *value) {
    return src_add(b, parent, SRC_ITEM, index, NULL, value);
}
GuardSrc em_guard_src_dict_item(GuardBuilder *b, GuardSrc parent, PyObject *key, PyObject *value) {
    return src_add(b, parent, SRC_DICT_ITEM, 0, key, value);
}

GuardSrc em_guard_src_dict_part_item(GuardBuilder *b, GuardSrc parent, PyObject *key, PyObject *value) {
    return src_add(b, parent, SRC_DICT_ITEM, 1, key, value);
}

GuardSrc em_guard_src_convert(GuardBuilder *b, GuardSrc parent, PyObject *fn, PyObject *value) {
    return src_add(b, parent, SRC_CONVERT, 0, fn, value);
}

static BSrc *src_get(const GuardBuilder *b, GuardSrc s) {
    return b && s >= 0 && (uint32_t)s < b->src.n ? &b->src.items[s] : NULL;
}

GuardSrc em_guard_src_parent(const GuardBuilder *b, GuardSrc s) {
    const BSrc *x = src_get(b, s);
    return x ? x->d.parent : -1;
}

bool em_guard_src_is_local(const GuardBuilder *b, GuardSrc s) {
    const BSrc *x = src_get(b, s);
    for (int depth = 0; x && x->d.parent >= 0 && depth < 1000; depth++) x = src_get(b, x->d.parent);
    return x && x->d.kind == SRC_LOCAL;
}

/* The compile-time value of s (borrowed; NULL without exception if s is invalid or had none). */
PyObject *em_guard_src_value_borrow(const GuardBuilder *b, GuardSrc s) {
    BSrc *src = src_get(b, s);
    return src ? src->value : NULL;
}

/* "L['x']" etc. for a builder source (em_guard_render.c does the text). */
PyObject *em_guard_src_repr(const GuardBuilder *b, GuardSrc s) {
    if (!src_get(b, s)) {
        bad_arg("bad source");
        return NULL;
    }
    return em_guard_render_src(b->src.items, sizeof(BSrc), s);
}

/* Stable: see em_guard.h. A source without a compile-time value cannot be stable. */
void em_guard_src_stable(GuardBuilder *b, GuardSrc s) {
    BSrc *src = src_get(b, s);
    if (src && src->value) src->stable = 1;
}

/* The same source fetched twice shares one slot. */
int em_guard_fetch(GuardBuilder *b, GuardSrc s) {
    BSrc *src = src_get(b, s);
    if (!src) return bad_arg("fetch of a bad source");
    if (src->fetch >= 0) return src->fetch;
    if (EM_VEC_PUSH(b->a, b->fetch, s) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    src->fetch = (int32_t)b->fetch.n - 1;
    return src->fetch;
}

/* ---- leaf guards in the builder. A leaf is identified by (kind, source, ident): ident is the
 * dict / type for DICT_VERSION / TYPE_VERSION and NULL otherwise (the expectation of a source
 * leaf derives from the source's compile-time value). ---- */

static uint64_t leaf_hash(int kind, int32_t src, const void *ident) {
    return mix(mix((uint64_t)kind, (uint64_t)(uint32_t)src), (uint64_t)(uintptr_t)ident);
}

/* 1 + its index if the leaf is already present, 0 if not, -1 out of memory (exception set). */
static int leaf_present(GuardBuilder *b, int kind, int32_t src, const void *ident) {
    if (ht_reserve(b->a, &b->leaf_ht, &b->leaf_htcap, b->leaf.n, b->leaf.items, sizeof(BLeaf),
                   offsetof(BLeaf, hash)) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t h = leaf_hash(kind, src, ident);
    uint32_t mask = b->leaf_htcap - 1;
    for (uint32_t j = (uint32_t)h & mask; b->leaf_ht[j]; j = (j + 1) & mask) {
        const BLeaf *l = &b->leaf.items[b->leaf_ht[j] - 1];
        const void *lid = l->kind == GUARD_DICT_VERSION || l->kind == GUARD_TYPE_VERSION ? (void *)l->obj : NULL;
        if (l->hash == h && l->kind == kind && l->src == src && lid == ident) return b->leaf_ht[j];
    }
    return 0;
}

/* Appends l (after leaf_present said 0, which reserved table room). */
static int leaf_push(GuardBuilder *b, BLeaf l, const void *ident) {
    l.hash = leaf_hash(l.kind, l.src, ident);
    if (EM_VEC_PUSH(b->a, b->leaf, l) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t mask = b->leaf_htcap - 1, j = (uint32_t)l.hash & mask;
    while (b->leaf_ht[j]) j = (j + 1) & mask;
    b->leaf_ht[j] = (int32_t)b->leaf.n;
    return 0;
}

/* Common front of the source leaves: validates s, checks for a duplicate. Returns the source's
 * value (borrowed) and *dup, or NULL with an exception. */
static PyObject *leaf_front(GuardBuilder *b, GuardSrc s, int kind, int *dup) {
    BSrc *src = src_get(b, s);
    if (!src || !src->value) {
        bad_arg("guard on a bad source or one without a value");
        return NULL;
    }
    int r = leaf_present(b, kind, s, NULL);
    if (r < 0) return NULL;
    *dup = r;
    return src->value;
}

int em_guard_type(GuardBuilder *b, GuardSrc s) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_TYPE_MATCH, &dup);
    if (!v) return -1;
    if (dup) return 0;
    BLeaf l = {.kind = GUARD_TYPE_MATCH, .src = s, .obj = (PyObject *)Py_TYPE(v)};
    return leaf_push(b, l, NULL);
}

int em_guard_id(GuardBuilder *b, GuardSrc s) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_ID_MATCH, &dup);
    if (!v) return -1;
    if (dup) return 0;
    BLeaf l = {.kind = GUARD_ID_MATCH, .src = s, .obj = v};
    return leaf_push(b, l, NULL);
}

int em_guard_equals(GuardBuilder *b, GuardSrc s) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_EQUALS, &dup);
    if (!v) return -1;
    if (dup) return 0;
    BLeaf l = {.kind = GUARD_EQUALS, .src = s, .obj = v, .sub = EQ_OTHER};
    if (v == Py_None) l.sub = EQ_NONE;
    else if (PyBool_Check(v)) l.sub = EQ_BOOL;
    else if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (!overflow) { /* compare as int64 at run time */
            l.sub = EQ_INT;
            l.tag = (uint64_t)x;
        }
    } else if (PyFloat_CheckExact(v)) l.sub = EQ_FLOAT;
    else if (PyUnicode_CheckExact(v)) l.sub = EQ_STR;
    return leaf_push(b, l, NULL);
}

int em_guard_len(GuardBuilder *b, GuardSrc s) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_LEN, &dup);
    if (!v) return -1;
    if (dup) return 0;
    if (!PyList_Check(v) && !PyTuple_Check(v) && !PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "ember: length guard on a %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyObject_Length(v);
    if (n < 0) return -1;
    BLeaf l = {.kind = GUARD_LEN, .src = s, .obj = (PyObject *)Py_TYPE(v), .tag = (uint64_t)n};
    return leaf_push(b, l, NULL);
}

/* The keys of a dict in iteration order, as a tuple: PyDict_Next order for exact dicts, and
 * list(v.keys()) for subclasses (an OrderedDict's order is its own). New reference. */
static PyObject *dict_keys_tuple(PyObject *v) {
    if (PyDict_CheckExact(v)) {
        PyObject *t = PyTuple_New(PyDict_GET_SIZE(v)), *k, *val;
        Py_ssize_t pos = 0, i = 0;
        if (!t) return NULL;
        while (PyDict_Next(v, &pos, &k, &val)) PyTuple_SET_ITEM(t, i++, Py_NewRef(k));
        return t;
    }
    PyObject *keys = PyMapping_Keys(v);
    if (!keys) return NULL;
    PyObject *t = PySequence_Tuple(keys);
    Py_DECREF(keys);
    return t;
}

int em_guard_dict_keys(GuardBuilder *b, GuardSrc s) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_DICT_KEYS, &dup);
    if (!v) return -1;
    if (dup) return 0;
    if (!PyDict_Check(v)) {
        PyErr_Format(PyExc_TypeError, "ember: dict keys guard on a %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    PyObject *keys = em_arena_hold_steal(b->a, dict_keys_tuple(v));
    if (!keys) return -1;
    BLeaf l = {.kind = GUARD_DICT_KEYS, .src = s, .obj = keys, .obj2 = (PyObject *)Py_TYPE(v)};
    return leaf_push(b, l, NULL);
}

int em_guard_tensor(GuardBuilder *b, GuardSrc s) { return em_guard_tensor_dynamic(b, s, 0); }

int em_guard_tensor_dynamic(GuardBuilder *b, GuardSrc s, uint64_t dynmask) {
    int dup;
    PyObject *v = leaf_front(b, s, GUARD_TENSOR_MATCH, &dup);
    if (!v) return -1;
    if (dup) return 0;
    EmTensorMeta *m = em_guard_tensor_record(b->a, v);
    if (!m) return -1;
    if (dynmask && m->ndim <= 32) { /* dense order of the example, innermost first */
        int32_t n = m->ndim;
        const int64_t *sz = m->dims, *st = m->dims + n;
        for (int32_t i = 0; i < n; i++) m->order[i] = (int8_t)(n - 1 - i);
        for (int32_t i = 1; i < n; i++)
            for (int32_t j = i; j > 0 && st[m->order[j]] < st[m->order[j - 1]]; j--) {
                int8_t t = m->order[j];
                m->order[j] = m->order[j - 1];
                m->order[j - 1] = t;
            }
        EM_UNUSED(sz);
        m->dynmask = dynmask;
    }
    BLeaf l = {.kind = GUARD_TENSOR_MATCH, .src = s, .obj = (PyObject *)Py_TYPE(v), .aux = m};
    return leaf_push(b, l, NULL);
}

/* The builder's SYM detail; the capsule that holds it frees a program never moved into a set. */
typedef struct BSym {
    SymProg *prog;
    uint32_t n;
    GuardSrc *src;
    int32_t *dim;
    PyObject *lines;
} BSym;

static void bsym_free(PyObject *cap) {
    BSym *bs = PyCapsule_GetPointer(cap, "ember.BSym");
    if (bs) em_sym_prog_free(bs->prog);
}

int em_guard_no_overlap(GuardBuilder *b, const GuardSrc *srcs, uint32_t nmut, uint32_t n) {
    if (!b || !nmut || nmut > n) return bad_arg("no-overlap guard without updated tensors");
    for (uint32_t i = 0; i < n; i++)
        if (srcs[i] < 0 || (uint32_t)srcs[i] >= b->src.n) return bad_arg("no-overlap guard on no source");
    int r = leaf_present(b, GUARD_NO_OVERLAP, srcs[0], NULL);
    if (r) return r < 0 ? -1 : 0;
    GOverlap *ov = em_arena_alloc(b->a, sizeof(GOverlap) + sizeof(int32_t) * n);
    if (!ov) {
        PyErr_NoMemory();
        return -1;
    }
    ov->n = n;
    ov->nmut = nmut;
    memcpy(ov->src, srcs, sizeof(int32_t) * n);
    BLeaf l = {.kind = GUARD_NO_OVERLAP, .src = srcs[0], .aux = ov};
    return leaf_push(b, l, NULL);
}

int em_guard_sym(GuardBuilder *b, SymProg *prog, const GuardSrc *srcs, const int32_t *dims, uint32_t n, PyObject *lines) {
    BSym *bs = em_arena_alloc(b->a, sizeof(BSym));
    PyObject *cap = bs ? PyCapsule_New(bs, "ember.BSym", bsym_free) : NULL;
    if (!bs || !cap || !em_arena_hold_steal(b->a, cap)) {
        em_sym_prog_free(prog);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    bs->prog = prog;
    bs->n = n;
    bs->src = em_arena_alloc(b->a, sizeof(GuardSrc) * (n + 1));
    bs->dim = em_arena_alloc(b->a, sizeof(int32_t) * (n + 1));
    bs->lines = em_arena_hold(b->a, lines);
    if (!bs->src || !bs->dim) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(bs->src, srcs, sizeof(GuardSrc) * n);
    memcpy(bs->dim, dims, sizeof(int32_t) * n);
    for (uint32_t i = 0; i < n; i++)
        if (srcs[i] < 0 || (uint32_t)srcs[i] >= b->src.n) return bad_arg("sym guard on no source");
    BLeaf l = {.kind = GUARD_SYM, .src = -1, .aux = bs};
    return leaf_push(b, l, NULL);
}

int em_guard_sym_refresh(GuardBuilder *b, SymProg *prog, PyObject *lines) {
    for (uint32_t i = 0; i < b->leaf.n; i++) {
        BLeaf *l = &b->leaf.items[i];
        if (l->kind != GUARD_SYM) continue;
        BSym *bs = (BSym *)(uintptr_t)l->aux; /* (the builder's own, made by em_guard_sym) */
        em_sym_prog_free(bs->prog);
        bs->prog = prog;
        bs->lines = em_arena_hold(b->a, lines);
        return bs->lines ? 0 : -1;
    }
    em_sym_prog_free(prog);
    return 0;
}

#if EM_PY312
/* ma_version_tag is deprecated in 3.12 (PEP 699) yet still maintained: its low DICT_MAX_WATCHERS
 * bits are the dict's watcher mask, the rest changes on every mutation
 * (Include/internal/pycore_dict.h, DICT_VERSION_INCREMENT = 1 << DICT_MAX_WATCHERS). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static inline uint64_t dict_tag(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag & ~(uint64_t)0xFF; }
#pragma GCC diagnostic pop

#if EM_PY313
/* Does a store through an object's inline values reach its materialised __dict__, which shares them:
 * does it move the dict's tag (tag_unseen = 0), does it fire the dict watchers (watch_unseen = 0)?
 * Neither on CPython 3.13.0 (gh-125608; 3.13.1 fires the watchers, as torch/_dynamo/guards.py
 * notes). Found by trying it at start-up, not from the version number; where the experiment cannot
 * run, the safe answer (unseen). */
static void probe_inline_values(EmGuardState *st) {
    st->inline_tag_unseen = st->inline_watch_unseen = 1;
    PyObject *cls = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O){}", "_ember_inline_probe",
                                          (PyObject *)&PyBaseObject_Type);
    PyObject *obj = cls ? PyObject_CallNoArgs(cls) : NULL, *d = NULL;
    if (obj && PyObject_SetAttrString(obj, "a", Py_None) == 0 && (d = PyObject_GenericGetDict(obj, NULL)) &&
        st->watcher_id >= 0 && PyDict_Watch(st->watcher_id, d) == 0) {
        uint64_t tag = dict_tag(d), epoch = st->dict_epoch;
        if (PyObject_SetAttrString(obj, "a", Py_True) == 0) {
            st->inline_tag_unseen = dict_tag(d) == tag;
            st->inline_watch_unseen = st->dict_epoch == epoch;
        }
        PyDict_Unwatch(st->watcher_id, d);
    }
    PyErr_Clear();
    Py_XDECREF(d);
    Py_XDECREF(obj);
    Py_XDECREF(cls);
}

/* Can a store to d go unseen by the watchers (an instance __dict__ sharing its object's inline values,
 * where em_guard_state.inline_watch_unseen)? Its guard set is then never skipped. */
static int dict_watch_unseen(PyObject *d) {
    return em_guard_state.inline_watch_unseen && em_dict_values_embedded(d);
}

int em_guard_inline_values_unseen(void) {
    return em_guard_state.inline_tag_unseen || em_guard_state.inline_watch_unseen;
}
#else
int em_guard_inline_values_unseen(void) { return 0; }
#endif

/* The tag a guard set's slot starts from: EM_DICT_TAG_UNSEEN for a dict whose stores the tag may
 * miss (an instance __dict__ sharing its object's inline values, where
 * em_guard_state.inline_tag_unseen). */
static uint64_t slot_tag(PyObject *d, uint64_t tag) {
#if EM_PY313
    if (em_guard_state.inline_tag_unseen && em_dict_values_embedded(d)) return EM_DICT_TAG_UNSEEN;
#endif
    EM_UNUSED(d);
    return tag;
}

/* Any event of any watched dict: the epoch moves, every guard set re-verifies its dict tags. */
static int dict_watch_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value) {
    EM_UNUSED(event);
    EM_UNUSED(dict);
    EM_UNUSED(key);
    EM_UNUSED(new_value);
    em_guard_state.dict_epoch++;
    return 0;
}
#else
/* PEP 509: a new, globally unique tag on every mutation. */
static inline uint64_t dict_tag(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
static uint64_t slot_tag(PyObject *d, uint64_t tag) {
    EM_UNUSED(d);
    return tag;
}

/* Dict groups smaller than this skip the probe: walking them costs less than the probe's store. */
#define EM_DICT_PROBE_MIN 64

/* 3.11 has no dict watchers, but every dict mutation anywhere takes its new tag from one global
 * counter (Include/internal/pycore_dict.h, DICT_NEXT_VERSION; Objects/dictobject.c). The counter is
 * not exported; mutating a private probe dict reads it: the probe's new tag is the counter. If it
 * is exactly one more than the previous probe's, no dict in the process changed in between, so
 * the epoch stays and every guard set that passed its dict group at this epoch skips the group
 * (the same one-compare steady state as the 3.12 watchers). Any mutation in between moves the
 * epoch and costs each guard set one exact re-check. */
/* Stores into the probe dict (a changed value: insertdict assigns a new tag) and reads its tag:
 * the global counter. 0, or -1 (exception cleared). */
static int probe_read(EmGuardState *st, uint64_t *v) {
    st->probe_flip ^= 1;
    if (PyDict_SetItem(st->probe_dict, st->s_module, st->probe_flip ? Py_True : Py_False) < 0) {
        PyErr_Clear();
        return -1;
    }
    *v = dict_tag(st->probe_dict);
    return 0;
}

static uint64_t dict_probe_epoch(void) {
    EmGuardState *st = &em_guard_state;
    if (!st->probe_dict) {
        st->probe_dict = PyDict_New();
        if (!st->probe_dict) {
            PyErr_Clear();
            return ++st->dict_epoch;
        }
    }
    uint64_t v;
    if (probe_read(st, &v) < 0) return ++st->dict_epoch;
    if (v != st->probe_last + 1) st->dict_epoch++;
    st->probe_last = v;
    return st->dict_epoch;
}
#endif

/* See em_guard.h. */
void em_guard_window_open(const GuardSet *gs, EmGraphWindow *w, unsigned long stamp) {
    w->open = 0;
#if EM_PY312
    EM_UNUSED(gs);
    EM_UNUSED(stamp);
#else
    EmGuardState *st = &em_guard_state;
    w->gen = ++st->window_gen; /* also closes an enclosing window */
    if (gs->ndict < EM_DICT_PROBE_MIN || gs->dict_epoch == UINT64_MAX) return;
    if (dict_probe_epoch() != gs->dict_epoch) return; /* a dict changed since the check passed */
    w->stamp = stamp;
    w->open = 1;
#endif
}

/* See em_guard.h. */
void em_guard_window_close(EmGraphWindow *w, unsigned long stamp) {
#if EM_PY312
    EM_UNUSED(w);
    EM_UNUSED(stamp);
#else
    EmGuardState *st = &em_guard_state;
    if (!w->open || w->gen != st->window_gen || w->stamp != stamp) return;
    w->open = 0;
    uint64_t v;
    if (probe_read(st, &v) < 0) st->dict_epoch++;
    else st->probe_last = v; /* the epoch stays: the call's dict activity is excused */
#endif
}

/* Appends (key, value) to a builder dict leaf's pairs (both held by the arena; value NULL: absent).
 * 0, or -1 with MemoryError. */
static int dict_leaf_pair(GuardBuilder *b, BLeaf *l, PyObject *key, PyObject *value) {
    if (l->nkv == l->capkv) {
        uint32_t nc = l->capkv ? 2 * l->capkv : 4;
        PyObject **kv = em_arena_realloc(b->a, l->kv, sizeof(PyObject *) * 2 * l->capkv, sizeof(PyObject *) * 2 * nc);
        if (!kv) goto nomem;
        l->kv = kv;
        l->capkv = nc;
    }
    if (!em_arena_hold(b->a, key) || (value && !em_arena_hold(b->a, value))) goto nomem;
    l->kv[2 * l->nkv] = key;
    l->kv[2 * l->nkv + 1] = value;
    l->nkv++;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* Makes l a whole-dict leaf: its pairs become every item of dict in iteration order, and its tag
 * the version that goes with them (the keys read before are subsumed: an absent key is absent
 * from the content too). */
static int dict_leaf_whole(GuardBuilder *b, BLeaf *l, PyObject *dict) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    l->nkv = 0;
    l->sub = 1;
    l->tag = dict_tag(dict);
    while (PyDict_Next(dict, &pos, &k, &v))
        if (dict_leaf_pair(b, l, k, v) < 0) return -1;
    return 0;
}

/* The DICT_VERSION leaf of dict, created on first use (sub = 1: whole dict, 0: keyed). */
static BLeaf *dict_leaf(GuardBuilder *b, PyObject *dict, GuardSrc owner, const char *how, int whole) {
    if (!b || !dict || !PyDict_Check(dict)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ember: dict version guard on a non-dict");
        return NULL;
    }
    int r = leaf_present(b, GUARD_DICT_VERSION, -1, dict);
    if (r < 0) return NULL;
    if (r > 0) {
        BLeaf *l = &b->leaf.items[r - 1];
        if (whole && !l->sub && dict_leaf_whole(b, l, dict) < 0) return NULL;
        return l;
    }
    if (!em_guard_state.s_module && em_guard_init(NULL) < 0) return NULL;
#if EM_PY312
    /* Watch first, then read the tag: the first check compares tags exactly anyway. */
    if (em_guard_state.watcher_id >= 0 && PyDict_Watch(em_guard_state.watcher_id, dict) < 0) return NULL;
#endif
    BLeaf l = {.kind = GUARD_DICT_VERSION, .sub = 0, .src = -1, .obj = em_arena_hold(b->a, dict),
               .tag = dict_tag(dict), .owner = src_get(b, owner) ? owner : -1};
    l.aux = em_arena_strdup(b->a, how ? how : "<dict>");
    if (!l.obj || !l.aux) {
        PyErr_NoMemory();
        return NULL;
    }
    if (whole && dict_leaf_whole(b, &l, dict) < 0) return NULL;
    if (leaf_push(b, l, dict) < 0) return NULL;
    return &b->leaf.items[b->leaf.n - 1];
}

int em_guard_dict_version(GuardBuilder *b, PyObject *dict, GuardSrc owner, const char *how) {
    return dict_leaf(b, dict, owner, how, 1) ? 0 : -1;
}

int em_guard_dict_key(GuardBuilder *b, PyObject *dict, PyObject *key, GuardSrc owner, const char *how) {
    if (!key) return bad_arg("dict key guard without a key");
    BLeaf *l = dict_leaf(b, dict, owner, how, 0);
    if (!l) return -1;
    if (l->sub) return 0; /* the whole content is guarded already */
    for (uint32_t i = 0; i < l->nkv; i++)
        if (key_equal(l->kv[2 * i], key)) return 0;
    PyObject *v = PyDict_GetItemWithError(dict, key); /* borrowed; NULL: absent */
    if (!v && PyErr_Occurred()) return -1;
    return dict_leaf_pair(b, l, key, v);
}

/* The type's version tag, assigning one if it has none: 3.12 has PyUnstable_Type_AssignVersionTag;
 * on 3.11 a method-cache lookup of a cacheable name assigns it (Objects/typeobject.c,
 * _PyType_Lookup -> assign_version_tag). 0 if the type cannot have one now. */
static unsigned int type_tag(PyTypeObject *tp) {
    if (tp->tp_version_tag == 0) {
#if EM_PY312
        PyUnstable_Type_AssignVersionTag(tp);
#else
        (void)_PyType_Lookup(tp, em_guard_state.s_module);
#endif
    }
    return tp->tp_version_tag;
}

/* The attribute dict of one class (new reference, or NULL without exception if it has none).
 * 3.12 keeps the dicts of static builtin types (object, int ...) in the interpreter, not in
 * tp_dict (Objects/typeobject.c, _PyType_GetDict): PyType_GetDict reads both kinds. */
static PyObject *class_dict(PyTypeObject *t) {
#if EM_PY312
    PyObject *d = PyType_GetDict(t);
    if (!d) PyErr_Clear();
    return d;
#else
    return t->tp_dict ? Py_NewRef(t->tp_dict) : NULL;
#endif
}

/* What attribute lookup through the MRO finds: {name: the object of the first class in mro whose
 * dict has it} (the rule of _PyType_Lookup, Objects/typeobject.c, find_name_in_mro). New dict, or
 * NULL with an exception. */
static PyObject *type_resolution(PyObject *mro) {
    PyObject *r = PyDict_New();
    if (!r) return NULL;
    for (Py_ssize_t i = PyTuple_GET_SIZE(mro); i-- > 0;) { /* later classes first: earlier ones override */
        PyObject *d = class_dict((PyTypeObject *)PyTuple_GET_ITEM(mro, i));
        int bad = d && PyDict_Update(r, d) < 0;
        Py_XDECREF(d);
        if (bad) {
            Py_DECREF(r);
            return NULL;
        }
    }
    return r;
}

/* A snapshot of what attribute lookup on tp sees: (tp.__mro__, (copy of each MRO class's
 * __dict__, ...), resolution of every name). A type's version tag changes on any assignment to
 * the class or a base, also when the value is set back (torch.fx patches nn.Module.__call__ /
 * __getattr__ while it traces, so every module class gets a new tag), so a changed tag is
 * re-verified against this snapshot before the guard fails. New reference. */
static PyObject *type_snapshot(PyTypeObject *tp) {
    PyObject *mro = tp->tp_mro;
    if (!mro || !PyTuple_Check(mro)) return Py_NewRef(Py_None);
    Py_ssize_t n = PyTuple_GET_SIZE(mro);
    PyObject *dicts = PyTuple_New(n), *res = NULL, *r = NULL;
    if (!dicts) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = class_dict((PyTypeObject *)PyTuple_GET_ITEM(mro, i));
        PyObject *c = d ? PyDict_Copy(d) : Py_NewRef(Py_None);
        Py_XDECREF(d);
        if (!c) goto done;
        PyTuple_SET_ITEM(dicts, i, c);
    }
    if ((res = type_resolution(mro))) r = PyTuple_Pack(3, mro, dicts, res);
done:
    Py_DECREF(dicts);
    Py_XDECREF(res);
    return r;
}

/* Names a class may gain (or whose resolution may change) without changing what a traced program
 * can read: caches the standard library stores on a class the first time it is asked
 * (copyreg._slotnames stores __slotnames__ when an instance is pickled, Lib/copyreg.py; reading
 * cls.__annotations__ stores an empty dict in cls, shadowing a base class's annotations,
 * Objects/typeobject.c, type_get_annotations). Backends pickle graphs and inspect annotations. */
static int class_cache_name(PyObject *k) {
    return PyUnicode_Check(k) && (PyUnicode_CompareWithASCIIString(k, "__slotnames__") == 0 ||
                                  PyUnicode_CompareWithASCIIString(k, "__annotations__") == 0);
}

/* Every MRO class still holds exactly the attributes of the snapshot (same keys, same objects): no
 * allocation, one walk. */
static int type_dicts_unchanged(PyObject *mro, PyObject *dicts) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyObject *now = class_dict((PyTypeObject *)PyTuple_GET_ITEM(mro, i)), *then = PyTuple_GET_ITEM(dicts, i);
        int same = now ? PyDict_Check(then) && PyDict_GET_SIZE(now) == PyDict_GET_SIZE(then) : then == Py_None;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (now && same && PyDict_Next(then, &pos, &k, &v)) {
            PyObject *cur = PyDict_GetItemWithError(now, k);
            if (cur != v) {
                PyErr_Clear();
                same = 0;
            }
        }
        Py_XDECREF(now);
        if (!same) return 0;
    }
    return 1;
}

/* Does attribute lookup on tp still find, for every name, the object it found when the snapshot
 * was taken? The same MRO classes, then either every class dict unchanged (the common case: an
 * attribute patched and restored), or, compared by resolution, the same object for every name
 * that resolved, and no new name but the class caches above (a backend that restores an inherited
 * method with setattr(cls, name, getattr(cls, name)) leaves an entry in cls that resolves to the
 * same object, as torch.fx's _Patcher.patch_method does; a new attribute that shadows anything,
 * or a name the trace may have found missing, fails). Runs only after the tag changed. */
static int type_snapshot_matches(PyTypeObject *tp, PyObject *snap) {
    if (!snap || !PyTuple_Check(snap) || PyTuple_GET_SIZE(snap) != 3) return 0;
    PyObject *mro = PyTuple_GET_ITEM(snap, 0), *dicts = PyTuple_GET_ITEM(snap, 1), *then = PyTuple_GET_ITEM(snap, 2);
    if (tp->tp_mro != mro) { /* the same classes, possibly in a new tuple object */
        if (!tp->tp_mro || PyTuple_GET_SIZE(tp->tp_mro) != PyTuple_GET_SIZE(mro)) return 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++)
            if (PyTuple_GET_ITEM(tp->tp_mro, i) != PyTuple_GET_ITEM(mro, i)) return 0;
    }
    if (type_dicts_unchanged(mro, dicts)) return 1;
    PyObject *now = type_resolution(mro), *k, *v;
    Py_ssize_t pos = 0;
    int same = now != NULL;
    while (same && PyDict_Next(then, &pos, &k, &v))
        if (PyDict_GetItemWithError(now, k) != v && !class_cache_name(k)) same = 0;
    pos = 0;
    while (same && PyDict_Next(now, &pos, &k, &v)) /* names that resolve only now */
        if (!PyDict_GetItemWithError(then, k) && !class_cache_name(k)) same = 0;
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(now);
    return same;
}

int em_guard_type_version(GuardBuilder *b, PyTypeObject *tp) {
    if (!b || !tp) return bad_arg("type version guard without a type");
    int r = leaf_present(b, GUARD_TYPE_VERSION, -1, tp);
    if (r) return r < 0 ? -1 : 0;
    if (!em_guard_state.s_module && em_guard_init(NULL) < 0) return -1;
    /* A tag of 0 is kept: the snapshot is then compared at every check. */
    BLeaf l = {.kind = GUARD_TYPE_VERSION, .src = -1, .obj = em_arena_hold(b->a, (PyObject *)tp), .tag = type_tag(tp)};
    l.obj2 = em_arena_hold_steal(b->a, type_snapshot(tp));
    if (!l.obj || !l.obj2) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    return leaf_push(b, l, tp);
}

/* Calls f(arg) (arg may be NULL: no argument). New reference or NULL with an exception. */
static PyObject *call1(PyObject *f, PyObject *arg) {
    PyObject *args[2] = {NULL, arg};
    return PyObject_Vectorcall(f, args + 1, (arg ? 1 : 0) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The dtype torch.autocast casts to on device dev (a str) as 2 bits: 0 bfloat16, 1 float16, 2 other.
 * A graph traced under autocast holds its casts' dtypes (passes/em_pass_autocast.c), so the
 * guard tells float16 from bfloat16 autocast. -1 with an exception. */
enum { AC_DT_BF16, AC_DT_F16, AC_DT_OTHER };
static int autocast_dtype_code(PyObject *dev) {
    PyObject *r = call1(em_guard_state.get_autocast_dtype, dev);
    if (!r) return -1;
    int code = r == em_guard_state.dt_bfloat16 ? AC_DT_BF16 : r == em_guard_state.dt_float16 ? AC_DT_F16 : AC_DT_OTHER;
    Py_DECREF(r);
    return code;
}

/* Reads the global torch state: bit 0 grad mode, bit 1 autocast on cpu, bit 2 autocast on cuda, and
 * each enabled autocast's dtype (bits 3-4 cpu, 5-6 cuda: autocast_dtype_code);
 * *dtype = torch.get_default_dtype() (new reference). 0, or -1 with an exception.
 * torch.is_autocast_enabled(device_type) parses its string argument on each call (about 130 ns
 * each on the H200 host); when torch._C._is_any_autocast_enabled() (no argument, about 85 ns;
 * torch/csrc/autograd/init.cpp) says no autocast is on for any device, both bits are 0 without
 * the two calls. */
static int global_state_read(uint8_t *bits, PyObject **dtype) {
    PyObject *r;
    int b = 0, any = 1;
    *dtype = NULL;
    if (!(r = call1(em_guard_state.is_grad_enabled, NULL))) return -1;
    b |= (r == Py_True) << 0;
    Py_DECREF(r);
    if (em_guard_state.is_any_autocast_enabled) {
        if (!(r = call1(em_guard_state.is_any_autocast_enabled, NULL))) return -1;
        any = r != Py_False;
        Py_DECREF(r);
    }
    if (any) {
        for (int dev = 0; dev < 2; dev++) {
            PyObject *name = dev ? em_guard_state.str_cuda : em_guard_state.str_cpu;
            if (!(r = call1(em_guard_state.is_autocast_enabled, name))) return -1;
            int on = r == Py_True;
            Py_DECREF(r);
            if (!on) continue;
            int code = autocast_dtype_code(name);
            if (code < 0) return -1;
            b |= 1 << (1 + dev);
            b |= code << (3 + 2 * dev);
        }
    }
    if (!(*dtype = call1(em_guard_state.get_default_dtype, NULL))) return -1;
    *bits = (uint8_t)b;
    return 0;
}

/* Which scaled_dot_product_attention backends torch may choose (torch.backends.cuda's
 * flash / mem_efficient / math / cudnn flags, which sdpa_kernel contexts set; the CPU flash kernel
 * follows the flash flag): bits 0-3; bit 4: whether the math kernel may compute half / bfloat16 in
 * their own dtype (allow_fp16_bf16_reduction_math_sdp; off: in float32, which a decomposed math
 * kernel reproduces). A flag torch does not have reads as on. 0, or -1 with an exception. */
static int sdp_flags_read(uint8_t *bits) {
    static const char *const names[EM_SDP_FLAGS] = {"_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled",
                                                    "_get_math_sdp_enabled", "_get_cudnn_sdp_enabled",
                                                    "_get_math_sdp_allow_fp16_bf16_reduction"};
    EmGuardState *st = &em_guard_state;
    int b = 0;
    for (int i = 0; i < EM_SDP_FLAGS; i++) {
        if (!st->sdp_enabled[i]) {
            PyObject *c = PyImport_ImportModule("torch._C");
            st->sdp_enabled[i] = c ? PyObject_GetAttrString(c, names[i]) : NULL;
            Py_XDECREF(c);
            if (!st->sdp_enabled[i]) {
                PyErr_Clear();
                st->sdp_enabled[i] = Py_NewRef(Py_None); /* absent in this torch: read as on */
            }
        }
        int on = 1;
        if (st->sdp_enabled[i] != Py_None) {
            PyObject *r = call1(st->sdp_enabled[i], NULL);
            if (!r) return -1;
            on = r == Py_True;
            Py_DECREF(r);
        }
        b |= on << i;
    }
    *bits = (uint8_t)b;
    return 0;
}

int em_guard_sdp_flags(GuardBuilder *b) {
    if (!b) return bad_arg("no builder");
    int r = leaf_present(b, GUARD_SDP_FLAGS, -1, NULL);
    if (r) return r < 0 ? -1 : 0;
    BLeaf l = {.kind = GUARD_SDP_FLAGS, .src = -1};
    if (sdp_flags_read(&l.sub) < 0) return -1;
    return leaf_push(b, l, NULL);
}

int em_guard_global_state(GuardBuilder *b) {
    if (!b) return bad_arg("no builder");
    int r = leaf_present(b, GUARD_GLOBAL_STATE, -1, NULL);
    if (r) return r < 0 ? -1 : 0;
    if (em_guard_torch_ready() < 0) return -1;
    BLeaf l = {.kind = GUARD_GLOBAL_STATE, .src = -1};
    PyObject *dtype;
    if (global_state_read(&l.sub, &dtype) < 0) return -1;
    if (!(l.obj = em_arena_hold_steal(b->a, dtype))) {
        PyErr_NoMemory();
        return -1;
    }
    return leaf_push(b, l, NULL);
}

/* ---- build ---- */

enum { IMPLIES_TYPE = (1u << GUARD_ID_MATCH) | (1u << GUARD_EQUALS) | (1u << GUARD_LEN) |
                      (1u << GUARD_DICT_KEYS) | (1u << GUARD_TENSOR_MATCH) };

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Whether leaf l of the builder is evaluated by the set (see the file comment). */
static int leaf_kept(const GuardBuilder *b, const BLeaf *l, const uint32_t *kinds) {
    if (l->src < 0) return 1;
    const BSrc *s = &b->src.items[l->src];
    if (s->stable && (l->kind == GUARD_ID_MATCH || l->kind == GUARD_EQUALS)) return 0;
    if (l->kind == GUARD_TYPE_MATCH && (kinds[l->src] & IMPLIES_TYPE)) return 0;
    return 1;
}

GuardSet *em_guard_build(GuardBuilder *b) {
    if (!b) {
        bad_arg("no builder");
        return NULL;
    }
    uint32_t ns = b->src.n, nl = b->leaf.n, nf = b->fetch.n;
    uint32_t *kinds = em_arena_alloc(b->a, sizeof(uint32_t) * (ns + 1));
    int32_t *remap = em_arena_alloc(b->a, sizeof(int32_t) * (ns + 1));
    uint32_t *order = em_arena_alloc(b->a, sizeof(uint32_t) * (nl + 1));
    if (!kinds || !remap || !order) {
        PyErr_NoMemory();
        return NULL;
    }
    for (uint32_t i = 0; i < nl; i++)
        if (b->leaf.items[i].src >= 0) kinds[b->leaf.items[i].src] |= 1u << b->leaf.items[i].kind;

    /* Used sources: those of kept leaves and fetch slots, with their ancestors. Parents precede
     * children in the table, so one backward sweep propagates the marks. */
    for (uint32_t i = 0; i < ns; i++) remap[i] = 0;
    uint32_t nkept = 0, nuse = 0, ntensor_bytes = 0, nhow = 0, nheld = 0;
    size_t ndictinfo = 0;
    for (uint32_t k = 0; k < GUARD__COUNT; k++) /* stable counting sort by kind */
        for (uint32_t i = 0; i < nl; i++) {
            const BLeaf *l = &b->leaf.items[i];
            if (l->kind != k || !leaf_kept(b, l, kinds)) continue;
            order[nkept++] = i;
            if (l->src >= 0) remap[l->src] = 1;
            if (l->kind == GUARD_SYM)
                for (uint32_t j = 0; j < ((const BSym *)l->aux)->n; j++) remap[((const BSym *)l->aux)->src[j]] = 1;
            if (l->kind == GUARD_TENSOR_MATCH) ntensor_bytes += em_guard_tensor_meta_size(l->aux);
            if (l->kind == GUARD_NO_OVERLAP) {
                const GOverlap *ov = l->aux;
                for (uint32_t j = 0; j < ov->n; j++) remap[ov->src[j]] = 1;
                ntensor_bytes += align8(sizeof(GOverlap) + sizeof(int32_t) * ov->n);
            }
            if (l->kind == GUARD_DICT_VERSION) {
                if (l->owner >= 0) remap[l->owner] = 1; /* kept to name the dict when shown */
                nhow += (uint32_t)strlen(l->aux) + 1;
                ndictinfo += align8(sizeof(GDictInfo)) + sizeof(PyObject *) * 2 * l->nkv;
                nheld += 2 * l->nkv;
            }
        }
    uint32_t ndict = 0;
    for (uint32_t k = 0; k < nkept; k++) ndict += b->leaf.items[order[k]].kind == GUARD_DICT_VERSION;
    for (uint32_t k = 0; k < nf; k++) remap[b->fetch.items[k]] = 1;
    for (uint32_t i = ns; i-- > 0;)
        if (remap[i] && b->src.items[i].d.parent >= 0) remap[b->src.items[i].d.parent] = 1;
    for (uint32_t i = 0; i < ns; i++) remap[i] = remap[i] ? (int32_t)nuse++ : -1;
    nheld += 2 * nuse + 5 * nkept; /* keys, stable values; obj, obj2; tensor dtype, device, layout */

    size_t off_src = align8(sizeof(GuardSet));
    size_t off_leaf = off_src + align8(sizeof(GSrc) * nuse);
    size_t off_dslot = off_leaf + align8(sizeof(GLeaf) * nkept);
    size_t off_held = off_dslot + sizeof(GDictSlot) * ndict;
    size_t off_tm = off_held + align8(sizeof(PyObject *) * nheld);
    size_t off_di = off_tm + align8(ntensor_bytes);
    size_t off_fetch = off_di + ndictinfo;
    size_t off_how = off_fetch + align8(sizeof(int32_t) * nf);
    size_t off_scratch = align8(off_how + nhow);
    size_t off_scratch_set = off_scratch + sizeof(PyObject *) * nuse;
    size_t total = off_scratch_set + sizeof(int32_t) * nuse;
    char *block = calloc(1, total);
    if (!block) {
        PyErr_NoMemory();
        return NULL;
    }
    GuardSet *gs = (GuardSet *)block;
    gs->src = (GSrc *)(block + off_src);
    gs->leaf = (GLeaf *)(block + off_leaf);
    gs->dslot = (GDictSlot *)(block + off_dslot);
    gs->held = (PyObject **)(block + off_held);
    gs->fetch = (int32_t *)(block + off_fetch);
    gs->scratch = (PyObject **)(block + off_scratch);
    gs->scratch_set = (int32_t *)(block + off_scratch_set);
    char *tm = block + off_tm, *how = block + off_how, *di = block + off_di;
    gs->dict_epoch = UINT64_MAX; /* the first check compares every dict tag */
#define HOLD(o) ((o) ? (gs->held[gs->nheld++] = Py_NewRef(o)) : NULL)
    for (uint32_t i = 0; i < ns; i++) {
        if (remap[i] < 0) continue;
        const BSrc *s = &b->src.items[i];
        GSrc *d = &gs->src[gs->nsrc++];
        d->d = s->d;
        d->d.parent = s->d.parent >= 0 ? remap[s->d.parent] : -1;
        d->d.key = HOLD(s->d.key);
        d->value = s->stable ? HOLD(s->value) : NULL;
    }
    for (uint32_t k = 0; k < nkept; k++) {
        const BLeaf *l = &b->leaf.items[order[k]];
        GLeaf *g = &gs->leaf[gs->nleaf++];
        g->kind = l->kind;
        g->sub = l->sub;
        g->src = l->src >= 0 ? remap[l->src] : -1;
        g->obj = HOLD(l->obj);
        g->tag = l->tag;
        if (l->kind == GUARD_DICT_VERSION) {
            GDictInfo *info = (GDictInfo *)di;
            size_t n = strlen(l->aux) + 1;
            gs->dslot[gs->ndict].dict = g->obj;
            gs->dslot[gs->ndict].tag = slot_tag(g->obj, l->tag);
#if EM_PY313
            gs->ndict_unseen += (uint32_t)dict_watch_unseen(g->obj);
#endif
            gs->ndict++;
            di += align8(sizeof(GDictInfo));
            memcpy(how, l->aux, n);
            info->owner = l->owner >= 0 ? remap[l->owner] : -1;
            info->how = how;
            how += n;
            info->whole = l->sub;
            info->nkeys = l->nkv;
            info->kv = (PyObject **)di;
            di += sizeof(PyObject *) * 2 * l->nkv;
            for (uint32_t j = 0; j < 2 * l->nkv; j++) info->kv[j] = HOLD(l->kv[j]);
            g->sub = 0;
            g->tag = 0;
            g->aux = info;
        } else if (l->kind == GUARD_DICT_KEYS || l->kind == GUARD_TYPE_VERSION) {
            g->aux = HOLD(l->obj2);
        } else if (l->kind == GUARD_TENSOR_MATCH) {
            EmTensorMeta *m = em_guard_tensor_meta_copy(l->aux, tm);
            tm += em_guard_tensor_meta_size(m);
            HOLD(m->dtype_obj);
            HOLD(m->device_obj);
            HOLD(m->layout_obj);
            g->aux = m;
        } else if (l->kind == GUARD_NO_OVERLAP) {
            const GOverlap *bo = l->aux;
            GOverlap *ov = (GOverlap *)tm;
            tm += align8(sizeof(GOverlap) + sizeof(int32_t) * bo->n);
            ov->n = bo->n;
            ov->nmut = bo->nmut;
            for (uint32_t j = 0; j < bo->n; j++) ov->src[j] = remap[bo->src[j]];
            g->aux = ov;
        } else if (l->kind == GUARD_SYM) {
            BSym *bs = (BSym *)l->aux;
            uint32_t n = bs->n;
            GSymInfo *info = calloc(1, sizeof(GSymInfo) + (sizeof(int32_t) * 2 + sizeof(void *)) * (n + 1));
            if (!info) {
                em_guard_set_free(gs);
                PyErr_NoMemory();
                return NULL;
            }
            const EmDLPackAPI **apis = (const EmDLPackAPI **)(info + 1);
            info->api = apis;
            info->src = (int32_t *)(apis + n + 1);
            info->dim = info->src + n + 1;
            info->n = n;
            for (uint32_t j = 0; j < n; j++) {
                PyObject *v = b->src.items[bs->src[j]].value;
                info->src[j] = remap[bs->src[j]];
                info->dim[j] = bs->dim[j];
                apis[j] = v ? em_guard_dlpack_api(Py_TYPE(v)) : NULL;
            }
            info->lines = Py_XNewRef(bs->lines);
            info->prog = bs->prog; /* moved: the set frees it */
            bs->prog = NULL;
            gs->sym = info;
            g->aux = info;
        }
    }
#undef HOLD
    for (uint32_t k = 0; k < nf; k++) gs->fetch[gs->nfetch++] = remap[b->fetch.items[k]];
    return gs;
}

void em_guard_set_free(GuardSet *gs) {
    if (!gs) return;
    if (gs->sym) {
        em_sym_prog_free(gs->sym->prog);
        Py_XDECREF(gs->sym->lines);
        free(gs->sym);
    }
    for (uint32_t i = 0; i < gs->nheld; i++) Py_DECREF(gs->held[i]);
    free(gs);
}

int em_guard_nfetch(const GuardSet *gs) { return gs ? (int)gs->nfetch : 0; }

void em_guard_drop_fetch(GuardSet *gs) {
    if (gs) gs->nfetch = 0;
}

/* The leaf's references stay in gs->held until the set is freed. */
int em_guard_drop(GuardSet *gs, int index) {
    if (!gs || index < 0 || (uint32_t)index >= gs->nleaf) return -1;
    uint32_t i = (uint32_t)index;
    memmove(&gs->leaf[i], &gs->leaf[i + 1], sizeof(GLeaf) * (gs->nleaf - i - 1));
    gs->nleaf--;
    if (i < gs->ndict) {
#if EM_PY313
        gs->ndict_unseen -= (uint32_t)dict_watch_unseen(gs->dslot[i].dict);
#endif
        memmove(&gs->dslot[i], &gs->dslot[i + 1], sizeof(GDictSlot) * (gs->ndict - i - 1));
        gs->ndict--;
    }
    return 0;
}
int em_guard_count(const GuardSet *gs) { return gs ? (int)gs->nleaf : 0; }

/* ---- check ---- */

/* Looks key up in a namespace dict (or mapping). New reference, or NULL (missing or error). */
static PyObject *ns_lookup(PyObject *ns, PyObject *key) {
    if (!ns) return NULL;
    if (PyDict_Check(ns)) return Py_XNewRef(PyDict_GetItemWithError(ns, key));
    return PyObject_GetItem(ns, key);
}

/* The sources' values during one check: v[s] (a new reference, or NULL: not read yet) and the
 * sources read, in order (GuardSet.scratch). */
typedef struct {
    GuardSet *gs;
    PyObject **v;
    int32_t *set;
    uint32_t nset;
    uint8_t owned; /* v and set were allocated for a nested check */
} SrcVals;

/* 0, or -1 (out of memory, no exception: the check fails). */
static int vals_open(GuardSet *gs, SrcVals *sv) {
    sv->gs = gs;
    sv->nset = 0;
    sv->owned = gs->scratch_busy;
    if (!sv->owned) {
        gs->scratch_busy = 1;
        sv->v = gs->scratch;
        sv->set = gs->scratch_set;
        return 0;
    }
    sv->v = calloc(gs->nsrc ? gs->nsrc : 1, sizeof(PyObject *));
    sv->set = malloc(sizeof(int32_t) * (gs->nsrc ? gs->nsrc : 1));
    if (sv->v && sv->set) return 0;
    free(sv->v);
    free(sv->set);
    return -1;
}

/* Releases the values read (leaving the scratch all NULL for the next check). */
static void vals_close(SrcVals *sv) {
    for (uint32_t i = 0; i < sv->nset; i++) {
        int32_t s = sv->set[i];
        PyObject *o = sv->v[s];
        sv->v[s] = NULL;
        Py_DECREF(o);
    }
    if (sv->owned) {
        free(sv->v);
        free(sv->set);
    } else {
        sv->gs->scratch_busy = 0;
    }
}

/* Value of source s in this frame, as a new reference stored in vals->v[s] (each source is resolved
 * at most once per check; the caller releases vals). Borrowed result; NULL when the path cannot
 * be followed (exception cleared). */
static PyObject *resolve(const GuardSet *gs, SrcVals *vals, const EmFrameView *fv, int32_t s) {
    if (vals->v[s]) return vals->v[s];
    const GSrc *src = &gs->src[s];
    PyObject *v = NULL, *p = NULL;
    if (src->value) { /* stable */
        vals->set[vals->nset++] = s;
        return vals->v[s] = Py_NewRef(src->value);
    }
    if (src->d.parent >= 0 && !(p = resolve(gs, vals, fv, src->d.parent))) return NULL;
    switch ((SrcKind)src->d.kind) {
    case SRC_LOCAL:
        if (src->d.index < fv->nlocals) v = Py_XNewRef(fv->locals[src->d.index]);
        break;
    case SRC_GLOBAL:
        v = ns_lookup(fv->globals, src->d.key);
        break;
    case SRC_BUILTIN: { /* LOAD_GLOBAL reads builtins only when globals lack the name */
        PyObject *g = ns_lookup(fv->globals, src->d.key);
        if (g) {
            Py_DECREF(g);
            break;
        }
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) break;
            PyErr_Clear();
        }
        v = ns_lookup(fv->builtins, src->d.key);
        break;
    }
    case SRC_CLOSURE:
        if (fv->closure && PyTuple_Check(fv->closure) && src->d.index < PyTuple_GET_SIZE(fv->closure)) {
            PyObject *cell = PyTuple_GET_ITEM(fv->closure, src->d.index);
            if (PyCell_Check(cell)) v = Py_XNewRef(PyCell_GET(cell));
        }
        break;
    case SRC_CELL:
        if (fv->closure && PyTuple_Check(fv->closure) && src->d.index < PyTuple_GET_SIZE(fv->closure))
            v = Py_NewRef(PyTuple_GET_ITEM(fv->closure, src->d.index));
        break;
    case SRC_CONST: /* always stable: answered above */
        break;
    case SRC_ATTR:
        v = PyObject_GetAttr(p, src->d.key);
        break;
    case SRC_ITEM:
        if (PyList_CheckExact(p)) {
            if (src->d.index < PyList_GET_SIZE(p)) v = Py_NewRef(PyList_GET_ITEM(p, src->d.index));
        } else if (PyTuple_CheckExact(p)) {
            if (src->d.index < PyTuple_GET_SIZE(p)) v = Py_NewRef(PyTuple_GET_ITEM(p, src->d.index));
        } else {
            PyObject *i = PyLong_FromSsize_t(src->d.index);
            if (i) v = PyObject_GetItem(p, i);
            Py_XDECREF(i);
        }
        break;
    case SRC_DICT_ITEM:
        v = PyDict_CheckExact(p) || (src->d.index == 1 && PyDict_Check(p)) ? Py_XNewRef(PyDict_GetItemWithError(p, src->d.key))
                                                                          : PyObject_GetItem(p, src->d.key);
        break;
    case SRC_CONVERT: /* a parent the conversion refuses (not an array any more): the guard fails */
        v = PyObject_CallOneArg(src->d.key, p);
        break;
    }
    if (!v) {
        if (PyErr_Occurred()) PyErr_Clear();
        return NULL;
    }
    vals->set[vals->nset++] = s;
    return vals->v[s] = v;
}

/* a and b are the same float for the traced program: equal with the same sign (0.0 vs -0.0
 * give different results), or both NaN (NaN != NaN must not force a recompile on every call). */
static int float_same(double a, double b) {
    return (a == b && signbit(a) == signbit(b)) || (isnan(a) && isnan(b));
}

/* v equals the constant c with the same exact type at every level (1 == 1.0 == True in Python,
 * but each traces differently). Tuples compare item by item. Never leaves an exception. */
static int const_equal(PyObject *v, PyObject *c) {
    if (v == c) return 1;
    PyTypeObject *t = Py_TYPE(c);
    if (Py_TYPE(v) != t || c == Py_None || t == &PyBool_Type) return 0;
    if (t == &PyFloat_Type) return float_same(PyFloat_AS_DOUBLE(v), PyFloat_AS_DOUBLE(c));
    if (t == &PyUnicode_Type)
        return PyUnicode_GET_LENGTH(v) == PyUnicode_GET_LENGTH(c) && PyUnicode_Compare(v, c) == 0;
    if (t == &PyTuple_Type) {
        Py_ssize_t n = PyTuple_GET_SIZE(c);
        if (PyTuple_GET_SIZE(v) != n) return 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!const_equal(PyTuple_GET_ITEM(v, i), PyTuple_GET_ITEM(c, i))) return 0;
        return 1;
    }
    int r = PyObject_RichCompareBool(v, c, Py_EQ);
    if (r < 0) PyErr_Clear();
    return r == 1;
}

static int equals_passes(const GLeaf *g, PyObject *v) {
    switch (g->sub) {
    case EQ_NONE:
    case EQ_BOOL:
        return v == g->obj;
    case EQ_INT: {
        if (v == g->obj) return 1;
        if (!PyLong_CheckExact(v)) return 0;
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        return !overflow && x == (long long)g->tag;
    }
    case EQ_FLOAT:
        return PyFloat_CheckExact(v) && float_same(PyFloat_AS_DOUBLE(v), PyFloat_AS_DOUBLE(g->obj));
    default:
        return const_equal(v, g->obj);
    }
}

static int len_passes(const GLeaf *g, PyObject *v) {
    Py_ssize_t n;
    if (Py_TYPE(v) != (PyTypeObject *)g->obj) return 0;
    if (PyList_CheckExact(v)) n = PyList_GET_SIZE(v);
    else if (PyTuple_CheckExact(v)) n = PyTuple_GET_SIZE(v);
    else if (PyDict_CheckExact(v)) n = PyDict_GET_SIZE(v);
    else if ((n = PyObject_Length(v)) < 0) PyErr_Clear();
    return n == (Py_ssize_t)g->tag;
}

/* Same exact dict type and the same keys in the same order, compared key by key. */
static int dict_keys_pass(const GLeaf *g, PyObject *v) {
    if (Py_TYPE(v) != (const PyTypeObject *)g->aux) return 0;
    PyObject *keys = g->obj, *k, *val;
    Py_ssize_t n = PyTuple_GET_SIZE(keys), pos = 0, i = 0;
    if (PyDict_GET_SIZE(v) != n) return 0;
    if (PyDict_CheckExact(v)) {
        while (PyDict_Next(v, &pos, &k, &val))
            if (i >= n || !const_equal(k, PyTuple_GET_ITEM(keys, i++))) return 0;
        return i == n;
    }
    PyObject *now = dict_keys_tuple(v);
    if (!now) {
        PyErr_Clear();
        return 0;
    }
    int ok = const_equal(now, keys);
    Py_DECREF(now);
    return ok;
}

static int global_state_passes(const GLeaf *g) {
    uint8_t bits;
    PyObject *dtype;
    if (global_state_read(&bits, &dtype) < 0) {
        Py_XDECREF(dtype);
        PyErr_Clear();
        return 0;
    }
    int ok = bits == g->sub && dtype == g->obj;
    Py_DECREF(dtype);
    return ok;
}

/* A key of a guarded dict is the recorded one: the same object, or an equal exact str (no user
 * __eq__ runs while the dict is walked). */
static int dict_key_same(PyObject *k, PyObject *rec) {
    return k == rec || (PyUnicode_CheckExact(k) && PyUnicode_CheckExact(rec) && PyUnicode_Compare(k, rec) == 0);
}

/* The dict still holds what the trace relied on. Whole: the same items in the same order (a hook
 * dict still empty, _modules the same children). Keyed: every key read holds the object it held,
 * or is still absent. Never leaves an exception. */
static int dict_content_same(PyObject *d, const GDictInfo *info) {
    if (info->whole) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        uint32_t i = 0;
        if (PyDict_GET_SIZE(d) != (Py_ssize_t)info->nkeys) return 0;
        while (PyDict_Next(d, &pos, &k, &v)) {
            if (i >= info->nkeys || v != info->kv[2 * i + 1] || !dict_key_same(k, info->kv[2 * i])) return 0;
            i++;
        }
        return i == info->nkeys;
    }
    for (uint32_t k = 0; k < info->nkeys; k++) {
        PyObject *v = PyDict_GetItemWithError(d, info->kv[2 * k]);
        if (!v && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (v != info->kv[2 * k + 1]) return 0;
    }
    return 1;
}

/* The dict group, leaves [0, ndict). Steady state: one loop of tag loads and compares over the
 * packed slots, no branch per dict. A moved tag is a fast path only: the dict's content is compared
 * with what the trace relied on and, if it is the same, the slot remembers the new tag (read before
 * the content: should a lookup mutate the dict, the next check looks again). 1 pass; 0 fail with
 * *failed = the failing leaf. */
static int dict_group_passes(GuardSet *gs, uint32_t *failed) {
    GDictSlot *slot = gs->dslot;
    uint32_t n = gs->ndict;
    uint64_t acc = 0;
    for (uint32_t i = 0; i < n; i++) acc |= dict_tag(slot[i].dict) ^ slot[i].tag;
    if (acc == 0) return 1;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t t = dict_tag(slot[i].dict);
        if (t == slot[i].tag) continue;
        if (!dict_content_same(slot[i].dict, gs->leaf[i].aux)) {
            *failed = i;
            return 0;
        }
        if (slot[i].tag != EM_DICT_TAG_UNSEEN) slot[i].tag = t;
    }
    return 1;
}

/* One leaf that reads a source (every kind but DICT_VERSION). 1 pass, 0 fail. */
static int leaf_passes(const GuardSet *gs, GLeaf *g, SrcVals *vals, const EmFrameView *fv) {
    PyObject *v = NULL;
    if (g->src >= 0 && !(v = resolve(gs, vals, fv, g->src))) return 0;
    switch ((GuardKind)g->kind) {
    case GUARD_TYPE_VERSION: {
        PyTypeObject *tp = (PyTypeObject *)g->obj;
        if (g->tag != 0 && tp->tp_version_tag == g->tag) return 1;
        if (!type_snapshot_matches(tp, (PyObject *)g->aux)) return 0;
        /* Same lookups under a new tag: remember it. A type that cannot get a tag now (the
         * interpreter's tag space ran out; 3.13+ also gives up on a class after
         * MAX_VERSIONS_PER_CLASS = 1000 reassignments, Objects/typeobject.c) keeps 0, and the
         * snapshot is compared at every check: slower, never a miss by itself. */
        g->tag = type_tag(tp);
        return 1;
    }
    case GUARD_ID_MATCH:
        return v == g->obj;
    case GUARD_TYPE_MATCH:
        return Py_TYPE(v) == (PyTypeObject *)g->obj;
    case GUARD_EQUALS:
        return equals_passes(g, v);
    case GUARD_LEN:
        return len_passes(g, v);
    case GUARD_DICT_KEYS:
        return dict_keys_pass(g, v);
    case GUARD_GLOBAL_STATE:
        return global_state_passes(g);
    case GUARD_SDP_FLAGS: {
        uint8_t bits;
        if (sdp_flags_read(&bits) < 0) return PyErr_Clear(), 0;
        return bits == g->sub;
    }
    case GUARD_TENSOR_MATCH:
        return Py_TYPE(v) == (PyTypeObject *)g->obj && em_guard_tensor_check(g->aux, v);
    case GUARD_NO_OVERLAP: { /* each updated tensor's bytes against every other tensor's */
        const GOverlap *ov = g->aux;
        uintptr_t stack[2 * 32], *r = ov->n <= 32 ? stack : malloc(sizeof(uintptr_t) * 2 * ov->n);
        int ok = r != NULL;
        for (uint32_t j = 0; ok && j < ov->n; j++) {
            PyObject *t = resolve(gs, vals, fv, ov->src[j]);
            ok = t && em_guard_tensor_extent(t, &r[2 * j], &r[2 * j + 1]) == 0;
        }
        ok = ok && em_guard_extents_apart(r, ov->nmut, ov->n);
        if (r != stack) free(r);
        return ok;
    }
    case GUARD_SYM: { /* the symbols' values (sizes, int arguments) into a stack array, then the compiled relations */
        const GSymInfo *info = g->aux;
        int64_t stack[16], *sz = info->n <= 16 ? stack : malloc(sizeof(int64_t) * info->n);
        int ok = sz != NULL;
        for (uint32_t j = 0; ok && j < info->n; j++) {
            PyObject *t = resolve(gs, vals, fv, info->src[j]);
            if (t && info->dim[j] < 0) { /* an int argument's symbol: the exact int itself */
                int overflow = 0;
                ok = PyLong_CheckExact(t) && ((sz[j] = PyLong_AsLongLongAndOverflow(t, &overflow)), !overflow);
                continue;
            }
            ok = t && em_guard_tensor_size(info->api[j], t, info->dim[j], &sz[j]) == 0;
        }
        ok = ok && em_sym_prog_check(info->prog, sz) < 0;
        if (sz != stack) free(sz);
        return ok;
    }
    case GUARD_DICT_VERSION: /* evaluated by em_guard_check as a group */
    case GUARD__COUNT:
        break;
    }
    return 0;
}

/* Does anything but gs keep o alive? (Dynamo's guards hold such objects by weak reference: one
 * that only the guards kept is dead there.) Every reference a set owns is in held[]. */
static bool alive_elsewhere(const GuardSet *gs, PyObject *o) {
    Py_ssize_t own = 0;
    for (uint32_t i = 0; i < gs->nheld; i++) own += gs->held[i] == o;
    return Py_REFCNT(o) > own;
}

bool em_guard_same_id_locals(const GuardSet *gs, const EmFrameView *fv) {
    for (uint32_t i = 0; i < gs->nleaf; i++) {
        const GLeaf *l = &gs->leaf[i];
        if (l->kind != GUARD_ID_MATCH || l->src < 0) continue;
        const GSrc *src = &gs->src[l->src];
        if (src->d.kind != SRC_LOCAL || src->d.parent >= 0 || src->value) continue;
        bool same = src->d.index < fv->nlocals && fv->locals[src->d.index] == l->obj;
        /* another object that lives on (a model's other block) makes the entry another object's; an
         * object only the guard keeps (a fresh output of an earlier call) does not */
        if (!same && alive_elsewhere(gs, l->obj)) return false;
    }
    return true;
}

/* See em_guard.h. *failed is the failing leaf, or -1 when no leaf failed (success, a fetched
 * source that could not be evaluated, or out of memory for a check nested in one of the same set). */
int em_guard_check(GuardSet *gs, const EmFrameView *fv, PyObject **fetched, int *failed) {
    SrcVals vs, *vals = &vs;
    uint32_t i = 0;
    int ok = 0;
    *failed = -1;
    if (vals_open(gs, vals) < 0) return 0;
#if EM_PY312
    uint64_t epoch = em_guard_state.dict_epoch;
    int skip = gs->dict_epoch == epoch && em_guard_state.watcher_id >= 0 && !gs->ndict_unseen;
#else
    em_guard_state.window_gen++; /* a check inside a graph callable closes its window */
    /* a small group costs less than the probe (a dict store): it is always walked */
    uint64_t epoch = gs->ndict >= EM_DICT_PROBE_MIN ? dict_probe_epoch() : UINT64_MAX;
    int skip = epoch != UINT64_MAX && gs->dict_epoch == epoch;
#endif
    if (gs->ndict) {
        if (skip) em_guard_state.group_skips++;
        else em_guard_state.group_walks++;
    }
    if (!skip && !dict_group_passes(gs, &i)) goto fail;
    gs->dict_epoch = epoch;
    for (i = gs->ndict; i < gs->nleaf; i++)
        if (!leaf_passes(gs, &gs->leaf[i], vals, fv)) goto fail;
    for (uint32_t k = 0; k < gs->nfetch; k++)
        if (!resolve(gs, vals, fv, gs->fetch[k])) goto done;
    for (uint32_t k = 0; k < gs->nfetch; k++) fetched[k] = Py_NewRef(vals->v[gs->fetch[k]]);
    ok = 1;
    goto done;
fail:
    *failed = (int)i;
done:
    vals_close(vals);
    return ok;
}

/* See em_guard.h: em_guard_check without its leaves (a pinned code, ember.pin). */
int em_guard_fetch_only(GuardSet *gs, const EmFrameView *fv, PyObject **fetched) {
    SrcVals vs, *vals = &vs;
    int ok = 0;
    if (vals_open(gs, vals) < 0) return 0;
    for (uint32_t k = 0; k < gs->nfetch; k++)
        if (!resolve(gs, vals, fv, gs->fetch[k])) goto done;
    for (uint32_t k = 0; k < gs->nfetch; k++) fetched[k] = Py_NewRef(vals->v[gs->fetch[k]]);
    ok = 1;
done:
    vals_close(vals);
    return ok;
}

/* ---- stage init ---- */

static int intern(PyObject **slot, const char *s) {
    if (!*slot && !(*slot = PyUnicode_InternFromString(s))) return -1;
    return 0;
}

/* ember._C._guard_stats() -> {"dict_group_walks": n, "dict_group_skips": n, "inline_values_unseen":
 * bool}: how many guard checks since start-up compared their dict-version group slot by slot, and how
 * many passed it with one epoch compare (tests check the 3.12 watcher and 3.11 probe fast paths by
 * these, not by timing); whether this CPython's inline-value stores go unseen (3.13.0: groups with
 * such a dict are walked at every check). */
static PyObject *guard_stats(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("{sKsKsN}", "dict_group_walks", (unsigned long long)em_guard_state.group_walks,
                         "dict_group_skips", (unsigned long long)em_guard_state.group_skips, "inline_values_unseen",
                         PyBool_FromLong(em_guard_state.inline_watch_unseen));
}

/* Interned names and, on 3.12, the dict watcher; torch objects now if torch is already imported
 * (otherwise at the first compile). module may be NULL (a lazy init: no functions are added). */
int em_guard_init(PyObject *module) {
    EmGuardState *st = &em_guard_state;
    static PyMethodDef stats_def = {"_guard_stats", guard_stats, METH_NOARGS, "Dict-group fast-path counters."};
    if (module) {
        PyObject *f = PyCFunction_New(&stats_def, NULL);
        if (!f || PyModule_AddObject(module, "_guard_stats", f) < 0) {
            Py_XDECREF(f);
            return -1;
        }
    }
    if (intern(&st->str_cpu, "cpu") < 0 || intern(&st->str_cuda, "cuda") < 0 ||
        intern(&st->s_requires_grad, "requires_grad") < 0 || intern(&st->s_is_conj, "is_conj") < 0 ||
        intern(&st->s_is_neg, "is_neg") < 0 || intern(&st->s_shape, "shape") < 0 ||
        intern(&st->s_stride, "stride") < 0 || intern(&st->s_dtype, "dtype") < 0 ||
        intern(&st->s_device, "device") < 0 || intern(&st->s_layout, "layout") < 0 || intern(&st->s_dlpack_api, "__dlpack_c_exchange_api__") < 0 || intern(&st->s_data_ptr, "data_ptr") < 0 ||
        intern(&st->s_module, "__module__") < 0 || intern(&st->s_qualname, "__qualname__") < 0)
        return -1;
#if EM_PY312
    if (st->watcher_id < 0) {
        st->watcher_id = PyDict_AddWatcher(dict_watch_event);
        if (st->watcher_id < 0) { /* all watcher slots taken: exact tag compares on every check */
            PyErr_Clear();
            st->watcher_id = -1;
        }
    }
#endif
#if EM_PY313
    probe_inline_values(st);
#endif
    PyObject *torch = PyImport_GetModule(em_str("torch"));
    if (torch) {
        Py_DECREF(torch);
        if (em_guard_torch_ready() < 0) PyErr_Clear(); /* retried at the first compile */
    } else if (PyErr_Occurred()) {
        PyErr_Clear();
    }
    return 0;
}

int em_guard_torch_ready(void) {
    EmGuardState *st = &em_guard_state;
    PyObject *torch = NULL, *tensor = NULL;
    if (st->torch_ready) return 0;
    if (!st->s_module && em_guard_init(NULL) < 0) return -1;
    if (!(torch = PyImport_ImportModule("torch"))) goto error;
    if (!(tensor = PyObject_GetAttrString(torch, "Tensor"))) goto error;
    if (!PyType_Check(tensor)) {
        PyErr_SetString(PyExc_TypeError, "ember: torch.Tensor is not a type");
        goto error;
    }
    if (!st->is_grad_enabled && !(st->is_grad_enabled = PyObject_GetAttrString(torch, "is_grad_enabled"))) goto error;
    if (!st->is_autocast_enabled &&
        !(st->is_autocast_enabled = PyObject_GetAttrString(torch, "is_autocast_enabled")))
        goto error;
    if (!st->get_default_dtype && !(st->get_default_dtype = PyObject_GetAttrString(torch, "get_default_dtype")))
        goto error;
    if (!st->get_autocast_dtype && !(st->get_autocast_dtype = PyObject_GetAttrString(torch, "get_autocast_dtype")))
        goto error;
    if (!st->dt_float16 && !(st->dt_float16 = PyObject_GetAttrString(torch, "float16"))) goto error;
    if (!st->dt_bfloat16 && !(st->dt_bfloat16 = PyObject_GetAttrString(torch, "bfloat16"))) goto error;
    if (!st->is_any_autocast_enabled) { /* optional: a private helper, feature-detected */
        PyObject *c = PyObject_GetAttrString(torch, "_C");
        st->is_any_autocast_enabled = c ? PyObject_GetAttrString(c, "_is_any_autocast_enabled") : NULL;
        Py_XDECREF(c);
        if (!st->is_any_autocast_enabled) PyErr_Clear();
    }
    st->tensor_type = (PyTypeObject *)tensor;
    st->torch_ready = 1;
    Py_DECREF(torch);
    return 0;
error:
    Py_XDECREF(torch);
    Py_XDECREF(tensor);
    return -1;
}

void em_guard_fini(void) {
    EmGuardState *st = &em_guard_state;
#if EM_PY312
    if (st->watcher_id >= 0 && PyDict_ClearWatcher(st->watcher_id) < 0) PyErr_Clear();
#endif
    Py_CLEAR(st->probe_dict);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->is_grad_enabled);
    Py_CLEAR(st->is_autocast_enabled);
    Py_CLEAR(st->is_any_autocast_enabled);
    Py_CLEAR(st->get_default_dtype);
    Py_CLEAR(st->get_autocast_dtype);
    for (int i = 0; i < EM_SDP_FLAGS; i++) Py_CLEAR(st->sdp_enabled[i]);
    Py_CLEAR(st->dt_float16);
    Py_CLEAR(st->dt_bfloat16);
    Py_CLEAR(st->str_cpu);
    Py_CLEAR(st->str_cuda);
    Py_CLEAR(st->s_requires_grad);
    Py_CLEAR(st->s_is_conj);
    Py_CLEAR(st->s_is_neg);
    Py_CLEAR(st->s_shape);
    Py_CLEAR(st->s_stride);
    Py_CLEAR(st->s_dtype);
    Py_CLEAR(st->s_device);
    Py_CLEAR(st->s_layout);
    Py_CLEAR(st->s_dlpack_api);
    Py_CLEAR(st->s_data_ptr);
    Py_CLEAR(st->s_module);
    Py_CLEAR(st->s_qualname);
    st->torch_ready = 0;
    st->watcher_id = -1;
}
