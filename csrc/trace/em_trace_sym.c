/* trace, symbolic sizes: tensor inputs whose dims are dynamic get symbols of the trace's ShapeEnv
 * (csrc/sym), size reads give SYMINT values, arithmetic and comparisons on them go through the
 * algebra (a branch records a guard), and an op with a symbolic argument is run a second time on
 * fake tensors whose sizes are torch SymInts mirroring our symbols, so that its output sizes are
 * expressions and every relation torch relied on becomes a guard of ours.
 * Invariant: a size that leaves the symbolic world (a Python int the trace needs) is specialised
 * with em_sym_guard_int, never read silently from the example; so every entry's guards admit only
 * sizes on which the recorded graph computes what eager computes. */
#include "trace/em_trace_int.h"
#include "sym/em_sym.h"

#include <stdio.h>
#include <string.h>

/* ---- the env: created on the first dynamic dim, freed with the trace arena ---- */

static void env_capsule_free(PyObject *cap) { em_sym_env_free(PyCapsule_GetPointer(cap, "ember.ShapeEnv")); }

static int ensure_env(Trace *T) {
    if (T->env) return 0;
    ShapeEnv *env = em_sym_env_new(NULL);
    if (!env) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *cap = PyCapsule_New(env, "ember.ShapeEnv", env_capsule_free);
    if (!cap) {
        em_sym_env_free(env);
        return -1;
    }
    if (!em_arena_hold_steal(T->arena, cap)) return -1;
    T->env = env;
    return 0;
}

static int note(Trace *T, PyObject *s) { /* steals s */
    if (!s) return -1;
    if (!T->sym_notes) {
        PyObject *l = PyList_New(0);
        if (!l || !(T->sym_notes = em_arena_hold_steal(T->arena, l))) {
            Py_DECREF(s);
            return -1;
        }
    }
    int rc = PyList_Append(T->sym_notes, s);
    Py_DECREF(s);
    return rc;
}

/* A sticky failure of the algebra is "cannot compile this", with the env's reason. */
static int env_break(Trace *T) {
    return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "symbolic sizes: %s", em_sym_error_text(em_sym_env_error(T->env)));
}

/* Records where the guard reads the symbols made since before_n (one entry per symbol). */
static int add_symsrc(Trace *T, uint32_t before_n, TValue *t, int32_t dim, GuardSrc src) {
    uint32_t after_n = em_sym_nsymbols(T->env);
    if (after_n > T->capsymsrc) {
        uint32_t nc = after_n * 2 + 8;
        struct TSymSrc *ns = em_arena_alloc(T->arena, sizeof(struct TSymSrc) * nc);
        if (!ns) {
            PyErr_NoMemory();
            return -1;
        }
        if (T->symsrc) memcpy(ns, T->symsrc, sizeof(struct TSymSrc) * T->capsymsrc);
        T->symsrc = ns;
        T->capsymsrc = nc;
    }
    for (uint32_t i = before_n; i < after_n; i++) {
        T->symsrc[i].t = t;
        T->symsrc[i].dim = dim;
        T->symsrc[i].src = src;
        T->symsrc[i].ref = 0;
    }
    return 0;
}

/* ---- policy: which dims of an input are dynamic ---- */

/* Dims listed in tensor.<attr> (a set of ints, as torch._dynamo.mark_dynamic stores them). */
static uint64_t marked_dims(PyObject *t, const char *attr, int ndim) {
    uint64_t mask = 0;
    PyObject *s = em_attr_optional(t, em_str(attr)), *it = NULL, *x; /* usually absent */
    if (!s) {
        PyErr_Clear();
        return 0;
    }
    if ((it = PyObject_GetIter(s))) {
        while ((x = PyIter_Next(it))) {
            long d = PyLong_AsLong(x);
            Py_DECREF(x);
            if (d >= 0 && d < ndim && d < 64) mask |= (uint64_t)1 << d;
        }
        Py_DECREF(it);
    }
    PyErr_Clear();
    Py_DECREF(s);
    return mask;
}

/* mark_dynamic(t, d, min=, max=) bounds: t._ember_dynamic_ranges = {d: (min, max)}. */
static void marked_range(PyObject *t, int d, int64_t *lo, int64_t *hi) {
    PyObject *r = PyObject_GetAttrString(t, "_ember_dynamic_ranges"), *k = NULL, *b;
    *lo = SYM_NEG_INF;
    *hi = SYM_INF;
    if (r && PyDict_Check(r) && (k = PyLong_FromLong(d)) && (b = PyDict_GetItem(r, k)) && PyTuple_Check(b) &&
        PyTuple_GET_SIZE(b) == 2) {
        PyObject *a = PyTuple_GET_ITEM(b, 0), *z = PyTuple_GET_ITEM(b, 1);
        if (a != Py_None) *lo = PyLong_AsLongLong(a);
        if (z != Py_None) *hi = PyLong_AsLongLong(z);
    }
    PyErr_Clear();
    Py_XDECREF(k);
    Py_XDECREF(r);
}

/* Automatic dynamic (Dynamo's frame_state): the sizes first seen for a source are remembered; a
 * later trace of the same code whose sizes differ in a dim makes that dim dynamic from then on.
 * Under a CUDA-graph mode (opts.batch_static) dim 0 never does: each batch size is an entry of its
 * own whose recordings share a bucket (docs/backend_cuda.md, "Buckets"); a KV cache that grows
 * along another dim is one symbolic entry, not a compile per decode step. */
static uint64_t automatic_dims(Trace *T, PyObject *key, const IRMeta *m, PyObject **before) {
    PyObject *fs = T->opts.frame_state, *prev;
    uint64_t mask = 0;
    *before = NULL;
    if (!fs || !key) return 0;
    prev = PyDict_GetItem(fs, key);
    if (prev && PyList_Check(prev) && PyList_GET_SIZE(prev) == m->ndim) {
        for (int d = 0; d < m->ndim && d < 64; d++) {
            PyObject *p = PyList_GET_ITEM(prev, d);
            if (d == 0 && T->opts.batch_static) continue; /* a new batch size: a new static entry */
            if (p == Py_None || PyLong_AsLongLong(p) != m->sizes[d]) {
                if (p != Py_None && !*before) *before = Py_NewRef(prev);
                mask |= (uint64_t)1 << d;
            }
        }
        PyErr_Clear();
        if (*before) { /* copy: the list is updated below */
            PyObject *c = PyList_GetSlice(*before, 0, m->ndim);
            Py_SETREF(*before, c);
        }
        for (int d = 0; d < m->ndim && d < 64; d++)
            if (mask & ((uint64_t)1 << d)) PyList_SetItem(prev, d, Py_NewRef(Py_None));
        return mask;
    }
    PyObject *l = PyList_New(m->ndim);
    for (int d = 0; l && d < m->ndim; d++) {
        PyObject *x = PyLong_FromLongLong(m->sizes[d]);
        if (!x) Py_CLEAR(l);
        else PyList_SET_ITEM(l, d, x);
    }
    if (l) PyDict_SetItem(fs, key, l);
    Py_XDECREF(l);
    PyErr_Clear();
    return 0;
}

/* The example's dim order, innermost first, when its strides are those of a dense tensor laid out
 * in that order (contiguous, channels-last, transposed); -1 when they are not (then the tensor
 * stays static: its strides would be expressions we do not guard). */
