/* codegen (private): what the C and the CUDA C generators share: the text buffer and the
 * expression of a pointwise node, written once for both dialects (they differ in type names and
 * a few helpers only). Not for other stages: their interface is em_codegen.h. */
#ifndef EM_CODEGEN_IMPL_H
#define EM_CODEGEN_IMPL_H

#include "codegen/em_codegen.h"

/* A growing text buffer with a sticky failure: oom, or `unsupported` naming what the generator
 * cannot emit (the graph then runs elsewhere: never code that computes something else). */
typedef struct EmSB {
    char *p;
    size_t n, cap;
    int oom;
    const char *unsupported;
} EmSB;

void em_sb_printf(EmSB *b, const char *fmt, ...);

/* The dialect of a generator: C11 (gcc) or CUDA C++ (NVRTC). */
typedef struct EmCgDialect {
    const char *(*ctype)(LDtype t); /* compute type of a dtype ("int64_t" / "long long") */
    const char *isinf_fmt;          /* isinf of the float operand %s */
    const char *false_lit;          /* "0" / "false" */
    int suffixed_div_floor;         /* em_div_floorf / em_div_floor (C) or one overloaded name (CUDA) */
} EmCgDialect;

/* The C expression of node i of kernel k (inputs named v<k>), without rounding to half types. */
void em_codegen_expr(EmSB *b, const EmCgDialect *d, const SKernel *k, uint32_t i);
/* The same, rounded to the node's half type (em_f16_round / em_bf16_round), as eager rounds each
 * op's result; both dialects' preludes define those helpers. */
void em_codegen_rounded_expr(EmSB *b, const EmCgDialect *d, const SKernel *k, uint32_t i);

/* Size expression e of a symbolic graph as C over `sv[j]` (symbol j's value for this call), with
 * Python's // and % (em_floordiv, em_mod; em_min, em_max), which both preludes define. Marks
 * used[j] for every symbol read (used may be NULL); sets *bad for what it cannot write. */
void em_codegen_sym(EmSB *b, ShapeEnv *env, SymRef e, uint8_t *used, int *bad);

#endif /* EM_CODEGEN_IMPL_H */
