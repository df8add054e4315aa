"""The report's building blocks: a :class:`Section` of it, and the :class:`ReportContext` shared by the section functions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Section:
    """One report section: a title, explanatory HTML, figures and named tables."""

    title: str
    intro_html: str
    figures: list = field(default_factory=list)  # matplotlib Figures
    tables: dict = field(default_factory=dict)  # name -> DataFrame (also written as <name>.csv)
    summary: list = field(default_factory=list)  # short text lines for the terminal


@dataclass
class ReportContext:
    """Inputs shared by sections; ``quick`` shrinks work for tests and CI."""

    quick: bool = False
    progress: bool = True
    cache: dict = field(default_factory=dict)

    def get(self, key, build):
        """Return the cached value for ``key``, building it with ``build()`` the first time."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def reference_setup(ctx: ReportContext):
    """The report's default job: the reference GPT on the CPU, micro-batch of 8 sequences."""
    from ... import models

    return ctx.get("setup", lambda: models.reference("gpt", batch_size=4 if ctx.quick else 8))


def reference_profile(ctx: ReportContext):
    """The default job's measured per-layer profile (computed once per report)."""
    from ...profiling.measure import profile

    def build():
        setup = reference_setup(ctx)
        repeats, warmup = (3, 1) if ctx.quick else (10, 3)
        return profile(
            setup.model,
            setup.inputs,
            target=setup.targets,
            loss_fn=setup.loss_fn,
            warmup=warmup,
            repeats=repeats,
            progress=False,
        )

    return ctx.get("profile", build)
