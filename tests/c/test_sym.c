/* C unit tests for csrc/sym (symbolic sizes and the shape environment): canonical forms and
 * hash-consing, Python // and % semantics, overflow, guards and what they teach, replacements,
 * rendering, guard programs, shape rules, and randomized differential tests against a direct
 * evaluation of random expression trees. Needs no Python at run time.
 * Invariant: one CHECK macro; the exit status is nonzero when a check failed. */
#include "sym/em_sym.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int nfailed, nchecks;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        nchecks++;                                                                    \
        if (!(cond)) {                                                                \
            nfailed++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                             \
    } while (0)

/* text of e in a style (a static buffer per call site is enough for CHECKs) */
static const char *sym_text(const ShapeEnv *env, SymRef e, SymStyle st) {
    static char buf[8][512];
    static int slot;
    char *b = buf[slot++ & 7];
    em_sym_render(env, e, st, b, 512);
    return b;
}
#define SYMS(e) sym_text(env, (e), SYM_STYLE_SYMBOLS)
#define SRCS(e) sym_text(env, (e), SYM_STYLE_SOURCES)
#define CHECK_TEXT(e, want)                                                                          \
    do {                                                                                             \
        const char *got_ = SYMS(e);                                                                  \
        CHECK(strcmp(got_, (want)) == 0);                                                            \
        if (strcmp(got_, (want)) != 0) fprintf(stderr, "   got %s, want %s\n", got_, (want));        \
    } while (0)
#define CHECK_SRC(e, want)                                                                           \
    do {                                                                                             \
        const char *got_ = SRCS(e);                                                                  \
        CHECK(strcmp(got_, (want)) == 0);                                                            \
        if (strcmp(got_, (want)) != 0) fprintf(stderr, "   got %s, want %s\n", got_, (want));        \
    } while (0)

static ShapeEnv *plain_env(void) { /* no 0/1 specialisation, no duck shaping: pure algebra */
    ShapeEnvOptions o = {false, false};
    return em_sym_env_new(&o);
}

#define C(v) em_sym_const(env, (v))

/* ---- reference Python arithmetic ---- */

static int64_t ref_floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b) && ((a < 0) != (b < 0))) q--;
    return q;
}
static int64_t ref_mod(int64_t a, int64_t b) { return a - b * ref_floordiv(a, b); }

/* ---- canonical forms ---- */

static void test_canonical(void) {
    ShapeEnv *env = plain_env();
    SymRef s0 = em_sym_new_int(env, "L['a']", 7, SYM_NEG_INF, SYM_INF);
    SymRef s1 = em_sym_new_int(env, "L['b']", 3, SYM_NEG_INF, SYM_INF);
    SymRef s2 = em_sym_new_int(env, "L['c']", -4, SYM_NEG_INF, SYM_INF);
    CHECK(s0 && s1 && s2 && s0 != s1);
    CHECK(em_sym_mul(env, s0, s1) == em_sym_mul(env, s1, s0));
    CHECK(em_sym_add(env, s0, s0) == em_sym_mul(env, C(2), s0));
    CHECK(em_sym_mul(env, s0, C(1)) == s0);
    CHECK(em_sym_add(env, s0, C(0)) == s0);
    CHECK(em_sym_floordiv(env, s0, C(1)) == s0);
    CHECK(em_sym_sub(env, s0, s0) == C(0));
    CHECK(em_sym_mul(env, s0, C(0)) == C(0));
    /* distribution and re-association */
    SymRef lhs = em_sym_mul(env, em_sym_add(env, s0, C(1)), s1);
    CHECK(lhs == em_sym_add(env, em_sym_mul(env, s0, s1), s1));
    CHECK(em_sym_add(env, em_sym_add(env, s0, s1), s2) == em_sym_add(env, s0, em_sym_add(env, s2, s1)));
    CHECK(em_sym_mul(env, em_sym_mul(env, s0, s1), s2) == em_sym_mul(env, s2, em_sym_mul(env, s1, s0)));
    /* (a+b)*(a-b) == a*a - b*b */
    CHECK(em_sym_mul(env, em_sym_add(env, s0, s1), em_sym_sub(env, s0, s1)) ==
          em_sym_sub(env, em_sym_mul(env, s0, s0), em_sym_mul(env, s1, s1)));
    /* floor division and modulo by constants */
    CHECK(em_sym_floordiv(env, em_sym_mul(env, s0, C(4)), C(2)) == em_sym_mul(env, s0, C(2)));
    CHECK(em_sym_floordiv(env, em_sym_mul(env, s0, C(5)), C(5)) == s0);
    CHECK(em_sym_floordiv(env, em_sym_mul(env, s0, C(6)), C(4)) ==
          em_sym_floordiv(env, em_sym_mul(env, s0, C(3)), C(2)));
    CHECK(em_sym_floordiv(env, em_sym_add(env, em_sym_mul(env, s0, C(2)), C(3)), C(2)) == em_sym_add(env, s0, C(1)));
    CHECK(em_sym_floordiv(env, em_sym_floordiv(env, s0, C(2)), C(3)) == em_sym_floordiv(env, s0, C(6)));
    CHECK(em_sym_floordiv(env, s0, C(-2)) == em_sym_floordiv(env, em_sym_neg(env, s0), C(2)));
    CHECK(em_sym_mod(env, em_sym_sub(env, s0, C(1)), C(4)) == em_sym_mod(env, em_sym_add(env, s0, C(3)), C(4)));
    CHECK(em_sym_mod(env, em_sym_mul(env, s0, C(8)), C(4)) == C(0));
    CHECK(em_sym_mod(env, em_sym_mod(env, s0, C(8)), C(4)) == em_sym_mod(env, s0, C(4)));
    CHECK(em_sym_mod(env, s0, C(1)) == C(0));
    SymRef m = em_sym_mod(env, em_sym_add(env, em_sym_mul(env, s0, C(4)), C(2)), C(8));
    CHECK(m == em_sym_mul(env, C(2), em_sym_mod(env, em_sym_add(env, em_sym_mul(env, s0, C(2)), C(1)), C(4))));
    /* min / max */
    CHECK(em_sym_min(env, s0, s0) == s0);
    CHECK(em_sym_min(env, s0, s1) == em_sym_min(env, s1, s0));
    CHECK(em_sym_max(env, em_sym_max(env, s0, s1), s2) == em_sym_max(env, s0, em_sym_max(env, s2, s1)));
    CHECK(em_sym_min(env, C(3), C(-2)) == C(-2));
    CHECK(em_sym_max(env, s0, em_sym_add(env, s0, C(1))) == em_sym_add(env, s0, C(1)));
    /* comparisons fold when the difference is constant */
    CHECK(em_sym_cmp(env, SYM_LT, s0, em_sym_add(env, s0, C(1))) == C(1));
    CHECK(em_sym_cmp(env, SYM_EQ, em_sym_mul(env, s0, s1), em_sym_mul(env, s1, s0)) == C(1));
    CHECK(em_sym_op(env, em_sym_cmp(env, SYM_LT, s0, s1)) == SYM_LT);
    CHECK(strcmp(em_sym_op_name(SYM_FLOORDIV), "//") == 0 && strcmp(em_sym_op_name(SYM_GE), ">=") == 0);
    CHECK(strcmp(em_sym_error_text(SYM_ERR_OVERFLOW), "integer overflow in a size expression") == 0);
    uint32_t fs[4];
    CHECK(em_sym_free_symbols(env, em_sym_add(env, em_sym_mul(env, s2, s0), s0), fs, 4) == 2 && fs[0] == 0 &&
          fs[1] == 2);
    CHECK(em_sym_free_symbols(env, C(3), fs, 4) == 0);
    CHECK(em_sym_symbol_index(env, s1) == 1 && em_sym_symbol_index(env, em_sym_add(env, s1, C(1))) == -1);
    CHECK(em_sym_has_symbols(env, em_sym_min(env, s1, C(2))) && !em_sym_has_symbols(env, C(2)));
    CHECK(em_sym_env_error(env) == SYM_ERR_OK);
    em_sym_env_free(env);

    /* size symbols: ranges decide more */
    env = em_sym_env_new(NULL);
    SymRef x = em_sym_new_size(env, "L['x'].size()[0]", 10, SYM_NEG_INF, SYM_INF);
    SymRef y = em_sym_new_size(env, "L['x'].size()[1]", 7, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_floordiv(env, em_sym_mul(env, x, y), y) == x);
    CHECK(em_sym_mod(env, em_sym_add(env, em_sym_mul(env, x, y), x), x) == C(0));
    CHECK(em_sym_floordiv(env, em_sym_mul(env, C(4), em_sym_mul(env, x, y)), em_sym_mul(env, C(2), y)) ==
          em_sym_mul(env, C(2), x));
    CHECK(em_sym_min(env, em_sym_floordiv(env, x, C(2)), x) == em_sym_floordiv(env, x, C(2)));
    CHECK(em_sym_max(env, x, C(1)) == x);
    CHECK(em_sym_cmp(env, SYM_GE, x, C(2)) == C(1));
    CHECK(em_sym_cmp(env, SYM_EQ, x, C(1)) == C(0));
    CHECK(em_sym_cmp(env, SYM_LT, em_sym_floordiv(env, x, C(2)), x) == C(1));
    CHECK(em_sym_mod(env, x, em_sym_add(env, x, C(1))) == x); /* 0 <= x < x + 1 */
    em_sym_env_free(env);
}

