/* C unit tests for core (arena, vectors, break reasons), ir (building, names, op lookups, DCE,
 * verifier, printer, export) and runtime (EagerGraph, OutSpec). Embeds CPython; needs no torch:
 * graphs call operator/math functions and str methods instead.
 * Invariant: one CHECK macro; the exit status is the number of failed checks (capped at 1). */
#include "core/em_core.h"
#include "ir/em_ir.h"
#include "runtime/em_runtime.h"

#include <stdio.h>
#include <string.h>

static int nfailed, nchecks;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        nchecks++;                                                                    \
        if (!(cond)) {                                                                \
            nfailed++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            if (PyErr_Occurred()) PyErr_Print();                                      \
        }                                                                             \
    } while (0)

/* ---- helpers ---- */

/* module.attr as a new reference (NULL on failure, with the error printed). */
static PyObject *py_get(const char *module, const char *attr) {
    PyObject *m = PyImport_ImportModule(module);
    PyObject *r = m ? PyObject_GetAttrString(m, attr) : NULL;
    Py_XDECREF(m);
    if (!r) PyErr_Print();
    return r;
}

static IRArg node_arg(IRRef r) {
    IRArg a = {0};
    a.kind = IRARG_NODE;
    a.u.ref = r;
    return a;
}

/* A constant argument; the arena holds the object (steals the reference given). */
static IRArg const_arg(EmArena *a, PyObject *obj_steal) {
    IRArg r = {0};
    r.kind = IRARG_CONST;
    r.u.obj = em_arena_hold_steal(a, obj_steal);
    return r;
}

/* Does str object s contain the C string needle? */
static bool str_has(PyObject *s, const char *needle) {
    const char *u = s ? PyUnicode_AsUTF8(s) : NULL;
    return u && strstr(u, needle) != NULL;
}

static IRMeta none_meta(void) {
    IRMeta m = {0};
    m.kind = IRMETA_NONE;
    return m;
}

/* ---- core ---- */

static void test_arena(void) {
    EmArena *a = em_arena_new();
    CHECK(a != NULL);
    unsigned char *p = em_arena_alloc(a, 100);
    CHECK(p != NULL && ((uintptr_t)p & 15) == 0);
    bool zero = true;
    for (int i = 0; i < 100; i++) zero = zero && p[i] == 0;
    CHECK(zero);
    memset(p, 7, 100);
    unsigned char *q = em_arena_realloc(a, p, 100, 300);
    CHECK(q != NULL && q[0] == 7 && q[99] == 7 && q[100] == 0);
    void *big = em_arena_alloc(a, 1 << 20); /* a block of its own */
    CHECK(big != NULL && ((uintptr_t)big & 15) == 0);
    void *after = em_arena_alloc(a, 32); /* still bump-allocated, not lost */
    CHECK(after != NULL);
    char *s = em_arena_strdup(a, "hello");
    CHECK(s && strcmp(s, "hello") == 0);
    for (int i = 0; i < 5000; i++) CHECK(em_arena_alloc(a, 48) != NULL);

    PyObject *obj = PyList_New(0);
    Py_ssize_t rc0 = Py_REFCNT(obj);
    CHECK(em_arena_hold(a, obj) == obj);
    CHECK(Py_REFCNT(obj) == rc0 + 1);
    for (int i = 0; i < 200; i++) em_arena_hold(a, obj); /* grows the held array */
    CHECK(Py_REFCNT(obj) == rc0 + 201);
    CHECK(em_arena_hold(a, NULL) == NULL);
    em_arena_free(a);
    CHECK(Py_REFCNT(obj) == rc0);
    Py_DECREF(obj);
    em_arena_free(NULL);
}

static void test_vec(void) {
    EmArena *a = em_arena_new();
    EM_VEC(int) v = {0};
    for (int i = 0; i < 1000; i++) CHECK(EM_VEC_PUSH(a, v, i * 3) == 0);
    CHECK(v.n == 1000 && v.cap >= 1000);
    bool ok = true;
    for (int i = 0; i < 1000; i++) ok = ok && v.items[i] == i * 3;
    CHECK(ok);
    em_arena_free(a);
}

