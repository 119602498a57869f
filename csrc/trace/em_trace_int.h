/* trace, private: abstract values, trace frames and the trace state shared by em_trace*.c.
 * Invariant: every TValue, frame and recorded node lives in the trace's arena; every PyObject a
 * value points at is held by that arena (em_arena_hold), so nothing here needs a DECREF. All
 * interpreter state (per-frame pc, stack, locals, pending KW_NAMES) lives in TFrame structs linked
 * by `parent`, so a later issue can split a frame at a break and resume after it. */
#ifndef EM_TRACE_INT_H
#define EM_TRACE_INT_H

#include "trace/em_trace.h"

/* ---- instruction kinds: our own enum, mapped from opcode *names* at init, so one C file serves
 * 3.11, 3.12 and 3.13 (their opcode numbers differ; a name a version lacks maps to no opcode there).
 * OP__UNKNOWN covers every name not listed. ---- */
#define TR_OPCODES(_)                                                                          \
    _(CACHE) _(POP_TOP) _(PUSH_NULL) _(NOP) _(RESUME) _(EXTENDED_ARG) _(COPY) _(SWAP)        \
    _(UNARY_POSITIVE) _(UNARY_NEGATIVE) _(UNARY_NOT) _(UNARY_INVERT) _(BINARY_OP)           \
    _(BINARY_SUBSCR) _(STORE_SUBSCR) _(DELETE_SUBSCR) _(BINARY_SLICE) _(STORE_SLICE)          \
    _(GET_ITER) _(FOR_ITER) _(END_FOR) _(LOAD_BUILD_CLASS) _(LOAD_ASSERTION_ERROR)           \
    _(RETURN_GENERATOR) _(RETURN_VALUE) _(RETURN_CONST) _(LIST_TO_TUPLE) _(YIELD_VALUE)      \
    _(UNPACK_SEQUENCE) _(UNPACK_EX) _(STORE_ATTR) _(DELETE_ATTR) _(STORE_GLOBAL)             \
    _(DELETE_GLOBAL) _(LOAD_CONST) _(LOAD_NAME) _(STORE_NAME) _(BUILD_TUPLE) _(BUILD_LIST)   \
    _(BUILD_SET) _(BUILD_MAP) _(BUILD_CONST_KEY_MAP) _(BUILD_SLICE) _(BUILD_STRING)          \
    _(LOAD_ATTR) _(LOAD_METHOD) _(LOAD_SUPER_ATTR) _(COMPARE_OP) _(IS_OP) _(CONTAINS_OP)     \
    _(JUMP_FORWARD) _(JUMP_BACKWARD) _(JUMP_BACKWARD_NO_INTERRUPT) _(JUMP_IF_FALSE_OR_POP)   \
    _(JUMP_IF_TRUE_OR_POP) _(POP_JUMP_IF_FALSE) _(POP_JUMP_IF_TRUE) _(POP_JUMP_IF_NONE)      \
    _(POP_JUMP_IF_NOT_NONE) _(POP_JUMP_FORWARD_IF_FALSE) _(POP_JUMP_FORWARD_IF_TRUE)         \
    _(POP_JUMP_FORWARD_IF_NONE) _(POP_JUMP_FORWARD_IF_NOT_NONE)                              \
    _(POP_JUMP_BACKWARD_IF_FALSE) _(POP_JUMP_BACKWARD_IF_TRUE) _(POP_JUMP_BACKWARD_IF_NONE)  \
    _(POP_JUMP_BACKWARD_IF_NOT_NONE) _(LOAD_GLOBAL) _(LOAD_FAST) _(LOAD_FAST_CHECK)          \
    _(LOAD_FAST_AND_CLEAR) _(STORE_FAST) _(DELETE_FAST) _(MAKE_CELL) _(LOAD_CLOSURE)         \
    _(LOAD_DEREF) _(STORE_DEREF) _(DELETE_DEREF) _(COPY_FREE_VARS) _(RAISE_VARARGS)          \
    _(MAKE_FUNCTION) _(CALL_FUNCTION_EX) _(PRECALL) _(CALL) _(KW_NAMES) _(CALL_INTRINSIC_1)  \
    _(LIST_APPEND) _(LIST_EXTEND) _(SET_ADD) _(SET_UPDATE) _(MAP_ADD) _(DICT_MERGE)          \
    _(DICT_UPDATE) _(FORMAT_VALUE) _(RERAISE) _(SEND) _(GET_YIELD_FROM_ITER) _(IMPORT_NAME)   \
    _(IMPORT_FROM) _(BEFORE_WITH) _(PUSH_EXC_INFO) _(POP_EXCEPT) _(CHECK_EXC_MATCH)          \
    _(WITH_EXCEPT_START) _(TO_BOOL) _(CALL_KW) _(LOAD_FAST_LOAD_FAST) _(STORE_FAST_STORE_FAST)        \
    _(STORE_FAST_LOAD_FAST) _(FORMAT_SIMPLE) _(FORMAT_WITH_SPEC) _(CONVERT_VALUE)                      \
    _(SET_FUNCTION_ATTRIBUTE)

typedef enum {
    OP__UNKNOWN = 0,
#define TR_OP_ENUM(name) OP_##name,
    TR_OPCODES(TR_OP_ENUM)
#undef TR_OP_ENUM
        OP__COUNT
} TrOp;

/* One decoded instruction (CACHE entries and EXTENDED_ARG folded away). */
typedef struct TInstr {
    uint16_t op;      /* TrOp */
    uint8_t opcode;   /* the real opcode (for opname in break reports) */
    int32_t arg;      /* with EXTENDED_ARG prefixes applied */
    uint32_t offset;  /* byte offset of the instruction itself (after its EXTENDED_ARGs) */
    uint32_t start;   /* byte offset of its first EXTENDED_ARG (jump targets land here) */
    int32_t target;   /* jumps: instruction index of the target, else -1 */
} TInstr;

