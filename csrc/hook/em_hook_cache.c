/* hook/cache: the per-code-object cache of compiled entries and the compile driver.
 * Each code object ember has seen carries an ExtraState in co_extra: a list of cache entries,
 * most recently used first (Dynamo's extra_state.cpp keeps the same order). An entry answers a
 * call only if all its guards pass. The ExtraState is freed with its code object (co_extra's free
 * function); ember.reset drops the entries of every live ExtraState. */
#include "hook/em_hook.h"
#include "hook/em_hook_cpython.h"

#include "trace/em_trace.h"
#include "autograd/em_autograd.h"

#include <stdlib.h>
#include <string.h>

#if EM_PY312
#define EM_REQUEST_EXTRA_INDEX PyUnstable_Eval_RequestCodeExtraIndex
#define EM_CODE_GET_EXTRA PyUnstable_Code_GetExtra
#define EM_CODE_SET_EXTRA PyUnstable_Code_SetExtra
#else
#define EM_REQUEST_EXTRA_INDEX _PyEval_RequestCodeExtraIndex
#define EM_CODE_GET_EXTRA _PyCode_GetExtra
#define EM_CODE_SET_EXTRA _PyCode_SetExtra
#endif

/* ExtraStates live in a doubly linked list so that ember.reset can reach every one of them; the
 * list holds no reference to the code objects (an ExtraState dies with its code). */
typedef struct ExtraNode {
    ExtraState state; /* first member: ExtraState* and ExtraNode* convert */
    struct ExtraNode *prev, *next;
    PyCodeObject *code; /* borrowed: the owner */
} ExtraNode;

static Py_ssize_t extra_index = -1;
static ExtraNode *extra_list = NULL;
static PyObject *config_obj = NULL;     /* ember._config.config */
static PyObject *compile_graph_fn = NULL; /* ember._backends.compile_graph, imported lazily */
static PyObject *graph_break_error = NULL; /* ember._C.GraphBreakError */
static PyObject *eager_str = NULL;

/* Releases a graph-break entry's part after the graph (made by make_break_entry). */
static void break_part_free(BreakPart *bp) {
    if (!bp) return;
    Py_XDECREF(bp->stub);
    Py_XDECREF(bp->stub_fn);
    Py_XDECREF(bp->stub_globals);
    for (int k = 0; k < 2; k++) Py_XDECREF(bp->resume[k]);
    em_out_free(bp->values);
    free(bp->cell_closure);
    free(bp->cell_value);
    free(bp);
}

/* Releases one entry and everything it owns. */
static void entry_free(CacheEntry *e) {
    if (!e) return;
    em_guard_set_free(e->guards);
    Py_XDECREF(e->backend_key);
    Py_XDECREF(e->compiled);
    em_out_free(e->out);
    free(e->input_fetch);
    break_part_free(e->brk);
    em_out_free(e->effects);
    Py_XDECREF(e->effect_names);
    Py_XDECREF(e->info);
    Py_XDECREF(e->debug_fn);
    free(e);
}

static void entries_free(ExtraState *es) {
    CacheEntry *e = es->head;
    while (e) {
        CacheEntry *n = e->next;
        entry_free(e);
        e = n;
    }
    es->head = NULL;
    es->nentries = 0;
    es->warned_limit = 0;
    es->max_fetch = 0;
    Py_CLEAR(es->resume_cache);
    Py_CLEAR(es->frame_state);
}

/* co_extra free function: called by CPython when the code object is deallocated. */
static void extra_free(void *p) {
    ExtraNode *n = p;
    if (!n) return;
    entries_free(&n->state);
    if (n->prev) n->prev->next = n->next;
    else extra_list = n->next;
    if (n->next) n->next->prev = n->prev;
    free(n);
}

ExtraState *em_cache_get(PyCodeObject *code, int create) {
    void *p = NULL;
    if (EM_CODE_GET_EXTRA((PyObject *)code, extra_index, &p) < 0) {
        PyErr_Clear();
        return NULL;
    }
    if (p || !create) return p;
    ExtraNode *n = calloc(1, sizeof(ExtraNode));
    if (!n) return NULL;
    n->code = code;
    if (EM_CODE_SET_EXTRA((PyObject *)code, extra_index, n) < 0) {
        PyErr_Clear();
        free(n);
        return NULL;
    }
    n->next = extra_list;
    if (extra_list) extra_list->prev = n;
    extra_list = n;
    return &n->state;
}

/* ---- logs (ember.set_logs): each builds its record only when its topic is on (em_core.h) ---- */

/* {"code": qualname, "filename": ..., "firstlineno": ...} of the code a record is about. */
static PyObject *log_record(PyCodeObject *code) {
    return Py_BuildValue("{s:O,s:O,s:i}", "code", code->co_qualname, "filename", code->co_filename, "firstlineno",
                         code->co_firstlineno);
}

/* +guards: one record per entry whose guards failed during a lookup. */
static void log_guard_failure(ExtraState *es, CacheEntry *e, int failed) {
    PyObject *d = log_record(((ExtraNode *)es)->code);
    PyObject *g = failed >= 0 ? em_guard_render_one(e->guards, failed) : Py_NewRef(Py_None);
    if (d && g && PyDict_SetItemString(d, "failed_guard", g) < 0) Py_CLEAR(d);
    if (d && PyDict_SetItemString(d, "event", em_str("guard_failure")) < 0) Py_CLEAR(d);
    Py_XDECREF(g);
    em_log_emit_steal(EM_LOG_GUARDS, d);
}

void em_cache_reset_all(void) {
    for (ExtraNode *n = extra_list; n; n = n->next) entries_free(&n->state);
}

CacheEntry *em_cache_lookup(ExtraState *es, const EmFrameView *fv, PyObject *backend_key,
                            PyObject **fetched, CacheEntry **last_failed_entry, int *last_failed_guard) {
    CacheEntry *prev = NULL;
    *last_failed_entry = NULL;
    *last_failed_guard = -1;
    if (es->pinned) { /* ember.pin: no guard runs (unsafe by design, em_hook.h) */
        for (CacheEntry *e = es->head; e; e = e->next) {
            if (e->backend_key != backend_key) continue;
            if (em_guard_fetch_only(e->guards, fv, fetched) != 1) break;
            e->hits++;
            return e;
        }
    }
    for (int pass = 0; pass < 2; pass++) { /* the entries of traces that raised last (CacheEntry.last_resort) */
        prev = NULL;
        for (CacheEntry *e = es->head; e; prev = e, e = e->next) {
            if (e->backend_key != backend_key || e->last_resort != pass) continue;
            int failed = -1;
            int ok = em_guard_check(e->guards, fv, fetched, &failed);
            if (ok == 1) {
                if (prev) { /* move to front: most recently used first */
                    prev->next = e->next;
                    e->next = es->head;
                    es->head = e;
                }
                e->hits++;
                return e;
            }
            if (!*last_failed_entry) {
                *last_failed_entry = e;
                *last_failed_guard = failed;
            }
            if (EM_LOG_DEBUG_ON(EM_LOG_GUARDS)) log_guard_failure(es, e, failed);
        }
    }
    return NULL;
}