static int dense_order(const IRMeta *m, int8_t *order) {
    int n = m->ndim;
    for (int i = 0; i < n; i++) order[i] = (int8_t)(n - 1 - i);
    for (int i = 1; i < n; i++) /* insertion sort by stride, ties keep the innermost dim first */
        for (int j = i; j > 0 && m->strides[order[j]] < m->strides[order[j - 1]]; j--) {
            int8_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    int64_t acc = 1;
    for (int k = 0; k < n; k++) {
        if (m->sizes[order[k]] < 1 || m->strides[order[k]] != acc) return -1;
        acc *= m->sizes[order[k]];
    }
    return 0;
}

int em_tr_sym_input(Trace *T, TValue *v, PyObject *tensor, GuardSrc src, IRMeta *m, uint64_t *dynmask) {
    int n = m->ndim;
    *dynmask = 0;
    if (n == 0 || n > 32 || T->opts.dynamic == 0) return 0;
    if (PyObject_TypeCheck(tensor, (PyTypeObject *)em_trace_rt.Parameter)) return 0; /* parameters stay static */
    PyObject *key = em_guard_src_repr(T->gb, src), *before = NULL;
    if (!key) return -1;
    uint64_t all = n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1);
    uint64_t marked = marked_dims(tensor, "_dynamo_dynamic_indices", n) | marked_dims(tensor, "_dynamo_weak_dynamic_indices", n);
    uint64_t stat = marked_dims(tensor, "_dynamo_static_indices", n);
    uint64_t autod = automatic_dims(T, key, m, &before);
    uint64_t want = ((T->opts.dynamic == 1 ? all : autod) | marked) & ~stat;
    int8_t order[32];
    int rc = 0;
    if (!want) goto done;
    if (dense_order(m, order) < 0) {
        rc = note(T, PyUnicode_FromFormat("%U stays static: its strides are not those of a dense tensor", key));
        goto done;
    }
    if ((rc = ensure_env(T)) < 0) goto done;
    const char *ktext = PyUnicode_AsUTF8(key);
    uint32_t *ss = em_arena_alloc(T->arena, sizeof(uint32_t) * (size_t)n * 2);
    if (!ktext || !ss) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        rc = -1;
        goto done;
    }
    uint64_t dyn = 0;
    for (int d = 0; d < n; d++) {
        int64_t hint = m->sizes[d];
        if (!(want & ((uint64_t)1 << d)) || em_sym_specializes(T->env, hint)) {
            ss[d] = em_sym_const(T->env, hint);
            if ((want & ((uint64_t)1 << d)) && (marked & ((uint64_t)1 << d)))
                note(T, PyUnicode_FromFormat("%s.size()[%d] specialised to %lld (sizes 0 and 1 are)", ktext, d,
                                             (long long)hint));
            continue;
        }
        char source[512];
        int64_t lo = SYM_NEG_INF, hi = SYM_INF;
        marked_range(tensor, d, &lo, &hi);
        snprintf(source, sizeof source, "%s.size()[%d]", ktext, d);
        uint32_t before_n = em_sym_nsymbols(T->env);
        /* duck shaping for dynamic=True only, as torch (DimDynamic.DUCK there, DYNAMIC for automatic
         * and marked dims: `a * b + a` on square then non-square sizes compiles twice, not three times) */
        bool duck = T->opts.dynamic == 1 && !(marked & ((uint64_t)1 << d));
        SymRef e = em_sym_new_size_as(T->env, source, hint, lo, hi, duck);
        if (e == SYM_NONE) {
            rc = env_break(T);
            goto done;
        }
        if ((rc = add_symsrc(T, before_n, v, d, src)) < 0) goto done;
        ss[d] = e;
        dyn |= (uint64_t)1 << d;
        char sym[64];
        em_sym_render(T->env, e, SYM_STYLE_SYMBOLS, sym, sizeof sym);
        PyObject *why = (marked & ((uint64_t)1 << d)) ? PyUnicode_FromString("marked dynamic")
                        : T->opts.dynamic == 1 ? PyUnicode_FromString("dynamic=True")
                        : before ? PyUnicode_FromFormat("automatic dynamic: the size changed (first %S, now %lld)",
                                                        PyList_GET_ITEM(before, d), (long long)hint)
                                 : PyUnicode_FromString("automatic dynamic");
        if (!why) {
            rc = -1;
            goto done;
        }
        rc = note(T, PyUnicode_FromFormat("%s = %s (%U)", source, sym, why));
        Py_DECREF(why);
        if (rc < 0) goto done;
    }
    if (!dyn) goto done;
    /* strides of a dense tensor in the example's dim order: products of the inner sizes */
    SymRef acc = em_sym_const(T->env, 1);
    for (int k = 0; k < n; k++) {
        ss[n + order[k]] = acc;
        acc = em_sym_mul(T->env, acc, ss[order[k]]);
    }
    if (acc == SYM_NONE) {
        rc = env_break(T);
        goto done;
    }
    m->sym_sizes = ss;
    m->sym_strides = ss + n;
    *dynmask = dyn;
done:
    Py_XDECREF(before);
    Py_DECREF(key);
    return rc;
}

/* ---- Python int inputs ----
 *
 * Dynamo's wrap_symint (torch/_dynamo/variables/builder.py, torch 2.13, specialize_int=False): an
 * exact int read from a local (a frame argument, or an item of one) is a constant guarded by
 * value on the first compile; when a recompile sees a different value (frame_state, as for sizes)
 * it becomes a symbol of its own ("automatic dynamic"); dynamic=True makes it one from the first
 * call (assume_static_by_default=False). Int symbols are unbounded and neither duck-shaped nor 0/1
 * specialised (ShapeEnv.create_unspecified_symbol). Ints of globals, closures and nn.Module
 * attributes stay constants, as Dynamo's is_int_specialization_case keeps them. Where the program needs a concrete value (range(n), a list index, int(n), a Python
 * call) the symbol is specialised by em_tr_sym_specialize: a guard n == value, noted. The frame
 * state key is the source text, shared with tensor sources (a list of sizes there). */

/* Dynamo's is_int_specialization_case, negated: a local's path (L['n'], L['args'][0], L['cfg'].k)
 * that passes through no nn.Module (module attributes are taken as configuration, kept static). */
static bool unspecialised_source(Trace *T, GuardSrc src) {
    if (!em_guard_src_is_local(T->gb, src)) return false;
    for (GuardSrc p = em_guard_src_parent(T->gb, src); p >= 0; p = em_guard_src_parent(T->gb, p)) {
        PyObject *o = em_guard_src_value_borrow(T->gb, p);
        if (o && PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.Module)) return false;
    }
    return true;
}

