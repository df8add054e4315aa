"""Test session settings shared by the unit tests and the nbval-executed notebooks.

The environment is set here, before any notebook kernel starts, so kernels inherit it:
no progress bars in stored outputs and a non-interactive matplotlib backend.
"""
import os

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
