/* pass attention: attention that a fused kernel can run. Hand-written attention,
 * softmax(q @ k^T * scale [+ mask]) @ v in its common spellings, becomes one
 * scaled_dot_product_attention call, as Inductor's attention patterns (fx_passes/fuse_attention.py);
 * an attention mask that is True everywhere by construction is dropped.
 * Invariant: a rewritten call computes what the original computes (the same attention, maybe by
 * another of torch's kernels: values within the dtype's tolerance). */
#include "passes/em_passes.h"

#include <math.h>
#include <stdio.h>
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
    if (!strncmp(s, "torch.nn.functional.", 20)) return s + 20;
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

/* ---------------------------------------------------------------- hand-written attention
 * o = matmul(p, v) where, each intermediate read by the next step only,
 *   p = softmax(t, -1 [, dtype]) [.to(q.dtype) | .type(v.dtype) | .type_as(x)] [dropout that is the identity]
 *   t = s [+ mask | mask +]  or  s.masked_fill(m, -inf)        (mask: q's dtype; m: bool)
 *   s = matmul(q', k'.transpose(-2, -1)) [* c | / c | c *]     (c: a number, or torch.full((), c))
 *   q' = q [* c],  k' = k [* c]
 * becomes scaled_dot_product_attention(q, k, v, mask or ~m, scale = the product of the c's), q, k,
 * v of one dtype and the same batch dims. transformers' eager_attention_forward (Llama, BERT, ViT
 * with attn_implementation="eager"), GPT-2's _attn and nanoGPT's hand-written attention are of
 * this form. Where fused attention runs, the (B, H, L, S) scores are never stored (at 8 x 12 x
 * 512 x 512 in bf16, 50 MB per layer written and read three times). Not rewritten: a dropout that
 * draws (its random stream is F.dropout's), a mask of another dtype (eager promotes the scores), a
 * mask that requires grad (MPNet's relative position bias), intermediates read elsewhere (attention
 * weights returned to the caller), symbolic sizes. A query row whose mask leaves no key is NaN, as
 * eager's softmax over -inf alone (the fused kernels give 0 there): emit_attention restores it. */

typedef struct {
    IRRef q, k, v, mask;   /* mask: 0 none */
    bool mask_negate;      /* mask is masked_fill's m: attend where it is False */
    double scale;
    IRRef absorbed[12];    /* the nodes the call replaces (each read only inside the pattern) */
    uint32_t nabsorbed;
} Attn;

/* Short op name of node r (NULL: not a call). ops: per-node cache (a borrowed C string or NULL). */
static const char *op_of(const IRGraph *g, IRRef r, PyObject **names) {
    const IRNode *n = em_ir_node(g, r);
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return NULL;
    if (!names[r]) {
        names[r] = em_rw_node_opname(n);
        if (!names[r]) {
            PyErr_Clear();
            return NULL;
        }
    }
    const char *s = PyUnicode_AsUTF8(names[r]);
    return s ? short_op(s) : (PyErr_Clear(), NULL);
}

/* A float or int constant (not a bool), or a 0-d torch.full((), c) node: its value. */
static bool number_of(const IRGraph *g, const IRArg *a, PyObject **names, double *v) {
    if (a->kind == IRARG_CONST && (PyFloat_Check(a->u.obj) || (PyLong_Check(a->u.obj) && !PyBool_Check(a->u.obj)))) {
        *v = PyFloat_AsDouble(a->u.obj);
        return !PyErr_Occurred() || (PyErr_Clear(), false);
    }
    if (a->kind != IRARG_NODE) return false;
    const char *op = op_of(g, a->u.ref, names);
    const IRNode *n = em_ir_node(g, a->u.ref);
    if (!op || strcmp(op, "full") || n->nargs < 2 || n->meta.kind != IRMETA_TENSOR || n->meta.ndim != 0) return false;
    return number_of(g, &n->args[1], names, v);
}

/* Does node r have exactly one use (in the whole graph, the output included)? */
static bool single_use(const uint32_t *uses, IRRef r) { return uses[r] == 1; }

static bool absorb(Attn *a, IRRef r) {
    if (a->nabsorbed == sizeof a->absorbed / sizeof a->absorbed[0]) return false;
    a->absorbed[a->nabsorbed++] = r;
    return true;
}

