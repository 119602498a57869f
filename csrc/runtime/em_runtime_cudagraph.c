/* runtime cudagraph: ember.compile(mode="reduce-overhead"): a graph entry's launches recorded in a
 * CUDA graph (torch.cuda.CUDAGraph, a private pool of torch's caching allocator) and replayed.
 * Two parts: the row-independence analysis over the IR (which graphs may be padded to a bucket of
 * batch sizes), and the runner (ember._C.CudaGraphs) whose call is the hit path: copy inputs into
 * the static buffers, replay, clone the outputs. Invariant: a call the runner cannot replay safely
 * runs the entry's plain compiled callable (never a wrong result); why is in cache_info. */
#include "runtime/em_runtime.h"

#include "guard/em_guard.h"

#include <stdio.h>
#include <string.h>
#include <structmember.h>

/* ---- row independence ----
 * A graph is row-independent along the batch dim when every output row b (dim 0 of an output that
 * carries the batch) depends only on row b of the batched inputs. Then padding the batched inputs
 * to P >= B rows and taking the first B rows of the outputs gives eager's result, and one CUDA
 * graph recorded at P serves every B in the bucket. Proven node by node from a whitelist (anything
 * else: not row-independent, with the node named):
 *   pointwise ops (broadcasting): a batched operand has the output's ndim (its dim 0 is the
 *     output's dim 0); an unbatched tensor operand must not span the output's dim 0 (fewer dims,
 *     or size 1 there);
 *   linear / matmul / mm with the batch on the left (the right operand unbatched, at most 2-d);
 *   convolutions and pooling on a batched input (weights unbatched);
 *   reductions, softmax, log_softmax, cumsum over constant dims other than 0;
 *   layer_norm / group_norm (normalized dims exclude 0), batch_norm with training=False;
 *   views that keep dim 0: flatten(start_dim >= 1), unsqueeze/squeeze/transpose/permute that leave
 *     dim 0 in place, getitem whose index starts with a full slice.
 * Rejected: in-place ops and out= (the recorded graph would mutate a static copy, not the user's
 * tensor), view/reshape with explicit sizes (the sizes name B), ops that read a size or any
 * non-tensor value of the graph, random ops, reductions over dim 0, training batch_norm. */

enum { ROW_NONE = 0, ROW_BATCHED = 1 };

static const char *const POINTWISE[] = {
    "add", "sub", "mul", "div", "true_divide", "neg", "pow", "exp", "log", "sin", "cos", "tanh", "sigmoid", "relu",
    "abs", "sqrt", "rsqrt", "where", "gelu", "silu", "erf", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
    "floor", "ceil", "round", "sign", "reciprocal", "log1p", "expm1", "exp2", "log2", "square", "truediv", "floordiv",
    "mod", "remainder", "fmod", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid", "relu6", "rsub", "float", "half",
    "bfloat16", "double", "contiguous", "clone", "type_as", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
    "__rmul__", "__truediv__", "__rtruediv__", "__neg__", "__pow__", "__mod__", "__lt__", "__gt__", "__le__", "__ge__",
    "tan", "atan", "asin", "acos", "sinh", "cosh", "lerp", "addcmul", "addcdiv", "nan_to_num", "selu", "celu",
    "logsigmoid", "tanhshrink", "softsign", "threshold", "prelu", NULL};
static const char *const REDUCE_DIM[] = {"softmax", "log_softmax", "sum", "mean", "amax", "amin", "var", "std",
                                         "logsumexp", "argmax", "argmin", "cumsum", "prod", "all", "any", "norm",
                                         NULL};
static const char *const CONV_POOL[] = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                                        "conv_transpose3d", "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d",
                                        "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                                        "adaptive_max_pool2d", "interpolate", "pixel_shuffle", NULL};

static int in_list(const char *s, const char *const *list) {
    for (int i = 0; list[i]; i++)
        if (strcmp(s, list[i]) == 0) return 1;
    return 0;
}

typedef struct {
    const IRGraph *g;
    uint8_t *row;  /* per node: ROW_NONE / ROW_BATCHED */
    char *why;
    size_t nwhy;
} RowCtx;

static int reject(RowCtx *c, const IRNode *n, const char *name, const char *what) {
    snprintf(c->why, c->nwhy, "%s (node %s, %s)", what, n->name ? n->name : "?", name);
    return -1;
}

static const IRMeta *tensor_meta(const RowCtx *c, const IRArg *a) {
    if (a->kind != IRARG_NODE) return NULL;
    const IRMeta *m = &c->g->nodes[a->u.ref].meta;
    return m->kind == IRMETA_TENSOR ? m : NULL;
}

/* Every node argument (nested too) must be a tensor node: a size, SymInt or tuple result would
 * carry B into the graph's constants. */
static int args_are_tensors(RowCtx *c, const IRArg *a) {
    if (a->kind == IRARG_NODE) return tensor_meta(c, a) != NULL;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++)
            if (!args_are_tensors(c, &a->u.items[i])) return 0;
    }
    return 1;
}

static const IRArg *arg_or_kw(const IRNode *n, uint32_t pos, const char *kw) {
    if (pos < n->nargs) return &n->args[pos];
    for (uint32_t k = 0; k < n->nkwargs; k++)
        if (PyUnicode_CompareWithASCIIString(n->kwnames[k], kw) == 0) return &n->kwargs[k];
    return NULL;
}