/* ---- abstract values ---- */
typedef enum {
    TV_NULL,          /* the NULL a call sequence pushes (PUSH_NULL, LOAD_GLOBAL bit 0) / unbound */
    TV_LAZY,          /* a real object from a frame input, not yet looked at: obj + src */
    TV_TENSOR,        /* graph value: t.ref (0 = input not yet a placeholder) + t.meta */
    TV_CONST,         /* an immutable Python object (None, bool, int, float, str, dtype, Size ...) */
    TV_TUPLE,         /* seq: items; seq.cls = namedtuple/structseq class or NULL */
    TV_LIST,          /* seq: items; mutable only if created in the trace */
    TV_DICT,          /* dict: constant keys (in order), values */
    TV_NN_MODULE,     /* obj: the nn.Module */
    TV_FUNCTION,      /* obj: a real function, or fn.* for one made by MAKE_FUNCTION */
    TV_BOUND_METHOD,  /* bm.self + bm.func (a FUNCTION value), or bm.func NULL and bm.name: a
                         builtin method (list.append, dict.get, str.format) on bm.self */
    TV_TENSOR_METHOD, /* tm.self (TENSOR) + tm.name */
    TV_OBJECT,        /* obj: an opaque Python object (torch functions, classes, Python modules,
                         builtins, operator.*, user objects) */
    TV_CELL,          /* cell.contents (NULL = empty); cell.input: a real cell of a frame input */
    TV_ITERATOR,      /* it.* */
    TV_SLICE,         /* sl.start/stop/step */
    TV_SUPER,         /* sup.self + sup.cls: super(cls, self) */
    TV_GRAD_MODE,     /* gm: a grad-mode context manager (torch.no_grad(), enable_grad(),
                         set_grad_enabled(b)) or, gm.exit, the __exit__ that BEFORE_WITH pushed */
    TV_AUTOCAST,      /* ac: a torch.autocast(...) made in the trace or, ac.exit, the __exit__ that
                         BEFORE_WITH pushed (em_trace_call.c) */
    TV_SYMINT,        /* si.e: a Python int that is a size expression over the trace's symbols
                         (x.shape[0], x.size(1) // 2); em_trace_sym.c */
    TV_INSTANCE,      /* inst: an object of a Python class constructed in the trace (dataclasses,
                         ModelOutput, context managers): attributes and, for dict subclasses,
                         items are trace values (em_trace_obj.c) */
    TV_NDARRAY,       /* t (as TENSOR): a NumPy array viewing that graph value (Tensor.numpy() and
                         NumPy calls on it; npscalar: a NumPy scalar), em_trace_numpy.c */
    TV_SYMFLOAT       /* sf: a Python float computed from symbolic ints (`n / 2`, `float(n)`): a
                         graph node, its hint, and the size expressions it reads (em_trace_sym.c) */
} TVKind;

typedef enum {
    IT_ARRAY,  /* over a snapshot it.items[0..n) */
    IT_LIST,   /* live over it.base (a TV_LIST), like list_iterator */
    IT_GEN,    /* a generator function call not yet run: it.genfn + it.genlocals */
} TIterKind;

typedef struct TValue TValue;
struct TFrame;
struct TValue {
    TVKind kind;
    GuardSrc src;      /* where the value came from; -1 if made in the trace */
    bool stable;       /* identity fixed by other guards (globals, module dicts): no ID/EQUALS */
    bool guarded;      /* the use-guard (EQUALS/ID) was added */
    bool mutable;      /* LIST/DICT/CELL created in the trace (may be mutated) */
    bool replayed;     /* an input LIST/DICT mutated in the trace: its final contents are written
                          back into the caller's object after the graph (em_trace_effects.c) */
    bool aliased;      /* an input LIST/DICT whose object was realized through another path too */
    bool npscalar;     /* NDARRAY: a 0-d result NumPy gives as a scalar (np.sum(a), a[0, 0]) */
    bool symbool;      /* SYMINT: a comparison of sizes (`n > 3`, a SymBool: 0 or 1), a Python bool. It
                          stays symbolic only as a tensor op's argument (`x + (n > 3)`); a branch
                          guards it, any other use specialises it (em_trace_sym.c) */
    bool by_type;      /* OBJECT: an instance of a Python class from an input, guarded by its type and by
                          what the trace reads from it (attributes through sources), not by identity:
                          objects built on every call (a dataclass, a cache, an output) must not
                          recompile every call. em_tr_use adds the identity guard where the
                          program's meaning depends on identity (em_trace_value.c, by_type_object) */
    PyObject *obj;     /* LAZY/CONST/NN_MODULE/OBJECT/FUNCTION(real): the object (held).
                          TENSOR input: the real tensor. TUPLE from a torch op: the meta result. */
    union {
        struct { uint32_t ref; IRMeta *meta; } t;
        struct { TValue **items; uint32_t n, cap; PyObject *cls; } seq;
        struct { PyObject **keys; TValue **vals; uint32_t n, cap; } dict;
        struct {
            PyCodeObject *code; PyObject *globals; PyObject *name;
            TValue *defaults;    /* TUPLE or NULL */
            TValue *kwdefaults;  /* DICT or NULL */
            TValue *closure;     /* TUPLE of CELL or NULL */
            GuardSrc gsrc;       /* source of the globals dict; -2: the frame's globals */
        } fn;
        struct { TValue *self; TValue *func; PyObject *name; } bm;
        struct { TValue *self; PyObject *name; } tm;
        struct {
            TValue *contents;
            GuardSrc self;  /* has_self: the source of the real cell (a frame or function closure's),
                               so that a `nonlocal` store can be replayed into it */
            bool has_self;
        } cell;
        struct {
            TIterKind kind; TValue **items; uint32_t n, pos; TValue *base;
            struct TFrame *genframe; /* IT_GEN: the bound, not yet run generator frame */
        } it;
        struct { TValue *start, *stop, *step; } sl;
        struct { uint32_t e; } si; /* SymRef in Trace.env */
        struct { uint32_t ref; double hint; uint32_t deps[4]; uint32_t ndeps; } sf; /* deps: SymRefs */
        struct { TValue *self; PyObject *cls; } sup;
        struct {
            bool mode;    /* grad mode inside the block */
            bool prev;    /* grad mode to restore on exit (set when entered / applied) */
            bool applied; /* set_grad_enabled(b): the mode changed at construction */
            bool exit;    /* this value is the bound __exit__ */
        } gm;
        struct {
            PyObject *mgr;  /* the real torch.autocast object, made at trace time (arena-held) */
            uint32_t enter; /* exit: the graph's _enter_autocast node */
            int depth;      /* exit: its index in Trace.ac_open */
            bool exit;      /* this value is the bound __exit__ */
        } ac;
        struct {
            PyObject *cls;       /* the class (held) */
            TValue *attrs;       /* DICT: the instance __dict__ */
            TValue *items;       /* DICT: the dict part of a dict subclass, else NULL */
            TValue *args;        /* TUPLE: positional arguments of the construction */
            PyObject *kwnames;   /* keyword names of the construction (tuple) or NULL */
            TValue **kwvals;
            bool constructed;    /* __init__ returned */
            bool dirty;          /* mutated after __init__: cannot be rebuilt by calling cls */
            bool input;          /* an input object read by its contents (em_trace_value.c,
                                    input_instance): v->obj is the object, v->src its source; a
                                    mutation breaks, and it leaves the frame as itself */
        } inst;
    } u;
};

