"""torchtitan 0.3 and later: a configuration as a Python module defining ``config()``, and such a module read back.

torchtitan 0.3 configures a job with a function returning ``Trainer.Config`` (``torchtitan/trainer.py``), run as
``torchrun ... -m torchtitan.train --module MODULE --config config``; its fields (``torchtitan/config/configs.py``):

* ``ParallelismConfig``: ``pipeline_parallel_degree`` (ranks, not stages), ``data_parallel_replicate_degree`` (the
  plan's ``D``), ``data_parallel_shard_degree`` (``fsdp``), ``tensor_parallel_degree``, ``module_fqns_per_model_part``
  (one list per global stage: ``P * v`` lists), ``pipeline_parallel_schedule`` or ``pipeline_parallel_schedule_csv``
  (torch's compute-only CSV, for your own orders), ``pipeline_parallel_microbatch_size`` (``b``);
* ``TrainingConfig``: ``local_batch_size`` (``m * b`` per data-parallel rank), ``global_batch_size``, ``seq_len``,
  ``steps``, ``mixed_precision_param``, ``disable_cuda_graphs`` (0.3 refuses a pipeline without it);
* ``activation_checkpoint``: ``FullAC.Config()``, ``SelectiveAC.Config()`` or None, one for every block.

torchtitan's decoders name their modules ``tok_embeddings``, ``layers.N``, ``norm`` and ``lm_head`` (``output`` in 0.2;
:mod:`.torchtitan_toml` writes those). The module is read back from its source without running it (:func:`read`).
torchtitan refuses, and so does the exporter: degrees whose product is not the world, ``seq_len`` not divisible by
``tp`` (with sequence parallelism) times ``2 * cp``, a split-backward schedule (zero-bubble, V) with compiled stages
(it fails at its first step, pytorch/pytorch#161904; torchtitan's flex attention is compiled too, torchtitan#3584, so
such a schedule is written with ``varlen`` attention).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.schedule import Schedule
from ..core.vocabulary import canonical_schedule, splits_backward
from .names import decoder_parts, stage_parts, torchtitan_fqns
from .nearest import uniform_recompute
from .target import ExportTarget, ImportedConfig

__all__ = ["FLAVORS", "even_stages", "nearest", "read", "write"]

#: torchtitan's model families by Hugging Face ``model_type``.
FAMILIES = {"llama": "llama3", "llama3": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3"}
#: Each family's registered flavors: ``{flavor: (layers, hidden)}`` (``torchtitan/models/*/__init__.py``, 0.3.0).
FLAVORS = {
    "llama3": {"debugmodel": (6, 256), "1B": (16, 2048), "3B": (28, 3072), "8B": (32, 4096), "70B": (80, 8192)}
    | {"405B": (126, 16384)},
    "qwen3": {"debugmodel": (8, 256), "0.6B": (28, 1024), "1.7B": (28, 2048), "4B": (36, 2560), "8B": (36, 4096)}
    | {"14B": (40, 5120), "32B": (64, 5120), "30B-A3B": (48, 2048), "235B-A22B": (94, 4096)},
}
#: The schedules torchtitan builds by name (torch's ``get_schedule_class``); any other order goes as a CSV.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
HEAD = "lm_head"


def family(target: ExportTarget) -> str:
    """torchtitan's family of ``target``'s model; ``ValueError`` naming the model type where it has none."""
    kind = (target.model_type or (target.spec.name if target.spec is not None else "")).lower()
    if kind not in FAMILIES:
        raise ValueError(
            f"torchtitan has no model for model_type {kind or '(unknown)'!r}: it trains "
            f"{sorted(set(FAMILIES.values()))} (Hugging Face {sorted(FAMILIES)}); pass model_config= the model's "
            "Hugging Face config or a TransformerSpec named so"
        )
    return FAMILIES[kind]


def flavor(target: ExportTarget) -> tuple[str, str]:
    """``(flavor, note)``: the registered flavor of ``target``'s shape, else the one with its layer count (or the
    nearest count) and a note saying what to register."""
    flavors = FLAVORS[family(target)]
    layers = len([p for p in decoder_parts(target.layer_names) if p.kind == "block"])
    hidden = target.spec.hidden if target.spec is not None else None
    exact = [name for name, shape in flavors.items() if shape == (layers, hidden)]
    if exact:
        return exact[0], ""
    near = min(flavors, key=lambda name: (abs(flavors[name][0] - layers), name))
    return near, (
        f"no registered {family(target)} flavor has {layers} layers of width {hidden}: register your model's under "
        f"the name {near!r} (its layer count must be {layers}, which module_fqns_per_model_part names)"
    )


def nearest(target: ExportTarget) -> tuple[ExportTarget, list[str]]:
    """The nearest configuration torchtitan can run and what changed: recomputation is one mode for every block."""
    return uniform_recompute(target, "activation_checkpoint applies to every block")


def check(target: ExportTarget) -> None:
    """torchtitan's refusals of ``target``: ``seq_len`` not divisible by ``tp`` (sequence parallelism is on by
    default)."""
    seq_len = target.seq_len
    if seq_len is not None and seq_len % target.tp:
        raise ValueError(
            f"torchtitan needs seq_len divisible by tp with sequence parallelism (tp * 2 * cp with context "
            f"parallelism): seq_len={seq_len}, tp={target.tp}"
        )


def module_fqns(target: ExportTarget, head: str = HEAD) -> list[list[str]]:
    """``module_fqns_per_model_part``: each global stage's modules in torchtitan's names."""
    out = [torchtitan_fqns(stage) for stage in stage_parts(target.layer_names, target.bounds)]
    return [[head if fqn == "output" else fqn for fqn in stage] for stage in out]


def values(target: ExportTarget, head: str = HEAD) -> dict[str, dict[str, Any]]:
    """The configuration's fields by section (``parallelism``, ``training``, ``activation_checkpoint``, ``model``)."""
    check(target)
    schedule = target.schedule
    csv = schedule.to_csv() if isinstance(schedule, Schedule) else ""
    # with an order's CSV, torchtitan still places the stages by the named schedule: a V's, a loop's (ValueError
    # for a placement it cannot make)
    name = schedule.torchtitan_schedule if isinstance(schedule, Schedule) else target.schedule_name
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": target.D,
        "data_parallel_shard_degree": target.fsdp,
        "tensor_parallel_degree": target.tp,
        "pipeline_parallel_degree": target.P,
        "pipeline_parallel_schedule": name,
        "pipeline_parallel_microbatch_size": target.microbatch_size,
    }
    if target.P * target.v > 1:
        parallelism["module_fqns_per_model_part"] = module_fqns(target, head)
    if target.tp > 1:
        parallelism["enable_sequence_parallel"] = True
    training: dict[str, Any] = {
        "local_batch_size": target.m * target.microbatch_size,
        "global_batch_size": target.global_batch,
        "steps": target.steps,
        "mixed_precision_param": "bfloat16" if target.bf16 or target.precision is None else "float32",
    }
    if target.seq_len is not None:
        training["seq_len"] = target.seq_len
    modes = set(target.recompute.values())
    mode = modes.pop() if modes else "none"
    fam = family(target)
    name_of, note = flavor(target)
    split = splits_backward(schedule if isinstance(schedule, Schedule) else target.schedule_name)
    return {
        "parallelism": parallelism,
        "training": training,
        "activation_checkpoint": {"mode": mode},
        "model": {"name": fam, "flavor": name_of, "note": note, "attn_backend": "varlen" if split else "flex"},
        "schedule_csv": {"text": csv},
    }