void em_fetched_release(CacheEntry *e, PyObject **fetched) {
    int n = em_guard_nfetch(e->guards);
    for (int i = 0; i < n; i++) Py_CLEAR(fetched[i]);
}

/* After a graph that changes grad mode raised: put back the mode the frame was entered with, as
 * the `with` block's __exit__ would have in eager, keeping the pending exception. */
void em_entry_restore_grad_mode(int mode) {
    static PyObject *set_grad = NULL; /* torch._C._set_grad_enabled; one interpreter (em_module.c) */
#if EM_PY312
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *exc_t, *exc_v, *exc_tb;
    PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
#endif
    em_lazy_attr(&set_grad, "torch._C", "_set_grad_enabled");
    PyObject *r = set_grad ? PyObject_CallOneArg(set_grad, mode ? Py_True : Py_False) : NULL;
    Py_XDECREF(r);
    PyErr_Clear();
#if EM_PY312
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(exc_t, exc_v, exc_tb);
#endif
}

int em_effects_replay(const CacheEntry *e, PyObject *graph_out, PyObject *const *fetched, PyObject *cells,
                      PyObject *globals) {
    PyObject *vals = em_out_build_values(e->effects, graph_out, fetched, cells);
    if (!vals) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(e->effect_names);
    int rc = PyTuple_GET_SIZE(vals) == 2 * n ? 0 : -1;
    if (rc < 0) PyErr_SetString(PyExc_SystemError, "ember: malformed side effects");
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        PyObject *target = PyTuple_GET_ITEM(vals, 2 * i), *v = PyTuple_GET_ITEM(vals, 2 * i + 1);
        PyObject *name = PyTuple_GET_ITEM(e->effect_names, i);
        if (name == Py_Ellipsis) { /* an input list/dict takes its final contents (em_trace_effects.c) */
            if (PyList_CheckExact(target) && PyList_Check(v)) {
                rc = PyList_SetSlice(target, 0, PY_SSIZE_T_MAX, v);
            } else if (PyDict_CheckExact(target) && PyDict_Check(v)) {
                PyDict_Clear(target);
                rc = PyDict_Update(target, v);
            } else {
                PyErr_SetString(PyExc_SystemError, "ember: malformed container write-back");
                rc = -1;
            }
        } else {
            rc = target == Py_None ? PyDict_SetItem(globals, name, v) : PyObject_SetAttr(target, name, v);
        }
    }
    Py_DECREF(vals);
    return rc;
}

PyObject *em_entry_run(CacheEntry *e, PyObject **fetched, PyObject *globals) {
    PyObject *small[16];
    PyObject **args = e->ninputs <= 16 ? small : PyMem_Malloc(e->ninputs * sizeof(PyObject *));
    PyObject *out = NULL, *result = NULL;
    if (!args) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t i = 0; i < e->ninputs; i++) args[i] = fetched[e->input_fetch[i]];
    EmGraphWindow w;
    em_guard_window_open(e->guards, &w, em_hook_window_stamp());
    if (e->eager_graph) out = em_eager_graph_run(e->compiled, args, e->ninputs);
    else out = PyObject_Vectorcall(e->compiled, args, e->ninputs, NULL);
    if (out) em_guard_window_close(&w, em_hook_window_stamp());
    if (!out) {
        if (e->grad_restore >= 0) em_entry_restore_grad_mode(e->grad_restore);
        goto done;
    }
    result = em_out_build(e->out, out, fetched);
    if (result && e->effects && em_effects_replay(e, out, fetched, NULL, globals) < 0) Py_CLEAR(result);
done:
    Py_XDECREF(out);
    if (args && args != small) PyMem_Free(args);
    em_fetched_release(e, fetched);
    return result;
}

/* ---- compile driver ---- */

/* Reads an int attribute of ember.config, with a default when it is missing or not an int. */
static long config_int(const char *name, long dflt) {
    if (!config_obj) return dflt;
    PyObject *v = PyObject_GetAttrString(config_obj, name);
    if (!v) {
        PyErr_Clear();
        return dflt;
    }
    long r = PyLong_Check(v) ? PyLong_AsLong(v) : dflt;
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        r = dflt;
    }
    return r;
}

/* A short "name (file:line)" for messages about a code object. New str. */
static PyObject *code_where(PyCodeObject *code) {
    return PyUnicode_FromFormat("%U (%U:%d)", code->co_qualname, code->co_filename, code->co_firstlineno);
}

/* The info dict of an entry for ember.cache_info, without "guards": em_cache_entry_info renders
 * them when asked (rendering every guard's text cost a tenth of a warm compile). */
static PyObject *entry_info(EntryKind kind, const EmCompileConfig *cfg, const EmTraceResult *res,
                            PyObject *graph_text, PyObject *out_text) {
    PyObject *d = PyDict_New(), *backend = NULL;
    if (!d) return NULL;
    backend = PyUnicode_Check(cfg->backend) ? Py_NewRef(cfg->backend) : PyObject_Repr(cfg->backend);
    if (!backend) goto error;
    const EmBreakInfo *b = &res->brk;
    int fallback = kind != ENTRY_GRAPH; /* a break entry reports its break like a fallback */
    PyObject *reason = fallback ? PyUnicode_FromString(em_break_name(b->reason)) : Py_NewRef(Py_None);
    PyObject *reason_text = fallback ? PyUnicode_FromString(em_break_text(b->reason)) : Py_NewRef(Py_None);
    PyObject *lineno = fallback && b->lineno >= 0 ? PyLong_FromLong(b->lineno) : Py_NewRef(Py_None);
    int bad = !reason || !reason_text || !lineno ||
              PyDict_SetItemString(d, "kind", em_str(kind == ENTRY_BREAK ? "break" : fallback ? "fallback" : "graph")) < 0 ||
              PyDict_SetItemString(d, "backend", backend) < 0 ||
              PyDict_SetItemString(d, "graph", graph_text ? graph_text : Py_None) < 0 ||
              PyDict_SetItemString(d, "output", out_text ? out_text : Py_None) < 0 ||
              PyDict_SetItemString(d, "reason", reason) < 0 ||
              PyDict_SetItemString(d, "reason_text", reason_text) < 0 ||
              PyDict_SetItemString(d, "detail", fallback && b->detail ? b->detail : Py_None) < 0 ||
              PyDict_SetItemString(d, "filename", fallback && b->filename ? b->filename : Py_None) < 0 ||
              PyDict_SetItemString(d, "lineno", lineno) < 0 ||
              PyDict_SetItemString(d, "opname", fallback && b->opname ? b->opname : Py_None) < 0;
    Py_XDECREF(reason);
    Py_XDECREF(reason_text);
    Py_XDECREF(lineno);
    if (bad) goto error;
    Py_DECREF(backend);
    return d;
error:
    Py_XDECREF(backend);
    Py_DECREF(d);
    return NULL;
}

