"""How a job's speed and its start-up costs change with the GPUs it gets.

A trace gives each job's run time on the GPUs it asked for; an elastic or preempted job
runs on other counts. :class:`ScalingModel` predicts, for every GPU count ``n``, the best
pipeline configuration of a profiled model (``P`` stages × ``D`` replicas) and from it:

* ``speed[n]`` — samples per ms at a fixed global batch: the 1F1B step of the slowest
  stage of the balanced :func:`~pipeswift_lab.partitioning.balance` (closed form,
  :func:`~pipeswift_lab.core.analytic.step_ms`) plus the ring all-reduce of its gradients over
  ``D`` replicas (:func:`~pipeswift_lab.core.costs.allreduce_ms`);
* ``assembly_s[n]`` — :class:`~pipeswift_lab.core.costs.AssemblyModel` of that ``(P, D)``;
* ``stall_s[n]``, ``save_s[n]``, ``restore_s[n]``, ``cleanup_s[n]`` —
  :class:`~pipeswift_lab.core.costs.CheckpointModel` of its largest stage shard (parameters
  plus Adam's two moments): what a periodic checkpoint stalls training (a staging copy when
  saves are asynchronous), a whole save the job waits for (before a resize), a restore, and
  the final save plus teardown.

:func:`profile_library` is the small library of synthetic profiles a job gets when it
names none, chosen by requested GPUs (:func:`default_profile`): GPT-2-shaped decoders
whose layer times come from their FLOPs (6·params·tokens per step, Kaplan et al. 2020)
at a stated effective GPU throughput, and whose stages must fit a 32 GB GPU
(:data:`MEMORY_PER_GPU_BYTES`: fp32 parameters, gradients, Adam state and the activations
in flight), so the largest model cannot run on one GPU. Any measured :class:`~pipeswift_lab.Profile` can
be given per job instead (``meta["global_batch"]`` and ``meta["batch_size"]`` are used
when present).
"""

from __future__ import annotations

import math

import pandas as pd

from ..core.analytic import step_ms
from ..core.costs import AssemblyModel, CheckpointModel, allreduce_ms
from ..core.precision import OPTIMIZER_STATES
from ..partitioning.balance import partition
from ..profiling.table import Profile

__all__ = [
    "DP_BANDWIDTH_GBps",
    "DP_LATENCY_MS",
    "LIBRARY_FLOPS_PER_MS",
    "MEMORY_PER_GPU_BYTES",
    "ScalingModel",
    "default_profile",
    "profile_library",
]

#: Effective training throughput of one GPU assumed by the library (bf16, ~40% of a
#: 125 TFLOP/s V100-class peak): 50 TFLOP/s.
LIBRARY_FLOPS_PER_MS = 50e12 / 1e3
#: Memory of one GPU (a 32 GB V100-class device): a configuration whose stages do not fit is not used.
MEMORY_PER_GPU_BYTES = 32e9
#: Gradient all-reduce link between replicas: 25 GB/s (a 200 Gb/s network), 10 µs latency.
DP_BANDWIDTH_GBps, DP_LATENCY_MS = 25.0, 0.01


def _decoder(name: str, blocks: int, hidden: int, seq: int, vocab: int, microbatch: int, global_batch: int) -> Profile:
    """A GPT-style decoder profile: embedding, ``blocks`` transformer blocks, LM head."""
    tokens = microbatch * seq
    block_params = 12 * hidden * hidden
    block_activation = 34 * seq * microbatch * hidden  # bytes saved for backward (Korthikanti et al. 2022, 16-bit)
    head_params = vocab * hidden
    # forward FLOPs per micro-batch: 2·params·tokens (+ attention scores 4·s·h per token); backward twice that
    block_fwd = (2 * block_params * tokens + 4 * seq * hidden * tokens) / LIBRARY_FLOPS_PER_MS
    head_fwd = 2 * head_params * tokens / LIBRARY_FLOPS_PER_MS
    embed_fwd = 0.05 * block_fwd  # a gather: memory-bound and small
    fwd = [embed_fwd] + [block_fwd] * blocks + [head_fwd]
    params = [head_params] + [block_params] * blocks + [head_params]
    names = ["wte"] + [f"h.{i}" for i in range(blocks)] + ["lm_head"]
    return Profile.synthetic(
        fwd_ms=fwd,
        bwd_ms=[2 * f for f in fwd],
        name=names,
        params=params,
        param_bytes=[4 * p for p in params],
        activation_bytes=[2 * tokens * hidden] + [block_activation] * blocks + [2 * tokens * vocab],
        output_bytes=2 * tokens * hidden,
        meta={"model": name, "batch_size": microbatch, "global_batch": global_batch, "seq": seq},
    )


