/* ember symbolic shapes: a small integer algebra (symbols s0, s1, ... under + - * // % min max and
 * comparisons), the shape environment (Dynamo's ShapeEnv: symbols made from sources, guards
 * recorded when the tracer asks a question, equality sets, ranges, divisibility) and guard
 * programs that check a call's sizes without allocating.
 * Invariant: expressions are hash-consed per ShapeEnv in canonical form, so two expressions are
 * structurally equal exactly when their SymRefs are equal. */
#ifndef EM_SYM_H
#define EM_SYM_H

#include "core/em_core.h"

/*
 * WHY A STAGE FOLDER OF ITS OWN. The tracer builds symbolic sizes, the IR's metadata carries them,
 * the fx export renders them, and the guard stage (which sits before the tracer in the pipeline)
 * runs their compiled checks. Like core/, sym/ is a leaf every stage may call; it calls nothing
 * but core/ and never touches the Python error state (failures are sticky codes on the env).
 *
 * THE WIRING PLAN (next session; nothing here is called by trace/guard/hook yet; the long form
 * is docs/dynamic_shapes.md).
 *  1. trace: one ShapeEnv per compilation (em_sym_env_new next to the trace arena, freed with it).
 *     A tensor input whose dim is dynamic (marked, automatic, or dynamic=True) gets
 *     em_sym_new_size(env, "L['x'].size()[0]", hint, lo, hi) for that dim instead of the int; a Python int
 *     that automatic-dynamic marks gets em_sym_new_int. Other dims stay constants (em_sym_const).
 *  2. ir: IRMeta.sizes / strides become SymRef arrays (constants are SymRefs too, so one code
 *     path); shape rules call the helpers below (em_sym_broadcast_shapes, em_sym_reshape,
 *     em_sym_slice, em_sym_conv_out, em_sym_matmul_shape, em_sym_cat_shape, ...); ops without a
 *     rule keep using meta tensors with the symbol's hint, and their output sizes are matched
 *     back to expressions by the tracer (a size equal to no expression's hint specialises).
 *     Python `x.shape[0] > 4`, `//`, `%`, min/max on sizes produce SymRef values in the tracer;
 *     `if`, `bool()`, `int()` on them call em_sym_guard_bool / em_sym_guard_int.
 *  3. guard: a GUARD_SYM leaf per entry: fetch the size of each input source
 *     (em_sym_prog_input_tag: the tracer tagged each symbol with its fetch slot and dim when it
 *     made it; em_sym_symbol_source for text) into an int64 array on the
 *     stack and run em_sym_prog_check on the program from em_sym_prog_compile (O(inputs), no
 *     allocation). TENSOR_MATCH then skips dynamic dims (its sizes become optional, as Dynamo's).
 *     Rendering for dumps: em_sym_render(SYM_STYLE_SOURCES) of each em_sym_produce_guards item.
 *  4. fx export: a SymInt placeholder per unreplaced symbol that a graph size needs (example
 *     value: its hint), `sym_size` nodes (torch.ops.aten.sym_size.int(x, d)) where the graph
 *     reads a size, and node meta rendered with SYM_STYLE_SYMBOLS (`s0*s1`, `(s0//2)`).
 *  5. policy, per code object in the hook's cache: remember each input dim's size per entry;
 *     a recompile whose only difference is a size marks that dim dynamic for later traces
 *     ("automatic dynamic", torch's frame_state); mark_dynamic / mark_static / dynamic=True/False
 *     feed the same per-dim state. Sizes 0 and 1 are specialised (em_sym_specializes).
 */

/* ---- expressions ---- */

typedef uint32_t SymRef;     /* index into the env's node table; 0 is SYM_NONE (error) */
#define SYM_NONE ((SymRef)0)
#define SYM_INF INT64_MAX    /* an unbounded range end: lo = -SYM_INF-1 (INT64_MIN), hi = SYM_INF */
#define SYM_NEG_INF INT64_MIN

