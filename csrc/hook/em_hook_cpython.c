/* hook: vendored CPython 3.12 internals that libpython does not export (_PyFrame_ClearExceptCode,
 * _PyThreadState_PopFrame), used to dispose of a frame the hook answered without evaluating it;
 * 3.13 exports the whole disposal (_PyEval_FrameClearAndPop).
 * Invariant: each function is a line-by-line copy of the CPython v3.12 function it names, minus
 * debug assertions, so that a frame is released exactly as the eval loop would release it. */
#include "hook/em_hook_cpython.h"

#include <string.h>

#if EM_PY313

#include "internal/pycore_ceval.h"

/* CPython v3.13 exports what the eval loop calls for a frame it is done with (Python/ceval.c):
 * clear_thread_frame for a thread-owned frame. */
void em_cpy_frame_dispose(PyThreadState *tstate, _PyInterpreterFrame *frame)
{
    EM_ASSERT(frame->owner == FRAME_OWNED_BY_THREAD);
    _PyEval_FrameClearAndPop(tstate, frame);
}

#elif EM_PY312

/* CPython v3.12 Python/frame.c, take_ownership: a frame object outlives its frame, so the frame's
 * contents move into the frame object. One difference: the hook's frame was never linked into the
 * thread's frame chain (_PyFrame_Initialize leaves frame->previous unset, the eval loop links it),
 * so there is no previous complete frame to make f_back of, and frame->previous is not read.
 * GC tracking through the public API, as torch/csrc/dynamo/cpython_defs.c (THP_take_ownership)
 * does. Not reached in practice: the hook only answers frames whose frame_obj is NULL, and the
 * frame is unreachable from Python while the hook runs. */
static void take_ownership(PyFrameObject *f, _PyInterpreterFrame *frame)
{
    Py_ssize_t size = ((char *)&frame->localsplus[frame->stacktop]) - (char *)frame;
    Py_INCREF(frame->f_code);
    memcpy((_PyInterpreterFrame *)f->_f_frame_data, frame, size);
    frame = (_PyInterpreterFrame *)f->_f_frame_data;
    f->f_frame = frame;
    frame->owner = FRAME_OWNED_BY_FRAME_OBJECT;
    if (_PyFrame_IsIncomplete(frame)) {
        /* "This may be a newly-created generator or coroutine frame. Since it's dead anyways,
         * just pretend that the first RESUME ran" (CPython comment). */
        PyCodeObject *code = frame->f_code;
        frame->prev_instr = _PyCode_CODE(code) + code->_co_firsttraceable;
    }
    frame->previous = NULL;
    if (!PyObject_GC_IsTracked((PyObject *)f)) PyObject_GC_Track((PyObject *)f);
}

/* CPython v3.12 Python/frame.c, _PyFrame_ClearExceptCode: releases everything the frame holds
 * except its code object. */
static void frame_clear_except_code(_PyInterpreterFrame *frame)
{
    if (frame->frame_obj) {
        PyFrameObject *f = frame->frame_obj;
        frame->frame_obj = NULL;
        if (Py_REFCNT(f) > 1) {
            take_ownership(f, frame);
            Py_DECREF(f);
            return;
        }
        Py_DECREF(f);
    }
    EM_ASSERT(frame->stacktop >= 0);
    for (int i = 0; i < frame->stacktop; i++) {
        Py_XDECREF(frame->localsplus[i]);
    }
    Py_XDECREF(frame->f_locals);
    Py_DECREF(frame->f_funcobj);
}

/* CPython v3.12 Python/pystate.c, _PyThreadState_PopFrame. _PyObject_VirtualFree is the object
 * arena allocator's free (Objects/obmalloc.c), reached through PyObject_GetArenaAllocator as in
 * torch/csrc/dynamo/cpython_defs.c (THP_PyObject_VirtualFree). */
static void thread_pop_frame(PyThreadState *tstate, _PyInterpreterFrame *frame)
{
    EM_ASSERT(tstate->datastack_chunk);
    PyObject **base = (PyObject **)frame;
    if (base == &tstate->datastack_chunk->data[0]) {
        _PyStackChunk *chunk = tstate->datastack_chunk;
        _PyStackChunk *previous = chunk->previous;
        /* push_chunk ensures that the root chunk is never popped */
        EM_ASSERT(previous);
        tstate->datastack_top = &previous->data[previous->top];
        tstate->datastack_chunk = previous;
        PyObjectArenaAllocator arena;
        PyObject_GetArenaAllocator(&arena);
        arena.free(arena.ctx, chunk, chunk->size);
        tstate->datastack_limit = (PyObject **)(((char *)previous) + previous->size);
    } else {
        EM_ASSERT(tstate->datastack_top);
        EM_ASSERT(tstate->datastack_top >= base);
        tstate->datastack_top = base;
    }
}

/* CPython v3.12 Python/ceval.c, clear_thread_frame (what _PyEvalFrameClearAndPop does for a
 * thread-owned frame). The frame must be the top of the thread's data stack: everything the hook
 * ran in between has returned and popped its own frames. */
void em_cpy_frame_dispose(PyThreadState *tstate, _PyInterpreterFrame *frame)
{
    EM_ASSERT(frame->owner == FRAME_OWNED_BY_THREAD);
    EM_ASSERT((PyObject **)frame + frame->f_code->co_framesize == tstate->datastack_top);
    tstate->c_recursion_remaining--;
    frame_clear_except_code(frame);
    Py_DECREF(frame->f_code);
    tstate->c_recursion_remaining++;
    thread_pop_frame(tstate, frame);
}

#else /* 3.11 */

/* 3.11: _PyEval_Vector calls _PyEvalFrameClearAndPop after the eval function returns, whether or
 * not the frame was evaluated (CPython v3.11 Python/ceval.c), so there is nothing to do here. */
void em_cpy_frame_dispose(PyThreadState *tstate, _PyInterpreterFrame *frame)
{
    EM_UNUSED(tstate);
    EM_UNUSED(frame);
}

#endif
