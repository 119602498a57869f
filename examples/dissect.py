"""Example for the "dissecting torch.compile" article (seeds/dissecting_torch_compile.md): a module
that owns a bare Parameter and a Linear, and ends in relu. Its parameters become graph inputs whose
sources are the module's attributes (L['self'].gain, L['self'].proj.weight ...).
"""
import torch


class GatedProjection(torch.nn.Module):
    def __init__(self, width=6):
        super().__init__()
        gen = torch.Generator(device=torch.get_default_device()).manual_seed(7)
        self.gain = torch.nn.Parameter(torch.rand(width, generator=gen))
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return (self.proj(x) * self.gain - x).relu()


def cases():
    torch.manual_seed(0)
    m = GatedProjection()
    return [
        ("gated_projection", m, [(torch.randn(3, 6),), (torch.randn(5, 6),)]),
    ]
