/* pass layout: channels_last for the convolutions of static inference graphs, as Inductor's layout
 * optimization: float32 on the CPU, float16 / bfloat16 on CUDA.
 * Invariant: graph outputs keep eager's strides. */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* ---------------------------------------------------------------- channels_last layout
 * oneDNN's convolutions are faster on channels_last inputs, and torch keeps that layout through
 * batch norm, ReLU, residual adds and pooling; Inductor converts convolution inputs to channels_last
 * on CPU (torch/_inductor/graph.py decide_layout_opt: "for cpu backend and mkldnn enabled, we always
 * use channels_last"). On CUDA, cuDNN's half-precision convolutions are NHWC kernels: an NCHW input
 * is transposed in and the result transposed back on every call (nchwToNhwcKernel /
 * nhwcToNchwKernel: 1.06 ms of ResNet-50 bf16's 5.7 ms at batch 64 on the H200), and 1x1
 * convolutions run as slower NCHW GEMMs; Inductor's decide_layout_opt converts convolution networks
 * there too. This pass does the same to a static inference graph: before each 2-d convolution of a
 * contiguous NCHW input (float32 on the CPU, float16 / bfloat16 on CUDA: where_channels_last),
 * x.contiguous(memory_format=torch.channels_last);
 * every node downstream of a conversion is emitted again with its meta inferred from its new
 * arguments (ag_emit, on fake CPU tensors for channels_last ones), so it has the layout eager gives a
 * channels_last model; a graph output whose strides changed is converted back with contiguous()
 * when eager's was contiguous. Anything else (a non-tensor result downstream, an output of another
 * layout, a view that channels_last cannot take, a failed meta call): NULL, the graph is kept. */
static bool where_channels_last(const IRMeta *m) {
    if (m->kind != IRMETA_TENSOR || m->ndim != 4 || !em_ir_meta_contiguous(m)) return false;
    if (em_ir_meta_on_cpu(m)) return em_rw_meta_dtype_is(m, "torch.float32");
    return em_rw_meta_on_cuda(m) && (em_rw_meta_dtype_is(m, "torch.bfloat16") || em_rw_meta_dtype_is(m, "torch.float16"));
}

static bool is_conv2d_nchw(const IRGraph *g, const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || n->nargs < 2 || n->args[0].kind != IRARG_NODE || n->args[1].kind != IRARG_NODE)
        return false;
    if (!em_rw_node_named(n, "torch.nn.functional.conv2d torch.conv2d")) return false;
    const IRMeta *x = &em_ir_node(g, n->args[0].u.ref)->meta, *w = &em_ir_node(g, n->args[1].u.ref)->meta;
    return where_channels_last(x) && x->sizes[1] > 1 && w->kind == IRMETA_TENSOR && w->ndim == 4;
}

/* A contiguous 4-d convolution weight whose channels_last layout differs from its own (not a 1x1
 * kernel, not one input channel). */
static bool weight_wants_channels_last(const IRMeta *w) {
    return where_channels_last(w) && w->sizes[1] > 1 && w->sizes[2] * w->sizes[3] > 1;
}

/* v.contiguous(memory_format=torch.channels_last) (clf) emitted into d's graph; 0 on failure. */
static IRRef to_channels_last(Rewrite *d, IRRef v, PyObject *clf) {
    PyObject *kw = em_rw_kwname(d, "memory_format"), *contig = em_rw_kwname(d, "contiguous");
    if (!kw || !contig) return 0;
    IRArg va = em_rw_arg_node(v), mf = {.kind = IRARG_CONST};
    mf.u.obj = clf;
    return em_rw_emit(d, IR_CALL_METHOD, contig, &va, 1, &kw, &mf, 1);
}

/* Why the rewrite stopped at node n (a str for info["layout_kept"]); NULL without one. */
static PyObject *kept_because(const Rewrite *d, const IRNode *n, const char *what) {
    PyObject *why = d->reason ? PyObject_Str(d->reason) : NULL;
    PyErr_Clear();
    PyObject *r = PyUnicode_FromFormat("%s at %s%s%S", what, n ? n->name : "the outputs", why ? ": " : "", why ? why : Py_None);
    Py_XDECREF(why);
    return r;
}