/* A constant int argument, normalized by ndim; -1 when absent/not an int (def: value if absent). */
static int const_dim(const IRArg *a, int ndim, long dflt, long *out) {
    if (!a) {
        *out = dflt;
        return 0;
    }
    if (a->kind != IRARG_CONST || !PyLong_Check(a->u.obj)) return -1;
    long d = PyLong_AsLong(a->u.obj);
    if (d == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (d < 0) d += ndim;
    *out = d;
    return 0;
}

/* Do the dims of a (an int or a tuple/list of ints) all differ from 0? (None / absent: no.) */
static int dims_exclude_0(const IRArg *a, int ndim) {
    if (!a) return 0;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        if (a->n == 0) return 0;
        for (uint32_t i = 0; i < a->n; i++)
            if (!dims_exclude_0(&a->u.items[i], ndim)) return 0;
        return 1;
    }
    long d;
    if (const_dim(a, ndim, 0, &d) < 0) return 0;
    return d != 0;
}

/* Pointwise with broadcasting against the output (out_ndim dims). */
static int rows_pointwise(RowCtx *c, const IRNode *n, const char *name, int out_ndim) {
    int any = 0;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
        const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
        const IRMeta *m = tensor_meta(c, a);
        if (!m) continue;
        if (c->row[a->u.ref] == ROW_BATCHED) {
            if (m->ndim != out_ndim) return reject(c, n, name, "a batched operand is broadcast across the batch dim");
            any = 1;
        } else if (m->ndim == out_ndim && out_ndim > 0 && m->sizes[0] != 1) {
            return reject(c, n, name, "an unbatched operand spans the batch dim");
        }
    }
    return any ? ROW_BATCHED : ROW_NONE;
}

static int unbatched(const RowCtx *c, const IRArg *a) {
    return !a || a->kind != IRARG_NODE || c->row[a->u.ref] != ROW_BATCHED;
}

/* A call node's op name (a method's name, a function's __name__) into buf; 0, or -1 if it has none. */
static int node_name(const IRNode *n, char *buf, size_t nbuf) {
    const char *name = NULL;
    PyObject *nm = NULL;
    if (n->kind == IR_CALL_METHOD) {
        name = PyUnicode_AsUTF8(n->target);
    } else {
        nm = PyObject_GetAttrString(n->target, "__name__");
        name = nm && PyUnicode_Check(nm) ? PyUnicode_AsUTF8(nm) : NULL;
    }
    if (name) snprintf(buf, nbuf, "%s", name);
    else PyErr_Clear();
    Py_XDECREF(nm);
    return name ? 0 : -1;
}

