"""Published runs: configurations someone trained and timed, predicted from an analytic profile.

A :class:`PublishedRun` is a configuration (a :class:`~pipeswift_lab.TransformerSpec` on a
:class:`~pipeswift_lab.Hardware`, its layout ``gpus = tp · pp · dp · fsdp``, batch, schedule and recomputation) with
what its authors measured: the iteration time, or the achieved teraFLOP/s per GPU (Narayanan et al., SC'21, Table
1), or tokens per second per GPU (torchtitan's benchmarks). :func:`load_published` reads the shipped ones
(:func:`pipeswift_lab.data.published_runs`); :func:`predict_iteration` prices one with the toolkit's own machinery:

1. :func:`~pipeswift_lab.analytic_profile` of the spec on the hardware at the run's micro-batch (``attention``,
   ``dropout`` as the run has them);
2. tensor parallelism as the planner prices it (the planner's own
   :func:`~pipeswift_lab.profiling.tp_rank.tp_table`: the compute the plan shards divided by ``tp``, the
   Megatron-LM collectives on the topology's intra-node link, all-reduces or, with sequence parallelism,
   all-gathers and reduce-scatters), then the recomputation on every layer
   (:func:`~pipeswift_lab.profiling.recompute_costs.recomputed`);
3. the stages as Megatron-LM and torchtitan cut them: ``layers / (pp · v)`` blocks each (where that does not divide,
   :func:`even_cut`'s, or the run's own ``stage_layers``), the embedding on the first and the head on the last
   (:meth:`~pipeswift_lab.Partition.from_bounds`); the step simulated
   (:func:`~pipeswift_lab.simulation.simulate_step_ms`), the pipeline's sends on the topology's ``pp`` link;
4. the terms beside the pipeline as :func:`pipeswift_lab.planning.placement.collective_terms` prices them, from
   :mod:`pipeswift_lab.core.topology`'s rings: the replicas' gradient all-reduce (``fsdp == 1``), or FSDP's
   all-gather and reduce-scatter and the replicas' all-reduce of a shard, on the links the topology gives the
   ``dp`` and ``fsdp`` groups; where the run overlaps its gradient reduction with the backward (torch DDP's
   buckets, Li et al., VLDB 2020; FSDP's prefetching, Zhao et al., VLDB 2023) only what outlasts the busiest rank's
   last micro-batch (its backward; its forward and backward under FSDP) is added, and under FSDP the first block's
   all-gather and the last block's reduce-scatter, which nothing overlaps (FSDP gathers and reduces a block at a
   time: one block's share of ``fsdp_ms``); and the optimizer step, streaming the busiest
   rank's state (:data:`OPTIMIZER_TRAFFIC_FACTOR` bytes per parameter byte) at the GPU's sustained HBM bandwidth.

A :class:`~pipeswift_lab.fidelity.Calibration` (``psl.calibrate(published_runs)``: one compute scale) scales every
action of step 3; :mod:`pipeswift_lab.fidelity.published_errors` calibrates on some runs and measures the error on
the rest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..core.checks import check_choice, check_flag, check_int
from ..core.costs import allreduce_ms
from ..core.hardware import DEVICES, Hardware, check_hardware
from ..core.precision import PRECISIONS, grad_bytes_per_param
from ..core.topology import Topology, all_gather_ms, all_reduce_ms, reduce_scatter_ms
from ..core.transformer_flops import transformer_flops
from ..core.transformer_spec import TransformerSpec
from ..core.vocabulary import MULTI_CHUNK_SCHEDULES, canonical_schedule
from ..partitioning.stages import Partition
from ..profiling.analytic import analytic_profile
from ..profiling.analytic_time import ATTENTIONS
from ..profiling.recompute_costs import recomputed
from ..profiling.table import Profile
from ..profiling.tp_rank import tp_table
from ..simulation.calibration import SimulatorCalibration, check_calibration
from ..simulation.simulator import simulate_step_ms

__all__ = [
    "MEASURES",
    "OPTIMIZER_TRAFFIC_FACTOR",
    "PRECISION",
    "PublishedRun",
    "even_cut",
    "layout_profile",
    "load_published",
    "predict_iteration",
]

#: Bytes the Adam step reads and writes per byte of parameters (parameter, gradient and two moments read; parameter
#: and two moments written): :data:`pipeswift_lab.planning.placement.OPTIMIZER_TRAFFIC_FACTOR`.
OPTIMIZER_TRAFFIC_FACTOR = 7.0
#: The precision every published run is priced in: bf16 (or fp16) weights and gradients, fp32 master weights and
#: Adam moments (:mod:`pipeswift_lab.core.precision`).
PRECISION = "bf16-mixed"
#: What a run may give as its measurement, one of them: seconds per iteration, teraFLOP/s per GPU, tokens/s per GPU.
MEASURES = ("iteration_s", "tflops_per_gpu", "tokens_per_s_per_gpu")


@dataclass(frozen=True)
class PublishedRun:
    """A published configuration and what was measured of it: ``PublishedRun(spec, hardware, *, gpus, tp=1, pp=1,
    dp=1, fsdp=1, micro_batch, global_batch, schedule="1F1B", v=1, recompute=None, sequence_parallel=False,
    iteration_s=None | tflops_per_gpu=None | tokens_per_s_per_gpu=None, ...)``.

    Checked against the spec at construction; ``ValueError`` names the run and the field: ``tp`` must divide the
    heads, the key/value heads, the MLP's inner size and the node; ``pp · v`` stages need a block each
    (``stage_layers`` says how many, :func:`even_cut` by default); ``gpus`` must be ``tp · pp ·
    dp · fsdp``; ``global_batch`` a multiple of ``micro_batch · dp · fsdp``; at most one measurement, ``> 0``.
    ``tflops_per_gpu`` is read as :func:`~pipeswift_lab.transformer_flops` counts an iteration with the run's
    recomputation (for a GPT with full recomputation, Eq. 3 of Narayanan et al., SC'21, the count their Table 1
    reports); give ``iteration_s`` where a source counted otherwise.
    """

    spec: TransformerSpec
    hardware: Hardware
    _: KW_ONLY
    gpus: int
    micro_batch: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    schedule: str = "1F1B"
    v: int = 1
    stage_layers: tuple[int, ...] | None = None
    """Blocks per pipeline stage in order, ``pp · v`` of them summing to the layers; None: :func:`even_cut`'s."""
    recompute: str | None = None
    sequence_parallel: bool = False
    iteration_s: float | None = None
    tflops_per_gpu: float | None = None
    tokens_per_s_per_gpu: float | None = None
    attention: str = "flash"
    """``"flash"`` or ``"eager"`` (the attention core written out, Megatron-LM's of 2021)."""
    dropout: bool = False
    overlap_grad_sync: bool = False
    """The gradient reduction overlaps the backward (torch DDP, FSDP2); False: it runs after it (Megatron's local
    DDP of 2021)."""
    gpus_per_node: int = 8
    name: str = ""
    model: str = ""
    """Runs of one model share it (the ranking is within a model); default: the spec's name."""
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, TransformerSpec):
            raise TypeError(
                f"{self._who}: spec must be a pipeswift_lab.TransformerSpec; got {type(self.spec).__name__}"
            )
        object.__setattr__(self, "hardware", check_hardware(self.hardware))
        for key in ("gpus", "micro_batch", "global_batch", "tp", "pp", "dp", "fsdp", "v", "gpus_per_node"):
            object.__setattr__(self, key, self._int(key))
        try:
            object.__setattr__(self, "schedule", canonical_schedule(self.schedule))
            object.__setattr__(self, "attention", check_choice("attention", self.attention, ATTENTIONS))
            recompute = None if self.recompute in (None, "", "none") else self.recompute
            modes = ("full", "selective")
            object.__setattr__(self, "recompute", recompute and check_choice("recompute", recompute, modes))
            for key in ("sequence_parallel", "dropout", "overlap_grad_sync"):
                check_flag(key, getattr(self, key))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self._who}: {exc}") from None
        object.__setattr__(self, "model", self.model or self.spec.name or "transformer")
        self._check_layout()
        self._check_measures()

    @property
    def _who(self) -> str:
        return f"PublishedRun {self.name!r}" if self.name else "PublishedRun"

    def _int(self, key: str) -> int:
        try:
            return check_int(key, getattr(self, key), minimum=1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self._who}: {exc}") from None

    def _check_layout(self) -> None:
        spec, tp, fail = self.spec, self.tp, self._fail
        sizes = {"heads": spec.heads, "kv_heads": spec.kv_heads_, "ffn": spec.ffn_}  # analytic.tp_divides(spec)
        for field, size in sizes.items():
            if size % tp:
                fail(f"tp={tp} does not divide {field}={size}: tensor parallelism splits them among the tp ranks")
        if self.gpus_per_node % tp:
            fail(f"tp={tp} does not divide gpus_per_node={self.gpus_per_node}: a tensor-parallel group is in one node")
        if self.sequence_parallel and spec.seq_len % tp:
            fail(f"sequence_parallel with tp={tp} needs tp to divide seq_len={spec.seq_len}")
        stages = self.pp * self.v
        if spec.layers < stages:
            fail(f"pp·v={self.pp}·{self.v}={stages} stages exceed layers={spec.layers}: each holds a block at least")
        if self.stage_layers is not None:
            try:
                cut = tuple(check_int(f"stage_layers[{i}]", n, minimum=1) for i, n in enumerate(self.stage_layers))
            except (TypeError, ValueError) as exc:
                fail(f"stage_layers: {exc}")
            if len(cut) != stages or sum(cut) != spec.layers:
                fail(
                    f"stage_layers={list(cut)} must give pp·v={stages} stages summing to layers={spec.layers}; "
                    f"got {len(cut)} summing to {sum(cut)}"
                )
            object.__setattr__(self, "stage_layers", cut)
        if self.v > 1 and self.schedule not in MULTI_CHUNK_SCHEDULES:
            fail(f"v={self.v} needs a multi-chunk schedule ({list(MULTI_CHUNK_SCHEDULES)}); got {self.schedule!r}")
        product = tp * self.pp * self.dp * self.fsdp
        if self.gpus != product:
            fail(f"gpus={self.gpus} is not tp·pp·dp·fsdp={tp}·{self.pp}·{self.dp}·{self.fsdp}={product}")
        replicas = self.micro_batch * self.dp * self.fsdp
        if self.global_batch % replicas:
            fail(
                f"global_batch={self.global_batch} is not a multiple of micro_batch·dp·fsdp={self.micro_batch}·"
                f"{self.dp}·{self.fsdp}={replicas}: each replica runs whole micro-batches"
            )

    def _check_measures(self) -> None:
        given = [key for key in MEASURES if getattr(self, key) is not None]
        if len(given) > 1:
            self._fail(f"give one measurement of {list(MEASURES)}; got {given}")
        for key in given:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                self._fail(f"{key} must be a finite number > 0; got {value!r}")

    def _fail(self, message: str) -> None:
        raise ValueError(f"{self._who}: {message}")

    # -- what it is -----------------------------------------------------------------------------------------------
    @property
    def m(self) -> int:
        """Micro-batches each pipeline runs per iteration: ``global_batch / (micro_batch · dp · fsdp)``."""
        return self.global_batch // (self.micro_batch * self.dp * self.fsdp)

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Blocks per pipeline stage, in order: ``stage_layers``, or :func:`even_cut` of the layers."""
        return self.stage_layers or even_cut(self.spec.layers, self.pp * self.v)

    @property
    def tokens(self) -> int:
        """Tokens per iteration: ``global_batch · seq_len``."""
        return self.global_batch * self.spec.seq_len

    @property
    def layout(self) -> str:
        """``tp8×pp4(v3)×dp32`` (the degrees above 1, FSDP's too; ``single GPU`` for none)."""
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "dp", "fsdp") if getattr(self, k) > 1]
        if self.v > 1:
            parts = [p + f"(v{self.v})" if p.startswith("pp") else p for p in parts]
        return "×".join(parts) or "single GPU"

    @property
    def topology(self) -> Topology:
        """Nodes of ``gpus_per_node`` of the run's GPUs (:meth:`Hardware.topology`)."""
        return self.hardware.topology(self.gpus_per_node)

    @property
    def measured_s(self) -> float | None:
        """The measured iteration in seconds (None without a measurement): ``iteration_s``; or the FLOPs of an
        iteration (:func:`~pipeswift_lab.transformer_flops` with the run's recomputation) over ``tflops_per_gpu ·
        gpus``; or ``tokens`` over ``tokens_per_s_per_gpu · gpus``."""
        if self.iteration_s is not None:
            return float(self.iteration_s)
        if self.tflops_per_gpu is not None:
            flops = transformer_flops(self.spec, self.tokens, recompute=self.recompute)
            return flops / (self.tflops_per_gpu * 1e12 * self.gpus)
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens / (self.tokens_per_s_per_gpu * self.gpus)
        return None

    @property
    def gpu_s_per_token(self) -> float | None:
        """Measured GPU-seconds per token (``measured_s · gpus / tokens``): what ranks layouts across GPU counts."""
        seconds = self.measured_s
        return None if seconds is None else seconds * self.gpus / self.tokens