static void test_render(void) {
    ShapeEnv *env = plain_env();
    SymRef s0 = em_sym_new_size(env, "L['x'].size()[0]", 6, SYM_NEG_INF, SYM_INF);
    SymRef s1 = em_sym_new_size(env, "L['x'].size()[1]", 9, SYM_NEG_INF, SYM_INF);
    CHECK_TEXT(em_sym_mul(env, s1, s0), "s0*s1");
    CHECK_TEXT(em_sym_floordiv(env, s0, C(2)), "(s0//2)");
    CHECK_TEXT(em_sym_max(env, s1, s0), "Max(s0, s1)");
    CHECK_TEXT(em_sym_min(env, s1, s0), "Min(s0, s1)");
    CHECK_TEXT(em_sym_mod(env, s0, C(4)), "Mod(s0, 4)");
    CHECK_TEXT(em_sym_add(env, em_sym_mul(env, C(2), s0), C(1)), "2*s0 + 1");
    CHECK_TEXT(em_sym_sub(env, s0, s1), "s0 - s1");
    CHECK_TEXT(em_sym_sub(env, C(3), s0), "-s0 + 3");
    CHECK_TEXT(em_sym_mul(env, s0, s0), "s0**2");
    CHECK_TEXT(em_sym_add(env, em_sym_mul(env, s0, s1), s0), "s0*s1 + s0");
    CHECK_TEXT(em_sym_mul(env, C(2), em_sym_floordiv(env, s0, C(3))), "2*(s0//3)");
    CHECK_TEXT(C(-5), "-5");
    CHECK_SRC(em_sym_cmp(env, SYM_GT, s0, C(4)), "L['x'].size()[0] > 4");
    CHECK_SRC(em_sym_cmp(env, SYM_EQ, s0, s1), "L['x'].size()[0] == L['x'].size()[1]");
    CHECK_SRC(em_sym_cmp(env, SYM_EQ, em_sym_mod(env, em_sym_mul(env, s0, s1), C(4)), C(0)),
              "(L['x'].size()[0] * L['x'].size()[1]) % 4 == 0");
    CHECK_SRC(em_sym_mul(env, C(2), em_sym_floordiv(env, s0, C(3))), "2 * (L['x'].size()[0] // 3)");
    CHECK_SRC(em_sym_max(env, s0, s1), "max(L['x'].size()[0], L['x'].size()[1])");
    CHECK_SRC(em_sym_floordiv(env, em_sym_add(env, s0, s1), C(2)), "(L['x'].size()[0] + L['x'].size()[1]) // 2");
    /* truncation is snprintf-like */
    char small[6];
    size_t need = em_sym_render(env, em_sym_mul(env, s0, s1), SYM_STYLE_SYMBOLS, small, sizeof small);
    CHECK(need == 5 && strcmp(small, "s0*s1") == 0);
    need = em_sym_render(env, em_sym_max(env, s0, s1), SYM_STYLE_SYMBOLS, small, sizeof small);
    CHECK(need == strlen("Max(s0, s1)") && strlen(small) == 5);
    em_sym_env_free(env);
}

/* ---- Python semantics and overflow ---- */

