"""ember.debug.dump's writer: turns the C core's description of each new cache entry (guards,
fetch sources, the graph's fx export, the stub's Python source from csrc/trace/em_trace_resume.c,
the output spec) into files, and compiles the entry's transformed code from the file it wrote, so
that a breakpoint there stops. Pure text assembly: every piece of Python it writes was rendered by
the C stage that made it (guards: csrc/guard/em_guard_render.c, values: em_runtime_out.c, stub:
em_trace_resume.c, graph: the fx bridge over em_ir_to_python).

Invariant: a file is only ever rewritten with its previous text as a prefix (new entries append
their blocks; the dispatchers, regenerated each time, come last), so code objects compiled from an
earlier version keep pointing at the right lines."""
from __future__ import annotations

import ast
import json
import os
import re
import threading
import types

from .. import _C, _fx

_FETCH = re.compile(r"fetched\[(\d+)\]")
_SAFE_NAMES = {"L", "G", "B", "graph_out", "MethodType", "torch", "iter", "getattr", "getattr", "slice",
               "Ellipsis", "True", "False", "None", "float", "inf", "nan", "device"}


def _ident(name: str) -> str:
    out = re.sub(r"\W", "_", name)
    return out if out and not out[0].isdigit() else "_" + out


def _nparams(code: types.CodeType) -> int:
    return (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08))


def _signature(code: types.CodeType) -> str:
    """The code's own parameter list (no defaults): a, b, *args, k, **kw."""
    names = code.co_varnames
    na, nk = code.co_argcount, code.co_kwonlyargcount
    parts = list(names[:na])
    i = na + nk
    if code.co_flags & 0x04:
        parts.append("*" + names[i])
        i += 1
    elif nk:
        parts.append("*")
    parts += names[na:na + nk]
    if code.co_flags & 0x08:
        parts.append("**" + names[i])
    return ", ".join(parts)


def _torch_names_resolve(src: str) -> bool:
    """Every torch.a.b chain in src names a real object (fx and reprs print some callables by a
    path that does not resolve: a lambda defined in a module prints as module.name)."""
    import torch
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, n = [], node
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id == "torch":
                obj = torch
                for a in reversed(chain):
                    if not hasattr(obj, a):
                        return False
                    obj = getattr(obj, a)
    return True


def _expr(text: str | None, sources: list[str]) -> str | None:
    """The C core's output/values spec as a Python expression over L, G, B and graph_out, or None
    when it names something only the C core can build (cells, functions made in the frame)."""
    if text is None:
        return None
    expr = _FETCH.sub(lambda m: sources[int(m.group(1))], text)
    try:
        code = compile(expr, "<ember output>", "eval")
    except SyntaxError:
        return None
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            return None
    if not names <= _SAFE_NAMES:
        return None
    # a constant's repr that names torch.something must name it for real (reprs need not round-trip)
    if not _torch_names_resolve(expr):
        return None
    return expr


_KNOWN = {"L", "G", "B", "torch", "len", "type", "list", "id", "getattr", "True", "False", "None", "int", "float",
          "str", "bool", "tuple", "dict", "set", "object", "device", "inf", "nan"}


def _modules_named(guards: list[str]) -> list[str]:
    """Top-level names a guard's text uses that the file does not define: modules of the types
    and objects it names (``test_mod.Net``, ``torch.nn.modules.module._global_forward_hooks``)."""
    names = set()
    for g in guards:
        try:
            tree = ast.parse(g.partition("  # ")[0], mode="eval")
        except SyntaxError:
            continue
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return sorted(n for n in names if n not in _KNOWN and not n.startswith("___") and n != "check_tensor")


def _nodes_of(gm) -> list[dict]:
    """The graph's nodes for the report's picture: name, op, target, inputs, dtype and shape."""
    out = []
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        out.append({"name": n.name, "op": n.op, "target": str(n.target) if n.op != "call_function"
                    else getattr(n.target, "__name__", str(n.target)),
                    "inputs": [a.name for a in n.all_input_nodes],
                    "dtype": str(tm.dtype).replace("torch.", "") if tm is not None and hasattr(tm, "dtype") else "",
                    "shape": list(tm.shape) if tm is not None and hasattr(tm, "shape") else None})
    return out