def even_cut(layers: int, stages: int) -> tuple[int, ...]:
    """``layers`` blocks over ``stages`` pipeline stages as evenly as they go, the first and the last stage (which also
    hold the embedding and the head) given one fewer first, then the second and the second-to-last, and so on: Llama
    3's 405B, 126 layers on 16 stages, is cut 7, 8 × 14, 7 (Dubey et al. 2024, §3.3.2). Returns a tuple of counts."""
    layers, stages = check_int("layers", layers, minimum=1), check_int("stages", stages, minimum=1)
    if stages > layers:
        raise ValueError(f"{stages} stages exceed {layers} layers: each stage holds a block at least")
    most = -(-layers // stages)
    counts = [most] * stages
    for i in range(most * stages - layers):
        counts[i // 2 if i % 2 == 0 else stages - 1 - i // 2] -= 1
    return tuple(counts)


# --------------------------------------------------------------------------- the shipped runs
def load_published(df: pd.DataFrame | None = None) -> list[PublishedRun]:
    """The rows of ``df`` (default :func:`pipeswift_lab.data.published_runs`, its columns) as
    :class:`PublishedRun` values, in order. A row whose configuration does not fit its spec raises ``ValueError``
    naming it. Returns a list."""
    from ..data.published import published_runs

    table = published_runs() if df is None else df
    return [_run_of(row) for _, row in table.iterrows()]


def _run_of(row: pd.Series) -> PublishedRun:
    """The :class:`PublishedRun` of one row of :func:`pipeswift_lab.data.published_runs`."""

    def optional(key: str) -> Any:
        value = row.get(key)
        return None if value is None or pd.isna(value) else value

    name = str(row["name"])
    try:
        spec = TransformerSpec(
            int(row["layers"]),
            int(row["hidden"]),
            int(row["heads"]),
            int(row["seq_len"]),
            int(row["vocab"]),
            ffn=None if optional("ffn") is None else int(row["ffn"]),
            kv_heads=None if optional("kv_heads") is None else int(row["kv_heads"]),
            **{k: bool(row[k]) for k in ("gated_mlp", "bias", "rms_norm", "learned_positions", "tied")},
            name=str(row["model"]),
        )
        unit = check_choice("unit", str(row["unit"]), ("tflops_per_gpu", "tokens_per_s_per_gpu", "iteration_s"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"published run {name!r}: {exc}") from None
    ints = {k: int(row[k]) for k in ("gpus", "tp", "pp", "dp", "fsdp", "micro_batch", "global_batch", "v")}
    cut = optional("stage_layers")
    stage_layers = None if cut is None else tuple(int(n) for n in str(cut).split())
    measured: dict[str, Any] = {unit: float(row["measured"])}
    return PublishedRun(
        spec,
        _hardware_of(row),
        **ints,
        schedule=str(row["schedule"]),
        stage_layers=stage_layers,
        recompute=optional("recompute") or None,
        sequence_parallel=bool(row["sequence_parallel"]),
        attention=str(row["attention"]),
        dropout=bool(row["dropout"]),
        overlap_grad_sync=bool(row["overlap_grad_sync"]),
        **measured,
        name=name,
        model=str(row["model"]),
        source=str(row["source"]),
    )


def _hardware_of(row: pd.Series) -> Hardware:
    """The row's device, its HBM capacity and bandwidth replaced where the row gives them (cited to the row)."""
    name = str(row["hardware"])
    if name not in DEVICES:
        raise ValueError(f"published run {row['name']!r}: hardware={name!r} is not one of {sorted(DEVICES)}")
    base = DEVICES[name]
    changes: dict[str, Any] = {
        k: float(row[k]) for k in ("hbm_bytes", "hbm_bandwidth") if k in row and not pd.isna(row[k])
    }
    if not changes:
        return base
    size, rate = changes.get("hbm_bytes", base.hbm_bytes), changes.get("hbm_bandwidth", base.hbm_bandwidth)
    label = f"{name} ({(size or 0) / 1e9:g} GB at {(rate or 0) / 1e12:g} TB/s)"
    sources = {**base.sources, **{k: f"the run's source: {row['source']}" for k in changes}}
    return dataclasses.replace(base, name=label, sources=sources, **changes)


# --------------------------------------------------------------------------- predicting one
def layout_profile(run: PublishedRun, profile: Profile | None = None) -> Profile:
    """The per-layer profile one rank of ``run`` computes: ``profile`` (default: the run's
    :func:`~pipeswift_lab.analytic_profile`) under its tensor parallelism
    (:func:`~pipeswift_lab.profiling.tp_rank.tp_table`) and recomputation
    (every layer, as ``plan(..., recompute=...)`` forces it). Returns a Profile."""
    if profile is None:
        profile = analytic_profile(
            run.spec, run.hardware, run.micro_batch, attention=run.attention, dropout=run.dropout, precision=PRECISION
        )
    table = tp_table(profile.df, run.tp, run.topology.intra_node, run.sequence_parallel)
    return recomputed(Profile(table, dict(profile.meta)), run.recompute)


def _partition(run: PublishedRun, prof: Profile) -> Partition:
    """The run's cut (:attr:`PublishedRun.stage_blocks`: Megatron-LM's and torchtitan's ``layers / (pp · v)`` blocks
    a stage where that divides), the embedding on the first stage, the head on the last."""
    n, ends, at = len(prof.df), [], 1
    for blocks in run.stage_blocks:
        at += blocks
        ends.append(at)
    ends[-1] = n
    bounds = list(zip([0, *ends[:-1]], ends))
    return Partition.from_bounds(
        prof, bounds, v=run.v, schedule=run.schedule, m=run.m, precision=PRECISION, D=run.dp * run.fsdp
    )


def predict_iteration(
    run: PublishedRun, *, calibration: SimulatorCalibration | None = None, profile: Profile | None = None
) -> dict[str, float]:
    """``run``'s iteration, priced as the module docs say, calibrated with ``calibration`` (None: the analytic
    profile as it is); ``profile``: the run's analytic profile if already made. Returns ``{"pipeline_ms",
    "dp_ms", "fsdp_ms", "exposed_sync_ms", "optimizer_ms", "iteration_ms"}`` (``exposed_sync_ms``: what of the
    gradient reduction is not overlapped)."""
    if not isinstance(run, PublishedRun):
        raise TypeError(f"run must be a PublishedRun; got {type(run).__name__}")
    calibration = check_calibration(calibration)
    part = _partition(run, layout_profile(run, profile))
    topo, mesh = run.topology, {"P": run.pp, "D": run.dp, "fsdp": run.fsdp, "tp": run.tp}
    link = topo.link_of("pp", **mesh) if run.pp > 1 else None
    pipeline = simulate_step_ms(part, run.m, run.schedule, v=run.v, link=link, calibration=calibration)
    if calibration is not None:
        pipeline += calibration.step_overhead_ms(run.schedule)
    ranks = np.asarray(part.stage_to_rank)
    params = float(np.bincount(ranks, weights=part.stage_params, minlength=run.pp).max())
    param_bytes = float(np.bincount(ranks, weights=part.stage_param_bytes, minlength=run.pp).max())
    grads, weights = params * grad_bytes_per_param(PRECISION), params * PRECISIONS[PRECISION].weight_bytes
    dp_link = topo.link_of("dp", **mesh)
    if run.fsdp == 1:
        fsdp_ms, dp_ms = 0.0, allreduce_ms(grads, run.dp, dp_link.bandwidth_GBps, dp_link.latency_ms)
    else:
        shard_link = topo.link_of("fsdp", **mesh)
        fsdp_ms = all_gather_ms(weights, run.fsdp, shard_link) + reduce_scatter_ms(grads, run.fsdp, shard_link)
        dp_ms = all_reduce_ms(grads / run.fsdp, run.dp, dp_link)
    exposed = dp_ms + fsdp_ms
    if run.overlap_grad_sync:  # hidden behind the busiest rank's last micro-batch (its forward too under FSDP)
        per_stage = np.asarray(part.stage_bwd_ms) + (np.asarray(part.stage_fwd_ms) if run.fsdp > 1 else 0.0)
        scale = calibration.scale(run.pp) if calibration is not None else 1.0
        window = scale * float(np.bincount(ranks, weights=per_stage, minlength=run.pp).max())
        first_and_last = fsdp_ms * run.pp * run.v / run.spec.layers  # one block's gathering and reduction
        exposed = first_and_last + max(0.0, exposed - first_and_last - window)
    bandwidth = run.hardware.hbm_bandwidth * run.hardware.bandwidth_efficiency  # type: ignore[operator]
    optimizer = OPTIMIZER_TRAFFIC_FACTOR * param_bytes / run.fsdp / bandwidth * 1e3
    return {
        "pipeline_ms": pipeline,
        "dp_ms": dp_ms,
        "fsdp_ms": fsdp_ms,
        "exposed_sync_ms": exposed,
        "optimizer_ms": optimizer,
        "iteration_ms": pipeline + exposed + optimizer,
    }