static int rows_node(RowCtx *c, const IRNode *n) {
    char buf[64];
    if (node_name(n, buf, sizeof buf) < 0) return reject(c, n, "?", "an op without a name");
    const char *name = buf;
    int r = -1;
    for (uint32_t i = 0; i < n->nargs; i++)
        if (!args_are_tensors(c, &n->args[i])) return reject(c, n, name, "an op reads a size or non-tensor value");
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        if (!args_are_tensors(c, &n->kwargs[i])) return reject(c, n, name, "an op reads a size or non-tensor value");
        if (PyUnicode_CompareWithASCIIString(n->kwnames[i], "out") == 0) return reject(c, n, name, "out= argument");
    }
    if (em_ir_mutates(n)) return reject(c, n, name, "an in-place op");
    const IRMeta *om = &n->meta;
    const IRArg *a0 = n->nargs ? &n->args[0] : NULL;
    const IRMeta *m0 = a0 ? tensor_meta(c, a0) : NULL;
    int b0 = a0 && !unbatched(c, a0);
    if (om->kind != IRMETA_TENSOR) return reject(c, n, name, "an op whose result is not one tensor");
    if (in_list(name, POINTWISE)) return rows_pointwise(c, n, name, om->ndim);
    /* every remaining rule: no batched operand -> unbatched result (an op on parameters alone) */
    int anyb = 0;
    for (uint32_t i = 0; i < n->nargs; i++)
        if (!unbatched(c, &n->args[i])) anyb = 1;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (!unbatched(c, &n->kwargs[i])) anyb = 1;
    if (!anyb && (in_list(name, REDUCE_DIM) || in_list(name, CONV_POOL) || !strcmp(name, "linear") ||
                  !strcmp(name, "matmul") || !strcmp(name, "mm") || !strcmp(name, "t")))
        return ROW_NONE;
    if (!b0 || !m0 || m0->ndim < 1) return reject(c, n, name, "the batched operand is not the op's first tensor");
    for (uint32_t i = 1; i < n->nargs; i++)
        if (!unbatched(c, &n->args[i])) return reject(c, n, name, "two batched operands of a non-pointwise op");
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (!unbatched(c, &n->kwargs[i])) return reject(c, n, name, "two batched operands of a non-pointwise op");
    if (om->ndim < 1) return reject(c, n, name, "the result has no batch dim");
    if (in_list(name, REDUCE_DIM)) {
        if (!dims_exclude_0(arg_or_kw(n, 1, "dim"), m0->ndim)) return reject(c, n, name, "a reduction over the batch dim");
        r = ROW_BATCHED;
    } else if (in_list(name, CONV_POOL)) {
        if (m0->ndim < 3) return reject(c, n, name, "an unbatched convolution/pooling input");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "linear") || !strcmp(name, "matmul") || !strcmp(name, "mm") || !strcmp(name, "__matmul__")) {
        const IRMeta *m1 = n->nargs > 1 ? tensor_meta(c, &n->args[1]) : NULL;
        if (m0->ndim < 2 || (m1 && m1->ndim > 2)) return reject(c, n, name, "a matmul whose batch is not the left operand's dim 0");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "layer_norm") || !strcmp(name, "rms_norm")) {
        const IRArg *ns = arg_or_kw(n, 1, "normalized_shape");
        if (!ns || (ns->kind != IRARG_TUPLE && ns->kind != IRARG_LIST && ns->kind != IRARG_CONST))
            return reject(c, n, name, "no normalized_shape");
        uint32_t k = ns->kind == IRARG_CONST ? (uint32_t)PyObject_Length(ns->u.obj) : ns->n;
        if (PyErr_Occurred()) {
            PyErr_Clear();
            k = 1;
        }
        if ((int)k >= m0->ndim) return reject(c, n, name, "normalized over the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "group_norm")) {
        r = m0->ndim >= 2 ? ROW_BATCHED : reject(c, n, name, "group_norm of a 1-d input");
    } else if (!strcmp(name, "batch_norm")) {
        const IRArg *tr = arg_or_kw(n, 5, "training");
        if (!tr || tr->kind != IRARG_CONST || tr->u.obj != Py_False)
            return reject(c, n, name, "batch_norm in training mode (statistics over the batch)");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "flatten")) {
        long d;
        if (const_dim(arg_or_kw(n, 1, "start_dim"), m0->ndim, 0, &d) < 0 || d < 1)
            return reject(c, n, name, "flatten over the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "unsqueeze")) {
        long d;
        if (const_dim(arg_or_kw(n, 1, "dim"), om->ndim, 0, &d) < 0 || d < 1) return reject(c, n, name, "a new dim before the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "squeeze")) {
        long d;
        if (const_dim(arg_or_kw(n, 1, "dim"), m0->ndim, 0, &d) < 0 || d < 1) return reject(c, n, name, "squeeze of the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "transpose") || !strcmp(name, "swapaxes")) {
        long d0, d1;
        if (const_dim(arg_or_kw(n, 1, "dim0"), m0->ndim, 0, &d0) < 0 ||
            const_dim(arg_or_kw(n, 2, "dim1"), m0->ndim, 0, &d1) < 0 || d0 == 0 || d1 == 0)
            return reject(c, n, name, "a transpose that moves the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "permute")) {
        const IRArg *p = n->nargs > 1 ? &n->args[1] : NULL;
        if (p && (p->kind == IRARG_TUPLE || p->kind == IRARG_LIST)) p = p->n ? &p->u.items[0] : NULL;
        long d;
        if (!p || const_dim(p, m0->ndim, 1, &d) < 0 || d != 0) return reject(c, n, name, "a permute that moves the batch dim");
        r = ROW_BATCHED;
    } else if (!strcmp(name, "getitem") || !strcmp(name, "__getitem__")) {
        const IRArg *ix = n->nargs > 1 ? &n->args[1] : NULL;
        if (ix && (ix->kind == IRARG_TUPLE || ix->kind == IRARG_LIST)) ix = ix->n ? &ix->u.items[0] : NULL;
        int full = 0;
        if (ix && ix->kind == IRARG_CONST && PySlice_Check(ix->u.obj)) {
            PySliceObject *s = (PySliceObject *)ix->u.obj;
            full = s->start == Py_None && s->stop == Py_None && s->step == Py_None;
        }
        if (!full) return reject(c, n, name, "an index that selects batch rows");
        r = ROW_BATCHED;
    } else {
        return reject(c, n, name, "an op the row analysis does not know");
    }
    return r;
}

int em_cudagraph_rows(const IRGraph *g, const uint8_t *batched_in, uint8_t *batched_out, char *why, size_t nwhy) {
    RowCtx c = {g, calloc(g->nnodes ? g->nnodes : 1, 1), why, nwhy};
    int ok = 1, anyin = 0;
    if (!c.row) return -1;
    why[0] = 0;
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRMeta *m = &g->nodes[g->inputs[i]].meta;
        if (batched_in[i] && m->kind == IRMETA_TENSOR && m->ndim >= 1) {
            c.row[g->inputs[i]] = ROW_BATCHED;
            anyin = 1;
        }
    }
    if (!anyin) {
        snprintf(why, nwhy, "no input carries a batch dim");
        ok = 0;
    }
    for (IRRef r = 1; ok && r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        int v = rows_node(&c, n);
        if (v < 0) ok = 0;
        else c.row[r] = (uint8_t)v;
    }
    if (ok && g->output) {
        const IRNode *o = &g->nodes[g->output];
        const IRArg *outs = o->nargs ? &o->args[0] : NULL;
        uint32_t no = outs && (outs->kind == IRARG_TUPLE || outs->kind == IRARG_LIST) ? outs->n : 0;
        for (uint32_t k = 0; k < no; k++) {
            const IRArg *a = &outs->u.items[k];
            batched_out[k] = a->kind == IRARG_NODE && c.row[a->u.ref] == ROW_BATCHED;
            if (a->kind == IRARG_NODE && g->nodes[a->u.ref].kind == IR_PLACEHOLDER) {
                snprintf(why, nwhy, "an input is returned as an output");
                ok = 0;
            }
        }
    }
    free(c.row);
    return ok;
}

/* ---- inputs written in place ----
 * A recording reads and writes fixed addresses: an input copied into a static buffer must not be
 * one the graph writes (the write would land in the copy, not in the user's tensor). Written, for
 * this analysis: the self of an in-place op (name ending in one '_', operator.iadd ..., setitem),
 * an out= argument, and every tensor argument but the first (the input) of a batch/instance norm
 * (running statistics; weight and bias too, conservatively), each followed back through the ops
 * whose result may alias their self (ALIASING) to the input it aliases. The walk stops at an op
 * not in ALIASING: that list must name every such op. */
static const char *const ALIASING[] = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims", "permute", "movedim", "t", "T",
    "mT", "H", "mH", "getitem", "__getitem__", "select", "narrow", "squeeze", "unsqueeze", "flatten", "unflatten",
    "expand", "expand_as", "as_strided", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "hsplit",
    "vsplit", "contiguous", "detach", "diagonal", "unfold", "real", "imag", "view_as_real", "view_as_complex",
    "alias", "type_as", "to", "float", "double", "half", "bfloat16", "data", "requires_grad_", "atleast_1d",
    "atleast_2d", "atleast_3d", "ravel", NULL};

static void mark_written(const IRGraph *g, const IRArg *a, uint8_t *node_written) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++) mark_written(g, &a->u.items[i], node_written);
        return;
    }
    if (a->kind != IRARG_NODE) return;
    IRRef r = a->u.ref;
    while (r && !node_written[r]) {
        node_written[r] = 1;
        const IRNode *n = &g->nodes[r];
        char name[64];
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->nargs == 0 ||
            node_name(n, name, sizeof name) < 0 || !in_list(name, ALIASING) || n->args[0].kind != IRARG_NODE)
            break;
        r = n->args[0].u.ref; /* the result may alias its self: the write reaches it too */
    }
}

