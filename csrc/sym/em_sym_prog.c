/* ember guard programs: the produced symbolic guards of an entry compiled to one postfix program
 * over an int64 value per symbol, run on every call by the guard stage.
 * Invariant: a program is one self-contained malloc'd block (no pointer into the env) and
 * running it allocates nothing; every int64 overflow fails the check it happens in (a miss,
 * then a retrace that fails OVERFLOW: never a wrong answer). */
#include "sym/em_sym_impl.h"

#include <stdlib.h>
#include <string.h>

#define SYM_PROG_STACK 64

typedef enum {
    PI_CONST,   /* push k */
    PI_LOAD,    /* push values[a] */
    PI_MULK,    /* top *= k */
    PI_ADDK,    /* top += k */
    PI_ADD,
    PI_MUL,
    PI_FLOORDIV,
    PI_MOD,
    PI_MIN,
    PI_MAX,
    PI_EQ,
    PI_NE,
    PI_LT,
    PI_LE,
    PI_GT,
    PI_GE,
    PI_CHECK,   /* pop; if 0, the check fails */
    /* whole checks of the most common forms (ranges, duck shaping, specialisation) */
    PI_CHECK_GE_K, /* values[a] >= k */
    PI_CHECK_LE_K, /* values[a] <= k */
    PI_CHECK_EQ_K, /* values[a] == k */
    PI_CHECK_EQ_V, /* values[a] == values[k] */
    PI_STORE,      /* pop into out[a] (expression programs, em_sym_exprs_compile) */
} ProgOp;

typedef struct SymInsn {
    uint32_t op;
    uint32_t a;
    int64_t k;
} SymInsn;

struct SymProg {
    uint32_t ninputs, nchecks, ninsns;
    uint64_t *tags;     /* ninputs entries, inside this block after the code */
    SymInsn code[];
};

typedef struct Emitter {
    ShapeEnv *env;
    SymInsn *code;
    uint32_t n, cap;
    uint32_t depth, maxdepth;
} Emitter;

static int put(Emitter *em, ProgOp op, uint32_t a, int64_t k, int push) {
    if (em_sym__grow(em->env, (void **)&em->code, &em->cap, sizeof(SymInsn), em->n + 1) < 0) return -1;
    em->code[em->n++] = (SymInsn){(uint32_t)op, a, k};
    em->depth = (uint32_t)((int)em->depth + push);
    if (em->depth > em->maxdepth) em->maxdepth = em->depth;
    if (em->maxdepth > SYM_PROG_STACK) return em_sym__fail(em->env, SYM_ERR_TOO_BIG);
    return 0;
}

static int emit_expr(Emitter *em, SymRef e) {
    const SymNode x = *em_sym__node(em->env, e);
    /* operands copied first: emitting never interns, but keep the rule of the other files */
    const SymTerm *t = em_sym__terms(em->env, e);
    switch ((SymOp)x.op) {
    case SYM_CONST: return put(em, PI_CONST, 0, x.k, 1);
    case SYM_SYMBOL: return put(em, PI_LOAD, (uint32_t)x.k, 0, 1);
    case SYM_ADD:
        for (uint32_t i = 0; i < x.n; i++) {
            if (emit_expr(em, t[i].ref) < 0) return -1;
            if (t[i].c != 1 && put(em, PI_MULK, 0, t[i].c, 0) < 0) return -1;
            if (i && put(em, PI_ADD, 0, 0, -1) < 0) return -1;
        }
        return x.k ? put(em, PI_ADDK, 0, x.k, 0) : 0;
    case SYM_MUL:
        for (uint32_t i = 0; i < x.n; i++)
            for (int64_t j = 0; j < t[i].c; j++) {
                if (emit_expr(em, t[i].ref) < 0) return -1;
                if ((i || j) && put(em, PI_MUL, 0, 0, -1) < 0) return -1;
            }
        return 0;
    case SYM_MIN:
    case SYM_MAX:
        for (uint32_t i = 0; i < x.n; i++) {
            if (emit_expr(em, t[i].ref) < 0) return -1;
            if (i && put(em, x.op == SYM_MIN ? PI_MIN : PI_MAX, 0, 0, -1) < 0) return -1;
        }
        return 0;
    default: {
        static const ProgOp binop[] = {[SYM_FLOORDIV] = PI_FLOORDIV, [SYM_MOD] = PI_MOD, [SYM_EQ] = PI_EQ,
                                       [SYM_NE] = PI_NE, [SYM_LT] = PI_LT, [SYM_LE] = PI_LE,
                                       [SYM_GT] = PI_GT, [SYM_GE] = PI_GE};
        if (emit_expr(em, t[0].ref) < 0 || emit_expr(em, t[1].ref) < 0) return -1;
        return put(em, binop[x.op], 0, 0, -1);
    }
    }
}

