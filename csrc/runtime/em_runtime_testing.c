/* runtime test support: ember._C._ir_build and ember._C._out_build build an IRGraph / OutSpec from
 * a Python description, so that tests/py can check the printer, the export, the fx bridge, the
 * EagerGraph and OutSpec without the tracer. Not part of the public API. It lives in runtime/, the
 * latest stage it uses (it also calls ir/), so its calls go from a later stage to an earlier one
 * only (DESIGN.md: no stage calls back into an earlier one).
 * Invariant: everything is built in a fresh arena freed before returning; what is returned must
 * therefore be arena-independent (which is itself under test). */
#include "ir/em_ir.h"
#include "runtime/em_runtime.h"

#include <string.h>

/* Is obj the marker ("__node__", i) / ("__const__", v)? */
static bool t_is_marker(PyObject *obj, const char *tag) {
    if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return false;
    PyObject *h = PyTuple_GET_ITEM(obj, 0);
    return PyUnicode_Check(h) && PyUnicode_CompareWithASCIIString(h, tag) == 0;
}

/* Converts a described argument into *out. refs maps description index -> IRRef. */
static int t_arg(EmArena *a, PyObject *obj, const IRRef *refs, Py_ssize_t nrefs, IRArg *out) {
    memset(out, 0, sizeof *out);
    if (t_is_marker(obj, "__node__")) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(obj, 1));
        if (i == -1 && PyErr_Occurred()) return -1;
        if (i < 0 || i >= nrefs || !refs[i]) {
            PyErr_Format(PyExc_ValueError, "_ir_build: node reference %zd is not an earlier value node", i);
            return -1;
        }
        out->kind = IRARG_NODE;
        out->u.ref = refs[i];
        return 0;
    }
    if (t_is_marker(obj, "__const__")) {
        out->kind = IRARG_CONST;
        out->u.obj = em_arena_hold(a, PyTuple_GET_ITEM(obj, 1));
        return out->u.obj ? 0 : (PyErr_NoMemory(), -1);
    }
    if (PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        out->kind = PyTuple_CheckExact(obj) ? IRARG_TUPLE : IRARG_LIST;
        out->n = (uint32_t)n;
        out->u.items = n ? em_arena_alloc(a, (size_t)n * sizeof(IRArg)) : NULL;
        if (n && !out->u.items) return PyErr_NoMemory(), -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (t_arg(a, PySequence_Fast_GET_ITEM(obj, i), refs, nrefs, &out->u.items[i]) < 0) return -1;
        return 0;
    }
    out->kind = IRARG_CONST;
    out->u.obj = em_arena_hold(a, obj);
    return out->u.obj ? 0 : (PyErr_NoMemory(), -1);
}

/* The meta of an example value: tensors (anything with .stride and .dtype) read through
 * em_ir_meta_from_tensor, tuples item by item, None as IRMETA_NONE, the rest as IRMETA_OTHER. */
static int t_meta(EmArena *a, PyObject *ex, IRMeta *m) {
    memset(m, 0, sizeof *m);
    if (ex == Py_None) {
        m->kind = IRMETA_NONE;
        return 0;
    }
    if (PyTuple_Check(ex) && !PyObject_HasAttrString(ex, "stride")) {
        Py_ssize_t n = PyTuple_GET_SIZE(ex);
        m->kind = IRMETA_TUPLE;
        m->nitems = (uint32_t)n;
        m->items = n ? em_arena_alloc(a, (size_t)n * sizeof(IRMeta)) : NULL;
        if (n && !m->items) return PyErr_NoMemory(), -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (t_meta(a, PyTuple_GET_ITEM(ex, i), &m->items[i]) < 0) return -1;
        return 0;
    }
    if (PyObject_HasAttrString(ex, "stride") && PyObject_HasAttrString(ex, "dtype") &&
        PyObject_HasAttrString(ex, "is_meta"))
        return em_ir_meta_from_tensor(a, ex, NULL, m);
    m->kind = IRMETA_OTHER;
    m->example = em_arena_hold(a, ex);
    return 0;
}