/* ---- recorded nodes (our own list; turned into an IRGraph at the end so that placeholders come
 * first even though inputs are discovered mid-trace). Refs are 1-based indices into Trace.nodes. */
typedef struct TNode {
    IRKind kind;
    PyObject *target;
    IRArg *args;
    uint32_t nargs, nkw;
    PyObject **kwnames;
    IRArg *kwargs;
    IRMeta meta;
    int32_t lineno;
    PyObject *filename;
    GuardSrc src;        /* PLACEHOLDER: the input's source */
    PyObject *real;      /* PLACEHOLDER: the real value (example input) */
    const char *pname;   /* PLACEHOLDER: name hint */
} TNode;

/* ---- trace frames ---- */
typedef struct TFrame {
    struct TFrame *parent;
    PyCodeObject *code;
    PyObject *globals, *builtins;
    GuardSrc gsrc;          /* -2: the traced frame's globals (G[...]); -1: none; else the dict */
    TInstr *ins;
    uint32_t nins;
    int32_t *off2ins;       /* code unit -> instruction index (-1 inside an instruction) */
    uint32_t pc;            /* index of the instruction being executed */
    TValue **locals;
    int nlocals;
    TValue **stack;
    int sp, stackcap;
    PyObject *kwnames;      /* pending KW_NAMES tuple (borrowed from co_consts) */
    int depth;
    bool is_gen;            /* running a generator: YIELD_VALUE collects into yields */
    bool lazy;              /* ... one item at a time: em_tr_run_frame returns 1 at each yield */
    struct { TValue **items; uint32_t n, cap; } yields;
    TValue *retval;         /* set by RETURN_* */
    bool returned;
    struct TExcEntry *exctab; /* exception table (em_trace_exc.c), nexc entries */
    uint32_t nexc;
} TFrame;

/* One exception-table entry, in instruction indices: [start, end) is covered, target the handler,
 * depth the value stack depth to unwind to, lasti whether the raising offset is pushed first
 * (Objects/exception_handling_notes.txt). */
typedef struct TExcEntry {
    uint32_t start, end;
    int32_t target;
    int depth;
    bool lasti;
} TExcEntry;

/* Objects looked up once at init (owned references, process lifetime; ember supports one
 * interpreter, em_module.c). */
enum { TR_NBINOPS = 26, TR_NCMP = 6, TR_MAX_AUTOCAST = 8 };
typedef struct TraceRT {
    bool ready;
    uint8_t op_of[256];            /* opcode -> TrOp */
    uint8_t ncache[256];           /* opcode -> inline cache entries */
    bool jrel[256], jback[256];
    PyObject *opname[256];
    PyObject *torch, *Tensor, *TensorBase, *Parameter, *Module, *Size, *dtype_type, *device_type;
    PyObject *set_grad_enabled, *is_grad_enabled, *get_default_device;
    PyObject *is_any_autocast_enabled; /* torch._C._is_any_autocast_enabled (NULL on a torch without it) */
    PyObject *no_grad_cls, *enable_grad_cls, *set_grad_enabled_cls; /* torch.no_grad ... (classes) */
    PyObject *autocast_cls;        /* torch.autocast (torch.amp.autocast_mode.autocast); NULL: absent */
    PyObject *autocast_legacy[2];  /* torch.cuda.amp.autocast, torch.cpu.amp.autocast (deprecated
                                      subclasses with the same __enter__/__exit__); NULL: absent */
    PyObject *enter_autocast, *exit_autocast; /* torch.amp.autocast_mode._enter_autocast, _exit_autocast */
    PyObject *module_call;         /* torch.nn.Module.__call__ */
    PyObject *global_hooks[4];     /* torch.nn.modules.module._global_*_hooks dicts */
    PyObject *ModuleList, *Sequential, *ModuleDict;
    PyObject *mod_modules, *mod_children, *mod_named_children, *mod_named_modules; /* Module.* */
    PyObject *binop_fn[TR_NBINOPS];/* operator.add ... operator.ixor in NB_* order */
    PyObject *cmp_fn[TR_NCMP];     /* operator.lt le eq ne gt ge */
    PyObject *op_neg, *op_pos, *op_invert, *op_not, *op_getitem, *op_setitem, *op_delitem,
        *op_contains, *op_truth, *op_abs;
    PyObject *builtins_dict;
    PyObject *operator_mod, *math_mod;
    PyObject *bi_table;            /* dict: id(builtin) -> BI_* int */
    PyObject *torch_query;         /* dict: id(torch query function) -> TQ_* int */
    PyObject *torch_factory;       /* dict: id(factory) -> True */
    PyObject *pure_classes;        /* tuple of classes whose construction from constants is pure */
    PyObject *meta_str;            /* "meta" */
    PyObject *meta_device;         /* torch.device("meta") */
    PyObject *inspect_signature, *inspect_Signature, *inspect_Parameter; /* inspect.* (immutable results) */
    PyObject *copy_deepcopy, *copy_copy; /* copy.deepcopy, copy.copy (em_trace_obj.c) */
    PyObject *enum_Enum;           /* enum.Enum: members are immutable singletons (constants) */
} TraceRT;
extern TraceRT em_trace_rt;

/* A side effect recorded for replay after the graph (em_trace_effects.c). */
typedef struct TEffect {
    int kind;              /* 1: obj.name = value; 2: globals[name] = value; 3: obj[:] = value
                              (an input list/dict takes its final contents; name is Ellipsis) */
    TValue *target;        /* the object (attribute stores) */
    PyObject *obj;         /* the real object / the globals dict (identity key; held) */
    PyObject *name;
    TValue *value;
} TEffect;