static void test_break_names(void) {
    CHECK(strcmp(em_break_name(EM_BREAK_NONE), "NONE") == 0);
    CHECK(strcmp(em_break_name(EM_BREAK_UNSUPPORTED_OPCODE), "UNSUPPORTED_OPCODE") == 0);
    CHECK(strcmp(em_break_text(EM_BREAK_NONE), "no graph break") == 0);
    CHECK(strcmp(em_break_name(EM_BREAK_INTERNAL), "INTERNAL") == 0);
    CHECK(strcmp(em_break_name(EM_BREAK__COUNT), "?") == 0);
    CHECK(strcmp(em_break_text((EmBreak)1000), "?") == 0);
    for (int i = 0; i < EM_BREAK__COUNT; i++)
        for (int j = i + 1; j < EM_BREAK__COUNT; j++) CHECK(strcmp(em_break_name(i), em_break_name(j)) != 0);
}

/* ---- ir ---- */

static void test_op_table(void) {
    CHECK(strcmp(em_ir_op_pyname(IROP_ADD), "torch.add") == 0);
    CHECK(strcmp(em_ir_op_pyname(IROP_GELU), "torch.nn.functional.gelu") == 0);
    CHECK(strcmp(em_ir_op_pyname(IROP_OTHER), "") == 0);
    CHECK(strcmp(em_ir_op_pyname(IROP__COUNT), "") == 0);
    CHECK(em_ir_op_category(IROP_SUM) == IRCAT_REDUCTION);
    CHECK(em_ir_op_category(IROP_VIEW) == IRCAT_VIEW);
    CHECK(em_ir_op_category(IROP_MATMUL) == IRCAT_EXTERN);
    CHECK(em_ir_op_category(IROP_SIN) == IRCAT_POINTWISE);
    CHECK(strcmp(em_ir_kind_name(IR_CALL_FUNCTION), "call_function") == 0);
    CHECK(strcmp(em_ir_kind_name(IR_OUTPUT), "output") == 0);
    CHECK(strcmp(em_ir_kind_name(IR_PLACEHOLDER), "placeholder") == 0);
}

/* Names follow torch.fx's _Namespace: snake case, sanitizing, _N suffixes, no keywords or
 * builtins (tests/py/test_fx_bridge.py compares against fx itself). */
