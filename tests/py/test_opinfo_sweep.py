"""CI subset of the OpInfo differential sweep (src/ember/testing/opinfo_sweep.py): the first two
float32 samples and first two error inputs of ~70 well-known ops through
ember.compile(backend="eager"), compared with eager PyTorch (about 10 s on 2 cores). ember may fall
back (a recorded fallback is correct behaviour) but must never give a wrong result, crash, or raise
a different exception. Also checks that the harness itself detects wrong results, crashes and
exception mismatches (a compiler that lies must not pass), that --shard splits a sweep into
disjoint parts that cover it, that merged reports count like one run, and the head-to-head and
per-dtype sections of the Markdown report.
"""
import json
import re
import shutil
import time

import pytest
import torch

pytest.importorskip("expecttest")

from ember.testing import opinfo_sweep as sw  # noqa: E402

CI_OPS = """
add mul sub div.no_rounding_mode div.floor_rounding sin cos exp log tanh sigmoid nn.functional.relu
softmax log_softmax sum mean amax argmax matmul mm bmm addmm mv baddbmm nn.functional.linear
nn.functional.conv2d nn.functional.max_pool2d nn.functional.layer_norm nn.functional.batch_norm
nn.functional.gelu nn.functional.silu cat stack reshape view permute transpose t squeeze unsqueeze
flatten expand index_select gather where clamp abs neg pow sqrt rsqrt floor cumsum topk sort
max.reduction_with_dim chunk split narrow masked_fill nn.functional.embedding clone minimum maximum
var std prod any all eq lt
""".split()


def test_ci_subset_has_no_wrong_results():
    regex = "^(" + "|".join(re.escape(n) for n in CI_OPS) + ")$"
    report = sw.sweep(ops=regex, dtypes=("float32",), max_samples=2, compilers=("ember",), log=None,
                      error_inputs=True)
    assert set(report["results"]) == set(CI_OPS), set(CI_OPS) ^ set(report["results"])
    bad = [f for f in report["failures"] if f["cls"] not in ("pass", "fallback")]  # inexact is bad too
    assert not bad, "\n".join(f"{f['op']} #{f['sample']} {f['cls']}: {f['detail']}\n{f['source']}" for f in bad)
    tot = sw.totals(report)["ember"]
    assert tot["pass"] + tot["fallback"] == sum(tot.values()) > 2 * len(CI_OPS) - 10
    assert tot["pass"] > tot["fallback"]


def _case():
    return sw.build_case(torch.add, type("S", (), {"input": torch.ones(3), "args": (torch.ones(3),),
                                                  "kwargs": {"alpha": 2}})())


def test_build_case_passes_tensors_as_arguments():
    case = _case()
    assert case.source == "def case(t0, t1):\n    return OP(t0, t1, alpha=2)\n"
    assert torch.equal(case.make()(*case.tensors), torch.full((3,), 3.0))


def test_classify_detects_wrong_crash_and_mismatch():
    case = _case()
    ref = sw.run_one(case.make(), case, 0)
    assert sw.classify(ref, sw.run_one(case.make(), case, 0), False)[0] == "pass"
    assert sw.classify(ref, sw.run_one(case.make(), case, 0), True)[0] == "fallback"
    assert sw.classify(ref, sw.run_one(lambda a, b: a - b, case, 0), False)[0] == "wrong"
    assert sw.classify(ref, sw.run_one(lambda a, b: (a + 2 * b).double(), case, 0), False)[0] == "wrong"
    assert sw.classify(ref, sw.run_one(lambda a, b: (a + 2 * b)[None], case, 0), False)[0] == "wrong"
    assert sw.classify(ref, sw.run_one(lambda a, b: (a.add_(b), a + b)[1], case, 0), False)[0] == "wrong"

    def boom(a, b):
        raise RuntimeError("boom")
    assert sw.classify(ref, sw.run_one(boom, case, 0), False)[0] == "crash"
    raised = sw.run_one(boom, case, 0)
    assert sw.classify(raised, sw.run_one(boom, case, 0), False)[0] == "pass"
    assert sw.classify(raised, ref, False)[0] == "mismatch"
    assert sw.classify(raised, sw.run_one(lambda a, b: 1 / 0, case, 0), False)[0] == "crash"

    def other(a, b):
        raise RuntimeError("other")
    assert sw.classify(raised, sw.run_one(other, case, 0), False)[0] == "mismatch"


