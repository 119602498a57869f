/* ir: the tensor graph that the tracer records and every backend consumes.
 * Nodes live in one array of the graph; an IRRef is a 32-bit index into it (LuaJIT style), never a
 * pointer. Node 0 is reserved so that IRRef 0 means "none". Nodes are appended in a topological
 * order: every argument of node i refers to a node < i. The graph is arena-owned. */
#ifndef EM_IR_H
#define EM_IR_H

#include "core/em_core.h"

typedef uint32_t IRRef;

/* Node kinds: the torch.fx opcodes ember emits. */
#define IR_KINDS(_)                                                                    \
    _(PLACEHOLDER, "placeholder")     /* graph input; target = input name (str) */     \
    _(CALL_FUNCTION, "call_function") /* target = a Python callable */                 \
    _(CALL_METHOD, "call_method")     /* target = method name (str); args[0] = self */ \
    _(OUTPUT, "output")               /* args[0] = tuple of the graph's results */

typedef enum {
#define IR_KIND_ENUM(name, fx) IR_##name,
    IR_KINDS(IR_KIND_ENUM)
#undef IR_KIND_ENUM
        IR__NKINDS
} IRKind;

/* The op table: torch operations ember knows by name, with the category later stages use
 * (lowering, fusion). One X-macro list is the single source of truth (STYLE.md, LuaJIT's IRDEF).
 * _(ENUM, "qualified python name", category). A node whose target is not in the table has
 * op == IROP_OTHER and is still a valid graph node (an extern call of its torch target). */
#define IR_OPS(_)                                      \
    _(OTHER, "", EXTERN)                               \
    _(ADD, "torch.add", POINTWISE)                     \
    _(SUB, "torch.sub", POINTWISE)                     \
    _(MUL, "torch.mul", POINTWISE)                     \
    _(DIV, "torch.div", POINTWISE)                     \
    _(NEG, "torch.neg", POINTWISE)                     \
    _(POW, "torch.pow", POINTWISE)                     \
    _(EXP, "torch.exp", POINTWISE)                     \
    _(LOG, "torch.log", POINTWISE)                     \
    _(SIN, "torch.sin", POINTWISE)                     \
    _(COS, "torch.cos", POINTWISE)                     \
    _(TANH, "torch.tanh", POINTWISE)                   \
    _(SIGMOID, "torch.sigmoid", POINTWISE)             \
    _(RELU, "torch.relu", POINTWISE)                   \
    _(ABS, "torch.abs", POINTWISE)                     \
    _(SQRT, "torch.sqrt", POINTWISE)                   \
    _(RSQRT, "torch.rsqrt", POINTWISE)                 \
    _(WHERE, "torch.where", POINTWISE)                 \
    _(GELU, "torch.nn.functional.gelu", POINTWISE)     \
    _(SUM, "torch.sum", REDUCTION)                     \
    _(MEAN, "torch.mean", REDUCTION)                   \
    _(AMAX, "torch.amax", REDUCTION)                   \
    _(SOFTMAX, "torch.softmax", REDUCTION)             \
    _(VIEW, "torch.Tensor.view", VIEW)                 \
    _(RESHAPE, "torch.reshape", VIEW)                  \
    _(PERMUTE, "torch.permute", VIEW)                  \
    _(TRANSPOSE, "torch.transpose", VIEW)              \
    _(GETITEM, "operator.getitem", VIEW)               \
    _(MATMUL, "torch.matmul", EXTERN)                  \
    _(LINEAR, "torch.nn.functional.linear", EXTERN)    \
    _(CONV2D, "torch.nn.functional.conv2d", EXTERN)    \
    _(BATCH_NORM, "torch.nn.functional.batch_norm", EXTERN) \
    _(LAYER_NORM, "torch.nn.functional.layer_norm", EXTERN)

typedef enum { IRCAT_POINTWISE, IRCAT_REDUCTION, IRCAT_VIEW, IRCAT_EXTERN } IRCategory;

