"""CI subset of the OpInfo differential sweep (src/ember/testing/opinfo_sweep.py): the first two
float32 samples and first two error inputs of ~70 well-known ops through
ember.compile(backend="eager"), compared with eager PyTorch (about 10 s on 2 cores). ember may fall back (a recorded fallback is correct behaviour) but must never give a
wrong result, crash, or raise a different exception. Also checks that the harness itself detects
wrong results, crashes and exception mismatches (a compiler that lies must not pass).
"""
import re

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