static void test_names(void) {
    EmArena *a = em_arena_new();
    IRGraph *g = em_ir_new(a);
    IRMeta m = none_meta();
    PyObject *sin = py_get("math", "sin"), *add = py_get("operator", "add"), *sum = py_get("builtins", "sum");
    IRRef x = em_ir_placeholder(g, "x", &m);
    IRRef x1 = em_ir_placeholder(g, "x", &m);
    IRRef cc = em_ir_placeholder(g, "L_selfCamelCase", &m);
    IRRef dg = em_ir_placeholder(g, "1abc", &m);
    IRRef bad = em_ir_placeholder(g, "a-b c", &m);
    IRRef kw = em_ir_placeholder(g, "class", &m);
    IRRef a1 = em_ir_placeholder(g, "add_1", &m);
    CHECK(strcmp(em_ir_node(g, x)->name, "x") == 0);
    CHECK(strcmp(em_ir_node(g, x1)->name, "x_1") == 0);
    CHECK(strcmp(em_ir_node(g, cc)->name, "l_self_camel_case") == 0);
    CHECK(strcmp(em_ir_node(g, dg)->name, "_1abc") == 0);
    CHECK(strcmp(em_ir_node(g, bad)->name, "a_b_c") == 0);
    CHECK(strcmp(em_ir_node(g, kw)->name, "class_1") == 0);
    CHECK(strcmp(em_ir_node(g, a1)->name, "add_1") == 0);
    /* placeholder targets: the given name unless it is no identifier or is taken */
    CHECK(PyUnicode_CompareWithASCIIString(em_ir_node(g, x)->target, "x") == 0);
    CHECK(PyUnicode_CompareWithASCIIString(em_ir_node(g, x1)->target, "x_1") == 0);
    CHECK(PyUnicode_CompareWithASCIIString(em_ir_node(g, cc)->target, "L_selfCamelCase") == 0);
    CHECK(PyUnicode_CompareWithASCIIString(em_ir_node(g, bad)->target, "a_b_c") == 0);
    CHECK(g->ninputs == 7 && g->inputs[0] == x && g->inputs[6] == a1);

    IRArg args[2] = {node_arg(x), node_arg(x1)};
    IRRef s0 = em_ir_call(g, IR_CALL_FUNCTION, sin, args, 1, NULL, NULL, 0, &m);
    IRRef s1 = em_ir_call(g, IR_CALL_FUNCTION, sin, args, 1, NULL, NULL, 0, &m);
    IRRef ad = em_ir_call(g, IR_CALL_FUNCTION, add, args, 2, NULL, NULL, 0, &m);
    IRRef ad2 = em_ir_call(g, IR_CALL_FUNCTION, add, args, 2, NULL, NULL, 0, &m);
    IRRef su = em_ir_call(g, IR_CALL_FUNCTION, sum, args, 1, NULL, NULL, 0, &m);
    IRRef su2 = em_ir_call(g, IR_CALL_FUNCTION, sum, args, 1, NULL, NULL, 0, &m);
    PyObject *gi = PyUnicode_FromString("__getitem__"), *up = PyUnicode_FromString("upperCase");
    IRArg gargs[2] = {node_arg(x), const_arg(a, PyLong_FromLong(0))};
    IRRef g0 = em_ir_call(g, IR_CALL_METHOD, gi, gargs, 2, NULL, NULL, 0, &m);
    IRRef u0 = em_ir_call(g, IR_CALL_METHOD, up, gargs, 1, NULL, NULL, 0, &m);
    CHECK(s0 && s1 && ad && ad2 && su && su2 && g0 && u0);
    CHECK(strcmp(em_ir_node(g, s0)->name, "sin") == 0);
    CHECK(strcmp(em_ir_node(g, s1)->name, "sin_1") == 0);
    CHECK(strcmp(em_ir_node(g, ad)->name, "add") == 0);
    CHECK(strcmp(em_ir_node(g, ad2)->name, "add_2") == 0); /* add_1 is taken by a placeholder */
    CHECK(strcmp(em_ir_node(g, su)->name, "sum_1") == 0);  /* "sum" would shadow a builtin */
    CHECK(strcmp(em_ir_node(g, su2)->name, "sum_2") == 0);
    CHECK(strcmp(em_ir_node(g, g0)->name, "getitem") == 0);
    CHECK(strcmp(em_ir_node(g, u0)->name, "upper_case") == 0);
    /* op lookups: operator functions and method names map to the table, others are OTHER */
    CHECK(em_ir_node(g, ad)->op == IROP_ADD);
    CHECK(em_ir_node(g, s0)->op == IROP_OTHER);
    CHECK(em_ir_node(g, g0)->op == IROP_GETITEM);
    CHECK(em_ir_node(g, u0)->op == IROP_OTHER);
    CHECK(em_ir_node(g, x)->kind == IR_PLACEHOLDER && em_ir_node(g, s0)->kind == IR_CALL_FUNCTION);
    /* many collisions stay unique and fast */
    char prev[64] = "";
    bool distinct = true;
    for (int i = 0; i < 3000; i++) {
        IRRef r = em_ir_call(g, IR_CALL_FUNCTION, sin, args, 1, NULL, NULL, 0, &m);
        distinct = distinct && r && strcmp(prev, em_ir_node(g, r)->name) != 0;
        snprintf(prev, sizeof prev, "%s", em_ir_node(g, r)->name);
    }
    CHECK(distinct && strcmp(prev, "sin_3001") == 0);
    IRRef outs[1] = {s0};
    CHECK(em_ir_set_output(g, outs, 1) == 0);
    CHECK(em_ir_set_output(g, outs, 1) == -1); /* only one output node */
    char msg[256];
    CHECK(em_ir_verify(g, msg, sizeof msg) == 0);
    Py_DECREF(gi);
    Py_DECREF(up);
    Py_XDECREF(sin);
    Py_XDECREF(add);
    Py_XDECREF(sum);
    em_arena_free(a);
}

