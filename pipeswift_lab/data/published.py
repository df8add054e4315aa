"""Published training runs and the published figures of Korthikanti et al.: what the analytic time and memory models
are checked against.

:func:`published_runs` reads ``published_runs.csv``: one row per configuration that was trained and timed by its
authors, with the configuration (the model's shape, the GPU, the layout, the batch, the schedule, the
recomputation) and what they measured (``measured`` in ``unit``), and where every number comes from (``source``).
Two sources, each read from the files named in ``source``:

* Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC'21
  (arXiv:2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters on A100s (Selene), the achieved
  teraFLOP/s per GPU as NVIDIA/Megatron-LM's README published the table (commit ``34ed99d``,
  ``images/cases_april2021.png``), the configuration of each as the paper's scripts run it
  (``examples/academic_paper_scripts/sc21/run_table_1.sh`` and ``CONFIG.sh``: heads, tensor and pipeline degrees,
  micro-batch, global batch, nodes, interleaving, full recomputation, sequence 2048, fp16). The vocabulary is the
  paper's 51,200;
* torchtitan's published benchmarks (``pytorch/torchtitan`` ``benchmarks/*.md``): Llama 3.1 8B and 70B on H100s
  (96GB HBM2e at 2.4 TB/s, 500 W: ``hbm_bytes`` and ``hbm_bandwidth`` override the H100 SXM's), the bf16 rows
  with ``torch.compile`` and vanilla tensor parallelism, in tokens per second per GPU; the sequence length and the
  recomputation policy from the model's training config at the benchmark's commit.

Rows whose configuration the sources do not state (a micro-batch, a split) are left out: the float8 rows, context
parallelism, asynchronous tensor parallelism, and the 405B pipeline runs (their micro-batch count and split are not
published).

:data:`KORTHIKANTI_TABLE_3`, :data:`KORTHIKANTI_FIGURE_1` and :data:`KORTHIKANTI_FIGURE_7` are the model
configurations and the memory figures of Korthikanti et al., *Reducing Activation Recomputation in Large Transformer
Models* (MLSys 2023, arXiv:2205.05198), which :func:`~pipeswift_lab.transformer_memory` reproduces.
"""

from __future__ import annotations

import pandas as pd

from .files import data_path

__all__ = [
    "KORTHIKANTI_FIGURE_1",
    "KORTHIKANTI_FIGURE_7",
    "KORTHIKANTI_SOURCE",
    "KORTHIKANTI_TABLE_3",
    "PUBLISHED_COLUMNS",
    "PUBLISHED_FILE",
    "PUBLISHED_UNITS",
    "published_runs",
]

#: File name of the published runs inside this package.
PUBLISHED_FILE: str = "published_runs.csv"
#: What a row's ``measured`` is: teraFLOP/s per GPU counted by Eq. 3 of Narayanan et al. (SC'21), tokens per second
#: per GPU (global tokens over all GPUs, torchtitan's ``tps``), or seconds per iteration.
PUBLISHED_UNITS = ("tflops_per_gpu", "tokens_per_s_per_gpu", "iteration_s")
#: The columns of :func:`published_runs`, in order, with their dtypes.
PUBLISHED_COLUMNS: dict[str, str] = {
    "name": "str",
    "model": "str",
    "framework": "str",
    "layers": "int64",
    "hidden": "int64",
    "heads": "int64",
    "kv_heads": "Int64",
    "ffn": "Int64",
    "vocab": "int64",
    "seq_len": "int64",
    "gated_mlp": "bool",
    "bias": "bool",
    "rms_norm": "bool",
    "learned_positions": "bool",
    "tied": "bool",
    "attention": "str",
    "dropout": "bool",
    "hardware": "str",
    "hbm_bytes": "float64",
    "hbm_bandwidth": "float64",
    "gpus": "int64",
    "tp": "int64",
    "pp": "int64",
    "dp": "int64",
    "fsdp": "int64",
    "micro_batch": "int64",
    "global_batch": "int64",
    "schedule": "str",
    "v": "int64",
    "recompute": "str",
    "sequence_parallel": "bool",
    "overlap_grad_sync": "bool",
    "measured": "float64",
    "unit": "str",
    "source": "str",
}

