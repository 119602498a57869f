/* hook: the front of the pipeline. Owns
 *  - the per-code-object cache (co_extra): cache entries (guards + compiled callable + return
 *    spec), most recently used first, freed with the code object          [em_hook_cache.c]
 *  - the compile driver on a miss: trace -> backend -> new entry           [em_hook_cache.c]
 *  - ember._C.CompiledFunction, the C callable ember.compile returns (direct dispatch: bind,
 *    guard, run, without a frame)                                          [em_hook_dispatch.c]
 *  - the PEP 523 frame evaluation function, acting only on the thread that installed it
 *                                                                          [em_hook.c]
 *  - entering and leaving compiled and ember.disable regions per thread; the frame evaluation
 *    function is installed only while a compiled call runs original bytecode [em_hook_install.c]
 *  - running a graph-break entry: graph, values at the break, stub          [em_hook_break.c]
 *  - ember.debug.dump's bridge                                             [em_hook_debug.c]
 *  - the CPython internals the hook needs (private header)                 [em_hook_cpython.h]
 * Invariant: a frame is answered by a cache entry only if all its guards passed; anything else
 * runs the original bytecode.
 * Calls between the files run one way: em_hook.c and dispatch -> break, debug, cache; break ->
 * cache; all of them -> install. The one circle is cache <-> debug (see ember.debug.dump below). */
#ifndef EM_HOOK_H
#define EM_HOOK_H

#include "core/em_core.h"
#include "guard/em_guard.h"
#include "runtime/em_runtime.h"

/* How a compiled call wants frames compiled: shared by the direct call and by the PEP 523 hook
 * for the frames it reaches. Lives inside the CompiledFunction object. */
typedef struct EmCompileConfig {
    PyObject *backend;     /* "eager" str, or a callable (gm, example_inputs) -> callable; or the
                              name of a registered backend ("inductor") */
    PyObject *backend_key; /* identity used to match cache entries to this backend */
    int fullgraph;         /* a break raises instead of falling back */
    int dynamic;           /* -1: None (automatic dynamic), 0: False (static), 1: True */
    PyObject *cudagraphs;  /* mode="reduce-overhead": the ember._cudagraphs.Pool of the compiled
                              function (strong), NULL otherwise: graph entries are wrapped in an
                              ember._C.CudaGraphs runner (em_runtime_cudagraph.c) */
} EmCompileConfig;

typedef enum { ENTRY_GRAPH, ENTRY_FALLBACK, ENTRY_BREAK } EntryKind;

/* What a graph-break entry runs after its graph (em_hook_break.c): the values live at the break
 * are built, the resume functions are made (with the frame's cells), and the stub is called with
 * them while the hook is active, so the resume functions' frames are compiled in turn. Made and
 * freed with its entry (em_hook_cache.c). */
typedef struct BreakPart {
    PyObject *stub;          /* code object (strong) */
    int stub_closure;        /* the stub needs the cells: made per call */
    PyObject *stub_fn;       /* the stub as a function for stub_globals (strong), reused */
    PyObject *stub_globals;  /* strong */
    PyObject *resume[2];     /* code objects (strong) */
    int nresume;
    OutSpec *values;         /* tuple: stub arguments, then new cells' contents (em_out_copy) */
    uint32_t nargs;
    uint32_t ncells;
    int32_t *cell_closure;   /* ncells: index into the frame's closure, or -1: a new cell */
    int32_t *cell_value;     /* ncells: index into the values of a new cell's contents, or -1 */
    int restore_grad;        /* -1, or the grad mode to restore if the stub raises */
} BreakPart;

