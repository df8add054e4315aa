"""Megatron-LM: a configuration as its command-line arguments, and arguments read back.

The flags are megatron-core's (``megatron/training/arguments.py``, 0.17 and later): the sizes
``--tensor-model-parallel-size`` and ``--pipeline-model-parallel-size``, the split as
``--pipeline-model-parallel-layout`` (``|`` between stages, ``E`` the embedding, ``t`` a transformer layer, ``L`` the
loss; ``P * v`` stages, stage ``i`` on rank ``i % P``, so virtual stages need no flag of their own), the batch as
``--micro-batch-size`` and ``--global-batch-size`` (the data-parallel size is the world over ``tp * pp``),
recomputation as ``--recompute-granularity``/``--recompute-method``/``--recompute-num-layers``.

What Megatron cannot run: schedules other than 1F1B and interleaved 1F1B (core has no zero-bubble or V schedules),
different recomputation per stage, FSDP shards as the toolkit plans them (exported as data-parallel ranks with the
distributed optimizer). Its refusals, met here: under interleaving ``m`` a multiple of ``P``
(``forward_backward_pipelining_with_interleaving``), a layout whose layers are not ``--num-layers``.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence

from .names import decoder_parts, megatron_letters, stage_parts
from .nearest import common_nearest, merged, merged_recompute
from .target import ExportTarget, ImportedConfig

__all__ = ["even_stages", "expand_layout", "nearest", "read", "write"]

#: The schedules Megatron-LM core runs, by the toolkit's names.
SCHEDULES = ("1F1B", "Interleaved1F1B")


def nearest(target: ExportTarget) -> tuple[ExportTarget, list[str]]:
    """The nearest configuration Megatron-LM can run and what changed (``[]``: ``target`` itself)."""
    from dataclasses import replace

    changes: list[str] = []
    out = target
    if out.schedule_name not in SCHEDULES:
        interleave = out.v > 1 and out.m % out.P == 0 and out.P > 1
        schedule = "Interleaved1F1B" if interleave else "1F1B"
        if out.v > 1 and not interleave:
            out = replace(out, v=1, bounds=merged(out.bounds, out.P), recompute=merged_recompute(out))
        changes.append(
            f"schedule {target.schedule_name} -> {schedule} (Megatron-LM core runs 1F1B and interleaved 1F1B only)"
        )
        out = replace(out, schedule=schedule)
    out, more = common_nearest(out)
    return out, changes + more


def write(target: ExportTarget) -> list[str]:
    """Megatron-LM's arguments for ``target`` (one Megatron can run: :func:`nearest` first).

    Raises ``ValueError`` where Megatron refuses it: an interleaved schedule whose ``m`` is not a multiple of ``P``
    (or is below it), interleaving on one rank, a stage split Megatron's layout cannot name."""
    P, v, m = target.P, target.v, target.m
    if v > 1 and (P < 2 or m % P or m < P):
        raise ValueError(
            f"Megatron-LM interleaves only with P >= 2 and m a multiple of P (m={m}, P={P}): its interleaved schedule "
            "refuses the rest (forward_backward_pipelining_with_interleaving); take m a multiple of P, or v=1"
        )
    args: list[str] = []
    spec = target.spec
    if spec is not None:
        args += _model_args(target)
    args += ["--tensor-model-parallel-size", str(target.tp), "--pipeline-model-parallel-size", str(P)]
    if P * v > 1:
        letters = [megatron_letters(stage) for stage in stage_parts(target.layer_names, target.bounds)]
        args += ["--pipeline-model-parallel-layout", "|".join(letters)]
    args += ["--micro-batch-size", str(target.microbatch_size), "--global-batch-size", str(target.global_batch)]
    if target.sequence_parallel and target.tp > 1:
        args.append("--sequence-parallel")
    if target.precision and target.precision.endswith("zero1"):
        args.append("--use-distributed-optimizer")
    if target.bf16:
        args.append("--bf16")
    modes = set(target.recompute.values())
    if modes == {"full"}:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif modes == {"selective"}:
        args += ["--recompute-granularity", "selective"]
    args += ["--train-iters", str(target.steps)]
    return args


