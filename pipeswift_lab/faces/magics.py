"""IPython magics: ``%pipeswift_profile`` (line) and ``%%pipeswift_profile`` (cell).

``%load_ext pipeswift_lab`` (or ``%load_ext pipeswift_lab.faces.magics``) registers them:

* ``%pipeswift_profile [options] model x [y ...]`` profiles one forward and backward of
  ``model(x, y, ...)`` per repeat (:func:`pipeswift_lab.profiling.measure.profile`);
* ``%%pipeswift_profile [options] model`` runs the cell body as the training step, ``-n``
  times after ``-w`` warm-up runs, attributing its time to ``model``'s layers
  (:func:`pipeswift_lab.profiling.measure.profile_step`). The cell really runs: an optimizer step in
  it updates the model.

Options: ``-n`` repeats, ``-w`` warm-up steps, ``--layers`` comma-separated names or glob
patterns (or ``auto``: the repeated blocks and the modules around them), ``--loss`` and
``--target`` (line form), ``-o`` return the Profile, ``-v NAME`` store it in the notebook,
``-q`` quiet (no card, no plot, no progress bar). Without ``-q`` the Profile and its plot
are displayed. Arguments are split as a shell would (``shlex``), so quoted values such as
``--layers 'embed,blocks.*'`` lose their quotes. Mistakes come back as a one-line
``UsageError``.

IPython is imported only when the extension loads, so ``import pipeswift_lab`` stays light.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from typing import TYPE_CHECKING, Any, cast

from ..core.display import first_line

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.magic import Magics
    from matplotlib.figure import Figure

    from ..profiling.table import Profile

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register ``%pipeswift_profile`` on the IPython shell ``ipython`` (called by ``%load_ext``)."""
    ipython.register_magics(_magics_class()(ipython))


