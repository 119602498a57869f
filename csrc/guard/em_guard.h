/* guard: the checks that decide whether a cache entry may answer a call.
 * A guard set is a table of sources (how to reach a value from the frame: L[i], G['torch'],
 * L['self'].fs, L['inputs']['x'] ...) and a list of leaf checks on those sources. Invariant: a
 * check that passes implies the traced program would take the same path on these inputs.
 * Guard cost is O(inputs): objects reached through guarded module trees / globals are covered by
 * dictionary version tags (3.11) or dict watchers (3.12), not by a check per value (DESIGN.md 5). */
#ifndef EM_GUARD_H
#define EM_GUARD_H

#include "core/em_core.h"

typedef int32_t GuardSrc; /* index into the builder's source table; -1 means "no source" */

/* What a call or a frame supplies to guards: the fast locals (arguments first, in code order),
 * the globals and builtins dicts, and the function's closure (tuple of cells, or NULL). */
typedef struct EmFrameView {
    PyObject *const *locals;
    Py_ssize_t nlocals;
    PyObject *globals;
    PyObject *builtins;
    PyObject *closure;
} EmFrameView;

typedef struct GuardBuilder GuardBuilder; /* compile time, arena-owned */
typedef struct GuardSet GuardSet;         /* what a cache entry keeps; malloc-owned */

GuardBuilder *em_guard_builder_new(EmArena *a);

/* ---- sources. Each records the compile-time value it had (borrowed from the caller, held by the
 * builder). The same (parent, accessor, key) returns the same GuardSrc. ---- */
GuardSrc em_guard_src_local(GuardBuilder *b, int index, PyObject *name, PyObject *value);
GuardSrc em_guard_src_global(GuardBuilder *b, PyObject *name, PyObject *value);
GuardSrc em_guard_src_builtin(GuardBuilder *b, PyObject *name, PyObject *value);
GuardSrc em_guard_src_closure(GuardBuilder *b, int index, PyObject *name, PyObject *value); /* cell contents */
GuardSrc em_guard_src_cell(GuardBuilder *b, int index, PyObject *name, PyObject *cell);     /* the cell itself */
GuardSrc em_guard_src_const(GuardBuilder *b, PyObject *value); /* value itself, held: a stable root */
GuardSrc em_guard_src_attr(GuardBuilder *b, GuardSrc parent, PyObject *name, PyObject *value);
GuardSrc em_guard_src_item(GuardBuilder *b, GuardSrc parent, Py_ssize_t index, PyObject *value); /* list/tuple */
GuardSrc em_guard_src_dict_item(GuardBuilder *b, GuardSrc parent, PyObject *key, PyObject *value);
GuardSrc em_guard_src_dict_part_item(GuardBuilder *b, GuardSrc parent, PyObject *key, PyObject *value); /* dict.__getitem__ */
/* fn(parent), fn held and called at each check: torch.from_numpy of an array input. Guard the
 * parent's type first (em_guard_type), so that the conversion only meets what it was traced on. */
GuardSrc em_guard_src_convert(GuardBuilder *b, GuardSrc parent, PyObject *fn, PyObject *value);
PyObject *em_guard_src_value_borrow(const GuardBuilder *b, GuardSrc s);
/* The parent of a derived source (attribute, item), -1 for a frame root or an invalid s. */
GuardSrc em_guard_src_parent(const GuardBuilder *b, GuardSrc s);
/* True when s's root is a frame local (L[...]), whatever the path below it. */
bool em_guard_src_is_local(const GuardBuilder *b, GuardSrc s);
/* The source as Python text: "L['x'], "G['torch']", "L['self'].fs[3]", "L['d']['k']". New str. */
PyObject *em_guard_src_repr(const GuardBuilder *b, GuardSrc s);

/* Declares that the value at s is fixed while the other guards pass (it was reached through
 * ID-matched objects and version-guarded dicts only). Fetching a stable source returns the
 * compile-time object (held by the guard set) without walking the path at run time. */
void em_guard_src_stable(GuardBuilder *b, GuardSrc s);

/* Marks a source whose value the compiled entry needs at run time (a graph input, or a value
 * returned as is). Returns the fetch slot k: em_guard_check stores the value in fetched[k]. */
int em_guard_fetch(GuardBuilder *b, GuardSrc s);

/* ---- leaf guards. Each returns 0, or -1 with an exception set (out of memory). Adding the same
 * guard twice keeps one. The expected value is the source's compile-time value. ---- */
int em_guard_type(GuardBuilder *b, GuardSrc s);       /* type(v) is T */
int em_guard_id(GuardBuilder *b, GuardSrc s);         /* v is O (O kept alive by the guard set) */
int em_guard_equals(GuardBuilder *b, GuardSrc s);     /* type(v) is T and v == c  (None, bool, int,
                                                          float, str, and tuples of these) */
int em_guard_len(GuardBuilder *b, GuardSrc s);        /* type(v) is T and len(v) == n (list, tuple, dict) */
int em_guard_dict_keys(GuardBuilder *b, GuardSrc s);  /* type(v) is dict and list(v) == keys, in order */
int em_guard_tensor(GuardBuilder *b, GuardSrc s);     /* tensor match: exact type, dtype, device,
                                                          sizes, strides, requires_grad */
