"""Examples for the TorchDynamo/TorchInductor tutorial (seeds/torchdynamo_inductor_tutorial.rst):
basic functions and modules, control flow that depends on data, a tensor plus a Python int, a call
into numpy (the tutorial uses scipy), and a custom backend that prints the FX graph it receives.
numpy is optional: without it the numpy case is listed by skipped() with a one-line reason.
"""
import importlib.util

import torch
import torch.nn.functional as F

try:
    import numpy as np
except ImportError as e:  # the demo's extra installs it; a bare `pip install -e .` may not have it
    np, _NUMPY_MISSING = None, f"numpy does not import ({type(e).__name__}: {e})"
else:
    _NUMPY_MISSING = None


def sin_plus_cos(x, y):
    """Two pointwise ops on different inputs, summed: one graph."""
    return torch.sin(x) + torch.cos(y)


class LinearRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 8)

    def forward(self, x):
        return F.relu(self.lin(x))


def sign_dependent(x, y):
    """The returned expression depends on the sign of x's mean: a data-dependent branch."""
    if x.mean() < 0:
        return y * -2.0
    return y + 1.0


def plus_int(x, k):
    """A Python int argument is specialised (guarded by value): each new k is a recompile."""
    return x + k


def through_numpy(x):
    """NumPy in the middle: x.numpy() and np.cumsum are traced into the graph as torch ops with
    NumPy's dtypes (one graph, as torch.compile); torch's cumsum is not NumPy's to the bit."""
    x = x * 3.0
    arr = np.cumsum(x.numpy(), axis=-1)
    return torch.from_numpy(arr) - 1.0


def tanh_then_normalise(a, b):
    """Tensor math, then a branch on b's values, then more math: the graph-break example."""
    h = torch.tanh(a) * 0.5
    if b.max() > 1.0:
        b = b / b.max()
    return h * b


def printing_backend(gm, example_inputs):
    """A custom backend: prints the FX graph it is handed and runs it unchanged."""
    print(f"custom backend called with an FX graph of {len(gm.graph.nodes)} nodes, "
          f"{len(example_inputs)} example inputs:")
    if importlib.util.find_spec("tabulate") is not None:
        gm.graph.print_tabular()
    else:  # print_tabular needs the optional 'tabulate' package; the graph's own text instead
        print(gm.graph)
    return gm.forward


# Cases whose graph computes with other kernels than eager's: compared within tolerances.
NOT_BITWISE = ("calls_numpy",)

# Cases that the demo also compiles with a custom backend (case name -> backend).
CUSTOM_BACKENDS = {"graph_break": printing_backend, "sin_plus_cos": printing_backend}


def skipped():
    """(name, why) for cases this machine cannot run."""
    return [("calls_numpy", _NUMPY_MISSING)] if _NUMPY_MISSING else []


def cases():
    torch.manual_seed(0)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    lr = LinearRelu()
    pos = torch.rand(10) + 0.1
    out = [
        ("sin_plus_cos", sin_plus_cos, [(x, y), (x, y)]),
        ("linear_relu", lr, [(torch.randn(4, 32),), (torch.randn(4, 32),)]),
        ("data_dependent_branch", sign_dependent, [(pos, y[0]), (-pos, y[0])]),
        ("tensor_plus_int", plus_int, [(x, 3), (x, 3), (x, 7)]),
        ("calls_numpy", through_numpy, [(torch.randn(3, 4),)]),
        ("graph_break", tanh_then_normalise, [(x[0], pos * 3.0), (x[0], pos * 0.5)]),
    ]
    return [c for c in out if not (c[0] == "calls_numpy" and np is None)]
