"""`python -m ember report DIR`: DIR/index.html from a dump directory (ember.debug.dump). Per frame:
its cache entries with their guards, transformed code, graphs drawn as pictures (graphviz's `dot`
through the `graphviz` package when both are installed, else a table), break reasons, compile
times, the generated kernels. One self-contained page: clean CSS, collapsible sections, code
highlighted by pygments when it is installed (pip install 'ember[debug]')."""
from __future__ import annotations

import html
import os
import re
import shutil

from ._dump import load

_CSS = """
:root { --fg:#1f2328; --muted:#656d76; --line:#d0d7de; --bg:#f6f8fa; --accent:#d9480f; }
* { box-sizing: border-box; }
body { font: 14px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--fg);
       margin: 0; background: #fff; }
header { background: linear-gradient(90deg, #7c2d12, #d9480f); color: #fff; padding: 18px 32px; }
header h1 { margin: 0; font-size: 22px; } header p { margin: 4px 0 0; opacity: .85; }
main { max-width: 1180px; margin: 0 auto; padding: 20px 32px 60px; }
.summary { display: flex; gap: 12px; margin: 8px 0 22px; flex-wrap: wrap; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 16px; background: var(--bg); min-width: 130px; }
.card b { display: block; font-size: 22px; }
.card span { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
section.frame { border: 1px solid var(--line); border-radius: 10px; margin: 18px 0; overflow: hidden; }
section.frame > h2 { margin: 0; padding: 12px 16px; font-size: 17px; background: var(--bg);
                     border-bottom: 1px solid var(--line); }
section.frame > h2 small { color: var(--muted); font-weight: normal; font-size: 13px; margin-left: 8px; }
.entries { padding: 4px 16px 12px; }
details { border-top: 1px solid #eaeef2; padding: 6px 0; }
details:first-child { border-top: 0; }
summary { cursor: pointer; padding: 4px 0; font-weight: 600; list-style: none; }
summary::-webkit-details-marker { display: none; }
summary::before { content: "\\25B8"; display: inline-block; width: 1.1em; color: var(--muted); transition: transform .15s; }
details[open] > summary::before { transform: rotate(90deg); }
details details { margin-left: 18px; }
details details summary { font-weight: 500; color: #24292f; }
.badge { display: inline-block; border-radius: 999px; padding: 1px 9px; font-size: 12px; font-weight: 600;
         margin-left: 6px; vertical-align: 1px; }
.graph { background: #dafbe1; color: #116329; } .break { background: #fff1e5; color: #9a3412; }
.fallback { background: #ffebe9; color: #a40e26; } .c { background: #eaeef2; color: #57606a; }
.file { background: #ddf4ff; color: #0550ae; }
.meta { color: var(--muted); font-weight: normal; font-size: 13px; margin-left: 8px; }
.reason { margin: 6px 0 8px 18px; padding: 8px 12px; border-left: 3px solid var(--accent); background: #fff8f3;
          border-radius: 0 6px 6px 0; }
.reason code { background: none; }
pre, .highlight pre { margin: 6px 0; padding: 10px 12px; background: var(--bg); border: 1px solid #eaeef2;
      border-radius: 6px; overflow-x: auto; font: 12.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px;
       background: var(--bg); padding: 1px 4px; border-radius: 4px; }
.pic { margin: 6px 0; padding: 8px; border: 1px solid #eaeef2; border-radius: 6px; background: #fff; overflow-x: auto; }
.pic svg { max-width: 100%; height: auto; max-height: 420px; }
table.nodes { border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }
table.nodes td, table.nodes th { border: 1px solid #eaeef2; padding: 3px 8px; text-align: left; }
table.nodes th { background: var(--bg); }
footer { color: var(--muted); font-size: 12px; margin-top: 30px; }
"""


def _highlighter():
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import CLexer, PythonLexer
    except ImportError:
        return None, ""
    fmt = HtmlFormatter(style="friendly", cssclass="highlight")
    lexers = {"python": PythonLexer(), "c": CLexer()}
    return (lambda src, lang: highlight(src, lexers[lang], fmt)), fmt.get_style_defs(".highlight")


