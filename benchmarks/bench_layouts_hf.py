"""Hugging Face families in PP × FSDP × TP layouts: each trained against one process, with its own tensor-parallel plan.

For each family and each of P2×tp2, P2×fsdp2, P1×tp2×fsdp2 and P2×tp2×fsdp2 (4 or 8 gloo processes), eager (the
caller's model) and on the meta device from its checkpoint (``weights=``): two SGD steps, then

* ``max_param_diff`` — the largest parameter difference from the same two steps in one process;
* ``worst_memory_error`` — the largest ``|predicted / measured - 1|`` of the peak over every process;
* ``worst_process`` — that process's (pp, dp, fsdp, tp), and where its measured peak came (``measured_peak_at``).

The models are the tests' small configurations (``tests/model_zoo.py``, untied), the same the CI subset in
``tests/runner/test_layouts_hf.py`` runs; this runs the whole matrix.

With ``--repeats N`` it runs the matrix N times and says whether every process measured the same peak each time
(the CPU measure is meant to repeat: the machine's load and where the allocator puts a buffer must not move it).

Run: ``python benchmarks/bench_layouts_hf.py`` (Llama, Qwen3 and Mixtral, about two minutes on 2 cores), or name the
families: ``python benchmarks/bench_layouts_hf.py Olmo2 Qwen2Moe``; ``--repeats 3`` for the repeat check.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import pandas as pd

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "runner")]

from hf_layouts import train_in_layout  # the tests' helpers, after the path
from test_layouts import LAYOUTS, sgd, worst
from tiny_transformers import single_process

#: The families the issue names by default.
FAMILIES = ("Llama", "Qwen3", "Mixtral")


def one_run(family: str, layout: str, meta: bool) -> dict:
    """One family in one layout, eager or from its checkpoint on meta: the row of the table (``peaks``: each
    process's measured peak, for the repeat check)."""
    with tempfile.TemporaryDirectory() as folder:
        model, result, x, y = train_in_layout(family, layout, meta, Path(folder))
    memory = result.memory
    at = memory["error"].abs().idxmax()
    return {
        "family": family,
        "layout": layout,
        "weights": "meta + checkpoint" if meta else "eager",
        "processes": len(memory),
        "max_param_diff": worst(result.state_dict(), single_process(model, x, y, 2, optimizer=sgd)),
        "worst_memory_error": float(memory["error"].abs().max()),
        "worst_process": tuple(int(memory.loc[at, c]) for c in ("pp", "dp", "fsdp", "tp")),
        "measured_peak_at": memory.loc[at, "measured_peak_at"],
        "peaks": tuple(int(b) for b in memory["measured_peak_bytes"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES), help="model zoo families (tests/model_zoo.py)")
    parser.add_argument("--repeats", type=int, default=1, help="run the matrix this many times; compare the peaks")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cases = [(f, layout, meta) for f in args.families for layout in LAYOUTS for meta in (False, True)]
    runs = [[one_run(*case) for case in cases] for _ in range(args.repeats)]
    table = pd.DataFrame(runs[0]).drop(columns="peaks")
    with pd.option_context("display.width", 200, "display.max_rows", None):
        print(table.to_string(index=False, formatters={"max_param_diff": "{:.1e}".format,
                                                       "worst_memory_error": "{:.1%}".format}))  # fmt: skip
    print(f"largest parameter difference {table['max_param_diff'].max():.1e} (bound 1e-5); worst memory error "
          f"{table['worst_memory_error'].max():.1%} (bound 10%)")  # fmt: skip
    if args.repeats > 1:
        moved = [case for i, case in enumerate(cases) if len({run[i]["peaks"] for run in runs}) > 1]
        print(f"{len(cases) - len(moved)} of {len(cases)} runs measured the same peak on every process in all "
              f"{args.repeats} repeats" + (f"; moved: {moved}" if moved else ""))  # fmt: skip


if __name__ == "__main__":
    main()
