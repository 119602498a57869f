/* runtime EagerGraph (ember._C.EagerGraph): the "eager" backend. An IRGraph is compiled once into
 * a compact instruction list that owns its targets and constants (no arena, no IR pointers); a
 * call replays it with vectorcall from C: no Python frame, no fx, no allocation besides the op
 * results, the tuples/lists an op takes as arguments, and the result tuple.
 * Invariant: it calls exactly the recorded targets (an operator maybe through a cheaper entry of the
 * same operator: call_target), with the same arguments, in graph order, and drops each intermediate
 * value right after its last use, as eager execution would. */
#include "runtime/em_runtime.h"

#include <stdlib.h>
#include <string.h>
#if !EM_PY312
#include <structmember.h> /* T_PYSSIZET, READONLY (3.12 moved them into Python.h as Py_T_*) */
#endif

PyTypeObject *EmEagerGraph_Type = NULL;

/* An argument template: where an op's argument comes from on each call. */
typedef enum {
    TPL_SLOT,  /* u.slot: a value slot (graph input or earlier result), passed borrowed */
    TPL_CONST, /* u.obj: a constant (owned); tuples of constants are folded into one */
    TPL_TUPLE, /* n items starting at template u.first: a tuple built on each call */
    TPL_LIST   /* same, a list (built fresh: an op may keep or mutate it, as in eager) */
} TplKind;

typedef struct {
    TplKind kind;
    uint32_t n;
    union {
        uint32_t slot;
        PyObject *obj;
        uint32_t first;
    } u;
} Tpl;

typedef struct {
    PyObject *target;   /* callable, or the method name (str) when method; owned */
    PyObject *call;     /* what is called: target, or the same operator through a cheaper entry
                           (call_target): its binding, or its `_op`; owned */
    PyObject *kwnames;  /* tuple of str or NULL; owned */
    uint32_t method;    /* call_method: PyObject_VectorcallMethod with args[0] = self */
    uint32_t autocast_enter; /* a torch.autocast block's _enter_autocast (em_ir_autocast_node) */
    uint32_t nargs;     /* positional arguments (self included) */
    uint32_t nkw;       /* keyword arguments, after the positional ones */
    uint32_t tpl;       /* first of the nargs + nkw templates */
    uint32_t nbuilt;    /* how many of those build a tuple/list per call (released after it) */
    uint32_t out;       /* result slot */
    uint32_t free_first, nfree; /* frees[free_first ..]: slots whose last use is this call */
} Instr;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t ninputs;
    uint32_t nvalues;  /* ninputs + ninstr */
    uint32_t ninstr, ntpl, noutputs, maxargs;
    int cleared;       /* tp_clear ran: the object is garbage and must not run */
    Instr *instr;      /* instr, tpl, frees, outputs share one malloc block (instr is its start) */
    Tpl *tpl;
    uint32_t *frees;
    uint32_t *outputs; /* result slot of each graph output */
    uint32_t *in_order; /* input slots by last use (run_boxed releases them in this order) */
    uint32_t *in_last;  /* input slot -> last instruction using it; UINT32_MAX: unused; ninstr: an output */
    PyObject *names;   /* tuple: the IR name of each slot, for __repr__ */
} EagerGraph;

enum { EG_STACK_VALUES = 64, EG_STACK_ARGS = 16 };

/* ------------------------------------------------------------------------------------------ */
/* Running                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Materializes template t: a new reference (slots and constants are new references too here;
 * only the top level borrows, see eg_run). */
static PyObject *eg_build(const EagerGraph *eg, const Tpl *t, PyObject *const *vals) {
    switch (t->kind) {
    case TPL_SLOT:
        return Py_NewRef(vals[t->u.slot]);
    case TPL_CONST:
        return Py_NewRef(t->u.obj);
    case TPL_TUPLE: {
        PyObject *r = PyTuple_New(t->n);
        for (uint32_t i = 0; r && i < t->n; i++) {
            PyObject *v = eg_build(eg, &eg->tpl[t->u.first + i], vals);
            if (!v) Py_CLEAR(r);
            else PyTuple_SET_ITEM(r, i, v);
        }
        return r;
    }
    case TPL_LIST: {
        PyObject *r = PyList_New(t->n);
        for (uint32_t i = 0; r && i < t->n; i++) {
            PyObject *v = eg_build(eg, &eg->tpl[t->u.first + i], vals);
            if (!v) Py_CLEAR(r);
            else PyList_SET_ITEM(r, i, v);
        }
        return r;
    }
    }
    PyErr_SetString(PyExc_SystemError, "ember: bad argument template");
    return NULL;
}

/* After instruction `failed` raised: exits, innermost first, the torch.autocast blocks the graph
 * entered and did not leave (an _enter_autocast result still held: its one use, the block's
 * _exit_autocast, releases it), as the with statement's __exit__ would have in eager. Keeps the
 * pending exception. */
static void autocast_unwind(const EagerGraph *eg, PyObject **vals, uint32_t failed) {
    static PyObject *exit_ = NULL; /* torch.amp.autocast_mode._exit_autocast; one interpreter */
    PyObject *exc = NULL;
    for (uint32_t k = failed; k-- > 0;) {
        const Instr *in = &eg->instr[k];
        if (!in->autocast_enter || !vals[in->out]) continue;
        if (!exc) exc = em_exc_take();
        PyObject *r = exit_ || em_lazy_attr(&exit_, "torch.amp.autocast_mode", "_exit_autocast")
                          ? PyObject_CallOneArg(exit_, vals[in->out])
                          : NULL;
        Py_XDECREF(r);
        PyErr_Clear();
        Py_CLEAR(vals[in->out]);
    }
    if (exc) em_exc_restore(exc);
}

