/* lower, the rules: LOWER_RULES (one entry per torch op: key, kind, signature) and what each kind
 * builds. A rule returns its result node, or 0 to decline (the node stays extern); the pass checks
 * the result's dtype and shape against the IR meta. Type promotion: the IR meta gives each op's
 * result dtype; comparisons compute in torch.result_type of their operands; every input is cast to
 * the compute dtype first, and Python numbers become constants of that dtype ("wrapped number"). */
#include "lower/em_lower_impl.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* The rules                                                                                  */
/* ------------------------------------------------------------------------------------------ */

enum { ACT_TANH, ACT_SIGMOID, ACT_SILU, ACT_GELU }; /* R_ACT_BACKWARD's prim */

#define U(k, p) {k, R_UNARY, LP_##p, "input"}
#define B(k, p) {k, R_BINARY, LP_##p, "input,other"}
static const LowerRule LOWER_RULES[] = {
    /* pointwise unary: torch.X, Tensor.X, F.X */
    U("abs", ABS), U("absolute", ABS), U("op.abs", ABS), U("neg", NEG), U("negative", NEG), U("op.neg", NEG),
    U("reciprocal", RECIP), U("sqrt", SQRT), U("rsqrt", RSQRT), U("exp", EXP), U("exp2", EXP2),
    U("expm1", EXPM1), U("log", LOG), U("log2", LOG2), U("log10", LOG10), U("log1p", LOG1P),
    U("sin", SIN), U("cos", COS), U("tan", TAN), U("tanh", TANH), U("F.tanh", TANH), U("asin", ASIN),
    U("acos", ACOS), U("atan", ATAN), U("sinh", SINH), U("cosh", COSH), U("erf", ERF),
    U("special.erf", ERF), U("sigmoid", SIGMOID), U("F.sigmoid", SIGMOID), U("special.expit", SIGMOID),
    U("relu", RELU), {"F.relu", R_UNARY, LP_RELU, "input,inplace"}, U("floor", FLOOR), U("ceil", CEIL),
    U("round", ROUND), U("trunc", TRUNC), U("sign", SIGN), U("logical_not", NOT), U("isnan", ISNAN),
    U("isinf", ISINF),
    {"F.gelu", R_GELU, 0, "input,approximate"},
    {"F.silu", R_SILU, 0, "input,inplace"},
    {"F.softplus", R_SOFTPLUS, 0, "input,beta,threshold"},
    {"square", R_SQUARE, 0, "input"},
    /* pointwise binary */
    {"add", R_ADDSUB, LP_ADD, "input,other,alpha"}, {"sub", R_ADDSUB, LP_SUB, "input,other,alpha"},
    {"subtract", R_ADDSUB, LP_SUB, "input,other,alpha"},
    B("op.add", ADD), B("op.sub", SUB), B("mul", MUL), B("multiply", MUL), B("op.mul", MUL),
    {"div", R_DIV, 0, "input,other,rounding_mode"}, {"divide", R_DIV, 0, "input,other,rounding_mode"},
    {"true_divide", R_DIV, 0, "input,other"}, {"op.truediv", R_DIV, 0, "input,other"},
    {"op.floordiv", R_DIV, 1, "input,other"}, {"floor_divide", R_DIV, 1, "input,other"},
    {"pow", R_POW, 0, "input,exponent"}, {"op.pow", R_POW, 0, "input,exponent"},
    B("maximum", MAX), B("minimum", MIN), B("fmax", MAX), B("eq", EQ), B("ne", NE), B("lt", LT), B("le", LE),
    B("gt", GT), B("ge", GE), B("less", LT), B("greater", GT), B("op.eq", EQ), B("op.ne", NE), B("op.lt", LT),
    B("op.le", LE), B("op.gt", GT), B("op.ge", GE), B("logical_and", AND), B("logical_or", OR),
    B("logical_xor", XOR),
    {"where", R_WHERE, 0, "condition,input,other"},
    {"masked_fill", R_MASKED_FILL, 0, "input,mask,value"},
    {"clamp", R_CLAMP, 0, "input,min,max"}, {"clip", R_CLAMP, 0, "input,min,max"},
    {"clamp_min", R_CLAMP_MIN, 0, "input,min"}, {"clamp_max", R_CLAMP_MAX, 0, "input,max"},
    {"max", R_MAXMIN, LP_RMAX, "input,other"}, {"min", R_MAXMIN, LP_RMIN, "input,other"},
    /* casts */
    {"to", R_TO, 0, "input"}, {"type_as", R_CAST, -2, "input,other"},
    /* Tensor.copy_'s functional form (the key only an in-place copy_ reaches): src's values as the
     * new value of self, same shape and dtype (functionalize admits no other dtype; another shape
     * fails the result check); self's old values are not read */
    {"copy", R_COPY, 0, "input,src"},
    {"float", R_CAST, LDT_F32, "input"}, {"double", R_CAST, LDT_F64, "input"},
    {"half", R_CAST, LDT_F16, "input"}, {"bfloat16", R_CAST, LDT_BF16, "input"},
    {"long", R_CAST, LDT_I64, "input"}, {"int", R_CAST, LDT_I32, "input"}, {"short", R_CAST, LDT_I16, "input"},
    {"char", R_CAST, LDT_I8, "input"}, {"byte", R_CAST, LDT_U8, "input"}, {"bool", R_CAST, LDT_BOOL, "input"},
    /* reductions */
    {"sum", R_REDUCE, LP_RSUM, "input,dim,keepdim,dtype"}, {"prod", R_REDUCE, LP_RPROD, "input,dim,keepdim,dtype"},
    {"mean", R_MEAN, 0, "input,dim,keepdim,dtype"},
    {"amax", R_REDUCE, LP_RMAX, "input,dim,keepdim"}, {"amin", R_REDUCE, LP_RMIN, "input,dim,keepdim"},
    {"any", R_REDUCE, LP_RANY, "input,dim,keepdim"}, {"all", R_REDUCE, LP_RALL, "input,dim,keepdim"},
    {"argmax", R_REDUCE, LP_RARGMAX, "input,dim,keepdim"}, {"argmin", R_REDUCE, LP_RARGMIN, "input,dim,keepdim"},
    {"var", R_VAR, 0, "input,dim,unbiased,keepdim,correction"},
    {"std", R_VAR, 1, "input,dim,unbiased,keepdim,correction"},
    {"softmax", R_SOFTMAX, 0, "input,dim,dtype"}, {"F.softmax", R_SOFTMAX, 0, "input,dim,_stacklevel,dtype"},
    {"special.softmax", R_SOFTMAX, 0, "input,dim,dtype"},
    {"log_softmax", R_SOFTMAX, 1, "input,dim,dtype"}, {"F.log_softmax", R_SOFTMAX, 1, "input,dim,_stacklevel,dtype"},
    /* the math attention kernel's softmax (decomposed attention, csrc/autograd): rows of -inf give 0 */
    {"ops.aten._safe_softmax", R_SOFTMAX, 2, "input,dim,dtype"},
    {"logsumexp", R_LOGSUMEXP, 0, "input,dim,keepdim"},
    /* normalizations (inference) as decompositions */
    {"F.layer_norm", R_LAYER_NORM, 0, "input,normalized_shape,weight,bias,eps"},
    {"F.rms_norm", R_RMS_NORM, 0, "input,normalized_shape,weight,eps"},
    {"F.batch_norm", R_BATCH_NORM, 0, "input,running_mean,running_var,weight,bias,training,momentum,eps"},
    {"F.group_norm", R_GROUP_NORM, 0, "input,num_groups,weight,bias,eps"},
    {"F.dropout", R_DROPOUT, 0, "input,p,training,inplace"},
    /* pooling: windows of masked loads (padding reads nothing); adaptive pooling to 1 is a mean */
    {"F.max_pool2d", R_MAX_POOL, 2, "input,kernel_size,stride,padding,dilation,ceil_mode,return_indices"},
    {"F.max_pool1d", R_MAX_POOL, 1, "input,kernel_size,stride,padding,dilation,ceil_mode,return_indices"},
    {"F.adaptive_avg_pool2d", R_ADAPTIVE_AVG_POOL, 2, "input,output_size"},
    {"F.adaptive_avg_pool1d", R_ADAPTIVE_AVG_POOL, 1, "input,output_size"},
    /* cat/stack: one masked load per piece */
    {"cat", R_CAT, 0, "tensors,dim"}, {"concat", R_CAT, 0, "tensors,dim"}, {"concatenate", R_CAT, 0, "tensors,dim"},
    {"stack", R_CAT, 1, "tensors,dim"},
    /* constant padding: one masked load (prim 1: F.pad, whose mode must be "constant") */
    {"F.pad", R_PAD, 1, "input,pad,mode,value"}, {"constant_pad_nd", R_PAD, 0, "input,pad,value"},
    /* factories: a constant of the meta's dtype and shape (prim: 0 zeros, 1 ones, 2 the fill value) */
    {"zeros", R_FILL, 0, ""}, {"ones", R_FILL, 1, ""}, {"full", R_FILL, 2, ""},
    {"new_zeros", R_FILL, 0, ""}, {"new_ones", R_FILL, 1, ""}, {"new_full", R_FILL, 2, ""},
    {"zeros_like", R_FILL, 0, ""}, {"ones_like", R_FILL, 1, ""}, {"full_like", R_FILL, 2, ""},
    {"tensor", R_FILL, 3, ""}, /* torch.tensor([]): a KV cache layer's empty start (lower_fill) */
    {"arange", R_ARANGE, 0, ""},
    /* bitwise ops: integer dtypes; on bool they are the logical ones */
    {"op.and_", R_BITWISE, LP_BAND, "input,other"}, {"bitwise_and", R_BITWISE, LP_BAND, "input,other"},
    {"__and__", R_BITWISE, LP_BAND, "input,other"}, {"__rand__", R_BITWISE, LP_BAND, "input,other"},
    {"op.or_", R_BITWISE, LP_BOR, "input,other"}, {"bitwise_or", R_BITWISE, LP_BOR, "input,other"},
    {"__or__", R_BITWISE, LP_BOR, "input,other"}, {"__ror__", R_BITWISE, LP_BOR, "input,other"},
    {"op.xor", R_BITWISE, LP_BXOR, "input,other"}, {"bitwise_xor", R_BITWISE, LP_BXOR, "input,other"},
    {"__xor__", R_BITWISE, LP_BXOR, "input,other"}, {"__rxor__", R_BITWISE, LP_BXOR, "input,other"},
    {"op.invert", R_BITNOT, 0, "input"}, {"op.inv", R_BITNOT, 0, "input"}, {"bitwise_not", R_BITNOT, 0, "input"},
    {"__invert__", R_BITNOT, 0, "input"},
    {"diff", R_DIFF, 0, "input,n,dim,prepend,append"},
    /* the gradients of slicing (csrc/autograd's basic indexing, narrow, select): one masked load */
    {"ops.aten.slice_backward", R_SLICE_BACKWARD, 0, "grad_output,input_sizes,dim,start,end,step"},
    {"ops.aten.select_backward", R_SLICE_BACKWARD, 1, "grad_output,input_sizes,dim,index"},
    /* indirect loads: the index values are another node's (gather loads, LNode.nidx) */
    {"F.embedding", R_EMBEDDING, 0, "input,weight,padding_idx,max_norm,norm_type,scale_grad_by_freq,sparse"},
    {"embedding", R_EMBEDDING, 1, "weight,input,padding_idx,scale_grad_by_freq,sparse"},
    {"index_select", R_INDEX_SELECT, 0, "input,dim,index"},
    {"gather", R_GATHER, 0, "input,dim,index,sparse_grad"},
    /* dropout with Philox random numbers (training graphs of backend "ember", csrc/autograd) */
    {"ember.philox_dropout", R_PHILOX_DROPOUT, 0, "input,seeds,index,p"},
    /* what backward graphs call (csrc/autograd): a broadcast operand's gradient, ReLU's backward */
    {"sum_to_size", R_SUM_TO_SIZE, 0, ""},
    {"ops.aten.threshold_backward", R_THRESHOLD_BACKWARD, 0, "grad_output,input,threshold"},
    /* activations' backward ops (prim: ACT_*), as aten's CPU kernels compute them */
    {"ops.aten.tanh_backward", R_ACT_BACKWARD, ACT_TANH, "grad_output,output"},
    {"ops.aten.sigmoid_backward", R_ACT_BACKWARD, ACT_SIGMOID, "grad_output,output"},
    {"ops.aten.silu_backward", R_ACT_BACKWARD, ACT_SILU, "grad_output,self"},
    {"ops.aten.gelu_backward", R_ACT_BACKWARD, ACT_GELU, "grad_output,self,approximate"},
    /* views: index arithmetic */
    {"view", R_RESHAPE, 0, ""}, {"reshape", R_RESHAPE, 1, ""}, {"flatten", R_RESHAPE, 1, ""},
    {"squeeze", R_RESHAPE, 0, ""}, {"unsqueeze", R_RESHAPE, 0, ""}, {"view_as", R_RESHAPE, 0, ""},
    {"reshape_as", R_RESHAPE, 1, ""}, {"unflatten", R_RESHAPE, 0, ""},
    {"permute", R_PERMUTE, 0, ""}, {"transpose", R_TRANSPOSE, 0, "input,dim0,dim1"},
    {"swapaxes", R_TRANSPOSE, 0, "input,axis0,axis1"}, {"t", R_T, 0, "input"},
    {"expand", R_EXPAND, 0, ""}, {"expand_as", R_EXPAND, 0, ""}, {"broadcast_to", R_EXPAND, 0, ""},
    {"narrow", R_NARROW, 0, "input,dim,start,length"}, {"select", R_SELECT, 0, "input,dim,index"},
    {"op.getitem", R_GETITEM, 0, "input,index"}, {"contiguous", R_IDENTITY, 1, "input,memory_format"},
    /* a tuple of views, each lowered where a getitem takes it (split_piece) */
    {"split", R_SPLIT, 0, "input,split_size_or_sections,dim"}, {"chunk", R_SPLIT, 1, "input,chunks,dim"},
    {"unbind", R_SPLIT, 2, "input,dim"},
};
#undef U
#undef B