typedef struct Trace {
    EmArena *arena;
    GuardBuilder *gb;
    const EmFrameView *fv;
    EmTraceOptions opts;
    EmTraceResult *res;
    PyObject *func;
    TFrame *cur, *top;
    struct { TNode *items; uint32_t n, cap; } nodes;  /* items[0] unused */
    struct { uint32_t *items; uint32_t n, cap; } inputs;
    struct { TValue **items; uint32_t n, cap; } by_src;  /* GuardSrc -> wrapped value */
    /* dict guards recorded, in order, and a table (dict, key) -> index + 1 over them (0: empty) */
    struct { struct TDictGuard { PyObject *dict; GuardSrc owner; const char *how; PyObject *key; } *items; uint32_t n, cap; } dguards;
    struct { uint32_t *slots; uint32_t cap; } dguard_ht;
    long loop_iters, ninstr;
    bool broke;
    bool grad_enabled;      /* grad mode at the current instruction */
    bool autocast;          /* torch.autocast on for some device: metas come from fake tensors (run_meta) */
    bool grad_changed;      /* the graph has a set-grad-mode node */
    bool grad_with;         /* ... made by a with-block (restored if the graph raises) */
    bool grad_statement;    /* ... made by a torch.set_grad_enabled(b) statement (never restored) */
    /* torch.autocast with-blocks: the _UnmanagedAutocast objects entered for real while tracing
     * (so that fake-tensor metas get the block's dtypes), innermost last; the trace's end exits
     * those still open */
    PyObject *ac_open[TR_MAX_AUTOCAST];
    int n_ac_open;
    long ac_top_step;       /* -1, or the top-frame step of the BEFORE_WITH of the outermost open
                               block: a break inside it splits the frame there (em_tr_break) */
    int ac_top_depth;       /* n_ac_open before that block was entered */
    TValue *null_value;
    struct { struct TEffect *items; uint32_t n, cap; } effects; /* side effects to replay */
    struct { TValue **items; uint32_t n, cap; } containers;     /* input lists/dicts realized */
    struct { TValue **items; uint32_t n, cap; } objects;        /* input objects realized (by_type) */
    long stop_at;           /* -1, or the top-frame instruction step at which to split */
    EmBreak split_reason;   /* when splitting: the reason the first trace broke there */
    long top_steps;         /* top-frame instructions started so far */
    PyObject *exc;          /* the exception a RAISE break stands for, when the trace knows it (a real
                               instance, held): a handler of an enclosing try block may catch it */
    TValue *exc_info;       /* the exception being handled (PUSH_EXC_INFO .. POP_EXCEPT), or NULL */
    /* attribute stores on real objects, held as an overlay that later reads see; the trace is
     * kept only when every one ends where it began (a value set and restored by try/finally),
     * em_tr_overlay_check */
    struct TAttrStore {
        PyObject *obj, *name, *orig;
        TValue *val;
        long top_step;      /* the top-frame instruction in progress at the first store */
    } *stores;
    uint32_t nstores, capstores;
    /* symbolic shapes (em_trace_sym.c): NULL env until an input dim is made dynamic */
    struct ShapeEnv *env;
    /* per symbol: where it is read. A size: tensor t's dim; an int argument: dim -1, t NULL, and
     * ref its placeholder node once the graph needs the value (0 before) */
    struct TSymSrc { TValue *t; int32_t dim; GuardSrc src; uint32_t ref; } *symsrc;
    uint32_t capsymsrc;
    uint32_t *symnode;      /* SymRef -> node computing it (0: none yet) */
    uint32_t capsymnode;
    PyObject *sym_ctx;      /* ember._fake.SymContext of this trace (held by the arena), or NULL */
    PyObject *sym_notes;    /* list of str: which dims are symbolic and why, what was specialised */
    PyObject *sym_fake;     /* list of str: ops whose symbolic sizes came from the fake-tensor run */
} Trace;

/* Building the return value (or the values live at a graph break) from abstract values. */
typedef struct OutCtx {
    struct { uint32_t *items; uint32_t n, cap; } refs;       /* graph outputs */
    bool split;                                              /* values at a graph break */
    struct { TValue **items; uint32_t n, cap; } seen;        /* mutable containers rebuilt */
    TValue **cells;                                          /* split: the frame's cells, in the */
    uint32_t ncells;                                         /*   order of the resume closure */
} OutCtx;

/* ---- exception save/restore (em_core.h: 3.11's Fetch/Restore, 3.12's GetRaisedException) ---- */
static inline PyObject *em_tr_exc_get(void) { return em_exc_take(); }
static inline void em_tr_exc_set(PyObject *e) { em_exc_restore(e); }

/* ---- em_trace.c ---- */
/* Records a break (first one wins) at the current instruction. Returns -1 so callers can
 * `return em_tr_break(...)`. The detail is printf-formatted; %U takes a PyObject* like
 * PyUnicode_FromFormat. Never raises (a pending MemoryError stays pending). */
int em_tr_break(Trace *T, EmBreak reason, const char *fmt, ...);
/* Turns an unexpected pending Python exception into a break: MemoryError/KeyboardInterrupt stay
 * pending (return -1 propagates), others become `reason` with the exception text. */
int em_tr_break_exc(Trace *T, EmBreak reason);
/* Runs one frame's instructions until it returns (0) or breaks / fails (-1); a lazy generator
 * frame also returns (1) after each yield, to be resumed by calling this again. */
int em_tr_run_frame(Trace *T, TFrame *F);
/* Makes a frame for code with locals array already sized; NULL on OOM. */
TFrame *em_tr_frame_new(Trace *T, PyCodeObject *code, PyObject *globals, PyObject *builtins, GuardSrc gsrc);
const char *em_tr_repr_cstr(Trace *T, PyObject *o); /* arena copy of repr(o), never NULL */

int em_tr_out_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth);
/* Turns the recorded nodes into res->graph with C's graph outputs. */
int em_tr_finish_graph(Trace *T, OutCtx *C);

/* ---- em_trace_resume.c ---- */
/* Splits the traced frame before the top frame's current instruction: finishes the graph of
 * everything traced so far, describes the live values, and builds the stub and the resume
 * functions' code (res->split). -1 with a break recorded when the state cannot be rebuilt. */