/* The replay loop. vals[0, ninputs) borrow the inputs (own_inputs: own them, and release each
 * after its last use, as the results are); vals[ninputs, nvalues) own the results until their last
 * use (NULL once released). args has one spare slot in front so that callees may use
 * PY_VECTORCALL_ARGUMENTS_OFFSET (CPython Objects/call.c, Include/cpython/abstract.h). */
static PyObject *eg_run(EagerGraph *eg, PyObject *const *inputs, int own_inputs) {
    PyObject *valbuf[EG_STACK_VALUES], *argbuf[EG_STACK_ARGS + 1];
    PyObject **vals = valbuf, **argsp = argbuf, *result = NULL;
    if (eg->cleared) {
        PyErr_SetString(PyExc_RuntimeError, "ember: EagerGraph was cleared by the garbage collector");
        goto early;
    }
    if (eg->nvalues > EG_STACK_VALUES) {
        vals = PyMem_Malloc(eg->nvalues * sizeof(PyObject *));
        if (!vals) {
            PyErr_NoMemory();
            goto early;
        }
    }
    if (eg->maxargs > EG_STACK_ARGS) {
        argsp = PyMem_Malloc((eg->maxargs + 1) * sizeof(PyObject *));
        if (!argsp) {
            if (vals != valbuf) PyMem_Free(vals);
            PyErr_NoMemory();
            goto early;
        }
    }
    uint32_t ninputs = (uint32_t)eg->ninputs, inext = 0;
    memcpy(vals, inputs, ninputs * sizeof(PyObject *));
    memset(vals + ninputs, 0, (eg->nvalues - ninputs) * sizeof(PyObject *));
    PyObject **args = argsp + 1;
    if (own_inputs) /* inputs no instruction reads */
        for (; inext < ninputs && eg->in_last[eg->in_order[inext]] == UINT32_MAX; inext++)
            Py_CLEAR(vals[eg->in_order[inext]]);
    for (uint32_t k = 0; k < eg->ninstr; k++) {
        const Instr *in = &eg->instr[k];
        const Tpl *tpl = &eg->tpl[in->tpl];
        uint32_t nall = in->nargs + in->nkw;
        for (uint32_t i = 0; i < nall; i++) {
            const Tpl *t = &tpl[i];
            if (t->kind == TPL_SLOT) {
                args[i] = vals[t->u.slot];
            } else if (t->kind == TPL_CONST) {
                args[i] = t->u.obj;
            } else if (!(args[i] = eg_build(eg, t, vals))) {
                for (uint32_t j = 0; j < i; j++)
                    if (tpl[j].kind == TPL_TUPLE || tpl[j].kind == TPL_LIST) Py_DECREF(args[j]);
                autocast_unwind(eg, vals, k);
                goto error;
            }
        }
        size_t nargsf = in->nargs | PY_VECTORCALL_ARGUMENTS_OFFSET;
        PyObject *res = in->method ? PyObject_VectorcallMethod(in->target, args, nargsf, in->kwnames)
                                   : PyObject_Vectorcall(in->call, args, nargsf, in->kwnames);
        if (in->nbuilt) {
            for (uint32_t i = 0; i < nall; i++)
                if (tpl[i].kind == TPL_TUPLE || tpl[i].kind == TPL_LIST) Py_DECREF(args[i]);
        }
        if (!res) {
            autocast_unwind(eg, vals, k);
            goto error;
        }
        vals[in->out] = res;
        for (uint32_t f = 0; f < in->nfree; f++) Py_CLEAR(vals[eg->frees[in->free_first + f]]);
        if (own_inputs)
            for (; inext < ninputs && eg->in_last[eg->in_order[inext]] == k; inext++) Py_CLEAR(vals[eg->in_order[inext]]);
    }
    result = PyTuple_New(eg->noutputs);
    if (result) {
        for (uint32_t i = 0; i < eg->noutputs; i++) PyTuple_SET_ITEM(result, i, Py_NewRef(vals[eg->outputs[i]]));
    }
error:
    for (uint32_t s = own_inputs ? 0 : ninputs; s < eg->nvalues; s++) Py_XDECREF(vals[s]);
    if (vals != valbuf) PyMem_Free(vals);
    if (argsp != argbuf) PyMem_Free(argsp);
    return result;
early: /* nothing ran: owned inputs are still to release */
    for (uint32_t i = 0; own_inputs && i < (uint32_t)eg->ninputs; i++) Py_DECREF(inputs[i]);
    return NULL;
}

/* Entry for dispatch: the inputs as an array, no argument tuple. */
PyObject *em_eager_graph_run(PyObject *eager_graph, PyObject *const *inputs, Py_ssize_t n) {
    EagerGraph *eg = (EagerGraph *)eager_graph;
    if (n != eg->ninputs) {
        PyErr_Format(PyExc_TypeError, "EagerGraph takes %zd inputs, got %zd", eg->ninputs, n);
        return NULL;
    }
    return eg_run(eg, inputs, 0);
}

/* eager_graph.run_boxed(list) -> tuple: the list's items are the inputs; the list is emptied and
 * each input is released right after its last use, so that tensors the caller hands over (a
 * backward's saved tensors) are freed as the graph goes, as eager autograd frees each node's saved
 * tensors after its backward (AOTAutograd's boxed calling convention). */