static void test_semantics(void) {
    ShapeEnv *env = plain_env();
    bool ok = true;
    for (int64_t a = -9; a <= 9; a++)
        for (int64_t b = -4; b <= 4; b++) {
            if (!b) continue;
            int64_t q, r;
            ok &= em_sym_is_const(env, em_sym_floordiv(env, C(a), C(b)), &q) && q == ref_floordiv(a, b);
            ok &= em_sym_is_const(env, em_sym_mod(env, C(a), C(b)), &r) && r == ref_mod(a, b);
            ok &= (r == 0 || (r < 0) == (b < 0)); /* the sign of the divisor */
        }
    CHECK(ok);
    int64_t v;
    CHECK(em_sym_is_const(env, em_sym_floordiv(env, C(-7), C(2)), &v) && v == -4);
    CHECK(em_sym_is_const(env, em_sym_mod(env, C(-7), C(2)), &v) && v == 1);
    CHECK(em_sym_is_const(env, em_sym_mod(env, C(7), C(-2)), &v) && v == -1);
    CHECK(em_sym_is_const(env, em_sym_mod(env, C(INT64_MIN), C(-1)), &v) && v == 0);
    /* symbolic operands evaluate with the same semantics */
    SymRef s0 = em_sym_new_int(env, "L['n']", -7, SYM_NEG_INF, SYM_INF);
    SymRef fd = em_sym_floordiv(env, s0, C(2)), md = em_sym_mod(env, s0, C(-3));
    ok = true;
    for (int64_t a = -20; a <= 20; a++) {
        int64_t vals[1] = {a}, got;
        ok &= em_sym_eval(env, fd, vals, &got) == SYM_ERR_OK && got == ref_floordiv(a, 2);
        ok &= em_sym_eval(env, md, vals, &got) == SYM_ERR_OK && got == ref_mod(a, -3);
    }
    CHECK(ok);
    CHECK(em_sym_env_error(env) == SYM_ERR_OK);
    em_sym_env_free(env);

    /* overflow: constant folding is sticky, evaluation reports it */
    env = plain_env();
    SymRef big = C(INT64_MAX / 2 + 1);
    CHECK(em_sym_mul(env, big, C(2)) == SYM_NONE);
    CHECK(em_sym_env_error(env) == SYM_ERR_OVERFLOW);
    CHECK(em_sym_add(env, C(1), C(2)) == SYM_NONE); /* sticky */
    em_sym_env_free(env);
    env = plain_env();
    CHECK(em_sym_floordiv(env, C(INT64_MIN), C(-1)) == SYM_NONE && em_sym_env_error(env) == SYM_ERR_OVERFLOW);
    em_sym_env_free(env);
    env = plain_env();
    CHECK(em_sym_floordiv(env, C(5), C(0)) == SYM_NONE && em_sym_env_error(env) == SYM_ERR_ZERO_DIV);
    em_sym_env_free(env);
    /* nesting is bounded: a deep chain fails TOO_BIG instead of exhausting the C stack */
    env = plain_env();
    SymRef deep = em_sym_new_int(env, "L['d']", 5, SYM_NEG_INF, SYM_INF);
    for (int i = 0; i < 200 && deep; i++) deep = em_sym_floordiv(env, em_sym_add(env, deep, em_sym_symbol(env, 0)), C(3));
    CHECK(deep == SYM_NONE && em_sym_env_error(env) == SYM_ERR_TOO_BIG);
    em_sym_env_free(env);
    env = plain_env();
    SymRef a = em_sym_new_size(env, "a", 5, SYM_NEG_INF, SYM_INF), b = em_sym_new_size(env, "b", 6, SYM_NEG_INF, SYM_INF);
    SymRef ab = em_sym_mul(env, a, b);
    int64_t huge[2] = {INT64_MAX / 3, 4}, got;
    CHECK(em_sym_eval(env, ab, huge, &got) == SYM_ERR_OVERFLOW);
    int64_t zero[2] = {5, 0};
    CHECK(em_sym_eval(env, em_sym_floordiv(env, a, b), zero, &got) == SYM_ERR_ZERO_DIV);
    CHECK(em_sym_hint(env, ab, &got) == 0 && got == 30);
    /* a guard program fails (never passes) on overflow */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, ab, C(20))) == 1);
    SymProg *p = em_sym_prog_compile(env);
    CHECK(p != NULL);
    if (p) {
        int64_t ok_vals[2] = {5, 6};
        CHECK(em_sym_prog_check(p, ok_vals) == -1);
        CHECK(em_sym_prog_check(p, huge) >= 0);
        em_sym_prog_free(p);
    }
    em_sym_env_free(env);
}

/* ---- guards ---- */

/* index of the produced guard whose SOURCES text is want, or -1 */
static int find_guard(ShapeEnv *env, const char *want) {
    const SymGuard *g;
    uint32_t n = em_sym_produce_guards(env, &g);
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(SRCS(g[i].rel), want) == 0) return (int)i;
    return -1;
}

static void dump_guards(ShapeEnv *env) {
    const SymGuard *g;
    uint32_t n = em_sym_produce_guards(env, &g);
    for (uint32_t i = 0; i < n; i++) fprintf(stderr, "   guard %u: %s\n", i, SRCS(g[i].rel));
}

/* int arguments (em_sym_new_int): not 0/1 specialised, not duck-shaped, unbounded (no guards) */
static void test_int_symbols(void) {
    ShapeEnv *env = em_sym_env_new(NULL);
    SymRef one = em_sym_new_int(env, "L['a']", 1, SYM_NEG_INF, SYM_INF);
    SymRef zero = em_sym_new_int(env, "L['b']", 0, SYM_NEG_INF, SYM_INF);
    SymRef size8 = em_sym_new_size(env, "L['x'].size()[0]", 8, SYM_NEG_INF, SYM_INF);
    SymRef int8 = em_sym_new_int(env, "L['n']", 8, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_op(env, one) == SYM_SYMBOL && em_sym_op(env, zero) == SYM_SYMBOL && em_sym_nsymbols(env) == 4);
    CHECK(int8 != size8 && em_sym_op(env, int8) == SYM_SYMBOL);
    const SymGuard *g;
    CHECK(em_sym_produce_guards(env, &g) == 1); /* only the size's range: 2 <= L['x'].size()[0] */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, int8, C(3))) == 1); /* learnt: L['n'] > 3 */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, one, C(1))) == 1 && em_sym_simplify(env, one) == C(1));
    em_sym_env_free(env);
}

