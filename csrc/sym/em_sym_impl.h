/* ember symbolic shapes, private layout: the node table, the hash-cons index, symbols, facts and
 * recorded guards of a ShapeEnv. Only csrc/sym/ includes this.
 * Invariant: node i's operands are terms[first .. first+n), all with indices < i (a DAG in
 * creation order), and (op, k, operands) is unique in the table. */
#ifndef EM_SYM_IMPL_H
#define EM_SYM_IMPL_H

#include "sym/em_sym.h"

/* One operand. ADD: coef * monomial; MUL: atom ** exp (c = exp >= 1); FLOORDIV, MOD and the
 * comparisons: two operands (c unused, 0); MIN/MAX: n operands (c unused). */
typedef struct SymTerm {
    int64_t c;
    SymRef ref;
} SymTerm;

typedef struct SymNode {
    uint8_t op;          /* SymOp */
    uint8_t depth;       /* 1 + the deepest operand's depth (<= SYM_MAX_DEPTH: recursion is bounded) */
    uint32_t n;          /* number of operands */
    uint32_t first;      /* index of the first operand in env->terms */
    int64_t k;           /* CONST: the value; SYMBOL: the symbol index; ADD: the constant */
    uint32_t hash;
    uint32_t simp_epoch; /* memo: simp is this node simplified under env->epoch == simp_epoch */
    SymRef simp;
    uint32_t range_epoch;
    int64_t lo, hi;      /* memo of em_sym_range */
} SymNode;

typedef struct SymSymbol {
    char *source;       /* malloc'd */
    int64_t hint;
    uint8_t kind;       /* SymKind */
    bool duck;          /* made under duck shaping (torch's DimDynamic.DUCK): later duck sizes of its hint are it */
    SymRef node;        /* its SYMBOL node */
    SymRef repl;        /* replacement (unsimplified: simplify before use), SYM_NONE if none */
    uint64_t tag;       /* the tracer's (em_sym_set_symbol_tag) */
} SymSymbol;

/* What is known of a normalised expression p (no constant, coefficients' gcd 1, first coefficient
 * positive): p lies in [lo, hi] and differs from each ne[i]. A symbol's range is the fact on it. */
#define SYM_MAX_NE 4
typedef struct SymFact {
    SymRef p;
    int64_t lo, hi;
    uint32_t nne;
    int64_t ne[SYM_MAX_NE];
} SymFact;

/* A divisibility learnt from `e % k == 0` (e normalised as stored by the guard). */
typedef struct SymDiv {
    SymRef e;
    int64_t k;
} SymDiv;

/* A recorded guard: the relation over the operands as simplified when it was asked (never
 * re-simplified: what it taught would make it look trivially true), and whether a replacement
 * or a symbol's range already expresses it. */
typedef struct SymRecorded {
    SymRef rel;
    bool covered;
} SymRecorded;

struct ShapeEnv {
    ShapeEnvOptions opts;
    SymErr error;
    uint32_t epoch;        /* bumped whenever a replacement or fact is learnt */
    SymNode *nodes;        /* nodes[0] is unused (SYM_NONE) */
    uint32_t nnodes, capnodes;
    SymTerm *terms;
    uint32_t nterms, capterms;
    uint32_t *index;       /* hash-cons table: open addressing, node refs, 0 = empty */
    uint32_t capindex;     /* power of two */
    SymSymbol *syms;
    uint32_t nsyms, capsyms;
    int64_t *hints;        /* hints[i] = syms[i].hint, contiguous for em_sym_eval */
    uint32_t caphints;
    SymFact *facts;
    uint32_t nfacts, capfacts;
    uint32_t *fact_index;  /* p -> fact index + 1, open addressing on p */
    uint32_t capfact_index;
    SymDiv *divs;
    uint32_t ndivs, capdivs;
    SymRecorded *guards;   /* the relations that held, in the order asked */
    uint32_t nguards, capguards;
    SymGuard *produced;    /* em_sym_produce_guards' result */
    uint32_t nproduced, capproduced;
};

/* Shared inside sym/ (em_sym.c). */
int em_sym__fail(ShapeEnv *env, SymErr e);                 /* sets the sticky error; returns -1 */
const SymNode *em_sym__node(const ShapeEnv *env, SymRef r);
const SymTerm *em_sym__terms(const ShapeEnv *env, SymRef r);
SymRef em_sym__intern(ShapeEnv *env, SymOp op, int64_t k, const SymTerm *t, uint32_t n);
int em_sym__grow(ShapeEnv *env, void **items, uint32_t *cap, size_t elem, uint32_t need);
/* Normalises the non-constant part of e: e == sg * p + k with p normalised (or p == SYM_NONE when
 * e is constant). Returns -1 on failure. */
int em_sym__normalise(ShapeEnv *env, SymRef e, SymRef *p, int64_t *sg, int64_t *k);
SymFact *em_sym__fact(const ShapeEnv *env, SymRef p);       /* NULL when nothing is known */
SymFact *em_sym__fact_add(ShapeEnv *env, SymRef p);         /* finds or adds (range unbounded) */
bool em_sym__known_divisible(const ShapeEnv *env, SymRef e, int64_t k);
int64_t em_sym__floordiv64(int64_t a, int64_t b);         /* Python //, b != 0, no overflow case */
int64_t em_sym__mod64(int64_t a, int64_t b);

#endif /* EM_SYM_IMPL_H */