typedef enum {
#define IR_OP_ENUM(name, py, cat) IROP_##name,
    IR_OPS(IR_OP_ENUM)
#undef IR_OP_ENUM
        IROP__COUNT
} IROp;

const char *em_ir_op_pyname(IROp op);
IRCategory em_ir_op_category(IROp op);
const char *em_ir_kind_name(IRKind k); /* the fx opcode string */

/* An argument of a node: a node result, a Python constant, or a (nested) tuple/list of those. */
typedef enum { IRARG_NODE, IRARG_CONST, IRARG_TUPLE, IRARG_LIST } IRArgKind;
typedef struct IRArg {
    IRArgKind kind;
    uint32_t n;              /* TUPLE/LIST: number of items */
    union {
        IRRef ref;           /* NODE */
        PyObject *obj;       /* CONST: held by the graph's arena (None, int, float, bool, str,
                                torch.dtype, torch.device, slice, Ellipsis, torch.Size ...) */
        struct IRArg *items; /* TUPLE/LIST */
    } u;
} IRArg;

/* What a node produces. Tensors carry full metadata; TUPLE describes multi-result ops
 * (torch.max(x, 1), chunk, split, ...), whose elements are taken with getitem nodes. */
typedef enum { IRMETA_TENSOR, IRMETA_NONE, IRMETA_TUPLE, IRMETA_OTHER } IRMetaKind;
typedef struct IRMeta {
    IRMetaKind kind;
    int32_t ndim;
    int64_t *sizes;          /* ndim entries */
    int64_t *strides;        /* ndim entries, in elements */
    PyObject *dtype;         /* torch.dtype, held */
    PyObject *device;        /* torch.device (the real device, not meta), held */
    bool requires_grad;
    PyObject *example;       /* TENSOR: a tensor on device "meta" with these sizes/strides/dtype
                                (held; used for shape inference of later ops). OTHER: the value. */
    uint32_t nitems;         /* TUPLE */
    struct IRMeta *items;    /* TUPLE */
    /* Symbolic shapes (docs/dynamic_shapes.md): sizes/strides above are the example's (the hints);
     * when the graph has a ShapeEnv, sym_sizes / sym_strides (ndim SymRefs each, NULL when every
     * size is static) say what they are in terms of the symbols. OTHER: sym != 0 for a SymInt
     * value (a sym_size node or arithmetic on sizes); example is then its hint (int). */
    uint32_t *sym_sizes, *sym_strides;
    uint32_t sym;
} IRMeta;

typedef struct IRNode {
    IRKind kind;
    IROp op;
    PyObject *target;        /* callable, method-name str, or placeholder name; held */
    IRArg *args;
    uint32_t nargs;
    uint32_t nkwargs;
    PyObject **kwnames;      /* nkwargs interned str, held */
    IRArg *kwargs;           /* nkwargs values */
    IRMeta meta;
    const char *name;        /* unique, fx-style: "x", "sin", "sin_1", "linear" (arena) */
    int32_t lineno;          /* user source line that produced the node, -1 if unknown */
    PyObject *filename;      /* user source file (str, held) or NULL */
    uint32_t nusers;         /* filled by em_ir_count_users */
} IRNode;