/* buf = a + b, truncated to size - 1 bytes (no rule key is that long). 0. */
static int key_join(char *buf, size_t size, const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > size - 1) la = size - 1;
    if (lb > size - 1 - la) lb = size - 1 - la;
    memcpy(buf, a, la);
    memcpy(buf + la, b, lb);
    buf[la + lb] = '\0';
    return 0;
}

/* The rule key of a call target: methods by name, torch.X and torch.Tensor.X as X,
 * torch.nn.functional.X as F.X, operator.X as op.X, torch.special.X as special.X. */
int em_lower_target_key(const IRNode *n, char *buf, size_t size) {
    PyObject *q = n->kind == IR_CALL_METHOD ? Py_NewRef(n->target) : em_ir_target_qualname(n->target);
    if (!q) {
        PyErr_Clear();
        return -1;
    }
    const char *s = PyUnicode_Check(q) ? PyUnicode_AsUTF8(q) : NULL;
    int r = -1;
    if (s) {
        static const struct { const char *prefix, *repl; } map[] = {
            {"torch.Tensor.", ""}, {"torch.nn.functional.", "F."}, {"torch._C._nn.", "F."},
            {"torch.special.", "special."}, {"torch._C._special.special_", "special."}, {"operator.", "op."},
            {"_operator.", "op."}, {"torch.", ""}, {"ember._C.", "ember."},
        };
        if (n->kind == IR_CALL_METHOD) {
            r = key_join(buf, size, "", s);
        } else {
            for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
                size_t lp = strlen(map[i].prefix);
                if (strncmp(s, map[i].prefix, lp) == 0) {
                    r = key_join(buf, size, map[i].repl, s + lp);
                    break;
                }
            }
            /* builtins of torch's C module (torch._C._VariableFunctions.add ...) print as "add" */
            if (r < 0 && !strchr(s, '.')) r = key_join(buf, size, "", s);
        }
    } else {
        PyErr_Clear();
    }
    Py_DECREF(q);
    return r;
}

/* The rule of a key (the first in LOWER_RULES when a key repeats), through an open-addressing
 * index of the table built on first use. NULL if none. */
static uint64_t key_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

enum { RULE_SLOTS = 1024 }; /* a power of two, more than twice the rules */
static const LowerRule *rule_by_key(const char *key) {
    static uint16_t slot[RULE_SLOTS]; /* rule index + 1; 0: empty */
    static int built;
    const size_t nrules = sizeof LOWER_RULES / sizeof LOWER_RULES[0];
    _Static_assert(sizeof LOWER_RULES / sizeof LOWER_RULES[0] * 2 < RULE_SLOTS, "grow RULE_SLOTS");
    if (!built) {
        for (size_t i = 0; i < nrules; i++) {
            uint32_t j = (uint32_t)key_hash(LOWER_RULES[i].key) & (RULE_SLOTS - 1);
            while (slot[j] && strcmp(LOWER_RULES[slot[j] - 1].key, LOWER_RULES[i].key) != 0) j = (j + 1) & (RULE_SLOTS - 1);
            if (!slot[j]) slot[j] = (uint16_t)(i + 1);
        }
        built = 1;
    }
    for (uint32_t j = (uint32_t)key_hash(key) & (RULE_SLOTS - 1); slot[j]; j = (j + 1) & (RULE_SLOTS - 1))
        if (strcmp(LOWER_RULES[slot[j] - 1].key, key) == 0) return &LOWER_RULES[slot[j] - 1];
    return NULL;
}

/* The augmented assignments of operator (x += y) and their functional forms. */
static const char *const inplace_operators[][2] = {
    {"op.iadd", "op.add"}, {"op.isub", "op.sub"}, {"op.imul", "op.mul"}, {"op.itruediv", "op.truediv"},
    {"op.ifloordiv", "op.floordiv"}, {"op.ipow", "op.pow"}, {"op.imod", "op.mod"}, {"op.iand", "op.and_"},
    {"op.ior", "op.or_"}, {"op.ixor", "op.xor"}, {"op.ilshift", "op.lshift"}, {"op.irshift", "op.rshift"},
    {"op.imatmul", "op.matmul"},
};

/* functional: the node is an in-place op that is lowered as its out-of-place form (relu_ as relu,
 * operator.iadd as operator.add; F.relu(x, inplace=True) keeps its key). An augmented assignment
 * onto a Python number (`b = 0; b += t`: int has no __iadd__, so Python computes 0 + t) updates
 * nothing and is always its out-of-place form (em_ir_mutates agrees). */
const LowerRule *em_lower_find_rule(const IRNode *n, int functional) {
    char key[128];
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return NULL;
    if (em_lower_target_key(n, key, sizeof key) < 0) return NULL;
    if (!functional && strncmp(key, "op.i", 4) == 0 && !em_ir_mutates(n))
        for (size_t i = 0; i < sizeof inplace_operators / sizeof inplace_operators[0]; i++)
            if (strcmp(key, inplace_operators[i][0]) == 0) return rule_by_key(inplace_operators[i][1]);
    if (functional) {
        size_t len = strlen(key);
        for (size_t i = 0; i < sizeof inplace_operators / sizeof inplace_operators[0]; i++)
            if (strcmp(key, inplace_operators[i][0]) == 0) {
                snprintf(key, sizeof key, "%s", inplace_operators[i][1]);
                len = 0;
            }
        if (len > 1 && key[len - 1] == '_' && key[len - 2] != '_') key[len - 1] = 0;
    }
    return rule_by_key(key);
}

int em_lower_is_view_rule(const LowerRule *r) { return r && r->kind >= R_RESHAPE; }

int em_lower_kind_of(const IRNode *n) {
    const LowerRule *r = em_lower_find_rule(n, 0);
    return !r ? EM_LOWER_EXTERN : em_lower_is_view_rule(r) ? EM_LOWER_VIEW : EM_LOWER_KERNEL;
}

/* torch.result_type(a, b) for a comparison's compute dtype, from the operands' meta examples and
 * Python numbers. -1 when unknown. */
static int result_type(Ctx *c, const IRArg *a, const IRArg *b) {
    PyObject *args[2] = {NULL, NULL}, *torch = NULL, *fn = NULL, *r = NULL;
    const IRArg *ab[2] = {a, b};
    int out = -1;
    for (int i = 0; i < 2; i++) {
        if (ab[i]->kind == IRARG_NODE) {
            const IRNode *src = &c->lg->ir->nodes[ab[i]->u.ref];
            if (src->meta.kind != IRMETA_TENSOR || !src->meta.example) goto done;
            args[i] = src->meta.example;
        } else if (ab[i]->kind == IRARG_CONST) {
            args[i] = ab[i]->u.obj;
        } else {
            goto done;
        }
    }
    torch = PyImport_ImportModule("torch");
    if (!torch) goto done;
    fn = PyObject_GetAttrString(torch, "result_type");
    if (!fn) goto done;
    r = PyObject_CallFunctionObjArgs(fn, args[0], args[1], NULL);
    if (r) out = em_lower_dtype_of(r);
done:
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(torch);
    Py_XDECREF(fn);
    Py_XDECREF(r);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* Building blocks of the rules                                                               */
/* ------------------------------------------------------------------------------------------ */

static uint32_t mk_reduce(Ctx *c, LPrim op, LDtype dt, uint32_t x, uint32_t rmask) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    int64_t sizes[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM];
    for (int d = 0; d < src.ndim; d++) {
        sizes[d] = (rmask >> d) & 1 ? 1 : src.sizes[d];
        ss[d] = (rmask >> d) & 1 ? em_lower_sk(c->lg, 1) : src.ssizes[d];
    }
    uint32_t id = em_lower_new_node(c->lg, op, dt, src.dtype, src.ndim, sizes, ss);
    if (!id) return 0;
    NODE(c, id)->in[0] = x;
    NODE(c, id)->rmask = rmask;
    NODE(c, id)->ir = c->ir;
    return id;
}

static int get_double(const IRArg *a, double *v) {
    if (!a || a->kind != IRARG_CONST) return -1;
    if (PyFloat_Check(a->u.obj)) *v = PyFloat_AS_DOUBLE(a->u.obj);
    else if (PyLong_Check(a->u.obj) && !PyBool_Check(a->u.obj)) *v = (double)PyLong_AsLongLong(a->u.obj);
    else return -1;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* dims argument of a reduction -> bit mask; None (or absent) = all dims. */
static int dims_mask(const IRArg *a, int32_t ndim, uint32_t *mask) {
    int64_t ds[EM_LMAXDIM + 1];
    if (em_lower_is_none(a)) {
        *mask = ndim ? (uint32_t)((1u << ndim) - 1) : 0;
        return 0;
    }
    int k = em_lower_get_ints(a, ds, EM_LMAXDIM + 1);
    if (k < 0) return -1;
    if (k == 0) {
        *mask = ndim ? (uint32_t)((1u << ndim) - 1) : 0;
        return 0;
    }
    *mask = 0;
    for (int i = 0; i < k; i++) {
        int32_t d;
        if (em_lower_norm_dim(ds[i], ndim, &d) < 0) return -1;
        if (ndim) *mask |= 1u << d;
    }
    return 0;
}

/* float compute dtype of a decomposition: half types compute in float32 and round once. */
static LDtype opmath(LDtype t) { return em_ldt_is_half(t) ? LDT_F32 : t; }

static uint32_t cnum(Ctx *c, double v, LDtype dt) { return em_lower_const(c, v, 0, 0, dt); }

/* The element count of the dims in rmask as a constant of dtype dt: a number in a static graph,
 * the size expression (CONST with sval) in a symbolic one. */
static uint32_t mk_count(Ctx *c, const LNode *src, uint32_t rmask, LDtype dt) {
    int64_t cnt = 1;
    SymRef scnt = em_lower_sk(c->lg, 1);
    for (int d = 0; d < src->ndim; d++)
        if ((rmask >> d) & 1) {
            cnt *= src->sizes[d];
            if (c->lg->env) scnt = em_sym_mul(c->lg->env, scnt, src->ssizes[d]);
        }
    uint32_t k = cnum(c, (double)cnt, dt);
    if (k && c->lg->env && !em_sym_is_const(c->lg->env, scnt, NULL)) NODE(c, k)->sval = scnt ? scnt : SYM_NONE;
    if (k && c->lg->env && scnt == SYM_NONE) return 0;
    return k;
}

/* sum over rmask divided by the element count (mean, keepdim). */
static uint32_t mk_mean(Ctx *c, uint32_t x, uint32_t rmask, LDtype dt) {
    LNode src = *NODE(c, x);
    uint32_t s = mk_reduce(c, LP_RSUM, dt, em_lower_cast(c, x, dt), rmask);
    return em_lower_op(c, LP_DIV, dt, dt, s, mk_count(c, &src, rmask, dt), 0);
}

/* var with correction, keepdim: Welford's M2 (one pass over the row) divided by count - correction. */
static uint32_t mk_var(Ctx *c, uint32_t x, uint32_t rmask, double correction, LDtype dt) {
    LNode src = *NODE(c, x);
    int64_t cnt = 1;
    for (int d = 0; d < src.ndim; d++)
        if ((rmask >> d) & 1) cnt *= src.sizes[d];
    /* Welford's one pass (as Inductor's and ATen's var on both devices): the sum of squared deviations */
    uint32_t ss = mk_reduce(c, LP_RM2, dt, em_lower_cast(c, x, dt), rmask);
    uint32_t den = mk_count(c, &src, rmask, dt);
    if (den && NODE(c, den)->sval) {
        /* symbolic count: max(count - correction, 0) computed in the kernel */
        den = em_lower_op(c, LP_MAX, dt, dt, em_lower_op(c, LP_SUB, dt, dt, den, cnum(c, correction, dt), 0), cnum(c, 0, dt), 0);
    } else {
        double denom = (double)cnt - correction;
        if (denom < 0) denom = 0;
        den = cnum(c, denom, dt);
    }
    return em_lower_op(c, LP_DIV, dt, dt, ss, den, 0);
}

/* Drops the reduced dims of a keepdim value (non-keepdim reductions). The value is stored with
 * the IR node's own strides when it is the IR node's result. */
static uint32_t squeeze_dims(Ctx *c, uint32_t x, uint32_t rmask) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    if (!rmask) return x;
    int64_t sizes[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM] = {0}, sst[EM_LMAXDIM] = {0};
    int k = 0;
    for (int d = 0; d < src.ndim; d++)
        if (!((rmask >> d) & 1)) {
            ss[k] = src.ssizes[d];
            sizes[k++] = src.sizes[d];
        }
    if (!em_lnode_is_view(&src)) return em_lower_as_load_shape(c, x, k, sizes, ss);
    int64_t st[EM_LMAXDIM];
    k = 0;
    for (int d = 0; d < src.ndim; d++)
        if (!((rmask >> d) & 1)) {
            sst[k] = src.sstrides[d];
            st[k++] = src.strides[d];
        }
    return em_lower_reload_s(c, x, k, sizes, st, 0, ss, sst, em_lower_sk(c->lg, 0));
}