/* Is this a training graph of backend "ember" or "aot_eager"? AOT autograd compiles a symbolic graph to one
 * region for all sizes where every rule it needs serves symbolic sizes (csrc/autograd, "Symbolic
 * sizes"); where one does not, the graph is traced again with concrete sizes, one region per size
 * (docs/dynamic_shapes.md), rather than run by the eager backend. Its C and CUDA code generators take
 * symbolic inference graphs (sizes as kernel arguments, docs/backend_cpu.md "Symbolic sizes"). */
static int specialises_sizes(const EmCompileConfig *cfg, const IRGraph *g) {
    if (!PyUnicode_Check(cfg->backend) || (PyUnicode_CompareWithASCIIString(cfg->backend, "ember") != 0 &&
                                          PyUnicode_CompareWithASCIIString(cfg->backend, "aot_eager") != 0))
        return 0;
    return em_autograd_needed(g) ? 1 : 0;
}

/* A symbolic training graph compiled before its entry is made (em_cache_compile tries the symbolic
 * region first): backend_compile hands it over for that graph instead of compiling again (per
 * thread: another thread may compile while this one waits for a C compiler). */
static _Thread_local struct {
    const IRGraph *graph;
    PyObject *compiled, *info;
    int eager_graph;
    const char *info_key;
    double secs;
} precompiled;

static void precompiled_clear(void) {
    Py_CLEAR(precompiled.compiled);
    Py_CLEAR(precompiled.info);
    precompiled.graph = NULL;
}

/* Hands the graph to the backend. "eager" compiles to an ember._C.EagerGraph in C; anything else
 * goes through ember._backends.compile_graph(backend, export, example_inputs, name), which builds
 * the torch.fx.GraphModule and calls the backend. New reference, or NULL with an exception. */
static PyObject *backend_compile_timed(const EmCompileConfig *cfg, const EmTraceResult *res, PyCodeObject *code,
                                       int *is_eager_graph, PyObject **backend_info, const char **info_key) {
    *is_eager_graph = 0;
    *info_key = "ember";
    if (PyUnicode_Check(cfg->backend) && PyUnicode_Compare(cfg->backend, eager_str) == 0) {
        *is_eager_graph = 1;
        return em_eager_graph_new(res->graph);
    }
    if (PyUnicode_Check(cfg->backend) && PyUnicode_CompareWithASCIIString(cfg->backend, "aot_eager") == 0) {
        /* ahead-of-time autograd: joint graph, min-cut partition, a torch.autograd.Function */
        *info_key = "autograd";
        return em_autograd_compile(res->graph, false, is_eager_graph, backend_info);
    }
    if (PyUnicode_Check(cfg->backend) && PyUnicode_CompareWithASCIIString(cfg->backend, "ember") == 0 &&
        em_autograd_needed(res->graph)) {
        *info_key = "autograd"; /* training: both halves through ember's code generator */
        return em_autograd_compile(res->graph, true, is_eager_graph, backend_info);
    }
    if (PyUnicode_Check(cfg->backend) && PyUnicode_CompareWithASCIIString(cfg->backend, "ember") == 0) {
        *is_eager_graph = 1; /* the "ember" backend's program is an EagerGraph of kernels and extern calls */
        /* the inference passes (passes/em_passes.c: decompose attention, layout ...) when sizes are
         * concrete (the decompositions read them), those that serve symbolic sizes (skinny_mm) when
         * they are not; what they did goes to cache_info()[i]["ember"] */
        EmPassCtx pc = {.when = res->symbolic ? EM_PASSES_INFERENCE_SYM : EM_PASSES_INFERENCE};
        const IRGraph *g2 = em_passes_run(res->graph, &pc);
        double t0 = em_now();
        PyObject *r = g2 ? em_ember_compile(g2, backend_info) : NULL;
        if (r && pc.info && *backend_info && PyDict_Check(*backend_info)) {
            PyObject *pt = PyDict_GetItemString(pc.info, "pass_times"); /* borrowed; seconds per pass */
            PyObject *t = pt ? PyFloat_FromDouble(em_now() - t0) : NULL;
            if (pt && (!t || PyDict_SetItemString(pt, "lower_codegen_load", t) < 0)) Py_CLEAR(r);
            Py_XDECREF(t);
            if (r && PyDict_Update(*backend_info, pc.info) < 0) Py_CLEAR(r);
        }
        Py_XDECREF(pc.info);
        return r;
    }
    if (!em_lazy_attr(&compile_graph_fn, "ember._backends", "compile_graph")) return NULL;
    PyObject *export = NULL, *examples = NULL, *r = NULL;
    export = em_ir_to_python(res->graph);
    if (!export) goto done;
    examples = PyList_New(res->ninputs);
    if (!examples) goto done;
    for (uint32_t i = 0; i < res->ninputs; i++) PyList_SET_ITEM(examples, i, Py_NewRef(res->example_inputs[i]));
    r = PyObject_CallFunctionObjArgs(compile_graph_fn, cfg->backend, export, examples, code->co_name, NULL);
done:
    Py_XDECREF(export);
    Py_XDECREF(examples);
    return r;
}

/* Is torch.autocast on for some device? 1 yes, 0 no, -1 with an exception. */
static int autocast_on(void) {
    static PyObject *any = NULL; /* torch._C._is_any_autocast_enabled; one interpreter (em_module.c) */
    if (!em_lazy_attr(&any, "torch._C", "_is_any_autocast_enabled")) return -1;
    PyObject *r = PyObject_CallNoArgs(any);
    if (!r) return -1;
    int on = r == Py_True;
    Py_DECREF(r);
    return on;
}

