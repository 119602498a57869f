"""Logs by topic: ember.set_logs(...) and EMBER_LOGS, through Python's logging (TORCH_LOGS's form).

Topics (each a child of the "ember" logger, e.g. logging.getLogger("ember.graph_breaks")):
  graph_breaks  a graph break or fallback: the reason, the user's file:line and source line
  recompiles    a compile of a code that already has entries: the guard that failed
  guards        the guards of each new cache entry (debug: each failed guard at lookup)
  graph         each captured graph, as a table
  output_code   generated code: the fx GraphModule's code for fx backends (inductor, custom
                callables; Inductor's own output is TORCH_LOGS=output_code's), the C kernels of
                backend "ember"; backend "eager" generates none
  perf          compile time per stage (trace, guards, backend, total)
"+topic" logs the topic at debug level too (more detail); "all" names every topic.
The C core checks one flag word (ember._C._set_logs) before it builds any record: a topic that is
off costs nothing. Records carry the event's data as record.ember_event (a dict).
"""
from __future__ import annotations

import linecache
import logging
import os
import sys

from . import _C

TOPICS = ("graph_breaks", "recompiles", "guards", "graph", "output_code", "perf")  # em_core.h order
_BIT = {t: 1 << i for i, t in enumerate(TOPICS)}
_DEBUG_SHIFT = _C.LOG_DEBUG_SHIFT

log = logging.getLogger("ember")
_levels: dict[str, int] = {}  # topic -> logging.INFO or logging.DEBUG, for the topics that are on
_handler: logging.Handler | None = None


def _parse(spec: str) -> dict[str, int]:
    out = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        level = logging.INFO
        if item.startswith("+"):
            level, item = logging.DEBUG, item[1:]
        names = TOPICS if item == "all" else (item,)
        for n in names:
            if n not in _BIT:
                raise ValueError(f"ember.set_logs: unknown topic {n!r}; known: {', '.join(TOPICS)}, all")
            out[n] = min(out.get(n, level), level)
    return out


def set_logs(spec: str | None = None, **topics) -> None:
    """Turns log topics on, and every other topic off.

    spec: "graph_breaks,+recompiles" (EMBER_LOGS's syntax: comma-separated topics, "+topic" for
    debug level, "all" for every topic); or keywords, as torch._logging.set_logs:
    ``set_logs(graph_breaks=True, guards=logging.DEBUG)`` (True = INFO). ``set_logs()`` turns
    every topic off. Records go to the "ember.<topic>" loggers; when neither the "ember" logger
    nor the root logger has a handler, one handler writing to stderr is added to "ember".
    Raises ValueError for an unknown topic, TypeError for a level that is not bool or int.
    """
    levels = _parse(spec) if spec else {}
    for name, v in topics.items():
        if name not in _BIT and name != "all":
            raise ValueError(f"ember.set_logs: unknown topic {name!r}; known: {', '.join(TOPICS)}, all")
        if v is None or v is False:
            continue
        if not isinstance(v, (bool, int)):
            raise TypeError(f"ember.set_logs: {name}= takes True/False or a logging level, got {v!r}")
        level = logging.INFO if v is True else int(v)
        for n in (TOPICS if name == "all" else (name,)):
            levels[n] = min(levels.get(n, level), level)
    _apply(levels)


def _apply(levels: dict[str, int]) -> None:
    global _handler
    _levels.clear()
    _levels.update(levels)
    mask = 0
    for t in TOPICS:
        lg = logging.getLogger(f"ember.{t}")
        if t in levels:
            mask |= _BIT[t]
            if levels[t] <= logging.DEBUG:
                mask |= _BIT[t] << _DEBUG_SHIFT
            lg.setLevel(levels[t])
        else:
            lg.setLevel(logging.NOTSET)
    if levels and _handler is None and not log.handlers and not logging.getLogger().handlers:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        log.addHandler(_handler)
    elif not levels and _handler is not None:
        log.removeHandler(_handler)
        _handler = None
    _C._set_logs(mask)


def enabled(topic: str, debug: bool = False) -> bool:
    """Is topic on (at debug level, with debug=True)?"""
    level = _levels.get(topic)
    return level is not None and (not debug or level <= logging.DEBUG)


def init_from_env() -> None:
    """EMBER_LOGS at import (a bad topic is reported once, not raised: the import must work)."""
    spec = os.environ.get("EMBER_LOGS")
    if not spec:
        return
    try:
        set_logs(spec)
    except ValueError as e:
        print(f"ember: EMBER_LOGS ignored: {e}", file=sys.stderr)


# ---- formatting of the C core's events (one record each; debug adds a second, longer one) ----

def _where(d):
    return f"{d['code']} ({d['filename']}:{d['firstlineno']})"