int em_cudagraph_written_inputs(const IRGraph *g, uint8_t *written) {
    uint8_t *w = calloc(g->nnodes ? g->nnodes : 1, 1);
    if (!w) return -1;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        char name[64];
        if (node_name(n, name, sizeof name) < 0) continue;
        int norm = strstr(name, "batch_norm") != NULL || strstr(name, "instance_norm") != NULL;
        if (norm) {
            for (uint32_t i = 1; i < n->nargs; i++) mark_written(g, &n->args[i], w);
            for (uint32_t i = 0; i < n->nkwargs; i++) mark_written(g, &n->kwargs[i], w);
        } else if (em_ir_mutates(n) && em_ir_mutated_arg(n)) { /* F.relu(x, inplace=True) too */
            mark_written(g, em_ir_mutated_arg(n), w);
        }
        for (uint32_t i = 0; i < n->nkwargs; i++)
            if (PyUnicode_CompareWithASCIIString(n->kwnames[i], "out") == 0) mark_written(g, &n->kwargs[i], w);
    }
    for (uint32_t i = 0; i < g->ninputs; i++) written[i] = w[g->inputs[i]];
    free(w);
    return 0;
}

/* Outputs of g (the OUTPUT node's tuple length). */
static uint32_t graph_noutputs(const IRGraph *g) {
    if (!g->output) return 0;
    const IRNode *o = &g->nodes[g->output];
    const IRArg *outs = o->nargs ? &o->args[0] : NULL;
    return outs && (outs->kind == IRARG_TUPLE || outs->kind == IRARG_LIST) ? outs->n : 0;
}

PyObject *em_cudagraph_rows_py(const IRGraph *g, PyObject *batched) {
    uint8_t *bin = calloc(g->ninputs + 1, 1), *bout = calloc(graph_noutputs(g) + 1, 1);
    PyObject *r = NULL, *outs = NULL;
    char why[256];
    if (!bin || !bout) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t i = 0; i < g->ninputs && i < (uint32_t)PySequence_Size(batched); i++) {
        PyObject *v = PySequence_GetItem(batched, i);
        if (!v) goto done;
        bin[i] = (uint8_t)PyObject_IsTrue(v);
        Py_DECREF(v);
    }
    int ok = em_cudagraph_rows(g, bin, bout, why, sizeof why);
    if (ok < 0) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t no = graph_noutputs(g);
    outs = PyTuple_New(no);
    for (uint32_t k = 0; outs && k < no; k++) PyTuple_SET_ITEM(outs, k, PyBool_FromLong(bout[k]));
    if (outs)
        r = Py_BuildValue("{s:O,s:s,s:O}", "row_independent", ok ? Py_True : Py_False, "reason", ok ? "" : why,
                          "batched_outputs", outs);
done:
    Py_XDECREF(outs);
    free(bin);
    free(bout);
    return r;
}

/* ---- the runner ---- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inner;       /* the entry's compiled callable */
    int inner_eager;       /* inner is an EagerGraph (em_eager_graph_run) */
    PyObject *pool;        /* ember._cudagraphs.Pool: recordings and the allocator pool, per compiled function */
    PyObject *plan;        /* dict for the recorder: export, backend, batched, out_batched, batch, bucket */
    PyObject *stats;       /* dict shown as cache_info()[i]["cudagraphs"] */
    int state;             /* 0: not recorded, 1: recorded, 2: plain launching (reason in stats) */
    Py_ssize_t ninputs;
    /* the recording, seen from this entry (ember._cudagraphs.record) */
    PyObject *replay;      /* CUDAGraph.replay (bound) */
    PyObject *dsts;        /* list: static buffers (views of B rows) the inputs are copied into */
    PyObject *srcs;        /* list of the same length, refilled per call */
    Py_ssize_t *src_idx;   /* input index per dst */
    Py_ssize_t ncopy;
    Py_ssize_t *static_idx;/* inputs the graph reads in place (parameters) */
    void **static_ptr;     /* their data_ptr at recording */
    Py_ssize_t nstatic;
    PyObject *outs;        /* tuple: the graph's outputs (views of B rows) */
    int nrerecords;        /* recordings dropped because a written input's storage moved */
    long long nreplays;    /* calls answered by a replay (cache_info's "replays") */
} CudaGraphs;

