/* trace, exceptions: try/except/finally and with-blocks, traced like any other control flow.
 * A try body runs on the normal path (its finally body is inlined there by CPython's compiler);
 * an exception the trace *knows* (a real instance: `raise ValueError("x")`, a missing attribute)
 * is a RAISE break that the innermost enclosing handler of the exception table may catch: the
 * break is cleared, the frame's stack is unwound to the entry's depth and the handler is traced
 * (PUSH_EXC_INFO, CHECK_EXC_MATCH, WITH_EXCEPT_START, POP_EXCEPT, RERAISE), as CPython does in
 * Python/ceval.c (exception_unwind). An exception no handler of the traced frames catches stays a
 * RAISE break: the frame runs eagerly and raises it for real.
 * Invariant: only exceptions raised by the traced Python code are caught here. An exception that a
 * graph op raises at run time (a data-dependent failure such as cholesky of a singular matrix)
 * propagates out of the compiled graph even if eager's try block would have caught it. */
#include "trace/em_trace_int.h"

#include <stdarg.h>
#include <string.h>

/* Reads a varint of the exception table (6-bit chunks, most significant first, bit 6 = more;
 * Objects/exception_handling_notes.txt). Returns the index after it, or -1 past the end. */
static Py_ssize_t exc_varint(const unsigned char *p, Py_ssize_t n, Py_ssize_t i, int *out) {
    if (i >= n) return -1;
    int v = p[i] & 63;
    while (p[i] & 64) {
        if (++i >= n) return -1;
        v = (v << 6) | (p[i] & 63);
    }
    *out = v;
    return i + 1;
}

int em_tr_exc_decode(Trace *T, TFrame *F, const unsigned char *p, Py_ssize_t len, uint32_t nunits) {
    Py_ssize_t j = 0;
    uint32_t cap = (uint32_t)(len / 4 + 1);
    F->exctab = em_arena_alloc(T->arena, sizeof(TExcEntry) * cap);
    F->nexc = 0;
    if (!F->exctab) {
        PyErr_NoMemory();
        return -1;
    }
    while (j < len && F->nexc < cap) {
        int s, l, t, d;
        if ((j = exc_varint(p, len, j, &s)) < 0 || (j = exc_varint(p, len, j, &l)) < 0 ||
            (j = exc_varint(p, len, j, &t)) < 0 || (j = exc_varint(p, len, j, &d)) < 0)
            return 1;
        if (t < 0 || (uint32_t)t >= nunits || F->off2ins[t] < 0) return 1;
        TExcEntry *e = &F->exctab[F->nexc++];
        e->start = (uint32_t)s;
        e->end = (uint32_t)(s + l);
        e->target = F->off2ins[t];
        e->depth = d >> 1;
        e->lasti = (d & 1) != 0;
    }
    return 0;
}

/* The entry covering instruction pc of F, or NULL (entries do not overlap: CPython's assembler
 * splits nested ranges, Python/assemble.c). */
static const TExcEntry *exc_lookup(const TFrame *F, uint32_t pc) {
    if (pc >= F->nins) return NULL;
    uint32_t unit = F->ins[pc].offset / 2;
    for (uint32_t i = 0; i < F->nexc; i++)
        if (F->exctab[i].start <= unit && unit < F->exctab[i].end) return &F->exctab[i];
    return NULL;
}

bool em_tr_in_try(const TFrame *F, uint32_t pc) {
    const TExcEntry *e = exc_lookup(F, pc);
    if (!e || e->target < 0) return false;
    uint32_t t = (uint32_t)e->target;
    /* a with statement's __exit__ call handles its block: breaks there are split as before */
    return !(t + 1 < F->nins && F->ins[t].op == OP_PUSH_EXC_INFO && F->ins[t + 1].op == OP_WITH_EXCEPT_START);
}

/* The break detail for a raised instance: "Type: message" when its only argument is a str (never
 * runs a user __str__). */
static int raise_break(Trace *T, PyObject *exc) {
    PyObject *args = PyObject_GetAttrString(exc, "args");
    if (!args) PyErr_Clear();
    const char *tn = Py_TYPE(exc)->tp_name;
    if (args && PyTuple_Check(args) && PyTuple_GET_SIZE(args) == 1 && PyUnicode_Check(PyTuple_GET_ITEM(args, 0)))
        em_tr_break(T, EM_BREAK_RAISE, "%s: %U", tn, PyTuple_GET_ITEM(args, 0));
    else
        em_tr_break(T, EM_BREAK_RAISE, "%s: raise statement", tn);
    Py_XDECREF(args);
    return -1;
}