def test_markdown_report_counts_cases():
    report = sw.sweep(ops="^add$", max_samples=2, compilers=("ember",), log=None, error_inputs=True)
    text = sw.to_markdown(report, "python -m ember.testing.opinfo_sweep --ops ^add$")
    assert "    python -m ember.testing.opinfo_sweep --ops ^add$" in text
    tot = sw.totals(report)["ember"]
    assert sum(tot.values()) >= 2
    assert f"| ember.compile(eager) | {sum(tot.values())} | {tot['pass']} | {tot['fallback']} | 0 | 0 | 0 |" in text
    assert "| add | ember |" in text
    # one `cases` entry per case, pass included, agreeing with the per-op counts
    assert len(report["cases"]) == sum(tot.values())
    assert all(op == "add" and cl.keys() == {"ember"} for op, _d, _s, cl in report["cases"])
    assert sum(cl["ember"] == "pass" for *_, cl in report["cases"]) == tot["pass"]
    f32 = sw.dtype_totals(report)["ember"]["float32"]
    assert f32["pass"] + f32["fallback"] == 2
    assert f"| ember.compile(eager) | float32 | 2 | {f32['pass']} | {f32['fallback']} | 0 | 0 | 0 |" in text
    assert "## Head to head" not in text  # nothing to compare ember with


SMALL = "^(add|sub|mul|div.no_rounding_mode)$"


@pytest.fixture(scope="module")
def small():
    """Sweeps of four ops, one float32 sample each: ember unsharded and in 2 and 4 shards, torch."""
    run = lambda **kw: sw.sweep(ops=SMALL, max_samples=1, log=None, **kw)  # noqa: E731
    return dict(ember=run(compilers=("ember",)), torch=run(compilers=("torch",)),
                **{f"{k}/{n}": run(compilers=("ember",), shard=(k, n)) for n in (2, 4) for k in range(n)})


