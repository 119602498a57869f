/* passes: the driver. PASSES is the one list of graph rewrites, in the order they run; a list run
 * (em_passes_run) takes the passes whose `when` includes the caller's point of the pipeline, as QBE's
 * main.c runs its passes one after another over a function.
 * Invariant: each pass sees the previous pass's result; a pass that returns NULL changed nothing. */
#include "passes/em_passes.h"

#include "passes/em_passes_rewrite.h"

_Thread_local bool em_passes_record_graphs = false;

typedef struct {
    const char *name;
    IRGraph *(*run)(const IRGraph *g, EmPassCtx *ctx);
    unsigned when; /* EM_PASSES_* it runs at */
} EmPass;

/* A new graph rewrite is one file (em_pass_<name>.c) and one line here. */
static const EmPass PASSES[] = {
    {"autocast", em_pass_autocast, EM_PASSES_AUTOCAST},
    {"attention", em_pass_attention, EM_PASSES_TRAINING | EM_PASSES_INFERENCE},
    {"decompose", em_pass_decompose, EM_PASSES_TRAINING | EM_PASSES_INFERENCE},
    {"functionalize", em_pass_functionalize, EM_PASSES_TRAINING},
    {"fold_mm", em_pass_fold_mm, EM_PASSES_TRAINING | EM_PASSES_INFERENCE},
    {"layout", em_pass_layout, EM_PASSES_INFERENCE},
    {"pad_mm", em_pass_pad_mm, EM_PASSES_TRAINING | EM_PASSES_INFERENCE},
    {"skinny_mm", em_pass_skinny_mm, EM_PASSES_INFERENCE | EM_PASSES_INFERENCE_SYM},
};
#define NPASSES (sizeof PASSES / sizeof PASSES[0])

/* Appends item (stolen) to info[key], a list made on first use. -1 with an exception. */
static int info_append_steal(PyObject *info, const char *key, PyObject *item) {
    if (!item) return -1;
    PyObject *l = PyDict_GetItemString(info, key); /* borrowed */
    if (!l) {
        l = PyList_New(0);
        if (!l || PyDict_SetItemString(info, key, l) < 0) {
            Py_XDECREF(l);
            Py_DECREF(item);
            return -1;
        }
        Py_DECREF(l); /* the dict holds it */
    }
    int rc = PyList_Append(l, item);
    Py_DECREF(item);
    return rc;
}

/* Records pass p's run: its time, and when it changed the graph (g2), its name and, while
 * em_passes_record_graphs is set, the new graph's table. -1 with an exception. */
static int record(EmPassCtx *ctx, const EmPass *p, const IRGraph *g2, double secs) {
    PyObject *times = PyDict_GetItemString(ctx->info, "pass_times"); /* borrowed */
    if (!times) {
        times = PyDict_New();
        if (!times || PyDict_SetItemString(ctx->info, "pass_times", times) < 0) {
            Py_XDECREF(times);
            return -1;
        }
        Py_DECREF(times);
    }
    PyObject *t = PyFloat_FromDouble(secs);
    if (!t || PyDict_SetItemString(times, p->name, t) < 0) {
        Py_XDECREF(t);
        return -1;
    }
    Py_DECREF(t);
    if (!g2) return 0;
    if (info_append_steal(ctx->info, "passes", PyUnicode_FromString(p->name)) < 0) return -1;
    if (!em_passes_record_graphs) return 0;
    PyObject *table = em_ir_format_tabular(g2);
    return info_append_steal(ctx->info, "pass_graphs", table ? Py_BuildValue("(sN)", p->name, table) : NULL);
}

const IRGraph *em_passes_run(const IRGraph *g, EmPassCtx *ctx) {
    if (!ctx->info && !(ctx->info = PyDict_New())) return NULL;
    for (size_t i = 0; i < NPASSES; i++) {
        const EmPass *p = &PASSES[i];
        if (!(p->when & ctx->when)) continue;
        double t0 = em_now();
        IRGraph *g2 = p->run(g, ctx);
        EM_ASSERT(!PyErr_Occurred()); /* passes leave no exception set (em_passes.h) */
        PyErr_Clear();
#ifdef EM_DEBUG
        char vbuf[256];
        if (g2 && em_ir_verify(g2, vbuf, sizeof vbuf) < 0) {
            fprintf(stderr, "ember: pass %s made an invalid graph: %s\n", p->name, vbuf);
            EM_ASSERT(0);
        }
#endif
        if (record(ctx, p, g2, em_now() - t0) < 0) return NULL;
        if (g2) g = g2;
    }
    return g;
}
