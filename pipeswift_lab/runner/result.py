"""What a real run measured: :class:`RunResult` (timeline, step times, losses, JCT, final parameters)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.display import html_card, text_card
from ..core.jct import JCT
from ..core.schedule import ScheduleLike
from .run_files import CHECKPOINT_COLUMNS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..simulation.timeline import Timeline

__all__ = ["RunResult"]


@dataclass(frozen=True, repr=False)
class RunResult:
    """One real pipeline run, measured.

    * ``timeline`` — a ``Timeline`` with ``source="measured"``: one row per executed compute
      action (``F``, ``B``, ``I``, ``W``) of every rank and step, and with ``D`` > 1 replicas
      one ``REDUCE_GRAD`` per stage and step (the gradient all-reduce, see
      :attr:`allreduce_ms`; FSDP's reduce-scatter with ``fsdp`` > 1, and its ``UNSHARD``); with
      ``tp`` > 1 one ``TP_ALL_REDUCE``/``TP_ALL_GATHER``/``TP_REDUCE_SCATTER``/``TP_ALL_TO_ALL`` row per
      tensor-parallel collective, nested in the ``F``/``B``/``I``/``W`` that ran it (see
      :attr:`tp_collectives`, :attr:`tp_comm_ms`); in ms since the first step started (None when the run was not
      instrumented);
    * ``step_ms`` — every step, from the first rank starting it to the last rank finishing it
      (optimizer step included);
    * ``losses`` — per step, the mean of the micro-batch losses on the last stage;
    * ``jct`` — measured ``JCT``: ``assembly_s`` from launch to the first step (processes,
      imports, rendezvous, process groups, stage build), ``training_s`` the steps,
      ``cleanup_s`` gathering the final state and teardown until the result is back;
      ``queue_s`` is 0 (nothing waited for machines);
    * :meth:`state_dict` — the trained parameters gathered from every rank, with the keys of
      ``model.state_dict()``;
    * ``status`` — ``"completed"``, ``"preempted"`` (stopped by SIGTERM after a clean save at
      the same step on every rank) or ``"nonfinite"`` (carried by the ``RunError``);
    * ``segments`` — one row per configuration the job ran in (``P``, ``bounds``, steps, and the
      measured ``save_s``, ``teardown_s``, ``assembly_s``, ``restore_s`` of each change; see
      ``run(elastic=Elastic(resize_at=...))``); ``rebalances`` — every rebalancing decision, taken or not;
    * ``first_step`` — the step the measured steps start from: 0, or the step the run (or its
      last restart) resumed from; ``step_ms``, ``losses`` and the timeline cover steps
      ``first_step`` .. the last step done;
    * ``checkpoints`` — one row per checkpoint committed or skipped (``step``, ``path``,
      ``bytes`` of its files, ``largest_rank_bytes`` the largest rank's file,
      ``largest_rank_state_bytes`` the tensors in it, ``blocking_ms`` the stall of the step
      loop, ``staging_ms`` the slowest rank's copy of its state, ``write_ms`` the slowest
      rank's background write (file, fsync, checksum), ``save_ms`` from the save's start to
      its commit, ``kind`` periodic/auto/preempt/final/rebalance, ``status`` committed or
      skipped (due while the last save was still being written), ``mode`` async, waited (a
      save that may not be skipped waits for its write) or sync, ``attempt``);
      ``checkpoint`` — the newest complete one (None without ``checkpoint_dir``);
    * ``restarts`` — workers restarted after a crash; ``steps_redone`` — steps trained again
      because they came after the checkpoint a restart resumed from; ``recovery_s`` — from the
      last step before each crash to the first step after it; ``restore_s`` — loading the
      checkpoint a ``resume_from`` run started from; ``skipped_steps`` — updates dropped at
      non-finite losses (``on_nonfinite="skip"``).

    With checkpoints, ``jct.cleanup_s`` is the final save plus teardown and
    ``jct.preemption_loss_s`` the periodic save stalls, the restore, the steps redone and the
    recovery; ``jct.total_s`` is the wall time from ``run()`` to its return.
    """

    timeline: Timeline | None
    step_ms: tuple[float, ...]
    losses: tuple[float, ...]
    jct: JCT
    schedule: ScheduleLike
    P: int
    v: int
    m: int
    steps: int
    backend: str
    device_type: str
    instrumented: bool
    ranks: pd.DataFrame = field(compare=False, repr=False)
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    _state: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    status: str = "completed"
    first_step: int = 0
    checkpoints: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=list(CHECKPOINT_COLUMNS)), compare=False, repr=False
    )
    checkpoint: str | None = None
    restarts: int = 0
    steps_redone: int = 0
    recovery_s: float = 0.0
    restore_s: float = 0.0
    skipped_steps: tuple[int, ...] = ()
    segments: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(), compare=False, repr=False)
    rebalances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(), compare=False, repr=False)
    D: int = 1

    @property
    def allreduce_ms(self) -> float:
        """The measured gradient all-reduce across the D replicas (ms): per step its longest ``REDUCE_GRAD`` action
        (a stage's buckets, from the first one's launch to the last one's end, overlapping the last backward),
        the median over the steps after the first. NaN for D=1 or a run without a timeline."""
        if self.D == 1 or self.timeline is None:
            return float("nan")
        df = self.timeline.df
        reduce = df[df["kind"] == "REDUCE_GRAD"]
        per_step = (reduce["end_ms"] - reduce["start_ms"]).groupby(reduce["step"]).max()
        if per_step.empty:
            return float("nan")
        return float(per_step.iloc[1:].median() if len(per_step) > 1 else per_step.iloc[0])

    @property
    def tp_collectives(self) -> pd.DataFrame:
        """Tensor parallelism's measured collectives, one row per collective: the timeline's ``TP_*`` rows
        (``step``, ``replica``, ``rank``, ``stage``, ``microbatch``, ``kind``, ``start_ms``, ``end_ms``, and ``bytes``
        where the timeline carries it) with ``collective`` (``all_reduce``, ``all_gather``, ``reduce_scatter``,
        ``all_to_all``), ``ms`` and ``phase``: the action it ran inside (``F`` the forward; ``B``, ``I``, ``W`` the
        backward). Empty without tensor parallelism or a timeline."""
        from ..core.vocabulary import COMPUTE_KINDS, TP_COLLECTIVE

        columns = ["step", "replica", "rank", "stage", "microbatch", "kind", "collective", "phase", "start_ms"]
        columns += ["end_ms", "ms"]
        if self.timeline is None:
            return pd.DataFrame(columns=columns)
        df = self.timeline.df
        tp = df[df["kind"].isin(list(TP_COLLECTIVE))].reset_index(drop=True)
        key = ["step", "replica", "rank", "stage", "microbatch"]
        actions = df.loc[df["kind"].isin(COMPUTE_KINDS), key + ["kind", "start_ms", "end_ms"]]
        inside = tp.reset_index().merge(actions, on=key, suffixes=("", "_action"))
        inside = inside[
            (inside["start_ms_action"] <= inside["start_ms"]) & (inside["end_ms"] <= inside["end_ms_action"])
        ]
        phase = inside.drop_duplicates("index").set_index("index")["kind_action"]
        out = tp.assign(
            collective=tp["kind"].map(TP_COLLECTIVE),
            phase=phase.reindex(tp.index).to_numpy(),
            ms=tp["end_ms"] - tp["start_ms"],
        )
        return out[columns + (["bytes"] if "bytes" in out.columns else [])]

    @property
    def tp_comm_ms(self) -> float:
        """The measured tensor-parallel communication of the measured step (:attr:`steady_step`), in ms: the summed
        duration of the busiest pipeline rank's ``TP_*`` collectives in that step (forward and backward, every
        micro-batch; the timeline holds each pipeline rank's tensor-parallel rank 0). They lie inside the
        ``F``/``B``/``I``/``W`` actions, so this is part of their time, not added to it. NaN without tensor
        parallelism or a timeline."""
        tp = self.tp_collectives
        if tp.empty or not self.step_ms:
            return float("nan")
        tp = tp[tp["step"] == self.steady_step]
        return float(tp.groupby(["replica", "rank"])["ms"].sum().max()) if len(tp) else float("nan")

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The final parameters and buffers from every rank, keyed and ordered like ``model.state_dict()`` (CPU
        tensors)."""
        return OrderedDict((k, self._state[k]) for k in self.meta["state_keys"])

    def save_pretrained(self, path: str | os.PathLike[str]) -> Path:
        """Write the trained model into the new folder ``path`` as a Hugging Face checkpoint and return it.

        The shards are the ones each rank wrote from its own stages (``model-<r>-of-<P>.safetensors`` with
        ``model.safetensors.index.json``; one rank: ``model.safetensors``), copied file by file: the model is never
        assembled in one process. A tied weight is stored once, under its first name. A Hugging Face model's
        ``config.json`` is written beside them, so ``AutoModelForCausalLM.from_pretrained(path)`` reads the folder;
        a plain module reads it with ``safetensors.torch.load_file`` and ``load_state_dict`` (``strict=False`` for
        the tied names, or through :func:`~pipeswift_lab.runner.weights.open_weights`). A result read back from
        disk (``load_result``) writes its saved state as one file.

        A Hugging Face model's tensors are written as ``save_pretrained`` writes them for its family, through
        transformers' own reverse conversion (:func:`~pipeswift_lab.runner.hf_conversion.to_stored`): GPT-NeoX's head
        as ``embed_out.weight``, a mixture of experts one tensor per expert, so other tools read the folder too."""
        from .final_weights import FinalWeights, write_pretrained

        config = self.meta.get("hf_config")
        stored_form = self._stored_form()
        if isinstance(self._state, FinalWeights):
            return self._state.save_pretrained(path, config, stored_form)
        return write_pretrained(self.state_dict(), path, self.meta.get("aliases", {}), config, stored_form)

    def _stored_form(self) -> Any:
        """How a shard of a Hugging Face model is stored (its family's names and tensors), or ``None``."""
        name, config = self.meta.get("hf_class"), self.meta.get("hf_config")
        if name is None or config is None:
            return None
        from .hf_conversion import model_of_class, to_stored

        model = model_of_class(name, config)
        return lambda state: to_stored(model, state)

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the final state into ``model`` (``load_state_dict``, strict) and return it."""
        model.load_state_dict(self.state_dict())
        return model

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write this result into the directory ``path``; return it. ``load_result(path)`` reads it back.

        The layout (:mod:`~pipeswift_lab.runner.result_files`): ``result.json`` (every scalar, step times, losses,
        JCT, meta, the tables' dtypes, each file's SHA-256), ``state.pt`` (the final state, loadable with
        ``torch.load(..., weights_only=True)``), ``timeline.csv`` and one CSV per table (``ranks``,
        ``checkpoints``, ``segments``, ``rebalances``). Loading runs no code. ``path`` must not exist or be empty;
        ``overwrite=True`` replaces an earlier saved result there.
        """
        from .result_files import save_result

        return save_result(self, path, overwrite=overwrite)

    @property
    def steady_step(self) -> int:
        """The step :attr:`steady_step_ms` is taken from: the median step after the first (see
        :data:`~pipeswift_lab.fidelity.comparison.MEASURED_STEP`)."""
        from ..simulation.steady import steady_step_index

        probed = [s - self.first_step for s in self.probed_steps]
        return self.first_step + steady_step_index(self.step_ms, skip=probed)

    @property
    def probed_steps(self) -> tuple[int, ...]:
        """The steps whose tensor-level memory was measured on CPU (slower for it: a Python call per operator), left
        out of :attr:`steady_step_ms` and :meth:`step_stats` while other steps remain."""
        if "probed_steps" in self.meta:
            return tuple(self.meta["probed_steps"])
        found = {row.get("probed_step") for row in self.meta.get("memory_measured", [])}
        return tuple(sorted(s for s in found if s is not None))

    @property
    def steady_step_ms(self) -> float:
        """The measured step: :data:`~pipeswift_lab.fidelity.comparison.MEASURED_STEP` (``compare``, ``calibrate`` and
        the report use it).

        The whole step (first rank starting it to the last rank finishing it, optimizer step
        included) of the median step after the first, which warms up allocators and
        communicators; for an even count the lower of the two middle steps, so the number is
        a step that happened and its Gantt chart can be shown. The only step if there is one.
        """
        return float(self.step_ms[self.steady_step - self.first_step])

    def step_stats(self, window: int = 100) -> pd.DataFrame:
        """Step-time dispersion per window of ``window`` steps and for the whole run, each warm-up step (and each
        step whose memory was probed, :attr:`probed_steps`) excluded.

        One row per window (``window`` = 0, 1, ...; the last may be shorter) and a last row
        ``window="all"``: ``first_step``, ``last_step``, ``steps``, ``mean_ms``, ``std_ms``
        (sample std, NaN for one step), ``cv`` (std / mean), ``p50_ms``, ``p95_ms`` (linear
        interpolation), ``max_ms``. A run of several segments (a resize or a rebalance, see
        ``segments``) is tracked after every change: windows restart in each segment, each
        segment's first step (new workers warming up) is left out, every row names its
        ``segment`` and each segment gets its own ``"all"`` row before the whole run's
        (``segment`` = -1); "the 100-step mean and variance after every change" is one call.
        """
        from ..core.checks import check_int
        from ..simulation.steady import step_time_stats

        window = check_int("window", window, minimum=1)
        offset = self.first_step  # step numbers, for a run resumed at a later step
        steps = pd.Series(list(self.step_ms), index=range(offset, offset + len(self.step_ms)), dtype=float)
        starts = sorted(int(x) for x in self.segments["first_step"]) if len(self.segments) > 1 else [offset]

        def stats(name: int | str, part: pd.Series, segment: int) -> dict[str, Any]:
            return {"segment": segment, "window": name, **step_time_stats(part)}

        rows, kept = [], []
        for seg, begin in enumerate(starts):
            end = starts[seg + 1] if seg + 1 < len(starts) else offset + len(self.step_ms)
            part = steps.loc[begin : end - 1]
            part = part.iloc[1:] if len(part) > 1 else part
            unprobed = part.drop([s for s in self.probed_steps if s in part.index])
            part = unprobed if len(unprobed) else part
            if part.empty:
                continue
            kept.append(part)
            rows += [stats(k, part.iloc[i : i + window], seg) for k, i in enumerate(range(0, len(part), window))]
            if len(starts) > 1:
                rows.append(stats("all", part, seg))
        rows.append(stats("all", pd.concat(kept), -1 if len(starts) > 1 else 0))
        out = pd.DataFrame(rows)
        out["window"] = out["window"].astype(object)
        return out

    @property
    def memory(self) -> pd.DataFrame:
        """Peak memory of every process, measured beside predicted: one row per process, with its mesh coordinates
        ``pp`` (also ``rank``), ``dp`` (also ``replica``), ``fsdp`` and ``tp``.

        * ``measured_peak_bytes`` — tensor level: on CUDA ``torch.cuda.max_memory_allocated`` over the
          run; on CPU the most bytes of tensor storage alive at once in the run's second step (every
          parameter, gradient, optimizer state, saved activation, buffer and temporary; see
          :mod:`~pipeswift_lab.runner.rank.memory_probe`);
        * ``predicted_peak_bytes`` — the memory model's prediction for that rank in this run (its
          partition replayed at this micro-batch size, schedule and optimizer), and ``error`` =
          predicted / measured - 1;
        * ``resident_peak_bytes`` (CPU) — the process's resident high-water over the steps above its
          resident size before the first, which adds the allocator's and libraries' memory;
          ``reserved_peak_bytes`` (CUDA) — ``torch.cuda.max_memory_reserved``;
        * the predicted terms ``weights_bytes``, ``grads_bytes``, ``optimizer_bytes``,
          ``activations_bytes``, ``buffers_bytes``, ``transient_bytes`` at the predicted peak and
          ``peak_at`` (the action, or ``"optimizer step"``), then the measured state bytes.

        Empty for a run that was not instrumented (``instrument=False``).
        """
        from .memory_report import memory_frame

        return memory_frame(self.meta.get("memory_measured", []), self.meta.get("memory_predicted"))

    def memory_terms(self) -> pd.DataFrame:
        """Every term of every rank's memory, measured beside predicted, at two moments: one row per (``replica``,
        ``rank``, ``moment``, ``term``) with ``measured_bytes``, ``predicted_bytes`` and ``error``.

        ``moment`` is ``"peak"`` (each at its own peak, :attr:`memory`'s ``peak_at`` and ``measured_peak_at``,
        which a backward's frees and transients trade between ``activations`` and ``transient``) or ``"before
        backward"`` (as the rank's first backward starts, where each term stands alone). The terms are
        :data:`~pipeswift_lab.core.memory_model.MEMORY_TERMS`. Empty where the peak was not told apart by term
        (a CUDA run, or one not instrumented).
        """
        from .memory_report import memory_terms

        return memory_terms(self.memory)

    @property
    def tied_weights(self) -> pd.DataFrame:
        """The parameters several stages held (tied weights), kept in sync every step: one row per parameter with
        its ``names`` in the model and the ``stages`` and pipeline ``ranks`` that held a copy."""
        placement = self.meta.get("stage_to_rank", ())
        rows = [
            {
                "names": tuple(g["names"]),
                "stages": tuple(g["stages"]),
                "ranks": tuple(sorted({placement[s] for s in g["stages"]})),
            }
            for g in self.meta.get("tied", [])
        ]
        return pd.DataFrame(rows, columns=["names", "stages", "ranks"])

    @property
    def measured_steps(self) -> range:
        """The step numbers ``step_ms`` and ``losses`` describe: ``first_step`` onwards."""
        return range(self.first_step, self.first_step + len(self.step_ms))

    @property
    def df(self) -> pd.DataFrame:
        """One row per measured step: ``step``, ``step_ms``, ``loss``."""
        return pd.DataFrame(
            {"step": list(self.measured_steps), "step_ms": list(self.step_ms), "loss": list(self.losses)}
        )

    @property
    def assembly_phases(self) -> pd.DataFrame:
        """The measured assembly, phase by phase (``phase``, ``seconds``): the milestones of the slowest rank."""
        return pd.DataFrame(self.meta["assembly_phases"], columns=["phase", "seconds"])

    def plot(self, ax: Axes | None = None, step: int | None = None) -> Axes:
        """Gantt chart of the measured timeline (one step, by default the median-time one after the first). Returns
        the Axes."""
        if not self.instrumented or self.timeline is None:
            raise ValueError("this run was not instrumented (instrument=False): there is no timeline to plot")
        from ..simulation.steady import pick_step

        step = pick_step(self, step)
        return self.timeline.plot(ax=ax, step=step)

    def _summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schedule": str(self.schedule),
            "P": self.P,
            "v": self.v,
            "m": self.m,
            "steps": self.steps,
        }
        if self.D > 1:
            out["D"] = self.D
        if self.status != "completed" or self.first_step:
            out.update(status=self.status, first_step=self.first_step)
        out.update(
            {
                "device": f"{self.device_type} ({self.backend})",
                "steady_step_ms": self.steady_step_ms if self.step_ms else "not measured: no step finished",
            }
        )
        if self.D > 1:
            out["allreduce_ms"] = self.allreduce_ms
        if self.meta.get("tp", 1) > 1 and self.timeline is not None:
            out["tp_comm_ms"] = self.tp_comm_ms
        out.update(
            {
                "final_loss": self.losses[-1] if self.losses else "none: no step finished",
                "jct_total_s": self.jct.total_s,
                "assembly_s": self.jct.assembly_s,
                "training_s": self.jct.training_s,
                "cleanup_s": self.jct.cleanup_s,
            }
        )
        if self.checkpoint is not None or self.jct.preemption_loss_s:
            out.update(
                preemption_loss_s=self.jct.preemption_loss_s,
                checkpoints=int((self.checkpoints["status"] != "skipped").sum()),
                checkpoint=self.checkpoint,
            )
        if self.restarts:
            out.update(restarts=self.restarts, steps_redone=self.steps_redone, recovery_s=self.recovery_s)
        if self.skipped_steps:
            out.update(skipped_steps=len(self.skipped_steps))
        memory = self.memory
        if len(memory):
            worst = memory.loc[memory["measured_peak_bytes"].idxmax()]
            peak = f"{worst['measured_peak_bytes'] / 2**20:.1f} MiB measured on rank {int(worst['rank'])}"
            if pd.notna(worst["predicted_peak_bytes"]):
                peak += f", {worst['predicted_peak_bytes'] / 2**20:.1f} MiB predicted"
                out["memory_error_max"] = float(memory["error"].abs().max())
            else:
                peak += f"; not predicted: {(self.meta.get('memory_predicted') or {}).get('note', 'no prediction')}"
            out["peak_memory"] = peak
        for g in self.meta.get("tied", []):
            out[f"tied {' = '.join(g['names'])}"] = f"stages {list(g['stages'])}, gradients summed every step"
        return out

    def _repr_html_(self) -> str:
        from ..core.display import noise_warning

        status = "" if self.status == "completed" else f" ({self.status} at step {self.first_step + len(self.step_ms)})"
        cv = float(self.step_stats().iloc[-1]["cv"]) if len(self.step_ms) > 2 else float("nan")
        return html_card(
            f"RunResult: {self.schedule}, P={self.P}, m={self.m}, {self.steps} steps{status}", self._summary(), self.df
        ) + noise_warning(cv, "the measured step after the warm-up")

    def __str__(self) -> str:
        return text_card(f"RunResult {self.schedule} P={self.P} m={self.m}", self._summary())

    __repr__ = __str__
