/* runtime: running what a backend produced, and building the Python return value.
 * - OutSpec describes the frame's return value as a tree over graph results, fetched inputs and
 *   constants (nested tuples, lists, dicts), built after the compiled graph ran.
 * - EagerGraph (ember._C.EagerGraph) is the "eager" backend: the graph replayed op by op from C
 *   with vectorcall, no Python frame, no fx. Invariant: it calls exactly the targets the tracer
 *   recorded (an OpOverload through its `_op` or torch's binding of the same op: em_runtime_eager.c
 *   call_target), with the same arguments, in graph order.
 * The stage's modules:
 *   em_runtime.c            the stage's init: calls each file's init below (em_runtime_init)
 *   em_runtime_out.c        OutSpec: copying, building return values and values at a break
 *   em_runtime_eager.c      EagerGraph (the "eager" backend) and AutocastOff
 *   em_runtime_ember.c      backend "ember": lower -> schedule -> codegen -> cc -> Kernel objects
 *   em_runtime_cc.c         the C compiler driver and the on-disk kernel cache
 *   em_runtime_cuda.c       NVRTC and the CUDA driver API (dlopen), launches on torch's stream
 *   em_runtime_random.c     the eager forms of Philox dropout
 *   em_runtime_skinny.c     ember._C.skinny_linear: F.linear of a few rows by a GEMV kernel (CUDA)
 *   em_runtime_gemm.c       ember._C.Gemm: a CUDA program's GEMMs through cuBLASLt from C
 *   em_runtime_cudagraph.c  CudaGraphs: mode="reduce-overhead"
 *   em_runtime_testing.c    test helpers (_ir_build, _out_build)
 * No circle: eager is used by ember, cudagraph and testing and calls none of them. */
#ifndef EM_RUNTIME_H
#define EM_RUNTIME_H

#include "core/em_core.h"
#include "ir/em_ir.h"

typedef enum {
    OUT_GRAPH,  /* index = position in the graph's result tuple */
    OUT_FETCH,  /* index = guard fetch slot: an input returned unchanged */
    OUT_CONST,  /* obj = the constant */
    OUT_TUPLE,  /* items */
    OUT_LIST,   /* items */
    OUT_DICT,   /* obj = tuple of keys; items = values in key order */
    OUT_NAMEDTUPLE, /* obj = the namedtuple class; items */
    OUT_ATTR,   /* getattr(items[0], obj): a bound method rebuilt at a graph break */
    OUT_METHOD, /* types.MethodType(obj, items[0]): a Python method bound to a rebuilt self */
    OUT_ITER,   /* iter(items[0]): a loop's iterator rebuilt at a graph break (over the rest) */
    OUT_CELL,   /* index = the frame's cell k (em_out_build_values only) */
    OUT_FUNCTION, /* obj = code; items: globals, closure (tuple of cells or None), defaults,
                     kwdefaults: a function made in the frame, rebuilt at a graph break */
    OUT_REF,    /* index = an earlier item of the values tuple: the same object (em_out_build_values) */
    OUT_CALL,   /* obj = a class; items[0] = TUPLE of positional, items[1] = DICT of keyword
                   arguments: obj(*items[0], **items[1]) (an object constructed in the frame) */
    OUT_NEW     /* obj = a plain class; items[0] = DICT: object.__new__(obj) with that __dict__ (an
                   object constructed in the frame and changed after its __init__: its final state) */
} OutKind;

typedef struct OutSpec {
    OutKind kind;
    uint32_t index;
    uint32_t n;
    PyObject *obj;          /* held by the arena at compile time; by the copy after em_out_copy */
    struct OutSpec *items;
} OutSpec;

/* Deep-copies an arena OutSpec into one malloc block that owns references to its objects. */
OutSpec *em_out_copy(const OutSpec *spec);
void em_out_free(OutSpec *spec);
/* Builds the return value. graph_out: the sequence (tuple or list) the compiled graph returned;
 * fetched: the guard fetch slots. New reference, or NULL with an exception. */
PyObject *em_out_build(const OutSpec *spec, PyObject *graph_out, PyObject *const *fetched);
/* Builds a TUPLE spec of the values live at a graph break: items may refer to the cells tuple
 * (OUT_CELL) and, at the top level, to earlier items (OUT_REF). New tuple or NULL. */
PyObject *em_out_build_values(const OutSpec *spec, PyObject *graph_out, PyObject *const *fetched, PyObject *cells);
/* Python text of the spec, e.g. "(graph_out[0], {'a': graph_out[1]}, 3)". New str. */
PyObject *em_out_repr(const OutSpec *spec);

/* ---- EagerGraph: the eager backend ---- */
extern PyTypeObject *EmEagerGraph_Type; /* set by em_runtime_eager_init */
/* Compiles the graph to a compact instruction list. The object is callable as
 * eager_graph(*inputs) -> tuple of results, like the callable a custom backend returns. */
PyObject *em_eager_graph_new(const IRGraph *g);
/* Direct entry used by dispatch to skip argument-tuple creation: runs with n inputs and returns
 * the result tuple (new reference) or NULL with an exception. */