int em_tr_sym_int_input(Trace *T, TValue *v, PyObject *o, GuardSrc src) {
    if (T->opts.dynamic == 0) return 0;
    int overflow = 0;
    long long hint = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (hint == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    /* the same source met twice in one trace is the same symbol */
    for (uint32_t i = 0; T->env && i < em_sym_nsymbols(T->env) && i < T->capsymsrc; i++)
        if (T->symsrc[i].dim < 0 && T->symsrc[i].src == src) {
            v->kind = TV_SYMINT;
            v->u.si.e = em_sym_symbol(T->env, i);
            return 1;
        }
    PyObject *key = em_guard_src_repr(T->gb, src), *why = NULL;
    if (!key) return -1;
    const char *ktext = PyUnicode_AsUTF8(key);
    int rc = 0;
    if (!ktext) {
        rc = -1;
        goto done;
    }
    if (!unspecialised_source(T, src)) goto done;
    if (T->opts.dynamic == 1) {
        why = PyUnicode_FromString("dynamic=True");
    } else {
        PyObject *fs = T->opts.frame_state, *prev = fs ? PyDict_GetItem(fs, key) : NULL;
        if (!fs) goto done;
        if (!prev) { /* first sight: remembered, stays a constant */
            PyObject *x = PyLong_FromLongLong(hint);
            rc = x ? PyDict_SetItem(fs, key, x) : -1;
            Py_XDECREF(x);
            goto done;
        }
        if (prev == Py_None) {
            why = PyUnicode_FromString("automatic dynamic");
        } else if (PyLong_CheckExact(prev)) {
            long long was = PyLong_AsLongLongAndOverflow(prev, &overflow);
            PyErr_Clear();
            if (!overflow && was == hint) goto done;
            why = PyUnicode_FromFormat("automatic dynamic: the value changed (first %S, now %lld)", prev, hint);
            if (why && PyDict_SetItem(fs, key, Py_None) < 0) Py_CLEAR(why);
        } else {
            goto done; /* the source held a tensor before: a different program point, stays static */
        }
    }
    if (!why || ensure_env(T) < 0) {
        rc = -1;
        goto done;
    }
    uint32_t before_n = em_sym_nsymbols(T->env);
    SymRef e = em_sym_new_int(T->env, ktext, hint, SYM_NEG_INF, SYM_INF);
    if (e == SYM_NONE) {
        rc = env_break(T);
        goto done;
    }
    if ((rc = add_symsrc(T, before_n, NULL, -1, src)) < 0) goto done;
    char sym[64];
    em_sym_render(T->env, e, SYM_STYLE_SYMBOLS, sym, sizeof sym);
    if ((rc = note(T, PyUnicode_FromFormat("%s = %s (%U)", ktext, sym, why))) < 0) goto done;
    v->kind = TV_SYMINT;
    v->u.si.e = e;
    rc = 1;
done:
    Py_XDECREF(why);
    Py_DECREF(key);
    return rc;
}

/* The placeholder node of int symbol k (made on first use: a graph input fetched from its source,
 * a SymInt placeholder in the fx export, as Dynamo's graphs take an unspecialised int). */
static uint32_t int_placeholder(Trace *T, struct TSymSrc *s, SymRef e, int64_t k) {
    if (s->ref) return s->ref;
    TNode nd;
    memset(&nd, 0, sizeof nd);
    nd.kind = IR_PLACEHOLDER;
    nd.meta.kind = IRMETA_OTHER;
    nd.meta.sym = e;
    nd.meta.example = em_arena_hold_steal(T->arena, PyLong_FromLongLong(em_sym_symbol_hint(T->env, (uint32_t)k)));
    if (!nd.meta.example) return 0;
    nd.src = s->src;
    nd.real = nd.meta.example;
    nd.lineno = -1;
    char *name = em_arena_alloc(T->arena, 32);
    if (!name) {
        PyErr_NoMemory();
        return 0;
    }
    snprintf(name, 32, "s%lld", (long long)k); /* as Dynamo names a SymInt placeholder */
    nd.pname = name;
    if (EM_VEC_PUSH(T->arena, T->nodes, nd) < 0 || EM_VEC_PUSH(T->arena, T->inputs, T->nodes.n - 1) < 0) {
        PyErr_NoMemory();
        return 0;
    }
    return s->ref = T->nodes.n - 1;
}

/* ---- SYMINT values ---- */

TValue *em_tr_symint(Trace *T, uint32_t e) {
    int64_t k;
    if (e == SYM_NONE) {
        env_break(T);
        return NULL;
    }
    e = em_sym_simplify(T->env, e);
    if (em_sym_is_const(T->env, e, &k)) return em_tr_const_steal(T, PyLong_FromLongLong(k));
    TValue *v = em_tr_new(T, TV_SYMINT);
    if (v) v->u.si.e = e;
    return v;
}

/* The expression of a SYMINT or a Python int constant (not bool). */
static bool sym_of(Trace *T, TValue *v, SymRef *out) {
    if (v->kind == TV_SYMINT) {
        *out = v->u.si.e;
        return true;
    }
    if (v->kind == TV_CONST && PyLong_CheckExact(v->obj) && T->env) {
        int overflow = 0;
        long long k = PyLong_AsLongLongAndOverflow(v->obj, &overflow);
        if (overflow || (k == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return false;
        }
        if (em_tr_use(T, v) < 0) return false;
        *out = em_sym_const(T->env, k);
        return true;
    }
    return false;
}

static const char *where(Trace *T, char *buf, size_t n) {
    TFrame *F = T->cur;
    buf[0] = 0;
    if (F && F->pc < F->nins) {
        const char *fn = PyUnicode_AsUTF8(F->code->co_filename);
        const char *slash = fn ? strrchr(fn, '/') : NULL;
        snprintf(buf, n, " at %s:%d", slash ? slash + 1 : fn ? fn : "?", PyCode_Addr2Line(F->code, (int)F->ins[F->pc].offset));
    }
    PyErr_Clear();
    return buf;
}

PyObject *em_tr_sym_specialize(Trace *T, TValue *v, const char *why) {
    int64_t k;
    SymRef e = em_sym_simplify(T->env, v->u.si.e);
    if (!em_sym_is_const(T->env, e, NULL)) {
        char txt[128], at[256];
        em_sym_render(T->env, e, SYM_STYLE_SYMBOLS, txt, sizeof txt);
        if (v->symbool) { /* a comparison: guarded as a relation (L['n'] > 3), not as an int */
            int r = em_sym_guard_bool(T->env, e);
            if (r < 0) {
                env_break(T);
                return NULL;
            }
            if (note(T, PyUnicode_FromFormat("%s specialised to %s (%s%s)", txt, r ? "True" : "False", why, where(T, at, sizeof at))) < 0)
                return NULL;
            return PyBool_FromLong(r);
        }
        if (em_sym_guard_int(T->env, e, &k) < 0) {
            env_break(T);
            return NULL;
        }
        if (note(T, PyUnicode_FromFormat("%s specialised to %lld (%s%s)", txt, (long long)k, why, where(T, at, sizeof at))) < 0)
            return NULL;
    } else {
        em_sym_is_const(T->env, e, &k);
    }
    return v->symbool ? PyBool_FromLong(k != 0) : PyLong_FromLongLong(k);
}

int em_tr_sym_dim_int(Trace *T, IRMeta *m, int dim, int64_t *out) {
    *out = m->sizes[dim];
    if (!m->sym_sizes || !T->env) return 0;
    TValue tmp;
    memset(&tmp, 0, sizeof tmp);
    tmp.kind = TV_SYMINT;
    tmp.u.si.e = m->sym_sizes[dim];
    PyObject *k = em_tr_sym_specialize(T, &tmp, "a Python loop or length over a tensor dim");
    if (!k) return -1;
    Py_DECREF(k);
    return 0;
}

static SymOp cmp_op(int cmp) { /* Py_LT.. Py_GE -> SymOp */
    static const SymOp map[6] = {SYM_LT, SYM_LE, SYM_EQ, SYM_NE, SYM_GT, SYM_GE};
    return map[cmp];
}

static TValue *settle_bool(Trace *T, TValue *v);

TValue *em_tr_sym_compare(Trace *T, int cmp, TValue *a, TValue *b, int *handled) {
    SymRef x, y;
    *handled = 0;
    if (a->kind != TV_SYMINT && b->kind != TV_SYMINT) return NULL;
    if ((a->symbool || b->symbool) && (!(a = settle_bool(T, a)) || !(b = settle_bool(T, b)))) {
        *handled = 1;
        return NULL;
    }
    if (a->kind != TV_SYMINT && b->kind != TV_SYMINT) return NULL;
    if (!sym_of(T, a, &x) || !sym_of(T, b, &y)) return NULL;
    *handled = 1;
    SymRef c = em_sym_cmp(T->env, cmp_op(cmp), x, y);
    int64_t k;
    if (c == SYM_NONE) {
        env_break(T);
        return NULL;
    }
    if (em_sym_is_const(T->env, c, &k)) return em_tr_const(T, k ? Py_True : Py_False); /* decided by the ranges */
    /* a SymBool, as torch's: guarded where a branch needs it, a graph value in a tensor op */
    TValue *v = em_tr_symint(T, c);
    if (v && v->kind == TV_SYMINT) v->symbool = true;
    return v;
}

/* A SymBool operand of Python arithmetic, min/max, another comparison, identity: its value now
 * (guarded), so that the result keeps Python's types (True & True is a bool, max(True, 0) is True).
 * NULL with a break. */
static TValue *settle_bool(Trace *T, TValue *v) {
    if (!v || v->kind != TV_SYMINT || !v->symbool) return v;
    PyObject *b = em_tr_sym_specialize(T, v, "a comparison used as a Python value");
    return em_tr_const_steal(T, b);
}

int em_tr_sym_truth(Trace *T, TValue *v, bool *out) {
    int r = em_sym_guard_bool(T->env, v->symbool ? v->u.si.e : em_sym_cmp(T->env, SYM_NE, v->u.si.e, em_sym_const(T->env, 0)));
    if (r < 0) return env_break(T);
    *out = r;
    return 0;
}

TValue *em_tr_sym_neg(Trace *T, TValue *a) { return em_tr_symint(T, em_sym_neg(T->env, a->u.si.e)); } /* -True is -1 */

TValue *em_tr_sym_binop(Trace *T, int nb, TValue *a, TValue *b, int *handled) {
    SymRef x, y;
    *handled = 0;
    if (a->kind != TV_SYMINT && b->kind != TV_SYMINT) return NULL;
    if ((a->symbool || b->symbool) && (!(a = settle_bool(T, a)) || !(b = settle_bool(T, b)))) {
        *handled = 1;
        return NULL;
    }
    if (a->kind != TV_SYMINT && b->kind != TV_SYMINT) return NULL; /* both were SymBools: Python's fold */
    if (!sym_of(T, a, &x) || !sym_of(T, b, &y)) return NULL;
    int base = nb >= 13 ? nb - 13 : nb;
    ShapeEnv *env = T->env;
    if (base == 2 || base == 6) { /* // and %: a divisor that may be 0 is specialised (Python raises) */
        int nz = em_sym_guard_bool(env, em_sym_cmp(env, SYM_NE, y, em_sym_const(env, 0)));
        if (nz < 0) {
            env_break(T);
            return NULL;
        }
        if (!nz) return NULL; /* 0: the fold raises ZeroDivisionError as eager does */
    }
    SymRef r;
    switch (base) {
    case 0: r = em_sym_add(env, x, y); break;
    case 10: r = em_sym_sub(env, x, y); break;
    case 5: r = em_sym_mul(env, x, y); break;
    case 2: r = em_sym_floordiv(env, x, y); break;
    case 6: r = em_sym_mod(env, x, y); break;
    case 8: case 3: case 9: { /* x ** k, x << k, x >> k for a constant k >= 0 (Python ints: x << k is
                               * x * 2**k and x >> k is x // 2**k, negative x included); a symbolic or
                               * negative k (a float power, a ValueError) is specialised */
        int64_t k;
        if (!em_sym_is_const(env, y, &k) || k < 0 || k > (base == 8 ? 64 : 62)) return NULL;
        if (base == 8) {
            r = em_sym_const(env, 1);
            for (int64_t j = 0; j < k && r != SYM_NONE; j++) r = em_sym_mul(env, r, x);
        } else {
            SymRef p2 = em_sym_const(env, (int64_t)1 << k);
            r = base == 3 ? em_sym_mul(env, x, p2) : em_sym_floordiv(env, x, p2);
        }
        if (r == SYM_NONE) {
            env_break(T);
            return NULL;
        }
        break;
    }
    default: return NULL; /* / & | ^ @: the caller specialises */
    }
    *handled = 1;
    return em_tr_symint(T, r);
}

/* min/max over ints of which some are symbolic (min(n, 5), max(a, b, 2)): Min/Max expressions, as
 * torch.sym_min / sym_max, instead of a guard on each value. *handled = 0 when an item is not an int. */
TValue *em_tr_sym_minmax(Trace *T, bool is_min, TValue **items, uint32_t n, int *handled) {
    *handled = 0;
    bool any = false;
    for (uint32_t i = 0; i < n; i++) {
        TValue *v = em_tr_realize(T, items[i]);
        if (!v) return NULL;
        if (v->kind == TV_SYMINT && v->symbool) return NULL; /* max(True, 0) is True: Python's fold */
        if (v->kind == TV_SYMINT) any = true;
        else if (v->kind != TV_CONST || !PyLong_CheckExact(v->obj)) return NULL;
    }
    if (!any || !T->env) return NULL;
    SymRef r = SYM_NONE;
    for (uint32_t i = 0; i < n; i++) {
        SymRef x;
        if (!sym_of(T, items[i], &x)) return NULL;
        r = i == 0 ? x : is_min ? em_sym_min(T->env, r, x) : em_sym_max(T->env, r, x);
    }
    *handled = 1;
    if (r == SYM_NONE) {
        env_break(T);
        return NULL;
    }
    return em_tr_symint(T, r);
}

/* abs() of a symbolic int: Max(x, -x). NULL with *handled = 0 for any other value. */
TValue *em_tr_sym_abs(Trace *T, TValue *v, int *handled) {
    *handled = 0;
    if (!(v = em_tr_realize(T, v)) || v->kind != TV_SYMINT || v->symbool) return NULL; /* abs(True): Python's fold */
    *handled = 1;
    SymRef r = em_sym_max(T->env, v->u.si.e, em_sym_neg(T->env, v->u.si.e));
    if (r == SYM_NONE) {
        env_break(T);
        return NULL;
    }
    return em_tr_symint(T, r);
}

/* ---- symbolic floats ---- */

/* The float of an operand: a SYMFLOAT's hint, a SYMINT's, a number's (bool and int too). 0 when the
 * operand is none of these. */
static int float_hint(Trace *T, TValue *v, double *out) {
    int64_t h;
    if (v->kind == TV_SYMFLOAT) {
        *out = v->u.sf.hint;
        return 1;
    }
    if (v->kind == TV_SYMINT) {
        if (em_sym_hint(T->env, v->u.si.e, &h) < 0) return 0;
        *out = (double)h;
        return 1;
    }
    if (v->kind == TV_CONST && (PyLong_CheckExact(v->obj) || PyFloat_CheckExact(v->obj) || PyBool_Check(v->obj))) {
        *out = PyFloat_AsDouble(v->obj);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return 1;
    }
    return 0;
}

/* The graph argument of an operand (a node or a constant), its Python hint in *py (new reference). */
static int float_arg(Trace *T, TValue *v, IRArg *out, PyObject **py) {
    if (v->kind == TV_SYMINT) return em_tr_sym_arg(T, v, out, py);
    memset(out, 0, sizeof *out);
    if (v->kind == TV_SYMFLOAT) {
        out->kind = IRARG_NODE;
        out->u.ref = v->u.sf.ref;
        *py = PyFloat_FromDouble(v->u.sf.hint);
        return *py ? 0 : -1;
    }
    if (em_tr_use(T, v) < 0) return -1;
    out->kind = IRARG_CONST;
    out->u.obj = v->obj;
    *py = Py_NewRef(v->obj);
    return 0;
}

/* Adds a's and b's size expressions to r's (NULL b: a only). false: more than 4 (the caller specialises). */
static bool merge_deps(TValue *r, TValue *a, TValue *b) {
    TValue *ops[2] = {a, b};
    r->u.sf.ndeps = 0;
    for (int i = 0; i < 2; i++) {
        TValue *o = ops[i];
        if (!o) continue;
        uint32_t n = o->kind == TV_SYMFLOAT ? o->u.sf.ndeps : o->kind == TV_SYMINT ? 1 : 0;
        for (uint32_t j = 0; j < n; j++) {
            uint32_t e = o->kind == TV_SYMFLOAT ? o->u.sf.deps[j] : o->u.si.e;
            bool seen = false;
            for (uint32_t k = 0; k < r->u.sf.ndeps; k++) seen |= r->u.sf.deps[k] == e;
            if (seen) continue;
            if (r->u.sf.ndeps == 4) return false;
            r->u.sf.deps[r->u.sf.ndeps++] = e;
        }
    }
    return true;
}

/* target(*operands) as a float node of the graph whose value for the hints is the Python result of
 * target on the operands' hints (so the float is Python's to the bit). */
static TValue *float_node(Trace *T, PyObject *target, TValue *a, TValue *b) {
    IRArg *args = em_arena_alloc(T->arena, sizeof(IRArg) * 2);
    PyObject *pa = NULL, *pb = NULL, *hint = NULL;
    TValue *r = em_tr_new(T, TV_SYMFLOAT);
    if (!args || !r) return NULL;
    if (!merge_deps(r, a, b)) return NULL;
    if (float_arg(T, a, &args[0], &pa) < 0 || (b && float_arg(T, b, &args[1], &pb) < 0)) goto fail;
    hint = b ? PyObject_CallFunctionObjArgs(target, pa, pb, NULL) : PyObject_CallOneArg(target, pa);
    if (!hint || !PyFloat_CheckExact(hint)) goto fail;
    IRMeta m;
    memset(&m, 0, sizeof m);
    m.kind = IRMETA_OTHER;
    m.example = em_arena_hold_steal(T->arena, Py_NewRef(hint));
    if (!m.example) goto fail;
    r->u.sf.hint = PyFloat_AS_DOUBLE(hint);
    r->u.sf.ref = em_tr_add_node(T, IR_CALL_FUNCTION, target, args, b ? 2 : 1, NULL, NULL, 0, &m);
    Py_XDECREF(pa);
    Py_XDECREF(pb);
    Py_XDECREF(hint);
    return r->u.sf.ref ? r : NULL;
fail:
    Py_XDECREF(pa);
    Py_XDECREF(pb);
    Py_XDECREF(hint);
    if (!T->broke && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError)) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
    return NULL;
}

PyObject *em_tr_sym_float_value(Trace *T, TValue *v, const char *why) {
    for (uint32_t i = 0; i < v->u.sf.ndeps; i++) {
        TValue tmp;
        memset(&tmp, 0, sizeof tmp);
        tmp.kind = TV_SYMINT;
        tmp.u.si.e = v->u.sf.deps[i];
        PyObject *k = em_tr_sym_specialize(T, &tmp, why);
        if (!k) return NULL;
        Py_DECREF(k);
    }
    return PyFloat_FromDouble(v->u.sf.hint);
}

TValue *em_tr_sym_settle(Trace *T, TValue *v) {
    if (v && v->kind == TV_SYMFLOAT)
        return em_tr_const_steal(T, em_tr_sym_float_value(T, v, "a symbolic float used as a Python value"));
    return settle_bool(T, v);
}

TValue *em_tr_sym_float_binop(Trace *T, int nb, TValue *a, TValue *b, int *handled) {
    *handled = 0;
    int base = nb >= 13 ? nb - 13 : nb;
    bool symf = a->kind == TV_SYMFLOAT || b->kind == TV_SYMFLOAT;
    bool symi = a->kind == TV_SYMINT || b->kind == TV_SYMINT;
    if (!T->env || !(symf || symi) || a->symbool || b->symbool) return NULL;
    /* ** by an int constant: a float's power, or an int's negative power (n ** -1); a fractional
     * power of a value that may be negative is complex in Python: specialised */
    bool ipow = base == 8 && b->kind == TV_CONST && PyLong_CheckExact(b->obj) && a->kind != TV_CONST &&
                (symf || _PyLong_Sign(b->obj) < 0);
    if (!symf && base != 11 && !ipow) return NULL; /* int arithmetic: em_tr_sym_binop */
    if (base != 0 && base != 10 && base != 5 && base != 11 && !ipow) return NULL; /* // % ...: specialised */
    double ha, hb;
    if (!float_hint(T, a, &ha) || !float_hint(T, b, &hb)) return NULL;
    if ((base == 11 || ipow) && (base == 11 ? hb : ha) == 0.0) return NULL; /* ZeroDivisionError: the fold raises it */
    *handled = 1;
    TValue *r = float_node(T, em_trace_rt.binop_fn[base], a, b); /* operator.add / sub / mul / truediv / pow */
    if (!r && !T->broke && !PyErr_Occurred()) *handled = 0; /* more than 4 sizes read: specialised */
    return r;
}

TValue *em_tr_sym_float_of(Trace *T, TValue *v, int *handled) {
    *handled = 0;
    if (!T->env || (v->kind != TV_SYMINT && v->kind != TV_SYMFLOAT) || v->symbool) return NULL;
    *handled = 1;
    if (v->kind == TV_SYMFLOAT) return v;
    return float_node(T, (PyObject *)&PyFloat_Type, v, NULL);
}

TValue *em_tr_sym_float_neg(Trace *T, TValue *v) { return float_node(T, em_trace_rt.op_neg, v, NULL); }

/* ---- graph nodes for size expressions ---- */

static PyObject *lookup(const char *mod, const char *name) {
    PyObject *m = PyImport_ImportModule(mod);
    if (!m) return NULL;
    PyObject *r = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return r;
}

static uint32_t sym_node(Trace *T, SymRef e, IRArg *out);

/* A node computing target(a, b) on two size expressions (hint as its example). */
static uint32_t binary_node(Trace *T, SymRef e, PyObject *target, const IRArg *a, const IRArg *b) {
    IRArg *args = em_arena_alloc(T->arena, sizeof(IRArg) * 2);
    int64_t hint = 0;
    if (!args || em_sym_hint(T->env, e, &hint) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return 0;
    }
    args[0] = *a;
    args[1] = *b;
    IRMeta m;
    memset(&m, 0, sizeof m);
    m.kind = IRMETA_OTHER;
    m.sym = e;
    m.example = em_arena_hold_steal(T->arena, PyLong_FromLongLong(hint));
    if (!m.example) return 0;
    return em_tr_add_node(T, IR_CALL_FUNCTION, target, args, 2, NULL, NULL, 0, &m);
}

static int const_arg(Trace *T, int64_t k, IRArg *out) {
    memset(out, 0, sizeof *out);
    out->kind = IRARG_CONST;
    out->u.obj = em_arena_hold_steal(T->arena, PyLong_FromLongLong(k));
    return out->u.obj ? 0 : -1;
}

static int node_arg(uint32_t r, IRArg *out) {
    memset(out, 0, sizeof *out);
    out->kind = IRARG_NODE;
    out->u.ref = r;
    return r ? 0 : -1;
}

/* Fills *out with the graph argument for e: a constant, or a node (memoised per SymRef). */
static int sym_arg_of(Trace *T, SymRef e, IRArg *out) {
    int64_t k;
    e = em_sym_simplify(T->env, e);
    if (em_sym_is_const(T->env, e, &k)) return const_arg(T, k, out);
    return node_arg(sym_node(T, e, out), out);
}

static uint32_t fold_terms(Trace *T, SymRef whole, SymOp op, PyObject *tgt, uint32_t n, SymRef e) {
    /* n-ary Min/Max as a chain of binary nodes; intermediate ones get the whole's SymRef 0 */
    IRArg acc, x;
    if (sym_arg_of(T, em_sym_operand(T->env, e, 0, NULL), &acc) < 0) return 0;
    uint32_t r = 0;
    for (uint32_t i = 1; i < n; i++) {
        if (sym_arg_of(T, em_sym_operand(T->env, e, i, NULL), &x) < 0) return 0;
        if (!(r = binary_node(T, i + 1 == n ? whole : e, tgt, &acc, &x))) return 0;
        node_arg(r, &acc);
    }
    EM_UNUSED(op);
    return r;
}

static uint32_t sym_node(Trace *T, SymRef e, IRArg *out) {
    EM_UNUSED(out);
    if (e < T->capsymnode && T->symnode[e]) return T->symnode[e];
    ShapeEnv *env = T->env;
    int64_t k;
    uint32_t n, r = 0;
    TraceRT *rt = &em_trace_rt;
    SymOp op = em_sym_node(env, e, &k, &n);
    IRArg a, b;
    switch (op) {
    case SYM_SYMBOL: { /* torch.ops.aten.sym_size.int(x, d) on the input the symbol was read from */
        struct TSymSrc *s = (uint64_t)k < T->capsymsrc ? &T->symsrc[k] : NULL;
        if (s && s->dim < 0) {
            r = int_placeholder(T, s, e, k);
            break;
        }
        if (!s || !s->t) {
            em_tr_break(T, EM_BREAK_INTERNAL, "symbol s%lld has no input", (long long)k);
            return 0;
        }
        uint32_t tr = em_tr_tensor_ref(T, s->t);
        PyObject *sz = lookup("torch", "ops");
        PyObject *t1 = sz ? PyObject_GetAttrString(sz, "aten") : NULL;
        PyObject *t2 = t1 ? PyObject_GetAttrString(t1, "sym_size") : NULL;
        PyObject *tgt = t2 ? PyObject_GetAttrString(t2, "int") : NULL;
        Py_XDECREF(sz);
        Py_XDECREF(t1);
        Py_XDECREF(t2);
        if (!tr || !tgt || !em_arena_hold_steal(T->arena, tgt)) return 0;
        if (node_arg(tr, &a) < 0 || const_arg(T, s->dim, &b) < 0) return 0;
        r = binary_node(T, e, tgt, &a, &b);
        break;
    }
    case SYM_ADD: { /* k + c0*m0 + c1*m1 ...: operator.add / sub / mul chain */
        IRArg acc;
        bool have = false;
        for (uint32_t i = 0; i < n; i++) {
            int64_t c;
            SymRef m = em_sym_operand(env, e, i, &c);
            IRArg t;
            if (sym_arg_of(T, m, &t) < 0) return 0;
            int64_t ac = c < 0 ? -c : c;
            if (ac != 1) {
                IRArg cc;
                if (const_arg(T, ac, &cc) < 0) return 0;
                uint32_t mr = binary_node(T, em_sym_mul(env, m, em_sym_const(env, ac)), rt->binop_fn[5], &t, &cc);
                if (node_arg(mr, &t) < 0) return 0;
            }
            if (!have) {
                if (c < 0) { /* -t: 0 - t */
                    IRArg z;
                    if (const_arg(T, 0, &z) < 0) return 0;
                    uint32_t nr = binary_node(T, em_sym_mul(env, m, em_sym_const(env, c)), rt->binop_fn[10], &z, &t);
                    if (node_arg(nr, &t) < 0) return 0;
                }
                acc = t;
                have = true;
                continue;
            }
            SymRef partial = e; /* the hint of a partial sum is computed from its own expression */
            SymRef sofar = em_sym_const(env, 0);
            for (uint32_t j = 0; j <= i; j++) {
                int64_t cj;
                SymRef mj = em_sym_operand(env, e, j, &cj);
                sofar = em_sym_add(env, sofar, em_sym_mul(env, mj, em_sym_const(env, cj)));
            }
            partial = sofar;
            uint32_t sr = binary_node(T, partial, rt->binop_fn[c < 0 ? 10 : 0], &acc, &t);
            if (node_arg(sr, &acc) < 0) return 0;
        }
        if (k != 0) {
            IRArg kc;
            if (const_arg(T, k < 0 ? -k : k, &kc) < 0) return 0;
            r = binary_node(T, e, rt->binop_fn[k < 0 ? 10 : 0], &acc, &kc);
        } else {
            r = acc.u.ref;
        }
        break;
    }
    case SYM_MUL: { /* atom0**e0 * atom1**e1 ...: operator.mul chain */
        IRArg acc;
        bool have = false;
        SymRef sofar = em_sym_const(env, 1);
        for (uint32_t i = 0; i < n; i++) {
            int64_t p;
            SymRef m = em_sym_operand(env, e, i, &p);
            IRArg t;
            if (sym_arg_of(T, m, &t) < 0) return 0;
            for (int64_t j = 0; j < p; j++) {
                sofar = em_sym_mul(env, sofar, m);
                if (!have) {
                    acc = t;
                    have = true;
                    continue;
                }
                uint32_t mr = binary_node(T, sofar, rt->binop_fn[5], &acc, &t);
                if (node_arg(mr, &acc) < 0) return 0;
            }
        }
        r = acc.u.ref;
        break;
    }
    case SYM_FLOORDIV: case SYM_MOD:
        if (sym_arg_of(T, em_sym_operand(env, e, 0, NULL), &a) < 0 || sym_arg_of(T, em_sym_operand(env, e, 1, NULL), &b) < 0)
            return 0;
        r = binary_node(T, e, rt->binop_fn[op == SYM_FLOORDIV ? 2 : 6], &a, &b);
        break;
    case SYM_MIN: case SYM_MAX: {
        PyObject *tgt = lookup("torch", op == SYM_MIN ? "sym_min" : "sym_max");
        if (!tgt || !em_arena_hold_steal(T->arena, tgt)) return 0;
        r = fold_terms(T, e, op, tgt, n, e);
        break;
    }
    case SYM_EQ: case SYM_NE: case SYM_LT: case SYM_LE: case SYM_GT: case SYM_GE: { /* a SymBool: operator.lt ... */
        static const int cmp_index[] = {[SYM_LT] = 0, [SYM_LE] = 1, [SYM_EQ] = 2, [SYM_NE] = 3, [SYM_GT] = 4, [SYM_GE] = 5};
        if (sym_arg_of(T, em_sym_operand(env, e, 0, NULL), &a) < 0 || sym_arg_of(T, em_sym_operand(env, e, 1, NULL), &b) < 0)
            return 0;
        if (!(r = binary_node(T, e, rt->cmp_fn[cmp_index[op]], &a, &b))) return 0;
        int64_t h = 0;
        if (em_sym_hint(env, e, &h) < 0) return 0;
        T->nodes.items[r].meta.example = h ? Py_True : Py_False; /* held: immortal singletons */
        break;
    }
    default:
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a size expression of an unsupported kind");
        return 0;
    }
    if (!r) return 0;
    if (e >= T->capsymnode) {
        uint32_t nc = e * 2 + 64;
        uint32_t *nm = em_arena_alloc(T->arena, sizeof(uint32_t) * nc);
        if (!nm) {
            PyErr_NoMemory();
            return 0;
        }
        if (T->symnode) memcpy(nm, T->symnode, sizeof(uint32_t) * T->capsymnode);
        T->symnode = nm;
        T->capsymnode = nc;
    }
    T->symnode[e] = r;
    return r;
}

int em_tr_sym_arg(Trace *T, TValue *v, IRArg *out, PyObject **py) {
    int64_t hint;
    SymRef e = em_sym_simplify(T->env, v->u.si.e);
    if (em_sym_hint(T->env, e, &hint) < 0) return env_break(T);
    if (sym_arg_of(T, e, out) < 0) {
        if (!T->broke && !PyErr_Occurred()) return env_break(T);
        return -1;
    }
    *py = v->symbool ? PyBool_FromLong(hint != 0) : PyLong_FromLongLong(hint);
    return *py ? 0 : -1;
}

/* ---- size queries ---- */

TValue *em_tr_sym_query(Trace *T, TValue *t, const char *what, TValue **args, uint32_t nargs, int *handled) {
    IRMeta *m = t->u.t.meta;
    *handled = 0;
    if (!m->sym_sizes || !T->env) return NULL;
    bool shape = !strcmp(what, "shape") || !strcmp(what, "size");
    bool stride = !strcmp(what, "stride");
    if (shape || stride) {
        const uint32_t *src = stride ? m->sym_strides : m->sym_sizes;
        if (!src) return NULL;
        if (nargs > 1) return NULL;
        *handled = 1;
        if (nargs == 1) {
            PyObject *d = em_tr_to_py_const(T, args[0]);
            if (!d) {
                if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "Tensor.%s with a non-constant dim", what);
                return NULL;
            }
            long dim = PyLong_AsLong(d);
            Py_DECREF(d);
            if (dim == -1 && PyErr_Occurred()) {
                em_tr_break_exc(T, EM_BREAK_RAISE);
                return NULL;
            }
            if (dim < 0) dim += m->ndim;
            if (dim < 0 || dim >= m->ndim) {
                em_tr_raise_msg(T, PyExc_IndexError, "Dimension out of range");
                return NULL;
            }
            return em_tr_symint(T, src[dim]);
        }
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * ((size_t)m->ndim + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        for (int i = 0; i < m->ndim; i++)
            if (!(items[i] = em_tr_symint(T, src[i]))) return NULL;
        TValue *tup = em_tr_tuple(T, items, (uint32_t)m->ndim);
        if (tup && shape) tup->u.seq.cls = em_trace_rt.Size; /* a torch.Size, as eager's (returned as one) */
        return tup;
    }
    if (!strcmp(what, "numel") || !strcmp(what, "nelement")) {
        *handled = 1;
        return em_tr_symint(T, em_sym_numel(T->env, m->sym_sizes, (uint32_t)m->ndim));
    }
    if (!strcmp(what, "__len__") || !strcmp(what, "len")) {
        *handled = 1;
        if (m->ndim == 0) {
            em_tr_break(T, EM_BREAK_RAISE, "len() of a 0-d tensor");
            return NULL;
        }
        return em_tr_symint(T, m->sym_sizes[0]);
    }
    return NULL;
}

/* ---- ops with symbolic arguments: the fake-tensor run ---- */

/* Builds a Python tree for _fake.sym_run from an IR argument: node refs become
 * ("T", example, device, sizes, strides) for tensors (sizes/strides: tuples of expressions in
 * symbol style, or None when static), ("S", expr) for size values, a slice for a slice node. */
static PyObject *sym_py_arg(Trace *T, const IRArg *a, int depth) {
    if (depth > 16) {
        PyErr_SetString(PyExc_RecursionError, "ember: argument nested too deep");
        return NULL;
    }
    switch (a->kind) {
    case IRARG_CONST:
        return Py_NewRef(a->u.obj);
    case IRARG_TUPLE: case IRARG_LIST: {
        PyObject *r = a->kind == IRARG_TUPLE ? PyTuple_New(a->n) : PyList_New(a->n);
        for (uint32_t i = 0; r && i < a->n; i++) {
            PyObject *x = sym_py_arg(T, &a->u.items[i], depth + 1);
            if (!x) Py_CLEAR(r);
            else if (a->kind == IRARG_TUPLE) PyTuple_SET_ITEM(r, i, x);
            else PyList_SET_ITEM(r, i, x);
        }
        return r;
    }
    case IRARG_NODE: {
        TNode *nd = &T->nodes.items[a->u.ref];
        IRMeta *m = &nd->meta;
        if (m->kind == IRMETA_OTHER && !m->sym && nd->target == (PyObject *)&PySlice_Type) {
            PyObject *p[3] = {Py_None, Py_None, Py_None};
            for (uint32_t i = 0; i < nd->nargs && i < 3; i++)
                if (!(p[i] = sym_py_arg(T, &nd->args[i], depth + 1))) {
                    for (uint32_t j = 0; j < i; j++) Py_DECREF(p[j]);
                    return NULL;
                }
            PyObject *sl = PySlice_New(p[0], p[1], p[2]);
            for (uint32_t i = 0; i < nd->nargs && i < 3; i++) Py_DECREF(p[i]);
            return sl;
        }
        return em_ir_sym_value_tree(T->env, m);
    }
    }
    return NULL;
}

/* tree: ("const", k) | ("sym", i) | (op, a, b) (em_ir_sym_from_tree). */
static SymRef tree_build(Trace *T, PyObject *tree) { return em_ir_sym_from_tree(T->env, tree); }

/* Specialises every symbol listed (a relation or size torch made that our algebra cannot hold). */
static int specialise_syms(Trace *T, PyObject *syms, const char *why) {
    for (Py_ssize_t i = 0; i < PySequence_Size(syms); i++) {
        PyObject *x = PySequence_GetItem(syms, i);
        long k = x ? PyLong_AsLong(x) : -1;
        Py_XDECREF(x);
        if (k < 0 || k >= (long)em_sym_nsymbols(T->env)) {
            PyErr_Clear();
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "symbolic sizes: an unknown symbol");
        }
        TValue tmp;
        memset(&tmp, 0, sizeof tmp);
        tmp.kind = TV_SYMINT;
        tmp.u.si.e = em_sym_symbol(T->env, (uint32_t)k);
        PyObject *r = em_tr_sym_specialize(T, &tmp, why);
        if (!r) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* A size from a result tree: ("unknown", [symbols]) specialises them and gives the hint. */
static int size_of_tree(Trace *T, PyObject *tree, int64_t hint, SymRef *out) {
    if (PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0)) &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(tree, 0), "unknown") == 0) {
        if (specialise_syms(T, PyTuple_GET_ITEM(tree, 1), "a size torch computes with a function ember's algebra lacks") < 0)
            return -1;
        *out = em_sym_const(T->env, hint);
        return 0;
    }
    SymRef e = tree_build(T, tree);
    int64_t h;
    if (e == SYM_NONE) {
        if (PyErr_Occurred()) return em_tr_break_exc(T, EM_BREAK_INTERNAL);
        return env_break(T);
    }
    if (em_sym_hint(T->env, e, &h) < 0) return env_break(T);
    if (h != hint)
        return em_tr_break(T, EM_BREAK_INTERNAL, "symbolic size %lld disagrees with the meta size %lld", (long long)h,
                           (long long)hint);
    *out = em_sym_simplify(T->env, e);
    return 0;
}