/* The operators, one X-macro list: enum name, symbol-style spelling. */
#define SYM_OPS(_)                                                   \
    _(CONST, "const")      /* k */                                  \
    _(SYMBOL, "symbol")    /* s<k> */                               \
    _(ADD, "+")            /* k + c0*m0 + c1*m1 + ...  (sorted)  */ \
    _(MUL, "*")            /* atom0**e0 * atom1**e1 ... (sorted) */ \
    _(FLOORDIV, "//")      /* Python floor division */              \
    _(MOD, "%")            /* Python modulo: sign of the divisor */ \
    _(MIN, "Min")          /* n-ary, sorted, no duplicates */       \
    _(MAX, "Max")                                                   \
    _(EQ, "==")                                                     \
    _(NE, "!=")                                                     \
    _(LT, "<")                                                      \
    _(LE, "<=")                                                     \
    _(GT, ">")                                                      \
    _(GE, ">=")

typedef enum {
#define SYM_OP_ENUM(name, text) SYM_##name,
    SYM_OPS(SYM_OP_ENUM)
#undef SYM_OP_ENUM
        SYM__NOPS
} SymOp;

/* Sticky failures: the first one sticks on the env, and every later call returns SYM_NONE / -1.
 * None of them is a Python exception: for the tracer each is "cannot compile this" (a graph break
 * or a static specialisation), never a crash. */
#define SYM_ERRORS(_)                                                  \
    _(OK, "no error")                                                  \
    _(NOMEM, "out of memory")                                          \
    _(OVERFLOW, "integer overflow in a size expression")               \
    _(ZERO_DIV, "division or modulo by zero in a size expression")     \
    _(TOO_BIG, "size expression too large")                            \
    _(BAD_ARG, "invalid argument to a size expression")

typedef enum {
#define SYM_ERR_ENUM(name, text) SYM_ERR_##name,
    SYM_ERRORS(SYM_ERR_ENUM)
#undef SYM_ERR_ENUM
        SYM_ERR__COUNT
} SymErr;

const char *em_sym_error_text(SymErr e);
const char *em_sym_op_name(SymOp op); /* the X-macro's spelling: "+", "//", "Min", "<=" ... */

typedef struct ShapeEnv ShapeEnv;

typedef struct ShapeEnvOptions {
    bool specialize_zero_one; /* sizes 0 and 1 stay constants (Dynamo's default: true) */
    bool duck_shape;          /* a new size whose hint equals an existing size symbol's hint is
                                 that symbol, guarded equal (Dynamo's duck shaping; default true) */
} ShapeEnvOptions;

ShapeEnv *em_sym_env_new(const ShapeEnvOptions *opts); /* opts NULL: Dynamo's defaults; NULL on OOM */
void em_sym_env_free(ShapeEnv *env);                     /* everything in one step; NULL is fine */
SymErr em_sym_env_error(const ShapeEnv *env);            /* the sticky failure, SYM_ERR_OK if none */

/* Constructors. Each returns the canonical, simplified expression under what the env knows now
 * (replacements, ranges, divisibility), or SYM_NONE after a failure (and for SYM_NONE operands). */
SymRef em_sym_const(ShapeEnv *env, int64_t k);
SymRef em_sym_add(ShapeEnv *env, SymRef a, SymRef b);
SymRef em_sym_sub(ShapeEnv *env, SymRef a, SymRef b);
SymRef em_sym_neg(ShapeEnv *env, SymRef a);
SymRef em_sym_mul(ShapeEnv *env, SymRef a, SymRef b);
SymRef em_sym_floordiv(ShapeEnv *env, SymRef a, SymRef b); /* a // b; b == 0 fails ZERO_DIV */
SymRef em_sym_mod(ShapeEnv *env, SymRef a, SymRef b);      /* a % b, Python semantics */
SymRef em_sym_min(ShapeEnv *env, SymRef a, SymRef b);
SymRef em_sym_max(ShapeEnv *env, SymRef a, SymRef b);
SymRef em_sym_cmp(ShapeEnv *env, SymOp op, SymRef a, SymRef b); /* op in EQ..GE; 0/1 when decided */
/* The binary op named op ("add" "sub" "mul" "floordiv" "mod" "min" "max" "==" "!=" "<" "<=" ">" ">=")
 * of a and b; *known = 0 (and SYM_NONE, no exception) for any other name. */