int em_tr_split_here(Trace *T, TFrame *F);
/* out_spec for values at a break: 0 done, -1 break/error, 1 not handled (the general case). */
int em_tr_split_value_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth);

/* ---- em_trace_effects.c ---- */
/* Records `target.name = value` for replay, or records a SIDE_EFFECT break (-1). */
int em_tr_effect_store_attr(Trace *T, TValue *target, PyObject *name, TValue *value);
/* Records `name = value` in the frame's globals for replay, or breaks (-1). */
int em_tr_effect_store_global(Trace *T, TFrame *F, PyObject *name, TValue *value);
/* The value a recorded store gave v.name / the global name, or NULL when none. */
TValue *em_tr_effect_attr(Trace *T, TValue *v, PyObject *name);
TValue *em_tr_effect_global(Trace *T, TFrame *F, PyObject *name);
/* An input list/dict (c->src >= 0) is about to be mutated by `what`: records the write-back of
 * its final contents (once), or a SIDE_EFFECT break (-1) when that would not be exact. */
int em_tr_effect_container(Trace *T, TValue *c, const char *what);
/* Registers an input list/dict just realized; -1 (break) when its object was already mutated in
 * the trace through another path, whose view this one would not see. */
int em_tr_effect_container_seen(Trace *T, TValue *c);
/* `nonlocal name = value` on a cell of a closure from outside the trace: recorded for replay
 * (`cell.cell_contents = value` after the graph), or a SIDE_EFFECT break (-1). */
int em_tr_effect_store_cell(Trace *T, TValue *cell, TValue *value);
/* The CELL value already made for the real cell object, or NULL: one value per cell, so that
 * every closure sharing it sees the trace's stores. */
TValue *em_tr_effect_cell_of(Trace *T, PyObject *cellobj);
/* Builds res->effects / res->effect_names (nothing when no effect was recorded). */
int em_tr_effects_spec(Trace *T, OutCtx *C);

/* ---- em_trace_attr.c: values for functions found by attribute lookups ---- */
/* A real Python function f (identity-stable), with source src or -1. */
TValue *em_tr_function_value(Trace *T, PyObject *f, GuardSrc src);
/* The method func bound to self. */
TValue *em_tr_bound(Trace *T, TValue *self, TValue *func);

/* ---- em_trace_value.c ---- */
TValue *em_tr_new(Trace *T, TVKind kind);
TValue *em_tr_const(Trace *T, PyObject *obj);             /* held; CONST, or TUPLE of CONST */
TValue *em_tr_const_steal(Trace *T, PyObject *obj);       /* NULL-safe: NULL in -> NULL out */
TValue *em_tr_object(Trace *T, PyObject *obj, GuardSrc src);
/* Wraps a real object reached through a source (src may be -1 for objects reached through
 * guarded constants). stable: its identity is fixed by dict-version guards. Values with a source
 * are cached per source, so one source always gives one value. */
TValue *em_tr_wrap(Trace *T, PyObject *obj, GuardSrc src, bool stable);
/* Turns a TV_LAZY value into its real kind in place, adding the guards its kind needs. Other
 * kinds are returned unchanged. NULL on break. */
TValue *em_tr_realize(Trace *T, TValue *v);
/* The value is about to be used as a Python value (arithmetic, branch, argument of a graph node):
 * adds EQUALS/ID for values from unstable sources. -1 on break/error. */
int em_tr_use(Trace *T, TValue *v);
TValue *em_tr_tuple(Trace *T, TValue **items, uint32_t n);
TValue *em_tr_list(Trace *T, TValue **items, uint32_t n);  /* mutable, trace-local */
TValue *em_tr_dict(Trace *T);                               /* mutable, trace-local, empty */
int em_tr_list_push(Trace *T, TValue *l, TValue *v);
int em_tr_dict_set(Trace *T, TValue *d, PyObject *key, TValue *v);
TValue *em_tr_dict_get(TValue *d, PyObject *key);          /* NULL if absent */
/* The key a value stands for in a dict of the trace: a constant (guarded by its value), or a
 * class or other object hashed and compared by identity (guarded by identity); else a break. */
PyObject *em_tr_dict_key(Trace *T, TValue *k);
/* A dict's key as a value (iteration, keys(), items()): a constant, or the identity-keyed object
 * itself as a stable value (its dict's guard keeps it in place). */
TValue *em_tr_dict_key_value(Trace *T, PyObject *key);
/* `int | None`, `list[int]` (types.UnionType, types.GenericAlias): immutable type expressions. */
bool em_tr_is_type_expression(PyObject *o);
TValue *em_tr_tensor(Trace *T, uint32_t ref, const IRMeta *meta);
/* The tensor's node ref, creating its placeholder if it is a not-yet-used input. 0 on failure. */
uint32_t em_tr_tensor_ref(Trace *T, TValue *v);
/* Items of a sequence-like value (TUPLE, LIST, CONST tuple/list/Size/range/str, DICT keys,
 * ITERATOR (consumed), generator (run), ModuleList/Sequential/ModuleDict modules, tensor dim 0).
 * *items is an arena array. -1 on break. */
int em_tr_items(Trace *T, TValue *v, TValue ***items, uint32_t *n);
/* Truthiness; -1 on break (tensors: DATA_DEPENDENT_BRANCH). */
int em_tr_truth(Trace *T, TValue *v, bool *out);
/* Python type of the value, borrowed (NULL on break). */
PyObject *em_tr_type_of(Trace *T, TValue *v);
/* Python object for a value built only of constants (for trace-time evaluation); NULL (no break
 * recorded, no exception) if it is not constant. New reference. */
PyObject *em_tr_to_py_const(Trace *T, TValue *v);
/* The tuple of keyword names that CALL_KW (3.13) takes from the stack, held by the trace's arena
 * (borrowed); NULL with a break recorded if v is not one. */
PyObject *em_tr_kwnames_operand(Trace *T, TValue *v);
TValue *em_tr_iter(Trace *T, TValue *v);                   /* GET_ITER; NULL on break */
/* FOR_ITER/next: 1 with *out, 0 when exhausted, -1 on break. */
int em_tr_iter_next(Trace *T, TValue *it, TValue **out);
TValue *em_tr_from_py(Trace *T, PyObject *o);             /* result of trace-time evaluation */