/* Do the stride trees st evaluate to m's strides at the hints? (An "unknown" tree counts as agreeing:
 * size_of_tree specialises it.) No break, no exception. */
static bool strides_agree(Trace *T, PyObject *st, const IRMeta *m) {
    for (int i = 0; i < m->ndim; i++) {
        PyObject *tree = PyTuple_GET_ITEM(st, i);
        if (PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0)) &&
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(tree, 0), "unknown") == 0)
            continue;
        SymRef e = tree_build(T, tree);
        int64_t h;
        if (e == SYM_NONE || em_sym_hint(T->env, e, &h) < 0) {
            PyErr_Clear();
            return true; /* size_of_tree reports it */
        }
        if (h != m->strides[i]) return false;
    }
    return true;
}

/* Strides of a dense layout in m's dim order (the fastest dim first), over the symbolic sizes sz:
 * where torch's fake kernel lays a result out in another order than the meta kernel (an advanced
 * index beside an Ellipsis, Falcon's fused_qkv[..., [-2], :]: the fake result indexed-dim-first,
 * the meta one contiguous), the meta's layout is the one the graph's meta records, and eager's.
 * -1 when m's layout is not dense (the caller then reports the disagreement). */
static int dense_strides(Trace *T, const IRMeta *m, const SymRef *sz, SymRef *out) {
    int order[16], n = m->ndim;
    if (n > 16) return -1;
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) /* by stride ascending; among equal strides the later dim first */
        for (int j = i; j > 0 && (m->strides[order[j]] < m->strides[order[j - 1]] ||
                                  (m->strides[order[j]] == m->strides[order[j - 1]] && order[j] > order[j - 1]));
             j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    int64_t run = 1;
    SymRef srun = em_sym_const(T->env, 1);
    for (int i = 0; i < n; i++) {
        int d = order[i];
        if (m->sizes[d] == 1) { /* any stride: the meta's */
            out[d] = em_sym_const(T->env, m->strides[d]);
            continue;
        }
        if (m->strides[d] != run) return -1;
        out[d] = srun;
        run *= m->sizes[d];
        srun = em_sym_mul(T->env, srun, sz[d]);
    }
    return 0;
}