SymRef em_sym_binop_named(ShapeEnv *env, const char *op, SymRef a, SymRef b, int *known);
/* e rewritten under what the env knows now (a replacement or range learnt since e was built). */
SymRef em_sym_simplify(ShapeEnv *env, SymRef e);

/* Inspection. */
SymOp em_sym_op(const ShapeEnv *env, SymRef e);
bool em_sym_is_const(const ShapeEnv *env, SymRef e, int64_t *value); /* value may be NULL */
bool em_sym_has_symbols(const ShapeEnv *env, SymRef e);
/* The symbol index of a SYMBOL node, or -1 for any other expression. */
int64_t em_sym_symbol_index(const ShapeEnv *env, SymRef e);
/* The distinct symbols e mentions, ascending, into out[0 .. max) (the fx export's SymInt inputs);
 * returns how many there are (which may exceed max). */
uint32_t em_sym_free_symbols(const ShapeEnv *env, SymRef e, uint32_t *out, uint32_t max);
/* The structure of e, for code that rebuilds it elsewhere (the tracer's graph nodes): its operator,
 * its constant (*k: CONST's value, SYMBOL's index, ADD's constant term) and operand count (*n).
 * em_sym_operand gives operand i and its coefficient (ADD) or exponent (MUL) in *c (1 otherwise). */
SymOp em_sym_node(const ShapeEnv *env, SymRef e, int64_t *k, uint32_t *n);
SymRef em_sym_operand(const ShapeEnv *env, SymRef e, uint32_t i, int64_t *c);
/* Range [lo, hi] of e under the env's facts (SYM_NEG_INF / SYM_INF when unbounded). */
void em_sym_range(ShapeEnv *env, SymRef e, int64_t *lo, int64_t *hi);

/* ---- symbols and the size policy ---- */

typedef enum { SYM_KIND_SIZE, SYM_KIND_INT } SymKind; /* SIZE: never negative; INT: any int */

/* Dynamo's 0/1 specialisation: true when a dim or int of this value stays a constant. */
bool em_sym_specializes(const ShapeEnv *env, int64_t hint);

/* A size of an input (automatic dynamic or marked): the constant hint if em_sym_specializes,
 * the existing symbol under duck shaping, else a new symbol with range [max(lo, 2), hi].
 * source: Python text ("L['x'].size()[0]"), copied. lo/hi: user bounds (mark_dynamic min/max),
 * SYM_NEG_INF / SYM_INF for none. A hint outside [lo, hi] fails BAD_ARG. */
SymRef em_sym_new_size(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi);
/* The same, duck-shaped only if duck (and the env's duck_shape option): torch makes dims of
 * dynamic=True duck-shaped (DimDynamic.DUCK) and dims made dynamic automatically or by
 * mark_dynamic not (DimDynamic.DYNAMIC: a symbol of their own, related by the guards the program
 * needs). A duck size unifies only with earlier duck sizes. */
SymRef em_sym_new_size_as(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi, bool duck);
/* A Python int argument made symbolic: range unbounded unless given, no duck shaping, and 0/1 are
 * not specialised (torch's ShapeEnv.create_unspecified_symbol). */
SymRef em_sym_new_int(ShapeEnv *env, const char *source, int64_t hint, int64_t lo, int64_t hi);

uint32_t em_sym_nsymbols(const ShapeEnv *env);                /* symbols are 0 .. n-1 */
SymRef em_sym_symbol(const ShapeEnv *env, uint32_t i);        /* the SYMBOL node of symbol i */
const char *em_sym_symbol_source(const ShapeEnv *env, uint32_t i);
int64_t em_sym_symbol_hint(const ShapeEnv *env, uint32_t i);
/* An opaque tag the tracer attaches to symbol i (e.g. its guard fetch slot and dim); copied into
 * compiled programs (em_sym_prog_input_tag) so the guard stage knows how to fetch each input. */
