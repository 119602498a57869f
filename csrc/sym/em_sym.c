/* ember symbolic integer algebra: the hash-consed node table, canonical forms, simplification
 * under the env's facts, ranges (interval arithmetic) and evaluation.
 * Invariant: every node reachable from a constructor's result is canonical, so structural
 * equality of expressions is equality of SymRefs.
 *
 * Canonical forms (the rules Dynamo's ShapeEnv gets from sympy, restricted to what sizes need):
 *   - a polynomial is ADD(k; c0*m0 + c1*m1 + ...): integer constant k, nonzero integer
 *     coefficients ci, distinct monomials mi sorted by (degree descending, structural order);
 *     products are expanded, so s0*(s1+1) is s0*s1 + s0 and s0+s0 is 2*s0. A lone monomial with
 *     coefficient 1 and no constant is the monomial itself; a polynomial with no terms is CONST.
 *   - a monomial is an atom or MUL(atom0**e0 * ...), atoms sorted, exponents >= 1.
 *   - atoms are SYMBOL, FLOORDIV, MOD, MIN, MAX and comparisons, each over canonical operands.
 *   - a // k and a % k (k > 0 constant) pull out every multiple of k from a's coefficients:
 *     (q*k + r) // k == q + r // k and (q*k + r) % k == r % k hold for all integers q, r; common
 *     factors cancel ((6*s0) // 4 == (3*s0) // 2, (4*s0) % 8 == 4*(s0 % 2)); a // -k == (-a) // k;
 *     (a // j) // k == a // (j*k) for j, k > 0; a remainder whose range is within one multiple of
 *     k folds to a constant (r // k == 0 and r % k == r for 0 <= r < k).
 *   - symbolic divisors: (b*X + r) // b == X + r // b and (b*X + r) % b == r % b for a monomial b
 *     known positive.
 *   - Min/Max are flattened, sorted, deduplicated, and drop operands a range comparison decides.
 *   - k * (e // k) == e when e % k == 0 is known (a guard learnt it).
 * Python semantics: a // b is floor(a / b) and a % b takes the sign of b (Objects/longobject.c,
 * l_divmod), for constants and for the values programs compute. */
#include "sym/em_sym_impl.h"

#include <stdlib.h>
#include <string.h>

#define SYM_MAX_TERMS 64   /* a polynomial with more terms fails TOO_BIG (sizes never need it) */
#define SYM_MAX_NODES (1u << 24)
#define SYM_MAX_DEPTH 64   /* deeper expressions fail TOO_BIG: every pass recurses on the C stack */

/* ---- checked int64 arithmetic (GCC/Clang builtins; C11 has none) ---- */

static bool ck_add(int64_t a, int64_t b, int64_t *r) { return !__builtin_add_overflow(a, b, r); }
static bool ck_mul(int64_t a, int64_t b, int64_t *r) { return !__builtin_mul_overflow(a, b, r); }

int64_t em_sym__floordiv64(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
    return q;
}

int64_t em_sym__mod64(int64_t a, int64_t b) {
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) r += b;
    return r;
}

/* Python a // b and a % b with failure codes (the one overflow is INT64_MIN // -1). */
static SymErr py_floordiv(int64_t a, int64_t b, int64_t *out) {
    if (b == 0) return SYM_ERR_ZERO_DIV;
    if (a == INT64_MIN && b == -1) return SYM_ERR_OVERFLOW;
    *out = em_sym__floordiv64(a, b);
    return SYM_ERR_OK;
}

static SymErr py_mod(int64_t a, int64_t b, int64_t *out) {
    if (b == 0) return SYM_ERR_ZERO_DIV;
    if (b == -1) {
        *out = 0;
        return SYM_ERR_OK;
    }
    *out = em_sym__mod64(a, b);
    return SYM_ERR_OK;
}

static int64_t gcd64(int64_t a, int64_t b) {
    uint64_t x = a < 0 ? (uint64_t)0 - (uint64_t)a : (uint64_t)a;
    uint64_t y = b < 0 ? (uint64_t)0 - (uint64_t)b : (uint64_t)b;
    while (y) {
        uint64_t t = x % y;
        x = y;
        y = t;
    }
    return x > (uint64_t)INT64_MAX ? 0 : (int64_t)x; /* 0: gcd is 2**63, treated as "no common factor" */
}

/* ---- saturating interval ends: SYM_NEG_INF / SYM_INF absorb ---- */

static int64_t sat_add(int64_t a, int64_t b) {
    if (a == SYM_NEG_INF || b == SYM_NEG_INF) return SYM_NEG_INF;
    if (a == SYM_INF || b == SYM_INF) return SYM_INF;
    int64_t r;
    if (!ck_add(a, b, &r)) return a > 0 ? SYM_INF : SYM_NEG_INF;
    return r;
}

static int64_t sat_mul(int64_t a, int64_t b) {
    if (a == 0 || b == 0) return 0;
    bool neg = (a < 0) != (b < 0);
    int64_t r;
    if (a == SYM_NEG_INF || a == SYM_INF || b == SYM_NEG_INF || b == SYM_INF || !ck_mul(a, b, &r))
        return neg ? SYM_NEG_INF : SYM_INF;
    return r;
}

static int64_t sat_floordiv(int64_t a, int64_t b) { /* b > 0 finite */
    if (a == SYM_NEG_INF || a == SYM_INF) return a;
    return em_sym__floordiv64(a, b);
}

/* ---- the env's tables ---- */

static const char *const sym_error_texts[] = {
#define SYM_ERR_TEXT(name, text) text,
    SYM_ERRORS(SYM_ERR_TEXT)
#undef SYM_ERR_TEXT
};

static const char *const sym_op_names[] = {
#define SYM_OP_TEXT(name, text) text,
    SYM_OPS(SYM_OP_TEXT)
#undef SYM_OP_TEXT
};

const char *em_sym_op_name(SymOp op) { return (unsigned)op < SYM__NOPS ? sym_op_names[op] : "?"; }

const char *em_sym_error_text(SymErr e) {
    return (unsigned)e < SYM_ERR__COUNT ? sym_error_texts[e] : "unknown error";
}

int em_sym__fail(ShapeEnv *env, SymErr e) {
    if (env->error == SYM_ERR_OK) env->error = e;
    return -1;
}

SymErr em_sym_env_error(const ShapeEnv *env) { return env->error; }

int em_sym__grow(ShapeEnv *env, void **items, uint32_t *cap, size_t elem, uint32_t need) {
    if (need <= *cap) return 0;
    uint32_t ncap = *cap ? *cap : 16;
    while (ncap < need) {
        if (ncap > UINT32_MAX / 2) return em_sym__fail(env, SYM_ERR_NOMEM);
        ncap *= 2;
    }
    void *p = realloc(*items, (size_t)ncap * elem);
    if (!p) return em_sym__fail(env, SYM_ERR_NOMEM);
    memset((char *)p + (size_t)*cap * elem, 0, (size_t)(ncap - *cap) * elem);
    *items = p;
    *cap = ncap;
    return 0;
}

const SymNode *em_sym__node(const ShapeEnv *env, SymRef r) { return &env->nodes[r]; }
const SymTerm *em_sym__terms(const ShapeEnv *env, SymRef r) { return &env->terms[env->nodes[r].first]; }