def _dot_svg(nodes: list[dict]) -> str | None:
    """The graph as an SVG drawn by graphviz's dot, or None without graphviz."""
    try:
        import graphviz
    except ImportError:
        return None
    if not shutil.which("dot"):
        return None
    g = graphviz.Digraph(graph_attr={"rankdir": "LR", "bgcolor": "transparent", "nodesep": "0.25", "ranksep": "0.3"},
                         node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                    "fontsize": "11", "color": "#d0d7de", "fillcolor": "#f6f8fa"},
                         edge_attr={"color": "#8c959f", "arrowsize": "0.6"})
    fills = {"placeholder": "#ddf4ff", "output": "#dafbe1", "get_attr": "#fff8c5"}
    for n in nodes:
        shape = "x".join(str(s) for s in n["shape"]) if n.get("shape") is not None else ""
        same = n["op"] in ("placeholder", "output") or n["target"] == n["name"].rstrip("_0123456789")
        label = n["name"] if same else f"{n['name']}\\n{n['target']}"
        if shape or n.get("dtype"):
            label += f"\\n{n.get('dtype', '')}[{shape}]"
        g.node(n["name"], label, fillcolor=fills.get(n["op"], "#f6f8fa"))
        for a in n["inputs"]:
            g.edge(a, n["name"])
    try:
        svg = g.pipe(format="svg").decode("utf-8")
    except Exception:  # dot failed: the table stands in
        return None
    return svg[svg.index("<svg"):]


def _table(nodes: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(n['op'])}</td><td>{html.escape(n['name'])}</td><td>{html.escape(str(n['target']))}</td>"
        f"<td>{html.escape(', '.join(n['inputs']))}</td><td>{html.escape(n.get('dtype') or '')}</td>"
        f"<td>{html.escape(str(n.get('shape') or ''))}</td></tr>" for n in nodes)
    return ("<table class='nodes'><tr><th>op</th><th>name</th><th>target</th><th>inputs</th><th>dtype</th>"
            f"<th>shape</th></tr>{rows}</table>")


def _block(full_code: str, code: str, k: int) -> str:
    """The lines of cache entry k of code in a full_code file."""
    m = re.search(rf"^# ---- cache entry {k} of {re.escape(code)} \(.*?(?=^# ---- |^__compiled_fn_\d+ = |\Z)",
                  full_code, re.S | re.M)
    return m.group(0).rstrip() + "\n" if m else ""