typedef struct IRGraph {
    EmArena *arena;          /* not owned by the graph */
    IRNode *nodes;           /* nodes[0] is the reserved "none" node */
    uint32_t nnodes, cap;
    IRRef *inputs;           /* placeholder refs, in input order */
    uint32_t ninputs, capinputs;
    IRRef output;            /* the OUTPUT node, 0 until em_ir_set_output */
    struct ShapeEnv *shape_env; /* borrowed: the symbols of sym_sizes (NULL: a static graph) */
    /* The generated code must give a transcendental function the same bits wherever it evaluates it
     * (codegen: no libmvec vector variants, whose results differ from libm's scalar ones by up to
     * 4 ulp): set by the autograd stage on both halves of a training region, whose backward compares
     * recomputed values (amax's gradient: self == result) and chains derivatives. */
    bool exact_math;
    /* Per input (ninputs entries; NULL: none): the caller hands the graph its only reference and
     * the runtime releases the input after its last use (EagerGraph.run_boxed: a training region's
     * backward, for its saved activations and its tangents; not for saved graph inputs or forward
     * outputs, which the user holds). The scheduler may count such an input's memory as freed after
     * its last read. */
    uint8_t *input_released;
    /* The tracer guarded (NO_OVERLAP) that every input the graph updates in place shares no memory
     * with another tensor input: such an update may stay an extern call whose result later nodes
     * read (a static KV cache's index_copy_; em_lower.c, input_update_read_later). */
    bool inputs_apart;
} IRGraph;

/* Does any node of g carry a symbolic size or SymInt value? */
bool em_ir_is_symbolic(const IRGraph *g);

IRGraph *em_ir_new(EmArena *a);
static inline IRNode *em_ir_node(const IRGraph *g, IRRef r) { return &g->nodes[r]; }

/* Appends a placeholder. name: a valid identifier (made unique). meta is copied (shallow:
 * pointers inside must already live in the arena / be held). Returns 0 on OOM.
 * Names follow torch.fx (_Namespace.create_name): "L_x_" -> node name "l_x_", repeats get "_1",
 * "_2", Python keywords and builtins get a suffix ("sum" -> "sum_1"). The node's target (the
 * parameter name of fx's forward) is name itself when it is an identifier that no earlier input
 * uses, else the unique node name. */
IRRef em_ir_placeholder(IRGraph *g, const char *name, const IRMeta *meta);

/* Appends a call node. kind is IR_CALL_FUNCTION (target: callable) or IR_CALL_METHOD (target: str).
 * args/kwargs arrays are copied into the arena; constants they hold must already be held by the
 * arena. The node's name derives from the target's __name__. Returns 0 on OOM. */
IRRef em_ir_call(IRGraph *g, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs,
                 PyObject *const *kwnames, const IRArg *kwargs, uint32_t nkwargs, const IRMeta *meta);

/* Sets the graph's results (a flat list of node refs; the same ref may appear twice). */
int em_ir_set_output(IRGraph *g, const IRRef *refs, uint32_t n);

/* Removes call nodes whose result is unused (in-place ops and ops on the "impure" list are kept)
 * and renumbers. Returns the number removed, or -1 on OOM. refmap (optional, nnodes entries)
 * receives old->new refs. */
int em_ir_dce(IRGraph *g, IRRef *refmap);
void em_ir_count_users(IRGraph *g);
/* How many times argument a (nested tuples and lists included) / node n's arguments and keyword
 * arguments refer to node r. */
int em_ir_arg_reads(const IRArg *a, IRRef r);
int em_ir_node_reads(const IRNode *n, IRRef r);
/* Does n read any node whose mark[ref] is nonzero (mark: one byte per node of n's graph)? */
bool em_ir_node_reads_marked(const IRNode *n, const uint8_t *mark);

/* The verifier: every argument refers to an earlier node, placeholders come first, exactly one
 * output node, metas are well formed. Returns 0, or -1 with a message in buf. */
int em_ir_verify(const IRGraph *g, char *buf, size_t bufsize);

/* A table like torch.fx.Graph.print_tabular: opcode, name, target, args, kwargs, and the output
 * meta (dtype, shape). Returns a new str, NULL with an exception on failure. */
PyObject *em_ir_format_tabular(const IRGraph *g);
/* The targets of the graph's call nodes in order, as the table names them ("torch.cos", "sum"):
 * ember.explain's ops_per_graph. New list, NULL with an exception on failure. */
PyObject *em_ir_op_targets(const IRGraph *g);