/* Sets backend_info["autocast"] (creating the dict): value is stolen. -1 with an exception. */
static int set_autocast_info(PyObject **backend_info, PyObject *value) {
    if (!value) return -1;
    if (!*backend_info && !(*backend_info = PyDict_New())) {
        Py_DECREF(value);
        return -1;
    }
    int rc = PyDict_Check(*backend_info) ? PyDict_SetItemString(*backend_info, "autocast", value) : 0;
    Py_DECREF(value);
    return rc;
}

typedef struct {
    const EmCompileConfig *cfg;
    const EmTraceResult *res;
    PyCodeObject *code;
    int *is_eager_graph;
    PyObject **backend_info;
    const char **info_key;
} CompileCall;

static PyObject *compile_call(void *ctx) {
    CompileCall *c = ctx;
    return backend_compile_timed(c->cfg, c->res, c->code, c->is_eager_graph, c->backend_info, c->info_key);
}

/* Backends "ember" and "aot_eager" under torch.autocast, or for a graph that enters autocast
 * blocks (with torch.autocast(...) in the frame): the graph with autocast's casts written
 * as nodes (the autocast pass, passes/em_pass_autocast.c) is compiled and run with autocast off
 * (em_with_autocast_off, em_autocast_off_new), so ember's code generator and AOT autograd see
 * explicit dtypes. When the rewrite is not possible, the graph compiles as traced (autocast at
 * dispatch: the eager backend and eager autograd) and backend_info["autocast"]["kept"] says why. */
static PyObject *backend_compile_autocast(const EmCompileConfig *cfg, const EmTraceResult *res, PyCodeObject *code,
                                          int *is_eager_graph, PyObject **backend_info, const char **info_key) {
    PyObject *why = NULL, *r = NULL;
    EmPassCtx pc = {.when = EM_PASSES_AUTOCAST};
    const IRGraph *g2 = em_passes_run(res->graph, &pc);
    long ncasts = pc.ncasts;
    why = pc.why;
    Py_XDECREF(pc.info);
    if (!g2) {
        Py_XDECREF(why);
        return NULL;
    }
    if (g2 == res->graph) { /* not rewritten: why says why */
        if (!why && !(why = PyUnicode_FromString("the rewrite failed"))) return NULL;
        r = backend_compile_timed(cfg, res, code, is_eager_graph, backend_info, info_key);
        if (r && set_autocast_info(backend_info, Py_BuildValue("{s:O,s:N}", "explicit", Py_False, "kept", why)) < 0)
            Py_CLEAR(r);
        else if (!r) Py_DECREF(why);
        return r;
    }
    EmTraceResult r2 = *res;
    r2.graph = (IRGraph *)g2; /* (a new graph of the arena: the pass made it) */
    CompileCall c = {cfg, &r2, code, is_eager_graph, backend_info, info_key};
    if (!(r = em_with_autocast_off(compile_call, &c))) return NULL;
    Py_SETREF(r, em_autocast_off_new(r));
    *is_eager_graph = 0;
    if (r && set_autocast_info(backend_info, Py_BuildValue("{s:O,s:l}", "explicit", Py_True, "casts", ncasts)) < 0)
        Py_CLEAR(r);
    return r;
}

/* backend_compile_timed, adding the seconds it took to *secs (compile_times["backend"]). */
static PyObject *backend_compile(const EmCompileConfig *cfg, const EmTraceResult *res, PyCodeObject *code,
                                 int *is_eager_graph, PyObject **backend_info, const char **info_key, double *secs) {
    if (precompiled.graph && precompiled.graph == res->graph) {
        PyObject *r = precompiled.compiled;
        *is_eager_graph = precompiled.eager_graph;
        *backend_info = precompiled.info;
        *info_key = precompiled.info_key;
        *secs += precompiled.secs;
        precompiled.compiled = precompiled.info = NULL;
        precompiled.graph = NULL;
        return r;
    }
    double t0 = em_now();
    PyObject *r = NULL;
    int ac = PyUnicode_Check(cfg->backend) && (PyUnicode_CompareWithASCIIString(cfg->backend, "ember") == 0 ||
                                                PyUnicode_CompareWithASCIIString(cfg->backend, "aot_eager") == 0)
                 ? (res->graph && em_ir_has_autocast(res->graph) ? 1 : autocast_on())
                 : 0;
    em_passes_record_graphs = em_debug_dumping(); /* each pass's graph for ember.debug.dump */
    if (ac == 1) r = backend_compile_autocast(cfg, res, code, is_eager_graph, backend_info, info_key);
    else if (ac == 0) r = backend_compile_timed(cfg, res, code, is_eager_graph, backend_info, info_key);
    em_passes_record_graphs = false;
    *secs += em_now() - t0;
    return r;
}

/* Raises GraphBreakError for fullgraph=True, naming the reason and the user's source line. */
static void raise_fullgraph(PyCodeObject *code, const EmBreakInfo *b) {
    PyObject *where = code_where(code);
    if (!where) return;
    PyObject *detail = b->detail ? PyUnicode_FromFormat(" (%U)", b->detail) : PyUnicode_FromString("");
    if (detail)
        PyErr_Format(graph_break_error, "fullgraph=True but %U cannot be captured whole: %s%U at %S:%d", where,
                     em_break_text(b->reason), detail, b->filename ? b->filename : code->co_filename, b->lineno);
    Py_XDECREF(detail);
    Py_DECREF(where);
}

/* Turns a graph entry into a fallback entry (reason and detail recorded in its info dict). */
static int mark_fallback(CacheEntry *e, EmBreak reason, PyObject *detail) {
    e->kind = ENTRY_FALLBACK;
    Py_CLEAR(e->compiled);
    Py_CLEAR(e->debug_fn); /* a dump's transformed code would run the graph: never on trust */
    PyObject *name = PyUnicode_FromString(em_break_name(reason)), *text = PyUnicode_FromString(em_break_text(reason));
    int r = !name || !text || PyDict_SetItemString(e->info, "kind", em_str("fallback")) < 0 ||
                    PyDict_SetItemString(e->info, "reason", name) < 0 ||
                    PyDict_SetItemString(e->info, "reason_text", text) < 0 ||
                    PyDict_SetItemString(e->info, "detail", detail) < 0 ||
                    PyDict_SetItemString(e->info, "graph", Py_None) < 0 ||
                    PyDict_SetItemString(e->info, "output", Py_None) < 0
                ? -1
                : 0;
    Py_XDECREF(name);
    Py_XDECREF(text);
    return r;
}