def test_shards_are_disjoint_and_cover_the_ops(small):
    whole = list(small["ember"]["results"])
    assert sorted(whole) == ["add", "div.no_rounding_mode", "mul", "sub"]
    for n in (2, 4):
        parts = [list(small[f"{k}/{n}"]["results"]) for k in range(n)]
        assert sorted(sum(parts, [])) == sorted(whole), parts
        assert all(len(p) == 4 // n for p in parts), parts  # index mod N: each shard gets N-th of the ops
        assert [small[f"{k}/{n}"]["shard"] for k in range(n)] == [f"{k}/{n}" for k in range(n)]
    assert [list(small[f"{k}/4"]["results"]) for k in range(4)] == [[op] for op in whole]
    assert sw.parse_shard("3/16") == (3, 16)
    for bad in ("16/16", "1", "-1/2", "a/b", "0/0"):
        with pytest.raises(ValueError):
            sw.parse_shard(bad)


def _case_rows(report):
    return sorted(json.dumps(c, sort_keys=True) for c in report["cases"])


def test_merged_shards_equal_the_unsharded_run(small):
    whole = small["ember"]
    for n in (2, 4):
        merged = sw.merge_reports([small[f"{k}/{n}"] for k in range(n)][::-1])  # order of inputs does not matter
        assert sw.totals(merged) == sw.totals(whole)
        assert list(merged["results"]) == list(whole["results"])  # op_db order again
        assert merged["results"] == whole["results"]
        assert _case_rows(merged) == _case_rows(whole)
        assert merged["compilers"] == ["ember"] and not merged["dropped"]
        assert merged["seconds"] == max(small[f"{k}/{n}"]["seconds"] for k in range(n))
    # a report merged with itself counts once
    twice = sw.merge_reports([whole, whole])
    assert sw.totals(twice) == sw.totals(whole) and len(twice["dropped"]) == len(whole["results"])
    assert len(twice["cases"]) == len(whole["cases"]) and len(twice["failures"]) == len(whole["failures"])


def test_merged_compilers_give_both_counts_and_head_to_head(small, tmp_path):
    e, t = dict(small["ember"], command="run-e"), dict(small["torch"], command="run-t")
    m = sw.merge_reports([e, t])
    assert m["compilers"] == ["ember", "torch"] and m["command"] == "run-e ; run-t"
    tot = sw.totals(m)
    assert tot["ember"] == sw.totals(e)["ember"] and tot["torch"] == sw.totals(t)["torch"]
    assert sum(tot["torch"].values()) == len(m["cases"]) == len(e["cases"]) == 4
    assert all(cl.keys() == {"ember", "torch"} for *_, cl in m["cases"])
    ec = {tuple(c[:3]): c[3]["ember"] for c in e["cases"]}
    tc = {tuple(c[:3]): c[3]["torch"] for c in t["cases"]}
    h = sw.head_to_head(m, "torch")
    assert h["both_ran"] == 4
    assert h["both_pass"] == sum(ec[k] == "pass" and tc[k] == "pass" for k in ec)
    assert h["first_only"] == sum(ec[k] == "pass" and tc[k] != "pass" for k in ec)
    assert h["other_only"] == sum(ec[k] != "pass" and tc[k] == "pass" for k in ec)
    assert h["both_pass"] + h["first_only"] + h["other_only"] + h["neither"] == 4
    text = sw.to_markdown(m, m["command"])
    assert "## Head to head on the same cases" in text
    assert (f"| torch.compile(eager) | 4 | {h['first_only']} | {h['other_only']} | {h['both_pass']}"
            f" | {h['neither']} |") in text
    assert "    run-e\n    run-t\n" in text
    # the same through the command line, with the JSON written and read back
    paths = []
    for r, name in ((e, "e.json"), (t, "t.json")):
        sw.write_json(r, str(tmp_path / name))
        paths.append(str(tmp_path / name))
    assert json.load(open(paths[0])) == json.loads(json.dumps(e))
    assert sw.main(["--merge", *paths, "--json", str(tmp_path / "m.json"), "--out", str(tmp_path / "m.md")]) == 0
    again = json.load(open(tmp_path / "m.json"))
    assert sw.totals(again) == tot and _case_rows(again) == _case_rows(m)
    assert "## Head to head on the same cases" in (tmp_path / "m.md").read_text()
    assert sw.main(["--render", str(tmp_path / "m.json"), "--out", str(tmp_path / "r.md")]) == 0
    assert "| torch.compile(eager) | 4 |" in (tmp_path / "r.md").read_text()


def test_head_to_head_lists_cases_with_embers_reason():
    counts = lambda **kw: dict(dict.fromkeys(sw.CLASSES, 0), **kw)  # noqa: E731
    report = dict(
        results={"item": {"ember": counts(fallback=1, wrong=1), "inductor": counts(**{"pass": 2})},
                 "nonzero": {"ember": counts(**{"pass": 1}), "inductor": counts(fallback=1)}},
        cases=[["item", "float32", 0, {"ember": "fallback", "inductor": "pass"}],
               ["item", "float64", 0, {"ember": "wrong", "inductor": "pass"}],
               ["nonzero", "float32", 0, {"ember": "pass", "inductor": "fallback"}],
               ["nonzero", "float32", 1, {"ember": "pass"}]],  # inductor did not run it
        failures=[dict(op="item", dtype="float32", sample=0, compiler="ember", cls="fallback",
                       detail="UNSUPPORTED_CALL: Tensor.item", source=""),
                  dict(op="item", dtype="float64", sample=0, compiler="ember", cls="wrong",
                       detail="output leaf 0: value 1 vs 2", source=""),
                  dict(op="nonzero", dtype="float32", sample=0, compiler="inductor", cls="fallback",
                       detail="Dynamic shape operator", source="")],
        inexact={"ember": 0, "inductor": 0}, skipped_random=[], error_inputs=False, seconds=1.0,
        out_of_time=False, compilers=["ember", "inductor"], dtypes=["float32", "float64"], torch="x", python="y")
    h = sw.head_to_head(report, "inductor")
    assert (h["both_ran"], h["first_only"], h["other_only"], h["both_pass"], h["neither"]) == (3, 1, 2, 0, 0)
    text = sw.to_markdown(report, "cmd")
    assert "| torch.compile(inductor) | 3 | 1 | 2 | 0 | 0 |" in text
    assert "### torch.compile(inductor) passes, ember does not (2)" in text
    assert "| item | float32 | 0 | fallback | UNSUPPORTED_CALL: Tensor.item |" in text
    assert "| item | float64 | 0 | wrong | output leaf 0: value 1 vs 2 |" in text
    assert "| torch.compile(inductor) | float64 | 1 | 1 | 0 | 0 | 0 | 0 |" in text  # per dtype
    assert "| torch.compile(inductor) | Dynamic shape operator | 1 |" in text  # graph break table
    assert "| nonzero | inductor | 0 | 1 |" in text


def test_torch_graph_breaks_are_recorded_as_fallbacks():
    report = sw.sweep(ops="^nonzero$", max_samples=1, compilers=("torch",), log=None)
    assert report["cases"] == [["nonzero", "float32", 0, {"torch": "fallback"}]]
    (f,) = report["failures"]
    assert (f["compiler"], f["cls"]) == ("torch", "fallback") and "nonzero" in f["detail"], f
    assert f["source"].startswith("def case(")


def test_torch_runners_share_one_function():
    assert set(sw.RUNNERS) == {"ember", "ember_codegen", "torch", "inductor"}
    for comp, backend in (("torch", "eager"), ("inductor", "inductor")):
        assert sw.RUNNERS[comp].func is sw.run_torch_compile and sw.RUNNERS[comp].keywords == {"backend": backend}
    assert sw.RUNNERS["ember_codegen"].func is sw.run_ember and sw.RUNNERS["ember_codegen"].keywords == {"backend": "ember"}
    case = _case()
    ref = sw.run_one(case.make(), case, 0)
    assert sw.RUNNERS["torch"](case, 0, ref) == ("pass", "", False)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_runner_passes_a_trivial_case():
    case = _case()
    ref = sw.run_one(case.make(), case, 0)
    torch._dynamo.reset()
    t0 = time.monotonic()
    cls, detail, _inexact = sw.RUNNERS["inductor"](case, 0, ref)
    assert (cls, detail) == ("pass", ""), detail
    assert time.monotonic() - t0 < 120


def test_error_rule_counts_an_error_met_while_tracing_as_pass():
    """ERROR_RULE: eager raises, ember met that error while tracing (META_FAILED with eager's
    exception type) and re-ran the frame eagerly: pass. Another fallback reason stays a fallback."""
    bad = sw.build_case(torch.arange, type("S", (), {"input": 0, "args": (10, 0), "kwargs": {}})())
    ref = sw.run_one(bad.make(), bad, 0)
    assert isinstance(ref.exc, RuntimeError)
    assert sw.run_ember(bad, 0, ref)[0] == "pass"
    info = [{"kind": "fallback", "reason": "UNSUPPORTED_CALL", "detail": "RuntimeError: x"}]
    assert not sw._error_met_while_tracing(info, ref.exc)
    info = [{"kind": "fallback", "reason": "META_FAILED", "detail": "ValueError: x"}]
    assert not sw._error_met_while_tracing(info, ref.exc)
    assert sw._error_met_while_tracing([{"kind": "fallback", "reason": "RAISE",
                                         "detail": "RuntimeError: raise statement"}], ref.exc)


def test_ember_codegen_runner_passes_a_trivial_case():
    case = _case()
    ref = sw.run_one(case.make(), case, 0)
    assert sw.RUNNERS["ember_codegen"](case, 0, ref) == ("pass", "", False)