/* ---- em_trace_call.c ---- */
/* Calls callee with positional args[0..nargs) and keyword values kwvals (names in kwnames, a
 * tuple of str, or NULL). Returns the result value, or NULL on break/error. */
TValue *em_tr_call(Trace *T, TValue *callee, TValue **args, uint32_t nargs, PyObject *kwnames,
                   TValue **kwvals);
/* A graph node for a Python operator on tensors, or trace-time evaluation on constants. */
TValue *em_tr_binop(Trace *T, int nb, TValue *a, TValue *b);
TValue *em_tr_compare(Trace *T, int cmp, TValue *a, TValue *b);
TValue *em_tr_unary(Trace *T, PyObject *opfn, TValue *a);
TValue *em_tr_getitem(Trace *T, TValue *c, TValue *key);
int em_tr_setitem(Trace *T, TValue *c, TValue *key, TValue *v);
TValue *em_tr_contains(Trace *T, TValue *c, TValue *item);
/* Inlines a function value with arguments (self already prepended when it is a method). */
TValue *em_tr_inline(Trace *T, TValue *fn, TValue **args, uint32_t nargs, PyObject *kwnames,
                     TValue **kwvals);
/* Runs a generator iterator (IT_GEN) to exhaustion; the yielded values. -1 on break. */
int em_tr_run_generator(Trace *T, TValue *it, TValue ***items, uint32_t *n);
/* Calls a torch callable (target) or a tensor method (method name, args[0] = self) as a graph
 * node with meta inference. */
TValue *em_tr_torch_call(Trace *T, IRKind kind, PyObject *target, TValue **args, uint32_t nargs,
                         PyObject *kwnames, TValue **kwvals);

/* Records a change of grad mode in the graph (a torch._C._set_grad_enabled(mode) node, as Dynamo
 * records one) and in the trace's own state; no node when the mode is already `mode`. -1 on
 * break. */
int em_tr_set_grad_mode(Trace *T, bool mode);
/* torch.autocast with-blocks (em_trace_call.c). enter: records the _enter_autocast node for the
 * manager m, enters the block for real for the rest of the trace, and returns the value of its
 * __exit__ (NULL with a break or an exception). unwind: exits the blocks still open (the trace's
 * end), keeping any pending exception. */
TValue *em_tr_autocast_enter(Trace *T, TValue *m);
/* Is o a torch.autocast object (of the class or a deprecated subclass)? autocast_of: the value of
 * such an object made outside the frame (`@torch.autocast(...)`'s closure, a module attribute) as
 * a manager the trace follows, its device, dtype, enabled and cache_enabled guarded; NULL with a
 * break. */
bool em_tr_is_autocast(PyObject *o);
TValue *em_tr_autocast_of(Trace *T, TValue *obj);
void em_tr_autocast_unwind(Trace *T);

/* ---- em_trace_sym.c: symbolic sizes ---- */
/* Decides which dims of the tensor input at src are dynamic (dynamic=, marks, automatic dynamic)
 * and fills m->sym_sizes / sym_strides; *dynmask gets those dims (0: static). -1 on error. */
int em_tr_sym_input(Trace *T, TValue *v, PyObject *tensor, GuardSrc src, IRMeta *m, uint64_t *dynmask);
/* A Python int input (exact int at a local source): 1 when it became a SYMINT (dynamic=True, or
 * automatic dynamic after its value changed), 0 when it stays a constant, -1 on error. */
int em_tr_sym_int_input(Trace *T, TValue *v, PyObject *o, GuardSrc src);
/* A value for size expression e: a CONST int when e is constant, else a SYMINT. */
TValue *em_tr_symint(Trace *T, uint32_t e);
/* The graph argument for a SYMINT (a node computing it, built from sym_size nodes on first use)
 * and its hint as *py (new reference). -1 on break. */
int em_tr_sym_arg(Trace *T, TValue *v, IRArg *out, PyObject **py);
/* Specialises a SYMINT: guards it equal to its hint. New int, NULL on break. */
PyObject *em_tr_sym_specialize(Trace *T, TValue *v, const char *why);
/* Operators with a SYMINT operand: NULL with *handled = 0 when not handled here. */
TValue *em_tr_sym_binop(Trace *T, int nb, TValue *a, TValue *b, int *handled);
TValue *em_tr_sym_minmax(Trace *T, bool is_min, TValue **items, uint32_t n, int *handled);
TValue *em_tr_sym_abs(Trace *T, TValue *v, int *handled);
TValue *em_tr_sym_compare(Trace *T, int cmp, TValue *a, TValue *b, int *handled);
TValue *em_tr_sym_neg(Trace *T, TValue *a);
/* Symbolic floats: true division of symbolic ints, float(n), and + - * / on them (a graph node each,
 * as torch's SymFloat). NULL with *handled = 0 when no operand is symbolic or the op is not one of
 * these. A SYMFLOAT used as a Python value (a branch, a comparison, math.sqrt, returned) is
 * specialised: em_tr_sym_float_value guards the ints it reads and gives its float. */
TValue *em_tr_sym_float_binop(Trace *T, int nb, TValue *a, TValue *b, int *handled);
TValue *em_tr_sym_float_of(Trace *T, TValue *v, int *handled); /* float(v) */
TValue *em_tr_sym_float_neg(Trace *T, TValue *v);
PyObject *em_tr_sym_float_value(Trace *T, TValue *v, const char *why);
/* v itself, or a SymBool's / SymFloat's value as a constant (guarded): where Python's type or value
 * of it matters (identity, a comparison of floats, a value leaving the frame). */
TValue *em_tr_sym_settle(Trace *T, TValue *v);
int em_tr_sym_truth(Trace *T, TValue *v, bool *out);
/* Size queries on a tensor with symbolic sizes: x.shape, x.size(), x.size(d), x.numel(), len(x),
 * x.stride(). NULL with *handled = 0 for a static tensor or another query. */
TValue *em_tr_sym_query(Trace *T, TValue *t, const char *what, TValue **args, uint32_t nargs, int *handled);
/* After an op's meta call when an argument is symbolic: runs it again on fake tensors with a torch
 * ShapeEnv mirroring ours (ember._fake.sym_run), imports the relations torch relied on as guards,
 * and gives each tensor result in m its symbolic sizes. *symout: for an int / Size result, the
 * value to use (or NULL). -1 on break. */