/* Fills a graph-break entry from the split: the graph (compiled only when it has calls: an empty
 * graph is not a graph, as in Dynamo), the values spec, the stub and the resume functions' code.
 * The stub's code is never compiled by the hook; the resume functions' code always is (even when
 * the user's file lies where the skip rules look away: the user compiled that function). */
static int make_break_entry(CacheEntry *e, const EmTraceResult *res, const EmCompileConfig *cfg, PyCodeObject *code,
                            PyObject **backend_info, const char **info_key, double *backend_s) {
    const EmSplit *sp = res->split;
    BreakPart *bp = calloc(1, sizeof(BreakPart));
    if (!bp) {
        PyErr_NoMemory();
        return -1;
    }
    e->brk = bp;
    bp->restore_grad = sp->restore_grad;
    bp->stub = Py_NewRef(sp->stub);
    bp->stub_closure = sp->stub_closure;
    bp->nresume = sp->nresume;
    for (int k = 0; k < sp->nresume; k++) bp->resume[k] = Py_NewRef(sp->resume[k]);
    bp->values = em_out_copy(sp->values);
    bp->nargs = sp->nargs;
    bp->ncells = sp->ncells;
    bp->cell_closure = malloc(sizeof(int32_t) * (sp->ncells + 1));
    bp->cell_value = malloc(sizeof(int32_t) * (sp->ncells + 1));
    if (!bp->values || !bp->cell_closure || !bp->cell_value) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    memcpy(bp->cell_closure, sp->cell_closure, sizeof(int32_t) * sp->ncells);
    memcpy(bp->cell_value, sp->cell_value, sizeof(int32_t) * sp->ncells);
    ExtraState *ses = em_cache_get((PyCodeObject *)sp->stub, 1);
    if (!ses) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    ses->skip = 1;
    for (int k = 0; k < sp->nresume; k++)
        if (!em_cache_get((PyCodeObject *)sp->resume[k], 1)) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
    if (em_trace_graph_has_calls(res->graph)) {
        e->compiled = backend_compile(cfg, res, code, &e->eager_graph, backend_info, info_key, backend_s);
        if (!e->compiled) return -1;
    } else if (res->graph->output && em_ir_node(res->graph, res->graph->output)->nargs &&
               em_ir_node(res->graph, res->graph->output)->args[0].n) {
        /* no op, but the values read graph outputs (a symbolic int input passed on): replay the graph */
        e->eager_graph = 1;
        if (!(e->compiled = em_eager_graph_new(res->graph))) return -1;
    }
    e->ninputs = e->compiled ? res->ninputs : 0;
    e->grad_restore = res->grad_restore;
    e->input_fetch = malloc((res->ninputs ? res->ninputs : 1) * sizeof(int));
    if (!e->input_fetch) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(e->input_fetch, res->input_fetch, res->ninputs * sizeof(int));
    return 0;
}

/* recompiles: a compile of a code that already has entries of this backend: the guard of the most
 * recently used one that failed (+recompiles: of every one), or the cache_size_limit reached
 * (limit >= 0). The guards are run again to name the failing one: this costs a guard check per
 * entry, only while the topic is on. */
static void log_recompile(ExtraState *es, PyCodeObject *code, const EmFrameView *fv, const EmCompileConfig *cfg,
                          PyObject **fetched, long limit) {
    PyObject *d = NULL, *failed = NULL;
    int n = 0;
    if (!(d = log_record(code)) || !(failed = PyList_New(0))) goto done;
    for (CacheEntry *e = es->head; e; e = e->next) {
        if (e->backend_key != cfg->backend_key) continue;
        if (n++ && !EM_LOG_DEBUG_ON(EM_LOG_RECOMPILES)) continue;
        int fg = -1;
        if (em_guard_check(e->guards, fv, fetched, &fg) == 1) em_fetched_release(e, fetched);
        PyObject *g = fg >= 0 ? em_guard_render_one(e->guards, fg) : Py_NewRef(Py_None);
        if (!g || PyList_Append(failed, g) < 0) {
            Py_XDECREF(g);
            Py_CLEAR(d);
            goto done;
        }
        Py_DECREF(g);
    }
    if (!n) { /* the first compile of this code for this backend: not a recompile */
        Py_CLEAR(d);
        goto done;
    }
    PyObject *nent = PyLong_FromLong(n), *lim = limit >= 0 ? PyLong_FromLong(limit) : Py_NewRef(Py_None);
    if (!nent || !lim || PyDict_SetItemString(d, "failed_guards", failed) < 0 ||
        PyDict_SetItemString(d, "entries", nent) < 0 || PyDict_SetItemString(d, "cache_size_limit", lim) < 0)
        Py_CLEAR(d);
    Py_XDECREF(nent);
    Py_XDECREF(lim);
done:
    Py_XDECREF(failed);
    if (!d) PyErr_Clear();
    em_log_emit_steal(EM_LOG_RECOMPILES, d);
}

/* graph_breaks, guards, graph, output_code (backend "ember": the generated C; the fx backends log
 * their code from ember._backends), perf: one record each about a new entry. */
static void log_new_entry(CacheEntry *e, PyCodeObject *code) {
    static const uint32_t topics[] = {EM_LOG_GRAPH_BREAKS, EM_LOG_GUARDS, EM_LOG_GRAPH, EM_LOG_OUTPUT_CODE, EM_LOG_PERF};
    PyObject *d = log_record(code), *info = d ? em_cache_entry_info(e) : NULL;
    if (!info || PyDict_SetItemString(d, "info", info) < 0) {
        Py_XDECREF(info);
        Py_XDECREF(d);
        PyErr_Clear();
        return;
    }
    Py_DECREF(info);
    PyObject *graph = PyDict_GetItemString(e->info, "graph"), *ember = PyDict_GetItemString(e->info, "ember");
    for (size_t i = 0; i < sizeof topics / sizeof topics[0]; i++) {
        uint32_t t = topics[i];
        if (!EM_LOG_ON(t)) continue;
        if (t == EM_LOG_GRAPH_BREAKS && e->kind == ENTRY_GRAPH) continue;
        if (t == EM_LOG_GRAPH && (!graph || graph == Py_None)) continue;
        if (t == EM_LOG_OUTPUT_CODE && !ember) continue;
        em_log_emit_steal(t, Py_NewRef(d));
    }
    Py_DECREF(d);
}