static PyObject *eg_run_boxed(PyObject *self, PyObject *list) {
    EagerGraph *eg = (EagerGraph *)self;
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "run_boxed takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n != eg->ninputs) {
        PyErr_Format(PyExc_TypeError, "EagerGraph takes %zd inputs, got %zd", eg->ninputs, n);
        return NULL;
    }
    PyObject **owned = PyMem_Malloc((n ? n : 1) * sizeof(PyObject *));
    if (!owned) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) owned[i] = Py_NewRef(PyList_GET_ITEM(list, i));
    if (PyList_SetSlice(list, 0, n, NULL) < 0) {
        for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(owned[i]);
        PyMem_Free(owned);
        return NULL;
    }
    PyObject *r = eg_run(eg, owned, 1); /* releases every owned input */
    PyMem_Free(owned);
    return r;
}

static PyMethodDef eg_methods[] = {
    {"run_boxed", eg_run_boxed, METH_O,
     "run_boxed(list) -> tuple: runs with the list's items as inputs, emptying the list and releasing "
     "each input after its last use."},
    {NULL, NULL, 0, NULL},
};

/* eager_graph(*inputs) -> tuple; keyword arguments are refused. */
static PyObject *eg_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        PyErr_SetString(PyExc_TypeError, "EagerGraph takes no keyword arguments");
        return NULL;
    }
    return em_eager_graph_run(self, args, PyVectorcall_NARGS(nargsf));
}

/* ------------------------------------------------------------------------------------------ */
/* Compiling an IRGraph                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    EagerGraph *eg;
    const IRGraph *g;
    const uint32_t *slot_of; /* IRRef -> slot, UINT32_MAX when not a value */
    uint32_t *lastuse;       /* slot -> last instruction using it, UINT32_MAX if none */
    uint32_t ntpl;           /* templates used so far */
    uint32_t cur;            /* instruction being compiled */
} Compiler;

/* Number of templates an argument may need (upper bound: constants are not folded here). */
static uint32_t eg_count_tpl(const IRArg *a) {
    uint32_t n = 1;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) n += eg_count_tpl(&a->u.items[i]);
    return n;
}

/* Is the argument made of constants only (so a tuple of it can be built once)? */
static bool eg_all_const(const IRArg *a) {
    if (a->kind == IRARG_CONST) return true;
    if (a->kind == IRARG_NODE) return false;
    for (uint32_t i = 0; i < a->n; i++)
        if (!eg_all_const(&a->u.items[i])) return false;
    return true;
}

/* The Python value of a constant-only argument. New reference. */
static PyObject *eg_const_value(const IRArg *a) {
    if (a->kind == IRARG_CONST) return Py_NewRef(a->u.obj);
    PyObject *r = a->kind == IRARG_TUPLE ? PyTuple_New(a->n) : PyList_New(a->n);
    for (uint32_t i = 0; r && i < a->n; i++) {
        PyObject *v = eg_const_value(&a->u.items[i]);
        if (!v) Py_CLEAR(r);
        else if (a->kind == IRARG_TUPLE) PyTuple_SET_ITEM(r, i, v);
        else PyList_SET_ITEM(r, i, v);
    }
    return r;
}

/* Fills template *t from argument a; nested items take fresh templates. -1 with exception. */
static int eg_compile_arg(Compiler *c, const IRArg *a, Tpl *t) {
    switch (a->kind) {
    case IRARG_NODE: {
        uint32_t s = a->u.ref < c->g->nnodes ? c->slot_of[a->u.ref] : UINT32_MAX;
        if (s == UINT32_MAX || s >= c->eg->ninputs + c->cur) {
            PyErr_Format(PyExc_ValueError, "ember: argument refers to node %u, which is not an earlier value",
                         (unsigned)a->u.ref);
            return -1;
        }
        t->kind = TPL_SLOT;
        t->u.slot = s;
        c->lastuse[s] = c->cur;
        return 0;
    }
    case IRARG_CONST:
        if (!a->u.obj) {
            PyErr_SetString(PyExc_ValueError, "ember: constant argument is NULL");
            return -1;
        }
        t->kind = TPL_CONST;
        t->u.obj = Py_NewRef(a->u.obj);
        return 0;
    case IRARG_TUPLE:
    case IRARG_LIST:
        if (a->kind == IRARG_TUPLE && eg_all_const(a)) {
            t->kind = TPL_CONST;
            t->u.obj = eg_const_value(a);
            return t->u.obj ? 0 : -1;
        }
        t->kind = a->kind == IRARG_TUPLE ? TPL_TUPLE : TPL_LIST;
        t->n = a->n;
        t->u.first = c->ntpl;
        c->ntpl += a->n;
        for (uint32_t i = 0; i < a->n; i++)
            if (eg_compile_arg(c, &a->u.items[i], &c->eg->tpl[t->u.first + i]) < 0) return -1;
        return 0;
    }
    PyErr_SetString(PyExc_ValueError, "ember: argument of unknown kind");
    return -1;
}

/* Releases everything the object owns (dealloc and tp_clear). */
static void eg_release(EagerGraph *eg) {
    if (eg->instr) {
        for (uint32_t k = 0; k < eg->ninstr; k++) {
            Py_CLEAR(eg->instr[k].target);
            Py_CLEAR(eg->instr[k].call);
            Py_CLEAR(eg->instr[k].kwnames);
        }
        for (uint32_t t = 0; t < eg->ntpl; t++)
            if (eg->tpl[t].kind == TPL_CONST) Py_CLEAR(eg->tpl[t].u.obj);
    }
    Py_CLEAR(eg->names);
}

