"""What an exporter writes and what a reader reads: one training configuration in framework-neutral terms.

:class:`ExportTarget` is a planned configuration with everything a framework's configuration needs (the split as
layer names, the model's shape, the sequence length); :class:`ImportedConfig` is a framework's configuration read
back, with the fields of a :class:`~pipeswift_lab.PlannedConfig` that a plan prices (:meth:`Plan.price
<pipeswift_lab.planning.result.Plan.price>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.display import html_card
from ..core.schedule import Schedule
from ..core.transformer_spec import TransformerSpec

__all__ = ["FRAMEWORKS", "ExportTarget", "ExportWarning", "ImportedConfig", "check_framework"]

#: The frameworks a plan is exported to and read from.
FRAMEWORKS = ("torchtitan", "torchtitan-toml", "megatron", "deepspeed")


class ExportWarning(UserWarning):
    """A plan's configuration was exported as the nearest one the framework can express; the message names what
    changed and what that configuration is predicted to cost, and ``nearest`` is it priced (a ``PlannedConfig``)."""

    def __init__(self, message: str, nearest: Any = None) -> None:
        super().__init__(message)
        self.nearest = nearest


def check_framework(framework: object) -> str:
    """``framework`` as one of :data:`FRAMEWORKS` (case and ``-``/``_`` ignored); ``ValueError`` naming them."""
    name = str(framework).lower().replace("_", "-") if isinstance(framework, str) else None
    aliases = {"megatron-lm": "megatron", "megatron-core": "megatron", "titan": "torchtitan"}
    name = aliases.get(name, name) if name is not None else None
    if name not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r} is not one the toolkit exports to; give one of {list(FRAMEWORKS)}")
    return name


@dataclass(frozen=True)
class ExportTarget:
    """One configuration to write in a framework's terms.

    ``bounds`` are the ``P * v`` stages in global order (stage ``s`` on rank ``s % P`` for a looped schedule, as the
    plan's schedule places them), ``layer_names`` the profile's layers, ``recompute`` ``{stage: "full" |
    "selective"}``, ``spec`` the model's shape (None where unknown: the framework's model flags are left out)."""

    P: int
    v: int
    D: int
    fsdp: int
    tp: int
    m: int
    microbatch_size: int
    schedule: str | Schedule
    bounds: tuple[tuple[int, int], ...]
    layer_names: tuple[str, ...]
    recompute: dict[int, str] = field(default_factory=dict)
    precision: str | None = None
    sequence_parallel: bool = False
    spec: TransformerSpec | None = None
    model_type: str = ""
    seq_len: int | None = None
    steps: int = 1
    label: str = ""
    layer_params: tuple[float, ...] = ()
    """Each layer's parameter bytes (what DeepSpeed's ``partition_method="parameters"`` balances)."""
    layer_types: tuple[str, ...] = ()
    """Each layer's module class (what DeepSpeed's ``partition_method="type:..."`` matches)."""
    planned_bounds: tuple[tuple[int, int], ...] = ()
    """The plan's own split where a framework's nearest configuration splits otherwise (``()``: ``bounds``)."""
    split_method: str = ""
    """How the framework splits by itself to give ``bounds`` (DeepSpeed's ``partition_method``; ``""``: by name)."""

    @property
    def world(self) -> int:
        """Processes the configuration runs on: ``P * D * fsdp * tp``."""
        return self.P * self.D * self.fsdp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that hold the same weights' gradients: replicas times FSDP shards."""
        return self.D * self.fsdp

    @property
    def global_batch(self) -> int:
        """Samples per step: ``m * microbatch_size * D * fsdp``."""
        return self.m * self.microbatch_size * self.data_parallel

    @property
    def schedule_name(self) -> str:
        """The schedule's name (a :class:`Schedule`'s own, ``"custom"`` where it has none)."""
        return self.schedule if isinstance(self.schedule, str) else (self.schedule.name or "custom")

    @property
    def bf16(self) -> bool:
        """Whether the configuration trains in bf16 (a ``bf16-mixed`` precision)."""
        return bool(self.precision) and str(self.precision).startswith("bf16")


@dataclass(frozen=True)
class ImportedConfig:
    """A framework's configuration read back (:func:`pipeswift_lab.frameworks.read`), in the fields a
    :class:`~pipeswift_lab.PlannedConfig` has: ``P``, ``D`` (replicas), ``fsdp`` (shards of each), ``tp``, ``v``,
    ``m``, ``microbatch_size``, ``schedule``, ``recompute`` (``"0:full 1:full"``).

    The split is in the framework's names: ``stage_modules``, one tuple per stage in global order (torchtitan's
    module names, Megatron's layout letters one per item); ``()`` where the framework splits evenly by itself
    (:meth:`Plan.price <pipeswift_lab.planning.result.Plan.price>` then takes the even split). ``world`` is the
    processes it runs on, ``seq_len`` its sequence length, ``settings`` what else it set that the toolkit reads."""

    framework: str
    P: int
    D: int
    fsdp: int
    tp: int
    v: int
    m: int
    microbatch_size: int
    schedule: str | Schedule
    recompute: str = ""
    stage_modules: tuple[tuple[str, ...], ...] = ()
    precision: str | None = None
    seq_len: int | None = None
    settings: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("P", "D", "fsdp", "tp", "v", "m", "microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the {self.framework} configuration gives {name}={value!r}; it must be an int >= 1")
        if self.stage_modules and len(self.stage_modules) != self.P * self.v:
            raise ValueError(
                f"the {self.framework} configuration splits the model into {len(self.stage_modules)} stages, but "
                f"P={self.P} ranks of v={self.v} stages each hold {self.P * self.v}"
            )

    @property
    def gpus(self) -> int:
        """Processes: ``P * D * fsdp * tp``."""
        return self.P * self.D * self.fsdp * self.tp

    @property
    def global_batch(self) -> int:
        """Samples per step: ``m * microbatch_size * D * fsdp``."""
        return self.m * self.microbatch_size * self.D * self.fsdp

    @property
    def label(self) -> str:
        """A short name in the planner's style: ``torchtitan P4×D2 m16 b2 1F1B``."""
        v = f" v{self.v}" if self.v > 1 else ""
        schedule = self.schedule if isinstance(self.schedule, str) else (self.schedule.name or "custom")
        modes = {item.split(":")[1] for item in self.recompute.split()}
        every = len(self.recompute.split()) == self.P * self.v and len(modes) == 1
        recompute = f" recompute {modes.pop() if every else self.recompute}" if self.recompute else ""
        layout = f"P{self.P}×D{self.D}" + (f"×fsdp{self.fsdp}" if self.fsdp > 1 else "")
        layout += f"×tp{self.tp}" if self.tp > 1 else ""
        return f"{self.framework} {layout} m{self.m} b{self.microbatch_size} {schedule}{v}{recompute}"

    def _summary(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "layout": self.label,
            "GPUs": self.gpus,
            "global batch": self.global_batch,
            "stages": len(self.stage_modules) or "even (the framework's own)",
            "precision": self.precision or "-",
            "seq_len": self.seq_len or "-",
        }

    def _repr_html_(self) -> str:
        return html_card("ImportedConfig", self._summary())