/* _ir_build(nodes, dce=False, ember=False) -> dict(export, eager, tabular, verify, removed, eager_error)
 * With ember=True: dict(ember=callable, info=dict), the graph compiled by backend "ember" (the
 * torch.compile backend "ember" imports Dynamo's fx graphs this way, src/ember/_backends.py).
 * With cuda_source=True: the CUDA C backend "ember" generates for it (em_ember_cuda_codegen), with
 * meta tensors standing for CUDA tensors; nothing is compiled or run.
 * With rows=[bool per input]: the row-independence analysis of CUDA graph buckets with those inputs
 * batched (em_cudagraph_rows_py): {row_independent, reason, batched_outputs}.
 * With written=True: a tuple of bools, the inputs the graph may write in place (em_cudagraph_written_inputs).
 * nodes: ("placeholder", name, example) | ("call_function", target, args, kwargs, example) |
 *        ("call_method", name, args, kwargs, example) | ("output", [node index, ...]).
 * In args/kwargs, ("__node__", i) refers to nodes[i] and ("__const__", v) is a constant v. */
static PyObject *t_ir_build(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nodes", "dce", "ember", "cuda_source", "rows", "written", NULL};
    PyObject *nodes = NULL, *result = NULL, *fast = NULL, *v = NULL, *rows = NULL;
    int dce = 0, ember = 0, cuda_source = 0, written = 0;
    EmArena *a = NULL;
    IRRef *refs = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pppOp:_ir_build", kwlist, &nodes, &dce, &ember, &cuda_source, &rows,
                                     &written))
        return NULL;
    fast = PySequence_Fast(nodes, "_ir_build: nodes must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t nn = PySequence_Fast_GET_SIZE(fast);
    a = em_arena_new();
    refs = PyMem_Calloc(nn ? (size_t)nn : 1, sizeof(IRRef));
    IRGraph *g = a ? em_ir_new(a) : NULL;
    if (!refs || !g) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nn; i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(fast, i);
        const char *op = NULL;
        if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) < 2 || !(op = PyUnicode_AsUTF8(PyTuple_GET_ITEM(d, 0)))) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "_ir_build: node %zd is not (opcode, ...)", i);
            goto done;
        }
        IRMeta m;
        if (strcmp(op, "placeholder") == 0) {
            const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(d, 1));
            if (!name || t_meta(a, PyTuple_GET_SIZE(d) > 2 ? PyTuple_GET_ITEM(d, 2) : Py_None, &m) < 0) goto done;
            refs[i] = em_ir_placeholder(g, name, &m);
        } else if (strcmp(op, "call_function") == 0 || strcmp(op, "call_method") == 0) {
            PyObject *pargs = PyTuple_GET_SIZE(d) > 2 ? PyTuple_GET_ITEM(d, 2) : NULL;
            PyObject *pkw = PyTuple_GET_SIZE(d) > 3 ? PyTuple_GET_ITEM(d, 3) : NULL;
            PyObject *ex = PyTuple_GET_SIZE(d) > 4 ? PyTuple_GET_ITEM(d, 4) : Py_None;
            IRArg *cargs = NULL, *ckw = NULL;
            PyObject **kwn = NULL;
            uint32_t na = 0, nk = 0;
            if (pargs && !PyTuple_Check(pargs)) {
                PyErr_SetString(PyExc_TypeError, "_ir_build: args must be a tuple");
                goto done;
            }
            if (pkw && pkw != Py_None && !PyDict_Check(pkw)) {
                PyErr_SetString(PyExc_TypeError, "_ir_build: kwargs must be a dict");
                goto done;
            }
            na = pargs ? (uint32_t)PyTuple_GET_SIZE(pargs) : 0;
            nk = pkw && pkw != Py_None ? (uint32_t)PyDict_GET_SIZE(pkw) : 0;
            cargs = na ? em_arena_alloc(a, na * sizeof(IRArg)) : NULL;
            ckw = nk ? em_arena_alloc(a, nk * sizeof(IRArg)) : NULL;
            kwn = nk ? em_arena_alloc(a, nk * sizeof(PyObject *)) : NULL;
            if ((na && !cargs) || (nk && (!ckw || !kwn))) {
                PyErr_NoMemory();
                goto done;
            }
            for (uint32_t k = 0; k < na; k++)
                if (t_arg(a, PyTuple_GET_ITEM(pargs, k), refs, i, &cargs[k]) < 0) goto done;
            Py_ssize_t pos = 0;
            PyObject *key, *val;
            for (uint32_t k = 0; nk && PyDict_Next(pkw, &pos, &key, &val); k++) {
                kwn[k] = key;
                if (t_arg(a, val, refs, i, &ckw[k]) < 0) goto done;
            }
            if (t_meta(a, ex, &m) < 0) goto done;
            IRKind kind = op[5] == 'f' ? IR_CALL_FUNCTION : IR_CALL_METHOD;
            refs[i] = em_ir_call(g, kind, PyTuple_GET_ITEM(d, 1), cargs, na, kwn, ckw, nk, &m);
        } else if (strcmp(op, "output") == 0) {
            PyObject *outs = PySequence_Fast(PyTuple_GET_ITEM(d, 1), "_ir_build: output takes a list");
            if (!outs) goto done;
            Py_ssize_t no = PySequence_Fast_GET_SIZE(outs);
            IRRef *orefs = em_arena_alloc(a, (size_t)(no ? no : 1) * sizeof(IRRef));
            for (Py_ssize_t k = 0; orefs && k < no; k++) {
                Py_ssize_t j = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(outs, k));
                if (j < 0 || j >= i || !refs[j]) {
                    Py_DECREF(outs);
                    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "_ir_build: bad output index %zd", j);
                    goto done;
                }
                orefs[k] = refs[j];
            }
            Py_DECREF(outs);
            if (!orefs || em_ir_set_output(g, orefs, (uint32_t)no) < 0) {
                PyErr_SetString(PyExc_ValueError, "_ir_build: could not set the output");
                goto done;
            }
            continue;
        } else {
            PyErr_Format(PyExc_ValueError, "_ir_build: unknown opcode %s", op);
            goto done;
        }
        if (!refs[i]) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto done;
        }
    }
    int removed = 0;
    if (dce && (removed = em_ir_dce(g, NULL)) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (rows && rows != Py_None) {
        result = em_cudagraph_rows_py(g, rows);
        goto done;
    }
    if (written) {
        uint8_t *w = calloc(g->ninputs + 1, 1);
        if (!w || em_cudagraph_written_inputs(g, w) < 0) {
            free(w);
            PyErr_NoMemory();
            goto done;
        }
        result = PyTuple_New(g->ninputs);
        for (uint32_t i = 0; result && i < g->ninputs; i++) PyTuple_SET_ITEM(result, i, PyBool_FromLong(w[i]));
        free(w);
        goto done;
    }
    if (cuda_source) {
        result = em_ember_cuda_codegen(g);
        goto done;
    }
    if (ember) {
        PyObject *info = NULL, *fn = em_ember_compile(g, &info);
        if (fn) result = Py_BuildValue("{s:N,s:N}", "ember", fn, "info", info);
        goto done;
    }
    char msg[512];
    PyObject *verify = em_ir_verify(g, msg, sizeof msg) == 0 ? Py_NewRef(Py_None) : PyUnicode_FromString(msg);
    if (!verify) goto done;
    result = PyDict_New();
    if (!result || PyDict_SetItemString(result, "verify", verify) < 0) {
        Py_DECREF(verify);
        Py_CLEAR(result);
        goto done;
    }
    Py_DECREF(verify);
    v = PyLong_FromLong(removed);
    if (!v || PyDict_SetItemString(result, "removed", v) < 0) goto fail;
    Py_SETREF(v, em_ir_to_python(g));
    if (!v || PyDict_SetItemString(result, "export", v) < 0) goto fail;
    Py_SETREF(v, em_ir_format_tabular(g));
    if (!v || PyDict_SetItemString(result, "tabular", v) < 0) goto fail;
    /* a graph the EagerGraph refuses is reported, not raised: tests check both outcomes */
    Py_SETREF(v, em_eager_graph_new(g));
    if (!v) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        int rc = PyDict_SetItemString(result, "eager_error", ev ? ev : Py_None);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        v = Py_NewRef(Py_None);
        if (rc < 0) goto fail;
    }
    if (PyDict_SetItemString(result, "eager", v) < 0) goto fail;
    Py_CLEAR(v);
    goto done;
