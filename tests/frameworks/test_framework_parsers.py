"""The frameworks' own code accepts what ``Plan.export`` writes and parses it to the plan's values
(:func:`pipeswift_lab.frameworks.parse_with_framework`): torchtitan's ``ConfigManager``, Megatron-LM's ``parse_args``
+ ``validate_args`` + ``core_transformer_config_from_args``, DeepSpeed's ``DeepSpeedConfig`` batch checks; and
DeepSpeed's own partition functions split the layers as the export priced.

Each runs in the environment ``.ci/run`` builds beside the test environment (torchtitan in a virtual environment of
its own, DeepSpeed as packages on ``PYTHONPATH``). Megatron-LM's needs Python 3.12, for which the only torch on PyPI is
the CUDA build: CI does not pull it, so that test runs where ``$PSL_MEGATRON_ENV`` names an environment
``.ci/framework_envs DIR megatron`` built. Where an environment is missing the test skips and says why.
"""

import json
import re
import subprocess
import sys
import textwrap

import pytest
from framework_envs import framework_env

from pipeswift_lab.frameworks import parse_each_with_framework, parse_with_framework
from pipeswift_lab.frameworks.deepspeed import method_parts

pytestmark = pytest.mark.filterwarnings("ignore::pipeswift_lab.frameworks.ExportWarning")

PLANS = ("uneven", "interleaved", "3d")


def test_torchtitans_config_manager_loads_the_exports_as_planned(plans):
    python = framework_env("PSL_TORCHTITAN_ENV", "torchtitan 0.3") / "venv" / "bin" / "python"
    exports = [plans[name].export("torchtitan") for name in PLANS]
    parsed = parse_each_with_framework("torchtitan", exports, python=python)
    for name, got in zip(PLANS, parsed):
        best = plans[name].best
        assert got["pipeline_parallel_degree"] == best.P and got["tensor_parallel_degree"] == best.tp
        assert (got["data_parallel_replicate_degree"], got["data_parallel_shard_degree"]) == (best.D, best.fsdp)
        assert got["pipeline_parallel_microbatch_size"] == best.microbatch_size
        assert got["local_batch_size"] == best.m * best.microbatch_size
        assert got["global_batch_size"] == best.m * best.microbatch_size * best.D * best.fsdp
        assert got["pipeline_parallel_schedule"] == best.schedule and got["model"] == ["llama3", "debugmodel", 6]
        assert len(got["module_fqns_per_model_part"] or [[]]) == best.P * best.v
        assert got["activation_checkpoint"] == "NoneType" and got["seq_len"] == 2048


def test_megatrons_own_parser_accepts_the_exports_as_planned(plans):
    unset = "CI does not build it: its torch for Python 3.12 is PyPI's CUDA build; .ci/framework_envs DIR megatron does"
    python = framework_env("PSL_MEGATRON_ENV", "megatron-core 0.19 (Python 3.12)", unset=unset) / "venv/bin/python"
    exports, worlds = [plans[name].export("megatron") for name in PLANS], [plans[name].best.gpus for name in PLANS]
    for name, got in zip(PLANS, parse_each_with_framework("megatron", exports, python=python, worlds=worlds)):
        best = plans[name].best
        assert (got["pipeline_model_parallel_size"], got["tensor_model_parallel_size"]) == (best.P, best.tp)
        assert (got["virtual_pipeline_model_parallel_size"] or 1) == best.v
        assert got["data_parallel_size"] == best.D * best.fsdp and got["micro_batch_size"] == best.microbatch_size
        assert got["global_batch_size"] // (best.microbatch_size * got["data_parallel_size"]) == best.m
        assert got["num_layers"] == 6 and got["bf16"] is True
        assert got["pipeline_model_parallel_layout"].count("|") + 1 == best.P * best.v


def test_deepspeeds_config_checks_accept_the_exports_and_split_as_exported(plans):
    site = framework_env("PSL_DEEPSPEED_ENV", "DeepSpeed 0.19.8") / "site"
    runs = {}
    exports = {name: plans[name].export("deepspeed") for name in PLANS}
    worlds = [plans[name].best.gpus for name in PLANS]
    parsed = parse_each_with_framework("deepspeed", list(exports.values()), pythonpath=site, worlds=worlds)
    for name, got in zip(PLANS, parsed):
        best, table = plans[name].best, plans[name].checked.costs.table(1)
        out = exports[name]
        assert got["train_batch_size"] == best.m * best.microbatch_size * best.D * best.fsdp
        assert (got["train_micro_batch_size_per_gpu"], got["gradient_accumulation_steps"]) == (
            best.microbatch_size,
            best.m,
        )
        assert got["bf16"] is True and got["zero_stage"] in (0, 1)
        method, stages = out["pipeline_module"]["partition_method"], out["pipeline_module"]["num_stages"]
        weights = list(table["param_bytes"]) if method == "parameters" else None
        if method.startswith("type:"):  # what PipelineModule balances: 1 for each layer of the type, 0 for the others
            weights = [1 if re.search(method[5:], t, re.IGNORECASE) else 0 for t in table["type"]]
        mine = method_parts(method, stages, list(table["param_bytes"]), list(table["type"]))
        runs[name] = {"layers": len(table), "stages": stages, "weights": weights, "mine": mine}
    # DeepSpeed's own partition functions (deepspeed/runtime/utils.py) split the layers as the export priced
    script = textwrap.dedent(
        f"""
        import json
        from deepspeed.runtime import utils
        runs = json.loads({json.dumps(json.dumps(runs))})
        out = {{}}
        for name, run in runs.items():
            if run["weights"] is None:
                out[name] = utils.partition_uniform(run["layers"], run["stages"])
            else:
                out[name] = [int(p) for p in utils.partition_balanced(run["weights"], run["stages"])]
        print(json.dumps(out))
        """
    )
    env = {"PYTHONPATH": str(site), "DS_ACCELERATOR": "cpu", "PATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = json.loads(done.stdout.strip().splitlines()[-1])
    assert parts == {name: run["mine"] for name, run in runs.items()}


def test_a_framework_not_installed_is_named_in_the_error(plans):
    # this environment has no torchtitan: the parser's own ImportError comes back, with the interpreter that ran it
    with pytest.raises(RuntimeError, match=r"(?s)torchtitan's own parser refused it .*No module named 'torchtitan'"):
        parse_with_framework("torchtitan", plans["uneven"].export("torchtitan"), python=sys.executable)


def test_megatron_and_deepspeed_need_one_world_size_per_export(plans):
    exports = [plans[name].export("megatron") for name in PLANS]
    with pytest.raises(ValueError, match="one world size per export"):
        parse_each_with_framework("megatron", exports, worlds=[8])
    with pytest.raises(ValueError, match="one world size per export"):
        parse_with_framework("deepspeed", plans["uneven"].export("deepspeed"))
