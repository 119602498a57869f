/* passes, shared with autograd: the graph rewriter (em_passes_rewrite.h): binding arguments to
 * signatures, which attention kernel eager runs, emitting nodes with their metas (meta or fake
 * tensors, the meta-call memo), symbolic sizes of emitted nodes, and the argument helpers the passes
 * and the derivative rules build nodes with.
 * Invariant: an emitted node's meta is the op's own on the example metas; anything else stops the
 * rewrite with a reason. */
#include "passes/em_passes_rewrite.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- small helpers */

int em_rw_fail(Rewrite *ag, const char *fmt, ...) {
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
int em_rw_fail_sym(Rewrite *ag, const char *fmt, ...) {
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
int em_rw_fail_exc(Rewrite *ag) {
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

IRArg em_rw_arg_node(IRRef r) {
    IRArg a = {0};
    a.kind = IRARG_NODE;
    a.u.ref = r;
    return a;
}

/* A constant argument; steals obj (held by the arena). kind IRARG_NODE with ref 0 on failure. */
IRArg em_rw_arg_const_steal(Rewrite *ag, PyObject *obj) {
    IRArg a = {0};
    a.kind = IRARG_CONST;
    a.u.obj = obj ? em_arena_hold_steal(ag->a, obj) : NULL;
    if (!a.u.obj) {
        a.kind = IRARG_NODE;
        a.u.ref = 0;
    }
    return a;
}

bool em_rw_arg_bad(const IRArg *a) { return a->kind == IRARG_NODE && a->u.ref == 0; }
bool em_rw_arg_is_none(const IRArg *a) { return a->kind == IRARG_CONST && a->u.obj == Py_None; }

bool em_rw_meta_needs_grad(const IRMeta *m) {
    if (m->kind == IRMETA_TENSOR) return m->requires_grad;
    if (m->kind == IRMETA_TUPLE)
        for (uint32_t i = 0; i < m->nitems; i++)
            if (em_rw_meta_needs_grad(&m->items[i])) return true;
    return false;
}

int em_rw_grow_roles(Rewrite *ag) {
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

const Rule EM_RW_LINEAR_SIG = {"torch.nn.functional.linear torch._C._nn.linear", "input, weight, bias=None", "", "", 0, 0};

/* The name rules use for a node: "Tensor.m" for call_method m, else the target's qualified name. */
PyObject *em_rw_node_opname(const IRNode *n) {
    if (n->kind == IR_CALL_METHOD) return PyUnicode_FromFormat("Tensor.%U", n->target);
    return em_ir_target_qualname(n->target);
}

bool em_rw_names_has(const char *names, const char *s) {
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
bool em_rw_node_named(const IRNode *n, const char *names) {
    PyObject *qn = em_rw_node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool r = s && em_rw_names_has(names, s);
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
PyObject *em_rw_literal(const char *s, size_t n) {
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

int em_rw_find_param(const Bind *b, const char *name) {
    for (int i = 0; i < b->np; i++)
        if (strcmp(b->p[i].name, name) == 0) return i;
    if (b->np && (strcmp(name, "input") == 0 || strcmp(name, "self") == 0) &&
        (strcmp(b->p[0].name, "self") == 0 || strcmp(b->p[0].name, "input") == 0))
        return 0;
    return -1;
}

/* Binds the node's arguments to the rule's signature. -1: they do not fit (no exception). */
int em_rw_bind_args(Rewrite *ag, const Rule *r, const IRNode *n, Bind *b) {
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
        int i = em_rw_find_param(b, kn);
        if (i < 0 || set[i] || b->p[i].varargs) return -1;
        b->val[i] = n->kwargs[k];
        set[i] = true;
    }
    for (int i = 0; i < b->np; i++) {
        if (set[i]) continue;
        if (b->p[i].varargs) {
            b->val[i] = em_rw_arg_const_steal(ag, PyTuple_New(0));
        } else {
            if (!b->p[i].dflt) return -1;
            b->val[i] = em_rw_arg_const_steal(ag, em_rw_literal(b->p[i].dflt, dflt_len(b->p[i].dflt)));
        }
        if (em_rw_arg_bad(&b->val[i])) {
            PyErr_Clear();
            return -1;
        }
    }
    return 0;
}

const IRMeta *em_rw_val_meta(const Rewrite *ag, const IRArg *v) {
    return v->kind == IRARG_NODE ? &em_ir_node(ag->g, v->u.ref)->meta : NULL;
}

/* ---------------------------------------------------------------- which attention kernel eager runs */

bool em_rw_meta_on_cuda(const IRMeta *m) {
    PyObject *t = m->device ? PyObject_GetAttrString(m->device, "type") : NULL;
    bool r = t && PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "cuda") == 0;
    Py_XDECREF(t);
    PyErr_Clear();
    return r;
}

bool em_rw_meta_dtype_is(const IRMeta *m, const char *name) {
    PyObject *s = m->kind == IRMETA_TENSOR && m->dtype ? PyObject_Str(m->dtype) : NULL;
    bool r = s && PyUnicode_CompareWithASCIIString(s, name) == 0;
    Py_XDECREF(s);
    PyErr_Clear();
    return r;
}

/* Does the math attention kernel compute in float32 for q (half / bfloat16 q, k, v, unless
 * torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True): _scaled_dot_product_attention_math
 * in attention.cpp, torch >= 2.5)? The flag is read when the graph is compiled; a traced
 * scaled_dot_product_attention call guards it (___sdp_flags), an attention the attention pass wrote
 * keeps the choice made then. */
bool em_rw_sdpa_math_upcasts(const IRMeta *q) {
    static PyObject *allow = NULL; /* one interpreter (em_lazy_attr) */
    if (!em_rw_meta_dtype_is(q, "torch.float16") && !em_rw_meta_dtype_is(q, "torch.bfloat16")) return false;
    if (!em_lazy_attr(&allow, "torch._C", "_get_math_sdp_allow_fp16_bf16_reduction")) return PyErr_Clear(), false;
    PyObject *r = PyObject_CallNoArgs(allow);
    bool up = r == Py_False;
    Py_XDECREF(r);
    PyErr_Clear();
    return up;
}

/* ember._autograd.sdpa_backend's answer (a new str), or NULL (no exception) where it is not asked:
 * the arguments are not constants, a value has no example. contiguous_mask: asked for the mask
 * made contiguous. */
static PyObject *sdpa_choice(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, const IRArg *dropout_p,
                             const IRArg *is_causal, const IRArg *scale, const IRArg *gqa, bool contiguous_mask) {
    static PyObject *choose = NULL; /* one interpreter (em_lazy_attr) */
    if (!q || !k || !v || q->kind != IRMETA_TENSOR || k->kind != IRMETA_TENSOR || v->kind != IRMETA_TENSOR) return NULL;
    if (mask && (mask->kind != IRMETA_TENSOR || mask->requires_grad)) return NULL;
    if (dropout_p->kind != IRARG_CONST || is_causal->kind != IRARG_CONST || scale->kind != IRARG_CONST ||
        gqa->kind != IRARG_CONST || gqa->u.obj != Py_False || !PyBool_Check(is_causal->u.obj))
        return NULL;
    if (!q->example || !k->example || !v->example || (mask && !mask->example) || q->ndim < 2) return NULL;
    PyObject *rg = Py_BuildValue("(OOO)", q->requires_grad ? Py_True : Py_False, k->requires_grad ? Py_True : Py_False,
                                 v->requires_grad ? Py_True : Py_False);
    PyObject *res = NULL;
    if (rg && em_lazy_attr(&choose, "ember._autograd", "sdpa_backend"))
        res = PyObject_CallFunction(choose, "OOOOOOOOOOO", q->example, k->example, v->example,
                                    mask ? mask->example : Py_None, dropout_p->u.obj, is_causal->u.obj, scale->u.obj,
                                    gqa->u.obj, q->device, rg, contiguous_mask ? Py_True : Py_False);
    Py_XDECREF(rg);
    if (res && !PyUnicode_Check(res)) Py_CLEAR(res);
    PyErr_Clear();
    return res;
}

bool em_rw_sdpa_fused_if_mask_contiguous(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask,
                                         const IRArg *dropout_p, const IRArg *is_causal, const IRArg *scale, const IRArg *gqa) {
    if (!q || !mask || mask->kind != IRMETA_TENSOR || mask->ndim < 1 || !em_rw_meta_on_cuda(q)) return false;
    if (mask->sizes[mask->ndim - 1] < 2 || mask->strides[mask->ndim - 1] == 1) return false; /* already unit-strided */
    PyObject *res = sdpa_choice(q, k, v, mask, dropout_p, is_causal, scale, gqa, true);
    const char *c = res ? PyUnicode_AsUTF8(res) : NULL;
    bool fused = c && (!strcmp(c, "flash") || !strcmp(c, "efficient") || !strcmp(c, "cudnn"));
    Py_XDECREF(res);
    PyErr_Clear();
    return fused;
}

PyObject *em_rw_sdpa_kernel_recipe(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, PyObject *dropout_p,
                                   PyObject *is_causal, PyObject *scale, PyObject *gqa) {
    static PyObject *probe = NULL; /* one interpreter (em_lazy_attr) */
    if (!q || !k || !v || q->kind != IRMETA_TENSOR || k->kind != IRMETA_TENSOR || v->kind != IRMETA_TENSOR || q->ndim != 4 ||
        k->ndim != 4 || v->ndim != 4 || (mask && mask->kind != IRMETA_TENSOR) || !q->example || !k->example || !v->example ||
        (mask && !mask->example) || !em_lazy_attr(&probe, "ember._autograd", "sdpa_kernel_call"))
        return PyErr_Clear(), NULL;
    PyObject *rec = PyObject_CallFunction(probe, "OOOOOOOOO", q->example, k->example, v->example, mask ? mask->example : Py_None,
                                          dropout_p, is_causal, scale, gqa, q->device);
    if (!rec || !PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) != 5 || !PyTuple_Check(PyTuple_GET_ITEM(rec, 1)) ||
        !PyDict_Check(PyTuple_GET_ITEM(rec, 2)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(rec, 1)) > 12 ||
        PyDict_GET_SIZE(PyTuple_GET_ITEM(rec, 2)) > 4) {
        Py_XDECREF(rec); /* None: not a recipe ember takes */
        return PyErr_Clear(), NULL;
    }
    return rec;
}

/* Does the recipe of a cuDNN attention with a mask (em_rw_sdpa_kernel_recipe) call
 * _scaled_dot_product_cudnn_attention on the mask it prepares, so that the rule can prepare it
 * alike (csrc/autograd, sdpa_cudnn_mask)? */
static bool cudnn_mask_recipe(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, const IRArg *dropout_p,
                              const IRArg *is_causal, const IRArg *scale, const IRArg *gqa) {
    PyObject *rec = em_rw_sdpa_kernel_recipe(q, k, v, mask, dropout_p->u.obj, is_causal->u.obj, scale->u.obj, gqa->u.obj);
    PyObject *name = rec ? PyObject_Str(PyTuple_GET_ITEM(rec, 0)) : NULL;
    const char *s = name ? PyUnicode_AsUTF8(name) : NULL;
    bool ok = s && strstr(s, "_scaled_dot_product_cudnn_attention") != NULL;
    Py_XDECREF(name);
    Py_XDECREF(rec);
    PyErr_Clear();
    return ok;
}

/* The kernel eager's F.scaled_dot_product_attention runs for these arguments (asked of torch's own
 * choice, ember._autograd.sdpa_backend) and whether ember can take its derivative:
 *   SDPA_MATH        the composite math kernel: decomposed before the joint graph (float32/64,
 *                    and half / bfloat16 where the kernel computes in float32: em_rw_sdpa_math_upcasts);
 *   SDPA_FLASH_CPU   _scaled_dot_product_flash_attention_for_cpu (+ its backward op), a bool mask
 *                    converted as eager converts it (sdpa_float_mask);
 *   SDPA_FLASH_CUDA  _scaled_dot_product_flash_attention, no mask, head dim a multiple of 8 (eager
 *                    pads other head dims, which this rule does not reproduce);
 *   SDPA_EFFICIENT   _scaled_dot_product_efficient_attention, a mask prepared as eager prepares
 *                    it (float, padded to 16-element alignment, expanded: sdpa_efficient_mask);
 *   SDPA_CUDNN       _scaled_dot_product_cudnn_attention, 4-d q, k, v, a mask prepared as this
 *                    torch version prepares it (its recipe recorded: em_rw_sdpa_kernel_recipe);
 * anything else (a mask that requires grad, GQA, non-constant flags):
 * SDPA_UNSUPPORTED, and the op keeps eager autograd. Masks are only read, never differentiated here. */
int em_rw_sdpa_kind(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, const IRArg *dropout_p,
                     const IRArg *is_causal, const IRArg *scale, const IRArg *gqa) {
    PyObject *res = sdpa_choice(q, k, v, mask, dropout_p, is_causal, scale, gqa, false);
    if (!res) return SDPA_UNSUPPORTED;
    const char *c = PyUnicode_AsUTF8(res);
    int kind = SDPA_UNSUPPORTED;
    bool cuda = em_rw_meta_on_cuda(q);
    int64_t hd = q->sizes[q->ndim - 1];
    bool fp = em_rw_meta_dtype_is(q, "torch.float32") || em_rw_meta_dtype_is(q, "torch.float64");
    if (c && !strcmp(c, "math") && (fp || em_rw_sdpa_math_upcasts(q))) kind = SDPA_MATH;
    else if (c && !strcmp(c, "flash") && !cuda && q->ndim == 4) kind = SDPA_FLASH_CPU; /* a bool mask: sdpa_float_mask */
    else if (c && !strcmp(c, "flash") && !cuda && fp)
        kind = SDPA_MATH; /* torch 2.14 runs the CPU flash kernel on 3-d inputs too, but its op (and its
                           * meta) take (B, H, L, D): computed as the math kernel, as torch 2.13 did */
    else if (c && !strcmp(c, "flash") && cuda && !mask && hd % 8 == 0) kind = SDPA_FLASH_CUDA;
    else if (c && !strcmp(c, "efficient") && cuda && (!mask || (q->ndim == 4 && k->ndim == 4)))
        kind = SDPA_EFFICIENT; /* a mask: sdpa_efficient_mask expands it to (B, H, L, S) */
    else if (c && !strcmp(c, "cudnn") && cuda && q->ndim == 4 && k->ndim == 4 && v->ndim == 4 &&
             (!mask || cudnn_mask_recipe(q, k, v, mask, dropout_p, is_causal, scale, gqa)))
        kind = SDPA_CUDNN;
    Py_XDECREF(res);
    PyErr_Clear();
    return kind;
}

/* Does an attention mask of meta mm broadcast to the scores of q and k, (*q.batch, L, S)? In a
 * symbolic graph each size the same expression as the scores', or a static 1. */
bool em_rw_sdpa_mask_broadcasts(const Rewrite *d, const IRMeta *qm, const IRMeta *km, const IRMeta *mm) {
    bool ok = mm->kind == IRMETA_TENSOR && mm->ndim <= qm->ndim && km->ndim >= 2;
    for (int32_t i = 1; ok && i <= mm->ndim; i++) {
        const IRMeta *wm = i == 1 ? km : qm;
        int32_t wd = i == 1 ? km->ndim - 2 : qm->ndim - i, md = mm->ndim - i;
        ok = mm->sizes[md] == 1 || mm->sizes[md] == wm->sizes[wd];
        if (ok && d->env)
            ok = em_sym_simplify(d->env, em_rw_dim_sym(d, mm, md)) ==
                 (mm->sizes[md] == 1 ? em_sym_const(d->env, 1) : em_sym_simplify(d->env, em_rw_dim_sym(d, wm, wd)));
    }
    return ok;
}

/* sdpa_kind of a bound g-level scaled_dot_product_attention node. */
int em_rw_sdpa_kind_bound(const Rewrite *ag, const Bind *b) {
    IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
    IRArg dp = em_rw_bval(b, "dropout_p"), ic = em_rw_bval(b, "is_causal"), sc = em_rw_bval(b, "scale"), gq = em_rw_bval(b, "enable_gqa");
    if (m.kind != IRARG_NODE && !em_rw_arg_is_none(&m)) return SDPA_UNSUPPORTED;
    return em_rw_sdpa_kind(em_rw_val_meta(ag, &q), em_rw_val_meta(ag, &k), em_rw_val_meta(ag, &v), m.kind == IRARG_NODE ? em_rw_val_meta(ag, &m) : NULL,
                     &dp, &ic, &sc, &gq);
}

/* torch.<name> for a dtype (borrowed: dtypes live as long as torch). */
PyObject *em_rw_torch_dtype(const char *name) {
    PyObject *d = em_rw_torch_attr(name);
    Py_XDECREF(d);
    PyErr_Clear();
    return d;
}

bool em_rw_checks_pass(const Rewrite *ag, const Bind *b) {
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
        int i = em_rw_find_param(b, name);
        if (i < 0) return false;
        const IRArg *v = &b->val[i];
        bool ok;
        if (!strcmp(kind, "null")) ok = em_rw_arg_is_none(v);
        else if (!strcmp(kind, "notnull")) ok = !em_rw_arg_is_none(v);
        else if (!strcmp(kind, "false")) ok = em_rw_arg_is_none(v) || (v->kind == IRARG_CONST && v->u.obj == Py_False);
        else if (!strcmp(kind, "const")) ok = v->kind == IRARG_CONST && (PyLong_Check(v->u.obj) || PyFloat_Check(v->u.obj));
        else if (!strcmp(kind, "node")) ok = v->kind == IRARG_NODE;
        else if (!strcmp(kind, "eq0")) {
            ok = v->kind == IRARG_CONST && (PyLong_Check(v->u.obj) || PyFloat_Check(v->u.obj)) &&
                 PyFloat_AsDouble(v->u.obj) == 0.0;
        } else if (!strcmp(kind, "batched")) { /* conv: input has the weight's number of dims */
            const IRMeta *m = em_rw_val_meta(ag, v);
            int wi = em_rw_find_param(b, "weight");
            const IRMeta *wm = wi >= 0 ? em_rw_val_meta(ag, &b->val[wi]) : NULL;
            ok = m && wm && m->kind == IRMETA_TENSOR && wm->kind == IRMETA_TENSOR && m->ndim == wm->ndim;
        } else if (!strcmp(kind, "sdpa")) {
            int sk = em_rw_sdpa_kind_bound(ag, b);
            ok = sk == SDPA_FLASH_CPU || sk == SDPA_FLASH_CUDA || sk == SDPA_EFFICIENT || sk == SDPA_CUDNN;
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
            int oi = em_rw_find_param(b, "operands");
            const IRArg *ops = oi >= 0 ? &b->val[oi] : NULL;
            const char *eq = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) ? PyUnicode_AsUTF8(v->u.obj) : NULL;
            EinsumEq q;
            ok = eq && ops && (ops->kind == IRARG_TUPLE || ops->kind == IRARG_LIST) && em_rw_einsum_parse(eq, ops->n, &q) == 0;
            PyErr_Clear();
        } else if (!strcmp(kind, "interp")) { /* v: F.interpolate's mode, 'nearest' or 'bilinear' of a 4-d self */
            const IRMeta *m = em_rw_val_meta(ag, &b->val[0]);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim == 4 && v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) &&
                 (!PyUnicode_CompareWithASCIIString(v->u.obj, "nearest") ||
                  !PyUnicode_CompareWithASCIIString(v->u.obj, "bilinear"));
        } else if (!strcmp(kind, "attrT") || !strcmp(kind, "attrmT")) { /* getattr(self, "T" | "mT") of a real tensor */
            const IRMeta *m = em_rw_val_meta(ag, &b->val[0]);
            bool T = kind[4] == 'T';
            ok = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) && !PyUnicode_CompareWithASCIIString(v->u.obj, T ? "T" : "mT") &&
                 m && m->kind == IRMETA_TENSOR && (T ? m->ndim <= 2 : m->ndim >= 2) && !em_rw_meta_complex(m);
        } else if (!strcmp(kind, "contig")) {
            ok = em_ir_meta_contiguous(em_rw_val_meta(ag, v));
        } else if (!strcmp(kind, "ndim1") || !strcmp(kind, "ndim3") || !strcmp(kind, "ndim4")) {
            const IRMeta *m = em_rw_val_meta(ag, v);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim == kind[4] - '0';
        } else if (!strcmp(kind, "ndim2")) {
            const IRMeta *m = em_rw_val_meta(ag, v);
            ok = m && m->kind == IRMETA_TENSOR && m->ndim >= 2;
        } else if (!strcmp(kind, "reduction")) {
            ok = v->kind == IRARG_CONST && PyUnicode_Check(v->u.obj) &&
                 (!PyUnicode_CompareWithASCIIString(v->u.obj, "none") ||
                  !PyUnicode_CompareWithASCIIString(v->u.obj, "mean") || !PyUnicode_CompareWithASCIIString(v->u.obj, "sum"));
        } else if (!strcmp(kind, "sameshape") || !strcmp(kind, "nll")) {
            int si = em_rw_find_param(b, kind[0] == 's' ? "self" : "target");
            const IRMeta *m = em_rw_val_meta(ag, v), *o = si >= 0 ? em_rw_val_meta(ag, &b->val[si]) : NULL;
            ok = m && o && m->kind == IRMETA_TENSOR && o->kind == IRMETA_TENSOR;
            if (ok && kind[0] == 's')
                ok = m->ndim == o->ndim && !memcmp(m->sizes, o->sizes, m->ndim * sizeof(int64_t)) && m->dtype == o->dtype;
            else if (ok) /* nll: v is the input, o the target */
                ok = (m->ndim == 1 || m->ndim == 2) && o->ndim == m->ndim - 1 && o->dtype == em_rw_torch_dtype("int64") &&
                     !o->requires_grad;
        } else {
            ok = false;
        }
        if (!ok) return false;
    }
    return true;
}

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

