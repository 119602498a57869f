/* codegen (shared by the C and CUDA C generators): the text buffer and the expression of a
 * pointwise node in either dialect. Invariant: an op without a form here sets `unsupported`, so
 * neither generator ever writes a placeholder that computes something else. */
#include "codegen/em_codegen_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

void em_sb_printf(EmSB *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static const char *fsuf(LDtype t) { return t == LDT_F64 ? "" : "f"; }

/* Math functions by C99 name (sinf for float, sin for double: both dialects have them); half types
 * arrive in float (their compute type). */
void em_codegen_expr(EmSB *b, const EmCgDialect *d, const SKernel *k, uint32_t i) {
    const LNode *n = &k->nodes[i];
    LDtype ct = n->cdtype;
    int fl = em_ldt_is_float(ct), isbool = ct == LDT_BOOL;
    const char *f = fsuf(ct);
    char A[24], B[24], C[24];
    snprintf(A, sizeof A, "v%u", n->in[0]);
    snprintf(B, sizeof B, "v%u", n->in[1]);
    snprintf(C, sizeof C, "v%u", n->in[2]);
#define FN(name) (fl ? em_sb_printf(b, "%s%s(%s)", name, f, A) : em_sb_printf(b, "%s", A))
    switch (n->op) {
    case LP_CAST:
        if (n->dtype == LDT_BOOL) em_sb_printf(b, "(%s != 0)", A);
        else if (d->helper_int_casts && !em_ldt_is_float(n->dtype) && em_ldt_is_float(k->nodes[n->in[0]].dtype)) {
            const char *fs = fsuf(k->nodes[n->in[0]].dtype); /* (a comparison's cdtype is its operands') */
            if (n->dtype == LDT_I64) em_sb_printf(b, "em_f2i64%s(%s)", fs, A);
            else em_sb_printf(b, "(%s)em_f2i32%s(%s)", d->ctype(n->dtype), fs, A);
        } else em_sb_printf(b, "(%s)%s", d->ctype(n->dtype), A);
        return;
    case LP_NEG: em_sb_printf(b, isbool ? "%s" : "-%s", A); return;
    case LP_ABS:
        if (fl) em_sb_printf(b, "fabs%s(%s)", f, A);
        else if (isbool || ct == LDT_U8) em_sb_printf(b, "%s", A);
        else em_sb_printf(b, "(%s < 0 ? -%s : %s)", A, A, A);
        return;
    case LP_RECIP: em_sb_printf(b, "(1 / %s)", A); return;
    case LP_SQRT: em_sb_printf(b, "sqrt%s(%s)", f, A); return;
    case LP_RSQRT:
        if (d->rsqrt_call && fl) em_sb_printf(b, "rsqrt%s(%s)", f, A);
        else em_sb_printf(b, "(1 / sqrt%s(%s))", f, A);
        return;
    case LP_EXP: em_sb_printf(b, "exp%s(%s)", f, A); return;
    case LP_EXP2: em_sb_printf(b, "exp2%s(%s)", f, A); return;
    case LP_EXPM1: em_sb_printf(b, "expm1%s(%s)", f, A); return;
    case LP_LOG: em_sb_printf(b, "log%s(%s)", f, A); return;
    case LP_LOG2: em_sb_printf(b, "log2%s(%s)", f, A); return;
    case LP_LOG10: em_sb_printf(b, "log10%s(%s)", f, A); return;
    case LP_LOG1P: em_sb_printf(b, "log1p%s(%s)", f, A); return;
    case LP_SIN: em_sb_printf(b, "sin%s(%s)", f, A); return;
    case LP_COS: em_sb_printf(b, "cos%s(%s)", f, A); return;
    case LP_TAN: em_sb_printf(b, "tan%s(%s)", f, A); return;
    case LP_TANH: em_sb_printf(b, "tanh%s(%s)", f, A); return;
    case LP_ASIN: em_sb_printf(b, "asin%s(%s)", f, A); return;
    case LP_ACOS: em_sb_printf(b, "acos%s(%s)", f, A); return;
    case LP_ATAN: em_sb_printf(b, "atan%s(%s)", f, A); return;
    case LP_SINH: em_sb_printf(b, "sinh%s(%s)", f, A); return;
    case LP_COSH: em_sb_printf(b, "cosh%s(%s)", f, A); return;
    case LP_ERF: em_sb_printf(b, "erf%s(%s)", f, A); return;
    case LP_SIGMOID: em_sb_printf(b, "(1 / (1 + exp%s(-%s)))", f, A); return;
    case LP_RELU: em_sb_printf(b, "(%s < 0 ? 0 : %s)", A, A); return;
    case LP_FLOOR: FN("floor"); return;
    case LP_CEIL: FN("ceil"); return;
    case LP_ROUND: FN("nearbyint"); return;
    case LP_TRUNC: FN("trunc"); return;
    case LP_SIGN:
        if (isbool) em_sb_printf(b, "%s", A);
        else em_sb_printf(b, "((%s > 0) - (%s < 0))", A, A);
        return;
    case LP_NOT: em_sb_printf(b, "!%s", A); return;
    case LP_ISNAN:
        if (fl) em_sb_printf(b, "(%s != %s)", A, A);
        else em_sb_printf(b, "(%s && %s == %s)", d->false_lit, A, A);
        return;
    case LP_ISINF:
        if (fl) em_sb_printf(b, d->isinf_fmt, A);
        else em_sb_printf(b, "(%s && %s)", d->false_lit, A);
        return;
    case LP_ADD: em_sb_printf(b, "(%s + %s)", A, B); return;
    case LP_SUB: em_sb_printf(b, "(%s - %s)", A, B); return;
    case LP_MUL: em_sb_printf(b, "(%s * %s)", A, B); return;
    case LP_DIV: em_sb_printf(b, "(%s / %s)", A, B); return;
    case LP_DIV_TRUNC:
        /* torch rounds a half quotient to half before truncating (BinaryOpsKernel.cpp div_trunc) */
        if (n->dtype == LDT_F16) em_sb_printf(b, "truncf(em_f16_round(%s / %s))", A, B);
        else if (n->dtype == LDT_BF16) em_sb_printf(b, "truncf(em_bf16_round(%s / %s))", A, B);
        else em_sb_printf(b, "trunc%s(%s / %s)", f, A, B);
        return;
    case LP_DIV_FLOOR: em_sb_printf(b, "em_div_floor%s(%s, %s)", d->suffixed_div_floor ? f : "", A, B); return;
    case LP_POW: em_sb_printf(b, "pow%s(%s, %s)", f, A, B); return;
    case LP_MAX:
        if (fl) em_sb_printf(b, "(%s != %s ? %s : (%s != %s ? %s : (%s > %s ? %s : %s)))", A, A, A, B, B, B, A, B, A, B);
        else em_sb_printf(b, "(%s > %s ? %s : %s)", A, B, A, B);
        return;
    case LP_MIN:
        if (fl) em_sb_printf(b, "(%s != %s ? %s : (%s != %s ? %s : (%s < %s ? %s : %s)))", A, A, A, B, B, B, A, B, A, B);
        else em_sb_printf(b, "(%s < %s ? %s : %s)", A, B, A, B);
        return;
    case LP_EQ: em_sb_printf(b, "(%s == %s)", A, B); return;
    case LP_NE: em_sb_printf(b, "(%s != %s)", A, B); return;
    case LP_LT: em_sb_printf(b, "(%s < %s)", A, B); return;
    case LP_LE: em_sb_printf(b, "(%s <= %s)", A, B); return;
    case LP_GT: em_sb_printf(b, "(%s > %s)", A, B); return;
    case LP_GE: em_sb_printf(b, "(%s >= %s)", A, B); return;
    case LP_AND: em_sb_printf(b, "(%s && %s)", A, B); return;
    case LP_OR: em_sb_printf(b, "(%s || %s)", A, B); return;
    case LP_XOR: em_sb_printf(b, "(%s != %s)", A, B); return;
    case LP_BAND: em_sb_printf(b, "(%s & %s)", A, B); return;
    case LP_BOR: em_sb_printf(b, "(%s | %s)", A, B); return;
    case LP_BXOR: em_sb_printf(b, "(%s ^ %s)", A, B); return;
    case LP_BNOT: em_sb_printf(b, "(~%s)", A); return;
    case LP_WHERE: em_sb_printf(b, "(%s ? %s : %s)", A, B, C); return;
    case LP_RAND: em_sb_printf(b, "em_philox_uniform((unsigned long long)%s, (unsigned long long)%s)", A, B); return;
    default:
        b->unsupported = "a pointwise operation the code generator does not emit";
        em_sb_printf(b, "0 /* ? */");
        return;
    }
#undef FN
}


void em_codegen_rounded_expr(EmSB *b, const EmCgDialect *d, const SKernel *k, uint32_t i) {
    LDtype dt = k->nodes[i].dtype;
    if (dt == LDT_F16) em_sb_printf(b, "em_f16_round(");
    else if (dt == LDT_BF16) em_sb_printf(b, "em_bf16_round(");
    em_codegen_expr(b, d, k, i);
    if (em_ldt_is_half(dt)) em_sb_printf(b, ")");
}

/* Writes a size expression as C over sv[j] (Python // and % semantics: em_floordiv, em_mod, em_min,
 * em_max, which both generators' preludes define). */
void em_codegen_sym(EmSB *b, ShapeEnv *env, SymRef e, uint8_t *used, int *bad) {
    int64_t kk, c;
    uint32_t n;
    if (e == SYM_NONE) {
        *bad = 1;
        em_sb_printf(b, "0");
        return;
    }
    SymOp op = em_sym_node(env, e, &kk, &n);
    switch (op) {
    case SYM_CONST: em_sb_printf(b, kk < 0 ? "(%lldLL)" : "%lldLL", (long long)kk); return;
    case SYM_SYMBOL:
        em_sb_printf(b, "sv[%lld]", (long long)kk);
        if (used) used[kk] = 1;
        return;
    case SYM_ADD:
        em_sb_printf(b, "(%lldLL", (long long)kk);
        for (uint32_t i = 0; i < n; i++) {
            SymRef t = em_sym_operand(env, e, i, &c);
            em_sb_printf(b, " + %lldLL * ", (long long)c);
            em_codegen_sym(b, env, t, used, bad);
        }
        em_sb_printf(b, ")");
        return;
    case SYM_MUL:
        em_sb_printf(b, "(");
        for (uint32_t i = 0; i < n; i++) {
            SymRef t = em_sym_operand(env, e, i, &c);
            if (c < 1 || c > 8) *bad = 1;
            for (int64_t r = 0; r < c; r++) {
                em_sb_printf(b, i || r ? " * " : "");
                em_codegen_sym(b, env, t, used, bad);
            }
        }
        em_sb_printf(b, ")");
        return;
    case SYM_FLOORDIV:
    case SYM_MOD:
        em_sb_printf(b, op == SYM_FLOORDIV ? "em_floordiv(" : "em_mod(");
        em_codegen_sym(b, env, em_sym_operand(env, e, 0, NULL), used, bad);
        em_sb_printf(b, ", ");
        em_codegen_sym(b, env, em_sym_operand(env, e, 1, NULL), used, bad);
        em_sb_printf(b, ")");
        return;
    case SYM_MIN:
    case SYM_MAX:
        for (uint32_t i = 0; i + 1 < n; i++) em_sb_printf(b, op == SYM_MIN ? "em_min(" : "em_max(");
        for (uint32_t i = 0; i < n; i++) {
            em_codegen_sym(b, env, em_sym_operand(env, e, i, NULL), used, bad);
            if (i) em_sb_printf(b, ")");
            if (i + 1 < n) em_sb_printf(b, ", ");
        }
        return;
    case SYM_EQ: case SYM_NE: case SYM_LT: case SYM_LE: case SYM_GT: case SYM_GE: { /* a SymBool: 0 or 1 */
        static const char *const cop[] = {[SYM_EQ] = " == ", [SYM_NE] = " != ", [SYM_LT] = " < ", [SYM_LE] = " <= ",
                                          [SYM_GT] = " > ", [SYM_GE] = " >= "};
        em_sb_printf(b, "((long long)("); /* no stdint.h in the CUDA source */
        em_codegen_sym(b, env, em_sym_operand(env, e, 0, NULL), used, bad);
        em_sb_printf(b, "%s", cop[op]);
        em_codegen_sym(b, env, em_sym_operand(env, e, 1, NULL), used, bad);
        em_sb_printf(b, "))");
        return;
    }
    default:
        *bad = 1;
        em_sb_printf(b, "0");
        return;
    }
}

void em_codegen_num(EmSB *b, const EmCgNums *ns, EmCgNum *out, int64_t hint, SymRef e, const char *name) {
    int64_t v = hint;
    if (!ns->env || (e != SYM_NONE && em_sym_is_const(ns->env, e, &v))) {
        snprintf(out->v, sizeof out->v, "%lld", (long long)v);
        out->zero = v == 0;
        out->one = v == 1;
        return;
    }
    if (e == SYM_NONE) *ns->bad = 1;
    snprintf(out->v, sizeof out->v, "%s", name);
    out->zero = out->one = 0;
    em_sb_printf(b, "    const %s %s = ", ns->type, name);
    if (ns->cast) em_sb_printf(b, "(%s)", ns->type);
    em_codegen_sym(b, ns->env, e, ns->used, ns->bad);
    em_sb_printf(b, ";\n");
}

void em_codegen_access_nums(EmSB *b, const EmCgNums *ns, const SKernel *k, EmCgNum *off, EmCgNum (*st)[EM_LMAXDIM]) {
    uint32_t nacc = k->nloads + k->nstores;
    for (uint32_t q = 0; q < nacc; q++) {
        const SAccess *ac = q < k->nloads ? &k->loads[q] : &k->stores[q - k->nloads];
        char nm[24];
        snprintf(nm, sizeof nm, "o%u", q);
        em_codegen_num(b, ns, &off[q], ac->offset, ac->soffset, nm);
        for (int j = 0; j < k->ndim; j++) {
            snprintf(nm, sizeof nm, "s%u_%d", q, j);
            em_codegen_num(b, ns, &st[q][j], ac->strides[j], ac->sstrides[j], nm);
        }
    }
}

int em_codegen_nums_alloc(EmSB *b, const SKernel *k, EmCgNum **off, EmCgNum (**st)[EM_LMAXDIM]) {
    uint32_t nacc = k->nloads + k->nstores;
    *off = calloc(nacc + 1, sizeof **off);
    *st = calloc(nacc + 1, sizeof **st);
    if (*off && *st) return 0;
    free(*off);
    free(*st);
    *off = NULL;
    *st = NULL;
    b->oom = 1;
    return -1;
}
