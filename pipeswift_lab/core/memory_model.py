"""The peak memory of each pipeline rank, replayed action by action in the order torch runs them.

A rank holds, for the whole step, its stages' weights, their optimizer state and the
schedule's receive buffers; the rest comes and goes with the actions of
:func:`~pipeswift_lab.core.schedule_orders.compute_orders`:

* a forward ``F`` of a micro-batch adds the activations its stage keeps until that
  micro-batch's backward: what its layers allocate and the forward still holds at its end
  (saved tensors, each storage once), what it sends that the forward would have freed (torch's
  stage keeps its outputs for the backward) and on the last stage what the loss keeps;
* a backward ``B`` (or the weight-gradient half ``W`` of a zero-bubble schedule, whose
  input-gradient half ``I`` leaves the graph alive, and with recomputation what ``I`` computed
  again) frees them; while it runs it allocates
  its transients (gradients of activations, the weight gradient of a micro-batch before it is
  added to ``.grad``, on the last stage the loss's backward); the stage's ``.grad`` tensors
  grow during its first backward of the step (its weight gradients become them) and stay
  until ``zero_grad(set_to_none=True)`` after the optimizer step; on the last stage the loss
  tensor of every micro-batch lives until the schedule's step ends, and with it what the loss
  retains after its backward (MSE keeps a tensor of its input's size); torch drops the gradient
  of a receive buffer once its send is queued (``stage_backward`` sets ``.grad = None``, torch 2.13);
* a tensor sent to another rank lives until torch waits on its send (:data:`SEND_WAITS`): the
  multi-stage runtime (``Interleaved1F1B`` and every schedule after it in the vocabulary) waits
  on every send at the end of the step, so each output it sent outlives its backward and each
  input gradient its own; ``GPipe`` waits on its backward sends after the last backward;
  ``1F1B`` on each send before the next;
* for the whole step: the receive buffers torch allocates per micro-batch (activations from the
  stage before, gradients from the stage after) and the step's batch (the first stage's
  inputs, the last stage's targets); with data-parallel replicas, DDP's gradient buckets (a
  copy of the gradients) for the whole run;
* the optimizer step, after every backward, holds the weights, gradients and state and
  allocates its own temporaries (:class:`OptimizerMemory`).

The peak is the most over those moments, and every term is reported as it stood there, so a
reader sees which one dominates. Stage pipelines pay this unevenly: 1F1B keeps ``P - r``
micro-batches on rank ``r`` and GPipe all ``m`` (Narayanan et al., *Memory-Efficient
Pipeline-Parallel DNN Training*, ICML 2021; Qi et al., *Zero Bubble Pipeline Parallelism*,
ICLR 2024, for the I/W split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MEMORY_TERMS",
    "SEND_WAITS",
    "send_wait",
    "OptimizerMemory",
    "StageBytes",
    "default_optimizer_memory",
    "rank_peak",
]

#: The terms of a rank's peak, in the order they are shown.
MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "buffers", "transient")

#: When torch waits on a schedule's sends, which keep what they send alive until then: ``"step"`` (every send at the
#: end of the step: ``_PipelineScheduleRuntime``), ``"backwards"`` (the backward sends after the last backward:
#: ``ScheduleGPipe``; its forward outputs live until their backwards anyway), ``"next"`` (each before the next:
#: ``Schedule1F1B``).
SEND_WAITS = ("step", "backwards", "next")


def send_wait(schedule: Any) -> str:
    """When torch's ``schedule`` waits on its sends (one of :data:`SEND_WAITS`); a
    :class:`~pipeswift_lab.core.schedule.Schedule` runs on ``_PipelineScheduleRuntime``, which waits at the step's
    end."""
    from .vocabulary import canonical_schedule

    name = canonical_schedule(schedule)
    return "backwards" if name == "GPipe" else "next" if name == "1F1B" else "step"


@dataclass(frozen=True, kw_only=True)
class OptimizerMemory:
    """What an optimizer keeps and allocates per parameter byte (fp32 parameters: per 4 bytes of parameter)."""

    states: float
    """Bytes of state per byte of parameter (Adam: 2, SGD with momentum: 1, plain SGD: 0)."""
    per_largest: float = 0.0
    """Temporaries of the step, in bytes per byte of the largest parameter tensor: an optimizer that updates one
    tensor at a time (torch's single-tensor Adam allocates ``sqrt`` and a quotient: 2)."""
    per_total: float = 0.0
    """Temporaries of the step, in bytes per byte of all the parameters: an optimizer that updates them all at once
    (torch's ``foreach`` Adam allocates one ``sqrt`` of every state: 1)."""
    name: str = ""
    """What it is, e.g. ``"Adam (single-tensor)"``."""

    def transient(self, largest: float, total: float) -> float:
        """Bytes of temporaries of one step over parameters whose largest tensor has ``largest`` bytes and all
        ``total``."""
        return self.per_largest * largest + self.per_total * total


def default_optimizer_memory(optimizer: str, device_type: str = "cpu") -> OptimizerMemory:
    """The memory of torch's implementation of ``optimizer`` (a name of
    :data:`~pipeswift_lab.core.precision.OPTIMIZER_STATES`) by default on ``device_type``: one tensor at a time on
    CPU, ``foreach`` on CUDA. Returns an :class:`OptimizerMemory`."""
    from .precision import OPTIMIZER_STATES, check_optimizer

    states = float(OPTIMIZER_STATES[check_optimizer(optimizer)])
    if optimizer in ("adam", "adamw"):
        name = optimizer.replace("adamw", "AdamW").replace("adam", "Adam")
        if device_type == "cuda":
            return OptimizerMemory(states=states, per_total=1.0, name=f"{name} (foreach)")
        # two temporaries of the tensor being updated, and the previous one's quotient still alive in the loop, as
        # pipeswift_lab.runner.optimizer_memory measures it (a = 5/3, b = 1/3)
        return OptimizerMemory(states=states, per_largest=5 / 3, per_total=1 / 3, name=f"{name} (single-tensor)")
    return OptimizerMemory(states=states, name="SGD with momentum" if states else "SGD")


@dataclass(frozen=True, kw_only=True)
class StageBytes:
    """What one stage holds and allocates, in bytes, at the run's micro-batch size."""

    weights: float
    """Its parameters (and buffers)."""
    grads: float
    """Its parameters' gradients, from its first backward of the step until the optimizer has stepped."""
    optimizer: float
    """Its optimizer state (master weights included)."""
    activations: float
    """Kept per micro-batch from its forward to its backward: the layers' saved tensors, its output, the loss's."""
    transient: float
    """The most a backward of one micro-batch allocates beyond what it frees (largest over its layers, and the
    loss's on the last stage)."""
    first_transient: float = -1.0
    """The same for the stage's first backward of a step, whose weight gradients become the ``.grad`` tensors as
    it goes (so they count here, not in ``grads``, until it ends) rather than temporaries added to them; negative:
    ``transient`` with the whole ``grads`` present."""
    recv: float = 0.0
    """One micro-batch's input, received from the previous stage (0 on the first stage)."""
    grad_recv: float = 0.0
    """One micro-batch's output gradient, received from the next stage (0 on the last stage)."""
    retained: float = 0.0
    """What a backward of one micro-batch leaves allocated until the step ends (on the last stage what the loss
    retains while its loss tensor lives)."""
    batch: float = 0.0
    """One micro-batch of the step's batch this stage is fed: the inputs on the first stage, the targets on the
    last."""
    sent_output: float = 0.0
    """One micro-batch's output sent to a stage on another rank (0 when the next stage is on this rank, or none)."""
    sent_grad: float = 0.0
    """One micro-batch's input gradient sent to a stage on another rank (0 when the stage before is on this rank, or
    none)."""
    weight_pass_held: float = 0.0
    """What an input-gradient pass (``I``) of one micro-batch holds until its weight-gradient pass (``W``) has run,
    beyond the forward's activations: the gradients torch's ``stage_backward_input`` keeps for ``W`` to start from
    (the profile's ``weight_pass_bytes``, with what ``I`` recomputed of checkpointed layers that ``W`` reads), 0 on
    the first stage, which has no ``I``: its ``W`` runs the whole backward. During the ``W`` they count in its
    ``transient``, which holds a backward's gradients."""
    input_transient: float = -1.0
    """The most an input-gradient pass (``I``) of one micro-batch allocates: it frees none of the forward's saved
    tensors (its graph is kept for ``W``), and each layer adds the gradients it keeps for ``W`` as the pass goes
    back through the stage; negative: ``transient``."""
    buckets: float = 0.0
    """Gradient buckets kept for the whole run: DDP's copy of the gradients it all-reduces (``D > 1``)."""
    largest_param: float = 0.0
    """Its largest parameter tensor (what a one-tensor-at-a-time optimizer allocates temporaries of)."""


def rank_peak(
    stages: Mapping[int, StageBytes],
    order: Sequence[tuple[str, int, int]],
    m: int,
    optimizer: OptimizerMemory,
    sends: str = "next",
) -> dict[str, float | str]:
    """Replay one rank's ``order`` (``(kind, stage, microbatch)`` actions, as
    :func:`~pipeswift_lab.core.schedule_orders.compute_orders` gives them) over its ``stages`` and return its peak;
    ``sends`` says when the schedule waits on its sends (:data:`SEND_WAITS`, :func:`send_wait`).

    Returns a dict: ``peak_bytes``, each of :data:`MEMORY_TERMS` as ``{term}_bytes`` at the peak, ``peak_at``
    (the action, e.g. ``"B stage 1 mb 0"``, or ``"optimizer step"``), and each term as it stands when the rank's
    first backward starts, ``{term}_before_backward_bytes`` (a moment without a backward's frees and transients).
    """
    if sends not in SEND_WAITS:
        raise ValueError(f"sends={sends!r} is not one of {list(SEND_WAITS)}")
    replay = _Replay.start(stages, m, sends)
    for kind, s, mb in order:
        if kind == "F":
            replay.forward(s, mb)
        else:
            replay.note_before_backward()
            replay.backward(kind, s, mb)
    replay.end_step()
    replay.optimizer_step(optimizer)
    return replay.result()


class _Peak:
    """The most a rank has held over the moments offered so far: each term there, their total and where."""

    def __init__(self) -> None:
        self.best: dict[str, float | str] = {"peak_bytes": -1.0}

    def offer(self, where: str, terms: dict[str, float]) -> None:
        """Keep the moment ``where`` if the total of its ``terms`` is above the most so far (so the earliest of tied
        moments stays)."""
        total = sum(terms.values())
        if total > float(self.best["peak_bytes"]):
            self.best = {**terms, "peak_bytes": total, "peak_at": where}

    def moment(self, terms: dict[str, float]) -> dict[str, float]:
        """``terms`` as floats, as a peak taken over their moment alone keeps them: where their total is not above
        -1 (negative or NaN bytes), the terms of the peak so far instead (none before a moment has been kept)."""
        kept = terms if sum(terms.values()) > -1.0 else self.best
        return {k: float(v) for k, v in kept.items() if k.endswith("_bytes") and k != "peak_bytes"}


@dataclass(kw_only=True)
class _Replay:
    """One rank's memory as :func:`rank_peak` replays its actions: what it holds for the whole step, what comes and
    goes with the actions, and the most it has held so far."""

    stages: Mapping[int, StageBytes]
    sends: str
    """When the schedule waits on its sends (:data:`SEND_WAITS`)."""
    weights: float
    state: float
    """The stages' optimizer state."""
    buffers: float
    """The step's receive buffers and batch, and the run's gradient buckets."""
    held: dict[tuple[int, int], float] = field(default_factory=dict)
    """The activations a forward of ``(stage, micro-batch)`` keeps until its backward."""
    graded: set[int] = field(default_factory=set)
    """The stages whose ``.grad`` tensors exist: their first ``B`` or ``W`` of the step has run."""
    again: dict[tuple[int, int], float] = field(default_factory=dict)
    """What an ``I`` of ``(stage, micro-batch)`` holds until its ``W`` (recomputed activations, the gradients ``W``
    starts from)."""
    retained: float = 0.0
    """What the step's backwards leave until it ends: the loss tensors' retained, the outputs sent."""
    sent_grads: float = 0.0
    """The input gradients sent and not yet waited on."""
    last_sent: dict[int, float] = field(default_factory=dict)
    """With ``sends="next"``: each stage's last input gradient sent."""
    peak: _Peak = field(default_factory=_Peak)
    before_backward: dict[str, float] = field(default_factory=dict)
    """Each term as it stood when the rank's first backward started."""

    @classmethod
    def start(cls, stages: Mapping[int, StageBytes], m: int, sends: str) -> _Replay:
        """The rank before its first action of a step of ``m`` micro-batches. Returns a :class:`_Replay`."""
        return cls(
            stages=stages,
            sends=sends,
            weights=sum(s.weights for s in stages.values()),
            state=sum(s.optimizer for s in stages.values()),
            buffers=m * sum(s.recv + s.grad_recv + s.batch for s in stages.values())
            + sum(s.buckets for s in stages.values()),
        )

    def terms(self, transient: float) -> dict[str, float]:
        """Each of :data:`MEMORY_TERMS` as ``{term}_bytes``, as the rank holds them now, with ``transient``."""
        return {
            "weights_bytes": self.weights,
            "grads_bytes": sum(self.stages[s].grads for s in self.graded),
            "optimizer_bytes": self.state,
            "activations_bytes": sum(self.held.values()) + sum(self.again.values()) + self.retained,
            "buffers_bytes": self.buffers + self.sent_grads,
            "transient_bytes": transient,
        }

    def consider(self, where: str, transient: float) -> None:
        """Offer the moment ``where``, with its ``transient``, as the peak."""
        self.peak.offer(where, self.terms(transient))

    def forward(self, s: int, mb: int) -> None:
        """Replay a forward of micro-batch ``mb`` on stage ``s``: it keeps its activations."""
        self.held[(s, mb)] = self.stages[s].activations
        self.consider(f"F stage {s} mb {mb}", 0.0)

    def note_before_backward(self) -> None:
        """Keep each term as it stands at the first backward, before it runs (a moment without a backward's frees and
        transients); later calls keep the first."""
        if not self.before_backward:
            self.before_backward = self.peak.moment(self.terms(0.0))

    def backward(self, kind: str, s: int, mb: int) -> None:
        """Replay a ``B``, ``I`` or ``W`` of micro-batch ``mb`` on stage ``s``: the moment it runs, then what it frees
        and what it leaves behind."""
        stage = self.stages[s]
        if kind == "W":  # what its I kept is what its transient computes the weight gradients from
            self.again.pop((s, mb), None)
        self._run_backward(kind, s, mb)
        if kind in ("B", "I"):
            self._send_input_grad(s)
        if kind == "I" and stage.weight_pass_held:
            self.again[(s, mb)] = stage.weight_pass_held
        if kind in ("B", "W"):
            self._free(s, mb)

    def _run_backward(self, kind: str, s: int, mb: int) -> None:
        """Offer the moment a backward runs, with its transient. A stage's first ``B`` or ``W`` of the step makes its
        ``.grad`` tensors: they count in ``grads`` from its start, or in its ``first_transient`` while they grow where
        the stage gives one (not negative)."""
        stage = self.stages[s]
        first = kind in ("B", "W") and s not in self.graded
        growing = first and stage.first_transient >= 0
        if first and not growing:
            self.graded.add(s)
        transient = stage.first_transient if growing else stage.transient
        if kind == "I" and stage.input_transient >= 0:
            transient = stage.input_transient
        self.consider(f"{kind} stage {s} mb {mb}", transient)
        if first:
            self.graded.add(s)

    def _send_input_grad(self, s: int) -> None:
        """After a ``B`` or ``I``: keep what the loss retains until the step ends, and the input gradient sent until
        torch waits on it."""
        stage = self.stages[s]
        self.retained += stage.retained
        if self.sends == "next":  # the last gradient sent lives until the stage's next send
            self.last_sent[s] = stage.sent_grad
            self.sent_grads = sum(self.last_sent.values())
        else:
            self.sent_grads += stage.sent_grad

    def _free(self, s: int, mb: int) -> None:
        """After a ``B`` or ``W``: drop the micro-batch's activations (its output sent stays until the step ends where
        torch waits on sends then)."""
        self.held.pop((s, mb), None)
        self.again.pop((s, mb), None)
        self.retained += self.stages[s].sent_output if self.sends == "step" else 0.0

    def end_step(self) -> None:
        """The schedule's step has returned: its sends are waited on, its losses dropped, every stage has ``.grad``."""
        self.graded.update(self.stages)
        self.retained = self.sent_grads = 0.0

    def optimizer_step(self, optimizer: OptimizerMemory) -> None:
        """Offer the optimizer's step, with its temporaries, as the peak."""
        largest = max((s.largest_param for s in self.stages.values()), default=0.0)
        self.consider("optimizer step", optimizer.transient(largest, self.weights))

    def result(self) -> dict[str, float | str]:
        """What :func:`rank_peak` returns: the peak, its terms and moment, then each term before the first backward."""
        before = {f"{k.removesuffix('_bytes')}_before_backward_bytes": v for k, v in self.before_backward.items()}
        return {**self.peak.best, **before}
