"""Testing helpers for ember: differential testing against eager PyTorch.

ember.testing.opinfo_sweep runs torch's OpInfo database (torch.testing._internal) through
ember.compile and torch.compile and classifies every case (pass / fallback / wrong / crash /
mismatch); `python -m ember.testing.opinfo_sweep --help` for the command line.
"""