/* normalized_shape -> mask of the trailing dims. In a symbolic graph an item may be a SymInt
 * node (F.layer_norm(x, x.shape[-1:])): it must be x's size expression. */
static int trailing_mask(Ctx *c, const IRArg *a, const LNode *x, uint32_t *mask) {
    int64_t ns[EM_LMAXDIM];
    SymRef sns[EM_LMAXDIM] = {0};
    int k = em_lower_get_ints(a, ns, EM_LMAXDIM);
    if (k < 0 && c->lg->env && a && (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) && a->n <= EM_LMAXDIM) {
        k = (int)a->n;
        for (int i = 0; i < k && k > 0; i++) {
            const IRArg *it = &a->u.items[i];
            if (it->kind == IRARG_NODE) {
                const IRMeta *im = &c->lg->ir->nodes[it->u.ref].meta;
                if (!im->sym || !im->example || !PyLong_Check(im->example)) k = -1;
                else {
                    ns[i] = PyLong_AsLongLong(im->example);
                    sns[i] = em_sym_simplify(c->lg->env, im->sym);
                    if (PyErr_Occurred()) {
                        PyErr_Clear();
                        k = -1;
                    }
                }
            } else if (em_lower_get_int(it, &ns[i]) == 0) {
                sns[i] = em_lower_sk(c->lg, ns[i]);
            } else {
                k = -1;
            }
        }
    } else if (k > 0) {
        for (int i = 0; i < k; i++) sns[i] = em_lower_sk(c->lg, ns[i]);
    }
    if (k < 0 || k > x->ndim) return -1;
    *mask = 0;
    for (int i = 0; i < k; i++) {
        if (!em_lower_same(c->lg, x->sizes[x->ndim - k + i], x->ssizes[x->ndim - k + i], ns[i], sns[i])) return -1;
        *mask |= 1u << (x->ndim - k + i);
    }
    return 0;
}

/* A per-channel vector (C,) seen as (C, 1, ..., 1) against x (N, C, ...). */
static uint32_t channel_view(Ctx *c, uint32_t v, int32_t ndim) {
    uint32_t l = em_lower_as_load(c, v);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    if (src.ndim != 1 || ndim < 2) return 0;
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM] = {0}, sst[EM_LMAXDIM] = {0};
    for (int d = 0; d < ndim - 1; d++) {
        sizes[d] = d == 0 ? src.sizes[0] : 1;
        st[d] = d == 0 ? src.strides[0] : 0;
        ss[d] = d == 0 ? src.ssizes[0] : em_lower_sk(c->lg, 1);
        sst[d] = d == 0 ? src.sstrides[0] : em_lower_sk(c->lg, 0);
    }
    return em_lower_reload_s(c, l, ndim - 1, sizes, st, 0, ss, sst, em_lower_sk(c->lg, 0));
}

/* ceil(a / b) for b > 0 */
static int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

/* A LOAD of buffer buf with the given view whose element exists only where lo[d] <= index d < hi[d]
 * for the dims in mask (elsewhere: fill, nothing read). Mask bits of size-1 dims are resolved here:
 * index 0 inside the range drops the bit; outside, the load is the fill constant. */
static uint32_t mk_masked_load(Ctx *c, uint32_t buf, int32_t nd, const int64_t *sizes, int64_t offset,
                               const int64_t *strides, const SymRef *ss, SymRef soff, const SymRef *sst, uint32_t mask,
                               const int64_t *lo, const int64_t *hi, double ffill, int64_t ifill) {
    LDtype dt = c->lg->bufs[buf].dtype;
    for (int d = 0; d < nd; d++) {
        if (!((mask >> d) & 1)) continue;
        if (lo[d] >= hi[d]) return em_lower_const(c, ffill, ifill, !em_ldt_is_float(dt), dt);
        if (lo[d] <= 0 && hi[d] >= sizes[d]) mask &= ~(1u << d);
        else if (sizes[d] == 1) return em_lower_const(c, ffill, ifill, !em_ldt_is_float(dt), dt);
    }
    uint32_t id = em_lower_load(c->lg, buf, nd, sizes, offset, strides, ss, soff, sst, c->ir);
    if (!id || !mask) return id;
    LNode *n = NODE(c, id);
    n->lmask = mask;
    for (int d = 0; d < nd; d++) {
        n->lo[d] = (mask >> d) & 1 ? lo[d] : 0;
        n->hi[d] = (mask >> d) & 1 ? hi[d] : sizes[d];
    }
    n->fval = ffill;
    n->ival = ifill;
    return id;
}

/* kernel_size/stride/padding/dilation of a pooling op: one int or sp ints. */
static int pool_arg(const IRArg *a, int sp, int64_t dflt, int64_t *out) {
    int64_t v[EM_LMAXDIM];
    if (em_lower_is_none(a)) {
        for (int i = 0; i < sp; i++) out[i] = dflt;
        return 0;
    }
    int k = em_lower_get_ints(a, v, EM_LMAXDIM);
    if (k == 0 && dflt > 0) k = -1;
    if (k == 1) for (int i = 0; i < sp; i++) out[i] = v[0];
    else if (k == sp) memcpy(out, v, sp * sizeof(int64_t));
    else return -1;
    return 0;
}

/* max_pool{1,2}d: the max over the window's positions, each a strided load masked to where the
 * window lies inside the input (padding reads nothing; -inf never wins a non-empty window). */
static uint32_t lower_max_pool(Ctx *c, int sp, uint32_t x, const IRArg **slot) {
    LDtype R = c->rdt;
    const IRMeta *m = &c->n->meta;
    int64_t ks[2], st[2], pd[2], dl[2];
    if (!em_ldt_is_float(R) || NODE(c, x)->dtype != R || !em_lower_is_false(slot[6])) return 0;
    if (pool_arg(slot[1], sp, -1, ks) < 0 || pool_arg(slot[3], sp, 0, pd) < 0 || pool_arg(slot[4], sp, 1, dl) < 0)
        return 0;
    if (em_lower_is_none(slot[2]) || (slot[2]->kind == IRARG_CONST && PySequence_Check(slot[2]->u.obj) &&
                                      PySequence_Size(slot[2]->u.obj) == 0))
        memcpy(st, ks, sizeof st);
    else if (pool_arg(slot[2], sp, -1, st) < 0)
        return 0;
    if (PyErr_Occurred()) PyErr_Clear();
    LNode src = *NODE(c, x);
    int32_t nd = src.ndim;
    if ((nd != sp + 1 && nd != sp + 2) || m->ndim != nd) return 0;
    int64_t npos = 1;
    for (int i = 0; i < sp; i++) {
        if (ks[i] <= 0 || st[i] <= 0 || dl[i] <= 0 || pd[i] < 0) return 0;
        npos *= ks[i];
    }
    if (npos > 64) return 0;
    uint32_t l = em_lower_as_load(c, x);
    if (!l) return 0;
    src = *NODE(c, l);
    uint32_t acc = 0;
    for (int64_t p = 0; p < npos; p++) {
        int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, off = src.offset, q = p;
        uint32_t mask = 0;
        for (int d = 0; d < nd - sp; d++) strides[d] = src.strides[d];
        for (int i = sp - 1; i >= 0; i--) {
            int d = nd - sp + i;
            int64_t k = q % ks[i], shift = k * dl[i] - pd[i];
            q /= ks[i];
            strides[d] = src.strides[d] * st[i];
            off += shift * src.strides[d];
            /* valid: 0 <= o * st + shift < input size */
            lo[d] = ceil_div(-shift, st[i]);
            hi[d] = ceil_div(src.sizes[d] - shift, st[i]);
            if (lo[d] < 0) lo[d] = 0;
            if (hi[d] > m->sizes[d]) hi[d] = m->sizes[d];
            mask |= 1u << d;
        }
        uint32_t v = mk_masked_load(c, src.buf, nd, m->sizes, off, strides, NULL, SYM_NONE, NULL, mask, lo, hi, -INFINITY, 0);
        if (!v) return 0;
        if (NODE(c, v)->op == LP_CONST) continue; /* this window position never lies inside */
        acc = acc ? em_lower_op(c, LP_MAX, R, R, acc, v, 0) : v;
    }
    return acc;
}

/* A piece of a cat computed from a view by negations and casts (rotate_half's -x2 in every rotary
 * embedding: torch.cat((-x[..., h:], x[..., :h]), -1)), all in float or all in integer dtypes: the
 * nodes from the piece down to the view's load in chain[0 .. n) (the view is chain[n - 1]'s input),
 * applied by lower_cat to the view's masked load, so the piece is computed in the cat's kernel
 * instead of being stored by a kernel of its own. Outside its range the load's fill goes through
 * the chain too, so the fill is chosen to come out as -0.0 (+0.0 under an odd number of NEGs; 0
 * for integers), the sum's identity. 0 when the piece is a view itself or another computation. */
static uint32_t cat_piece_chain(Ctx *c, uint32_t x, uint32_t chain[4]) {
    uint32_t n = 0;
    const LNode *top = NODE(c, x);
    int fl = em_ldt_is_float(top->dtype);
    if (top->dtype == LDT_BOOL) return 0;
    while (!em_lnode_is_view(NODE(c, x))) {
        const LNode *p = NODE(c, x), *in = p->op == LP_NEG || p->op == LP_CAST ? NODE(c, p->in[0]) : NULL;
        if (n == 4 || !in || in->dtype == LDT_BOOL || em_ldt_is_float(in->dtype) != fl || in->ndim != top->ndim ||
            memcmp(in->sizes, top->sizes, top->ndim * sizeof(int64_t)) != 0)
            return 0;
        chain[n++] = x;
        x = p->in[0];
    }
    return n;
}

/* cat / stack: the sum of one masked load per piece, each existing only on its range of the
 * output's dim (fill -0.0, the identity of float addition for every value, 0 for integers, false
 * for bool with OR). The pieces must have the result's dtype (no promotion in the sum). */