SymOp em_sym_op(const ShapeEnv *env, SymRef e) { return (SymOp)env->nodes[e].op; }

SymOp em_sym_node(const ShapeEnv *env, SymRef e, int64_t *k, uint32_t *n) {
    const SymNode *nd = &env->nodes[e];
    if (k) *k = nd->k;
    if (n) *n = nd->n;
    return (SymOp)nd->op;
}

SymRef em_sym_operand(const ShapeEnv *env, SymRef e, uint32_t i, int64_t *c) {
    const SymNode *nd = &env->nodes[e];
    const SymTerm *t = &env->terms[nd->first + i];
    if (c) *c = (nd->op == SYM_ADD || nd->op == SYM_MUL) ? t->c : 1;
    return t->ref;
}

bool em_sym_is_const(const ShapeEnv *env, SymRef e, int64_t *value) {
    if (e == SYM_NONE || env->nodes[e].op != SYM_CONST) return false;
    if (value) *value = env->nodes[e].k;
    return true;
}

bool em_sym_has_symbols(const ShapeEnv *env, SymRef e) {
    const SymNode *n = &env->nodes[e];
    if (n->op == SYM_SYMBOL) return true;
    const SymTerm *t = &env->terms[n->first];
    for (uint32_t i = 0; i < n->n; i++)
        if (em_sym_has_symbols(env, t[i].ref)) return true;
    return false;
}

int64_t em_sym_symbol_index(const ShapeEnv *env, SymRef e) {
    return e && env->nodes[e].op == SYM_SYMBOL ? env->nodes[e].k : -1;
}

static void mark_symbols(const ShapeEnv *env, SymRef e, uint8_t *seen) {
    const SymNode *n = &env->nodes[e];
    if (n->op == SYM_SYMBOL) {
        seen[n->k] = 1;
        return;
    }
    for (uint32_t i = 0; i < n->n; i++) mark_symbols(env, env->terms[n->first + i].ref, seen);
}

uint32_t em_sym_free_symbols(const ShapeEnv *env, SymRef e, uint32_t *out, uint32_t max) {
    if (!e || !env->nsyms) return 0;
    uint8_t small[256], *seen = env->nsyms <= sizeof small ? small : calloc(env->nsyms, 1);
    if (!seen) return 0;
    memset(seen, 0, env->nsyms <= sizeof small ? env->nsyms : 0);
    mark_symbols(env, e, seen);
    uint32_t n = 0;
    for (uint32_t i = 0; i < env->nsyms; i++)
        if (seen[i]) {
            if (n < max) out[n] = i;
            n++;
        }
    if (seen != small) free(seen);
    return n;
}

/* FNV-1a over (op, k, operands). */
static uint32_t node_hash(SymOp op, int64_t k, const SymTerm *t, uint32_t n) {
    uint64_t h = 1469598103934665603ull;
#define MIX(v) (h = (h ^ (uint64_t)(v)) * 1099511628211ull)
    MIX(op);
    MIX(k);
    MIX(n);
    for (uint32_t i = 0; i < n; i++) {
        MIX(t[i].c);
        MIX(t[i].ref);
    }
#undef MIX
    return (uint32_t)(h ^ (h >> 32));
}

static bool node_equal(const ShapeEnv *env, const SymNode *a, SymOp op, int64_t k, const SymTerm *t, uint32_t n) {
    if (a->op != op || a->k != k || a->n != n) return false;
    const SymTerm *at = &env->terms[a->first];
    for (uint32_t i = 0; i < n; i++)
        if (at[i].c != t[i].c || at[i].ref != t[i].ref) return false;
    return true;
}

static int index_rehash(ShapeEnv *env, uint32_t ncap) {
    uint32_t *idx = calloc(ncap, sizeof *idx);
    if (!idx) return em_sym__fail(env, SYM_ERR_NOMEM);
    for (uint32_t r = 1; r < env->nnodes; r++) {
        uint32_t j = env->nodes[r].hash & (ncap - 1);
        while (idx[j]) j = (j + 1) & (ncap - 1);
        idx[j] = r;
    }
    free(env->index);
    env->index = idx;
    env->capindex = ncap;
    return 0;
}

/* The unique node (op, k, operands): found, or appended. Operands must be canonical. */
SymRef em_sym__intern(ShapeEnv *env, SymOp op, int64_t k, const SymTerm *t, uint32_t n) {
    if (env->error) return SYM_NONE;
    uint32_t h = node_hash(op, k, t, n);
    if ((env->nnodes + 1) * 2 > env->capindex && index_rehash(env, env->capindex * 2) < 0) return SYM_NONE;
    uint32_t j = h & (env->capindex - 1);
    for (; env->index[j]; j = (j + 1) & (env->capindex - 1)) {
        const SymNode *cand = &env->nodes[env->index[j]];
        if (cand->hash == h && node_equal(env, cand, op, k, t, n)) return env->index[j];
    }
    if (env->nnodes >= SYM_MAX_NODES) return em_sym__fail(env, SYM_ERR_TOO_BIG), SYM_NONE;
    uint32_t depth = 0;
    for (uint32_t i = 0; i < n; i++)
        if (env->nodes[t[i].ref].depth > depth) depth = env->nodes[t[i].ref].depth;
    if (++depth > SYM_MAX_DEPTH) return em_sym__fail(env, SYM_ERR_TOO_BIG), SYM_NONE;
    if (em_sym__grow(env, (void **)&env->nodes, &env->capnodes, sizeof(SymNode), env->nnodes + 1) < 0 ||
        em_sym__grow(env, (void **)&env->terms, &env->capterms, sizeof(SymTerm), env->nterms + n) < 0)
        return SYM_NONE;
    SymRef r = env->nnodes++;
    SymNode *node = &env->nodes[r];
    memset(node, 0, sizeof *node);
    node->op = (uint8_t)op;
    node->k = k;
    node->n = n;
    node->first = env->nterms;
    node->hash = h;
    node->depth = (uint8_t)depth;
    if (n) memcpy(&env->terms[env->nterms], t, n * sizeof *t);
    env->nterms += n;
    env->index[j] = r;
    return r;
}

SymRef em_sym_const(ShapeEnv *env, int64_t k) { return em_sym__intern(env, SYM_CONST, k, NULL, 0); }

/* ---- structural order: deterministic (independent of creation order) and total ---- */

static int op_rank(SymOp op) { return (int)op; } /* CONST < SYMBOL < ADD < MUL < ... */

static int sym_order(const ShapeEnv *env, SymRef a, SymRef b) {
    if (a == b) return 0;
    const SymNode *x = &env->nodes[a], *y = &env->nodes[b];
    if (x->op != y->op) return op_rank((SymOp)x->op) < op_rank((SymOp)y->op) ? -1 : 1;
    if (x->k != y->k) return x->k < y->k ? -1 : 1;
    const SymTerm *xt = &env->terms[x->first], *yt = &env->terms[y->first];
    uint32_t n = x->n < y->n ? x->n : y->n;
    for (uint32_t i = 0; i < n; i++) {
        int c = sym_order(env, xt[i].ref, yt[i].ref);
        if (c) return c;
        if (xt[i].c != yt[i].c) return xt[i].c < yt[i].c ? -1 : 1;
    }
    return x->n < y->n ? -1 : (x->n > y->n ? 1 : 0);
}