def _skip_all(code: types.CodeType) -> None:
    """The frame hook never compiles code that runs from a dump file."""
    _C._debug_skip(code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _skip_all(c)


class _Frame:
    """One compiled user frame: full_code_<name>.py with its resume functions' entries."""

    def __init__(self, dumper: "Dumper", origin: types.CodeType, name: str):
        self.dumper = dumper
        self.origin = origin
        self.name = name
        self.path = os.path.join(dumper.dir, f"full_code_{name}.py")
        self.blocks: list[str] = []
        self.codes: dict[types.CodeType, dict] = {}  # code -> {"name", "entries": [...]}
        self.resume_objs: dict[str, types.CodeType] = {}
        self.globals = None
        self.graphs: dict[str, object] = {}
        self.records: list[dict] = []
        self.graph_nodes: dict[str, list] = {}

    def code_name(self, code: types.CodeType) -> str:
        if code is self.origin:
            return _ident(code.co_name)
        if code not in self.codes:
            return self.dumper.resume_names.get(code) or f"__resume_{len(self.codes)}"
        return self.codes[code]["name"]

    def header(self) -> str:
        o = self.origin
        mod = (self.globals or {}).get("__name__", "__main__")
        return (
            f'"""ember transformed code of {o.co_qualname} ({o.co_filename}:{o.co_firstlineno}), written by ember.debug.dump.\n\n'
            "What ember runs on each call of the frame: the guards of each cache entry (checked in C by ember;\n"
            "here as Python), the calls of the compiled graphs (__compiled_fn_N.py next to this file), the\n"
            "values live at each graph break, the breaking instruction, and the resume functions. Inside\n"
            "ember.debug.dump the __transformed_code_* functions below are what runs, so a breakpoint here\n"
            f"stops. On its own: runpy.run_path(this file)[{o.co_name!r}](...) gives the compiled function's results.\n"
            '"""\n'
            "import builtins\n"
            "from types import MethodType\n\n"
            "import torch\n"
            "from torch import device, inf, nan\n\n"
            "from ember.debug import _rt as __ember_rt\n"
            "from ember.debug._rt import ___dict_version, ___dict_entries_unchanged, ___dict_items_unchanged, "
            "___type_version, ___id, ___global_state, ___sdp_flags, check_tensor\n\n"
            f"G = __ember_rt.user_globals(globals(), {mod!r})\n"
            "B = builtins.__dict__\n\n"
        )

    def add_entry(self, code: types.CodeType, info: dict):
        d = self.dumper
        cname = self.code_name(code)
        slot = self.codes.setdefault(code, {"name": cname, "entries": []})
        k = len(slot["entries"])
        params = list(code.co_varnames[:_nparams(code)])
        sources = info.get("fetch_sources") or []
        lines = []
        why_c = []  # why this entry cannot run from the file (it then runs from C)
        if code.co_cellvars or code.co_freevars:
            why_c.append("the frame has cells")
        if info.get("effects"):
            why_c.append("it replays side effects")
        if {"L", "G", "B", "graph_out"} & set(params):
            why_c.append("a parameter is named L, G, B or graph_out")
        kind = info["kind"]
        where = ""
        if kind == "fallback":
            why_c.append("a fallback runs the original bytecode")
        if kind in ("break", "fallback"):
            where = (f"{'graph break' if kind == 'break' else 'fallback'} at {info.get('filename')}:"
                     f"{info.get('lineno')}: {info.get('reason_text')}")
            if info.get("detail"):
                where += f" ({info['detail']})"
        lines.append(f"# ---- cache entry {k} of {cname} ({kind}{', ' + where if where else ''}); "
                     f"backend {info.get('backend')!r}, compiled in {info.get('compile_time_s', 0) * 1e3:.1f} ms")
        gfn = f"__guard_{k}_for_{cname}"
        lines.append(f"def {gfn}(L, G, B):")
        for mod in _modules_named(info.get("guards") or []):
            lines.append(f"    {mod} = __ember_rt.module({mod!r})  # named by a guard")
        for g in info.get("guards") or []:
            expr, _, note = g.partition("  # ")
            try:
                compile(expr, "<guard>", "eval")
            except SyntaxError:  # names Python cannot spell (a class defined in a function: <locals>)
                lines.append(f"    # checked by ember in C only: {g}")
                continue
            lines.append(f"    if not ({expr}):" + (f"  # {note}" if note else ""))
            lines.append("        return False")
        lines.append("    return True\n")
        graph_name = None
        if info.get("fx") is not None:
            graph_name = d.write_graph(self, cname, k, info)
        tfn = f"__transformed_code_{k}_for_{cname}"
        lines.append(f"def {tfn}({', '.join(params)}):")
        lines.append(f"    L = {{{', '.join(f'{p!r}: {p}' for p in params)}}}")
        call = None
        if graph_name:
            args = [sources[i] for i in info.get("input_fetch") or []]
            call = f"{graph_name}({', '.join(args)})"
            lines.append(f"    graph_out = {call}  # {graph_name}.py")
        if kind == "fallback":
            lines.append(f"    # {info.get('reason')}: ember runs the original bytecode of {code.co_qualname}")
            lines.append(f"    return __ember_rt.original(globals(), G, {cname!r}, {code.co_qualname!r})({', '.join(params)})")
        elif kind == "graph":
            expr = _expr(info.get("output"), sources)
            if expr is None:
                why_c.append(f"its return value is built in C: {info.get('output')}")
                lines.append(f"    raise NotImplementedError({'ember builds this return value in C: ' + str(info.get('output'))!r})")
            else:
                lines.append(f"    return {expr}")
        else:
            vals = _expr(info.get("output"), sources)
            stub_src = info.get("stub_source")
            resume = list(info.get("resume") or ())
            rnames = []
            for i, rc in enumerate(resume):
                rn = d.resume_names.get(rc)
                if rn is None:  # one name per resume code object (several may resume at one offset)
                    base = rn = f"__resume_at_{info.get('break_offset')}_{i}"
                    while rn in d.resume_names.values():
                        rn = f"{base}_{sum(v.startswith(base) for v in d.resume_names.values())}"
                    d.resume_names[rc] = rn
                self.resume_objs[rn] = rc
                rnames.append(rn)
                if rc.co_freevars or rc.co_cellvars:
                    why_c.append("a resume function has cells")
            if vals is None:
                why_c.append(f"the values at the break are built in C: {info.get('output')}")
            if stub_src is None or info.get("stub_closure") or info.get("ncells"):
                why_c.append("its breaking instruction runs only from C")
            bfn = f"__graph_break_{k}_for_{cname}"
            if vals is not None:
                lines.append(f"    ___values = {vals}")
                lines.append(f"    return {bfn}({''.join(r + ', ' for r in rnames)}*___values)\n")
            else:
                lines.append("    raise NotImplementedError('ember builds the values at this break in C')\n")
            stub = info.get("stub")
            sparams = list(stub.co_varnames[:stub.co_argcount]) if stub is not None else []
            src_line = ""
            try:
                import linecache
                src_line = linecache.getline(info.get("filename") or "", info.get("lineno") or 0).strip()
            except Exception:
                pass
            lines.append(f"def {bfn}({', '.join(sparams)}):")
            lines.append(f"    # the breaking instruction {info.get('opname')} of line {info.get('lineno')}: {src_line}")
            if stub_src:
                body = stub_src.rstrip("\n").splitlines()
                # the user's line on the instruction's own line: a traceback through it shows both
                body[0] += f"  # {os.path.basename(info.get('filename') or '')}:{info.get('lineno')}: {src_line}"
                lines += ["    " + ln for ln in body]
            else:
                lines.append("    raise NotImplementedError('ember runs this instruction from C')")
        lines.append("")
        block = "\n".join(lines) + "\n"
        try:
            compile(block, "<entry>", "exec")
        except SyntaxError as e:  # a source or value only C can spell: keep the text as comments
            why_c.append(f"its Python does not parse ({e.msg})")
            block = "".join(f"# {ln}\n" for ln in lines) + (
                f"def {gfn}(L, G, B):\n    return False  # see the comments above\n\n"
                f"def {tfn}(*args):\n    raise NotImplementedError('ember runs this entry from C')\n\n")
        self.blocks.append(block)
        slot["entries"].append({"guard": gfn, "transformed": tfn, "c_only": why_c, "params": params})
        self.records.append({
            "code": cname, "qualname": code.co_qualname, "entry": k, "kind": kind, "backend": info.get("backend"),
            "guards": info.get("guards") or [], "graph": graph_name, "graph_table": info.get("graph"),
            "reason": info.get("reason"), "reason_text": info.get("reason_text"), "detail": info.get("detail"),
            "filename": info.get("filename"), "lineno": info.get("lineno"),
            "compile_time_s": info.get("compile_time_s"), "runs_from": "C" if why_c else "dump file",
            "c_only": why_c, "transformed": tfn, "graph_nodes": self.graph_nodes.get(graph_name),
            "kernels": f"{graph_name}.kernels.c" if graph_name and (info.get("ember") or {}).get("source") else None,
            "autograd": f"{graph_name}.autograd.txt" if graph_name and info.get("autograd") else None,
        })
        return tfn if not why_c else None

    def dispatchers(self) -> str:
        out = ["# ---- dispatchers: the if-chain over each code's cache entries (ember does this in C) ----"]
        for code, slot in self.codes.items():
            params = list(code.co_varnames[:_nparams(code)])
            out.append(f"def {slot['name']}({_signature(code)}):")
            out.append(f"    L = {{{', '.join(f'{p!r}: {p}' for p in params)}}}")
            for e in slot["entries"]:
                out.append(f"    if {e['guard']}(L, G, B):")
                out.append(f"        return {e['transformed']}({', '.join(params)})")
            out.append(f"    raise __ember_rt.NoCacheEntry({slot['name']!r})  # ember would compile a new entry\n")
        for rn in self.resume_objs:
            if not any(s["name"] == rn for s in self.codes.values()):
                out.append(f"def {rn}(*args):")
                out.append(f"    raise __ember_rt.NoCacheEntry({rn!r})  # not compiled yet\n")
        out.append("__ember_rt.bind_resume(globals())\n")
        return "\n".join(out)

    def text(self) -> str:
        graphs = sorted(self.graphs)
        head = self.header()
        return head + "".join(self.blocks) + "".join(
            f"{g} = __ember_rt.load_graph(globals(), {g!r})\n" for g in graphs) + "\n" + self.dispatchers()

    def write_and_load(self, tfn: str | None, user_globals: dict):
        """Writes the file; returns the entry's transformed code compiled from it, bound to the
        globals the entry was compiled under (one code object may run under several: exec)."""
        text = self.text()
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(text)
        if tfn is None:
            return None
        code = compile(text, self.path, "exec")
        _skip_all(code)
        resume = {rn: types.FunctionType(rc, user_globals) for rn, rc in self.resume_objs.items()}
        ns = {"__name__": f"ember_dump_{self.name}", "__file__": self.path, "__ember_globals__": user_globals,
              "__ember_graphs__": dict(self.graphs), "__ember_resume__": resume}
        exec(code, ns)
        return ns[tfn]


class Dumper:
    def __init__(self, path: str):
        self.dir = os.path.abspath(path)
        os.makedirs(self.dir, exist_ok=True)
        self.frames: dict[types.CodeType, _Frame] = {}
        self.names: set[str] = set()
        self.resume_names: dict[types.CodeType, str] = {}
        self.ngraphs = 0
        self.nindexed = 0
        self.lock = threading.Lock()

    def frame_of(self, origin: types.CodeType) -> _Frame:
        fr = self.frames.get(origin)
        if fr is None:
            name = _ident(origin.co_name)
            base, i = name, 1
            while name in self.names:
                i += 1
                name = f"{base}_{i}"
            self.names.add(name)
            fr = self.frames[origin] = _Frame(self, origin, name)
        return fr

    def write_graph(self, fr: _Frame, cname: str, k: int, info: dict) -> str:
        self.ngraphs += 1
        name = f"__compiled_fn_{self.ngraphs}"
        gm = _fx.to_graph_module(info["fx"], name=name)
        backend = info.get("backend")
        program = info.get("compiled")
        path = os.path.join(self.dir, name + ".py")
        fx_code = gm.code.strip("\n")
        table = "\n".join("# " + ln for ln in (info.get("graph") or "").splitlines())
        if info.get("ember"):  # backend "ember": its kernels and extern calls, as ember.explain shows them
            from .._backends import explain_ember
            summary = [ln for ln in explain_ember(info["ember"]) if not ln.startswith("    ")
                       or ln.startswith("    kernel ")]
            summary = summary[:summary.index("  generated C:")] if "  generated C:" in summary else summary
            table += "\n#\n" + "\n".join("#" + ln for ln in summary)
        # backend "eager": the fx code runs (breakpoints inside the graph), when it is real Python
        runs_fx = (backend == "eager" and _torch_names_resolve(fx_code)) or program is None
        text = (
            f'"""Graph {self.ngraphs} of ember: cache entry {k} of {cname} (frame {fr.origin.co_qualname}),\n'
            f"backend {backend!r}. The fx graph below is the one handed to the backend (fx-style, readable).\n"
            + ("Inside ember.debug.dump this forward is what runs, so a breakpoint here stops.\n" if runs_fx else
               "Inside ember.debug.dump the backend's program runs (__compiled_fn_N calls it)"
               + (f"; its C kernels are in {name}.kernels.c" if info.get("ember") else "") + ".\n")
            + '"""\n'
            "import operator\n\nimport torch\nfrom torch import device, inf, nan\n\n"
            "from ember.debug import _rt as __ember_rt\n\n"
            "__self__ = globals().get('__self__')\n"
            "__backend_program__ = globals().get('__backend_program__')\n\n"
            f"{fx_code}\n\n\n"
            f"def {name}(*args):\n"
            "    # a graph runs no frame through ember (as from C: csrc/hook/em_hook_break.c run_graph)\n"
            "    with __ember_rt.graph_region():\n"
            "        if __backend_program__ is not None:\n"
            f"            return __backend_program__(*args)  # backend {backend!r}\n"
            "        return forward(__self__, *args)\n\n\n"
            f"# the graph as a table:\n{table}\n"
        )
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if info.get("graph"):
            with open(os.path.join(self.dir, name + ".txt"), "w", encoding="utf-8") as f:
                f.write(info["graph"])
        if info.get("ember") and info["ember"].get("source"):
            with open(os.path.join(self.dir, name + ".kernels.c"), "w", encoding="utf-8") as f:
                f.write(info["ember"]["source"])
        passes = (info.get("ember") or info.get("autograd") or {}).get("pass_graphs")
        if passes:  # the graph after each pass that changed it (csrc/passes/em_passes.c), in order
            with open(os.path.join(self.dir, name + ".passes.txt"), "w", encoding="utf-8") as f:
                f.write(f"Graph {self.ngraphs} after each graph rewrite (pass) that changed it, in the order they ran:\n")
                for pname, table in passes:
                    f.write(f"\n# after pass {pname}\n{table}\n")
        if info.get("autograd"):  # AOT autograd: joint, forward and backward graphs, saved vs recomputed
            from .._autograd import explain_lines
            with open(os.path.join(self.dir, name + ".autograd.txt"), "w", encoding="utf-8") as f:
                f.write(f"AOT autograd of graph {self.ngraphs} (backend {backend!r}), as ember.explain shows it:\n")
                f.write("\n".join(explain_lines(info["autograd"], indent="")) + "\n")
        code = compile(text, path, "exec")
        _skip_all(code)
        gns = {"__name__": name, "__file__": path, "__self__": gm, "__builtins__": __builtins__,
               "__backend_program__": None if runs_fx else program}
        gns.update({k2: v for k2, v in gm.forward.__globals__.items() if not k2.startswith("__")})
        exec(code, gns)
        fr.graphs[name] = gns[name]
        fr.graph_nodes[name] = _nodes_of(gm)
        return name

    def on_compile(self, code: types.CodeType, info: dict):
        with self.lock:
            origin = info.get("origin") or code
            fr = self.frame_of(origin)
            if fr.globals is None:
                fr.globals = info.get("__globals__")
            tfn = fr.add_entry(code, info)
            fn = fr.write_and_load(tfn, info.get("__globals__") or fr.globals)
            self.write_index(fr)
            return fn

    def write_index(self, fr: _Frame):
        """frame_<name>.json for the frame that changed, and ember_dump.json listing the frames
        (each compile rewrites one frame's record, not the whole dump's)."""
        rec = {"name": fr.name, "qualname": fr.origin.co_qualname, "filename": fr.origin.co_filename,
               "firstlineno": fr.origin.co_firstlineno, "full_code": os.path.basename(fr.path), "entries": fr.records}
        _write_json(os.path.join(self.dir, f"frame_{fr.name}.json"), rec)
        if len(self.frames) != self.nindexed:
            self.nindexed = len(self.frames)
            _write_json(os.path.join(self.dir, "ember_dump.json"),
                        {"frames": [f"frame_{f.name}.json" for f in self.frames.values()]})


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def load(directory: str) -> dict:
    """A dump directory's records: {"frames": [{name, qualname, filename, firstlineno, full_code,
    entries: [...]}, ...]} in the order the frames were first compiled."""
    with open(os.path.join(directory, "ember_dump.json"), encoding="utf-8") as f:
        index = json.load(f)
    frames = []
    for name in index["frames"]:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            frames.append(json.load(f))
    return {"frames": frames}