/* ---- The entry an operator is called through ----
 * An OpOverload (torch.ops.aten.<op>.<overload>) is a Python object whose __call__ is
 * `return self._op(*args, **kwargs)` (torch/_ops.py); `_op` is the C++ operator, reached through
 * pybind: arguments converted to IValues by the schema, a boxed call, results converted back.
 * Calling `_op` saves the Python frame of __call__; so for an OpOverloadPacket without torchbind
 * overloads (its __call__ is the same line otherwise). Where torch also generates a Python binding
 * for the op (torch._C._VariableFunctions / torch._C._nn: PythonArgParser and an unboxed call of the
 * same at:: function), that binding costs several µs less per call (bench/extern_calls.py);
 * FAST_BINDINGS lists the ops ember's own passes emit (autograd's forward rewrites) whose packets
 * hold only the functional overload and its out= variant, so the binding's signature parse picks
 * the very overload the graph names, and whose results are unnamed: for named results a binding
 * returns a torch.return_types struct sequence where the OpOverload returns a tuple (the scaled
 * dot product attention ops, left out; fast_binding checks the schema too). Any other target is
 * called as recorded. */
static const struct {
    const char *op;     /* schema name; the overload is "default" */
    const char *module; /* attribute of torch._C */
    const char *attr;
} FAST_BINDINGS[] = {
    {"aten::native_batch_norm", "_VariableFunctions", "native_batch_norm"},
    {"aten::cudnn_batch_norm", "_VariableFunctions", "cudnn_batch_norm"},
    {"aten::native_layer_norm", "_VariableFunctions", "native_layer_norm"},
    {"aten::native_group_norm", "_VariableFunctions", "native_group_norm"},
    {"aten::native_dropout", "_VariableFunctions", "native_dropout"},
    {"aten::max_pool2d_with_indices", "_nn", "max_pool2d_with_indices"},
    {"aten::max_pool3d_with_indices", "_nn", "max_pool3d_with_indices"},
};

/* Are all of schema's results unnamed (a binding returns a plain tuple, as the OpOverload)? 1 / 0,
 * -1 with an exception. */
static int results_unnamed(PyObject *schema) {
    PyObject *rets = PyObject_GetAttrString(schema, "returns"), *seq = rets ? PySequence_Fast(rets, "returns") : NULL;
    int ok = seq ? 1 : -1;
    for (Py_ssize_t i = 0; seq && ok == 1 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *nm = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(seq, i), "name");
        ok = !nm || !PyUnicode_Check(nm) ? -1 : PyUnicode_GET_LENGTH(nm) == 0;
        Py_XDECREF(nm);
    }
    Py_XDECREF(seq);
    Py_XDECREF(rets);
    return ok;
}

/* The binding FAST_BINDINGS gives OpOverload op, or NULL without an exception. New reference. */
static PyObject *fast_binding(PyObject *op) {
    PyObject *over = PyObject_GetAttrString(op, "_overloadname"), *schema = NULL, *name = NULL, *r = NULL;
    if (!over || !PyUnicode_Check(over) || PyUnicode_CompareWithASCIIString(over, "default")) goto done;
    if (!(schema = PyObject_GetAttrString(op, "_schema")) || !(name = PyObject_GetAttrString(schema, "name")) ||
        !PyUnicode_Check(name) || results_unnamed(schema) != 1)
        goto done;
    for (size_t i = 0; i < sizeof FAST_BINDINGS / sizeof FAST_BINDINGS[0]; i++) {
        if (PyUnicode_CompareWithASCIIString(name, FAST_BINDINGS[i].op)) continue;
        PyObject *c = PyImport_ImportModule("torch._C"), *m = c ? PyObject_GetAttrString(c, FAST_BINDINGS[i].module) : NULL;
        r = m ? PyObject_GetAttrString(m, FAST_BINDINGS[i].attr) : NULL;
        Py_XDECREF(m);
        Py_XDECREF(c);
        if (r && !PyCallable_Check(r)) Py_CLEAR(r);
        break;
    }
done:
    PyErr_Clear(); /* an attribute torch does not have: the op is called as recorded */
    Py_XDECREF(over);
    Py_XDECREF(schema);
    Py_XDECREF(name);
    return r;
}

/* ember._C._fast_calls(on) -> previous: whether graphs compiled from now on call operators
 * through call_target (default) or as recorded; for in-process A/B benchmarks and the tests. */
static int fast_calls = 1;

static PyObject *py_fast_calls(PyObject *self, PyObject *on) {
    int v = PyObject_IsTrue(on), prev = fast_calls;
    if (v < 0) return NULL;
    fast_calls = v;
    return PyBool_FromLong(prev);
}

/* What a call_function instruction calls for target (see above). New reference; never fails (a
 * lookup that fails leaves target as it is). */
static PyObject *call_target(PyObject *target) {
    PyObject *ops = NULL, *overload = NULL, *packet = NULL, *r = NULL;
    if (!fast_calls || PyCFunction_Check(target) || PyType_Check(target)) return Py_NewRef(target); /* torch.sin, ... */
    ops = PyImport_ImportModule("torch._ops");
    overload = ops ? PyObject_GetAttrString(ops, "OpOverload") : NULL;
    packet = ops ? PyObject_GetAttrString(ops, "OpOverloadPacket") : NULL;
    if (!overload || !packet) goto same; /* no torch, or another layout of torch._ops */
    if ((PyObject *)Py_TYPE(target) == overload) { /* exactly: TorchBindOpOverload dispatches in Python */
        if ((r = fast_binding(target))) goto done;
        r = PyObject_GetAttrString(target, "_op");
    } else if ((PyObject *)Py_TYPE(target) == packet) {
        PyObject *tb = PyObject_GetAttrString(target, "_has_torchbind_op_overload");
        int has = tb ? PyObject_IsTrue(tb) : -1;
        Py_XDECREF(tb);
        if (has == 0) r = PyObject_GetAttrString(target, "_op");
    }
    if (r && !PyCallable_Check(r)) Py_CLEAR(r);
same:
    PyErr_Clear();
    if (!r) r = Py_NewRef(target);
done:
    Py_XDECREF(ops);
    Py_XDECREF(overload);
    Py_XDECREF(packet);
    return r;
}