static void test_guards(void) {
    ShapeEnv *env = em_sym_env_new(NULL);
    /* 0/1 specialisation */
    CHECK(em_sym_specializes(env, 0) && em_sym_specializes(env, 1) && !em_sym_specializes(env, 2));
    CHECK(em_sym_new_size(env, "L['z'].size()[0]", 1, SYM_NEG_INF, SYM_INF) == C(1));
    CHECK(em_sym_new_size(env, "L['z'].size()[1]", 0, SYM_NEG_INF, SYM_INF) == C(0));
    CHECK(em_sym_nsymbols(env) == 0);
    SymRef x = em_sym_new_size(env, "L['x'].size()[0]", 8, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_op(env, x) == SYM_SYMBOL && em_sym_nsymbols(env) == 1);
    CHECK(strcmp(em_sym_symbol_source(env, 0), "L['x'].size()[0]") == 0 && em_sym_symbol_hint(env, 0) == 8);
    const SymGuard *g;
    CHECK(em_sym_produce_guards(env, &g) == 1 && find_guard(env, "2 <= L['x'].size()[0]") == 0);
    /* static: no guard */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GE, x, C(2))) == 1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_NE, x, C(1))) == 1);
    CHECK(em_sym_produce_guards(env, &g) == 1);
    /* an inequality narrows the range */
    CHECK(em_sym_static_bool(env, em_sym_cmp(env, SYM_GT, x, C(4))) == -1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, x, C(4))) == 1);
    CHECK(em_sym_static_bool(env, em_sym_cmp(env, SYM_GE, x, C(5))) == 1);
    CHECK(em_sym_static_bool(env, em_sym_cmp(env, SYM_LE, x, C(4))) == 0);
    int64_t lo, hi;
    em_sym_range(env, x, &lo, &hi);
    CHECK(lo == 5 && hi == SYM_INF);
    CHECK(em_sym_produce_guards(env, &g) == 1 && find_guard(env, "5 <= L['x'].size()[0]") == 0);
    /* the answer false records the negation */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, x, C(100))) == 0);
    em_sym_range(env, x, &lo, &hi);
    CHECK(lo == 5 && hi == 100);
    CHECK(find_guard(env, "L['x'].size()[0] <= 100") >= 0);
    /* relations between symbols */
    SymRef y = em_sym_new_size(env, "L['y'].size()[0]", 12, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_LT, x, y)) == 1);
    CHECK(find_guard(env, "L['x'].size()[0] < L['y'].size()[0]") >= 0);
    uint32_t before = em_sym_produce_guards(env, &g);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GT, y, x)) == 1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_NE, x, y)) == 1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_LE, em_sym_add(env, x, C(1)), y)) == 1);
    CHECK(em_sym_produce_guards(env, &g) == before);
    CHECK(em_sym_min(env, x, y) == x && em_sym_max(env, y, x) == y);
    /* int(): specialise */
    SymRef z = em_sym_new_size(env, "L['z'].size()[2]", 3, SYM_NEG_INF, SYM_INF);
    int64_t v;
    CHECK(em_sym_guard_int(env, em_sym_mul(env, z, C(2)), &v) == 0 && v == 6);
    CHECK(em_sym_simplify(env, z) == C(3) && em_sym_replacement(env, 2) == C(3));
    CHECK(find_guard(env, "L['z'].size()[2] == 3") >= 0);
    /* the program agrees with the rendered guards, and carries the tracer's tags */
    em_sym_set_symbol_tag(env, 1, 0xabc00001ull);
    CHECK(em_sym_symbol_tag(env, 1) == 0xabc00001ull && em_sym_symbol_tag(env, 0) == 0);
    SymProg *p = em_sym_prog_compile(env);
    CHECK(p && em_sym_prog_input_tag(p, 1) == 0xabc00001ull && em_sym_prog_input_tag(p, 2) == 0);
    CHECK(p && em_sym_prog_ninputs(p) == 3 && em_sym_prog_nchecks(p) == em_sym_produce_guards(env, &g));
    if (p) {
        int64_t hint[3] = {8, 12, 3}, small[3] = {4, 12, 3}, eq[3] = {9, 9, 3}, z4[3] = {8, 12, 4},
                big[3] = {101, 200, 3};
        CHECK(em_sym_prog_check(p, hint) == -1);
        CHECK(em_sym_prog_check(p, small) >= 0);
        CHECK(em_sym_prog_check(p, eq) >= 0);
        CHECK(em_sym_prog_check(p, z4) >= 0);
        CHECK(em_sym_prog_check(p, big) >= 0);
        em_sym_prog_free(p);
    }
    CHECK(em_sym_env_error(env) == SYM_ERR_OK);
    if (nfailed) dump_guards(env);
    em_sym_env_free(env);
}

static void test_replacements(void) {
    ShapeEnv *env = em_sym_env_new(NULL);
    SymRef a = em_sym_new_size(env, "L['a'].size()[0]", 3, SYM_NEG_INF, SYM_INF);
    SymRef b = em_sym_new_size(env, "L['b'].size()[0]", 5, SYM_NEG_INF, SYM_INF);
    SymRef c = em_sym_new_size(env, "L['c'].size()[0]", 5, SYM_NEG_INF, SYM_INF); /* duck: is b */
    CHECK(c == b && em_sym_nsymbols(env) == 3);
    CHECK(find_guard(env, "L['c'].size()[0] == L['b'].size()[0]") >= 0);
    /* b == a + 2: b (the newest solvable symbol) is replaced, and c follows through the chain */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, b, em_sym_add(env, a, C(2)))) == 1);
    CHECK(em_sym_simplify(env, b) == em_sym_add(env, a, C(2)));
    CHECK(em_sym_simplify(env, em_sym_symbol(env, 2)) == em_sym_add(env, a, C(2)));
    CHECK(em_sym_mul(env, b, C(2)) == em_sym_add(env, em_sym_mul(env, a, C(2)), C(4)));
    CHECK(find_guard(env, "L['b'].size()[0] == L['a'].size()[0] + 2") >= 0);
    CHECK(find_guard(env, "L['c'].size()[0] == L['a'].size()[0] + 2") >= 0);
    /* an expression built before the guard simplifies after it */
    SymRef prod = em_sym_mul(env, a, em_sym_symbol(env, 2));
    CHECK(prod == em_sym_add(env, em_sym_mul(env, a, a), em_sym_mul(env, C(2), a)));
    SymProg *p = em_sym_prog_compile(env);
    if (p) {
        int64_t ok1[3] = {3, 5, 5}, ok2[3] = {10, 12, 12}, bad1[3] = {3, 5, 6}, bad2[3] = {3, 6, 6}, bad3[3] = {1, 3, 3};
        CHECK(em_sym_prog_check(p, ok1) == -1 && em_sym_prog_check(p, ok2) == -1);
        CHECK(em_sym_prog_check(p, bad1) >= 0 && em_sym_prog_check(p, bad2) >= 0 && em_sym_prog_check(p, bad3) >= 0);
        em_sym_prog_free(p);
    }
    CHECK(p != NULL);
    em_sym_env_free(env);

    /* union of two symbols: the ranges intersect */
    ShapeEnvOptions o = {true, false};
    env = em_sym_env_new(&o);
    SymRef s0 = em_sym_new_size(env, "L['x'].size()[0]", 7, SYM_NEG_INF, SYM_INF);
    SymRef s1 = em_sym_new_size(env, "L['y'].size()[1]", 7, 4, 100);
    CHECK(s0 != s1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, s1, s0)) == 1);
    CHECK(em_sym_simplify(env, s1) == s0);
    int64_t lo, hi;
    em_sym_range(env, s0, &lo, &hi);
    CHECK(lo == 4 && hi == 100);
    CHECK(find_guard(env, "L['y'].size()[1] == L['x'].size()[0]") >= 0);
    CHECK(find_guard(env, "4 <= L['x'].size()[0]") >= 0 && find_guard(env, "L['x'].size()[0] <= 100") >= 0);
    /* a replacement by an expression keeps the replaced symbol's range as guards */
    SymRef s2 = em_sym_new_size(env, "L['z'].size()[0]", 6, SYM_NEG_INF, SYM_INF);
    SymRef s3 = em_sym_new_size(env, "L['w'].size()[0]", 5, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, s3, em_sym_sub(env, s2, C(1)))) == 1);
    em_sym_range(env, s2, &lo, &hi);
    CHECK(lo == 3); /* s3 >= 2 means s2 - 1 >= 2 */
    /* a range that shrinks to a point pins the symbol */
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_LE, s2, C(6))) == 1);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_GE, s2, C(6))) == 1);
    CHECK(em_sym_simplify(env, s2) == C(6) && em_sym_simplify(env, s3) == C(5));
    CHECK(em_sym_env_error(env) == SYM_ERR_OK);
    em_sym_env_free(env);

    /* divisibility */
    env = em_sym_env_new(&o);
    SymRef n = em_sym_new_size(env, "L['x'].size()[0]", 12, SYM_NEG_INF, SYM_INF);
    CHECK(em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, em_sym_mod(env, n, C(4)), C(0))) == 1);
    CHECK(em_sym_mod(env, n, C(4)) == C(0) && em_sym_mod(env, n, C(2)) == C(0));
    CHECK(em_sym_mul(env, em_sym_floordiv(env, n, C(4)), C(4)) == n);
    CHECK(em_sym_mul(env, em_sym_floordiv(env, n, C(2)), C(2)) == n);
    CHECK(find_guard(env, "L['x'].size()[0] % 4 == 0") >= 0);
    em_sym_env_free(env);
}

