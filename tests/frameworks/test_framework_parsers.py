"""The frameworks' own code accepts what ``Plan.export`` writes and parses it to the plan's values: torchtitan's
``ConfigManager``, Megatron-LM's ``parse_args`` + ``validate_args`` + ``core_transformer_config_from_args``,
DeepSpeed's ``DeepSpeedConfig`` batch checks and partition functions.

Each runs in its own process, in the environment ``.ci/run`` builds beside the test environment (torchtitan and
DeepSpeed as packages on ``PYTHONPATH``, torchtitan in a virtual environment of its own, Megatron-LM in a Python 3.12
one: megatron-core's parser needs 3.12). Where an environment is missing the test skips and says why.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
from framework_envs import framework_env

from pipeswift_lab.frameworks import ExportWarning
from pipeswift_lab.frameworks.deepspeed import method_parts

pytestmark = pytest.mark.filterwarnings("ignore::pipeswift_lab.frameworks.ExportWarning")

PLANS = ("uneven", "interleaved", "3d")


def _run(python, script, env_extra, timeout=600):
    env = {**os.environ, **env_extra}
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expected(plan):
    best = plan.best
    return {"P": best.P, "D": best.D, "fsdp": best.fsdp, "tp": best.tp, "m": best.m, "b": best.microbatch_size}


def test_torchtitans_config_manager_loads_the_exports_as_planned(plans, tmp_path):
    target = framework_env("PSL_TORCHTITAN_ENV", "torchtitan 0.3")
    for name in PLANS:
        plans[name].export("torchtitan", path=tmp_path / f"plan_{name}.py")
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from torchtitan.config import ConfigManager
        out = {{}}
        for name in {list(PLANS)!r}:
            cfg = ConfigManager().parse_args(["--module", f"plan_{{name}}", "--config", "config"])
            p, t = cfg.parallelism, cfg.training
            out[name] = {{
                "P": p.pipeline_parallel_degree, "D": p.data_parallel_replicate_degree,
                "fsdp": p.data_parallel_shard_degree, "tp": p.tensor_parallel_degree,
                "b": p.pipeline_parallel_microbatch_size,
                "m": t.local_batch_size // p.pipeline_parallel_microbatch_size,
                "schedule": p.pipeline_parallel_schedule, "fqns": p.module_fqns_per_model_part,
                "global_batch": t.global_batch_size, "layers": len(cfg.model_spec.model.layers),
                "ac": type(cfg.activation_checkpoint).__qualname__,
            }}
        print(json.dumps(out))
        """
    )
    parsed = _run(str(target / "venv" / "bin" / "python"), script, {"PYTHONPATH": ""})
    for name in PLANS:
        plan, got = plans[name], parsed[name]
        assert {k: got[k] for k in ("P", "D", "fsdp", "tp", "m", "b")} == _expected(plan)
        assert got["schedule"] == plan.best.schedule and got["layers"] == 6
        assert got["global_batch"] == plan.best.m * plan.best.microbatch_size * plan.best.D * plan.best.fsdp
        assert len(got["fqns"] or [[]]) == plan.best.P * plan.best.v and got["ac"] == "NoneType"