static int64_t degree(const ShapeEnv *env, SymRef m) {
    const SymNode *x = &env->nodes[m];
    if (x->op != SYM_MUL) return 1;
    int64_t d = 0;
    for (uint32_t i = 0; i < x->n; i++) d += env->terms[x->first + i].c;
    return d;
}

/* Order of monomials inside a polynomial: higher degree first, then structural. */
static int mono_order(const ShapeEnv *env, SymRef a, SymRef b) {
    if (a == b) return 0;
    int64_t da = degree(env, a), db = degree(env, b);
    if (da != db) return da > db ? -1 : 1;
    return sym_order(env, a, b);
}

/* ---- polynomials in scratch form ---- */

typedef struct Poly {
    int64_t k;
    uint32_t n;
    SymTerm t[SYM_MAX_TERMS];
} Poly;

static SymRef mono_mul(ShapeEnv *env, SymRef a, SymRef b);
static SymRef mk_mul(ShapeEnv *env, SymRef a, SymRef b);
static SymRef mk_floordiv(ShapeEnv *env, SymRef a, SymRef b);

/* p = e as a polynomial. */
static void poly_of(const ShapeEnv *env, SymRef e, Poly *p) {
    const SymNode *x = &env->nodes[e];
    p->k = 0;
    p->n = 0;
    if (x->op == SYM_CONST) {
        p->k = x->k;
    } else if (x->op == SYM_ADD) {
        p->k = x->k;
        p->n = x->n;
        memcpy(p->t, &env->terms[x->first], x->n * sizeof(SymTerm));
    } else {
        p->n = 1;
        p->t[0].c = 1;
        p->t[0].ref = e;
    }
}

/* p += c * q (q's terms appended; duplicates merged by poly_finish). */
static int poly_axpy(ShapeEnv *env, Poly *p, int64_t c, const Poly *q) {
    int64_t v;
    if (!ck_mul(c, q->k, &v) || !ck_add(p->k, v, &p->k)) return em_sym__fail(env, SYM_ERR_OVERFLOW);
    for (uint32_t i = 0; i < q->n; i++) {
        if (p->n >= SYM_MAX_TERMS) return em_sym__fail(env, SYM_ERR_TOO_BIG);
        if (!ck_mul(c, q->t[i].c, &v)) return em_sym__fail(env, SYM_ERR_OVERFLOW);
        p->t[p->n].c = v;
        p->t[p->n].ref = q->t[i].ref;
        p->n++;
    }
    return 0;
}

bool em_sym__known_divisible(const ShapeEnv *env, SymRef e, int64_t k) {
    for (uint32_t i = 0; i < env->ndivs; i++)
        if (env->divs[i].e == e && env->divs[i].k % k == 0) return true;
    return false;
}

/* Sorts, merges equal monomials, drops zeros, applies k*(e//k) == e for known-divisible e, and
 * interns. */
static SymRef poly_finish(ShapeEnv *env, Poly *p) {
    if (env->error) return SYM_NONE;
    /* k*(e//k) -> e where e % k == 0 is known; e's own terms are appended and merged below */
    for (uint32_t i = 0; i < p->n; i++) {
        const SymNode *x = &env->nodes[p->t[i].ref];
        if (x->op != SYM_FLOORDIV) continue;
        const SymTerm *ops = &env->terms[x->first];
        int64_t d;
        if (!em_sym_is_const(env, ops[1].ref, &d) || d <= 0 || p->t[i].c % d != 0) continue;
        if (!em_sym__known_divisible(env, ops[0].ref, d)) continue;
        Poly q;
        int64_t c = p->t[i].c / d;
        poly_of(env, ops[0].ref, &q);
        p->t[i] = p->t[--p->n];
        if (poly_axpy(env, p, c, &q) < 0) return SYM_NONE;
        i = (uint32_t)-1; /* restart: the appended terms may hold more of the same */
    }
    /* insertion sort: polynomials are small */
    for (uint32_t i = 1; i < p->n; i++) {
        SymTerm t = p->t[i];
        uint32_t j = i;
        while (j > 0 && mono_order(env, p->t[j - 1].ref, t.ref) > 0) {
            p->t[j] = p->t[j - 1];
            j--;
        }
        p->t[j] = t;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->n; i++) {
        if (n && p->t[n - 1].ref == p->t[i].ref) {
            if (!ck_add(p->t[n - 1].c, p->t[i].c, &p->t[n - 1].c)) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
        } else {
            p->t[n++] = p->t[i];
        }
        if (p->t[n - 1].c == 0) n--;
    }
    /* a zero produced by a merge in the middle leaves a gap-free list already; re-check pairs */
    p->n = n;
    if (n == 0) return em_sym_const(env, p->k);
    if (n == 1 && p->k == 0 && p->t[0].c == 1) return p->t[0].ref;
    return em_sym__intern(env, SYM_ADD, p->k, p->t, n);
}

/* Linear combination ca*a + cb*b. */
static SymRef mk_lin(ShapeEnv *env, int64_t ca, SymRef a, int64_t cb, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    Poly p, q;
    p.k = 0;
    p.n = 0;
    poly_of(env, a, &q);
    if (poly_axpy(env, &p, ca, &q) < 0) return SYM_NONE;
    poly_of(env, b, &q);
    if (poly_axpy(env, &p, cb, &q) < 0) return SYM_NONE;
    return poly_finish(env, &p);
}

/* Factors of a monomial as (atom, exp) terms. */
static uint32_t mono_factors(const ShapeEnv *env, SymRef m, SymTerm *out) {
    const SymNode *x = &env->nodes[m];
    if (x->op == SYM_MUL) {
        memcpy(out, &env->terms[x->first], x->n * sizeof(SymTerm));
        return x->n;
    }
    out[0].c = 1;
    out[0].ref = m;
    return 1;
}

static SymRef mono_from_factors(ShapeEnv *env, SymTerm *f, uint32_t n) {
    if (n == 0) return em_sym_const(env, 1);
    if (n == 1 && f[0].c == 1) return f[0].ref;
    return em_sym__intern(env, SYM_MUL, 0, f, n);
}

/* Product of two monomials (sorted merge of factor lists, exponents added). */
static SymRef mono_mul(ShapeEnv *env, SymRef a, SymRef b) {
    SymTerm fa[SYM_MAX_TERMS], fb[SYM_MAX_TERMS], f[2 * SYM_MAX_TERMS];
    uint32_t na = mono_factors(env, a, fa), nb = mono_factors(env, b, fb), i = 0, j = 0, n = 0;
    while (i < na || j < nb) {
        int c = i == na ? 1 : (j == nb ? -1 : sym_order(env, fa[i].ref, fb[j].ref));
        if (c < 0) {
            f[n++] = fa[i++];
        } else if (c > 0) {
            f[n++] = fb[j++];
        } else {
            f[n] = fa[i++];
            if (!ck_add(f[n].c, fb[j++].c, &f[n].c)) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
            n++;
        }
    }
    if (n > SYM_MAX_TERMS) return em_sym__fail(env, SYM_ERR_TOO_BIG), SYM_NONE;
    return mono_from_factors(env, f, n);
}

