"""ember.explain: what ember did with a function, as torch._dynamo.explain reports it.

Both forms work: ``ember.explain(fn)(*args)`` (torch._dynamo.explain's) and the older
``ember.explain(fn, *args)``. Either compiles fn if it is not compiled yet (backend "eager"),
calls it once and reads the cache entries of fn and of its resume functions.
"""
from __future__ import annotations

import linecache


class BreakReason(str):
    """One graph break (or fallback), as text "REASON: detail at file:line" with its parts:
    reason (the fallback reason's name, ember.FALLBACK_REASONS), reason_text, detail, filename,
    lineno, source_line (the user's line, stripped; "" when the file cannot be read), code (the
    qualified name of the function or resume function that broke), kind ("break" or "fallback")."""
    reason: str
    reason_text: str
    detail: str | None
    filename: str | None
    lineno: int | None
    source_line: str
    code: str
    kind: str


class ExplainOutput(str):
    """ember.explain's report: a str (print it) with torch._dynamo.explain's fields as attributes:
      graph_count: graphs compiled for the call, resume functions included (an empty graph is not
        counted, as in Dynamo);
      graph_break_count: graph breaks (break entries; a whole-frame fallback is not a break);
      break_reasons: list of BreakReason, one per graph break;
      fallbacks: list of BreakReason, one per entry that runs the whole frame eagerly;
      ops_per_graph: for each counted graph, the targets of its calls ("torch.cos", "sum", ...);
      op_count: their total;
      guards: every guard of every entry, one line of Python each;
      compile_times: seconds per stage summed over the entries {"trace", "guards", "backend",
        "total"};
      entries: the cache entries (ember.cache_info(fn, resume=True))."""
    graph_count: int
    graph_break_count: int
    break_reasons: list
    fallbacks: list
    ops_per_graph: list
    op_count: int
    guards: list
    compile_times: dict
    entries: list


def _break_reason(e) -> BreakReason:
    where = f" at {e['filename']}:{e['lineno']}" if e.get("lineno") else ""
    r = BreakReason(f"{e['reason']}: {e['detail'] or e['reason_text']}{where}")
    r.reason, r.reason_text, r.detail = e["reason"], e["reason_text"], e.get("detail")
    r.filename, r.lineno, r.code, r.kind = e.get("filename"), e.get("lineno"), e["code"], e["kind"]
    r.source_line = linecache.getline(r.filename, r.lineno).strip() if r.filename and r.lineno else ""
    return r


def report(entries) -> ExplainOutput:
    """The ExplainOutput of a list of cache entries (ember.cache_info(..., resume=True))."""
    from ._backends import explain_ember
    lines = []
    ops_per_graph, guards, breaks, fallbacks = [], [], [], []
    times = {"trace": 0.0, "guards": 0.0, "backend": 0.0, "total": 0.0}
    for i, e in enumerate(entries):
        lines.append(f"entry {i}: {e['kind']} of {e['code']} (backend {e['backend']}, hits {e['hits']})")
        if e.get("graph") and "call_" in e["graph"]:  # a graph with operations (an empty one is not counted)
            ops_per_graph.append(list(e.get("ops", [])))
        if e["kind"] in ("fallback", "break"):
            r = _break_reason(e)
            detail = f" ({e['detail']})" if e.get("detail") else ""
            where = f" at {r.filename}:{r.lineno}" if r.lineno else ""
            lines.append(f"  reason: {e['reason']}: {e['reason_text']}{detail}{where}")
            if r.source_line:
                lines.append(f"    {r.source_line}")
            (breaks if e["kind"] == "break" else fallbacks).append(r)
        if e.get("graph"):
            lines.append("  graph:")
            lines += ["    " + ln for ln in e["graph"].splitlines()]
            lines.append(f"  output: {e['output']}")
        if e.get("dynamic"):
            lines.append("  symbolic sizes:")
            lines += ["    " + d for d in e["dynamic"]]
        if e.get("ember"):
            lines += explain_ember(e["ember"])
        if e.get("autograd"):
            from . import _autograd
            lines += _autograd.explain_lines(e["autograd"])
        cg = e.get("cudagraphs")
        if cg and cg.get("training"):
            lines.append(f"  CUDA graphs (training region): {cg['state']}; forward {cg['forward']}, backward "
                         f"{cg['backward']}; {cg['replays']} replay(s), {cg['plain_calls']} plain call(s)"
                         f"{'; ' + cg['reason'] if cg.get('reason') else ''}")
        elif cg:
            how = (f"bucket {cg['bucket']} (batch {cg['batch']})" if cg.get("row_independent")
                   else "one recording per shape")
            lines.append(f"  CUDA graphs: {cg['state']}, {how}; {cg['pool']['captures']} recording(s) in this "
                         f"function's pool{'; ' + cg['reason'] if cg.get('reason') else ''}")
        lines.append("  guards:")
        lines += ["    " + g for g in e["guards"]]
        guards += e["guards"]
        for k, v in (e.get("compile_times") or {}).items():
            times[k] = times.get(k, 0.0) + v
        if e.get("compile_times"):
            t = e["compile_times"]
            lines.append(f"  compile time: {t['total'] * 1e3:.2f} ms (trace {t['trace'] * 1e3:.2f}, guards "
                         f"{t['guards'] * 1e3:.2f}, backend {t['backend'] * 1e3:.2f})")
    head = [f"graphs: {len(ops_per_graph)}, graph breaks: {len(breaks)}"]
    for r in breaks + fallbacks:
        head.append(f"  {'break' if r.kind == 'break' else 'fallback'}: {r}")
        if r.source_line:
            head.append(f"    {r.source_line}")
    for k, ops in enumerate(ops_per_graph):
        head.append(f"  graph {k}: {len(ops)} op(s): {', '.join(ops)}")
    head.append(f"  compile time: {times['total'] * 1e3:.2f} ms (trace {times['trace'] * 1e3:.2f}, guards "
                f"{times['guards'] * 1e3:.2f}, backend {times['backend'] * 1e3:.2f})")
    out = ExplainOutput("\n".join(head + lines))
    out.graph_count = len(ops_per_graph)
    out.graph_break_count = len(breaks)
    out.break_reasons = breaks
    out.fallbacks = fallbacks
    out.ops_per_graph = ops_per_graph
    out.op_count = sum(len(o) for o in ops_per_graph)
    out.guards = guards
    out.compile_times = times
    out.entries = list(entries)
    return out


def explain(fn, *args, **kwargs):
    """ember.explain(fn)(*args, **kwargs) -> ExplainOutput, or ember.explain(fn, *args, **kwargs).

    fn: a function, bound method, module or compiled object; it is compiled with backend "eager"
    unless it already is compiled (then its own backend is used). The call runs once (its result
    is dropped); the report covers every cache entry of fn and its resume functions, including
    entries from earlier calls. With no arguments, returns the function that takes them (a
    function of no arguments is explained with ``ember.explain(fn)()``).
    """
    import ember
    from . import _C

    compiled = fn
    if not (isinstance(fn, _C.CompiledFunction) or hasattr(type(fn), "_ember_compiled")):
        compiled = ember.compile(fn, backend="eager")

    def run(*a, **k) -> ExplainOutput:
        compiled(*a, **k)
        return report(ember.cache_info(compiled, resume=True))

    if not args and not kwargs:
        return run
    return run(*args, **kwargs)