/* Is dim d (a constant, maybe negative) the last dim of an ndim-d tensor? */
static bool is_last_dim(const IRArg *d, int32_t ndim) {
    long long v;
    return arg_int(d, &v) && (v == -1 || v == ndim - 1);
}

/* A transpose of the last two dims of node k: k itself in *k. */
static bool last_two_swapped(const IRGraph *g, IRRef r, PyObject **names, IRRef *k) {
    const IRNode *n = em_ir_node(g, r);
    const char *op = op_of(g, r, names);
    if (!op || n->nargs < 1 || n->args[0].kind != IRARG_NODE || n->nkwargs) return false;
    int32_t nd = n->meta.ndim;
    long long a, b;
    if (!strcmp(op, "transpose") && n->nargs == 3 && arg_int(&n->args[1], &a) && arg_int(&n->args[2], &b)) {
        a = a < 0 ? a + nd : a;
        b = b < 0 ? b + nd : b;
        *k = n->args[0].u.ref;
        return nd >= 2 && ((a == nd - 2 && b == nd - 1) || (a == nd - 1 && b == nd - 2));
    }
    if (!strcmp(op, "permute") && n->nargs >= 2) {
        const IRArg *p = n->nargs == 2 && (n->args[1].kind == IRARG_TUPLE || n->args[1].kind == IRARG_LIST) ? n->args[1].u.items : &n->args[1];
        uint32_t np = n->nargs == 2 && (n->args[1].kind == IRARG_TUPLE || n->args[1].kind == IRARG_LIST) ? n->args[1].n : n->nargs - 1;
        if ((int32_t)np != nd || nd < 2) return false;
        for (int32_t i = 0; i < nd; i++) {
            long long v;
            if (!arg_int(&p[i], &v)) return false;
            v = v < 0 ? v + nd : v;
            if (v != (i == nd - 2 ? nd - 1 : i == nd - 1 ? nd - 2 : i)) return false;
        }
        *k = n->args[0].u.ref;
        return true;
    }
    return false;
}

/* x * c or c * x (c a number): x in *x, c multiplied into *scale. div: x / c. */
static bool scaled(const IRGraph *g, IRRef r, PyObject **names, IRRef *x, double *scale) {
    const IRNode *n = em_ir_node(g, r);
    const char *op = op_of(g, r, names);
    double c;
    if (!op || n->nargs != 2 || n->nkwargs) return false;
    if (!strcmp(op, "mul")) {
        for (int i = 0; i < 2; i++)
            if (n->args[i].kind == IRARG_NODE && number_of(g, &n->args[1 - i], names, &c) &&
                em_ir_node(g, n->args[i].u.ref)->meta.kind == IRMETA_TENSOR &&
                em_ir_node(g, n->args[i].u.ref)->meta.ndim >= 2) {
                *x = n->args[i].u.ref;
                *scale *= c;
                return true;
            }
        return false;
    }
    if ((!strcmp(op, "truediv") || !strcmp(op, "div")) && n->args[0].kind == IRARG_NODE &&
        number_of(g, &n->args[1], names, &c) && c != 0.0) {
        *x = n->args[0].u.ref;
        *scale /= c;
        return true;
    }
    return false;
}

static bool is_neg_inf(const IRArg *a) {
    if (a->kind != IRARG_CONST || !PyFloat_Check(a->u.obj)) return false;
    double v = PyFloat_AsDouble(a->u.obj);
    return v < 0 && v * 0.5 == v; /* -inf */
}