/* A fallback entry not stored in the cache (cache_size_limit reached): one static object that
 * callers recognise by its kind; it owns nothing. */
static CacheEntry limit_entry = {.kind = ENTRY_FALLBACK};

/* The same for a frame whose trace holds no tensor operation (skip_no_ops). */
static CacheEntry skip_entry = {.kind = ENTRY_FALLBACK};

/* Does entry e run no graph: a fallback, or a graph break before any tensor operation? */
static bool unproductive(const CacheEntry *e) {
    return e->kind == ENTRY_FALLBACK || (e->kind == ENTRY_BREAK && !e->compiled);
}

/* Frames the hook met (not the function the user compiled) that compiling gains nothing for are
 * skipped from now on, as torch.compile skips them (the skip applies to the code): they run as
 * Python, and the functions they call are still compiled. Running the original bytecode is correct
 * under any inputs. Two kinds, the recompiles log names them:
 *  - a trace without a graph break that holds no tensor operation ("No ops traced for the FX
 *    graph", torch/_dynamo/symbolic_convert.py): a config read by key, an object's __setattr__;
 *  - a second trace in a row that runs no graph (a fallback, or a break before any tensor
 *    operation) while every entry the code has runs none either: its guards failed on new inputs
 *    (a fresh iterator, an object the trace relied on by identity), and each new call would trace
 *    again until cache_size_limit. */
static int skip_no_ops(ExtraState *es, PyCodeObject *code, const EmTraceResult *res, const EmCompileConfig *cfg,
                       int hooked) {
    if (!hooked || cfg->fullgraph) return 0;
    const char *why = NULL;
    if (res->graph && !res->split && !em_trace_graph_has_calls(res->graph)) {
        why = "no tensor operations: the code runs as Python from now on";
    } else if (!res->graph || (res->split && !em_trace_graph_has_calls(res->graph))) {
        int n = 0, all = 1;
        for (CacheEntry *e = es->head; e; e = e->next)
            if (e->backend_key == cfg->backend_key) {
                n++;
                all &= unproductive(e);
            }
        if (n && all) why = "traced again and again without a graph (fallbacks, breaks before any tensor operation): "
                            "the code runs as Python from now on";
    }
    if (!why) return 0;
    es->skip = 1;
    es->skip_reason = why;
    if (EM_LOG_ON(EM_LOG_RECOMPILES)) {
        PyObject *d = log_record(code);
        if (d && (PyDict_SetItemString(d, "event", em_str("skip")) < 0 ||
                  PyDict_SetItemString(d, "reason", em_str(es->skip_reason)) < 0))
            Py_CLEAR(d);
        em_log_emit_steal(EM_LOG_RECOMPILES, d);
    }
    return 1;
}

