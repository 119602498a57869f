/* ember core: what every stage shares — the graph-break reason table, the per-compilation
 * arena, growable arrays, assertions, and the CPython 3.11/3.12 compatibility layer.
 * Invariant: nothing in core/ raises a Python exception except the em_py_* helpers. */
#ifndef EM_CORE_H
#define EM_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030E0000
#error "ember supports CPython 3.11, 3.12 and 3.13"
#endif
/* 3.12 and later (the interpreter's layout and bytecode where they differ from 3.11's) */
#define EM_PY312 (PY_VERSION_HEX >= 0x030C0000)
/* 3.13 and later: callable below its NULL/self in a call sequence, CALL_KW, TO_BOOL, superinstructions
 * (docs/architecture.md, "Python versions") */
#define EM_PY313 (PY_VERSION_HEX >= 0x030D0000)

/* ---- assertions: internal bugs abort in debug builds only (STYLE.md, three kinds of failure) ---- */
#ifdef EM_DEBUG
#define EM_ASSERT(c) \
    ((c) ? (void)0 : (fprintf(stderr, "ember: assertion %s failed at %s:%d\n", #c, __FILE__, __LINE__), abort()))
#else
#define EM_ASSERT(c) ((void)0)
#endif
#define EM_UNUSED(x) ((void)(x))

/* ---- why a frame could not be compiled. One X-macro list: the name is the Python-visible
 * key (ember.FallbackReason.name), the text the human sentence. "Cannot compile this" is never
 * an error: the tracer records one of these and the frame runs its original bytecode. ---- */
#define EM_BREAK_REASONS(_)                                                                   \
    _(NONE, "no graph break")                                                                 \
    _(UNSUPPORTED_OPCODE, "bytecode instruction not supported by the tracer")                 \
    _(DATA_DEPENDENT_BRANCH, "control flow depends on a tensor value")                         \
    _(TENSOR_TO_PYTHON, "a tensor value is converted to a Python object (item/bool/int/float)") \
    _(UNSUPPORTED_CALL, "call of a function the tracer does not understand")                   \
    _(UNSUPPORTED_ATTRIBUTE, "attribute access the tracer does not understand")                \
    _(UNSUPPORTED_VALUE, "value of a type the tracer does not understand")                     \
    _(SIDE_EFFECT, "side effect on an object that outlives the frame")                         \
    _(PRINT, "print or other I/O")                                                             \
    _(RAISE, "the traced code raises an exception")                                            \
    _(META_FAILED, "shape inference on meta tensors failed")                                   \
    _(GENERATOR, "generator, coroutine or async frame")                                        \
    _(INLINE_DEPTH, "inlining depth limit reached")                                            \
    _(LOOP_LIMIT, "loop unrolling limit reached")                                              \
    _(TRY_BLOCK, "try/except or with block")                                                   \
    _(HOOKS, "module with hooks")                                                              \
    _(CACHE_LIMIT, "cache_size_limit reached")                                                 \
    _(DISABLED, "frame marked by ember.disable")                                               \
    _(INTERNAL, "internal error while tracing")

typedef enum {
#define EM_BREAK_ENUM(name, text) EM_BREAK_##name,
    EM_BREAK_REASONS(EM_BREAK_ENUM)
#undef EM_BREAK_ENUM
        EM_BREAK__COUNT
} EmBreak;

const char *em_break_name(EmBreak b);
const char *em_break_text(EmBreak b);

/* ---- arena: one per compilation; everything the tracer and IR allocate lives here and is
 * freed in one step. PyObject references registered with em_arena_hold are released with it. ---- */
typedef struct EmArena EmArena;

EmArena *em_arena_new(void);                        /* NULL on out-of-memory (no exception set) */
void em_arena_free(EmArena *a);                     /* releases every held reference; NULL is fine */
void *em_arena_alloc(EmArena *a, size_t size);      /* zeroed, 16-byte aligned; NULL on OOM */
void *em_arena_realloc(EmArena *a, void *p, size_t old_size, size_t new_size);
char *em_arena_strdup(EmArena *a, const char *s);
/* Registers a new reference to be released when the arena is freed; returns obj (borrowed from
 * the caller's view: the arena now owns one reference). Steals nothing: it INCREFs. NULL-safe. */
PyObject *em_arena_hold(EmArena *a, PyObject *obj);
/* Same, but steals the caller's reference. */
PyObject *em_arena_hold_steal(EmArena *a, PyObject *obj);

/* ---- growable arrays in an arena: EM_VEC(T) v = {0}; EM_VEC_PUSH(arena, v, x) ---- */
#define EM_VEC(T) \
    struct {      \
        T *items; \
        uint32_t n, cap; \
    }
int em_vec_grow(EmArena *a, void **items, uint32_t *cap, size_t elem, uint32_t need);
/* Evaluates to 0 on success, -1 on out-of-memory. */
#define EM_VEC_PUSH(arena, v, x)                                                              \
    (((v).n < (v).cap || em_vec_grow((arena), (void **)&(v).items, &(v).cap, sizeof(*(v).items), \
                                     (v).n + 1) == 0)                                         \
         ? ((v).items[(v).n++] = (x), 0)                                                      \
         : -1)

/* ---- small Python helpers ---- */
/* Interned-string cache: em_str("forward") is a borrowed, immortal-for-our-purposes interned str.
 * Only for literal names; the table lives in module state and is released at module free. */
PyObject *em_str(const char *literal);
/* module.attr, imported on first use and kept in *slot (a file-level static: one interpreter,
 * em_module.c). Borrowed reference, or NULL with an exception. */
PyObject *em_lazy_attr(PyObject **slot, const char *module, const char *attr);
/* obj.name, or NULL with no exception when obj has no such attribute (a generic getattr then
 * makes no AttributeError to clear); NULL with an exception on any other error. New reference. */
PyObject *em_attr_optional(PyObject *obj, PyObject *name);
/* The raised exception, taken (normalized, with its traceback), or NULL when none is set: 3.12's
 * PyErr_GetRaisedException, Fetch + Normalize on 3.11. New reference. */
static inline PyObject *em_exc_take(void) {
#if EM_PY312
    return PyErr_GetRaisedException();
#else
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v) PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
#endif
}
/* Raises e again (stolen; NULL restores nothing): the inverse of em_exc_take. */
static inline void em_exc_restore(PyObject *e) {
#if EM_PY312
    PyErr_SetRaisedException(e);
#else
    if (!e) return;
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(e)), e, PyException_GetTraceback(e));
#endif
}
/* 3.13: is dict d a split table whose values live inside its object (an instance __dict__ sharing
 * the object's inline values, internal/pycore_dict.h `embedded`)? 0 before 3.13. */
