"""Every minimized reproducer in tests/regressions/ (saved by ember.testing.program_gen's shrinker,
or written by hand) compiled with ember vs eager: each file defines program(...) and inputs() (a
list of argument tuples); ember must give eager's results, exceptions and argument mutations,
bitwise. A file that sets XFAIL = "<bug>" is a known ember bug: the test is xfail(strict=True), so
the fix makes it pass and pytest then reports XPASS as a failure until the XFAIL line is removed.
"""
import pathlib

import pytest

from ember.testing import program_gen as pg

DIR = pathlib.Path(__file__).resolve().parents[1] / "regressions"
FILES = sorted(DIR.glob("*.py"))


def _params():
    out = []
    for f in FILES:
        ns = pg.load_source(f.read_text(), str(f))
        marks = [pytest.mark.xfail(strict=True, reason=ns["XFAIL"])] if ns.get("XFAIL") else []
        out.append(pytest.param(f, id=f.stem, marks=marks))
    return out


@pytest.mark.parametrize("path", _params())
def test_regression(path):
    ns = pg.load_source(path.read_text(), str(path))
    ns_eager = pg.load_source(path.read_text(), str(path))   # eager's own globals
    cls, detail = pg.check(ns["program"], ns["inputs"](), eager_fn=ns_eager["program"], backward=ns.get("BACKWARD", "all"))
    assert cls in ("pass", "fallback"), f"{path.name}: {cls}: {detail}"


def test_regression_folder_is_there():
    assert DIR.is_dir()