/* Gives tensor meta m the sizes/strides of tree ("T", sizes, strides). */
static int apply_tensor(Trace *T, PyObject *tree, IRMeta *m) {
    if (!PyTuple_Check(tree) || PyTuple_GET_SIZE(tree) != 3) return em_tr_break(T, EM_BREAK_INTERNAL, "bad symbolic result");
    PyObject *sz = PyTuple_GET_ITEM(tree, 1), *st = PyTuple_GET_ITEM(tree, 2);
    if (!PyTuple_Check(sz) || PyTuple_GET_SIZE(sz) != m->ndim || !PyTuple_Check(st) || PyTuple_GET_SIZE(st) != m->ndim)
        return em_tr_break(T, EM_BREAK_INTERNAL, "symbolic result of another rank");
    uint32_t *ss = em_arena_alloc(T->arena, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
    if (!ss) {
        PyErr_NoMemory();
        return -1;
    }
    bool any = false;
    for (int i = 0; i < m->ndim; i++) {
        if (size_of_tree(T, PyTuple_GET_ITEM(sz, i), m->sizes[i], &ss[i]) < 0) return -1;
        any |= !em_sym_is_const(T->env, ss[i], NULL);
    }
    if (!strides_agree(T, st, m) && dense_strides(T, m, ss, ss + m->ndim) == 0) {
        any |= m->ndim > 0;
    } else {
        for (int i = 0; i < m->ndim; i++) {
            if (size_of_tree(T, PyTuple_GET_ITEM(st, i), m->strides[i], &ss[m->ndim + i]) < 0) return -1;
            any |= !em_sym_is_const(T->env, ss[m->ndim + i], NULL);
        }
    }
    m->sym_sizes = any ? ss : NULL;
    m->sym_strides = any ? ss + m->ndim : NULL;
    return 0;
}

static int apply_result(Trace *T, PyObject *tree, IRMeta *m, int depth) {
    if (tree == Py_None || depth > 4) return 0;
    const char *k = PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) > 0 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))
                        ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0))
                        : NULL;
    if (!k) return em_tr_break(T, EM_BREAK_INTERNAL, "bad symbolic result");
    if (!strcmp(k, "T") && m->kind == IRMETA_TENSOR) return apply_tensor(T, tree, m);
    if (!strcmp(k, "Q") && m->kind == IRMETA_TUPLE) {
        PyObject *items = PyTuple_GET_ITEM(tree, 1);
        if (!PyList_Check(items) || PyList_GET_SIZE(items) != m->nitems)
            return em_tr_break(T, EM_BREAK_INTERNAL, "symbolic result of another length");
        for (uint32_t i = 0; i < m->nitems; i++)
            if (apply_result(T, PyList_GET_ITEM(items, i), &m->items[i], depth + 1) < 0) return -1;
        return 0;
    }
    if ((!strcmp(k, "I") || !strcmp(k, "Q")) && (m->kind == IRMETA_OTHER || m->kind == IRMETA_NONE)) {
        /* numbers inside a sequence result: items that depend on sizes are specialised */
        if (!strcmp(k, "I")) {
            SymRef e;
            int64_t h = 0;
            if (m->example && PyLong_Check(m->example)) h = PyLong_AsLongLong(m->example);
            if (size_of_tree(T, PyTuple_GET_ITEM(tree, 1), h, &e) < 0) return -1;
            if (!em_sym_is_const(T->env, e, NULL)) {
                TValue tmp;
                memset(&tmp, 0, sizeof tmp);
                tmp.kind = TV_SYMINT;
                tmp.u.si.e = e;
                PyObject *r = em_tr_sym_specialize(T, &tmp, "an int inside an op's result");
                if (!r) return -1;
                Py_DECREF(r);
            }
        }
        return 0;
    }
    return em_tr_break(T, EM_BREAK_INTERNAL, "symbolic result of another kind (%s)", k);
}