int em_tr_raise_steal(Trace *T, PyObject *exc, const char *what) {
    if (!exc) return -1;
    if (T->broke) {
        Py_DECREF(exc);
        return -1;
    }
    if (what)
        em_tr_break(T, EM_BREAK_RAISE, "%s: %s", Py_TYPE(exc)->tp_name, what);
    else
        raise_break(T, exc);
    T->exc = em_arena_hold_steal(T->arena, exc);
    return -1;
}

int em_tr_raise_msg(Trace *T, PyObject *cls, const char *fmt, ...) {
    if (T->broke) return -1;
    PyObject *saved = em_tr_exc_get();
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    PyObject *exc = msg ? PyObject_CallOneArg(cls, msg) : NULL;
    Py_XDECREF(msg);
    if (!exc) {
        PyErr_Clear();
        em_tr_exc_set(saved);
        return em_tr_break(T, EM_BREAK_RAISE, "%s", ((PyTypeObject *)cls)->tp_name);
    }
    em_tr_exc_set(saved);
    return em_tr_raise_steal(T, exc, NULL);
}

int em_tr_exc_unwind(Trace *T, TFrame *F) {
    if (!T->broke || !T->exc || T->res->brk.reason != EM_BREAK_RAISE || PyErr_Occurred()) return 0;
    const TExcEntry *e = exc_lookup(F, F->pc);
    if (!e || e->depth > F->sp || e->target < 0) return 0;
    TValue *ev = em_tr_object(T, T->exc, -1);
    TValue *lasti = e->lasti ? em_tr_const_steal(T, PyLong_FromLong((long)F->ins[F->pc].offset)) : NULL;
    if (!ev || (e->lasti && !lasti)) return 0; /* MemoryError pending: stays a failure */
    ev->stable = true;
    F->sp = e->depth;
    if (lasti) F->stack[F->sp++] = lasti;
    if (F->sp >= F->stackcap) return 0;
    F->stack[F->sp++] = ev;
    F->pc = (uint32_t)e->target;
    F->kwnames = NULL;
    T->exc = NULL;
    T->broke = false;
    EmBreakInfo *b = &T->res->brk;
    b->reason = EM_BREAK_NONE;
    b->detail = b->filename = b->opname = NULL;
    b->lineno = -1;
    T->cur = F;
    return 1;
}

/* The real exception instance a value stands for, or NULL. */
static PyObject *exc_instance(TValue *v) {
    if (v && v->kind == TV_OBJECT && v->obj && PyExceptionInstance_Check(v->obj)) return v->obj;
    return NULL;
}

/* Does constructing cls() run only BaseException's C code (no Python __new__/__init__)? */
static bool plain_exception_class(PyObject *cls) {
    if (!PyExceptionClass_Check(cls)) return false;
    PyTypeObject *tp = (PyTypeObject *)cls;
    PyObject *init = _PyType_Lookup(tp, em_str("__init__")), *new_ = _PyType_Lookup(tp, em_str("__new__"));
    return init && !PyFunction_Check(init) && new_ && !PyFunction_Check(new_);
}

static int do_raise(Trace *T, TValue *e) {
    if (!(e = em_tr_realize(T, e))) return -1;
    PyObject *inst = exc_instance(e);
    if (inst) return em_tr_raise_steal(T, Py_NewRef(inst), NULL);
    PyObject *cls = e->obj && PyType_Check(e->obj) ? e->obj : NULL;
    if (cls && plain_exception_class(cls)) { /* `raise ValueError`: the class is instantiated */
        PyObject *x = PyObject_CallNoArgs(cls);
        if (!x) return em_tr_break_exc(T, EM_BREAK_RAISE);
        return em_tr_raise_steal(T, x, "raise statement");
    }
    if (cls && PyExceptionClass_Check(cls))
        return em_tr_break(T, EM_BREAK_RAISE, "%s: raise statement", ((PyTypeObject *)cls)->tp_name);
    return em_tr_break(T, EM_BREAK_RAISE, "raise statement");
}

static TValue *pop1(Trace *T, TFrame *F) {
    if (F->sp <= 0) {
        em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        return NULL;
    }
    return F->stack[--F->sp];
}

static int push1(Trace *T, TFrame *F, TValue *v) {
    if (!v) return -1;
    if (F->sp >= F->stackcap) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack overflow");
    F->stack[F->sp++] = v;
    return 0;
}