CacheEntry *em_cache_compile(ExtraState *es, PyObject *func, PyCodeObject *code, const EmFrameView *fv,
                             const EmCompileConfig *cfg, PyObject **fetched, int hooked) {
    double t_start = em_now(); /* compile_times (explain, logs) and the debug dump's compile time */
    /* the limits, as Dynamo's (torch/_dynamo/cache_size.py): cache_size_limit counts the entries
     * made for the objects this frame's locals hold (em_guard_same_id_locals: a model's twelve
     * blocks share a forward's code, one entry each), accumulated_cache_size_limit all of them */
    long limit = config_int("cache_size_limit", 8), all_limit = config_int("accumulated_cache_size_limit", 256);
    long same = 0;
    for (CacheEntry *e = es->head; e && same < limit; e = e->next)
        same += !e->guards || em_guard_same_id_locals(e->guards, fv);
    bool by_objects = same >= limit, full = by_objects || es->nentries >= all_limit;
    if (EM_LOG_ON(EM_LOG_RECOMPILES)) log_recompile(es, code, fv, cfg, fetched, full ? (by_objects ? limit : all_limit) : -1);
    if (full) {
        if (!es->warned_limit) {
            CacheEntry *fe = NULL;
            int fg = -1;
            es->warned_limit = 1;
            /* name the guard that failed on the most recent entry */
            PyObject *guard = NULL;
            if (es->head) {
                fe = es->head;
                /* re-run its guards to learn which one fails (cheap, once per code object) */
                if (em_guard_check(fe->guards, fv, fetched, &fg) == 1) em_fetched_release(fe, fetched);
                if (fg >= 0) guard = em_guard_render_one(fe->guards, fg);
                if (!guard) PyErr_Clear();
            }
            PyObject *where = code_where(code);
            if (!where) {
                Py_XDECREF(guard);
                return NULL;
            }
            int w = PyErr_WarnFormat(PyExc_UserWarning, 1,
                                     "ember: %U hit config.%s (%ld); it runs eagerly from now on%s. "
                                     "Last failed guard: %S",
                                     where, by_objects ? "cache_size_limit" : "accumulated_cache_size_limit",
                                     by_objects ? limit : all_limit, by_objects ? " for the objects its locals hold" : "",
                                     guard ? guard : em_str("?"));
            Py_DECREF(where);
            Py_XDECREF(guard);
            if (w < 0) return NULL;
        }
        return &limit_entry;
    }

    EmTraceOptions opts = {
        .max_inline_depth = (int)config_int("max_inline_depth", 64),
        .max_loop_iterations = (int)config_int("max_loop_iterations", 10000),
        .max_instructions = (int)config_int("max_instructions", 1000000),
        .split = !cfg->fullgraph && config_int("graph_breaks", 1) != 0,
        .dynamic = cfg->dynamic,
        .batch_static = cfg->cudagraphs != NULL && cfg->dynamic == -1,
        .shape_rules = config_int("sym_shape_rules", 1) != 0,
        .meta_memo = config_int("meta_memo", 1) != 0,
    };
    if (!es->frame_state && !(es->frame_state = PyDict_New())) PyErr_Clear();
    opts.frame_state = es->frame_state;
    {
        /* resume functions are cached on the ORIGINAL code (resume-of-resume starts from it too) */
        PyCodeObject *orig = em_trace_resume_origin(code);
        ExtraState *oes = orig ? em_cache_get(orig, 1) : es;
        if (oes && !oes->resume_cache) oes->resume_cache = PyDict_New();
        if (!oes || !oes->resume_cache) PyErr_Clear();
        opts.resume_cache = oes ? oes->resume_cache : NULL;
    }
    EmTraceResult res;
    memset(&res, 0, sizeof res);
    CacheEntry *e = NULL;
    PyObject *graph_text = NULL, *out_text = NULL, *backend_info = NULL, *cg_info = NULL, *sym_why = NULL;
    const char *info_key = "ember";
    double backend_s = 0, t_traced, t_guarded;
    if (em_trace_frame(func, code, fv, &opts, &res) < 0) goto error;
    precompiled_clear();
    if (res.graph && res.symbolic && specialises_sizes(cfg, res.graph)) {
        /* A symbolic training graph (backends "ember", "aot_eager"): AOT autograd compiles one region
         * for all sizes where every rule it needs serves symbolic sizes, compiled here, before the
         * entry's guards are built, so that relations of sizes its derivative ops rely on become
         * guards too (em_passes_sym_guards). Where a rule does not serve symbolic sizes, the region
         * would run on eager autograd: under automatic dynamic, trace again with concrete sizes, as
         * before (one compiled region per size, up to config.cache_size_limit); dynamic=True and
         * mark_dynamic keep the symbolic graph on eager autograd. */
        double secs = 0;
        PyObject *info = NULL;
        const char *key = "ember";
        int eg = 0;
        em_passes_sym_guards = true;
        PyObject *c = backend_compile(cfg, &res, code, &eg, &info, &key, &secs);
        em_passes_sym_guards = false;
        if (!c) {
            Py_XDECREF(info);
            goto error;
        }
        PyObject *why = eg && info && PyDict_Check(info) ? PyDict_GetItemString(info, "fallback") : NULL;
        /* only a fallback for the sizes being symbolic ("per_size", csrc/autograd's ag_fail_sym) is
         * traced per size: another (an input returned as an output, an in-place update autograd
         * needs) keeps the symbolic graph on eager autograd, as a trace per size would only compile
         * the same fallback again, size after size */
        bool sizes_matter = why && PyDict_GetItemString(info, "per_size");
        if (sizes_matter && cfg->dynamic < 0) {
            sym_why = PyUnicode_FromFormat("traced per size: no symbolic training region (%S)", why);
            Py_DECREF(c);
            Py_XDECREF(info);
            em_arena_free(res.arena);
            memset(&res, 0, sizeof res);
            opts.dynamic = 0;
            if (em_trace_frame(func, code, fv, &opts, &res) < 0) goto error;
        } else {
            precompiled.graph = res.graph;
            precompiled.compiled = c;
            precompiled.info = info;
            precompiled.eager_graph = eg;
            precompiled.info_key = key;
            precompiled.secs = secs;
            if (em_trace_sym_refresh_guards(&res) < 0) goto error;
        }
    }
    t_traced = em_now();
    if (skip_no_ops(es, code, &res, cfg, hooked)) {
        precompiled_clear();
        Py_XDECREF(sym_why);
        em_arena_free(res.arena);
        return &skip_entry;
    }
    if ((!res.graph || res.split) && cfg->fullgraph) {
        raise_fullgraph(code, &res.brk);
        goto error;
    }
    e = calloc(1, sizeof(CacheEntry));
    if (e) e->grad_restore = -1;
    if (!e) {
        PyErr_NoMemory();
        goto error;
    }
    e->kind = res.split ? ENTRY_BREAK : res.graph ? ENTRY_GRAPH : ENTRY_FALLBACK;
    e->last_resort = e->kind != ENTRY_GRAPH && (res.brk.reason == EM_BREAK_RAISE || res.brk.reason == EM_BREAK_META_FAILED);
    e->backend_key = Py_NewRef(cfg->backend_key);
    e->guards = em_guard_build(res.guards);
    if (!e->guards) goto error;
    t_guarded = em_now();
    if (e->kind != ENTRY_FALLBACK && em_guard_nfetch(e->guards) > EM_MAX_FETCH) {
        /* more graph inputs than a fetch buffer holds: run this frame eagerly (a fallback) */
        e->kind = ENTRY_FALLBACK;
        res.brk.reason = EM_BREAK_UNSUPPORTED_VALUE;
        res.brk.detail = em_arena_hold_steal(res.arena, PyUnicode_FromFormat(
                                                            "more than %d graph inputs", (int)EM_MAX_FETCH));
    }
    if (e->kind == ENTRY_FALLBACK) em_guard_drop_fetch(e->guards); /* a fallback runs no graph */
    if (e->kind != ENTRY_FALLBACK && res.effects) {
        e->effects = em_out_copy(res.effects);
        e->effect_names = Py_NewRef(res.effect_names);
        if (!e->effects) goto error;
    }
    if (e->kind == ENTRY_GRAPH) {
        e->compiled = backend_compile(cfg, &res, code, &e->eager_graph, &backend_info, &info_key, &backend_s);
        if (!e->compiled) goto error;
        if (cfg->cudagraphs) { /* mode="reduce-overhead": replayed from CUDA graphs where it is safe */
            PyObject *w = em_cudagraph_wrap(e->compiled, e->eager_graph, res.graph, res.example_inputs, res.ninputs,
                                            cfg->backend, cfg->cudagraphs, &cg_info);
            if (!w) goto error;
            Py_SETREF(e->compiled, w);
            e->eager_graph = 0;
        }
        e->out = em_out_copy(res.out);
        e->ninputs = res.ninputs;
        e->grad_restore = res.grad_restore;
        e->input_fetch = malloc((res.ninputs ? res.ninputs : 1) * sizeof(int));
        if (!e->out || !e->input_fetch) {
            PyErr_NoMemory();
            goto error;
        }
        memcpy(e->input_fetch, res.input_fetch, res.ninputs * sizeof(int));
        graph_text = em_ir_format_tabular(res.graph);
        out_text = em_out_repr(e->out);
        if (!graph_text || !out_text) goto error;
    } else if (e->kind == ENTRY_BREAK) {
        if (make_break_entry(e, &res, cfg, code, &backend_info, &info_key, &backend_s) < 0) goto error;
        if (e->compiled) {
            graph_text = em_ir_format_tabular(res.graph);
            if (!graph_text) goto error;
        }
        out_text = em_out_repr(e->brk->values);
        if (!out_text) goto error;
    }
    e->info = entry_info(e->kind, cfg, &res, graph_text, out_text);
    if (!e->info || (backend_info && PyDict_SetItemString(e->info, info_key, backend_info) < 0)) goto error;
    if (cg_info && PyDict_SetItemString(e->info, "cudagraphs", cg_info) < 0) goto error;
    Py_CLEAR(cg_info);
    {   /* which dims are symbolic and why (ember.cache_info / explain) */
        PyObject *dyn = res.sym_notes ? PyList_GetSlice(res.sym_notes, 0, PY_SSIZE_T_MAX) : PyList_New(0);
        int bad = !dyn || (sym_why && PyList_Append(dyn, sym_why) < 0) || PyDict_SetItemString(e->info, "dynamic", dyn) < 0;
        Py_XDECREF(dyn);
        if (bad) goto error;
    }
    Py_CLEAR(backend_info);
    {
        /* ember.explain: the graph's operations and the compile time of each stage (seconds) */
        PyObject *ops = e->compiled ? em_ir_op_targets(res.graph) : PyList_New(0);
        PyObject *times = Py_BuildValue("{s:d,s:d,s:d,s:d}", "trace", t_traced - t_start, "guards", t_guarded - t_traced,
                                        "backend", backend_s, "total", em_now() - t_start);
        int bad = !ops || !times || PyDict_SetItemString(e->info, "ops", ops) < 0 ||
                  PyDict_SetItemString(e->info, "compile_times", times) < 0;
        Py_XDECREF(ops);
        Py_XDECREF(times);
        if (bad) goto error;
    }
    if (e->kind == ENTRY_BREAK) {
        PyObject *rc = PyTuple_New(e->brk->nresume), *off = PyLong_FromUnsignedLong(res.split->offset);
        for (int k = 0; rc && k < e->brk->nresume; k++) PyTuple_SET_ITEM(rc, k, Py_NewRef(e->brk->resume[k]));
        int bad = !rc || !off || PyDict_SetItemString(e->info, "resume", rc) < 0 ||
                  PyDict_SetItemString(e->info, "break_offset", off) < 0;
        Py_XDECREF(rc);
        Py_XDECREF(off);
        if (bad) goto error;
    }
    Py_CLEAR(graph_text);
    Py_CLEAR(out_text);
    if (em_debug_dumping()) em_debug_on_compile(e, code, fv->globals, &res, em_now() - t_start);
    em_arena_free(res.arena);
    res.arena = NULL;
    precompiled_clear(); /* (taken by the entry; or unused: the entry became a fallback) */
    Py_CLEAR(sym_why);

    e->next = es->head;
    es->head = e;
    es->nentries++;
    if (em_guard_nfetch(e->guards) > es->max_fetch) es->max_fetch = em_guard_nfetch(e->guards);
    if (e->kind != ENTRY_FALLBACK) {
        /* the fresh entry must answer this very call: evaluate its guards to fill fetched */
        int failed = -1;
        if (em_guard_check(e->guards, fv, fetched, &failed) != 1) {
            /* Guards that fail on the inputs they were made from (an ember bug, or a backend that
             * changed what the guards read while compiling): the graph must never run on trust.
             * The entry becomes a fallback with the reason recorded; the call runs eagerly. */
            PyObject *guard = failed >= 0 ? em_guard_render_one(e->guards, failed) : NULL;
            PyObject *detail = PyUnicode_FromFormat("guard fails on the inputs it was made from: %S",
                                                    guard ? guard : em_str("?"));
            Py_XDECREF(guard);
            if (!detail || mark_fallback(e, EM_BREAK_INTERNAL, detail) < 0) {
                Py_XDECREF(detail);
                return NULL;
            }
            Py_DECREF(detail);
            /* Guards compare content, not tags (DESIGN.md, rules learned), so this means the backend
             * really changed what the trace read, and may do so on every compile: recompiling would
             * loop until cache_size_limit. A fallback is correct under any guards, so the leaves
             * that fail on these inputs are dropped and the entry answers them from now on:
             * recorded once, compiled once. */
            em_guard_drop_fetch(e->guards);
            while (failed >= 0 && em_guard_check(e->guards, fv, fetched, &failed) != 1 && failed >= 0)
                em_guard_drop(e->guards, failed);
        }
    }
    if (em_log_mask) log_new_entry(e, code);
    return e;
error:
    precompiled_clear();
    Py_XDECREF(sym_why);
    Py_XDECREF(graph_text);
    Py_XDECREF(out_text);
    Py_XDECREF(backend_info);
    Py_XDECREF(cg_info);
    entry_free(e);
    em_arena_free(res.arena);
    return NULL;
}