def test_megatrons_own_parser_accepts_the_exports_as_planned(plans):
    venv = framework_env("PSL_MEGATRON_ENV", "megatron-core 0.19 (Python 3.12)")
    runs = {}
    for name in PLANS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)
            runs[name] = {"args": plans[name].export("megatron"), "world": plans[name].best.gpus}
    # a rotary model's config asks for Transformer Engine's fused RoPE, which a CPU machine lacks: --no-rope-fusion;
    # tensor parallelism reads the GPU's architecture unless CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's own rule)
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from unittest import mock
        import megatron.training.arguments as arguments
        runs = json.loads({json.dumps(json.dumps(runs))})
        out = {{}}
        for name, run in runs.items():
            os.environ["WORLD_SIZE"] = str(run["world"])
            sys.argv = ["pretrain_gpt.py", *run["args"], "--no-rope-fusion", "--tokenizer-type", "NullTokenizer",
                        "--mock-data", "--lr", "1e-4"]
            with mock.patch.object(arguments, "get_device_arch_version", return_value=9):
                args = arguments.parse_args()
                arguments.validate_args(args, {{}})
            config = arguments.core_transformer_config_from_args(args)
            dp = args.data_parallel_size
            out[name] = {{
                "P": args.pipeline_model_parallel_size, "tp": args.tensor_model_parallel_size, "dp": dp,
                "b": args.micro_batch_size, "m": args.global_batch_size // (args.micro_batch_size * dp),
                "v": args.virtual_pipeline_model_parallel_size or 1, "layers": config.num_layers,
            }}
        print(json.dumps(out))
        """
    )
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": ""}
    parsed = _run(str(venv / "venv" / "bin" / "python"), script, env)
    for name in PLANS:
        best, got = plans[name].best, parsed[name]
        assert (got["P"], got["tp"], got["b"], got["m"], got["v"]) == (
            best.P,
            best.tp,
            best.microbatch_size,
            best.m,
            best.v,
        )
        assert got["dp"] == best.D * best.fsdp and got["layers"] == 6


def test_deepspeeds_config_checks_accept_the_exports_and_split_as_exported(plans):
    target = framework_env("PSL_DEEPSPEED_ENV", "DeepSpeed 0.19.8")
    runs = {}
    for name in PLANS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExportWarning)
            out = plans[name].export("deepspeed")
        best, table = plans[name].best, plans[name].checked.costs.table(1)
        method = out["pipeline_module"]["partition_method"]
        weights = list(table["param_bytes"]) if method == "parameters" else None
        if method.startswith("type:"):  # what PipelineModule balances: 1 for each layer of the type, 0 for the others
            weights = [1 if re.search(method[5:], t, re.IGNORECASE) else 0 for t in table["type"]]
        stages = out["pipeline_module"]["num_stages"] * (2 if best.schedule == "DualPipeV" else 1)
        mine = method_parts(method, stages, list(table["param_bytes"]), list(table["type"]))
        runs[name] = {"export": out, "dp": best.D * best.fsdp, "weights": weights, "stages": stages, "mine": mine}
    # DeepSpeedConfig reads the data-parallel size from an mpu once deepspeed.comm is up (one gloo process here);
    # its CPU shared-memory op is not built (a 2-minute compile that a config check does not use)
    script = textwrap.dedent(
        f"""
        import json, os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import deepspeed, deepspeed.ops
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime import utils
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")

        class DataParallel:
            def __init__(self, n):
                self.n = n
            def get_data_parallel_world_size(self):
                return self.n

        runs = json.loads({json.dumps(json.dumps(runs))})
        out = {{}}
        for name, run in runs.items():
            ds, module = run["export"]["ds_config"], run["export"]["pipeline_module"]
            config = DeepSpeedConfig(ds, mpu=DataParallel(run["dp"]))
            if run["weights"] is None:
                parts = utils.partition_uniform(len(module["layers"]), run["stages"])
            else:
                parts = utils.partition_balanced(run["weights"], run["stages"])
            out[name] = {{"tbs": config.train_batch_size, "b": config.train_micro_batch_size_per_gpu,
                          "gas": config.gradient_accumulation_steps, "bf16": config.bfloat16_config.enabled,
                          "parts": [int(p) for p in parts]}}
        print(json.dumps(out))
        """
    )
    parsed = _run(sys.executable, script, {"PYTHONPATH": str(target / "site"), "DS_ACCELERATOR": "cpu"})
    for name in PLANS:
        best, got, module = plans[name].best, parsed[name], runs[name]["export"]["pipeline_module"]
        assert (got["b"], got["gas"]) == (best.microbatch_size, best.m) and got["bf16"] is True
        assert got["tbs"] == best.m * best.microbatch_size * best.D * best.fsdp
        # DeepSpeed's own partition of the layers by the exported method is the split the export priced
        assert got["parts"] == runs[name]["mine"]
        if best.v == 1:  # the plan's own split, for a PipelineModule that takes boundaries
            assert module["planned_parts"] == [a for a, _ in _bounds(plans[name])] + [_bounds(plans[name])[-1][1]]


def _bounds(plan):
    return [tuple(int(x) for x in item.split("-")) for item in plan.price(plan.best).stage_bounds.split()]