/* ---- shape rules ---- */

static void test_shapes(void) {
    ShapeEnvOptions o = {true, false};
    ShapeEnv *env = em_sym_env_new(&o);
    SymRef s0 = em_sym_new_size(env, "L['x'].size()[0]", 5, SYM_NEG_INF, SYM_INF);
    SymRef s1 = em_sym_new_size(env, "L['y'].size()[0]", 5, SYM_NEG_INF, SYM_INF);
    SymRef s2 = em_sym_new_size(env, "L['z'].size()[0]", 4, SYM_NEG_INF, SYM_INF);
    SymRef out, outs[4];
    /* with 1 and with itself: no guard */
    CHECK(em_sym_broadcast(env, s0, C(1), &out) == 0 && out == s0);
    CHECK(em_sym_broadcast(env, C(1), s0, &out) == 0 && out == s0);
    CHECK(em_sym_broadcast(env, s0, s0, &out) == 0 && out == s0);
    const SymGuard *g;
    CHECK(em_sym_produce_guards(env, &g) == 3); /* the three ranges */
    /* two symbols: guarded equal */
    CHECK(em_sym_broadcast(env, s0, s1, &out) == 0 && out == s0 && em_sym_simplify(env, s1) == s0);
    CHECK(find_guard(env, "L['y'].size()[0] == L['x'].size()[0]") >= 0);
    /* mismatch: eager raises; the relation is recorded */
    CHECK(em_sym_broadcast(env, s0, s2, &out) == SYM_SHAPE_ERROR);
    CHECK(find_guard(env, "L['x'].size()[0] != L['z'].size()[0]") >= 0);
    /* a symbol against a constant specialises it */
    SymRef a[2] = {s2, C(3)}, b[3] = {C(7), C(4), C(1)};
    CHECK(em_sym_broadcast_shapes(env, a, 2, b, 3, outs) == 0);
    CHECK(outs[0] == C(7) && outs[1] == C(4) && outs[2] == C(3) && em_sym_simplify(env, s2) == C(4));
    em_sym_env_free(env);

    env = em_sym_env_new(&o);
    s0 = em_sym_new_size(env, "L['x'].size()[0]", 6, SYM_NEG_INF, SYM_INF);
    s1 = em_sym_new_size(env, "L['x'].size()[1]", 10, SYM_NEG_INF, SYM_INF);
    SymRef sizes[3] = {s0, s1, C(3)}, strides[3];
    CHECK(em_sym_contiguous_strides(env, sizes, 3, strides) == 0);
    CHECK_TEXT(strides[0], "3*s1");
    CHECK(strides[1] == C(3) && strides[2] == C(1));
    CHECK_TEXT(em_sym_numel(env, sizes, 3), "3*s0*s1");
    /* view(-1, 4) guards divisibility; view(s0, -1) needs no guard */
    SymRef numel = em_sym_numel(env, sizes, 2);
    SymRef shape[2] = {C(-1), C(4)};
    CHECK(em_sym_reshape(env, numel, shape, 2, outs) == 0);
    CHECK_TEXT(outs[0], "((s0*s1)//4)");
    CHECK(outs[1] == C(4));
    CHECK(em_sym_mul(env, outs[0], C(4)) == numel);
    CHECK(find_guard(env, "(L['x'].size()[0] * L['x'].size()[1]) % 4 == 0") >= 0);
    uint32_t nbefore = em_sym_produce_guards(env, &g);
    SymRef shape2[2] = {s0, C(-1)};
    CHECK(em_sym_reshape(env, numel, shape2, 2, outs) == 0 && outs[0] == s0 && outs[1] == s1);
    CHECK(em_sym_produce_guards(env, &g) == nbefore);
    SymRef shape3[2] = {C(-1), C(7)};
    CHECK(em_sym_reshape(env, numel, shape3, 2, outs) == SYM_SHAPE_ERROR); /* 60 % 7 != 0 */
    SymRef shape4[2] = {C(-1), C(-1)};
    CHECK(em_sym_reshape(env, numel, shape4, 2, outs) == SYM_SHAPE_ERROR);
    /* slicing */
    CHECK(em_sym_slice(env, s0, SYM_NONE, em_sym_floordiv(env, s0, C(2)), SYM_NONE, &out) == 0);
    CHECK_TEXT(out, "(s0//2)");
    CHECK(em_sym_slice(env, s0, C(1), SYM_NONE, SYM_NONE, &out) == 0);
    CHECK_TEXT(out, "s0 - 1");
    CHECK(em_sym_slice(env, s0, SYM_NONE, SYM_NONE, C(2), &out) == 0);
    CHECK_TEXT(out, "((s0 + 1)//2)");
    CHECK(em_sym_produce_guards(env, &g) == nbefore + 1); /* 60 % 7 != 0 was recorded */
    /* conv output size: k=3, stride 2, pad 1 -> (s + 1)//2, and no guard (always >= 1) */
    CHECK(em_sym_conv_out(env, s1, C(3), C(2), C(1), C(1), &out) == 0);
    CHECK_TEXT(out, "((s1 + 1)//2)");
    CHECK(em_sym_conv_out(env, s1, C(5), C(1), C(0), C(1), &out) == 0); /* s1 - 4 >= 1: guarded */
    CHECK_TEXT(out, "s1 - 4");
    CHECK(find_guard(env, "5 <= L['x'].size()[1]") >= 0);
    CHECK(em_sym_conv_out(env, s0, C(9), C(1), C(0), C(1), &out) == SYM_SHAPE_ERROR); /* 6 < 9 */
    /* an int argument that is -1 at the example infers too (guarded == -1, i.e. specialised) */
    SymRef d = em_sym_new_int(env, "L['d']", -1, SYM_NEG_INF, SYM_INF);
    SymRef shape5[2] = {s0, d};
    CHECK(em_sym_reshape(env, numel, shape5, 2, outs) == 0 && outs[1] == s1 && em_sym_simplify(env, d) == C(-1));
    em_sym_env_free(env);

    env = em_sym_env_new(&o);
    SymRef bq = em_sym_new_size(env, "L['a'].size()[0]", 3, SYM_NEG_INF, SYM_INF);
    SymRef n = em_sym_new_size(env, "L['a'].size()[1]", 5, SYM_NEG_INF, SYM_INF);
    SymRef k = em_sym_new_size(env, "L['a'].size()[2]", 7, SYM_NEG_INF, SYM_INF);
    SymRef k2 = em_sym_new_size(env, "L['b'].size()[0]", 7, SYM_NEG_INF, SYM_INF);
    SymRef m = em_sym_new_size(env, "L['b'].size()[1]", 9, SYM_NEG_INF, SYM_INF);
    SymRef A[3] = {bq, n, k}, B[2] = {k2, m};
    uint32_t nout;
    CHECK(em_sym_matmul_shape(env, A, 3, B, 2, outs, &nout) == 0 && nout == 3);
    CHECK(outs[0] == bq && outs[1] == n && outs[2] == m && em_sym_simplify(env, k2) == k);
    SymRef v1[1] = {k};
    CHECK(em_sym_matmul_shape(env, v1, 1, B, 2, outs, &nout) == 0 && nout == 1 && outs[0] == m);
    CHECK(em_sym_matmul_shape(env, B, 2, A, 3, outs, &nout) == SYM_SHAPE_ERROR); /* 9 != 5 */
    SymRef c1[2] = {bq, n}, c2[2] = {k, n}, cat[2];
    const SymRef *shapes[2] = {c1, c2};
    CHECK(em_sym_cat_shape(env, shapes, 2, 2, 0, cat) == 0);
    CHECK_TEXT(cat[0], "s0 + s2");
    CHECK(cat[1] == n);
    CHECK(em_sym_cat_shape(env, shapes, 2, 2, 1, cat) == SYM_SHAPE_ERROR); /* 3 != 7 */
    CHECK(em_sym_env_error(env) == SYM_ERR_OK);
    em_sym_env_free(env);
}

