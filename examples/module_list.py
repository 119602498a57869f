"""Example for the depyf optimization tutorial (seeds/optimization_tutorial_depyf.rst): a ModuleList
of n small modules, each adding its own Python int constant. With n=100 the guards must not cost
100 times those of n=1 (DESIGN.md decision 5): the module tree is covered by dict version tags.
"""
import torch


class AddConstant(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x + self.c


class Chain(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.steps = torch.nn.ModuleList([AddConstant(3 * k + 1) for k in range(n)])

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x


def cases():
    ints = torch.tensor([2])
    floats = torch.arange(4, dtype=torch.float32)
    return [
        ("chain_1", Chain(1), [(ints,), (ints,)]),
        ("chain_100", Chain(100), [(ints,), (ints,)]),
        ("chain_100_float", Chain(100), [(floats,)]),
    ]
