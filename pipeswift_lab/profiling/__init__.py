"""Profiling: reads an ``nn.Module`` and a sample batch, returns a :class:`Profile` (one row per layer).

Each layer's forward, backward and weight-gradient time, its activation and parameter bytes, measured with hooks
on the real model (CUDA events on a GPU, ``perf_counter`` on the CPU)::

    import pipeswift_lab as psl
    prof = psl.profile(model, inputs, target=targets, loss_fn=loss_fn)
    prof.df[["name", "fwd_ms", "bwd_ms", "param_bytes", "activation_bytes"]]

Modules: :mod:`.measure` (:func:`profile`, :func:`profile_step`), :mod:`.table` (the :class:`Profile` type, its
checks and its CSV), :mod:`.hooks` (the per-layer recorder), :mod:`.clocks`, :mod:`.units` (which modules count as
layers), :mod:`.unit_options` (the :class:`UnitByUnit` record of profiling one unit at a time), :mod:`.tp_columns`
(what each layer becomes under a tensor-parallel plan: ``profile(..., tp_plan=...)``) and :mod:`.tp_dataflow` (the
fake-tensor forward that follows the plan's shards); :mod:`.analytic` (:func:`analytic_profile`: a profile of a
:class:`~pipeswift_lab.TransformerSpec` on a :class:`~pipeswift_lab.Hardware` you do not have, computed by
:mod:`.analytic_time` and :mod:`.analytic_bytes` instead of measured).
"""

from __future__ import annotations

from .analytic import analytic_profile
from .measure import profile, profile_step
from .table import Profile
from .unit_options import UnitByUnit

__all__ = ["Profile", "UnitByUnit", "analytic_profile", "profile", "profile_step"]