int em_tr_exc_op(Trace *T, TFrame *F, int op, int arg) {
    switch (op) {
    case OP_RAISE_VARARGS: {
        if (arg == 0) {
            if (T->exc_info && exc_instance(T->exc_info)) return do_raise(T, T->exc_info);
            return em_tr_break(T, EM_BREAK_RAISE, "re-raise");
        }
        if (arg == 2 && !pop1(T, F)) return -1; /* the cause: not modelled (a caught exception's
                                                    __cause__ is not read by traced handlers) */
        TValue *e = pop1(T, F);
        return e ? do_raise(T, e) : -1;
    }
    case OP_RERAISE: {
        TValue *e = pop1(T, F);
        if (!e || (arg && !pop1(T, F))) return -1;
        if (exc_instance(e)) return do_raise(T, e);
        return em_tr_break(T, EM_BREAK_RAISE, "re-raise");
    }
    case OP_PUSH_EXC_INFO: {
        TValue *e = pop1(T, F);
        if (!e) return -1;
        if (push1(T, F, T->exc_info ? T->exc_info : em_tr_const(T, Py_None)) < 0) return -1;
        T->exc_info = e;
        return push1(T, F, e);
    }
    case OP_POP_EXCEPT: {
        TValue *prev = pop1(T, F);
        if (!prev) return -1;
        T->exc_info = prev->kind == TV_CONST && prev->obj == Py_None ? NULL : prev;
        return 0;
    }
    case OP_CHECK_EXC_MATCH: {
        TValue *types = pop1(T, F);
        if (!types || F->sp < 1) return types ? em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow") : -1;
        PyObject *inst = exc_instance(F->stack[F->sp - 1]);
        PyObject *t = em_tr_to_py_const(T, types);
        if (!inst || !t) {
            Py_XDECREF(t);
            if (T->broke || PyErr_Occurred()) return -1;
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "except clause on a value the tracer does not know");
        }
        int m = PyErr_GivenExceptionMatches(inst, t);
        Py_DECREF(t);
        return push1(T, F, em_tr_const(T, m ? Py_True : Py_False));
    }
    case OP_WITH_EXCEPT_START: {
        /* [exit, lasti, prev_exc, exc] -> [..., exit(type(exc), exc, tb)] (Python/bytecodes.c) */
        if (F->sp < 4) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        TValue *exit = F->stack[F->sp - 4], *e = F->stack[F->sp - 1];
        PyObject *inst = exc_instance(e);
        if (!inst) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "with-exit of an unknown exception");
        TValue *args[3] = {em_tr_object(T, (PyObject *)Py_TYPE(inst), -1), e, em_tr_const(T, Py_None)};
        if (!args[0] || !args[2]) return -1;
        args[0]->stable = true;
        TValue *r = em_tr_call(T, exit, args, 3, NULL, NULL);
        return push1(T, F, r);
    }
    default:
        return em_tr_break(T, EM_BREAK_INTERNAL, "not an exception instruction");
    }
}

int em_tr_with_enter(Trace *T, TFrame *F, TValue *m) {
    PyObject *cls = m->kind == TV_INSTANCE ? m->u.inst.cls
                    : (m->kind == TV_OBJECT && m->obj && !PyType_Check(m->obj) && !PyModule_Check(m->obj))
                        ? (PyObject *)Py_TYPE(m->obj)
                        : NULL;
    PyObject *enter = cls ? _PyType_Lookup((PyTypeObject *)cls, em_str("__enter__")) : NULL;
    PyObject *exit = cls ? _PyType_Lookup((PyTypeObject *)cls, em_str("__exit__")) : NULL;
    if (!enter || !exit || !PyFunction_Check(enter) || !PyFunction_Check(exit)) {
        const char *what = cls ? ((PyTypeObject *)cls)->tp_name : m->obj ? Py_TYPE(m->obj)->tp_name : "value";
        return em_tr_break(T, EM_BREAK_TRY_BLOCK, "with block on a %s (no Python __enter__/__exit__)", what);
    }
    TValue *ex = em_tr_getattr(T, m, em_str("__exit__"), NULL);
    if (!ex || push1(T, F, ex) < 0) return -1;
    TValue *en = em_tr_getattr(T, m, em_str("__enter__"), NULL);
    if (!en) return -1;
    return push1(T, F, em_tr_call(T, en, NULL, 0, NULL, NULL));
}
