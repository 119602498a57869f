/* ember shape environment (Dynamo's ShapeEnv, torch/fx/experimental/symbolic_shapes.py): symbols
 * made from sources, guards recorded when the tracer asks a question, and what they teach.
 * Invariant: every recorded guard held on the hints, and every fact or replacement the env uses
 * to decide a question statically is implied by the guards em_sym_produce_guards returns.
 *
 * What a guard teaches (the relation that held, `a op b`, with diff = a - b = sg*p + k, p the
 * normalised non-constant part):
 *   ==  a symbol with coefficient +-1 that occurs nowhere else in diff is solved for and replaced
 *       (the newest such symbol, so s1 == s0 replaces s1 by s0: union-find by replacement map,
 *       chains resolved by em_sym_simplify); otherwise p's range becomes the point -k/sg, and
 *       `e % m == 0` also records that m divides e.
 *   !=  p != -k/sg (and the end of p's range moves inward when it was that value).
 *   < <= > >=  p's range narrows (a single symbol: its range, `s0 > 4` gives lo = 5).
 * A symbol whose range narrows to one value is replaced by that constant. Replacing a symbol by
 * an expression moves its range onto the expression (recorded as guards when not implied). */
#include "sym/em_sym_impl.h"

#include <stdlib.h>
#include <string.h>

ShapeEnv *em_sym_env_new(const ShapeEnvOptions *opts) {
    ShapeEnv *env = calloc(1, sizeof *env);
    if (!env) return NULL;
    if (opts) {
        env->opts = *opts;
    } else {
        env->opts.specialize_zero_one = true;
        env->opts.duck_shape = true;
    }
    env->capindex = 256;
    env->index = calloc(env->capindex, sizeof *env->index);
    env->nnodes = 1; /* nodes[0] is SYM_NONE */
    if (!env->index || em_sym__grow(env, (void **)&env->nodes, &env->capnodes, sizeof(SymNode), 256) < 0) {
        em_sym_env_free(env);
        return NULL;
    }
    return env;
}

void em_sym_env_free(ShapeEnv *env) {
    if (!env) return;
    for (uint32_t i = 0; i < env->nsyms; i++) free(env->syms[i].source);
    free(env->nodes);
    free(env->terms);
    free(env->index);
    free(env->syms);
    free(env->hints);
    free(env->facts);
    free(env->fact_index);
    free(env->divs);
    free(env->guards);
    free(env->produced);
    free(env);
}

bool em_sym_specializes(const ShapeEnv *env, int64_t hint) {
    return env->opts.specialize_zero_one && (hint == 0 || hint == 1);
}

uint32_t em_sym_nsymbols(const ShapeEnv *env) { return env->nsyms; }
SymRef em_sym_symbol(const ShapeEnv *env, uint32_t i) { return i < env->nsyms ? env->syms[i].node : SYM_NONE; }
const char *em_sym_symbol_source(const ShapeEnv *env, uint32_t i) {
    return i < env->nsyms ? env->syms[i].source : NULL;
}
int64_t em_sym_symbol_hint(const ShapeEnv *env, uint32_t i) { return i < env->nsyms ? env->syms[i].hint : 0; }

void em_sym_set_symbol_tag(ShapeEnv *env, uint32_t i, uint64_t tag) {
    if (i < env->nsyms) env->syms[i].tag = tag;
}
uint64_t em_sym_symbol_tag(const ShapeEnv *env, uint32_t i) { return i < env->nsyms ? env->syms[i].tag : 0; }

SymRef em_sym_replacement(ShapeEnv *env, uint32_t i) {
    if (i >= env->nsyms || !env->syms[i].repl) return SYM_NONE;
    return em_sym_simplify(env, env->syms[i].node);
}

int em_sym_hint(ShapeEnv *env, SymRef e, int64_t *out) {
    if (env->error || !e) return -1;
    SymErr err = em_sym_eval(env, e, env->hints, out);
    return err ? em_sym__fail(env, err) : 0;
}