def write(target: ExportTarget) -> str:
    """The Python source of a module defining ``config()`` for torchtitan 0.3 and later."""
    v = values(target)
    model, parallelism, training = v["model"], v["parallelism"], v["training"]
    ac = {"full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}.get(v["activation_checkpoint"]["mode"])
    csv = v["schedule_csv"]["text"]
    lines = [
        f'"""torchtitan configuration of the plan {target.label}, written by pipeswift_lab.',
        "",
        f"{target.world} processes: pipeline {target.P} x data-parallel {target.D} x FSDP {target.fsdp} x tensor "
        f"{target.tp}; {target.P * target.v} stages, m={target.m} micro-batches of {target.microbatch_size}.",
        "Run it with torchtitan 0.3 or later (this file's folder on PYTHONPATH):",
        f"    torchrun --nproc-per-node {target.world} -m torchtitan.train --module MODULE_NAME --config config",
        '"""',
        "",
    ]
    if model["note"]:
        lines.append(f"# NOTE: {model['note']}")
    if model["attn_backend"] == "varlen":
        lines.append(
            "# a split-backward schedule fails on compiled stages (pytorch#161904); flex attention is compiled"
        )
    imports = ["from torchtitan.config import ParallelismConfig, TrainingConfig"]
    if ac:
        imports.append(f"from torchtitan.distributed.activation_checkpoint import {ac.split('.')[0]}")
    imports += [
        f"from torchtitan.models.{model['name']} import model_registry",
        "from torchtitan.trainer import Trainer",
    ]
    lines += ["import hashlib", "import os", "import tempfile", "", *imports, "", f"FLAVOR = {model['flavor']!r}"]
    lines.append(f"SCHEDULE_CSV = {csv!r}" if csv else 'SCHEDULE_CSV = ""')
    lines += ["", "", "def config() -> Trainer.Config:"]
    if csv:  # named by its content and written whole: every rank writes the same file, no job overwrites another's
        lines += [
            "    digest = hashlib.sha256(SCHEDULE_CSV.encode()).hexdigest()[:16]",
            "    path = os.path.join(tempfile.gettempdir(), f'pipeswift_schedule_{digest}.csv')",
            "    with tempfile.NamedTemporaryFile('w', dir=os.path.dirname(path), delete=False) as f:",
            "        f.write(SCHEDULE_CSV)",
            "    os.replace(f.name, path)",
        ]
    csv_field = "path" if csv else '""'
    lines += [
        "    return Trainer.Config(",
        f"        model_spec=model_registry(FLAVOR, attn_backend={model['attn_backend']!r}),",
        "        training=TrainingConfig(",
        *(f"            {k}={val!r}," for k, val in training.items()),
        f"            disable_cuda_graphs={target.P > 1},",
        "        ),",
        "        parallelism=ParallelismConfig(",
        *(f"            {k}={val!r}," for k, val in parallelism.items()),
        f"            pipeline_parallel_schedule_csv={csv_field},",
        "        ),",
        f"        activation_checkpoint={ac or 'None'},",
        "    )",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- reading
def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return _UNREAD


_UNREAD = object()
_AC = {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "selective"}
#: The calls whose keyword arguments are the configuration's fields (others, such as a validation section's
#: ``local_batch_size``, are not read).
_SECTIONS = ("Trainer", "TrainingConfig", "ParallelismConfig", "CompileConfig", "JobConfig")


def _call_name(node: ast.AST) -> str:
    """``FullAC.Config()`` -> ``"FullAC"``; ``ParallelismConfig(...)`` -> ``"ParallelismConfig"``."""
    func = node.func if isinstance(node, ast.Call) else node
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    parts = [p for p in reversed(parts) if p != "Config"]
    return parts[-1] if parts else ""


def read_python(text: str) -> dict[str, Any]:
    """The literal fields a torchtitan Python config sets: keyword arguments of its calls and assignments to
    ``config.section.field``, by field name, and ``activation_checkpoint`` as a mode; not run."""
    try:
        tree = ast.parse(text)
    except SyntaxError as error:
        raise ValueError(f"the torchtitan config is not Python: {error}") from None
    found: dict[str, Any] = {}
    constants = {
        t.id: _literal(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.Call) and _call_name(node) == "model_registry" and node.args:
            return ("model", value(node.args[0]))
        return _literal(node)

    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.AST]] = []
        if isinstance(node, ast.Call) and _call_name(node) in _SECTIONS:  # TrainingConfig(...), Trainer.Config(...)
            prefix = "compile." if _call_name(node) == "CompileConfig" else ""
            pairs = [(prefix + k.arg, k.value) for k in node.keywords if k.arg]
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = node.targets[0]  # config.parallelism.pipeline_parallel_degree = 4, config.activation_checkpoint
            section = target.value.attr if isinstance(target.value, ast.Attribute) else ""
            if section in ("training", "parallelism", "compile", "") or target.attr == "activation_checkpoint":
                pairs = [(("compile." if section == "compile" else "") + target.attr, node.value)]
        for key, sub in pairs:
            if key == "activation_checkpoint":
                found[key] = "none" if value(sub) is None else _AC.get(_call_name(sub), "selective")
            elif key == "model_spec" and isinstance(sub, ast.Call):
                found["flavor"] = value(sub)[1] if isinstance(value(sub), tuple) else _UNREAD
            else:
                got = value(sub)
                if got is not _UNREAD:
                    found[key] = got
    found.setdefault("activation_checkpoint", "selective")  # Trainer.Config's default: SelectiveAC
    if isinstance(constants.get("SCHEDULE_CSV"), str) and constants["SCHEDULE_CSV"]:  # an order this module writes
        found["schedule_csv_text"] = constants["SCHEDULE_CSV"]
    return found


def read(source: str | Path, world: int | None = None) -> ImportedConfig:
    """A torchtitan Python config (a path or its source) as an :class:`ImportedConfig`; ``world`` is the GPUs it
    runs on (needed where ``data_parallel_shard_degree`` is -1, its default: the shards fill the world)."""
    text = str(source)
    if isinstance(source, Path) or ("\n" not in text and Path(text).exists()):
        text = Path(text).read_text(encoding="utf-8")
    return imported(read_python(text), "torchtitan", world)


def imported(found: dict[str, Any], framework: str, world: int | None = None) -> ImportedConfig:
    """The :class:`ImportedConfig` of torchtitan's fields ``found`` (by field name, either version's). Raises
    ``ValueError`` for what torchtitan refuses."""
    pp = int(found.get("pipeline_parallel_degree", 1))
    tp = int(found.get("tensor_parallel_degree", 1))
    cp = int(found.get("context_parallel_degree", 1))
    replicate = int(found.get("data_parallel_replicate_degree", 1))
    shard = int(found.get("data_parallel_shard_degree", -1))
    if cp != 1:
        raise ValueError(f"context_parallel_degree={cp}: the toolkit plans no context parallelism")
    if shard == -1:  # the shards fill the world, which the config does not hold
        if world is None:
            raise ValueError(
                "data_parallel_shard_degree is -1 (torchtitan's default: the shards fill the world), and the world "
                "is not in the config: pass world= (the GPUs it runs on)"
            )
        shard = int(world) // (replicate * tp * pp)
    if world is not None and replicate * shard * tp * pp != int(world):
        raise ValueError(
            f"dp_replicate({replicate}) * dp_shard({shard}) * cp({cp}) * tp({tp}) * pp({pp}) != WORLD_SIZE({world})"
        )
    b = int(found.get("pipeline_parallel_microbatch_size", 1))
    local = int(found.get("local_batch_size", 8))
    if local % b:
        raise ValueError(f"local_batch_size={local} is not divisible by pipeline_parallel_microbatch_size={b}")
    m = local // b
    schedule_name = canonical_schedule(str(found.get("pipeline_parallel_schedule", "1F1B")))
    csv = found.get("schedule_csv_text") or found.get("pipeline_parallel_schedule_csv") or ""
    schedule: str | Schedule = schedule_name
    if isinstance(csv, str) and csv and "," not in csv and Path(csv).is_file():  # a CSV file beside the config
        csv = Path(csv).read_text(encoding="utf-8")
    if isinstance(csv, str) and "," in csv:
        schedule = Schedule.from_csv(csv)
    fqns = found.get("module_fqns_per_model_part")
    stages = tuple(tuple(str(f) for f in stage) for stage in fqns) if fqns else ()
    single = schedule_name in ("GPipe", "1F1B") and not isinstance(schedule, Schedule)
    v = len(stages) // pp if stages else (1 if single else 2)
    if isinstance(schedule, Schedule):
        v = schedule.v
    seq_len = found.get("seq_len")
    if seq_len is not None and tp > 1 and found.get("enable_sequence_parallel", True) and int(seq_len) % tp:
        raise ValueError(f"Training sequence length ({seq_len}) must be divisible by {tp} (tensor parallel)")
    compiled = bool(found.get("compile.enable", False)) and "model" in (found.get("compile.components") or ["model"])
    if compiled and splits_backward(schedule):
        raise ValueError(
            f"pipeline_parallel_schedule={schedule_name}: zero-bubble and V schedules split the backward, which "
            "fails on compiled stages (compile.enable; pytorch/pytorch#161904); turn compile off"
        )
    if framework == "torchtitan" and pp > 1 and not found.get("disable_cuda_graphs", False):
        raise ValueError("torchtitan 0.3 refuses pipeline parallelism with CUDA graphs: set disable_cuda_graphs=True")
    mode = found.get("activation_checkpoint", found.get("mode", "selective"))
    recompute = "" if mode in ("none", None) else " ".join(f"{s}:{mode}" for s in range(pp * v))
    precision = "bf16-mixed" if found.get("mixed_precision_param", "bfloat16") == "bfloat16" else "fp32"
    return ImportedConfig(
        framework=framework,
        P=pp,
        D=replicate,
        fsdp=shard,
        tp=tp,
        v=v,
        m=m,
        microbatch_size=b,
        schedule=schedule,
        recompute=recompute,
        stage_modules=stages,
        precision=precision,
        seq_len=int(seq_len) if seq_len is not None else None,
        settings={"flavor": found.get("flavor"), "steps": found.get("steps")},
    )


def even_stages(
    config: ImportedConfig, names: Sequence[str], params: Sequence[float] = (), types: Sequence[str] = ()
) -> tuple[tuple[str, ...], ...]:
    """torchtitan's own split (``_generate_llm_fqn_per_model_part``, ``torchtitan/distributed/pipeline_parallel.py``):
    the blocks and the embedding and output, each weighed as one layer, evenly over the stages, the first stages one
    longer."""
    blocks = sum(part.kind == "block" for part in decoder_parts(names))
    stages = config.P * config.v
    effective = blocks + 2
    per, extra = divmod(effective, stages)
    if per == 0:
        raise ValueError(f"{stages} stages exceed torchtitan's {effective} effective layers")
    out, layer = [], 0
    for s in range(stages):
        count = per + (s < extra)
        stage = ["tok_embeddings"] if s == 0 else []
        take = count - (s == 0) - (s == stages - 1)
        stage += [f"layers.{i}" for i in range(layer, min(layer + take, blocks))]
        layer = min(layer + take, blocks)
        if s == stages - 1:
            stage += ["norm", HEAD]
        out.append(tuple(stage))
    return tuple(out)
