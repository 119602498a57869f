/* sym test support: ember._C._sym_eval, _sym_guards and _sym_bench let tests/py compare the
 * algebra, the renderer and guard programs with Python's own integers, and bench/ time a guard
 * program. Not part of the public API.
 * Invariant: each call builds a fresh ShapeEnv and frees it before returning. */
#include "sym/em_sym.h"

#include <string.h>
#include <time.h>

/* tree: ("const", k) | ("sym", i) | (op, a, b), op in add sub mul floordiv mod min max. */
static SymRef t_build(ShapeEnv *env, PyObject *tree, const SymRef *syms, Py_ssize_t nsyms) {
    if (!PyTuple_Check(tree) || PyTuple_GET_SIZE(tree) < 2 || !PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))) {
        PyErr_SetString(PyExc_TypeError, "_sym: a tree is (op, ...)");
        return SYM_NONE;
    }
    const char *op = PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0));
    if (!op) return SYM_NONE;
    if (!strcmp(op, "const") || !strcmp(op, "sym")) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tree, 1));
        if (v == -1 && PyErr_Occurred()) return SYM_NONE;
        if (!strcmp(op, "const")) return em_sym_const(env, v);
        if (v < 0 || v >= nsyms) {
            PyErr_SetString(PyExc_IndexError, "_sym: no such symbol");
            return SYM_NONE;
        }
        return syms[v];
    }
    if (PyTuple_GET_SIZE(tree) != 3) {
        PyErr_SetString(PyExc_TypeError, "_sym: a binary op takes two operands");
        return SYM_NONE;
    }
    SymRef a = t_build(env, PyTuple_GET_ITEM(tree, 1), syms, nsyms);
    if (PyErr_Occurred()) return SYM_NONE;
    SymRef b = t_build(env, PyTuple_GET_ITEM(tree, 2), syms, nsyms);
    if (PyErr_Occurred()) return SYM_NONE;
    int known;
    SymRef r = em_sym_binop_named(env, op, a, b, &known);
    if (known) return r;
    PyErr_Format(PyExc_ValueError, "_sym: unknown op %s", op);
    return SYM_NONE;
}

static int t_int64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: expected %zd values", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

#define T_MAXSYMS 16

/* A fresh env with one symbol per hint, sources L['s0'], L['s1'], ...; sizes: size symbols with
 * Dynamo's defaults (0/1 specialised, duck shaping), else int symbols with neither. */
static ShapeEnv *t_env(PyObject *hints_seq, int sizes, SymRef *syms, Py_ssize_t *nsyms) {
    PyObject *fast = PySequence_Fast(hints_seq, "_sym: hints must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_DECREF(fast);
    int64_t hints[T_MAXSYMS];
    if (n > T_MAXSYMS) return PyErr_SetString(PyExc_ValueError, "_sym: too many symbols"), NULL;
    if (t_int64s(hints_seq, hints, n, "_sym: hints") < 0) return NULL;
    ShapeEnvOptions plain = {false, false};
    ShapeEnv *env = em_sym_env_new(sizes ? NULL : &plain);
    if (!env) return PyErr_NoMemory(), NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "L['s%d']", (int)i);
        syms[i] = sizes ? em_sym_new_size(env, src, hints[i], SYM_NEG_INF, SYM_INF)
                        : em_sym_new_int(env, src, hints[i], SYM_NEG_INF, SYM_INF);
    }
    *nsyms = n;
    return env;
}

static PyObject *t_render(ShapeEnv *env, SymRef e, SymStyle st) {
    char small[256];
    size_t need = em_sym_render(env, e, st, small, sizeof small);
    if (need < sizeof small) return PyUnicode_FromString(small);
    char *big = PyMem_Malloc(need + 1);
    if (!big) return PyErr_NoMemory();
    em_sym_render(env, e, st, big, need + 1);
    PyObject *r = PyUnicode_FromString(big);
    PyMem_Free(big);
    return r;
}

