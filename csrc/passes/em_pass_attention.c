/* pass attention: scaled_dot_product_attention calls rewritten so that a fused kernel can run them.
 * An attention mask that is True everywhere, by construction, is dropped.
 * Invariant: a rewritten call computes what the original computes (the same attention, maybe by
 * another of torch's kernels: values within the dtype's tolerance). */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* ---------------------------------------------------------------- all-True masks
 * transformers builds the attention mask of a batch without padding from index comparisons when it
 * runs under a compiler (masking_utils.sdpa_mask: eager checks the padding mask's values and passes
 * no mask at all, a data-dependent branch a compiler does not take). BERT's is
 * `(arange(S) + 0)[None, None, :, None] >= 0` expanded to (B, 1, L, S): True everywhere, and a
 * boolean mask with a last stride of 0 that no fused kernel accepts, so torch runs the math kernel,
 * in fp32 for bf16 inputs (BERT-base bf16 on the H200: 60% of the call; Inductor does the same). A
 * mask proven True everywhere attends to every key, the same attention as no mask: the call is
 * emitted without it, and eager's kernel choice for unmasked attention applies.
 *
 * The proof is an interval analysis of integer and boolean values: for each node, bounds lo <= v
 * <= hi over all its elements, from arange / ones / zeros / full, shifted by additions and
 * subtractions, through comparisons (True everywhere when the bounds decide them), logical and / or
 * / not, and ops whose elements are elements of their input (views, expand, indexing, clone). */

typedef struct {
    bool known;
    long long lo, hi;
} Range;

static bool meta_integral(const IRMeta *m) {
    static const char *const names[] = {"torch.bool", "torch.uint8", "torch.int8", "torch.int16", "torch.int32", "torch.int64"};
    if (m->kind != IRMETA_TENSOR) return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (em_rw_meta_dtype_is(m, names[i])) return true;
    return false;
}

/* An int constant argument (bools excluded); false otherwise. */
static bool arg_int(const IRArg *a, long long *v) {
    if (a->kind != IRARG_CONST || !PyLong_Check(a->u.obj) || PyBool_Check(a->u.obj)) return false;
    int ovf = 0;
    *v = PyLong_AsLongLongAndOverflow(a->u.obj, &ovf);
    if (PyErr_Occurred() || ovf || *v > (1LL << 40) || *v < -(1LL << 40)) return PyErr_Clear(), false;
    return true;
}

/* The bounds of argument a: a node's, or an int / bool constant's. */
static Range arg_range(const Range *rg, const IRArg *a) {
    long long v;
    if (a->kind == IRARG_NODE) return rg[a->u.ref];
    if (a->kind == IRARG_CONST && PyBool_Check(a->u.obj)) return (Range){true, a->u.obj == Py_True, a->u.obj == Py_True};
    if (arg_int(a, &v)) return (Range){true, v, v};
    return (Range){0};
}

/* Bounds of a comparison's result (a bool: [1, 1] when it holds everywhere, [0, 0] nowhere). */
static Range compare(const char *op, Range x, Range y) {
    if (!x.known || !y.known) return (Range){0};
    int always = -1; /* 1: true everywhere, 0: false everywhere, -1: undecided */
    if (!strcmp(op, "ge")) always = x.lo >= y.hi ? 1 : x.hi < y.lo ? 0 : -1;
    else if (!strcmp(op, "gt")) always = x.lo > y.hi ? 1 : x.hi <= y.lo ? 0 : -1;
    else if (!strcmp(op, "le")) always = x.hi <= y.lo ? 1 : x.lo > y.hi ? 0 : -1;
    else if (!strcmp(op, "lt")) always = x.hi < y.lo ? 1 : x.lo >= y.hi ? 0 : -1;
    else if (!strcmp(op, "eq")) always = x.lo == x.hi && y.lo == y.hi && x.lo == y.lo ? 1 : x.hi < y.lo || y.hi < x.lo ? 0 : -1;
    else if (!strcmp(op, "ne")) always = x.hi < y.lo || y.hi < x.lo ? 1 : x.lo == x.hi && y.lo == y.hi && x.lo == y.lo ? 0 : -1;
    return always < 0 ? (Range){true, 0, 1} : (Range){true, always, always};
}

/* The op's short name when n is one of torch's spellings of it (operator.X, torch.X, Tensor.X), else
 * NULL. s: n's qualified name. */