def _model_args(target: ExportTarget) -> list[str]:
    spec = target.spec
    assert spec is not None
    seq_len = target.seq_len or spec.seq_len
    args = ["--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden)]
    args += ["--num-attention-heads", str(spec.heads), "--ffn-hidden-size", str(spec.ffn_)]
    if spec.kv_heads_ != spec.heads:
        args += ["--group-query-attention", "--num-query-groups", str(spec.kv_heads_)]
    if spec.head_dim is not None and spec.head_dim * spec.heads != spec.hidden:
        args += ["--kv-channels", str(spec.head_dim)]
    args += ["--seq-length", str(seq_len), "--max-position-embeddings", str(spec.max_positions or seq_len)]
    args += ["--vocab-size", str(spec.vocab)]
    if spec.gated_mlp:
        args.append("--swiglu")
    if spec.rms_norm:
        args += ["--normalization", "RMSNorm"]
    args += ["--position-embedding-type", "learned_absolute" if spec.learned_positions else "rope"]
    if not spec.tied:
        args.append("--untie-embeddings-and-output-weights")
    if not spec.bias:
        args.append("--disable-bias-linear")
    if spec.qk_norm:
        args.append("--qk-layernorm")
    if spec.experts:
        args += ["--num-experts", str(spec.experts), "--moe-router-topk", str(spec.top_k_)]
    return args


def expand_layout(layout: str) -> list[str]:
    """``--pipeline-model-parallel-layout`` as one string of letters per stage: ``(tt|)*2`` and ``t*3`` repeated,
    commas and spaces dropped (Megatron's ``PipelineParallelLayerLayout`` syntax, without nesting)."""
    text = layout.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    text = re.sub(r"([A-Za-z])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    if "(" in text or ")" in text or "*" in text or not re.fullmatch(r"[EtLm|]*", text):
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: use the letters E, t, m, L, '|', (..)*n, x*n")
    return text.split("|")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron", add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size"):
        parser.add_argument(f"--{flag}", type=int, default=1)
    for flag in ("num-virtual-stages-per-pipeline-rank", "num-layers-per-virtual-pipeline-stage", "num-layers"):
        parser.add_argument(f"--{flag}", type=int)
    for flag in ("micro-batch-size", "global-batch-size", "seq-length", "recompute-num-layers", "train-iters"):
        parser.add_argument(f"--{flag}", type=int)
    for flag in ("decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--pipeline-model-parallel-layout")
    parser.add_argument("--recompute-granularity", choices=("full", "selective"))
    parser.add_argument("--recompute-method", choices=("uniform", "block"))
    parser.add_argument("--recompute-activations", action="store_true")
    for flag in ("sequence-parallel", "use-distributed-optimizer", "bf16", "fp16"):
        parser.add_argument(f"--{flag}", action="store_true")
    for flag in ("nproc-per-node", "nproc_per_node", "nnodes"):  # a torchrun command line's own
        parser.add_argument(f"--{flag}", type=int)
    return parser


def read(source: str | Sequence[str], world: int | None = None) -> ImportedConfig:
    """Megatron-LM arguments (a list, or one string as a shell would split it; a ``torchrun`` command line too) as
    an :class:`ImportedConfig`.

    Megatron derives the data-parallel size from the world size, which its arguments do not hold: ``world`` gives
    it, else a torchrun command line's ``--nproc-per-node`` × ``--nnodes``. Raises ``ValueError`` for arguments that
    cannot run: a world not divisible by ``tp * pp * cp``, a global batch not divisible by the micro-batch size times
    the data-parallel size, a layout whose stages are not a multiple of ``P`` or whose layers are not
    ``--num-layers``, interleaving with ``m`` not a multiple of ``P``."""
    tokens = shlex.split(source) if isinstance(source, str) else [str(t) for t in source]
    try:
        args, unknown = _parser().parse_known_args(tokens)
    except (argparse.ArgumentError, SystemExit) as error:  # a value argparse cannot read, e.g. an unexpanded $MBS
        raise ValueError(f"the Megatron-LM arguments do not parse: {error}") from None
    tp, P, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if cp != 1:
        raise ValueError(f"--context-parallel-size {cp}: the toolkit plans no context parallelism; read it with 1")
    if world is None:
        procs, nodes = args.nproc_per_node, args.nnodes or 1
        if procs is None:
            raise ValueError(
                "Megatron-LM derives its data-parallel size from the world size, which its arguments do not hold: "
                "pass world= (the GPUs it runs on), or read a torchrun command line with --nproc-per-node"
            )
        world = procs * nodes
    if world % (tp * P):
        raise ValueError(f"world={world} is not divisible by tensor x pipeline = {tp} x {P}: the degrees do not fit")
    dp = world // (tp * P)
    b = args.micro_batch_size
    if b is None:
        raise ValueError("the arguments have no --micro-batch-size (Megatron-LM requires it)")
    G = args.global_batch_size if args.global_batch_size is not None else b * dp
    if G % (b * dp):
        raise ValueError(
            f"--global-batch-size {G} is not divisible by --micro-batch-size {b} x data-parallel size {dp} "
            f"(world {world} / (tp {tp} x pp {P}))"
        )
    m = G // (b * dp)
    stages, v = _stages(args, P)
    schedule = "Interleaved1F1B" if v > 1 else "1F1B"
    if v > 1 and (m % P or m < P):
        raise ValueError(f"interleaving needs m a multiple of P and at least P; the arguments give m={m}, P={P}")
    precision = "fp32"  # fp16 is priced as bf16: the same bytes per parameter
    if args.bf16 or args.fp16:
        precision = "bf16-mixed-zero1" if args.use_distributed_optimizer else "bf16-mixed"
    return ImportedConfig(
        framework="megatron",
        P=P,
        D=dp,
        fsdp=1,
        tp=tp,
        v=v,
        m=m,
        microbatch_size=b,
        schedule=schedule,
        recompute=_recompute(args, P * v),
        stage_modules=stages,
        precision=precision,
        seq_len=args.seq_length,
        settings={
            "world": world,
            "unread": unknown,
            "sequence_parallel": args.sequence_parallel and tp > 1,
            "first_layers": args.decoder_first_pipeline_num_layers,
            "last_layers": args.decoder_last_pipeline_num_layers,
        },
    )


def _stages(args: argparse.Namespace, P: int) -> tuple[tuple[tuple[str, ...], ...], int]:
    """The stages as layout letters (``()``: Megatron's even split) and ``v``."""
    layers = args.num_layers
    if args.pipeline_model_parallel_layout:
        stages = expand_layout(args.pipeline_model_parallel_layout)
        if len(stages) % P:
            raise ValueError(
                f"--pipeline-model-parallel-layout has {len(stages)} stages, not a multiple of "
                f"--pipeline-model-parallel-size {P}"
            )
        counted = sum(stage.count("t") for stage in stages)
        if layers is not None and counted != layers:
            raise ValueError(
                f"--pipeline-model-parallel-layout holds {counted} transformer layers (t) but --num-layers is {layers}"
            )
        return tuple(tuple(stage) for stage in stages), len(stages) // P
    if args.num_virtual_stages_per_pipeline_rank:
        return (), args.num_virtual_stages_per_pipeline_rank
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk and layers:
        if layers % P or (layers // P) % per_chunk:
            raise ValueError(
                f"--num-layers {layers} over --pipeline-model-parallel-size {P} does not divide into chunks of "
                f"--num-layers-per-virtual-pipeline-stage {per_chunk}"
            )
        return (), layers // P // per_chunk
    return (), 1


def _recompute(args: argparse.Namespace, stages: int) -> str:
    mode = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    if mode is None:
        return ""
    return " ".join(f"{s}:{mode}" for s in range(stages))


def even_stages(
    config: ImportedConfig, names: Sequence[str], params: Sequence[float] = (), types: Sequence[str] = ()
) -> tuple[tuple[str, ...], ...]:
    """Megatron's own split without a layout: the transformer layers evenly over the ``P * v`` stages (the first
    and last stages' counts as ``--decoder-first/last-pipeline-num-layers`` say), the embedding on the first stage,
    the loss on the last. Raises ``ValueError`` where the layers do not divide, as Megatron does."""
    blocks = sum(part.kind == "block" for part in decoder_parts(names))
    stages = config.P * config.v
    first, last = config.settings.get("first_layers"), config.settings.get("last_layers")
    counts: list[int | None] = [None] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = blocks - sum(c for c in counts if c is not None)
    open_stages = sum(c is None for c in counts)
    if open_stages and (rest < 0 or rest % open_stages):
        raise ValueError(
            f"Megatron-LM splits the {blocks} transformer layers evenly over {open_stages} stages only where they "
            "divide ('Number of layers should be divisible by the pipeline-model-parallel size'); give "
            "--pipeline-model-parallel-layout"
        )
    filled = [c if c is not None else rest // max(open_stages, 1) for c in counts]
    out = [["t"] * c for c in filled]
    out[0].insert(0, "E")
    out[-1].append("L")
    return tuple(tuple(stage) for stage in out)