/* Python slice length of range(n)[start:stop:step] (step > 0), as a reference. */
static int64_t ref_slice_len(int64_t n, bool has_start, int64_t start, bool has_stop, int64_t stop, int64_t step) {
    int64_t s = has_start ? start : 0, e = has_stop ? stop : n;
    if (s < 0) s += n;
    if (s < 0) s = 0;
    if (s > n) s = n;
    if (e < 0) e += n;
    if (e < s) e = s;
    if (e > n) e = n;
    return (e - s + step - 1) / step;
}

/* Shape rules are right for every size their guards admit. */
static void test_shapes_differential(void) {
    bool ok = true;
    int cases = 0, admitted = 0;
    for (int64_t hint = 2; hint <= 9; hint++)
        for (int64_t start = -12; start <= 12; start += 3)
            for (int64_t stop = -11; stop <= 12; stop += 4)
                for (int64_t step = 1; step <= 3; step++)
                    for (int mask = 0; mask < 4; mask++) {
                        ShapeEnv *env = em_sym_env_new(NULL);
                        SymRef n = em_sym_new_size(env, "n", hint, SYM_NEG_INF, SYM_INF);
                        /* a bound given as an expression of n too: n//2 + start */
                        SymRef st = (mask & 1) ? C(start) : em_sym_add(env, em_sym_floordiv(env, n, C(2)), C(start));
                        SymRef out;
                        int r = em_sym_slice(env, n, (mask & 2) ? SYM_NONE : st, C(stop), C(step), &out);
                        SymProg *p = em_sym_prog_compile(env);
                        ok &= r == 0 && p != NULL;
                        for (int64_t v = 2; p && v <= 30; v++) {
                            int64_t vals[1] = {v}, got;
                            cases++;
                            if (em_sym_prog_check(p, vals) >= 0) continue;
                            admitted++;
                            int64_t s = (mask & 1) ? start : v / 2 + start;
                            bool good = em_sym_eval(env, out, vals, &got) == SYM_ERR_OK &&
                                        got == ref_slice_len(v, !(mask & 2), s, true, stop, step);
                            if (!good && ok)
                                fprintf(stderr, "   slice n=%lld hint=%lld start=%lld stop=%lld step=%lld mask=%d: %s\n",
                                        (long long)v, (long long)hint, (long long)s, (long long)stop,
                                        (long long)step, mask, SYMS(out));
                            ok &= good;
                        }
                        em_sym_prog_free(p);
                        em_sym_env_free(env);
                    }
    CHECK(ok);
    CHECK(admitted > cases / 4); /* the guards are not so tight that nothing is reused */

    /* reshape(-1, d) and broadcasting over two symbols */
    ok = true;
    for (int64_t h0 = 2; h0 <= 7; h0++)
        for (int64_t h1 = 2; h1 <= 7; h1++)
            for (int64_t d = 2; d <= 6; d++) {
                ShapeEnvOptions o = {true, false};
                ShapeEnv *env = em_sym_env_new(&o);
                SymRef a = em_sym_new_size(env, "a", h0, SYM_NEG_INF, SYM_INF);
                SymRef b = em_sym_new_size(env, "b", h1, SYM_NEG_INF, SYM_INF);
                SymRef shape[2] = {C(-1), C(d)}, out[2], bo;
                int r = em_sym_reshape(env, em_sym_mul(env, a, b), shape, 2, out);
                int rb = em_sym_broadcast(env, a, b, &bo);
                SymProg *p = em_sym_prog_compile(env);
                ok &= p != NULL && r == ((h0 * h1) % d ? SYM_SHAPE_ERROR : 0) && rb == (h0 == h1 ? 0 : SYM_SHAPE_ERROR);
                for (int64_t v0 = 2; p && v0 <= 12; v0++)
                    for (int64_t v1 = 2; v1 <= 12; v1++) {
                        int64_t vals[2] = {v0, v1}, got;
                        if (em_sym_prog_check(p, vals) >= 0) continue;
                        /* admitted sizes behave like the example: same error or same formula */
                        ok &= ((v0 * v1) % d != 0) == (r == SYM_SHAPE_ERROR);
                        ok &= (v0 == v1) == (rb == 0);
                        if (r == 0) ok &= em_sym_eval(env, out[0], vals, &got) == SYM_ERR_OK && got == v0 * v1 / d;
                    }
                em_sym_prog_free(p);
                em_sym_env_free(env);
            }
    CHECK(ok);

    /* convolution output sizes over every admitted input size */
    ok = true;
    int nadmitted = 0;
    for (int64_t hint = 2; hint <= 12; hint++)
        for (int64_t k = 1; k <= 5; k++)
            for (int64_t stride = 1; stride <= 3; stride++)
                for (int64_t pad = 0; pad <= 2; pad++)
                    for (int64_t dil = 1; dil <= 2; dil++) {
                        ShapeEnv *env = em_sym_env_new(NULL);
                        SymRef n = em_sym_new_size(env, "n", hint, SYM_NEG_INF, SYM_INF), out;
                        int r = em_sym_conv_out(env, n, C(k), C(stride), C(pad), C(dil), &out);
                        SymProg *p = em_sym_prog_compile(env);
                        int64_t want0 = ref_floordiv(hint + 2 * pad - dil * (k - 1) - 1, stride) + 1;
                        ok &= p != NULL && r == (want0 >= 1 ? 0 : SYM_SHAPE_ERROR);
                        for (int64_t v = 0; p && v <= 40; v++) {
                            int64_t vals[1] = {v}, got;
                            if (em_sym_prog_check(p, vals) >= 0) continue;
                            nadmitted++;
                            int64_t want = ref_floordiv(v + 2 * pad - dil * (k - 1) - 1, stride) + 1;
                            ok &= (want >= 1) == (r == 0);
                            if (r == 0) ok &= em_sym_eval(env, out, vals, &got) == SYM_ERR_OK && got == want;
                        }
                        em_sym_prog_free(p);
                        em_sym_env_free(env);
                    }
    CHECK(ok);
    CHECK(nadmitted > 10000);
}