def profile_library() -> dict[str, Profile]:
    """The library: ``{"gpt-small": Profile, "gpt-medium": Profile, "gpt-xl": Profile}``.

    GPT-2 small (12 blocks, h=768, 124M parameters; micro-batch 8 × 1,024 tokens, global
    batch 256), medium (24 blocks, h=1,024, 355M; 8, 512) and XL (48 blocks, h=1,600,
    1.5B; 4, 1,024), vocabulary 50,257, parameters in fp32. Built fresh on every call.
    """
    return {
        "gpt-small": _decoder("gpt-small", 12, 768, 1024, 50257, microbatch=8, global_batch=256),
        "gpt-medium": _decoder("gpt-medium", 24, 1024, 1024, 50257, microbatch=8, global_batch=512),
        "gpt-xl": _decoder("gpt-xl", 48, 1600, 1024, 50257, microbatch=4, global_batch=1024),
    }


def default_profile(gpus: int) -> str:
    """Library profile for a job that names none: ``gpt-small`` on 1 GPU, ``gpt-medium`` on 2–8, ``gpt-xl`` above."""
    return "gpt-small" if gpus <= 1 else "gpt-medium" if gpus <= 8 else "gpt-xl"


class ScalingModel:
    """Per-GPU-count speed and costs of one profiled model; tables grow on demand.

    ``speed``, ``P``, ``D``, ``assembly_s``, ``stall_s``, ``save_s``, ``restore_s`` and ``cleanup_s``
    are lists indexed by the GPU count (index 0 unused). A count with no valid
    configuration (more GPUs than ``layers × global_batch / micro-batch``) keeps the best
    smaller configuration, its extra GPUs idle: ``speed`` never decreases with ``n``.
    """

    def __init__(
        self,
        profile: Profile,
        assembly: AssemblyModel | None = None,
        checkpoint: CheckpointModel | None = None,
        memory_bytes: float = MEMORY_PER_GPU_BYTES,
    ) -> None:
        if not isinstance(profile, Profile):
            raise TypeError(
                f"profile must be a pipeswift_lab.Profile or a library name; got {type(profile).__name__} {profile!r}"
            )
        self.profile = profile
        self.assembly = assembly or AssemblyModel()
        self.checkpoint = checkpoint or CheckpointModel()
        self.memory_bytes = memory_bytes
        self.microbatch = int(profile.meta.get("batch_size") or 1)
        self.global_batch = int(profile.meta.get("global_batch") or self.microbatch * 64)
        self.n_layers = profile.n_layers
        # P -> (fwd_ms, bwd_ms, grad_bytes, shard_bytes) of the slowest stage of the balanced split (None: none fits)
        self._stage: dict[int, tuple[float, float, float, float] | None] = {}
        self.speed: list[float] = [0.0]
        self.P: list[int] = [0]
        self.D: list[int] = [0]
        self.assembly_s, self.save_s, self.restore_s, self.cleanup_s = [0.0], [0.0], [0.0], [0.0]
        self.stall_s: list[float] = [0.0]
        """Seconds a periodic checkpoint stalls training (``CheckpointModel.stall_s``), by GPU count."""

    @property
    def max_useful_gpus(self) -> int:
        """The most GPUs any configuration uses: ``layers × global_batch / micro-batch``."""
        return self.n_layers * max(1, self.global_batch // self.microbatch)

    def _stage_of(self, P: int) -> tuple[float, float, float, float] | None:
        if P not in self._stage:
            try:
                part = partition(self.profile, P, mem_per_gpu_bytes=self.memory_bytes)
            except ValueError:  # no split over P ranks fits one GPU's memory
                self._stage[P] = None
                return None
            slowest = max(range(P), key=lambda s: part.stage_ms[s])
            shard = max(part.stage_param_bytes) * (1.0 + OPTIMIZER_STATES["adam"])
            self._stage[P] = (
                part.stage_fwd_ms[slowest],
                part.stage_bwd_ms[slowest],
                max(part.stage_param_bytes),
                shard,
            )
        return self._stage[P]

    def step_ms(self, P: int, D: int) -> float:
        """Predicted step (ms) of ``P`` stages × ``D`` replicas at the global batch; ``inf`` if invalid."""
        if P > self.n_layers or D * self.microbatch > self.global_batch:
            return math.inf
        stage = self._stage_of(P)
        if stage is None:
            return math.inf
        m = math.ceil(self.global_batch / (D * self.microbatch))
        fwd, bwd, grad_bytes, _ = stage
        return step_ms(P, m, "1F1B", fwd_ms=fwd, bwd_ms=bwd) + allreduce_ms(
            grad_bytes, D, DP_BANDWIDTH_GBps, DP_LATENCY_MS
        )

    def ensure(self, n: int) -> None:
        """Fill the tables up to ``n`` GPUs."""
        for gpus in range(len(self.speed), n + 1):
            best = (math.inf, 0, 0)
            for P in range(1, min(gpus, self.n_layers) + 1):
                if gpus % P == 0:
                    best = min(best, (self.step_ms(P, gpus // P), P, gpus // P))
            step, P, D = best
            if not math.isfinite(step) or self.global_batch / step <= self.speed[-1]:
                if self.speed[-1] == 0.0:  # nothing fits yet: this count cannot run the job
                    self._append(0.0, 0, 0, math.nan)
                    continue
                step, P, D = self.global_batch / self.speed[-1], self.P[-1], self.D[-1]  # extra GPUs idle
            stage = self._stage_of(P)  # found: P fits, or it is the last count's, which fits
            self._append(self.global_batch / step, P, D, stage[3] if stage is not None else math.nan)

    @property
    def min_gpus(self) -> int:
        """The fewest GPUs whose stages fit in memory (0 if none up to the layers' count)."""
        self.ensure(self.n_layers)
        return next((n for n in range(1, len(self.speed)) if self.speed[n] > 0), 0)

    def _append(self, speed: float, P: int, D: int, shard: float) -> None:
        self.speed.append(speed)
        self.P.append(P)
        self.D.append(D)
        if P == 0:
            for table in (self.assembly_s, self.stall_s, self.save_s, self.restore_s, self.cleanup_s):
                table.append(math.nan)
            return
        self.assembly_s.append(self.assembly.seconds(P, D))
        self.stall_s.append(self.checkpoint.stall_s(shard))
        self.save_s.append(self.checkpoint.save_s(shard))
        self.restore_s.append(self.checkpoint.restore_s(shard))
        self.cleanup_s.append(self.checkpoint.cleanup_s(shard))

    def table(self, n: int) -> pd.DataFrame:
        """The tables up to ``n`` GPUs as a DataFrame (``gpus``, ``P``, ``D``, ``speed_samples_per_s``, costs)."""
        self.ensure(n)
        rows = slice(1, n + 1)
        return pd.DataFrame(
            {
                "gpus": range(1, n + 1),
                "P": self.P[rows],
                "D": self.D[rows],
                "speed_samples_per_s": [s * 1e3 for s in self.speed[rows]],
                "assembly_s": self.assembly_s[rows],
                "stall_s": self.stall_s[rows],
                "save_s": self.save_s[rows],
                "restore_s": self.restore_s[rows],
                "cleanup_s": self.cleanup_s[rows],
            }
        )