static uint32_t lower_cat(Ctx *c, int stack, const IRArg **slot) {
    LDtype R = c->rdt;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    const IRMeta *m = &c->n->meta;
    const IRArg *ts = slot[0];
    int64_t dim = 0;
    int32_t nd = m->ndim, d;
    if (!ts || (ts->kind != IRARG_LIST && ts->kind != IRARG_TUPLE) || ts->n == 0 || ts->n > 16) return 0;
    if (slot[1] && em_lower_get_int(slot[1], &dim) < 0) return 0;
    if (nd == 0 || em_lower_norm_dim(dim, nd, &d) < 0) return 0;
    /* symbolic: the pieces' extents along dim are the same for every size (the masks' bounds are
     * numbers), the other dims are the result's */
    SymRef mss[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    if (env && !em_sym_is_const(env, mss[d], NULL)) return 0;
    LPrim comb = R == LDT_BOOL ? LP_OR : LP_ADD;
    double ffill = -0.0;
    uint32_t acc = 0;
    int64_t start = 0;
    for (uint32_t i = 0; i < ts->n; i++) {
        Opnd o;
        if (em_lower_opnd(c, &ts->u.items[i], &o) < 0 || o.kind != 1 || NODE(c, o.node)->dtype != R) return 0;
        uint32_t chain[4], nchain = cat_piece_chain(c, o.node, chain);
        uint32_t l = nchain ? NODE(c, chain[nchain - 1])->in[0] : em_lower_as_load(c, o.node);
        if (!l) return 0;
        LNode src = *NODE(c, l);
        int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, piece;
        SymRef sst[EM_LMAXDIM];
        if (!stack && nd > 1 && src.ndim == 1 && src.sizes[0] == 0 && (!env || em_sym_is_const(env, src.ssizes[0], NULL)))
            continue; /* a 1-D empty tensor, which torch.cat skips (its legacy rule): a KV cache's first cat */
        if (stack) {
            if (src.ndim != nd - 1) return 0;
            for (int e = 0, k = 0; e < nd; e++) {
                if (e == d) {
                    strides[e] = 0;
                    sst[e] = em_lower_sk(lg, 0);
                    continue;
                }
                if (!em_lower_same(lg, src.sizes[k], src.ssizes[k], m->sizes[e], mss[e])) return 0;
                sst[e] = src.sstrides[k];
                strides[e] = src.strides[k++];
            }
            piece = 1;
        } else {
            if (src.ndim != nd || (env && !em_sym_is_const(env, src.ssizes[d], NULL))) return 0;
            for (int e = 0; e < nd; e++) {
                if (e != d && !em_lower_same(lg, src.sizes[e], src.ssizes[e], m->sizes[e], mss[e])) return 0;
                strides[e] = src.strides[e];
                sst[e] = src.sstrides[e];
            }
            piece = src.sizes[d];
        }
        if (piece == 0) continue;
        lo[d] = start;
        hi[d] = start + piece;
        SymRef soff = env ? em_sym_sub(env, src.soffset, em_sym_mul(env, em_lower_sk(lg, start), sst[d])) : SYM_NONE;
        int flips = 0; /* the fill the chain maps to -0.0 */
        for (uint32_t q = 0; q < nchain; q++) flips ^= NODE(c, chain[q])->op == LP_NEG;
        uint32_t v = mk_masked_load(c, src.buf, nd, m->sizes, src.offset - start * strides[d], strides, mss, soff, sst,
                                    1u << d, lo, hi, flips ? 0.0 : ffill, 0);
        for (uint32_t q = nchain; q-- > 0 && v;) {
            const LNode *op = NODE(c, chain[q]);
            v = em_lower_op(c, op->op, op->dtype, op->cdtype, v, 0, 0);
        }
        if (!v) return 0;
        acc = acc ? em_lower_op(c, comb, R, R, acc, v, 0) : v;
        start += piece;
    }
    if (start != m->sizes[d]) return 0;
    return acc;
}

/* F.pad(input, pad, mode="constant", value) and torch.constant_pad_nd(input, pad, value): one masked
 * load of the input over the result's shape, shifted by each padded dim's leading pad, the value
 * where the element lies in the padding (a negative pad crops: the load starts further in). pad:
 * (before, after) pairs from the last dim backwards, as torch orders them. pad_mm's padded weight
 * (GPT-2's LM head, 77 MB in bf16) was aten's constant_pad_nd: a fill of the whole result, then a
 * copy of the input into it (two passes, 65 us a call on the H200, and the host time of four torch
 * calls); here one kernel writes each element once. Static graphs. */
static uint32_t lower_pad(Ctx *c, int functional, const IRArg **slot) {
    LDtype R = c->rdt;
    LGraph *lg = c->lg;
    const IRMeta *m = &c->n->meta;
    const IRArg *value = slot[functional ? 3 : 2];
    Opnd x, v = {0};
    int64_t p[2 * EM_LMAXDIM];
    if (lg->env || em_lower_opnd(c, slot[0], &x) < 0 || x.kind != 1 || NODE(c, x.node)->dtype != R) return 0;
    if (functional && slot[2] && !em_lower_is_none(slot[2])) {
        const char *s = slot[2]->kind == IRARG_CONST && PyUnicode_Check(slot[2]->u.obj) ? PyUnicode_AsUTF8(slot[2]->u.obj) : NULL;
        if (!s || strcmp(s, "constant") != 0) return PyErr_Clear(), 0; /* reflect / replicate / circular: torch's */
    }
    if (value && !em_lower_is_none(value) && (em_lower_opnd(c, value, &v) < 0 || v.kind != 2)) return 0;
    int k = em_lower_get_ints(slot[1], p, 2 * EM_LMAXDIM);
    int32_t nd = m->ndim;
    if (k < 0 || k % 2 || k / 2 > nd) return 0;
    uint32_t l = em_lower_as_load(c, x.node);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    if (src.ndim != nd) return 0;
    int64_t lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, off = src.offset;
    uint32_t mask = 0;
    for (int i = 0; i < k / 2; i++) {
        int d = nd - 1 - i;
        int64_t before = p[2 * i], after = p[2 * i + 1];
        if (src.sizes[d] + before + after != m->sizes[d]) return 0;
        lo[d] = before; /* result index j reads input index j - before */
        hi[d] = before + src.sizes[d];
        off -= before * src.strides[d];
        mask |= 1u << d;
    }
    SymRef mss[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    double f = v.kind ? (v.isint ? (double)v.i : v.f) : 0.0;
    int64_t iv = v.kind ? (v.isint ? v.i : (int64_t)v.f) : 0;
    if (!em_ldt_is_float(R) && v.kind && !v.isint && (double)iv != v.f) return 0; /* torch raises or rounds */
    uint32_t r = mk_masked_load(c, src.buf, nd, m->sizes, off, src.strides, mss, SYM_NONE, src.sstrides, mask, lo, hi, f, iv);
    if (!r || !em_lnode_is_view(NODE(c, r))) return r;
    /* no padding left (zero pads, or only crops): eager returns a new tensor, not a view of the
     * input; a CAST to the same dtype is that copy */
    uint32_t cp = em_lower_new_node(lg, LP_CAST, R, R, nd, m->sizes, NULL);
    if (!cp) return 0;
    NODE(c, cp)->in[0] = r;
    NODE(c, cp)->ir = c->ir;
    return cp;
}

/* slice_backward's result seen from grad's LOAD l: a load of l's buffer with c->n's shape, masked
 * to [start, end) along dim d (select: grad lacks dim d), the fill elsewhere: fill[i] for a load
 * pushed down from leaf[i] of grad's DAG, else +0.0. */
#define SB_LEAVES 8
typedef struct {
    int select;
    int32_t d;
    int64_t start, end;
    uint32_t nleaf, leaf[SB_LEAVES];
    double fill[SB_LEAVES];
} SliceBack;

static uint32_t slice_backward_load(Ctx *c, void *arg, uint32_t orig, uint32_t l) {
    const SliceBack *sb = arg;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    const IRMeta *m = &c->n->meta;
    int32_t nd = m->ndim, d = sb->d;
    SymRef mss[EM_LMAXDIM], sst[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    LNode src = *NODE(c, l);
    int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0};
    double fill = 0.0;
    for (uint32_t i = 0; i < sb->nleaf; i++)
        if (sb->leaf[i] == orig) fill = sb->fill[i];
    /* a masked leaf, or the index table (its loads read no memory: masks are for memory): stored first */
    if (!em_lnode_is_view(&src) || lg->bufs[src.buf].kind == LBUF_INDEX || src.ndim != nd - sb->select) return 0;
    for (int e = 0, k = 0; e < nd; e++) {
        if (e == d) {
            if (!sb->select && src.sizes[k] != sb->end - sb->start) return 0;
            sst[e] = sb->select ? em_lower_sk(lg, 0) : src.sstrides[k];
            strides[e] = sb->select ? 0 : src.strides[k++];
            continue;
        }
        if (!em_lower_same(lg, src.sizes[k], src.ssizes[k], m->sizes[e], mss[e])) return 0;
        sst[e] = src.sstrides[k];
        strides[e] = src.strides[k++];
    }
    lo[d] = sb->start;
    hi[d] = sb->end;
    SymRef soff = env ? em_sym_sub(env, src.soffset, em_sym_mul(env, em_lower_sk(lg, sb->start), sst[d])) : SYM_NONE;
    return mk_masked_load(c, src.buf, nd, m->sizes, src.offset - sb->start * strides[d], strides, mss, soff, sst, 1u << d,
                          lo, hi, fill, 0);
}

/* The value of the pointwise DAG x where its LOAD leaf[i] reads fill[i] (scalar CONSTs their
 * value), for ops that keep zeros zero up to sign; 0 with *v, -1 for another op, a leaf not in the
 * table (it is added when there is room: *nleaf grows) or a deeper DAG. Computed in double: zeros
 * and their signs come out as in every float dtype. */
static int dag_value_at(const LGraph *lg, uint32_t x, SliceBack *sb, int depth, double *v) {
    const LNode *n = &lg->nodes[x];
    double a = 0, b = 0;
    if (n->op == LP_LOAD) {
        for (uint32_t i = 0; i < sb->nleaf; i++)
            if (sb->leaf[i] == x) {
                *v = sb->fill[i];
                return 0;
            }
        if (sb->nleaf == SB_LEAVES) return -1;
        sb->leaf[sb->nleaf] = x;
        sb->fill[sb->nleaf++] = 0.0;
        *v = 0.0;
        return 0;
    }
    if (n->op == LP_CONST) {
        if (n->ndim != 0 || n->sval != SYM_NONE) return -1;
        *v = em_ldt_is_float(n->dtype) ? n->fval : (double)n->ival;
        return 0;
    }
    if (depth > 24 || !em_ldt_is_float(n->dtype) || !em_ldt_is_float(n->cdtype)) return -1;
    int ar = em_lprim_arity(n->op);
    if ((ar >= 1 && dag_value_at(lg, n->in[0], sb, depth + 1, &a) < 0) ||
        (ar >= 2 && dag_value_at(lg, n->in[1], sb, depth + 1, &b) < 0))
        return -1;
    switch (n->op) {
    case LP_CAST: *v = a; return 0;
    case LP_NEG: *v = -a; return 0;
    case LP_SIN: *v = sin(a); return 0;
    case LP_TANH: *v = tanh(a); return 0;
    case LP_ADD: *v = a + b; return 0;
    case LP_SUB: *v = a - b; return 0;
    case LP_MUL: *v = a * b; return 0;
    case LP_DIV: *v = a / b; return 0;
    default: return -1;
    }
}

/* Fills of +0.0 / -0.0 for the leaves of grad's DAG x (sb->leaf, sb->fill) under which x is +0.0
 * exactly, as slice_backward's zeros are: 1 when some choice does (the rotary embedding's
 * -(g * sin(t))[..., :h]: g's loads fill +0.0, t's -0.0), else 0. */
static int zero_fills(const LGraph *lg, uint32_t x, SliceBack *sb) {
    double v;
    sb->nleaf = 0;
    if (dag_value_at(lg, x, sb, 0, &v) < 0) return 0; /* collects the leaves */
    for (uint32_t bits = 0; bits < (1u << sb->nleaf); bits++) {
        for (uint32_t i = 0; i < sb->nleaf; i++) sb->fill[i] = (bits >> i) & 1 ? -0.0 : 0.0;
        if (dag_value_at(lg, x, sb, 0, &v) == 0 && v == 0.0 && !signbit(v)) return 1;
    }
    return 0;
}

/* aten slice_backward(grad, input_sizes, dim, start, end, step 1) and select_backward(grad,
 * input_sizes, dim, index): a tensor of input_sizes holding grad in [start, end) (at index) along
 * dim and +0.0 elsewhere (aten/src/ATen/native/TensorShape.cpp: zeros, then the slice copied in),
 * as one load of grad masked to that range, so no zeros are written and the sum of several
 * pieces' gradients (rotary embeddings' x[..., :h] and x[..., h:]) is one kernel. A grad computed
 * by a pointwise DAG that only this node reads is not stored first: its loads are masked instead
 * (em_lower_pushdown), with fills of +0.0 or -0.0 that the DAG maps to +0.0 exactly (zero_fills),
 * so the zeros come out as eager's. Other steps: the torch op. */
static uint32_t lower_slice_backward(Ctx *c, int select, const IRArg **slot) {
    LDtype R = c->rdt;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    const IRMeta *m = &c->n->meta;
    Opnd go;
    int64_t dim, start, end, step = 1;
    int32_t nd = m->ndim, d;
    if (em_lower_opnd(c, slot[0], &go) < 0 || go.kind != 1 || NODE(c, go.node)->dtype != R || em_lower_get_int(slot[2], &dim) < 0 ||
        em_lower_norm_dim(dim, nd, &d) < 0 || em_lower_get_int(slot[3], &start) < 0)
        return 0;
    /* symbolic: dim's extent is the same for every size (the mask's bounds are numbers) */
    SymRef mss[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    if (env && !em_sym_is_const(env, mss[d], NULL)) return 0;
    if (select) {
        if (start < 0) start += m->sizes[d];
        end = start + 1;
    } else if (em_lower_get_int(slot[4], &end) < 0 || em_lower_get_int(slot[5], &step) < 0) {
        return 0;
    }
    if (step != 1 || start < 0 || end > m->sizes[d] || start > end) return 0;
    SliceBack sb = {.select = select, .d = d, .start = start, .end = end};
    const LNode *gn = NODE(c, go.node);
    if (!env && em_ldt_is_float(R) && gn->op != LP_LOAD && gn->op != LP_CONST && slot[0]->kind == IRARG_NODE &&
        em_lower_ir_reads(lg->ir, slot[0]->u.ref) == 1 && zero_fills(lg, go.node, &sb)) {
        uint32_t before = lg->nnodes, bbefore = lg->nbufs;
        uint32_t r = em_lower_pushdown(c, go.node, slice_backward_load, &sb);
        if (r) return r;
        if (PyErr_Occurred()) return 0;
        lg->nnodes = before; /* nothing of a failed attempt stays */
        lg->nbufs = bbefore;
    }
    sb.nleaf = 0;
    uint32_t l = em_lower_as_load(c, go.node);
    return l ? slice_backward_load(c, &sb, 0, l) : 0;
}

/* Tensor.to(dtype | device | device, dtype | other, non_blocking, copy=False): the result dtype is
 * the IR meta's and every tensor of the graph is on one device (em_lower_graph_device), so to() is
 * a cast, or, to the dtype the input has, the input itself (torch returns self: an alias, like a
 * view). copy=True and memory_format are the torch op's. */
static uint32_t lower_to(Ctx *c) {
    const IRNode *n = c->n;
    Opnd a;
    if (n->nargs < 1 || em_lower_opnd(c, &n->args[0], &a) < 0 || a.kind != 1) return 0;
    int nbools = 0;
    for (uint32_t i = 1; i < n->nargs; i++) {
        const IRArg *x = &n->args[i];
        if (x->kind == IRARG_NODE && c->lg->ir->nodes[x->u.ref].meta.kind == IRMETA_TENSOR) continue; /* to(other) */
        if (x->kind != IRARG_CONST) return 0;
        PyObject *o = x->u.obj;
        if (PyBool_Check(o)) {
            if (nbools++ == 1 && o != Py_False) return 0; /* (dtype, non_blocking, copy) */
        } else if (o != Py_None && !PyUnicode_Check(o) && em_lower_dtype_of(o) < 0 &&
                   strcmp(Py_TYPE(o)->tp_name, "torch.device") != 0) {
            return 0;
        }
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "copy") == 0 || strcmp(kw, "memory_format") == 0) {
            if (strcmp(kw, "copy") == 0 ? !em_lower_is_false(x) : !em_lower_is_none(x)) return 0;
        } else if (strcmp(kw, "dtype") != 0 && strcmp(kw, "device") != 0 && strcmp(kw, "non_blocking") != 0) {
            return 0;
        } else if (x->kind != IRARG_CONST) {
            return 0;
        }
    }
    return em_lower_cast(c, a.node, c->rdt);
}

/* ones/zeros/full, new_ones/new_zeros/new_full, ones_like/zeros_like/full_like: a CONST of the IR
 * meta's dtype and shape. The sizes, dtype, device and layout arguments must be constants (the meta
 * says what they give); requires_grad only False; the fill value a Python number that converts to
 * the dtype exactly (torch would round or raise otherwise: its op runs). Static graphs only. */
static uint32_t lower_fill(Ctx *c, int which) {
    const IRNode *n = c->n;
    const IRMeta *m = &n->meta;
    char key[64];
    if (c->lg->env || em_lower_target_key(n, key, sizeof key) < 0) return 0;
    int self_first = strncmp(key, "new_", 4) == 0 || strstr(key, "_like") != NULL;
    const IRArg *value = NULL;
    if (which == 3) {
        /* torch.tensor(data): only an empty list or tuple, a 1-d tensor of no elements (transformers'
         * DynamicLayer starts its keys and values so; torch.cat skips it), which no kernel reads:
         * no torch call, no allocation */
        const IRArg *x = n->nargs == 1 ? &n->args[0] : NULL;
        bool empty = x && (x->kind == IRARG_LIST || x->kind == IRARG_TUPLE) && x->n == 0;
        if (!empty || m->kind != IRMETA_TENSOR || m->ndim != 1 || m->sizes[0] != 0) return 0;
        which = 0;
    }
    for (uint32_t i = 0; i < n->nargs; i++) {
        const IRArg *x = &n->args[i];
        if (i == 0 && self_first) {
            if (x->kind != IRARG_NODE) return 0;
            continue;
        }
        if (which == 2 && i == n->nargs - 1) value = x; /* full(size, v), new_full(self, size, v), full_like(x, v) */
        else if (x->kind == IRARG_NODE) return 0;      /* a size computed at run time */
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "fill_value") == 0) value = x;
        else if (strcmp(kw, "requires_grad") == 0 ? !em_lower_is_false(x) : x->kind != IRARG_CONST) return 0;
        else if (strcmp(kw, "dtype") && strcmp(kw, "device") && strcmp(kw, "layout") && strcmp(kw, "pin_memory") &&
                 strcmp(kw, "memory_format") && strcmp(kw, "size") && strcmp(kw, "requires_grad"))
            return 0;
    }
    double f = which;
    int64_t i = which;
    int isint = 1;
    if (which == 2) {
        Opnd v;
        if (!value || em_lower_opnd(c, value, &v) < 0 || v.kind != 2) return 0;
        isint = v.isint;
        f = v.f;
        i = v.i;
    }
    LDtype R = c->rdt;
    if (!isint && !em_ldt_is_float(R) && R != LDT_BOOL && !(f == (double)(int64_t)f && fabs(f) < 9e15)) return 0;
    /* the kernels round a half type's constant through float: one rounding only if float holds it */
    if (!isint && em_ldt_is_half(R) && f == f && (double)(float)f != f) return 0;
    uint32_t k = em_lower_const(c, f, isint ? i : (int64_t)f, isint, R);
    if (!k) return 0;
    if (!isint && R == LDT_BOOL) NODE(c, k)->ival = f != 0;
    if (R == LDT_BOOL) NODE(c, k)->ival = NODE(c, k)->ival != 0;
    if (!em_ldt_is_float(R) && R != LDT_BOOL) {
        /* the value must fit the integer type (torch raises "value cannot be converted ...") */
        Opnd o = {.kind = 2, .isint = 1, .i = NODE(c, k)->ival};
        if (!em_lower_operand_node(c, &o, R)) return 0;
    }
    LNode *kn = NODE(c, k);
    kn->ndim = m->ndim;
    memcpy(kn->sizes, m->sizes, m->ndim * sizeof(int64_t));
    return k;
}