/* Compiles g: slots for inputs then call results, templates for arguments (constant tuples
 * folded), last uses turned into per-instruction free lists (counting sort). */
PyObject *em_eager_graph_new(const IRGraph *g) {
    EagerGraph *eg = NULL;
    uint32_t *slot_of = NULL, *lastuse = NULL;
    if (!EmEagerGraph_Type) {
        PyErr_SetString(PyExc_RuntimeError, "ember: EagerGraph type not initialised (em_runtime_init)");
        return NULL;
    }
    if (!g->output || g->output >= g->nnodes || g->nodes[g->output].kind != IR_OUTPUT ||
        g->nodes[g->output].nargs != 1) {
        PyErr_SetString(PyExc_ValueError, "ember: graph has no output node");
        return NULL;
    }
    const IRArg *outarg = &g->nodes[g->output].args[0];
    uint32_t ninstr = 0, ntpl = 0, maxargs = 0;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        ninstr++;
        for (uint32_t i = 0; i < n->nargs; i++) ntpl += eg_count_tpl(&n->args[i]);
        for (uint32_t i = 0; i < n->nkwargs; i++) ntpl += eg_count_tpl(&n->kwargs[i]);
        if (n->nargs + n->nkwargs > maxargs) maxargs = n->nargs + n->nkwargs;
    }
    uint32_t noutputs = outarg->n, nvalues = g->ninputs + ninstr;

    eg = PyObject_GC_New(EagerGraph, EmEagerGraph_Type);
    if (!eg) return NULL;
    eg->vectorcall = eg_vectorcall;
    eg->ninputs = g->ninputs;
    eg->nvalues = nvalues;
    eg->ninstr = 0; /* counts compiled instructions, so that eg_release sees only filled ones */
    eg->ntpl = 0;
    eg->noutputs = noutputs;
    eg->maxargs = maxargs;
    eg->cleared = 0;
    eg->names = NULL;
    /* one block: instr[ninstr] | tpl[ntpl] | frees[nvalues] | outputs[noutputs] | in_order | in_last */
    size_t bytes = ninstr * sizeof(Instr) + ntpl * sizeof(Tpl) +
                   (nvalues + noutputs + 2 * (size_t)g->ninputs) * sizeof(uint32_t);
    eg->instr = calloc(1, bytes ? bytes : 1);
    slot_of = malloc(g->nnodes * sizeof(uint32_t));
    lastuse = malloc((nvalues ? nvalues : 1) * sizeof(uint32_t));
    eg->names = PyTuple_New(nvalues);
    if (!eg->instr || !slot_of || !lastuse) {
        PyErr_NoMemory();
        goto error;
    }
    if (!eg->names) goto error;
    eg->tpl = (Tpl *)(eg->instr + ninstr);
    eg->frees = (uint32_t *)(eg->tpl + ntpl);
    eg->outputs = eg->frees + nvalues;
    eg->in_order = eg->outputs + noutputs;
    eg->in_last = eg->in_order + g->ninputs;
    for (IRRef r = 0; r < g->nnodes; r++) slot_of[r] = UINT32_MAX;
    for (uint32_t s = 0; s < nvalues; s++) lastuse[s] = UINT32_MAX;
    for (uint32_t i = 0; i < g->ninputs; i++) {
        IRRef r = g->inputs[i];
        if (r == 0 || r >= g->nnodes || g->nodes[r].kind != IR_PLACEHOLDER) {
            PyErr_Format(PyExc_ValueError, "ember: graph input %u is not a placeholder", i);
            goto error;
        }
        slot_of[r] = i;
        PyObject *nm = PyUnicode_FromString(g->nodes[r].name ? g->nodes[r].name : "?");
        if (!nm) goto error;
        PyTuple_SET_ITEM(eg->names, i, nm);
    }

    Compiler c = {eg, g, slot_of, lastuse, 0, 0};
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->kind == IR_PLACEHOLDER && slot_of[r] == UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "ember: placeholder %s is not a graph input", n->name);
            goto error;
        }
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (n->kind == IR_CALL_METHOD && (n->nargs < 1 || !PyUnicode_Check(n->target))) {
            PyErr_Format(PyExc_ValueError, "ember: call_method %s needs a str target and a self argument", n->name);
            goto error;
        }
        Instr *in = &eg->instr[c.cur];
        in->target = Py_NewRef(n->target);
        eg->ninstr = c.cur + 1;
        if (!(in->call = n->kind == IR_CALL_METHOD ? Py_NewRef(n->target) : call_target(n->target))) goto error;
        in->method = n->kind == IR_CALL_METHOD;
        in->autocast_enter = em_ir_autocast_node(n) == 1;
        in->nargs = n->nargs;
        in->nkw = n->nkwargs;
        in->out = g->ninputs + c.cur;
        in->tpl = c.ntpl;
        c.ntpl += n->nargs + n->nkwargs;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            Tpl *t = &eg->tpl[in->tpl + i];
            int rc = eg_compile_arg(&c, a, t);
            eg->ntpl = c.ntpl; /* every template below c.ntpl is zeroed or filled: safe to release */
            if (rc < 0) goto error;
            if (t->kind == TPL_TUPLE || t->kind == TPL_LIST) in->nbuilt++;
        }
        if (n->nkwargs) {
            in->kwnames = PyTuple_New(n->nkwargs);
            if (!in->kwnames) goto error;
            for (uint32_t i = 0; i < n->nkwargs; i++) {
                if (!n->kwnames[i] || !PyUnicode_Check(n->kwnames[i])) {
                    PyErr_Format(PyExc_ValueError, "ember: keyword name of %s is not a str", n->name);
                    goto error;
                }
                PyTuple_SET_ITEM(in->kwnames, i, Py_NewRef(n->kwnames[i]));
            }
        }
        slot_of[r] = in->out;
        PyObject *nm = PyUnicode_FromString(n->name ? n->name : "?");
        if (!nm) goto error;
        PyTuple_SET_ITEM(eg->names, in->out, nm);
        c.cur++;
    }
    if (outarg->kind != IRARG_TUPLE && outarg->kind != IRARG_LIST) {
        PyErr_SetString(PyExc_ValueError, "ember: output node must hold a tuple of results");
        goto error;
    }
    /* outputs: slots that live to the end (marked with lastuse = ninstr) */
    for (uint32_t i = 0; i < noutputs; i++) {
        const IRArg *a = &outarg->u.items[i];
        uint32_t s = a->kind == IRARG_NODE && a->u.ref < g->nnodes ? slot_of[a->u.ref] : UINT32_MAX;
        if (s == UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "ember: graph output %u is not a node result", i);
            goto error;
        }
        eg->outputs[i] = s;
        lastuse[s] = ninstr;
    }
    /* free lists: each result is released after its last use, or right after it is made when
     * unused (an in-place op kept by DCE); inputs are borrowed and never released */
    /* bucket the slots by the instruction after which they die (counting sort: O(values)) */
    for (uint32_t k = 0; k < ninstr; k++) eg->instr[k].nfree = 0;
    for (uint32_t s = g->ninputs; s < nvalues; s++) {
        uint32_t last = lastuse[s] == UINT32_MAX ? s - (uint32_t)g->ninputs : lastuse[s];
        if (last < ninstr) eg->instr[last].nfree++;
    }
    uint32_t nfree = 0;
    for (uint32_t k = 0; k < ninstr; k++) {
        eg->instr[k].free_first = nfree;
        nfree += eg->instr[k].nfree;
        eg->instr[k].nfree = 0;
    }
    for (uint32_t s = g->ninputs; s < nvalues; s++) {
        uint32_t last = lastuse[s] == UINT32_MAX ? s - (uint32_t)g->ninputs : lastuse[s];
        if (last < ninstr) eg->frees[eg->instr[last].free_first + eg->instr[last].nfree++] = s;
    }
    /* inputs by last use (insertion sort: graphs have tens of inputs); unused ones first */
    for (uint32_t i = 0; i < g->ninputs; i++) {
        uint32_t last = lastuse[i], j = i;
        eg->in_last[i] = last;
        while (j > 0 && (last == UINT32_MAX ? 0 : last + 1) <
                            (eg->in_last[eg->in_order[j - 1]] == UINT32_MAX ? 0 : eg->in_last[eg->in_order[j - 1]] + 1)) {
            eg->in_order[j] = eg->in_order[j - 1];
            j--;
        }
        eg->in_order[j] = i;
    }
    free(slot_of);
    free(lastuse);
    PyObject_GC_Track((PyObject *)eg);
    return (PyObject *)eg;
