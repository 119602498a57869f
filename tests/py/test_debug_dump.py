"""ember.debug.dump (issue 10 items 1, 2, 5): the files written for frames with graph breaks,
recompiles and modules; the dumped full_code file run on its own against the compiled function
and eager; breakpoints in dumped files hit under pdb (subprocess); the HTML report (and, when a
headless Chromium is installed, its screenshot); nothing written and nothing run from files when
no dump is active."""
import io
import os
import runpy
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ember

# the dumped guards are compared as text (device='cpu'): CPU tensors under EMBER_TEST_DEVICE=cuda too
pytestmark = pytest.mark.usefixtures("cpu_tensors")
import ember.debug

OUT = io.StringIO()


def brk(x, y):
    a = torch.sin(x) + y
    print("between graphs", file=OUT)
    if a.sum() > 0:
        return a * 2
    return a - 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        print("module break", file=OUT)
        return h.sum(-1) + 1


def _json(d):
    return ember.debug._dump.load(d)


@pytest.fixture
def dump_dir(tmp_path):
    ember.reset()
    yield str(tmp_path / "dump")
    ember.reset()


def test_dump_frame_with_breaks_and_recompiles(dump_dir):
    cf = ember.compile(brk, dynamic=False, backend="eager")  # static sizes: the second shape is a second entry
    x, y = torch.ones(4), torch.ones(4)
    xs, ys = torch.ones(6), torch.ones(6)
    with ember.debug.dump(dump_dir) as d:
        assert d == os.path.abspath(dump_dir)
        r1 = cf(x, y)
        r2 = cf(xs, ys)  # new shape: a recompile, one more cache entry of each code
        r3 = cf(-x, y * 0)  # the other branch: another resume function
    for got, args in ((r1, (x, y)), (r2, (xs, ys)), (r3, (-x, y * 0))):
        torch.testing.assert_close(got, brk(*args), rtol=0, atol=0)
    files = sorted(os.listdir(dump_dir))
    assert "full_code_brk.py" in files and "ember_dump.json" in files and "frame_brk.json" in files
    graphs = [f for f in files if f.startswith("__compiled_fn_") and f.endswith(".py")]
    assert len(graphs) >= 5  # brk x2, the branch's resume x2, each side's tail
    src = open(os.path.join(dump_dir, "full_code_brk.py"), encoding="utf-8").read()
    # the guards of each entry as an if-chain, the graph calls, the break, the resume functions
    assert "def __guard_0_for_brk(L, G, B):" in src and "def __guard_1_for_brk(L, G, B):" in src
    assert "check_tensor(L['x'], torch.float32, device='cpu', size=[4]" in src
    # the recompile: a new static shape, or (automatic dynamic shapes) a symbolic one
    assert ("check_tensor(L['x'], torch.float32, device='cpu', size=[6]" in src
            or "check_tensor(L['x'], torch.float32, device='cpu', size=[None]" in src)
    assert "graph_out = __compiled_fn_1(L['x'], L['y'])" in src
    assert "___result0 = ___operand0(___operand1, file=___operand2)" in src  # print(..., file=OUT)
    assert "def __resume_at_" in src and "if not ___operand0:" in src
    assert "    if __guard_1_for_brk(L, G, B):\n        return __transformed_code_1_for_brk(x, y)" in src
    g1 = open(os.path.join(dump_dir, "__compiled_fn_1.py"), encoding="utf-8").read()
    assert "def forward(self, l_x, l_y):" in g1 and "torch.sin(l_x)" in g1
    assert "# call_function  sin" in g1  # the table
    meta = _json(dump_dir)
    (frame,) = meta["frames"]
    kinds = [(e["code"], e["kind"], e["runs_from"]) for e in frame["entries"]]
    assert ("brk", "break", "dump file") in kinds and any(k[1] == "graph" for k in kinds)
    b = next(e for e in frame["entries"] if e["code"] == "brk")
    assert b["reason"] == "PRINT" and b["lineno"] == brk.__code__.co_firstlineno + 2
    assert b["compile_time_s"] > 0


def test_full_code_runs_on_its_own(dump_dir):
    cf = ember.compile(brk, backend="eager")
    cases = [(torch.rand(4) + 1, torch.rand(4)), (-torch.rand(4) - 2, torch.rand(4)), (torch.rand(3) + 1, torch.rand(3))]
    with ember.debug.dump(dump_dir):
        compiled = [cf(*a) for a in cases]
    ns = runpy.run_path(os.path.join(dump_dir, "full_code_brk.py"))
    for args, want in zip(cases, compiled):
        got = ns["brk"](*args)  # guards in Python, the dumped graphs, the resume functions
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, brk(*args), rtol=0, atol=0)
    with pytest.raises(ember.debug._rt.NoCacheEntry):
        ns["brk"](torch.ones(2, 2), torch.ones(2, 2))  # no entry: ember would compile one