/* DCE removes unused pure calls (chains too), keeps in-place ops, operator.setitem, out=,
 * and random ops; refs are renumbered everywhere. */
static void test_dce(void) {
    EmArena *a = em_arena_new();
    IRGraph *g = em_ir_new(a);
    IRMeta m = none_meta();
    PyObject *add = py_get("operator", "add"), *neg = py_get("operator", "neg"), *mul = py_get("operator", "mul");
    PyObject *setitem = py_get("operator", "setitem"), *iadd = py_get("operator", "iadd");
    PyObject *rnd = py_get("random", "random"), *pure_abs = py_get("builtins", "abs");
    PyObject *append_ = PyUnicode_FromString("append_"), *dunder = PyUnicode_FromString("__add__");
    PyObject *outname = PyUnicode_FromString("out");
    IRRef x = em_ir_placeholder(g, "x", &m);
    IRRef y = em_ir_placeholder(g, "y", &m); /* unused placeholders stay */
    IRArg a_x1[2] = {node_arg(x), const_arg(a, PyLong_FromLong(1))};
    /* DCE deletes only views and selections (em_ir.c, removable_names) */
    PyObject *getitem = py_get("operator", "getitem"), *view_m = PyUnicode_FromString("view"),
             *reshape_m = PyUnicode_FromString("reshape");
    IRRef dead1 = em_ir_call(g, IR_CALL_FUNCTION, getitem, a_x1, 2, NULL, NULL, 0, &m);
    IRRef chain1 = em_ir_call(g, IR_CALL_METHOD, view_m, a_x1, 2, NULL, NULL, 0, &m);
    IRArg a_c[2] = {node_arg(chain1), const_arg(a, PyLong_FromLong(2))};
    IRRef chain2 = em_ir_call(g, IR_CALL_METHOD, reshape_m, a_c, 2, NULL, NULL, 0, &m);
    Py_DECREF(view_m);
    Py_DECREF(reshape_m);
    IRRef kept_pure = em_ir_call(g, IR_CALL_FUNCTION, neg, a_x1, 1, NULL, NULL, 0, &m); /* may raise */
    IRArg a_set[3] = {node_arg(x), const_arg(a, PyLong_FromLong(0)), node_arg(x)};
    IRRef keep_set = em_ir_call(g, IR_CALL_FUNCTION, setitem, a_set, 3, NULL, NULL, 0, &m);
    IRRef keep_iadd = em_ir_call(g, IR_CALL_FUNCTION, iadd, a_x1, 2, NULL, NULL, 0, &m);
    IRRef keep_m = em_ir_call(g, IR_CALL_METHOD, append_, a_x1, 2, NULL, NULL, 0, &m);
    IRRef dead_dunder = em_ir_call(g, IR_CALL_METHOD, dunder, a_x1, 2, NULL, NULL, 0, &m);
    PyObject *setitem_m = PyUnicode_FromString("__setitem__");
    IRRef keep_setitem_m = em_ir_call(g, IR_CALL_METHOD, setitem_m, a_set, 3, NULL, NULL, 0, &m);
    Py_DECREF(setitem_m);
    IRArg kwv[1] = {node_arg(x)};
    IRRef keep_out = em_ir_call(g, IR_CALL_FUNCTION, add, a_x1, 2, &outname, kwv, 1, &m);
    IRRef keep_rand = em_ir_call(g, IR_CALL_FUNCTION, rnd, NULL, 0, NULL, NULL, 0, &m);
    IRRef live = em_ir_call(g, IR_CALL_FUNCTION, add, a_x1, 2, NULL, NULL, 0, &m);
    IRArg a_l[2] = {node_arg(live), node_arg(live)};
    IRRef live2 = em_ir_call(g, IR_CALL_FUNCTION, mul, a_l, 2, NULL, NULL, 0, &m);
    IRRef shuf = em_ir_call(g, IR_CALL_FUNCTION, pure_abs, a_x1, 1, NULL, NULL, 0, &m);
    IRRef outs[3] = {live2, x, live2};
    CHECK(em_ir_set_output(g, outs, 3) == 0);
    em_ir_count_users(g);
    CHECK(em_ir_node(g, live)->nusers == 1); /* one distinct user though used twice */
    CHECK(em_ir_node(g, live2)->nusers == 1);
    CHECK(em_ir_node(g, x)->nusers == 12);
    CHECK(em_ir_node(g, dead1)->nusers == 0);
    uint32_t nbefore = g->nnodes;
    IRRef map[64];
    int removed = em_ir_dce(g, map);
    CHECK(removed == 3); /* dead1, chain1, chain2: unused ops that may raise or write stay */
    CHECK(g->nnodes == nbefore - 3);
    CHECK(map[dead1] == 0 && map[chain1] == 0 && map[chain2] == 0);
    CHECK(map[dead_dunder] != 0 && map[shuf] != 0 && map[kept_pure] != 0);
    CHECK(map[x] == x && map[y] == y);
    CHECK(map[keep_setitem_m] != 0);
    CHECK(map[keep_set] != 0 && map[keep_iadd] != 0 && map[keep_m] != 0 && map[keep_out] != 0 && map[keep_rand] != 0);
    CHECK(map[live] != 0 && map[live2] == map[live] + 1);
    CHECK(em_ir_node(g, map[live2])->args[0].u.ref == map[live]);
    CHECK(g->output == g->nnodes - 1 && em_ir_node(g, g->output)->kind == IR_OUTPUT);
    CHECK(em_ir_node(g, g->output)->args[0].u.items[0].u.ref == map[live2]);
    CHECK(em_ir_node(g, g->output)->args[0].u.items[1].u.ref == x);
    CHECK(strcmp(em_ir_node(g, map[live])->name, "add_2") == 0); /* names survive renumbering */
    char msg[256];
    CHECK(em_ir_verify(g, msg, sizeof msg) == 0);
    if (msg[0]) fprintf(stderr, "verify: %s\n", msg);
    CHECK(em_ir_dce(g, NULL) == 0); /* idempotent */
    Py_XDECREF(add);
    Py_XDECREF(neg);
    Py_XDECREF(mul);
    Py_XDECREF(setitem);
    Py_XDECREF(iadd);
    Py_XDECREF(rnd);
    Py_XDECREF(pure_abs);
    Py_DECREF(append_);
    Py_DECREF(dunder);
    Py_DECREF(outname);
    em_arena_free(a);
}