/* A value for an int or tuple-of-int result tree. */
static TValue *value_of_tree(Trace *T, PyObject *tree, PyObject *res, int depth) {
    const char *k = PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))
                        ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0))
                        : NULL;
    if (k && !strcmp(k, "I") && PyLong_Check(res)) {
        SymRef e;
        if (size_of_tree(T, PyTuple_GET_ITEM(tree, 1), PyLong_AsLongLong(res), &e) < 0) return NULL;
        return em_tr_symint(T, e);
    }
    if (k && !strcmp(k, "Q") && PyTuple_Check(res) && depth < 4) {
        PyObject *items = PyTuple_GET_ITEM(tree, 1);
        Py_ssize_t n = PyTuple_GET_SIZE(res);
        if (!PyList_Check(items) || PyList_GET_SIZE(items) != n) goto bad;
        TValue **vals = em_arena_alloc(T->arena, sizeof(TValue *) * ((size_t)n + 1));
        if (!vals) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (!(vals[i] = value_of_tree(T, PyList_GET_ITEM(items, i), PyTuple_GET_ITEM(res, i), depth + 1))) return NULL;
        return em_tr_tuple(T, vals, (uint32_t)n);
    }
    if (tree == Py_None || (k && !strcmp(k, "C"))) return em_tr_from_py(T, res);