/* Does node o = matmul(p, v) end a hand-written attention (above)? Fills *a. */
static bool match_attention(const IRGraph *g, IRRef o, PyObject **names, const uint32_t *uses, Attn *a) {
    memset(a, 0, sizeof *a);
    a->scale = 1.0;
    const IRNode *on = em_ir_node(g, o);
    const char *op = op_of(g, o, names);
    if (!op || (strcmp(op, "matmul") && strcmp(op, "bmm")) || on->nargs != 2 || on->nkwargs || on->args[0].kind != IRARG_NODE ||
        on->args[1].kind != IRARG_NODE)
        return false;
    IRRef x = on->args[0].u.ref;
    a->v = on->args[1].u.ref;
    /* p: casts back and identity dropouts, then the softmax */
    for (int steps = 0; steps < 3; steps++) {
        const IRNode *n = em_ir_node(g, x);
        const char *xo = op_of(g, x, names);
        if (!xo || !single_use(uses, x) || n->nargs < 1 || n->args[0].kind != IRARG_NODE) return false;
        if (!strcmp(xo, "softmax")) break;
        bool ok = false;
        if (!strcmp(xo, "to") || !strcmp(xo, "type_as") || !strcmp(xo, "type")) ok = n->nargs == 2 && n->nkwargs == 0;
        else if (!strcmp(xo, "dropout")) {
            const IRArg *pa = n->nargs > 1 ? &n->args[1] : NULL, *ta = n->nargs > 2 ? &n->args[2] : NULL;
            for (uint32_t i = 0; i < n->nkwargs; i++) {
                const char *kw = PyUnicode_AsUTF8(n->kwnames[i]);
                if (kw && !strcmp(kw, "p")) pa = &n->kwargs[i];
                else if (kw && !strcmp(kw, "training")) ta = &n->kwargs[i];
            }
            double pv = 0.5;
            ok = (ta && ta->kind == IRARG_CONST && ta->u.obj == Py_False) || (pa && number_of(g, pa, names, &pv) && pv == 0.0);
        }
        if (!ok || !absorb(a, x)) return false;
        x = n->args[0].u.ref;
    }
    const IRNode *sm = em_ir_node(g, x);
    const char *xo = op_of(g, x, names);
    if (!xo || strcmp(xo, "softmax") || !single_use(uses, x) || !absorb(a, x) || sm->args[0].kind != IRARG_NODE) return false;
    const IRArg *dim = sm->nargs > 1 ? &sm->args[1] : NULL;
    for (uint32_t i = 0; i < sm->nkwargs; i++) {
        const char *kw = PyUnicode_AsUTF8(sm->kwnames[i]);
        if (kw && !strcmp(kw, "dim")) dim = &sm->kwargs[i];
        else if (!kw || strcmp(kw, "dtype")) return PyErr_Clear(), false;
    }
    if (!dim || !is_last_dim(dim, sm->meta.ndim) || sm->nargs > 3) return false;
    /* t: the mask */
    IRRef t = sm->args[0].u.ref, sref = t;
    const IRNode *tn = em_ir_node(g, t);
    const char *to = op_of(g, t, names);
    if (to && single_use(uses, t) && tn->nargs == 2 && tn->nkwargs == 0 && !strcmp(to, "add") &&
        tn->args[0].kind == IRARG_NODE && tn->args[1].kind == IRARG_NODE) {
        int si = -1; /* which operand is the scores: the one made by the chain below */
        for (int i = 0; i < 2 && si < 0; i++) {
            IRRef c = tn->args[i].u.ref, inner;
            double sc = 1.0;
            const char *co = op_of(g, c, names);
            if (co && (!strcmp(co, "matmul") || !strcmp(co, "bmm") || scaled(g, c, names, &inner, &sc))) si = i;
        }
        if (si < 0) return false;
        sref = tn->args[si].u.ref;
        a->mask = tn->args[1 - si].u.ref;
        if (!absorb(a, t)) return false;
    } else if (to && single_use(uses, t) && !strcmp(to, "masked_fill") && tn->nargs == 3 && tn->nkwargs == 0 &&
               tn->args[0].kind == IRARG_NODE && tn->args[1].kind == IRARG_NODE && is_neg_inf(&tn->args[2])) {
        sref = tn->args[0].u.ref;
        a->mask = tn->args[1].u.ref;
        a->mask_negate = true;
        if (!absorb(a, t) || !em_rw_meta_dtype_is(&em_ir_node(g, a->mask)->meta, "torch.bool")) return false;
    }
    /* s: the scale on the scores, then q @ k^T */
    IRRef inner;
    if (single_use(uses, sref) && scaled(g, sref, names, &inner, &a->scale)) {
        if (!absorb(a, sref)) return false;
        sref = inner;
    }
    const IRNode *mm = em_ir_node(g, sref);
    const char *mo = op_of(g, sref, names);
    if (!mo || (strcmp(mo, "matmul") && strcmp(mo, "bmm")) || !single_use(uses, sref) || mm->nargs != 2 || mm->nkwargs ||
        mm->args[0].kind != IRARG_NODE || mm->args[1].kind != IRARG_NODE || !absorb(a, sref))
        return false;
    a->q = mm->args[0].u.ref;
    IRRef kt = mm->args[1].u.ref;
    if (single_use(uses, a->q) && scaled(g, a->q, names, &inner, &a->scale)) {
        if (!absorb(a, a->q)) return false;
        a->q = inner;
    }
    if (!single_use(uses, kt) || !last_two_swapped(g, kt, names, &a->k) || !absorb(a, kt)) return false;
    if (single_use(uses, a->k) && scaled(g, a->k, names, &inner, &a->scale)) {
        if (!absorb(a, a->k)) return false;
        a->k = inner;
    }
    /* q, k, v of one dtype, the same batch dims, k and q of one head size; o in q's dtype */
    const IRMeta *qm = &em_ir_node(g, a->q)->meta, *km = &em_ir_node(g, a->k)->meta, *vm = &em_ir_node(g, a->v)->meta;
    if (qm->kind != IRMETA_TENSOR || km->kind != IRMETA_TENSOR || vm->kind != IRMETA_TENSOR || qm->ndim < 3 ||
        km->ndim != qm->ndim || vm->ndim != qm->ndim || qm->dtype != km->dtype || qm->dtype != vm->dtype ||
        on->meta.kind != IRMETA_TENSOR || on->meta.dtype != qm->dtype || !em_rw_dtype_differentiable(qm->dtype))
        return false;
    int32_t nd = qm->ndim;
    for (int32_t i = 0; i < nd - 2; i++)
        if (qm->sizes[i] != km->sizes[i] || qm->sizes[i] != vm->sizes[i]) return false;
    if (qm->sizes[nd - 1] != km->sizes[nd - 1] || km->sizes[nd - 2] != vm->sizes[nd - 2]) return false;
    if (a->mask && !a->mask_negate && em_ir_node(g, a->mask)->meta.dtype != qm->dtype) return false;
    if (a->mask && em_ir_node(g, a->mask)->meta.requires_grad) return false; /* (a learned bias: SDPA's rule has no mask gradient) */
    return true;
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

/* uses[r]: how many arguments of g's nodes (the output's included) name node r. */
static void count_uses(const IRArg *args, uint32_t n, uint32_t *uses) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_NODE) uses[args[i].u.ref]++;
        else if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST) count_uses(args[i].u.items, args[i].n, uses);
    }
}

