/* hook: the CPython internals the PEP 523 frame evaluation function needs, for 3.11 and 3.12:
 * _PyInterpreterFrame field access and disposal of a frame the hook answered without running it.
 * Invariant: nothing outside csrc/hook/em_hook*.c includes this file; the internal headers it pulls
 * in (internal/pycore_frame.h) are private CPython ABI pinned to the minor version. */
#ifndef EM_HOOK_CPYTHON_H
#define EM_HOOK_CPYTHON_H

#include "core/em_core.h"

/* internal/pycore_frame.h needs Py_BUILD_CORE; Py_BUILD_CORE_MODULE (setup.py) implies it and
 * keeps _PyThreadState_GET() an exported call on 3.12 (cpython_internals.md, section 1). */
#ifndef Py_BUILD_CORE_MODULE
#define Py_BUILD_CORE_MODULE 1
#endif
#include "internal/pycore_frame.h"
#if !EM_PY312
#include "internal/pycore_interp.h"
#include "internal/pycore_runtime.h"
#endif

/* A stamp that moves whenever Python code other than the running call's own may have run: another
 * thread took the GIL (3.11: _PyRuntime.ceval.gil.switch_number, internal/pycore_gil.h; take_gil
 * counts a hand-over whenever the new holder is not the last one) or the cyclic GC collected (its
 * finalizers and weakref callbacks run arbitrary code; the interpreter's per-generation collection
 * counts, internal/pycore_gc.h). Both only grow, so their sum is unchanged exactly when neither
 * moved. For em_guard_window_open/close (em_guard.h); 3.12 has no use for it (dict watchers) and
 * answers 0. */
static inline unsigned long em_hook_window_stamp(void)
{
#if EM_PY312
    return 0;
#else
    const struct _gc_runtime_state *gc = &PyInterpreterState_Get()->gc;
    unsigned long n = _PyRuntime.ceval.gil.switch_number;
    for (int g = 0; g < NUM_GENERATIONS; g++) n += (unsigned long)gc->generation_stats[g].collections;
    return n;
#endif
}

/* The frame's code object and function object (borrowed; the frame holds strong references).
 * 3.11: f_func is a PyFunctionObject *; 3.12: f_funcobj is a PyObject * (internal/pycore_frame.h);
 * 3.13: the code is f_executable (a code object for every frame the hook sees). */
#if EM_PY313
#define EM_FRAME_CODE(f) ((PyCodeObject *)(f)->f_executable)
#else
#define EM_FRAME_CODE(f) ((f)->f_code)
#endif
#if EM_PY312
#define EM_FRAME_FUNC(f) ((f)->f_funcobj)
#else
#define EM_FRAME_FUNC(f) ((PyObject *)(f)->f_func)
#endif

/* Has the frame started running its bytecode? A frame fresh from _PyEvalFramePushAndInit has
 * prev_instr = _PyCode_CODE(co) - 1, i.e. LASTI == -1; the prologue (COPY_FREE_VARS, MAKE_CELL,
 * RETURN_GENERATOR) ends at RESUME, the instruction _co_firsttraceable indexes. Same test as
 * _PyFrame_IsIncomplete and Dynamo's has_started_execution (torch/_dynamo/convert_frame.py).
 * 3.13 keeps instr_ptr, the instruction about to run (a fresh frame: the first one, LASTI == 0),
 * so a frame has started once it is past its RESUME. */
static inline int em_frame_started(_PyInterpreterFrame *f)
{
#if EM_PY313
    return _PyInterpreterFrame_LASTI(f) > EM_FRAME_CODE(f)->_co_firsttraceable;
#else
    return _PyInterpreterFrame_LASTI(f) >= EM_FRAME_CODE(f)->_co_firsttraceable;
#endif
}

/* Disposes of a fresh thread-owned frame that the hook answered without evaluating it (a graph
 * entry ran, or compilation raised). 3.11: a no-op, the caller (_PyEval_Vector) clears and pops
 * the frame after the eval function returns. 3.12: the eval loop clears and pops even its entry
 * frame, so a hook that does not evaluate the frame must do it: clear the locals, the function
 * and the code, and pop it off the thread's data stack (CPython 3.12 Python/ceval.c,
 * clear_thread_frame; torch/csrc/dynamo/eval_frame.c, clear_old_frame_if_python_312_plus). 3.13
 * exports the eval loop's own _PyEval_FrameClearAndPop (internal/pycore_ceval.h). */
void em_cpy_frame_dispose(PyThreadState *tstate, _PyInterpreterFrame *frame);

#endif /* EM_HOOK_CPYTHON_H */