/* Export for the Python fx bridge (src/ember/_fx.py): a list of tuples, one per node in order,
 *   (opcode: str, name: str, target: object, args: tuple, kwargs: dict, meta: dict|None)
 * Inside args/kwargs:
 *   ("__node__", name)   a reference to the node called name (the node-reference marker);
 *   ("__const__", obj)   a constant that is itself a tuple or list (torch.Size, a tuple of ints),
 *                        wrapped so it cannot be mistaken for a marker or a nested argument;
 *   tuple / list         an IRARG_TUPLE / IRARG_LIST of arguments (recurse);
 *   anything else        a constant, as is.
 * The output node's args is ((ref, ref, ...),): the graph returns a tuple. meta is None (output,
 * IRMETA_NONE) or a dict: {"kind": "tensor", "shape": tuple, "stride": tuple, "dtype",
 * "device", "requires_grad": bool} | {"kind": "tuple", "items": [meta, ...]} |
 * {"kind": "other", "value": obj}. New reference. */
PyObject *em_ir_to_python(const IRGraph *g);

/* The qualified Python name of a call target as printed graphs write it ("torch.sin",
 * "operator.add", "torch.nn.functional.relu", "torch.Tensor.view"); a str target is returned as
 * is. Never fails for lack of a name (falls back to repr). New str, NULL only on OOM. */
PyObject *em_ir_target_qualname(PyObject *target);

/* Helpers to build metadata. em_ir_meta_from_tensor reads sizes/strides/dtype/device/requires_grad
 * of a real or meta tensor into arena memory; device_override (may be NULL) replaces the device
 * (used when the value is a meta tensor standing for a tensor on a real device). Returns -1 with an
 * exception set on failure. */
int em_ir_meta_from_tensor(EmArena *a, PyObject *tensor, PyObject *device_override, IRMeta *out);
/* torch.empty_strided(sizes, strides, dtype=dtype, device="meta"): a new meta example, or NULL with
 * an exception. */
PyObject *em_ir_meta_empty(PyObject *sizes, PyObject *strides, PyObject *dtype);
/* Is m a 4-d or 5-d tensor laid out channels_last (channels innermost, not contiguous)? torch's meta
 * kernels do not give such tensors their device's output layouts: CUDA's on device "meta"
 * (device_hint) for a CPU tensor, and a contiguous convolution output for a CUDA one (ResNet-50 bf16
 * on the H200: every convolution's result copied back to NCHW), so the tracer and the passes infer
 * their ops on fake tensors of the real device instead. */
bool em_ir_meta_channels_last(const IRMeta *m);
/* Does fn's result on the meta device have another layout than its real kernels give, so that its
 * meta must come from fake tensors of the real device? scaled_dot_product_attention: the meta
 * device runs the math kernel (a contiguous result); the flash kernels (CPU and CUDA) and cuDNN
 * write (B, S, H, D) memory when the query is a head view of a projection, as in attention layers. */
bool em_ir_layout_needs_fake(PyObject *fn);
/* A torch.autocast with-block's node (em_trace_call.c): 1 for _enter_autocast(device, dtype,
 * enabled, cache_enabled), 2 for _exit_autocast(enter), 0 for any other node. */
int em_ir_autocast_node(const IRNode *n);
/* Does g enter a torch.autocast block (has an _enter_autocast node)? */
bool em_ir_has_autocast(const IRGraph *g);
/* Does call node n update a tensor in place: an in-place method or function (`add_`, `relu_`,
 * `Tensor.__iadd__`, `operator.iadd` on a tensor, setitem), an `out=` argument, or `inplace`
 * given as anything but False (keyword or positional, F.relu(x, True))? The operator module's
 * `and_`, `or_`, `not_`, `is_`, `concat` are out-of-place despite the trailing underscore. */
bool em_ir_mutates(const IRNode *n);
/* The tensor an in-place update writes (and returns): the `out` keyword when there is one, else
 * the first argument; NULL when the node has neither. */