/* A small valid graph: x, y -> add = operator.add(x, y); up = add.upper(); out (up, add, x). */
static IRGraph *small_graph(EmArena *a, PyObject *add, PyObject *upper) {
    IRGraph *g = em_ir_new(a);
    IRMeta m = none_meta();
    IRRef x = em_ir_placeholder(g, "x", &m);
    IRRef y = em_ir_placeholder(g, "y", &m);
    IRArg args[2] = {node_arg(x), node_arg(y)};
    IRRef s = em_ir_call(g, IR_CALL_FUNCTION, add, args, 2, NULL, NULL, 0, &m);
    IRArg uargs[1] = {node_arg(s)};
    IRRef u = em_ir_call(g, IR_CALL_METHOD, upper, uargs, 1, NULL, NULL, 0, &m);
    IRRef outs[3] = {u, s, x};
    if (!u || em_ir_set_output(g, outs, 3) < 0) return NULL;
    return g;
}

/* The verifier accepts a good graph and rejects each kind of damage. */
static void test_verify(void) {
    PyObject *add = py_get("operator", "add"), *upper = PyUnicode_FromString("upper");
    char msg[256];
    for (int kind = 0; kind < 9; kind++) {
        EmArena *a = em_arena_new();
        IRGraph *g = small_graph(a, add, upper);
        CHECK(g != NULL);
        if (!g) break;
        CHECK(em_ir_verify(g, msg, sizeof msg) == 0);
        IRNode *sum = em_ir_node(g, 3), *up = em_ir_node(g, 4);
        switch (kind) {
        case 0: sum->args[1].u.ref = 4; break;               /* refers forward */
        case 1: sum->args[0].u.ref = 0; break;               /* refers to "none" */
        case 2: up->name = "add"; break;                     /* duplicate name */
        case 3: g->output = 0; break;                        /* output not registered */
        case 4: up->kind = IR_PLACEHOLDER; break;            /* placeholder after a call */
        case 5: sum->meta.kind = IRMETA_TENSOR; sum->meta.ndim = 2; break; /* no sizes */
        case 6: up->nargs = 0; break;                        /* method without self */
        case 7: g->ninputs = 1; break;                       /* inputs disagree */
        case 8: sum->args[0].kind = IRARG_CONST; sum->args[0].u.obj = NULL; break;
        }
        msg[0] = '\0';
        CHECK(em_ir_verify(g, msg, sizeof msg) == -1);
        CHECK(msg[0] != '\0');
        if (kind == 0) CHECK(strstr(msg, "not an earlier node") != NULL);
        if (kind == 2) CHECK(strstr(msg, "used twice") != NULL);
        em_arena_free(a);
    }
    /* a graph without output */
    EmArena *a = em_arena_new();
    IRGraph *g = em_ir_new(a);
    IRMeta m = none_meta();
    em_ir_placeholder(g, "x", &m);
    CHECK(em_ir_verify(g, msg, sizeof msg) == -1 && strstr(msg, "output") != NULL);
    CHECK(em_ir_verify(g, NULL, 0) == -1);
    em_arena_free(a);
    Py_XDECREF(add);
    Py_DECREF(upper);
}