PyObject *em_eager_graph_run(PyObject *eager_graph, PyObject *const *inputs, Py_ssize_t n);

/* fn(*args) run with torch.autocast off (torch._C._DisableAutocast): the program of a graph whose
 * autocast casts are nodes (passes/em_pass_autocast.c). A new ember._C.AutocastOff, or NULL with
 * an exception. */
PyObject *em_autocast_off_new(PyObject *fn);
/* fn(ctx) inside torch._C._DisableAutocast (entered before, exited after, exception or not): its
 * result, or NULL with fn's exception (or the context manager's). */
PyObject *em_with_autocast_off(PyObject *(*fn)(void *), void *ctx);
/* ember._C.EagerGraph, AutocastOff, _fast_calls. Called by em_runtime_init. */
int em_runtime_eager_init(PyObject *module);

/* ---- the "ember" backend (em_runtime_ember.c): lower -> schedule -> codegen -> cc -> run ---- */
/* Compiles g for CPU. Returns the callable (an EagerGraph whose ops are the generated kernels and
 * the extern calls) and, in *info, a dict for cache_info (kernels, externs, source, cache key, or
 * why the graph runs on the eager backend). NULL with an exception on failure. */
PyObject *em_ember_compile(const IRGraph *g, PyObject **info);
/* Lowers, schedules and writes g's C (a CPU graph) and starts its compiler in the background
 * (em_cc_start), so that a later em_ember_compile of g finds the compile under way: two graphs
 * compiled at once. Best effort: never raises, keeps the caller's exception. */
void em_ember_prefetch(const IRGraph *g);
/* ---- CUDA graphs (em_runtime_cudagraph.c): ember.compile(mode="reduce-overhead") ---- */
/* Row independence along the batch dim (dim 0 of the inputs flagged in batched_in): 1 when every
 * output row depends only on the same row of the batched inputs (batched_out[k]: output k carries
 * the batch), 0 with the reason in why, -1 on OOM. */
int em_cudagraph_rows(const IRGraph *g, const uint8_t *batched_in, uint8_t *batched_out, char *why, size_t nwhy);
/* The same as a dict {row_independent, reason, batched_outputs} (the _ir_build(rows=...) hook). */
PyObject *em_cudagraph_rows_py(const IRGraph *g, PyObject *batched);
/* written[i] = 1 for each input the graph may write in place (in-place ops, out=, a batch norm's
 * running statistics, through views of it). 0, or -1 on OOM. */
int em_cudagraph_written_inputs(const IRGraph *g, uint8_t *written);
/* Wraps an entry's compiled callable in an ember._C.CudaGraphs runner sharing pool (an
 * ember._cudagraphs.Pool); *info: its live stats dict for cache_info. New reference or NULL. A training
 * region (an input requires grad) is handed to ember._cudagraphs.training instead, which records its
 * forward and backward halves; its callable is returned as it is. */
PyObject *em_cudagraph_wrap(PyObject *compiled, int is_eager_graph, const IRGraph *g, PyObject *const *examples,
                            uint32_t n, PyObject *backend, PyObject *pool, PyObject **info);
int em_runtime_cudagraph_init(PyObject *module);
/* Compile driver (em_runtime_cc.c): compiles or loads from the on-disk cache; dlopen handle. */
void *em_cc_load(const char *source, size_t srclen, char *key_out, int *was_cached);
/* Starts compiling source in the background (best effort, never raises): a later em_cc_load of the
 * same source waits for that process. em_cc_drain waits for the ones nothing loaded. */
void em_cc_start(const char *source, size_t srclen);
void em_cc_drain(void);
PyObject *em_cc_stats(PyObject *self, PyObject *noargs);
void em_cc_note_internal_fallback(void); /* counted in _cc_stats()["internal_fallbacks"] */
int em_runtime_ember_init(PyObject *module);
/* Compiles g's kernels to CUDA C without loading anything (tensors on "meta" stand for CUDA device
 * 0): a dict {source, launch: [per kernel: block, blocks, per_sm, vec, idx64, rows_per_block,
 * threads_per_row, cached], kernel_list} or {fallback}; NULL with an exception. For tests. */
PyObject *em_ember_cuda_codegen(const IRGraph *g);
/* Content-addressed blobs in the compile cache (em_runtime_cc.c): key_out (33 bytes) = hash of the
 * parts; get returns a malloc'd copy without its trailer (NULL: miss, or an exception is set);
 * put publishes data (and the readable source next to it) atomically, -1 with an exception. */
void em_cc_key(const void *const *parts, const size_t *lens, int n, char *key_out);
char *em_cc_blob_get(const char *key, const char *ext, size_t *len);
int em_cc_blob_put(const char *key, const char *ext, const void *data, size_t len, const char *source, size_t srclen,
                   const char *src_ext);