static const char *short_op(const char *s) {
    if (!strncmp(s, "operator.", 9)) return s + 9;
    if (!strncmp(s, "torch.", 6) && !strchr(s + 6, '.')) return s + 6;
    if (!strncmp(s, "Tensor.", 7)) return s + 7;
    return NULL;
}

/* Ops whose result's elements are all elements of their first argument. */
static const char *const SUBSET_OPS = "getitem expand expand_as view reshape unsqueeze squeeze transpose permute contiguous "
                                      "clone broadcast_to repeat flatten unflatten narrow select t detach";

/* The bounds of node n's elements (an integer or bool tensor), from its arguments' (rg). */
static Range node_range(const IRNode *n, const Range *rg) {
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !meta_integral(&n->meta)) return (Range){0};
    PyObject *qn = em_rw_node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    const char *op = s ? short_op(s) : NULL;
    Range r = {0};
    long long v[3];
    if (!op) goto done;
    if (!strcmp(op, "arange") && n->kind == IR_CALL_FUNCTION && n->nargs >= 1 && n->nargs <= 3) {
        for (uint32_t i = 0; i < n->nargs; i++)
            if (!arg_int(&n->args[i], &v[i])) goto done;
        long long start = n->nargs == 1 ? 0 : v[0], end = n->nargs == 1 ? v[0] : v[1], step = n->nargs == 3 ? v[2] : 1;
        if (step <= 0 || end <= start) goto done; /* empty or descending: not needed */
        r = (Range){true, start, start + (end - start - 1) / step * step};
    } else if ((!strcmp(op, "ones") || !strcmp(op, "zeros")) && n->kind == IR_CALL_FUNCTION) {
        long long c = op[0] == 'o';
        r = (Range){true, c, c};
    } else if (!strcmp(op, "full") && n->kind == IR_CALL_FUNCTION && n->nargs == 2) {
        r = arg_range(rg, &n->args[1]);
    } else if ((!strcmp(op, "add") || !strcmp(op, "sub")) && n->nargs == 2 && n->nkwargs == 0 &&
               !em_rw_meta_dtype_is(&n->meta, "torch.bool")) {
        Range x = arg_range(rg, &n->args[0]), y = arg_range(rg, &n->args[1]);
        if (x.known && y.known)
            r = op[0] == 'a' ? (Range){true, x.lo + y.lo, x.hi + y.hi} : (Range){true, x.lo - y.hi, x.hi - y.lo};
    } else if ((!strcmp(op, "ge") || !strcmp(op, "gt") || !strcmp(op, "le") || !strcmp(op, "lt") || !strcmp(op, "eq") ||
                !strcmp(op, "ne")) &&
               n->nargs == 2 && n->nkwargs == 0) {
        r = compare(op, arg_range(rg, &n->args[0]), arg_range(rg, &n->args[1]));
    } else if ((!strcmp(op, "and_") || !strcmp(op, "logical_and") || !strcmp(op, "or_") || !strcmp(op, "logical_or")) &&
               n->nargs == 2 && n->nkwargs == 0 && em_rw_meta_dtype_is(&n->meta, "torch.bool")) {
        Range x = arg_range(rg, &n->args[0]), y = arg_range(rg, &n->args[1]);
        bool conj = op[0] == 'a' || !strcmp(op, "logical_and");
        if (x.known && y.known && x.lo >= 0 && x.hi <= 1 && y.lo >= 0 && y.hi <= 1)
            r = conj ? (Range){true, x.lo && y.lo, x.hi && y.hi} : (Range){true, x.lo || y.lo, x.hi || y.hi};
    } else if ((!strcmp(op, "invert") || !strcmp(op, "logical_not") || !strcmp(op, "bitwise_not")) && n->nargs == 1 &&
               em_rw_meta_dtype_is(&n->meta, "torch.bool")) {
        Range x = arg_range(rg, &n->args[0]);
        if (x.known && x.lo >= 0 && x.hi <= 1) r = (Range){true, 1 - x.hi, 1 - x.lo};
    } else if (em_rw_names_has(SUBSET_OPS, op) && n->nargs >= 1 && n->args[0].kind == IRARG_NODE) {
        r = rg[n->args[0].u.ref]; /* a view of the input, or a copy of some of its elements */
    }
done:
    Py_XDECREF(qn);
    PyErr_Clear();
    return r;
}

