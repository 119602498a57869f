"""Smoke test of an installed ember (a wheel or an sdist in a fresh venv, run from outside the checkout):
the package and its subpackages import, ember._C is the installed one, a compiled function and module
equal eager, and the CLI answers. Exit status 0 on success; used by .ci/run."""
import os
import subprocess
import sys

import torch

import ember
import ember.debug
import ember.testing

here = os.path.dirname(os.path.abspath(ember.__file__))
assert "site-packages" in here, f"ember imported from {here}, not from the installed package"
assert os.path.dirname(os.path.abspath(ember._C.__file__)) == here, ember._C.__file__


@ember.compile
def f(x, y):
    return torch.cos(torch.cos(x)) * y


x, y = torch.randn(64), torch.randn(64)
torch.testing.assert_close(f(x, y), torch.cos(torch.cos(x)) * y)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
c = ember.compile(m)
z = torch.randn(4, 8)
with torch.no_grad():
    torch.testing.assert_close(c(z), m(z))
assert ember.cache_info(f)[0]["kind"] == "graph"
out = subprocess.run([sys.executable, "-m", "ember", "--help"], capture_output=True, text=True)
assert out.returncode == 0 and "demo" in out.stdout, out.stdout + out.stderr
print(f"smoke: ember {ember.__file__} OK (torch {torch.__version__}, Python {sys.version.split()[0]})")