/* The program's index table (LBUF_INDEX: element e holds e), at least len elements: a load of it is
 * its offset, computed in the kernel (SAccess.iota), so its size costs no memory. UINT32_MAX on OOM. */
static uint32_t index_table(LGraph *lg, int64_t len) {
    for (uint32_t i = 0; i < lg->nbufs; i++)
        if (lg->bufs[i].kind == LBUF_INDEX) {
            if (lg->bufs[i].sizes[0] < len) lg->bufs[i].sizes[0] = len;
            if (lg->env) lg->bufs[i].ssizes[0] = em_lower_sk(lg, lg->bufs[i].sizes[0]);
            return i;
        }
    /* its loads read their offset, never memory (SAccess.iota): the size is nominal, a constant
     * shadow in a symbolic graph too */
    LBuf b = {.kind = LBUF_INDEX, .dtype = LDT_I64, .ndim = 1, .sizes = {len}, .strides = {1},
              .ssizes = {em_lower_sk(lg, len)}, .sstrides = {em_lower_sk(lg, 1)}};
    return em_lower_buffer(lg, &b);
}

/* arange(end) / arange(start, end[, step]) with Python numbers: start + step * i, i loaded from the
 * program's index table and computed in int64, then cast to the meta's dtype. Integer results;
 * float results only when every value is an integer the dtype holds exactly (ATen computes
 * start + step * i in double on the CPU and in float on CUDA: equal then). In a symbolic graph the
 * end may be a size (integer results). */
static uint32_t lower_arange(Ctx *c) {
    const IRNode *n = c->n;
    const IRMeta *m = &n->meta;
    LGraph *lg = c->lg;
    if (m->ndim != 1 || n->nargs < 1 || n->nargs > 3) return 0;
    double v[3] = {0, 0, 1};
    int allint = 1;
    for (uint32_t i = 0; i < n->nargs; i++) {
        Opnd o;
        if (em_lower_opnd(c, &n->args[i], &o) < 0) return 0;
        /* symbolic: the end may be a size (arange(x.shape[1])): the length is the meta's
         * expression; start and step are numbers */
        int end = i == (n->nargs == 1 ? 0u : 1u);
        if (o.kind == 4 && end && lg->env) o.kind = 2;
        if (o.kind != 2) return 0;
        double x = o.isint ? (double)o.i : o.f;
        if (!o.isint) allint &= x == floor(x);
        if (fabs(x) > 9e15) return 0;
        v[n->nargs == 1 ? 1 : i] = x;
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "requires_grad") == 0 ? !em_lower_is_false(x) : x->kind != IRARG_CONST) return 0;
        if (strcmp(kw, "dtype") && strcmp(kw, "device") && strcmp(kw, "layout") && strcmp(kw, "pin_memory") &&
            strcmp(kw, "requires_grad"))
            return 0;
    }
    LDtype R = c->rdt;
    int64_t len = m->sizes[0], start = (int64_t)v[0], step = (int64_t)v[2];
    if (!allint || step == 0) return 0;
    SymRef slen = SYM_NONE;
    em_lower_meta_shadows(lg, m, &slen, NULL);
    /* a symbolic length: integer results only (a float's exactness bound needs the length) */
    if (lg->env && (slen == SYM_NONE || (!em_sym_is_const(lg->env, slen, NULL) && em_ldt_is_float(R)))) return 0;
    if (em_ldt_is_float(R)) {
        static const double exact[] = {[LDT_F32] = 16777216.0, [LDT_F64] = 9007199254740992.0, [LDT_F16] = 2048.0,
                                       [LDT_BF16] = 256.0};
        double hi = fabs((double)start) + fabs((double)step) * (double)len;
        if (hi > exact[R]) return 0;
    } else if (R == LDT_BOOL) {
        return 0;
    }
    uint32_t tb = index_table(lg, len);
    if (tb == UINT32_MAX) return 0;
    int64_t one = 1;
    SymRef sone = em_lower_sk(lg, 1);
    uint32_t i = em_lower_load(lg, tb, 1, &len, 0, &one, &slen, em_lower_sk(lg, 0), &sone, c->ir);
    if (!i) return 0;
    if (step != 1) i = em_lower_op(c, LP_MUL, LDT_I64, LDT_I64, i, em_lower_const(c, 0, step, 1, LDT_I64), 0);
    if (start != 0) i = em_lower_op(c, LP_ADD, LDT_I64, LDT_I64, i, em_lower_const(c, 0, start, 1, LDT_I64), 0);
    return em_lower_cast(c, i, R);
}

/* y[i + shift] along dim d, i over the result's sizes, of y = cat(pieces) along d: one masked load
 * per piece (lower_cat's rule: fill -0.0 / 0 combined by ADD, OR for bool). */
static uint32_t cat_window(Ctx *c, const uint32_t *pieces, int np, int32_t d, int32_t nd, const int64_t *rsizes,
                           int64_t shift, LDtype R) {
    uint32_t acc = 0;
    int64_t start = 0;
    for (int p = 0; p < np; p++) {
        LNode src = *NODE(c, pieces[p]);
        int64_t lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, piece = src.sizes[d];
        if (src.ndim != nd) return 0;
        for (int e = 0; e < nd; e++)
            if (e != d && src.sizes[e] != rsizes[e]) return 0;
        if (piece == 0) continue;
        lo[d] = start - shift;
        hi[d] = start + piece - shift;
        uint32_t v = mk_masked_load(c, src.buf, nd, rsizes, src.offset - (start - shift) * src.strides[d], src.strides,
                                    NULL, SYM_NONE, NULL,
                                    1u << d, lo, hi, -0.0, 0);
        if (!v) return 0;
        acc = acc ? em_lower_op(c, R == LDT_BOOL ? LP_OR : LP_ADD, R, R, acc, v, 0) : v;
        start += piece;
    }
    return acc;
}

/* diff(x, n=1, dim, prepend, append): y[i + 1] - y[i] over y = cat(prepend, x, append) along dim
 * (xor for bool: aten/src/ATen/native/ReduceOps.cpp, diff_helper). Pieces of the result's dtype. */
static uint32_t lower_diff(Ctx *c, const IRArg **slot) {
    const IRMeta *m = &c->n->meta;
    LDtype R = c->rdt;
    int64_t nn = 1, dim = -1;
    int32_t d;
    if ((slot[1] && em_lower_get_int(slot[1], &nn) < 0) || nn != 1 || (slot[2] && em_lower_get_int(slot[2], &dim) < 0)) return 0;
    if (m->ndim == 0 || em_lower_norm_dim(dim, m->ndim, &d) < 0) return 0;
    uint32_t pieces[3];
    int np = 0;
    const IRArg *order[3] = {slot[3], slot[0], slot[4]};
    for (int i = 0; i < 3; i++) {
        Opnd o;
        if (em_lower_is_none(order[i])) continue;
        if (em_lower_opnd(c, order[i], &o) < 0 || o.kind != 1 || NODE(c, o.node)->dtype != R) return 0;
        if (!(pieces[np++] = em_lower_as_load(c, o.node))) return 0;
    }
    uint32_t hi = cat_window(c, pieces, np, d, m->ndim, m->sizes, 1, R);
    uint32_t lo = cat_window(c, pieces, np, d, m->ndim, m->sizes, 0, R);
    if (!hi || !lo) return 0;
    return em_lower_op(c, R == LDT_BOOL ? LP_XOR : LP_SUB, R, R, hi, lo, 0);
}

/* v rounded to dtype dt (float types): the constant a kernel multiplies by, as eager holds it. */
static double round_to(double v, LDtype dt) {
    if (dt == LDT_F32) return (double)(float)v;
    if (dt == LDT_F16) return (double)(_Float16)(float)v; /* via float: torch's opmath scalar */
    if (dt == LDT_BF16) { /* round to nearest even (c10/util/BFloat16.h) */
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        memcpy(&f, &u, 4);
        return (double)f;
    }
    return v;
}

/* ember._C.philox_dropout(input, seeds, index, p) (em_runtime_random.c: its eager form, the same
 * numbers): input * (u < 1 - p ? s : 0), u = em_philox_uniform(seeds[index], e) in float32 for the
 * element at row-major position e of input's shape (its counter: a load of the index table, so that
 * views pushed into the loads move it with the element), s = 1 / (1 - p) in input's dtype (eager's
 * noise tensor holds it in that dtype). A dropped NaN stays NaN (x * 0), as in eager. Static
 * graphs, float dtypes, 0 < p < 1. */