static PyTypeObject *CudaGraphs_Type = NULL;
static PyObject *record_fn = NULL;  /* ember._cudagraphs.record */
static PyObject *foreach_copy = NULL; /* torch._foreach_copy_ */

static PyObject *run_inner(CudaGraphs *r, PyObject *const *args, Py_ssize_t n) {
    if (r->inner_eager) return em_eager_graph_run(r->inner, args, n);
    return PyObject_Vectorcall(r->inner, args, (size_t)n, NULL);
}

static int set_stat(CudaGraphs *r, const char *k, PyObject *v_steal) {
    if (!v_steal) return -1;
    int rc = PyDict_SetItemString(r->stats, k, v_steal);
    Py_DECREF(v_steal);
    return rc;
}

/* Plain launching from now on for this entry; the reason (str) goes to cache_info. */
static void to_plain(CudaGraphs *r, PyObject *reason) {
    r->state = 2;
    if (set_stat(r, "state", PyUnicode_FromString("plain")) < 0 || set_stat(r, "reason", reason) < 0) PyErr_Clear();
}

/* Drops this entry's recording (the next call records again): an input the graph writes in place
 * (a static KV cache) came with other storage, as a new cache does for each generate(). The pool
 * drops the recording too (ember._cudagraphs.record evicts the plan's previous key), so the old
 * buffers are freed, not kept for ever. */
static void drop_recording(CudaGraphs *r) {
    Py_CLEAR(r->replay);
    Py_CLEAR(r->dsts);
    Py_CLEAR(r->srcs);
    Py_CLEAR(r->outs);
    PyMem_Free(r->src_idx);
    PyMem_Free(r->static_idx);
    PyMem_Free(r->static_ptr);
    r->src_idx = r->static_idx = NULL;
    r->static_ptr = NULL;
    r->ncopy = r->nstatic = 0;
    r->state = 0;
    r->nrerecords++;
    if (set_stat(r, "rerecords", PyLong_FromLong(r->nrerecords)) < 0) PyErr_Clear();
}

/* Is input i one the graph writes in place (plan["written"][i])? */
static int written_input(const CudaGraphs *r, Py_ssize_t i) {
    PyObject *w = r->plan ? PyDict_GetItemString(r->plan, "written") : NULL; /* borrowed */
    return w && PyTuple_Check(w) && i < PyTuple_GET_SIZE(w) && PyTuple_GET_ITEM(w, i) == Py_True;
}

static int take_recording(CudaGraphs *r, PyObject *rec) {
    /* rec = (replay, dsts, src_idx, static_idx, static_ptrs, outs) */
    if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) != 6) {
        PyErr_SetString(PyExc_TypeError, "ember: bad CUDA graph recording");
        return -1;
    }
    PyObject *dsts = PyTuple_GET_ITEM(rec, 1), *si = PyTuple_GET_ITEM(rec, 2), *st = PyTuple_GET_ITEM(rec, 3),
             *sp = PyTuple_GET_ITEM(rec, 4);
    r->ncopy = PyList_GET_SIZE(dsts);
    r->nstatic = PyTuple_GET_SIZE(st);
    r->src_idx = PyMem_Calloc((size_t)r->ncopy + 1, sizeof(Py_ssize_t));
    r->static_idx = PyMem_Calloc((size_t)r->nstatic + 1, sizeof(Py_ssize_t));
    r->static_ptr = PyMem_Calloc((size_t)r->nstatic + 1, sizeof(void *));
    r->srcs = PyList_New(r->ncopy);
    if (!r->src_idx || !r->static_idx || !r->static_ptr || !r->srcs) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < r->ncopy; i++) {
        r->src_idx[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(si, i));
        PyList_SET_ITEM(r->srcs, i, Py_NewRef(Py_None));
    }
    for (Py_ssize_t i = 0; i < r->nstatic; i++) {
        r->static_idx[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, i));
        r->static_ptr[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(sp, i));
    }
    if (PyErr_Occurred()) return -1;
    r->replay = Py_NewRef(PyTuple_GET_ITEM(rec, 0));
    r->dsts = Py_NewRef(dsts);
    r->outs = Py_NewRef(PyTuple_GET_ITEM(rec, 5));
    r->state = 1;
    return 0;
}