/* The scaled_dot_product_attention call a hand-written attention (at) becomes, in d's graph. */
static IRRef emit_attention(Rewrite *d, const Attn *at) {
    IRRef mask = at->mask ? d->fmap[at->mask] : 0;
    if (at->mask && at->mask_negate) {
        IRArg na[1] = {em_rw_arg_node(mask)};
        mask = em_rw_dz(d, em_rw_emit_method(d, "logical_not", na, 1));
        if (!mask) return 0;
    }
    IRArg a[6] = {em_rw_arg_node(d->fmap[at->q]), em_rw_arg_node(d->fmap[at->k]), em_rw_arg_node(d->fmap[at->v]),
                  mask ? em_rw_arg_node(mask) : em_rw_arg_const_steal(d, Py_NewRef(Py_None)),
                  em_rw_arg_const_steal(d, PyFloat_FromDouble(0.0)), em_rw_arg_const_steal(d, Py_NewRef(Py_False))};
    IRArg sc = em_rw_arg_const_steal(d, PyFloat_FromDouble(at->scale));
    PyObject *kwn[1] = {em_rw_kwname(d, "scale")};
    PyObject *t = em_rw_torch_attr("nn.functional.scaled_dot_product_attention");
    if (!t || !em_arena_hold_steal(d->a, t) || !kwn[0] || em_rw_arg_bad(&sc) || em_rw_arg_bad(&a[3]) || em_rw_arg_bad(&a[4]) ||
        em_rw_arg_bad(&a[5]))
        return em_rw_fail_exc(d), 0;
    IRRef o = em_rw_dz(d, em_rw_emit(d, IR_CALL_FUNCTION, t, a, 6, kwn, &sc, 1));
    if (!o || !at->mask) return o;
    /* a query row masked everywhere: eager's softmax over -inf alone is NaN, SDPA's kernels give 0
     * (_safe_softmax); the rows where the mask leaves no key (masked_fill's m True everywhere, an
     * additive mask -inf everywhere) are NaN again, as eager's */
    IRArg ma = em_rw_arg_node(d->fmap[at->mask]), ninf = em_rw_arg_const_steal(d, PyFloat_FromDouble(-INFINITY));
    IRRef all_masked = at->mask_negate ? d->fmap[at->mask] : em_rw_dz(d, em_rw_emit_op(d, "eq", ma, ninf, 2));
    IRArg aa[3] = {em_rw_arg_node(all_masked), em_rw_arg_const_steal(d, PyLong_FromLong(-1)), em_rw_arg_const_steal(d, Py_NewRef(Py_True))};
    IRRef full = all_masked && !em_rw_arg_bad(&aa[1]) ? em_rw_dz(d, em_rw_emit_method(d, "all", aa, 3)) : 0;
    IRArg fa[3] = {em_rw_arg_node(o), em_rw_arg_node(full), em_rw_arg_const_steal(d, PyFloat_FromDouble(NAN))};
    return full && !em_rw_arg_bad(&fa[2]) ? em_rw_dz(d, em_rw_emit_method(d, "masked_fill", fa, 3)) : 0;
}

