/* hook/install: the PEP 523 hook's install and enable state, shared by the frame evaluation
 * function (em_hook.c), which reads it on every frame, and by every file that enters or leaves a
 * compiled region or an ember.disable region (em_hook_break.c, em_hook_debug.c, em_hook_dispatch.c).
 * Invariant: this part calls neither the eval function nor the cache; it installs the function
 * em_hook_init registered in em_hook_global.eval. Private to csrc/hook/. */
#ifndef EM_HOOK_INSTALL_H
#define EM_HOOK_INSTALL_H

#include "hook/em_hook.h"

/* ---- per-thread state ----
 * The eval function receives only the thread state and the frame, and it runs for every Python
 * call in the process while installed, on every thread. The state it consults (is this thread
 * inside a compiled call? with which config? disabled? inside ember itself?) is per thread, and
 * must cost next to nothing to reach: a C11 _Thread_local struct is one TLS access, where the
 * thread-state dict (PyThreadState_GetDict) would be a dict lookup per frame. ember supports one
 * interpreter (core/em_core.c), so thread-locals are not shared between interpreters.
 *
 * The config stack is run-length encoded: a recursive compiled function enters the hook once per
 * level with the same config, and those levels share one run. */
typedef struct ConfigRun {
    const EmCompileConfig *cfg;
    uint32_t count; /* em_hook_enter calls with cfg, nested back to back */
} ConfigRun;

enum { INLINE_RUNS = 8 };

typedef struct HookThread {
    uint32_t depth;            /* em_hook_enter calls not yet exited */
    uint32_t nruns;            /* runs in use */
    uint32_t cap_heap;         /* capacity of heap_runs */
    ConfigRun *heap_runs;      /* replaces inline_runs once they overflow; freed at depth 0 */
    ConfigRun inline_runs[INLINE_RUNS];
    int disabled;              /* ember.disable regions entered and not exited */
    int busy;                  /* ember itself is looking up, compiling or running an entry */
    const PyCodeObject *skip_next; /* identity only: compared, never dereferenced or owned */
} HookThread;

extern _Thread_local HookThread em_hook_thread;

static inline ConfigRun *thread_runs(HookThread *t)
{
    return t->heap_runs ? t->heap_runs : t->inline_runs;
}

/* ---- process-wide state (protected by the GIL) ----
 * The frame evaluation function is per interpreter (cpython_internals.md, section 1). */
typedef struct HookGlobal {
    int nthreads;               /* threads whose depth > 0 */
    int forced;                 /* test-only: _hook_force_install(True) */
    _PyFrameEvalFunction prev;  /* the function ours replaced (default, or e.g. Dynamo's shim) */
    _PyFrameEvalFunction eval;  /* ours (em_hook.c hook_eval_frame), set by em_hook_init */
} HookGlobal;

extern HookGlobal em_hook_global;

/* Installs or uninstalls em_hook_global.eval as the threads' state and the test flag ask. */
void em_hook_update_install(void);

#endif /* EM_HOOK_INSTALL_H */