typedef struct CacheEntry {
    struct CacheEntry *next;
    EntryKind kind;
    GuardSet *guards;
    PyObject *backend_key;   /* strong */
    PyObject *compiled;      /* GRAPH: the backend's callable (strong) */
    int eager_graph;         /* compiled is an ember._C.EagerGraph: call it without a tuple */
    OutSpec *out;            /* GRAPH: return value spec (malloc) */
    int *input_fetch;        /* GRAPH: graph input i = fetch slot input_fetch[i] (malloc) */
    uint32_t ninputs;
    int grad_restore;        /* GRAPH: -1, or the grad mode to restore when the graph raises (it
                                changes grad mode: with torch.no_grad() inside the frame) */
    BreakPart *brk;          /* BREAK: the part after the graph (compiled is NULL for an empty graph) */
    OutSpec *effects;        /* GRAPH/BREAK: side effects replayed after the graph, or NULL */
    PyObject *effect_names;  /* tuple of names, one per (target, value) pair of effects */
    PyObject *info;          /* dict for ember.cache_info: graph text, guards, reason ... */
    PyObject *debug_fn;      /* ember.debug.dump: the entry's transformed code compiled from the dumped
                                file, called with the frame's arguments instead (strong), or NULL */
    uint64_t hits;
    int last_resort;         /* made because the traced code raised for these inputs (a break or fallback
                                at RAISE / META_FAILED): looked up after every other entry, so that
                                its guards, as general as the sizes it was traced at, never take a
                                call another entry serves (x.reshape(-1, 4) at a size 4 does not
                                divide, then at one it does: the symbolic graph's) */
} CacheEntry;

typedef struct ExtraState {
    CacheEntry *head;
    int nentries;
    int warned_limit;        /* the cache_size_limit warning was given for this code */
    int skip;                /* never compile this code (ember's own code, ember.disable, no tensor
                                operations: skip_reason) */
    const char *skip_reason; /* why the hook skips this code after meeting it, or NULL (static text) */
    int max_fetch;           /* the most fetch slots any entry uses: lookups need that much room */
    int pinned;              /* ember.pin: UNSAFE, lookups skip the guards and take the most recently
                                used entry of the backend (em_cache_lookup) */
    PyObject *resume_cache;  /* dict: the resume functions' code objects made from this code */
    PyObject *frame_state;   /* dict: tensor input source -> sizes seen (automatic dynamic) */
} ExtraState;

/* ---- cache (em_hook_cache.c) ---- */
/* The code's cache, created on demand (create=1). NULL without exception when create=0 and none. */
ExtraState *em_cache_get(PyCodeObject *code, int create);
/* Finds an entry of this backend whose guards pass. On a hit returns it (moved to the front) with
 * fetched[] filled (new references, em_guard_nfetch(entry->guards) of them; fetched must have room
 * for EM_MAX_FETCH). Returns NULL on a miss (*last_failed_entry / *last_failed_guard describe the
 * most recent entry's failure, for the recompilation warning; -1 if none). Never raises. */
/* A pinned code (es->pinned, ember.pin) skips every guard: the most recently used entry of this
 * backend answers, with only its fetched sources evaluated (a source that cannot be evaluated
 * falls back to the guarded lookup). Unsafe by design: the entry may not match the inputs. */
/* Callers size fetched buffers with EM_MAX_FETCH (stack arrays are fine: 4 KiB); a trace that
 * would need more fetch slots becomes a fallback entry. */
enum { EM_MAX_FETCH = 512 };
CacheEntry *em_cache_lookup(ExtraState *es, const EmFrameView *fv, PyObject *backend_key,
                            PyObject **fetched, CacheEntry **last_failed_entry, int *last_failed_guard);
/* Traces the frame and adds an entry (graph or fallback). On success returns the new entry and,
 * for a graph entry, fills fetched like em_cache_lookup. Returns NULL with an exception for errors
 * (and for a break when cfg->fullgraph). Honors config.cache_size_limit: past it returns a fallback
 * that is not stored, after one warning per code object. hooked: the frame was met by the hook
 * (not the function the user compiled): a trace without tensor operations then marks the code
 * skipped (es->skip, es->skip_reason) and returns a fallback that is not stored. */
CacheEntry *em_cache_compile(ExtraState *es, PyObject *func, PyCodeObject *code, const EmFrameView *fv,
                             const EmCompileConfig *cfg, PyObject **fetched, int hooked);
/* Runs a graph entry: calls the compiled callable with the graph inputs taken from fetched, builds
 * the return value, releases fetched. New reference or NULL with exception. */
PyObject *em_entry_run(CacheEntry *e, PyObject **fetched, PyObject *globals);
/* Performs an entry's recorded side effects (attribute and global stores) in program order,
 * after its graph ran. globals: the frame's. 0, or -1 with an exception. */
