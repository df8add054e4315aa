"""What each layer costs and keeps when it is recomputed: the columns ``profile(..., recompute=True)`` adds.

The profiler measures the model twice more, every unit under a checkpoint
(:func:`~pipeswift_lab.core.recompute.recomputing`): once ``"full"`` (each keeps only its input),
once ``"selective"`` (each keeps its matrix multiplications' results too). Per unit:

* ``recompute_ms`` — the extra forward of full recomputation: its measured backward less the plain
  backward (medians of each);
* ``selective_recompute_ms`` — the same under selective recomputation (the cheap operators alone);
* ``recompute_forward_ms`` / ``selective_recompute_forward_ms`` — what the checkpointed forward itself
  takes more (selective checkpointing caches every kept result through a dispatch mode: on CPU it
  costs as much again as the recomputation);
* ``full_activation_bytes`` / ``selective_activation_bytes`` — what the unit holds until its
  backward under each, measured as :mod:`.hooks`' memory step measures ``activation_bytes``
  (on the eager forward: recomputing layers keep their inputs, which the exported graph holds
  alike);
* ``full_transient_bytes`` / ``selective_transient_bytes`` — the most its backward allocates
  beyond what it keeps, the recomputed activations included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from torch import nn

from ..core.recompute import RECOMPUTE_MODES, recomputing
from .step_record import StepRecord

__all__ = ["FORWARD_COLUMNS", "RECOMPUTE_COLUMNS", "recompute_columns", "recomputed"]

#: The columns :func:`recompute_columns` returns, in order.
RECOMPUTE_COLUMNS = (
    "recompute_ms",
    "selective_recompute_ms",
    "full_activation_bytes",
    "selective_activation_bytes",
    "full_transient_bytes",
    "selective_transient_bytes",
)
#: Columns :func:`recompute_columns` adds that an older profile may lack (then 0: a forward that costs what it did).
FORWARD_COLUMNS = {"full": "recompute_forward_ms", "selective": "selective_recompute_forward_ms"}


def recompute_columns(
    layers: list[nn.Module],
    plain: list[StepRecord],
    measure: Callable[[], tuple[list[StepRecord], StepRecord | None]],
) -> dict[str, list[float]]:
    """Per unit (``layers``, in unit order), the :data:`RECOMPUTE_COLUMNS` and :data:`FORWARD_COLUMNS`: ``measure()``
    runs the profiler's timed steps and memory step again with every unit recomputed, once per mode; ``plain`` are
    the timed steps without.

    Returns ``{column: [value per unit]}`` (unit order, as ``StepRecord``'s lists).
    """
    base = np.median(np.array([r.bwd_ms for r in plain]), axis=0)
    base_forward = np.median(np.array([r.fwd_ms for r in plain]), axis=0)
    out: dict[str, list[float]] = {}
    for mode in RECOMPUTE_MODES:
        with recomputing(layers, mode):
            kept, memory = measure()
        extra = np.maximum(0.0, np.median(np.array([r.bwd_ms for r in kept]), axis=0) - base)
        out["recompute_ms" if mode == "full" else "selective_recompute_ms"] = [float(x) for x in extra]
        forward = np.maximum(0.0, np.median(np.array([r.fwd_ms for r in kept]), axis=0) - base_forward)
        out[FORWARD_COLUMNS[mode]] = [float(x) for x in forward]
        held = memory.held_bytes if memory is not None and memory.held_bytes is not None else None
        out[f"{mode}_activation_bytes"] = [float(x) for x in held] if held is not None else [float("nan")] * len(base)
        transient = memory.accumulate_transient_bytes if memory is not None else None
        out[f"{mode}_transient_bytes"] = (
            [float(x) for x in transient] if transient is not None else [float("nan")] * len(base)
        )
    return {name: out[name] for name in (*RECOMPUTE_COLUMNS, *FORWARD_COLUMNS.values())}


def recomputed(profile: Any, recompute: str | Mapping[str, str] | None) -> Any:
    """``profile`` (a :class:`~pipeswift_lab.profiling.table.Profile` measured with ``recompute=True``) as its layers
    cost recomputed: ``recompute`` is ``"full"`` or ``"selective"`` (every layer), or ``{layer name or glob: mode}``
    (those layers; the others as they are), or None (the profile itself). Returns a new Profile.

    A recomputed layer holds ``{mode}_activation_bytes`` until its backward, its forward takes
    ``recompute_forward_ms`` (or ``selective_recompute_forward_ms``) more, its backward ``recompute_ms`` (or
    ``selective_recompute_ms``) more (``recomputed_ms`` says how much: the zero-bubble schedules run it in both
    their passes, and ``wgrad_ms``, where given, grows by it), its transients are its recomputed ones, and what a
    zero-bubble ``I`` pass keeps of it for ``W`` is ``{mode}_weight_pass_bytes`` where the profile measured it. A
    profile already recomputed this way is returned as it is (``meta["recompute"]`` says how). Raises
    ``ValueError`` for a profile without the recompute columns, one already recomputed another way, an unknown mode,
    or a name that matches no layer.
    """
    if recompute is None:
        return profile
    _check_measured(profile.df)
    names = [str(n) for n in profile.df["name"]]
    modes = _layer_modes(recompute, names)
    if profile.meta.get("recompute"):  # the columns now hold the recomputed costs: a second pass would add to them
        return _recomputed_already(profile, modes)
    table = _recomputed_table(profile.df, names, modes)
    return type(profile)(table, {**profile.meta, "recompute": modes})


def _check_measured(df: pd.DataFrame) -> None:
    """Raise ``ValueError`` unless the profile table ``df`` has the :data:`RECOMPUTE_COLUMNS`."""
    missing = [c for c in RECOMPUTE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(
            f"the profile has no {missing[:2]} columns: profile the model with profile(..., recompute=True) to plan "
            "or predict recomputation"
        )


def _layer_modes(recompute: str | Mapping[str, str], names: list[str]) -> dict[str, str]:
    """The mode of each layer of ``names`` that ``recompute`` recomputes (:func:`recomputed`'s argument), checked.
    Returns ``{layer name: mode}``, in layer order for a mode given to every layer, else in the order named."""
    modes = _modes_as_named(recompute, names)
    bad = sorted({m for m in modes.values() if m not in RECOMPUTE_MODES})
    if bad:
        raise ValueError(f"recompute mode {bad[0]!r} is not one of {list(RECOMPUTE_MODES)}")
    return {n: m for n, m in modes.items() if m}


def _modes_as_named(recompute: str | Mapping[str, str], names: list[str]) -> dict[str, str]:
    """The mode ``recompute`` gives each layer of ``names`` it names, empty modes and unknown ones included. Returns
    ``{layer name: mode}``."""
    if isinstance(recompute, str):
        return {name: recompute for name in names}
    if not isinstance(recompute, Mapping):
        raise TypeError(f"recompute must be None, 'full', 'selective' or a dict {{layer: mode}}; got {recompute!r}")
    modes: dict[str, str] = {}
    for pattern, mode in recompute.items():
        modes.update({n: mode for n in _matching(pattern, names)})
    return modes


def _matching(pattern: str, names: list[str]) -> list[str]:
    """The layers of ``names`` that ``pattern`` (a name or a glob) names; raises ``ValueError`` where none. Returns
    them in layer order."""
    import fnmatch

    matched = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, str(pattern))]
    if not matched:
        raise ValueError(f"recompute names {pattern!r}, which matches no layer of the profile: {names[:12]}")
    return matched


def _recomputed_already(profile: Any, modes: dict[str, str]) -> Any:
    """``profile``, already recomputed, if it is recomputed as ``modes`` say; raises ``ValueError`` if otherwise.
    Returns the profile."""
    already = profile.meta["recompute"]
    if already == modes:
        return profile
    raise ValueError(
        f"the profile already costs its layers recomputed ({_listed(already)}); recompute from the profile as measured"
    )


def _recomputed_table(df: pd.DataFrame, names: list[str], modes: dict[str, str]) -> pd.DataFrame:
    """The profile table ``df`` (its layers ``names``) with each layer of ``modes`` costed recomputed under its mode.
    Returns a new table."""
    out = df.copy()
    out["recomputed_ms"] = 0.0  # what the backward recomputes: a zero-bubble schedule's I and W each run it
    for mode in RECOMPUTE_MODES:
        rows = np.array([modes.get(n) == mode for n in names])
        if rows.any():
            _add_recomputed_times(out, df, rows, mode)
            _set_recomputed_bytes(out, df, rows, mode)
    out["total_ms"] = out["fwd_ms"] + out["bwd_ms"]
    out["activation_bytes"] = out["activation_bytes"].astype("int64")
    return out


def _add_recomputed_times(out: pd.DataFrame, df: pd.DataFrame, rows: np.ndarray, mode: str) -> None:
    """Add to the ``rows`` of ``out`` what recomputing them under ``mode`` takes, as the profile ``df`` measured it:
    the backward's recomputation (in ``recomputed_ms`` and, where given, ``wgrad_ms`` too) and the checkpointed
    forward's extra."""
    extra = df["recompute_ms" if mode == "full" else "selective_recompute_ms"].to_numpy(float)
    out.loc[rows, "bwd_ms"] = df["bwd_ms"].to_numpy(float)[rows] + extra[rows]
    out.loc[rows, "recomputed_ms"] = extra[rows]
    if FORWARD_COLUMNS[mode] in df.columns:
        forward = np.nan_to_num(df[FORWARD_COLUMNS[mode]].to_numpy(float))
        out.loc[rows, "fwd_ms"] = df["fwd_ms"].to_numpy(float)[rows] + forward[rows]
    if "wgrad_ms" in df.columns:
        out.loc[rows, "wgrad_ms"] = df["wgrad_ms"].to_numpy(float)[rows] + extra[rows]


def _set_recomputed_bytes(out: pd.DataFrame, df: pd.DataFrame, rows: np.ndarray, mode: str) -> None:
    """Set the ``rows`` of ``out`` to what they keep and allocate recomputed under ``mode``, as the profile ``df``
    measured it: the activations held until the backward, what an ``I`` pass keeps for ``W`` and the most it holds,
    and the transients
    (the recomputed activations included)."""
    out.loc[rows, "activation_bytes"] = df[f"{mode}_activation_bytes"].to_numpy(float)[rows].round()
    for column in ("weight_pass_bytes", "input_pass_peak_bytes"):
        if f"{mode}_{column}" in df.columns:
            out.loc[rows, column] = df[f"{mode}_{column}"].to_numpy(float)[rows]
    transient = df[f"{mode}_transient_bytes"].to_numpy(float)
    if "accumulate_transient_bytes" in df.columns:
        grown = transient - np.nan_to_num(df["accumulate_transient_bytes"].to_numpy(float))
        out.loc[rows, "transient_bytes"] = df["transient_bytes"].to_numpy(float)[rows] + np.maximum(grown, 0)[rows]
        out.loc[rows, "accumulate_transient_bytes"] = transient[rows]


def _listed(modes: Mapping[str, str]) -> str:
    items = [f"{name}: {mode}" for name, mode in list(modes.items())[:4]]
    return ", ".join(items) + (", ..." if len(modes) > 4 else "")
