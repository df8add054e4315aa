"""A framework's own code run on what ``Plan.export`` wrote: the check that a configuration is accepted where it
will run, and what the framework parses it to.

Each parser runs in a separate process, with the interpreter of the environment the framework is installed in
(``python``: your training environment's, by default this one's), so the toolkit never imports a framework:

* torchtitan — ``ConfigManager().parse_args(["--module", ..., "--config", "config"])``, which imports the module,
  calls ``config()`` and validates it again (torchtitan 0.3 and later);
* Megatron-LM — ``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``
  (``megatron/training/arguments.py``, megatron-core 0.17 and later, Python 3.12) with ``WORLD_SIZE`` set to the
  configuration's GPUs; on a machine without the GPU, ``gpu_arch`` is the compute capability major version
  ``validate_args`` is told (9: Hopper), and ``--no-rope-fusion`` is added (the fused kernel is Transformer Engine's);
* DeepSpeed — ``DeepSpeedConfig`` with the data-parallel size, in one gloo process (its batch checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .target import check_framework

__all__ = ["parse_with_framework", "parse_each_with_framework"]

_TORCHTITAN = """
import json, sys
sys.path.insert(0, FOLDER)
from torchtitan.config import ConfigManager

def parsed(module):
    cfg = ConfigManager().parse_args(["--module", module, "--config", "config"])
    p, t = cfg.parallelism, cfg.training
    return {
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_schedule": p.pipeline_parallel_schedule,
        "pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
        "module_fqns_per_model_part": p.module_fqns_per_model_part,
        "local_batch_size": t.local_batch_size,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
        "activation_checkpoint": type(cfg.activation_checkpoint).__qualname__,
        "model": [cfg.model_spec.name, cfg.model_spec.flavor, len(cfg.model_spec.model.layers)],
    }

print(json.dumps([parsed(module) for module in MODULES]))
"""

_MEGATRON = """
import json, os, sys
from unittest import mock
import megatron.training.arguments as arguments

def parsed(argv, world):
    os.environ["WORLD_SIZE"] = str(world)
    sys.argv = ["pretrain_gpt.py", *argv, "--no-rope-fusion", "--tokenizer-type", "NullTokenizer", "--mock-data",
                "--lr", "1e-4"]
    with mock.patch.object(arguments, "get_device_arch_version", return_value=GPU_ARCH):
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    config = arguments.core_transformer_config_from_args(args)
    return {
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "pipeline_model_parallel_layout": str(args.pipeline_model_parallel_layout or ""),
        "recompute_granularity": args.recompute_granularity,
        "num_layers": config.num_layers,
        "bf16": args.bf16,
    }

print(json.dumps([parsed(argv, world) for argv, world in zip(ARGS, WORLDS)]))
"""

_DEEPSPEED = """
import json, os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, deepspeed.ops
from deepspeed.runtime.config import DeepSpeedConfig
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a config check needs no compiled CPU op
deepspeed.init_distributed(dist_backend="gloo")

class DataParallel:  # the mpu DeepSpeedConfig reads the data-parallel size from
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp

def parsed(ds, dp):
    config = DeepSpeedConfig(ds, mpu=DataParallel(dp))
    return {
        "train_batch_size": config.train_batch_size,
        "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "bf16": config.bfloat16_config.enabled,
        "zero_stage": config.zero_optimization_stage,
    }

print(json.dumps([parsed(ds, dp) for ds, dp in zip(DS, DP)]))
"""


def _script(template: str, **values: Any) -> str:
    head = "".join(f"{name} = json.loads({json.dumps(json.dumps(value))})\n" for name, value in values.items())
    return "import json\n" + head + textwrap.dedent(template)


def parse_with_framework(
    framework: str,
    exported: Any,
    *,
    python: str | os.PathLike[str] = sys.executable,
    world: int | None = None,
    gpu_arch: int = 9,
    pythonpath: str | os.PathLike[str] | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """What ``framework``'s own code parses ``exported`` (what ``Plan.export(framework)`` returned) to, run with the
    interpreter ``python`` (with ``pythonpath`` as its ``PYTHONPATH``: a folder the framework is installed in): a dict
    of the values it read (see the module docs). ``world`` is the GPUs a Megatron-LM or DeepSpeed configuration runs
    on (they derive the data-parallel size from it).

    Raises ``RuntimeError`` with the framework's own message where it refuses the configuration or is not installed
    in that environment."""
    worlds = None if world is None else [world]
    return parse_each_with_framework(
        framework,
        [exported],
        python=python,
        worlds=worlds,
        gpu_arch=gpu_arch,
        pythonpath=pythonpath,
        timeout_s=timeout_s,
    )[0]


def parse_each_with_framework(
    framework: str,
    exports: Sequence[Any],
    *,
    python: str | os.PathLike[str] = sys.executable,
    worlds: Sequence[int] | None = None,
    gpu_arch: int = 9,
    pythonpath: str | os.PathLike[str] | None = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """:func:`parse_with_framework` for several exports in one process (the framework imported once): a list of what
    each parsed to, in order. ``worlds`` has one world size per export (Megatron-LM and DeepSpeed). Raises
    ``RuntimeError`` where the framework refuses any of them."""
    name = check_framework(framework)
    exports = list(exports)
    world_sizes = [int(w) for w in worlds or ()]
    if name in ("megatron", "deepspeed") and len(world_sizes) != len(exports):
        raise ValueError(
            f"worlds= needs one world size per export ({len(exports)}, not {len(world_sizes)}): {name} derives its "
            "data-parallel size from the world size"
        )
    with tempfile.TemporaryDirectory() as folder:
        if name == "torchtitan":
            modules = [f"pipeswift_plan_{i}" for i in range(len(exports))]
            for module, exported in zip(modules, exports):
                Path(folder, f"{module}.py").write_text(str(exported), encoding="utf-8")
            script = _script(_TORCHTITAN, FOLDER=folder, MODULES=modules)
        elif name == "megatron":
            args = [[str(a) for a in exported] for exported in exports]
            script = _script(_MEGATRON, ARGS=args, WORLDS=world_sizes, GPU_ARCH=int(gpu_arch))
        elif name == "deepspeed":
            configs, dps = [], []
            for exported, world in zip(exports, world_sizes):
                module = exported.get("pipeline_module", {})
                stages, tp = int(module.get("num_stages", 1)), int(module.get("topology", {}).get("num_mp", 1))
                configs.append(exported["ds_config"])
                dps.append(world // (stages * tp))
            script = _script(_DEEPSPEED, DS=configs, DP=dps, PORT=29000 + os.getpid() % 1000)
        else:
            raise ValueError(f"framework={framework!r}: the own parser runs for torchtitan, megatron and deepspeed")
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "DS_ACCELERATOR": "cpu"}
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
        done = subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=folder
        )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name}'s own parser refused it ({python}):\n{done.stderr.strip()[-2000:]}")
    return [dict(parsed) for parsed in json.loads(lines[-1])]