error:
    free(slot_of);
    free(lastuse);
    eg_release(eg);
    free(eg->instr);
    eg->instr = NULL;
    PyObject_GC_Del(eg);
    Py_DECREF(EmEagerGraph_Type); /* PyObject_GC_New took a reference to the heap type */
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* The type                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* One template as Python text, with slot names. Appends to parts. -1 with exception. */
static int eg_repr_tpl(const EagerGraph *eg, const Tpl *t, PyObject *parts) {
    PyObject *s = NULL;
    int rc = -1;
    switch (t->kind) {
    case TPL_SLOT:
        s = Py_NewRef(PyTuple_GET_ITEM(eg->names, t->u.slot));
        break;
    case TPL_CONST:
        s = PyObject_Repr(t->u.obj);
        break;
    case TPL_TUPLE:
    case TPL_LIST:
        s = PyUnicode_FromString(t->kind == TPL_TUPLE ? "(" : "[");
        if (!s || PyList_Append(parts, s) < 0) goto done;
        for (uint32_t i = 0; i < t->n; i++) {
            if (i) {
                Py_SETREF(s, PyUnicode_FromString(", "));
                if (!s || PyList_Append(parts, s) < 0) goto done;
            }
            if (eg_repr_tpl(eg, &eg->tpl[t->u.first + i], parts) < 0) goto done;
        }
        Py_SETREF(s, PyUnicode_FromString(t->kind == TPL_LIST ? "]" : t->n == 1 ? ",)" : ")"));
        break;
    }
    if (s) rc = PyList_Append(parts, s);
done:
    Py_XDECREF(s);
    return rc;
}

/* Appends a new str to parts (stealing it). -1 with exception. */
static int eg_put(PyObject *parts, PyObject *s) {
    if (!s) return -1;
    int rc = PyList_Append(parts, s);
    Py_DECREF(s);
    return rc;
}

/* EagerGraph(2 inputs, 3 instructions):
 *   sin = torch.sin(x)
 *   add = sin.add(y)  # frees sin
 *   return (add,)                                                                             */
