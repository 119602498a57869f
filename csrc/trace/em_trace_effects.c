/* trace/effects: side effects replayed after the graph. An attribute store on an object that
 * outlives the frame (`self.calls += 1`, `obj.last = y`) and a store to the frame's globals are
 * recorded instead of breaking the graph; later reads of the same attribute or global in the
 * trace see the stored value (keyed by the real object, so another path to the same object sees
 * it too), and the runtime performs the stores in program order after the graph ran (Dynamo's
 * side-effect replay). Invariant: only stores whose replay does exactly what eager's store does
 * are recorded: the object's class sets attributes with object.__setattr__ or
 * nn.Module.__setattr__ (plain values), and no data descriptor (property, slot) owns the name.
 * Anything else stays a SIDE_EFFECT break, run in Python by a graph break.
 * Lists and dicts of the caller (`acc.append(y)`, `d["k"] = v`, reached through a source) are
 * mutated in the trace like lists made there, and their final contents are written back into the
 * caller's object after the graph (`obj[:] = items`; `obj.clear(); obj.update(items)`): the
 * object keeps its identity, and nothing outside the frame can see the states in between. One
 * object realized through two paths (an argument that is also `self.acc`) gives two views, so
 * a mutation of it breaks instead. */
#include "trace/em_trace_int.h"

#include <string.h>

enum { EFFECT_ATTR = 1, EFFECT_GLOBAL = 2, EFFECT_CONTAINER = 3, EFFECT_CELL = 4 };

/* May `obj.name = value` be recorded and replayed? Returns 1 yes, 0 no (why in *why). */
static int attr_replayable(Trace *T, TValue *target, PyObject *name, TValue *value, const char **why) {
    PyObject *obj = target->obj;
    PyTypeObject *tp = Py_TYPE(obj);
    *why = NULL;
    if (target->src < 0) {
        *why = "on an object without a source";
        return 0;
    }
    PyObject *setattr = _PyType_Lookup(tp, em_str("__setattr__"));
    bool is_module = PyObject_TypeCheck(obj, (PyTypeObject *)em_trace_rt.Module);
    if (is_module) {
        PyObject *ms = PyObject_GetAttrString(em_trace_rt.Module, "__setattr__");
        if (!ms) return -1;
        Py_DECREF(ms); /* the class keeps it alive */
        if (setattr != ms) {
            *why = "on a module whose class defines __setattr__";
            return 0;
        }
        /* nn.Module.__setattr__ treats parameters, buffers, submodules and tensors specially */
        if (value->kind == TV_TENSOR || value->kind == TV_NN_MODULE || value->kind == TV_LAZY) {
            *why = "of a tensor or module on a module";
            return 0;
        }
        static const char *const dicts[3] = {"_parameters", "_buffers", "_modules"};
        static const char *const whats[3] = {"._parameters", "._buffers", "._modules"}; /* as em_trace_attr.c */
        PyObject *d = PyObject_GenericGetDict(obj, NULL);
        if (!d) return -1;
        for (int i = 0; i < 3; i++) {
            PyObject *sub = PyDict_GetItemString(d, dicts[i]);
            if (!sub || !PyDict_Check(sub)) continue;
            if (PyDict_GetItemWithError(sub, name)) {
                Py_DECREF(d);
                *why = "of a parameter, buffer or submodule name";
                return 0;
            }
            if (em_tr_guard_dict(T, sub, target->src, whats[i], name) < 0) {
                Py_DECREF(d);
                return -1;
            }
        }
        Py_DECREF(d);
    } else if (tp->tp_setattro != PyObject_GenericSetAttr || (setattr && setattr != _PyType_Lookup(&PyBaseObject_Type, em_str("__setattr__")))) {
        *why = "on an object whose class defines __setattr__";
        return 0;
    }
    if (!tp->tp_dictoffset) {
        *why = "on an object without a __dict__";
        return 0;
    }
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set) {
        *why = "to a property or slot";
        return 0;
    }
    /* the class must stay as it is: a property added later would change what the store does */
    if (em_guard_type(T->gb, target->src) < 0) return -1;
    return 1;
}