/* The hit path: no host synchronisation, no Python frame. */
static PyObject *cg_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    CudaGraphs *r = (CudaGraphs *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (r->state == 2 || n != r->ninputs) return run_inner(r, args, n);
record:
    if (r->state == 0) {
        PyObject *argt = PyTuple_New(n);
        if (!argt) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(argt, i, Py_NewRef(args[i]));
        PyObject *rec = PyObject_CallFunctionObjArgs(record_fn, r->pool, r->plan, r->inner, argt, r->stats, NULL);
        Py_DECREF(argt);
        if (!rec || take_recording(r, rec) < 0) {
            /* a capture error (an op that syncs with the host, an unsupported call ...): plain
             * launching, the exception's text in cache_info */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyObject *msg = v ? PyObject_Str(v) : NULL;
            to_plain(r, PyUnicode_FromFormat("capture failed: %S: %S", t ? t : Py_None, msg ? msg : Py_None));
            Py_XDECREF(msg);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
            Py_XDECREF(rec);
            return run_inner(r, args, n);
        }
        Py_DECREF(rec);
        /* the recording ran this call's inputs at capture: replay below gives the result again */
    }
    for (Py_ssize_t i = 0; i < r->nstatic; i++) {
        char *ptr;
        if (em_guard_tensor_data_ptr(args[r->static_idx[i]], &ptr) < 0) return NULL;
        if ((void *)ptr != r->static_ptr[i]) {
            /* an input written in place with other storage (a new KV cache): record again, at most
             * a few times per entry; a parameter's storage replaced: run plainly (its old memory is
             * recorded) */
            if (written_input(r, r->static_idx[i]) && r->nrerecords < 64) {
                drop_recording(r);
                goto record;
            }
            return run_inner(r, args, n);
        }
    }
    if (r->ncopy == 1) {
        PyObject *x = PyObject_CallMethodOneArg(PyList_GET_ITEM(r->dsts, 0), em_str("copy_"), args[r->src_idx[0]]);
        if (!x) return NULL;
        Py_DECREF(x);
    } else if (r->ncopy > 1) {
        for (Py_ssize_t i = 0; i < r->ncopy; i++) {
            PyObject *old = PyList_GET_ITEM(r->srcs, i);
            PyList_SET_ITEM(r->srcs, i, Py_NewRef(args[r->src_idx[i]]));
            Py_DECREF(old);
        }
        PyObject *x = PyObject_CallFunctionObjArgs(foreach_copy, r->dsts, r->srcs, NULL);
        for (Py_ssize_t i = 0; i < r->ncopy; i++) { /* hold no user tensor between calls */
            PyObject *old = PyList_GET_ITEM(r->srcs, i);
            PyList_SET_ITEM(r->srcs, i, Py_NewRef(Py_None));
            Py_DECREF(old);
        }
        if (!x) return NULL;
        Py_DECREF(x);
    }
    PyObject *x = PyObject_CallNoArgs(r->replay);
    if (!x) return NULL;
    Py_DECREF(x);
    PyObject *cnt = PyLong_FromLongLong(++r->nreplays);
    int rc = cnt ? PyDict_SetItem(r->stats, em_str("replays"), cnt) : -1;
    Py_XDECREF(cnt);
    if (rc < 0) return NULL;
    /* outputs are cloned: the next replay overwrites the recorded ones, and a user must never see
     * that (torch's cudagraph trees raise on a stale access instead; a clone costs one launch) */
    Py_ssize_t no = PyTuple_GET_SIZE(r->outs);
    PyObject *res = PyTuple_New(no);
    if (!res) return NULL;
    for (Py_ssize_t k = 0; k < no; k++) {
        PyObject *c = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(r->outs, k), em_str("clone"));
        if (!c) {
            Py_DECREF(res);
            return NULL;
        }
        PyTuple_SET_ITEM(res, k, c);
    }
    return res;
}