static PyObject *eg_repr(PyObject *self) {
    EagerGraph *eg = (EagerGraph *)self;
    PyObject *parts = NULL, *empty = NULL, *r = NULL;
    if (eg->cleared || !eg->names) return PyUnicode_FromString("<EagerGraph (cleared)>");
    parts = PyList_New(0);
    if (!parts) return NULL;
    if (eg_put(parts, PyUnicode_FromFormat("EagerGraph(%zd inputs, %u instructions):", eg->ninputs, eg->ninstr)) < 0)
        goto done;
    for (uint32_t k = 0; k < eg->ninstr; k++) {
        const Instr *in = &eg->instr[k];
        PyObject *target = in->method ? Py_NewRef(in->target) : em_ir_target_qualname(in->target);
        if (!target) goto done;
        /* call_method prints as self.name(rest) */
        if (eg_put(parts, PyUnicode_FromFormat("\n  %U = ", PyTuple_GET_ITEM(eg->names, in->out))) < 0 ||
            (in->method && eg_repr_tpl(eg, &eg->tpl[in->tpl], parts) < 0)) {
            Py_DECREF(target);
            goto done;
        }
        PyObject *line = PyUnicode_FromFormat("%s%U(", in->method ? "." : "", target);
        Py_DECREF(target);
        if (eg_put(parts, line) < 0) goto done;
        for (uint32_t i = in->method ? 1 : 0; i < in->nargs + in->nkw; i++) {
            if (i > (in->method ? 1u : 0u) && eg_put(parts, PyUnicode_FromString(", ")) < 0) goto done;
            if (i >= in->nargs &&
                eg_put(parts, PyUnicode_FromFormat("%U=", PyTuple_GET_ITEM(in->kwnames, i - in->nargs))) < 0)
                goto done;
            if (eg_repr_tpl(eg, &eg->tpl[in->tpl + i], parts) < 0) goto done;
        }
        if (eg_put(parts, PyUnicode_FromString(")")) < 0) goto done;
        if (!in->method && in->call != in->target) { /* call_target: a binding (builtin), or `_op` */
            PyObject *via = em_ir_torch_callable(in->call) ? em_ir_target_qualname(in->call) : PyUnicode_FromString("_op");
            if (eg_put(parts, via ? PyUnicode_FromFormat("  # via %U", via) : NULL) < 0) {
                Py_XDECREF(via);
                goto done;
            }
            Py_DECREF(via);
        }
        for (uint32_t f = 0; f < in->nfree; f++) {
            PyObject *nm = PyTuple_GET_ITEM(eg->names, eg->frees[in->free_first + f]);
            if (eg_put(parts, PyUnicode_FromFormat(f ? ", %U" : "  # frees %U", nm)) < 0) goto done;
        }
    }
    if (eg_put(parts, PyUnicode_FromString("\n  return (")) < 0) goto done;
    for (uint32_t i = 0; i < eg->noutputs; i++) {
        PyObject *nm = PyTuple_GET_ITEM(eg->names, eg->outputs[i]);
        if (eg_put(parts, PyUnicode_FromFormat(i ? ", %U" : "%U", nm)) < 0) goto done;
    }
    if (eg_put(parts, PyUnicode_FromString(eg->noutputs == 1 ? ",)" : ")")) < 0) goto done;
    empty = PyUnicode_FromString("");
    if (empty) r = PyUnicode_Join(empty, parts);
done:
    Py_XDECREF(empty);
    Py_XDECREF(parts);
    return r;
}

/* GC: targets and constants are arbitrary objects (bound methods of modules, tensors...). */
static int eg_traverse(PyObject *self, visitproc visit, void *arg) {
    EagerGraph *eg = (EagerGraph *)self;
    Py_VISIT(Py_TYPE(self));
    if (eg->instr) {
        for (uint32_t k = 0; k < eg->ninstr; k++) {
            Py_VISIT(eg->instr[k].target);
            Py_VISIT(eg->instr[k].call);
            Py_VISIT(eg->instr[k].kwnames);
        }
        for (uint32_t t = 0; t < eg->ntpl; t++)
            if (eg->tpl[t].kind == TPL_CONST) Py_VISIT(eg->tpl[t].u.obj);
    }
    Py_VISIT(eg->names);
    return 0;
}

/* Breaks reference cycles; the object is marked so that it can no longer run. */
static int eg_clear(PyObject *self) {
    EagerGraph *eg = (EagerGraph *)self;
    eg->cleared = 1;
    eg_release(eg);
    return 0;
}

/* Heap-type dealloc: untrack, release, free, drop the type reference (PEP 573 rules). */
static void eg_dealloc(PyObject *self) {
    EagerGraph *eg = (EagerGraph *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    eg_release(eg);
    free(eg->instr);
    eg->instr = NULL;
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* eager_graph.noutputs (ninputs is a member), for tests and reports. */
static PyObject *eg_get_noutputs(PyObject *self, void *closure) {
    return PyLong_FromUnsignedLong(((EagerGraph *)self)->noutputs);
}
/* eager_graph.ninstructions. */
static PyObject *eg_get_ninstructions(PyObject *self, void *closure) {
    return PyLong_FromUnsignedLong(((EagerGraph *)self)->ninstr);
}

static PyMemberDef eg_members[] = {
#if EM_PY312
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(EagerGraph, vectorcall), Py_READONLY, NULL},
    {"ninputs", Py_T_PYSSIZET, offsetof(EagerGraph, ninputs), Py_READONLY, "number of graph inputs"},
#else
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(EagerGraph, vectorcall), READONLY, NULL},
    {"ninputs", T_PYSSIZET, offsetof(EagerGraph, ninputs), READONLY, "number of graph inputs"},
#endif
    {NULL},
};

static PyGetSetDef eg_getset[] = {
    {"noutputs", eg_get_noutputs, NULL, "number of graph results", NULL},
    {"ninstructions", eg_get_ninstructions, NULL, "number of recorded calls", NULL},
    {NULL},
};