/* ---- randomized differential tests ---- */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}
static int64_t rnd_in(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }

enum { T_CONST, T_SYM, T_ADD, T_SUB, T_MUL, T_FLOORDIV, T_MOD, T_MIN, T_MAX, T__N };
typedef struct Tree {
    int op;
    int64_t k;
    struct Tree *a, *b;
} Tree;

static Tree pool[4096];
static int npool;

static Tree *gen(int depth, int nsyms, bool positive_divisors) {
    Tree *t = &pool[npool++];
    memset(t, 0, sizeof *t);
    int op = depth <= 0 ? (int)rnd_in(T_CONST, T_SYM) : (int)rnd_in(T_CONST, T__N - 1);
    if (depth > 0 && rnd() % 4 == 0) op = (int)rnd_in(T_CONST, T_SYM);
    t->op = op;
    if (op == T_CONST) t->k = rnd_in(-6, 6);
    else if (op == T_SYM) t->k = rnd_in(0, nsyms - 1);
    else {
        t->a = gen(depth - 1, nsyms, positive_divisors);
        if ((op == T_FLOORDIV || op == T_MOD) && (positive_divisors || rnd() % 2)) {
            t->b = &pool[npool++];
            memset(t->b, 0, sizeof *t->b);
            t->b->op = T_CONST;
            t->b->k = rnd_in(1, 6) * ((positive_divisors || rnd() % 3) ? 1 : -1);
        } else {
            t->b = gen(depth - 1, nsyms, positive_divisors);
        }
    }
    return t;
}

/* Direct evaluation with Python semantics; false on overflow or division by zero. */
static bool direct(const Tree *t, const int64_t *v, int64_t *out) {
    int64_t a, b;
    if (t->op == T_CONST) return *out = t->k, true;
    if (t->op == T_SYM) return *out = v[t->k], true;
    if (!direct(t->a, v, &a) || !direct(t->b, v, &b)) return false;
    switch (t->op) {
    case T_ADD: return !__builtin_add_overflow(a, b, out);
    case T_SUB: return !__builtin_sub_overflow(a, b, out);
    case T_MUL: return !__builtin_mul_overflow(a, b, out);
    case T_FLOORDIV: if (!b || (a == INT64_MIN && b == -1)) return false; *out = ref_floordiv(a, b); return true;
    case T_MOD: if (!b || (a == INT64_MIN && b == -1)) return false; *out = ref_mod(a, b); return true;
    case T_MIN: *out = a < b ? a : b; return true;
    default: *out = a > b ? a : b; return true;
    }
}

/* The tree built through the constructors; commutative operands swapped when swap. */
static SymRef build(ShapeEnv *env, const Tree *t, const SymRef *syms, bool swap) {
    if (t->op == T_CONST) return C(t->k);
    if (t->op == T_SYM) return syms[t->k];
    SymRef a = build(env, t->a, syms, swap), b = build(env, t->b, syms, swap);
    bool s = swap && (rnd() & 1);
    switch (t->op) {
    case T_ADD: return s ? em_sym_add(env, b, a) : em_sym_add(env, a, b);
    case T_SUB: return s ? em_sym_add(env, em_sym_neg(env, b), a) : em_sym_sub(env, a, b);
    case T_MUL: return s ? em_sym_mul(env, b, a) : em_sym_mul(env, a, b);
    case T_FLOORDIV: return em_sym_floordiv(env, a, b);
    case T_MOD: return em_sym_mod(env, a, b);
    case T_MIN: return s ? em_sym_min(env, b, a) : em_sym_min(env, a, b);
    default: return s ? em_sym_max(env, b, a) : em_sym_max(env, a, b);
    }
}