fail:
    Py_CLEAR(v);
    Py_CLEAR(result);
done:
    PyMem_Free(refs);
    em_arena_free(a);
    Py_XDECREF(fast);
    return result;
}

/* Builds an arena OutSpec from ("graph", i) | ("fetch", i) | ("const", v) | ("tuple", [...]) |
 * ("list", [...]) | ("dict", keys_tuple, [...]) | ("namedtuple", cls, [...]). */
static int t_spec(EmArena *a, PyObject *d, OutSpec *s) {
    const char *k = PyTuple_Check(d) && PyTuple_GET_SIZE(d) >= 2 ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(d, 0)) : NULL;
    memset(s, 0, sizeof *s);
    if (!k) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_out_build: bad spec");
        return -1;
    }
    PyObject *last = PyTuple_GET_ITEM(d, PyTuple_GET_SIZE(d) - 1);
    if (strcmp(k, "graph") == 0 || strcmp(k, "fetch") == 0) {
        s->kind = k[0] == 'g' ? OUT_GRAPH : OUT_FETCH;
        long i = PyLong_AsLong(last);
        if (i < 0) return PyErr_Occurred() ? -1 : (PyErr_SetString(PyExc_ValueError, "negative index"), -1);
        s->index = (uint32_t)i;
        return 0;
    }
    if (strcmp(k, "const") == 0) {
        s->kind = OUT_CONST;
        s->obj = em_arena_hold(a, last);
        return 0;
    }
    if (strcmp(k, "tuple") == 0) s->kind = OUT_TUPLE;
    else if (strcmp(k, "list") == 0) s->kind = OUT_LIST;
    else if (strcmp(k, "dict") == 0) s->kind = OUT_DICT;
    else if (strcmp(k, "namedtuple") == 0) s->kind = OUT_NAMEDTUPLE;
    else return PyErr_Format(PyExc_ValueError, "_out_build: unknown kind %s", k), -1;
    if (s->kind == OUT_DICT || s->kind == OUT_NAMEDTUPLE) {
        if (PyTuple_GET_SIZE(d) < 3) return PyErr_SetString(PyExc_ValueError, "_out_build: missing items"), -1;
        s->obj = em_arena_hold(a, PyTuple_GET_ITEM(d, 1));
    }
    PyObject *items = PySequence_Fast(last, "_out_build: items must be a sequence");
    if (!items) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    s->n = (uint32_t)n;
    s->items = n ? em_arena_alloc(a, (size_t)n * sizeof(OutSpec)) : NULL;
    int rc = n && !s->items ? (PyErr_NoMemory(), -1) : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) rc = t_spec(a, PySequence_Fast_GET_ITEM(items, i), &s->items[i]);
    Py_DECREF(items);
    return rc;
}