static void test_print_and_export(void) {
    PyObject *add = py_get("operator", "add"), *upper = PyUnicode_FromString("upper");
    PyObject *len = py_get("builtins", "len"), *kwname = PyUnicode_FromString("sep");
    EmArena *a = em_arena_new();
    IRGraph *g = em_ir_new(a);
    IRMeta m = none_meta();
    IRRef x = em_ir_placeholder(g, "x", &m);
    IRArg items[2] = {node_arg(x), const_arg(a, PyLong_FromLong(1))};
    IRArg targ = {0};
    targ.kind = IRARG_TUPLE;
    targ.n = 2;
    targ.u.items = items;
    IRArg args[2] = {node_arg(x), const_arg(a, Py_BuildValue("(ii)", 1, 2))};
    IRArg kw[1] = {const_arg(a, PyUnicode_FromString("-"))};
    IRRef s = em_ir_call(g, IR_CALL_FUNCTION, add, args, 2, &kwname, kw, 1, &m);
    IRRef l = em_ir_call(g, IR_CALL_FUNCTION, len, &targ, 1, NULL, NULL, 0, &m);
    IRRef outs[2] = {s, l};
    CHECK(em_ir_set_output(g, outs, 2) == 0);

    PyObject *tab = em_ir_format_tabular(g);
    CHECK(tab != NULL);
    CHECK(str_has(tab, "opcode         name    target        args"));
    CHECK(str_has(tab, "placeholder    x       x             ()"));
    CHECK(str_has(tab, "call_function  add     operator.add  (x, (1, 2))      {'sep': '-'}\n"));
    CHECK(str_has(tab, "call_function  len_1   len           ((x, 1),)        {}\n")); /* len is a builtin */
    CHECK(str_has(tab, "output         output  output        ((add, len_1),)  {}\n"));
    CHECK(str_has(tab, "-------------  ------  ------------  ---------------  ------------  -----  -----\n"));
    if (!str_has(tab, "((add, len_1),)")) fprintf(stderr, "%s\n", tab ? PyUnicode_AsUTF8(tab) : "(null)");
    Py_XDECREF(tab);

    PyObject *ex = em_ir_to_python(g);
    CHECK(ex && PyList_Check(ex) && PyList_GET_SIZE(ex) == 4);
    if (ex && PyList_GET_SIZE(ex) == 4) {
        PyObject *expect = Py_BuildValue("[(sss()OO)]", "placeholder", "x", "x", PyDict_New(), Py_None);
        /* compare the placeholder row (dict compares by value) */
        PyObject *row0 = PyList_GET_ITEM(ex, 0);
        CHECK(PyObject_RichCompareBool(row0, PyList_GET_ITEM(expect, 0), Py_EQ) == 1);
        Py_XDECREF(expect);
        PyObject *row1 = PyList_GET_ITEM(ex, 1);
        PyObject *want_args = Py_BuildValue("((ss)(s(ii)))", "__node__", "x", "__const__", 1, 2);
        CHECK(PyObject_RichCompareBool(PyTuple_GET_ITEM(row1, 3), want_args, Py_EQ) == 1);
        CHECK(PyTuple_GET_ITEM(row1, 2) == add);
        PyObject *sep = PyDict_GetItemString(PyTuple_GET_ITEM(row1, 4), "sep");
        CHECK(sep && PyUnicode_CompareWithASCIIString(sep, "-") == 0);
        Py_XDECREF(want_args);
        PyObject *row3 = PyList_GET_ITEM(ex, 3);
        PyObject *want_out = Py_BuildValue("(((ss)(ss)))", "__node__", "add", "__node__", "len_1");
        CHECK(PyObject_RichCompareBool(PyTuple_GET_ITEM(row3, 3), want_out, Py_EQ) == 1);
        CHECK(PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(row3, 0), "output") == 0);
        Py_XDECREF(want_out);
    }
    Py_XDECREF(ex);
    PyObject *q = em_ir_target_qualname(add);
    CHECK(q && PyUnicode_CompareWithASCIIString(q, "operator.add") == 0);
    Py_XDECREF(q);
    q = em_ir_target_qualname(len);
    CHECK(q && PyUnicode_CompareWithASCIIString(q, "len") == 0);
    Py_XDECREF(q);
    em_arena_free(a);
    Py_XDECREF(add);
    Py_DECREF(upper);
    Py_XDECREF(len);
    Py_DECREF(kwname);
}

