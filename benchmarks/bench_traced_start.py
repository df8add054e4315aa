"""What a rank spends building traced stages: tracing the model itself, or unpickling the caller's split.

    python benchmarks/bench_traced_start.py [--families Llama,Qwen3,Mixtral,JetMoe,GptOss] [--layers 4] [--repeats 3]

For each Hugging Face family (built on the meta device from a small config: width 64, ``--layers`` decoder layers,
4 experts where it has experts, nothing downloaded), cut in two at its middle layer:

* ``caller_s`` — ``make_spec`` (the check before launch: one export and split, and the split pickled for the
  ranks), and ``split_MB``, the pickled split's size;
* ``trace_s`` — what a rank did before: ``trace(model, ...)``, torch's ``pipeline()`` exporting the whole model
  and splitting it;
* ``unpickle_s`` — what a rank does now: ``trace(model, ..., split)``, the caller's split unpickled;
* ``saved`` — ``1 - unpickle_s / trace_s``.

Each of the last two is timed as a rank meets it: in a fresh process that has imported what the runner's fork
server preloads (torch, torch.export's tracer, transformers and the family's modeling module) and has traced
nothing yet, the spec's model and plan read from a file; median of ``--repeats`` processes. Prints one row per
family and the median saving.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

#: Config overrides per family, beside the shared small shape (:func:`config`).
FAMILIES = {
    "Llama": {},
    "Qwen3": dict(head_dim=16),
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "JetMoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "GptOss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
}


def config(family: str, layers: int) -> object:
    import transformers

    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return getattr(transformers, f"{family}Config")(**{**shape, **FAMILIES[family]})


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())  # type: ignore[attr-defined]


def rank_s(spec_file: Path, shipped: bool, repeats: int) -> float:
    """Median seconds of a fresh process's first ``trace`` of the pickled spec (see the module docstring)."""
    times = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(spec_file), "--shipped" if shipped else "--trace"],
            capture_output=True,
            text=True,
            check=True,
        )
        times.append(float(done.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def child(spec_file: Path, shipped: bool) -> None:
    """Import what the fork server preloads, read the spec, print the seconds of one ``trace``."""
    import cloudpickle
    import torch.distributed.pipelining
    import torch.export._trace
    import transformers  # noqa: F401

    from pipeswift_lab.runner.stages.traced import trace

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, traced = cloudpickle.loads(spec_file.read_bytes())
    t0 = time.perf_counter()
    trace(model, traced.example, traced.split_names, torch.device("cpu"), traced.split if shipped else None)
    print(time.perf_counter() - t0)


def measure(family: str, layers: int, repeats: int) -> dict[str, object]:
    import transformers

    from pipeswift_lab.partitioning.stages import Partition
    from pipeswift_lab.profiling.table import Profile
    from pipeswift_lab.profiling.units import auto_units
    from pipeswift_lab.runner import make_spec

    torch.manual_seed(0)
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(config(family, layers))
    names = [name for name, _ in auto_units(model, announce=False)]
    half = len(names) // 2
    profile = Profile.synthetic(fwd_ms=[1.0] * len(names), bwd_ms=[1.0] * len(names), name=names)
    part = Partition.from_bounds(profile, [(0, half), (half, len(names))])
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    spec = make_spec(model, (tokens, tokens), lm_loss, part, 4)
    caller_s = time.perf_counter() - t0
    traced = spec.traced
    assert traced is not None and traced.split is not None, f"{family}: no split travelled"
    import cloudpickle

    with tempfile.TemporaryDirectory() as folder:
        spec_file = Path(folder) / "spec.pkl"
        spec_file.write_bytes(cloudpickle.dumps((spec.model, traced)))
        trace_s, unpickle_s = rank_s(spec_file, False, repeats), rank_s(spec_file, True, repeats)
    return {
        "family": family,
        "layers": layers,
        "caller_s": caller_s,
        "split_MB": len(traced.split) / 1e6,
        "trace_s": trace_s,
        "unpickle_s": unpickle_s,
        "saved": 1 - unpickle_s / trace_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shipped", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.shipped)
        return
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    families = args.families.split(",")
    table = pd.DataFrame([measure(f, args.layers, args.repeats) for f in families])
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"a rank's stage build: median {table['saved'].median():.0%} less time than tracing the model itself")


if __name__ == "__main__":
    main()