int em_tr_sym_call(Trace *T, IRKind kind, PyObject *target, const IRArg *ia, uint32_t nargs, PyObject *kwnames,
                   const IRArg *ik, uint32_t nkw, PyObject *res, IRMeta *m, TValue **symout);
/* em_trace_shape.c: the symbolic sizes/strides of a tensor result m of a common op by ember's own
 * shape rules, recording the relations eager relied on. 1 when done, 0 when the op has no rule
 * (or the rule does not describe this call: the fake run decides), -1 on error. */
int em_tr_shape_rule(Trace *T, IRKind kind, PyObject *target, const IRArg *ia, uint32_t nargs, PyObject *kwnames,
                     const IRArg *ik, uint32_t nkw, IRMeta *m);
/* Specialises the first dim of a symbolic tensor (iteration, len as a loop bound). */
int em_tr_sym_dim_int(Trace *T, IRMeta *m, int dim, int64_t *out);
/* At the end of a trace: the sym guard leaf, symbolic metadata simplified, the graph's env. */
int em_tr_sym_finish(Trace *T, IRGraph *g);
uint32_t em_tr_add_node(Trace *T, IRKind kind, PyObject *target, IRArg *args, uint32_t nargs, PyObject *kwnames,
                        IRArg *kwargs, uint32_t nkw, const IRMeta *meta);

/* ---- em_trace_attr.c ---- */
/* Attribute access. *missing (optional) is set to 1 when the attribute certainly does not exist
 * (then NULL is returned without a break), for hasattr/getattr with a default. */
TValue *em_tr_getattr(Trace *T, TValue *v, PyObject *name, int *missing);
/* Looks up a module's attribute the way nn.Module does (MRO, __dict__, _parameters, _buffers,
 * _modules), guarding each dict consulted. */
TValue *em_tr_module_getattr(Trace *T, TValue *m, PyObject *name, int *missing);
/* The module's _modules entries as values (keys in *keys if wanted). -1 on break. */
int em_tr_module_children(Trace *T, TValue *m, PyObject ***keys, TValue ***vals, uint32_t *n);
/* Guards/ checks the hook dicts of a module before inlining its forward. -1 on break. */
int em_tr_module_check_hooks(Trace *T, TValue *m);
/* Records that the trace read dict[key] (or, key == NULL, depends on the whole dict: iteration,
 * emptiness of hook dicts). owner/what name the dict for rendering (owner's source + what), which
 * happens only when the guard is shown; what must outlive the trace (a literal or arena text). */
int em_tr_guard_dict(Trace *T, PyObject *dict, GuardSrc owner, const char *what, PyObject *key);
/* Records a dict-version guard on dict[key] (key == NULL: the whole dict). The guards are added
 * to the builder when the trace ends (em_tr_flush_dict_guards), after every meta call: running
 * torch ops may import submodules lazily, which bumps the version tag of torch.__dict__ and would
 * make the entry fail its own guards if the tag were read before. Keyed guards survive unrelated
 * changes of the dict (em_guard_dict_key), e.g. Inductor importing into torch.__dict__. how names the
 * dict (a literal or arena text). */
int em_tr_dict_version(Trace *T, PyObject *dict, const char *how, PyObject *key);
int em_tr_flush_dict_guards(Trace *T);
/* object.__getattribute__ on a real object (OBJECT/NN_MODULE value): the lookup without the class's
 * own __getattribute__; a Python __getattr__ is inlined when it misses. */
TValue *em_tr_generic_getattr(Trace *T, TValue *v, PyObject *name, int *missing);
PyObject *em_tr_instance_dict_borrow(PyObject *o); /* o's instance __dict__ (borrowed), or NULL */

/* ---- em_trace_exc.c: exception tables, raise / catch, with-blocks on Python managers ---- */
/* Parses the code's exception table into F->exctab (instruction indices). -1 on OOM. */
int em_tr_exc_decode(Trace *T, TFrame *F, const unsigned char *tab, Py_ssize_t len, uint32_t nunits);
/* Records a RAISE break that stands for the real exception instance exc (stolen; NULL: a
 * MemoryError is pending). An enclosing handler may catch it (em_tr_exc_unwind). Returns -1. */
int em_tr_raise_steal(Trace *T, PyObject *exc, const char *what);
/* Same with an instance of cls built from a message (AttributeError etc.). */
int em_tr_raise_msg(Trace *T, PyObject *cls, const char *fmt, ...);
/* After a failure inside F: when the failure is a RAISE break with a known exception and F has a
 * handler at its pc, clears the break, unwinds F's stack and jumps to the handler (returns 1);
 * else 0. */
int em_tr_exc_unwind(Trace *T, TFrame *F);
/* Is instruction pc of F covered by an except or finally clause (an exception-table entry whose
 * handler is not a with statement's __exit__ call)? A frame is not split there: the breaking
 * instruction would run in the stub, outside the handler that must see its exception. */
bool em_tr_in_try(const TFrame *F, uint32_t pc);
/* PUSH_EXC_INFO, POP_EXCEPT, CHECK_EXC_MATCH, WITH_EXCEPT_START, RERAISE, RAISE_VARARGS. -1 on
 * break (a raise is a break that em_tr_exc_unwind may turn into a jump). */
int em_tr_exc_op(Trace *T, TFrame *F, int op, int arg);
/* BEFORE_WITH on a manager whose class has Python __enter__/__exit__: pushes the bound __exit__
 * and the inlined __enter__()'s result. -1 on break. */
int em_tr_with_enter(Trace *T, TFrame *F, TValue *mgr);

/* ---- em_trace_obj.c: Python objects with their own attribute protocol ---- */
/* Attribute read on an object whose class defines a Python __getattribute__: inlined. NULL with
 * *handled = 0 when the class has none (the caller does the usual lookup). */
TValue *em_tr_custom_getattr(Trace *T, TValue *v, PyObject *name, int *missing, int *handled);
/* Instances of Python classes constructed in the trace (TV_INSTANCE). */
TValue *em_tr_instance_new(Trace *T, PyObject *cls, TValue **args, uint32_t nargs, PyObject *kwnames,
                           TValue **kwvals);