void em_sym_set_symbol_tag(ShapeEnv *env, uint32_t i, uint64_t tag);
uint64_t em_sym_symbol_tag(const ShapeEnv *env, uint32_t i);
/* The expression symbol i was replaced by (after an equality guard, duck shaping or a range that
 * shrank to a point), or SYM_NONE while it stands for itself. */
SymRef em_sym_replacement(ShapeEnv *env, uint32_t i);

/* ---- evaluation ---- */

/* Evaluates e with values[i] for symbol i (Python semantics for // and %). Returns SYM_ERR_OK,
 * SYM_ERR_OVERFLOW (int64 overflow anywhere) or SYM_ERR_ZERO_DIV. Does not allocate or touch
 * the env's sticky state. */
SymErr em_sym_eval(const ShapeEnv *env, SymRef e, const int64_t *values, int64_t *out);
/* e evaluated on the symbols' hints (the example's sizes) without guarding. -1 on failure (sticky). */
int em_sym_hint(ShapeEnv *env, SymRef e, int64_t *out);

/* ---- guards ---- */

/* The tracer asks a question: cmp (from em_sym_cmp) is decided statically from what is known
 * (no guard), or evaluated on the hints, and the relation that held is recorded as a guard and
 * learnt (an equality becomes a replacement or a fact, an inequality narrows a range or a
 * relation's range, `e % k == 0` a divisibility). Returns 1 / 0, or -1 on a sticky failure. */
int em_sym_guard_bool(ShapeEnv *env, SymRef cmp);
/* Decided without guarding? 1 / 0, or -1 when it depends on the sizes. */
int em_sym_static_bool(ShapeEnv *env, SymRef cmp);
/* Specialise: guards e == its hint and returns the hint in *out (int() of a size). -1 on failure. */
int em_sym_guard_int(ShapeEnv *env, SymRef e, int64_t *out);

/* The guards an entry needs, after tracing: equalities for replaced symbols (`s1 == s0`,
 * `s0 == 5`), each symbol's range where it is narrower than its kind's (`2 <= s0`,
 * `s0 <= 64`), and every other recorded relation that is not already implied by those.
 * Items are valid until the next guard_bool / produce call. */
typedef enum { SYM_GUARD_REPLACEMENT, SYM_GUARD_RANGE, SYM_GUARD_RELATION } SymGuardKind;
typedef struct SymGuard {
    SymGuardKind kind;
    SymRef rel; /* a comparison node over unreplaced symbols (replacements: s_i == expr) */
} SymGuard;
uint32_t em_sym_produce_guards(ShapeEnv *env, const SymGuard **out); /* count; *out owned by env */

/* ---- rendering ---- */

/* SYMBOLS: graph metadata (`s0*s1`, `(s0//2)`, `Max(s0, s1)`, `Mod(s0, 4)`).
 * SOURCES: Python over the symbols' sources that eval() answers exactly like em_sym_eval
 * (`(L['x'].size()[0] * L['x'].size()[1]) % 4 == 0`, `min(...)`, parenthesised by precedence). */
typedef enum { SYM_STYLE_SYMBOLS, SYM_STYLE_SOURCES } SymStyle;
/* snprintf-like: writes at most size bytes (always NUL-terminated when size > 0) and returns the
 * length the full text needs. */
size_t em_sym_render(const ShapeEnv *env, SymRef e, SymStyle style, char *buf, size_t size);

/* ---- guard programs: what the guard stage runs on every call ---- */

/* A postfix program over an int64 value per symbol, checking every produced guard. Self-contained
 * (one malloc'd block, no pointer into the env): it outlives the trace. NULL on failure (sticky). */
typedef struct SymProg SymProg;
SymProg *em_sym_prog_compile(ShapeEnv *env);
void em_sym_prog_free(SymProg *p);
uint32_t em_sym_prog_ninputs(const SymProg *p); /* = em_sym_nsymbols at compile time */
uint32_t em_sym_prog_nchecks(const SymProg *p);
uint64_t em_sym_prog_input_tag(const SymProg *p, uint32_t i); /* symbol i's tag at compile time */
/* -1 when every check holds, else the index of the first failing check (an overflow fails the
 * check it happens in). No allocation; values has em_sym_prog_ninputs entries. */