def test_dump_module(dump_dir):
    torch.manual_seed(0)
    net = Net()
    cm = ember.compile(net, backend="eager")
    x = torch.randn(2, 4)
    with ember.debug.dump(dump_dir):
        got = cm(x)
    torch.testing.assert_close(got, net(x))
    src = open(os.path.join(dump_dir, "full_code_forward.py"), encoding="utf-8").read()
    assert "def __transformed_code_0_for_forward(self, x):" in src
    assert "L['self'].fc.weight" in src or "L['self'].fc" in src
    ns = runpy.run_path(os.path.join(dump_dir, "full_code_forward.py"))
    torch.testing.assert_close(ns["forward"](net, x), net(x))


def test_dump_backend_ember_kernels(dump_dir):
    def g(x):
        return torch.cos(x) * 2 + 1
    cf = ember.compile(g, backend="ember")
    x = torch.randn(8)
    with ember.debug.dump(dump_dir):
        got = cf(x)
    torch.testing.assert_close(got, g(x))
    files = os.listdir(dump_dir)
    kernels = [f for f in files if f.endswith(".kernels.c")]
    assert kernels, files
    assert "void ember_k0" in open(os.path.join(dump_dir, kernels[0]), encoding="utf-8").read()
    gsrc = open(os.path.join(dump_dir, kernels[0].replace(".kernels.c", ".py")), encoding="utf-8").read()
    assert "backend 'ember'" in gsrc and "torch.cos" in gsrc


def test_dump_custom_backend_gets_same_fx_graph(dump_dir):
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm.code)
        return gm.forward

    def h(x):
        return torch.tanh(x) - x
    cf = ember.compile(h, backend=backend)
    x = torch.randn(3)
    with ember.debug.dump(dump_dir):
        torch.testing.assert_close(cf(x), h(x))
    g = open(os.path.join(dump_dir, "__compiled_fn_1.py"), encoding="utf-8").read()
    assert seen and seen[0].strip() in g


def test_dump_off_writes_nothing_and_runs_no_dumped_code(dump_dir, tmp_path):
    cf = ember.compile(brk, backend="eager")
    x, y = torch.ones(4), torch.ones(4)
    cf(x, y)
    assert not os.path.exists(dump_dir)
    with ember.debug.dump(dump_dir):
        cf2 = ember.compile(lambda x: torch.cos(x) + 1, backend="eager")
        cf2(x)
    ran = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(os.path.abspath(dump_dir)):
            ran.append(frame.f_code.co_name)
    sys.setprofile(prof)
    try:
        cf2(x)  # compiled inside the dump; outside it runs from C again
        cf(x, y)
    finally:
        sys.setprofile(None)
    assert ran == []
    assert ember._C._set_dump_hook(None) is None