static int push_effect(Trace *T, int kind, TValue *target, PyObject *obj, PyObject *name, TValue *value) {
    TEffect e = {kind, target, obj, name, value};
    if (EM_VEC_PUSH(T->arena, T->effects, e) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int em_tr_effect_store_attr(Trace *T, TValue *target, PyObject *name, TValue *value) {
    if (!(target = em_tr_realize(T, target))) return -1;
    if ((target->kind != TV_NN_MODULE && target->kind != TV_OBJECT) || !target->obj || PyType_Check(target->obj) ||
        PyModule_Check(target->obj))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U", name);
    TValue *overlaid = NULL;
    if (em_tr_overlay_get(T, target->obj, name, &overlaid)) /* one mechanism per attribute */
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U after a store through __setattr__", name);
    const char *why = NULL;
    int ok = attr_replayable(T, target, name, value, &why);
    if (ok < 0) return em_tr_break_exc(T, EM_BREAK_SIDE_EFFECT);
    if (!ok) return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U %s", name, why);
    return push_effect(T, EFFECT_ATTR, target, em_arena_hold(T->arena, target->obj), name, value);
}

int em_tr_effect_store_global(Trace *T, TFrame *F, PyObject *name, TValue *value) {
    if (F->gsrc != -2 || F->globals != T->fv->globals)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store to a global of another module");
    /* the dict must be the frame's: guard the name like a read (keyed dict-version guard) */
    if (em_tr_dict_version(T, F->globals, "G", name) < 0) return -1;
    return push_effect(T, EFFECT_GLOBAL, NULL, F->globals, name, value);
}

int em_tr_effect_container_seen(Trace *T, TValue *c) {
    for (uint32_t i = 0; i < T->containers.n; i++) {
        TValue *o = T->containers.items[i];
        if (o->obj != c->obj || o == c) continue;
        if (o->replayed)
            return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "%s read through a second path after a mutation",
                               Py_TYPE(c->obj)->tp_name);
        o->aliased = c->aliased = true;
    }
    if (EM_VEC_PUSH(T->arena, T->containers, c) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Containers whose write-back would bypass what reads them in the trace: a module's parameter,
 * buffer and submodule dicts and instance __dict__s are read through attribute lookups, not
 * through this value. */
static bool internal_dict(Trace *T, TValue *c) {
    PyObject *r = em_guard_src_repr(T->gb, c->src);
    if (!r) {
        PyErr_Clear();
        return true;
    }
    static const char *const tails[] = {"._parameters", "._buffers", "._modules", ".__dict__", NULL};
    const char *u = PyUnicode_AsUTF8(r);
    bool bad = !u;
    size_t n = u ? strlen(u) : 0;
    for (int i = 0; u && tails[i]; i++) {
        size_t m = strlen(tails[i]);
        if (n >= m && strcmp(u + n - m, tails[i]) == 0) bad = true;
    }
    if (!u) PyErr_Clear();
    Py_DECREF(r);
    return bad;
}

int em_tr_effect_container(Trace *T, TValue *c, const char *what) {
    if (c->mutable || c->replayed) return 0;
    const char *kind = c->kind == TV_LIST ? "list" : "dict";
    if ((c->kind != TV_LIST && c->kind != TV_DICT) || c->src < 0 || !c->obj ||
        !(PyList_CheckExact(c->obj) || PyDict_CheckExact(c->obj)))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "%s on a %s that outlives the frame", what, kind);
    if (c->aliased)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "%s on a %s reached through two paths", what, kind);
    if (PyDict_CheckExact(c->obj) && internal_dict(T, c))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "%s on a module's or object's own dict", what);
    c->replayed = true;
    return push_effect(T, EFFECT_CONTAINER, c, em_arena_hold(T->arena, c->obj), Py_Ellipsis, c);
}

TValue *em_tr_effect_cell_of(Trace *T, PyObject *cellobj) {
    for (uint32_t i = 0; i < T->containers.n; i++)
        if (T->containers.items[i]->kind == TV_CELL && T->containers.items[i]->obj == cellobj)
            return T->containers.items[i];
    return NULL;
}

