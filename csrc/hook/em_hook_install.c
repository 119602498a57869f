/* hook/install: entering and leaving compiled regions and ember.disable regions, per thread, and
 * installing the PEP 523 frame evaluation function while some thread is inside a compiled region.
 * Invariants: the function is installed only while some thread is inside em_hook_enter (or a test
 * forces it); enters and exits pair up per thread. */
#include "hook/em_hook_install.h"

#include <stdlib.h>
#include <string.h>

_Thread_local HookThread em_hook_thread;

HookGlobal em_hook_global;

/* ---- installation ---- */

/* Makes the installed function agree with "some thread is inside em_hook_enter, or forced".
 * Installing saves the current function as the previous one, unless the current one is already
 * ours (another hook restored ours after we left: keep the saved previous one). Uninstalling
 * restores the previous function only if ours is still the current one: if another hook (Dynamo's)
 * was installed on top of ours, it saved ours as its previous and will restore it; ours then
 * passes every frame through (no thread has a config) and is removed at the next exit. */
void em_hook_update_install(void)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    _PyFrameEvalFunction cur = _PyInterpreterState_GetEvalFrameFunc(interp);
    EM_ASSERT(em_hook_global.eval != NULL); /* em_hook_init ran */
    int want = em_hook_global.nthreads > 0 || em_hook_global.forced;
    if (want && cur != em_hook_global.eval) {
        em_hook_global.prev = cur;
        _PyInterpreterState_SetEvalFrameFunc(interp, em_hook_global.eval);
    } else if (!want && cur == em_hook_global.eval) {
        _PyInterpreterState_SetEvalFrameFunc(interp, em_hook_global.prev ? em_hook_global.prev : _PyEval_EvalFrameDefault);
    }
}

/* Pushes cfg on the thread's config stack; the first enter of a thread counts it as active and
 * installs the eval function. Out of memory for a new run degrades to counting the enter in the
 * current top run: the nested region then compiles with the outer config (still correct results,
 * maybe another backend), and exits stay paired. */
void em_hook_enter(const EmCompileConfig *cfg)
{
    HookThread *t = &em_hook_thread;
    ConfigRun *runs = thread_runs(t);
    uint32_t cap = t->heap_runs ? t->cap_heap : INLINE_RUNS;
    if (t->nruns > 0 && runs[t->nruns - 1].cfg == cfg) {
        runs[t->nruns - 1].count++;
    } else {
        if (t->nruns == cap) {
            uint32_t ncap = cap * 2;
            ConfigRun *grown = t->heap_runs ? realloc(t->heap_runs, ncap * sizeof(ConfigRun))
                                            : malloc(ncap * sizeof(ConfigRun));
            if (grown) {
                if (!t->heap_runs) memcpy(grown, t->inline_runs, sizeof(t->inline_runs));
                t->heap_runs = grown;
                t->cap_heap = ncap;
                runs = grown;
                cap = ncap;
            }
        }
        if (t->nruns < cap) {
            runs[t->nruns].cfg = cfg;
            runs[t->nruns].count = 1;
            t->nruns++;
        } else {
            runs[t->nruns - 1].count++; /* nruns == cap >= INLINE_RUNS > 0 */
        }
    }
    if (t->depth++ == 0) {
        em_hook_global.nthreads++;
        em_hook_update_install();
    }
}

/* Pops the innermost config. The last exit of a thread forgets its skip-next slot (it named the
 * frame the caller was about to start; if that call failed before its frame was created, the slot
 * must not catch a later frame) and uninstalls the eval function when no thread is active. */
void em_hook_exit(void)
{
    HookThread *t = &em_hook_thread;
    EM_ASSERT(t->depth > 0 && t->nruns > 0);
    if (t->depth == 0 || t->nruns == 0) return; /* unbalanced exit: ignore rather than corrupt */
    ConfigRun *runs = thread_runs(t);
    if (--runs[t->nruns - 1].count == 0) t->nruns--;
    t->skip_next = NULL;
    if (--t->depth == 0) {
        free(t->heap_runs);
        t->heap_runs = NULL;
        t->cap_heap = 0;
        t->nruns = 0;
        em_hook_global.nthreads--;
        em_hook_update_install();
    }
}

void em_hook_disable_enter(void) { em_hook_thread.disabled++; }

void em_hook_disable_exit(void)
{
    EM_ASSERT(em_hook_thread.disabled > 0);
    if (em_hook_thread.disabled > 0) em_hook_thread.disabled--;
}

/* Also true while the hook is busy (looking up, compiling, running an entry): a compiled object
 * called from a backend, a guard or meta inference then runs its original code, as it does inside
 * direct dispatch's own compile and run (which it wraps in em_hook_disable_enter/exit). */
int em_hook_disabled(void) { return em_hook_thread.disabled > 0 || em_hook_thread.busy > 0; }

/* Identity only: the slot is compared with the next frames' code objects and never dereferenced,
 * so it holds no reference. Cleared when consumed and at em_hook_exit. */
void em_hook_skip_next(PyCodeObject *code) { em_hook_thread.skip_next = code; }