def _pdb_session(tmp_path, target_file, needle, commands):
    """Runs a script under pdb that dumps brk, sets a breakpoint on the dumped line containing
    needle, and calls the compiled function again; returns pdb's output."""
    dump = tmp_path / "dump"
    script = tmp_path / "drive.py"
    script.write_text(textwrap.dedent(f"""
        import io, os, pdb, sys
        import torch, ember, ember.debug
        OUT = io.StringIO()
        def brk(x, y):
            a = torch.sin(x) + y
            print("between graphs", file=OUT)
            return a * 2
        cf = ember.compile(brk, backend="eager")
        x, y = torch.ones(4), torch.full((4,), 2.0)
        with ember.debug.dump({str(dump)!r}) as d:
            cf(x, y)
            path = os.path.join(d, {target_file!r})
            line = next(i for i, t in enumerate(open(path), 1) if {needle!r} in t)
            dbg = pdb.Pdb(stdin=sys.stdin, stdout=sys.stdout)
            dbg.set_break(path, line)
            print("BREAK AT", path, line, flush=True)
            r = dbg.runcall(cf, x, y)
        print("RESULT", r.tolist(), flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], input="\n".join(commands) + "\n", capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_pdb_breakpoint_in_full_code(tmp_path):
    out = _pdb_session(tmp_path, "full_code_brk.py", "___result0 = ___operand0(", ["c", "p (x.tolist(), a.tolist())", "where", "c"])
    assert "full_code_brk.py" in out and "___result0 = ___operand0(___operand1, file=___operand2)" in out
    # the user's locals at the break: x, y and the graph's result a = sin(1) + 2
    assert "([1.0, 1.0, 1.0, 1.0], [2.84147" in out
    assert "RESULT [5.68" in out


def test_pdb_breakpoint_in_graph_file(tmp_path):
    out = _pdb_session(tmp_path, "__compiled_fn_1.py", "add = sin + l_y", ["c", "p sin.tolist()", "c"])
    assert "__compiled_fn_1.py" in out and "[0.84147" in out
    assert "RESULT [5.68" in out


def _make_report(dump_dir):
    torch.manual_seed(0)
    cf = ember.compile(brk, backend="eager")
    cm = ember.compile(Net(), backend="eager")
    cg = ember.compile(lambda x: torch.cos(x) * 2 + 1, backend="ember")
    with ember.debug.dump(dump_dir):
        cf(torch.ones(4), torch.ones(4))
        cf(torch.ones(5), torch.ones(5))
        cm(torch.randn(2, 4))
        cg(torch.randn(8))
    p = subprocess.run([sys.executable, "-m", "ember", "report", dump_dir], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    page = os.path.join(dump_dir, "index.html")
    assert p.stdout.strip() == page
    return page


def test_report_html(dump_dir):
    page = open(_make_report(dump_dir), encoding="utf-8").read()
    assert page.startswith("<!doctype html>") and page.count("<section class='frame'>") == 3
    for text in ("brk", "forward", "graph break</b> (PRINT)", "print or other I/O", "transformed code",
                 "__graph_break_0_for_brk", "check_tensor", "generated C kernels", "ember_k0", "compiled in"):
        assert text in page, text
    import importlib.util
    if importlib.util.find_spec("graphviz") and shutil.which("dot"):
        assert "<svg" in page  # graphs drawn by dot
    else:
        assert "<table class='nodes'>" in page


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_browser() is None, reason="no headless Chromium installed (apt-get install chromium)")
def test_report_in_headless_browser(dump_dir, tmp_path):
    page = _make_report(dump_dir)
    shot = tmp_path / "report.png"
    base = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]
    p = subprocess.run(base + ["--window-size=1200,1400", f"--screenshot={shot}", "file://" + page],
                       capture_output=True, text=True, timeout=120)
    assert shot.exists(), p.stderr
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1200, 1400)
    assert len(png) > 20_000  # a drawn page, not a blank one
    dom = subprocess.run(base + ["--dump-dom", "file://" + page], capture_output=True, text=True, timeout=120).stdout
    assert "ember report" in dom and "__compiled_fn_1" in dom and "graph break" in dom


def test_dump_break_in_a_long_loop(dump_dir):
    def loop(x, n):
        for i in range(n):
            x = x + 1
            print(i, end="", file=OUT)  # a break in each iteration: resume functions nest
        return x * 2
    cf = ember.compile(loop, backend="eager")
    x = torch.zeros(3)
    with ember.debug.dump(dump_dir):
        got = cf(x, 300)
    torch.testing.assert_close(got, loop(x, 300))


def test_ember_dump_environment_variable(tmp_path):
    d = tmp_path / "envdump"
    code = ("import torch, ember\n"
            "f = ember.compile(lambda x: torch.sin(x) * 3)\n"
            "print(f(torch.ones(2)).tolist())\n")
    env = dict(os.environ, EMBER_DUMP=str(d))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "full_code__lambda_.py" in os.listdir(d) and "__compiled_fn_1.py" in os.listdir(d)
    (frame,) = _json(str(d))["frames"]
    assert frame["entries"][0]["runs_from"] == "dump file"


def test_full_code_keeps_the_signature(dump_dir):
    def sig(x, *rest, scale, **kw):
        y = x * scale + sum(rest)
        print("sig", file=OUT)
        return y + kw["bias"]
    cf = ember.compile(sig, backend="eager")
    x = torch.ones(3)
    with ember.debug.dump(dump_dir):
        got = cf(x, 1.0, 2.0, scale=3.0, bias=torch.full((3,), 0.5))
    want = sig(x, 1.0, 2.0, scale=3.0, bias=torch.full((3,), 0.5))
    torch.testing.assert_close(got, want)
    ns = runpy.run_path(os.path.join(dump_dir, "full_code_sig.py"))
    assert "def sig(x, *rest, scale, **kw):" in open(os.path.join(dump_dir, "full_code_sig.py")).read()
    torch.testing.assert_close(ns["sig"](x, 1.0, 2.0, scale=3.0, bias=torch.full((3,), 0.5)), want)


def test_dump_entry_turned_fallback_runs_no_dumped_graph(dump_dir):
    """A backend that changes what the trace read: the fresh entry fails its own guards and becomes
    a fallback (csrc/hook/em_hook_cache.c); its dumped transformed code must not run either."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 1.0

        def forward(self, x):
            return x * self.k
    m = Scaled()

    def bumping_backend(gm, example_inputs):
        m.k = m.k + 1.0
        return gm.forward
    c = ember.compile(m, backend=bumping_backend)
    x = torch.randn(3)
    with ember.debug.dump(dump_dir):
        for _ in range(3):
            torch.testing.assert_close(c(x), m.forward(x), rtol=0, atol=0)


def test_dump_writes_the_aot_autograd_graphs(dump_dir):
    def f(x, w):
        return (torch.tanh(x @ w) * 2).sum()

    cf = ember.compile(f, backend="aot_eager")
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    with ember.debug.dump(dump_dir):
        loss = cf(x, w)
    loss.backward()
    w2 = w.detach().clone().requires_grad_(True)
    f(x, w2).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    files = [n for n in os.listdir(dump_dir) if n.endswith(".autograd.txt")]
    assert len(files) == 1, sorted(os.listdir(dump_dir))
    text = open(os.path.join(dump_dir, files[0]), encoding="utf-8").read()
    for part in ("joint graph:", "forward graph:", "backward graph:", "saved tensor(s)", "recomputed"):
        assert part in text, text
    from ember.debug import report
    page = open(report.render(dump_dir), encoding="utf-8").read()
    assert "AOT autograd: joint, forward, backward graphs" in page and "backward graph:" in page