/* ---- learning ---- */

static int64_t ceil_div(int64_t a, int64_t b) { /* b != 0, a finite */
    return -em_sym__floordiv64(-a, b);
}

static int learn(ShapeEnv *env, SymOp op, SymRef a, SymRef b);

/* Records `a op b` as a guard (it holds on the hints) and learns it. */
static int assume(ShapeEnv *env, SymOp op, SymRef a, SymRef b) {
    if (env->error) return -1;
    SymTerm t[2] = {{0, a}, {0, b}};
    SymRef rel = em_sym__intern(env, op, 0, t, 2);
    if (!rel || em_sym__grow(env, (void **)&env->guards, &env->capguards, sizeof(SymRecorded), env->nguards + 1) < 0)
        return -1;
    uint32_t i = env->nguards++;
    env->guards[i] = (SymRecorded){rel, false};
    int r = learn(env, op, a, b);
    if (r > 0) env->guards[i].covered = true;
    return r < 0 ? -1 : 0;
}

static bool contains(const ShapeEnv *env, SymRef e, SymRef sym) {
    if (e == sym) return true;
    const SymNode *x = em_sym__node(env, e);
    const SymTerm *t = em_sym__terms(env, e);
    for (uint32_t i = 0; i < x->n; i++)
        if (contains(env, t[i].ref, sym)) return true;
    return false;
}

/* diff == 0 holds: solve for a symbol and replace it. Returns 1 if a replacement was made. */
static int try_replace(ShapeEnv *env, SymRef diff) {
    const SymNode *x = em_sym__node(env, diff);
    SymTerm t[64];
    uint32_t n;
    int64_t k = 0;
    if (x->op == SYM_ADD) {
        n = x->n;
        k = x->k;
        memcpy(t, em_sym__terms(env, diff), n * sizeof(SymTerm));
    } else if (x->op == SYM_SYMBOL) {
        n = 1;
        t[0] = (SymTerm){1, diff};
    } else {
        return 0;
    }
    int64_t g = k < 0 ? -k : k;
    for (uint32_t i = 0; i < n; i++) {
        int64_t c = t[i].c < 0 ? -t[i].c : t[i].c;
        while (c) { /* gcd */
            int64_t r = g % c;
            g = c;
            c = r;
        }
    }
    if (g <= 0) return 0;
    int best = -1;
    for (uint32_t i = 0; i < n; i++) {
        const SymNode *m = em_sym__node(env, t[i].ref);
        if (m->op != SYM_SYMBOL || (t[i].c / g != 1 && t[i].c / g != -1)) continue;
        bool alone = true;
        for (uint32_t j = 0; j < n && alone; j++)
            if (j != i && contains(env, t[j].ref, t[i].ref)) alone = false;
        if (alone && (best < 0 || m->k > em_sym__node(env, t[best].ref)->k)) best = (int)i;
    }
    if (best < 0) return 0;
    SymRef s = t[best].ref;
    uint32_t idx = (uint32_t)em_sym__node(env, s)->k;
    /* diff/g == c*s + rest == 0 with c = +-1: s == -c*rest == s - c*diff/g */
    int64_t c = t[best].c / g;
    SymRef scaled = em_sym_floordiv(env, diff, em_sym_const(env, g)); /* exact */
    SymRef e = em_sym_sub(env, s, em_sym_mul(env, em_sym_const(env, c), scaled));
    if (!e) return -1;
    int64_t lo = SYM_NEG_INF, hi = SYM_INF;
    const SymFact *f = em_sym__fact(env, s);
    if (f) {
        lo = f->lo;
        hi = f->hi;
    }
    env->syms[idx].repl = e;
    env->epoch++;
    /* s's range now constrains e */
    int64_t el, eh;
    em_sym_range(env, e, &el, &eh);
    if (lo != SYM_NEG_INF && el < lo && assume(env, SYM_GE, e, em_sym_const(env, lo)) < 0) return -1;
    em_sym_range(env, e, &el, &eh);
    if (hi != SYM_INF && eh > hi && assume(env, SYM_LE, e, em_sym_const(env, hi)) < 0) return -1;
    return 1;
}