/* The program of em's instructions (nchecks: guards or stored expressions), with the symbols' tags;
 * frees em's buffer. NULL (env failed) when out of memory. */
static SymProg *prog_finish(Emitter *em, uint32_t nchecks) {
    ShapeEnv *env = em->env;
    SymProg *p = malloc(sizeof(SymProg) + (size_t)em->n * sizeof(SymInsn) + (size_t)env->nsyms * sizeof(uint64_t));
    if (!p) {
        free(em->code);
        em_sym__fail(env, SYM_ERR_NOMEM);
        return NULL;
    }
    p->ninputs = env->nsyms;
    p->nchecks = nchecks;
    p->ninsns = em->n;
    if (em->n) memcpy(p->code, em->code, (size_t)em->n * sizeof(SymInsn));
    p->tags = (uint64_t *)(void *)&p->code[em->n]; /* SymInsn is 16 bytes: 8-byte aligned */
    for (uint32_t i = 0; i < env->nsyms; i++) p->tags[i] = em_sym_symbol_tag(env, i);
    free(em->code);
    return p;
}

SymProg *em_sym_prog_compile(ShapeEnv *env) {
    const SymGuard *g;
    uint32_t ng = em_sym_produce_guards(env, &g);
    if (env->error) return NULL;
    Emitter em = {env, NULL, 0, 0, 0, 0};
    for (uint32_t i = 0; i < ng; i++) {
        const SymNode *x = em_sym__node(env, g[i].rel);
        const SymTerm *t = em_sym__terms(env, g[i].rel);
        const SymNode *a = em_sym__node(env, t[0].ref), *b = em_sym__node(env, t[1].ref);
        int r = 1;
        if (x->op == SYM_LE && a->op == SYM_CONST && b->op == SYM_SYMBOL) r = put(&em, PI_CHECK_GE_K, (uint32_t)b->k, a->k, 0);
        else if (x->op == SYM_LE && a->op == SYM_SYMBOL && b->op == SYM_CONST) r = put(&em, PI_CHECK_LE_K, (uint32_t)a->k, b->k, 0);
        else if (x->op == SYM_EQ && a->op == SYM_SYMBOL && b->op == SYM_CONST) r = put(&em, PI_CHECK_EQ_K, (uint32_t)a->k, b->k, 0);
        else if (x->op == SYM_EQ && a->op == SYM_SYMBOL && b->op == SYM_SYMBOL) r = put(&em, PI_CHECK_EQ_V, (uint32_t)a->k, b->k, 0);
        if (r == 0) continue;
        if (r < 0 || emit_expr(&em, g[i].rel) < 0 || put(&em, PI_CHECK, 0, 0, -1) < 0) {
            free(em.code);
            return NULL;
        }
    }
    return prog_finish(&em, ng);
}

void em_sym_prog_free(SymProg *p) { free(p); }
uint32_t em_sym_prog_ninputs(const SymProg *p) { return p->ninputs; }
uint32_t em_sym_prog_nchecks(const SymProg *p) { return p->nchecks; }
uint64_t em_sym_prog_input_tag(const SymProg *p, uint32_t i) { return i < p->ninputs ? p->tags[i] : 0; }

/* Runs p: guard checks (out NULL) or stores into out. Returns -1 when every check holds (and for
 * an expression program that ran to the end), else the index of the failing check; an overflow
 * fails the check it happens in (expression programs: returns 0). */