const IRArg *em_ir_mutated_arg(const IRNode *n);
/* The out-of-place call of in-place update n, as functionalization rewrites it: x.add_(y) ->
 * x.add(y), operator.iadd / x.__iadd__(y) -> operator.add, torch.relu_ -> torch.relu,
 * F.relu(x, inplace=True) -> the same call with inplace False. Sets *kind, *target (a new
 * reference) and *inplace_arg (-1, or the index of the `inplace` argument to pass as False: i for
 * args[i], nargs + k for kwargs[k]). 0, or -1 (no exception) when n has no such form: setitem,
 * out=, copy_ / zero_ / fill_, random fills, in-place view ops (unsqueeze_ ...), a name whose
 * out-of-place form does not exist. */
int em_ir_functional_form(const IRNode *n, IRKind *kind, PyObject **target, int *inplace_arg);
/* Symbolic sizes and ember._fake.sym_run (em_ir_sym.c). em_ir_sym_value_tree: the argument tree of a
 * value for sym_run: ("S", expr) for a SymInt, ("T", example, device, sizes, strides, requires_grad)
 * for a tensor (sizes/strides: tuples of expressions in symbol style, None when static), the value
 * itself for another static one; NULL with NotImplementedError for other metas. em_ir_sym_from_tree: the expression of a result tree
 * (("const", k) | ("sym", i) | (op, a, b)); SYM_NONE with an exception on a bad tree, SYM_NONE
 * without one on a sticky env failure. */
PyObject *em_ir_sym_value_tree(struct ShapeEnv *env, const IRMeta *m);
uint32_t em_ir_sym_from_tree(struct ShapeEnv *env, PyObject *tree);
/* Is m a tensor with torch's contiguous strides (size-1 dims ignored, as is_contiguous)? */
bool em_ir_meta_contiguous(const IRMeta *m);
/* Can ATen fold tensor m, a matmul's larger operand, into a matrix without a copy (LinearAlgebra.cpp,
 * should_fold: every dimension but the last two has stride[i] == stride[i + 1] * size[i + 1])? */
bool em_ir_meta_foldable(const IRMeta *m);
/* Is m a tensor on a CPU device? */
bool em_ir_meta_on_cpu(const IRMeta *m);

/* Is fn torch's own callable, long-lived and not bound to an instance (a builtin of a module or
 * type, a method descriptor, a method name, an OpOverload, a Python function of a torch module)?
 * Its result is a function of its arguments and torch's state, and holding it keeps nothing of the
 * user's alive: the memo and em_ir_target_qualname's cache take only these. */
bool em_ir_torch_callable(PyObject *fn);
/* The meta-call memo (em_ir_memo.c): results of fn(*args, **kw) on meta examples, by the call's
 * key. em_ir_memo_key: the key of a call whose tensor arguments are the examples of metas[0..n)
 * (device: the device the call's result is on, or NULL); a new tuple, a new Py_None when the call
 * cannot be memoized, NULL with an exception. em_ir_memo_get: a new result (fresh meta tensors)
 * (or the argument an in-place call returns) and *device (replaced when the memoized call set
 * one), or NULL without an exception on a miss.
 * em_ir_memo_put: keeps res when it is a fresh result; never raises (a pending exception stays).
 * em_ir_memo_clear: drop every entry (ember._C._meta_memo(True)); em_ir_memo_info: a new dict
 * {"entries", "hits", "misses"} (counts since the last clear). */
PyObject *em_ir_memo_key(PyObject *fn, PyObject *args, PyObject *kw, PyObject *device, const IRMeta *const *metas,
                         int nmetas);
PyObject *em_ir_memo_get(PyObject *key, const IRMeta *const *metas, int nmetas, PyObject **device);
void em_ir_memo_put(PyObject *key, PyObject *res, PyObject *device, const IRMeta *const *metas, int nmetas);
void em_ir_memo_clear(void);
PyObject *em_ir_memo_info(void);

#endif /* EM_IR_H */