int em_sym_prog_check(const SymProg *p, const int64_t *values);
/* Size expressions compiled the same way, for a runtime that needs their values per call (the CUDA
 * launch: grid, output layout): out[i] = exprs[i] under this call's symbol values. Free with
 * em_sym_prog_free; em_sym_prog_nchecks gives n. eval: 0, or -1 when an expression overflows or
 * divides by zero (no allocation). */
SymProg *em_sym_exprs_compile(ShapeEnv *env, const SymRef *exprs, uint32_t n);
int em_sym_exprs_eval(const SymProg *p, const int64_t *values, int64_t *out);

/* ---- shape rules the tracer calls (torch's own formulas, guarded as Dynamo guards them) ----
 * Each returns 0 on success, SYM_SHAPE_ERROR when eager would raise for these sizes (the
 * relations that decided so are recorded as guards), or -1 on a sticky failure. */
#define SYM_SHAPE_ERROR 1

/* torch._refs._broadcast_shapes for one dim: a == 1 ? b : (b != 1 ? check a == b : a). */
int em_sym_broadcast(ShapeEnv *env, SymRef a, SymRef b, SymRef *out);
/* Right-aligned broadcast of two shapes; out has max(na, nb) entries. */
int em_sym_broadcast_shapes(ShapeEnv *env, const SymRef *a, uint32_t na, const SymRef *b, uint32_t nb,
                            SymRef *out);
/* torch._prims_common.make_contiguous_strides_for: stride[i] = prod(max(size[j], 1), j > i). */
int em_sym_contiguous_strides(ShapeEnv *env, const SymRef *sizes, uint32_t n, SymRef *strides);
/* Dense strides for sizes in the dim order of hint_strides (a tensor's example strides: innermost
 * first, ties keeping the inner dim first, as torch's infer_dense_strides), for a result whose
 * layout the kernel picks (attention's (B, S, H, D) memory); order (may be NULL): the dims,
 * innermost first. n <= 64; -1 past that or on failure. */
int em_sym_dense_strides(ShapeEnv *env, const int64_t *hint_strides, const SymRef *sizes, uint32_t n, SymRef *strides,
                         int32_t *order);
SymRef em_sym_numel(ShapeEnv *env, const SymRef *sizes, uint32_t n);
/* torch._prims_common.infer_size: shape may hold one constant -1; guards numel % known == 0. */
int em_sym_reshape(ShapeEnv *env, SymRef numel, const SymRef *shape, uint32_t n, SymRef *out);
/* The size of x[start:stop:step] along a dim of size len (aten.slice.Tensor): start/stop may be
 * SYM_NONE for "omitted"; negative ones wrap (the sign is guarded unless static); clamping is
 * Min/Max, not guards. step must be a positive constant or expression. */
int em_sym_slice(ShapeEnv *env, SymRef len, SymRef start, SymRef stop, SymRef step, SymRef *out);
/* Convolution/pooling output size: (in + 2*pad - dil*(k-1) - 1) // stride + 1; eager raises for
 * a result < 1 (guarded). */
int em_sym_conv_out(ShapeEnv *env, SymRef in, SymRef kernel, SymRef stride, SymRef pad, SymRef dil,
                    SymRef *out);
/* torch.matmul shapes (1-D, 2-D, batched with broadcast batch dims); inner dims guarded equal. */
int em_sym_matmul_shape(ShapeEnv *env, const SymRef *a, uint32_t na, const SymRef *b, uint32_t nb,
                        SymRef *out, uint32_t *nout);
/* torch.cat along dim of k shapes of rank n each: sizes summed on dim, other dims guarded equal. */
int em_sym_cat_shape(ShapeEnv *env, const SymRef *const *shapes, uint32_t k, uint32_t n, uint32_t dim,
                     SymRef *out);

/* Test support (em_sym_testing.c): ember._C._sym_eval / _sym_guards / _sym_bench, not public
 * API; registered by em_module.c. */
int em_sym_testing_init(PyObject *module);

#endif /* EM_SYM_H */