/* m / d for monomials when d divides m (every factor of d in m with at least its exponent):
 * the quotient monomial (CONST 1 when equal), or SYM_NONE when d does not divide m. */
static SymRef mono_div(ShapeEnv *env, SymRef m, SymRef d) {
    SymTerm fm[SYM_MAX_TERMS], fd[SYM_MAX_TERMS];
    uint32_t nm = mono_factors(env, m, fm), nd = mono_factors(env, d, fd), j = 0, n = 0;
    for (uint32_t i = 0; i < nm; i++) {
        if (j < nd && fm[i].ref == fd[j].ref) {
            if (fm[i].c < fd[j].c) return SYM_NONE;
            fm[i].c -= fd[j].c;
            j++;
        }
        if (fm[i].c) fm[n++] = fm[i];
    }
    if (j < nd) return SYM_NONE;
    return mono_from_factors(env, fm, n);
}

static SymRef mk_mul(ShapeEnv *env, SymRef a, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    Poly pa, pb, p;
    poly_of(env, a, &pa);
    poly_of(env, b, &pb);
    if ((uint64_t)(pa.n + 1) * (pb.n + 1) > SYM_MAX_TERMS) return em_sym__fail(env, SYM_ERR_TOO_BIG), SYM_NONE;
    p.n = 0;
    if (!ck_mul(pa.k, pb.k, &p.k)) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
    /* (ka + A)(kb + B) = ka*kb + ka*B + kb*A + A*B */
    Poly tmp;
    tmp.k = 0;
    tmp.n = pb.n;
    memcpy(tmp.t, pb.t, pb.n * sizeof(SymTerm));
    if (poly_axpy(env, &p, pa.k, &tmp) < 0) return SYM_NONE;
    tmp.n = pa.n;
    memcpy(tmp.t, pa.t, pa.n * sizeof(SymTerm));
    if (poly_axpy(env, &p, pb.k, &tmp) < 0) return SYM_NONE;
    for (uint32_t i = 0; i < pa.n; i++)
        for (uint32_t j = 0; j < pb.n; j++) {
            int64_t c;
            if (!ck_mul(pa.t[i].c, pb.t[j].c, &c)) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
            SymRef m = mono_mul(env, pa.t[i].ref, pb.t[j].ref);
            if (!m) return SYM_NONE;
            p.t[p.n].c = c;
            p.t[p.n].ref = m;
            p.n++;
        }
    return poly_finish(env, &p);
}

/* ---- ranges ---- */

static void op_range(ShapeEnv *env, SymRef e, int64_t *lo, int64_t *hi);

void em_sym_range(ShapeEnv *env, SymRef e, int64_t *lo, int64_t *hi) {
    if (!e || env->error) {
        *lo = SYM_NEG_INF;
        *hi = SYM_INF;
        return;
    }
    SymNode *x = &env->nodes[e];
    if (x->range_epoch == env->epoch + 1) { /* +1: the zeroed memo of a new node never matches */
        *lo = x->lo;
        *hi = x->hi;
        return;
    }
    int64_t l, h;
    op_range(env, e, &l, &h);
    x = &env->nodes[e]; /* the table may have moved */
    x->lo = l;
    x->hi = h;
    x->range_epoch = env->epoch + 1;
    *lo = l;
    *hi = h;
}

static void mul_range(int64_t al, int64_t ah, int64_t bl, int64_t bh, int64_t *lo, int64_t *hi) {
    int64_t c[4] = {sat_mul(al, bl), sat_mul(al, bh), sat_mul(ah, bl), sat_mul(ah, bh)};
    *lo = *hi = c[0];
    for (int i = 1; i < 4; i++) {
        if (c[i] < *lo) *lo = c[i];
        if (c[i] > *hi) *hi = c[i];
    }
}

/* The comparison `diff op 0` decided by diff's range: 1, 0, or -1 (unknown). */
static int decide(SymOp op, int64_t lo, int64_t hi) {
    switch (op) {
    case SYM_EQ: return (lo == 0 && hi == 0) ? 1 : ((lo > 0 || hi < 0) ? 0 : -1);
    case SYM_NE: return (lo == 0 && hi == 0) ? 0 : ((lo > 0 || hi < 0) ? 1 : -1);
    case SYM_LT: return hi < 0 ? 1 : (lo >= 0 ? 0 : -1);
    case SYM_LE: return hi <= 0 ? 1 : (lo > 0 ? 0 : -1);
    case SYM_GT: return lo > 0 ? 1 : (hi <= 0 ? 0 : -1);
    case SYM_GE: return lo >= 0 ? 1 : (hi < 0 ? 0 : -1);
    default: return -1;
    }
}

/* Does a known `p != v` exclude diff == 0 (diff = sg*p + k)? */
static bool excluded_zero(ShapeEnv *env, SymRef diff) {
    SymRef p;
    int64_t sg, k;
    if (em_sym__normalise(env, diff, &p, &sg, &k) < 0 || !p) return false;
    const SymFact *f = em_sym__fact(env, p);
    if (!f || (-k) % sg != 0) return false;
    for (uint32_t i = 0; i < f->nne; i++)
        if (f->ne[i] == -k / sg) return true;
    return false;
}

/* `a op b` decided from what is known, without guards: 1, 0 or -1. */
static int decide_cmp(ShapeEnv *env, SymOp op, SymRef a, SymRef b) {
    SymRef diff = mk_lin(env, 1, a, -1, b);
    if (!diff) return -1;
    int64_t lo, hi;
    em_sym_range(env, diff, &lo, &hi);
    int r = decide(op, lo, hi);
    if (r < 0 && (op == SYM_EQ || op == SYM_NE) && excluded_zero(env, diff)) r = op == SYM_NE;
    return r;
}

/* Tightens the range of a sum holding terms c*(a//k) (k > 0 constant) through
 * k*(a//k) = a - r, 0 <= r < k: with L the lcm of the k's, L*e is a polynomial P in which each
 * a//k became (L/k)*a, plus an error interval; P's range (where a - a cancels) divided by L bounds
 * e. This is what decides s0//2 < s0 (so Min(s0//2, s0) is s0//2 and slices need no guard). */