PyObject *em_rw_arg_example(const Rewrite *ag, const IRArg *a) {
    switch (a->kind) {
    case IRARG_NODE: return meta_example(&em_ir_node(ag->j, a->u.ref)->meta);
    case IRARG_CONST: return Py_NewRef(a->u.obj);
    case IRARG_TUPLE:
    case IRARG_LIST: {
        PyObject *t = a->kind == IRARG_TUPLE ? PyTuple_New(a->n) : PyList_New(a->n);
        for (uint32_t i = 0; t && i < a->n; i++) {
            PyObject *x = em_rw_arg_example(ag, &a->u.items[i]);
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

static PyObject *first_device(const Rewrite *ag, const IRArg *args, uint32_t n) {
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

static int meta_from_value(Rewrite *ag, PyObject *v, PyObject *device, IRMeta *out) {
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

/* Sets *cl when a tensor argument is a channels_last tensor (em_ir_meta_channels_last);
 * with lists (metas non-NULL), collects the tensor arguments' meta examples and devices for
 * ember._fake.run. -1 with an exception. */
static int fake_args(const Rewrite *ag, const IRArg *args, uint32_t n, PyObject *metas, PyObject *devs, bool *cl) {
    for (uint32_t i = 0; i < n; i++) {
        if (args[i].kind == IRARG_TUPLE || args[i].kind == IRARG_LIST) {
            if (fake_args(ag, args[i].u.items, args[i].n, metas, devs, cl) < 0) return -1;
            continue;
        }
        if (args[i].kind != IRARG_NODE) continue;
        const IRMeta *m = &em_ir_node(ag->j, args[i].u.ref)->meta;
        if (m->kind != IRMETA_TENSOR || !m->example || !m->device) continue;
        *cl |= em_ir_meta_channels_last(m);
        if (metas && (PyList_Append(metas, m->example) < 0 || PyList_Append(devs, m->device) < 0)) return -1;
    }
    return 0;
}

/* fn(*pargs, **pkw) for a node's meta: on the meta examples, or, where torch's meta kernels would
 * not pick the device's layout for channels_last tensors, or pick the math kernel's for attention
 * (em_ir_layout_needs_fake), on fake tensors of the real devices (ember._fake.run, as the tracer
 * does). New reference or NULL with an exception. */
static PyObject *meta_call(const Rewrite *ag, PyObject *fn, PyObject *pargs, PyObject *pkw, const IRArg *args, uint32_t nargs,
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
static bool memo_metas(const Rewrite *ag, const IRArg *args, uint32_t n, const IRMeta **metas, int *nm) {
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
static PyObject *memo_key(const Rewrite *ag, IRKind kind, PyObject *target, PyObject *pargs, PyObject *pkw, const IRArg *args,
                          uint32_t nargs, const IRArg *kwv, uint32_t nkw, const IRMeta **metas, int *nmetas) {
    *nmetas = 0;
    if (!ag->meta_memo || !memo_metas(ag, args, nargs, metas, nmetas) || !memo_metas(ag, kwv, nkw, metas, nmetas))
        return Py_NewRef(Py_None);
    if (kind != IR_CALL_METHOD) return em_ir_memo_key(target, pargs, pkw, NULL, metas, *nmetas);
    PyObject *self = em_rw_arg_example(ag, &args[0]), *all = NULL, *key = NULL;
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

_Thread_local bool em_passes_sym_guards = false;

const IRMeta *em_rw_jmeta(const Rewrite *ag, IRRef r) { return &em_ir_node(ag->j, r)->meta; }

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

static bool arg_symbolic(const Rewrite *ag, const IRArg *a) {
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
bool em_rw_sym_dense(const Rewrite *ag, const IRMeta *m, int32_t *perm) {
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
bool em_rw_dims_symbolic(const Rewrite *ag, const IRMeta *m, int32_t from) {
    if (!ag->env || m->kind != IRMETA_TENSOR || !m->sym_sizes) return false;
    for (int32_t d = from < 0 ? 0 : from; d < m->ndim; d++)
        if (!em_sym_is_const(ag->env, m->sym_sizes[d], NULL)) return true;
    return false;
}

/* Do tensor metas a and b have the same symbolic sizes and strides (the same expressions, so equal
 * for every size)? True for static ones (their hints are compared elsewhere). */
bool em_rw_same_sym_layout(const Rewrite *ag, const IRMeta *a, const IRMeta *b) {
    if (!ag->env || (!a->sym_sizes && !b->sym_sizes)) return true;
    if (!a->sym_sizes || !b->sym_sizes || a->ndim != b->ndim) return false;
    for (int32_t d = 0; d < a->ndim; d++)
        if (em_sym_simplify(ag->env, a->sym_sizes[d]) != em_sym_simplify(ag->env, b->sym_sizes[d]) ||
            em_sym_simplify(ag->env, a->sym_strides[d]) != em_sym_simplify(ag->env, b->sym_strides[d]))
            return false;
    return true;
}

/* The size of dim d of tensor meta m as an expression (a constant for a static dim). */
uint32_t em_rw_dim_sym(const Rewrite *ag, const IRMeta *m, int32_t d) {
    return m->sym_sizes ? m->sym_sizes[d] : em_sym_const(ag->env, m->sizes[d]);
}

/* sym_run's argument tree of joint argument a (em_ir_sym_value_tree; a slice node as a slice). */
static PyObject *sym_tree(Rewrite *ag, const IRArg *a, int depth) {
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
static int sym_size_of(Rewrite *ag, PyObject *tree, int64_t hint, uint32_t *out) {
    if (PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0)) &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(tree, 0), "unknown") == 0)
        return em_rw_fail_sym(ag, "a size torch computes with a function ember's algebra lacks");
    uint32_t e = em_ir_sym_from_tree(ag->env, tree);
    int64_t h;
    if (!e || em_sym_hint(ag->env, e, &h) < 0) {
        if (PyErr_Occurred()) return em_rw_fail_exc(ag);
        return em_rw_fail_sym(ag, "%s", em_sym_error_text(em_sym_env_error(ag->env)));
    }
    if (h != hint)
        return em_rw_fail_sym(ag, "the size %lld torch computes disagrees with the meta size %lld", (long long)h,
                       (long long)hint);
    *out = em_sym_simplify(ag->env, e);
    return 0;
}

static int sym_apply(Rewrite *ag, PyObject *tree, IRMeta *m, int depth) {
    if (tree == Py_None || depth > 4) return 0;
    const char *k = PyTuple_Check(tree) && PyTuple_GET_SIZE(tree) > 0 && PyUnicode_Check(PyTuple_GET_ITEM(tree, 0))
                        ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(tree, 0))
                        : NULL;
    if (!k) return em_rw_fail_sym(ag, "a bad result tree");
    if (!strcmp(k, "T") && m->kind == IRMETA_TENSOR && PyTuple_GET_SIZE(tree) == 3) {
        PyObject *sz = PyTuple_GET_ITEM(tree, 1), *st = PyTuple_GET_ITEM(tree, 2);
        if (!PyTuple_Check(sz) || PyTuple_GET_SIZE(sz) != m->ndim || !PyTuple_Check(st) || PyTuple_GET_SIZE(st) != m->ndim)
            return em_rw_fail_sym(ag, "a result of another rank");
        uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
        if (!ss) return PyErr_NoMemory(), em_rw_fail_exc(ag);
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
            return em_rw_fail_sym(ag, "a result of another length");
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
    return em_rw_fail_sym(ag, "a result of another kind (%s)", k);
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
static int dense_sym_strides(const Rewrite *ag, const IRMeta *m, const uint32_t *sizes, uint32_t *strides) {
    if (em_sym_dense_strides(ag->env, m->strides, sizes, (uint32_t)m->ndim, strides, NULL) < 0) return -1;
    for (int32_t d = 0; d < m->ndim; d++) {
        int64_t h;
        if (em_sym_hint(ag->env, strides[d], &h) < 0 || (h != m->strides[d] && m->sizes[d] != 1)) return -1;
    }
    return 0;
}

/* A result tensor's symbolic layout from argument src's: its sizes; its strides where the hint
 * strides agree, else the contiguous ones where the result is contiguous. */
static int same_shape_item(Rewrite *ag, IRMeta *m, const IRArg *src) {
    if (m->kind == IRMETA_NONE) return 0;
    const IRMeta *a = src && src->kind == IRARG_NODE ? em_rw_jmeta(ag, src->u.ref) : NULL;
    if (m->kind != IRMETA_TENSOR || !a || a->kind != IRMETA_TENSOR || a->ndim != m->ndim ||
        memcmp(a->sizes, m->sizes, sizeof(int64_t) * (size_t)m->ndim))
        return em_rw_fail_sym(ag, "a gradient of another shape than its input");
    if (!a->sym_sizes) return 0;
    uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
    if (!ss) return PyErr_NoMemory(), em_rw_fail_exc(ag);
    memcpy(ss, a->sym_sizes, sizeof(uint32_t) * (size_t)m->ndim);
    if (!memcmp(a->strides, m->strides, sizeof(int64_t) * (size_t)m->ndim)) {
        memcpy(ss + m->ndim, a->sym_strides, sizeof(uint32_t) * (size_t)m->ndim);
    } else if (dense_sym_strides(ag, m, ss, ss + m->ndim) < 0) {
        return em_rw_fail_sym(ag, "a gradient of another layout than its input, not dense");
    }
    m->sym_sizes = ss;
    m->sym_strides = ss + m->ndim;
    return 0;
}

/* 1 when target is a SAME_SHAPE op (m then has its symbolic sizes, or the region failed), 0 if not. */
static int same_shape_meta(Rewrite *ag, PyObject *target, const IRArg *args, uint32_t nargs, IRMeta *m) {
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
    if (n > 4) em_rw_fail_sym(ag, "more results than the table knows");
    return 1;
}

/* matmul / mm / bmm by the C shape rule (em_sym_matmul_shape, torch's formula; its questions become
 * guards, so only while the entry's guards are still to be built) and linear (the input's sizes, the
 * weight's rows last; the inner dims guarded equal): torch's CUDA fake kernels specialise the batch
 * size of a folded matmul. The result is fresh contiguous memory (the meta call's hint layout must
 * say so). 1: done (or failed with ag->reason), 0: not such a call. */
static int matmul_meta(Rewrite *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs, uint32_t nkw,
                       IRMeta *m) {
    if (!em_passes_sym_guards || nargs < 2 || nargs > 3 || nkw || m->kind != IRMETA_TENSOR ||
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
    const IRMeta *a = em_rw_jmeta(ag, args[0].u.ref), *b = em_rw_jmeta(ag, args[1].u.ref);
    if ((!mm && !lin) || a->kind != IRMETA_TENSOR || b->kind != IRMETA_TENSOR || a->ndim > 16 || b->ndim > 16) return 0;
    uint32_t sa[16], sb[16], so[17], nout = 0;
    for (int32_t d = 0; d < a->ndim; d++) sa[d] = em_sym_simplify(ag->env, em_rw_dim_sym(ag, a, d));
    for (int32_t d = 0; d < b->ndim; d++) sb[d] = em_sym_simplify(ag->env, em_rw_dim_sym(ag, b, d));
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
    if (r != 0 || nout != (uint32_t)m->ndim) return em_rw_fail_sym(ag, "matmul's shape"), 1;
    uint32_t *ss = em_arena_alloc(ag->a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
    if (!ss) return PyErr_NoMemory(), em_rw_fail_exc(ag), 1;
    bool any = false;
    for (int32_t d = 0; d < m->ndim; d++) {
        int64_t h;
        ss[d] = em_sym_simplify(ag->env, so[d]);
        if (em_sym_hint(ag->env, ss[d], &h) < 0 || h != m->sizes[d])
            return em_rw_fail_sym(ag, "matmul's shape disagrees with the meta's"), 1;
        any |= !em_sym_is_const(ag->env, ss[d], NULL);
    }
    if (em_sym_contiguous_strides(ag->env, ss, (uint32_t)m->ndim, ss + m->ndim) < 0)
        return em_rw_fail_sym(ag, "%s", em_sym_error_text(em_sym_env_error(ag->env))), 1;
    m->sym_sizes = any ? ss : NULL;
    m->sym_strides = any ? ss + m->ndim : NULL;
    return 1;
}

/* Gives meta m (the meta call's result on the hints) its symbolic sizes when an argument has any. */
static int sym_meta(Rewrite *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs, PyObject *const *kwn,
                    const IRArg *kwv, uint32_t nkw, IRMeta *m) {
    static PyObject *sym_run = NULL, *ctx_cls = NULL, *getitem = NULL; /* one interpreter (em_lazy_attr) */
    bool any = false;
    for (uint32_t i = 0; i < nargs && !any; i++) any = arg_symbolic(ag, &args[i]);
    for (uint32_t i = 0; i < nkw && !any; i++) any = arg_symbolic(ag, &kwv[i]);
    if (!any) return 0;
    if (!em_lazy_attr(&getitem, "operator", "getitem")) return em_rw_fail_exc(ag);
    if (target == getitem && nargs == 2 && args[0].kind == IRARG_NODE && args[1].kind == IRARG_CONST &&
        em_ir_node(ag->j, args[0].u.ref)->meta.kind == IRMETA_TUPLE) { /* an item of a tuple value: its meta */
        const IRMeta *t = &em_ir_node(ag->j, args[0].u.ref)->meta;
        long i = PyLong_AsLong(args[1].u.obj);
        if (i < 0) i += (long)t->nitems;
        if (PyErr_Occurred() || i < 0 || i >= (long)t->nitems || t->items[i].kind != m->kind) {
            PyErr_Clear();
            return em_rw_fail_sym(ag, "an item of a tuple");
        }
        m->sym_sizes = t->items[i].sym_sizes;
        m->sym_strides = t->items[i].sym_strides;
        m->sym = t->items[i].sym;
        return 0;
    }
    if (same_shape_meta(ag, target, args, nargs, m) || matmul_meta(ag, kind, target, args, nargs, nkw, m))
        return ag->reason ? -1 : 0;
    if (!em_lazy_attr(&sym_run, "ember._fake", "sym_run") || !em_lazy_attr(&ctx_cls, "ember._fake", "SymContext"))
        return em_rw_fail_exc(ag);
    if (!ag->symctx) {
        uint32_t ns = em_sym_nsymbols(ag->env);
        if (!(ag->symctx = PyObject_CallNoArgs(ctx_cls)) || !(ag->symhints = PyList_New(ns))) return em_rw_fail_exc(ag);
        for (uint32_t i = 0; i < ns; i++) {
            /* an int argument's symbol (a placeholder that is the symbol) is (hint, True): any int */
            bool is_int = false;
            for (uint32_t k = 0; k < ag->g->ninputs && !is_int; k++) {
                const IRMeta *im = &em_ir_node(ag->g, ag->g->inputs[k])->meta;
                is_int = im->kind == IRMETA_OTHER && im->sym && em_sym_symbol_index(ag->env, im->sym) == (int64_t)i;
            }
            PyObject *h = PyLong_FromLongLong(em_sym_symbol_hint(ag->env, i));
            if (h && is_int) h = Py_BuildValue("(NO)", h, Py_True);
            if (!h) return em_rw_fail_exc(ag);
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
        rc = em_rw_fail_sym(ag, "torch runs %S only on concrete sizes (%S)", qn ? qn : Py_None,
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
        if (!c || (em_passes_sym_guards ? em_sym_guard_bool(ag->env, c) : em_sym_static_bool(ag->env, c)) != 1) {
            PyObject *qn = em_ir_target_qualname(target);
            char buf[256] = "?";
            if (c) em_sym_render(ag->env, c, SYM_STYLE_SYMBOLS, buf, sizeof buf);
            rc = em_rw_fail_sym(ag, "%S relies on %s, which the entry's guards do not check%s",
                         qn ? qn : Py_None, buf, em_passes_sym_guards ? " (nor hold)" : "");
            Py_XDECREF(qn);
            goto out;
        }
    }
    rc = sym_apply(ag, PyTuple_GET_ITEM(r, 0), m, 0);
    goto out;
done:
    rc = em_rw_fail_exc(ag);
out:
    Py_XDECREF(pa);
    Py_XDECREF(kw);
    Py_XDECREF(r);
    return rc;
}

/* Appends a call node to the joint graph; its meta comes from running the target on the meta
 * examples of its arguments (as the tracer does; meta_call), or from the meta-call memo. Returns 0
 * with ag->reason set on failure. */
IRRef em_rw_emit(Rewrite *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs,
                     PyObject *const *kwn, const IRArg *kwv, uint32_t nkw) {
    PyObject *pargs = NULL, *pkw = NULL, *fn = NULL, *res = NULL, *key = NULL, *made_on = NULL;
    const IRMeta *metas[MEMO_TENSORS];
    int nmetas = 0;
    IRRef r = 0;
    IRMeta meta;
    uint32_t first = kind == IR_CALL_METHOD ? 1 : 0;
    pargs = PyTuple_New(nargs - first);
    pkw = PyDict_New();
    if (!pargs || !pkw) goto done;
    for (uint32_t i = first; i < nargs; i++) {
        PyObject *x = em_rw_arg_example(ag, &args[i]);
        if (!x) goto done;
        PyTuple_SET_ITEM(pargs, i - first, x);
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *x = em_rw_arg_example(ag, &kwv[i]);
        if (!x || PyDict_SetItem(pkw, kwn[i], x) < 0) {
            Py_XDECREF(x);
            goto done;
        }
        Py_DECREF(x);
    }
    if (kind == IR_CALL_METHOD) {
        PyObject *self = em_rw_arg_example(ag, &args[0]);
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
    /* a factory call (no tensor argument: torch.ones(..., device=d)) runs on d's real device, but a
     * memo hit rebuilds its result on meta: the memo keeps the device the result was made on */
    PyObject *fd = first_device(ag, args, nargs); /* borrowed */
    if (!(res = em_ir_memo_get(key, metas, nmetas, fd ? NULL : &made_on))) {
        res = meta_call(ag, fn, pargs, pkw, args + first, nargs - first, kwv, nkw);
        if (res && !fd && !(made_on = PyObject_GetAttrString(res, "device"))) PyErr_Clear(); /* a tensor's; tuples: none */
        if (res) em_ir_memo_put(key, res, made_on, metas, nmetas);
    }
    if (!res || meta_from_value(ag, res, fd ? fd : made_on, &meta) < 0) goto done;
    if (ag->env && sym_meta(ag, kind, target, args, nargs, kwn, kwv, nkw, &meta) < 0) goto done;
    r = em_ir_call(ag->j, kind, target, args, nargs, kwn, kwv, nkw, &meta);
    if (!r && !PyErr_Occurred()) PyErr_NoMemory();
    if (r && em_rw_grow_roles(ag) < 0) {
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
    Py_XDECREF(made_on);
    if (!r) em_rw_fail_exc(ag);
    return r;
}

PyObject *em_rw_torch_attr(const char *dotted) {
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

/* Emits torch.<dotted>(args) / operator.<name> / a Tensor method; the target is held by the arena. */
IRRef em_rw_emit_fn(Rewrite *ag, const char *dotted, const IRArg *args, uint32_t n) {
    PyObject *t = em_rw_torch_attr(dotted);
    if (!t || !em_arena_hold_steal(ag->a, t)) {
        em_rw_fail_exc(ag);
        return 0;
    }
    return em_rw_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0);
}

IRRef em_rw_emit_method(Rewrite *ag, const char *name, const IRArg *args, uint32_t n) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (!s || !em_arena_hold_steal(ag->a, s)) {
        em_rw_fail_exc(ag);
        return 0;
    }
    return em_rw_emit(ag, IR_CALL_METHOD, s, args, n, NULL, NULL, 0);
}

/* module.name, held by the arena (borrowed); NULL with ag->reason set on failure. */
PyObject *em_rw_held_attr(Rewrite *ag, const char *module, const char *name) {
    PyObject *mod = PyImport_ImportModule(module);
    PyObject *t = mod ? PyObject_GetAttrString(mod, name) : NULL;
    Py_XDECREF(mod);
    if (!t || !em_arena_hold_steal(ag->a, t)) {
        em_rw_fail_exc(ag);
        return NULL;
    }
    return t;
}

/* Emits ember._C.<name>(args) (the random ops' eager forms, em_runtime_random.c). */
IRRef em_rw_emit_ember(Rewrite *ag, const char *name, const IRArg *args, uint32_t n) {
    PyObject *t = em_rw_held_attr(ag, "ember._C", name);
    return t ? em_rw_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0) : 0;
}

IRRef em_rw_emit_op(Rewrite *ag, const char *opname, IRArg a, IRArg b, uint32_t n) {
    PyObject *t = em_rw_held_attr(ag, "operator", opname);
    if (!t) return 0;
    IRArg args[2] = {a, b};
    return em_rw_emit(ag, IR_CALL_FUNCTION, t, args, n, NULL, NULL, 0);
}

IRRef em_rw_emit_getitem(Rewrite *ag, IRRef tuple, long i) {
    return em_rw_emit_op(ag, "getitem", em_rw_arg_node(tuple), em_rw_arg_const_steal(ag, PyLong_FromLong(i)), 2);
}

/* An interned keyword name held by the arena; NULL with an exception. */
PyObject *em_rw_kwname(Rewrite *ag, const char *s) {
    PyObject *k = PyUnicode_InternFromString(s);
    return k ? em_arena_hold_steal(ag->a, k) : NULL;
}

/* The sizes of m as a constant tuple; for a symbolic m the region fails (shape_arg reads them). */
IRArg em_rw_shape_const(Rewrite *ag, const IRMeta *m) {
    if (em_rw_dims_symbolic(ag, m, 0)) return em_rw_fail_sym(ag, "a rule reads a symbolic shape as numbers"), em_rw_arg_node(0);
    PyObject *t = PyTuple_New(m->ndim);
    for (int32_t i = 0; t && i < m->ndim; i++) {
        PyObject *v = PyLong_FromLongLong(m->sizes[i]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return em_rw_arg_const_steal(ag, t);
}

/* The size of dim d of joint value x as an argument: a constant, or (symbolic) the int of an
 * aten.sym_size.int(x, d) node, made once per (x, d) in the forward (the partitioner saves the int
 * for the backward, not x). */
IRArg em_rw_size_arg(Rewrite *ag, IRRef x, int32_t d) {
    const IRMeta *m = em_rw_jmeta(ag, x);
    if (!ag->env || !m->sym_sizes || em_sym_is_const(ag->env, m->sym_sizes[d], NULL))
        return em_rw_arg_const_steal(ag, PyLong_FromLongLong(m->sizes[d]));
    PyObject *key = Py_BuildValue("(Ii)", (unsigned)x, (int)d), *have = NULL;
    if (!key || (!ag->sizes && !(ag->sizes = PyDict_New()))) goto fail;
    if ((have = PyDict_GetItemWithError(ag->sizes, key))) {
        Py_DECREF(key);
        return em_rw_arg_node((IRRef)PyLong_AsUnsignedLong(have));
    }
    if (PyErr_Occurred()) goto fail;
    static PyObject *sym_size = NULL;
    if (!sym_size) sym_size = em_rw_torch_attr("ops.aten.sym_size.int"); /* immortal: the op registry holds it */
    if (!sym_size) goto fail;
    uint8_t role = ag->cur_role;
    ag->cur_role = ROLE_FWD; /* read where x is: in the forward */
    IRArg a[2] = {em_rw_arg_node(x), em_rw_arg_const_steal(ag, PyLong_FromLong(d))};
    IRRef r = em_rw_arg_bad(&a[1]) ? 0 : em_rw_emit(ag, IR_CALL_FUNCTION, sym_size, a, 2, NULL, NULL, 0);
    ag->cur_role = role;
    PyObject *v = r ? PyLong_FromUnsignedLong(r) : NULL;
    if (!v || PyDict_SetItem(ag->sizes, key, v) < 0) {
        Py_XDECREF(v);
        goto fail;
    }
    Py_DECREF(v);
    Py_DECREF(key);
    return em_rw_arg_node(r);
fail:
    Py_XDECREF(key);
    if (PyErr_Occurred()) em_rw_fail_exc(ag);
    return em_rw_arg_node(0);
}

/* The sizes of joint value x from dim `from` on, as an argument: shape_const of a static shape, a
 * tuple of constants and size_arg nodes of a symbolic one. */
IRArg em_rw_shape_arg(Rewrite *ag, IRRef x, int32_t from) {
    const IRMeta *m = em_rw_jmeta(ag, x);
    if (!em_rw_dims_symbolic(ag, m, from)) {
        IRMeta pm = *m;
        pm.ndim = m->ndim - from;
        pm.sizes = m->sizes + from;
        pm.sym_sizes = pm.sym_strides = NULL; /* (constants from dim `from` on) */
        return em_rw_shape_const(ag, &pm);
    }
    IRArg t = {0};
    t.kind = IRARG_TUPLE;
    t.n = (uint32_t)(m->ndim - from);
    t.u.items = em_arena_alloc(ag->a, (t.n + 1) * sizeof(IRArg));
    if (!t.u.items) return PyErr_NoMemory(), em_rw_fail_exc(ag), em_rw_arg_node(0);
    for (uint32_t i = 0; i < t.n; i++) {
        t.u.items[i] = em_rw_size_arg(ag, x, from + (int32_t)i);
        if (em_rw_arg_bad(&t.u.items[i])) return em_rw_arg_node(0);
    }
    return t;
}

/* Is numel(a) / numel(b) the same number for every size: b's symbolic dims cancel against equal
 * ones of a and what is left is static (mean over a static dim, [4, s0, 64] over [4, s0, 1])? */
bool em_rw_numel_ratio_const(Rewrite *ag, const IRMeta *a, const IRMeta *b) {
    if (a->ndim > 64) return false;
    uint64_t used = 0;
    for (int32_t i = 0; i < b->ndim; i++) {
        uint32_t sb = em_sym_simplify(ag->env, em_rw_dim_sym(ag, b, i));
        if (em_sym_is_const(ag->env, sb, NULL)) continue;
        bool found = false;
        for (int32_t j = 0; j < a->ndim && !found; j++)
            if (!((used >> j) & 1) && em_sym_simplify(ag->env, em_rw_dim_sym(ag, a, j)) == sb) {
                used |= 1ull << j;
                found = true;
            }
        if (!found) return false;
    }
    for (int32_t j = 0; j < a->ndim; j++)
        if (!((used >> j) & 1) && !em_sym_is_const(ag->env, em_sym_simplify(ag->env, em_rw_dim_sym(ag, a, j)), NULL))
            return false;
    return true;
}

/* The number of elements of joint value x as an argument: a constant, or (symbolic) the int of an
 * x.numel() node in the forward. */
IRArg em_rw_numel_arg(Rewrite *ag, IRRef x) {
    const IRMeta *m = em_rw_jmeta(ag, x);
    if (!em_rw_dims_symbolic(ag, m, 0)) {
        int64_t numel = 1;
        for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
        return em_rw_arg_const_steal(ag, PyLong_FromLongLong(numel));
    }
    uint8_t role = ag->cur_role;
    ag->cur_role = ROLE_FWD;
    IRArg a[1] = {em_rw_arg_node(x)};
    IRRef r = em_rw_emit_method(ag, "numel", a, 1);
    ag->cur_role = role;
    return em_rw_arg_node(r);
}

/* Maps a bound g-level argument to the joint graph (node refs through fmap). */
IRArg em_rw_map_arg(Rewrite *ag, const IRArg *a) {
    if (a->kind == IRARG_NODE) return em_rw_arg_node(ag->fmap[a->u.ref]);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        IRArg out = *a;
        IRArg *items = em_arena_alloc(ag->a, (a->n ? a->n : 1) * sizeof(IRArg));
        if (!items) return em_rw_arg_node(0);
        for (uint32_t i = 0; i < a->n; i++) items[i] = em_rw_map_arg(ag, &a->u.items[i]);
        out.u.items = items;
        return out;
    }
    return *a;
}

IRArg em_rw_bval(const Bind *b, const char *name) {
    int i = em_rw_find_param(b, name);
    return b->val[i];
}

bool em_rw_needs(const Rewrite *ag, const IRArg *v) {
    return v->kind == IRARG_NODE && em_rw_meta_needs_grad(&em_ir_node(ag->g, v->u.ref)->meta);
}

/* A tuple/list argument of constants as one constant tuple (else returned as is). */
IRArg em_rw_const_fold(Rewrite *ag, IRArg a) {
    if (a.kind != IRARG_TUPLE && a.kind != IRARG_LIST) return a;
    for (uint32_t i = 0; i < a.n; i++)
        if (a.u.items[i].kind != IRARG_CONST) return a;
    PyObject *t = PyTuple_New(a.n);
    for (uint32_t i = 0; t && i < a.n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(a.u.items[i].u.obj));
    IRArg c = em_rw_arg_const_steal(ag, t);
    if (em_rw_arg_bad(&c)) PyErr_Clear();
    return em_rw_arg_bad(&c) ? a : c;
}

/* Parses eq for nops operands (spaces dropped; an implicit output is the ellipsis, then the
 * subscripts seen once, in order, as torch makes it) and checks that each operand's gradient is an
 * einsum: no repeated subscript in a term (a diagonal), every subscript of a term in the output or
 * another term, and no ellipsis the output drops. 0, or -1 (no exception) when not. */
int em_rw_einsum_parse(const char *eq, uint32_t nops, EinsumEq *q) {
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

/* ---------------------------------------------------------------- the forward half of the joint graph */

static IRArg copy_arg(Rewrite *ag, const IRArg *a) { return em_rw_map_arg(ag, a); }

IRRef em_rw_copy_node(Rewrite *ag, const IRNode *n) {
    IRArg *args = em_arena_alloc(ag->a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
    if (!args) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = copy_arg(ag, &n->args[i]);
    for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = copy_arg(ag, &n->kwargs[i]);
    IRRef r = em_ir_call(ag->j, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs, &n->meta);
    if (r && em_rw_grow_roles(ag) == 0) {
        ag->role[r] = ROLE_FWD;
        return r;
    }
    return 0;
}

bool em_rw_dtype_differentiable(PyObject *dtype) {
    PyObject *f = dtype ? PyObject_GetAttrString(dtype, "is_floating_point") : NULL;
    PyObject *c = dtype ? PyObject_GetAttrString(dtype, "is_complex") : NULL;
    bool r = (f && PyObject_IsTrue(f) == 1) || (c && PyObject_IsTrue(c) == 1);
    Py_XDECREF(f);
    Py_XDECREF(c);
    PyErr_Clear();
    return r;
}

bool em_rw_arg_requires_grad(const IRGraph *g, const IRArg *a) {
    if (a->kind == IRARG_NODE) return em_rw_meta_needs_grad(&em_ir_node(g, a->u.ref)->meta);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (em_rw_arg_requires_grad(g, &a->u.items[i])) return true;
    return false;
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

IRRef em_rw_copy_into(EmArena *a, IRGraph *dst, const IRNode *n, const IRRef *map) {
    IRArg *args = em_arena_alloc(a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
    if (!args) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = remap(a, &n->args[i], map);
    for (uint32_t i = 0; i < n->nkwargs; i++) args[n->nargs + i] = remap(a, &n->kwargs[i], map);
    return em_ir_call(dst, n->kind, n->target, args, n->nargs, n->kwnames, args + n->nargs, n->nkwargs, &n->meta);
}

/* ---------------------------------------------------------------- splitting around ops without a rule */

/* Does m (a tensor, or a tuple's items) hold a complex tensor? */
bool em_rw_meta_complex(const IRMeta *m) {
    if (m->kind == IRMETA_TUPLE) {
        for (uint32_t i = 0; i < m->nitems; i++)
            if (em_rw_meta_complex(&m->items[i])) return true;
        return false;
    }
    if (m->kind != IRMETA_TENSOR || !m->dtype) return false;
    PyObject *c = PyObject_GetAttrString(m->dtype, "is_complex");
    bool r = c && PyObject_IsTrue(c) == 1;
    Py_XDECREF(c);
    PyErr_Clear();
    return r;
}

void em_rw_visit_refs(const IRArg *a, void (*fn)(IRRef, void *), void *ctx) {
    if (a->kind == IRARG_NODE) fn(a->u.ref, ctx);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) em_rw_visit_refs(&a->u.items[i], fn, ctx);
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
IRRef em_rw_dz(Rewrite *d, IRRef r) {
    if (!r) return 0;
    IRNode *n = &d->j->nodes[r];
    bool any = false;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs && !any; i++)
        any = em_rw_arg_requires_grad(d->j, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
    if (n->meta.kind == IRMETA_TENSOR) /* an inference graph's values need no gradient (no_grad, or no input that does) */
        n->meta.requires_grad = !d->inference && any && em_rw_dtype_differentiable(n->meta.dtype);
    return r;
}

/* The graph rewriters below (attention decomposition, channels_last layout) copy g node by node
 * into d->j through the joint-graph emitters: rewriter_begin sets d up with g's placeholders,
 * rewriter_finish sets the outputs and verifies (the new graph or NULL), rewriter_free releases. */
int em_rw_rewriter_begin(Rewrite *d, const IRGraph *g) {
    uint32_t G = g->nnodes;
    d->a = g->arena;
    d->g = g;
    d->j = em_ir_new(g->arena);
    d->fmap = calloc(G, sizeof(IRRef));
    d->aux = calloc(G, sizeof *d->aux);
    if (!d->j || !d->fmap || !d->aux || em_rw_grow_roles(d) < 0) return -1;
    d->cur_role = ROLE_FWD;
    d->meta_memo = em_config_bool("meta_memo", 1);
    d->j->inputs_apart = g->inputs_apart; /* the same inputs under the same NO_OVERLAP guard */
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *p = em_ir_node(g, g->inputs[i]);
        d->fmap[g->inputs[i]] = em_ir_placeholder(d->j, p->name, &p->meta);
        if (!d->fmap[g->inputs[i]] || em_rw_grow_roles(d) < 0) return -1;
    }
    return 0;
}

IRGraph *em_rw_rewriter_finish(Rewrite *d, const IRRef *outs, uint32_t n) {
    char vbuf[256];
    if (em_ir_set_output(d->j, outs, n) < 0 || em_ir_verify(d->j, vbuf, sizeof vbuf) < 0) return NULL;
    return d->j;
}

/* em_rw_rewriter_finish with g's outputs mapped through fmap (each must be a node the rewrite
 * copied or replaced; NULL otherwise). */
IRGraph *em_rw_rewriter_finish_mapped(Rewrite *d) {
    const IRArg *go = &em_ir_node(d->g, d->g->output)->args[0];
    IRRef *outs = calloc(go->n + 1, sizeof(IRRef));
    IRGraph *out = outs ? d->j : NULL;
    for (uint32_t k = 0; out && k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d->fmap[go->u.items[k].u.ref]) out = NULL;
        else outs[k] = d->fmap[go->u.items[k].u.ref];
    }
    out = out ? em_rw_rewriter_finish(d, outs, go->n) : NULL;
    free(outs);
    return out;
}

void em_rw_rewriter_free(Rewrite *d) {
    PyErr_Clear();
    Py_CLEAR(d->symctx);
    Py_CLEAR(d->symhints);
    Py_CLEAR(d->sizes);
    free(d->fmap);
    free(d->aux);
    free(d->role);
    free(d->pinned);
    Py_XDECREF(d->reason);
}

bool em_rw_same_strides(const IRMeta *a, const IRMeta *b) {
    if (a->ndim != b->ndim) return false;
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->sizes[d] != b->sizes[d] || (a->sizes[d] != 1 && a->strides[d] != b->strides[d])) return false;
    return true;
}