@functools.cache
def _magics_class() -> type[Magics]:
    """The magics class, built on first use so that IPython loads only with the extension."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_cell_magic, magics_class
    from IPython.core.magic_arguments import argument, magic_arguments

    @magics_class
    class PipeswiftMagics(Magics):
        """The pipeswift_lab magics."""

        @magic_arguments()
        @argument("-n", "--repeats", type=int, default=10, help="measured steps (default 10)")
        @argument("-w", "--warmup", type=int, default=3, help="warm-up steps, not measured (default 3)")
        @argument(
            "--layers",
            default=None,
            help="comma-separated submodule names or glob patterns, e.g. 'embed,blocks.*,head', or 'auto'",
        )
        @argument(
            "--loss", default=None, help="line form: a loss function from the notebook, called loss(output, target)"
        )
        @argument("--target", default=None, help="line form: the target passed to --loss")
        @argument("-o", "--output", action="store_true", help="return the Profile")
        @argument("-v", "--variable", default=None, help="store the Profile in the notebook under this name")
        @argument("-q", "--quiet", action="store_true", help="do not display the Profile and its plot")
        @argument("model", help="the model (an nn.Module in the notebook)")
        @argument("sample", nargs="*", help="line form: the sample inputs, model(*sample)")
        @line_cell_magic
        def pipeswift_profile(self, line: str, cell: str | None = None) -> Profile | None:
            """Profile a model per layer: ``%pipeswift_profile model x`` or ``%%pipeswift_profile model`` over a
            training-step cell. Returns the Profile with ``-o``, else None."""
            args, layers = self._parse(line)
            model = self._evaluate(args.model, "model")
            try:
                if cell is None:
                    result = self._profile_line(model, args, layers)
                else:
                    result = self._profile_cell(model, args, layers, cell)
            except UsageError:
                raise
            except _CellError as err:
                raise UsageError(f"the cell raised {type(err.exc).__name__}: {first_line(err.exc)}") from None
            except (ValueError, TypeError) as exc:
                raise UsageError(first_line(exc)) from None
            except RuntimeError as exc:
                raise UsageError(f"{type(exc).__name__}: {first_line(exc)}") from None
            if args.variable is not None:
                self._namespace()[args.variable] = result
            if not args.quiet:
                _show(result, card=not args.output)
            return result if args.output else None

        def _parse(self, line: str) -> tuple[argparse.Namespace, str | list[str] | None]:
            """The magic's arguments and its ``--layers`` patterns (None when not given, ``"auto"`` for auto)."""
            try:  # split as a shell would, so --layers 'embed,block_*' pasted from the help works
                argv = shlex.split(line)
            except ValueError as exc:
                raise UsageError(f"could not split the arguments {line!r} as a shell would: {exc}") from None
            args = self.pipeswift_profile.parser.parse_args(argv)
            if args.variable is not None and not args.variable.isidentifier():
                raise UsageError(f"-v {args.variable!r} is not a valid Python name to store the Profile under")
            layers = [p.strip() for p in args.layers.split(",") if p.strip()] if args.layers is not None else None
            if layers == ["auto"]:  # the repeated blocks and what runs around them (profile(..., layers="auto"))
                return args, "auto"
            return args, layers

        def _profile_line(self, model: Any, args: argparse.Namespace, layers: str | list[str] | None) -> Profile:
            """The line form: one forward and backward of ``model(*sample)`` per repeat."""
            from ..profiling.measure import profile

            if not args.sample:
                raise UsageError(
                    "give the sample input after the model: %pipeswift_profile model x  "
                    "(or use %%pipeswift_profile model over a cell)"
                )
            if args.target is not None and args.loss is None:
                raise UsageError("--target needs --loss: %pipeswift_profile --loss lm_loss --target y model x")
            sample = [self._evaluate(s, "sample") for s in args.sample]
            loss_fn = self._evaluate(args.loss, "--loss") if args.loss is not None else None
            target = self._evaluate(args.target, "--target") if args.target is not None else None
            return profile(
                model,
                *sample,
                target=target,
                loss_fn=loss_fn,
                layers=layers,
                warmup=args.warmup,
                repeats=args.repeats,
                progress=not args.quiet,
            )

        def _profile_cell(
            self, model: Any, args: argparse.Namespace, layers: str | list[str] | None, cell: str
        ) -> Profile:
            """The cell form: the cell body, run in the notebook's namespace, is the training step."""
            from ..profiling.measure import profile_step

            if args.sample or args.loss is not None or args.target is not None:
                raise UsageError(
                    "the cell form takes only the model: %%pipeswift_profile [options] model; "
                    "the cell body is the training step"
                )
            if not cell.strip():
                raise UsageError("the cell is empty; its body is the training step to profile")
            shell = self._shell()
            code = compile(shell.transform_cell(cell), "<%%pipeswift_profile>", "exec")
            namespace = shell.user_ns

            def step() -> None:
                try:
                    exec(code, namespace)
                except Exception as exc:
                    raise _CellError(exc) from exc

            return profile_step(
                model, step, layers=layers, warmup=args.warmup, repeats=args.repeats, progress=not args.quiet
            )

        def _evaluate(self, expression: str, what: str) -> Any:
            try:
                return self._shell().ev(expression)
            except Exception as exc:
                raise UsageError(
                    f"{what} {expression!r} could not be evaluated in the notebook: "
                    f"{type(exc).__name__}: {first_line(exc)}"
                ) from None

        def _shell(self) -> InteractiveShell:
            """The shell the magics were registered on (``Magics.shell`` is typed optional)."""
            if self.shell is None:
                raise UsageError("the pipeswift_lab magics are not registered on an IPython shell")
            return self.shell

        def _namespace(self) -> dict[str, Any]:
            return self._shell().user_ns

    return PipeswiftMagics


class _CellError(Exception):
    """Carries an exception raised by the profiled cell's own code."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _show(result: Profile, card: bool = True) -> None:
    """Display the Profile (unless ``card`` is False) and its plot, then close the figure."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    if card:
        display(result)
    figure = cast("Figure", result.plot().figure)  # a whole figure: the Profile plots on a new one
    display(figure)
    plt.close(figure)