static void floordiv_relaxed_range(ShapeEnv *env, SymRef e, int64_t *lo, int64_t *hi) {
    Poly p, q, out;
    poly_of(env, e, &p);
    int64_t L = 1;
    bool any = false;
    for (uint32_t i = 0; i < p.n; i++) {
        const SymNode *x = &env->nodes[p.t[i].ref];
        int64_t k;
        if (x->op != SYM_FLOORDIV || !em_sym_is_const(env, env->terms[x->first + 1].ref, &k) || k <= 0) continue;
        int64_t g = gcd64(L, k), nl;
        if (g == 0 || !ck_mul(L / g, k, &nl)) return;
        L = nl;
        any = true;
    }
    if (!any) return;
    int64_t el = 0, eh = 0;
    out.n = 0;
    if (!ck_mul(p.k, L, &out.k)) return;
    for (uint32_t i = 0; i < p.n; i++) {
        const SymNode *x = &env->nodes[p.t[i].ref];
        int64_t k, c;
        if (x->op == SYM_FLOORDIV && em_sym_is_const(env, env->terms[x->first + 1].ref, &k) && k > 0) {
            if (!ck_mul(p.t[i].c, L / k, &c)) return;
            poly_of(env, env->terms[x->first].ref, &q);
            int64_t err = sat_mul(c, -(k - 1)); /* c * (L/k) * -r, r in [0, k-1] */
            if (err < 0) el = sat_add(el, err);
            else eh = sat_add(eh, err);
            if (poly_axpy(env, &out, c, &q) < 0) return;
        } else {
            if (out.n >= SYM_MAX_TERMS || !ck_mul(p.t[i].c, L, &c)) return;
            out.t[out.n++] = (SymTerm){c, p.t[i].ref};
        }
    }
    SymRef r = poly_finish(env, &out);
    if (!r) return;
    int64_t rl, rh;
    em_sym_range(env, r, &rl, &rh);
    rl = sat_add(rl, el);
    rh = sat_add(rh, eh);
    if (rl != SYM_NEG_INF && rl != SYM_INF) {
        int64_t v = -em_sym__floordiv64(-rl, L); /* ceil */
        if (v > *lo) *lo = v;
    }
    if (rh != SYM_INF && rh != SYM_NEG_INF) {
        int64_t v = em_sym__floordiv64(rh, L);
        if (v < *hi) *hi = v;
    }
}

static void op_range(ShapeEnv *env, SymRef e, int64_t *lo, int64_t *hi) {
    const SymNode x = env->nodes[e];
    const SymTerm *t = &env->terms[x.first];
    SymRef r0 = x.n > 0 ? t[0].ref : SYM_NONE, r1 = x.n > 1 ? t[1].ref : SYM_NONE;
    int64_t al, ah, bl, bh;
    *lo = SYM_NEG_INF;
    *hi = SYM_INF;
    switch ((SymOp)x.op) {
    case SYM_CONST:
        *lo = *hi = x.k;
        return;
    case SYM_SYMBOL:
        break; /* the fact on the symbol, below */
    case SYM_ADD: {
        int64_t l = x.k, h = x.k;
        for (uint32_t i = 0; i < x.n; i++) {
            em_sym_range(env, t[i].ref, &al, &ah);
            t = &env->terms[x.first];
            mul_range(al, ah, t[i].c, t[i].c, &bl, &bh);
            l = sat_add(l, bl);
            h = sat_add(h, bh);
        }
        *lo = l;
        *hi = h;
        floordiv_relaxed_range(env, e, lo, hi);
        /* and what is known of its normalised form */
        SymRef p;
        int64_t sg, k;
        if (em_sym__normalise(env, e, &p, &sg, &k) == 0 && p) {
            const SymFact *f = em_sym__fact(env, p);
            if (f) {
                int64_t fl = sat_add(sat_mul(f->lo, sg), k), fh = sat_add(sat_mul(f->hi, sg), k);
                if (sg < 0) {
                    int64_t tmp = fl;
                    fl = fh;
                    fh = tmp;
                }
                if (fl > *lo) *lo = fl;
                if (fh < *hi) *hi = fh;
            }
        }
        return;
    }
    case SYM_MUL: {
        int64_t l = 1, h = 1;
        for (uint32_t i = 0; i < x.n; i++) {
            em_sym_range(env, t[i].ref, &al, &ah);
            t = &env->terms[x.first];
            int64_t pl = 1, ph = 1;
            for (int64_t j = 0; j < t[i].c && j < 64; j++) mul_range(pl, ph, al, ah, &pl, &ph);
            if (t[i].c % 2 == 0 && pl < 0) pl = 0; /* an even power is never negative */
            mul_range(l, h, pl, ph, &l, &h);
        }
        *lo = l;
        *hi = h;
        break;
    }
    case SYM_FLOORDIV: {
        em_sym_range(env, r0, &al, &ah);
        em_sym_range(env, r1, &bl, &bh);
        if (bl >= 1 && bh != SYM_INF) {
            /* floor(a/b) is monotone in a, and in b for a fixed sign of a: extremes at corners */
            int64_t c[4] = {sat_floordiv(al, bl), sat_floordiv(al, bh), sat_floordiv(ah, bl), sat_floordiv(ah, bh)};
            *lo = *hi = c[0];
            for (int i = 1; i < 4; i++) {
                if (c[i] < *lo) *lo = c[i];
                if (c[i] > *hi) *hi = c[i];
            }
        } else if (bl >= 1) { /* b unbounded above: a/b tends to 0 (or -1 from below) */
            *lo = al >= 0 ? 0 : sat_floordiv(al, bl);
            *hi = ah >= 0 ? sat_floordiv(ah, bl) : -1;
        }
        break;
    }
    case SYM_MOD:
        em_sym_range(env, r0, &al, &ah);
        em_sym_range(env, r1, &bl, &bh);
        if (bl >= 1) {
            *lo = 0;
            *hi = bh == SYM_INF ? SYM_INF : bh - 1;
            if (al >= 0 && ah < *hi) *hi = ah; /* a % b <= a for a >= 0 */
        } else if (bh <= -1) {
            *lo = bl == SYM_NEG_INF ? SYM_NEG_INF : bl + 1;
            *hi = 0;
        }
        break;
    case SYM_MIN:
    case SYM_MAX:
        for (uint32_t i = 0; i < x.n; i++) {
            em_sym_range(env, t[i].ref, &al, &ah);
            t = &env->terms[x.first];
            if (i == 0) {
                *lo = al;
                *hi = ah;
            } else if (x.op == SYM_MIN) {
                if (al < *lo) *lo = al;
                if (ah < *hi) *hi = ah;
            } else {
                if (al > *lo) *lo = al;
                if (ah > *hi) *hi = ah;
            }
        }
        break;
    default: { /* comparisons */
        int r = decide_cmp(env, (SymOp)x.op, r0, r1);
        *lo = r == 1 ? 1 : 0;
        *hi = r == 0 ? 0 : 1;
        return;
    }
    }
    /* an atom is its own normalised form: intersect with what guards taught */
    const SymFact *f = em_sym__fact(env, e);
    if (f) {
        if (f->lo > *lo) *lo = f->lo;
        if (f->hi < *hi) *hi = f->hi;
    }
}

/* ---- normal form of the non-constant part, and facts ---- */

int em_sym__normalise(ShapeEnv *env, SymRef e, SymRef *p, int64_t *sg, int64_t *k) {
    Poly q;
    poly_of(env, e, &q);
    *k = q.k;
    *sg = 1;
    *p = SYM_NONE;
    if (q.n == 0) return 0;
    int64_t g = 0;
    for (uint32_t i = 0; i < q.n; i++) g = gcd64(g, q.t[i].c);
    if (g == 0) return em_sym__fail(env, SYM_ERR_OVERFLOW);
    *sg = q.t[0].c < 0 ? -g : g;
    for (uint32_t i = 0; i < q.n; i++) q.t[i].c /= *sg;
    q.k = 0;
    *p = poly_finish(env, &q);
    return *p ? 0 : -1;
}

static uint32_t ref_hash(SymRef r) { return (uint32_t)(r * 2654435761u); }