/* _sym_eval(tree, hints, values_list, sizes=False) -> (error, symbols_text, sources_text, results)
 * error: None or the sticky failure's text (then the rest is None); results: per values vector,
 * the int or None when evaluation failed (overflow, division by zero). */
static PyObject *t_sym_eval(PyObject *self, PyObject *args) {
    PyObject *tree, *hints, *values_list, *result = NULL, *results = NULL, *t1 = NULL, *t2 = NULL;
    int sizes = 0;
    if (!PyArg_ParseTuple(args, "OOO|p:_sym_eval", &tree, &hints, &values_list, &sizes)) return NULL;
    SymRef syms[T_MAXSYMS];
    Py_ssize_t n;
    ShapeEnv *env = t_env(hints, sizes, syms, &n);
    if (!env) return NULL;
    SymRef e = t_build(env, tree, syms, n);
    if (PyErr_Occurred()) goto done;
    if (em_sym_env_error(env)) {
        result = Py_BuildValue("(sOOO)", em_sym_error_text(em_sym_env_error(env)), Py_None, Py_None, Py_None);
        goto done;
    }
    t1 = t_render(env, e, SYM_STYLE_SYMBOLS);
    t2 = t1 ? t_render(env, e, SYM_STYLE_SOURCES) : NULL;
    PyObject *fast = t2 ? PySequence_Fast(values_list, "_sym_eval: values_list") : NULL;
    if (!fast) goto done;
    results = PyList_New(PySequence_Fast_GET_SIZE(fast));
    for (Py_ssize_t i = 0; results && i < PySequence_Fast_GET_SIZE(fast); i++) {
        int64_t v[T_MAXSYMS], out;
        if (t_int64s(PySequence_Fast_GET_ITEM(fast, i), v, em_sym_nsymbols(env), "_sym_eval: values") < 0) {
            Py_CLEAR(results);
            break;
        }
        PyObject *item = em_sym_eval(env, e, v, &out) == SYM_ERR_OK ? PyLong_FromLongLong(out) : Py_NewRef(Py_None);
        if (!item) {
            Py_CLEAR(results);
            break;
        }
        PyList_SET_ITEM(results, i, item);
    }
    Py_DECREF(fast);
    if (results) result = Py_BuildValue("(OOOO)", Py_None, t1, t2, results);
done:
    Py_XDECREF(t1);
    Py_XDECREF(t2);
    Py_XDECREF(results);
    em_sym_env_free(env);
    return result;
}

/* _sym_guards(hints, questions, values_list, sizes=True) -> (answers, guards, checks)
 * questions: trees whose op is a comparison; answers: em_sym_guard_bool of each (None after a
 * failure); guards: the produced guards rendered as Python over L['s<i>']; checks: per values
 * vector, em_sym_prog_check's result (-1: all hold). */