/* A symbol whose range is one value becomes that constant. */
static int pin_symbol(ShapeEnv *env, SymRef p) {
    const SymNode *x = em_sym__node(env, p);
    const SymFact *f = em_sym__fact(env, p);
    if (x->op != SYM_SYMBOL || !f || f->lo != f->hi || env->syms[x->k].repl) return 0;
    env->syms[x->k].repl = em_sym_const(env, f->lo);
    env->epoch++;
    return env->syms[x->k].repl ? 0 : -1;
}

static int learn(ShapeEnv *env, SymOp op, SymRef a, SymRef b) {
    SymRef diff = em_sym_sub(env, a, b);
    if (!diff) return -1;
    if (em_sym_is_const(env, diff, NULL)) return 0; /* nothing new */
    if (op == SYM_EQ) {
        int r = try_replace(env, diff);
        if (r != 0) return r; /* 1: the replacement guard expresses it */
        const SymNode *x = em_sym__node(env, a);
        int64_t zero, m;
        if (x->op == SYM_MOD && em_sym_is_const(env, b, &zero) && zero == 0 &&
            em_sym_is_const(env, em_sym__terms(env, a)[1].ref, &m) && m > 0) {
            SymRef e = em_sym__terms(env, a)[0].ref;
            if (em_sym__grow(env, (void **)&env->divs, &env->capdivs, sizeof(SymDiv), env->ndivs + 1) < 0) return -1;
            env->divs[env->ndivs++] = (SymDiv){e, m};
        }
    }
    SymRef p;
    int64_t sg, k;
    if (em_sym__normalise(env, diff, &p, &sg, &k) < 0) return -1;
    if (!p) return 0;
    SymFact *f = em_sym__fact_add(env, p);
    if (!f) return -1;
    /* sg*p + k op 0, i.e. sg*p op -k */
    int64_t v = -k, lo = SYM_NEG_INF, hi = SYM_INF; /* bounds on sg*p */
    switch (op) {
    case SYM_EQ: lo = hi = v; break;
    case SYM_LT: hi = v - 1; break;
    case SYM_LE: hi = v; break;
    case SYM_GT: lo = v + 1; break;
    case SYM_GE: lo = v; break;
    case SYM_NE:
        if (v % sg == 0) {
            int64_t w = v / sg;
            if (w == f->lo && w != SYM_INF) f->lo = w + 1;
            else if (w == f->hi && w != SYM_NEG_INF) f->hi = w - 1;
            else if (f->nne < SYM_MAX_NE) f->ne[f->nne++] = w;
        }
        env->epoch++;
        return pin_symbol(env, p);
    default: return em_sym__fail(env, SYM_ERR_BAD_ARG);
    }
    /* divide the bounds of sg*p by sg, rounding inward */
    int64_t pl, ph;
    if (sg > 0) {
        pl = lo == SYM_NEG_INF ? SYM_NEG_INF : ceil_div(lo, sg);
        ph = hi == SYM_INF ? SYM_INF : em_sym__floordiv64(hi, sg);
    } else {
        pl = hi == SYM_INF ? SYM_NEG_INF : ceil_div(hi, sg);
        ph = lo == SYM_NEG_INF ? SYM_INF : em_sym__floordiv64(lo, sg);
    }
    if (pl > f->lo) f->lo = pl;
    if (ph < f->hi) f->hi = ph;
    EM_ASSERT(f->lo <= f->hi);
    env->epoch++;
    if (pin_symbol(env, p) < 0) return -1;
    /* an inequality on one symbol is its range, which em_sym_produce_guards emits */
    return op != SYM_EQ && em_sym_op(env, p) == SYM_SYMBOL;
}

