"""Examples for the walk-through tutorial's two programs (seeds/walk_through_torch_compile.rst).

1. A sigmoid-like function that takes a dict of tensors and branches on a tensor value, called with
   two shapes: the branch makes the frame fall back (DATA_DEPENDENT_BRANCH); the shape change adds
   a cache entry. A branch-free twin shows the same arithmetic captured as one graph.
2. One function that is handed two different modules as an argument: the module is guarded by
   identity, so the second module makes the JIT compile a second entry (a recompile).
"""
import torch


def gated_sigmoid(inputs):
    """Softened logistic of inputs["a"], halved when it saturates, plus inputs["b"]."""
    a = inputs["a"]
    b = inputs["b"]
    s = 2.0 / (torch.exp(-1.5 * a) + 3.0)
    if s.max() > 0.6:          # depends on tensor values: the tracer cannot decide it
        s = s * 0.5
    return s * b + 0.25


def smooth_sigmoid(inputs):
    """gated_sigmoid without the branch: everything is tensor arithmetic, one graph."""
    a = inputs["a"]
    s = 2.0 / (torch.exp(-1.5 * a) + 3.0)
    return {"out": s * inputs["b"], "scale": s.mean()}


class Squash(torch.nn.Module):
    def forward(self, x):
        return torch.sigmoid(3.0 * x) + 0.5


class Stretch(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x * 0.25)


def log_of_module(x, mod):
    """The module is an argument: each distinct module object gets its own cache entry."""
    return torch.log(mod(x)) * 2.0


def _inputs(n, lo, hi, requires_grad=False):
    a = torch.linspace(lo, hi, n).requires_grad_(requires_grad)
    b = torch.linspace(1.0, 2.0, n).requires_grad_(requires_grad)
    return {"a": a, "b": b}


def cases():
    # shape 10 reaches s.max() ~0.66 (branch taken); shape 8 stays below 0.6 (branch not taken)
    two_shapes = [(_inputs(10, -2.0, 3.0),), (_inputs(8, -2.0, 0.2),), (_inputs(10, -2.0, 3.0),)]
    grad_shapes = [(_inputs(10, -2.0, 3.0, True),), (_inputs(8, -2.0, 0.2, True),)]
    x = torch.rand(5, 5, 5) + 0.1
    squash, stretch = Squash(), Stretch()
    return [
        ("sigmoid_dict_branch", gated_sigmoid, two_shapes),
        ("sigmoid_dict_branch_grad", gated_sigmoid, grad_shapes),
        ("sigmoid_dict", smooth_sigmoid, two_shapes),
        ("module_as_argument", log_of_module, [(x, squash), (x, squash), (x, stretch), (x, stretch)]),
    ]