static PyObject *t_sym_guards(PyObject *self, PyObject *args) {
    PyObject *hints, *questions, *values_list, *answers = NULL, *guards = NULL, *checks = NULL, *result = NULL;
    PyObject *fq = NULL, *fv = NULL;
    int sizes = 1;
    SymProg *p = NULL;
    if (!PyArg_ParseTuple(args, "OOO|p:_sym_guards", &hints, &questions, &values_list, &sizes)) return NULL;
    SymRef syms[T_MAXSYMS];
    Py_ssize_t n;
    ShapeEnv *env = t_env(hints, sizes, syms, &n);
    if (!env) return NULL;
    fq = PySequence_Fast(questions, "_sym_guards: questions");
    fv = fq ? PySequence_Fast(values_list, "_sym_guards: values_list") : NULL;
    if (!fv) goto done;
    answers = PyList_New(0);
    if (!answers) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fq); i++) {
        SymRef q = t_build(env, PySequence_Fast_GET_ITEM(fq, i), syms, n);
        if (PyErr_Occurred()) goto done;
        int r = em_sym_guard_bool(env, q);
        PyObject *a = r < 0 ? Py_NewRef(Py_None) : PyBool_FromLong(r);
        if (PyList_Append(answers, a) < 0) {
            Py_DECREF(a);
            goto done;
        }
        Py_DECREF(a);
    }
    const SymGuard *g;
    uint32_t ng = em_sym_produce_guards(env, &g);
    guards = PyList_New(0);
    if (!guards) goto done;
    for (uint32_t i = 0; i < ng; i++) {
        PyObject *s = t_render(env, g[i].rel, SYM_STYLE_SOURCES);
        if (!s || PyList_Append(guards, s) < 0) {
            Py_XDECREF(s);
            goto done;
        }
        Py_DECREF(s);
    }
    p = em_sym_prog_compile(env);
    checks = PyList_New(0);
    if (!checks) goto done;
    for (Py_ssize_t i = 0; p && i < PySequence_Fast_GET_SIZE(fv); i++) {
        int64_t v[T_MAXSYMS];
        if (t_int64s(PySequence_Fast_GET_ITEM(fv, i), v, em_sym_prog_ninputs(p), "_sym_guards: values") < 0) goto done;
        PyObject *c = PyLong_FromLong(em_sym_prog_check(p, v));
        if (!c || PyList_Append(checks, c) < 0) {
            Py_XDECREF(c);
            goto done;
        }
        Py_DECREF(c);
    }
    result = PyTuple_Pack(3, answers, guards, p ? checks : Py_None);
done:
    Py_XDECREF(fq);
    Py_XDECREF(fv);
    Py_XDECREF(answers);
    Py_XDECREF(guards);
    Py_XDECREF(checks);
    em_sym_prog_free(p);
    em_sym_env_free(env);
    return result;
}

/* _sym_bench(iterations) -> (ns per check, guards): a typical entry's guard program, three size
 * symbols of x: [s0, s1] and y: [s2] with four relations asked (s0 > 4, s1 % 4 == 0, s0 < s2,
 * s0*s1 <= 65536), run on the example's sizes. */
static PyObject *t_sym_bench(PyObject *self, PyObject *args) {
    long long iters;
    if (!PyArg_ParseTuple(args, "L:_sym_bench", &iters)) return NULL;
    ShapeEnv *env = em_sym_env_new(NULL);
    if (!env) return PyErr_NoMemory();
    SymRef s0 = em_sym_new_size(env, "L['x'].size()[0]", 8, SYM_NEG_INF, SYM_INF);
    SymRef s1 = em_sym_new_size(env, "L['x'].size()[1]", 16, SYM_NEG_INF, SYM_INF);
    SymRef s2 = em_sym_new_size(env, "L['y'].size()[0]", 24, SYM_NEG_INF, SYM_INF);
    em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, s0, em_sym_const(env, 4)));
    em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, em_sym_mod(env, s1, em_sym_const(env, 4)), em_sym_const(env, 0)));
    em_sym_guard_bool(env, em_sym_cmp(env, SYM_LT, s0, s2));
    em_sym_guard_bool(env, em_sym_cmp(env, SYM_LE, em_sym_mul(env, s0, s1), em_sym_const(env, 65536)));
    SymProg *p = em_sym_prog_compile(env);
    PyObject *guards = PyList_New(0);
    const SymGuard *g;
    uint32_t ng = em_sym_produce_guards(env, &g);
    for (uint32_t i = 0; guards && i < ng; i++) {
        PyObject *s = t_render(env, g[i].rel, SYM_STYLE_SOURCES);
        if (!s || PyList_Append(guards, s) < 0) Py_CLEAR(guards);
        Py_XDECREF(s);
    }
    em_sym_env_free(env);
    if (!p || !guards) {
        em_sym_prog_free(p);
        Py_XDECREF(guards);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    volatile int64_t vals[3] = {8, 16, 24};
    int64_t v[3];
    long long sink = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long long i = 0; i < iters; i++) {
        v[0] = vals[0]; /* as the guard stage would: fetched values, then the program */
        v[1] = vals[1];
        v[2] = vals[2];
        sink += em_sym_prog_check(p, v);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    em_sym_prog_free(p);
    double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)(iters ? iters : 1);
    if (sink != -iters) { /* every check passed; also keeps the loop alive */
        Py_DECREF(guards);
        PyErr_SetString(PyExc_AssertionError, "_sym_bench: the example's sizes failed their guards");
        return NULL;
    }
    PyObject *r = Py_BuildValue("(dO)", ns, guards);
    Py_DECREF(guards);
    return r;
}