/* _out_build(spec, graph_out, fetched) -> (value, repr): copies the spec out of its arena
 * (em_out_copy), frees the arena, then builds the value and its repr from the copy. */
static PyObject *t_out_build(PyObject *self, PyObject *args) {
    PyObject *desc, *graph_out, *fetched_seq, *value = NULL, *repr = NULL, *result = NULL, *fast = NULL;
    OutSpec root, *copy = NULL;
    if (!PyArg_ParseTuple(args, "OOO:_out_build", &desc, &graph_out, &fetched_seq)) return NULL;
    EmArena *a = em_arena_new();
    if (!a) return PyErr_NoMemory();
    int rc = t_spec(a, desc, &root);
    if (rc == 0) copy = em_out_copy(&root);
    em_arena_free(a);
    if (!copy) return NULL;
    fast = PySequence_Fast(fetched_seq, "_out_build: fetched must be a sequence");
    if (!fast) goto done;
    value = em_out_build(copy, graph_out, PySequence_Fast_ITEMS(fast));
    if (!value) goto done;
    repr = em_out_repr(copy);
    if (!repr) goto done;
    result = PyTuple_Pack(2, value, repr);
done:
    Py_XDECREF(fast);
    Py_XDECREF(value);
    Py_XDECREF(repr);
    em_out_free(copy);
    return result;
}

static PyMethodDef t_methods[] = {
    {"_ir_build", (PyCFunction)(void (*)(void))t_ir_build, METH_VARARGS | METH_KEYWORDS,
     "_ir_build(nodes, dce=False) -> dict: test helper, builds an IRGraph from a description."},
    {"_out_build", t_out_build, METH_VARARGS,
     "_out_build(spec, graph_out, fetched) -> (value, repr): test helper for OutSpec."},
    {NULL, NULL, 0, NULL},
};

int em_runtime_testing_init(PyObject *module) { return PyModule_AddFunctions(module, t_methods); }