static int prog_run(const SymProg *p, const int64_t *values, int64_t *out) {
    int64_t st[SYM_PROG_STACK];
    int sp = 0;
    int check = 0;
    for (uint32_t i = 0; i < p->ninsns; i++) {
        const SymInsn *in = &p->code[i];
        int64_t b;
        switch ((ProgOp)in->op) {
        case PI_CONST: st[sp++] = in->k; break;
        case PI_LOAD: st[sp++] = values[in->a]; break;
        case PI_MULK:
            if (__builtin_mul_overflow(st[sp - 1], in->k, &st[sp - 1])) return check;
            break;
        case PI_ADDK:
            if (__builtin_add_overflow(st[sp - 1], in->k, &st[sp - 1])) return check;
            break;
        case PI_ADD:
            b = st[--sp];
            if (__builtin_add_overflow(st[sp - 1], b, &st[sp - 1])) return check;
            break;
        case PI_MUL:
            b = st[--sp];
            if (__builtin_mul_overflow(st[sp - 1], b, &st[sp - 1])) return check;
            break;
        case PI_FLOORDIV:
        case PI_MOD: {
            b = st[--sp];
            int64_t a = st[sp - 1];
            if (b == 0 || (a == INT64_MIN && b == -1)) {
                if (b == -1 && in->op == PI_MOD) { /* INT64_MIN % -1 == 0 */
                    st[sp - 1] = 0;
                    break;
                }
                return check;
            }
            st[sp - 1] = in->op == PI_FLOORDIV ? em_sym__floordiv64(a, b) : em_sym__mod64(a, b);
            break;
        }
        case PI_MIN: b = st[--sp]; if (b < st[sp - 1]) st[sp - 1] = b; break;
        case PI_MAX: b = st[--sp]; if (b > st[sp - 1]) st[sp - 1] = b; break;
        case PI_EQ: b = st[--sp]; st[sp - 1] = st[sp - 1] == b; break;
        case PI_NE: b = st[--sp]; st[sp - 1] = st[sp - 1] != b; break;
        case PI_LT: b = st[--sp]; st[sp - 1] = st[sp - 1] < b; break;
        case PI_LE: b = st[--sp]; st[sp - 1] = st[sp - 1] <= b; break;
        case PI_GT: b = st[--sp]; st[sp - 1] = st[sp - 1] > b; break;
        case PI_GE: b = st[--sp]; st[sp - 1] = st[sp - 1] >= b; break;
        case PI_CHECK:
            if (!st[--sp]) return check;
            check++;
            break;
        case PI_CHECK_GE_K:
            if (values[in->a] < in->k) return check;
            check++;
            break;
        case PI_CHECK_LE_K:
            if (values[in->a] > in->k) return check;
            check++;
            break;
        case PI_CHECK_EQ_K:
            if (values[in->a] != in->k) return check;
            check++;
            break;
        case PI_CHECK_EQ_V:
            if (values[in->a] != values[in->k]) return check;
            check++;
            break;
        case PI_STORE: out[in->a] = st[--sp]; break;
        }
    }
    return -1;
}

int em_sym_prog_check(const SymProg *p, const int64_t *values) { return prog_run(p, values, NULL); }

/* Expression programs: the same instructions, each expression followed by a store of its value. */
SymProg *em_sym_exprs_compile(ShapeEnv *env, const SymRef *exprs, uint32_t n) {
    if (env->error) return NULL;
    Emitter em = {env, NULL, 0, 0, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        if (exprs[i] == SYM_NONE) {
            em_sym__fail(env, SYM_ERR_BAD_ARG);
            free(em.code);
            return NULL;
        }
        if (emit_expr(&em, exprs[i]) < 0 || put(&em, PI_STORE, i, 0, -1) < 0) {
            free(em.code);
            return NULL;
        }
    }
    return prog_finish(&em, n);
}

int em_sym_exprs_eval(const SymProg *p, const int64_t *values, int64_t *out) {
    return prog_run(p, values, out) == -1 ? 0 : -1;
}