static uint32_t lower_philox_dropout(Ctx *c, const IRArg **slot) {
    LGraph *lg = c->lg;
    Opnd x, sd;
    int64_t index;
    double p;
    if (em_lower_opnd(c, slot[0], &x) < 0 || x.kind != 1 || em_lower_opnd(c, slot[1], &sd) < 0 || sd.kind != 1 ||
        em_lower_get_int(slot[2], &index) < 0 || get_double(slot[3], &p) < 0 || !(p > 0.0 && p < 1.0))
        return 0;
    LDtype R = c->rdt;
    LNode xn = *NODE(c, x.node);
    if (!em_ldt_is_float(R) || xn.dtype != R) return 0;
    uint32_t sl = em_lower_as_load(c, sd.node);
    if (!sl) return 0;
    LNode sn = *NODE(c, sl);
    if (sn.dtype != LDT_I64 || sn.ndim != 1 || index < 0 || index >= sn.sizes[0] || sn.lmask || sn.nidx) return 0;
    /* symbolic sizes: the counter is the element's index in x's contiguous order for this call's
     * sizes, as philox_dropout's eager implementation counts (the table's loads read no memory) */
    int64_t zero[EM_LMAXDIM] = {0}, st[EM_LMAXDIM];
    SymRef szero[EM_LMAXDIM], sst[EM_LMAXDIM];
    for (int d = 0; d < xn.ndim; d++) szero[d] = em_lower_sk(lg, 0);
    em_lower_contiguous_sstrides(lg, xn.ndim, xn.ssizes, sst);
    SymRef soff = lg->env ? em_sym_add(lg->env, sn.soffset, em_sym_mul(lg->env, em_lower_sk(lg, index), sn.sstrides[0])) : SYM_NONE;
    uint32_t seed = em_lower_load(lg, sn.buf, xn.ndim, xn.sizes, sn.offset + index * sn.strides[0], zero, xn.ssizes,
                                  soff, szero, c->ir);
    uint32_t tb = index_table(lg, em_lower_numel_of(xn.ndim, xn.sizes));
    if (!seed || tb == UINT32_MAX) return 0;
    em_lower_contiguous_strides(xn.ndim, xn.sizes, st);
    uint32_t ctr = em_lower_load(lg, tb, xn.ndim, xn.sizes, 0, st, xn.ssizes, em_lower_sk(lg, 0), sst, c->ir);
    uint32_t u = em_lower_op(c, LP_RAND, LDT_F32, LDT_I64, seed, ctr, 0);
    uint32_t keep = em_lower_op(c, LP_LT, LDT_BOOL, LDT_F32, u, em_lower_const(c, (double)(float)(1.0 - p), 0, 0, LDT_F32), 0);
    uint32_t noise = em_lower_op(c, LP_WHERE, R, R, keep, em_lower_const(c, round_to(1.0 / (1.0 - p), R), 0, 0, R),
                                 em_lower_const(c, 0.0, 0, 0, R));
    return em_lower_op(c, LP_MUL, R, R, x.node, noise, 0);
}

/* An activation's backward op: grad x the activation's derivative, from its output (tanh,
 * sigmoid) or its input (silu, gelu), in the order aten's CPU kernels compute it
 * (aten/src/ATen/native/cpu/BinaryOpsKernel.cpp tanh_backward / sigmoid_backward,
 * Activation.cpp silu_backward / GeluBackwardKernelImpl; on CUDA BinaryMiscBackwardOpsKernels.cu),
 * in float for half types (CUDA's tanh_backward rounds y * y to the half type first). Lowered, the
 * backward's chain around it fuses into one kernel instead of an extern call and its buffer. */
static uint32_t lower_act_backward(Ctx *c, int act, const IRArg *const *slot) {
    Opnd g, y;
    LDtype R = c->rdt;
    if (em_lower_opnd(c, slot[0], &g) < 0 || g.kind != 1 || em_lower_opnd(c, slot[1], &y) < 0 || y.kind != 1 || !em_ldt_is_float(R) ||
        NODE(c, g.node)->dtype != R || NODE(c, y.node)->dtype != R)
        return 0;
    int tanh_approx = 0;
    if (act == ACT_GELU && slot[2]) {
        const char *s = slot[2]->kind == IRARG_CONST && PyUnicode_Check(slot[2]->u.obj) ? PyUnicode_AsUTF8(slot[2]->u.obj) : NULL;
        if (!s) return 0;
        if (strcmp(s, "tanh") == 0) tanh_approx = 1;
        else if (strcmp(s, "none") != 0) return 0;
    }
    LDtype F = opmath(R);
    uint32_t dy = em_lower_cast(c, g.node, F), x = em_lower_cast(c, y.node, F), one = cnum(c, 1.0, F), r;
#define OP(p, a, b) em_lower_op(c, LP_##p, F, F, a, b, 0)
    switch (act) {
    case ACT_TANH: { /* dy * (1 - y * y); CUDA's kernel multiplies y * y in the half type itself
                        (c10's operator* of two Half/BFloat16 values rounds), its CPU kernel in float */
        uint32_t ysq = OP(MUL, x, x);
        if (c->lg->device >= 0 && em_ldt_is_half(R)) ysq = em_lower_cast(c, em_lower_cast(c, ysq, R), F);
        r = OP(MUL, dy, OP(SUB, one, ysq));
        break;
    }
    case ACT_SIGMOID: /* dy * (1 - y) * y */
        r = OP(MUL, OP(MUL, dy, OP(SUB, one, x)), x);
        break;
    case ACT_SILU: { /* s = 1 / (1 + exp(-x)); dy * s * (1 + x * (1 - s)) */
        uint32_t sg = OP(DIV, one, OP(ADD, one, em_lower_op(c, LP_EXP, F, F, em_lower_op(c, LP_NEG, F, F, x, 0, 0), 0, 0)));
        r = OP(MUL, OP(MUL, dy, sg), OP(ADD, one, OP(MUL, x, OP(SUB, one, sg))));
        break;
    }
    default:
        if (tanh_approx) {
            /* beta = sqrt(2) * 2/sqrt(pi) * 0.5, kappa = 0.044715; t = tanh(beta * (x + kappa x^3));
             * dy * (0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2)) */
            uint32_t xsq = OP(MUL, x, x), xcube = OP(MUL, xsq, x);
            uint32_t inner = OP(MUL, cnum(c, 0.7978845608028654, F), OP(ADD, x, OP(MUL, cnum(c, 0.044715, F), xcube)));
            uint32_t t = em_lower_op(c, LP_TANH, F, F, inner, 0, 0);
            uint32_t left = OP(MUL, cnum(c, 0.5, F), x), right = OP(ADD, one, t);
            uint32_t dleft = OP(MUL, cnum(c, 0.5, F), right);
            uint32_t dtanh = OP(SUB, one, OP(MUL, t, t));
            uint32_t dinner = OP(MUL, cnum(c, 0.7978845608028654, F), OP(ADD, one, OP(MUL, cnum(c, 3.0 * 0.044715, F), xsq)));
            r = OP(MUL, dy, OP(ADD, dleft, OP(MUL, OP(MUL, left, dtanh), dinner)));
        } else {
            /* cdf = 0.5 (1 + erf(x / sqrt(2))), pdf = exp(-x^2 / 2) / sqrt(2 pi); dy * (cdf + x pdf) */
            uint32_t cdf = OP(MUL, cnum(c, 0.5, F),
                              OP(ADD, one, em_lower_op(c, LP_ERF, F, F, OP(MUL, x, cnum(c, 0.7071067811865476, F)), 0, 0)));
            uint32_t pdf = OP(MUL, cnum(c, 0.3989422804014327, F),
                              em_lower_op(c, LP_EXP, F, F, OP(MUL, OP(MUL, x, x), cnum(c, -0.5, F)), 0, 0));
            r = OP(MUL, dy, OP(ADD, cdf, OP(MUL, x, pdf)));
        }
    }
#undef OP
    return em_lower_cast(c, r, R);
}

/* x.sum_to_size(*size) (autograd's reduction of a broadcast operand's gradient): a sum over the
 * leading dims and over the dims where size is 1 and x's is not, keeping those as 1, then the
 * leading dims dropped. Static graphs, float dtypes (integer sums promote in torch). */
static uint32_t lower_sum_to_size(Ctx *c) {
    const IRNode *n = c->n;
    int64_t size[EM_LMAXDIM];
    Opnd a;
    if (c->lg->env || n->nargs < 2 || em_lower_opnd(c, &n->args[0], &a) < 0 || a.kind != 1) return 0;
    int ns = em_lower_varargs_ints(n, 1, size, EM_LMAXDIM);
    LNode src = *NODE(c, a.node);
    LDtype R = c->rdt;
    if (ns < 0 || ns > src.ndim || !em_ldt_is_float(R) || src.dtype != R) return 0;
    int lead = src.ndim - ns;
    uint32_t mask = 0, lmask = 0;
    for (int d = 0; d < src.ndim; d++) {
        if (d < lead) {
            mask |= 1u << d;
            lmask |= 1u << d;
        } else if (size[d - lead] == 1 && src.sizes[d] != 1) {
            mask |= 1u << d;
        } else if (size[d - lead] != src.sizes[d]) {
            return 0; /* torch raises: not expandable to x's shape */
        }
    }
    if (!mask) return 0; /* the same shape: torch returns x itself (an alias): the torch call */
    return squeeze_dims(c, mk_reduce(c, LP_RSUM, R, a.node, mask), lmask);
}