/* g with its hand-written attentions as scaled_dot_product_attention calls and the masks of its
 * attention calls dropped where droppable_mask says so; info["attention"] says what was done to
 * which node. NULL when there is nothing to do or the rewrite failed. */
IRGraph *em_pass_attention(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.inference = ctx->when == EM_PASSES_INFERENCE};
    uint32_t G = g->nnodes;
    Range *rg = calloc(G, sizeof(Range));
    uint8_t *drop = calloc(G, 1), *gone = calloc(G, 1);
    uint32_t *uses = calloc(G, sizeof(uint32_t));
    PyObject **names = calloc(G, sizeof(PyObject *));
    Attn *at = calloc(G, sizeof(Attn));
    PyObject *done_list = PyList_New(0);
    IRGraph *out = NULL;
    bool any = false;
    if (!rg || !drop || !gone || !uses || !names || !at || !done_list) goto done;
    d.a = g->arena;
    d.g = g;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        count_uses(n->args, n->nargs, uses);
        count_uses(n->kwargs, n->nkwargs, uses);
    }
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        rg[r] = node_range(em_ir_node(g, r), rg);
        drop[r] = droppable_mask(&d, r, rg, &b);
        if (!drop[r] && !d.env && match_attention(g, r, names, uses, &at[r]) &&
            (!at[r].mask || em_rw_sdpa_mask_broadcasts(&d, &em_ir_node(g, at[r].q)->meta, &em_ir_node(g, at[r].k)->meta,
                                                       &em_ir_node(g, at[r].mask)->meta))) {
            drop[r] = 2;
            for (uint32_t i = 0; i < at[r].nabsorbed; i++) gone[at[r].absorbed[i]] = 1;
        }
        any |= drop[r] != 0;
    }
    if (!any || em_rw_rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (gone[r]) continue; /* replaced by the attention call that ends its pattern */
        if (!drop[r]) {
            if (!(d.fmap[r] = em_rw_copy_node(&d, n))) goto done;
            continue;
        }
        PyObject *what = NULL;
        if (drop[r] == 2) {
            if (!(d.fmap[r] = emit_attention(&d, &at[r]))) goto done;
            char sc[32];
            snprintf(sc, sizeof sc, "%.6g", at[r].scale);
            what = PyUnicode_FromFormat("%s: softmax(q @ k^T%s) @ v as scaled_dot_product_attention (scale %s)", n->name,
                                        !at[r].mask ? "" : at[r].mask_negate ? ", masked_fill" : " + mask", sc);
        } else {
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
            what = PyUnicode_FromFormat("%s: mask True everywhere, dropped", n->name);
        }
        if (!what || PyList_Append(done_list, what) < 0) PyErr_Clear();
        Py_XDECREF(what);
    }
    if (d.reason) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && em_ir_dce(out, NULL) < 0) out = NULL; /* the mask's ops, a divisor's torch.full */
    if (out && PyDict_SetItemString(ctx->info, "attention", done_list) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(done_list);
    for (uint32_t r = 0; names && r < G; r++) Py_XDECREF(names[r]);
    free(names);
    free(rg);
    free(drop);
    free(gone);
    free(uses);
    free(at);
    em_rw_rewriter_free(&d);
    return out;
}