/* _sym_bench_trace(iterations) -> ns per iteration: what one trace of a small program asks of
 * the algebra: a fresh env, x: [s0, s1, s2] and y: [s1, s2] (duck-shaped), broadcast, contiguous
 * strides, numel, view(-1, 4), a slice x[:, : s1 // 2], a conv output size, a matmul, then
 * produce + compile the guard program and free everything. */
static PyObject *t_sym_bench_trace(PyObject *self, PyObject *args) {
    long long iters;
    if (!PyArg_ParseTuple(args, "L:_sym_bench_trace", &iters)) return NULL;
    struct timespec t0, t1;
    int failures = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long long it = 0; it < iters; it++) {
        ShapeEnv *env = em_sym_env_new(NULL);
        if (!env) return PyErr_NoMemory();
        SymRef x[3] = {em_sym_new_size(env, "L['x'].size()[0]", 8, SYM_NEG_INF, SYM_INF),
                       em_sym_new_size(env, "L['x'].size()[1]", 16, SYM_NEG_INF, SYM_INF),
                       em_sym_new_size(env, "L['x'].size()[2]", 32, SYM_NEG_INF, SYM_INF)};
        SymRef y[2] = {em_sym_new_size(env, "L['y'].size()[0]", 16, SYM_NEG_INF, SYM_INF),
                       em_sym_new_size(env, "L['y'].size()[1]", 32, SYM_NEG_INF, SYM_INF)};
        SymRef b[3], st[3], v[2], m[3], out;
        uint32_t nm;
        SymRef shape[2] = {em_sym_const(env, -1), em_sym_const(env, 4)};
        SymRef w[2] = {x[2], em_sym_const(env, 64)};
        int r = em_sym_broadcast_shapes(env, x, 3, y, 2, b);
        r |= em_sym_contiguous_strides(env, b, 3, st);
        r |= em_sym_reshape(env, em_sym_numel(env, b, 3), shape, 2, v);
        r |= em_sym_slice(env, x[1], SYM_NONE, em_sym_floordiv(env, x[1], em_sym_const(env, 2)), SYM_NONE, &out);
        r |= em_sym_conv_out(env, x[2], em_sym_const(env, 3), em_sym_const(env, 2), em_sym_const(env, 1),
                             em_sym_const(env, 1), &out);
        r |= em_sym_matmul_shape(env, b, 3, w, 2, m, &nm);
        SymProg *p = em_sym_prog_compile(env);
        if (r || !p) failures++;
        em_sym_prog_free(p);
        em_sym_env_free(env);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (failures) {
        PyErr_SetString(PyExc_AssertionError, "_sym_bench_trace: a shape rule failed");
        return NULL;
    }
    double ns = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)(iters ? iters : 1);
    return PyFloat_FromDouble(ns);
}

static PyMethodDef t_methods[] = {
    {"_sym_bench_trace", t_sym_bench_trace, METH_VARARGS, "_sym_bench_trace(iterations) -> ns: bench helper."},
    {"_sym_eval", t_sym_eval, METH_VARARGS, "_sym_eval(tree, hints, values_list, sizes=False): test helper."},
    {"_sym_guards", t_sym_guards, METH_VARARGS, "_sym_guards(hints, questions, values_list, sizes=True): test helper."},
    {"_sym_bench", t_sym_bench, METH_VARARGS, "_sym_bench(iterations) -> (ns per check, guards): bench helper."},
    {NULL, NULL, 0, NULL},
};

int em_sym_testing_init(PyObject *module) { return PyModule_AddFunctions(module, t_methods); }