bad:
    em_tr_break(T, EM_BREAK_INTERNAL, "symbolic result of another kind");
    return NULL;
}

int em_tr_sym_call(Trace *T, IRKind kind, PyObject *target, const IRArg *ia, uint32_t nargs, PyObject *kwnames,
                   const IRArg *ik, uint32_t nkw, PyObject *res, IRMeta *m, TValue **symout) {
    static PyObject *sym_run = NULL, *ctx_cls = NULL; /* ember._fake.*; one interpreter (em_module.c) */
    PyObject *args = NULL, *kw = NULL, *hints = NULL, *r = NULL;
    int rc = -1;
    if (symout) *symout = NULL;
    if (m && (m->kind == IRMETA_TENSOR || m->kind == IRMETA_TUPLE) && T->opts.shape_rules) { /* ember's own rule first (em_trace_shape.c) */
        int k = em_tr_shape_rule(T, kind, target, ia, nargs, kwnames, ik, nkw, m);
        if (k != 0) return k < 0 ? -1 : 0;
    }
    { /* remembered for the entry's notes: ops that still need torch's fake run (docs/dynamic_shapes.md) */
        PyObject *name = PyUnicode_Check(target) ? Py_NewRef(target) : PyObject_GetAttrString(target, "__name__");
        if (!name) PyErr_Clear();
        if (name && !T->sym_fake) {
            PyObject *l = PyList_New(0);
            if (!l || !(T->sym_fake = em_arena_hold_steal(T->arena, l))) PyErr_Clear();
        }
        if (name && T->sym_fake && !PySequence_Contains(T->sym_fake, name) && PyList_Append(T->sym_fake, name) < 0)
            PyErr_Clear();
        Py_XDECREF(name);
    }
    if (!em_lazy_attr(&sym_run, "ember._fake", "sym_run") || !em_lazy_attr(&ctx_cls, "ember._fake", "SymContext"))
        return em_tr_break_exc(T, EM_BREAK_INTERNAL);
    if (!T->sym_ctx) {
        PyObject *c = PyObject_CallNoArgs(ctx_cls);
        if (!c || !(T->sym_ctx = em_arena_hold_steal(T->arena, c))) return em_tr_break_exc(T, EM_BREAK_INTERNAL);
    }
    args = PyTuple_New(nargs);
    kw = PyDict_New();
    hints = PyList_New(em_sym_nsymbols(T->env));
    if (!args || !kw || !hints) goto done;
    for (uint32_t i = 0; i < em_sym_nsymbols(T->env); i++) {
        /* an int argument's symbol is passed as (hint, True): torch makes it an unspecified int */
        PyObject *h = PyLong_FromLongLong(em_sym_symbol_hint(T->env, i));
        if (h && i < T->capsymsrc && T->symsrc[i].dim < 0) Py_SETREF(h, Py_BuildValue("(NO)", h, Py_True));
        if (!h) goto done;
        PyList_SET_ITEM(hints, i, h);
    }
    for (uint32_t i = 0; i < nargs; i++) {
        PyObject *x = sym_py_arg(T, &ia[i], 0);
        if (!x) goto done;
        PyTuple_SET_ITEM(args, i, x);
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *x = sym_py_arg(T, &ik[i], 0);
        if (!x || PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), x) < 0) {
            Py_XDECREF(x);
            goto done;
        }
        Py_DECREF(x);
    }
    r = PyObject_CallFunctionObjArgs(sym_run, T->sym_ctx, hints, target, kind == IR_CALL_METHOD ? Py_True : Py_False, args,
                                     kw, NULL);
    if (!r) goto done;
    /* r = (result tree, [guard trees], break reason or None) */
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
        PyErr_SetString(PyExc_TypeError, "ember._fake.sym_run returned no triple");
        goto done;
    }
    PyObject *guards = PyTuple_GET_ITEM(r, 1);
    if (PyTuple_GET_ITEM(r, 2) != Py_None) { /* torch cannot run it on symbolic sizes: specialise them */
        const char *why = PyUnicode_AsUTF8(PyTuple_GET_ITEM(r, 2));
        char buf[320];
        snprintf(buf, sizeof buf, "an op torch runs only on concrete sizes: %s", why ? why : "?");
        PyErr_Clear();
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(guards); i++)
            if (specialise_syms(T, PyTuple_GET_ITEM(PyList_GET_ITEM(guards, i), 1), buf) < 0) goto out;
        rc = 0; /* every symbol of the arguments is a constant now: the meta result is exact */
        goto out;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(guards); i++) {
        PyObject *g = PyList_GET_ITEM(guards, i);
        if (PyTuple_GET_SIZE(g) == 2 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(g, 0), "unknown") == 0) {
            if (specialise_syms(T, PyTuple_GET_ITEM(g, 1), "a relation torch relied on that ember's algebra lacks") < 0) {
                rc = -1;
                goto out;
            }
            continue;
        }
        SymRef c = tree_build(T, g);
        if (c == SYM_NONE) goto done;
        int b = em_sym_guard_bool(T->env, c);
        if (b < 0) {
            rc = env_break(T);
            goto out;
        }
        if (b != 1) {
            rc = em_tr_break(T, EM_BREAK_INTERNAL, "a relation torch relied on does not hold on the hints");
            goto out;
        }
    }
    PyObject *tree = PyTuple_GET_ITEM(r, 0);
    if (m && m->kind != IRMETA_NONE && (m->kind == IRMETA_TENSOR || m->kind == IRMETA_TUPLE)) {
        rc = apply_result(T, tree, m, 0);
        goto out;
    }
    if (symout) {
        *symout = value_of_tree(T, tree, res, 0);
        rc = *symout ? 0 : -1;
        goto out;
    }
    rc = 0;
    goto out;
