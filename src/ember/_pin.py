"""ember.pin / ember.unpin / ember.pinned: the guard pin for hot loops. EXPLICITLY UNSAFE.

A pinned function's calls evaluate NO guard: the most recently used cache entry of its backend
answers every call, whatever the inputs (the optimization tutorial's hand-removed guard checks,
as an API). What still happens per call: the arguments are bound and the entry's graph inputs are
fetched from them (a graph input that cannot be fetched falls back to the guarded lookup).

What that means:
  - a tensor of another shape, dtype, device or requires_grad runs the pinned graph on it: the
    result may be wrong or the graph may raise;
  - a changed Python constant the graph specialised on (an int argument, a module attribute)
    is NOT seen: the pinned graph keeps the old value;
  - a changed global, module attribute or submodule hook is NOT seen; grad mode and autocast
    are not checked either. (Hooks on a module compiled with ember.compile(module) itself are
    still seen: that check runs before any lookup and routes the call through Module.__call__.)
Scope: the code of fn and the resume functions that its graph breaks created before pin() (call
fn once first); functions reached through fallbacks or compiled later are not pinned. Break
entries are pinned too: the graph before the break, the breaking instruction in Python, then the
pinned resume function. A code with no entry yet compiles normally on its first call and is
pinned from then on. unpin() restores guard evaluation: the next call checks every guard again
and recompiles if the inputs changed. Use it only where the inputs are known to keep the
properties the entry was compiled for; measure first (bench/overhead.py shows what it saves).
"""
from __future__ import annotations

import contextlib

from . import _C


def _codes(fn):
    import ember
    from . import _code_of
    codes = [_code_of(fn)]
    for e in ember.cache_info(fn, resume=True):
        codes += list(e.get("resume", ()))
    return codes


def pin(fn) -> None:
    """UNSAFE: fn's calls skip guard evaluation and run its most recently used entry (module doc).
    fn: a compiled function, bound method or module (or the plain function whose code the frame
    hook compiles). Raises TypeError when fn has no code object."""
    for c in _codes(fn):
        _C._pin(c, True)


def unpin(fn) -> None:
    """Restores guard evaluation for fn's code and the resume functions pin() pinned."""
    for c in _codes(fn):
        _C._pin(c, False)


@contextlib.contextmanager
def pinned(fn):
    """``with ember.pinned(fn): ...`` pins fn (UNSAFE, see ember.pin) for the block, then unpins
    it, also when the block raises."""
    pin(fn)
    try:
        yield fn
    finally:
        unpin(fn)
