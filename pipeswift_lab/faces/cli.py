"""The ``pipeswift-lab`` command (also ``python -m pipeswift_lab``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeswift-lab",
        description="Pipeline-parallel training lab that optimizes job completion time (JCT).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    report = sub.add_parser("report", help="build the HTML report on the default reference job (CPU)")
    report.add_argument("--out", default="pipeswift-report", help="output directory (default: %(default)s)")
    report.add_argument("--quick", action="store_true", help="smaller measurements, for CI and smoke tests")
    report.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "report":
        from .report import build_report

        result = build_report(args.out, quick=args.quick, progress=not args.no_progress)
        print(result)
        return 0
    parser.error(f"unknown command {args.command!r}")  # argparse exits with status 2
    return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main"]