SymFact *em_sym__fact(const ShapeEnv *env, SymRef p) {
    if (!env->capfact_index) return NULL;
    for (uint32_t j = ref_hash(p) & (env->capfact_index - 1); env->fact_index[j];
         j = (j + 1) & (env->capfact_index - 1))
        if (env->facts[env->fact_index[j] - 1].p == p) return &env->facts[env->fact_index[j] - 1];
    return NULL;
}

SymFact *em_sym__fact_add(ShapeEnv *env, SymRef p) {
    SymFact *f = em_sym__fact(env, p);
    if (f) return f;
    if (em_sym__grow(env, (void **)&env->facts, &env->capfacts, sizeof(SymFact), env->nfacts + 1) < 0) return NULL;
    if ((env->nfacts + 1) * 2 > env->capfact_index) {
        uint32_t ncap = env->capfact_index ? env->capfact_index * 2 : 64;
        uint32_t *idx = calloc(ncap, sizeof *idx);
        if (!idx) return em_sym__fail(env, SYM_ERR_NOMEM), NULL;
        for (uint32_t i = 0; i < env->nfacts; i++) {
            uint32_t j = ref_hash(env->facts[i].p) & (ncap - 1);
            while (idx[j]) j = (j + 1) & (ncap - 1);
            idx[j] = i + 1;
        }
        free(env->fact_index);
        env->fact_index = idx;
        env->capfact_index = ncap;
    }
    f = &env->facts[env->nfacts++];
    memset(f, 0, sizeof *f);
    f->p = p;
    f->lo = SYM_NEG_INF;
    f->hi = SYM_INF;
    uint32_t j = ref_hash(p) & (env->capfact_index - 1);
    while (env->fact_index[j]) j = (j + 1) & (env->capfact_index - 1);
    env->fact_index[j] = env->nfacts;
    return f;
}

/* ---- floor division, modulo, min/max, comparisons ---- */

static bool known_positive(ShapeEnv *env, SymRef e) {
    int64_t lo, hi;
    em_sym_range(env, e, &lo, &hi);
    return lo >= 1;
}

/* Is m a monomial (an atom or a MUL, coefficient 1, no constant)? */
static bool is_monomial(const ShapeEnv *env, SymRef m) {
    SymOp op = (SymOp)env->nodes[m].op;
    return op != SYM_CONST && op != SYM_ADD;
}

/* Splits a = d*Q + R for a positive monomial d: terms of a divisible by d go to Q (divided). */
static int split_by_mono(ShapeEnv *env, SymRef a, SymRef d, Poly *qp, Poly *rp) {
    Poly p;
    poly_of(env, a, &p);
    qp->k = qp->n = 0;
    rp->k = p.k;
    rp->n = 0;
    for (uint32_t i = 0; i < p.n; i++) {
        SymRef m = mono_div(env, p.t[i].ref, d);
        if (env->error) return -1;
        int64_t c;
        if (m && em_sym_is_const(env, m, &c)) { /* the term was c*d */
            if (!ck_mul(c, p.t[i].c, &c) || !ck_add(qp->k, c, &qp->k)) return em_sym__fail(env, SYM_ERR_OVERFLOW);
        } else if (m) {
            qp->t[qp->n].c = p.t[i].c;
            qp->t[qp->n].ref = m;
            qp->n++;
        } else {
            rp->t[rp->n++] = p.t[i];
        }
    }
    return 0;
}

static SymRef mk_floordiv(ShapeEnv *env, SymRef a, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    int64_t kb, ka;
    if (em_sym_is_const(env, b, &kb)) {
        if (kb == 0) return em_sym__fail(env, SYM_ERR_ZERO_DIV), SYM_NONE;
        if (em_sym_is_const(env, a, &ka)) {
            int64_t r;
            SymErr err = py_floordiv(ka, kb, &r);
            return err ? (em_sym__fail(env, err), SYM_NONE) : em_sym_const(env, r);
        }
        if (kb == 1) return a;
        if (kb < 0) {
            if (kb == INT64_MIN) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
            return mk_floordiv(env, mk_lin(env, -1, a, 0, a), em_sym_const(env, -kb));
        }
        const SymNode *x = &env->nodes[a];
        int64_t kc;
        if (x->op == SYM_FLOORDIV && em_sym_is_const(env, env->terms[x->first + 1].ref, &kc) && kc > 0) {
            int64_t kk; /* (e // kc) // kb == e // (kc*kb) for positive divisors */
            SymRef inner = env->terms[x->first].ref;
            if (ck_mul(kc, kb, &kk)) return mk_floordiv(env, inner, em_sym_const(env, kk));
        }
        Poly p, q, r;
        poly_of(env, a, &p);
        int64_t g = gcd64(kb, p.k);
        for (uint32_t i = 0; i < p.n; i++) g = gcd64(g, p.t[i].c);
        if (g > 1) { /* (g*a') // (g*k') == a' // k' */
            p.k /= g;
            for (uint32_t i = 0; i < p.n; i++) p.t[i].c /= g;
            kb /= g;
            if (kb == 1) return poly_finish(env, &p);
        }
        /* a = kb*Q + R with R's coefficients in [0, kb) */
        q.k = em_sym__floordiv64(p.k, kb);
        r.k = em_sym__mod64(p.k, kb);
        q.n = r.n = 0;
        for (uint32_t i = 0; i < p.n; i++) {
            int64_t qc = em_sym__floordiv64(p.t[i].c, kb), rc = em_sym__mod64(p.t[i].c, kb);
            if (qc) q.t[q.n++] = (SymTerm){qc, p.t[i].ref};
            if (rc) r.t[r.n++] = (SymTerm){rc, p.t[i].ref};
        }
        SymRef rem = poly_finish(env, &r);
        if (!rem) return SYM_NONE;
        SymRef quo = poly_finish(env, &q);
        if (!quo) return SYM_NONE;
        int64_t lo, hi;
        em_sym_range(env, rem, &lo, &hi);
        SymRef rq;
        if (lo != SYM_NEG_INF && hi != SYM_INF && em_sym__floordiv64(lo, kb) == em_sym__floordiv64(hi, kb)) {
            rq = em_sym_const(env, em_sym__floordiv64(lo, kb));
        } else {
            SymTerm t[2] = {{0, rem}, {0, em_sym_const(env, kb)}};
            rq = em_sym__intern(env, SYM_FLOORDIV, 0, t, 2);
        }
        return mk_lin(env, 1, quo, 1, rq);
    }
    if (em_sym_is_const(env, a, &ka) && ka == 0) return a;
    /* symbolic divisor */
    const SymNode *y = &env->nodes[b];
    if (y->op == SYM_ADD && y->k == 0 && y->n == 1) {
        SymTerm t = env->terms[y->first]; /* b == c*m, c > 0, m > 0: a // b == (a // m) // c */
        if (t.c > 0 && known_positive(env, t.ref))
            return mk_floordiv(env, mk_floordiv(env, a, t.ref), em_sym_const(env, t.c));
    }
    if (is_monomial(env, b) && known_positive(env, b)) {
        Poly q, r;
        if (split_by_mono(env, a, b, &q, &r) < 0) return SYM_NONE;
        if (q.n || q.k) {
            SymRef quo = poly_finish(env, &q), rem = poly_finish(env, &r);
            return mk_lin(env, 1, quo, 1, mk_floordiv(env, rem, b));
        }
    }
    if (known_positive(env, b)) {
        int64_t lo, hi;
        em_sym_range(env, a, &lo, &hi);
        if (lo >= 0 && decide_cmp(env, SYM_LT, a, b) == 1) return em_sym_const(env, 0); /* 0 <= a < b */
    }
    SymTerm t[2] = {{0, a}, {0, b}};
    return em_sym__intern(env, SYM_FLOORDIV, 0, t, 2);
}