uint32_t em_lower_rule(Ctx *c, const LowerRule *rule) {
    const IRArg *slot[MAXP];
    if (rule->kind == R_TO) return lower_to(c);
    if (rule->kind == R_FILL) return lower_fill(c, rule->prim);
    if (rule->kind == R_ARANGE) return lower_arange(c);
    if (rule->kind == R_SUM_TO_SIZE) return lower_sum_to_size(c);
    if (rule->sig[0] && em_lower_bind(c->n, rule->sig, slot) < 0) return 0;
    if (!rule->sig[0] && c->n->nkwargs) return 0;
    if (rule->kind == R_GETITEM && em_lower_getitem_advanced(c->lg->ir, c->n)) return em_lower_adv_index(c, slot);
    if (em_lower_is_view_rule(rule)) return em_lower_view(c, rule, slot);
    if (c->lg->env && (rule->kind == R_INDEX_SELECT || rule->kind == R_GATHER))
        return 0; /* gather loads are static only, embedding's excepted (mk_gather_load) */
    if (rule->kind == R_EMBEDDING) return em_lower_embedding(c, rule->prim, slot);
    if (rule->kind == R_INDEX_SELECT) return em_lower_index_select(c, slot);
    if (rule->kind == R_GATHER) return em_lower_gather(c, slot);
    if (rule->kind == R_PHILOX_DROPOUT) return lower_philox_dropout(c, slot);
    if (rule->kind == R_THRESHOLD_BACKWARD) { /* aten threshold_backward: input <= threshold ? 0 : grad */
        Opnd g, x, t;
        LDtype R = c->rdt;
        if (em_lower_opnd(c, slot[0], &g) < 0 || g.kind != 1 || em_lower_opnd(c, slot[1], &x) < 0 || x.kind != 1 ||
            em_lower_opnd(c, slot[2], &t) < 0 || t.kind != 2 || NODE(c, g.node)->dtype != R || NODE(c, x.node)->dtype != R ||
            !em_ldt_is_float(R))
            return 0;
        uint32_t le = em_lower_op(c, LP_LE, LDT_BOOL, R, x.node, em_lower_operand_node(c, &t, R), 0);
        return em_lower_op(c, LP_WHERE, R, R, le, em_lower_const(c, 0.0, 0, 0, R), g.node);
    }
    if (rule->kind == R_ACT_BACKWARD) return lower_act_backward(c, rule->prim, slot);
    /* pooling windows, diff's pieces and group_norm's regrouping have no shadows yet: in a
     * symbolic graph they stay torch's (cat and slice_backward mask a dim of fixed extent) */
    if (c->lg->env && (rule->kind == R_MAX_POOL || rule->kind == R_GROUP_NORM || rule->kind == R_DIFF)) return 0;
    if (rule->kind == R_CAT) return lower_cat(c, rule->prim, slot);
    if (rule->kind == R_PAD) return lower_pad(c, rule->prim, slot);
    if (rule->kind == R_DIFF) return lower_diff(c, slot);
    if (rule->kind == R_SLICE_BACKWARD) return lower_slice_backward(c, rule->prim, slot);
    Opnd a, b, w;
    if (em_lower_opnd(c, slot[0], &a) < 0 || em_lower_opnd(c, slot[1], &b) < 0 || em_lower_opnd(c, slot[2], &w) < 0) return 0;
    LDtype R = c->rdt;
    switch (rule->kind) {
    case R_UNARY: {
        if (a.kind != 1 || (slot[1] && !em_lower_is_false(slot[1]) && !c->inplace_ok)) return 0;
        LPrim p = (LPrim)rule->prim;
        LDtype cd = (p == LP_ISNAN || p == LP_ISINF) ? NODE(c, a.node)->dtype : p == LP_NOT ? LDT_BOOL : R;
        if (p == LP_SIGN && R == LDT_BOOL) return 0;
        return em_lower_op(c, p, R, cd, a.node, 0, 0);
    }
    case R_BITWISE: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        if (em_ldt_is_float(R)) return 0; /* torch raises */
        static const LPrim logical[] = {[LP_BAND] = LP_AND, [LP_BOR] = LP_OR, [LP_BXOR] = LP_XOR};
        LPrim p = R == LDT_BOOL ? logical[rule->prim] : (LPrim)rule->prim;
        return em_lower_op(c, p, R, R, em_lower_operand_node(c, &a, R), em_lower_operand_node(c, &b, R), 0);
    }
    case R_BITNOT:
        if (a.kind != 1 || em_ldt_is_float(R)) return 0;
        return em_lower_op(c, R == LDT_BOOL ? LP_NOT : LP_BNOT, R, R, em_lower_cast(c, a.node, R), 0, 0);
    case R_SQUARE:
        if (a.kind != 1) return 0;
        return em_lower_op(c, LP_MUL, R, R, a.node, a.node, 0);
    case R_BINARY:
    case R_ADDSUB: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        LPrim p = (LPrim)rule->prim;
        LDtype cd = R;
        if (p >= LP_EQ && p <= LP_GE) {
            int t = result_type(c, slot[0], slot[1]);
            if (t < 0) return 0;
            cd = (LDtype)t;
        } else if (p == LP_AND || p == LP_OR || p == LP_XOR) {
            cd = LDT_BOOL;
        }
        if (R == LDT_BOOL && (p == LP_SUB)) return 0; /* torch raises; keep its error */
        /* arange(n) + 0 (transformers' position arithmetic) is the index table's LOAD itself, so
         * that views of it stay views (an index operand then needs no kernel of its own). Only for
         * the index table: it never reaches a call or the output as itself (need_tensor copies it),
         * so this makes no alias that eager would not make. */
        if (p == LP_ADD && a.kind == 1 && b.kind == 2 && b.isint && b.i == 0 && NODE(c, a.node)->dtype == R &&
            em_lnode_is_view(NODE(c, a.node)) && c->lg->bufs[NODE(c, a.node)->buf].kind == LBUF_INDEX)
            return a.node;
        uint32_t x = em_lower_operand_node(c, &a, cd), y = em_lower_operand_node(c, &b, cd);
        if (rule->kind == R_ADDSUB && slot[2]) {
            Opnd al;
            if (em_lower_opnd(c, slot[2], &al) < 0 || al.kind != 2) return 0;
            if (!(al.isint && al.i == 1)) y = em_lower_op(c, LP_MUL, R, cd, y, em_lower_const(c, al.f, al.i, al.isint, cd), 0);
        }
        return em_lower_op(c, p, R, cd, x, y, 0);
    }
    case R_DIV: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        LPrim p = rule->prim == 1 ? LP_DIV_FLOOR : LP_DIV;
        if (rule->prim == 0 && slot[2] && !em_lower_is_none(slot[2])) {
            const char *mode = slot[2]->kind == IRARG_CONST && PyUnicode_Check(slot[2]->u.obj)
                                   ? PyUnicode_AsUTF8(slot[2]->u.obj) : NULL;
            if (!mode) return 0;
            if (strcmp(mode, "trunc") == 0) p = LP_DIV_TRUNC;
            else if (strcmp(mode, "floor") == 0) p = LP_DIV_FLOOR;
            else return 0;
        }
        if (!em_ldt_is_float(R)) return 0; /* integer division (by zero raises): extern */
        return em_lower_op(c, p, R, R, em_lower_operand_node(c, &a, R), em_lower_operand_node(c, &b, R), 0);
    }
    case R_POW: {
        if (a.kind != 1 || (b.kind != 1 && b.kind != 2) || !em_ldt_is_float(R)) return 0;
        uint32_t x = em_lower_cast(c, a.node, R);
        if (b.kind == 2) {
            /* torch's pow_tensor_scalar_optimized_kernel special cases (aten/src/ATen/native/cpu/PowKernel.cpp) */
            double e = b.isint ? (double)b.i : b.f;
            if (e == 2) return em_lower_op(c, LP_MUL, R, R, x, x, 0);
            if (e == 3) return em_lower_op(c, LP_MUL, R, R, em_lower_op(c, LP_MUL, R, R, x, x, 0), x, 0);
            if (e == 0.5) return em_lower_op(c, LP_SQRT, R, R, x, 0, 0);
            if (e == -0.5) return em_lower_op(c, LP_RSQRT, R, R, x, 0, 0);
            if (e == -1) return em_lower_op(c, LP_RECIP, R, R, x, 0, 0);
            if (e == -2) return em_lower_op(c, LP_RECIP, R, R, em_lower_op(c, LP_MUL, R, R, x, x, 0), 0, 0);
        }
        return em_lower_op(c, LP_POW, R, R, x, em_lower_operand_node(c, &b, R), 0);
    }
    case R_WHERE: {
        if (a.kind != 1 || (b.kind != 1 && b.kind != 2) || (w.kind != 1 && w.kind != 2)) return 0;
        return em_lower_op(c, LP_WHERE, R, R, a.node, em_lower_operand_node(c, &b, R), em_lower_operand_node(c, &w, R));
    }
    case R_MASKED_FILL: {
        if (a.kind != 1 || b.kind != 1 || (w.kind != 1 && w.kind != 2)) return 0;
        if (w.kind == 1 && NODE(c, w.node)->ndim != 0) return 0;
        return em_lower_op(c, LP_WHERE, R, R, b.node, em_lower_operand_node(c, &w, R), em_lower_cast(c, a.node, R));
    }
    case R_CLAMP:
    case R_CLAMP_MIN:
    case R_CLAMP_MAX: {
        if (a.kind != 1) return 0;
        Opnd lo = rule->kind == R_CLAMP_MAX ? (Opnd){0} : b;
        Opnd hi = rule->kind == R_CLAMP ? w : rule->kind == R_CLAMP_MAX ? b : (Opnd){0};
        if (lo.kind == 3 || hi.kind == 3 || (lo.kind == 0 && hi.kind == 0)) return 0;
        uint32_t x = em_lower_cast(c, a.node, R);
        if (lo.kind) x = em_lower_op(c, LP_MAX, R, R, x, em_lower_operand_node(c, &lo, R), 0);
        if (hi.kind) x = em_lower_op(c, LP_MIN, R, R, x, em_lower_operand_node(c, &hi, R), 0);
        return x;
    }
    case R_MAXMIN: {
        if (a.kind != 1) return 0;
        if (b.kind == 1) return em_lower_op(c, rule->prim == LP_RMAX ? LP_MAX : LP_MIN, R, R, a.node, b.node, 0);
        if (b.kind != 0) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask = src.ndim ? (1u << src.ndim) - 1 : 0;
        return squeeze_dims(c, mk_reduce(c, (LPrim)rule->prim, R, a.node, mask), mask);
    }
    case R_COPY:
        if (a.kind != 1 || b.kind != 1) return 0;
        return em_lower_cast(c, b.node, R);
    case R_CAST: {
        if (a.kind != 1 || (rule->prim == -2 && b.kind != 1)) return 0;
        return em_lower_cast(c, a.node, R); /* the dtype it has: torch returns self, the same node */
    }
    case R_GELU: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        int tanh_approx = 0;
        if (slot[1]) {
            const char *s = slot[1]->kind == IRARG_CONST && PyUnicode_Check(slot[1]->u.obj) ? PyUnicode_AsUTF8(slot[1]->u.obj) : NULL;
            if (!s) return 0;
            if (strcmp(s, "tanh") == 0) tanh_approx = 1;
            else if (strcmp(s, "none") != 0) return 0;
        }
        LDtype F = opmath(R);
        uint32_t x = em_lower_cast(c, a.node, F), inner;
        if (tanh_approx) {
            /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (aten/src/ATen/native/cpu/Activation.cpp) */
            uint32_t x3 = em_lower_op(c, LP_MUL, F, F, em_lower_op(c, LP_MUL, F, F, x, x, 0), x, 0);
            uint32_t u = em_lower_op(c, LP_ADD, F, F, x, em_lower_op(c, LP_MUL, F, F, x3, cnum(c, 0.044715, F), 0), 0);
            inner = em_lower_op(c, LP_TANH, F, F, em_lower_op(c, LP_MUL, F, F, u, cnum(c, 0.7978845608028654, F), 0), 0, 0);
        } else {
            inner = em_lower_op(c, LP_ERF, F, F, em_lower_op(c, LP_MUL, F, F, x, cnum(c, 0.7071067811865476, F), 0), 0, 0);
        }
        uint32_t r = em_lower_op(c, LP_MUL, F, F, em_lower_op(c, LP_MUL, F, F, x, cnum(c, 0.5, F), 0),
                                 em_lower_op(c, LP_ADD, F, F, inner, cnum(c, 1.0, F), 0), 0);
        return em_lower_cast(c, r, R);
    }
    case R_SILU: {
        if (a.kind != 1 || (!em_lower_is_false(slot[1]) && !c->inplace_ok) || !em_ldt_is_float(R)) return 0;
        LDtype F = opmath(R);
        uint32_t x = em_lower_cast(c, a.node, F);
        uint32_t den = em_lower_op(c, LP_ADD, F, F, cnum(c, 1.0, F), em_lower_op(c, LP_EXP, F, F, em_lower_op(c, LP_NEG, F, F, x, 0, 0), 0, 0), 0);
        return em_lower_cast(c, em_lower_op(c, LP_DIV, F, F, x, den, 0), R);
    }
    case R_SOFTPLUS: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        double beta = 1, thr = 20;
        if ((slot[1] && get_double(slot[1], &beta) < 0) || (slot[2] && get_double(slot[2], &thr) < 0)) return 0;
        LDtype F = opmath(R);
        uint32_t x = em_lower_cast(c, a.node, F);
        uint32_t bx = em_lower_op(c, LP_MUL, F, F, x, cnum(c, beta, F), 0);
        uint32_t soft = em_lower_op(c, LP_DIV, F, F, em_lower_op(c, LP_LOG1P, F, F, em_lower_op(c, LP_EXP, F, F, bx, 0, 0), 0, 0), cnum(c, beta, F), 0);
        uint32_t cond = em_lower_op(c, LP_GT, LDT_BOOL, F, bx, cnum(c, thr, F), 0);
        return em_lower_cast(c, em_lower_op(c, LP_WHERE, F, F, cond, x, soft), R);
    }
    case R_REDUCE:
    case R_MEAN: {
        if (a.kind != 1) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        int keep = 0;
        if (dims_mask(slot[1], src.ndim, &mask) < 0) return 0;
        if (slot[2]) {
            if (!(slot[2]->kind == IRARG_CONST && PyBool_Check(slot[2]->u.obj))) return 0;
            keep = slot[2]->u.obj == Py_True;
        }
        LPrim p = (LPrim)rule->prim;
        uint32_t x = a.node, r;
        if (rule->kind == R_MEAN) {
            if (!em_ldt_is_float(R)) return 0;
            r = mk_mean(c, em_lower_cast(c, x, R), mask, R);
        } else if (p == LP_RARGMAX || p == LP_RARGMIN) {
            if (em_lower_is_none(slot[1])) {
                /* argmax over the flattened tensor: reduce every dim, result shape () */
                r = mk_reduce(c, p, LDT_I64, x, mask);
                if (!keep) return squeeze_dims(c, r, mask);
                return r;
            }
            r = mk_reduce(c, p, LDT_I64, x, mask);
        } else if (p == LP_RANY || p == LP_RALL) {
            r = mk_reduce(c, p, R, em_lower_cast(c, x, LDT_BOOL), mask);
        } else if (p == LP_RMAX || p == LP_RMIN) {
            r = mk_reduce(c, p, R, em_lower_cast(c, x, R), mask);
        } else {
            r = mk_reduce(c, p, R, em_lower_cast(c, x, R), mask);
        }
        return keep ? r : squeeze_dims(c, r, mask);
    }
    case R_VAR: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        const IRArg *dim = slot[1], *unb = slot[2];
        /* torch.var(x, True): the second positional is `unbiased` when it is a bool */
        if (dim && dim->kind == IRARG_CONST && PyBool_Check(dim->u.obj)) {
            if (unb) return 0;
            unb = dim;
            dim = NULL;
        }
        uint32_t mask;
        int keep = 0;
        double corr = 1;
        if (dims_mask(dim, src.ndim, &mask) < 0) return 0;
        if (slot[3]) {
            if (!(slot[3]->kind == IRARG_CONST && PyBool_Check(slot[3]->u.obj))) return 0;
            keep = slot[3]->u.obj == Py_True;
        }
        if (unb && !em_lower_is_none(unb)) {
            if (!(unb->kind == IRARG_CONST && PyBool_Check(unb->u.obj))) return 0;
            corr = unb->u.obj == Py_True ? 1 : 0;
        }
        if (slot[4] && !em_lower_is_none(slot[4]) && get_double(slot[4], &corr) < 0) return 0;
        LDtype F = opmath(R);
        uint32_t v = mk_var(c, em_lower_cast(c, a.node, F), mask, corr, F);
        if (rule->prim == 1) v = em_lower_op(c, LP_SQRT, F, F, v, 0, 0);
        v = em_lower_cast(c, v, R);
        return keep ? v : squeeze_dims(c, v, mask);
    }
    case R_SOFTMAX: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        int64_t dim;
        int32_t d;
        LNode src = *NODE(c, a.node);
        if (em_lower_get_int(slot[1], &dim) < 0 || em_lower_norm_dim(dim, src.ndim, &d) < 0) return 0;
        const IRArg *dt = rule->key[0] == 'F' ? slot[3] : slot[2];
        if (!em_lower_is_none(dt) && (dt->kind != IRARG_CONST || em_lower_dtype_of(dt->u.obj) != (int)R)) return 0;
        uint32_t mask = src.ndim ? 1u << d : 0;
        LDtype F = opmath(R);
        /* aten/src/ATen/native/cpu/SoftMaxKernel.cpp (_vec_softmax_lastdim): max, exp(x - max), sum,
         * then x * (1 / sum) */
        uint32_t x = em_lower_cast(c, a.node, F);
        uint32_t m = mk_reduce(c, LP_RMAX, F, x, mask);
        uint32_t sh = em_lower_op(c, LP_SUB, F, F, x, m, 0);
        uint32_t e = em_lower_op(c, LP_EXP, F, F, sh, 0, 0);
        uint32_t s = mk_reduce(c, LP_RSUM, F, e, mask);
        uint32_t r = rule->prim == 1 ? em_lower_op(c, LP_SUB, F, F, sh, em_lower_op(c, LP_LOG, F, F, s, 0, 0), 0)
                                     : em_lower_op(c, LP_MUL, F, F, e, em_lower_op(c, LP_RECIP, F, F, s, 0, 0), 0);
        if (rule->prim == 2) { /* aten/src/ATen/native/SoftMax.cpp _safe_softmax: where(all(x == -inf), 0, softmax) */
            uint32_t ninf = em_lower_op(c, LP_EQ, LDT_BOOL, F, x, cnum(c, -INFINITY, F), 0);
            uint32_t dead = mk_reduce(c, LP_RALL, LDT_BOOL, ninf, mask);
            r = em_lower_op(c, LP_WHERE, F, F, dead, cnum(c, 0, F), r);
        }
        return em_lower_cast(c, r, R);
    }
    case R_LOGSUMEXP: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        int keep = 0;
        if (!slot[1] || dims_mask(slot[1], src.ndim, &mask) < 0) return 0;
        if (slot[2]) {
            if (!(slot[2]->kind == IRARG_CONST && PyBool_Check(slot[2]->u.obj))) return 0;
            keep = slot[2]->u.obj == Py_True;
        }
        LDtype F = opmath(R);
        /* aten/src/ATen/native/ReduceOps.cpp logsumexp: an infinite max is replaced by 0 */
        uint32_t x = em_lower_cast(c, a.node, F);
        uint32_t m0 = mk_reduce(c, LP_RMAX, F, x, mask);
        uint32_t m = em_lower_op(c, LP_WHERE, F, F, em_lower_op(c, LP_ISINF, LDT_BOOL, F, m0, 0, 0), cnum(c, 0, F), m0);
        uint32_t s = mk_reduce(c, LP_RSUM, F, em_lower_op(c, LP_EXP, F, F, em_lower_op(c, LP_SUB, F, F, x, m, 0), 0, 0), mask);
        uint32_t r = em_lower_cast(c, em_lower_op(c, LP_ADD, F, F, em_lower_op(c, LP_LOG, F, F, s, 0, 0), m, 0), R);
        return keep ? r : squeeze_dims(c, r, mask);
    }
    case R_LAYER_NORM:
    case R_RMS_NORM: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        if (trailing_mask(c, slot[1], &src, &mask) < 0) return 0;
        const IRArg *weight = slot[2], *bias = rule->kind == R_LAYER_NORM ? slot[3] : NULL;
        const IRArg *epsa = rule->kind == R_LAYER_NORM ? slot[4] : slot[3];
        /* rms_norm's default eps is the epsilon of the opmath type (aten/src/ATen/native/layer_norm.cpp) */
        double eps = rule->kind == R_LAYER_NORM ? 1e-5 : (R == LDT_F64 ? 2.220446049250313e-16 : 1.1920928955078125e-07);
        if (!em_lower_is_none(epsa) && get_double(epsa, &eps) < 0) return 0;
        Opnd wo, bo;
        if (em_lower_opnd(c, weight, &wo) < 0 || em_lower_opnd(c, bias, &bo) < 0 || wo.kind >= 2 || bo.kind >= 2)
            return 0;
        LDtype F = opmath(R);
        uint32_t x = em_lower_cast(c, a.node, F), y;
        if (rule->kind == R_LAYER_NORM) {
            /* aten/src/ATen/native/cpu/layer_norm_kernel.cpp: mean, biased variance, rstd */
            uint32_t mean = mk_mean(c, x, mask, F);
            uint32_t dev = em_lower_op(c, LP_SUB, F, F, x, mean, 0);
            uint32_t var = em_lower_op(c, LP_DIV, F, F, mk_reduce(c, LP_RSUM, F, em_lower_op(c, LP_MUL, F, F, dev, dev, 0), mask),
                                       mk_count(c, &src, mask, F), 0);
            uint32_t rstd = em_lower_op(c, LP_RSQRT, F, F, em_lower_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0);
            y = em_lower_op(c, LP_MUL, F, F, dev, rstd, 0);
        } else {
            uint32_t ms = mk_mean(c, em_lower_op(c, LP_MUL, F, F, x, x, 0), mask, F);
            uint32_t rr = em_lower_op(c, LP_RSQRT, F, F, em_lower_op(c, LP_ADD, F, F, ms, cnum(c, eps, F), 0), 0, 0);
            y = em_lower_op(c, LP_MUL, F, F, x, rr, 0);
        }
        if (rule->kind == R_RMS_NORM) {
            /* torch's composite rms_norm casts back to the input dtype, then multiplies by weight */
            y = em_lower_cast(c, y, R);
            if (wo.kind == 1) y = em_lower_op(c, LP_MUL, R, R, y, wo.node, 0);
            return y;
        }
        if (wo.kind == 1) y = em_lower_op(c, LP_MUL, F, F, y, em_lower_cast(c, wo.node, F), 0);
        if (bo.kind == 1) y = em_lower_op(c, LP_ADD, F, F, y, em_lower_cast(c, bo.node, F), 0);
        return em_lower_cast(c, y, R);
    }
    case R_MAX_POOL:
        if (a.kind != 1) return 0;
        return lower_max_pool(c, rule->prim, a.node, slot);
    case R_ADAPTIVE_AVG_POOL: {
        /* ATen's adaptive_avg_pool2d to (1, 1) is input.mean((-1, -2), keepdim=True) (AdaptiveAveragePooling.cpp) */
        int sp = rule->prim;
        int64_t os[EM_LMAXDIM];
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        if (src.ndim != sp + 1 && src.ndim != sp + 2) return 0;
        int k = em_lower_get_ints(slot[1], os, EM_LMAXDIM);
        if (k != 1 && k != sp) return 0;
        for (int i = 0; i < k; i++)
            if (os[i] != 1) return 0;
        uint32_t mask = 0;
        for (int i = 0; i < sp; i++) mask |= 1u << (src.ndim - 1 - i);
        LDtype F = opmath(R);
        return em_lower_cast(c, mk_mean(c, em_lower_cast(c, a.node, F), mask, F), R);
    }
    case R_GROUP_NORM: {
        /* x (N, C, *) seen as (N, G, C/G, *): mean and biased variance per (n, g), then the
         * per-channel affine (aten/src/ATen/native/group_norm.cpp, math_group_norm) */
        int64_t G;
        double eps = 1e-5;
        if (a.kind != 1 || !em_ldt_is_float(R) || em_lower_get_int(slot[1], &G) < 0) return 0;
        if (slot[4] && !em_lower_is_none(slot[4]) && get_double(slot[4], &eps) < 0) return 0;
        Opnd wo, bo;
        if (em_lower_opnd(c, slot[2], &wo) < 0 || em_lower_opnd(c, slot[3], &bo) < 0 || wo.kind > 1 || bo.kind > 1) return 0;
        LNode src = *NODE(c, a.node);
        if (src.ndim < 2 || src.ndim + 1 > EM_LMAXDIM || G <= 0 || src.sizes[1] % G != 0) return 0;
        uint32_t l = em_lower_as_load(c, a.node);
        if (!l) return 0;
        src = *NODE(c, l);
        int32_t nd = src.ndim + 1;
        int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM], cg = src.sizes[1] / G;
        sizes[0] = src.sizes[0];
        st[0] = src.strides[0];
        sizes[1] = G;
        st[1] = src.strides[1] * cg;
        sizes[2] = cg;
        st[2] = src.strides[1];
        for (int d = 2; d < src.ndim; d++) {
            sizes[d + 1] = src.sizes[d];
            st[d + 1] = src.strides[d];
        }
        uint32_t xs = em_lower_reload_s(c, l, nd, sizes, st, 0, NULL, NULL, SYM_NONE);
        uint32_t mask = 0;
        int64_t cnt = 1;
        for (int d = 2; d < nd; d++) {
            mask |= 1u << d;
            cnt *= sizes[d];
        }
        LDtype F = opmath(R);
        uint32_t x = em_lower_cast(c, xs, F);
        uint32_t mean = mk_mean(c, x, mask, F);
        uint32_t dev = em_lower_op(c, LP_SUB, F, F, x, mean, 0);
        uint32_t var = em_lower_op(c, LP_DIV, F, F, mk_reduce(c, LP_RSUM, F, em_lower_op(c, LP_MUL, F, F, dev, dev, 0), mask),
                                   cnum(c, (double)(cnt ? cnt : 1), F), 0);
        uint32_t y = em_lower_op(c, LP_MUL, F, F, dev, em_lower_op(c, LP_RSQRT, F, F, em_lower_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0), 0);
        /* weight/bias (C,) seen as (G, C/G, 1, ...) */
        const Opnd *ab[2] = {&wo, &bo};
        for (int i = 0; i < 2; i++) {
            if (ab[i]->kind != 1) continue;
            uint32_t wl = em_lower_as_load(c, ab[i]->node);
            if (!wl) return 0;
            LNode w = *NODE(c, wl);
            if (w.ndim != 1 || w.sizes[0] != src.sizes[1]) return 0;
            int64_t ws[EM_LMAXDIM], wst[EM_LMAXDIM];
            ws[0] = G;
            wst[0] = w.strides[0] * cg;
            ws[1] = cg;
            wst[1] = w.strides[0];
            for (int d = 2; d < nd - 1; d++) {
                ws[d] = 1;
                wst[d] = 0;
            }
            uint32_t wv = em_lower_cast(c, em_lower_reload_s(c, wl, nd - 1, ws, wst, 0, NULL, NULL, SYM_NONE), F);
            y = em_lower_op(c, i == 0 ? LP_MUL : LP_ADD, F, F, y, wv, 0);
        }
        y = em_lower_cast(c, y, R);
        /* back to (N, C, *): the value materialized contiguous, seen with the input's shape */
        uint32_t yl = em_lower_as_load(c, y);
        if (!yl) return 0;
        int64_t cst[EM_LMAXDIM];
        em_lower_contiguous_strides(src.ndim, src.sizes, cst);
        return em_lower_reload_s(c, yl, src.ndim, src.sizes, cst, 0, NULL, NULL, SYM_NONE);
    }
    case R_BATCH_NORM: {
        if (a.kind != 1 || !em_ldt_is_float(R) || !em_lower_is_false(slot[5])) return 0;
        Opnd rm, rv, wo, bo;
        if (em_lower_opnd(c, slot[1], &rm) < 0 || em_lower_opnd(c, slot[2], &rv) < 0 || em_lower_opnd(c, slot[3], &wo) < 0 ||
            em_lower_opnd(c, slot[4], &bo) < 0 || rm.kind != 1 || rv.kind != 1 || wo.kind > 1 || bo.kind > 1)
            return 0;
        double eps = 1e-5;
        if (slot[7] && get_double(slot[7], &eps) < 0) return 0;
        int32_t nd = NODE(c, a.node)->ndim;
        LDtype F = opmath(R);
        /* (x - mean) * rsqrt(var + eps) * w + b, the channel at dim 1 (aten/src/ATen/native/Normalization.cpp) */
        uint32_t x = em_lower_cast(c, a.node, F);
        uint32_t mean = em_lower_cast(c, channel_view(c, rm.node, nd), F), var = em_lower_cast(c, channel_view(c, rv.node, nd), F);
        uint32_t inv = em_lower_op(c, LP_RSQRT, F, F, em_lower_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0);
        uint32_t y = em_lower_op(c, LP_MUL, F, F, em_lower_op(c, LP_SUB, F, F, x, mean, 0), inv, 0);
        if (wo.kind == 1) y = em_lower_op(c, LP_MUL, F, F, y, em_lower_cast(c, channel_view(c, wo.node, nd), F), 0);
        if (bo.kind == 1) y = em_lower_op(c, LP_ADD, F, F, y, em_lower_cast(c, channel_view(c, bo.node, nd), F), 0);
        return em_lower_cast(c, y, R);
    }
    default:
        return 0;
    }
}