/* Random trees: the canonical form evaluates like the tree, and commuted builds are one node. */
static void test_random_expressions(bool sizes) {
    int compared = 0, mismatches = 0, noncanonical = 0;
    for (int iter = 0; iter < 600; iter++) {
        ShapeEnv *env = sizes ? em_sym_env_new(NULL) : plain_env();
        SymRef syms[3];
        int64_t hints[3];
        for (int i = 0; i < 3; i++) {
            hints[i] = sizes ? rnd_in(2, 9) : rnd_in(-9, 9);
            char src[32];
            snprintf(src, sizeof src, "L['s%d']", i);
            syms[i] = sizes ? em_sym_new_size(env, src, hints[i], SYM_NEG_INF, SYM_INF)
                            : em_sym_new_int(env, src, hints[i], SYM_NEG_INF, SYM_INF);
        }
        npool = 0;
        Tree *t = gen((int)rnd_in(1, 4), 3, sizes);
        SymRef e = build(env, t, syms, false);
        if (em_sym_env_error(env)) { /* division by a constant zero, or a too-large expansion */
            em_sym_env_free(env);
            continue;
        }
        SymRef e2 = build(env, t, syms, true);
        if (e2 != e) {
            noncanonical++;
            if (noncanonical < 4) fprintf(stderr, "   noncanonical: %s vs %s\n", SYMS(e), SYMS(e2));
        }
        for (int trial = 0; trial < 20; trial++) {
            int64_t v[3];
            for (int i = 0; i < 3; i++) v[i] = sizes ? rnd_in(2, 40) : rnd_in(-30, 30);
            /* size symbols were duck-shaped: equal hints are one symbol, so give them equal values */
            if (sizes)
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < i; j++)
                        if (hints[i] == hints[j]) v[i] = v[j];
            int64_t want, got;
            if (!direct(t, v, &want)) continue;
            SymErr err = em_sym_eval(env, e, v, &got);
            if (err == SYM_ERR_OVERFLOW) continue; /* the expanded form may overflow first */
            compared++;
            if (err != SYM_ERR_OK || got != want) {
                mismatches++;
                if (mismatches < 4)
                    fprintf(stderr, "   mismatch: %s at (%lld, %lld, %lld): %lld, want %lld (err %d)\n", SYMS(e),
                            (long long)v[0], (long long)v[1], (long long)v[2], (long long)got, (long long)want, err);
            }
        }
        em_sym_env_free(env);
    }
    CHECK(mismatches == 0);
    CHECK(noncanonical == 0);
    CHECK(compared > 3000);
}

/* Random questions: a guard program that admits other sizes must give every question the same
 * answer there (guard soundness), and must admit the example itself. */
static void test_random_guards(bool sizes) {
    int admitted = 0, unsound = 0, rejected_self = 0;
    for (int iter = 0; iter < 400; iter++) {
        ShapeEnv *env = sizes ? em_sym_env_new(NULL) : plain_env();
        SymRef syms[3];
        int64_t hints[3];
        for (int i = 0; i < 3; i++) {
            hints[i] = sizes ? rnd_in(2, 8) : rnd_in(-8, 8);
            char src[32];
            snprintf(src, sizeof src, "L['s%d']", i);
            syms[i] = sizes ? em_sym_new_size(env, src, hints[i], SYM_NEG_INF, SYM_INF)
                            : em_sym_new_int(env, src, hints[i], SYM_NEG_INF, SYM_INF);
        }
        npool = 0;
        Tree *qa[4], *qb[4];
        int qop[4], answers[4], nq = 0;
        for (int q = 0; q < 4; q++) {
            qa[q] = gen((int)rnd_in(0, 2), 3, sizes);
            qb[q] = gen((int)rnd_in(0, 2), 3, sizes);
            qop[q] = (int)rnd_in(SYM_EQ, SYM_GE);
            SymRef a = build(env, qa[q], syms, false), b = build(env, qb[q], syms, false);
            answers[q] = em_sym_guard_bool(env, em_sym_cmp(env, (SymOp)qop[q], a, b));
            if (answers[q] < 0) break;
            nq++;
        }
        if (em_sym_env_error(env)) {
            em_sym_env_free(env);
            continue;
        }
        /* the symbols' values at the example (duck-shaped symbols share their value) */
        int64_t hv[3];
        for (uint32_t i = 0; i < em_sym_nsymbols(env); i++) hv[i] = em_sym_symbol_hint(env, i);
        SymProg *p = em_sym_prog_compile(env);
        CHECK(p != NULL);
        if (!p) {
            em_sym_env_free(env);
            continue;
        }
        if (em_sym_prog_check(p, hv) >= 0) rejected_self++;
        for (int trial = 0; trial < 60; trial++) {
            int64_t v[3];
            for (int i = 0; i < 3; i++) v[i] = rnd() % 3 == 0 ? hints[i] : (sizes ? rnd_in(0, 12) : rnd_in(-12, 12));
            if (em_sym_prog_check(p, v) >= 0) continue;
            admitted++;
            /* questions are asked of the tree over the symbol values; each symbol i reads v[i] */
            for (int q = 0; q < nq; q++) {
                int64_t a, b;
                if (!direct(qa[q], v, &a) || !direct(qb[q], v, &b)) continue;
                int r;
                switch (qop[q]) {
                case SYM_EQ: r = a == b; break;
                case SYM_NE: r = a != b; break;
                case SYM_LT: r = a < b; break;
                case SYM_LE: r = a <= b; break;
                case SYM_GT: r = a > b; break;
                default: r = a >= b; break;
                }
                if (r != answers[q]) {
                    unsound++;
                    if (unsound < 4) {
                        fprintf(stderr, "   unsound: question %d at (%lld, %lld, %lld)\n", q, (long long)v[0],
                                (long long)v[1], (long long)v[2]);
                        dump_guards(env);
                    }
                }
            }
        }
        em_sym_prog_free(p);
        em_sym_env_free(env);
    }
    CHECK(unsound == 0);
    CHECK(rejected_self == 0);
    CHECK(admitted > 1000);
}

int main(void) {
    test_canonical();
    test_render();
    test_semantics();
    test_int_symbols();
    test_guards();
    test_replacements();
    test_shapes();
    test_shapes_differential();
    test_random_expressions(false);
    test_random_expressions(true);
    test_random_guards(true);
    test_random_guards(false);
    printf("test_sym: %d checks, %d failed\n", nchecks, nfailed);
    return nfailed ? 1 : 0;
}
