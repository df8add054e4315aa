"""How torch spells a pipeline action in a schedule CSV: ``{stage}{kind}{microbatch}`` (``0F0``, ``1I2``), and an
overlapped forward-backward step as ``(3F2;0B0)OVERLAP_F_B`` (``_Action.from_str`` and ``__repr__``)."""

from __future__ import annotations

import re

__all__ = ["KINDS", "Action", "Groups", "cell", "group_cell", "is_cell", "parse_cell", "parse_group"]

#: One compute action: ``(kind, stage, microbatch)``.
Action = tuple[str, int, int]
#: The compute kinds of a schedule: forward, full backward, input gradient, weight gradient.
KINDS = ("F", "B", "I", "W")
_CELL = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")
_OVERLAP = re.compile(r"^\s*\(([^)]*)\)\s*OVERLAP_F_B\s*$")
#: Per rank, its groups of actions (one torch action each: one compute action, or an ``OVERLAP_F_B``'s two).
Groups = tuple[tuple[tuple[Action, ...], ...], ...]


def is_cell(text: str) -> bool:
    """Whether ``text`` is one compute cell (``"1I2"``)."""
    return _CELL.match(text) is not None


def parse_cell(cell: str, where: str = "") -> Action:
    """``"1I2"`` -> ``("I", 1, 2)``: torch's compute-only spelling ``{stage}{kind}{microbatch}``.

    Raises ``ValueError`` naming ``where`` (a row and column) when the cell is not one of F, B, I, W with a stage
    and a micro-batch."""
    match = _CELL.match(cell)
    if match is None:
        raise ValueError(
            f"{where or 'cell'} {cell!r} is not a compute action: write {{stage}}{{kind}}{{microbatch}} with kind "
            "F (forward), B (full backward), I (input gradient) or W (weight gradient), e.g. 0F0, 1I2, 1W2"
        )
    stage, kind, microbatch = match.groups()
    return kind, int(stage), int(microbatch)


def parse_group(text: str, where: str = "") -> tuple[Action, ...]:
    """One CSV cell as a group: ``"1I2"`` -> ``(("I", 1, 2),)``, ``"(3F2;0B0)OVERLAP_F_B"`` -> its two actions."""
    match = _OVERLAP.match(text)
    if match is None:
        return (parse_cell(text, where),)
    parts = tuple(parse_cell(part, where) for part in match.group(1).split(";") if part.strip())
    if sorted(k for k, _, _ in parts) != ["B", "F"]:
        raise ValueError(f"{where or 'cell'} {text!r}: an OVERLAP_F_B holds one forward and one full backward")
    return parts


def cell(action: Action) -> str:
    """``("I", 1, 2)`` -> ``"1I2"``."""
    kind, stage, microbatch = action
    return f"{stage}{kind}{microbatch}"


def group_cell(group: tuple[Action, ...]) -> str:
    """A group as torch spells it: ``"1I2"``, or ``"(3F2;0B0)OVERLAP_F_B"``."""
    return cell(group[0]) if len(group) == 1 else f"({';'.join(cell(a) for a in group)})OVERLAP_F_B"