done:
    if (PyErr_Occurred()) rc = em_tr_break_exc(T, EM_BREAK_META_FAILED);
out:
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(hints);
    Py_XDECREF(r);
    return rc;
}

/* ---- end of trace ---- */

/* Simplifies m's expressions under everything learnt; metadata whose sizes all became constants
 * (specialised) is static again. */
static void simplify_meta(ShapeEnv *env, IRMeta *m) {
    if (m->sym_sizes) {
        bool any = false;
        for (int i = 0; i < m->ndim; i++) {
            m->sym_sizes[i] = em_sym_simplify(env, m->sym_sizes[i]);
            any |= !em_sym_is_const(env, m->sym_sizes[i], NULL);
            if (m->sym_strides) {
                m->sym_strides[i] = em_sym_simplify(env, m->sym_strides[i]);
                any |= !em_sym_is_const(env, m->sym_strides[i], NULL);
            }
        }
        if (!any) m->sym_sizes = m->sym_strides = NULL;
    }
    if (m->sym) m->sym = em_sym_simplify(env, m->sym);
    for (uint32_t i = 0; m->kind == IRMETA_TUPLE && i < m->nitems; i++) simplify_meta(env, &m->items[i]);
}

/* The entry's relations as Python text (rendering). New list, NULL with an exception. */
static PyObject *guard_lines(ShapeEnv *env) {
    const SymGuard *gs;
    uint32_t ng = em_sym_produce_guards(env, &gs);
    PyObject *lines = PyList_New(0);
    for (uint32_t i = 0; lines && i < ng; i++) {
        char buf[1024];
        em_sym_render(env, gs[i].rel, SYM_STYLE_SOURCES, buf, sizeof buf);
        PyObject *s = PyUnicode_FromString(buf);
        if (!s || PyList_Append(lines, s) < 0) Py_CLEAR(lines);
        Py_XDECREF(s);
    }
    return lines;
}

int em_trace_sym_refresh_guards(EmTraceResult *res) {
    ShapeEnv *env = res->graph ? res->graph->shape_env : NULL;
    if (!env || !res->guards) return 0;
    if (em_sym_env_error(env) != SYM_ERR_OK) {
        PyErr_Format(PyExc_RuntimeError, "ember: symbolic sizes: %s", em_sym_error_text(em_sym_env_error(env)));
        return -1;
    }
    PyObject *lines = guard_lines(env);
    SymProg *p = lines ? em_sym_prog_compile(env) : NULL;
    if (!p) {
        Py_XDECREF(lines);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: symbolic sizes: the guard program");
        return -1;
    }
    int rc = em_guard_sym_refresh(res->guards, p, lines);
    Py_DECREF(lines);
    return rc;
}

int em_tr_sym_finish(Trace *T, IRGraph *g) {
    if (!T->env) return 0;
    if (em_sym_env_error(T->env) != SYM_ERR_OK) return env_break(T);
    if (g) {
        g->shape_env = T->env;
        for (IRRef i = 1; i < g->nnodes; i++) simplify_meta(T->env, &g->nodes[i].meta);
    }
    if (T->sym_fake && PyList_GET_SIZE(T->sym_fake)) {
        PyObject *sep = PyUnicode_FromString(", "), *j = sep ? PyUnicode_Join(sep, T->sym_fake) : NULL;
        Py_XDECREF(sep);
        if (!j || note(T, PyUnicode_FromFormat("sizes from a fake-tensor run (no C shape rule): %U", j)) < 0) {
            Py_XDECREF(j);
            return -1;
        }
        Py_DECREF(j);
    }
    T->res->sym_notes = T->sym_notes;
    if (g) T->res->symbolic = em_ir_is_symbolic(g);
    /* the guard: every produced relation, checked by a compiled program on each call */
    uint32_t ns = em_sym_nsymbols(T->env);
    GuardSrc *srcs = em_arena_alloc(T->arena, sizeof(GuardSrc) * (ns + 1));
    int32_t *dims = em_arena_alloc(T->arena, sizeof(int32_t) * (ns + 1));
    if (!srcs || !dims) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < ns; i++) {
        srcs[i] = T->symsrc[i].src;
        dims[i] = T->symsrc[i].dim;
    }
    PyObject *lines = guard_lines(T->env);
    if (!lines) return -1;
    SymProg *p = em_sym_prog_compile(T->env);
    if (!p) {
        Py_DECREF(lines);
        return env_break(T);
    }
    int rc = em_guard_sym(T->gb, p, srcs, dims, ns, lines); /* takes p */
    Py_DECREF(lines);
    return rc;
}