PyObject *em_cache_entry_info(const CacheEntry *e) {
    PyObject *d = PyDict_Copy(e->info), *guards = d && e->guards ? em_guard_render(e->guards) : PyList_New(0);
    if (!d || !guards || PyDict_SetItemString(d, "guards", guards) < 0) {
        Py_XDECREF(d);
        Py_XDECREF(guards);
        return NULL;
    }
    Py_DECREF(guards);
    return d;
}

PyObject *em_cache_info(PyCodeObject *code) {
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    ExtraState *es = em_cache_get(code, 0);
    if (!es) return list;
    for (CacheEntry *e = es->head; e; e = e->next) {
        PyObject *d = em_cache_entry_info(e);
        PyObject *hits = PyLong_FromUnsignedLongLong(e->hits);
        if (!d || !hits || PyDict_SetItemString(d, "hits", hits) < 0 || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_XDECREF(hits);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
        Py_DECREF(hits);
    }
    return list;
}

int em_cache_pin(PyCodeObject *code, int pinned) {
    ExtraState *es = em_cache_get(code, 1);
    if (!es) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    es->pinned = pinned;
    return 0;
}

int em_cache_init(PyObject *module) {
    extra_index = EM_REQUEST_EXTRA_INDEX(extra_free);
    if (extra_index < 0) {
        PyErr_SetString(PyExc_RuntimeError, "ember: no co_extra index left");
        return -1;
    }
    eager_str = PyUnicode_InternFromString("eager");
    if (!eager_str) return -1;
    graph_break_error = PyErr_NewExceptionWithDoc(
        "ember._C.GraphBreakError",
        "Raised when fullgraph=True and a frame cannot be captured as one graph. The message names the "
        "reason (a fallback reason of ember.cache_info) and the user's source line.",
        PyExc_RuntimeError, NULL);
    if (!graph_break_error || PyModule_AddObjectRef(module, "GraphBreakError", graph_break_error) < 0) return -1;
    PyObject *cm = PyImport_ImportModule("ember._config");
    if (!cm) return -1;
    config_obj = PyObject_GetAttrString(cm, "config");
    Py_DECREF(cm);
    return config_obj ? 0 : -1;
}