int em_effects_replay(const CacheEntry *e, PyObject *graph_out, PyObject *const *fetched, PyObject *cells,
                      PyObject *globals);
void em_fetched_release(CacheEntry *e, PyObject **fetched);
/* Runs a graph-break entry: graph, values at the break, then the stub (which runs the breaking
 * instruction and returns the resume function's result) with the hook active under cfg. Releases
 * fetched. New reference or NULL with an exception. [em_hook_break.c] */
PyObject *em_entry_run_break(CacheEntry *e, PyObject **fetched, const EmFrameView *fv, const EmCompileConfig *cfg);
/* Puts the grad mode back while keeping a pending exception (a graph or stub raised). */
void em_entry_restore_grad_mode(int mode);
/* Drops every cache entry of every code object ember has seen (ember.reset). */
void em_cache_reset_all(void);
/* list of dicts describing the code's entries (new reference). */
PyObject *em_cache_info(PyCodeObject *code);
/* One entry's info dict (ember.cache_info's item, less "hits"): e->info with its guards rendered
 * now. New dict, or NULL with an exception. */
PyObject *em_cache_entry_info(const CacheEntry *e);
/* ember.pin / ember.unpin: sets es->pinned of the code (created on demand). 0, or -1 with an
 * exception. */
int em_cache_pin(PyCodeObject *code, int pinned);
int em_cache_init(PyObject *module);

/* ---- PEP 523 hook: install and enable state (em_hook_install.c) ---- */
/* Enters a region in which frames started by this thread are compiled with cfg (nesting allowed;
 * the innermost config wins). Installs the frame evaluation function if no thread has it. */
void em_hook_enter(const EmCompileConfig *cfg);
void em_hook_exit(void);
/* Regions in which the hook passes everything through and compiled calls run eagerly
 * (ember.disable as a context manager / decorator). */
void em_hook_disable_enter(void);
void em_hook_disable_exit(void);
int em_hook_disabled(void);
/* The next frame of this code started by this thread runs its original bytecode (the caller
 * already looked it up and decided so). */
void em_hook_skip_next(PyCodeObject *code);

/* ---- PEP 523 hook: the frame evaluation function (em_hook.c) ---- */
/* Should the hook leave this code alone (ember's, torch's, stdlib, generator ...)? Cached in the
 * ExtraState.skip flag. */
int em_hook_skip_code(PyCodeObject *code);
/* Sets code's ExtraState.skip flag by request (skip 0: compiled even where the skip rules would
 * leave it alone; 1: never compiled) and clears its skip reason. Returns None, or NULL with a
 * TypeError naming caller when code is not a code object. */
PyObject *em_hook_set_skip(PyObject *code, int skip, const char *caller);
int em_hook_init(PyObject *module);

/* ---- ember.debug.dump (em_hook_debug.c) ----
 * A real mutual dependency with the cache (em_hook_cache.c): the compile driver describes each new
 * entry to the dump while the trace's result still lives (em_debug_on_compile, inside
 * em_cache_compile, before the trace's arena is freed), and the dump describes and runs entries
 * with the cache's own helpers (em_cache_entry_info, em_cache_get, em_fetched_release,
 * em_entry_restore_grad_mode). The dump observes compilation and reads what it made. */
int em_debug_dumping(void);
/* A hit on an entry with a debug function runs it: a dump is active and dumped code is not nested
 * too deep on this thread. */
int em_debug_use(void);
/* After a new entry is complete (before the trace's arena is freed): describes it to the dump
 * hook and stores the function it returns in e->debug_fn. */
struct EmTraceResult;
void em_debug_on_compile(CacheEntry *e, PyCodeObject *code, PyObject *globals, const struct EmTraceResult *res,
                         double seconds);
/* Runs an entry's debug function with the frame's arguments (hook active under cfg); releases
 * fetched. New reference or NULL with an exception. */
PyObject *em_debug_run(CacheEntry *e, PyObject **fetched, const EmFrameView *fv, const EmCompileConfig *cfg);
int em_debug_init(PyObject *module);

/* ---- direct dispatch (em_hook_dispatch.c) ---- */
int em_dispatch_init(PyObject *module);

#endif /* EM_HOOK_H */