static SymRef mk_mod(ShapeEnv *env, SymRef a, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    int64_t kb, ka;
    if (em_sym_is_const(env, b, &kb)) {
        if (kb == 0) return em_sym__fail(env, SYM_ERR_ZERO_DIV), SYM_NONE;
        if (em_sym_is_const(env, a, &ka)) {
            int64_t r;
            SymErr err = py_mod(ka, kb, &r);
            return err ? (em_sym__fail(env, err), SYM_NONE) : em_sym_const(env, r);
        }
        if (kb == 1 || kb == -1) return em_sym_const(env, 0);
        if (kb < 0) { /* a % -k == -((-a) % k) */
            if (kb == INT64_MIN) return em_sym__fail(env, SYM_ERR_OVERFLOW), SYM_NONE;
            SymRef m = mk_mod(env, mk_lin(env, -1, a, 0, a), em_sym_const(env, -kb));
            return mk_lin(env, -1, m, 0, m);
        }
        const SymNode *x = &env->nodes[a];
        int64_t kc;
        if (x->op == SYM_MOD && em_sym_is_const(env, env->terms[x->first + 1].ref, &kc) && kc > 0 && kc % kb == 0)
            return mk_mod(env, env->terms[x->first].ref, b); /* (e % (j*k)) % k == e % k; no allocation before the call */
        Poly p;
        poly_of(env, a, &p);
        p.k = em_sym__mod64(p.k, kb);
        uint32_t n = 0;
        for (uint32_t i = 0; i < p.n; i++) {
            p.t[i].c = em_sym__mod64(p.t[i].c, kb);
            if (p.t[i].c) p.t[n++] = p.t[i];
        }
        p.n = n;
        if (n == 0) return em_sym_const(env, p.k);
        int64_t g = gcd64(kb, p.k);
        for (uint32_t i = 0; i < p.n; i++) g = gcd64(g, p.t[i].c);
        if (g > 1) { /* (g*a') % (g*k') == g * (a' % k') */
            p.k /= g;
            for (uint32_t i = 0; i < p.n; i++) p.t[i].c /= g;
            SymRef inner = mk_mod(env, poly_finish(env, &p), em_sym_const(env, kb / g));
            return mk_lin(env, g, inner, 0, inner);
        }
        SymRef r = poly_finish(env, &p);
        if (!r) return SYM_NONE;
        int64_t lo, hi;
        em_sym_range(env, r, &lo, &hi);
        if (lo >= 0 && hi < kb) return r;
        if (em_sym__known_divisible(env, r, kb)) return em_sym_const(env, 0);
        SymTerm t[2] = {{0, r}, {0, b}};
        return em_sym__intern(env, SYM_MOD, 0, t, 2);
    }
    if (em_sym_is_const(env, a, &ka) && ka == 0) return a;
    if (is_monomial(env, b) && known_positive(env, b)) {
        Poly q, r;
        if (split_by_mono(env, a, b, &q, &r) < 0) return SYM_NONE;
        if (q.n || q.k) return mk_mod(env, poly_finish(env, &r), b);
    }
    if (known_positive(env, b)) {
        int64_t lo, hi;
        em_sym_range(env, a, &lo, &hi);
        if (lo >= 0 && decide_cmp(env, SYM_LT, a, b) == 1) return a; /* 0 <= a < b */
    }
    SymTerm t[2] = {{0, a}, {0, b}};
    return em_sym__intern(env, SYM_MOD, 0, t, 2);
}

static SymRef mk_minmax(ShapeEnv *env, SymOp op, SymRef a, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    SymTerm t[SYM_MAX_TERMS];
    uint32_t n = 0;
    SymRef in[2] = {a, b};
    for (int s = 0; s < 2; s++) { /* flatten Min(Min(x, y), z) */
        const SymNode *x = &env->nodes[in[s]];
        if (x->op == op) {
            if (n + x->n > SYM_MAX_TERMS) return em_sym__fail(env, SYM_ERR_TOO_BIG), SYM_NONE;
            memcpy(&t[n], &env->terms[x->first], x->n * sizeof(SymTerm));
            n += x->n;
        } else {
            t[n++] = (SymTerm){0, in[s]};
        }
    }
    /* drop every operand that another one dominates (a range comparison decides it); this also
     * folds constants and removes duplicates */
    SymOp keep_if = op == SYM_MIN ? SYM_LE : SYM_GE; /* for Min, x is dropped if some y <= x */
    for (uint32_t i = 0; i < n; i++) {
        bool drop = false;
        for (uint32_t j = 0; j < n && !drop; j++) {
            if (i == j) continue;
            if (t[j].ref == t[i].ref) {
                drop = j < i; /* keep the first copy */
                continue;
            }
            int64_t ci, cj;
            if (em_sym_is_const(env, t[i].ref, &ci) && em_sym_is_const(env, t[j].ref, &cj)) {
                drop = op == SYM_MIN ? (cj < ci || (cj == ci && j < i)) : (cj > ci || (cj == ci && j < i));
                continue;
            }
            drop = decide_cmp(env, keep_if, t[j].ref, t[i].ref) == 1;
            if (env->error) return SYM_NONE;
        }
        if (drop) {
            memmove(&t[i], &t[i + 1], (n - i - 1) * sizeof(SymTerm));
            n--;
            i = (uint32_t)-1; /* restart: domination is transitive, a rescan is cheap */
        }
    }
    if (n == 1) return t[0].ref;
    for (uint32_t i = 1; i < n; i++) {
        SymTerm v = t[i];
        uint32_t j = i;
        while (j > 0 && sym_order(env, t[j - 1].ref, v.ref) > 0) {
            t[j] = t[j - 1];
            j--;
        }
        t[j] = v;
    }
    return em_sym__intern(env, op, 0, t, n);
}

static SymRef mk_cmp(ShapeEnv *env, SymOp op, SymRef a, SymRef b) {
    if (env->error || !a || !b) return SYM_NONE;
    if (op < SYM_EQ || op > SYM_GE) return em_sym__fail(env, SYM_ERR_BAD_ARG), SYM_NONE;
    int r = decide_cmp(env, op, a, b);
    if (env->error) return SYM_NONE;
    if (r >= 0) return em_sym_const(env, r);
    SymTerm t[2] = {{0, a}, {0, b}};
    return em_sym__intern(env, op, 0, t, 2);
}

/* ---- simplification under what the env knows now ---- */

/* The last step of every public constructor: an expression whose range is one point is that
 * constant (a fact `e == v` learnt by a guard), and the result is its own simplification. */
static SymRef done(ShapeEnv *env, SymRef r) {
    if (!r || env->error) return SYM_NONE;
    if (env->nodes[r].op != SYM_CONST) {
        int64_t lo, hi;
        em_sym_range(env, r, &lo, &hi);
        if (lo == hi) r = em_sym_const(env, lo);
        if (!r) return SYM_NONE;
    }
    env->nodes[r].simp = r;
    env->nodes[r].simp_epoch = env->epoch + 1;
    return r;
}