/* ---- symbols ---- */

static SymRef new_symbol(ShapeEnv *env, const char *source, int64_t hint, SymKind kind, int64_t lo, int64_t hi,
                         bool duck) {
    if (env->error) return SYM_NONE;
    if (!source) return em_sym__fail(env, SYM_ERR_BAD_ARG), SYM_NONE;
    /* sizes 0/1 are specialised; an int symbol is not (torch's create_unspecified_symbol:
     * do_not_specialize_zero_one, so x * n compiles once for every n, 0 and 1 included) */
    if (kind == SYM_KIND_SIZE && em_sym_specializes(env, hint)) return em_sym_const(env, hint);
    bool user_bounds = lo != SYM_NEG_INF || hi != SYM_INF;
    if (kind == SYM_KIND_SIZE) {
        int64_t natural = env->opts.specialize_zero_one ? 2 : 0;
        if (lo < natural) lo = natural;
    }
    if (hint < lo || hint > hi) return em_sym__fail(env, SYM_ERR_BAD_ARG), SYM_NONE;
    if (em_sym__grow(env, (void **)&env->syms, &env->capsyms, sizeof(SymSymbol), env->nsyms + 1) < 0 ||
        em_sym__grow(env, (void **)&env->hints, &env->caphints, sizeof(int64_t), env->nsyms + 1) < 0)
        return SYM_NONE;
    char *src = malloc(strlen(source) + 1);
    if (!src) return em_sym__fail(env, SYM_ERR_NOMEM), SYM_NONE;
    strcpy(src, source);
    uint32_t i = env->nsyms;
    SymRef node = em_sym__intern(env, SYM_SYMBOL, i, NULL, 0);
    if (!node) {
        free(src);
        return SYM_NONE;
    }
    duck = duck && kind == SYM_KIND_SIZE && env->opts.duck_shape && !user_bounds;
    env->syms[i] = (SymSymbol){src, hint, (uint8_t)kind, duck, node, SYM_NONE, 0};
    env->hints[i] = hint;
    env->nsyms++;
    SymFact *f = em_sym__fact_add(env, node);
    if (!f) return SYM_NONE;
    f->lo = lo;
    f->hi = hi;
    env->epoch++;
    if (duck) {
        /* duck shaping: the earliest unreplaced duck size symbol with the same hint and no user bounds */
        for (uint32_t j = 0; j < i; j++) {
            const SymSymbol *o = &env->syms[j];
            if (!o->duck || o->hint != hint || o->repl || o->source[0] == '\0') continue;
            const SymFact *of = em_sym__fact(env, o->node);
            if (!of || of->lo != lo || of->hi != SYM_INF) continue;
            if (assume(env, SYM_EQ, node, o->node) < 0) return SYM_NONE;
            break;
        }
    }
    return em_sym_simplify(env, node);
}

SymRef em_sym_new_size(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi) {
    return em_sym_new_size_as(env, source, hint, lo, hi, true);
}

SymRef em_sym_new_size_as(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi, bool duck) {
    if (hint < 0) return em_sym__fail(env, SYM_ERR_BAD_ARG), SYM_NONE;
    return new_symbol(env, source, hint, SYM_KIND_SIZE, lo, hi, duck);
}

SymRef em_sym_new_int(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi) {
    return new_symbol(env, source, hint, SYM_KIND_INT, lo, hi, false);
}

/* ---- questions ---- */

static SymOp negate(SymOp op) {
    switch (op) {
    case SYM_EQ: return SYM_NE;
    case SYM_NE: return SYM_EQ;
    case SYM_LT: return SYM_GE;
    case SYM_LE: return SYM_GT;
    case SYM_GT: return SYM_LE;
    default: return SYM_LT;
    }
}

int em_sym_static_bool(ShapeEnv *env, SymRef cmp) {
    SymRef c = em_sym_simplify(env, cmp);
    int64_t v;
    if (!c) return -1;
    return em_sym_is_const(env, c, &v) ? v != 0 : -1;
}