/* ---- runtime ---- */

static void test_eager_graph(void) {
    PyObject *mod = PyModule_New("ember_test_runtime");
    CHECK(mod && em_runtime_init(mod) == 0);
    CHECK(EmEagerGraph_Type != NULL);
    PyObject *add = py_get("operator", "add"), *upper = PyUnicode_FromString("upper");
    EmArena *a = em_arena_new();
    IRGraph *g = small_graph(a, add, upper);
    PyObject *eg = g ? em_eager_graph_new(g) : NULL;
    em_arena_free(a); /* the EagerGraph must not need the arena */
    CHECK(eg != NULL && Py_TYPE(eg) == EmEagerGraph_Type);
    if (eg) {
        PyObject *in[2] = {PyUnicode_FromString("ab"), PyUnicode_FromString("cd")};
        Py_ssize_t rc0 = Py_REFCNT(in[0]);
        PyObject *r = em_eager_graph_run(eg, in, 2);
        CHECK(r && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 3);
        if (r && PyTuple_GET_SIZE(r) == 3) {
            CHECK(PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(r, 0), "ABCD") == 0);
            CHECK(PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(r, 1), "abcd") == 0);
            CHECK(PyTuple_GET_ITEM(r, 2) == in[0]);
        }
        Py_XDECREF(r);
        CHECK(Py_REFCNT(in[0]) == rc0);
        /* through the type's vectorcall, as a backend callable */
        r = PyObject_Vectorcall(eg, in, 2, NULL);
        CHECK(r && PyTuple_GET_SIZE(r) == 3);
        Py_XDECREF(r);
        /* errors raised by an op propagate unchanged */
        PyObject *bad[2] = {PyUnicode_FromString("ab"), PyLong_FromLong(1)};
        r = em_eager_graph_run(eg, bad, 2);
        CHECK(r == NULL && PyErr_ExceptionMatches(PyExc_TypeError));
        PyErr_Clear();
        r = em_eager_graph_run(eg, in, 1); /* wrong arity */
        CHECK(r == NULL && PyErr_ExceptionMatches(PyExc_TypeError));
        PyErr_Clear();
        PyObject *rep = PyObject_Repr(eg);
        CHECK(str_has(rep, "add = operator.add(x, y)") && str_has(rep, "upper = add.upper()"));
        CHECK(str_has(rep, "return (upper, add, x)"));
        Py_XDECREF(rep);
        for (int i = 0; i < 2; i++) {
            Py_DECREF(in[i]);
            Py_DECREF(bad[i]);
        }
        Py_DECREF(eg);
    }
    Py_XDECREF(add);
    Py_DECREF(upper);
    Py_XDECREF(mod);
}

