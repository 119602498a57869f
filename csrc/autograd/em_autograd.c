/* autograd: the joint forward+backward graph and its min-cut partition (DESIGN.md stage `autograd`).
 * Invariant: a region gets a compiled backward only when every node that needs a gradient has a
 * rule (em_autograd_rules.h) whose formulas cover every argument that requires grad; anything else
 * (no rule, in-place updates of values autograd would need, grad-mode changes) keeps torch's eager
 * autograd for the whole region, with the reason in cache_info()["autograd"]["fallback"].
 *
 * Pipeline (as torch's AOTAutograd + Inductor's min_cut_rematerialization_partition):
 *   1. joint graph: primals, tangents, the forward nodes (layer_norm / batch_norm / dropout are
 *      rewritten to the native ops that return what their backward needs), then for each node in
 *      reverse order the backward nodes its rule emits, gradients accumulated per value;
 *   2. min-cut over the forward nodes (each value split into in -> out with its size in bytes;
 *      ops that are not cheap or not deterministic are tied to the source): the cut is the set of
 *      saved tensors; forward values on the sink side that the backward needs are recomputed;
 *   3. forward graph (primals -> outputs + saved) and backward graph (saved + tangents ->
 *      gradients of the inputs that require grad), each an ember._C.EagerGraph, wrapped by
 *      ember._autograd.make_region in a torch.autograd.Function. */
#include "autograd/em_autograd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lower/em_lower.h"
#include "runtime/em_runtime.h"
#include "sym/em_sym.h"
#include "autograd/em_autograd_rules.h"

#define MAXP 32
#define INF_CAP ((int64_t)1 << 50)

enum { ROLE_PRIMAL = 1, ROLE_TANGENT, ROLE_FWD, ROLE_BWD };

typedef struct {
    char name[40];
    const char *dflt; /* default literal, NULL: required */
    bool kwonly, varargs;
} Param;

typedef struct {
    const Rule *rule;
    int np;
    Param p[MAXP];
    IRArg val[MAXP];
} Bind;

typedef struct {
    EmArena *a;
    const IRGraph *g;
    IRGraph *j;
    IRRef *fmap;      /* g ref -> joint ref of the value */
    IRRef (*aux)[5];  /* g ref -> joint refs a rewrite made for the backward (mean, rstd, mask ...; fused
                       * attention: [3] the kernel's output when the value is a relaid copy of it,
                       * [4] the attention mask as the fused kernel reads it) */
    IRRef *grad;      /* g ref -> joint ref of its accumulated gradient, 0: none */
    struct Pieces { IRRef *part; int64_t n; } *pieces; /* g ref -> gradients of x[0] .. x[n-1] (int
                       * getitems) not yet stacked into x's gradient (finalize_grad); for a tuple
                       * of split / chunk / unbind, its pieces' gradients (SP_SPLIT) */
    IRRef *scatter;   /* g ref -> its gradient while it is a zeros buffer that getitem gradients
                       * add into slice by slice (x[0], x[1], x[2] of one tensor), 0: none */
    uint8_t *role;    /* joint ref -> ROLE_* */
    uint8_t *pinned;  /* joint ref -> 1: the partitioner must not recompute it */
    uint32_t rcap;
    PyObject *reason; /* why the region keeps eager autograd; NULL while fine */
    IRRef cur;        /* the g node whose rule runs */
    uint8_t cur_role;
    bool cur_pinned;
    bool ember_halves; /* compile both halves with backend "ember" (em_ember_compile) */
    /* dropout with Philox random numbers (ember_halves, ember.config.fallback_random False): one
     * ember._C.philox_seeds node draws a seed per dropout of the graph (nphilox of them); philox[r]
     * is 1 + the seed's index for dropout node r of g, 0 for others */
    uint32_t nphilox, nphilox_used, *philox;
    IRRef seeds;
    bool inference;    /* decompose_attention of an inference graph: every node, grad or not */
    bool meta_memo;    /* node metas through the meta-call memo (ember.config.meta_memo) */
    /* symbolic sizes (a graph automatic dynamic or dynamic=True made symbolic; "Symbolic sizes"
     * below): g's ShapeEnv, NULL for a static graph */
    struct ShapeEnv *env;
    PyObject *symctx;  /* ember._fake.SymContext of this compilation, made on first use */
    PyObject *symhints; /* the symbols' hints as sym_run takes them */
    PyObject *sizes;   /* (joint ref, dim) -> the joint ref of its aten.sym_size.int node */
    bool sym_fail;     /* the reason is the sizes being symbolic (ag_fail_sym) */
    /* absent output gradients ("Absent tangents" below): flag[k] is the joint ref of output k's
     * flag placeholder (0-d bool, True when its gradient is given), 0 for all when the region has
     * fewer than two tangents; tangent[k] its tangent; deps[r] the tangents joint value r is
     * computed from (bit k: output k), known for refs below ndeps; flag_or memoizes the logical_or
     * of several outputs' flags */
    IRRef *flag, *tangent;
    uint32_t nouts, ndeps, depcap, nor;
    uint64_t *deps;
    struct { uint64_t set; IRRef ref; } flag_or[32];
    /* the where(flag, x, 0) nodes absent_zero made (gate[i]: its joint ref, gate_set[i]: the outputs
     * whose flags it reads), for saved_needs */
    IRRef *gate;
    uint64_t *gate_set;
    uint32_t ngates, gatecap;
} AG;

/* ---------------------------------------------------------------- small helpers */

static int ag_fail(AG *ag, const char *fmt, ...) {
    if (!ag->reason) {
        va_list va;
        va_start(va, fmt);
        ag->reason = PyUnicode_FromFormatV(fmt, va);
        va_end(va);
        if (!ag->reason) PyErr_Clear();
    }
    return -1;
}

/* ag_fail for a reason that is the sizes being symbolic ("symbolic sizes: ..."): a trace per size
 * may compile the region (fallback_result says so to the hook: "per_size"). */
static int ag_fail_sym(AG *ag, const char *fmt, ...) {
    if (!ag->reason) {
        va_list va;
        va_start(va, fmt);
        PyObject *m = PyUnicode_FromFormatV(fmt, va);
        va_end(va);
        ag->reason = m ? PyUnicode_FromFormat("symbolic sizes: %U", m) : NULL;
        Py_XDECREF(m);
        if (!ag->reason) PyErr_Clear();
    }
    ag->sym_fail = true;
    return -1;
}

/* Turns a pending Python exception (a failed meta call while emitting) into the fallback reason. */
static int ag_fail_exc(AG *ag) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    const IRNode *n = ag->cur ? em_ir_node(ag->g, ag->cur) : NULL;
    if (!ag->reason)
        ag->reason = PyUnicode_FromFormat("derivative of %s failed: %S", n ? n->name : "?", v ? v : Py_None);
    ag->sym_fail |= ag->env != NULL; /* (a fake run with symbolic sizes, say: a trace per size may not fail) */
    if (!ag->reason) PyErr_Clear();
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return -1;
}

static IRArg arg_node(IRRef r) {
    IRArg a = {0};
    a.kind = IRARG_NODE;
    a.u.ref = r;
    return a;
}

/* A constant argument; steals obj (held by the arena). kind IRARG_NODE with ref 0 on failure. */
static IRArg arg_const_steal(AG *ag, PyObject *obj) {
    IRArg a = {0};
    a.kind = IRARG_CONST;
    a.u.obj = obj ? em_arena_hold_steal(ag->a, obj) : NULL;
    if (!a.u.obj) {
        a.kind = IRARG_NODE;
        a.u.ref = 0;
    }
    return a;
}

static bool arg_bad(const IRArg *a) { return a->kind == IRARG_NODE && a->u.ref == 0; }
static bool arg_is_none(const IRArg *a) { return a->kind == IRARG_CONST && a->u.obj == Py_None; }

static bool meta_needs_grad(const IRMeta *m) {
    if (m->kind == IRMETA_TENSOR) return m->requires_grad;
    if (m->kind == IRMETA_TUPLE)
        for (uint32_t i = 0; i < m->nitems; i++)
            if (meta_needs_grad(&m->items[i])) return true;
    return false;
}

static int64_t meta_bytes(const IRMeta *m) {
    if (m->kind != IRMETA_TENSOR) return -1;
    int64_t numel = 1;
    for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
    PyObject *isz = PyObject_GetAttrString(m->dtype, "itemsize");
    long item = isz ? PyLong_AsLong(isz) : 4;
    Py_XDECREF(isz);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        item = 4;
    }
    return numel * item;
}

static int ag_grow_roles(AG *ag) {
    if (ag->j->nnodes <= ag->rcap) return 0;
    uint32_t cap = ag->j->nnodes * 2 + 16;
    uint8_t *r = realloc(ag->role, cap), *p = realloc(ag->pinned, cap);
    if (r) ag->role = r;
    if (p) ag->pinned = p;
    if (!r || !p) return -1;
    memset(ag->role + ag->rcap, 0, cap - ag->rcap);
    memset(ag->pinned + ag->rcap, 0, cap - ag->rcap);
    ag->rcap = cap;
    return 0;
}

/* The name rules use for a node: "Tensor.m" for call_method m, else the target's qualified name. */
static PyObject *node_opname(const IRNode *n) {
    if (n->kind == IR_CALL_METHOD) return PyUnicode_FromFormat("Tensor.%U", n->target);
    return em_ir_target_qualname(n->target);
}

static bool names_has(const char *names, const char *s) {
    size_t len = strlen(s);
    for (const char *p = names; *p;) {
        while (*p == ' ') p++;
        const char *e = p;
        while (*e && *e != ' ') e++;
        if ((size_t)(e - p) == len && memcmp(p, s, len) == 0) return true;
        p = e;
    }
    return false;
}

/* Is n's op one of names (space-separated qualified names, as node_opname writes them)? */
static bool node_named(const IRNode *n, const char *names) {
    PyObject *qn = node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool r = s && names_has(names, s);
    Py_XDECREF(qn);
    PyErr_Clear();
    return r;
}

/* ---------------------------------------------------------------- signatures and binding */

static int parse_sig(const char *sig, Param *out) {
    int np = 0;
    bool kwonly = false;
    const char *p = sig;
    while (*p && np < MAXP) {
        while (*p == ' ' || *p == ',') p++;
        if (!*p) break;
        if (*p == '*' && (p[1] == ',' || p[1] == '\0')) {
            kwonly = true;
            p++;
            continue;
        }
        Param *q = &out[np];
        memset(q, 0, sizeof *q);
        if (*p == '*') {
            q->varargs = true;
            p++;
        }
        size_t k = 0;
        while (*p && *p != ',' && *p != '=' && *p != ' ' && k + 1 < sizeof q->name) q->name[k++] = *p++;
        q->name[k] = '\0';
        q->kwonly = kwonly;
        if (q->varargs) kwonly = true;
        while (*p == ' ') p++;
        if (*p == '=') {
            q->dflt = ++p; /* up to the next top-level comma */
            int depth = 0;
            while (*p && (depth || *p != ',')) {
                if (*p == '(') depth++;
                if (*p == ')') depth--;
                p++;
            }
        }
        np++;
    }
    return np;
}

/* A default literal ("None", "True", "1", "1e-05", "'none'", "()", "inf") as a new object. */
static PyObject *literal(const char *s, size_t n) {
    while (n && s[n - 1] == ' ') n--;
    if (n == 4 && !memcmp(s, "None", 4)) return Py_NewRef(Py_None);
    if (n == 4 && !memcmp(s, "True", 4)) return Py_NewRef(Py_True);
    if (n == 5 && !memcmp(s, "False", 5)) return Py_NewRef(Py_False);
    if (n == 2 && !memcmp(s, "()", 2)) return PyTuple_New(0);
    if (n == 3 && !memcmp(s, "inf", 3)) return PyFloat_FromDouble(INFINITY);
    if (n == 4 && !memcmp(s, "-inf", 4)) return PyFloat_FromDouble(-INFINITY);
    if (n >= 2 && s[0] == '\'') return PyUnicode_FromStringAndSize(s + 1, (Py_ssize_t)n - 2);
    char buf[64];
    if (n >= sizeof buf) n = sizeof buf - 1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    bool isfloat = strpbrk(buf, ".eE") != NULL;
    return isfloat ? PyFloat_FromDouble(strtod(buf, NULL)) : PyLong_FromLongLong(strtoll(buf, NULL, 10));
}

static size_t dflt_len(const char *d) {
    size_t n = 0;
    int depth = 0;
    while (d[n] && (depth || d[n] != ',')) {
        if (d[n] == '(') depth++;
        if (d[n] == ')') depth--;
        n++;
    }
    return n;
}

static int find_param(const Bind *b, const char *name) {
    for (int i = 0; i < b->np; i++)
        if (strcmp(b->p[i].name, name) == 0) return i;
    if (b->np && (strcmp(name, "input") == 0 || strcmp(name, "self") == 0) &&
        (strcmp(b->p[0].name, "self") == 0 || strcmp(b->p[0].name, "input") == 0))
        return 0;
    return -1;
}

/* Binds the node's arguments to the rule's signature. -1: they do not fit (no exception). */
static int bind_args(AG *ag, const Rule *r, const IRNode *n, Bind *b) {
    b->rule = r;
    b->np = parse_sig(r->sig, b->p);
    bool set[MAXP] = {0};
    uint32_t ia = 0;
    for (int i = 0; i < b->np && ia < n->nargs; i++) {
        if (b->p[i].kwonly) break;
        if (b->p[i].varargs) {
            uint32_t rest = n->nargs - ia;
            if (rest == 1 && (n->args[ia].kind == IRARG_TUPLE || n->args[ia].kind == IRARG_LIST ||
                              (n->args[ia].kind == IRARG_CONST &&
                               (PyTuple_Check(n->args[ia].u.obj) || PyList_Check(n->args[ia].u.obj))))) {
                b->val[i] = n->args[ia];
            } else {
                IRArg t = {0};
                t.kind = IRARG_TUPLE;
                t.n = rest;
                t.u.items = n->args + ia;
                b->val[i] = t;
            }
            set[i] = true;
            ia = n->nargs;
            break;
        }
        b->val[i] = n->args[ia++];
        set[i] = true;
    }
    if (ia < n->nargs) return -1;
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kn = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kn) {
            PyErr_Clear();
            return -1;
        }
        int i = find_param(b, kn);
        if (i < 0 || set[i] || b->p[i].varargs) return -1;
        b->val[i] = n->kwargs[k];
        set[i] = true;
    }
    for (int i = 0; i < b->np; i++) {
        if (set[i]) continue;
        if (b->p[i].varargs) {
            b->val[i] = arg_const_steal(ag, PyTuple_New(0));
        } else {
            if (!b->p[i].dflt) return -1;
            b->val[i] = arg_const_steal(ag, literal(b->p[i].dflt, dflt_len(b->p[i].dflt)));
        }
        if (arg_bad(&b->val[i])) {
            PyErr_Clear();
            return -1;
        }
    }
    return 0;
}

static const IRMeta *val_meta(const AG *ag, const IRArg *v) {
    return v->kind == IRARG_NODE ? &em_ir_node(ag->g, v->u.ref)->meta : NULL;
}

/* ---------------------------------------------------------------- which attention kernel eager runs */

enum { SDPA_UNSUPPORTED = -1, SDPA_MATH = 0, SDPA_FLASH_CPU, SDPA_FLASH_CUDA, SDPA_EFFICIENT };

static bool meta_on_cuda(const IRMeta *m) {
    PyObject *t = m->device ? PyObject_GetAttrString(m->device, "type") : NULL;
    bool r = t && PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "cuda") == 0;
    Py_XDECREF(t);
    PyErr_Clear();
    return r;
}

static bool meta_dtype_is(const IRMeta *m, const char *name) {
    PyObject *s = m->kind == IRMETA_TENSOR && m->dtype ? PyObject_Str(m->dtype) : NULL;
    bool r = s && PyUnicode_CompareWithASCIIString(s, name) == 0;
    Py_XDECREF(s);
    PyErr_Clear();
    return r;
}

/* The kernel eager's F.scaled_dot_product_attention runs for these arguments (asked of torch's own
 * choice, ember._autograd.sdpa_backend) and whether ember can take its derivative:
 *   SDPA_MATH        the composite math kernel: decomposed before the joint graph (float32/64);
 *   SDPA_FLASH_CPU   _scaled_dot_product_flash_attention_for_cpu (+ its backward op), a bool mask
 *                    converted as eager converts it (sdpa_float_mask);
 *   SDPA_FLASH_CUDA  _scaled_dot_product_flash_attention, no mask, head dim a multiple of 8 (eager
 *                    pads other head dims, which this rule does not reproduce);
 *   SDPA_EFFICIENT   _scaled_dot_product_efficient_attention, a mask prepared as eager prepares
 *                    it (float, padded to 16-element alignment, expanded: sdpa_efficient_mask);
 * anything else (cuDNN, a mask that requires grad, GQA, non-constant flags): SDPA_UNSUPPORTED, and
 * the op keeps eager autograd. Masks are only read, never differentiated here. */
static int sdpa_kind(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, const IRArg *dropout_p,
                     const IRArg *is_causal, const IRArg *scale, const IRArg *gqa) {
    static PyObject *choose = NULL; /* one interpreter (em_lazy_attr) */
    if (!q || !k || !v || q->kind != IRMETA_TENSOR || k->kind != IRMETA_TENSOR || v->kind != IRMETA_TENSOR)
        return SDPA_UNSUPPORTED;
    if (mask && (mask->kind != IRMETA_TENSOR || mask->requires_grad)) return SDPA_UNSUPPORTED;
    if (dropout_p->kind != IRARG_CONST || is_causal->kind != IRARG_CONST || scale->kind != IRARG_CONST ||
        gqa->kind != IRARG_CONST || gqa->u.obj != Py_False || !PyBool_Check(is_causal->u.obj))
        return SDPA_UNSUPPORTED;
    if (!q->example || !k->example || !v->example || (mask && !mask->example) || q->ndim < 2) return SDPA_UNSUPPORTED;
    PyObject *rg = Py_BuildValue("(OOO)", q->requires_grad ? Py_True : Py_False, k->requires_grad ? Py_True : Py_False,
                                 v->requires_grad ? Py_True : Py_False);
    PyObject *res = NULL;
    if (rg && em_lazy_attr(&choose, "ember._autograd", "sdpa_backend"))
        res = PyObject_CallFunction(choose, "OOOOOOOOOO", q->example, k->example, v->example,
                                    mask ? mask->example : Py_None, dropout_p->u.obj, is_causal->u.obj, scale->u.obj,
                                    gqa->u.obj, q->device, rg);
    Py_XDECREF(rg);
    const char *c = res && PyUnicode_Check(res) ? PyUnicode_AsUTF8(res) : NULL;
    int kind = SDPA_UNSUPPORTED;
    bool cuda = meta_on_cuda(q);
    int64_t hd = q->sizes[q->ndim - 1];
    bool fp = meta_dtype_is(q, "torch.float32") || meta_dtype_is(q, "torch.float64");
    if (c && !strcmp(c, "math") && fp) kind = SDPA_MATH;
    else if (c && !strcmp(c, "flash") && !cuda) kind = SDPA_FLASH_CPU; /* a bool mask: sdpa_float_mask */
    else if (c && !strcmp(c, "flash") && cuda && !mask && hd % 8 == 0) kind = SDPA_FLASH_CUDA;
    else if (c && !strcmp(c, "efficient") && cuda && (!mask || (q->ndim == 4 && k->ndim == 4)))
        kind = SDPA_EFFICIENT; /* a mask: sdpa_efficient_mask expands it to (B, H, L, S) */
    Py_XDECREF(res);
    PyErr_Clear();
    return kind;
}

static IRArg bval(const Bind *b, const char *name);

/* sdpa_kind of a bound g-level scaled_dot_product_attention node. */
static int sdpa_kind_bound(const AG *ag, const Bind *b) {
    IRArg q = bval(b, "query"), k = bval(b, "key"), v = bval(b, "value"), m = bval(b, "attn_mask");
    IRArg dp = bval(b, "dropout_p"), ic = bval(b, "is_causal"), sc = bval(b, "scale"), gq = bval(b, "enable_gqa");
    if (m.kind != IRARG_NODE && !arg_is_none(&m)) return SDPA_UNSUPPORTED;
    return sdpa_kind(val_meta(ag, &q), val_meta(ag, &k), val_meta(ag, &v), m.kind == IRARG_NODE ? val_meta(ag, &m) : NULL,
                     &dp, &ic, &sc, &gq);
}

/* Checks of a rule against the bound g-node arguments (see em_autograd_rules.h). */
static PyObject *torch_attr(const char *dotted);

/* torch.<name> for a dtype (borrowed: dtypes live as long as torch). */
static PyObject *torch_dtype(const char *name) {
    PyObject *d = torch_attr(name);
    Py_XDECREF(d);
    PyErr_Clear();
    return d;
}

/* An einsum equation split into its input terms and output (einsum_parse). */
typedef struct {
    char term[8][64];
    char out[64];
    uint32_t nt;
} EinsumEq;
static int einsum_parse(const char *eq, uint32_t nops, EinsumEq *q);

static bool checks_pass(const AG *ag, const Bind *b) {
    const char *p = b->rule->checks;
    while (*p) {
        while (*p == ' ') p++;
        if (!*p) break;
        const char *colon = strchr(p, ':');
        if (!colon) return false;
        const char *e = colon + 1;
        while (*e && *e != ' ') e++;
        char kind[16], name[40];
        size_t kl = (size_t)(colon - p), nl = (size_t)(e - colon - 1);
        if (kl >= sizeof kind || nl >= sizeof name) return false;
        memcpy(kind, p, kl);
        kind[kl] = '\0';
        memcpy(name, colon + 1, nl);
        name[nl] = '\0';
        p = e;
        int i = find_param(b, name);
        if (i < 0) return false;
        const IRArg *v = &b->val[i];
        bool ok;
        if (!strcmp(kind, "null")) ok = arg_is_none(v);
        else if (!strcmp(kind, "notnull")) ok = !arg_is_none(v);
        else if (!strcmp(kind, "false")) ok = arg_is_none(v) || (v->kind == IRARG_CONST && v->u.obj == Py_False);
        else if (!strcmp(kind, "const")) ok = v->kind == IRARG_CONST && (PyLong_Check(v->u.obj) || PyFloat_Check(v->u.obj));
        else if (!strcmp(kind, "node")) ok = v->kind == IRARG_NODE;
        else if (!strcmp(kind, "eq0")) {
            ok = v->kind == IRARG_CONST && (PyLong_Check(v->u.obj) || PyFloat_Check(v->u.obj)) &&
                 PyFloat_AsDouble(v->u.obj) == 0.0;
        } else if (!strcmp(kind, "batched")) { /* conv: input has the weight's number of dims */
            const IRMeta *m = val_meta(ag, v);
            int wi = find_param(b, "weight");
            const IRMeta *wm = wi >= 0 ? val_meta(ag, &b->val[wi]) : NULL;
            ok = m && wm && m->kind == IRMETA_TENSOR && wm->kind == IRMETA_TENSOR && m->ndim == wm->ndim;
        } else if (!strcmp(kind, "sdpa")) {
            int sk = sdpa_kind_bound(ag, b);
            ok = sk == SDPA_FLASH_CPU || sk == SDPA_FLASH_CUDA || sk == SDPA_EFFICIENT;
        } else if (!strcmp(kind, "nonzero")) {
            ok = v->kind == IRARG_CONST && PyNumber_Check(v->u.obj) && PyFloat_AsDouble(v->u.obj) != 0.0;
            PyErr_Clear();
        } else if (!strcmp(kind, "padconst")) { /* F.pad's mode is 'constant' */
            ok = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) && !PyUnicode_CompareWithASCIIString(v->u.obj, "constant");
        } else if (!strcmp(kind, "l2")) { /* a norm's order is 2 (None and 'fro' for a vector norm) */
            ok = v->kind == IRARG_CONST && (v->u.obj == Py_None ||
                                            (PyUnicode_Check(v->u.obj) && !PyUnicode_CompareWithASCIIString(v->u.obj, "fro")) ||
                                            (PyNumber_Check(v->u.obj) && !PyBool_Check(v->u.obj) && PyFloat_AsDouble(v->u.obj) == 2.0));
            PyErr_Clear();
        } else if (!strcmp(kind, "einsum")) { /* v: the equation; every operand's gradient is an einsum */
            int oi = find_param(b, "operands");
            const IRArg *ops = oi >= 0 ? &b->val[oi] : NULL;
            const char *eq = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) ? PyUnicode_AsUTF8(v->u.obj) : NULL;
            EinsumEq q;
            ok = eq && ops && (ops->kind == IRARG_TUPLE || ops->kind == IRARG_LIST) && einsum_parse(eq, ops->n, &q) == 0;
            PyErr_Clear();
        } else if (!strcmp(kind, "interp")) { /* v: F.interpolate's mode, 'nearest' or 'bilinear' of a 4-d self */
            const IRMeta *m = val_meta(ag, &b->val[0]);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim == 4 && v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) &&
                 (!PyUnicode_CompareWithASCIIString(v->u.obj, "nearest") ||
                  !PyUnicode_CompareWithASCIIString(v->u.obj, "bilinear"));
        } else if (!strcmp(kind, "contig")) {
            ok = em_ir_meta_contiguous(val_meta(ag, v));
        } else if (!strcmp(kind, "ndim1") || !strcmp(kind, "ndim3") || !strcmp(kind, "ndim4")) {
            const IRMeta *m = val_meta(ag, v);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim == kind[4] - '0';
        } else if (!strcmp(kind, "ndim2")) {
            const IRMeta *m = val_meta(ag, v);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim >= 2;
        } else if (!strcmp(kind, "reduction")) {
            ok = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) &&
                 (!PyUnicode_CompareWithASCIIString(v->u.obj, "none") ||
                  !PyUnicode_CompareWithASCIIString(v->u.obj, "mean") || !PyUnicode_CompareWithASCIIString(v->u.obj, "sum"));
        } else if (!strcmp(kind, "sameshape") || !strcmp(kind, "nll")) {
            int si = find_param(b, kind[0] == 's' ? "self" : "target");
            const IRMeta *m = val_meta(ag, v), *o = si >= 0 ? val_meta(ag, &b->val[si]) : NULL;
            ok = m && o && m->kind == IRMETA_TENSOR && o->kind == IRMETA_TENSOR;
            if (ok && kind[0] == 's')
                ok = m->ndim == o->ndim && !memcmp(m->sizes, o->sizes, m->ndim * sizeof(int64_t)) && m->dtype == o->dtype;
            else if (ok) /* nll: v is the input, o the target */
                ok = (m->ndim == 1 || m->ndim == 2) && o->ndim == m->ndim - 1 && o->dtype == torch_dtype("int64") &&
                     !o->requires_grad;
        } else {
            ok = false;
        }
        if (!ok) return false;
    }
    return true;
}

/* The first rule that matches the node's name, binding and checks; NULL if none. */
static const Rule *find_rule(AG *ag, const IRNode *n, Bind *b) {
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return NULL;
    PyObject *name = node_opname(n);
    const char *s = name ? PyUnicode_AsUTF8(name) : NULL;
    const Rule *found = NULL;
    if (s) {
        for (size_t i = 0; i < NRULES && !found; i++) {
            if (!names_has(RULES[i].names, s)) continue;
            if (bind_args(ag, &RULES[i], n, b) < 0) continue;
            if (checks_pass(ag, b)) found = &RULES[i];
        }
    }
    Py_XDECREF(name);
    PyErr_Clear();
    return found;
}

/* ---------------------------------------------------------------- emitting joint nodes */

static PyObject *arg_example(const AG *ag, const IRArg *a);

static PyObject *meta_example(const IRMeta *m) {
    if (m->kind == IRMETA_TUPLE) {
        PyObject *t = PyTuple_New(m->nitems);
        for (uint32_t i = 0; t && i < m->nitems; i++) {
            PyObject *x = meta_example(&m->items[i]);
            if (!x) {
                Py_CLEAR(t);
                break;
            }
            PyTuple_SET_ITEM(t, i, x);
        }
        return t;
    }
    if (m->kind == IRMETA_NONE) return Py_NewRef(Py_None);
    if (!m->example) {
        PyErr_SetString(PyExc_RuntimeError, "ember: value without an example");
        return NULL;
    }
    return Py_NewRef(m->example);
}

static PyObject *arg_example(const AG *ag, const IRArg *a) {
    switch (a->kind) {
    case IRARG_NODE: return meta_example(&em_ir_node(ag->j, a->u.ref)->meta);
    case IRARG_CONST: return Py_NewRef(a->u.obj);
    case IRARG_TUPLE:
    case IRARG_LIST: {
        PyObject *t = a->kind == IRARG_TUPLE ? PyTuple_New(a->n) : PyList_New(a->n);
        for (uint32_t i = 0; t && i < a->n; i++) {
            PyObject *x = arg_example(ag, &a->u.items[i]);
            if (!x) {
                Py_CLEAR(t);
                break;
            }
            if (a->kind == IRARG_TUPLE) PyTuple_SET_ITEM(t, i, x);
            else PyList_SET_ITEM(t, i, x);
        }
        return t;
    }
    }
    return NULL;
}

static PyObject *first_device(const AG *ag, const IRArg *args, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_NODE) {
            const IRMeta *m = &em_ir_node(ag->j, args[i].u.ref)->meta;
            if (m->kind == IRMETA_TENSOR) return m->device;
            for (uint32_t k = 0; m->kind == IRMETA_TUPLE && k < m->nitems; k++)
                if (m->items[k].kind == IRMETA_TENSOR) return m->items[k].device;
        } else if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST) {
            PyObject *d = first_device(ag, args[i].u.items, args[i].n);
            if (d) return d;
        }
    }
    return NULL;
}

static int meta_from_value(AG *ag, PyObject *v, PyObject *device, IRMeta *out) {
    memset(out, 0, sizeof *out);
    if (v == Py_None) {
        out->kind = IRMETA_NONE;
        return 0;
    }
    if (PyTuple_Check(v) || PyList_Check(v)) {
        PyObject *seq = PySequence_Tuple(v);
        if (!seq) return -1;
        uint32_t n = (uint32_t)PyTuple_GET_SIZE(seq);
        out->kind = IRMETA_TUPLE;
        out->nitems = n;
        out->items = em_arena_alloc(ag->a, (n ? n : 1) * sizeof(IRMeta));
        for (uint32_t i = 0; out->items && i < n; i++)
            if (meta_from_value(ag, PyTuple_GET_ITEM(seq, i), device, &out->items[i]) < 0) {
                Py_DECREF(seq);
                return -1;
            }
        Py_DECREF(seq);
        return out->items ? 0 : (PyErr_NoMemory(), -1);
    }
    static PyObject *tensor_type = NULL; /* one interpreter (em_lazy_attr) */
    if (!em_lazy_attr(&tensor_type, "torch", "Tensor")) return -1;
    int is_t = PyObject_IsInstance(v, tensor_type);
    if (is_t < 0) return -1;
    if (is_t) {
        if (em_ir_meta_from_tensor(ag->a, v, device, out) < 0) return -1;
        out->requires_grad = false;
        return 0;
    }
    out->kind = IRMETA_OTHER;
    out->example = em_arena_hold(ag->a, v);
    return 0;
}

/* Sets *cl when a tensor argument is a channels_last CPU tensor (em_ir_meta_cpu_channels_last);
 * with lists (metas non-NULL), collects the tensor arguments' meta examples and devices for
 * ember._fake.run. -1 with an exception. */
static int fake_args(const AG *ag, const IRArg *args, uint32_t n, PyObject *metas, PyObject *devs, bool *cl) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST) {
            if (fake_args(ag, args[i].u.items, args[i].n, metas, devs, cl) < 0) return -1;
            continue;
        }
        if (args[i].kind != IRARG_NODE) continue;
        const IRMeta *m = &em_ir_node(ag->j, args[i].u.ref)->meta;
        if (m->kind != IRMETA_TENSOR || !m->example || !m->device) continue;
        *cl |= em_ir_meta_cpu_channels_last(m);
        if (metas && (PyList_Append(metas, m->example) < 0 || PyList_Append(devs, m->device) < 0)) return -1;
    }
    return 0;
}

/* fn(*pargs, **pkw) for a node's meta: on the meta examples, or, where torch's meta kernels would
 * pick CUDA's layout for channels_last CPU tensors or the math kernel's for attention
 * (em_ir_layout_needs_fake), on fake tensors of the real devices (ember._fake.run, as the tracer
 * does). New reference or NULL with an exception. */
static PyObject *meta_call(const AG *ag, PyObject *fn, PyObject *pargs, PyObject *pkw, const IRArg *args, uint32_t nargs,
                           const IRArg *kwv, uint32_t nkw) {
    bool cl = em_ir_layout_needs_fake(fn); /* attention: the real kernels' layout, not the math kernel's */
    fake_args(ag, args, nargs, NULL, NULL, &cl);
    fake_args(ag, kwv, nkw, NULL, NULL, &cl);
    if (!cl) return PyObject_Call(fn, pargs, pkw); /* the common case: the meta examples */
    PyObject *metas = PyList_New(0), *devs = PyList_New(0), *res = NULL;
    if (metas && devs && fake_args(ag, args, nargs, metas, devs, &cl) == 0 && fake_args(ag, kwv, nkw, metas, devs, &cl) == 0) {
        static PyObject *run = NULL; /* ember._fake.run */
        if (!run) em_lazy_attr(&run, "ember._fake", "run");
        PyObject *mt = run ? PyList_AsTuple(metas) : NULL, *dt = mt ? PyList_AsTuple(devs) : NULL;
        PyObject *r = dt ? PyObject_CallFunctionObjArgs(run, fn, pargs, pkw, mt, dt, NULL) : NULL;
        if (r && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) res = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        Py_XDECREF(r);
        Py_XDECREF(mt);
        Py_XDECREF(dt);
    }
    PyErr_Clear();
    Py_XDECREF(metas);
    Py_XDECREF(devs);
    return res ? res : PyObject_Call(fn, pargs, pkw);
}

/* Collects the metas of the tensor arguments (through tuples and lists) into metas[*n..], at most
 * MEMO_TENSORS; false when there are more. */
enum { MEMO_TENSORS = 32 };
static bool memo_metas(const AG *ag, const IRArg *args, uint32_t n, const IRMeta **metas, int *nm) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST) {
            if (!memo_metas(ag, args[i].u.items, args[i].n, metas, nm)) return false;
        } else if (args[i].kind == IRARG_NODE) {
            if (*nm == MEMO_TENSORS) return false;
            metas[(*nm)++] = &em_ir_node(ag->j, args[i].u.ref)->meta;
        }
    }
    return true;
}

/* The meta-call memo's key of a node (em_ir_memo.c; a method by its name, over its receiver and
 * arguments): a new tuple, a new Py_None when not memoizable or config.meta_memo is off, NULL with
 * an exception. metas/nmetas: the tensor arguments, for em_ir_memo_put. */
static PyObject *memo_key(const AG *ag, IRKind kind, PyObject *target, PyObject *pargs, PyObject *pkw, const IRArg *args,
                          uint32_t nargs, const IRArg *kwv, uint32_t nkw, const IRMeta **metas, int *nmetas) {
    *nmetas = 0;
    if (!ag->meta_memo || !memo_metas(ag, args, nargs, metas, nmetas) || !memo_metas(ag, kwv, nkw, metas, nmetas))
        return Py_NewRef(Py_None);
    if (kind != IR_CALL_METHOD) return em_ir_memo_key(target, pargs, pkw, NULL, metas, *nmetas);
    PyObject *self = arg_example(ag, &args[0]), *all = NULL, *key = NULL;
    if (self && (all = PyTuple_New(PyTuple_GET_SIZE(pargs) + 1))) {
        PyTuple_SET_ITEM(all, 0, Py_NewRef(self));
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pargs); i++) PyTuple_SET_ITEM(all, i + 1, Py_NewRef(PyTuple_GET_ITEM(pargs, i)));
        key = em_ir_memo_key(target, all, pkw, NULL, metas, *nmetas);
    }
    Py_XDECREF(self);
    Py_XDECREF(all);
    return key;
}

/* ---------------------------------------------------------------- symbolic sizes
 * A graph automatic dynamic (or dynamic=True, mark_dynamic) made symbolic compiles to one region for
 * all sizes. The forward nodes keep the tracer's symbolic metas; every node the joint graph adds
 * gets its sizes as expressions of g's ShapeEnv by running the op on fake tensors whose sizes are
 * torch SymInts (ember._fake.sym_run, as the tracer does for ops without a C shape rule). The
 * entry's guards were built before this stage, so a relation torch relies on must follow from what
 * they check (em_sym_static_bool): otherwise, and for any rule that reads a size as a number, the
 * region is not compiled symbolically (ag_fail), and the hook traces per size instead
 * (em_hook_cache.c). Sizes a backward op takes as arguments (sum_to_size's, expand's, new_zeros')
 * are aten.sym_size.int nodes of the forward, saved for the backward as ints. */

_Thread_local bool em_autograd_sym_guards = false;

static const IRMeta *jmeta(const AG *ag, IRRef r) { return &em_ir_node(ag->j, r)->meta; }

static bool meta_symbolic(const IRMeta *m) {
    if (m->kind == IRMETA_TENSOR) return m->sym_sizes != NULL;
    if (m->kind == IRMETA_OTHER) return m->sym != 0;
    for (uint32_t i = 0; m->kind == IRMETA_TUPLE && i < m->nitems; i++)
        if (meta_symbolic(&m->items[i])) return true;
    return false;
}

static bool is_slice_node(const IRNode *n) {
    return n->meta.kind == IRMETA_OTHER && !n->meta.sym && n->target == (PyObject *)&PySlice_Type;
}

static bool arg_symbolic(const AG *ag, const IRArg *a) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++)
            if (arg_symbolic(ag, &a->u.items[i])) return true;
        return false;
    }
    if (a->kind != IRARG_NODE) return false;
    const IRNode *n = em_ir_node(ag->j, a->u.ref);
    for (uint32_t i = 0; is_slice_node(n) && i < n->nargs; i++)
        if (arg_symbolic(ag, &n->args[i])) return true;
    return meta_symbolic(&n->meta);
}

/* Are m's symbolic strides dense (for every size) in the dim order of its hint strides? *perm:
 * that order, outermost first (x.permute(perm) is contiguous). */
static bool sym_dense(const AG *ag, const IRMeta *m, int32_t *perm) {
    uint32_t st[64];
    int32_t order[64];
    if (!ag->env || !m->sym_sizes || m->ndim > 64 ||
        em_sym_dense_strides(ag->env, m->strides, m->sym_sizes, (uint32_t)m->ndim, st, order) < 0)
        return false;
    for (int32_t d = 0; d < m->ndim; d++)
        if (em_sym_simplify(ag->env, st[d]) != em_sym_simplify(ag->env, m->sym_strides[d]) &&
            !(m->sizes[d] == 1 && em_sym_is_const(ag->env, m->sym_sizes[d], NULL)))
            return false;
    for (int32_t k = 0; k < m->ndim; k++) perm[k] = order[m->ndim - 1 - k];
    return true;
}

/* Does m have a symbolic size among dims [from, ndim)? (A rule that reads such a size as a number
 * cannot serve every size: it fails the symbolic compile instead.) */
static bool dims_symbolic(const AG *ag, const IRMeta *m, int32_t from) {
    if (!ag->env || m->kind != IRMETA_TENSOR || !m->sym_sizes) return false;
    for (int32_t d = from < 0 ? 0 : from; d < m->ndim; d++)
        if (!em_sym_is_const(ag->env, m->sym_sizes[d], NULL)) return true;
    return false;
}

/* Do tensor metas a and b have the same symbolic sizes and strides (the same expressions, so equal
 * for every size)? True for static ones (their hints are compared elsewhere). */
static bool same_sym_layout(const AG *ag, const IRMeta *a, const IRMeta *b) {
    if (!ag->env || (!a->sym_sizes && !b->sym_sizes)) return true;
    if (!a->sym_sizes || !b->sym_sizes || a->ndim != b->ndim) return false;
    for (int32_t d = 0; d < a->ndim; d++)
        if (em_sym_simplify(ag->env, a->sym_sizes[d]) != em_sym_simplify(ag->env, b->sym_sizes[d]) ||
            em_sym_simplify(ag->env, a->sym_strides[d]) != em_sym_simplify(ag->env, b->sym_strides[d]))
            return false;
    return true;
}

/* The size of dim d of tensor meta m as an expression (a constant for a static dim). */
static uint32_t dim_sym(const AG *ag, const IRMeta *m, int32_t d) {
    return m->sym_sizes ? m->sym_sizes[d] : em_sym_const(ag->env, m->sizes[d]);
}

/* sym_run's argument tree of joint argument a (em_ir_sym_value_tree; a slice node as a slice). */
static PyObject *sym_tree(AG *ag, const IRArg *a, int depth) {
    if (depth > 16) {
        PyErr_SetString(PyExc_RecursionError, "ember: argument nested too deep");
        return NULL;
    }
    switch (a->kind) {
    case IRARG_CONST: return Py_NewRef(a->u.obj);
    case IRARG_TUPLE:
    case IRARG_LIST: {
        PyObject *r = a->kind == IRARG_TUPLE ? PyTuple_New(a->n) : PyList_New(a->n);
        for (uint32_t i = 0; r && i < a->n; i++) {
            PyObject *x = sym_tree(ag, &a->u.items[i], depth + 1);
            if (!x) Py_CLEAR(r);
            else if (a->kind == IRARG_TUPLE) PyTuple_SET_ITEM(r, i, x);
            else PyList_SET_ITEM(r, i, x);
        }
        return r;
    }
    case IRARG_NODE: {
        const IRNode *n = em_ir_node(ag->j, a->u.ref);
        if (!is_slice_node(n)) return em_ir_sym_value_tree(ag->env, &n->meta);
        PyObject *p[3] = {Py_None, Py_None, Py_None};
        for (uint32_t i = 0; i < n->nargs && i < 3; i++)
            if (!(p[i] = sym_tree(ag, &n->args[i], depth + 1))) {
                for (uint32_t k = 0; k < i; k++) Py_DECREF(p[k]);
                return NULL;
            }
        PyObject *sl = PySlice_New(p[0], p[1], p[2]);
        for (uint32_t i = 0; i < n->nargs && i < 3; i++) Py_DECREF(p[i]);
        return sl;
    }
    }
    return NULL;
}

/* A size of a result tree as an expression; its value on the hints must be the meta call's. */
static int sym_size_of(AG *ag, PyObject *tree, int64_t hint, uint32_t *out) {
    if (PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0)) &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(tree, 0), "unknown") == 0)
        return ag_fail_sym(ag, "a size torch computes with a function ember's algebra lacks");
    uint32_t e = em_ir_sym_from_tree(ag->env, tree);
    int64_t h;
    if (!e || em_sym_hint(ag->env, e, &h) < 0) {
        if (PyErr_Occurred()) return ag_fail_exc(ag);
        return ag_fail_sym(ag, "%s", em_sym_error_text(em_sym_env_error(ag->env)));
    }
    if (h != hint)
        return ag_fail_sym(ag, "the size %lld torch computes disagrees with the meta size %lld", (long long)h,
                       (long long)hint);
    *out = em_sym_simplify(ag->env, e);
    return 0;
}

static int sym_apply(AG *ag, PyObject *tree, IRMeta *m, int depth) {
    if (tree == Py_None || depth > 4) return 0;
    const char *k = PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) > 0 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))
                        ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0))
                        : NULL;
    if (!k) return ag_fail_sym(ag, "a bad result tree");
    if (!strcmp(k, "T") && m->kind == IRMETA_TENSOR && PyTuple_GET_SIZE(tree) == 3) {
        PyObject *sz = PyTuple_GET_ITEM(tree, 1), *st = PyTuple_GET_ITEM(tree, 2);
        if (!PyTuple_Check(sz) || PyTuple_GET_SIZE(sz) != m->ndim || !PyTuple_Check(st) || PyTuple_GET_SIZE(st) != m->ndim)
            return ag_fail_sym(ag, "a result of another rank");
        uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
        if (!ss) return PyErr_NoMemory(), ag_fail_exc(ag);
        bool any = false;
        for (int32_t i = 0; i < m->ndim; i++) {
            if (sym_size_of(ag, PyTuple_GET_ITEM(sz, i), m->sizes[i], &ss[i]) < 0 ||
                sym_size_of(ag, PyTuple_GET_ITEM(st, i), m->strides[i], &ss[m->ndim + i]) < 0)
                return -1;
            any |= !em_sym_is_const(ag->env, ss[i], NULL) || !em_sym_is_const(ag->env, ss[m->ndim + i], NULL);
        }
        m->sym_sizes = any ? ss : NULL;
        m->sym_strides = any ? ss + m->ndim : NULL;
        return 0;
    }
    if (!strcmp(k, "Q") && m->kind == IRMETA_TUPLE) {
        PyObject *items = PyTuple_GET_ITEM(tree, 1);
        if (!PyList_Check(items) || PyList_GET_SIZE(items) != m->nitems)
            return ag_fail_sym(ag, "a result of another length");
        for (uint32_t i = 0; i < m->nitems; i++)
            if (sym_apply(ag, PyList_GET_ITEM(items, i), &m->items[i], depth + 1) < 0) return -1;
        return 0;
    }
    if (!strcmp(k, "I") && m->kind == IRMETA_OTHER && m->example && PyLong_Check(m->example)) {
        uint32_t e;
        if (sym_size_of(ag, PyTuple_GET_ITEM(tree, 1), PyLong_AsLongLong(m->example), &e) < 0) return -1;
        m->sym = em_sym_is_const(ag->env, e, NULL) ? 0 : e;
        return 0;
    }
    if (!strcmp(k, "C") && (m->kind == IRMETA_OTHER || m->kind == IRMETA_NONE)) return 0;
    return ag_fail_sym(ag, "a result of another kind (%s)", k);
}

/* Backward ops whose results have their arguments' shapes (derivatives.yaml: a gradient has its
 * input's shape): result i takes argument from[i]'s sizes; -2: static (a constant argument gives
 * them: convolution_backward's bias_sizes); -1: none. Their fake kernels may
 * guard on sizes to choose a kernel (convolution_backward's `s0 < 16` on CPU), which says nothing
 * about the shapes and which the entry's guards cannot take afterwards. */
static const struct {
    const char *op;
    int8_t from[4];
} SAME_SHAPE[] = {
    {"torch.ops.aten.convolution_backward.default", {1, 2, -2}},
    {"torch.ops.aten.native_batch_norm_backward.default", {1, 2, 2}},
    {"torch.ops.aten.cudnn_batch_norm_backward.default", {0, 2, 2}},
    {"torch.ops.aten.native_layer_norm_backward.default", {1, 5, 6}},
    {"torch.ops.aten.max_pool2d_with_indices_backward", {1, -1, -1}},
    {"torch.ops.aten.max_pool3d_with_indices_backward", {1, -1, -1}},
    {"torch.ops.aten.nll_loss_backward.default", {1, -1, -1}},
    {"ember._C.philox_dropout", {0, -1, -1}}, /* (runs on real tensors only) */
    {"ember._C.philox_seeds", {-2, -1, -1}},
    /* attention's backward ops: the gradients of query, key, value (and of the bias, a float mask) */
    {"torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", {1, 2, 3}},
    {"torch.ops.aten._scaled_dot_product_efficient_attention_backward", {1, 2, 3, 4}},
};

/* strides: dense strides for the symbolic sizes in the dim order of m's hint strides (innermost
 * first, ties keeping the inner dim first, as torch's infer_dense_strides), which must give m's hint
 * strides back (m dense, non-overlapping); -1 otherwise. */
static int dense_sym_strides(const AG *ag, const IRMeta *m, const uint32_t *sizes, uint32_t *strides) {
    if (em_sym_dense_strides(ag->env, m->strides, sizes, (uint32_t)m->ndim, strides, NULL) < 0) return -1;
    for (int32_t d = 0; d < m->ndim; d++) {
        int64_t h;
        if (em_sym_hint(ag->env, strides[d], &h) < 0 || (h != m->strides[d] && m->sizes[d] != 1)) return -1;
    }
    return 0;
}

/* A result tensor's symbolic layout from argument src's: its sizes; its strides where the hint
 * strides agree, else the contiguous ones where the result is contiguous. */
static int same_shape_item(AG *ag, IRMeta *m, const IRArg *src) {
    if (m->kind == IRMETA_NONE) return 0;
    const IRMeta *a = src && src->kind == IRARG_NODE ? jmeta(ag, src->u.ref) : NULL;
    if (m->kind != IRMETA_TENSOR || !a || a->kind != IRMETA_TENSOR || a->ndim != m->ndim ||
        memcmp(a->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim))
        return ag_fail_sym(ag, "a gradient of another shape than its input");
    if (!a->sym_sizes) return 0;
    uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
    if (!ss) return PyErr_NoMemory(), ag_fail_exc(ag);
    memcpy(ss, a->sym_sizes, sizeof(uint32_t) * (size_t)m->ndim);
    if (!memcmp(a->strides, m->strides, sizeof(int64_t) * (size_t)m->ndim)) {
        memcpy(ss + m->ndim, a->sym_strides, sizeof(uint32_t) * (size_t)m->ndim);
    } else if (dense_sym_strides(ag, m, ss, ss + m->ndim) < 0) {
        return ag_fail_sym(ag, "a gradient of another layout than its input, not dense");
    }
    m->sym_sizes = ss;
    m->sym_strides = ss + m->ndim;
    return 0;
}

/* 1 when target is a SAME_SHAPE op (m then has its symbolic sizes, or the region failed), 0 if not. */
static int same_shape_meta(AG *ag, PyObject *target, const IRArg *args, uint32_t nargs, IRMeta *m) {
    PyObject *qn = em_ir_target_qualname(target);
    const char *q = qn ? PyUnicode_AsUTF8(qn) : NULL;
    size_t i = 0;
    for (; q && i < sizeof SAME_SHAPE / sizeof SAME_SHAPE[0]; i++)
        if (!strcmp(q, SAME_SHAPE[i].op)) break;
    Py_XDECREF(qn);
    PyErr_Clear();
    if (!q || i == sizeof SAME_SHAPE / sizeof SAME_SHAPE[0]) return 0;
    uint32_t n = m->kind == IRMETA_TUPLE ? m->nitems : 1;
    for (uint32_t k = 0; k < n && k < 4; k++) {
        int8_t f = SAME_SHAPE[i].from[k];
        IRMeta *mk = m->kind == IRMETA_TUPLE ? &m->items[k] : m;
        if (f == -2) continue;
        if (same_shape_item(ag, mk, f >= 0 && (uint32_t)f < nargs ? &args[f] : NULL) < 0) return 1;
    }
    if (n > 4) ag_fail_sym(ag, "more results than the table knows");
    return 1;
}

/* matmul / mm / bmm by the C shape rule (em_sym_matmul_shape, torch's formula; its questions become
 * guards, so only while the entry's guards are still to be built) and linear (the input's sizes, the
 * weight's rows last; the inner dims guarded equal): torch's CUDA fake kernels specialise the batch
 * size of a folded matmul. The result is fresh contiguous memory (the meta call's hint layout must
 * say so). 1: done (or failed with ag->reason), 0: not such a call. */
static int matmul_meta(AG *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs, uint32_t nkw,
                       IRMeta *m) {
    if (!em_autograd_sym_guards || nargs < 2 || nargs > 3 || nkw || m->kind != IRMETA_TENSOR ||
        !em_ir_meta_contiguous(m) || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE || m->ndim > 16)
        return 0;
    PyObject *qn = kind == IR_CALL_METHOD ? Py_NewRef(target) : em_ir_target_qualname(target);
    const char *q = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool mm = q && nargs == 2 && (!strcmp(q, "matmul") || !strcmp(q, "mm") || !strcmp(q, "bmm") || !strcmp(q, "__matmul__") ||
                                  !strcmp(q, "torch.matmul") || !strcmp(q, "operator.matmul") || !strcmp(q, "torch.mm") ||
                                  !strcmp(q, "torch.bmm"));
    bool lin = q && (!strcmp(q, "torch.nn.functional.linear") || !strcmp(q, "torch._C._nn.linear"));
    Py_XDECREF(qn);
    PyErr_Clear();
    const IRMeta *a = jmeta(ag, args[0].u.ref), *b = jmeta(ag, args[1].u.ref);
    if ((!mm && !lin) || a->kind != IRMETA_TENSOR || b->kind != IRMETA_TENSOR || a->ndim > 16 || b->ndim > 16) return 0;
    uint32_t sa[16], sb[16], so[17], nout = 0;
    for (int32_t d = 0; d < a->ndim; d++) sa[d] = em_sym_simplify(ag->env, dim_sym(ag, a, d));
    for (int32_t d = 0; d < b->ndim; d++) sb[d] = em_sym_simplify(ag->env, dim_sym(ag, b, d));
    int r = 0;
    if (lin) { /* F.linear(x, w): (*x.shape[:-1], w.shape[0]), x[-1] == w[1] */
        if (a->ndim < 1 || b->ndim != 2) return 0;
        r = em_sym_guard_bool(ag->env, em_sym_cmp(ag->env, SYM_EQ, sa[a->ndim - 1], sb[1])) == 1 ? 0 : -1;
        nout = (uint32_t)a->ndim;
        memcpy(so, sa, sizeof(uint32_t) * nout);
        so[nout - 1] = sb[0];
    } else {
        r = em_sym_matmul_shape(ag->env, sa, (uint32_t)a->ndim, sb, (uint32_t)b->ndim, so, &nout);
    }
    if (r != 0 || nout != (uint32_t)m->ndim) return ag_fail_sym(ag, "matmul's shape"), 1;
    uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
    if (!ss) return PyErr_NoMemory(), ag_fail_exc(ag), 1;
    bool any = false;
    for (int32_t d = 0; d < m->ndim; d++) {
        int64_t h;
        ss[d] = em_sym_simplify(ag->env, so[d]);
        if (em_sym_hint(ag->env, ss[d], &h) < 0 || h != m->sizes[d])
            return ag_fail_sym(ag, "matmul's shape disagrees with the meta's"), 1;
        any |= !em_sym_is_const(ag->env, ss[d], NULL);
    }
    if (em_sym_contiguous_strides(ag->env, ss, (uint32_t)m->ndim, ss + m->ndim) < 0)
        return ag_fail_sym(ag, "%s", em_sym_error_text(em_sym_env_error(ag->env))), 1;
    m->sym_sizes = any ? ss : NULL;
    m->sym_strides = any ? ss + m->ndim : NULL;
    return 1;
}

/* Gives meta m (the meta call's result on the hints) its symbolic sizes when an argument has any. */
static int sym_meta(AG *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs, PyObject *const *kwn,
                    const IRArg *kwv, uint32_t nkw, IRMeta *m) {
    static PyObject *sym_run = NULL, *ctx_cls = NULL, *getitem = NULL; /* one interpreter (em_lazy_attr) */
    bool any = false;
    for (uint32_t i = 0; i < nargs && !any; i++) any = arg_symbolic(ag, &args[i]);
    for (uint32_t i = 0; i < nkw && !any; i++) any = arg_symbolic(ag, &kwv[i]);
    if (!any) return 0;
    if (!em_lazy_attr(&getitem, "operator", "getitem")) return ag_fail_exc(ag);
    if (target == getitem && nargs == 2 && args[0].kind == IRARG_NODE && args[1].kind == IRARG_CONST &&
        em_ir_node(ag->j, args[0].u.ref)->meta.kind == IRMETA_TUPLE) { /* an item of a tuple value: its meta */
        const IRMeta *t = &em_ir_node(ag->j, args[0].u.ref)->meta;
        long i = PyLong_AsLong(args[1].u.obj);
        if (i < 0) i += (long)t->nitems;
        if (PyErr_Occurred() || i < 0 || i >= (long)t->nitems || t->items[i].kind != m->kind) {
            PyErr_Clear();
            return ag_fail_sym(ag, "an item of a tuple");
        }
        m->sym_sizes = t->items[i].sym_sizes;
        m->sym_strides = t->items[i].sym_strides;
        m->sym = t->items[i].sym;
        return 0;
    }
    if (same_shape_meta(ag, target, args, nargs, m) || matmul_meta(ag, kind, target, args, nargs, nkw, m))
        return ag->reason ? -1 : 0;
    if (!em_lazy_attr(&sym_run, "ember._fake", "sym_run") || !em_lazy_attr(&ctx_cls, "ember._fake", "SymContext"))
        return ag_fail_exc(ag);
    if (!ag->symctx) {
        uint32_t ns = em_sym_nsymbols(ag->env);
        if (!(ag->symctx = PyObject_CallNoArgs(ctx_cls)) || !(ag->symhints = PyList_New(ns))) return ag_fail_exc(ag);
        for (uint32_t i = 0; i < ns; i++) {
            /* an int argument's symbol (a placeholder that is the symbol) is (hint, True): any int */
            bool is_int = false;
            for (uint32_t k = 0; k < ag->g->ninputs && !is_int; k++) {
                const IRMeta *im = &em_ir_node(ag->g, ag->g->inputs[k])->meta;
                is_int = im->kind == IRMETA_OTHER && im->sym && em_sym_symbol_index(ag->env, im->sym) == (int64_t)i;
            }
            PyObject *h = PyLong_FromLongLong(em_sym_symbol_hint(ag->env, i));
            if (h && is_int) h = Py_BuildValue("(NO)", h, Py_True);
            if (!h) return ag_fail_exc(ag);
            PyList_SET_ITEM(ag->symhints, i, h);
        }
    }
    int rc = -1;
    PyObject *pa = PyTuple_New(nargs), *kw = PyDict_New(), *r = NULL;
    if (!pa || !kw) goto done;
    for (uint32_t i = 0; i < nargs; i++) {
        PyObject *x = sym_tree(ag, &args[i], 0);
        if (!x) goto done;
        PyTuple_SET_ITEM(pa, i, x);
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *x = sym_tree(ag, &kwv[i], 0);
        if (!x || PyDict_SetItem(kw, kwn[i], x) < 0) {
            Py_XDECREF(x);
            goto done;
        }
        Py_DECREF(x);
    }
    r = PyObject_CallFunctionObjArgs(sym_run, ag->symctx, ag->symhints, target,
                                     kind == IR_CALL_METHOD ? Py_True : Py_False, pa, kw, NULL);
    if (!r) goto done;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
        PyErr_SetString(PyExc_TypeError, "ember._fake.sym_run returned no triple");
        goto done;
    }
    if (PyTuple_GET_ITEM(r, 2) != Py_None) {
        PyObject *qn = em_ir_target_qualname(target);
        rc = ag_fail_sym(ag, "torch runs %S only on concrete sizes (%S)", qn ? qn : Py_None,
                     PyTuple_GET_ITEM(r, 2));
        Py_XDECREF(qn);
        goto out;
    }
    PyObject *guards = PyTuple_GET_ITEM(r, 1);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(guards); i++) {
        PyObject *gt = PyList_GET_ITEM(guards, i);
        uint32_t c = PyTuple_GET_SIZE(gt) == 2 ? 0 : em_ir_sym_from_tree(ag->env, gt);
        if (PyErr_Occurred()) goto done;
        /* a guard of the entry's when they are still to be built, else already implied by them */
        if (!c || (em_autograd_sym_guards ? em_sym_guard_bool(ag->env, c) : em_sym_static_bool(ag->env, c)) != 1) {
            PyObject *qn = em_ir_target_qualname(target);
            char buf[256] = "?";
            if (c) em_sym_render(ag->env, c, SYM_STYLE_SYMBOLS, buf, sizeof buf);
            rc = ag_fail_sym(ag, "%S relies on %s, which the entry's guards do not check%s",
                         qn ? qn : Py_None, buf, em_autograd_sym_guards ? " (nor hold)" : "");
            Py_XDECREF(qn);
            goto out;
        }
    }
    rc = sym_apply(ag, PyTuple_GET_ITEM(r, 0), m, 0);
    goto out;
done:
    rc = ag_fail_exc(ag);
out:
    Py_XDECREF(pa);
    Py_XDECREF(kw);
    Py_XDECREF(r);
    return rc;
}

/* Appends a call node to the joint graph; its meta comes from running the target on the meta
 * examples of its arguments (as the tracer does; meta_call), or from the meta-call memo. Returns 0
 * with ag->reason set on failure. */
static IRRef ag_emit(AG *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs,
                     PyObject *const *kwn, const IRArg *kwv, uint32_t nkw) {
    PyObject *pargs = NULL, *pkw = NULL, *fn = NULL, *res = NULL, *key = NULL;
    const IRMeta *metas[MEMO_TENSORS];
    int nmetas = 0;
    IRRef r = 0;
    IRMeta meta;
    uint32_t first = kind == IR_CALL_METHOD ? 1 : 0;
    pargs = PyTuple_New(nargs - first);
    pkw = PyDict_New();
    if (!pargs || !pkw) goto done;
    for (uint32_t i = first; i < nargs; i++) {
        PyObject *x = arg_example(ag, &args[i]);
        if (!x) goto done;
        PyTuple_SET_ITEM(pargs, i - first, x);
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *x = arg_example(ag, &kwv[i]);
        if (!x || PyDict_SetItem(pkw, kwn[i], x) < 0) {
            Py_XDECREF(x);
            goto done;
        }
        Py_DECREF(x);
    }
    if (kind == IR_CALL_METHOD) {
        PyObject *self = arg_example(ag, &args[0]);
        if (!self) goto done;
        fn = PyObject_GetAttr(self, target);
        Py_DECREF(self);
    } else {
        fn = Py_NewRef(target);
    }
    if (!fn) goto done;
    if (!(key = memo_key(ag, kind, target, pargs, pkw, args, nargs, kwv, nkw, metas, &nmetas))) {
        PyErr_Clear(); /* the memo is an optimisation: without a key the call runs */
        key = Py_NewRef(Py_None);
    }
    if (!(res = em_ir_memo_get(key, metas, nmetas, NULL))) {
        res = meta_call(ag, fn, pargs, pkw, args + first, nargs - first, kwv, nkw);
        if (res) em_ir_memo_put(key, res, NULL, metas, nmetas);
    }
    if (!res || meta_from_value(ag, res, first_device(ag, args, nargs), &meta) < 0) goto done;
    if (ag->env && sym_meta(ag, kind, target, args, nargs, kwn, kwv, nkw, &meta) < 0) goto done;
    r = em_ir_call(ag->j, kind, target, args, nargs, kwn, kwv, nkw, &meta);
    if (!r && !PyErr_Occurred()) PyErr_NoMemory();
    if (r && ag_grow_roles(ag) < 0) {
        r = 0;
        PyErr_NoMemory();
    }
    if (r) {
        ag->role[r] = ag->cur_role;
        ag->pinned[r] = ag->cur_pinned;
    }
done:
    Py_XDECREF(pargs);
    Py_XDECREF(pkw);
    Py_XDECREF(fn);
    Py_XDECREF(res);
    Py_XDECREF(key);
    if (!r) ag_fail_exc(ag);
    return r;
}

static PyObject *torch_attr(const char *dotted) {
    PyObject *obj = PyImport_ImportModule("torch");
    const char *p = dotted;
    while (obj && *p) {
        const char *e = strchr(p, '.');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        PyObject *name = PyUnicode_FromStringAndSize(p, (Py_ssize_t)n);
        PyObject *next = name ? PyObject_GetAttr(obj, name) : NULL;
        Py_XDECREF(name);
        Py_SETREF(obj, next);
        p += n;
        if (*p == '.') p++;
    }
    return obj;
}

/* A loss's reduction ('none' / 'mean' / 'sum', checked by `reduction:`) as at::Reduction's int. */
static IRArg eval_redenum(AG *ag, IRArg r) {
    long v = !PyUnicode_CompareWithASCIIString(r.u.obj, "none") ? 0 : !PyUnicode_CompareWithASCIIString(r.u.obj, "mean") ? 1 : 2;
    return arg_const_steal(ag, PyLong_FromLong(v));
}

/* Emits torch.<dotted>(args) / operator.<name> / a Tensor method; the target is held by the arena. */
static IRRef emit_fn(AG *ag, const char *dotted, const IRArg *args, uint32_t n) {
    PyObject *t = torch_attr(dotted);
    if (!t || !em_arena_hold_steal(ag->a, t)) {
        ag_fail_exc(ag);
        return 0;
    }
    return ag_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0);
}

static IRRef emit_method(AG *ag, const char *name, const IRArg *args, uint32_t n) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (!s || !em_arena_hold_steal(ag->a, s)) {
        ag_fail_exc(ag);
        return 0;
    }
    return ag_emit(ag, IR_CALL_METHOD, s, args, n, NULL, NULL, 0);
}

/* module.name, held by the arena (borrowed); NULL with ag->reason set on failure. */
static PyObject *held_attr(AG *ag, const char *module, const char *name) {
    PyObject *mod = PyImport_ImportModule(module);
    PyObject *t = mod ? PyObject_GetAttrString(mod, name) : NULL;
    Py_XDECREF(mod);
    if (!t || !em_arena_hold_steal(ag->a, t)) {
        ag_fail_exc(ag);
        return NULL;
    }
    return t;
}

/* Emits ember._C.<name>(args) (the random ops' eager forms, em_runtime_random.c). */
static IRRef emit_ember(AG *ag, const char *name, const IRArg *args, uint32_t n) {
    PyObject *t = held_attr(ag, "ember._C", name);
    return t ? ag_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0) : 0;
}

static IRRef emit_op(AG *ag, const char *opname, IRArg a, IRArg b, uint32_t n) {
    PyObject *t = held_attr(ag, "operator", opname);
    if (!t) return 0;
    IRArg args[2] = {a, b};
    return ag_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0);
}

static IRRef emit_getitem(AG *ag, IRRef tuple, long i) {
    return emit_op(ag, "getitem", arg_node(tuple), arg_const_steal(ag, PyLong_FromLong(i)), 2);
}

/* An interned keyword name held by the arena; NULL with an exception. */
static PyObject *kwname(AG *ag, const char *s) {
    PyObject *k = PyUnicode_InternFromString(s);
    return k ? em_arena_hold_steal(ag->a, k) : NULL;
}

static bool dims_symbolic(const AG *ag, const IRMeta *m, int32_t from);

/* The sizes of m as a constant tuple; for a symbolic m the region fails (shape_arg reads them). */
static IRArg shape_const(AG *ag, const IRMeta *m) {
    if (dims_symbolic(ag, m, 0)) return ag_fail_sym(ag, "a rule reads a symbolic shape as numbers"), arg_node(0);
    PyObject *t = PyTuple_New(m->ndim);
    for (int32_t i = 0; t && i < m->ndim; i++) {
        PyObject *v = PyLong_FromLongLong(m->sizes[i]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return arg_const_steal(ag, t);
}

/* The size of dim d of joint value x as an argument: a constant, or (symbolic) the int of an
 * aten.sym_size.int(x, d) node, made once per (x, d) in the forward (the partitioner saves the int
 * for the backward, not x). */
static IRArg size_arg(AG *ag, IRRef x, int32_t d) {
    const IRMeta *m = jmeta(ag, x);
    if (!ag->env || !m->sym_sizes || em_sym_is_const(ag->env, m->sym_sizes[d], NULL))
        return arg_const_steal(ag, PyLong_FromLongLong(m->sizes[d]));
    PyObject *key = Py_BuildValue("(Ii)", (unsigned)x, (int)d), *have = NULL;
    if (!key || (!ag->sizes && !(ag->sizes = PyDict_New()))) goto fail;
    if ((have = PyDict_GetItemWithError(ag->sizes, key))) {
        Py_DECREF(key);
        return arg_node((IRRef)PyLong_AsUnsignedLong(have));
    }
    if (PyErr_Occurred()) goto fail;
    static PyObject *sym_size = NULL;
    if (!sym_size) sym_size = torch_attr("ops.aten.sym_size.int"); /* immortal: the op registry holds it */
    if (!sym_size) goto fail;
    uint8_t role = ag->cur_role;
    ag->cur_role = ROLE_FWD; /* read where x is: in the forward */
    IRArg a[2] = {arg_node(x), arg_const_steal(ag, PyLong_FromLong(d))};
    IRRef r = arg_bad(&a[1]) ? 0 : ag_emit(ag, IR_CALL_FUNCTION, sym_size, a, 2, NULL, NULL, 0);
    ag->cur_role = role;
    PyObject *v = r ? PyLong_FromUnsignedLong(r) : NULL;
    if (!v || PyDict_SetItem(ag->sizes, key, v) < 0) {
        Py_XDECREF(v);
        goto fail;
    }
    Py_DECREF(v);
    Py_DECREF(key);
    return arg_node(r);
fail:
    Py_XDECREF(key);
    if (PyErr_Occurred()) ag_fail_exc(ag);
    return arg_node(0);
}

/* The sizes of joint value x from dim `from` on, as an argument: shape_const of a static shape, a
 * tuple of constants and size_arg nodes of a symbolic one. */
static IRArg shape_arg(AG *ag, IRRef x, int32_t from) {
    const IRMeta *m = jmeta(ag, x);
    if (!dims_symbolic(ag, m, from)) {
        IRMeta pm = *m;
        pm.ndim = m->ndim - from;
        pm.sizes = m->sizes + from;
        pm.sym_sizes = pm.sym_strides = NULL; /* (constants from dim `from` on) */
        return shape_const(ag, &pm);
    }
    IRArg t = {0};
    t.kind = IRARG_TUPLE;
    t.n = (uint32_t)(m->ndim - from);
    t.u.items = em_arena_alloc(ag->a, (t.n + 1) * sizeof(IRArg));
    if (!t.u.items) return PyErr_NoMemory(), ag_fail_exc(ag), arg_node(0);
    for (uint32_t i = 0; i < t.n; i++) {
        t.u.items[i] = size_arg(ag, x, from + (int32_t)i);
        if (arg_bad(&t.u.items[i])) return arg_node(0);
    }
    return t;
}

/* Is numel(a) / numel(b) the same number for every size: b's symbolic dims cancel against equal
 * ones of a and what is left is static (mean over a static dim, [4, s0, 64] over [4, s0, 1])? */
static bool numel_ratio_const(AG *ag, const IRMeta *a, const IRMeta *b) {
    if (a->ndim > 64) return false;
    uint64_t used = 0;
    for (int32_t i = 0; i < b->ndim; i++) {
        uint32_t sb = em_sym_simplify(ag->env, dim_sym(ag, b, i));
        if (em_sym_is_const(ag->env, sb, NULL)) continue;
        bool found = false;
        for (int32_t j = 0; j < a->ndim && !found; j++)
            if (!((used >> j) & 1) && em_sym_simplify(ag->env, dim_sym(ag, a, j)) == sb) {
                used |= 1ull << j;
                found = true;
            }
        if (!found) return false;
    }
    for (int32_t j = 0; j < a->ndim; j++)
        if (!((used >> j) & 1) && !em_sym_is_const(ag->env, em_sym_simplify(ag->env, dim_sym(ag, a, j)), NULL))
            return false;
    return true;
}

/* The number of elements of joint value x as an argument: a constant, or (symbolic) the int of an
 * x.numel() node in the forward. */
static IRArg numel_arg(AG *ag, IRRef x) {
    const IRMeta *m = jmeta(ag, x);
    if (!dims_symbolic(ag, m, 0)) {
        int64_t numel = 1;
        for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
        return arg_const_steal(ag, PyLong_FromLongLong(numel));
    }
    uint8_t role = ag->cur_role;
    ag->cur_role = ROLE_FWD;
    IRArg a[1] = {arg_node(x)};
    IRRef r = emit_method(ag, "numel", a, 1);
    ag->cur_role = role;
    return arg_node(r);
}

/* Sum a broadcast gradient back to the input's shape and cast it to the input's dtype, as
 * torch/csrc/autograd/engine.cpp validate_outputs does. */
static IRRef reduce_to(AG *ag, IRRef gi, IRRef gref) {
    const IRMeta *m = jmeta(ag, gi), *want = &em_ir_node(ag->g, gref)->meta;
    if (m->kind != IRMETA_TENSOR || want->kind != IRMETA_TENSOR) return gi;
    bool same = m->ndim == want->ndim;
    for (int32_t i = 0; same && i < m->ndim; i++) same = m->sizes[i] == want->sizes[i];
    /* symbolic: the same expressions (then equal for every size) */
    for (int32_t i = 0; same && ag->env && (m->sym_sizes || want->sym_sizes) && i < m->ndim; i++)
        same = m->sym_sizes && want->sym_sizes && em_sym_simplify(ag->env, m->sym_sizes[i]) ==
                                                       em_sym_simplify(ag->env, want->sym_sizes[i]);
    if (!same && ag->env && m->ndim >= want->ndim && m->ndim <= 64) {
        /* symbolic: sum_to_size as the reduction it is (sum over the leading dims and the dims the
         * value broadcast from 1, then squeeze the leading ones: no squeeze when there are only
         * leading ones), which ember's lowering fuses
         * where it cannot take sum_to_size of symbolic sizes; when a dim is neither the value's
         * own nor a static 1, sum_to_size below */
        int32_t lead = m->ndim - want->ndim, nd = 0;
        PyObject *dims = PyList_New(0), *ldims = PyTuple_New(lead);
        bool ok = dims && ldims;
        for (int32_t d = 0; ok && d < m->ndim; d++) {
            bool red = d < lead;
            if (!red) {
                int32_t w = d - lead;
                uint32_t gs = em_sym_simplify(ag->env, dim_sym(ag, m, d)), ws = em_sym_simplify(ag->env, dim_sym(ag, want, w));
                red = want->sizes[w] == 1 && !(want->sym_sizes && !em_sym_is_const(ag->env, want->sym_sizes[w], NULL)) &&
                      gs != em_sym_const(ag->env, 1);
                ok = red || gs == ws;
            }
            PyObject *v = red ? PyLong_FromLong(d) : NULL;
            if (red && (!v || PyList_Append(dims, v) < 0)) ok = false;
            if (red && d < lead && v) PyTuple_SET_ITEM(ldims, d, Py_NewRef(v));
            Py_XDECREF(v);
            nd += red;
        }
        if (ok && nd) {
            /* only the leading dims: one sum without keepdim (no squeeze, a view the graph would
             * return: the lowering keeps returned views torch's) */
            PyObject *keep = nd == lead ? Py_False : Py_True;
            IRArg a[3] = {arg_node(gi), arg_const_steal(ag, Py_NewRef(dims)), arg_const_steal(ag, Py_NewRef(keep))};
            gi = emit_method(ag, "sum", a, 3);
            if (gi && lead && nd != lead) {
                IRArg q[2] = {arg_node(gi), arg_const_steal(ag, Py_NewRef(ldims))};
                gi = emit_method(ag, "squeeze", q, 2);
            }
            same = true;
        }
        Py_XDECREF(dims);
        Py_XDECREF(ldims);
        if (!gi) return 0;
        if (PyErr_Occurred()) return ag_fail_exc(ag), 0;
    }
    if (!same) {
        IRArg a[2] = {arg_node(gi), ag->fmap[gref] ? shape_arg(ag, ag->fmap[gref], 0) : shape_const(ag, want)};
        gi = emit_method(ag, "sum_to_size", a, 2);
        if (!gi) return 0;
    }
    if (jmeta(ag, gi)->dtype != want->dtype) {
        IRArg a[2] = {arg_node(gi), arg_const_steal(ag, Py_NewRef(want->dtype))};
        gi = emit_method(ag, "to", a, 2);
    }
    return gi;
}

/* ---------------------------------------------------------------- absent tangents
 * An output nothing after the region differentiates gets no gradient (None); CompiledRegion hands
 * the backward graph zeros for its tangent, and flags saying which tangents are given. Zeros are not
 * enough where the gradients of several outputs meet: eager never runs the backward of an output
 * without a gradient, while the compiled backward multiplies the zeros through, and 0 * inf is NaN
 * (f(x, y) = (x * y, x + 1) with an inf in y and only the second output differentiated: eager's
 * x.grad is 1 everywhere). So where values computed from different sets of tangents meet (a
 * gradient accumulated from two uses, a stack of pieces), each that is computed from tangents the
 * other is not is taken through where(any of its tangents given, value, 0): exactly zero when none
 * is, NaN or not. */

static bool dtype_differentiable(PyObject *dtype);

static uint64_t arg_deps(const AG *ag, const IRArg *a) {
    uint64_t d = 0;
    if (a->kind == IRARG_NODE) d = a->u.ref < ag->ndeps ? ag->deps[a->u.ref] : 0;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) d |= arg_deps(ag, &a->u.items[i]);
    return d;
}

/* deps[r] for every joint ref so far (refs only read earlier refs). */
static int deps_update(AG *ag) {
    uint32_t n = ag->j->nnodes;
    if (n > ag->depcap) {
        uint32_t cap = n * 2 + 16;
        uint64_t *d = realloc(ag->deps, cap * sizeof(uint64_t));
        if (!d) return PyErr_NoMemory(), ag_fail_exc(ag);
        ag->deps = d;
        ag->depcap = cap;
    }
    for (IRRef r = ag->ndeps; r < n; r++) {
        const IRNode *nd = em_ir_node(ag->j, r);
        uint64_t d = 0;
        for (uint32_t k = 0; k < ag->nouts; k++)
            if (ag->tangent[k] && ag->tangent[k] == r) d = (uint64_t)1 << k;
        if (ag->role[r] == ROLE_BWD)
            for (uint32_t i = 0; i < nd->nargs + nd->nkwargs; i++)
                d |= arg_deps(ag, i < nd->nargs ? &nd->args[i] : &nd->kwargs[i - nd->nargs]);
        ag->deps[r] = d;
        ag->ndeps = r + 1;
    }
    return 0;
}

/* The joint ref of "any of the outputs in set has a gradient": a flag, or their logical_or. */
static IRRef flag_of(AG *ag, uint64_t set) {
    for (uint32_t i = 0; i < ag->nor; i++)
        if (ag->flag_or[i].set == set) return ag->flag_or[i].ref;
    IRRef acc = 0;
    for (uint32_t k = 0; k < ag->nouts; k++) {
        if (!(set >> k & 1) || !ag->flag[k]) continue;
        if (!acc) {
            acc = ag->flag[k];
            continue;
        }
        IRArg a[2] = {arg_node(acc), arg_node(ag->flag[k])};
        if (!(acc = emit_fn(ag, "logical_or", a, 2))) return 0;
    }
    if (acc && ag->nor < sizeof ag->flag_or / sizeof ag->flag_or[0]) {
        ag->flag_or[ag->nor].set = set;
        ag->flag_or[ag->nor++].ref = acc;
    }
    return acc;
}

/* x as the meeting point takes it: where(flag, x, 0) when x is a floating tensor computed from
 * tangents, not all of those the meeting point's values are computed from (all: the point itself
 * has no gradient when none is given, and its own meeting points take care of it). */
static IRRef absent_zero(AG *ag, IRRef x, uint64_t all) {
    if (!ag->flag || !x) return x;
    if (deps_update(ag) < 0) return 0;
    uint64_t d = x < ag->ndeps ? ag->deps[x] : 0;
    const IRMeta *m = jmeta(ag, x);
    if (!d || d == all || m->kind != IRMETA_TENSOR || !dtype_differentiable(m->dtype)) return x;
    IRRef f = flag_of(ag, d);
    if (!f) return 0;
    IRArg a[3] = {arg_node(f), arg_node(x), arg_const_steal(ag, PyFloat_FromDouble(0.0))};
    IRRef w = emit_fn(ag, "where", a, 3);
    if (w && ag->ngates == ag->gatecap) {
        uint32_t cap = ag->gatecap * 2 + 8;
        IRRef *gr = realloc(ag->gate, cap * sizeof(IRRef));
        if (gr) ag->gate = gr;
        uint64_t *gs = gr ? realloc(ag->gate_set, cap * sizeof(uint64_t)) : NULL;
        if (gs) ag->gate_set = gs;
        if (!gr || !gs) return PyErr_NoMemory(), ag_fail_exc(ag), 0;
        ag->gatecap = cap;
    }
    if (w) {
        ag->gate[ag->ngates] = w;
        ag->gate_set[ag->ngates++] = d;
    }
    return w;
}

/* add(a, b) of two values meeting (a gradient accumulated), each through absent_zero. */
static IRRef absent_add(AG *ag, IRRef a, IRRef b) {
    if (ag->flag && deps_update(ag) < 0) return 0;
    uint64_t all = ag->flag ? ag->deps[a] | ag->deps[b] : 0;
    a = absent_zero(ag, a, all);
    b = a ? absent_zero(ag, b, all) : 0;
    return b ? emit_op(ag, "add", arg_node(a), arg_node(b), 2) : 0;
}

/* x[0], x[1], ... x[n-1] each used (the packed attention projection's proj[0], proj[1], proj[2]):
 * x's gradient is torch.stack of theirs (zeros for an index not used), one buffer written once,
 * no in-place op, as eager's SelectBackward nodes summed would give. Called before anything reads
 * the gradient of gref. */
static int finalize_grad(AG *ag, IRRef gref) {
    struct Pieces *pc = ag->pieces ? &ag->pieces[gref] : NULL;
    if (!pc || !pc->part || em_ir_node(ag->g, gref)->meta.kind == IRMETA_TUPLE) return 0; /* SP_SPLIT's */
    IRRef any = 0;
    for (int64_t i = 0; i < pc->n && !any; i++) any = pc->part[i];
    IRArg list = {0};
    list.kind = IRARG_LIST;
    list.n = (uint32_t)pc->n;
    list.u.items = em_arena_alloc(ag->a, (size_t)pc->n * sizeof(IRArg));
    if (!list.u.items) return -1;
    for (int64_t i = 0; i < pc->n; i++) {
        IRRef v = pc->part[i];
        if (!v) {
            IRArg za[2] = {arg_node(any), shape_arg(ag, ag->fmap[gref], 1)};
            v = emit_method(ag, "new_zeros", za, 2);
            if (!v) return -1;
        }
        list.u.items[i] = arg_node(v);
    }
    pc->part = NULL;
    if (ag->flag) { /* pieces computed from different outputs' gradients meet here */
        if (deps_update(ag) < 0) return -1;
        uint64_t all = arg_deps(ag, &list);
        for (uint32_t i = 0; i < list.n; i++)
            if (!(list.u.items[i].u.ref = absent_zero(ag, list.u.items[i].u.ref, all))) return -1;
    }
    IRRef st = emit_fn(ag, "stack", &list, 1);
    if (!st) return -1;
    if (ag->grad[gref]) {
        st = absent_add(ag, ag->grad[gref], st);
        if (!st) return -1;
    }
    ag->grad[gref] = st;
    return 0;
}

static int accumulate(AG *ag, IRRef gref, IRRef gi) {
    if (!gi) return -1;
    if (finalize_grad(ag, gref) < 0) return -1;
    gi = reduce_to(ag, gi, gref);
    if (!gi) return -1;
    if (ag->grad[gref]) {
        gi = absent_add(ag, ag->grad[gref], gi);
        if (!gi) return -1;
    }
    ag->grad[gref] = gi;
    if (ag->scatter) ag->scatter[gref] = 0; /* read by an add: no longer written slice by slice */
    return 0;
}

/* ---------------------------------------------------------------- formula evaluation */

typedef struct {
    AG *ag;
    const Bind *b;
    IRRef n;     /* the g node */
    const char *p;
} Eval;

static void skip_ws(Eval *e) {
    while (*e->p == ' ') e->p++;
}

/* Maps a bound g-level argument to the joint graph (node refs through fmap). */
static IRArg map_arg(AG *ag, const IRArg *a) {
    if (a->kind == IRARG_NODE) return arg_node(ag->fmap[a->u.ref]);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        IRArg out = *a;
        IRArg *items = em_arena_alloc(ag->a, (a->n ? a->n : 1) * sizeof(IRArg));
        if (!items) return arg_node(0);
        for (uint32_t i = 0; i < a->n; i++) items[i] = map_arg(ag, &a->u.items[i]);
        out.u.items = items;
        return out;
    }
    return *a;
}

static int64_t norm_dim(int64_t d, int64_t ndim) { return d < 0 ? d + (ndim ? ndim : 1) : d; }

/* The reduced dims of a reduction (None / () = all) as a sorted bitmask; -1 if not ints. */
static int64_t dims_mask(const IRArg *dim, int32_t ndim) {
    if (dim->kind != IRARG_CONST) return -1;
    PyObject *d = dim->u.obj;
    if (d == Py_None || (PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 0) || (PyList_Check(d) && PyList_GET_SIZE(d) == 0))
        return ndim >= 63 ? -1 : (int64_t)((1ull << ndim) - 1);
    int64_t mask = 0;
    if (PyLong_Check(d)) return (int64_t)1 << norm_dim(PyLong_AsLongLong(d), ndim);
    PyObject *seq = PySequence_Fast(d, "dims");
    if (!seq) {
        PyErr_Clear();
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(seq);
            return -1;
        }
        mask |= (int64_t)1 << norm_dim(v, ndim);
    }
    Py_DECREF(seq);
    return mask;
}

/* unsqueeze x at each reduced dim (when keepdim is false), so it broadcasts against self. */
static IRRef unsq(AG *ag, IRRef x, const IRMeta *self, const IRArg *dim, const IRArg *keepdim) {
    int64_t mask = dims_mask(dim, self->ndim);
    if (mask < 0) {
        ag_fail(ag, "reduction dims are not constants");
        return 0;
    }
    bool keep = keepdim->kind == IRARG_CONST && PyObject_IsTrue(keepdim->u.obj) == 1;
    if (keep || self->ndim == 0) return x;
    if (jmeta(ag, x)->ndim == self->ndim) return x;
    for (int32_t d = 0; d < self->ndim; d++) {
        if (!(mask & ((int64_t)1 << d))) continue;
        IRArg a[2] = {arg_node(x), arg_const_steal(ag, PyLong_FromLong(d))};
        x = emit_method(ag, "unsqueeze", a, 2);
        if (!x) return 0;
    }
    return x;
}

/* varback(grad, self, dim, unbiased, keepdim, correction): var's gradient, derivatives.yaml's
 * var_backward: (2 / (N - correction)) * grad * (self - self.mean(dim, keepdim=True)), N the number
 * of reduced elements. torch.var(x, True) passes unbiased in dim's place; correction defaults to
 * unbiased's (1 / 0), else 1. A full reduction with N <= correction (eager's NaN / inf) declines. */
static IRRef var_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 6 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE) return ag_fail(ag, "varback: bad call"), 0;
    IRArg dim = args[2], unbiased = args[3], keepdim = args[4], corr = args[5];
    if (dim.kind == IRARG_CONST && PyBool_Check(dim.u.obj)) { /* var(x, unbiased) */
        unbiased = dim;
        dim = arg_const_steal(ag, Py_NewRef(Py_None));
    }
    double c = 1;
    if (!arg_is_none(&corr)) {
        if (corr.kind != IRARG_CONST || !PyNumber_Check(corr.u.obj)) return ag_fail(ag, "var: a correction that is not a constant"), 0;
        c = PyFloat_AsDouble(corr.u.obj);
    } else if (!arg_is_none(&unbiased)) {
        if (unbiased.kind != IRARG_CONST) return ag_fail(ag, "var: unbiased is not a constant"), 0;
        c = PyObject_IsTrue(unbiased.u.obj) == 1 ? 1 : 0;
    }
    const IRMeta *sm = jmeta(ag, args[1].u.ref);
    bool full = arg_is_none(&dim) || sm->ndim == 0;
    int64_t mask = full ? (sm->ndim >= 63 ? -1 : (int64_t)((1ull << sm->ndim) - 1)) : dims_mask(&dim, sm->ndim);
    if (mask < 0) return ag_fail(ag, "var: reduction dims are not constants"), 0;
    double n = 1;
    PyObject *dl = PyList_New(0);
    for (int32_t d = 0; dl && d < sm->ndim; d++)
        if (mask & ((int64_t)1 << d)) {
            n *= (double)sm->sizes[d];
            PyObject *v = PyLong_FromLong(d);
            if (!v || PyList_Append(dl, v) < 0) Py_CLEAR(dl);
            Py_XDECREF(v);
        }
    if (!dl) return ag_fail_exc(ag), 0;
    IRArg dims = arg_const_steal(ag, dl);
    if (full && n - c <= 0) return ag_fail(ag, "var over %g elements with correction %g", n, c), 0;
    IRRef g = full ? args[0].u.ref : unsq(ag, args[0].u.ref, sm, &dims, &keepdim);
    IRArg ma[3] = {args[1], dims, arg_const_steal(ag, Py_NewRef(Py_True))};
    IRRef mean = g ? emit_method(ag, "mean", ma, sm->ndim ? 3 : 1) : 0;
    IRRef centered = mean ? emit_op(ag, "sub", args[1], arg_node(mean), 2) : 0;
    IRRef scaled = centered ? emit_op(ag, "mul", arg_const_steal(ag, PyFloat_FromDouble(2.0 / (n - c))), arg_node(g), 2) : 0;
    return scaled ? emit_op(ag, "mul", arg_node(scaled), arg_node(centered), 2) : 0;
}

/* repeatback(grad, self, repeats): Tensor.repeat's gradient (FunctionsManual.cpp repeat_backward):
 * the leading new dims summed, then each repeated dim split into (repeat, size) and the repeats
 * summed, in one reshape and one sum; zeros for a repeat of 0. torch.tile's dims are first padded
 * with leading 1s to self's rank. */
static IRRef repeat_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 3 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE || args[2].kind != IRARG_CONST)
        return ag_fail(ag, "repeatback: bad call"), 0;
    const IRMeta *sm = jmeta(ag, args[1].u.ref);
    PyObject *seq = PySequence_Tuple(args[2].u.obj);
    if (!seq || PyTuple_GET_SIZE(seq) > 32) return Py_XDECREF(seq), PyErr_Clear(), ag_fail(ag, "repeat: repeats not ints"), 0;
    int64_t rep[64];
    int32_t nr = (int32_t)PyTuple_GET_SIZE(seq), pad = nr < sm->ndim ? sm->ndim - nr : 0;
    for (int32_t i = 0; i < pad; i++) rep[i] = 1;
    for (int32_t i = 0; i < nr; i++) rep[pad + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    Py_DECREF(seq);
    nr += pad;
    if (PyErr_Occurred()) return PyErr_Clear(), ag_fail(ag, "repeat: repeats not ints"), 0;
    IRRef g = args[0].u.ref;
    for (int32_t i = 0; i < nr; i++)
        if (rep[i] == 0) {
            IRArg za[2] = {args[0], shape_const(ag, sm)};
            return emit_method(ag, "new_zeros", za, 2);
        }
    int32_t lead = nr - sm->ndim;
    if (lead > 0) {
        PyObject *dl = PyTuple_New(lead);
        for (int32_t i = 0; dl && i < lead; i++) PyTuple_SET_ITEM(dl, i, PyLong_FromLong(i));
        IRArg sa[2] = {arg_node(g), arg_const_steal(ag, dl)};
        if (!(g = emit_method(ag, "sum", sa, 2))) return 0;
    }
    PyObject *size = PyList_New(0), *sum_dims = PyList_New(0);
    for (int32_t d = 0; size && sum_dims && d < sm->ndim; d++) {
        if (rep[lead + d] != 1) {
            PyObject *r = PyLong_FromLongLong(rep[lead + d]), *i = PyLong_FromSsize_t(PyList_GET_SIZE(size));
            if (!r || !i || PyList_Append(size, r) < 0 || PyList_Append(sum_dims, i) < 0) Py_CLEAR(size);
            Py_XDECREF(r);
            Py_XDECREF(i);
        }
        PyObject *s = size ? PyLong_FromLongLong(sm->sizes[d]) : NULL;
        if (!s || PyList_Append(size, s) < 0) Py_CLEAR(size);
        Py_XDECREF(s);
    }
    if (!size || !sum_dims) return Py_XDECREF(size), Py_XDECREF(sum_dims), ag_fail_exc(ag), 0;
    IRArg ra[2] = {arg_node(g), arg_const_steal(ag, size)};
    if (!(g = emit_method(ag, "reshape", ra, 2))) return Py_DECREF(sum_dims), 0;
    if (!PyList_GET_SIZE(sum_dims)) return Py_DECREF(sum_dims), g;
    IRArg sa[2] = {arg_node(g), arg_const_steal(ag, sum_dims)};
    return emit_method(ag, "sum", sa, 2);
}

/* interpback(grad, self, result, scale_factor, mode, align_corners, recompute_scale_factor):
 * F.interpolate's gradient for a 4-d input in modes 'nearest' and 'bilinear' (the ops F.interpolate
 * calls, upsample_nearest2d / upsample_bilinear2d, and their backward ops in derivatives.yaml),
 * with the scale factors the forward passed (none when the size was given or recomputed). */
static IRRef interp_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 7 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE || args[2].kind != IRARG_NODE ||
        args[4].kind != IRARG_CONST || !PyUnicode_Check(args[4].u.obj))
        return ag_fail(ag, "interpolate: bad call"), 0;
    const IRMeta *sm = jmeta(ag, args[1].u.ref), *rm = jmeta(ag, args[2].u.ref);
    bool nearest = !PyUnicode_CompareWithASCIIString(args[4].u.obj, "nearest");
    bool bilinear = !PyUnicode_CompareWithASCIIString(args[4].u.obj, "bilinear");
    if (sm->ndim != 4 || rm->ndim != 4 || (!nearest && !bilinear)) return ag_fail(ag, "interpolate: not 4-d nearest or bilinear"), 0;
    PyObject *sh = Py_None, *sw = Py_None;
    IRArg sf = args[3], rsf = args[6];
    bool recompute = rsf.kind == IRARG_CONST && PyObject_IsTrue(rsf.u.obj) == 1;
    if (sf.kind != IRARG_CONST || rsf.kind != IRARG_CONST) return ag_fail(ag, "interpolate: non-constant scale"), 0;
    if (sf.u.obj != Py_None && !recompute) {
        if (PyNumber_Check(sf.u.obj)) {
            sh = sw = sf.u.obj;
        } else if (PySequence_Check(sf.u.obj) && PySequence_Size(sf.u.obj) == 2) {
            sh = em_arena_hold_steal(ag->a, PySequence_GetItem(sf.u.obj, 0));
            sw = em_arena_hold_steal(ag->a, PySequence_GetItem(sf.u.obj, 1));
            if (!sh || !sw) return ag_fail_exc(ag), 0;
        } else {
            return ag_fail(ag, "interpolate: scale_factor"), 0;
        }
    }
    PyObject *osz = Py_BuildValue("[LL]", (long long)rm->sizes[2], (long long)rm->sizes[3]);
    IRArg a[7] = {args[0], arg_const_steal(ag, osz), shape_const(ag, sm), {0}, {0}, {0}, {0}};
    uint32_t na = 3;
    if (bilinear) a[na++] = args[5].kind == IRARG_CONST && args[5].u.obj != Py_None ? args[5] : arg_const_steal(ag, Py_NewRef(Py_False));
    a[na++] = arg_const_steal(ag, Py_NewRef(sh));
    a[na++] = arg_const_steal(ag, Py_NewRef(sw));
    for (uint32_t i = 0; i < na; i++)
        if (arg_bad(&a[i])) return ag_fail_exc(ag), 0;
    return emit_fn(ag, nearest ? "ops.aten.upsample_nearest2d_backward" : "ops.aten.upsample_bilinear2d_backward", a, na);
}

/* A loss's elementwise gradient r divided by the input x's element count for reduction 'mean' (as
 * aten's *_backward kernels do); r itself for another reduction; 0 (ag->reason set) when r is 0. */
static IRRef loss_mean(AG *ag, IRRef r, IRRef x, PyObject *reduction) {
    if (!r || PyUnicode_CompareWithASCIIString(reduction, "mean")) {
        if (!r && !ag->reason) ag_fail(ag, "a loss's gradient could not be emitted");
        return r;
    }
    IRArg n = numel_arg(ag, x);
    return arg_bad(&n) ? 0 : emit_op(ag, "truediv", arg_node(r), n, 2);
}

static IRArg eval_expr(Eval *e);

static IRArg eval_call(Eval *e, const char *fname, IRArg *args, uint32_t nargs, PyObject **kwn, IRArg *kwv, uint32_t nkw) {
    AG *ag = e->ag;
    const IRMeta *selfm = NULL;
    for (uint32_t k = 0; k < nargs; k++) { /* a tuple of constants (varargs dims) as one constant */
        if (args[k].kind != IRARG_TUPLE && args[k].kind != IRARG_LIST) continue;
        bool allc = true;
        for (uint32_t i = 0; i < args[k].n; i++) allc &= args[k].u.items[i].kind == IRARG_CONST;
        if (!allc) continue;
        PyObject *t = PyTuple_New(args[k].n);
        for (uint32_t i = 0; t && i < args[k].n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(args[k].u.items[i].u.obj));
        args[k] = arg_const_steal(ag, t);
        if (arg_bad(&args[k])) goto bad;
    }
    /* helpers */
    if (ag->env && (!strcmp(fname, "size0") || !strcmp(fname, "padidx") || !strcmp(fname, "hw") ||
                    !strcmp(fname, "varback") || !strcmp(fname, "repeatback") || !strcmp(fname, "interpback"))) {
        /* helpers that read sizes as numbers: only static ones */
        for (uint32_t k = 0; k < nargs; k++)
            if (args[k].kind == IRARG_NODE && dims_symbolic(ag, jmeta(ag, args[k].u.ref), 0)) {
                ag_fail_sym(ag, "%s reads a symbolic size", fname);
                return arg_node(0);
            }
    }
    if (!strcmp(fname, "shape") || !strcmp(fname, "dtype") || !strcmp(fname, "size0")) {
        if (nargs != 1 || args[0].kind != IRARG_NODE) goto bad;
        selfm = jmeta(ag, args[0].u.ref);
        if (fname[0] == 's' && fname[1] == 'h') return shape_arg(ag, args[0].u.ref, 0);
        if (fname[0] == 'd') return arg_const_steal(ag, Py_NewRef(selfm->dtype));
        return arg_const_steal(ag, PyLong_FromLongLong(selfm->ndim ? selfm->sizes[0] : 1));
    }
    if (!strcmp(fname, "padidx")) { /* F.embedding: None -> -1, negative -> += num_weights */
        if (nargs != 2) goto bad;
        if (arg_is_none(&args[0])) return arg_const_steal(ag, PyLong_FromLong(-1));
        long long p = PyLong_AsLongLong(args[0].u.obj);
        if (PyErr_Occurred()) goto bad;
        if (p < 0) p += jmeta(ag, args[1].u.ref)->sizes[0];
        return arg_const_steal(ag, PyLong_FromLongLong(p));
    }
    if (!strcmp(fname, "redenum")) { /* a loss's reduction as at::Reduction (aten/src/ATen/core/Reduction.h) */
        if (nargs != 1 || args[0].kind != IRARG_CONST || !PyUnicode_Check(args[0].u.obj)) goto bad;
        return eval_redenum(ag, args[0]);
    }
    if (!strcmp(fname, "l1back")) { /* l1_loss(x, y): sign(x - y) * grad, / numel for 'mean' */
        if (nargs != 4 || args[3].kind != IRARG_CONST || !PyUnicode_Check(args[3].u.obj)) goto bad;
        IRRef d = emit_op(ag, "sub", args[1], args[2], 2);
        IRArg da[1] = {arg_node(d)};
        IRRef sg = d ? emit_fn(ag, "sign", da, 1) : 0;
        IRRef r = sg ? emit_op(ag, "mul", arg_node(sg), args[0], 2) : 0;
        return arg_node(loss_mean(ag, r, args[1].u.ref, args[3].u.obj));
    }
    if (!strcmp(fname, "hw")) { /* the last two sizes (col2im's output size) */
        if (nargs != 1 || args[0].kind != IRARG_NODE) goto bad;
        const IRMeta *m = jmeta(ag, args[0].u.ref);
        if (m->ndim < 2) goto bad;
        return arg_const_steal(ag, Py_BuildValue("[LL]", (long long)m->sizes[m->ndim - 2], (long long)m->sizes[m->ndim - 1]));
    }
    if (!strcmp(fname, "tup")) { /* an int dim as a one-element tuple (flip's dims) */
        if (nargs != 1 || args[0].kind != IRARG_CONST) goto bad;
        return PyLong_Check(args[0].u.obj) ? arg_const_steal(ag, PyTuple_Pack(1, args[0].u.obj)) : args[0];
    }
    if (!strcmp(fname, "negs")) { /* -x of an int or of each int of a tuple (roll's shifts, a pad) */
        if (nargs != 1 || args[0].kind != IRARG_CONST) goto bad;
        PyObject *v = args[0].u.obj;
        if (PyLong_Check(v)) return arg_const_steal(ag, PyNumber_Negative(v));
        PyObject *seq = PySequence_Tuple(v);
        if (!seq) goto bad;
        PyObject *out = PyTuple_New(PyTuple_GET_SIZE(seq));
        for (Py_ssize_t i = 0; out && i < PyTuple_GET_SIZE(seq); i++) {
            PyObject *x = PyNumber_Negative(PyTuple_GET_ITEM(seq, i));
            if (!x) Py_CLEAR(out);
            else PyTuple_SET_ITEM(out, i, x);
        }
        Py_DECREF(seq);
        if (!out) goto bad;
        return arg_const_steal(ag, out);
    }
    if (!strcmp(fname, "unsq")) { /* unsq(x, self, dim, keepdim): x broadcastable against self again */
        if (nargs != 4 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE) goto bad;
        return arg_node(unsq(ag, args[0].u.ref, jmeta(ag, args[1].u.ref), &args[2], &args[3]));
    }
    if (!strcmp(fname, "varback")) return arg_node(var_backward(ag, args, nargs));
    if (!strcmp(fname, "repeatback")) return arg_node(repeat_backward(ag, args, nargs));
    if (!strcmp(fname, "interpback")) return arg_node(interp_backward(ag, args, nargs));
    if (!strcmp(fname, "bcelback")) { /* binary_cross_entropy_with_logits' input gradient (FunctionsManual.cpp):
                                          * (sigmoid(x) - t) or ((pw * t + 1 - t) * sigmoid(x) - pw * t), times
                                          * grad and weight, / numel for 'mean' */
        if (nargs != 6 || args[1].kind != IRARG_NODE || args[5].kind != IRARG_CONST || !PyUnicode_Check(args[5].u.obj)) goto bad;
        IRArg ea[1] = {args[1]};
        IRRef sg = emit_fn(ag, "sigmoid", ea, 1), r;
        if (arg_is_none(&args[4])) {
            r = sg ? emit_op(ag, "sub", arg_node(sg), args[2], 2) : 0;
        } else {
            IRRef t = sg ? emit_op(ag, "mul", args[4], args[2], 2) : 0;
            IRRef t1 = t ? emit_op(ag, "add", arg_node(t), arg_const_steal(ag, PyLong_FromLong(1)), 2) : 0;
            IRRef t2 = t1 ? emit_op(ag, "sub", arg_node(t1), args[2], 2) : 0;
            IRRef t3 = t2 ? emit_op(ag, "mul", arg_node(t2), arg_node(sg), 2) : 0;
            r = t3 ? emit_op(ag, "sub", arg_node(t3), arg_node(t), 2) : 0;
        }
        r = r ? emit_op(ag, "mul", arg_node(r), args[0], 2) : 0;
        if (r && !arg_is_none(&args[3])) r = emit_op(ag, "mul", arg_node(r), args[3], 2);
        return arg_node(loss_mean(ag, r, args[1].u.ref, args[5].u.obj));
    }
    if (!strcmp(fname, "stride_or_kernel")) { /* pooling: stride None means the kernel size */
        if (nargs != 2) goto bad;
        return arg_is_none(&args[0]) ? args[1] : args[0];
    }
    if (!strcmp(fname, "numel_ratio")) {
        int64_t a = 1, b = 1;
        const IRMeta *ma = jmeta(ag, args[0].u.ref), *mb = jmeta(ag, args[1].u.ref);
        for (int32_t i = 0; i < ma->ndim; i++) a *= ma->sizes[i];
        for (int32_t i = 0; i < mb->ndim; i++) b *= mb->sizes[i];
        if (b && (dims_symbolic(ag, ma, 0) || dims_symbolic(ag, mb, 0)) && !numel_ratio_const(ag, ma, mb)) {
            /* numel(a) // numel(b), ints of the forward (symbolic dims are >= 2: b == 0 is a static 0 dim) */
            IRArg na = numel_arg(ag, args[0].u.ref), nb = arg_bad(&na) ? na : numel_arg(ag, args[1].u.ref);
            if (arg_bad(&nb)) return arg_node(0);
            uint8_t role = ag->cur_role;
            ag->cur_role = ROLE_FWD;
            IRRef q = emit_op(ag, "floordiv", na, nb, 2);
            ag->cur_role = role;
            return arg_node(q);
        }
        return arg_const_steal(ag, PyLong_FromLongLong(b ? a / b : 1));
    }
    if (!strcmp(fname, "invperm")) {
        PyObject *d = args[0].kind == IRARG_CONST ? PySequence_Tuple(args[0].u.obj) : NULL;
        if (!d) goto bad;
        Py_ssize_t n = PyTuple_GET_SIZE(d);
        PyObject *inv = PyTuple_New(n);
        for (Py_ssize_t i = 0; inv && i < n; i++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(d, i));
            if (v < 0) v += (long)n;
            if (v < 0 || v >= n || PyErr_Occurred()) {
                Py_CLEAR(inv);
                break;
            }
            PyTuple_SET_ITEM(inv, v, PyLong_FromSsize_t(i));
        }
        Py_DECREF(d);
        if (!inv) goto bad;
        return arg_const_steal(ag, inv);
    }
    if (!strcmp(fname, "flat2")) {
        const IRMeta *m = jmeta(ag, args[0].u.ref);
        if (dims_symbolic(ag, m, m->ndim - 1)) {
            ag_fail_sym(ag, "flat2 of a symbolic last dim");
            return arg_node(0);
        }
        PyObject *shape = Py_BuildValue("(iL)", -1, (long long)(m->ndim ? m->sizes[m->ndim - 1] : 1));
        IRArg a[2] = {args[0], arg_const_steal(ag, shape)};
        return arg_node(emit_method(ag, "reshape", a, 2));
    }
    if (!strcmp(fname, "like")) {
        const IRMeta *want = jmeta(ag, args[1].u.ref), *m = jmeta(ag, args[0].u.ref);
        int same_dev = PyObject_RichCompareBool(want->device, m->device, Py_EQ);
        if (same_dev != 1) { /* a copy between devices: the meta call cannot express it */
            PyErr_Clear();
            ag_fail(ag, "a copy between devices (%S -> %S)", m->device, want->device);
            return arg_node(0);
        }
        if (want->dtype == m->dtype) return args[0];
        IRArg a[2] = {args[0], arg_const_steal(ag, Py_NewRef(want->dtype))};
        return arg_node(emit_method(ag, "to", a, 2));
    }
    if (!strcmp(fname, "sumback")) { /* sum's backward: unsqueeze the reduced dims, expand */
        if (nargs != 4) goto bad;
        selfm = jmeta(ag, args[1].u.ref);
        IRRef x = unsq(ag, args[0].u.ref, selfm, &args[2], &args[3]);
        if (!x) return arg_node(0);
        IRArg a[2] = {arg_node(x), shape_arg(ag, args[1].u.ref, 0)};
        return arg_node(emit_method(ag, "expand", a, 2));
    }
    if (!strcmp(fname, "amaxback")) { /* torch: grad distributed evenly among the maxima */
        if (nargs != 5) goto bad;
        selfm = jmeta(ag, args[1].u.ref);
        IRRef g = unsq(ag, args[0].u.ref, selfm, &args[3], &args[4]);
        IRRef r = g ? unsq(ag, args[2].u.ref, selfm, &args[3], &args[4]) : 0;
        IRRef mask = r ? emit_op(ag, "eq", args[1], arg_node(r), 2) : 0;
        if (!mask) return arg_node(0);
        int64_t dm = dims_mask(&args[3], selfm->ndim);
        PyObject *dims = PyList_New(0);
        for (int32_t d = 0; dims && d < selfm->ndim; d++)
            if (dm & ((int64_t)1 << d)) {
                PyObject *v = PyLong_FromLong(d);
                if (!v || PyList_Append(dims, v) < 0) Py_CLEAR(dims);
                Py_XDECREF(v);
            }
        IRArg sa[3] = {arg_node(mask), arg_const_steal(ag, dims), arg_const_steal(ag, Py_NewRef(Py_True))};
        IRRef count = selfm->ndim ? emit_method(ag, "sum", sa, 3) : emit_method(ag, "sum", sa, 1);
        IRRef scaled = count ? emit_op(ag, "truediv", arg_node(g), arg_node(count), 2) : 0;
        return arg_node(scaled ? emit_op(ag, "mul", arg_node(scaled), arg_node(mask), 2) : 0);
    }
    /* Python operators, constants folded, multiplication by 1 dropped */
    static const char *const ops[][2] = {{"add", "add"}, {"sub", "sub"}, {"mul", "mul"}, {"div", "truediv"}, {"neg", "neg"}};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        if (strcmp(fname, ops[i][0])) continue;
        bool allconst = true;
        for (uint32_t k = 0; k < nargs; k++) allconst &= args[k].kind == IRARG_CONST;
        if (allconst) {
            PyObject *mod = PyImport_ImportModule("operator");
            PyObject *f = mod ? PyObject_GetAttrString(mod, ops[i][1]) : NULL;
            PyObject *r = NULL;
            if (f) r = nargs == 1 ? PyObject_CallOneArg(f, args[0].u.obj)
                                  : PyObject_CallFunctionObjArgs(f, args[0].u.obj, args[1].u.obj, NULL);
            Py_XDECREF(mod);
            Py_XDECREF(f);
            if (!r) goto bad;
            return arg_const_steal(ag, r);
        }
        bool one1 = nargs == 2 && args[1].kind == IRARG_CONST && PyNumber_Check(args[1].u.obj) &&
                    !PyBool_Check(args[1].u.obj) && PyFloat_AsDouble(args[1].u.obj) == 1.0;
        bool one0 = nargs == 2 && args[0].kind == IRARG_CONST && PyNumber_Check(args[0].u.obj) &&
                    !PyBool_Check(args[0].u.obj) && PyFloat_AsDouble(args[0].u.obj) == 1.0;
        PyErr_Clear();
        if ((i == 2 || i == 3) && one1) return args[0];
        if (i == 2 && one0) return args[1];
        return arg_node(emit_op(ag, ops[i][1], args[0], nargs > 1 ? args[1] : args[0], nargs));
    }
    for (uint32_t k = 0; k < nargs; k++)
        if (arg_bad(&args[k])) return arg_node(0);
    PyObject *target;
    IRKind kind = IR_CALL_FUNCTION;
    if (!strncmp(fname, "T.", 2)) {
        target = PyUnicode_InternFromString(fname + 2);
        kind = IR_CALL_METHOD;
    } else if (!strncmp(fname, "aten.", 5)) {
        char buf[96];
        snprintf(buf, sizeof buf, "ops.%s", fname);
        target = torch_attr(buf);
    } else {
        target = torch_attr(fname);
    }
    if (!target || !em_arena_hold_steal(ag->a, target)) goto bad;
    return arg_node(ag_emit(ag, kind, target, args, nargs, kwn, kwv, nkw));
bad:
    if (PyErr_Occurred()) ag_fail_exc(ag);
    else ag_fail(ag, "bad derivative formula call %s", fname);
    return arg_node(0);
}

static IRArg eval_expr(Eval *e) {
    AG *ag = e->ag;
    skip_ws(e);
    const char *s = e->p;
    if (*s == '\'') { /* a string: 'trunc' */
        const char *q = strchr(s + 1, '\'');
        if (!q) {
            ag_fail(ag, "bad derivative formula at %s", s);
            return arg_node(0);
        }
        e->p = q + 1;
        return arg_const_steal(ag, literal(s, (size_t)(q + 1 - s)));
    }
    if (*s == '-' || (*s >= '0' && *s <= '9')) {
        const char *q = s + 1;
        while ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e') q++;
        e->p = q;
        return arg_const_steal(ag, literal(s, (size_t)(q - s)));
    }
    const char *q = s;
    while ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '_' || *q == '.') q++;
    char name[64];
    size_t nl = (size_t)(q - s);
    if (!nl || nl >= sizeof name) {
        ag_fail(ag, "bad derivative formula at %s", s);
        return arg_node(0);
    }
    memcpy(name, s, nl);
    name[nl] = '\0';
    e->p = q;
    skip_ws(e);
    if (*e->p != '(') {
        if (!strcmp(name, "grad")) return arg_node(ag->grad[e->n]);
        if (!strcmp(name, "result")) return arg_node(ag->fmap[e->n]);
        int i = find_param(e->b, name);
        if (i >= 0) return map_arg(ag, &e->b->val[i]);
        if (!strcmp(name, "None") || !strcmp(name, "True") || !strcmp(name, "False") || !strcmp(name, "inf"))
            return arg_const_steal(ag, literal(name, nl));
        ag_fail(ag, "derivative formula names %s, which is not a parameter", name);
        return arg_node(0);
    }
    e->p++;
    IRArg args[8];
    IRArg kwv[4];
    PyObject *kwn[4];
    uint32_t na = 0, nk = 0;
    for (;;) {
        skip_ws(e);
        if (*e->p == ')') {
            e->p++;
            break;
        }
        /* keyword argument? */
        const char *k = e->p;
        while ((*k >= 'a' && *k <= 'z') || *k == '_') k++;
        if (*k == '=' && k > e->p && nk < 4) {
            kwn[nk] = em_arena_hold_steal(ag->a, PyUnicode_FromStringAndSize(e->p, k - e->p));
            e->p = k + 1;
            kwv[nk] = eval_expr(e);
            if (!kwn[nk] || arg_bad(&kwv[nk])) return arg_node(0);
            nk++;
        } else {
            if (na >= 8) return arg_node(0);
            args[na] = eval_expr(e);
            if (arg_bad(&args[na])) return arg_node(0);
            na++;
        }
        skip_ws(e);
        if (*e->p == ',') e->p++;
    }
    return eval_call(e, name, args, na, kwn, kwv, nk);
}

/* ---------------------------------------------------------------- rules: generic and special */

static bool collect_grad_refs(const AG *ag, const IRArg *a, bool top, bool *nested) {
    bool any = false;
    if (a->kind == IRARG_NODE) return meta_needs_grad(&em_ir_node(ag->g, a->u.ref)->meta);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (collect_grad_refs(ag, &a->u.items[i], false, nested)) {
                any = true;
                *nested = true;
            }
    EM_UNUSED(top);
    return any;
}

/* Finds the formula of a parameter in "p: expr; q: expr". */
static const char *formula_of(const char *grads, const char *pname) {
    size_t n = strlen(pname);
    const char *p = grads;
    while (*p) {
        while (*p == ' ' || *p == ';') p++;
        if (!strncmp(p, pname, n) && p[n] == ':') return p + n + 1;
        /* skip to the next top-level ';' */
        int depth = 0;
        while (*p && (depth || *p != ';')) {
            if (*p == '(') depth++;
            if (*p == ')') depth--;
            p++;
        }
    }
    return NULL;
}

static int backward_generic(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    /* every argument that requires grad must be a parameter with a formula */
    for (uint32_t i = 0; i < node->nargs + node->nkwargs; i++) {
        const IRArg *a = i < node->nargs ? &node->args[i] : &node->kwargs[i - node->nargs];
        bool nested = false;
        if (!collect_grad_refs(ag, a, true, &nested)) continue;
        if (nested) return ag_fail(ag, "%s: a tensor that requires grad inside a list argument", node->name);
        int pi = -1;
        for (int k = 0; k < b->np && pi < 0; k++)
            if (b->val[k].kind == IRARG_NODE && b->val[k].u.ref == a->u.ref) pi = k;
        if (pi < 0 || !formula_of(b->rule->grads, b->p[pi].name))
            return ag_fail(ag, "no derivative formula for argument %s of %s", pi < 0 ? "?" : b->p[pi].name, node->name);
    }
    for (int k = 0; k < b->np; k++) {
        const IRArg *v = &b->val[k];
        if (v->kind != IRARG_NODE || !meta_needs_grad(&em_ir_node(ag->g, v->u.ref)->meta)) continue;
        const char *f = formula_of(b->rule->grads, b->p[k].name);
        while (*f == ' ') f++;
        if (!strncmp(f, "nograd", 6) && (f[6] == ';' || f[6] == '\0')) continue; /* read for its shape only */
        Eval e = {ag, b, n, f};
        IRArg gi = eval_expr(&e);
        if (gi.kind != IRARG_NODE || !gi.u.ref) {
            if (!ag->reason) ag_fail(ag, "derivative of %s is not a tensor", node->name);
            return -1;
        }
        if (accumulate(ag, v->u.ref, gi.u.ref) < 0) return -1;
    }
    return 0;
}

static IRArg bval(const Bind *b, const char *name) {
    int i = find_param(b, name);
    return b->val[i];
}

static bool needs(const AG *ag, const IRArg *v) {
    return v->kind == IRARG_NODE && meta_needs_grad(&em_ir_node(ag->g, v->u.ref)->meta);
}

static PyObject *bool_list(bool a, bool b, bool c) {
    return Py_BuildValue("[OOO]", a ? Py_True : Py_False, b ? Py_True : Py_False, c ? Py_True : Py_False);
}

/* A constant int or tuple of ints as a list of n ints (conv's stride/padding/dilation). */
static PyObject *int_list(PyObject *v, int n) {
    if (PyLong_Check(v)) {
        PyObject *l = PyList_New(n);
        for (int i = 0; l && i < n; i++) PyList_SET_ITEM(l, i, Py_NewRef(v));
        return l;
    }
    if (PyTuple_Check(v) || PyList_Check(v)) {
        if (PySequence_Size(v) == 1 && n > 1) {
            PyObject *x = PySequence_GetItem(v, 0);
            PyObject *l = x ? int_list(x, n) : NULL;
            Py_XDECREF(x);
            return l;
        }
        return PySequence_List(v);
    }
    PyErr_SetString(PyExc_TypeError, "not an int list");
    return NULL;
}

/* A tuple/list argument of constants as one constant tuple (else returned as is). */
static IRArg const_fold(AG *ag, IRArg a) {
    if (a.kind != IRARG_TUPLE && a.kind != IRARG_LIST) return a;
    for (uint32_t i = 0; i < a.n; i++)
        if (a.u.items[i].kind != IRARG_CONST) return a;
    PyObject *t = PyTuple_New(a.n);
    for (uint32_t i = 0; t && i < a.n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(a.u.items[i].u.obj));
    IRArg c = arg_const_steal(ag, t);
    if (arg_bad(&c)) PyErr_Clear();
    return arg_bad(&c) ? a : c;
}

/* Accumulates items 0, 1, 2 of the tuple r (a backward op's gradients) into the inputs a, b, c
 * that need one. 0, or -1 on failure. */
static int accumulate_items(AG *ag, IRRef r, const IRArg *a, const IRArg *b, const IRArg *c) {
    const IRArg *ins[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (needs(ag, ins[i])) {
            IRRef gi = emit_getitem(ag, r, i);
            if (!gi || accumulate(ag, ins[i]->u.ref, gi) < 0) return -1;
        }
    return 0;
}

static bool same_strides(const IRMeta *a, const IRMeta *b);

/* x[indices]'s gradient: index_put(zeros, indices, grad, accumulate=True) (repeated indices add, as
 * eager's IndexBackward), accumulated into self's gradient. */
static int index_put_grad(AG *ag, IRRef self, IRRef zeros, IRArg indices, IRRef g) {
    PyObject *t = torch_attr("ops.aten.index_put");
    if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
    IRArg ia[4] = {arg_node(zeros), indices, arg_node(g), arg_const_steal(ag, Py_NewRef(Py_True))};
    IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, ia, 4, NULL, NULL, 0);
    return r ? accumulate(ag, self, r) : -1;
}

/* A list argument whose items are all constants ([1, 2] inside x[:, [1, 2]]). */
static bool const_list(const IRArg *a) {
    if (a->kind != IRARG_LIST) return false;
    for (uint32_t i = 0; i < a->n; i++)
        if (a->u.items[i].kind != IRARG_CONST) return false;
    return true;
}

/* The gradient of x[idx] for an advanced index of constant lists: a top-level list (x[[0, -1]]) or
 * a tuple of full slices and lists (x[:, [1, 2]]): index_put(zeros, [None | tensor(list), ...],
 * grad, accumulate=True), as eager's IndexBackward (repeated indices add). Other forms keep eager
 * autograd (the region's fallback names the node). */
static int index_list_backward(AG *ag, IRRef self, IRRef g, const IRArg *idx, const char *name) {
    const IRMeta *selfm = &em_ir_node(ag->g, self)->meta;
    PyObject *items = NULL;
    if (idx->kind == IRARG_LIST || (idx->kind == IRARG_CONST && PyList_Check(idx->u.obj))) {
        items = PyTuple_New(1);
        PyObject *l = idx->kind == IRARG_CONST ? Py_NewRef(idx->u.obj) : PyList_New(idx->n);
        for (uint32_t i = 0; l && idx->kind == IRARG_LIST && i < idx->n; i++)
            PyList_SET_ITEM(l, i, Py_NewRef(idx->u.items[i].u.obj));
        if (items && l) {
            PyTuple_SET_ITEM(items, 0, l);
        } else {
            Py_CLEAR(items);
            Py_XDECREF(l);
        }
    } else if (idx->kind == IRARG_TUPLE || (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj))) {
        Py_ssize_t n = idx->kind == IRARG_TUPLE ? (Py_ssize_t)idx->n : PyTuple_GET_SIZE(idx->u.obj);
        items = PyTuple_New(n);
        for (Py_ssize_t i = 0; items && i < n; i++) {
            const IRArg *it = idx->kind == IRARG_TUPLE ? &idx->u.items[i] : NULL;
            PyObject *v = NULL;
            if (!it) {
                v = Py_NewRef(PyTuple_GET_ITEM(idx->u.obj, i));
            } else if (it->kind == IRARG_LIST) { /* [1, 2] inside the tuple: its constants */
                v = PyList_New(it->n);
                for (uint32_t k = 0; v && k < it->n; k++) PyList_SET_ITEM(v, k, Py_NewRef(it->u.items[k].u.obj));
            } else {
                v = Py_NewRef(it->u.obj);
            }
            if (!v) {
                Py_CLEAR(items);
                break;
            }
            PyTuple_SET_ITEM(items, i, v);
        }
    }
    if (!items) return PyErr_Occurred() ? ag_fail_exc(ag) : ag_fail(ag, "%s: advanced indexing with a list", name);
    /* indices: None for a full slice, an int64 tensor on self's device for a list of ints */
    PyObject *tensor = torch_attr("tensor"), *i64 = torch_dtype("int64");
    PyObject *lst = tensor ? PyList_New(PyTuple_GET_SIZE(items)) : NULL;
    bool ok = lst && PyTuple_GET_SIZE(items) <= selfm->ndim;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(items); i++) {
        PyObject *it = PyTuple_GET_ITEM(items, i), *v = NULL;
        if (PySlice_Check(it)) {
            PySliceObject *sl = (PySliceObject *)it;
            ok = sl->start == Py_None && sl->stop == Py_None && sl->step == Py_None;
            v = Py_NewRef(Py_None);
        } else if (PyList_Check(it)) {
            for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(it); k++)
                ok = PyLong_Check(PyList_GET_ITEM(it, k)) && !PyBool_Check(PyList_GET_ITEM(it, k));
            PyObject *kw = ok ? Py_BuildValue("{s:O,s:O}", "dtype", i64, "device", selfm->device) : NULL;
            PyObject *a = kw ? PyTuple_Pack(1, it) : NULL;
            v = a ? PyObject_Call(tensor, a, kw) : NULL;
            Py_XDECREF(a);
            Py_XDECREF(kw);
            ok = ok && v;
        } else {
            ok = false;
        }
        if (v) PyList_SET_ITEM(lst, i, v);
        else PyList_SET_ITEM(lst, i, Py_NewRef(Py_None));
    }
    Py_XDECREF(tensor);
    Py_DECREF(items);
    if (!ok) {
        Py_XDECREF(lst);
        PyErr_Clear();
        return ag_fail(ag, "%s: advanced indexing with a list", name);
    }
    IRArg a[2] = {arg_node(g), shape_const(ag, selfm)}, il = arg_const_steal(ag, lst);
    IRRef z = arg_bad(&il) ? 0 : emit_method(ag, "new_zeros", a, 2);
    return z ? index_put_grad(ag, self, z, il, g) : -1;
}

/* Basic indexing x[idx] with constant ints, slices (positive steps), None and Ellipsis, as torch
 * applies it (applySlicing, aten/src/ATen/TensorIndexing.h): a chain of select / slice / unsqueeze
 * over x's dims. Its gradient undoes the chain in reverse with the functional ops eager's
 * SelectBackward / SliceBackward run (aten select_backward / slice_backward: zeros outside the
 * view, the gradient inside), a squeeze for each None, nothing for a slice that takes the whole dim
 * (x[:, 0:] of GPT-2's LM head). 1: accumulated into x's gradient; 0: idx is not such an index;
 * -1: failed (ag->reason). Before, every basic index was zeros(x)[idx].copy_(grad): an in-place
 * update through a view, which ember's lowering refuses (the backward ran on the eager backend). */
static int basic_index_backward(AG *ag, IRRef self, IRRef g, const IRArg *idx) {
    const IRMeta *xm = &em_ir_node(ag->g, self)->meta;
    enum { MAXI = 32, MAXD = 64 };
    PyObject *items[MAXI];
    int ni = 0;
    if (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj)) {
        if (PyTuple_GET_SIZE(idx->u.obj) > MAXI) return 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(idx->u.obj); i++) items[ni++] = PyTuple_GET_ITEM(idx->u.obj, i);
    } else if (idx->kind == IRARG_CONST) {
        items[ni++] = idx->u.obj;
    } else if (idx->kind == IRARG_TUPLE) {
        if (idx->n > MAXI) return 0;
        for (uint32_t i = 0; i < idx->n; i++) {
            if (idx->u.items[i].kind != IRARG_CONST) return 0;
            items[ni++] = idx->u.items[i].u.obj;
        }
    } else {
        return 0;
    }
    int consume = 0, ellipses = 0;
    for (int i = 0; i < ni; i++) {
        PyObject *it = items[i];
        if (it == Py_Ellipsis) ellipses++;
        else if (PyLong_CheckExact(it) || PySlice_Check(it)) consume++;
        else if (it != Py_None) return 0;
        if (PySlice_Check(it)) {
            PySliceObject *sl = (PySliceObject *)it;
            if ((sl->start != Py_None && !PyLong_CheckExact(sl->start)) || (sl->stop != Py_None && !PyLong_CheckExact(sl->stop)) ||
                (sl->step != Py_None && !PyLong_CheckExact(sl->step)))
                return 0;
        }
    }
    if (ellipses > 1 || consume > xm->ndim || xm->ndim + ni > MAXD) return 0;
    /* the forward chain: each step's kind, dim and arguments, and the sizes before it (org: the dim
     * of x each dim is, untouched; -1 a static one made by a step; -2 a symbolic one a step
     * sliced, whose size is known to no size node). Steps on symbolic dims keep the index as
     * written (select_backward / slice_backward resolve negative and clamp as the forward did). */
    typedef struct { char kind; int dim; long long a, b, c; int nd; int64_t sizes[MAXD]; int8_t org[MAXD]; } Step;
    Step steps[MAXI];
    int ns = 0, nd = xm->ndim, cd = 0;
    int64_t cur[MAXD];
    int8_t org[MAXD];
    for (int d = 0; d < nd; d++) {
        cur[d] = xm->sizes[d];
        org[d] = (int8_t)d;
    }
#define SYMDIM(d)                                                                                                  \
    (org[d] == -2 || (org[d] >= 0 && xm->sym_sizes && ag->env && !em_sym_is_const(ag->env, xm->sym_sizes[org[d]], NULL)))
    for (int i = 0; i < ni; i++) {
        PyObject *it = items[i];
        if (it == Py_Ellipsis) {
            cd += xm->ndim - consume;
            continue;
        }
        Step *st = &steps[ns++];
        st->nd = nd;
        memcpy(st->sizes, cur, sizeof(int64_t) * (size_t)nd);
        memcpy(st->org, org, (size_t)nd);
        st->dim = cd;
        if (it == Py_None) { /* unsqueeze(cd) */
            st->kind = 'n';
            memmove(cur + cd + 1, cur + cd, sizeof(int64_t) * (size_t)(nd - cd));
            memmove(org + cd + 1, org + cd, (size_t)(nd - cd));
            cur[cd] = 1;
            org[cd] = -1;
            nd++;
            cd++;
        } else if (PyLong_CheckExact(it)) { /* select(cd, i) */
            long long k = PyLong_AsLongLong(it);
            if (PyErr_Occurred()) return ag_fail_exc(ag);
            long long raw = k;
            if (k < 0) k += cur[cd];
            if (k < 0 || k >= cur[cd]) return 0; /* eager raised in the forward already */
            st->kind = 's';
            st->a = SYMDIM(cd) ? raw : k;
            memmove(cur + cd, cur + cd + 1, sizeof(int64_t) * (size_t)(nd - cd - 1));
            memmove(org + cd, org + cd + 1, (size_t)(nd - cd - 1));
            nd--;
        } else { /* slice(cd, start, stop, step) */
            Py_ssize_t start, stop, step;
            PySliceObject *sl = (PySliceObject *)it;
            if (PySlice_Unpack(it, &start, &stop, &step) < 0) return ag_fail_exc(ag);
            if (step <= 0) return 0;
            if (SYMDIM(cd)) { /* whole for every size, or a part as written */
                bool whole = (sl->start == Py_None || start == 0) && sl->stop == Py_None && step == 1;
                st->kind = whole ? 'i' : 'l';
                st->a = start; /* (PySlice_Unpack: None -> 0 / PY_SSIZE_T_MAX, as written otherwise) */
                st->b = stop;
                st->c = step;
                if (!whole) org[cd] = -2;
                cur[cd] = PySlice_AdjustIndices((Py_ssize_t)cur[cd], &start, &stop, step);
                cd++;
                continue;
            }
            Py_ssize_t len = PySlice_AdjustIndices((Py_ssize_t)cur[cd], &start, &stop, step);
            st->kind = start == 0 && len == cur[cd] && (step == 1 || len <= 1) ? 'i' : 'l';
            if (st->kind != 'i') org[cd] = -1;
            st->a = start;
            st->b = stop < start ? start : stop;
            st->c = step;
            cur[cd] = len;
            cd++;
        }
    }
#undef SYMDIM
    IRRef r = g;
    for (int i = ns - 1; i >= 0 && r; i--) {
        const Step *st = &steps[i];
        if (st->kind == 'i') continue;
        /* the sizes before the step: x's own (size_arg: symbolic ones read from x) where untouched */
        IRArg before = {0};
        before.kind = IRARG_TUPLE;
        before.n = (uint32_t)st->nd;
        before.u.items = em_arena_alloc(ag->a, (size_t)(st->nd + 1) * sizeof(IRArg));
        if (!before.u.items) return PyErr_NoMemory(), ag_fail_exc(ag);
        for (int d = 0; d < st->nd; d++) {
            if (st->org[d] == -2) return ag_fail_sym(ag, "a step after a part of a symbolic dim");
            before.u.items[d] = st->org[d] >= 0 ? size_arg(ag, ag->fmap[self], st->org[d])
                                                : arg_const_steal(ag, PyLong_FromLongLong(st->sizes[d]));
            if (arg_bad(&before.u.items[d])) return -1;
        }
        bool allc = true;
        for (int d = 0; d < st->nd; d++) allc &= before.u.items[d].kind == IRARG_CONST;
        if (allc) { /* a static shape: one constant tuple, as shape_const makes it */
            PyObject *t = PyTuple_New(st->nd);
            for (int d = 0; t && d < st->nd; d++) PyTuple_SET_ITEM(t, d, Py_NewRef(before.u.items[d].u.obj));
            before = arg_const_steal(ag, t);
            if (arg_bad(&before)) return ag_fail_exc(ag);
        }
        if (st->kind == 'n') {
            IRArg a[2] = {arg_node(r), arg_const_steal(ag, PyLong_FromLong(st->dim))};
            r = emit_method(ag, "squeeze", a, 2);
            continue;
        }
        PyObject *t = torch_attr(st->kind == 's' ? "ops.aten.select_backward" : "ops.aten.slice_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg a[6] = {arg_node(r), before, arg_const_steal(ag, PyLong_FromLong(st->dim)),
                      arg_const_steal(ag, PyLong_FromLongLong(st->a)), arg_const_steal(ag, PyLong_FromLongLong(st->b)),
                      arg_const_steal(ag, PyLong_FromLongLong(st->c))};
        r = ag_emit(ag, IR_CALL_FUNCTION, t, a, st->kind == 's' ? 4 : 6, NULL, NULL, 0);
    }
    if (!r) return -1;
    return accumulate(ag, self, r) < 0 ? -1 : 1;
}

/* getitem t[k] of a tuple t that split / chunk / unbind made: g is piece k's gradient, kept for
 * t's own rule (SP_SPLIT), which runs after every reader of t (reverse order). A tuple of any
 * other op keeps eager autograd. */
static int tuple_piece_grad(AG *ag, IRRef t, const IRArg *idx, IRRef g) {
    const IRNode *tn = em_ir_node(ag->g, t);
    Bind tb;
    const Rule *tr = find_rule(ag, tn, &tb);
    if (!tr || (tr->special != SP_SPLIT && tr->special != SP_VALSEL)) {
        PyObject *qn = node_opname(tn);
        ag_fail(ag, "no derivative rule for %S (node %s, a tuple result)", qn ? qn : Py_None, tn->name);
        Py_XDECREF(qn);
        PyErr_Clear();
        return -1;
    }
    long long k = idx->kind == IRARG_CONST && PyLong_Check(idx->u.obj) && !PyBool_Check(idx->u.obj)
                      ? PyLong_AsLongLong(idx->u.obj) : -(1LL << 62);
    if (PyErr_Occurred()) return ag_fail_exc(ag);
    int64_t np = tn->meta.nitems;
    if (k < 0) k += np;
    if (k < 0 || k >= np) return ag_fail(ag, "%s indexed by something other than an int", tn->name);
    struct Pieces *pc = &ag->pieces[t];
    if (!pc->part) {
        pc->n = np;
        pc->part = em_arena_alloc(ag->a, (size_t)(np ? np : 1) * sizeof(IRRef));
        if (!pc->part) return -1;
        memset(pc->part, 0, (size_t)(np ? np : 1) * sizeof(IRRef));
    }
    if (pc->part[k]) g = emit_op(ag, "add", arg_node(pc->part[k]), arg_node(g), 2);
    if (!g) return -1;
    pc->part[k] = g;
    return 0;
}

/* split / chunk / unbind of self into the tuple n: self's gradient is cat (stack for unbind) of
 * the pieces' gradients along dim, zeros of a piece's shape where none reached it, as eager's
 * SplitBackward / UnbindBackward give. Every reader of n must be an int getitem (anything else
 * read the tuple whole: eager autograd). */
/* Is every reader of the tuple n an int getitem (its pieces' gradients all came through
 * tuple_piece_grad)? -1 with the reason otherwise. */
static int tuple_read_by_items(AG *ag, IRRef n) {
    for (IRRef u = n + 1; u < ag->g->nnodes; u++) {
        const IRNode *un = em_ir_node(ag->g, u);
        if (!em_ir_node_reads(un, n)) continue;
        if (!node_named(un, "operator.getitem") || un->nargs != 2 || un->args[0].kind != IRARG_NODE ||
            un->args[1].kind != IRARG_CONST || !PyLong_Check(un->args[1].u.obj) || em_ir_node_reads(un, n) != 1)
            return ag_fail(ag, "%s reads the tuple %s whole", un->name, em_ir_node(ag->g, n)->name);
    }
    return 0;
}

/* max / min / median (dim), kthvalue, mode, topk, sort: (values, indices); the values' gradient
 * scattered back to the indices the forward chose (value_selecting_reduction_backward, as
 * derivatives.yaml; keepdim True for topk and sort), the indices saved by forward_rewrite. */
static int valsel_backward(AG *ag, IRRef n, const Bind *b) {
    IRArg self = bval(b, "self"), dim = bval(b, "dim");
    struct Pieces *pc = &ag->pieces[n];
    IRRef gv = pc->part ? pc->part[0] : 0;
    pc->part = NULL;
    if (!needs(ag, &self) || !gv) return 0;
    if (tuple_read_by_items(ag, n) < 0) return -1;
    const IRNode *node = em_ir_node(ag->g, n);
    bool keep = node_named(node, "torch.topk Tensor.topk torch.sort Tensor.sort");
    IRArg kd = keep ? arg_const_steal(ag, Py_NewRef(Py_True)) : bval(b, "keepdim");
    PyObject *t = torch_attr("ops.aten.value_selecting_reduction_backward");
    if (!t || !em_arena_hold_steal(ag->a, t) || !ag->aux[n][0]) return ag_fail_exc(ag);
    IRArg a[5] = {arg_node(gv), dim, arg_node(ag->aux[n][0]), shape_arg(ag, ag->fmap[self.u.ref], 0), kd};
    IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
    return r ? accumulate(ag, self.u.ref, r) : -1;
}

static int split_backward(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    IRArg self = bval(b, "self"), dim = bval(b, "dim");
    if (!needs(ag, &self)) return 0;
    if (tuple_read_by_items(ag, n) < 0) return -1;
    const IRMeta *tm = &node->meta, *xm = &em_ir_node(ag->g, self.u.ref)->meta;
    struct Pieces *pc = &ag->pieces[n];
    if (dim.kind != IRARG_CONST || !PyLong_Check(dim.u.obj) || !pc->part || pc->n != (int64_t)tm->nitems)
        return ag_fail(ag, "%s: no piece's gradient, or a dim that is not an int", node->name);
    bool unbind = node_named(node, "Tensor.unbind torch.unbind");
    IRRef any = 0;
    for (int64_t i = 0; i < pc->n && !any; i++) any = pc->part[i];
    IRArg list = {0};
    list.kind = IRARG_LIST;
    list.n = (uint32_t)pc->n;
    list.u.items = em_arena_alloc(ag->a, (size_t)(pc->n ? pc->n : 1) * sizeof(IRArg));
    if (!list.u.items) return -1;
    for (int64_t i = 0; i < pc->n; i++) {
        IRRef v = pc->part[i];
        const IRMeta *im = &tm->items[i];
        if (im->kind != IRMETA_TENSOR) return ag_fail(ag, "%s: a piece that is not a tensor", node->name);
        if (!v) { /* (symbolic sizes: read from the piece, taken out of the tuple in the forward) */
            uint8_t role = ag->cur_role;
            ag->cur_role = ROLE_FWD;
            IRRef piece = dims_symbolic(ag, im, 0) ? emit_getitem(ag, ag->fmap[n], (long)i) : 0;
            ag->cur_role = role;
            IRArg za[2] = {arg_node(any), piece ? shape_arg(ag, piece, 0) : shape_const(ag, im)};
            v = emit_method(ag, "new_zeros", za, 2);
        } else if (jmeta(ag, v)->dtype != im->dtype) { /* as autograd's validate_outputs casts each piece */
            IRArg ca[2] = {arg_node(v), arg_const_steal(ag, Py_NewRef(im->dtype))};
            v = emit_method(ag, "to", ca, 2);
        }
        if (!v) return -1;
        list.u.items[i] = arg_node(v);
    }
    pc->part = NULL;
    long long d = PyLong_AsLongLong(dim.u.obj);
    if (PyErr_Occurred()) return ag_fail_exc(ag);
    if (d < 0) d += xm->ndim;
    IRArg a[2] = {list, arg_const_steal(ag, PyLong_FromLongLong(d))};
    IRRef r = emit_fn(ag, unbind ? "stack" : "cat", a, 2);
    return r ? accumulate(ag, self.u.ref, r) : -1;
}

/* group_norm's N, C and HxW (aten's group_norm) of a contiguous input m, as constants; -1 with
 * ag->reason for another layout (eager's input.contiguous(memory_format) would copy or keep a
 * channels_last one: not handled). */
static int group_norm_sizes(AG *ag, const IRMeta *m, IRArg out[3]) {
    if (m->kind != IRMETA_TENSOR || m->ndim < 2) return ag_fail(ag, "group_norm of fewer than 2 dims");
    if (!em_ir_meta_contiguous(m)) return ag_fail(ag, "group_norm of a non-contiguous input");
    int64_t hw = 1;
    for (int32_t d = 2; d < m->ndim; d++) hw *= m->sizes[d];
    out[0] = arg_const_steal(ag, PyLong_FromLongLong(m->sizes[0]));
    out[1] = arg_const_steal(ag, PyLong_FromLongLong(m->sizes[1]));
    out[2] = arg_const_steal(ag, PyLong_FromLongLong(hw));
    return arg_bad(&out[0]) || arg_bad(&out[1]) || arg_bad(&out[2]) ? ag_fail_exc(ag) : 0;
}

/* Parses eq for nops operands (spaces dropped; an implicit output is the ellipsis, then the
 * subscripts seen once, in order, as torch makes it) and checks that each operand's gradient is an
 * einsum: no repeated subscript in a term (a diagonal), every subscript of a term in the output or
 * another term, and no ellipsis the output drops. 0, or -1 (no exception) when not. */
static int einsum_parse(const char *eq, uint32_t nops, EinsumEq *q) {
    char buf[256];
    size_t k = 0;
    for (const char *p = eq; *p; p++)
        if (*p != ' ') {
            if (k + 1 >= sizeof buf) return -1;
            buf[k++] = *p;
        }
    buf[k] = '\0';
    char *arrow = strstr(buf, "->");
    q->nt = 0;
    for (char *p = buf, *e;; p = e + 1) {
        e = p;
        while (*e && *e != ',' && e != arrow) e++;
        if (q->nt == 8 || (size_t)(e - p) >= sizeof q->term[0]) return -1;
        memcpy(q->term[q->nt], p, (size_t)(e - p));
        q->term[q->nt++][e - p] = '\0';
        if (*e != ',') break;
    }
    if (q->nt != nops) return -1;
    if (arrow) {
        if (strlen(arrow + 2) >= sizeof q->out) return -1;
        strcpy(q->out, arrow + 2);
    } else {
        int count[128] = {0};
        bool ell = false;
        for (uint32_t i = 0; i < q->nt; i++)
            for (const char *c = q->term[i]; *c; c++) {
                if (*c == '.') ell = true;
                else count[(unsigned char)*c & 127]++;
            }
        size_t m = ell ? (size_t)snprintf(q->out, sizeof q->out, "...") : 0;
        for (int c = 'A'; c <= 'z' && m + 1 < sizeof q->out; c++)
            if (count[c] == 1) q->out[m++] = (char)c;
        q->out[m] = '\0';
    }
    for (uint32_t i = 0; i < q->nt; i++) {
        const char *ti = q->term[i];
        if (strstr(ti, "...") && !strstr(q->out, "...")) return -1;
        for (const char *c = ti; *c; c++) {
            if (*c == '.') continue;
            if (strchr(c + 1, *c)) return -1;
            bool found = strchr(q->out, *c) != NULL;
            for (uint32_t j = 0; j < q->nt && !found; j++) found = j != i && strchr(q->term[j], *c);
            if (!found) return -1;
        }
    }
    return 0;
}

/* torch.einsum's gradient for each operand: another einsum, of the output gradient (the output's
 * subscripts) and the other operands, back to that operand's subscripts (checked by the rule's
 * `einsum:` check, einsum_parse). */
static int einsum_backward(AG *ag, IRRef n, const Bind *b) {
    IRArg eqa = bval(b, "equation"), ops = bval(b, "operands");
    EinsumEq q;
    if (einsum_parse(PyUnicode_AsUTF8(eqa.u.obj), ops.n, &q) < 0) return ag_fail(ag, "einsum: an equation without a rule");
    for (uint32_t i = 0; i < q.nt; i++) {
        IRArg op = ops.u.items[i];
        if (!needs(ag, &op)) continue;
        char geq[600];
        size_t m = (size_t)snprintf(geq, sizeof geq, "%s", q.out);
        IRArg args[9];
        args[1] = arg_node(ag->grad[n]);
        uint32_t na = 2;
        for (uint32_t j = 0; j < q.nt; j++) {
            if (j == i) continue;
            m += (size_t)snprintf(geq + m, sizeof geq - m, ",%s", q.term[j]);
            args[na++] = map_arg(ag, &ops.u.items[j]);
        }
        snprintf(geq + m, sizeof geq - m, "->%s", q.term[i]);
        args[0] = arg_const_steal(ag, PyUnicode_FromString(geq));
        if (arg_bad(&args[0])) return ag_fail_exc(ag);
        IRRef r = emit_fn(ag, "einsum", args, na);
        if (!r || accumulate(ag, op.u.ref, r) < 0) return -1;
    }
    return 0;
}

/* Is n max_pool3d (the SP_MAX_POOL2D rule's 3-d form: max_pool3d_with_indices and its backward)? */
static bool max_pool_3d(const IRNode *n) {
    return node_named(n, "torch.nn.functional.max_pool3d torch.nn.functional._max_pool3d torch.max_pool3d");
}

static int backward_special(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    IRRef g = ag->grad[n];
    const IRMeta *selfm = NULL;
    if (ag->env && b->rule->special == SP_GROUP_NORM)
        return ag_fail_sym(ag, "the derivative of %s reads sizes as numbers", node->name);
    switch (b->rule->special) {
    case SP_SPLIT: return split_backward(ag, n, b);
    case SP_EINSUM: return einsum_backward(ag, n, b);
    case SP_VALSEL: return valsel_backward(ag, n, b);
    case SP_GETITEM: {
        IRArg self = bval(b, "self"), idx = bval(b, "index");
        bool nested = false;
        if (collect_grad_refs(ag, &idx, true, &nested)) return ag_fail(ag, "%s: index requires grad", node->name);
        if (!needs(ag, &self)) return 0;
        if (self.kind == IRARG_NODE && em_ir_node(ag->g, self.u.ref)->meta.kind == IRMETA_TUPLE)
            return tuple_piece_grad(ag, self.u.ref, &idx, g);
        if (idx.kind == IRARG_TUPLE || idx.kind == IRARG_LIST)
            for (uint32_t i = 0; i < idx.n; i++)
                if (idx.u.items[i].kind != IRARG_CONST && !const_list(&idx.u.items[i]))
                    return ag_fail(ag, "%s: indexing with tensors inside a tuple", node->name);
        /* a list index is advanced indexing (x[[0, -1]], x[:, [1, 2]]): its result is a copy, so the
         * basic-indexing gradient below (zeros[idx].copy_(grad)) would write into a temporary */
        bool adv = idx.kind == IRARG_LIST || (idx.kind == IRARG_CONST && PyList_Check(idx.u.obj));
        for (uint32_t i = 0; idx.kind == IRARG_TUPLE && i < idx.n && !adv; i++)
            adv = idx.u.items[i].kind == IRARG_LIST ||
                  (idx.u.items[i].kind == IRARG_CONST && PyList_Check(idx.u.items[i].u.obj));
        if (idx.kind == IRARG_CONST && PyTuple_Check(idx.u.obj))
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(idx.u.obj) && !adv; i++)
                adv = PyList_Check(PyTuple_GET_ITEM(idx.u.obj, i));
        if (adv) return index_list_backward(ag, self.u.ref, g, &idx, node->name);
        selfm = &em_ir_node(ag->g, self.u.ref)->meta;
        if (idx.kind == IRARG_NODE && jmeta(ag, ag->fmap[idx.u.ref])->kind != IRMETA_TENSOR)
            return ag_fail(ag, "%s: an index that is a graph value but no tensor (a slice of symbolic bounds)",
                           node->name);
        if (idx.kind == IRARG_CONST && PyLong_Check(idx.u.obj) && !PyBool_Check(idx.u.obj) && ag->pieces &&
            !(selfm->sym_sizes && ag->env && !em_sym_is_const(ag->env, selfm->sym_sizes[0], NULL)) &&
            selfm->ndim >= 1 && selfm->sizes[0] >= 1 && selfm->sizes[0] <= 64 && !ag->grad[self.u.ref] &&
            jmeta(ag, g)->dtype == selfm->dtype) { /* x[i]: one piece of x's stacked gradient */
            long long i = PyLong_AsLongLong(idx.u.obj);
            if (PyErr_Occurred()) return ag_fail_exc(ag);
            if (i < 0) i += selfm->sizes[0];
            struct Pieces *pc = &ag->pieces[self.u.ref];
            if (i >= 0 && i < selfm->sizes[0]) {
                if (!pc->part) {
                    pc->n = selfm->sizes[0];
                    pc->part = em_arena_alloc(ag->a, (size_t)pc->n * sizeof(IRRef));
                    if (!pc->part) return -1;
                    memset(pc->part, 0, (size_t)pc->n * sizeof(IRRef));
                }
                IRRef v = g;
                if (pc->part[i]) v = emit_op(ag, "add", arg_node(pc->part[i]), arg_node(g), 2);
                if (!v) return -1;
                pc->part[i] = v;
                return 0;
            }
        }
        if (idx.kind != IRARG_NODE && ag->scatter && ag->scatter[self.u.ref]) {
            /* another slice of the same tensor (proj[0], proj[1], proj[2] of the attention's packed
             * in-projection): add into the pending zeros buffer in place, no new buffer, no add */
            IRRef z = ag->scatter[self.u.ref];
            IRRef v = emit_op(ag, "getitem", arg_node(z), map_arg(ag, &idx), 2);
            IRArg ca[2] = {arg_node(v), arg_node(g)};
            return v && emit_method(ag, "add_", ca, 2) ? 0 : -1;
        }
        int basic = idx.kind == IRARG_NODE ? 0 : basic_index_backward(ag, self.u.ref, g, &idx);
        if (basic) return basic < 0 ? -1 : 0;
        IRArg a[3] = {arg_node(g), shape_arg(ag, ag->fmap[self.u.ref], 0)};
        IRRef z = emit_method(ag, "new_zeros", a, 2);
        if (!z) return -1;
        if (idx.kind == IRARG_NODE) { /* x[t]: scatter-add, duplicates accumulate */
            IRArg il = {0};
            il.kind = IRARG_LIST;
            il.n = 1;
            il.u.items = em_arena_alloc(ag->a, sizeof(IRArg));
            if (!il.u.items) return -1;
            il.u.items[0] = map_arg(ag, &idx);
            return index_put_grad(ag, self.u.ref, z, il, g);
        }
        IRArg va[2] = {arg_node(z), map_arg(ag, &idx)};
        IRRef v = emit_op(ag, "getitem", va[0], va[1], 2);
        IRArg ca[2] = {arg_node(v), arg_node(g)};
        if (!v || !emit_method(ag, "copy_", ca, 2)) return -1;
        ag->pinned[z] = 1;
        if (accumulate(ag, self.u.ref, z) < 0) return -1;
        if (ag->scatter && ag->grad[self.u.ref] == z) ag->scatter[self.u.ref] = z;
        return 0;
    }
    case SP_SELECT:
    case SP_NARROW: {
        IRArg self = bval(b, "self");
        if (!needs(ag, &self)) return 0;
        selfm = &em_ir_node(ag->g, self.u.ref)->meta;
        IRArg dim = bval(b, "dim");
        PyObject *t = torch_attr(b->rule->special == SP_SELECT ? "ops.aten.select_backward" : "ops.aten.slice_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRRef r;
        if (b->rule->special == SP_SELECT) {
            IRArg a[4] = {arg_node(g), shape_arg(ag, ag->fmap[self.u.ref], 0), dim, bval(b, "index")};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 4, NULL, NULL, 0);
        } else {
            IRArg start = bval(b, "start"), len = bval(b, "length");
            if (start.kind != IRARG_CONST || len.kind != IRARG_CONST) return ag_fail(ag, "narrow with tensor bounds");
            long long s = PyLong_AsLongLong(start.u.obj), l = PyLong_AsLongLong(len.u.obj);
            long long d = PyLong_AsLongLong(dim.u.obj);
            if (PyErr_Occurred()) return ag_fail_exc(ag);
            if (d < 0) d += selfm->ndim;
            if (s < 0 && d >= 0 && d < selfm->ndim && dims_symbolic(ag, selfm, 0) && selfm->sym_sizes &&
                !em_sym_is_const(ag->env, selfm->sym_sizes[d], NULL))
                return ag_fail_sym(ag, "narrow from the end of a symbolic dim");
            if (s < 0) s += selfm->sizes[d];
            IRArg a[6] = {arg_node(g), shape_arg(ag, ag->fmap[self.u.ref], 0), arg_const_steal(ag, PyLong_FromLongLong(d)),
                          arg_const_steal(ag, PyLong_FromLongLong(s)), arg_const_steal(ag, PyLong_FromLongLong(s + l)),
                          arg_const_steal(ag, PyLong_FromLong(1))};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 6, NULL, NULL, 0);
        }
        return r ? accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_CAT:
    case SP_STACK: {
        IRArg ts = bval(b, "tensors"), dim = bval(b, "dim");
        if (ts.kind != IRARG_TUPLE && ts.kind != IRARG_LIST) return ag_fail(ag, "%s of a non-list", node->name);
        long long d = PyLong_AsLongLong(dim.u.obj);
        if (PyErr_Occurred()) return ag_fail_exc(ag);
        const IRMeta *om = &node->meta;
        if (d < 0) d += om->ndim;
        /* each piece's offset and length along d: constants, or (a symbolic dim) size nodes of the
         * pieces read in the forward and their running sum */
        IRArg off = arg_const_steal(ag, PyLong_FromLong(0));
        for (uint32_t i = 0; i < ts.n; i++) {
            const IRArg *it = &ts.u.items[i];
            if (it->kind != IRARG_NODE) return ag_fail(ag, "%s of a non-tensor", node->name);
            const IRMeta *im = &em_ir_node(ag->g, it->u.ref)->meta;
            IRArg sz;
            if (b->rule->special != SP_CAT) sz = arg_const_steal(ag, PyLong_FromLong(1));
            else if (im->ndim == 1 && im->sizes[0] == 0 && om->ndim > 1) sz = arg_const_steal(ag, PyLong_FromLong(0));
            else if (im->ndim == om->ndim && d >= 0 && d < im->ndim) sz = size_arg(ag, ag->fmap[it->u.ref], (int32_t)d);
            else return ag_fail(ag, "%s: a piece of another rank", node->name);
            if (arg_bad(&sz) || arg_bad(&off)) return -1;
            if (meta_needs_grad(im) && !(b->rule->special == SP_CAT && im->ndim != om->ndim)) {
                IRRef r; /* (a legacy empty 1-D input of cat gets no gradient) */
                if (b->rule->special == SP_CAT) {
                    IRArg a[4] = {arg_node(g), arg_const_steal(ag, PyLong_FromLongLong(d)), off, sz};
                    r = emit_method(ag, "narrow", a, 4);
                } else {
                    IRArg a[3] = {arg_node(g), arg_const_steal(ag, PyLong_FromLongLong(d)),
                                  arg_const_steal(ag, PyLong_FromLongLong(i))};
                    r = emit_method(ag, "select", a, 3);
                }
                if (!r || accumulate(ag, it->u.ref, r) < 0) return -1;
            }
            if (off.kind == IRARG_CONST && sz.kind == IRARG_CONST) {
                off = arg_const_steal(ag, PyNumber_Add(off.u.obj, sz.u.obj));
            } else { /* a running sum of sizes: an int of the forward, saved as sizes are */
                uint8_t role = ag->cur_role;
                ag->cur_role = ROLE_FWD;
                off = arg_node(emit_op(ag, "add", off, sz, 2));
                ag->cur_role = role;
            }
        }
        return 0;
    }
    case SP_LAYER_NORM: {
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias");
        PyObject *t = torch_attr("ops.aten.native_layer_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg a[8] = {arg_node(g), map_arg(ag, &self), const_fold(ag, bval(b, "normalized_shape")), arg_node(ag->aux[n][0]),
                      arg_node(ag->aux[n][1]), map_arg(ag, &w), map_arg(ag, &bias),
                      arg_const_steal(ag, bool_list(needs(ag, &self), needs(ag, &w), needs(ag, &bias)))};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_GROUP_NORM: { /* derivatives.yaml native_group_norm: native_group_norm_backward */
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias");
        PyObject *t = torch_attr("ops.aten.native_group_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg nchw[3];
        if (group_norm_sizes(ag, &em_ir_node(ag->g, self.u.ref)->meta, nchw) < 0) return -1;
        IRArg a[10] = {arg_node(g), map_arg(ag, &self), arg_node(ag->aux[n][0]), arg_node(ag->aux[n][1]),
                       map_arg(ag, &w), nchw[0], nchw[1], nchw[2], bval(b, "num_groups"),
                       arg_const_steal(ag, bool_list(needs(ag, &self), needs(ag, &w), needs(ag, &bias)))};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 10, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_BATCH_NORM: {
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias"), train = bval(b, "training");
        IRArg rm = bval(b, "running_mean"), rv = bval(b, "running_var");
        if (needs(ag, &rm) || needs(ag, &rv)) return ag_fail(ag, "batch_norm running statistics require grad");
        int training = train.kind == IRARG_CONST ? PyObject_IsTrue(train.u.obj) : -1;
        if (training < 0) return ag_fail(ag, "batch_norm with a non-constant training flag");
        if (ag->aux[n][2]) { /* cudnn_batch_norm_backward(input, grad (input's layout), weight, running stats,
                                save_mean, save_var, eps, reserve): all three gradients */
            PyObject *t = torch_attr("ops.aten.cudnn_batch_norm_backward.default");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
            IRArg ga[1] = {arg_node(g)};
            IRRef gc = emit_method(ag, "contiguous", ga, 1);
            IRArg a[9] = {map_arg(ag, &self), arg_node(gc), map_arg(ag, &w), map_arg(ag, &rm), map_arg(ag, &rv),
                          arg_node(ag->aux[n][0]), arg_node(ag->aux[n][1]), bval(b, "eps"), arg_node(ag->aux[n][2])};
            IRRef r = gc ? ag_emit(ag, IR_CALL_FUNCTION, t, a, 9, NULL, NULL, 0) : 0;
            if (!r) return -1;
            return accumulate_items(ag, r, &self, &w, &bias);
        }
        PyObject *t = torch_attr("ops.aten.native_batch_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg none = arg_const_steal(ag, Py_NewRef(Py_None));
        IRArg a[10] = {arg_node(g), map_arg(ag, &self), map_arg(ag, &w), training ? none : map_arg(ag, &rm),
                       training ? none : map_arg(ag, &rv), arg_node(ag->aux[n][0]), arg_node(ag->aux[n][1]),
                       train, bval(b, "eps"),
                       arg_const_steal(ag, bool_list(needs(ag, &self), needs(ag, &w), needs(ag, &bias)))};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 10, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_CONV: {
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias");
        const IRMeta *wm = &em_ir_node(ag->g, w.u.ref)->meta;
        int nsp = wm->ndim - 2;
        IRArg st = const_fold(ag, bval(b, "stride")), pd = const_fold(ag, bval(b, "padding"));
        IRArg dl = const_fold(ag, bval(b, "dilation")), gr = bval(b, "groups");
        bool transposed = find_param(b, "output_padding") >= 0; /* conv_transpose */
        IRArg op = transposed ? const_fold(ag, bval(b, "output_padding")) : arg_const_steal(ag, PyLong_FromLong(0));
        if (st.kind != IRARG_CONST || pd.kind != IRARG_CONST || dl.kind != IRARG_CONST || gr.kind != IRARG_CONST ||
            op.kind != IRARG_CONST)
            return ag_fail(ag, "%s with non-constant stride/padding", node->name);
        if (PyUnicode_Check(pd.u.obj)) { /* 'valid': 0; 'same' (stride 1): dilation * (k - 1) / 2 per side,
                                          * when even (aten's _convolution_mode pads odd totals first) */
            PyObject *dil = int_list(dl.u.obj, nsp), *padl = PyList_New(nsp);
            bool same = !PyUnicode_CompareWithASCIIString(pd.u.obj, "same");
            bool ok = dil && padl && (same || !PyUnicode_CompareWithASCIIString(pd.u.obj, "valid")) && !transposed;
            for (int i = 0; ok && i < nsp; i++) {
                long long tot = same ? PyLong_AsLongLong(PyList_GET_ITEM(dil, i)) * (wm->sizes[i + 2] - 1) : 0;
                ok = tot % 2 == 0 && !PyErr_Occurred();
                PyList_SET_ITEM(padl, i, PyLong_FromLongLong(tot / 2));
            }
            Py_XDECREF(dil);
            PyErr_Clear();
            if (!ok) {
                Py_XDECREF(padl);
                return ag_fail(ag, "%s with padding=%S and an odd total padding", node->name, pd.u.obj);
            }
            pd = arg_const_steal(ag, padl);
            if (arg_bad(&pd)) return ag_fail_exc(ag);
        }
        PyObject *bias_sizes = bias.kind == IRARG_NODE
                                   ? Py_BuildValue("[L]", (long long)em_ir_node(ag->g, bias.u.ref)->meta.sizes[0])
                                   : Py_NewRef(Py_None);
        PyObject *t = torch_attr("ops.aten.convolution_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg a[11] = {arg_node(g), map_arg(ag, &self), map_arg(ag, &w), arg_const_steal(ag, bias_sizes),
                       arg_const_steal(ag, int_list(st.u.obj, nsp)), arg_const_steal(ag, int_list(pd.u.obj, nsp)),
                       arg_const_steal(ag, int_list(dl.u.obj, nsp)), arg_const_steal(ag, PyBool_FromLong(transposed)),
                       arg_const_steal(ag, int_list(op.u.obj, nsp)), gr,
                       arg_const_steal(ag, bool_list(needs(ag, &self), needs(ag, &w), needs(ag, &bias)))};
        for (int i = 0; i < 11; i++)
            if (arg_bad(&a[i])) return ag_fail_exc(ag);
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 11, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_NLL_LOSS: { /* derivatives.yaml nll_loss_forward: nll_loss_backward(grad, self, target, weight, ...) */
        IRArg self = bval(b, "self"), target = bval(b, "target"), w = bval(b, "weight");
        if (!needs(ag, &self)) return 0;
        PyObject *t = torch_attr("ops.aten.nll_loss_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg red = eval_redenum(ag, bval(b, "reduction"));
        IRArg a[7] = {arg_node(g), map_arg(ag, &self), map_arg(ag, &target), map_arg(ag, &w), red,
                      bval(b, "ignore_index"), arg_node(ag->aux[n][0])};
        IRRef r = arg_bad(&red) ? 0 : ag_emit(ag, IR_CALL_FUNCTION, t, a, 7, NULL, NULL, 0);
        return r ? accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_MAX_POOL2D: {
        IRArg self = bval(b, "self"), st = bval(b, "stride");
        PyObject *t = torch_attr(max_pool_3d(node) ? "ops.aten.max_pool3d_with_indices_backward"
                                                   : "ops.aten.max_pool2d_with_indices_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
        IRArg a[8] = {arg_node(g), map_arg(ag, &self), const_fold(ag, bval(b, "kernel_size")),
                      arg_is_none(&st) ? arg_const_steal(ag, PyList_New(0)) : const_fold(ag, st),
                      const_fold(ag, bval(b, "padding")), const_fold(ag, bval(b, "dilation")), bval(b, "ceil_mode"),
                      arg_node(ag->aux[n][0])};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        return r ? accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_SDPA: { /* derivatives.yaml: _scaled_dot_product_{flash_attention_for_cpu,efficient,flash}_attention */
        IRArg q = bval(b, "query"), k = bval(b, "key"), v = bval(b, "value"), m = bval(b, "attn_mask");
        IRArg dp = bval(b, "dropout_p"), ic = bval(b, "is_causal"), sc = bval(b, "scale");
        int kind = sdpa_kind_bound(ag, b);
        PyObject *kwn[2] = {kwname(ag, "attn_mask"), kwname(ag, "scale")};
        if (!kwn[0] || !kwn[1]) return ag_fail_exc(ag);
        IRArg none = arg_const_steal(ag, Py_NewRef(Py_None));
        IRArg out = arg_node(ag->aux[n][3] ? ag->aux[n][3] : ag->fmap[n]);
        IRRef r = 0;
        if (kind == SDPA_FLASH_CPU) {
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_flash_attention_for_cpu_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
            IRArg a[8] = {arg_node(g), map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v), out, arg_node(ag->aux[n][0]), dp, ic};
            IRArg kv[2] = {ag->aux[n][4] ? arg_node(ag->aux[n][4]) : map_arg(ag, &m), sc};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 8, kwn, kv, 2);
        } else if (kind == SDPA_EFFICIENT) {
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_efficient_attention_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
            PyObject *mask = Py_BuildValue("[OOOO]", needs(ag, &q) ? Py_True : Py_False, needs(ag, &k) ? Py_True : Py_False,
                                           needs(ag, &v) ? Py_True : Py_False, Py_False);
            IRArg a[12] = {arg_node(g), map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v),
                           ag->aux[n][4] ? arg_node(ag->aux[n][4]) : none, out,
                           arg_node(ag->aux[n][0]), arg_node(ag->aux[n][1]), arg_node(ag->aux[n][2]), dp,
                           arg_const_steal(ag, mask), ic};
            if (arg_bad(&a[10])) return ag_fail_exc(ag);
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 12, kwn + 1, &sc, 1);
        } else if (kind == SDPA_FLASH_CUDA) {
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_flash_attention_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
            const IRMeta *qm = val_meta(ag, &q), *km = val_meta(ag, &k);
            if (dims_symbolic(ag, qm, 0) || dims_symbolic(ag, km, 0))
                return ag_fail_sym(ag, "flash attention's backward takes the sequence lengths as numbers");
            /* dense inputs: cum_seq_q/k are undefined, max_q/max_k the sequence lengths (attention.cu) */
            IRArg a[14] = {arg_node(g), map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v), out, arg_node(ag->aux[n][0]),
                           none, none, arg_const_steal(ag, PyLong_FromLongLong(qm->sizes[qm->ndim - 2])),
                           arg_const_steal(ag, PyLong_FromLongLong(km->sizes[km->ndim - 2])), dp, ic,
                           arg_node(ag->aux[n][1]), arg_node(ag->aux[n][2])};
            if (arg_bad(&a[8]) || arg_bad(&a[9])) return ag_fail_exc(ag);
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 14, kwn + 1, &sc, 1);
        } else {
            return ag_fail(ag, "scaled_dot_product_attention: no fused kernel with a backward op for these inputs");
        }
        if (!r) return -1;
        return accumulate_items(ag, r, &q, &k, &v);
    }
    case SP_DROPOUT: {
        IRArg self = bval(b, "self");
        if (!needs(ag, &self)) return 0;
        if (!ag->aux[n][0]) return accumulate(ag, self.u.ref, g); /* eval mode or p == 0: identity */
        if (ag->philox[n]) { /* the same mask from the same seed: philox_dropout is its own derivative */
            IRArg a[4] = {arg_node(g), arg_node(ag->aux[n][0]), arg_const_steal(ag, PyLong_FromUnsignedLong(ag->philox[n] - 1)),
                          bval(b, "p")};
            IRRef r = arg_bad(&a[2]) ? 0 : emit_ember(ag, "philox_dropout", a, 4);
            return r ? accumulate(ag, self.u.ref, r) : -1;
        }
        if (ag->aux[n][1]) { /* CUDA: native_dropout's mask */
            PyObject *t = torch_attr("ops.aten.native_dropout_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag);
            double pv = PyFloat_AsDouble(bval(b, "p").u.obj);
            IRArg a[3] = {arg_node(g), arg_node(ag->aux[n][0]), arg_const_steal(ag, PyFloat_FromDouble(1.0 / (1.0 - pv)))};
            IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 3, NULL, NULL, 0);
            return r ? accumulate(ag, self.u.ref, r) : -1;
        }
        IRRef r = emit_op(ag, "mul", arg_node(g), arg_node(ag->aux[n][0]), 2);
        return r ? accumulate(ag, self.u.ref, r) : -1;
    }
    }
    return ag_fail(ag, "unknown special rule");
}

/* ---------------------------------------------------------------- the forward half of the joint graph */

static IRArg copy_arg(AG *ag, const IRArg *a) { return map_arg(ag, a); }

static IRRef copy_node(AG *ag, const IRNode *n) {
    IRArg *args = em_arena_alloc(ag->a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
    if (!args) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = copy_arg(ag, &n->args[i]);
    for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = copy_arg(ag, &n->kwargs[i]);
    IRRef r = em_ir_call(ag->j, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs, &n->meta);
    if (r && ag_grow_roles(ag) == 0) {
        ag->role[r] = ROLE_FWD;
        return r;
    }
    return 0;
}

#define EM_MAXDIM_AG 16

/* perm: m's dims ordered by stride, largest first (stable), such that x.permute(perm) is
 * contiguous; false when m is not dense and non-overlapping (then empty_like's layout is not a
 * permutation of a contiguous one). */
static bool dense_order(const IRMeta *m, int32_t *perm) {
    if (m->kind != IRMETA_TENSOR || m->ndim > EM_MAXDIM_AG) return false;
    for (int32_t i = 0; i < m->ndim; i++) {
        int32_t j = i;
        while (j > 0 && m->strides[perm[j - 1]] < m->strides[i]) {
            perm[j] = perm[j - 1];
            j--;
        }
        perm[j] = i;
    }
    int64_t want = 1;
    for (int32_t k = m->ndim - 1; k >= 0; k--) {
        int32_t d = perm[k];
        if (m->sizes[d] == 0) return false;
        if (m->sizes[d] != 1 && m->strides[d] != want) return false;
        want *= m->sizes[d];
    }
    return true;
}

static bool identity_perm(const int32_t *perm, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (perm[i] != i) return false;
    return true;
}

/* perm (or its inverse) as a tuple of ints; new reference. */
static PyObject *int_tuple_of(const int32_t *perm, int32_t n, bool inverse) {
    PyObject *t = PyTuple_New(n);
    for (int32_t i = 0; t && i < n; i++) {
        int32_t v = i;
        if (inverse) {
            for (int32_t k = 0; k < n; k++)
                if (perm[k] == i) v = k;
        } else {
            v = perm[i];
        }
        PyObject *o = PyLong_FromLong(v);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, o);
    }
    return t;
}

/* Ops the forward may rewrite so the backward gets what torch's backward kernels need. Returns the
 * joint ref of the value, 0 (and no reason) when the node is copied as is, or 0 with a reason. */
/* Does eager's batch_norm run cuDNN here (aten/src/ATen/native/Normalization.cpp
 * _batch_norm_impl_index)? Training on CUDA, float32 / float16 input with float weight and bias (not
 * bfloat16), both running statistics or neither, at least 3 dims, batch <= 880801, eps >= 1e-5
 * (CUDNN_BN_MIN_EPSILON of the cuDNN versions torch supports is at most that), fewer than 2^31
 * elements, torch.backends.cudnn.enabled when compiled. Then at::cudnn_batch_norm: one kernel
 * forward and one backward, where native_batch_norm launches several. Contiguous input only (eager
 * makes the input and the gradient contiguous in the input's suggested format). */
static bool bn_uses_cudnn(AG *ag, const Bind *b) {
    IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias"), train = bval(b, "training");
    IRArg rm = bval(b, "running_mean"), rv = bval(b, "running_var"), eps = bval(b, "eps");
    const IRMeta *m = val_meta(ag, &self), *wm = val_meta(ag, &w), *bm = val_meta(ag, &bias);
    if (!m || !wm || !bm || m->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || bm->kind != IRMETA_TENSOR) return false;
    if (train.kind != IRARG_CONST || train.u.obj != Py_True || eps.kind != IRARG_CONST) return false;
    if (arg_is_none(&rm) != arg_is_none(&rv) || m->ndim < 3 || m->sizes[0] > 880801) return false;
    if (dims_symbolic(ag, m, 0)) return false; /* cuDNN's size limits hold for the hints only */
    double e = PyFloat_AsDouble(eps.u.obj);
    if (PyErr_Occurred() || e < 1e-5) return PyErr_Clear(), false;
    PyObject *dev = PyObject_GetAttrString(m->device, "type");
    bool cuda = dev && !PyUnicode_CompareWithASCIIString(dev, "cuda");
    Py_XDECREF(dev);
    PyErr_Clear();
    PyObject *f32 = torch_dtype("float32"), *f16 = torch_dtype("float16");
    if (!cuda || !(m->dtype == f32 || (m->dtype == f16 && wm->dtype == f32)) || wm->dtype != bm->dtype ||
        (wm->dtype != f32 && wm->dtype != f16))
        return false;
    int64_t numel = 1;
    for (int32_t d = 0; d < m->ndim; d++) numel *= m->sizes[d];
    if (!em_ir_meta_contiguous(m) || numel >= INT32_MAX) return false;
    PyObject *enabled = torch_attr("backends.cudnn.enabled");
    bool on = enabled && PyObject_IsTrue(enabled) == 1;
    Py_XDECREF(enabled);
    PyErr_Clear();
    return on;
}

/* A bool attention mask as at::scaled_dot_product_attention hands it to the fused kernels
 * (convert_boolean_attn_mask, aten/src/ATen/native/transformers/attention.cpp): 0 where True,
 * -inf where False, in the query's dtype. The joint mask ref, 0 on failure. */
static IRRef sdpa_float_mask(AG *ag, IRArg mask, PyObject *dtype) {
    PyObject *kw = kwname(ag, "dtype");
    PyObject *zl = torch_attr("zeros_like");
    if (!kw || !zl || !em_arena_hold_steal(ag->a, zl)) return ag_fail_exc(ag), 0;
    IRArg dt = arg_const_steal(ag, Py_NewRef(dtype));
    IRRef z = ag_emit(ag, IR_CALL_FUNCTION, zl, &mask, 1, &kw, &dt, 1);
    IRRef off = z ? emit_fn(ag, "logical_not", &mask, 1) : 0;
    if (!off) return 0;
    IRArg a[3] = {arg_node(z), arg_node(off), arg_const_steal(ag, PyFloat_FromDouble(-INFINITY))};
    return emit_method(ag, "masked_fill", a, 3);
}

/* The mask as at::scaled_dot_product_attention hands it to the CUDA memory-efficient kernel
 * (preprocess_mask, aten/src/ATen/native/transformers/cuda/attention.cu): a bool mask made float
 * (sdpa_float_mask); unless its strides are 16-element aligned (the last 1, the others multiples
 * of 16: aligned_tensor), padded by 16 - S % 16 columns and sliced back to S (pad_bias: a view
 * of aligned memory); expanded to (B, H, L, S). The joint ref, 0 on failure. */
static IRRef sdpa_efficient_mask(AG *ag, IRArg mask, IRRef q, IRRef k) {
    const IRMeta *qm = jmeta(ag, q), *km = jmeta(ag, k);
    IRRef b = mask.u.ref;
    if (meta_dtype_is(jmeta(ag, b), "torch.bool") && !(b = sdpa_float_mask(ag, mask, qm->dtype))) return 0;
    const IRMeta *bm = jmeta(ag, b);
    if (bm->kind != IRMETA_TENSOR || bm->ndim < 1 || qm->ndim != 4 || km->ndim != 4) { /* sdpa_kind checked q, k */
        ag_fail(ag, "scaled_dot_product_attention: a mask the efficient kernel's rule does not take");
        return 0;
    }
    /* symbolic sizes: whether the strides are aligned depends on the size, so always padded (the
     * same mask values, aligned for every size) */
    bool aligned = bm->strides[bm->ndim - 1] == 1 && !dims_symbolic(ag, bm, 0);
    for (int32_t i = 0; aligned && i < bm->ndim - 1; i++) aligned = bm->strides[i] % 16 == 0;
    if (!aligned) {
        IRArg S = size_arg(ag, b, bm->ndim - 1);
        if (arg_bad(&S)) return 0;
        IRRef padded;
        if (S.kind == IRARG_CONST) { /* constant_pad_nd(b, [0, 16 - S % 16]) */
            PyObject *t = torch_attr("constant_pad_nd");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
            IRArg pa[2] = {arg_node(b), arg_const_steal(ag, Py_BuildValue("[iL]", 0, 16 - PyLong_AsLongLong(S.u.obj) % 16))};
            padded = arg_bad(&pa[1]) ? 0 : ag_emit(ag, IR_CALL_FUNCTION, t, pa, 2, NULL, NULL, 0);
        } else { /* symbolic: cat((b, zeros(..., 16 - S % 16)), -1) (torch's fake constant_pad_nd takes
                  * concrete pads only) */
            IRRef r = emit_op(ag, "mod", S, arg_const_steal(ag, PyLong_FromLong(16)), 2);
            IRArg pad = arg_node(r ? emit_op(ag, "sub", arg_const_steal(ag, PyLong_FromLong(16)), arg_node(r), 2) : 0);
            IRArg zs = arg_bad(&pad) ? pad : shape_arg(ag, b, 0);
            if (arg_bad(&zs)) return 0;
            if (zs.kind == IRARG_CONST) { /* (only the last dim symbolic) */
                PyObject *t = PySequence_Tuple(zs.u.obj);
                Py_ssize_t nz = t ? PyTuple_GET_SIZE(t) : 0;
                zs.kind = IRARG_TUPLE;
                zs.n = (uint32_t)nz;
                zs.u.items = t ? em_arena_alloc(ag->a, (size_t)(nz + 1) * sizeof(IRArg)) : NULL;
                for (Py_ssize_t i = 0; zs.u.items && i < nz; i++)
                    zs.u.items[i] = arg_const_steal(ag, Py_NewRef(PyTuple_GET_ITEM(t, i)));
                Py_XDECREF(t);
                if (!zs.u.items) return ag_fail_exc(ag), 0;
            }
            zs.u.items[zs.n - 1] = pad;
            IRArg za[2] = {arg_node(b), zs};
            IRRef z = emit_method(ag, "new_zeros", za, 2);
            IRArg l = {0};
            l.kind = IRARG_LIST;
            l.n = 2;
            l.u.items = z ? em_arena_alloc(ag->a, 2 * sizeof(IRArg)) : NULL;
            if (!l.u.items) return z ? (PyErr_NoMemory(), ag_fail_exc(ag), 0) : 0;
            l.u.items[0] = arg_node(b);
            l.u.items[1] = arg_node(z);
            IRArg ca[2] = {l, arg_const_steal(ag, PyLong_FromLong(-1))};
            padded = emit_fn(ag, "cat", ca, 2);
        }
        if (!padded) return 0;
        IRArg na[4] = {arg_node(padded), arg_const_steal(ag, PyLong_FromLong(-1)), arg_const_steal(ag, PyLong_FromLong(0)), S};
        if (!(b = emit_method(ag, "narrow", na, 4))) return 0;
    }
    IRArg sz = {0}; /* (q0, q1, q2, k2) */
    sz.kind = IRARG_TUPLE;
    sz.n = 4;
    sz.u.items = em_arena_alloc(ag->a, 4 * sizeof(IRArg));
    if (!sz.u.items) return PyErr_NoMemory(), ag_fail_exc(ag), 0;
    bool allc = true;
    for (int i = 0; i < 4; i++) {
        sz.u.items[i] = i < 3 ? size_arg(ag, q, i) : size_arg(ag, k, 2);
        if (arg_bad(&sz.u.items[i])) return 0;
        allc &= sz.u.items[i].kind == IRARG_CONST;
    }
    if (allc)
        sz = arg_const_steal(ag, Py_BuildValue("(OOOO)", sz.u.items[0].u.obj, sz.u.items[1].u.obj, sz.u.items[2].u.obj,
                                                sz.u.items[3].u.obj));
    IRArg ea[2] = {arg_node(b), sz};
    return arg_bad(&ea[1]) ? 0 : emit_method(ag, "expand", ea, 2);
}

static IRRef forward_rewrite(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    ag->cur_role = ROLE_FWD;
    if (ag->env && b->rule->special == SP_GROUP_NORM)
        return ag_fail_sym(ag, "group_norm's native op takes sizes as numbers"), 0;
    if (ag->env && b->rule->special == SP_SDPA) { /* the kernel choice reads the head dim */
        IRArg q = bval(b, "query"), k = bval(b, "key");
        const IRMeta *qm = val_meta(ag, &q), *km = val_meta(ag, &k);
        if (!qm || !km || dims_symbolic(ag, qm, qm->ndim - 1))
            return ag_fail_sym(ag, "attention reads the head dim as a number"), 0;
    }
    switch (b->rule->special) {
    case SP_VALSEL: { /* the tuple as the user's op makes it, and its indices for the backward */
        if (node->meta.kind != IRMETA_TUPLE || node->meta.nitems != 2) return ag_fail(ag, "%s: not a (values, indices) pair", node->name), 0;
        IRRef r = copy_node(ag, node);
        if (r && !(ag->aux[n][0] = emit_getitem(ag, r, 1))) return 0;
        return r;
    }
    case SP_LAYER_NORM: {
        PyObject *t = torch_attr("ops.aten.native_layer_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias");
        IRArg a[5] = {map_arg(ag, &self), const_fold(ag, bval(b, "normalized_shape")), map_arg(ag, &w), map_arg(ag, &bias), bval(b, "eps")};
        ag->cur_pinned = true;
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
        ag->cur_pinned = false;
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? emit_getitem(ag, r, 2) : 0;
        return ag->aux[n][1] ? out : 0;
    }
    case SP_GROUP_NORM: { /* aten's group_norm of a contiguous input: native_group_norm's (out, mean, rstd) */
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias"), nchw[3];
        if (self.kind != IRARG_NODE) return ag_fail(ag, "group_norm of a constant"), 0;
        if (group_norm_sizes(ag, &em_ir_node(ag->g, self.u.ref)->meta, nchw) < 0) return 0;
        PyObject *t = torch_attr("ops.aten.native_group_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
        IRArg a[8] = {map_arg(ag, &self), map_arg(ag, &w), map_arg(ag, &bias), nchw[0], nchw[1], nchw[2],
                      bval(b, "num_groups"), bval(b, "eps")};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? emit_getitem(ag, r, 2) : 0;
        return ag->aux[n][1] ? out : 0;
    }
    case SP_BATCH_NORM: {
        IRArg self = bval(b, "self"), w = bval(b, "weight"), bias = bval(b, "bias");
        IRArg rm = bval(b, "running_mean"), rv = bval(b, "running_var");
        bool cudnn = bn_uses_cudnn(ag, b);
        PyObject *t = torch_attr(cudnn ? "ops.aten.cudnn_batch_norm.default" : "ops.aten.native_batch_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
        IRArg a[8] = {map_arg(ag, &self), map_arg(ag, &w), map_arg(ag, &bias), map_arg(ag, &rm), map_arg(ag, &rv),
                      bval(b, "training"), bval(b, "momentum"), bval(b, "eps")};
        ag->cur_pinned = true; /* updates the running statistics: runs exactly once, in the forward */
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        ag->cur_pinned = false;
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? emit_getitem(ag, r, 2) : 0;
        if (cudnn) ag->aux[n][2] = ag->aux[n][1] ? emit_getitem(ag, r, 3) : 0; /* cuDNN's reserve space */
        return ag->aux[n][1] && (!cudnn || ag->aux[n][2]) ? out : 0;
    }
    case SP_NLL_LOSS: { /* F.nll_loss of (C) / (N, C) is at::nll_loss_forward (LossNLL.cpp): (output, total_weight) */
        PyObject *t = torch_attr("ops.aten.nll_loss_forward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
        IRArg self = bval(b, "self"), target = bval(b, "target"), w = bval(b, "weight");
        IRArg red = eval_redenum(ag, bval(b, "reduction"));
        IRArg a[5] = {map_arg(ag, &self), map_arg(ag, &target), map_arg(ag, &w), red, bval(b, "ignore_index")};
        IRRef r = arg_bad(&red) ? 0 : ag_emit(ag, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
        return ag->aux[n][0] ? out : 0;
    }
    case SP_MAX_POOL2D: { /* at::max_pool2d's values are max_pool2d_with_indices' first result (3d alike) */
        PyObject *t = torch_attr(max_pool_3d(node) ? "ops.aten.max_pool3d_with_indices" : "ops.aten.max_pool2d_with_indices");
        if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
        IRArg self = bval(b, "self"), st = bval(b, "stride");
        IRArg a[6] = {map_arg(ag, &self), const_fold(ag, bval(b, "kernel_size")),
                      arg_is_none(&st) ? arg_const_steal(ag, PyList_New(0)) : const_fold(ag, st),
                      const_fold(ag, bval(b, "padding")), const_fold(ag, bval(b, "dilation")), bval(b, "ceil_mode")};
        IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 6, NULL, NULL, 0);
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
        return ag->aux[n][0] ? out : 0;
    }
    case SP_SDPA: { /* the fused op eager's scaled_dot_product_attention calls, with what its backward reads */
        IRArg q = bval(b, "query"), k = bval(b, "key"), v = bval(b, "value"), m = bval(b, "attn_mask");
        IRArg dp = bval(b, "dropout_p"), ic = bval(b, "is_causal"), sc = bval(b, "scale");
        int kind = sdpa_kind_bound(ag, b);
        IRArg bias = m.kind == IRARG_NODE ? map_arg(ag, &m) : arg_const_steal(ag, Py_NewRef(Py_None));
        if (m.kind == IRARG_NODE && kind == SDPA_FLASH_CPU && meta_dtype_is(val_meta(ag, &m), "torch.bool")) {
            if (!(ag->aux[n][4] = sdpa_float_mask(ag, bias, val_meta(ag, &q)->dtype))) return 0;
            bias = arg_node(ag->aux[n][4]); /* the backward op reads the same float mask */
        } else if (m.kind == IRARG_NODE && kind == SDPA_EFFICIENT) {
            if (!(ag->aux[n][4] = sdpa_efficient_mask(ag, bias, map_arg(ag, &q).u.ref, map_arg(ag, &k).u.ref))) return 0;
            bias = arg_node(ag->aux[n][4]);
        }
        PyObject *kwn[2] = {kwname(ag, "attn_mask"), kwname(ag, "scale")};
        if (!kwn[0] || !kwn[1]) return ag_fail_exc(ag), 0;
        IRArg yes = arg_const_steal(ag, Py_NewRef(Py_True));
        IRArg no = arg_const_steal(ag, Py_NewRef(Py_False));
        IRRef r = 0;
        int aux[3] = {1, 0, 0}; /* which results the backward reads besides the output */
        ag->cur_pinned = true;  /* random with dropout_p > 0 (philox state): never recomputed */
        if (kind == SDPA_FLASH_CPU) {
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_flash_attention_for_cpu");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
            IRArg a[5] = {map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v), dp, ic};
            IRArg kv[2] = {bias, sc};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 5, kwn, kv, 2);
        } else if (kind == SDPA_EFFICIENT) { /* compute_log_sumexp: inputs require grad, grad mode on */
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_efficient_attention");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
            IRArg a[7] = {map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v), bias, yes, dp, ic};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 7, kwn + 1, &sc, 1);
            aux[1] = 2;
            aux[2] = 3;
        } else if (kind == SDPA_FLASH_CUDA) {
            PyObject *t = torch_attr("ops.aten._scaled_dot_product_flash_attention");
            if (!t || !em_arena_hold_steal(ag->a, t)) return ag_fail_exc(ag), 0;
            IRArg a[6] = {map_arg(ag, &q), map_arg(ag, &k), map_arg(ag, &v), dp, ic, no};
            r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 6, kwn + 1, &sc, 1);
            aux[1] = 6;
            aux[2] = 7;
        } else {
            ag->cur_pinned = false;
            return ag_fail(ag, "scaled_dot_product_attention: no fused kernel with a backward op"), 0;
        }
        ag->cur_pinned = false;
        IRRef out = r ? emit_getitem(ag, r, 0) : 0;
        for (int i = 0; out && i < 3; i++) {
            if (!aux[i]) continue;
            ag->aux[n][i] = emit_getitem(ag, r, aux[i]);
            if (!ag->aux[n][i]) return 0;
        }
        /* the nodes after this one were typed with the traced result's layout (the meta device's
         * attention is contiguous), the fused kernel's may differ ((B, S, H, D) memory for flash
         * and cuDNN): the value gets the traced layout, so that views of it read the right elements */
        const IRMeta *want = &em_ir_node(ag->g, n)->meta;
        if (out && !same_strides(jmeta(ag, out), want)) {
            if (!em_ir_meta_contiguous(want))
                return ag_fail(ag, "scaled_dot_product_attention: the fused kernel's output layout is not the traced one"), 0;
            IRArg ca[1] = {arg_node(out)};
            ag->aux[n][3] = out; /* the backward op reads the kernel's own output */
            out = emit_method(ag, "contiguous", ca, 1);
        }
        return out;
    }
    case SP_DROPOUT: {
        IRArg p = bval(b, "p"), train = bval(b, "training"), self = bval(b, "self");
        if (p.kind != IRARG_CONST || train.kind != IRARG_CONST) return ag_fail(ag, "dropout with tensor arguments"), 0;
        double pv = PyFloat_AsDouble(p.u.obj);
        int tr = PyObject_IsTrue(train.u.obj);
        if (PyErr_Occurred() || tr < 0) return ag_fail_exc(ag), 0;
        if (!tr || pv == 0.0) return 0; /* identity: copied as is, aux stays 0 */
        if (pv >= 1.0) return ag_fail(ag, "dropout with p=1"), 0;
        const IRMeta *m = &node->meta;
        PyObject *dtype_str = PyObject_GetAttrString(m->device, "type");
        int cuda = dtype_str ? PyUnicode_CompareWithASCIIString(dtype_str, "cuda") == 0 : 0;
        Py_XDECREF(dtype_str);
        PyErr_Clear();
        ag->cur_pinned = true; /* random: never recomputed */
        IRRef out = 0;
        int32_t perm[EM_MAXDIM_AG];
        if (ag->nphilox) {
            /* Philox: the seeds drawn once per call of the graph (at its first dropout), each dropout
             * one op that lowers into kernels; the backward draws its mask again from the saved seed */
            if (!ag->seeds) {
                IRArg a[2] = {map_arg(ag, &self), arg_const_steal(ag, PyLong_FromUnsignedLong(ag->nphilox))};
                ag->seeds = arg_bad(&a[1]) ? 0 : emit_ember(ag, "philox_seeds", a, 2);
                if (!ag->seeds) return 0;
            }
            uint32_t k = ag->nphilox_used++;
            ag->cur_pinned = false; /* deterministic given the seeds */
            IRArg a[4] = {map_arg(ag, &self), arg_node(ag->seeds), arg_const_steal(ag, PyLong_FromUnsignedLong(k)), p};
            out = arg_bad(&a[2]) || k >= ag->nphilox ? 0 : emit_ember(ag, "philox_dropout", a, 4);
            ag->philox[n] = k + 1;
            ag->aux[n][0] = ag->seeds;
        } else if (cuda) { /* at::dropout on CUDA is native_dropout (aten/src/ATen/native/Dropout.cpp) */
            PyObject *t = torch_attr("ops.aten.native_dropout");
            if (t && em_arena_hold_steal(ag->a, t)) {
                IRArg a[3] = {map_arg(ag, &self), p, train};
                IRRef r = ag_emit(ag, IR_CALL_FUNCTION, t, a, 3, NULL, NULL, 0);
                out = r ? emit_getitem(ag, r, 0) : 0;
                ag->aux[n][0] = out ? emit_getitem(ag, r, 1) : 0;
                ag->aux[n][1] = ag->aux[n][0]; /* marks native_dropout's mask */
            } else {
                ag_fail_exc(ag);
            }
        } else if (dense_order(m, perm)) {
            /* on CPU: noise = empty_like(x).bernoulli_(1 - p).div_(1 - p); x * noise (_dropout_impl).
             * empty_like keeps x's layout (dense: a permutation of a contiguous one) and bernoulli_
             * draws in memory order; torch.bernoulli(x.permute(perm), 1 - p) (perm: x's dims by
             * stride, a contiguous view) makes the same draws in the same memory order, and
             * .permute(back) puts them on x's elements: the same mask, and no in-place op (the
             * ember backend then compiles the forward half; lower refuses in-place updates of
             * values read again) */
            IRArg pm = arg_const_steal(ag, int_tuple_of(perm, m->ndim, false));
            IRArg inv = arg_const_steal(ag, int_tuple_of(perm, m->ndim, true));
            if (arg_bad(&pm) || arg_bad(&inv)) return ag_fail_exc(ag), 0;
            IRArg pa[2] = {map_arg(ag, &self), pm};
            IRRef xp = identity_perm(perm, m->ndim) ? map_arg(ag, &self).u.ref : emit_method(ag, "permute", pa, 2);
            IRArg a2[2] = {arg_node(xp), arg_const_steal(ag, PyFloat_FromDouble(1.0 - pv))};
            IRRef bern = xp ? emit_fn(ag, "bernoulli", a2, 2) : 0;
            if (bern && !identity_perm(perm, m->ndim)) {
                IRArg ba[2] = {arg_node(bern), inv};
                bern = emit_method(ag, "permute", ba, 2);
            }
            IRRef noise = bern ? emit_op(ag, "truediv", arg_node(bern), a2[1], 2) : 0;
            out = noise ? emit_op(ag, "mul", map_arg(ag, &self), arg_node(noise), 2) : 0;
            ag->aux[n][0] = noise;
            if (out) ag->pinned[out] = 0;
        } else { /* on CPU, x not contiguous: empty_like keeps x's layout, so the in-place form */
            IRArg a1[1] = {map_arg(ag, &self)};
            IRRef e = emit_fn(ag, "empty_like", a1, 1);
            IRArg a2[2] = {arg_node(e), arg_const_steal(ag, PyFloat_FromDouble(1.0 - pv))};
            IRRef bern = e ? emit_method(ag, "bernoulli_", a2, 2) : 0;
            a2[0] = arg_node(bern);
            IRRef noise = bern ? emit_method(ag, "div_", a2, 2) : 0;
            out = noise ? emit_op(ag, "mul", map_arg(ag, &self), arg_node(noise), 2) : 0;
            ag->aux[n][0] = noise;
            if (out) ag->pinned[out] = 0;
        }
        ag->cur_pinned = false;
        return out;
    }
    }
    return 0;
}

static bool arg_requires_grad(const IRGraph *g, const IRArg *a);

/* The graph input that graph value r may be at run time, as an object: -1 when none can be. The
 * placeholder itself; an in-place update returns what it writes (x.add_(1), x += 1, out=x); and
 * many ops return their first argument itself when there is nothing to do (x.contiguous() of a
 * contiguous x, x.to(x.dtype), F.dropout(x, training=False), x.flatten() of a 1-d x), so any
 * other call node is followed through its first argument. The caller compares objects at run time
 * (ember._autograd.CompiledRegion.forward): this only names the one input worth comparing. */
static int32_t maybe_input(const IRGraph *g, IRRef r) {
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER) {
            for (uint32_t i = 0; i < g->ninputs; i++)
                if (g->inputs[i] == r) return (int32_t)i;
            return -1;
        }
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->meta.kind != IRMETA_TENSOR) return -1;
        const IRArg *m = em_ir_mutates(n) ? em_ir_mutated_arg(n) : (n->nargs ? &n->args[0] : NULL);
        if (!m || m->kind != IRARG_NODE) return -1;
        r = m->u.ref;
    }
    return -1;
}

/* getattr(x, "T") and the other transposing attributes: views of x. */
static bool is_view_attr(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || n->nargs != 2 || n->args[1].kind != IRARG_CONST || !PyUnicode_Check(n->args[1].u.obj))
        return false;
    const char *a = PyUnicode_AsUTF8(n->args[1].u.obj);
    return node_named(n, "builtins.getattr getattr") && a && (!strcmp(a, "T") || !strcmp(a, "mT") || !strcmp(a, "H") || !strcmp(a, "mH"));
}

/* One step back along r's memory: the tensor node r is an alias of (a view's base; what an in-place
 * update writes, which it also returns), 0 when r is neither. *view: the step is a view op. */
static IRRef alias_step(const IRGraph *g, IRRef r, bool *view) {
    const IRNode *n = em_ir_node(g, r);
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->meta.kind != IRMETA_TENSOR) return 0;
    bool mut = em_ir_mutates(n);
    if (!mut && em_lower_kind_of(n) != EM_LOWER_VIEW && !is_view_attr(n)) return 0;
    const IRArg *m = mut ? em_ir_mutated_arg(n) : (n->nargs ? &n->args[0] : NULL);
    if (!m || m->kind != IRARG_NODE) return 0;
    *view = !mut;
    return m->u.ref;
}

/* Does eager's op n return its input object itself? `flatten` does when its start and end dims are
 * the same dim (a 1-D input; aten/src/ATen/native/TensorShape.cpp flatten: `if (start_dim ==
 * end_dim) return self`), `contiguous()` of a contiguous tensor does. */
static bool returns_self(const IRGraph *g, const IRNode *n) {
    if (n->nargs < 1 || n->args[0].kind != IRARG_NODE) return false;
    const IRMeta *in = &em_ir_node(g, n->args[0].u.ref)->meta;
    if (node_named(n, "Tensor.contiguous")) /* of a contiguous tensor, no memory format named */
        return n->nargs == 1 && n->nkwargs == 0 && in->kind == IRMETA_TENSOR && em_ir_meta_contiguous(in);
    if (!node_named(n, "torch.flatten Tensor.flatten")) return false;
    if (in->kind != IRMETA_TENSOR || in->ndim < 1) return false; /* a 0-d input: reshape((1,)), a new tensor */
    int64_t dims[2] = {0, -1};
    for (uint32_t i = 1; i < n->nargs && i < 3; i++) {
        if (n->args[i].kind != IRARG_CONST || !PyLong_Check(n->args[i].u.obj)) return false;
        dims[i - 1] = PyLong_AsLongLong(n->args[i].u.obj);
    }
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[i]);
        if (!kw || n->kwargs[i].kind != IRARG_CONST || !PyLong_Check(n->kwargs[i].u.obj)) {
            PyErr_Clear();
            return false;
        }
        if (!strcmp(kw, "start_dim")) dims[0] = PyLong_AsLongLong(n->kwargs[i].u.obj);
        else if (!strcmp(kw, "end_dim")) dims[1] = PyLong_AsLongLong(n->kwargs[i].u.obj);
        else return false;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return norm_dim(dims[0], in->ndim) == norm_dim(dims[1], in->ndim);
}

/* The value whose memory r is: followed back through views and in-place updates to the first node
 * that is neither. */
static IRRef alias_root(const IRGraph *g, IRRef r) {
    bool view;
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        IRRef up = alias_step(g, r, &view);
        if (!up) return r;
        r = up;
    }
    return r;
}

/* The graph input that r is a view of through view ops only (views, in-place updates, aliases as
 * contiguous() of a contiguous value), -1 when r is no such chain. */
static int32_t maybe_input_view(const IRGraph *g, IRRef r) {
    bool view = false, step;
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        if (em_ir_node(g, r)->kind == IR_PLACEHOLDER) {
            for (uint32_t i = 0; view && i < g->ninputs; i++)
                if (g->inputs[i] == r) return (int32_t)i;
            return -1;
        }
        IRRef up = alias_step(g, r, &step);
        if (!up) return -1;
        view |= step;
        r = up;
    }
    return -1;
}

static bool is_batch_norm(const IRNode *n) { return node_named(n, "torch.nn.functional.batch_norm"); }

/* torch._C._set_grad_enabled(mode): a `with torch.no_grad()` / `enable_grad()` block's edge. */
static bool grad_mode_node(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION) return false;
    PyObject *qn = node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool gm = s && strstr(s, "set_grad_enabled");
    Py_XDECREF(qn);
    PyErr_Clear();
    return gm;
}

/* Grad-mode blocks (`with torch.no_grad():` inside the region, as LlamaRotaryEmbedding's
 * @torch.no_grad() forward): the tracer typed the ops inside them as not requiring grad, so no
 * gradient flows through them, as in eager; the region is compiled with grad mode on (a guard),
 * its halves run without grad (Function.forward and backward), and when the graph's last mode
 * change turns grad mode back on, the mode after the region is the mode before it: the nodes are
 * dropped from the joint graph (and from a split region's steps: compile_split). A graph that ends
 * with grad mode off (a break inside the block, a set_grad_enabled(False) statement) keeps eager
 * autograd. */
static int check_grad_mode(AG *ag) {
    const IRGraph *g = ag->g;
    PyObject *last = NULL;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (!grad_mode_node(n)) continue;
        if (n->nargs != 1 || n->nkwargs || n->args[0].kind != IRARG_CONST || !PyBool_Check(n->args[0].u.obj))
            return ag_fail(ag, "the graph changes grad mode to a value not known at compile time (%s)", n->name);
        last = n->args[0].u.obj;
    }
    if (last && last != Py_True) return ag_fail(ag, "the graph ends with grad mode off (a no_grad block not closed in it)");
    return 0;
}

/* In-place updates are allowed only on inputs that do not require grad and that no other op reads
 * except other in-place updates of them and batch_norm (its running statistics): then no value the
 * backward uses can change under it. Returns -1 with a reason otherwise. */
static int check_mutations(AG *ag) {
    const IRGraph *g = ag->g;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (grad_mode_node(n)) continue; /* check_grad_mode */
        if (em_ir_autocast_node(n)) return ag_fail(ag, "the graph enters a torch.autocast block (%s)", n->name);
        if (!em_ir_mutates(n)) continue;
        const IRArg *a0 = em_ir_mutated_arg(n); /* out= writes `out`, not its first argument */
        if (!a0 || a0->kind != IRARG_NODE || em_ir_node(g, a0->u.ref)->kind != IR_PLACEHOLDER ||
            meta_needs_grad(&em_ir_node(g, a0->u.ref)->meta) || meta_needs_grad(&n->meta))
            return ag_fail(ag, "in-place update %s of a value autograd may need", n->name);
        /* x[i] = v with v requiring grad: eager gives x a grad_fn (CopySlices) and requires_grad;
         * the Function's forward runs under no_grad and cannot. (Its meta is None: checked here.) */
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            if (a != a0 && arg_requires_grad(g, a))
                return ag_fail(ag, "in-place update %s writes a value that requires grad into an input", n->name);
        }
        IRRef p = a0->u.ref;
        for (IRRef u = 1; u < g->nnodes; u++) {
            const IRNode *un = em_ir_node(g, u);
            if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) continue;
            bool uses = false;
            for (uint32_t i = 0; i < un->nargs + un->nkwargs && !uses; i++) {
                const IRArg *a = i < un->nargs ? &un->args[i] : &un->kwargs[i - un->nargs];
                uses = a->kind == IRARG_NODE && a->u.ref == p;
            }
            if (!uses) continue;
            const IRArg *um = em_ir_mutates(un) ? em_ir_mutated_arg(un) : NULL;
            bool ok = (um && um->kind == IRARG_NODE && um->u.ref == p) ||
                      (is_batch_norm(un) && un->args[0].kind == IRARG_NODE && un->args[0].u.ref != p);
            if (!ok) return ag_fail(ag, "%s reads %s, which %s updates in place", un->name, em_ir_node(g, p)->name, n->name);
        }
    }
    return 0;
}

static bool dtype_differentiable(PyObject *dtype) {
    PyObject *f = dtype ? PyObject_GetAttrString(dtype, "is_floating_point") : NULL;
    PyObject *c = dtype ? PyObject_GetAttrString(dtype, "is_complex") : NULL;
    bool r = (f && PyObject_IsTrue(f) == 1) || (c && PyObject_IsTrue(c) == 1);
    Py_XDECREF(f);
    Py_XDECREF(c);
    PyErr_Clear();
    return r;
}

static bool arg_requires_grad(const IRGraph *g, const IRArg *a) {
    if (a->kind == IRARG_NODE) return meta_needs_grad(&em_ir_node(g, a->u.ref)->meta);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (arg_requires_grad(g, &a->u.items[i])) return true;
    return false;
}

static void meta_clear_grad(IRMeta *m, bool all) {
    if (m->kind == IRMETA_TENSOR && (all || !dtype_differentiable(m->dtype))) m->requires_grad = false;
    if (m->kind == IRMETA_TUPLE)
        for (uint32_t i = 0; i < m->nitems; i++) meta_clear_grad(&m->items[i], all);
}

/* requires_grad as eager autograd sets it: the tracer's metas are an upper bound; a value of an
 * integer or bool dtype, a detach, and an op none of whose arguments requires grad never do. The
 * graph's metas are corrected in place (the graph is the compilation's own). */
static void fix_requires_grad(IRGraph *g) {
    for (IRRef r = 1; r < g->nnodes; r++) {
        IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (!meta_needs_grad(&n->meta)) continue;
        bool any = false;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs && !any; i++)
            any = arg_requires_grad(g, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
        PyObject *qn = node_opname(n);
        const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
        bool detach = s && names_has("Tensor.detach torch.detach Tensor.argmax torch.argmax Tensor.argmin torch.argmin", s);
        /* a leaf made in the graph (torch.ones(..., requires_grad=True), x.requires_grad_()) keeps
         * the tracer's flag: with no rule, it runs in an eager-autograd step */
        bool leaf = s && names_has("Tensor.requires_grad_ torch.nn.parameter.Parameter", s);
        for (uint32_t k = 0; k < n->nkwargs && !leaf; k++) {
            const char *kn = PyUnicode_AsUTF8(n->kwnames[k]);
            leaf = kn && !strcmp(kn, "requires_grad");
        }
        Py_XDECREF(qn);
        PyErr_Clear();
        if (leaf) continue;
        meta_clear_grad(&n->meta, !any || detach);
    }
}

bool em_autograd_needed(const IRGraph *g) {
    fix_requires_grad((IRGraph *)g);
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && meta_needs_grad(&n->meta)) return true;
    }
    return false;
}

/* ---------------------------------------------------------------- min-cut (Dinic's max-flow) */

typedef struct {
    uint32_t to, next;
    int64_t cap;
} Edge;

typedef struct {
    Edge *e;
    uint32_t ne, cap;
    uint32_t *head, *it;
    int32_t *level;
    uint32_t nv;
} Flow;

static int flow_add(Flow *f, uint32_t u, uint32_t v, int64_t c) {
    if (f->ne + 2 > f->cap) {
        uint32_t nc = f->cap * 2 + 64;
        Edge *ne = realloc(f->e, nc * sizeof(Edge));
        if (!ne) return -1;
        f->e = ne;
        f->cap = nc;
    }
    f->e[f->ne] = (Edge){v, f->head[u], c};
    f->head[u] = f->ne++;
    f->e[f->ne] = (Edge){u, f->head[v], 0};
    f->head[v] = f->ne++;
    return 0;
}

static bool flow_bfs(Flow *f, uint32_t s, uint32_t t, uint32_t *queue) {
    for (uint32_t i = 0; i < f->nv; i++) f->level[i] = -1;
    uint32_t qh = 0, qt = 0;
    f->level[s] = 0;
    queue[qt++] = s;
    while (qh < qt) {
        uint32_t u = queue[qh++];
        for (uint32_t k = f->head[u]; k != UINT32_MAX; k = f->e[k].next)
            if (f->e[k].cap > 0 && f->level[f->e[k].to] < 0) {
                f->level[f->e[k].to] = f->level[u] + 1;
                queue[qt++] = f->e[k].to;
            }
    }
    return f->level[t] >= 0;
}

static int64_t flow_dfs(Flow *f, uint32_t u, uint32_t t, int64_t pushed) {
    if (u == t) return pushed;
    for (; f->it[u] != UINT32_MAX; f->it[u] = f->e[f->it[u]].next) {
        Edge *ed = &f->e[f->it[u]];
        if (ed->cap <= 0 || f->level[ed->to] != f->level[u] + 1) continue;
        int64_t d = flow_dfs(f, ed->to, t, pushed < ed->cap ? pushed : ed->cap);
        if (d > 0) {
            f->e[f->it[u]].cap -= d;
            f->e[f->it[u] ^ 1].cap += d;
            return d;
        }
    }
    return 0;
}

static void mark_args(const IRArg *a, uint8_t *need);

/* mat[r] = 1 for each forward value an argument of a backward extern call reads, itself or through
 * views of it (forward or backward views: `mm(h.t(), grad)`), back to the value the chain starts from. */
static void mark_materialized(const IRGraph *j, const uint8_t *role, const IRArg *a, uint8_t *mat) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) mark_materialized(j, role, &a->u.items[i], mat);
    if (a->kind != IRARG_NODE) return;
    for (IRRef r = a->u.ref; r && (role[r] == ROLE_FWD || role[r] == ROLE_BWD) && !mat[r];) {
        const IRNode *n = em_ir_node(j, r);
        mat[r] = 1;
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || em_lower_kind_of(n) != EM_LOWER_VIEW ||
            n->nargs < 1 || n->args[0].kind != IRARG_NODE)
            break;
        r = n->args[0].u.ref;
    }
}

/* Partition: saved[r] = 1 for the joint values the forward saves, recompute[r] = 1 for forward
 * values the backward recomputes. allow_all: every deterministic forward op may be recomputed
 * (activation-memory budget below 1). Returns -1 when no finite cut exists. */
static int partition(AG *ag, const int64_t *bytes, bool allow_all, uint8_t *saved, uint8_t *recompute) {
    IRGraph *j = ag->j;
    uint32_t N = j->nnodes;
    Flow f = {0};
    f.nv = 2 * N + 2;
    uint32_t S = 2 * N, T = 2 * N + 1;
    f.head = malloc(f.nv * sizeof(uint32_t));
    f.it = malloc(f.nv * sizeof(uint32_t));
    f.level = malloc(f.nv * sizeof(int32_t));
    uint32_t *queue = malloc(f.nv * sizeof(uint32_t));
    int rc = -1;
    uint8_t *read_by_bwd = calloc(N, 1), *materialized = calloc(N, 1), *input_alias = calloc(N, 1);
    if (!f.head || !f.it || !f.level || !queue || !read_by_bwd || !materialized || !input_alias) goto done;
    memset(f.head, 0xff, f.nv * sizeof(uint32_t));
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(j, r);
        if (ag->role[r] != ROLE_BWD) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], read_by_bwd);
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && em_lower_kind_of(n) == EM_LOWER_EXTERN)
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                mark_materialized(j, ag->role, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], materialized);
    }
    /* A graph input, or a forward alias of one, that no backward node reads is never saved: eager's
     * autograd would not save it (its formulas read values computed from it), so the user may update
     * it in place between the forward and the backward, where a saved input would make the backward
     * raise "modified by an inplace operation" (program_gen seed 190254: x / (y.abs() + 1), then
     * y[0] = 0 before backward). The cut saves what is computed from it instead. */
    for (IRRef r = 1; r < N; r++) {
        bool view;
        IRRef up = ag->role[r] == ROLE_FWD ? alias_step(j, r, &view) : 0; /* views, .T, in-place results */
        input_alias[r] = ag->role[r] == ROLE_PRIMAL || (up && input_alias[up]);
    }
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(j, r);
        uint8_t role = ag->role[r];
        bool unsaved_input = input_alias[r] && !read_by_bwd[r];
        if (role == ROLE_PRIMAL) {
            if (flow_add(&f, S, 2 * r, INF_CAP) < 0 ||
                flow_add(&f, 2 * r, 2 * r + 1, bytes[r] >= 0 && !unsaved_input ? 1 : INF_CAP) < 0)
                goto done;
        } else if (role == ROLE_FWD) {
            PyObject *qn = node_opname(n);
            bool cheap = false;
            const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
            for (size_t i = 0; s && i < NRULES && !cheap; i++)
                cheap = names_has(RULES[i].names, s) && (RULES[i].flags & R_RECOMPUTE);
            Py_XDECREF(qn);
            PyErr_Clear();
            if (allow_all) cheap = true;
            /* Inductor's should_ban_recomputation / is_materialized_backwards: a value an extern call
             * of the backward reads (a convolution_backward's weight, an mm's operand) is a buffer
             * there; recomputing it costs a kernel of its own (the bf16 cast of each weight under
             * autocast: one launch per parameter per step) where saving it costs what eager's
             * autograd saves. Views stay free. */
            else if (materialized[r] && em_lower_kind_of(n) != EM_LOWER_VIEW) cheap = false;
            if (ag->pinned[r] || em_ir_mutates(n)) cheap = false;
            if (!cheap && flow_add(&f, S, 2 * r, INF_CAP) < 0) goto done;
            /* bytes first; among cuts of equal bytes, the one that saves values the backward reads
             * itself (+1) over their producers (+7): recomputation costs kernels (a copy like
             * contiguous, a chain replayed op by op) and saves no memory then */
            if (flow_add(&f, 2 * r, 2 * r + 1,
                         bytes[r] >= 0 && !unsaved_input ? 8 * bytes[r] + (read_by_bwd[r] ? 1 : 7) : INF_CAP) < 0)
                goto done;
        }
        if (role != ROLE_FWD && role != ROLE_BWD) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            /* flatten nested args */
            const IRArg *stack[64];
            int sp = 0;
            stack[sp++] = a;
            while (sp) {
                const IRArg *x = stack[--sp];
                if (x->kind == IRARG_TUPLE || x->kind == IRARG_LIST) {
                    for (uint32_t k = 0; k < x->n && sp < 64; k++) stack[sp++] = &x->u.items[k];
                    continue;
                }
                if (x->kind != IRARG_NODE) continue;
                uint8_t ar = ag->role[x->u.ref];
                if (ar != ROLE_PRIMAL && ar != ROLE_FWD) continue;
                if (flow_add(&f, 2 * x->u.ref + 1, role == ROLE_BWD ? T : 2 * r, INF_CAP) < 0) goto done;
            }
        }
    }
    int64_t total = 0;
    while (flow_bfs(&f, S, T, queue)) {
        memcpy(f.it, f.head, f.nv * sizeof(uint32_t));
        int64_t d;
        while ((d = flow_dfs(&f, S, T, INF_CAP)) > 0) {
            total += d;
            if (total >= INF_CAP) goto done;
        }
    }
    flow_bfs(&f, S, T, queue); /* level >= 0: reachable from the source in the residual graph */
    for (IRRef r = 1; r < N; r++) {
        uint8_t role = ag->role[r];
        saved[r] = recompute[r] = 0;
        if (role != ROLE_PRIMAL && role != ROLE_FWD) continue;
        bool in_s = f.level[2 * r] >= 0, out_s = f.level[2 * r + 1] >= 0;
        if (in_s && !out_s) saved[r] = 1;
        else if (!in_s && role == ROLE_FWD) recompute[r] = 1; /* filtered to what the backward needs later */
    }
    rc = 0;
done:
    free(read_by_bwd);
    free(materialized);
    free(input_alias);
    free(f.e);
    free(f.head);
    free(f.it);
    free(f.level);
    free(queue);
    return rc;
}

/* ---------------------------------------------------------------- the two halves */

static IRArg remap(EmArena *a, const IRArg *x, const IRRef *map) {
    IRArg o = *x;
    if (x->kind == IRARG_NODE) o.u.ref = map[x->u.ref];
    if (x->kind == IRARG_TUPLE || x->kind == IRARG_LIST) {
        o.u.items = em_arena_alloc(a, (x->n ? x->n : 1) * sizeof(IRArg));
        if (!o.u.items) return o;
        for (uint32_t i = 0; i < x->n; i++) o.u.items[i] = remap(a, &x->u.items[i], map);
    }
    return o;
}

static IRRef copy_into(EmArena *a, IRGraph *dst, const IRNode *n, const IRRef *map) {
    IRArg *args = em_arena_alloc(a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
    if (!args) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = remap(a, &n->args[i], map);
    for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = remap(a, &n->kwargs[i], map);
    return em_ir_call(dst, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs, &n->meta);
}

static void mark_args(const IRArg *a, uint8_t *need) {
    if (a->kind == IRARG_NODE) need[a->u.ref] = 1;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) mark_args(&a->u.items[i], need);
}

/* ember.config.<name> (new reference; dflt as a float when ember.config lacks it). */
static PyObject *config_attr(const char *name, double dflt) {
    PyObject *v = em_config_attr(name);
    return v ? v : PyFloat_FromDouble(dflt);
}

static PyObject *fallback_result(const IRGraph *g, AG *ag, int *is_eager_graph, PyObject **info) {
    *is_eager_graph = 1;
    *info = Py_BuildValue("{s:O}", "fallback", ag->reason ? ag->reason : Py_None);
    if (!*info || (ag->sym_fail && PyDict_SetItemString(*info, "per_size", Py_True) < 0)) return NULL;
    return em_eager_graph_new(g);
}

/* ---------------------------------------------------------------- splitting around ops without a rule */

/* Does m (a tensor, or a tuple's items) hold a complex tensor? */
static bool meta_complex(const IRMeta *m) {
    if (m->kind == IRMETA_TUPLE) {
        for (uint32_t i = 0; i < m->nitems; i++)
            if (meta_complex(&m->items[i])) return true;
        return false;
    }
    if (m->kind != IRMETA_TENSOR || !m->dtype) return false;
    PyObject *c = PyObject_GetAttrString(m->dtype, "is_complex");
    bool r = c && PyObject_IsTrue(c) == 1;
    Py_XDECREF(c);
    PyErr_Clear();
    return r;
}

/* A node whose result or a differentiable argument is complex: the rules are written for real
 * dtypes (a complex gradient needs the conjugates of derivatives.yaml's Wirtinger formulas,
 * `grad * cos(self).conj()`), so it keeps eager autograd. */
static bool complex_grad(const AG *ag, const IRNode *n) {
    if (meta_complex(&n->meta)) return true;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
        const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
        if (a->kind == IRARG_NODE && meta_complex(&em_ir_node(ag->g, a->u.ref)->meta)) return true;
        for (uint32_t k = 0; (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) && k < a->n; k++)
            if (a->u.items[k].kind == IRARG_NODE && meta_complex(&em_ir_node(ag->g, a->u.items[k].u.ref)->meta))
                return true;
    }
    return false;
}

/* Nodes that keep torch's eager autograd: they need a gradient and have no rule (or one whose
 * formulas do not cover an argument that requires grad), and the getitems of their tuple results.
 * Appends a reason per node to reasons. Returns how many. */
static int find_eager_nodes(AG *ag, uint8_t *U, PyObject *reasons) {
    const IRGraph *g = ag->g;
    int count = 0;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (!meta_needs_grad(&n->meta)) continue;
        bool eager = false;
        for (uint32_t i = 0; i < n->nargs && !eager; i++)
            eager = n->args[i].kind == IRARG_NODE && U[n->args[i].u.ref] &&
                    em_ir_node(g, n->args[i].u.ref)->meta.kind == IRMETA_TUPLE;
        if (!eager && complex_grad(ag, n)) {
            eager = true;
            PyObject *msg = PyUnicode_FromFormat("%s: complex values (ember's derivative rules are for real dtypes): "
                                                 "it keeps eager autograd", n->name);
            if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
            Py_XDECREF(msg);
        }
        Bind b;
        const Rule *rule = eager ? NULL : find_rule(ag, n, &b);
        if (!eager && !rule) {
            eager = true;
            PyObject *qn = node_opname(n);
            PyObject *msg = PyUnicode_FromFormat("no derivative rule for %S (node %s): it keeps eager autograd",
                                                 qn ? qn : Py_None, n->name);
            if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
            Py_XDECREF(msg);
            Py_XDECREF(qn);
        } else if (rule && !rule->special) {
            for (uint32_t i = 0; i < n->nargs + n->nkwargs && !eager; i++) {
                const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
                bool nested = false;
                if (!collect_grad_refs(ag, a, true, &nested)) continue;
                int pi = -1;
                for (int k = 0; !nested && k < b.np && pi < 0; k++)
                    if (b.val[k].kind == IRARG_NODE && b.val[k].u.ref == a->u.ref) pi = k;
                if (nested || pi < 0 || !formula_of(rule->grads, b.p[pi].name)) {
                    eager = true;
                    PyObject *msg = PyUnicode_FromFormat("no derivative for an argument of %s: it keeps eager autograd", n->name);
                    if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
                    Py_XDECREF(msg);
                }
            }
        }
        PyErr_Clear();
        if (eager) {
            U[r] = 1;
            count++;
        }
    }
    return count;
}

static void visit_refs(const IRArg *a, void (*fn)(IRRef, void *), void *ctx) {
    if (a->kind == IRARG_NODE) fn(a->u.ref, ctx);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) visit_refs(&a->u.items[i], fn, ctx);
}

/* Outputs eager saves: an output whose op's eager backward saves the op's result (R_RESULT: exp,
 * tanh, relu, softmax ..., through views of it), updated in place after the forward, makes eager's
 * backward raise "modified by an inplace operation" when a gradient reaches that op. The region's
 * backward may not read that value at all (its partition saved the op's input and recomputes), so
 * ember._autograd checks the output's version itself. Per such output: (output index, the outputs
 * whose gradients reach the op, or None: all). */
static PyObject *outputs_eager_saves(AG *ag, const IRArg *outs) {
    const IRGraph *g = ag->g;
    PyObject *res = PyList_New(0);
    if (ag->flag && deps_update(ag) < 0) Py_CLEAR(res);
    for (uint32_t k = 0; res && k < outs->n; k++) {
        if (outs->u.items[k].kind != IRARG_NODE || !ag->tangent[k]) continue;
        IRRef r = outs->u.items[k].u.ref;
        bool view = false;
        for (uint32_t depth = 0; depth < g->nnodes; depth++) {
            IRRef up = alias_step(g, r, &view);
            if (!up || !view) break;
            r = up;
        }
        const IRNode *n = em_ir_node(g, r);
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !ag->grad[r] || !meta_needs_grad(&n->meta))
            continue;
        ag->cur = r;
        Bind b;
        const Rule *rule = find_rule(ag, n, &b);
        PyErr_Clear();
        if (!rule || !(rule->flags & R_RESULT)) continue;
        PyObject *ks = Py_NewRef(Py_None);
        uint64_t d = ag->flag && ag->grad[r] < ag->ndeps ? ag->deps[ag->grad[r]] : 0;
        for (uint32_t j = 0; d && ks && j < outs->n; j++) {
            if (ks == Py_None) Py_SETREF(ks, PyList_New(0));
            PyObject *v = ks && (d >> j & 1) ? PyLong_FromUnsignedLong(j) : NULL;
            if (v && PyList_Append(ks, v) < 0) Py_CLEAR(ks);
            Py_XDECREF(v);
        }
        PyObject *it = ks ? Py_BuildValue("(IN)", (unsigned)k, ks) : NULL;
        if (!it || PyList_Append(res, it) < 0) Py_CLEAR(res);
        Py_XDECREF(it);
    }
    return res;
}

/* A saved tensor that only the gradients of outputs without a gradient read (the backward never
 * needs its value: absent_zero masks what it reaches), and that an in-place update changed after
 * the forward, is no error in eager, which never runs those outputs' backward; autograd's
 * ctx.saved_tensors checks every saved tensor (program_gen seed 880121). saved_needs says, per
 * saved value, which outputs' gradients make the backward read it: ember._autograd unpacks the
 * saved tensors one by one when ctx.saved_tensors raises, and raises only for one that a given
 * gradient needs.
 *
 * nd[r] over the joint graph, in reverse (an over-approximation: "r's value may reach a returned
 * gradient only if one of the outputs in nd[r] has a gradient"): an input gradient reaches the
 * caller when one of its grad_deps outputs has a gradient (any output, all bits, when grad_deps is
 * empty); a value reaches what reads it, except that the value argument of a where(flag, x, 0) of
 * absent_zero reaches it only when one of the flag's outputs has a gradient (the gate's set: "and
 * the where's own value reaches", dropped, keeps it an over-approximation); an in-place update
 * reaches whatever reads the value it writes (its alias root) after it, which the fixed point
 * covers for views made before the update. Per saved value: a list of output indices, or None
 * (always read: no flags, an empty or full set). */
typedef struct {
    uint64_t *nd, v;
    bool grew;
} NeedCtx;

static void need_or(IRRef r, void *ctx) {
    NeedCtx *c = ctx;
    if ((c->nd[r] | c->v) != c->nd[r]) c->nd[r] |= c->v, c->grew = true;
}

static PyObject *saved_needs(const AG *ag, const uint8_t *saved, const uint8_t *need, const IRRef *grads,
                             uint32_t ngrads, PyObject *gdeps) {
    const IRGraph *j = ag->j;
    uint32_t N = j->nnodes;
    if (!ag->flag) return Py_NewRef(Py_None);
    uint64_t *nd = calloc(N + 1, sizeof(uint64_t)), *gs = calloc(N + 1, sizeof(uint64_t));
    PyObject *res = nd && gs ? PyList_New(0) : NULL;
    if (!res) {
        free(nd);
        free(gs);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    for (uint32_t i = 0; i < ag->ngates; i++) gs[ag->gate[i]] = ag->gate_set[i];
    for (uint32_t i = 0; i < ngrads; i++) {
        PyObject *ks = PyList_GET_ITEM(gdeps, i);
        uint64_t m = PyList_GET_SIZE(ks) ? 0 : ~(uint64_t)0;
        for (Py_ssize_t q = 0; q < PyList_GET_SIZE(ks); q++) m |= (uint64_t)1 << PyLong_AsUnsignedLong(PyList_GET_ITEM(ks, q));
        nd[grads[i]] |= m;
    }
    NeedCtx c = {nd, 0, true};
    while (c.grew) {
        c.grew = false;
        for (IRRef r = N - 1; r >= 1; r--) {
            const IRNode *n = em_ir_node(j, r);
            if (n->kind == IR_OUTPUT) continue;
            if (em_ir_mutates(n)) {
                c.v = nd[alias_root(j, r)];
                need_or(r, &c);
            }
            if (!nd[r]) continue;
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
                c.v = gs[r] && i == 1 ? gs[r] : nd[r];
                visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need_or, &c);
            }
        }
    }
    uint64_t all = ag->nouts >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << ag->nouts) - 1;
    for (IRRef r = 1; r < N && res; r++) {
        if (!(saved[r] && need[r])) continue;
        PyObject *ks = Py_NewRef(Py_None);
        if (nd[r] && (nd[r] & ~all) == 0 && nd[r] != all) {
            Py_SETREF(ks, PyList_New(0));
            for (uint32_t k = 0; ks && k < ag->nouts; k++) {
                if (!(nd[r] >> k & 1)) continue;
                PyObject *v = PyLong_FromUnsignedLong(k);
                if (!v || PyList_Append(ks, v) < 0) Py_CLEAR(ks);
                Py_XDECREF(v);
            }
        }
        if (!ks || PyList_Append(res, ks) < 0) Py_CLEAR(res);
        Py_XDECREF(ks);
    }
    free(nd);
    free(gs);
    return res;
}

typedef struct {
    const uint32_t *step;
    uint32_t s;
    uint8_t *mark;
    IRRef *list;
    uint32_t n;
} RefCollect;

static void collect_input(IRRef r, void *ctx) {
    RefCollect *c = ctx;
    if (c->step[r] == c->s || c->mark[r]) return;
    c->mark[r] = 1;
    c->list[c->n++] = r;
}

typedef struct {
    const uint32_t *step;
    uint32_t s;
    uint8_t *used_outside;
} UseCollect;

static void collect_use(IRRef r, void *ctx) {
    UseCollect *c = ctx;
    if (c->step[r] != c->s) c->used_outside[r] = 1;
}

/* The graph as a chain of steps: runs of nodes with rules (each its own compiled region) and runs
 * of nodes that keep eager autograd (replayed by an EagerGraph with grad enabled), glued by
 * ember._autograd.make_split. Gradients flow between steps through eager autograd. */
static PyObject *compile_split(AG *ag, const uint8_t *U, PyObject *reasons, PyObject **info) {
    const IRGraph *g = ag->g;
    uint32_t G = g->nnodes;
    uint32_t *step = calloc(G, sizeof(uint32_t));
    uint8_t *used_outside = calloc(G, 1), *mark = calloc(G, 1);
    IRRef *map = calloc(G, sizeof(IRRef)), *list = calloc(G, sizeof(IRRef)), *outl = calloc(G, sizeof(IRRef));
    PyObject *steps = PyList_New(0), *infos = PyList_New(0), *result = NULL, *make = NULL, *outs = NULL, *ins = NULL;
    if (!step || !used_outside || !mark || !map || !list || !outl || !steps || !infos) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t nsteps = 0;
    int prev = -1;
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER || grad_mode_node(n)) {
            /* grad-mode nodes belong to no step (check_grad_mode): the ops inside a no_grad block
             * need no grad, so they are in compiled steps, which run without grad; an eager step's
             * ops need grad, so they are outside such blocks, where grad mode is the caller's (on) */
            step[r] = UINT32_MAX;
            continue;
        }
        if (n->kind == IR_OUTPUT) continue;
        if ((int)U[r] != prev) {
            nsteps++;
            prev = U[r];
        }
        step[r] = nsteps - 1;
    }
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER) continue;
        UseCollect uc = {step, n->kind == IR_OUTPUT ? UINT32_MAX - 1 : step[r], used_outside};
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], collect_use, &uc);
    }
    for (uint32_t s = 0; s < nsteps; s++) {
        IRGraph *sub = em_ir_new(g->arena);
        if (!sub) goto done;
        sub->shape_env = g->shape_env; /* symbolic sizes: each step is a symbolic region too */
        memset(mark, 0, G);
        RefCollect rc = {step, s, mark, list, 0};
        bool eager = false;
        for (IRRef r = 1; r < G; r++) {
            if (step[r] != s || em_ir_node(g, r)->kind == IR_PLACEHOLDER || em_ir_node(g, r)->kind == IR_OUTPUT) continue;
            const IRNode *n = em_ir_node(g, r);
            eager = U[r];
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], collect_input, &rc);
        }
        ins = PyTuple_New(rc.n);
        if (!ins) goto done;
        for (uint32_t i = 0; i < rc.n; i++) {
            const IRNode *p = em_ir_node(g, rc.list[i]);
            map[rc.list[i]] = em_ir_placeholder(sub, p->name, &p->meta);
            PyObject *v = PyLong_FromUnsignedLong(rc.list[i]);
            if (!map[rc.list[i]] || !v) {
                Py_XDECREF(v);
                goto done;
            }
            PyTuple_SET_ITEM(ins, i, v);
        }
        uint32_t nout = 0;
        for (IRRef r = 1; r < G; r++) {
            if (step[r] != s || (em_ir_node(g, r)->kind != IR_CALL_FUNCTION && em_ir_node(g, r)->kind != IR_CALL_METHOD)) continue;
            map[r] = copy_into(g->arena, sub, em_ir_node(g, r), map);
            if (!map[r]) goto done;
            if (used_outside[r]) outl[nout++] = r;
        }
        outs = PyTuple_New(nout);
        IRRef *subouts = calloc(nout + 1, sizeof(IRRef));
        if (!outs || !subouts) {
            free(subouts);
            goto done;
        }
        for (uint32_t i = 0; i < nout; i++) {
            subouts[i] = map[outl[i]];
            PyTuple_SET_ITEM(outs, i, PyLong_FromUnsignedLong(outl[i]));
        }
        int rcode = em_ir_set_output(sub, subouts, nout);
        free(subouts);
        if (rcode < 0) {
            PyErr_NoMemory();
            goto done;
        }
        PyObject *fn = NULL, *sinfo = NULL;
        int is_eg = 0;
        if (eager) fn = em_eager_graph_new(sub);
        else fn = em_autograd_compile(sub, ag->ember_halves, &is_eg, &sinfo);
        if (!fn) {
            Py_XDECREF(sinfo);
            goto done;
        }
        /* a compiled step's kernels index its inputs with their metas' strides; an input made by an
         * eager step can have another layout than the meta promised (a fused attention kernel's
         * output, traced on the meta device as contiguous): make_split copies it into the layout */
        PyObject *lay = Py_NewRef(Py_None);
        for (Py_ssize_t i = 0; !eager && ag->ember_halves && i < PyTuple_GET_SIZE(ins); i++) {
            IRRef r = (IRRef)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(ins, i));
            const IRMeta *m = &em_ir_node(g, r)->meta;
            if (em_ir_node(g, r)->kind == IR_PLACEHOLDER || m->kind != IRMETA_TENSOR) continue;
            int32_t perm[64];
            if (m->sym_sizes && !sym_dense(ag, m, perm)) { /* a layout per size: not expressible here */
                Py_DECREF(lay);
                Py_DECREF(fn);
                Py_XDECREF(sinfo);
                ag_fail_sym(ag, "a step of a split region reads a value of a layout that is not dense");
                goto done;
            }
            if (lay == Py_None) {
                Py_SETREF(lay, PyList_New(PyTuple_GET_SIZE(ins)));
                for (Py_ssize_t k = 0; lay && k < PyTuple_GET_SIZE(ins); k++) PyList_SET_ITEM(lay, k, Py_NewRef(Py_None));
            }
            PyObject *l = !lay ? NULL
                          : m->sym_sizes ? Py_BuildValue("(sN)", "dense", int_tuple_of(perm, m->ndim, false)) /* (every size) */
                                         : Py_BuildValue("(NN)", em_int64_tuple(m->ndim, m->sizes), em_int64_tuple(m->ndim, m->strides));
            if (!l) {
                Py_XDECREF(lay);
                Py_DECREF(fn);
                Py_XDECREF(sinfo);
                goto done;
            }
            PyList_SetItem(lay, i, l);
        }
        PyObject *item = Py_BuildValue("(NOON)", fn, ins, outs, lay);
        PyObject *ii = Py_BuildValue("{s:s,s:N}", "kind", eager ? "eager autograd" : "compiled",
                                     "autograd", sinfo ? sinfo : Py_NewRef(Py_None));
        Py_CLEAR(ins);
        Py_CLEAR(outs);
        if (!item || !ii || PyList_Append(steps, item) < 0 || PyList_Append(infos, ii) < 0) {
            Py_XDECREF(item);
            Py_XDECREF(ii);
            goto done;
        }
        Py_DECREF(item);
        Py_DECREF(ii);
    }
    {
        const IRArg *go = &em_ir_node(g, g->output)->args[0];
        outs = PyTuple_New(go->n);
        ins = PyTuple_New(g->ninputs);
        if (!outs || !ins) goto done;
        for (uint32_t k = 0; k < go->n; k++) PyTuple_SET_ITEM(outs, k, PyLong_FromUnsignedLong(go->u.items[k].u.ref));
        for (uint32_t i = 0; i < g->ninputs; i++) PyTuple_SET_ITEM(ins, i, PyLong_FromUnsignedLong(g->inputs[i]));
    }
    if (!em_lazy_attr(&make, "ember._autograd", "make_split")) goto done;
    result = PyObject_CallFunction(make, "OOOI", steps, ins, outs, (unsigned)G);
    if (result) {
        *info = Py_BuildValue("{s:O,s:O}", "split", reasons, "steps", infos);
        if (!*info) Py_CLEAR(result);
    }
done:
    free(step);
    free(used_outside);
    free(mark);
    free(map);
    free(list);
    free(outl);
    Py_XDECREF(steps);
    Py_XDECREF(infos);
    Py_XDECREF(outs);
    Py_XDECREF(ins);
    return result;
}

/* ---------------------------------------------------------------- decompositions before the joint graph */

/* Attention is decomposed before the joint graph is built, as AOTAutograd's tracing through
 * F.multi_head_attention_forward and the math attention kernel does: the region then holds the
 * ops they are made of (linear, views, scaled_dot_product_attention or matmul / _safe_softmax /
 * dropout), each with its own rule, instead of one op without a derivative that splits it.
 *   multi_head_attention_forward: the self-attention form nn.MultiheadAttention and
 *     nn.TransformerEncoderLayer call (query is key is value, packed in_proj_weight, no bias_k/v,
 *     no zero attention, need_weights=False, no key_padding_mask), op for op as
 *     torch/nn/functional.py writes it; other forms keep eager autograd (split).
 *   scaled_dot_product_attention running the math kernel (sdpa_kind): op for op as
 *     _scaled_dot_product_attention_math (aten/src/ATen/native/transformers/attention.cpp): q and
 *     k^T each scaled by sqrt(scale), matmul, + mask (is_causal: the 0/-inf lower-triangular
 *     mask), _safe_softmax, dropout (at::dropout: the same random draws), matmul with v. */

/* requires_grad of a decomposition's node as eager autograd sets it. */
static IRRef dz(AG *d, IRRef r) {
    if (!r) return 0;
    IRNode *n = &d->j->nodes[r];
    bool any = false;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs && !any; i++)
        any = arg_requires_grad(d->j, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
    if (n->meta.kind == IRMETA_TENSOR) /* an inference graph's values need no gradient (no_grad, or no input that does) */
        n->meta.requires_grad = !d->inference && any && dtype_differentiable(n->meta.dtype);
    return r;
}

/* x.name(*consts) (consts: a new tuple, stolen), requires_grad set. */
static IRRef dz_m(AG *d, const char *name, IRRef x, PyObject *consts) {
    if (!x || !consts || PyTuple_GET_SIZE(consts) > 6) {
        Py_XDECREF(consts);
        if (!d->reason) ag_fail_exc(d);
        return 0;
    }
    IRArg a[8];
    uint32_t n = 1 + (uint32_t)PyTuple_GET_SIZE(consts);
    a[0] = arg_node(x);
    for (uint32_t i = 1; i < n; i++) a[i] = arg_const_steal(d, Py_NewRef(PyTuple_GET_ITEM(consts, i - 1)));
    Py_DECREF(consts);
    return dz(d, emit_method(d, name, a, n));
}

static IRRef dz_mul(AG *d, IRRef x, double c) {
    return x ? dz(d, emit_op(d, "mul", arg_node(x), arg_const_steal(d, PyFloat_FromDouble(c)), 2)) : 0;
}

/* bool mask -> 0 / -inf in dtype: zeros_like(m, dtype=dtype).masked_fill(where_inf, -inf), as
 * convert_boolean_attn_mask (attention.cpp) and F._canonical_mask do. where_inf: m itself (MHA's
 * convention, True = masked) or m.logical_not() (scaled_dot_product_attention's, True = attend). */
static IRRef dz_bool_mask(AG *d, IRRef m, bool true_attends, PyObject *dtype) {
    PyObject *kwn[1] = {kwname(d, "dtype")};
    if (!kwn[0]) return ag_fail_exc(d), 0;
    PyObject *t = torch_attr("zeros_like");
    if (!t || !em_arena_hold_steal(d->a, t)) return ag_fail_exc(d), 0;
    IRArg a[1] = {arg_node(m)}, kv[1] = {arg_const_steal(d, Py_NewRef(dtype))};
    IRRef z = dz(d, ag_emit(d, IR_CALL_FUNCTION, t, a, 1, kwn, kv, 1));
    IRRef w = true_attends ? dz_m(d, "logical_not", m, PyTuple_New(0)) : m;
    if (!z || !w) return 0;
    IRArg fa[3] = {arg_node(z), arg_node(w), arg_const_steal(d, PyFloat_FromDouble(-INFINITY))};
    return dz(d, emit_method(d, "masked_fill", fa, 3));
}

/* scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale) in the decomposed graph:
 * the math kernel's ops when eager runs that kernel, else one sdpa node (its SP_SDPA rule, or the
 * split when no rule applies). Returns 0 with d->reason on failure. */
static IRRef dz_sdpa(AG *d, IRRef q, IRRef k, IRRef v, IRRef mask, double dropout_p, bool causal, PyObject *scale) {
    const IRMeta *qm = jmeta(d, q), *km = jmeta(d, k), *mm = mask ? jmeta(d, mask) : NULL;
    IRArg dp = arg_const_steal(d, PyFloat_FromDouble(dropout_p)), ic = arg_const_steal(d, PyBool_FromLong(causal));
    IRArg sc = arg_const_steal(d, Py_NewRef(scale)), gq = arg_const_steal(d, Py_NewRef(Py_False));
    if (arg_bad(&dp) || arg_bad(&ic) || arg_bad(&sc) || arg_bad(&gq)) return ag_fail_exc(d), 0;
    int kind = sdpa_kind(qm, km, jmeta(d, v), mm, &dp, &ic, &sc, &gq);
    bool bcast_ok = true; /* attn.add_(mask): the mask broadcasts to the scores' shape */
    if (mm) { /* scores: (*q.batch, L, S); symbolic sizes: the same expressions, or a static 1 */
        bcast_ok = mm->ndim <= qm->ndim;
        for (int32_t i = 1; bcast_ok && i <= mm->ndim; i++) {
            const IRMeta *wm = i == 1 ? km : qm;
            int32_t wd = i == 1 ? km->ndim - 2 : qm->ndim - i, md = mm->ndim - i;
            bcast_ok = mm->sizes[md] == 1 || mm->sizes[md] == wm->sizes[wd];
            if (bcast_ok && d->env)
                bcast_ok = em_sym_simplify(d->env, dim_sym(d, mm, md)) ==
                               (mm->sizes[md] == 1 ? em_sym_const(d->env, 1) : em_sym_simplify(d->env, dim_sym(d, wm, wd)));
        }
    }
    if (kind != SDPA_MATH || (causal && mask) || !bcast_ok) {
        PyObject *t = torch_attr("nn.functional.scaled_dot_product_attention");
        if (!t || !em_arena_hold_steal(d->a, t)) return ag_fail_exc(d), 0;
        IRArg a[6] = {arg_node(q), arg_node(k), arg_node(v), mask ? arg_node(mask) : arg_const_steal(d, Py_NewRef(Py_None)),
                      dp, ic};
        PyObject *kwn[1] = {kwname(d, "scale")};
        if (!kwn[0]) return ag_fail_exc(d), 0;
        return dz(d, ag_emit(d, IR_CALL_FUNCTION, t, a, 6, kwn, &sc, scale == Py_None ? 0 : 1));
    }
    if (dims_symbolic(d, qm, qm->ndim - 1)) return 0; /* symbolic sizes: the scale reads the head dim */
    double s = scale == Py_None ? 1.0 / sqrt((double)qm->sizes[qm->ndim - 1]) : fabs(PyFloat_AsDouble(scale));
    bool neg = scale != Py_None && PyFloat_AsDouble(scale) < 0.0;
    if (PyErr_Occurred()) return ag_fail_exc(d), 0;
    double sf = sqrt(s); /* sdp::calculate_scale(...).sqrt() */
    IRRef q1 = dz_mul(d, q, neg ? 0.0 - sf : sf);
    IRRef kt = dz_mul(d, dz_m(d, "transpose", k, Py_BuildValue("(ii)", -2, -1)), sf);
    IRRef attn = q1 && kt ? dz(d, emit_fn(d, "matmul", (IRArg[]){arg_node(q1), arg_node(kt)}, 2)) : 0;
    if (!attn) return 0;
    IRRef add = mask;
    if (causal) { /* at::ones({L, S}, bool).tril(), converted */
        PyObject *kwn[2] = {kwname(d, "dtype"), kwname(d, "device")};
        PyObject *bool_t = torch_attr("bool"), *ones = torch_attr("ones");
        if (!kwn[0] || !kwn[1] || !bool_t || !ones || !em_arena_hold_steal(d->a, bool_t) || !em_arena_hold_steal(d->a, ones))
            return ag_fail_exc(d), 0;
        IRArg ls = size_arg(d, q, qm->ndim - 2), ss = arg_bad(&ls) ? ls : size_arg(d, k, km->ndim - 2);
        if (arg_bad(&ss)) return 0;
        IRArg a[1] = {{0}};
        a[0].kind = IRARG_TUPLE;
        a[0].n = 2;
        a[0].u.items = em_arena_alloc(d->a, 2 * sizeof(IRArg));
        if (!a[0].u.items) return PyErr_NoMemory(), ag_fail_exc(d), 0;
        a[0].u.items[0] = ls;
        a[0].u.items[1] = ss;
        if (ls.kind == IRARG_CONST && ss.kind == IRARG_CONST) /* static: one constant */
            a[0] = arg_const_steal(d, Py_BuildValue("(OO)", ls.u.obj, ss.u.obj));
        IRArg kv[2] = {arg_const_steal(d, Py_NewRef(bool_t)), arg_const_steal(d, Py_NewRef(qm->device))};
        IRRef o = dz(d, ag_emit(d, IR_CALL_FUNCTION, ones, a, 1, kwn, kv, 2));
        IRRef tri = dz_m(d, "tril", o, PyTuple_New(0));
        add = tri ? dz_bool_mask(d, tri, true, qm->dtype) : 0;
        if (!add) return 0;
    } else if (mask && meta_dtype_is(mm, "torch.bool")) {
        add = dz_bool_mask(d, mask, true, qm->dtype);
        if (!add) return 0;
    }
    if (add) attn = dz(d, emit_op(d, "add", arg_node(attn), arg_node(add), 2));
    PyObject *ss = torch_attr("ops.aten._safe_softmax");
    if (!attn || !ss || !em_arena_hold_steal(d->a, ss)) return attn ? (ag_fail_exc(d), 0) : 0;
    IRRef p = dz(d, ag_emit(d, IR_CALL_FUNCTION, ss, (IRArg[]){arg_node(attn), arg_const_steal(d, PyLong_FromLong(-1))}, 2,
                            NULL, NULL, 0));
    if (p && dropout_p > 0.0) { /* at::dropout(attn, p, true) */
        IRArg a[4] = {arg_node(p), dp, arg_const_steal(d, Py_NewRef(Py_True)), arg_const_steal(d, Py_NewRef(Py_False))};
        p = dz(d, emit_fn(d, "nn.functional.dropout", a, 4));
    }
    return p ? dz(d, emit_fn(d, "matmul", (IRArg[]){arg_node(p), arg_node(v)}, 2)) : 0;
}

/* a * b of two size arguments (constants fold; a size node: an int node of the graph). */
static IRArg size_mul(AG *d, IRArg a, IRArg b) {
    if (arg_bad(&a) || arg_bad(&b)) return arg_node(0);
    if (a.kind == IRARG_CONST && b.kind == IRARG_CONST) return arg_const_steal(d, PyNumber_Multiply(a.u.obj, b.u.obj));
    return arg_node(emit_op(d, "mul", a, b, 2));
}

/* x.view(sizes), sizes constants or size nodes (size_arg): the symbolic form of dz_m(.., "view", ..). */
static IRRef dz_view(AG *d, IRRef x, const IRArg *sizes, uint32_t n) {
    IRArg t = {0};
    t.kind = IRARG_TUPLE;
    t.n = n;
    t.u.items = em_arena_alloc(d->a, (n + 1) * sizeof(IRArg));
    bool allc = true;
    for (uint32_t i = 0; t.u.items && i < n; i++) {
        if (arg_bad(&sizes[i])) return 0;
        t.u.items[i] = sizes[i];
        allc &= sizes[i].kind == IRARG_CONST;
    }
    if (!x || !t.u.items) return 0;
    if (allc) { /* a static shape: one constant, as dz_m passes it */
        PyObject *c = PyTuple_New(n);
        for (uint32_t i = 0; c && i < n; i++) PyTuple_SET_ITEM(c, i, Py_NewRef(sizes[i].u.obj));
        t = arg_const_steal(d, c);
        if (arg_bad(&t)) return ag_fail_exc(d), 0;
    }
    IRArg a[2] = {arg_node(x), t};
    return dz(d, emit_method(d, "view", a, 2));
}

#define K(v) arg_const_steal(d, PyLong_FromLongLong(v))

static const Rule MHA_RULE = {
    "torch.nn.functional.multi_head_attention_forward",
    "query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn, "
    "dropout_p, out_proj_weight, out_proj_bias, training=True, key_padding_mask=None, need_weights=True, attn_mask=None, "
    "use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, "
    "static_v=None, average_attn_weights=True, is_causal=False",
    "", "", 0, 0};

static bool const_is(IRArg a, PyObject *v) { return a.kind == IRARG_CONST && a.u.obj == v; }
static bool const_false(IRArg a) { return a.kind == IRARG_CONST && (a.u.obj == Py_False || a.u.obj == Py_None); }

/* F.multi_head_attention_forward (torch/nn/functional.py, need_weights=False branch) op for op.
 * Returns the joint ref of attn_output, 0 without a reason when this form is not decomposed. */
static IRRef dz_mha(AG *d, const Bind *b) {
    IRArg q = bval(b, "query"), k = bval(b, "key"), v = bval(b, "value"), w = bval(b, "in_proj_weight");
    IRArg bias = bval(b, "in_proj_bias"), wo = bval(b, "out_proj_weight"), bo = bval(b, "out_proj_bias");
    IRArg nh = bval(b, "num_heads"), dp = bval(b, "dropout_p"), tr = bval(b, "training"), ic = bval(b, "is_causal");
    IRArg am = bval(b, "attn_mask");
    if (q.kind != IRARG_NODE || k.kind != IRARG_NODE || v.kind != IRARG_NODE || q.u.ref != k.u.ref || k.u.ref != v.u.ref)
        return 0; /* cross-attention forms: not decomposed */
    if (!const_is(bval(b, "bias_k"), Py_None) || !const_is(bval(b, "bias_v"), Py_None) ||
        !const_false(bval(b, "add_zero_attn")) || !const_is(bval(b, "need_weights"), Py_False) ||
        !const_false(bval(b, "use_separate_proj_weight")) || !const_is(bval(b, "key_padding_mask"), Py_None) ||
        !const_is(bval(b, "static_k"), Py_None) || !const_is(bval(b, "static_v"), Py_None) || w.kind != IRARG_NODE ||
        wo.kind != IRARG_NODE || nh.kind != IRARG_CONST || !PyLong_Check(nh.u.obj) || dp.kind != IRARG_CONST ||
        tr.kind != IRARG_CONST || ic.kind != IRARG_CONST || (am.kind != IRARG_NODE && !arg_is_none(&am)) ||
        (bias.kind != IRARG_NODE && !arg_is_none(&bias)) || (bo.kind != IRARG_NODE && !arg_is_none(&bo)))
        return 0;
    const IRMeta *xm = &em_ir_node(d->g, q.u.ref)->meta, *wom = &em_ir_node(d->g, wo.u.ref)->meta;
    if (xm->kind != IRMETA_TENSOR || xm->ndim != 3 || wom->kind != IRMETA_TENSOR || wom->ndim != 2) return 0;
    long long L = xm->sizes[0], B = xm->sizes[1], E = xm->sizes[2], H = PyLong_AsLongLong(nh.u.obj);
    double p = PyFloat_AsDouble(dp.u.obj);
    int training = PyObject_IsTrue(tr.u.obj), causal = PyObject_IsTrue(ic.u.obj);
    if (PyErr_Occurred() || H <= 0 || E % H || training < 0 || causal < 0) {
        PyErr_Clear();
        return 0;
    }
    long long hd = E / H, S = L;
    IRRef mask = 0;
    if (dims_symbolic(d, xm, 2) || (dims_symbolic(d, xm, 0) && am.kind == IRARG_NODE))
        return 0; /* symbolic sizes: a symbolic embedding dim, or a mask (its checks compare sizes) */
    IRRef xr = d->fmap[q.u.ref];
    IRArg Ls = xr ? size_arg(d, xr, 0) : arg_node(0), Bs = xr ? size_arg(d, xr, 1) : arg_node(0); /* L, B */
    IRArg BHs = size_mul(d, Bs, K(H));
    if (am.kind == IRARG_NODE) {
        const IRMeta *mm = &em_ir_node(d->g, am.u.ref)->meta;
        if (mm->kind != IRMETA_TENSOR || mm->requires_grad) return 0;
        if (!(mm->ndim == 2 && mm->sizes[0] == L && mm->sizes[1] == S) &&
            !(mm->ndim == 3 && mm->sizes[0] == B * H && mm->sizes[1] == L && mm->sizes[2] == S))
            return 0; /* eager raises: keep its error */
        if (!causal) { /* is_causal with no key_padding_mask and need_weights=False: the mask is dropped */
            mask = d->fmap[am.u.ref];
            if (meta_dtype_is(mm, "torch.bool")) mask = dz_bool_mask(d, mask, false, xm->dtype);
            else if (!dtype_differentiable(mm->dtype)) return 0;
            if (mask && mm->ndim == 2) mask = dz_m(d, "unsqueeze", mask, Py_BuildValue("(i)", 0));
            if (!mask) return 0;
        }
    } else if (causal) {
        return 0; /* eager raises "Need attn_mask if specifying the is_causal hint" */
    }
    /* _in_projection_packed, q is k is v */
    IRArg la[3] = {d->fmap[q.u.ref] ? arg_node(d->fmap[q.u.ref]) : arg_node(0), map_arg(d, &w), map_arg(d, &bias)};
    IRRef proj = dz(d, emit_fn(d, "nn.functional.linear", la, 3));
    proj = dz_view(d, proj, (IRArg[]){Ls, Bs, K(3), K(E)}, 4); /* unflatten(-1, (3, E)) */
    proj = dz_m(d, "unsqueeze", proj, Py_BuildValue("(i)", 0));
    proj = dz_m(d, "transpose", proj, Py_BuildValue("(ii)", 0, -2));
    proj = dz_m(d, "squeeze", proj, Py_BuildValue("(i)", -2));
    proj = dz_m(d, "contiguous", proj, PyTuple_New(0));
    if (!proj) return 0;
    IRRef qkv[3];
    for (int i = 0; i < 3; i++) {
        qkv[i] = dz(d, emit_getitem(d, proj, i));
        qkv[i] = dz_view(d, qkv[i], (IRArg[]){Ls, BHs, K(hd)}, 3);
        qkv[i] = dz_m(d, "transpose", qkv[i], Py_BuildValue("(ii)", 0, 1));
    }
    if (!training) p = 0.0;
    if (mask) {
        const IRMeta *mm = jmeta(d, mask);
        if (!(mm->sizes[0] == 1 && mm->ndim == 3)) mask = dz_m(d, "view", mask, Py_BuildValue("((LLLL))", B, H, -1LL, S));
        else mask = dz_m(d, "unsqueeze", mask, Py_BuildValue("(i)", 0));
        if (!mask) return 0;
    }
    for (int i = 0; i < 3; i++) qkv[i] = dz_view(d, qkv[i], (IRArg[]){Bs, K(H), Ls, K(hd)}, 4);
    if (!qkv[0] || !qkv[1] || !qkv[2]) return 0;
    IRRef out = dz_sdpa(d, qkv[0], qkv[1], qkv[2], mask, p, causal, Py_None);
    out = dz_m(d, "permute", out, Py_BuildValue("(iiii)", 2, 0, 1, 3));
    /* reshape(B * L, E) of the permuted (non-contiguous) result: the copy it makes, then a view
     * (aten reshape: _unsafe_view(clone(contiguous))), each of which the meta memo keeps */
    out = dz_m(d, "contiguous", out, PyTuple_New(0));
    out = dz_view(d, out, (IRArg[]){size_mul(d, Bs, Ls), K(E)}, 2);
    if (!out) return 0;
    IRArg oa[3] = {arg_node(out), map_arg(d, &wo), map_arg(d, &bo)};
    out = dz(d, emit_fn(d, "nn.functional.linear", oa, 3));
    return dz_view(d, out, (IRArg[]){Ls, Bs, K(wom->sizes[0])}, 3);
}

#undef K

/* F.cross_entropy with class indices (torch/nn/functional.py -> cross_entropy_loss, LossNLL.cpp):
 * nll_loss(log_softmax(input, class dim), target, weight, reduction, ignore_index), each with its
 * own rule. Label smoothing and class-probability targets: CE_SMOOTH_RULE below. */
#define CE_SIG                                                                                     \
    "self, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction='mean', " \
    "label_smoothing=0.0"
static const Rule CE_RULE = {
    "torch.nn.functional.cross_entropy", CE_SIG,
    "nll:self null:size_average null:reduce const:ignore_index reduction:reduction eq0:label_smoothing", "", 0, 0};

static IRRef dz_cross_entropy(AG *d, const Bind *b) {
    IRArg self = bval(b, "self"), target = bval(b, "target"), w = bval(b, "weight");
    const IRMeta *m = val_meta(d, &self);
    IRArg la[2] = {map_arg(d, &self), arg_const_steal(d, PyLong_FromLong(m->ndim == 1 ? 0 : 1))};
    IRRef ls = arg_bad(&la[1]) ? 0 : dz(d, emit_fn(d, "nn.functional.log_softmax", la, 2));
    IRArg none = arg_const_steal(d, Py_NewRef(Py_None));
    IRArg na[7] = {arg_node(ls), map_arg(d, &target), map_arg(d, &w), none, bval(b, "ignore_index"), none,
                   bval(b, "reduction")};
    return ls ? dz(d, emit_fn(d, "nn.functional.nll_loss", na, 7)) : 0;
}

/* F.cross_entropy without class weights in the two forms cross_entropy_loss_symint (LossNLL.cpp)
 * composes from differentiable ops: class-probability targets (cross_entropy_loss_prob_target:
 * -(log_softmax(x) * t').sum(...), t' the target smoothed when label_smoothing > 0) and class
 * indices with label smoothing (cross_entropy_loss_label_smoothing: (1 - ls) * nll_loss + ls / C
 * times the mean, over the targets not ignored, of -log_softmax(x).sum(class dim)). */
static const Rule CE_SMOOTH_RULE = {
    "torch.nn.functional.cross_entropy", CE_SIG,
    "null:weight null:size_average null:reduce const:ignore_index reduction:reduction const:label_smoothing", "", 0, 0};

static IRRef dz_cross_entropy_smooth(AG *d, const Bind *b) {
    IRArg self = bval(b, "self"), target = bval(b, "target"), ii = bval(b, "ignore_index");
    const IRMeta *m = val_meta(d, &self), *tm = val_meta(d, &target);
    if (!m || !tm || m->kind != IRMETA_TENSOR || tm->kind != IRMETA_TENSOR || m->ndim < 1) return 0;
    double lsv = PyFloat_AsDouble(bval(b, "label_smoothing").u.obj);
    const char *red = PyUnicode_AsUTF8(bval(b, "reduction").u.obj);
    if (PyErr_Occurred() || !red || lsv < 0 || lsv > 1) return PyErr_Clear(), 0;
    int cd = m->ndim == 1 ? 0 : 1;
    int64_t C = m->sizes[cd], numel = 1;
    for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
    bool prob = tm->ndim == m->ndim && !memcmp(tm->sizes, m->sizes, (size_t)m->ndim * sizeof(int64_t)) &&
                dtype_differentiable(tm->dtype) && !meta_complex(tm);
    bool idx = !prob && (m->ndim == 1 || m->ndim == 2) && tm->ndim == m->ndim - 1 && tm->dtype == torch_dtype("int64") && lsv > 0;
    long long ignore = PyLong_AsLongLong(ii.u.obj);
    if (PyErr_Occurred()) return PyErr_Clear(), 0;
    if ((!prob && !idx) || (prob && (ignore >= 0 || numel == 0 || C == 0))) return 0; /* eager raises or divides by 0 */
    IRArg la[2] = {map_arg(d, &self), arg_const_steal(d, PyLong_FromLong(cd))};
    IRRef ls = dz(d, emit_fn(d, "nn.functional.log_softmax", la, 2));
    if (!ls) return 0;
    IRArg cdim = arg_const_steal(d, PyLong_FromLong(cd)), t = map_arg(d, &target);
    if (prob) {
        IRRef tt = t.u.ref;
        if (lsv > 0) {
            tt = dz(d, emit_op(d, "mul", t, arg_const_steal(d, PyFloat_FromDouble(1 - lsv)), 2));
            tt = tt ? dz(d, emit_op(d, "add", arg_node(tt), arg_const_steal(d, PyFloat_FromDouble(lsv / (double)C)), 2)) : 0;
        }
        IRRef p = tt ? dz(d, emit_op(d, "mul", arg_node(ls), arg_node(tt), 2)) : 0;
        IRArg sa[2] = {arg_node(p), cdim};
        bool none = !strcmp(red, "none");
        IRRef sm = p ? dz(d, emit_method(d, "sum", sa, none ? 2 : 1)) : 0;
        IRRef r = sm ? dz(d, emit_op(d, "neg", arg_node(sm), arg_node(sm), 1)) : 0;
        if (r && !strcmp(red, "mean"))
            r = dz(d, emit_op(d, "truediv", arg_node(r), arg_const_steal(d, PyLong_FromLongLong(numel / C)), 2));
        return r;
    }
    IRArg none = arg_const_steal(d, Py_NewRef(Py_None));
    IRArg na[7] = {arg_node(ls), t, none, none, ii, none, bval(b, "reduction")};
    IRRef nll = dz(d, emit_fn(d, "nn.functional.nll_loss", na, 7));
    IRArg sa[2] = {arg_node(ls), cdim};
    IRRef ssum = nll ? dz(d, emit_method(d, "sum", sa, 2)) : 0;
    IRRef smooth = ssum ? dz(d, emit_op(d, "neg", arg_node(ssum), arg_node(ssum), 1)) : 0;
    IRRef mask = smooth ? emit_op(d, "eq", t, ii, 2) : 0;
    IRArg fa[3] = {arg_node(smooth), arg_node(mask), arg_const_steal(d, PyFloat_FromDouble(0.0))};
    IRRef ret = mask ? dz(d, emit_method(d, "masked_fill", fa, 3)) : 0;
    if (ret && strcmp(red, "none")) {
        IRArg ra[1] = {arg_node(ret)};
        ret = dz(d, emit_method(d, "sum", ra, 1));
        if (ret && !strcmp(red, "mean")) {
            IRArg na1[1] = {arg_node(mask)};
            IRRef keep = emit_fn(d, "logical_not", na1, 1);
            IRArg ka[1] = {arg_node(keep)};
            IRRef cnt = keep ? emit_method(d, "sum", ka, 1) : 0;
            ret = cnt ? dz(d, emit_op(d, "truediv", arg_node(ret), arg_node(cnt), 2)) : 0;
        }
    }
    IRRef a = ret ? dz(d, emit_op(d, "mul", arg_const_steal(d, PyFloat_FromDouble(1 - lsv)), arg_node(nll), 2)) : 0;
    IRRef c = a ? dz(d, emit_op(d, "mul", arg_node(ret), arg_const_steal(d, PyFloat_FromDouble(lsv / (double)C)), 2)) : 0;
    return c ? dz(d, emit_op(d, "add", arg_node(a), arg_node(c), 2)) : 0;
}

/* F.normalize (torch/nn/functional.py): x / x.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(x). */
static const Rule NORMALIZE_RULE = {"torch.nn.functional.normalize", "self, p=2.0, dim=1, eps=1e-12, out=None",
                                    "null:out const:p const:eps", "", 0, 0};

static IRRef dz_normalize(AG *d, const Bind *b) {
    IRArg self = bval(b, "self");
    IRArg na[4] = {map_arg(d, &self), bval(b, "p"), bval(b, "dim"), arg_const_steal(d, Py_NewRef(Py_True))};
    IRRef nrm = dz(d, emit_method(d, "norm", na, 4));
    IRArg ca[2] = {arg_node(nrm), bval(b, "eps")};
    IRRef cl = nrm ? dz(d, emit_method(d, "clamp_min", ca, 2)) : 0;
    IRArg ea[2] = {arg_node(cl), map_arg(d, &self)};
    IRRef den = cl ? dz(d, emit_method(d, "expand_as", ea, 2)) : 0;
    return den ? dz(d, emit_op(d, "truediv", map_arg(d, &self), arg_node(den), 2)) : 0;
}

/* F.kl_div (torch/nn/functional.py) over aten's composite kl_div (Loss.cpp): exp(t) * (t - x) for a
 * log target, else xlogy(t, t) - t * x; then the reduction ('batchmean': the sum / x.size(0)). */
static const Rule KL_RULE = {"torch.nn.functional.kl_div",
                             "self, target, size_average=None, reduce=None, reduction='mean', log_target=False",
                             "null:size_average null:reduce const:log_target", "", 0, 0};

static IRRef dz_kl_div(AG *d, const Bind *b) {
    IRArg self = bval(b, "self"), target = bval(b, "target"), rd = bval(b, "reduction");
    const IRMeta *m = val_meta(d, &self);
    const char *red = rd.kind == IRARG_CONST && PyUnicode_Check(rd.u.obj) ? PyUnicode_AsUTF8(rd.u.obj) : NULL;
    if (!red || !m || m->kind != IRMETA_TENSOR || meta_complex(m) || target.kind != IRARG_NODE ||
        (strcmp(red, "none") && strcmp(red, "mean") && strcmp(red, "sum") && strcmp(red, "batchmean")))
        return PyErr_Clear(), 0;
    IRArg x = map_arg(d, &self), t = map_arg(d, &target), ta[2] = {t, t};
    IRRef out;
    if (PyObject_IsTrue(bval(b, "log_target").u.obj) == 1) {
        IRRef e = dz(d, emit_fn(d, "exp", ta, 1));
        IRRef df = e ? dz(d, emit_op(d, "sub", t, x, 2)) : 0;
        out = df ? dz(d, emit_op(d, "mul", arg_node(e), arg_node(df), 2)) : 0;
    } else {
        IRRef xl = dz(d, emit_fn(d, "xlogy", ta, 2));
        IRRef tx = xl ? dz(d, emit_op(d, "mul", t, x, 2)) : 0;
        out = tx ? dz(d, emit_op(d, "sub", arg_node(xl), arg_node(tx), 2)) : 0;
    }
    if (!out || !strcmp(red, "none")) return out;
    IRArg oa[1] = {arg_node(out)};
    IRRef r = dz(d, emit_method(d, strcmp(red, "mean") ? "sum" : "mean", oa, 1));
    if (r && !strcmp(red, "batchmean") && m->ndim != 0)
        r = dz(d, emit_op(d, "truediv", arg_node(r), arg_const_steal(d, PyLong_FromLongLong(m->sizes[0])), 2));
    return r;
}

/* F.prelu (aten's prelu: the weight viewed as (C, 1, ...) along dim 1 unless it has one element, then
 * _prelu_kernel: x > 0 ? x : w * x, whose gradients where / mul give). */
static const Rule PRELU_RULE = {"torch.prelu torch.nn.functional.prelu", "self, weight", "", "", 0, 0};

static IRRef dz_prelu(AG *d, const Bind *b) {
    IRArg self = bval(b, "self"), w = bval(b, "weight");
    const IRMeta *m = val_meta(d, &self), *wm = val_meta(d, &w);
    if (!m || !wm || m->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || wm->ndim != 1 || meta_complex(m)) return 0;
    IRRef wv = d->fmap[w.u.ref];
    if (m->ndim >= 2 && wm->sizes[0] != 1) {
        PyObject *shape = PyTuple_New(m->ndim - 1);
        for (int32_t i = 0; shape && i < m->ndim - 1; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(i ? 1 : wm->sizes[0]));
        wv = dz_m(d, "view", wv, Py_BuildValue("(N)", shape));
    }
    IRRef pos = wv ? emit_op(d, "gt", map_arg(d, &self), arg_const_steal(d, PyLong_FromLong(0)), 2) : 0;
    IRRef neg = pos ? dz(d, emit_op(d, "mul", arg_node(wv), map_arg(d, &self), 2)) : 0;
    IRArg wa[3] = {arg_node(pos), map_arg(d, &self), arg_node(neg)};
    return neg ? dz(d, emit_fn(d, "where", wa, 3)) : 0;
}

/* F.pairwise_distance (aten's pairwise_distance): norm(x1 - x2 + eps, p, last dim of the wider, keepdim). */
static const Rule PDIST_RULE = {"torch.pairwise_distance torch.nn.functional.pairwise_distance",
                                "self, x2, p=2.0, eps=1e-06, keepdim=False", "const:p const:eps", "", 0, 0};

static IRRef dz_pairwise_distance(AG *d, const Bind *b) {
    IRArg x1 = bval(b, "self"), x2 = bval(b, "x2");
    const IRMeta *m1 = val_meta(d, &x1), *m2 = val_meta(d, &x2);
    if (!m1 || !m2 || m1->kind != IRMETA_TENSOR || m2->kind != IRMETA_TENSOR || meta_complex(m1) || meta_complex(m2)) return 0;
    int32_t nd = m1->ndim > m2->ndim ? m1->ndim : m2->ndim;
    IRRef df = dz(d, emit_op(d, "sub", map_arg(d, &x1), map_arg(d, &x2), 2));
    IRRef de = df ? dz(d, emit_op(d, "add", arg_node(df), bval(b, "eps"), 2)) : 0;
    IRArg na[4] = {arg_node(de), bval(b, "p"), arg_const_steal(d, PyLong_FromLong(nd - 1)), bval(b, "keepdim")};
    return de ? dz(d, emit_method(d, "norm", na, 4)) : 0;
}

/* F.cosine_similarity (aten's cosine_similarity): x1 and x2 broadcast, each divided by its 2-norm
 * over dim clamped to eps, the product summed over dim. Eager clamps a clone of the norm in place
 * under no_grad, so the clamp passes the gradient through unchanged: n + (clamp_min(n, eps) - n)
 * with the difference detached gives the clamped value and that gradient. */
static const Rule COSSIM_RULE = {"torch.cosine_similarity torch.nn.functional.cosine_similarity",
                                 "self, x2, dim=1, eps=1e-08", "const:dim const:eps", "", 0, 0};

static IRRef dz_cosine_similarity(AG *d, const Bind *b) {
    IRArg x[2] = {bval(b, "self"), bval(b, "x2")};
    const IRMeta *m[2] = {val_meta(d, &x[0]), val_meta(d, &x[1])};
    for (int i = 0; i < 2; i++)
        if (!m[i] || m[i]->kind != IRMETA_TENSOR || !dtype_differentiable(m[i]->dtype) || meta_complex(m[i])) return 0;
    if (m[0]->dtype != m[1]->dtype) return 0;
    int32_t nd = m[0]->ndim > m[1]->ndim ? m[0]->ndim : m[1]->ndim;
    PyObject *shape = PyTuple_New(nd);
    for (int32_t i = 0; shape && i < nd; i++) { /* the broadcast shape (eager: expand_outplace) */
        int32_t i0 = i - (nd - m[0]->ndim), i1 = i - (nd - m[1]->ndim);
        int64_t a = i0 >= 0 ? m[0]->sizes[i0] : 1, c = i1 >= 0 ? m[1]->sizes[i1] : 1;
        if (a != c && a != 1 && c != 1) return Py_DECREF(shape), 0;
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(a == 1 ? c : a));
    }
    if (!shape) return 0;
    IRArg sh = arg_const_steal(d, shape);
    IRRef unit[2];
    for (int i = 0; i < 2; i++) {
        IRArg ea[2] = {map_arg(d, &x[i]), sh};
        IRRef xe = dz(d, emit_method(d, "expand", ea, 2));
        IRArg na[4] = {arg_node(xe), arg_const_steal(d, PyLong_FromLong(2)), bval(b, "dim"), arg_const_steal(d, Py_NewRef(Py_True))};
        IRRef n = xe ? dz(d, emit_fn(d, "linalg.vector_norm", na, 4)) : 0;
        IRArg ca[2] = {arg_node(n), bval(b, "eps")};
        IRRef cl = n ? emit_method(d, "clamp_min", ca, 2) : 0; /* no gradient: the difference is detached */
        IRRef dl = cl ? emit_op(d, "sub", arg_node(cl), arg_node(n), 2) : 0;
        IRArg da[1] = {arg_node(dl)};
        IRRef dt = dl ? emit_method(d, "detach", da, 1) : 0;
        if (!dt) return 0;
        d->j->nodes[cl].meta.requires_grad = d->j->nodes[dl].meta.requires_grad = d->j->nodes[dt].meta.requires_grad = false;
        IRRef nc = dz(d, emit_op(d, "add", arg_node(n), arg_node(dt), 2));
        unit[i] = nc ? dz(d, emit_op(d, "truediv", arg_node(xe), arg_node(nc), 2)) : 0;
        if (!unit[i]) return 0;
    }
    IRRef pr = dz(d, emit_op(d, "mul", arg_node(unit[0]), arg_node(unit[1]), 2));
    IRArg sa[2] = {arg_node(pr), bval(b, "dim")};
    return pr ? dz(d, emit_method(d, "sum", sa, 2)) : 0;
}

/* F.rms_norm (aten's rms_norm_symint, the composite CPU eager differentiates op by op): x in its
 * op-math dtype (float32 for half / bfloat16), x * rsqrt(mean(x^2 over the normalized dims,
 * keepdim) + eps) cast back to x's dtype, times weight; eps None is the op-math dtype's epsilon. */
static const Rule RMS_RULE = {"torch.nn.functional.rms_norm torch.rms_norm", "self, normalized_shape, weight=None, eps=None",
                              "", "", 0, 0};

static IRRef dz_rms_norm(AG *d, const Bind *b) {
    IRArg self = bval(b, "self"), w = bval(b, "weight"), eps = bval(b, "eps"), ns = const_fold(d, bval(b, "normalized_shape"));
    const IRMeta *m = val_meta(d, &self);
    if (!m || m->kind != IRMETA_TENSOR || ns.kind != IRARG_CONST || (!arg_is_none(&eps) && eps.kind != IRARG_CONST)) return 0;
    Py_ssize_t k = PyLong_Check(ns.u.obj) ? 1 : PySequence_Size(ns.u.obj);
    if (k < 0 || k > m->ndim) return PyErr_Clear(), 0;
    bool low = meta_dtype_is(m, "torch.float16") || meta_dtype_is(m, "torch.bfloat16");
    if (!low && !meta_dtype_is(m, "torch.float32") && !meta_dtype_is(m, "torch.float64")) return 0;
    bool f32 = low || meta_dtype_is(m, "torch.float32");
    double e = arg_is_none(&eps) ? (f32 ? 1.1920928955078125e-07 : 2.220446049250313e-16) : PyFloat_AsDouble(eps.u.obj);
    if (PyErr_Occurred()) return PyErr_Clear(), 0;
    PyObject *dims = PyList_New(k);
    for (Py_ssize_t i = 0; dims && i < k; i++) PyList_SET_ITEM(dims, i, PyLong_FromSsize_t(m->ndim - 1 - i));
    IRRef x = d->fmap[self.u.ref];
    if (low) x = dz_m(d, "to", x, Py_BuildValue("(O)", torch_dtype("float32")));
    IRRef sq = x ? dz(d, emit_op(d, "pow", arg_node(x), arg_const_steal(d, PyLong_FromLong(2)), 2)) : 0;
    IRRef mean = sq && dims ? dz_m(d, "mean", sq, Py_BuildValue("(NO)", dims, Py_True)) : (Py_XDECREF(dims), 0);
    IRRef ms = mean ? dz(d, emit_op(d, "add", arg_node(mean), arg_const_steal(d, PyFloat_FromDouble(e)), 2)) : 0;
    IRArg ra[1] = {arg_node(ms)};
    IRRef rs = ms ? dz(d, emit_fn(d, "rsqrt", ra, 1)) : 0;
    IRRef y = rs ? dz(d, emit_op(d, "mul", arg_node(x), arg_node(rs), 2)) : 0;
    if (y && low) y = dz_m(d, "to", y, Py_BuildValue("(O)", m->dtype));
    if (y && w.kind == IRARG_NODE) y = dz(d, emit_op(d, "mul", arg_node(y), map_arg(d, &w), 2));
    return y;
}

/* Which node to decompose: 1 MHA, 2 sdpa on the math kernel, 3 cross_entropy (training),
 * 4 rms_norm, 5 cross_entropy with label smoothing or probabilities, 6 F.normalize, 7 F.kl_div,
 * 8 prelu, 9 pairwise_distance, 10 cosine_similarity (4-10: training graphs), 0 none. */
static int dz_target(AG *d, IRRef r, Bind *b) {
    const IRNode *n = em_ir_node(d->g, r);
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || (!d->inference && !meta_needs_grad(&n->meta)))
        return 0;
    PyObject *qn = node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    int what = 0;
    if (s && !strcmp(s, MHA_RULE.names) && bind_args(d, &MHA_RULE, n, b) == 0) what = 1;
    else if (s && !d->inference && !strcmp(s, CE_RULE.names) && bind_args(d, &CE_RULE, n, b) == 0 && checks_pass(d, b))
        what = 3;
    else if (s && !d->inference && names_has(RMS_RULE.names, s) && bind_args(d, &RMS_RULE, n, b) == 0) what = 4;
    else if (s && !d->inference && !strcmp(s, CE_SMOOTH_RULE.names) && bind_args(d, &CE_SMOOTH_RULE, n, b) == 0 &&
             checks_pass(d, b))
        what = 5;
    else if (s && !d->inference && !strcmp(s, NORMALIZE_RULE.names) && bind_args(d, &NORMALIZE_RULE, n, b) == 0 &&
             checks_pass(d, b))
        what = 6;
    else if (s && !d->inference && !strcmp(s, KL_RULE.names) && bind_args(d, &KL_RULE, n, b) == 0 && checks_pass(d, b))
        what = 7;
    else if (s && !d->inference && names_has(PRELU_RULE.names, s) && bind_args(d, &PRELU_RULE, n, b) == 0) what = 8;
    else if (s && !d->inference && names_has(PDIST_RULE.names, s) && bind_args(d, &PDIST_RULE, n, b) == 0 &&
             checks_pass(d, b))
        what = 9;
    else if (s && !d->inference && names_has(COSSIM_RULE.names, s) && bind_args(d, &COSSIM_RULE, n, b) == 0 &&
             checks_pass(d, b))
        what = 10;
    else if (s && !strcmp(s, "torch.nn.functional.scaled_dot_product_attention")) {
        for (size_t i = 0; i < NRULES && !what; i++)
            if (RULES[i].special == SP_SDPA && bind_args(d, &RULES[i], n, b) == 0 && sdpa_kind_bound(d, b) == SDPA_MATH)
                what = 2;
    }
    Py_XDECREF(qn);
    PyErr_Clear();
    /* symbolic sizes: MHA (its views take size nodes), sdpa (dz_sdpa checks) and cross_entropy (no
     * sizes read); the others read sizes as numbers */
    if (d->env && what != 1 && what != 2 && what != 3) what = 0;
    return what;
}

/* The graph rewriters below (attention decomposition, channels_last layout) copy g node by node
 * into d->j through the joint-graph emitters: rewriter_begin sets d up with g's placeholders,
 * rewriter_finish sets the outputs and verifies (the new graph or NULL), rewriter_free releases. */
static int rewriter_begin(AG *d, const IRGraph *g) {
    uint32_t G = g->nnodes;
    d->a = g->arena;
    d->g = g;
    d->j = em_ir_new(g->arena);
    d->fmap = calloc(G, sizeof(IRRef));
    d->aux = calloc(G, sizeof *d->aux);
    d->grad = calloc(G, sizeof(IRRef));
    if (!d->j || !d->fmap || !d->aux || !d->grad || ag_grow_roles(d) < 0) return -1;
    d->cur_role = ROLE_FWD;
    d->meta_memo = em_config_bool("meta_memo", 1);
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *p = em_ir_node(g, g->inputs[i]);
        d->fmap[g->inputs[i]] = em_ir_placeholder(d->j, p->name, &p->meta);
        if (!d->fmap[g->inputs[i]] || ag_grow_roles(d) < 0) return -1;
    }
    return 0;
}

static IRGraph *rewriter_finish(AG *d, const IRRef *outs, uint32_t n) {
    char vbuf[256];
    if (em_ir_set_output(d->j, outs, n) < 0 || em_ir_verify(d->j, vbuf, sizeof vbuf) < 0) return NULL;
    return d->j;
}

static void rewriter_free(AG *d) {
    PyErr_Clear();
    Py_CLEAR(d->symctx);
    Py_CLEAR(d->symhints);
    Py_CLEAR(d->sizes);
    free(d->fmap);
    free(d->aux);
    free(d->grad);
    free(d->role);
    free(d->pinned);
    Py_XDECREF(d->reason);
}

/* The graph with its attention decomposed; NULL when there is nothing to decompose or a
 * decomposition failed (no exception: the region then keeps the ops as they are). names receives
 * the decomposed nodes' names. */
/* ---------------------------------------------------------------- functionalization
 * An in-place update r of an intermediate value v (`out += identity`, ReLU(inplace=True),
 * `h.masked_fill_(m, 0)`) becomes its out-of-place op (em_ir_functional_form), and the readers of v
 * after r read the new value, as AOTAutograd's functionalization does; eager's semantics hold when
 * nothing else can see v's memory: v is fresh (made by an op that returns new memory, or itself a
 * functionalized result), and no value that may alias v (a view, an op that may return its input)
 * is read at or after r. The new value must have v's dtype, sizes and strides (an in-place op
 * keeps them). A backward that reads v's old contents is eager's "modified by an inplace
 * operation" error: the stale list sends that region to eager autograd (em_autograd_compile). */

/* Does g node u return new memory (a rule without R_ALIAS), or is it a functionalized update? */
static bool fresh_node(AG *d, IRRef u, const uint8_t *done) {
    if (done[u]) return true;
    const IRNode *n = em_ir_node(d->g, u);
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return false;
    if (em_ir_mutates(n)) return false;
    Bind b;
    const Rule *rule = find_rule(d, n, &b);
    PyErr_Clear();
    if (rule && (rule->flags & R_ALIAS) && n->nargs && n->args[0].kind == IRARG_NODE) {
        /* clone, and a conversion to another dtype, make new memory */
        const IRMeta *in = &em_ir_node(d->g, n->args[0].u.ref)->meta;
        if (node_named(n, "Tensor.clone torch.clone")) return true;
        return node_named(n, "Tensor.float Tensor.double Tensor.half Tensor.bfloat16 Tensor.to Tensor.type_as") &&
               n->meta.kind == IRMETA_TENSOR && in->kind == IRMETA_TENSOR && n->meta.dtype != in->dtype;
    }
    return rule && !(rule->flags & R_ALIAS);
}

/* Is g node x read by a node at or after r (the output included)? */
static bool read_from(const IRGraph *g, IRRef x, IRRef r) {
    for (IRRef w = r; w < g->nnodes; w++)
        if (em_ir_node_reads(em_ir_node(g, w), x)) return true;
    return false;
}

/* Can in-place update r of v be functionalized: v fresh, and no alias of v (a reader before r that
 * may return v or a view of it, transitively) read at or after r? */
static bool alias_free(AG *d, IRRef v, IRRef r, const uint8_t *done) {
    const IRGraph *g = d->g;
    if (em_ir_node(g, v)->kind == IR_PLACEHOLDER || !fresh_node(d, v, done)) return false;
    IRRef stack[64];
    uint32_t sp = 0;
    stack[sp++] = v;
    while (sp) {
        IRRef x = stack[--sp];
        for (IRRef u = 1; u < r; u++) {
            if (!em_ir_node_reads(em_ir_node(g, u), x) || fresh_node(d, u, done)) continue;
            if (read_from(g, u, r) || sp == 64) return false; /* an alias the update would show through */
            stack[sp++] = u;
        }
    }
    return true;
}

/* The out-of-place node for in-place update r (args mapped, `inplace` False); 0 without a reason
 * when its result is not v's dtype, sizes and strides. */
static IRRef functional_node(AG *d, IRRef r, IRRef v) {
    const IRNode *n = em_ir_node(d->g, r);
    IRKind kind;
    PyObject *target;
    int ia;
    if (node_named(n, "operator.setitem _operator.setitem Tensor.__setitem__") && n->nargs == 3 && !n->nkwargs) {
        /* h[mask] = value with a bool mask of h's shape and a scalar value: torch.where(mask, value, h) */
        const IRArg *m = &n->args[1], *val = &n->args[2];
        const IRMeta *mm = m->kind == IRARG_NODE ? &em_ir_node(d->g, m->u.ref)->meta : NULL;
        const IRMeta *vm = &em_ir_node(d->g, v)->meta, *valm = val->kind == IRARG_NODE ? &em_ir_node(d->g, val->u.ref)->meta : NULL;
        bool scalar = (val->kind == IRARG_CONST && PyNumber_Check(val->u.obj) && !PyComplex_Check(val->u.obj)) ||
                      (valm && valm->kind == IRMETA_TENSOR && valm->ndim == 0);
        if (!mm || mm->kind != IRMETA_TENSOR || !meta_dtype_is(mm, "torch.bool") || mm->ndim != vm->ndim ||
            memcmp(mm->sizes, vm->sizes, (size_t)vm->ndim * sizeof(int64_t)) || !scalar)
            return 0;
        for (int32_t i = 0; d->env && i < vm->ndim; i++) /* symbolic: the same sizes for every size */
            if (!mm->sym_sizes != !vm->sym_sizes ||
                (mm->sym_sizes && em_sym_simplify(d->env, mm->sym_sizes[i]) != em_sym_simplify(d->env, vm->sym_sizes[i])))
                return 0;
        IRArg wa[3] = {map_arg(d, m), map_arg(d, val), map_arg(d, &n->args[0])};
        IRRef w = emit_fn(d, "where", wa, 3);
        if (!w) {
            Py_CLEAR(d->reason);
            PyErr_Clear();
            return 0;
        }
        const IRMeta *wm = jmeta(d, w);
        if (wm->dtype != vm->dtype || !same_strides(wm, vm) || !same_sym_layout(d, wm, vm)) return 0;
        return dz(d, w);
    }
    if (em_ir_functional_form(n, &kind, &target, &ia) < 0 || !em_arena_hold_steal(d->a, target)) return PyErr_Clear(), 0;
    IRArg args[16], kwv[8];
    if (n->nargs > 16 || n->nkwargs > 8) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = (int)i == ia ? arg_const_steal(d, Py_NewRef(Py_False)) : map_arg(d, &n->args[i]);
    for (uint32_t k = 0; k < n->nkwargs; k++)
        kwv[k] = (int)(n->nargs + k) == ia ? arg_const_steal(d, Py_NewRef(Py_False)) : map_arg(d, &n->kwargs[k]);
    IRRef nr = ag_emit(d, kind, target, args, n->nargs, n->kwnames, kwv, n->nkwargs);
    if (!nr) {
        Py_CLEAR(d->reason); /* a form the meta call rejects: keep the update (no functionalization) */
        PyErr_Clear();
        return 0;
    }
    const IRMeta *nm = jmeta(d, nr), *vm = &em_ir_node(d->g, v)->meta;
    if (nm->kind != IRMETA_TENSOR || vm->kind != IRMETA_TENSOR || nm->dtype != vm->dtype || !same_strides(nm, vm) ||
        !same_sym_layout(d, nm, vm))
        return 0; /* (the emitted node is dead: nothing reads it) */
    return dz(d, nr);
}

IRGraph *em_autograd_decompose(const IRGraph *g, bool inference, PyObject *names, PyObject *stale) {
    AG d = {.inference = inference};
    IRGraph *out = NULL;
    uint32_t G = g->nnodes;
    uint8_t *what = calloc(G, 1), *bad = calloc(G, 1), *done = calloc(G, 1);
    IRRef *outs = NULL;
    bool any = false;
    if (!what || !bad || !done) goto done;
    d.a = g->arena;
    d.g = g;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL; /* symbolic sizes: the decompositions that serve them */
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        what[r] = (uint8_t)dz_target(&d, r, &b);
        any |= what[r] != 0;
        if (!inference && stale && !what[r]) { /* an in-place update of an intermediate: functionalized below */
            const IRNode *n = em_ir_node(g, r);
            const IRArg *m = em_ir_mutates(n) ? em_ir_mutated_arg(n) : NULL;
            if (m && m->kind == IRARG_NODE && em_ir_node(g, m->u.ref)->kind != IR_PLACEHOLDER) {
                what[r] = 100;
                any = true;
            }
        }
    }
    if (!any) goto done;
    /* an MHA result is decomposed only when every use is getitem(result, 0) (need_weights=False) */
    for (IRRef u = 1; u < G; u++) {
        const IRNode *un = em_ir_node(g, u);
        for (uint32_t i = 0; i < un->nargs + un->nkwargs; i++) {
            const IRArg *a = i < un->nargs ? &un->args[i] : &un->kwargs[i - un->nargs];
            if (un->kind == IR_OUTPUT && (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)) {
                for (uint32_t k = 0; k < a->n; k++)
                    if (a->u.items[k].kind == IRARG_NODE && what[a->u.items[k].u.ref] == 1) bad[a->u.items[k].u.ref] = 1;
                continue;
            }
            if (a->kind != IRARG_NODE || what[a->u.ref] != 1) continue;
            bool ok = i == 0 && un->nargs == 2 && un->nkwargs == 0 && un->args[1].kind == IRARG_CONST &&
                      PyLong_Check(un->args[1].u.obj) && PyLong_AsLong(un->args[1].u.obj) == 0;
            PyObject *qn = ok ? node_opname(un) : NULL;
            const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
            ok = ok && s && !strcmp(s, "operator.getitem");
            Py_XDECREF(qn);
            PyErr_Clear();
            if (!ok) bad[a->u.ref] = 1;
        }
    }
    outs = calloc(G + 1, sizeof(IRRef));
    if (!outs || rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    int ndone = 0;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (n->nargs == 2 && n->args[0].kind == IRARG_NODE && what[n->args[0].u.ref] == 1 && !bad[n->args[0].u.ref] &&
            d.fmap[n->args[0].u.ref]) { /* getitem(mha, 0): the decomposed attn_output */
            d.fmap[r] = d.fmap[n->args[0].u.ref];
            continue;
        }
        IRRef v = 0;
        if (what[r] == 100) { /* functionalization */
            IRRef mv = em_ir_mutated_arg(n)->u.ref;
            if (alias_free(&d, mv, r, done) && (v = functional_node(&d, r, mv))) {
                PyObject *it = Py_BuildValue("(ss)", n->name, em_ir_node(d.j, d.fmap[mv])->name);
                if (!it || PyList_Append(stale, it) < 0) PyErr_Clear();
                Py_XDECREF(it);
                d.fmap[mv] = v; /* v's readers from here on read the new value */
                done[r] = 1;
                ndone++;
            }
            if (PyErr_Occurred() || d.reason) goto done;
        } else if (what[r] && !bad[r]) {
            d.cur = r;
            Bind b;
            dz_target(&d, r, &b);
            v = what[r] == 1   ? dz_mha(&d, &b)
                : what[r] == 3 ? dz_cross_entropy(&d, &b)
                : what[r] == 4 ? dz_rms_norm(&d, &b)
                : what[r] == 5 ? dz_cross_entropy_smooth(&d, &b)
                : what[r] == 6 ? dz_normalize(&d, &b)
                : what[r] == 7 ? dz_kl_div(&d, &b)
                : what[r] == 8 ? dz_prelu(&d, &b)
                : what[r] == 9 ? dz_pairwise_distance(&d, &b)
                : what[r] == 10 ? dz_cosine_similarity(&d, &b)
                               : dz_sdpa(&d, d.fmap[bval(&b, "query").u.ref], d.fmap[bval(&b, "key").u.ref],
                                       d.fmap[bval(&b, "value").u.ref],
                                       bval(&b, "attn_mask").kind == IRARG_NODE ? d.fmap[bval(&b, "attn_mask").u.ref] : 0,
                                       PyFloat_AsDouble(bval(&b, "dropout_p").u.obj),
                                       PyObject_IsTrue(bval(&b, "is_causal").u.obj) == 1, bval(&b, "scale").u.obj);
            if (v) {
                ndone++;
                PyObject *nm = PyUnicode_FromString(n->name);
                if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
                Py_XDECREF(nm);
            } else if (PyErr_Occurred() || d.reason) {
                goto done; /* a failed emission: keep the graph as it is */
            }
        }
        if (!v) v = copy_node(&d, n);
        if (!v) goto done;
        d.fmap[r] = v;
    }
    if (d.reason || !ndone) goto done;
    const IRArg *go = &em_ir_node(g, g->output)->args[0];
    for (uint32_t k = 0; k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d.fmap[go->u.items[k].u.ref]) goto done;
        outs[k] = d.fmap[go->u.items[k].u.ref];
    }
    out = rewriter_finish(&d, outs, go->n);
done:
    free(what);
    free(bad);
    free(done);
    free(outs);
    rewriter_free(&d);
    return out;
}

/* ---------------------------------------------------------------- torch.autocast made explicit
 * Under torch.autocast each op's dtypes are decided at dispatch; ember's lowering and derivative
 * rules type ops by torch's promotion rules alone. This pass writes autocast's decisions into the
 * graph (AOTAutograd's joint graph holds them as _to_copy nodes, traced through the dispatcher):
 * each call node becomes x.to(dtype) nodes for the arguments autocast casts, plus dtype=... where
 * autocast passes one (softmax, sum ...), as ember._autocast.plan finds by running the op on fake
 * tensors under torch's own dispatcher and checking that the rewrite dispatches the same aten ops.
 * The result means the same with autocast off (the caller runs it so). A cast to float16/bfloat16 of
 * a graph input that requires grad is one node for the graph (autocast's cast cache keeps one cast
 * per leaf, so its gradient is summed in the low precision, as eager does); other casts are per use,
 * as autocast makes them. */
enum { AC_MAXT = 64 };

typedef struct {
    IRRef ref[AC_MAXT];
    int n;
} TensorArgs;

/* Adds the joint-graph tensor refs of a (through tuples and lists) to t, once each; -1 when full. */
static int tensor_args(const AG *d, const IRArg *a, TensorArgs *t) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++)
            if (tensor_args(d, &a->u.items[i], t) < 0) return -1;
        return 0;
    }
    if (a->kind != IRARG_NODE || em_ir_node(d->j, a->u.ref)->meta.kind != IRMETA_TENSOR) return 0;
    for (int i = 0; i < t->n; i++)
        if (t->ref[i] == a->u.ref) return 0;
    if (t->n == AC_MAXT) return -1;
    t->ref[t->n++] = a->u.ref;
    return 0;
}

/* a with t->ref[i] replaced by to[i] where to[i] != 0. */
static IRArg swap_refs(AG *d, const IRArg *a, const TensorArgs *t, const IRRef *to) {
    if (a->kind == IRARG_NODE) {
        for (int i = 0; i < t->n; i++)
            if (t->ref[i] == a->u.ref && to[i]) return arg_node(to[i]);
        return *a;
    }
    if (a->kind != IRARG_TUPLE && a->kind != IRARG_LIST) return *a;
    IRArg out = *a;
    IRArg *items = em_arena_alloc(d->a, (a->n ? a->n : 1) * sizeof(IRArg));
    if (!items) return arg_node(0);
    for (uint32_t i = 0; i < a->n; i++) items[i] = swap_refs(d, &a->u.items[i], t, to);
    out.u.items = items;
    return out;
}

static bool low_precision(PyObject *dtype) {
    PyObject *s = PyObject_Str(dtype);
    const char *c = s ? PyUnicode_AsUTF8(s) : NULL;
    bool r = c && (!strcmp(c, "torch.float16") || !strcmp(c, "torch.bfloat16"));
    Py_XDECREF(s);
    PyErr_Clear();
    return r;
}

/* ember._autocast.plan for joint-graph node args/kwargs (n's target and kind): a new
 * (casts, dtype) tuple, Py_None when no rewrite reproduces autocast, NULL with an exception. */
static PyObject *autocast_plan(AG *d, const IRNode *n, const IRArg *args, const IRArg *kw, const TensorArgs *t) {
    PyObject *plan = PyImport_ImportModule("ember._autocast"); /* plan read per call: tests replace it */
    if (plan) Py_SETREF(plan, PyObject_GetAttrString(plan, "plan"));
    if (!plan) return NULL;
    PyObject *pargs = PyTuple_New(n->nargs), *pkw = PyDict_New(), *metas = PyTuple_New(t->n), *devs = PyTuple_New(t->n);
    PyObject *r = NULL;
    if (!pargs || !pkw || !metas || !devs) goto done;
    for (uint32_t i = 0; i < n->nargs; i++) {
        PyObject *x = arg_example(d, &args[i]);
        if (!x) goto done;
        PyTuple_SET_ITEM(pargs, i, x);
    }
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        PyObject *x = arg_example(d, &kw[i]);
        int rc = x ? PyDict_SetItem(pkw, n->kwnames[i], x) : -1;
        Py_XDECREF(x);
        if (rc < 0) goto done;
    }
    for (int i = 0; i < t->n; i++) {
        const IRMeta *m = &em_ir_node(d->j, t->ref[i])->meta;
        if (!m->example || !m->device) {
            PyErr_SetString(PyExc_RuntimeError, "ember: a tensor argument without metadata");
            goto done;
        }
        PyTuple_SET_ITEM(metas, i, Py_NewRef(m->example));
        PyTuple_SET_ITEM(devs, i, Py_NewRef(m->device));
    }
    r = PyObject_CallFunctionObjArgs(plan, n->kind == IR_CALL_METHOD ? Py_True : Py_False, n->target, pargs, pkw,
                                     metas, devs, NULL);
    if (r && r != Py_None && !(PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 && PyTuple_Check(PyTuple_GET_ITEM(r, 0)) &&
                               PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 0)) == t->n)) {
        PyErr_SetString(PyExc_TypeError, "ember._autocast.plan returned no (casts, dtype) pair");
        Py_CLEAR(r);
    }
done:
    Py_DECREF(plan);
    Py_XDECREF(pargs);
    Py_XDECREF(pkw);
    Py_XDECREF(metas);
    Py_XDECREF(devs);
    return r;
}

/* x.to(dtype) for the ref src of d->j. In a graph with symbolic sizes the cast's meta is src's (its
 * symbolic sizes and strides) with the dtype changed, for a contiguous src (to() keeps a dense
 * layout; anything else: 0 with *why); a static graph infers it (ag_emit). */
static IRRef emit_cast(AG *d, IRRef src, PyObject *dtype, bool sym, PyObject **why) {
    IRArg ca[2] = {arg_node(src), arg_const_steal(d, Py_NewRef(dtype))};
    if (!sym) return emit_method(d, "to", ca, 2);
    IRMeta m = em_ir_node(d->j, src)->meta;
    if (m.kind != IRMETA_TENSOR || !m.example || !em_ir_meta_contiguous(&m)) {
        *why = PyUnicode_FromFormat("%s: a cast of a non-contiguous tensor in a graph with symbolic sizes",
                                    em_ir_node(d->j, src)->name);
        return 0;
    }
    PyObject *ex = PyObject_CallMethod(m.example, "to", "O", dtype);
    if (!ex || !em_arena_hold_steal(d->a, ex) || !em_arena_hold(d->a, dtype)) return 0;
    m.example = ex;
    m.dtype = dtype;
    PyObject *to = kwname(d, "to");
    IRRef v = to ? em_ir_call(d->j, IR_CALL_METHOD, to, ca, 2, NULL, NULL, 0, &m) : 0;
    if (!v || ag_grow_roles(d) < 0) return 0;
    d->role[v] = ROLE_FWD;
    return v;
}

/* Emits node n (kind, target, kwnames and meta from n; arguments `args`, already in the new graph:
 * n->nargs positional then n->nkwargs keyword ones) with autocast's casts explicit, as the autocast
 * state in force decides them. The new ref; 0 with *why (ember._autocast.plan raised), with an
 * exception, or with neither when no explicit casts reproduce autocast for this op. */
static IRRef explicit_node(AG *d, const IRNode *n, IRArg *args, bool sym, PyObject *shared, long *ncasts,
                           PyObject **why) {
    IRArg *kw = args + n->nargs;
    TensorArgs t = {.n = 0};
    bool floating = false, full = false;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) full |= tensor_args(d, &args[i], &t) < 0;
    for (int i = 0; i < t.n && !floating; i++) floating = dtype_differentiable(em_ir_node(d->j, t.ref[i])->meta.dtype);
    PyObject *p = !floating ? Py_BuildValue("(()O)", Py_None) : full ? Py_NewRef(Py_None) : autocast_plan(d, n, args, kw, &t);
    if (!p) {
        PyObject *exc = em_exc_take();
        *why = PyUnicode_FromFormat("%s (line %d): %S", n->name, (int)n->lineno, exc ? exc : Py_None);
        Py_XDECREF(exc);
        return 0;
    }
    if (p == Py_None) {
        Py_DECREF(p);
        return 0;
    }
    PyObject *casts = PyTuple_GET_ITEM(p, 0), *dtype = PyTuple_GET_ITEM(p, 1);
    IRRef to[AC_MAXT] = {0};
    for (int i = 0; i < t.n && i < PyTuple_GET_SIZE(casts); i++) {
        PyObject *c = PyTuple_GET_ITEM(casts, i);
        if (c == Py_None) continue;
        const IRNode *src = em_ir_node(d->j, t.ref[i]); /* not used after an emission (nodes may move) */
        bool src_rg = src->meta.requires_grad;
        PyObject *key = src->kind == IR_PLACEHOLDER && src_rg && low_precision(c)
                            ? Py_BuildValue("(IO)", (unsigned)t.ref[i], c)
                            : NULL;
        PyObject *hit = key ? PyDict_GetItemWithError(shared, key) : NULL;
        if (hit) { /* the shared cast needs a gradient once any op it feeds does */
            to[i] = (IRRef)PyLong_AsUnsignedLong(hit);
            if (meta_needs_grad(&n->meta)) em_ir_node(d->j, to[i])->meta.requires_grad = true;
        } else {
            to[i] = emit_cast(d, t.ref[i], c, sym, why);
            /* a cast needs a gradient when its argument has one and the op it feeds does (so
             * not under no_grad, where the graph's inputs may still require grad) */
            if (to[i]) em_ir_node(d->j, to[i])->meta.requires_grad = src_rg && meta_needs_grad(&n->meta);
            PyObject *rv = to[i] && key ? PyLong_FromUnsignedLong(to[i]) : NULL;
            if (rv && PyDict_SetItem(shared, key, rv) < 0) to[i] = 0;
            Py_XDECREF(rv);
            (*ncasts)++;
        }
        Py_XDECREF(key);
        if (!to[i]) {
            Py_DECREF(p);
            if (!*why && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: a cast could not be emitted");
            return 0;
        }
    }
    uint32_t nkw = n->nkwargs + (dtype != Py_None);
    IRArg *na = em_arena_alloc(d->a, (n->nargs + nkw + 1) * sizeof(IRArg));
    PyObject **kwn = em_arena_alloc(d->a, (nkw + 1) * sizeof(PyObject *));
    if (!na || !kwn) {
        Py_DECREF(p);
        PyErr_NoMemory();
        return 0;
    }
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) na[i] = swap_refs(d, &args[i], &t, to);
    for (uint32_t i = 0; i < n->nkwargs; i++) kwn[i] = n->kwnames[i];
    if (dtype != Py_None) {
        kwn[n->nkwargs] = kwname(d, "dtype");
        na[n->nargs + n->nkwargs] = arg_const_steal(d, Py_NewRef(dtype));
    }
    Py_DECREF(p);
    IRRef v = em_ir_call(d->j, n->kind, n->target, na, n->nargs, kwn, na + n->nargs, nkw, &n->meta);
    if (!v || ag_grow_roles(d) < 0) return 0;
    d->role[v] = ROLE_FWD;
    return v;
}

/* A composite op whose autocast casts an intermediate, written as the ops it is made of when
 * ember._autocast.composite confirms that they dispatch what the op does under the autocast in
 * force. F.cross_entropy with class indices under CUDA autocast: its log_softmax runs in the
 * input's dtype and its nll_loss (float32 list) casts that result to float32, so
 * nll_loss(log_softmax(x, dim), ...) with the log_softmax left as it is and the nll_loss's casts
 * explicit. 0 when n is not such an op (nothing set), as explicit_node otherwise. */
static IRRef explicit_composite(AG *d, const IRNode *n, IRArg *args, bool sym, PyObject *shared, long *ncasts,
                                PyObject **why) {
    PyObject *qn = node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool ce = s && !strcmp(s, CE_RULE.names) && !sym; /* (log_softmax's meta would be inferred concrete) */
    Py_XDECREF(qn);
    PyErr_Clear();
    Bind b;
    if (!ce || bind_args(d, &CE_RULE, n, &b) < 0 || !checks_pass(d, &b)) {
        PyErr_Clear();
        return 0;
    }
    IRArg bs = bval(&b, "self"), bt = bval(&b, "target"), w = bval(&b, "weight");
    IRArg self = map_arg(d, &bs), target = map_arg(d, &bt);
    IRArg ii = bval(&b, "ignore_index"), red = bval(&b, "reduction");
    const IRNode *xs = self.kind == IRARG_NODE ? em_ir_node(d->j, self.u.ref) : NULL;
    const IRNode *ys = target.kind == IRARG_NODE ? em_ir_node(d->j, target.u.ref) : NULL;
    if (!xs || !ys || !xs->meta.example || !ys->meta.example || w.kind != IRARG_CONST || w.u.obj != Py_None ||
        ii.kind != IRARG_CONST || red.kind != IRARG_CONST)
        return 0; /* (a class weight: not written out) */
    PyObject *mod = PyImport_ImportModule("ember._autocast"); /* read per call: tests replace it */
    PyObject *fn = mod ? PyObject_GetAttrString(mod, "composite") : NULL;
    Py_XDECREF(mod);
    PyObject *ok = fn ? PyObject_CallFunction(fn, "O(OO)(OO){sOsO}", n->target, xs->meta.example, ys->meta.example,
                                              xs->meta.device, ys->meta.device, "ignore_index", ii.u.obj,
                                              "reduction", red.u.obj)
                      : NULL;
    Py_XDECREF(fn);
    int yes = ok == Py_True;
    Py_XDECREF(ok);
    if (!yes) {
        PyErr_Clear();
        return 0;
    }
    bool rg = xs->meta.requires_grad && meta_needs_grad(&n->meta); /* (xs moves with emissions) */
    IRArg la[2] = {self, arg_const_steal(d, PyLong_FromLong(xs->meta.ndim == 1 ? 0 : 1))};
    IRRef ls = arg_bad(&la[1]) ? 0 : emit_fn(d, "nn.functional.log_softmax", la, 2);
    if (ls) em_ir_node(d->j, ls)->meta.requires_grad = rg;
    PyObject *nll = ls ? torch_attr("nn.functional.nll_loss") : NULL;
    if (!nll || !em_arena_hold_steal(d->a, nll)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: log_softmax could not be emitted");
        return 0;
    }
    IRArg none = arg_const_steal(d, Py_NewRef(Py_None));
    IRArg *na = em_arena_alloc(d->a, 8 * sizeof(IRArg));
    if (!na) {
        PyErr_NoMemory();
        return 0;
    }
    IRArg nv[7] = {arg_node(ls), target, none, none, ii, none, red};
    memcpy(na, nv, sizeof nv);
    IRNode nn = *n; /* nll_loss(...) in n's place: n's result, name and line */
    nn.kind = IR_CALL_FUNCTION;
    nn.target = nll;
    nn.nargs = 7;
    nn.nkwargs = 0;
    nn.kwnames = NULL;
    IRRef v = explicit_node(d, &nn, na, sym, shared, ncasts, why);
    if (!v && !*why && !PyErr_Occurred())
        *why = PyUnicode_FromFormat("%s (line %d): nll_loss of its log_softmax has no explicit casts", n->name,
                                    (int)n->lineno);
    return v;
}

/* The torch.autocast blocks a graph enters (_enter_autocast nodes, em_ir_autocast_node), entered
 * for real while the pass reads the nodes inside them, so that ember._autocast.plan sees each
 * block's autocast state. */
enum { AC_MAXOPEN = 8 };
typedef struct {
    PyObject *mode[AC_MAXOPEN]; /* torch's _UnmanagedAutocast, innermost last */
    IRRef enter[AC_MAXOPEN];
    int n;
    int on; /* autocast on for some device at the current node */
} AutocastBlocks;

static int blocks_refresh(AutocastBlocks *b) {
    static PyObject *any = NULL; /* torch._C._is_any_autocast_enabled; one interpreter */
    if (!any && !em_lazy_attr(&any, "torch._C", "_is_any_autocast_enabled")) return -1;
    PyObject *r = PyObject_CallNoArgs(any);
    if (!r) return -1;
    b->on = r == Py_True;
    Py_DECREF(r);
    return 0;
}

/* Runs the enter or exit node n (kind 1 or 2) for real. 0, 1 with *why (a block the pass cannot
 * follow), -1 with an exception. */
static int blocks_step(AutocastBlocks *b, const IRGraph *g, IRRef r, int kind, PyObject **why) {
    const IRNode *n = em_ir_node(g, r);
    if (kind == 1) {
        if (b->n == AC_MAXOPEN) {
            *why = PyUnicode_FromFormat("torch.autocast blocks nested deeper than %d", AC_MAXOPEN);
            return 1;
        }
        PyObject *vals = PyTuple_New(n->nargs);
        for (uint32_t i = 0; vals && i < n->nargs; i++) {
            if (n->args[i].kind != IRARG_CONST) {
                Py_DECREF(vals);
                *why = PyUnicode_FromFormat("%s has a non-constant argument", n->name);
                return 1;
            }
            PyTuple_SET_ITEM(vals, i, Py_NewRef(n->args[i].u.obj));
        }
        PyObject *mode = vals ? PyObject_Call(n->target, vals, NULL) : NULL;
        Py_XDECREF(vals);
        if (!mode) return -1;
        b->mode[b->n] = mode;
        b->enter[b->n++] = r;
    } else {
        if (!b->n || n->nargs != 1 || n->args[0].kind != IRARG_NODE || n->args[0].u.ref != b->enter[b->n - 1]) {
            *why = PyUnicode_FromFormat("%s exits a torch.autocast block out of order", n->name);
            return 1;
        }
        PyObject *mode = b->mode[--b->n];
        PyObject *res = PyObject_CallOneArg(n->target, mode);
        Py_DECREF(mode);
        if (!res) return -1;
        Py_DECREF(res);
    }
    return blocks_refresh(b);
}

/* Exits the blocks still open, keeping any pending exception. */
static void blocks_unwind(AutocastBlocks *b) {
    static PyObject *exit_ = NULL; /* torch.amp.autocast_mode._exit_autocast; one interpreter */
    PyObject *exc = em_exc_take();
    while (b->n) {
        PyObject *mode = b->mode[--b->n];
        PyObject *res = exit_ || em_lazy_attr(&exit_, "torch.amp.autocast_mode", "_exit_autocast")
                            ? PyObject_CallOneArg(exit_, mode)
                            : NULL;
        Py_XDECREF(res);
        Py_DECREF(mode);
        PyErr_Clear();
    }
    em_exc_restore(exc);
}

IRGraph *em_autograd_explicit_autocast(const IRGraph *g, PyObject **why, long *ncasts) {
    AG d = {0};
    IRGraph *out = NULL;
    IRRef *outs = calloc(g->nnodes + 1, sizeof(IRRef));
    PyObject *shared = PyDict_New(); /* (input ref, dtype) -> its cast's ref */
    AutocastBlocks blocks = {.n = 0};
    *why = NULL;
    *ncasts = 0;
    if (!outs || !shared) goto fail;
    bool sym = em_ir_is_symbolic(g);
    if (rewriter_begin(&d, g) < 0 || blocks_refresh(&blocks) < 0) goto fail;
    d.j->shape_env = g->shape_env; /* symbolic sizes: the nodes keep their metas' symbols */
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        int ak = em_ir_autocast_node(n);
        if (ak) { /* a with-block's edge: followed here, not kept (the casts say what it did) */
            int rc = blocks_step(&blocks, g, r, ak, why);
            if (rc < 0) goto fail;
            if (rc > 0) goto done;
            continue;
        }
        if (!blocks.on) { /* outside any autocast: the node as it is */
            IRRef v = copy_node(&d, n);
            if (!v) goto fail;
            d.fmap[r] = v;
            continue;
        }
        IRArg *args = em_arena_alloc(d.a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
        if (!args) goto fail;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            args[i] = map_arg(&d, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
        IRRef v = explicit_node(&d, n, args, sym, shared, ncasts, why);
        if (!v && !*why && !PyErr_Occurred()) v = explicit_composite(&d, n, args, sym, shared, ncasts, why);
        if (!v && !*why && !PyErr_Occurred()) {
            PyObject *op = node_opname(n);
            *why = PyUnicode_FromFormat("%s = %S (line %d): no explicit casts dispatch what torch.autocast does", n->name,
                                        op ? op : Py_None, (int)n->lineno);
            Py_XDECREF(op);
        }
        if (!v) {
            if (*why) goto done;
            goto fail;
        }
        d.fmap[r] = v;
    }
    if (blocks.n) {
        *why = PyUnicode_FromString("a torch.autocast block is open at the graph's end");
        goto done;
    }
    const IRArg *go = &em_ir_node(g, g->output)->args[0];
    for (uint32_t k = 0; k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d.fmap[go->u.items[k].u.ref]) {
            *why = PyUnicode_FromString("a graph output that is not a node");
            goto done;
        }
        outs[k] = d.fmap[go->u.items[k].u.ref];
    }
    out = rewriter_finish(&d, outs, go->n);
    if (!out) goto fail;
    goto done;
fail:
    if (!*why) {
        PyObject *exc = em_exc_take();
        *why = d.reason ? Py_NewRef(d.reason) : PyUnicode_FromFormat("%S", exc ? exc : Py_None);
        Py_XDECREF(exc);
    }
    out = NULL;
done:
    blocks_unwind(&blocks);
    free(outs);
    Py_XDECREF(shared);
    rewriter_free(&d);
    if (!*why && !out) *why = PyUnicode_FromString("the rewrite failed");
    PyErr_Clear();
    return out;
}

/* ---------------------------------------------------------------- channels_last layout (CPU inference)
 * oneDNN's convolutions are faster on channels_last inputs, and torch keeps that layout through
 * batch norm, ReLU, residual adds and pooling; Inductor converts convolution inputs to channels_last
 * on CPU (torch/_inductor/graph.py decide_layout_opt: "for cpu backend and mkldnn enabled, we always
 * use channels_last"). This pass does the same to a static CPU inference graph: before each 2-d
 * convolution of a contiguous float32 NCHW input, x.contiguous(memory_format=torch.channels_last);
 * every node downstream of a conversion is emitted again with its meta inferred from its new
 * arguments (ag_emit, on fake CPU tensors for channels_last ones), so it has the layout eager gives a
 * channels_last model; a graph output whose strides changed is converted back with contiguous()
 * when eager's was contiguous. Anything else (a non-tensor result downstream, an output of another
 * layout, a view that channels_last cannot take, a failed meta call): NULL, the graph is kept. */
static bool is_conv2d_nchw_f32(const IRGraph *g, const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || n->nargs < 2 || n->args[0].kind != IRARG_NODE || n->args[1].kind != IRARG_NODE)
        return false;
    if (!node_named(n, "torch.nn.functional.conv2d torch.conv2d")) return false;
    const IRMeta *x = &em_ir_node(g, n->args[0].u.ref)->meta, *w = &em_ir_node(g, n->args[1].u.ref)->meta;
    return x->kind == IRMETA_TENSOR && x->ndim == 4 && w->kind == IRMETA_TENSOR && w->ndim == 4 && x->sizes[1] > 1 &&
           meta_dtype_is(x, "torch.float32") && em_ir_meta_contiguous(x) && em_ir_meta_on_cpu(x);
}

/* A contiguous float32 4-d CPU convolution weight whose channels_last layout differs from its own
 * (not a 1x1 kernel, not one input channel). */
static bool weight_wants_channels_last(const IRMeta *w) {
    if (w->kind != IRMETA_TENSOR || w->ndim != 4 || !meta_dtype_is(w, "torch.float32") || !em_ir_meta_contiguous(w) ||
        !em_ir_meta_on_cpu(w))
        return false;
    return w->sizes[1] > 1 && w->sizes[2] * w->sizes[3] > 1;
}

/* v.contiguous(memory_format=torch.channels_last) (clf) emitted into d's graph; 0 on failure. */
static IRRef to_channels_last(AG *d, IRRef v, PyObject *clf) {
    PyObject *kw = kwname(d, "memory_format"), *contig = kwname(d, "contiguous");
    if (!kw || !contig) return 0;
    IRArg va = arg_node(v), mf = {.kind = IRARG_CONST};
    mf.u.obj = clf;
    return ag_emit(d, IR_CALL_METHOD, contig, &va, 1, &kw, &mf, 1);
}

static bool same_strides(const IRMeta *a, const IRMeta *b) {
    if (a->ndim != b->ndim) return false;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d] || (a->sizes[d] != 1 && a->strides[d] != b->strides[d])) return false;
    return true;
}

IRGraph *em_autograd_channels_last(const IRGraph *g, PyObject *names) {
    AG d = {.inference = true};
    IRGraph *out = NULL;
    uint32_t G = g->nnodes;
    uint8_t *conv = calloc(G, 1), *dep = calloc(G, 1);
    IRRef *cl = calloc(G, sizeof(IRRef)), *outs = NULL;
    IRArg *args = NULL;
    bool any = false;
    if (!conv || !dep || !cl) goto done;
    for (IRRef r = 1; r < G; r++) {
        conv[r] = is_conv2d_nchw_f32(g, em_ir_node(g, r));
        any |= conv[r] != 0;
    }
    if (!any) goto done;
    outs = calloc(G + 1, sizeof(IRRef));
    if (!outs || rewriter_begin(&d, g) < 0) goto done;
    PyObject *clf = held_attr(&d, "torch", "channels_last");
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
            d.fmap[r] = copy_node(&d, n);
            if (!d.fmap[r]) goto done;
            continue;
        }
        if (n->meta.kind != IRMETA_TENSOR) goto done; /* tuple / non-tensor results: keep the graph */
        args = em_arena_alloc(d.a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
        if (!args) goto done;
        for (uint32_t i = 0; i < n->nargs; i++) args[i] = map_arg(&d, &n->args[i]);
        for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = map_arg(&d, &n->kwargs[i]);
        if (conv[r] && !dep[n->args[0].u.ref]) {
            IRRef x = n->args[0].u.ref;
            if (!cl[x] && !(cl[x] = to_channels_last(&d, d.fmap[x], clf))) goto done;
            args[0] = arg_node(cl[x]);
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
            args[1] = arg_node(cl[w]);
        }
        dep[r] = 1;
        d.fmap[r] = ag_emit(&d, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs);
        if (!d.fmap[r]) goto done;
    }
    if (d.reason) goto done;
    const IRArg *go = &em_ir_node(g, g->output)->args[0];
    for (uint32_t k = 0; k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d.fmap[go->u.items[k].u.ref]) goto done;
        IRRef o = go->u.items[k].u.ref, v = d.fmap[o];
        const IRMeta *m0 = &em_ir_node(g, o)->meta, *m1 = &em_ir_node(d.j, v)->meta;
        if (m0->kind == IRMETA_TENSOR && dep[o] && !same_strides(m0, m1)) {
            if (!em_ir_meta_contiguous(m0)) goto done;
            IRArg va = arg_node(v);
            v = ag_emit(&d, IR_CALL_METHOD, contig, &va, 1, NULL, NULL, 0);
            if (!v || !same_strides(m0, &em_ir_node(d.j, v)->meta)) goto done;
        }
        outs[k] = v;
    }
    out = rewriter_finish(&d, outs, go->n);
done:
    free(conv);
    free(dep);
    free(cl);
    free(outs);
    rewriter_free(&d);
    return out;
}

typedef struct {
    AG *ag;
    IRGraph *B;
    IRRef *fmapB;
    const uint8_t *recompute, *need, *saved;
    const int64_t *bytes;
    PyObject *list; /* (name, bytes) of each recomputed value */
    int64_t bytes_total;
    int failed;
} RecompCtx;

/* Emits the recomputed forward value r into the backward graph (its recomputed inputs first). */
static void emit_recomputed(IRRef r, void *ctx) {
    RecompCtx *c = ctx;
    AG *ag = c->ag;
    if (c->failed || c->fmapB[r] || ag->role[r] != ROLE_FWD || !(c->recompute[r] && c->need[r] && !c->saved[r])) return;
    const IRNode *n = em_ir_node(ag->j, r);
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
        visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], emit_recomputed, c);
    if (c->failed) return;
    c->fmapB[r] = copy_into(ag->g->arena, c->B, n, c->fmapB);
    PyObject *it = c->fmapB[r] ? Py_BuildValue("(sL)", n->name, (long long)c->bytes[r]) : NULL;
    if (!it || PyList_Append(c->list, it) < 0) c->failed = 1;
    Py_XDECREF(it);
    c->bytes_total += c->bytes[r] > 0 ? c->bytes[r] : 0;
}

/* Do two elements of a tensor of this layout share memory (an expand: stride 0 over a size > 1)?
 * The dims of size > 1 ordered by stride must each step over the ones inside it (torch's
 * has_internal_overlap is the cheap half of this: a zero stride). */
static bool layout_overlaps(const IRMeta *m) {
    int32_t order[64], n = 0;
    if (m->ndim > 64) return true; /* torch has at most 64 dims; be safe */
    for (int32_t d = 0; d < m->ndim; d++) {
        if (m->sizes[d] <= 1) continue;
        int32_t k = n++;
        for (; k > 0 && m->strides[order[k - 1]] > m->strides[d]; k--) order[k] = order[k - 1];
        order[k] = d;
    }
    for (int32_t k = 0; k < n; k++) {
        const int32_t d = order[k];
        if (k == 0 ? m->strides[d] < 1 : m->strides[d] < m->strides[order[k - 1]] * m->sizes[order[k - 1]])
            return true;
    }
    return false;
}

/* The layout of the tangent of an output in the backward graph: the output's own (ember's kernels
 * index the tangent with those strides; CompiledRegion re-strides what autograd hands over), unless
 * the output's elements overlap in memory (an expand), where a gradient, one value per element,
 * cannot be stored: contiguous then. m: a copy of the output's meta, changed in place. */
static int tangent_meta(EmArena *a, IRMeta *m, struct ShapeEnv *env) {
    m->requires_grad = false;
    if (m->kind != IRMETA_TENSOR || (!layout_overlaps(m) && !m->sym_sizes)) return 0;
    if (m->sym_sizes) { /* symbolic sizes: contiguous (CompiledRegion makes the tangent contiguous), for
                         * every size */
        uint32_t *ss = em_arena_alloc(a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
        if (!ss) return PyErr_NoMemory(), -1;
        memcpy(ss, m->sym_sizes, sizeof(uint32_t) * (size_t)m->ndim);
        if (em_sym_contiguous_strides(env, ss, (uint32_t)m->ndim, ss + m->ndim) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "ember: symbolic sizes: contiguous strides");
            return -1;
        }
        m->sym_sizes = ss;
        m->sym_strides = ss + m->ndim;
    }
    int64_t *st = em_arena_alloc(a, (size_t)(m->ndim ? m->ndim : 1) * sizeof(int64_t));
    PyObject *ex = m->example ? em_arena_hold_steal(a, PyObject_CallMethod(m->example, "contiguous", NULL)) : NULL;
    if (!st || (m->example && !ex)) return -1;
    int64_t acc = 1;
    for (int32_t d = m->ndim - 1; d >= 0; d--) {
        st[d] = acc; /* torch._prims_common.make_contiguous_strides_for */
        acc *= m->sizes[d] > 1 ? m->sizes[d] : 1;
    }
    m->strides = st;
    m->example = ex;
    return 0;
}

static PyObject *compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info,
                                PyObject *stale);

PyObject *em_autograd_compile(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info) {
    return compile_region(g, ember_halves, is_eager_graph, info, NULL);
}

/* Does a backward node of the joint graph read the joint value of g's node named name? */
static bool backward_reads(const AG *ag, const char *name) {
    IRRef v = 0;
    for (IRRef r = 1; r < ag->g->nnodes && !v; r++)
        if (!strcmp(em_ir_node(ag->g, r)->name, name)) v = ag->fmap[r];
    for (IRRef u = 1; v && u < ag->j->nnodes; u++)
        if (ag->role[u] == ROLE_BWD && em_ir_node_reads(em_ir_node(ag->j, u), v)) return true;
    return false;
}

/* em_autograd_compile; stale: names of g's values an in-place update replaced (em_autograd_decompose),
 * NULL for none. */
static PyObject *compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info,
                                PyObject *stale) {
    AG ag = {0};
    PyObject *result = NULL, *fwd_eg = NULL, *bwd_eg = NULL, *make = NULL, *d = NULL;
    PyObject *saved_list = NULL, *recomp_list = NULL, *tang = NULL, *gin = NULL, *nondiff = NULL;
    PyObject *gdeps = NULL, *same = NULL, *views = NULL, *oviews = NULL, *unview = NULL, *saved_ints = NULL;
    PyObject *sneeds = NULL, *watch = NULL;
    PyObject *jt = NULL, *ft = NULL, *bt = NULL, *budget_obj = NULL, *ember_info = NULL;
    int64_t *bytes = NULL;
    uint8_t *saved = NULL, *recompute = NULL, *need = NULL;
    IRRef *fmapF = NULL, *fmapB = NULL;
    *info = NULL;
    *is_eager_graph = 0;
    if (!em_autograd_needed(g)) {
        *is_eager_graph = 1;
        return em_eager_graph_new(g);
    }
    ag.a = g->arena;
    ag.g = g;
    ag.ember_halves = ember_halves;
    ag.meta_memo = em_config_bool("meta_memo", 1);
    ag.j = em_ir_new(g->arena);
    ag.env = em_ir_is_symbolic(g) ? g->shape_env : NULL; /* one region for all sizes ("Symbolic sizes") */
    if (ag.j) ag.j->shape_env = ag.env;
    uint32_t G = g->nnodes;
    ag.fmap = calloc(G, sizeof(IRRef));
    ag.aux = calloc(G, sizeof *ag.aux);
    ag.grad = calloc(G, sizeof(IRRef));
    ag.scatter = calloc(G, sizeof(IRRef));
    ag.pieces = calloc(G, sizeof *ag.pieces);
    ag.philox = calloc(G, sizeof(uint32_t));
    if (!ag.j || !ag.fmap || !ag.aux || !ag.grad || !ag.scatter || !ag.pieces || !ag.philox || ag_grow_roles(&ag) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    {
        PyObject *blk = NULL;
        PyObject *fn = PyImport_ImportModule("ember._autograd");
        if (fn) Py_SETREF(fn, PyObject_GetAttrString(fn, "compile_blocker"));
        if (fn) blk = PyObject_CallNoArgs(fn);
        Py_XDECREF(fn);
        if (!blk) goto error;
        if (blk != Py_None) {
            ag.reason = blk;
            goto fallback;
        }
        Py_DECREF(blk);
    }
    if (check_grad_mode(&ag) < 0) goto fallback;
    {
        PyObject *names = PyList_New(0), *st = PyList_New(0);
        IRGraph *g2 = names && st ? em_autograd_decompose(g, false, names, st) : NULL;
        if (!names || !st) {
            Py_XDECREF(names);
            Py_XDECREF(st);
            goto error;
        }
        if (g2) {
            result = compile_region(g2, ember_halves, is_eager_graph, info, PyList_GET_SIZE(st) ? st : NULL);
            PyObject *why = result && PyList_GET_SIZE(st) && *is_eager_graph && *info && PyDict_Check(*info)
                                ? PyDict_GetItemString(*info, "fallback")
                                : NULL;
            if (why) { /* updates were functionalized but the region runs eagerly: the user's graph, with
                        * its in-place ops (and eager's errors) */
                ag.reason = Py_NewRef(why);
                ag.sym_fail = PyDict_GetItemString(*info, "per_size") != NULL;
                Py_CLEAR(result);
                Py_CLEAR(*info);
                Py_DECREF(names);
                Py_DECREF(st);
                goto fallback;
            }
            if (result && *info && PyDict_Check(*info) && PyList_GET_SIZE(names) &&
                PyDict_SetItemString(*info, "decomposed", names) < 0)
                Py_CLEAR(result);
            PyObject *fz = result && *info && PyDict_Check(*info) && PyList_GET_SIZE(st) ? PyList_New(0) : NULL;
            for (Py_ssize_t i = 0; fz && i < PyList_GET_SIZE(st); i++)
                if (PyList_Append(fz, PyTuple_GET_ITEM(PyList_GET_ITEM(st, i), 0)) < 0) Py_CLEAR(fz);
            if (fz && PyDict_SetItemString(*info, "functionalized", fz) < 0) Py_CLEAR(result);
            Py_XDECREF(fz);
            Py_DECREF(names);
            Py_DECREF(st);
            if (!result) goto error;
            goto done;
        }
        Py_DECREF(names);
        Py_DECREF(st);
    }
    if (check_mutations(&ag) < 0) goto fallback;
    {
        uint8_t *U = calloc(G, 1);
        PyObject *reasons = PyList_New(0);
        if (!U || !reasons) {
            free(U);
            Py_XDECREF(reasons);
            PyErr_NoMemory();
            goto error;
        }
        int ne = find_eager_nodes(&ag, U, reasons);
        if (ne > 0 && stale) { /* the steps' graphs do not know the replaced values: the whole region */
            free(U);
            Py_DECREF(reasons);
            ag_fail(&ag, "in-place updates of intermediate values in a region split around ops without a rule");
            goto fallback;
        }
        if (ne > 0) {
            result = compile_split(&ag, U, reasons, info);
            free(U);
            Py_DECREF(reasons);
            if (!result && ag.reason && !PyErr_Occurred()) goto fallback; /* (a symbolic step it cannot take) */
            if (!result) goto error;
            goto done;
        }
        free(U);
        Py_DECREF(reasons);
    }
    const IRNode *outn = em_ir_node(g, g->output);
    const IRArg *outs = &outn->args[0];
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRArg *o = &outs->u.items[k];
        if (o->kind != IRARG_NODE) {
            ag_fail(&ag, "a graph output that is not a node");
            goto fallback;
        }
        const IRNode *on = em_ir_node(g, o->u.ref);
        if (on->kind == IR_PLACEHOLDER && meta_needs_grad(&on->meta)) {
            ag_fail(&ag, "an input that requires grad is returned as a graph output");
            goto fallback;
        }
        if (on->meta.kind == IRMETA_TUPLE && meta_needs_grad(&on->meta)) {
            ag_fail(&ag, "a tuple output that requires grad");
            goto fallback;
        }
    }
    /* 1. joint graph: primals, tangents, forward */
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *p = em_ir_node(g, g->inputs[i]);
        IRRef r = em_ir_placeholder(ag.j, p->name, &p->meta);
        if (!r || ag_grow_roles(&ag) < 0) goto error;
        ag.role[r] = ROLE_PRIMAL;
        ag.fmap[g->inputs[i]] = r;
    }
    IRRef *tangent = calloc(outs->n + 1, sizeof(IRRef));
    if (!tangent) goto error;
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRNode *on = em_ir_node(g, outs->u.items[k].u.ref);
        if (on->meta.kind != IRMETA_TENSOR || !on->meta.requires_grad) continue;
        char name[32];
        snprintf(name, sizeof name, "tangents_%u", k + 1);
        IRMeta m = on->meta;
        if (tangent_meta(g->arena, &m, ag.env) < 0) {
            free(tangent);
            goto error;
        }
        tangent[k] = em_ir_placeholder(ag.j, name, &m);
        if (!tangent[k] || ag_grow_roles(&ag) < 0) {
            free(tangent);
            goto error;
        }
        ag.role[tangent[k]] = ROLE_TANGENT;
    }
    /* with two tangents or more, a flag per tangent: is its gradient given ("absent tangents") */
    ag.tangent = tangent;
    ag.nouts = outs->n;
    uint32_t ntan = 0;
    for (uint32_t k = 0; k < outs->n; k++) ntan += tangent[k] != 0;
    if (ntan >= 2 && outs->n <= 64 && !(ag.flag = calloc(outs->n + 1, sizeof(IRRef)))) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (uint32_t k = 0; ag.flag && k < outs->n; k++) {
        if (!tangent[k]) continue;
        char name[40];
        snprintf(name, sizeof name, "tangent_given_%u", k + 1);
        IRMeta m = {0};
        m.kind = IRMETA_TENSOR;
        m.sizes = em_arena_alloc(g->arena, sizeof(int64_t));
        m.strides = em_arena_alloc(g->arena, sizeof(int64_t));
        m.dtype = torch_dtype("bool");
        m.device = em_ir_node(ag.j, tangent[k])->meta.device;
        PyObject *tex = em_ir_node(ag.j, tangent[k])->meta.example;
        m.example = tex ? em_arena_hold_steal(g->arena, PyObject_CallMethod(tex, "new_empty", "(())")) : NULL;
        if (m.example) {
            PyObject *b = PyObject_CallMethod(m.example, "bool", NULL);
            m.example = b ? em_arena_hold_steal(g->arena, b) : NULL;
        }
        IRRef f = m.sizes && m.strides && m.dtype && m.example ? em_ir_placeholder(ag.j, name, &m) : 0;
        if (!f || ag_grow_roles(&ag) < 0) {
            free(tangent);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto error;
        }
        ag.role[f] = ROLE_TANGENT;
        ag.flag[k] = f;
    }
    /* a seed per dropout (an upper bound) */
    if (ag.ember_halves && !em_config_bool("fallback_random", 0))
        for (IRRef r = 1; r < G; r++) {
            const IRNode *n = em_ir_node(g, r);
            Bind b;
            const Rule *rule = meta_needs_grad(&n->meta) ? find_rule(&ag, n, &b) : NULL;
            ag.nphilox += rule && rule->special == SP_DROPOUT;
        }
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        ag.cur = r;
        Bind b;
        if (grad_mode_node(n)) continue; /* check_grad_mode: the halves run without grad */
        const Rule *rule = meta_needs_grad(&n->meta) ? find_rule(&ag, n, &b) : NULL;
        IRRef v = 0;
        if (rule && rule->special) v = forward_rewrite(&ag, r, &b);
        if (ag.reason) break;
        if (!v) v = copy_node(&ag, n);
        if (!v) {
            if (!ag.reason) ag_fail_exc(&ag);
            break;
        }
        ag.fmap[r] = v;
    }
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    uint32_t nfwd_end = ag.j->nnodes;
    /* 2. backward: output gradients, then each node in reverse */
    ag.cur_role = ROLE_BWD;
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        IRRef o = outs->u.items[k].u.ref;
        if (ag.grad[o]) {
            IRRef s = absent_add(&ag, ag.grad[o], tangent[k]);
            if (!s) break;
            ag.grad[o] = s;
        } else {
            ag.grad[o] = tangent[k];
        }
    }
    for (IRRef r = G - 1; r >= 1 && !ag.reason; r--) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (finalize_grad(&ag, r) < 0) {
            if (!ag.reason) ag_fail_exc(&ag);
            break;
        }
        bool reached = ag.grad[r] || (n->meta.kind == IRMETA_TUPLE && ag.pieces[r].part); /* SP_SPLIT */
        if (!reached || !meta_needs_grad(&n->meta)) continue;
        ag.cur = r;
        Bind b;
        const Rule *rule = find_rule(&ag, n, &b);
        if (!rule) {
            PyObject *qn = node_opname(n);
            ag_fail(&ag, "no derivative rule for %S (node %s)", qn ? qn : Py_None, n->name);
            Py_XDECREF(qn);
            PyErr_Clear();
            break;
        }
        if (rule->special ? backward_special(&ag, r, &b) : backward_generic(&ag, r, &b)) {
            if (!ag.reason) ag_fail(&ag, "derivative of %s failed", n->name);
            break;
        }
    }
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    /* gradient outputs: inputs that require grad and were reached */
    IRRef grads[256];
    uint32_t ngrads = 0;
    gin = PyList_New(0);
    tang = PyList_New(0);
    nondiff = PyList_New(0);
    if (!gin || !tang || !nondiff) {
        free(tangent);
        goto error;
    }
    for (uint32_t i = 0; i < g->ninputs && !ag.reason; i++)
        if (finalize_grad(&ag, g->inputs[i]) < 0 && !ag.reason) ag_fail_exc(&ag);
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    for (uint32_t i = 0; i < g->ninputs; i++) {
        IRRef p = g->inputs[i];
        if (!ag.grad[p] || !meta_needs_grad(&em_ir_node(g, p)->meta)) continue;
        if (ngrads >= 256) {
            free(tangent);
            ag_fail(&ag, "more than 256 inputs that require grad");
            goto fallback;
        }
        grads[ngrads++] = ag.grad[p];
        PyObject *v = PyLong_FromUnsignedLong(i);
        if (!v || PyList_Append(gin, v) < 0) {
            Py_XDECREF(v);
            free(tangent);
            goto error;
        }
        Py_DECREF(v);
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        PyObject *v = PyLong_FromUnsignedLong(k);
        if (!v || PyList_Append(tangent[k] ? tang : nondiff, v) < 0) {
            Py_XDECREF(v);
            free(tangent);
            goto error;
        }
        Py_DECREF(v);
    }
    /* which outputs' gradients each input gradient reads: an output that gets no gradient (None:
     * nothing after the region uses it) contributes nothing, and an input all of whose paths go
     * through such outputs gets None, as in eager autograd (ember._autograd.CompiledRegion) */
    gdeps = PyList_New(0);
    uint8_t *reach = calloc(ag.j->nnodes + 1, 1);
    if (!gdeps || !reach) {
        free(reach);
        free(tangent);
        if (gdeps) PyErr_NoMemory();
        goto error;
    }
    for (uint32_t i = 0; i < ngrads; i++) {
        PyObject *ks = PyList_New(0);
        memset(reach, 0, ag.j->nnodes + 1);
        reach[grads[i]] = 1;
        /* what the gradient reads, and what writes into it later: a rule may build a gradient in
         * place (`new_zeros`, then `add_` of a tangent into a view of it: a region whose outputs are
         * x[:1] * 0.5 and the view x[..., :2] lost the first one's gradient, program_gen seed 96925),
         * so an in-place update of a value the gradient reads (through views) is read too, and so
         * on until nothing new is reached */
        for (bool more = true; ks && more;) {
            more = false;
            for (IRRef r = ag.j->nnodes - 1; r >= 1; r--) {
                const IRNode *n = em_ir_node(ag.j, r);
                if (!reach[r] && em_ir_mutates(n) && reach[alias_root(ag.j, r)]) reach[r] = more = 1;
                if (!reach[r]) continue;
                for (uint32_t a = 0; a < n->nargs + n->nkwargs; a++)
                    mark_args(a < n->nargs ? &n->args[a] : &n->kwargs[a - n->nargs], reach);
            }
        }
        for (uint32_t k = 0; ks && k < outs->n; k++) {
            if (!tangent[k] || !reach[tangent[k]]) continue;
            PyObject *v = PyLong_FromUnsignedLong(k);
            if (!v || PyList_Append(ks, v) < 0) Py_CLEAR(ks);
            Py_XDECREF(v);
        }
        if (!ks || PyList_Append(gdeps, ks) < 0) {
            Py_XDECREF(ks);
            free(reach);
            free(tangent);
            goto error;
        }
        Py_DECREF(ks);
    }
    free(reach);
    if (!(watch = outputs_eager_saves(&ag, outs))) {
        free(tangent);
        goto error;
    }
    /* outputs that may be a graph input object at run time (the input itself, an in-place update
     * of it, x.contiguous() ...): eager returns the input object, the Function would return a new
     * alias of it (ember._autograd.make_region) */
    same = PyList_New(0);
    for (uint32_t k = 0; same && k < outs->n; k++) {
        int32_t i = maybe_input(g, outs->u.items[k].u.ref);
        const IRMeta *om = &em_ir_node(g, outs->u.items[k].u.ref)->meta;
        const IRMeta *im = i < 0 ? NULL : &em_ir_node(g, g->inputs[i])->meta;
        /* the same object has the same sizes and dtype */
        if (!im || om->kind != im->kind || (om->kind == IRMETA_TENSOR &&
            (om->ndim != im->ndim || om->dtype != im->dtype ||
             memcmp(om->sizes, im->sizes, (size_t)om->ndim * sizeof(int64_t)) != 0)))
            continue;
        PyObject *it = Py_BuildValue("(Ii)", (unsigned)k, (int)i);
        if (!it || PyList_Append(same, it) < 0) Py_CLEAR(same);
        Py_XDECREF(it);
    }
    /* outputs that may be a view of a graph input at run time (x.T.contiguous() of a (1, n) x is
     * x.T): eager's is a view made outside any Function; the Function's would be one made inside it,
     * which autograd forbids to use once its base is updated in place (ember._autograd.make_region
     * makes it again from the input) */
    views = same ? PyList_New(0) : NULL;
    for (uint32_t k = 0; views && k < outs->n; k++) {
        int32_t i = maybe_input_view(g, outs->u.items[k].u.ref);
        if (i < 0 || em_ir_node(g, outs->u.items[k].u.ref)->meta.kind != IRMETA_TENSOR) continue;
        PyObject *it = Py_BuildValue("(Ii)", (unsigned)k, (int)i);
        if (!it || PyList_Append(views, it) < 0) Py_CLEAR(views);
        Py_XDECREF(it);
    }
    /* outputs that are a view of another output (both live after the region: x * y and its last
     * row): a Function returning two views of one value forbids using them once that value is
     * updated in place, which eager allows (program_gen seed 100632); ember._autograd.make_region
     * makes the view again from the other output, outside the Function, as AOTAutograd regenerates
     * aliased outputs */
    oviews = views ? PyList_New(0) : NULL;
    for (uint32_t k = 0; oviews && k < outs->n; k++) {
        if (outs->u.items[k].kind != IRARG_NODE || em_ir_node(g, outs->u.items[k].u.ref)->meta.kind != IRMETA_TENSOR)
            continue;
        int32_t base = -1;
        IRRef r = outs->u.items[k].u.ref;
        bool view = false, itself = true; /* itself: every step returns its input object in eager */
        const IRNode *kn = em_ir_node(g, r);
        if (returns_self(g, kn)) /* v.contiguous() of a contiguous v that is an output too */
            for (uint32_t k2 = 0; k2 < outs->n && base < 0; k2++)
                if (k2 != k && outs->u.items[k2].kind == IRARG_NODE && outs->u.items[k2].u.ref == kn->args[0].u.ref)
                    base = (int32_t)k2;
        for (uint32_t depth = 0; base < 0 && depth < g->nnodes; depth++) {
            IRRef from = r;
            r = alias_step(g, r, &view);
            if (!r || !view) break; /* views only: an in-place update's result is its argument */
            itself = itself && returns_self(g, em_ir_node(g, from));
            for (uint32_t k2 = 0; k2 < outs->n && base < 0; k2++)
                if (k2 != k && outs->u.items[k2].kind == IRARG_NODE && outs->u.items[k2].u.ref == r) base = (int32_t)k2;
        }
        if (base < 0) continue;
        PyObject *it = Py_BuildValue("(IiO)", (unsigned)k, (int)base, itself ? Py_True : Py_False);
        if (!it || PyList_Append(oviews, it) < 0) Py_CLEAR(oviews);
        Py_XDECREF(it);
    }
    /* outputs that may be a view of an intermediate value (not an op whose rule returns new memory):
     * a view a Function returns may not be updated in place, which eager allows; make_region's
     * _unview_outputs returns them as no view when they are one at run time */
    uint8_t *no_done = calloc(G, 1);
    unview = no_done && oviews ? PyList_New(0) : NULL;
    for (uint32_t k = 0; unview && k < outs->n; k++) {
        IRRef r = outs->u.items[k].u.ref;
        const IRNode *on = em_ir_node(g, r);
        if (on->kind == IR_PLACEHOLDER || on->meta.kind != IRMETA_TENSOR || fresh_node(&ag, r, no_done)) continue;
        PyObject *kv = PyLong_FromUnsignedLong(k);
        if (!kv || PyList_Append(unview, kv) < 0) Py_CLEAR(unview);
        Py_XDECREF(kv);
    }
    free(no_done);
    if (!same || !views || !oviews || !unview) {
        free(tangent);
        goto error;
    }
    if (em_ir_set_output(ag.j, grads, ngrads) < 0) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; stale && i < PyList_GET_SIZE(stale); i++) { /* eager raises at backward */
        const char *nm = PyUnicode_AsUTF8(PyTuple_GET_ITEM(PyList_GET_ITEM(stale, i), 1));
        if (nm && backward_reads(&ag, nm)) {
            free(tangent);
            ag_fail(&ag, "the backward reads %s, which an in-place update changed (eager raises: modified by an "
                         "inplace operation)", nm);
            goto fallback;
        }
    }
    /* 3. partition */
    uint32_t N = ag.j->nnodes;
    bytes = calloc(N, sizeof(int64_t));
    saved = calloc(N, 1);
    recompute = calloc(N, 1);
    need = calloc(N, 1);
    fmapF = calloc(N, sizeof(IRRef));
    fmapB = calloc(N, sizeof(IRRef));
    if (!bytes || !saved || !recompute || !need || !fmapF || !fmapB) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (IRRef r = 1; r < N; r++) {
        const IRMeta *m = &em_ir_node(ag.j, r)->meta;
        bytes[r] = meta_bytes(m);
        if (bytes[r] < 0 && ag.env && m->kind == IRMETA_OTHER && m->example && PyLong_Check(m->example))
            bytes[r] = 8; /* a symbolic size: saved as an int (ember._autograd's saved_ints) */
    }
    if (partition(&ag, bytes, false, saved, recompute) < 0) {
        free(tangent);
        ag_fail(&ag, "the min-cut found no finite cut");
        goto fallback;
    }
    budget_obj = config_attr("activation_memory_budget", 1.0);
    double budget = budget_obj ? PyFloat_AsDouble(budget_obj) : 1.0;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        budget = 1.0;
    }
    if (budget < 1.0) {
        /* baseline: every forward value the backward reads is saved (nothing recomputed) */
        int64_t base = 0, cut = 0;
        for (IRRef r = nfwd_end; r < N; r++) {
            const IRNode *n = em_ir_node(ag.j, r);
            if (ag.role[r] != ROLE_BWD) continue; /* (a symbolic size read for the backward is ROLE_FWD) */
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
        }
        for (IRRef r = 1; r < N; r++) {
            if (need[r] && ag.role[r] == ROLE_FWD && bytes[r] > 0) base += bytes[r];
            if (saved[r] && ag.role[r] == ROLE_FWD && bytes[r] > 0) cut += bytes[r];
        }
        memset(need, 0, N);
        if ((double)cut > budget * (double)base) {
            uint8_t *s2 = calloc(N, 1), *r2 = calloc(N, 1);
            if (s2 && r2 && partition(&ag, bytes, true, s2, r2) == 0) {
                memcpy(saved, s2, N);
                memcpy(recompute, r2, N);
            }
            free(s2);
            free(r2);
        }
    }
    /* what the backward needs: backward nodes' forward arguments, then recomputed values' arguments */
    for (IRRef r = N - 1; r >= 1; r--) {
        const IRNode *n = em_ir_node(ag.j, r);
        uint8_t role = ag.role[r];
        bool in_bwd = role == ROLE_BWD || (role == ROLE_FWD && recompute[r] && need[r]);
        if (n->kind == IR_OUTPUT || !in_bwd) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
    }
    /* forward graph */
    IRGraph *F = em_ir_new(g->arena), *B = em_ir_new(g->arena);
    if (!F || !B) {
        free(tangent);
        goto error;
    }
    F->shape_env = B->shape_env = ag.env;
    /* (up to N: symbolic sizes the backward reads are forward nodes emitted with it, size_arg) */
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(ag.j, r);
        if (ag.role[r] == ROLE_PRIMAL) fmapF[r] = em_ir_placeholder(F, n->name, &n->meta);
        else if (ag.role[r] == ROLE_FWD) fmapF[r] = copy_into(g->arena, F, n, fmapF);
        else continue;
        if (!fmapF[r]) {
            free(tangent);
            goto error;
        }
    }
    IRRef *fout = malloc((outs->n + N + 1) * sizeof(IRRef));
    if (!fout) {
        free(tangent);
        goto error;
    }
    uint32_t nfout = 0, nsaved = 0;
    for (uint32_t k = 0; k < outs->n; k++) fout[nfout++] = fmapF[ag.fmap[outs->u.items[k].u.ref]];
    saved_list = PyList_New(0);
    recomp_list = PyList_New(0);
    saved_ints = PyList_New(0); /* positions among the saved values of ints (symbolic sizes) */
    int64_t saved_bytes = 0, recomp_bytes = 0, saved_input_bytes = 0;
    /* backward graph placeholders: saved values, then tangents */
    for (IRRef r = 1; r < N && saved_list; r++) {
        if (!(saved[r] && need[r])) continue;
        const IRNode *n = em_ir_node(ag.j, r);
        fout[nfout++] = fmapF[r];
        if (n->meta.kind != IRMETA_TENSOR) {
            PyObject *pos = PyLong_FromUnsignedLong(nsaved);
            if (!pos || !saved_ints || PyList_Append(saved_ints, pos) < 0) Py_CLEAR(saved_list);
            Py_XDECREF(pos);
            if (!saved_list) break;
        }
        nsaved++;
        fmapB[r] = em_ir_placeholder(B, n->name, &n->meta);
        PyObject *it = Py_BuildValue("(sL)", n->name, (long long)bytes[r]);
        if (!it || PyList_Append(saved_list, it) < 0 || !fmapB[r]) {
            Py_XDECREF(it);
            free(fout);
            free(tangent);
            goto error;
        }
        Py_DECREF(it);
        /* a saved graph input costs no activation memory: the caller holds it anyway */
        if (ag.role[r] == ROLE_PRIMAL) saved_input_bytes += bytes[r] > 0 ? bytes[r] : 0;
        else saved_bytes += bytes[r] > 0 ? bytes[r] : 0;
    }
    if (!saved_list || !recomp_list || !saved_ints) {
        free(fout);
        free(tangent);
        goto error;
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        fmapB[tangent[k]] = em_ir_placeholder(B, em_ir_node(ag.j, tangent[k])->name, &em_ir_node(ag.j, tangent[k])->meta);
        if (!fmapB[tangent[k]]) {
            free(fout);
            free(tangent);
            goto error;
        }
    }
    /* then the tangents' flags (CompiledRegion passes them after the tangents) */
    for (uint32_t k = 0; ag.flag && k < outs->n; k++) {
        IRRef f = ag.flag[k];
        if (!f) continue;
        if (!(fmapB[f] = em_ir_placeholder(B, em_ir_node(ag.j, f)->name, &em_ir_node(ag.j, f)->meta))) {
            free(fout);
            free(tangent);
            goto error;
        }
    }
    /* which backward inputs its call releases (IRGraph.input_released): the saved values that are
     * neither a graph input of the forward (a parameter) nor one of its outputs (the caller holds
     * those), activations whose copies autograd clears before the call, and the tangents
     * (CompiledRegion._take_gradient); not the flags */
    if ((B->input_released = em_arena_alloc(B->arena, B->ninputs + 1))) {
        uint32_t i = 0;
        for (IRRef r = 1; r < N; r++) {
            if (!(saved[r] && need[r])) continue;
            bool held = ag.role[r] == ROLE_PRIMAL;
            for (uint32_t k = 0; k < outs->n && !held; k++) held = ag.fmap[outs->u.items[k].u.ref] == r;
            B->input_released[i++] = !held;
        }
        for (uint32_t k = 0; k < outs->n && i < B->ninputs; k++)
            if (tangent[k]) B->input_released[i++] = 1;
    }
    ag.tangent = NULL;
    free(tangent);
    if (em_ir_set_output(F, fout, nfout) < 0) {
        free(fout);
        PyErr_NoMemory();
        goto error;
    }
    free(fout);
    /* backward nodes in order; a recomputed forward value is emitted just before the first
     * backward node that reads it (after its own inputs), not at the start of the backward: it
     * then lives only from there to its last use (as Inductor's partitioner places recomputation) */
    {
        RecompCtx rc = {&ag, B, fmapB, recompute, need, saved, bytes, recomp_list, 0, 0};
        for (IRRef r = 1; r < N && !rc.failed; r++) {
            const IRNode *n = em_ir_node(ag.j, r);
            if (n->kind == IR_OUTPUT || ag.role[r] != ROLE_BWD) continue;
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], emit_recomputed, &rc);
            if (rc.failed) break;
            fmapB[r] = copy_into(g->arena, B, n, fmapB);
            if (!fmapB[r]) goto error;
        }
        if (rc.failed) goto error;
        recomp_bytes = rc.bytes_total;
    }
    /* which outputs' gradients make the backward read each saved value (joint refs still) */
    if (!(sneeds = saved_needs(&ag, saved, need, grads, ngrads, gdeps))) goto error;
    for (uint32_t i = 0; i < ngrads; i++) grads[i] = fmapB[grads[i]];
    if (em_ir_set_output(B, grads, ngrads) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    char vbuf[256];
    if (em_ir_verify(F, vbuf, sizeof vbuf) < 0 || em_ir_verify(B, vbuf, sizeof vbuf) < 0) {
        ag_fail(&ag, "internal: partitioned graph does not verify: %s", vbuf);
        em_cc_note_internal_fallback();
        goto fallback;
    }
    /* both halves run under no_grad inside the Function: their values do not require grad */
    for (IRRef r = 1; r < F->nnodes; r++) F->nodes[r].meta.requires_grad = false;
    for (IRRef r = 1; r < B->nnodes; r++) B->nodes[r].meta.requires_grad = false;
    if (ember_halves) {
        PyObject *fi = NULL, *bi = NULL;
        /* libm's scalar functions in both halves (IRGraph.exact_math): the backward compares
         * recomputed values (amax's gradient: self == result), and gradients chain derivatives of
         * transcendental functions, where libmvec's errors (<= 4 ulp) compound past assert_close's
         * defaults (program_gen seeds 20254, 20783) */
        F->exact_math = B->exact_math = true;
        em_ember_prefetch(B); /* the backward's C compiler runs while the forward's does */
        fwd_eg = em_ember_compile(F, &fi);
        bwd_eg = fwd_eg ? em_ember_compile(B, &bi) : NULL;
        em_cc_drain(); /* (when the forward failed, or the backward's source differed) */
        bool half_eager = (fi && PyDict_Check(fi) && PyDict_GetItemString(fi, "fallback")) ||
                          (bi && PyDict_Check(bi) && PyDict_GetItemString(bi, "fallback"));
        if (half_eager && fwd_eg && bwd_eg) {
            /* one half on the eager backend (ATen's vectorized functions), the other on ember's
             * kernels (libm's): a backward that compares a recomputed value with a saved one
             * (amax's gradient: self == result) would compare two implementations' bits, and no
             * element would match (program_gen seed 670184: a NaN gradient). Both halves run on the
             * eager backend then. */
            Py_SETREF(fwd_eg, em_eager_graph_new(F));
            Py_SETREF(bwd_eg, fwd_eg ? em_eager_graph_new(B) : NULL);
        }
        if (fi && saved_list) {
            PyObject *t = Py_BuildValue("{s:N,s:N}", "forward", fi, "backward", bi ? bi : Py_NewRef(Py_None));
            PyObject *why = half_eager ? PyUnicode_FromString("a half ran on the eager backend: both halves do (one "
                                                              "implementation of each function)") : NULL;
            if (t && half_eager && (!why || PyDict_SetItemString(t, "fallback", why) < 0)) Py_CLEAR(t);
            Py_XDECREF(why);
            ember_info = t;
        } else {
            Py_XDECREF(fi);
            Py_XDECREF(bi);
        }
    } else {
        fwd_eg = em_eager_graph_new(F);
        bwd_eg = em_eager_graph_new(B);
    }
    if (!fwd_eg || !bwd_eg) goto error;
    jt = em_ir_format_tabular(ag.j);
    ft = em_ir_format_tabular(F);
    bt = em_ir_format_tabular(B);
    if (!jt || !ft || !bt) goto error;
    d = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:L,s:L,s:L,s:O,s:O,s:O,s:I}", "joint", jt, "forward", ft, "backward", bt,
                      "saved", saved_list, "recomputed", recomp_list, "saved_bytes", (long long)saved_bytes,
                      "saved_input_bytes", (long long)saved_input_bytes,
                      "recomputed_bytes", (long long)recomp_bytes, "grad_inputs", gin, "tangent_outputs", tang,
                      "non_differentiable_outputs", nondiff, "nsaved", nsaved);
    if (!d || (ember_info && PyDict_SetItemString(d, "ember", ember_info) < 0)) goto error;
    if (!em_lazy_attr(&make, "ember._autograd", "make_region")) goto error;
    /* ember's kernels index tangents with the output's layout; autograd may hand any strides */
    PyObject *layouts = Py_NewRef(Py_None);
    if (ember_halves) {
        Py_SETREF(layouts, PyList_New(0));
        for (uint32_t k = 0; layouts && k < outs->n; k++) {
            IRMeta tm = em_ir_node(g, outs->u.items[k].u.ref)->meta;
            const IRMeta *m = &tm;
            if (m->kind == IRMETA_TENSOR && m->sym_sizes) { /* symbolic: contiguous, made so per call */
                if (PyList_Append(layouts, Py_None) < 0) Py_CLEAR(layouts);
                continue;
            }
            PyObject *st = tangent_meta(g->arena, &tm, ag.env) < 0 ? NULL : PyTuple_New(m->kind == IRMETA_TENSOR ? m->ndim : 0);
            for (int32_t i = 0; st && m->kind == IRMETA_TENSOR && i < m->ndim; i++) {
                PyObject *v = PyLong_FromLongLong(m->strides[i]);
                if (!v) Py_CLEAR(st);
                else PyTuple_SET_ITEM(st, i, v);
            }
            if (!st || PyList_Append(layouts, st) < 0) Py_CLEAR(layouts);
            Py_XDECREF(st);
        }
        if (!layouts) goto error;
    }
    /* inputs that require grad but get no gradient (dead code, non-differentiable uses): the region
     * takes them detached, so autograd never walks from it into their history, as eager never
     * reaches them (a dead floor_divide's NotImplemented backward raised: program_gen seed 61219) */
    PyObject *detached = PyList_New(0);
    for (uint32_t i = 0; detached && i < g->ninputs; i++) {
        const IRMeta *im = &em_ir_node(g, g->inputs[i])->meta;
        if (im->kind != IRMETA_TENSOR || !meta_needs_grad(im)) continue; /* (a tuple input stays as it is) */
        PyObject *iv = PyLong_FromUnsignedLong(i);
        int has = iv ? PySequence_Contains(gin, iv) : -1;
        if (has < 0 || (has == 0 && PyList_Append(detached, iv) < 0)) Py_CLEAR(detached);
        Py_XDECREF(iv);
    }
    if (!detached) {
        Py_DECREF(layouts);
        goto error;
    }
    result = PyObject_CallFunction(make, "OOIIOOONOOONOOOOOO", fwd_eg, bwd_eg, (unsigned)outs->n, (unsigned)g->ninputs, gin,
                                   tang, nondiff, layouts, gdeps, same, views, detached, oviews, unview, saved_ints,
                                   ag.flag ? Py_True : Py_False, sneeds, watch);
    if (!result) goto error;
    *info = d;
    d = NULL;
    goto done;
fallback:
    result = fallback_result(g, &ag, is_eager_graph, info);
    goto done;
error:
    result = NULL;
done:
    free(ag.fmap);
    free(ag.aux);
    free(ag.grad);
    free(ag.scatter);
    free(ag.pieces);
    free(ag.philox);
    free(ag.role);
    free(ag.pinned);
    free(ag.flag);
    free(ag.deps);
    free(ag.gate);
    free(ag.gate_set);
    Py_XDECREF(ag.reason);
    Py_XDECREF(ag.symctx);
    Py_XDECREF(ag.symhints);
    Py_XDECREF(ag.sizes);
    Py_XDECREF(saved_ints);
    Py_XDECREF(sneeds);
    Py_XDECREF(watch);
    free(bytes);
    free(saved);
    free(recompute);
    free(need);
    free(fmapF);
    free(fmapB);
    Py_XDECREF(fwd_eg);
    Py_XDECREF(bwd_eg);
    Py_XDECREF(d);
    Py_XDECREF(saved_list);
    Py_XDECREF(recomp_list);
    Py_XDECREF(tang);
    Py_XDECREF(gin);
    Py_XDECREF(nondiff);
    Py_XDECREF(gdeps);
    Py_XDECREF(same);
    Py_XDECREF(views);
    Py_XDECREF(oviews);
    Py_XDECREF(unview);
    Py_XDECREF(jt);
    Py_XDECREF(ft);
    Py_XDECREF(bt);
    Py_XDECREF(budget_obj);
    Py_XDECREF(ember_info);
    return result;
}