int em_dict_values_embedded(PyObject *d);
/* A new tuple of n Python ints (sizes, strides), or NULL with an exception. */
PyObject *em_int64_tuple(int32_t n, const int64_t *v);
/* ember.config.<name> (src/ember/_config.py) as a truth value; dflt when it is absent or its truth
 * cannot be taken (the error is cleared). Read when a graph is compiled, not per call. */
int em_config_bool(const char *name, int dflt);
/* ember.config.<name>: a new reference, or NULL (no exception) when it cannot be read. */
PyObject *em_config_attr(const char *name);

/* ---- logs by topic (ember.set_logs, EMBER_LOGS; src/ember/_logs.py formats and emits through
 * Python's logging under the "ember" logger). One bit per topic, and the same bit shifted by
 * EM_LOG_DEBUG_SHIFT for its debug level ("+topic"). Zero cost when off: every emitting site tests
 * em_log_mask before it builds anything. ---- */
#define EM_LOG_TOPICS(_)          \
    _(GRAPH_BREAKS, "graph_breaks") \
    _(RECOMPILES, "recompiles")   \
    _(GUARDS, "guards")           \
    _(GRAPH, "graph")             \
    _(OUTPUT_CODE, "output_code") \
    _(PERF, "perf")

enum {
#define EM_LOG_BIT_ENUM(name, text) EM_LOG_BIT_##name,
    EM_LOG_TOPICS(EM_LOG_BIT_ENUM)
#undef EM_LOG_BIT_ENUM
        EM_LOG__COUNT
};
enum {
#define EM_LOG_MASK_ENUM(name, text) EM_LOG_##name = 1u << EM_LOG_BIT_##name,
    EM_LOG_TOPICS(EM_LOG_MASK_ENUM)
#undef EM_LOG_MASK_ENUM
};
enum { EM_LOG_DEBUG_SHIFT = 16 };
/* Set by ember._C._set_logs(mask) only (one interpreter, em_module.c). */
extern uint32_t em_log_mask;
#define EM_LOG_ON(topic) (em_log_mask & (topic))
#define EM_LOG_DEBUG_ON(topic) (em_log_mask & ((uint32_t)(topic) << EM_LOG_DEBUG_SHIFT))
/* Hands one event to ember._logs._emit(topic, data): topic is EM_LOG_<TOPIC>, data a dict (stolen;
 * NULL is fine: nothing is emitted and the error is dropped). Never raises and keeps a pending
 * exception: a failing log handler must not change what the compiled program does. */
void em_log_emit_steal(uint32_t topic, PyObject *data);
/* Monotonic clock in seconds, for compile times. */
double em_now(void);

#endif /* EM_CORE_H */