static void test_outspec(void) {
    EmArena *a = em_arena_new();
    OutSpec *items = em_arena_alloc(a, 4 * sizeof(OutSpec));
    OutSpec *ditems = em_arena_alloc(a, 1 * sizeof(OutSpec));
    items[0].kind = OUT_GRAPH;
    items[0].index = 1;
    items[1].kind = OUT_FETCH;
    items[1].index = 0;
    items[2].kind = OUT_CONST;
    items[2].obj = em_arena_hold_steal(a, PyLong_FromLong(7));
    items[3].kind = OUT_DICT;
    items[3].obj = em_arena_hold_steal(a, Py_BuildValue("(s)", "k"));
    items[3].n = 1;
    items[3].items = ditems;
    ditems[0].kind = OUT_GRAPH;
    ditems[0].index = 0;
    OutSpec root = {0};
    root.kind = OUT_LIST;
    root.n = 4;
    root.items = items;
    OutSpec *copy = em_out_copy(&root);
    em_arena_free(a); /* the copy owns its objects */
    CHECK(copy != NULL);
    if (!copy) return;
    PyObject *gout = Py_BuildValue("(ss)", "g0", "g1"), *f0 = PyUnicode_FromString("f0");
    PyObject *fetched[1] = {f0};
    PyObject *v = em_out_build(copy, gout, fetched);
    PyObject *want = Py_BuildValue("[sOi{ss}]", "g1", f0, 7, "k", "g0");
    CHECK(v && PyObject_RichCompareBool(v, want, Py_EQ) == 1);
    PyObject *rep = em_out_repr(copy);
    CHECK(rep && PyUnicode_CompareWithASCIIString(rep, "[graph_out[1], fetched[0], 7, {'k': graph_out[0]}]") == 0);
    PyObject *short_out = Py_BuildValue("(s)", "only");
    PyObject *v2 = em_out_build(copy, short_out, fetched);
    CHECK(v2 == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError));
    PyErr_Clear();
    Py_XDECREF(v);
    Py_XDECREF(want);
    Py_XDECREF(rep);
    Py_XDECREF(short_out);
    Py_DECREF(gout);
    Py_DECREF(f0);
    em_out_free(copy);
}

int main(int argc, char **argv) {
    Py_Initialize();
    test_arena();
    test_vec();
    test_break_names();
    test_op_table();
    test_names();
    test_dce();
    test_verify();
    test_print_and_export();
    test_eager_graph();
    test_outspec();
    if (PyErr_Occurred()) {
        nfailed++;
        fprintf(stderr, "a Python exception was left set:\n");
        PyErr_Print();
    }
    printf("test_ir: %d checks, %d failed\n", nchecks, nfailed);
    Py_FinalizeEx();
    return nfailed ? 1 : 0;
}
