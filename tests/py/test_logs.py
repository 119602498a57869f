"""Logs by topic (ember.set_logs, EMBER_LOGS): each topic emits its record as the event happens,
"+topic" adds debug records, and a topic that is off emits nothing."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import ember
from conftest import assert_same


@pytest.fixture(autouse=True)
def _logs_off():
    ember.set_logs()
    yield
    ember.set_logs()


def broken(x, n):
    y = torch.cos(x) * n
    if y.sum() > 0:  # BREAK-LINE
        return y.sin()
    return y


BREAK_LINE = broken.__code__.co_firstlineno + 2


def records(caplog, topic=None):
    return [r for r in caplog.records if r.name.startswith("ember") and (topic is None or r.name == f"ember.{topic}")]


def run_broken(backend="eager"):
    c = ember.compile(broken, backend=backend, dynamic=False)  # each n its own entry (no symbolic int)
    x = torch.rand(6) * 0.5  # cos(x) > 0: the sin branch
    assert_same(c(x, 2), broken(x, 2), exact=backend == "eager")
    return c, x


def test_off_emits_nothing(caplog):
    caplog.set_level(logging.DEBUG)
    c, x = run_broken()
    c(x, 3)  # a recompile
    assert records(caplog) == []


def test_graph_breaks_record_has_reason_user_line_and_source(caplog):
    ember.set_logs("graph_breaks")
    run_broken()
    (r,) = records(caplog, "graph_breaks")
    assert r.levelno == logging.INFO
    msg = r.getMessage()
    assert "DATA_DEPENDENT_BRANCH" in msg and f"{__file__}:{BREAK_LINE}" in msg and "# BREAK-LINE" in msg
    assert r.ember_event["info"]["lineno"] == BREAK_LINE
    assert records(caplog, "guards") == [] and records(caplog, "graph") == []  # other topics stay off


def test_debug_level_adds_records(caplog):
    ember.set_logs("+graph_breaks")
    run_broken()
    rs = records(caplog, "graph_breaks")
    assert [r.levelno for r in rs] == [logging.INFO, logging.DEBUG]
    assert "resume functions" in rs[1].getMessage() and "instruction" in rs[1].getMessage()


def test_recompiles_names_failed_guard(caplog):
    ember.set_logs("recompiles")
    c, x = run_broken()
    assert records(caplog, "recompiles") == []  # a first compile is not a recompile
    c(x, 3)
    (r,) = records(caplog, "recompiles")
    assert "L['n'] == 2" in r.getMessage() and r.ember_event["failed_guards"] == ["L['n'] == 2"]


def test_recompiles_debug_lists_every_entry(caplog):
    ember.set_logs(recompiles=logging.DEBUG)
    c, x = run_broken()
    c(x, 3)
    c(x, 4)
    last = [r for r in records(caplog, "recompiles")][-2:]
    assert last[0].levelno == logging.INFO and last[1].levelno == logging.DEBUG
    assert "L['n'] == 3" in last[1].getMessage() and "L['n'] == 2" in last[1].getMessage()


def test_guards_of_new_entries_and_debug_failures(caplog):
    ember.set_logs("+guards")
    c, x = run_broken()
    new = [r for r in records(caplog, "guards") if r.levelno == logging.INFO]
    assert len(new) == 2  # the break entry, then the resume function's graph entry
    assert "check_tensor(L['x']" in new[0].getMessage() and "L['n'] == 2" in new[0].getMessage()
    assert new[0].ember_event["info"]["guards"] == ember.cache_info(c)[0]["guards"]
    caplog.clear()
    c(x, 5)
    fails = [r for r in records(caplog, "guards") if r.levelno == logging.DEBUG]
    assert any("L['n'] == 2" in r.getMessage() for r in fails)


def test_graph_record_is_the_captured_table(caplog):
    ember.set_logs("graph")
    c, _ = run_broken()
    rs = records(caplog, "graph")
    assert len(rs) == 2 and "torch.cos" in rs[0].getMessage() and "sin" in rs[1].getMessage()
    assert ember.cache_info(c)[0]["graph"].splitlines()[2].strip() in rs[0].getMessage()


def test_output_code_fx_backend(caplog):
    ember.set_logs("output_code")
    run_broken(backend="fx")
    rs = records(caplog, "output_code")
    assert len(rs) == 2 and "def forward(self" in rs[0].getMessage() and "torch.cos" in rs[0].getMessage()


def test_output_code_ember_backend_has_c_kernels(caplog):
    ember.set_logs("output_code")
    f = ember.compile(lambda x: torch.sin(x) * 2, backend="ember")
    x = torch.randn(16)
    torch.testing.assert_close(f(x), torch.sin(x) * 2)
    (r,) = records(caplog, "output_code")
    info = ember.cache_info(f)[0]["ember"]
    assert "fallback" not in info
    assert "void ember_k0" in r.getMessage() and "sinf" in r.getMessage()


def test_perf_has_stage_times(caplog):
    ember.set_logs(perf=True)
    run_broken()
    rs = records(caplog, "perf")
    assert len(rs) == 2
    t = rs[0].ember_event["info"]["compile_times"]
    assert set(t) == {"trace", "guards", "backend", "total"}
    assert all(v >= 0 for v in t.values()) and t["total"] >= t["trace"]
    assert "trace" in rs[0].getMessage() and " ms" in rs[0].getMessage()


def test_perf_of_backend_ember_has_its_stages(caplog):
    ember.set_logs("perf")
    f = ember.compile(lambda x: torch.cos(x) + 1, backend="ember")
    x = torch.randn(8)
    torch.testing.assert_close(f(x), torch.cos(x) + 1)
    (r,) = records(caplog, "perf")
    stages = r.ember_event["info"]["ember"]["stage_times"]
    assert set(stages) == {"lower", "schedule", "codegen", "cc_and_build"}
    assert "ember: lower" in r.getMessage()


def test_set_logs_rejects_unknown_topic_and_all_turns_every_topic_on(caplog):
    with pytest.raises(ValueError):
        ember.set_logs("graph_brakes")
    with pytest.raises(ValueError):
        ember.set_logs(graphs=True)
    ember.set_logs("all")
    run_broken()
    assert {r.name for r in records(caplog)} == {"ember.graph_breaks", "ember.guards", "ember.graph", "ember.perf"}
    ember.set_logs()
    caplog.clear()
    ember.reset()
    run_broken()
    assert records(caplog) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_raising_handler_does_not_change_results():
    """A handler that raises is reported as unraisable (sys.unraisablehook); the call's results
    and cache entries are what they are without logs."""
    class Bad(logging.Handler):
        def emit(self, record):
            raise RuntimeError("handler failed")

    lg = logging.getLogger("ember.graph")
    h = Bad()
    lg.addHandler(h)
    try:
        ember.set_logs("graph")
        c, _ = run_broken()  # compares with eager
        assert [e["kind"] for e in ember.cache_info(c, resume=True)] == ["break", "graph"]
    finally:
        lg.removeHandler(h)


def test_ember_logs_env_prints_to_stderr():
    code = ("import torch, ember\n"
            "f = ember.compile(lambda x, n: torch.cos(x) * n)\n"
            "x = torch.ones(3); f(x, 1); f(x, 2)\n")
    env = dict(os.environ, EMBER_LOGS="recompiles,+guards")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "[ember.recompiles] INFO: Recompiling" in p.stderr and "L['n'] == 1" in p.stderr
    assert "[ember.guards] DEBUG: Guard failed" in p.stderr
    assert "[ember.graph]" not in p.stderr