TValue *em_tr_instance_getattr(Trace *T, TValue *v, PyObject *name, int *missing);
int em_tr_instance_setattr(Trace *T, TValue *v, PyObject *name, TValue *val); /* val NULL: delete */
/* Calls of C slot functions on values (object.__getattribute__(o, n), object.__setattr__,
 * dict.__setitem__ on an instance's items, ...). NULL with *handled = 0 when not one of these. */
TValue *em_tr_call_slot(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames,
                        TValue **kwvals, int *handled);
/* v's class attribute `name` (Python override or a dict method) called with args. */
TValue *em_tr_instance_dunder(Trace *T, TValue *v, const char *name, TValue **args, uint32_t nargs);
/* IMPORT_NAME / IMPORT_FROM of modules already in sys.modules (a lookup; the sys.modules entry and
 * builtins.__import__ are version-guarded). A module not yet imported is a break. -1 on break. */
int em_tr_import(Trace *T, TFrame *F, int op, int arg);
/* Attribute store (val) or delete (val NULL) on a real object (OBJECT value, not a module or
 * class): a Python __setattr__/__delattr__ is inlined; object's own records an overlay entry.
 * -1 on break. */
int em_tr_object_setattr(Trace *T, TValue *v, PyObject *name, TValue *val);
/* `v.name = val` (STORE_ATTR, setattr) or, val NULL, `del v.name` (DELETE_ATTR, delattr): into an
 * instance made in the trace, through a Python __setattr__/__delattr__, into the overlay, or a
 * store replayed after the graph; otherwise a break. */
int em_tr_store_attr(Trace *T, TValue *v, PyObject *name, TValue *val);
/* The overlay entry for obj.name: 1 with *val (NULL: deleted), 0 when none. */
int em_tr_overlay_get(Trace *T, PyObject *obj, PyObject *name, TValue **val);
/* At the frame's return: a break unless every overlaid attribute holds its original value. */
int em_tr_overlay_check(Trace *T);
/* -1 with a break if an overlay store is not back to its original value (a split there would lose
 * it): called before a frame is split. */
int em_tr_overlay_settled(Trace *T);
/* type(v).<name>(v, *args) when it is a Python function and v a real object (OBJECT value):
 * inlined (*handled = 1); otherwise NULL with *handled = 0. */
TValue *em_tr_object_dunder(Trace *T, TValue *v, const char *name, TValue **args, uint32_t nargs, int *handled);
/* BUILD_SET / SET_ADD / SET_UPDATE: a set of constants made in the trace is a real set (a CONST
 * value marked mutable, never returned). -1 on break. */
int em_tr_set_op(Trace *T, TFrame *F, int op, int arg);
/* Calls the tracer answers itself (inspect.signature of a Python function: its Signature is an
 * immutable value of the function's code and defaults; copy.deepcopy and copy.copy: new values
 * held in the trace). NULL with *handled = 0 otherwise. em_tr_is_special_call: is fn one of them? */
bool em_tr_is_special_call(PyObject *fn);
TValue *em_tr_call_special(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, int *handled);
/* Is cls a class whose construction the tracer may model (a Python class with object's or dict's
 * __new__ and a Python __init__ or none)? */
bool em_tr_instance_class_ok(PyObject *cls);

/* ---- em_trace_dist.c: torch.distributed collectives as functional collectives ---- */
/* funcol.<fname>(...) (torch.distributed._functional_collectives) for fname "all_reduce",
 * "broadcast", "all_gather_single" / "all_gather_tensor", "reduce_scatter_single" /
 * "reduce_scatter_tensor", "all_to_all_single": the collective's result, waited on; NULL without a
 * break for other names and what is not taken. */
TValue *em_tr_funcol(Trace *T, const char *fname, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals);
/* dist.<which>(...) for which "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
 * "broadcast", "all_to_all_single", "all_to_all", "all_gather", "reduce_scatter": None, the
 * collective and the copies into its outputs recorded; NULL without a break for other names and
 * what is not taken. */
TValue *em_tr_dist_collective(Trace *T, const char *which, TValue **args, uint32_t nargs, PyObject *kwnames,
                              TValue **kwvals);
/* dist.get_rank() / dist.get_world_size(): a trace-time constant; NULL where not taken. */
TValue *em_tr_dist_query(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals);

/* ---- em_trace_numpy.c: NumPy code on CPU tensors, traced into torch ops ---- */
/* Tensor.numpy() of tensor value t: an NDARRAY value, or NULL with a break (eager raises). */
TValue *em_tr_np_from_tensor(Trace *T, TValue *t, uint32_t nargs, PyObject *kwnames);
/* A call of a NumPy function or ufunc, or of torch.from_numpy / as_tensor / asarray / tensor on an
 * array. NULL with *handled = 0 when fn is none of these. */
TValue *em_tr_np_call(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals,
                      int *handled);
TValue *em_tr_np_method(Trace *T, TValue *a, PyObject *name, TValue **args, uint32_t nargs, PyObject *kwnames,
                        TValue **kwvals);
TValue *em_tr_np_getattr(Trace *T, TValue *a, PyObject *name, int *missing);
/* Operators with an NDARRAY operand, as NumPy's ufuncs. */
TValue *em_tr_np_binop(Trace *T, int nb, TValue *a, TValue *b);
TValue *em_tr_np_compare(Trace *T, int cmp, TValue *a, TValue *b);
TValue *em_tr_np_unary(Trace *T, PyObject *opfn, TValue *a);
TValue *em_tr_np_getitem(Trace *T, TValue *a, TValue *key);
/* A NumPy array from a frame input (v TV_LAZY, with a source): 1 when it became an NDARRAY whose
 * tensor is torch.from_numpy of it, 0 when not (an ordinary object), -1 on break/error. */
int em_tr_np_input(Trace *T, TValue *v);
/* The TENSOR value of the same graph value as array a. */
TValue *em_tr_np_tensor(Trace *T, TValue *a);
/* type(a): numpy.ndarray, or the NumPy scalar type (borrowed / arena-held). */
PyObject *em_tr_np_type(Trace *T, TValue *v);
/* The out spec of an array leaving the frame: Tensor.numpy(graph_out[k]) ([()] for a scalar). */
int em_tr_np_out_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth);

#endif /* EM_TRACE_INT_H */
