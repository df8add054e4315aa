"""IPython magics: ``%pipeswift_profile`` (line) and ``%%pipeswift_profile`` (cell).

``%load_ext pipeswift_lab`` (or ``%load_ext pipeswift_lab.faces.magics``) registers them:

* ``%pipeswift_profile [options] model x [y ...]`` profiles one forward and backward of
  ``model(x, y, ...)`` per repeat (:func:`pipeswift_lab.profiling.measure.profile`);
* ``%%pipeswift_profile [options] model`` runs the cell body as the training step, ``-n``
  times after ``-w`` warm-up runs, attributing its time to ``model``'s layers
  (:func:`pipeswift_lab.profiling.measure.profile_step`). The cell really runs: an optimizer step in
  it updates the model.

Options: ``-n`` repeats, ``-w`` warm-up steps, ``--layers`` comma-separated names or glob
patterns, ``--loss`` and ``--target`` (line form), ``-o`` return the Profile, ``-v NAME``
store it in the notebook, ``-q`` quiet (no card, no plot, no progress bar). Without ``-q`` the
Profile and its plot are displayed. Arguments are split as a shell would (``shlex``), so
quoted values such as ``--layers 'embed,blocks.*'`` lose their quotes. Mistakes come back as
a one-line ``UsageError``.

IPython is imported only when the extension loads, so ``import pipeswift_lab`` stays light.
"""

from __future__ import annotations

import functools
import shlex

from ..core.display import first_line

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    """Register ``%pipeswift_profile`` on the IPython shell ``ipython`` (called by ``%load_ext``)."""
    ipython.register_magics(_magics_class()(ipython))


@functools.cache
def _magics_class():
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
            help="comma-separated submodule names or glob patterns, e.g. 'embed,blocks.*,head'",
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
        def pipeswift_profile(self, line, cell=None):
            """Profile a model per layer: ``%pipeswift_profile model x`` or ``%%pipeswift_profile model`` over a training-step cell."""
            from ..profiling.measure import profile, profile_step

            try:  # split as a shell would, so --layers 'embed,block_*' pasted from the help works
                argv = shlex.split(line)
            except ValueError as exc:
                raise UsageError(f"could not split the arguments {line!r} as a shell would: {exc}") from None
            args = self.pipeswift_profile.parser.parse_args(argv)
            if args.variable is not None and not args.variable.isidentifier():
                raise UsageError(f"-v {args.variable!r} is not a valid Python name to store the Profile under")
            layers = [p.strip() for p in args.layers.split(",") if p.strip()] if args.layers is not None else None
            model = self._evaluate(args.model, "model")
            try:
                if cell is None:
                    if not args.sample:
                        raise UsageError(
                            "give the sample input after the model: %pipeswift_profile model x  (or use %%pipeswift_profile model over a cell)"
                        )
                    if args.target is not None and args.loss is None:
                        raise UsageError("--target needs --loss: %pipeswift_profile --loss lm_loss --target y model x")
                    sample = [self._evaluate(s, "sample") for s in args.sample]
                    loss_fn = self._evaluate(args.loss, "--loss") if args.loss is not None else None
                    target = self._evaluate(args.target, "--target") if args.target is not None else None
                    result = profile(
                        model,
                        *sample,
                        target=target,
                        loss_fn=loss_fn,
                        layers=layers,
                        warmup=args.warmup,
                        repeats=args.repeats,
                        progress=not args.quiet,
                    )
                else:
                    if args.sample or args.loss is not None or args.target is not None:
                        raise UsageError(
                            "the cell form takes only the model: %%pipeswift_profile [options] model; the cell body is the training step"
                        )
                    if not cell.strip():
                        raise UsageError("the cell is empty; its body is the training step to profile")
                    code = compile(self.shell.transform_cell(cell), "<%%pipeswift_profile>", "exec")
                    namespace = self.shell.user_ns

                    def step():
                        try:
                            exec(code, namespace)
                        except Exception as exc:
                            raise _CellError(exc) from exc

                    result = profile_step(
                        model, step, layers=layers, warmup=args.warmup, repeats=args.repeats, progress=not args.quiet
                    )
            except UsageError:
                raise
            except _CellError as err:
                raise UsageError(f"the cell raised {type(err.exc).__name__}: {first_line(err.exc)}") from None
            except (ValueError, TypeError) as exc:
                raise UsageError(first_line(exc)) from None
            except RuntimeError as exc:
                raise UsageError(f"{type(exc).__name__}: {first_line(exc)}") from None
            if args.variable is not None:
                self.shell.user_ns[args.variable] = result
            if not args.quiet:
                _show(result, card=not args.output)
            return result if args.output else None

        def _evaluate(self, expression: str, what: str):
            try:
                return self.shell.ev(expression)
            except Exception as exc:
                raise UsageError(
                    f"{what} {expression!r} could not be evaluated in the notebook: {type(exc).__name__}: {first_line(exc)}"
                ) from None

    return PipeswiftMagics


class _CellError(Exception):
    """Carries an exception raised by the profiled cell's own code."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _show(result, card: bool = True) -> None:
    """Display the Profile (unless ``card`` is False) and its plot, then close the figure."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    if card:
        display(result)
    ax = result.plot()
    display(ax.figure)
    plt.close(ax.figure)