static IRGraph *channels_last(const IRGraph *g, PyObject *names, PyObject **kept) {
    Rewrite d = {.inference = true};
    IRGraph *out = NULL;
    uint32_t G = g->nnodes;
    uint8_t *conv = calloc(G, 1), *dep = calloc(G, 1);
    IRRef *cl = calloc(G, sizeof(IRRef)), *outs = NULL;
    IRArg *args = NULL;
    bool any = false;
    if (!conv || !dep || !cl) goto done;
    for (IRRef r = 1; r < G; r++) {
        conv[r] = is_conv2d_nchw(g, em_ir_node(g, r));
        any |= conv[r] != 0;
    }
    if (!any) goto done;
    outs = calloc(G + 1, sizeof(IRRef));
    if (!outs || em_rw_rewriter_begin(&d, g) < 0) goto done;
    PyObject *clf = em_rw_held_attr(&d, "torch", "channels_last");
    PyObject *contig = em_arena_hold_steal(d.a, PyUnicode_InternFromString("contiguous"));
    if (!clf || !contig) goto done;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs && !dep[r]; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            if (a->kind == IRARG_NODE) dep[r] = dep[a->u.ref];
            else if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
                for (uint32_t k = 0; k < a->n; k++)
                    if (a->u.items[k].kind == IRARG_NODE && dep[a->u.items[k].u.ref]) dep[r] = 1;
        }
        if (!conv[r] && !dep[r]) { /* upstream of every conversion: as it was */
            d.fmap[r] = em_rw_copy_node(&d, n);
            if (!d.fmap[r]) goto done;
            continue;
        }
        if (n->meta.kind != IRMETA_TENSOR) { /* tuple / non-tensor results: keep the graph */
            *kept = kept_because(&d, n, "a non-tensor value after a converted convolution");
            goto done;
        }
        args = em_arena_alloc(d.a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
        if (!args) goto done;
        for (uint32_t i = 0; i < n->nargs; i++) args[i] = em_rw_map_arg(&d, &n->args[i]);
        for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = em_rw_map_arg(&d, &n->kwargs[i]);
        if (conv[r] && !dep[n->args[0].u.ref]) {
            IRRef x = n->args[0].u.ref;
            if (!cl[x] && !(cl[x] = to_channels_last(&d, d.fmap[x], clf))) goto done;
            args[0] = em_rw_arg_node(cl[x]);
            PyObject *nm = PyUnicode_FromString(n->name);
            if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
            Py_XDECREF(nm);
        }
        /* the weight of a convolution whose input is now channels_last, as Inductor's layout
         * optimization does: torch's convolution makes the weight channels_last itself on every
         * call (weight.contiguous(memory_format), a TensorIterator copy); here it is ember's copy
         * kernel (em_lower.c, contiguous_channels_last), fused with same-shaped ones. The same cost
         * (docs/backend_cpu.md, "channels_last"); per call, so in-place updates are seen. */
        const IRMeta *xm = args[0].kind == IRARG_NODE ? &em_ir_node(d.j, args[0].u.ref)->meta : NULL;
        IRRef w = n->args[1].u.ref;
        if (conv[r] && xm && xm->ndim == 4 && xm->strides && xm->strides[1] == 1 && !dep[w] &&
            weight_wants_channels_last(&em_ir_node(g, w)->meta)) {
            if (!cl[w] && !(cl[w] = to_channels_last(&d, d.fmap[w], clf))) goto done;
            args[1] = em_rw_arg_node(cl[w]);
        }
        dep[r] = 1;
        d.fmap[r] = em_rw_emit(&d, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs);
        if (!d.fmap[r]) {
            *kept = kept_because(&d, n, "no channels_last form");
            goto done;
        }
    }
    if (d.reason) goto done;
    const IRArg *go = &em_ir_node(g, g->output)->args[0];
    for (uint32_t k = 0; k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d.fmap[go->u.items[k].u.ref]) goto done;
        IRRef o = go->u.items[k].u.ref, v = d.fmap[o];
        const IRMeta *m0 = &em_ir_node(g, o)->meta, *m1 = &em_ir_node(d.j, v)->meta;
        if (m0->kind == IRMETA_TENSOR && dep[o] && !em_rw_same_strides(m0, m1)) {
            if (!em_ir_meta_contiguous(m0)) {
                *kept = kept_because(&d, NULL, "an output of another layout than contiguous");
                goto done;
            }
            IRArg va = em_rw_arg_node(v);
            v = em_rw_emit(&d, IR_CALL_METHOD, contig, &va, 1, NULL, NULL, 0);
            if (!v || !em_rw_same_strides(m0, &em_ir_node(d.j, v)->meta)) goto done;
        }
        outs[k] = v;
    }
    out = em_rw_rewriter_finish(&d, outs, go->n);
done:
    free(conv);
    free(dep);
    free(cl);
    free(outs);
    em_rw_rewriter_free(&d);
    return out;
}

/* g with the inputs of its 2-d convolutions of contiguous NCHW tensors (where_channels_last) converted to
 * channels_last and every node after a conversion re-typed (the layout eager gives a channels_last
 * model), graph outputs converted back to their strides (static inference graphs, while
 * ember.config.layout_optimization is on); info["channels_last"] names the converted convolutions,
 * info["layout_kept"] says why a graph with such convolutions kept its layout.
 * NULL when nothing changed or the rewrite failed: then g as it is. */
IRGraph *em_pass_layout(const IRGraph *g, EmPassCtx *ctx) {
    if (!em_config_bool("layout_optimization", 1)) return NULL;
    PyObject *convs = PyList_New(0), *kept = NULL;
    IRGraph *out = convs ? channels_last(g, convs, &kept) : NULL;
    if (out && PyDict_SetItemString(ctx->info, "channels_last", convs) < 0) out = NULL;
    if (!out && kept && PyDict_SetItemString(ctx->info, "layout_kept", kept) < 0) PyErr_Clear();
    Py_XDECREF(kept);
    Py_XDECREF(convs);
    PyErr_Clear();
    return out;
}