static PyType_Slot eg_slots[] = {
    {Py_tp_doc, "The graph replayed op by op from C (ember's \"eager\" backend).\n"
                "eager_graph(*inputs) -> tuple of the graph's results. Exceptions raised by an op\n"
                "propagate unchanged, as in eager PyTorch."},
    {Py_tp_dealloc, eg_dealloc},
    {Py_tp_traverse, eg_traverse},
    {Py_tp_clear, eg_clear},
    {Py_tp_repr, eg_repr},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, eg_members},
    {Py_tp_methods, eg_methods},
    {Py_tp_getset, eg_getset},
    {0, NULL},
};

static PyType_Spec eg_spec = {
    .name = "ember._C.EagerGraph",
    .basicsize = sizeof(EagerGraph),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = eg_slots,
};

/* ---- AutocastOff: a compiled program run with torch.autocast off ---------------------------- */

/* fn(*args) inside torch._C._DisableAutocast (what `with torch._C._DisableAutocast():` does: the
 * Autocast dispatch keys excluded while fn runs, restored after, exception or not). The program of
 * a graph whose autocast casts are nodes (passes/em_pass_autocast.c) must not be recast. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;
} AutocastOff;

static PyTypeObject *AutocastOff_Type = NULL;

PyObject *em_with_autocast_off(PyObject *(*fn)(void *), void *ctx) {
    static PyObject *disable = NULL; /* torch._C._DisableAutocast; one interpreter (em_module.c) */
    if (!em_lazy_attr(&disable, "torch._C", "_DisableAutocast")) return NULL;
    PyObject *cm = PyObject_CallNoArgs(disable);
    PyObject *r = cm ? PyObject_CallMethodNoArgs(cm, em_str("__enter__")) : NULL;
    if (!r) {
        Py_XDECREF(cm);
        return NULL;
    }
    Py_DECREF(r);
    PyObject *out = fn(ctx);
    PyObject *exc = em_exc_take();
    PyObject *ea[4] = {cm, Py_None, Py_None, Py_None};
    r = PyObject_VectorcallMethod(em_str("__exit__"), ea, 4, NULL);
    Py_DECREF(cm);
    if (!r) {
        Py_XDECREF(exc);
        Py_XDECREF(out);
        return NULL;
    }
    Py_DECREF(r);
    em_exc_restore(exc);
    return out;
}

typedef struct {
    PyObject *fn;
    PyObject *const *args;
    size_t nargsf;
    PyObject *kwnames;
} AoCall;

static PyObject *ao_run(void *ctx) {
    AoCall *c = ctx;
    return PyObject_Vectorcall(c->fn, c->args, c->nargsf, c->kwnames);
}

static PyObject *ao_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    AoCall c = {((AutocastOff *)self)->fn, args, nargsf, kwnames};
    return em_with_autocast_off(ao_run, &c);
}

static int ao_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((AutocastOff *)self)->fn);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int ao_clear(PyObject *self) {
    Py_CLEAR(((AutocastOff *)self)->fn);
    return 0;
}

static void ao_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ao_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef ao_members[] = {
#if EM_PY312
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(AutocastOff, vectorcall), Py_READONLY, NULL},
    {"__wrapped__", Py_T_OBJECT_EX, offsetof(AutocastOff, fn), Py_READONLY, "the program run with autocast off"},
#else
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(AutocastOff, vectorcall), READONLY, NULL},
    {"__wrapped__", T_OBJECT_EX, offsetof(AutocastOff, fn), READONLY, "the program run with autocast off"},
#endif
    {NULL},
};

static PyType_Slot ao_slots[] = {
    {Py_tp_doc, "A compiled program run with torch.autocast off (its casts are graph nodes)."},
    {Py_tp_dealloc, ao_dealloc},
    {Py_tp_traverse, ao_traverse},
    {Py_tp_clear, ao_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, ao_members},
    {0, NULL},
};

static PyType_Spec ao_spec = {
    .name = "ember._C.AutocastOff",
    .basicsize = sizeof(AutocastOff),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ao_slots,
};

PyObject *em_autocast_off_new(PyObject *fn) {
    if (!AutocastOff_Type) {
        PyErr_SetString(PyExc_RuntimeError, "ember: AutocastOff type not initialised (em_runtime_init)");
        return NULL;
    }
    AutocastOff *a = PyObject_GC_New(AutocastOff, AutocastOff_Type);
    if (!a) return NULL;
    a->vectorcall = ao_vectorcall;
    a->fn = Py_NewRef(fn);
    PyObject_GC_Track((PyObject *)a);
    return (PyObject *)a;
}

/* Creates ember._C.EagerGraph (a heap type bound to the module) and sets EmEagerGraph_Type (one
 * strong reference, kept for the process: ember supports one interpreter); the same for
 * AutocastOff, and adds _fast_calls. Called by em_runtime_init (em_runtime.c). */
int em_runtime_eager_init(PyObject *module) {
    PyObject *tp = PyType_FromModuleAndSpec(module, &eg_spec, NULL);
    if (!tp) return -1;
    if (PyModule_AddObjectRef(module, "EagerGraph", tp) < 0) {
        Py_DECREF(tp);
        return -1;
    }
    Py_XSETREF(EmEagerGraph_Type, (PyTypeObject *)tp);
    if (!(tp = PyType_FromModuleAndSpec(module, &ao_spec, NULL))) return -1;
    Py_XSETREF(AutocastOff_Type, (PyTypeObject *)tp);
    static PyMethodDef fast_def = {"_fast_calls", py_fast_calls, METH_O,
                                   "_fast_calls(on) -> previous: operators called through their cheapest entry (default True) "
                                   "in graphs compiled from now on (benchmarks, tests)."};
    PyObject *f = PyCFunction_NewEx(&fast_def, NULL, NULL);
    if (!f || PyModule_AddObject(module, fast_def.ml_name, f) < 0) {
        Py_XDECREF(f);
        return -1;
    }
    return 0;
}