/* Tensor match whose dims in dynmask are symbolic: their sizes are not compared (the SYM leaf
 * checks them) and the strides must be dense in the example's dim order. */
int em_guard_tensor_dynamic(GuardBuilder *b, GuardSrc s, uint64_t dynmask);
/* t.data_ptr() (the address of the tensor's first element) through the DLPack C exchange API of
 * t's type, without a Python call; torch's Tensor.data_ptr() where the type has no table or DLPack
 * refuses the tensor (sparse, meta, quantized). 0, or -1 with an exception. Used by the runtime
 * for every kernel argument. */
int em_guard_tensor_data_ptr(PyObject *t, char **out);
/* Tensor t's rank, sizes and strides (elements; cap entries at most) through the DLPack C exchange
 * API, without a Python call. 0, or -1 (no exception) where DLPack cannot tell (no table; sparse,
 * meta, mkldnn ... tensors) or the rank is above cap. The runtime checks extern results' layouts
 * with it on every call. */
int em_guard_tensor_layout(PyObject *t, int32_t cap, int32_t *ndim, int64_t *sizes, int64_t *strides);
/* What a kernel of the runtime's own needs of a tensor argument, from one DLPack call: its first
 * element's address, rank, sizes and strides (elements), dtype as DLPack codes it (code: kDLFloat
 * 2, kDLBfloat 4; bits) and device (DLPack type: kDLCPU 1, kDLCUDA 2; index). */
typedef struct EmTensorDesc {
    char *data;
    int32_t ndim;
    int64_t sizes[8], strides[8];
    uint8_t code, bits;
    int32_t device_type, device_id;
} EmTensorDesc;
/* 0, or -1 (no exception) where DLPack cannot tell (meta, sparse ... tensors, rank above 8). */
int em_guard_tensor_desc(PyObject *t, EmTensorDesc *d);
/* [*lo, *hi) the bytes tensor t can reach (empty: *lo == *hi), from DLPack. -1 (no exception)
 * when DLPack cannot tell. */
int em_guard_tensor_extent(PyObject *t, uintptr_t *lo, uintptr_t *hi);
/* Do ranges r[2i], r[2i+1] (lo, hi) of the first nmut tensors share no byte with any other of the
 * n? Empty ranges touch nothing. The NO_OVERLAP leaf's test, also for the tracer's first look. */
bool em_guard_extents_apart(const uintptr_t *r, uint32_t nmut, uint32_t n);
/* The relations the trace relied on among symbolic sizes (csrc/sym): prog checks them on the sizes
 * read from tensor srcs[i], dim dims[i], for symbol i (n symbols). Takes prog (freed with the set or
 * the builder's arena). lines: the relations as Python text, for rendering. */
struct SymProg;
/* The tensors of srcs[0..nmut) share no memory with any tensor of srcs[0..n): one NO_OVERLAP
 * leaf (the inputs a graph updates in place against the graph's other tensor inputs). */
int em_guard_no_overlap(GuardBuilder *b, const GuardSrc *srcs, uint32_t nmut, uint32_t n);
int em_guard_sym(GuardBuilder *b, struct SymProg *prog, const GuardSrc *srcs, const int32_t *dims, uint32_t n,
                 PyObject *lines);
/* Replaces the program and lines of b's sym guard (relations a backend learnt on the same symbols
 * after the trace: ember's AOT autograd of a symbolic region). Takes prog; 0 when b has no sym
 * guard (prog freed), -1 with an exception. */
int em_guard_sym_refresh(GuardBuilder *b, struct SymProg *prog, PyObject *lines);

/* The dict (a hook dict, an iterated _modules ...) still holds what it held at compile time: the
 * same items (keys, and values by identity) in the same order. owner, how: the dict's name, the
 * text of source owner followed by how (L['self'] + ".__dict__"), or how alone when owner < 0
 * ("G"); made only when the guard is shown, not while tracing. The version tag is the fast path
 * (3.11: ma_version_tag; 3.12: a dict watcher, the check costs nothing until a watched dict
 * changes); a moved tag re-compares the items, so an entry added and removed again keeps the
 * guard. The dict is kept alive by the set. */
int em_guard_dict_version(GuardBuilder *b, PyObject *dict, GuardSrc owner, const char *how);
/* Only dict[key] is guarded: it is still the very object it was at compile time, or still absent.
 * Other keys may change without failing (a module-level loop variable rebound in f_globals must not
 * fail the guards of every function of that module). The keys of one dict share one leaf with the
 * version fast path: an unchanged version (or, on 3.12, an unchanged watcher epoch) passes at
 * once; a changed version re-reads just these keys and, if they are unchanged, remembers the new
 * version. em_guard_dict_version on the same dict subsumes its keys. */
int em_guard_dict_key(GuardBuilder *b, PyObject *dict, PyObject *key, GuardSrc owner, const char *how);
/* Lookups through the type's MRO are stable: the tag (tp_version_tag) is the fast path; when it
 * moved, every name must still resolve to the same object and no new name may resolve (except the
 * stdlib's class caches __slotnames__ and __annotations__): an attribute patched and restored, or
 * an inherited one copied into the class, keeps the guard. */
