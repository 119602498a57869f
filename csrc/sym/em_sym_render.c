/* ember symbolic expressions rendered as text: SYMBOLS for graph metadata (`s0*s1`, `(s0//2)`,
 * `Mod(s0, 4)`, `Max(s0, s1)`, as Dynamo's sympy printer writes them) and SOURCES for guards
 * (Python over the symbols' sources that eval() answers exactly like em_sym_eval).
 * Invariant: parentheses follow Python's precedence (comparison < + - < * // % < unary < **),
 * and // and % operands that are sums or products are always parenthesised, for readers. */
#include "sym/em_sym_impl.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { P_CMP, P_ADD, P_MUL, P_UNARY, P_ATOM };

typedef struct Out {
    char *buf;
    size_t size, len;
} Out;

static void puts_(Out *o, const char *s) {
    size_t n = strlen(s);
    if (o->len < o->size) {
        size_t room = o->size - o->len - 1;
        memcpy(o->buf + o->len, s, n < room ? n : room);
        o->buf[o->len + (n < room ? n : room)] = '\0';
    }
    o->len += n;
}

static void putf(Out *o, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    puts_(o, tmp);
}

static int node_prec(const ShapeEnv *env, SymRef e, SymStyle st) {
    const SymNode *x = em_sym__node(env, e);
    switch ((SymOp)x->op) {
    case SYM_CONST: return x->k < 0 ? P_UNARY : P_ATOM;
    case SYM_SYMBOL: return P_ATOM;
    case SYM_ADD: {
        if (x->n != 1 || x->k != 0) return P_ADD;
        /* c*m: "-m" is a unary minus unless m is itself a product; "-2 * m" and "2 * m" products */
        const SymTerm *t = em_sym__terms(env, e);
        return t[0].c == -1 && em_sym__node(env, t[0].ref)->op != SYM_MUL ? P_UNARY : P_MUL;
    }
    case SYM_MUL: return P_MUL;
    case SYM_FLOORDIV:
    case SYM_MOD: return st == SYM_STYLE_SYMBOLS ? P_ATOM : P_MUL;
    case SYM_MIN:
    case SYM_MAX: return P_ATOM;
    default: return P_CMP;
    }
}

static void render(Out *o, const ShapeEnv *env, SymRef e, SymStyle st, int ctx);

/* c*m, after a unary minus when negated: -(a // b) is not -a // b in Python */
static void render_mono(Out *o, const ShapeEnv *env, uint64_t c, SymRef m, SymStyle st, bool negated) {
    const char *times = st == SYM_STYLE_SYMBOLS ? "*" : " * ";
    if (c != 1) {
        putf(o, "%" PRIu64, c);
        puts_(o, times);
    }
    /* 2*s0*s1 reads as (2*s0)*s1, but 2 * a // b would not be 2 * (a // b) */
    render(o, env, m, st, (c != 1 || negated) && em_sym__node(env, m)->op != SYM_MUL ? P_UNARY : P_MUL);
}

static void render(Out *o, const ShapeEnv *env, SymRef e, SymStyle st, int ctx) {
    if (!e) {
        puts_(o, "<none>");
        return;
    }
    const SymNode *x = em_sym__node(env, e);
    const SymTerm *t = em_sym__terms(env, e);
    bool sym = st == SYM_STYLE_SYMBOLS;
    bool paren = node_prec(env, e, st) < ctx;
    if (paren) puts_(o, "(");
    switch ((SymOp)x->op) {
    case SYM_CONST: putf(o, "%" PRId64, x->k); break;
    case SYM_SYMBOL:
        if (sym) putf(o, "s%" PRId64, x->k);
        else puts_(o, env->syms[x->k].source);
        break;
    case SYM_ADD:
        for (uint32_t i = 0; i < x->n; i++) {
            int64_t c = t[i].c;
            if (i == 0) {
                if (c < 0) puts_(o, "-");
            } else {
                puts_(o, c < 0 ? " - " : " + ");
            }
            uint64_t mag = c < 0 ? (uint64_t)0 - (uint64_t)c : (uint64_t)c; /* |INT64_MIN| too */
            render_mono(o, env, mag, t[i].ref, st, i == 0 && c < 0);
        }
        if (x->k > 0) putf(o, " + %" PRId64, x->k);
        else if (x->k < 0) putf(o, " - %" PRIu64, (uint64_t)0 - (uint64_t)x->k);
        break;
    case SYM_MUL:
        for (uint32_t i = 0; i < x->n; i++) {
            if (i) puts_(o, sym ? "*" : " * ");
            render(o, env, t[i].ref, st, t[i].c > 1 ? P_ATOM : P_UNARY);
            if (t[i].c > 1) putf(o, "**%" PRId64, t[i].c);
        }
        break;
    case SYM_FLOORDIV:
        if (sym) {
            puts_(o, "(");
            render(o, env, t[0].ref, st, P_UNARY);
            puts_(o, "//");
            render(o, env, t[1].ref, st, P_UNARY);
            puts_(o, ")");
        } else {
            render(o, env, t[0].ref, st, P_UNARY);
            puts_(o, " // ");
            render(o, env, t[1].ref, st, P_UNARY);
        }
        break;
    case SYM_MOD:
        if (sym) {
            puts_(o, "Mod(");
            render(o, env, t[0].ref, st, P_CMP + 1);
            puts_(o, ", ");
            render(o, env, t[1].ref, st, P_CMP + 1);
            puts_(o, ")");
        } else {
            render(o, env, t[0].ref, st, P_UNARY);
            puts_(o, " % ");
            render(o, env, t[1].ref, st, P_UNARY);
        }
        break;
    case SYM_MIN:
    case SYM_MAX:
        puts_(o, x->op == SYM_MIN ? (sym ? "Min(" : "min(") : (sym ? "Max(" : "max("));
        for (uint32_t i = 0; i < x->n; i++) {
            if (i) puts_(o, ", ");
            render(o, env, t[i].ref, st, P_CMP + 1);
        }
        puts_(o, ")");
        break;
    default: {
        static const char *const cmp[] = {[SYM_EQ] = " == ", [SYM_NE] = " != ", [SYM_LT] = " < ",
                                          [SYM_LE] = " <= ", [SYM_GT] = " > ",   [SYM_GE] = " >= "};
        render(o, env, t[0].ref, st, P_ADD);
        puts_(o, cmp[x->op]);
        render(o, env, t[1].ref, st, P_ADD);
        break;
    }
    }
    if (paren) puts_(o, ")");
}

size_t em_sym_render(const ShapeEnv *env, SymRef e, SymStyle style, char *buf, size_t size) {
    Out o = {buf, size, 0};
    if (size) buf[0] = '\0';
    render(&o, env, e, style, P_CMP);
    return o.len;
}
