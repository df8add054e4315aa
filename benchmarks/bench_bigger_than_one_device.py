"""A model no single process here can hold for training, taken through profile, plan and run.

    python benchmarks/bench_bigger_than_one_device.py [--layers 20] [--cap-gib 6]

A Llama-style model of about 1 B parameters (hidden 2048, 20 layers, vocabulary 32,000) is built on the meta
device: fp32 weights, gradients and Adam's two moments are about 16 GB, two thirds of this machine's 24 GiB, with
nothing left for four processes' activations and libraries. The script

1. profiles it one unit at a time under ``--cap-gib`` of tensor memory (``repeated="once"``) and prints the
   profile's peak;
2. plans it on 4 devices of that memory (6 GiB: half the model's training state does not fit, a quarter does);
3. writes a sharded safetensors checkpoint of its initialization one decoder layer at a time (the way a large
   checkpoint arrives from the Hub), never holding the model;
4. trains it 2 steps at P=4 from that checkpoint and prints what every rank held: its stage's training state, its
   tensor peak and its resident peak, beside the caller's growth and the assembly.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

import pipeswift_lab as psl
from pipeswift_lab.core.meta_device import initial_values

GiB = 2**30


def config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip


def lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def write_checkpoint(model: torch.nn.Module, folder: Path) -> Path:
    """The model's initialization (as ``run`` initializes it: seeded by name) as Hugging Face shards, one top-level
    unit at a time: a copy of that unit alone is made, initialized, written and freed."""
    folder.mkdir(parents=True)
    units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    names = {id(m): n for n, m in model.named_modules()}
    weight_map = {}
    for i, unit in enumerate(units):
        prefix = names[id(unit)]
        alone = copy.deepcopy(unit)
        keys = [f"{prefix}.{k}" for k in alone.state_dict()]
        holder = torch.nn.Module()  # the unit under its own name, so each tensor is seeded by its full name
        parent = holder
        parts = prefix.split(".")
        for part in parts[:-1]:
            child = torch.nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(parts[-1], alone)
        holder._init_weights = model._init_weights  # Hugging Face's own init of each submodule
        holder.config = model.config
        state = initial_values(holder, keys, torch.device("cpu"), 0, None)
        name = f"model-{i + 1:05d}-of-{len(units):05d}.safetensors"
        save_file({k: t.contiguous() for k, t in state.items()}, str(folder / name))
        weight_map.update({k: name for k in state})
        del alone, holder, state
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.to_json_file(str(folder / "config.json"))
    return folder


def resident() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--cap-gib", type=float, default=6.0, help="each device's tensor memory")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    cap = int(args.cap_gib * GiB)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(args.layers))
    params = sum(p.numel() for p in model.parameters())
    state = 16 * params
    print(f"{params / 1e9:.2f} B parameters: {4 * params / GiB:.1f} GiB of fp32 weights, {state / GiB:.1f} GiB of "
          f"training state with Adam; each device {args.cap_gib:g} GiB")  # fmt: skip
    MICRO, M = 1, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (MICRO * M, args.seq), generator=g)
    targets = torch.randint(0, 32000, (MICRO * M, args.seq), generator=g)

    t0 = time.perf_counter()
    prof = psl.profile(model, ids[:MICRO], target=targets[:MICRO], loss_fn=lm_loss, layers="auto",
                       unit_by_unit=psl.UnitByUnit(repeated="once", memory_cap=cap), warmup=1, repeats=2,
                       progress=False)  # fmt: skip
    print(f"profile: {time.perf_counter() - t0:.0f} s, {prof.meta['timed_units']} of {prof.n_layers} units timed, "
          f"peak {prof.meta['live_peak_bytes'] / GiB:.2f} GiB of tensors (cap {args.cap_gib:g} GiB)")  # fmt: skip

    plan = psl.plan(prof, gpus=4, global_batch=MICRO * M, steps=1000, mem_per_gpu_bytes=cap, schedules=["1F1B"],
                    microbatch_sizes=[MICRO], progress=False)  # fmt: skip
    print(f"plan: best {plan.best.label}, {len(plan.feasible)} of {len(plan.table)} configurations fit")
    with pd.option_context("display.width", 200, "display.max_columns", 12):
        print(plan.top(3)[["P", "D", "m", "schedule", "peak_mem_bytes", "total_s"]])

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = write_checkpoint(model, Path(tmp) / "init")
        print(f"checkpoint: {time.perf_counter() - t0:.0f} s, {len(list(folder.glob('*.safetensors')))} shards")
        part = plan.partition_of(plan.best)  # balanced by time within the cap
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before, _ = resident()
        result = psl.run(model, (ids, targets), lm_loss, part, M, steps=2, progress=False, weights=folder,
                         optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4),
                         launch=psl.Launch(timeout_s=3600))  # fmt: skip
        growth = resident()[1] - before
    layer_state = 4 * prof.df["param_bytes"]
    memory = result.memory.set_index("rank")
    ranks = result.ranks.set_index("rank")
    table = pd.DataFrame(
        {
            "stages": ranks["stages"],
            "stage_training_state_GiB": [
                layer_state.iloc[slice(*part.bounds[s])].sum() / GiB for (s,) in ranks["stages"]
            ],
            "tensor_peak_GiB": memory["measured_peak_bytes"] / GiB,
            "resident_peak_GiB": (ranks["resident_peak_bytes"] - ranks["resident_start_bytes"]) / GiB,
        }
    )
    print(f"run: losses {[round(x, 3) for x in result.losses]}, assembly {result.jct.assembly_s:.1f} s, the caller "
          f"grew {growth / 2**20:.0f} MiB")  # fmt: skip
    with pd.option_context("display.precision", 2):
        print(table)
    print(f"the largest process held {table['resident_peak_GiB'].max():.1f} GiB; the model's training state is "
          f"{state / GiB:.1f} GiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