int em_tr_effect_store_cell(Trace *T, TValue *cell, TValue *value) {
    if (!cell->u.cell.has_self || !cell->obj)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store to a closure variable of the traced function");
    if (cell->aliased) /* the same cell through another closure: two views of its contents */
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store to a closure variable shared with another traced closure");
    cell->replayed = true;
    cell->u.cell.contents = value;
    return push_effect(T, EFFECT_CELL, cell, em_arena_hold(T->arena, cell->obj), em_str("cell_contents"), value);
}

/* The spec of an input container's final contents: a new list/dict of its items. */
static int contents_spec(Trace *T, OutCtx *C, TValue *c, OutSpec *o) {
    uint32_t n = c->kind == TV_LIST ? c->u.seq.n : c->u.dict.n;
    TValue **vals = c->kind == TV_LIST ? c->u.seq.items : c->u.dict.vals;
    o->n = n;
    o->items = em_arena_alloc(T->arena, sizeof(OutSpec) * (n + 1));
    if (!o->items) {
        PyErr_NoMemory();
        return -1;
    }
    if (c->kind == TV_LIST) {
        o->kind = OUT_LIST;
    } else {
        PyObject *keys = PyTuple_New(n);
        if (!keys) return -1;
        for (uint32_t i = 0; i < n; i++) PyTuple_SET_ITEM(keys, i, Py_NewRef(c->u.dict.keys[i]));
        o->kind = OUT_DICT;
        if (!(o->obj = em_arena_hold_steal(T->arena, keys))) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (uint32_t i = 0; i < n; i++)
        if (em_tr_out_spec(T, C, vals[i], &o->items[i], 1) < 0) return -1;
    return 0;
}

/* The latest recorded store to (obj, name), or NULL. */
static TValue *pending(Trace *T, int kind, PyObject *obj, PyObject *name) {
    for (uint32_t i = T->effects.n; i-- > 0;) {
        TEffect *e = &T->effects.items[i];
        if (e->kind == kind && e->obj == obj &&
            (e->name == name || PyUnicode_Compare(e->name, name) == 0))
            return e->value;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return NULL;
}

TValue *em_tr_effect_attr(Trace *T, TValue *v, PyObject *name) {
    if (!T->effects.n || !v->obj) return NULL;
    if (v->kind != TV_NN_MODULE && v->kind != TV_OBJECT && v->kind != TV_LAZY) return NULL;
    return pending(T, EFFECT_ATTR, v->obj, name);
}

TValue *em_tr_effect_global(Trace *T, TFrame *F, PyObject *name) {
    if (!T->effects.n) return NULL;
    return pending(T, EFFECT_GLOBAL, F->globals, name);
}

int em_tr_effects_spec(Trace *T, OutCtx *C) {
    uint32_t n = T->effects.n;
    if (!n) return 0;
    OutSpec *spec = em_arena_alloc(T->arena, sizeof(OutSpec));
    PyObject *names = PyTuple_New(n);
    if (!spec || !names || !(spec->items = em_arena_alloc(T->arena, sizeof(OutSpec) * 2 * n))) {
        Py_XDECREF(names);
        PyErr_NoMemory();
        return -1;
    }
    em_arena_hold_steal(T->arena, names);
    spec->kind = OUT_TUPLE;
    spec->n = 2 * n;
    for (uint32_t i = 0; i < n; i++) {
        TEffect *e = &T->effects.items[i];
        PyTuple_SET_ITEM(names, i, Py_NewRef(e->name));
        OutSpec *t = &spec->items[2 * i];
        if (e->kind == EFFECT_GLOBAL) { /* None: the frame's globals, at run time */
            t->kind = OUT_CONST;
            t->obj = Py_None;
        } else {
            int slot = em_guard_fetch(T->gb, e->kind == EFFECT_CELL ? e->target->u.cell.self : e->target->src);
            if (slot < 0) return -1;
            t->kind = OUT_FETCH;
            t->index = (uint32_t)slot;
        }
        if (e->kind == EFFECT_CONTAINER ? contents_spec(T, C, e->value, &spec->items[2 * i + 1]) < 0
                                        : em_tr_out_spec(T, C, e->value, &spec->items[2 * i + 1], 1) < 0)
            return -1;
    }
    T->res->effects = spec;
    T->res->effect_names = names;
    return 0;
}
