"""ember.debug: see every stage of what ember compiled.

    with ember.debug.dump("dump_dir"):     # or EMBER_DUMP=dump_dir in the environment
        compiled(x)

writes, for every frame compiled inside the block, full_code_<fn>.py (the guards of each cache
entry as an if-chain, the graph calls, the values at each graph break, the breaking instruction and
the resume functions), __compiled_fn_<n>.py for each graph (fx-style code, the fx graph handed to
the backend, and the graph as a table), __compiled_fn_<n>.kernels.c for backend "ember", and
ember_dump.json (what `python -m ember report dump_dir` draws as dump_dir/index.html).

Inside the block, entries run their transformed code from the dumped files (the C core calls the
file's __transformed_code_* function after checking the guards), so a breakpoint in a dumped file
stops there with the frame's locals. Entries the files cannot express (frames with cells, side
effects to replay, values only C builds) run from C as usual; ember_dump.json says why. Compiled
entries are dumped when they are made: reset ember (ember.reset()) or use fresh functions to dump
frames that were compiled before. Outside a dump the hit path pays one pointer test per call.
"""
from __future__ import annotations

import contextlib
import os

from .. import _C
from ._dump import Dumper

__all__ = ["dump"]

_active: list[Dumper] = []


def _hook(code, info):
    return _active[-1].on_compile(code, info) if _active else None


def _start(path: str) -> Dumper:
    d = Dumper(path)
    _active.append(d)
    _C._set_dump_hook(_hook)
    return d


def _stop(d: Dumper) -> None:
    _active.remove(d)
    if not _active:
        _C._set_dump_hook(None)


@contextlib.contextmanager
def dump(path: str | os.PathLike):
    """Dumps every frame compiled inside the block into the directory path (created if needed).

    Yields the directory's absolute path. Nested dumps write to the innermost directory."""
    d = _start(os.fspath(path))
    try:
        yield d.dir
    finally:
        _stop(d)


def _from_env() -> None:
    path = os.environ.get("EMBER_DUMP")
    if path:
        _start(path)
