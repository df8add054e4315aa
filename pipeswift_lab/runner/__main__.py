"""``torchrun --nproc-per-node P -m pipeswift_lab.runner SPEC [--out DIR]``: run a saved spec on every rank.

``SPEC`` is a file written by ``run(..., launch=Launch(save_spec=SPEC))``. Every rank trains its stages;
rank 0 gathers what all ranks measured into ``DIR/result.pt`` (default: ``SPEC`` with the
suffix ``.out``), copies the spec to ``DIR/spec.pkl`` and prints a summary. Read the result
back with ``pipeswift_lab.runner.load_result(DIR)``. ``pipeswift_lab.run`` starts this same
command through torch's elastic agent (with ``--from-run``).
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run this process's rank; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m pipeswift_lab.runner", description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="spec file written by pipeswift_lab.run(..., launch=Launch(save_spec=PATH))")
    parser.add_argument(
        "--out", default=None, help="directory for the per-rank files and result.pt (default: SPEC.out)"
    )
    parser.add_argument("--progress", action="store_true", help="write the steps done to OUT/progress")
    parser.add_argument("--from-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--caller-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    spec_path = Path(args.spec)
    out = Path(args.out) if args.out else spec_path.with_suffix(".out")

    from .rank import worker

    worker.main(spec_path, out, progress=args.progress, caller_pid=args.caller_pid)  # under torch elastic's @record
    if not args.from_run and int(os.environ.get("RANK", "0")) == 0:
        from .assembly import read_run_dir

        if spec_path.resolve() != (out / "spec.pkl").resolve():
            shutil.copyfile(spec_path, out / "spec.pkl")
        result = read_run_dir(out)
        print(result)
        print(f"result: {out / 'result.pt'}; read it with pipeswift_lab.runner.load_result({str(out)!r})")
    return 0


def exit_now(code: int) -> None:
    """Flush what this process wrote, then leave without interpreter teardown (``os._exit``).

    A rank's results are on disk by now; see [Note: the process group outlives its destroy] in
    :mod:`pipeswift_lab.runner.rank.worker` for why a finished rank does not run the interpreter's shutdown.
    """
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to deliver
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