#: The paper the Korthikanti constants come from.
KORTHIKANTI_SOURCE: str = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', MLSys 2023 (arXiv:2205.05198)"
)
#: Korthikanti et al.'s Table 3: ``{model: (heads a, hidden h, layers L, tensor t, pipeline p)}``; sequence 2048,
#: vocabulary 51200, micro-batch 1.
KORTHIKANTI_TABLE_3: dict[str, tuple[int, int, int, int, int]] = {
    "22B": (64, 6144, 48, 8, 1),
    "175B": (96, 12288, 96, 8, 8),
    "530B": (128, 20480, 105, 8, 35),
    "1T": (160, 25600, 128, 8, 64),
}
#: Korthikanti et al.'s Figure 1, per GPU in GB: parameters and optimizer state (18 bytes a parameter), activations
#: of the tensor-parallel baseline (no recomputation) and of the present work (sequence parallelism and selective
#: recomputation).
KORTHIKANTI_FIGURE_1: dict[str, tuple[float, float, float]] = {
    "22B": (49.89, 16.02, 2.79),
    "175B": (50.81, 55.77, 10.54),
    "530B": (37.10, 93.95, 19.24),
    "1T": (39.29, 144.28, 29.36),
}
#: Korthikanti et al.'s Figure 7: activation memory per layer as a percentage of the tensor-parallel baseline,
#: ``(sequence parallel, selective recompute, both)``.
KORTHIKANTI_FIGURE_7: dict[str, tuple[float, float, float]] = {
    "22B": (66.8, 49.4, 16.1),
    "175B": (62.0, 56.5, 18.5),
    "530B": (58.3, 61.9, 20.2),
    "1T": (58.3, 61.9, 20.2),
}


def published_runs() -> pd.DataFrame:
    """The published runs, one row a configuration (the module docs list the sources).

    Returns a DataFrame with the columns of :data:`PUBLISHED_COLUMNS`: ``name`` (unique), ``model`` (runs of one
    model share it), ``framework``; the :class:`~pipeswift_lab.TransformerSpec` fields ``layers`` … ``tied``
    (``kv_heads`` and ``ffn`` missing where the spec's default holds); ``attention`` (``"eager"`` or ``"flash"``) and
    ``dropout``; ``hardware`` (a name of :data:`pipeswift_lab.core.hardware.DEVICES`) with ``hbm_bytes`` and
    ``hbm_bandwidth`` where the GPU differs from it; the layout ``gpus = tp · pp · dp · fsdp``; ``micro_batch``,
    ``global_batch``; ``schedule``, ``v``; ``recompute`` (``"full"``, ``"selective"`` or ``""``);
    ``sequence_parallel``; ``overlap_grad_sync`` (the gradient reduction overlaps the backward: torch DDP, FSDP2);
    ``measured`` in ``unit`` (:data:`PUBLISHED_UNITS`); ``source``. ``df.attrs["source"]`` names the sources.
    :func:`pipeswift_lab.fidelity.load_published` turns the rows into
    :class:`~pipeswift_lab.fidelity.PublishedRun` values.
    """
    with data_path(PUBLISHED_FILE).open("r", encoding="utf-8") as f:
        df = pd.read_csv(f)
    df["recompute"] = df["recompute"].fillna("")  # no recomputation
    df = df[list(PUBLISHED_COLUMNS)]
    df = df.astype(PUBLISHED_COLUMNS)
    df.attrs["source"] = (
        "Narayanan et al., SC'21 (arXiv:2104.04473) Table 1 with NVIDIA/Megatron-LM's sc21 scripts; torchtitan's "
        "published H100 benchmarks (pytorch/torchtitan benchmarks/*.md). Each row's source column says which."
    )
    return df