static int cg_traverse(PyObject *self, visitproc visit, void *arg) {
    CudaGraphs *r = (CudaGraphs *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(r->inner);
    Py_VISIT(r->pool);
    Py_VISIT(r->plan);
    Py_VISIT(r->stats);
    Py_VISIT(r->replay);
    Py_VISIT(r->dsts);
    Py_VISIT(r->srcs);
    Py_VISIT(r->outs);
    return 0;
}

static int cg_clear(PyObject *self) {
    CudaGraphs *r = (CudaGraphs *)self;
    Py_CLEAR(r->inner);
    Py_CLEAR(r->pool);
    Py_CLEAR(r->plan);
    Py_CLEAR(r->stats);
    Py_CLEAR(r->replay);
    Py_CLEAR(r->dsts);
    Py_CLEAR(r->srcs);
    Py_CLEAR(r->outs);
    return 0;
}

static void cg_dealloc(PyObject *self) {
    CudaGraphs *r = (CudaGraphs *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    cg_clear(self);
    PyMem_Free(r->src_idx);
    PyMem_Free(r->static_idx);
    PyMem_Free(r->static_ptr);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef cg_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(CudaGraphs, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot cg_slots[] = {
    {Py_tp_doc, "A graph entry's compiled callable replayed from CUDA graphs (mode=\"reduce-overhead\")."},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, cg_traverse},
    {Py_tp_clear, cg_clear},
    {Py_tp_dealloc, cg_dealloc},
    {Py_tp_members, cg_members},
    {0, NULL},
};

static PyType_Spec cg_spec = {
    "ember._C.CudaGraphs", sizeof(CudaGraphs), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, cg_slots,
};

static int is_param(PyObject *t) {
    static PyObject *param_type = NULL; /* torch.nn.Parameter: a type object, immortal for the process */
    if (!param_type && !em_lazy_attr(&param_type, "torch.nn", "Parameter")) return -1;
    return PyObject_IsInstance(t, param_type);
}

/* Is t a tensor (has data_ptr and dim)? 1 / 0 / -1. */
static int tensor_attr_long(PyObject *t, const char *meth, long *out) {
    PyObject *v = PyObject_CallMethod(t, meth, NULL);
    if (!v) return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

static int tensor_attr_true(PyObject *t, const char *attr) {
    PyObject *v = PyObject_GetAttrString(t, attr);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The inputs' part of plan_entry: all CUDA tensors of one device; *training when one requires grad
 * (grad mode on); batched_in / *batch: the non-parameter inputs whose dim 0 is the first one's.
 * Py_None (new) when recordable, a reason string (new), or NULL with an exception. */
static PyObject *plan_inputs(PyObject *const *ex, uint32_t n, int grad_on, const uint8_t *written, uint8_t *batched_in,
                             long *batch, int *training, long *dev) {
    static PyObject *tensor_type = NULL;
    if (!tensor_type && !em_lazy_attr(&tensor_type, "torch", "Tensor")) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        int isT = PyObject_IsInstance(ex[i], tensor_type);
        if (isT < 0) return NULL;
        if (!isT) return PyUnicode_FromString("a graph input is not a tensor");
        int cuda = tensor_attr_true(ex[i], "is_cuda");
        if (cuda < 0) return NULL;
        if (!cuda) return PyUnicode_FromString("CPU tensors (CUDA graphs record CUDA work only)");
        long d;
        if (tensor_attr_long(ex[i], "get_device", &d) < 0) return NULL;
        if (*dev != -2 && d != *dev) return PyUnicode_FromString("inputs on several CUDA devices");
        *dev = d;
        int rg = grad_on ? tensor_attr_true(ex[i], "requires_grad") : 0; /* grad mode is guarded */
        if (rg < 0) return NULL;
        if (rg) *training = 1;
        int p = is_param(ex[i]);
        if (p < 0) return NULL;
        long nd;
        if (tensor_attr_long(ex[i], "dim", &nd) < 0) return NULL;
        batched_in[i] = 0;
        if (!p && nd >= 1) {
            PyObject *s = PyObject_CallMethod(ex[i], "size", "i", 0);
            long b = s ? PyLong_AsLong(s) : -1;
            Py_XDECREF(s);
            if (PyErr_Occurred()) return NULL;
            if (*batch < 0) *batch = b;
            batched_in[i] = b == *batch;
        }
    }
    return Py_NewRef(Py_None);
}

/* Decides at compile time, from the example inputs, whether the entry can be recorded and how:
 * a reason string (new) for plain launching, or Py_None (new) with batched_in / plan filled. */
static PyObject *plan_entry(const IRGraph *g, PyObject *const *ex, uint32_t n, PyObject *backend, uint8_t *batched_in,
                            uint8_t *batched_out, const uint8_t *written, long *batch, int *rows_ok, int *training,
                            char *why, size_t nwhy) {
    static PyObject *is_grad_enabled = NULL;
    if (!is_grad_enabled && !em_lazy_attr(&is_grad_enabled, "torch", "is_grad_enabled")) return NULL;
    if (em_ir_is_symbolic(g)) return PyUnicode_FromString("symbolic sizes (one entry serves many shapes)");
    PyObject *ge = PyObject_CallNoArgs(is_grad_enabled);
    if (!ge) return NULL;
    int grad_on = ge == Py_True;
    Py_DECREF(ge);
    long dev = -2;
    *batch = -1;
    *training = 0;
    PyObject *r = plan_inputs(ex, n, grad_on, written, batched_in, batch, training, &dev);
    if (r != Py_None) return r;
    Py_DECREF(r);
    if (n == 0) return PyUnicode_FromString("a graph without inputs");
    if (*training) return Py_NewRef(Py_None); /* ember._cudagraphs.TrainingGraphs records per call */
    /* buckets need a program for the padded size: the eager backend runs any size, "ember" is
     * compiled again at the bucket (ember._cudagraphs); other backends record per shape */
    int bucketable = PyUnicode_Check(backend) && (PyUnicode_CompareWithASCIIString(backend, "eager") == 0 ||
                                                  PyUnicode_CompareWithASCIIString(backend, "ember") == 0);
    /* An input the graph writes in place (a static KV cache, `x.add_(1)`) is recorded at its own
     * address, as a parameter is (ember._cudagraphs.record; the replay checks the address and runs
     * plainly when it moved), never through a copy; it cannot be padded to a bucket. */
    for (uint32_t i = 0; i < n; i++)
        if (written[i]) {
            snprintf(why, nwhy, "input %u is written in place (recorded at its address)", i);
            *rows_ok = 0;
            return Py_NewRef(Py_None);
        }
    int ok = em_cudagraph_rows(g, batched_in, batched_out, why, nwhy);
    if (ok == 0) {
        /* another input of B rows may be a coincidence (a bias of size B broadcast along rows):
         * the analysis proves the mask it is given, so try the first batched input alone */
        int first = 1, more = 0;
        uint8_t *one = calloc(n + 1, 1);
        if (!one) return PyErr_NoMemory();
        for (uint32_t i = 0; i < n; i++) {
            one[i] = batched_in[i] && first;
            if (batched_in[i] && !first) more = 1;
            if (batched_in[i]) first = 0;
        }
        char why2[256];
        if (more && em_cudagraph_rows(g, one, batched_out, why2, sizeof why2) == 1) {
            memcpy(batched_in, one, n);
            ok = 1;
        }
        free(one);
    }
    if (ok < 0) return PyErr_NoMemory();
    if (ok && !bucketable) {
        snprintf(why, nwhy, "backend records one graph per shape");
        ok = 0;
    }
    *rows_ok = ok;
    return Py_NewRef(Py_None);
}

static long bucket_of(long b) {
    long p = 1;
    while (p < b) p <<= 1;
    return p;
}

PyObject *em_cudagraph_wrap(PyObject *compiled, int is_eager_graph, const IRGraph *g, PyObject *const *examples,
                            uint32_t n, PyObject *backend, PyObject *pool, PyObject **info) {
    uint32_t no = graph_noutputs(g);
    uint8_t *bin = calloc(n + 1, 1), *bout = calloc(no + 1, 1);
    PyObject *plain = NULL, *bt = NULL, *bo = NULL, *export = NULL;
    CudaGraphs *r = NULL;
    uint8_t *written = NULL;
    char why[256] = "";
    long batch = -1;
    int rows_ok = 0, training = 0;
    if (!bin || !bout) {
        PyErr_NoMemory();
        goto error;
    }
    if (!record_fn && !em_lazy_attr(&record_fn, "ember._cudagraphs", "record")) goto error;
    if (!foreach_copy && !em_lazy_attr(&foreach_copy, "torch", "_foreach_copy_")) goto error;
    written = calloc(n + 1, 1);
    if (!written || em_cudagraph_written_inputs(g, written) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    plain = plan_entry(g, examples, n, backend, bin, bout, written, &batch, &rows_ok, &training, why, sizeof why);
    if (!plain) goto error;
    if (training && plain == Py_None) {
        /* a training region (csrc/autograd): its forward and backward halves are recorded by
         * ember._cudagraphs.training, which returns (callable, stats) */
        static PyObject *training_fn = NULL;
        if (!training_fn && !em_lazy_attr(&training_fn, "ember._cudagraphs", "training")) goto error;
        PyObject *wt = PyTuple_New(n);
        if (!wt) goto error;
        for (uint32_t i = 0; i < n; i++) PyTuple_SET_ITEM(wt, i, PyBool_FromLong(written[i]));
        PyObject *res = PyObject_CallFunctionObjArgs(training_fn, compiled, wt, NULL);
        Py_DECREF(wt);
        if (!res) goto error;
        PyObject *fn = NULL, *st = NULL;
        if (!PyArg_ParseTuple(res, "OO", &fn, &st)) {
            Py_DECREF(res);
            goto error;
        }
        *info = Py_NewRef(st);
        PyObject *out = Py_NewRef(fn);
        Py_DECREF(res);
        Py_DECREF(plain);
        free(bin);
        free(bout);
        free(written);
        return out;
    }
    r = PyObject_GC_New(CudaGraphs, CudaGraphs_Type);
    if (!r) goto error;
    r->vectorcall = cg_vectorcall;
    r->inner = Py_NewRef(compiled);
    r->inner_eager = is_eager_graph;
    r->pool = Py_NewRef(pool);
    r->plan = NULL;
    r->stats = PyDict_New();
    r->state = 0;
    r->ninputs = n;
    r->replay = r->dsts = r->srcs = r->outs = NULL;
    r->src_idx = r->static_idx = NULL;
    r->static_ptr = NULL;
    r->ncopy = r->nstatic = 0;
    r->nrerecords = 0;
    r->nreplays = 0;
    PyObject_GC_Track((PyObject *)r);
    if (!r->stats) goto error;
    PyObject *pstats = PyObject_GetAttrString(pool, "stats");
    if (set_stat(r, "pool", pstats) < 0) goto error;
    if (plain != Py_None) {
        to_plain(r, Py_NewRef(plain));
        if (set_stat(r, "row_independent", Py_NewRef(Py_False)) < 0) goto error;
    } else {
        long bucket = rows_ok ? bucket_of(batch) : -1;
        bt = PyTuple_New(n);
        bo = PyTuple_New(no);
        export = rows_ok ? em_ir_to_python(g) : Py_NewRef(Py_None); /* the bucket's recording key */
        if (!bt || !bo || !export) goto error;
        for (uint32_t i = 0; i < n; i++) PyTuple_SET_ITEM(bt, i, PyBool_FromLong(rows_ok && bin[i]));
        for (uint32_t k = 0; k < no; k++) PyTuple_SET_ITEM(bo, k, PyBool_FromLong(rows_ok && bout[k]));
        PyObject *wt = PyTuple_New(n);
        for (uint32_t i = 0; wt && i < n; i++) PyTuple_SET_ITEM(wt, i, PyBool_FromLong(written[i]));
        r->plan = wt ? Py_BuildValue("{s:O,s:O,s:O,s:O,s:l,s:l,s:N}", "export", export, "backend", backend, "batched",
                                     bt, "out_batched", bo, "batch", rows_ok ? batch : -1L, "bucket", bucket, "written",
                                     wt)
                     : NULL;
        if (!r->plan || set_stat(r, "state", PyUnicode_FromString("not recorded")) < 0 ||
            set_stat(r, "row_independent", PyBool_FromLong(rows_ok)) < 0 ||
            set_stat(r, "reason", rows_ok ? PyUnicode_FromString("") : PyUnicode_FromFormat("one graph per shape: %s", why)) < 0 ||
            set_stat(r, "batch", PyLong_FromLong(rows_ok ? batch : -1)) < 0 ||
            set_stat(r, "bucket", PyLong_FromLong(bucket)) < 0)
            goto error;
    }
    *info = Py_NewRef(r->stats);
    Py_DECREF(plain);
    Py_XDECREF(bt);
    Py_XDECREF(bo);
    Py_XDECREF(export);
    free(bin);
    free(bout);
    free(written);
    return (PyObject *)r;
error:
    Py_XDECREF(plain);
    Py_XDECREF(bt);
    Py_XDECREF(bo);
    Py_XDECREF(export);
    Py_XDECREF(r);
    free(bin);
    free(bout);
    free(written);
    return NULL;
}

int em_runtime_cudagraph_init(PyObject *module) {
    CudaGraphs_Type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &cg_spec, NULL);
    if (!CudaGraphs_Type) return -1;
    return PyModule_AddObjectRef(module, "CudaGraphs", (PyObject *)CudaGraphs_Type);
}
