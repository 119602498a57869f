"""Builds and runs the C unit tests (tests/c: arena, vectors, break reasons, IR building, names,
DCE, verifier, printer, export, EagerGraph, OutSpec; test_sym: symbolic sizes and the shape
environment) with the system C compiler, so that pytest is the one test command. Skips when no
C compiler, make, or libpython to embed is available."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CDIR = os.path.join(ROOT, "tests", "c")


def _libpython_available() -> bool:
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ldversion = sysconfig.get_config_var("LDVERSION") or ""
    return any(
        os.path.exists(os.path.join(libdir, f"libpython{ldversion}{ext}")) for ext in (".so", ".a", ".dylib")
    )


def _toolchain_missing() -> str | None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if shutil.which("make") is None:
        return "no make"
    if not _libpython_available():
        return "no libpython to embed"
    return None


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_c_units(sanitize, tmp_path):
    why = _toolchain_missing()
    if why:
        pytest.skip(why)
    if sanitize and os.environ.get("EMBER_C_SANITIZE", "1") == "0":
        pytest.skip("EMBER_C_SANITIZE=0")
    # each variant builds into its own directory: the two builds must not reuse each other's binary
    cmd = ["make", "-s", "-B", "-C", CDIR, f"PYTHON={sys.executable}", f"BIN={tmp_path}"]
    if sanitize:
        cmd.append("SANITIZE=1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if sanitize and proc.returncode != 0 and ("cannot find -lasan" in out or ("libasan" in out and "not found" in out)):
        pytest.skip("AddressSanitizer runtime not installed")
    assert proc.returncode == 0, out
    assert "0 failed" in out, out