/* ---- CUDA (em_runtime_cuda.c): NVRTC and the driver API, found with dlopen at run time ---- */
struct EmCudaLaunch;
typedef struct EmCudaFn EmCudaFn;
/* 1 when NVRTC and the driver load and device exists; 0 with *why (a static sentence) otherwise. */
int em_cuda_available(int device, const char **why);
/* Compiles source with NVRTC for device's architecture (or takes the binary from the cache) and
 * loads it into the device's primary context: a capsule owning the module, NULL with an exception. */
PyObject *em_cuda_module_load(const char *source, size_t srclen, int device, char *key_out, int *was_cached);
/* The kernel `name` of a loaded module with its launch shape; NULL with an exception. */
EmCudaFn *em_cuda_fn_new(PyObject *module, const char *name, const struct EmCudaLaunch *launch);
void em_cuda_fn_free(EmCudaFn *f);
/* The CUDA device a kernel runs on. */
int em_cuda_fn_device(const EmCudaFn *f);
/* Is device the calling thread's current CUDA device (its primary context current, which is what
 * cudaGetDevice and so torch.cuda.current_device() answer)? 0 when not, or not known. */
int em_cuda_device_is_current(int device);
/* torch's current stream on device (torch.cuda.current_stream(device).cuda_stream) into *stream, and
 * whether it is capturing a CUDA graph into *capturing; the device's primary context made ready.
 * 0, or -1 with an exception (no driver, no such device). */
int em_cuda_current_stream(int device, void **stream, int *capturing);
/* Launches f on torch's current stream of its device with the argument data pointers; no host
 * synchronisation (except under CUDA_LAUNCH_BLOCKING=1). -1 with an exception naming the kernel. */
int em_cuda_launch(EmCudaFn *f, char *const *ptrs, uint32_t nptr);
/* A kernel of a symbolic graph, launched for this call's sizes: sv (em_sym_nsymbols values, at
 * least 1: the kernel's em_sv argument), units (rows of a reduction, elements of a pointwise
 * kernel; 0: nothing to run), row (the row length: a per-call block) and reach (the farthest
 * element: which index width runs), all from em_codegen_cuda_sym_exprs's expressions. */
typedef struct EmCudaCall {
    const int64_t *sv;
    int64_t units, row, reach;
} EmCudaCall;
int em_cuda_launch_sym(EmCudaFn *f, char *const *ptrs, uint32_t nptr, const EmCudaCall *c);
int em_runtime_cuda_init(PyObject *module); /* ember._C._nvrtc_compile, ember._C._cuda_info */

/* ember._C.philox_seeds and ember._C.philox_dropout, the eager forms of dropout with Philox random
 * numbers (em_runtime_random.c) */
int em_runtime_random_init(PyObject *module);
/* Adds defs (static, NULL-terminated) to module as functions of module "ember._C" (em_runtime.c). */
int em_runtime_add_functions(PyObject *module, PyMethodDef *defs);
/* ember._C.skinny_linear and _skinny_source (em_runtime_skinny.c) */
int em_runtime_skinny_init(PyObject *module);
/* A compiled CUDA program's GEMM extern (em_runtime_gemm.c): an ember._C.Gemm calling cuBLASLt from
 * C where the call's tensors allow and target (torch.mm, torch.addmm, torch.matmul, operator.matmul,
 * F.linear) otherwise, for a call of nargs positional arguments (ndim[i]: the dims of tensor
 * argument i, -1 for another value) and no keyword arguments. New reference; NULL without an
 * exception when target is not such a call. */
PyObject *em_gemm_new(PyObject *target, uint32_t nargs, uint32_t nkwargs, const int *ndim);
/* The positional index of a Gemm call's bias among its nargs arguments (addmm's 0, F.linear's 2), or -1. */
int em_gemm_bias_arg(PyObject *gemm, uint32_t nargs);
int em_runtime_gemm_init(PyObject *module); /* the Gemm type and ember._C._gemm_stats */
/* Shared by the extern calls of ember's own (Gemm, skinny_linear), em_runtime_gemm.c: does torch
 * record a gradient for any of ts[0 .. n) (NULL entries skipped)? 1 / 0, -1 with an exception. */
int em_grad_recorded(PyObject *const *ts, int n);
/* A new contiguous tensor of x's leading dims then n (xd: x's DLPack description), of dtype, on the
 * current CUDA device through torch's caching allocator (x.new_empty_strided where torch lacks the
 * fast entry). New reference or NULL with an exception. */
struct EmTensorDesc;
PyObject *em_cuda_rows_result(PyObject *x, const struct EmTensorDesc *xd, int64_t n, PyObject *dtype);

/* The stage's init (em_runtime.c): each file's init above and below, in one place. Called by
 * em_module.c. */
int em_runtime_init(PyObject *module);

/* Test support (em_runtime_testing.c): adds ember._C._ir_build(nodes, dce=False) -> dict (verify
 * message, export list, tabular text, EagerGraph or its error), which builds an IRGraph from a
 * Python description, and ember._C._out_build(spec, graph_out, fetched) -> (value, repr) for
 * OutSpec. Called by em_runtime_init. */
int em_runtime_testing_init(PyObject *module);

#endif /* EM_RUNTIME_H */