static const Rule SDPA_SIG = {"torch.nn.functional.scaled_dot_product_attention",
                              "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False",
                              "", "", 0, SP_SDPA};

/* Is node r of g an attention call whose mask the rewrite drops (a bool mask True everywhere, that
 * broadcasts to the scores, and is_causal False: eager raises for a mask with is_causal)? */
static bool droppable_mask(Rewrite *d, IRRef r, const Range *rg, Bind *b) {
    const IRNode *n = em_ir_node(d->g, r);
    if (n->kind != IR_CALL_FUNCTION || !em_rw_node_named(n, SDPA_SIG.names) || em_rw_bind_args(d, &SDPA_SIG, n, b) < 0)
        return PyErr_Clear(), false;
    IRArg m = em_rw_bval(b, "attn_mask"), q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), ic = em_rw_bval(b, "is_causal");
    if (m.kind != IRARG_NODE || q.kind != IRARG_NODE || k.kind != IRARG_NODE || ic.kind != IRARG_CONST || ic.u.obj != Py_False)
        return false;
    const IRMeta *mm = &em_ir_node(d->g, m.u.ref)->meta;
    if (!em_rw_meta_dtype_is(mm, "torch.bool") || !rg[m.u.ref].known || rg[m.u.ref].lo != 1) return false;
    return em_rw_sdpa_mask_broadcasts(d, &em_ir_node(d->g, q.u.ref)->meta, &em_ir_node(d->g, k.u.ref)->meta, mm);
}

/* g with the masks of its attention calls dropped where droppable_mask says so; info["attention"]
 * names the calls. NULL when there is none or the rewrite failed. */
IRGraph *em_pass_attention(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.inference = ctx->when == EM_PASSES_INFERENCE};
    uint32_t G = g->nnodes;
    Range *rg = calloc(G, sizeof(Range));
    uint8_t *drop = calloc(G, 1);
    PyObject *names = PyList_New(0);
    IRGraph *out = NULL;
    bool any = false;
    if (!rg || !drop || !names) goto done;
    d.a = g->arena;
    d.g = g;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        rg[r] = node_range(em_ir_node(g, r), rg);
        drop[r] = droppable_mask(&d, r, rg, &b);
        any |= drop[r];
    }
    if (!any || em_rw_rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (!drop[r]) {
            if (!(d.fmap[r] = em_rw_copy_node(&d, n))) goto done;
            continue;
        }
        Bind b;
        if (!droppable_mask(&d, r, rg, &b)) goto done;
        IRArg a[6], kv[2];
        static const char *const pos[] = {"query", "key", "value", "attn_mask", "dropout_p", "is_causal"};
        for (int i = 0; i < 6; i++) {
            IRArg v = em_rw_bval(&b, pos[i]);
            a[i] = i == 3 ? em_rw_arg_const_steal(&d, Py_NewRef(Py_None)) : em_rw_map_arg(&d, &v);
        }
        /* scale and enable_gqa as keywords, where the call gave them other than their defaults */
        IRArg sc = em_rw_bval(&b, "scale"), gq = em_rw_bval(&b, "enable_gqa");
        PyObject *kwn[2];
        uint32_t nkw = 0;
        if (!em_rw_arg_is_none(&sc)) {
            kwn[nkw] = em_rw_kwname(&d, "scale");
            kv[nkw++] = em_rw_map_arg(&d, &sc);
        }
        if (!(gq.kind == IRARG_CONST && gq.u.obj == Py_False)) {
            kwn[nkw] = em_rw_kwname(&d, "enable_gqa");
            kv[nkw++] = em_rw_map_arg(&d, &gq);
        }
        for (uint32_t i = 0; i < nkw; i++)
            if (!kwn[i]) goto done;
        if (em_rw_arg_bad(&a[3]) || !(d.fmap[r] = em_rw_dz(&d, em_rw_emit(&d, n->kind, n->target, a, 6, kwn, kv, nkw))))
            goto done; /* (requires_grad as eager sets it: the meta call runs without autograd) */
        PyObject *nm = PyUnicode_FromFormat("%s: mask True everywhere, dropped", n->name);
        if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
        Py_XDECREF(nm);
    }
    if (d.reason) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyDict_SetItemString(ctx->info, "attention", names) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(names);
    free(rg);
    free(drop);
    em_rw_rewriter_free(&d);
    return out;
}