int em_guard_type_version(GuardBuilder *b, PyTypeObject *tp);
/* Global torch state at compile time: grad mode, autocast (cpu, cuda), default dtype. */
int em_guard_global_state(GuardBuilder *b);
/* The scaled_dot_product_attention backend flags (sdpa_kernel contexts), once per entry: added when
 * the graph calls scaled_dot_product_attention, whose fused kernel a training graph picks when it
 * is compiled (and whose math kernel the passes decompose). */
int em_guard_sdp_flags(GuardBuilder *b);

/* Compacts the builder into a guard set that outlives the arena. NULL with exception on failure. */
GuardSet *em_guard_build(GuardBuilder *b);
void em_guard_set_free(GuardSet *gs);
int em_guard_nfetch(const GuardSet *gs);

/* Evaluates the guards against a frame. Returns 1 if every guard passes; then fetched[0..nfetch)
 * hold new references to the fetched sources (the caller releases them). Returns 0 if a guard
 * fails (*failed = index of the failing guard, fetched holds nothing). A source that cannot be
 * evaluated (attribute error, ...) counts as a failure, and the exception is cleared. */
int em_guard_check(GuardSet *gs, const EmFrameView *fv, PyObject **fetched, int *failed);
/* Is every object gs checks by identity straight from a frame local (___id(L['self'])) the one that
 * local holds now, or one that nothing but gs keeps alive? Dynamo's _has_same_id_matched_objs
 * (torch/_dynamo/cache_size.py, whose guards hold such objects weakly): the entries a frame's
 * recompile limit counts are those made for the same live objects, so one code object serving many
 * module instances (a model's blocks) is not cut off after the limit, while a frame guarded on a
 * fresh object per call still is. Never fails. */
bool em_guard_same_id_locals(const GuardSet *gs, const EmFrameView *fv);
/* 3.11 only (3.12's dict watchers need none of this; there both calls are no-ops). A compiled
 * graph's callable (a backend's compiled function: Inductor's creates dicts on every call) moves
 * 3.11's global dict-version counter, so the next check's probe (em_guard.c) would see "some dict
 * changed" and walk the whole dict group: a cost that grows with the number of guarded dicts
 * (hook dicts of every submodule). The callable is a compiled form of a graph, which mutates no
 * Python object (torch's backend contract: the callable computes what the fx graph computes; the
 * frame's own writes are replayed by ember after it), so the dict activity inside it is excused:
 * em_guard_window_open, right before the call, checks that nothing changed since gs passed (a
 * probe); em_guard_window_close, right after a successful call, re-reads the counter without
 * moving the epoch, unless other code may have run inside the call: stamp (read by the caller,
 * em_hook_window_stamp) moved because another thread took the GIL or the cyclic GC ran, or a
 * nested window opened (compiled code answered inside the call). Small groups (no probe) open
 * no window. */
typedef struct EmGraphWindow {
    uint64_t gen;
    unsigned long stamp;
    int open;
} EmGraphWindow;
void em_guard_window_open(const GuardSet *gs, EmGraphWindow *w, unsigned long stamp);
void em_guard_window_close(EmGraphWindow *w, unsigned long stamp);
/* UNSAFE by design (ember.pin): fills fetched like a passing em_guard_check without evaluating a
 * single leaf. 1, or 0 when a fetched source cannot be evaluated (exception cleared). */
int em_guard_fetch_only(GuardSet *gs, const EmFrameView *fv, PyObject **fetched);

/* For a fallback entry, which runs the original bytecode and so is correct under any guards:
 * em_guard_drop_fetch makes em_guard_check fetch nothing (the entry runs no graph);
 * em_guard_drop removes leaf index (later leaves move down by one), so that an entry whose guards
 * fail on the very inputs they were made from can still answer those inputs. 0, or -1 for a bad
 * index. */
void em_guard_drop_fetch(GuardSet *gs);
int em_guard_drop(GuardSet *gs, int index);

/* Every guard as a line of Python source, in evaluation order (list of str, new reference). */
PyObject *em_guard_render(const GuardSet *gs);
/* One guard's line (new str), e.g. for the recompilation warning. */
PyObject *em_guard_render_one(const GuardSet *gs, int index);
/* The source of each fetch slot as one line of Python (debug dumps). New list. */
PyObject *em_guard_render_fetch(const GuardSet *gs);
int em_guard_count(const GuardSet *gs);

/* Module init/teardown of the guard stage (dict watcher registration on 3.12, torch objects). */
int em_guard_init(PyObject *module);
/* Does this CPython hide stores through an object's inline values from its __dict__'s guards (3.13.0,
 * gh-125608; found by trying it at init)? The tracer then detaches an instance __dict__ it reads
 * from its object's inline values (em_trace_attr.c, em_tr_instance_dict_borrow). */
int em_guard_inline_values_unseen(void);
void em_guard_fini(void);

#endif /* EM_GUARD_H */