def render(directory: str) -> str:
    """Writes directory/index.html from the dump's records (ember_dump.json and frame_*.json);
    returns the page's path."""
    data = load(directory)
    hl, style = _highlighter()

    def code(src: str, lang: str = "python") -> str:
        return hl(src, lang) if hl else f"<pre>{html.escape(src)}</pre>"

    frames = data["frames"]
    entries = [e for fr in frames for e in fr["entries"]]
    nbreak = sum(e["kind"] == "break" for e in entries)
    ngraph = sum(1 for e in entries if e.get("graph"))
    total = sum(e.get("compile_time_s") or 0 for e in entries)
    parts = [f"<div class='summary'><div class='card'><b>{len(frames)}</b><span>frames</span></div>"
             f"<div class='card'><b>{len(entries)}</b><span>cache entries</span></div>"
             f"<div class='card'><b>{ngraph}</b><span>graphs</span></div>"
             f"<div class='card'><b>{nbreak}</b><span>graph breaks</span></div>"
             f"<div class='card'><b>{total * 1e3:.0f} ms</b><span>compile time</span></div></div>"]
    for fr in frames:
        try:
            with open(os.path.join(directory, fr["full_code"]), encoding="utf-8") as f:
                full = f.read()
        except OSError:
            full = ""
        parts.append(f"<section class='frame'><h2>{html.escape(fr['qualname'])}<small>{html.escape(fr['filename'])}:"
                     f"{fr['firstlineno']} &middot; <a href='{html.escape(fr['full_code'])}'>{html.escape(fr['full_code'])}</a>"
                     "</small></h2><div class='entries'>")
        for e in fr["entries"]:
            kind = e["kind"]
            runs = ("<span class='badge file'>runs from dump</span>" if e["runs_from"] == "dump file"
                    else "<span class='badge c'>runs from C</span>")
            ms = f"{(e.get('compile_time_s') or 0) * 1e3:.1f} ms"
            head = (f"{html.escape(e['code'])} &middot; entry {e['entry']}<span class='badge {kind}'>{kind}</span>{runs}"
                    f"<span class='meta'>backend {html.escape(str(e['backend']))} &middot; compiled in {ms} &middot; "
                    f"{len(e['guards'])} guards</span>")
            parts.append(f"<details open><summary>{head}</summary>")
            if kind == "break":
                where = f"{e.get('filename')}:{e.get('lineno')}"
                line = ""
                try:
                    import linecache
                    line = linecache.getline(e.get("filename") or "", e.get("lineno") or 0).strip()
                except Exception:
                    pass
                parts.append(f"<div class='reason'><b>graph break</b> ({html.escape(str(e.get('reason')))}): "
                             f"{html.escape(str(e.get('reason_text')))}"
                             + (f" &mdash; {html.escape(str(e['detail']))}" if e.get("detail") else "")
                             + f"<br><code>{html.escape(where)}</code>"
                             + (f" &nbsp;<code>{html.escape(line)}</code>" if line else "") + "</div>")
            if e.get("c_only"):
                parts.append(f"<div class='reason'>runs from C: {html.escape('; '.join(e['c_only']))}</div>")
            if e.get("graph") and e.get("graph_nodes"):
                svg = _dot_svg(e["graph_nodes"])
                pic = f"<div class='pic'>{svg}</div>" if svg else _table(e["graph_nodes"])
                parts.append(f"<details open><summary>graph <a href='{html.escape(e['graph'])}.py'>"
                             f"{html.escape(e['graph'])}</a> ({len(e['graph_nodes'])} nodes)</summary>{pic}</details>")
            parts.append(f"<details><summary>guards ({len(e['guards'])})</summary>"
                         f"{code(chr(10).join(e['guards']) + chr(10))}</details>")
            block = _block(full, e["code"], e["entry"])
            if block:
                parts.append(f"<details open><summary>transformed code</summary>{code(block)}</details>")
            if e.get("graph"):
                try:
                    with open(os.path.join(directory, e["graph"] + ".py"), encoding="utf-8") as f:
                        gsrc = f.read()
                    parts.append(f"<details><summary>graph code ({html.escape(e['graph'])}.py)</summary>{code(gsrc)}</details>")
                except OSError:
                    pass
            for key, title, lang in (("kernels", "generated C kernels", "c"),
                                     ("autograd", "AOT autograd: joint, forward, backward graphs", "text")):
                if not e.get(key):
                    continue
                try:
                    with open(os.path.join(directory, e[key]), encoding="utf-8") as f:
                        ksrc = f.read()
                    parts.append(f"<details><summary>{title} ({html.escape(e[key])})</summary>"
                                 f"{code(ksrc, lang) if lang != 'text' else '<pre>' + html.escape(ksrc) + '</pre>'}</details>")
                except OSError:
                    pass
            parts.append("</details>")
        if full:
            parts.append(f"<details><summary>full code ({html.escape(fr['full_code'])})</summary>{code(full)}</details>")
        parts.append("</div></section>")
    page = ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>ember report</title>"
            f"<style>{_CSS}{style}</style></head><body><header><h1>ember report</h1>"
            f"<p>{html.escape(os.path.abspath(directory))}</p></header><main>{''.join(parts)}"
            "<footer>Written by <code>python -m ember report</code> from ember.debug.dump's files. "
            "Set breakpoints in the full_code and __compiled_fn files: inside ember.debug.dump they are what runs."
            "</footer></main></body></html>")
    out = os.path.join(directory, "index.html")
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out