SymRef em_sym_simplify(ShapeEnv *env, SymRef e) {
    if (!e || env->error) return SYM_NONE;
    if (env->nodes[e].simp_epoch == env->epoch + 1) return env->nodes[e].simp;
    const SymNode x = env->nodes[e];
    SymRef r = SYM_NONE;
    switch ((SymOp)x.op) {
    case SYM_CONST:
        r = e;
        break;
    case SYM_SYMBOL: {
        SymRef repl = env->syms[x.k].repl;
        r = repl ? em_sym_simplify(env, repl) : e;
        break;
    }
    case SYM_ADD: {
        r = em_sym_const(env, x.k);
        for (uint32_t i = 0; i < x.n && r; i++) {
            SymTerm t = env->terms[x.first + i];
            r = mk_lin(env, 1, r, t.c, em_sym_simplify(env, t.ref));
        }
        break;
    }
    case SYM_MUL: {
        r = em_sym_const(env, 1);
        for (uint32_t i = 0; i < x.n && r; i++) {
            SymTerm t = env->terms[x.first + i];
            SymRef f = em_sym_simplify(env, t.ref);
            for (int64_t j = 0; j < t.c && r; j++) r = mk_mul(env, r, f);
        }
        break;
    }
    case SYM_FLOORDIV:
    case SYM_MOD: {
        SymRef a = em_sym_simplify(env, env->terms[x.first].ref);
        SymRef b = em_sym_simplify(env, env->terms[x.first + 1].ref);
        r = x.op == SYM_FLOORDIV ? mk_floordiv(env, a, b) : mk_mod(env, a, b);
        break;
    }
    case SYM_MIN:
    case SYM_MAX:
        r = em_sym_simplify(env, env->terms[x.first].ref);
        for (uint32_t i = 1; i < x.n && r; i++)
            r = mk_minmax(env, (SymOp)x.op, r, em_sym_simplify(env, env->terms[x.first + i].ref));
        break;
    default: {
        SymRef a = em_sym_simplify(env, env->terms[x.first].ref);
        SymRef b = em_sym_simplify(env, env->terms[x.first + 1].ref);
        r = mk_cmp(env, (SymOp)x.op, a, b);
        break;
    }
    }
    r = done(env, r);
    if (r) {
        env->nodes[e].simp = r;
        env->nodes[e].simp_epoch = env->epoch + 1;
    }
    return r;
}

/* ---- the public constructors: operands simplified first, results finished ---- */

#define S(x) em_sym_simplify(env, (x))

SymRef em_sym_add(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_lin(env, 1, S(a), 1, S(b))); }
SymRef em_sym_sub(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_lin(env, 1, S(a), -1, S(b))); }
SymRef em_sym_neg(ShapeEnv *env, SymRef a) {
    SymRef s = S(a);
    return done(env, mk_lin(env, -1, s, 0, s));
}
SymRef em_sym_mul(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_mul(env, S(a), S(b))); }
SymRef em_sym_floordiv(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_floordiv(env, S(a), S(b))); }
SymRef em_sym_mod(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_mod(env, S(a), S(b))); }
SymRef em_sym_min(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_minmax(env, SYM_MIN, S(a), S(b))); }
SymRef em_sym_max(ShapeEnv *env, SymRef a, SymRef b) { return done(env, mk_minmax(env, SYM_MAX, S(a), S(b))); }
SymRef em_sym_cmp(ShapeEnv *env, SymOp op, SymRef a, SymRef b) { return done(env, mk_cmp(env, op, S(a), S(b))); }

SymRef em_sym_binop_named(ShapeEnv *env, const char *op, SymRef a, SymRef b, int *known) {
    *known = 1;
    if (!strcmp(op, "add")) return em_sym_add(env, a, b);
    if (!strcmp(op, "sub")) return em_sym_sub(env, a, b);
    if (!strcmp(op, "mul")) return em_sym_mul(env, a, b);
    if (!strcmp(op, "floordiv")) return em_sym_floordiv(env, a, b);
    if (!strcmp(op, "mod")) return em_sym_mod(env, a, b);
    if (!strcmp(op, "min")) return em_sym_min(env, a, b);
    if (!strcmp(op, "max")) return em_sym_max(env, a, b);
    static const char *const cmps[] = {"==", "!=", "<", "<=", ">", ">="};
    for (int i = 0; i < 6; i++)
        if (!strcmp(op, cmps[i])) return em_sym_cmp(env, (SymOp)(SYM_EQ + i), a, b);
    *known = 0;
    return SYM_NONE;
}

#undef S

/* ---- evaluation ---- */

SymErr em_sym_eval(const ShapeEnv *env, SymRef e, const int64_t *values, int64_t *out) {
    if (!e) return SYM_ERR_BAD_ARG;
    const SymNode *x = &env->nodes[e];
    const SymTerm *t = &env->terms[x->first];
    int64_t a, b, v = 0;
    SymErr err;
    switch ((SymOp)x->op) {
    case SYM_CONST: *out = x->k; return SYM_ERR_OK;
    case SYM_SYMBOL: *out = values[x->k]; return SYM_ERR_OK;
    case SYM_ADD:
        v = x->k;
        for (uint32_t i = 0; i < x->n; i++) {
            if ((err = em_sym_eval(env, t[i].ref, values, &a))) return err;
            if (!ck_mul(a, t[i].c, &a) || !ck_add(v, a, &v)) return SYM_ERR_OVERFLOW;
        }
        *out = v;
        return SYM_ERR_OK;
    case SYM_MUL:
        v = 1;
        for (uint32_t i = 0; i < x->n; i++) {
            if ((err = em_sym_eval(env, t[i].ref, values, &a))) return err;
            for (int64_t j = 0; j < t[i].c; j++)
                if (!ck_mul(v, a, &v)) return SYM_ERR_OVERFLOW;
        }
        *out = v;
        return SYM_ERR_OK;
    case SYM_FLOORDIV:
    case SYM_MOD:
        if ((err = em_sym_eval(env, t[0].ref, values, &a)) || (err = em_sym_eval(env, t[1].ref, values, &b))) return err;
        return x->op == SYM_FLOORDIV ? py_floordiv(a, b, out) : py_mod(a, b, out);
    case SYM_MIN:
    case SYM_MAX:
        for (uint32_t i = 0; i < x->n; i++) {
            if ((err = em_sym_eval(env, t[i].ref, values, &a))) return err;
            if (i == 0 || (x->op == SYM_MIN ? a < v : a > v)) v = a;
        }
        *out = v;
        return SYM_ERR_OK;
    default:
        if ((err = em_sym_eval(env, t[0].ref, values, &a)) || (err = em_sym_eval(env, t[1].ref, values, &b))) return err;
        switch ((SymOp)x->op) {
        case SYM_EQ: *out = a == b; break;
        case SYM_NE: *out = a != b; break;
        case SYM_LT: *out = a < b; break;
        case SYM_LE: *out = a <= b; break;
        case SYM_GT: *out = a > b; break;
        default: *out = a >= b; break;
        }
        return SYM_ERR_OK;
    }
}

