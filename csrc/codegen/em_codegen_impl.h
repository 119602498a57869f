/* codegen (private): what the C and the CUDA C generators share: the text buffer and the
 * expression of a pointwise node, written once for both dialects (they differ in type names and
 * a few helpers only). Not for other stages: their interface is em_codegen.h. */
#ifndef EM_CODEGEN_IMPL_H
#define EM_CODEGEN_IMPL_H

#include "codegen/em_codegen.h"
#include "core/em_philox.h"

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
    int helper_int_casts;           /* float -> integer casts through em_f2i64 / em_f2i32 (C: eager's
                                     * x86 results for NaN and out of range; CUDA's cvt is defined) */
    int rsqrt_call;                 /* rsqrt as rsqrtf / rsqrt (CUDA: the MUFU instruction, what eager's
                                     * torch.rsqrt calls), else 1 / sqrt (C: eager's CPU kernel) */
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

/* A number of a kernel (a size, stride or offset): a literal, or the name of a local the kernel's
 * prologue computes from the size values; zero / one: it is 0 / 1 for every size. */
typedef struct EmCgNum {
    char v[40];
    int zero, one;
} EmCgNum;

/* Where size locals go: the graph's ShapeEnv (NULL: a static kernel, literals only), the symbols
 * read (used, may be NULL), the failure flag, and the locals' C type (cast: written as a cast of the
 * expression, "(idx_t)"). */
typedef struct EmCgNums {
    ShapeEnv *env;
    uint8_t *used;
    int *bad;
    const char *type;
    int cast;
} EmCgNums;

/* *out = the literal hint (static kernel, or a constant shadow), else a local `name` defined in the
 * prologue as e ("const <type> name = e;"). */
void em_codegen_num(EmSB *b, const EmCgNums *ns, EmCgNum *out, int64_t hint, SymRef e, const char *name);

/* Room for the offset and strides of every access of k (one more entry, never empty); 0, or -1
 * with *b marked out of memory. The caller frees both. */
int em_codegen_nums_alloc(EmSB *b, const SKernel *k, EmCgNum **off, EmCgNum (**st)[EM_LMAXDIM]);

/* The offset (o<q>) and strides (s<q>_<j>) of every access of k, loads then stores. */
void em_codegen_access_nums(EmSB *b, const EmCgNums *ns, const SKernel *k, EmCgNum *off, EmCgNum (*st)[EM_LMAXDIM]);

#endif /* EM_CODEGEN_IMPL_H */