int em_sym_guard_bool(ShapeEnv *env, SymRef cmp) {
    SymRef c = em_sym_simplify(env, cmp);
    if (!c) return -1;
    int64_t v;
    if (em_sym_is_const(env, c, &v)) return v != 0;
    SymOp op = em_sym_op(env, c);
    SymRef a, b;
    if (op >= SYM_EQ && op <= SYM_GE) {
        a = em_sym__terms(env, c)[0].ref;
        b = em_sym__terms(env, c)[1].ref;
    } else { /* the truth of an int: c != 0 */
        op = SYM_NE;
        a = c;
        b = em_sym_const(env, 0);
    }
    if (em_sym_hint(env, c, &v) < 0) return -1;
    int answer = v != 0;
    if (assume(env, answer ? op : negate(op), a, b) < 0) return -1;
    return answer;
}

int em_sym_guard_int(ShapeEnv *env, SymRef e, int64_t *out) {
    SymRef s = em_sym_simplify(env, e);
    if (!s) return -1;
    if (em_sym_is_const(env, s, out)) return 0;
    if (em_sym_hint(env, s, out) < 0) return -1;
    return assume(env, SYM_EQ, s, em_sym_const(env, *out));
}

/* ---- producing the guards of an entry ---- */

static int emit(ShapeEnv *env, SymGuardKind kind, SymOp op, SymRef a, SymRef b) {
    SymTerm t[2] = {{0, a}, {0, b}};
    SymRef rel = em_sym__intern(env, op, 0, t, 2);
    if (!rel) return -1;
    for (uint32_t i = 0; i < env->nproduced; i++)
        if (env->produced[i].rel == rel) return 0;
    if (em_sym__grow(env, (void **)&env->produced, &env->capproduced, sizeof(SymGuard), env->nproduced + 1) < 0)
        return -1;
    env->produced[env->nproduced++] = (SymGuard){kind, rel};
    return 0;
}

uint32_t em_sym_produce_guards(ShapeEnv *env, const SymGuard **out) {
    *out = NULL;
    env->nproduced = 0;
    if (env->error) return 0;
    /* replacements: s1 == s0, s0 == 5, s2 == 2*s0 */
    for (uint32_t i = 0; i < env->nsyms; i++) {
        if (!env->syms[i].repl) continue;
        SymRef r = em_sym_simplify(env, env->syms[i].node);
        if (!r || emit(env, SYM_GUARD_REPLACEMENT, SYM_EQ, env->syms[i].node, r) < 0) return 0;
    }
    /* ranges of the symbols that stand for themselves, where narrower than their kind's */
    for (uint32_t i = 0; i < env->nsyms; i++) {
        const SymSymbol *s = &env->syms[i];
        if (s->repl) continue;
        const SymFact *f = em_sym__fact(env, s->node);
        int64_t natural = s->kind == SYM_KIND_SIZE ? 0 : SYM_NEG_INF;
        int64_t lo = f->lo, hi = f->hi;
        if (lo > natural && emit(env, SYM_GUARD_RANGE, SYM_LE, em_sym_const(env, lo), s->node) < 0) return 0;
        if (hi != SYM_INF && emit(env, SYM_GUARD_RANGE, SYM_LE, s->node, em_sym_const(env, hi)) < 0) return 0;
    }
    /* every other relation, as it was asked: re-simplifying it under what it taught would make it
     * trivially true. A replaced symbol it mentions is still an input the program reads. */
    for (uint32_t i = 0; i < env->nguards; i++) {
        if (env->guards[i].covered) continue;
        SymRef g = env->guards[i].rel;
        if (emit(env, SYM_GUARD_RELATION, em_sym_op(env, g), em_sym__terms(env, g)[0].ref,
                 em_sym__terms(env, g)[1].ref) < 0)
            return 0;
    }
    *out = env->produced;
    return env->nproduced;
}