def _ms(s):
    return f"{s * 1e3:.2f} ms"


def _indent(text, n=4):
    return "\n".join(" " * n + ln for ln in str(text).rstrip().splitlines())


def _graph_breaks(d, debug):
    i = d["info"]
    detail = f" ({i['detail']})" if i.get("detail") else ""
    at = f" at {i['filename']}:{i['lineno']}" if i.get("lineno") is not None else ""
    what = "Graph break" if i["kind"] == "break" else "Fallback to eager"
    msg = f"{what} in {_where(d)}: {i['reason']}: {i['reason_text']}{detail}{at}"
    if i.get("lineno") is not None and i.get("filename"):
        src = linecache.getline(i["filename"], i["lineno"]).strip()
        if src:
            msg += f"\n    {src}"
    yield logging.INFO, msg
    if debug:
        extra = [f"instruction: {i.get('opname')}"]
        if i.get("resume"):
            extra.append("resume functions: " + ", ".join(c.co_qualname for c in i["resume"]))
        if i.get("output"):
            extra.append(f"values live at the break: {i['output']}")
        yield logging.DEBUG, f"Graph break in {_where(d)}:\n" + _indent("\n".join(extra))


def _recompiles(d, debug):
    if d.get("event") == "skip":  # a frame the hook met that holds no tensor operation
        yield logging.INFO, f"Skipping {_where(d)}: {d['reason']}"
        return
    failed = d["failed_guards"]
    head = f"Recompiling {_where(d)} ({d['entries']} entr{'y' if d['entries'] == 1 else 'ies'} of this backend)"
    if d.get("cache_size_limit") is not None:
        head += f": cache_size_limit ({d['cache_size_limit']}) reached, it runs eagerly from now on"
    yield logging.INFO, f"{head}; guard failed: {failed[0] if failed else '?'}"
    if debug and len(failed) > 1:
        yield logging.DEBUG, f"Recompiling {_where(d)}, failed guard of each entry:\n" + _indent(
            "\n".join(f"entry {k}: {g}" for k, g in enumerate(failed)))


def _guards(d, debug):
    if d.get("event") == "guard_failure":
        yield logging.DEBUG, f"Guard failed for {_where(d)}: {d['failed_guard']}"
        return
    i = d["info"]
    yield logging.INFO, f"Guards of a new {i['kind']} entry of {_where(d)}:\n" + _indent("\n".join(i["guards"]))


def _graph(d, debug):
    i = d["info"]
    yield logging.INFO, f"Graph of {_where(d)} (backend {i['backend']}):\n" + _indent(i["graph"])
    if debug:
        yield logging.DEBUG, f"Graph of {_where(d)}: ops {i.get('ops')}; output: {i.get('output')}"


def _output_code(d, debug):
    if "source" in d:  # fx backends (ember._backends.compile_graph)
        yield logging.INFO, f"Output code of {d['code']} (backend {d['backend']}, fx GraphModule):\n" + _indent(d["source"].strip("\n"))
        return
    ember = d["info"]["ember"]
    if "fallback" in ember:
        yield logging.INFO, f"Output code of {_where(d)} (backend ember): none, {ember['fallback']}"
        return
    src = ember["source"]
    kernels = src[src.find("/* kernel "):] if "/* kernel " in src else src
    yield logging.INFO, f"Output code of {_where(d)} (backend ember, C kernels):\n" + _indent(kernels)
    if debug:
        from ._backends import explain_ember
        lines = explain_ember(ember)
        summary = lines[:lines.index("  generated C:")] if "  generated C:" in lines else lines
        yield logging.DEBUG, (f"Output code of {_where(d)} (backend ember), whole file:\n" + "\n".join(summary)
                              + "\n" + _indent(src))


def _perf(d, debug):
    t = d["info"]["compile_times"]
    stages = (d["info"].get("ember") or {}).get("stage_times")
    sub = f" (ember: {', '.join(f'{k} {_ms(v)}' for k, v in stages.items())})" if stages else ""
    yield logging.INFO, (f"Compile times of {_where(d)}: trace {_ms(t['trace'])}, guards {_ms(t['guards'])}, "
                         f"backend {_ms(t['backend'])}{sub}, total {_ms(t['total'])}")


_FORMAT = {"graph_breaks": _graph_breaks, "recompiles": _recompiles, "guards": _guards, "graph": _graph,
           "output_code": _output_code, "perf": _perf}


def _emit(topic: str, data: dict) -> None:
    """Called by the C core (em_log_emit_steal) when topic is on; one record per event."""
    lg = logging.getLogger(f"ember.{topic}")
    debug = enabled(topic, debug=True)
    for level, msg in _FORMAT[topic](data, debug):
        if lg.isEnabledFor(level):
            lg.log(level, msg, extra={"ember_event": data})
