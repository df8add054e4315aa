"""A GPU described by its datasheet numbers: what an analytic profile times a model on, and the links a plan prices
its collectives on, for GPUs you do not have.

:class:`Hardware` holds a device's peak dense bf16 tensor throughput, its HBM capacity and bandwidth, its NVLink
bandwidth inside a node and (optionally) its network bandwidth between nodes, the efficiencies the time model of
:mod:`pipeswift_lab.profiling.analytic_time` reaches of those peaks, and where each number comes from
(``sources``). Three devices are named, from NVIDIA's datasheets::

    import pipeswift_lab as psl
    psl.hardware.H100_SXM.peak_flops          # 989e12 FLOP/s, dense bf16
    psl.hardware.H100_SXM.topology()           # nodes of 8, NVLink 450 GB/s each way, 400 Gb/s NICs between
    psl.Hardware("my-gpu", peak_flops=400e12, hbm_bytes=64e9, hbm_bandwidth=2e12, nvlink_bandwidth=200e9)

Units are SI: FLOP/s, bytes, bytes per second; latencies in ms as :class:`~pipeswift_lab.Link` takes them.
``GB`` is ``10**9`` bytes, as datasheets quote memory and bandwidth.

**Link bandwidths follow** :class:`~pipeswift_lab.Link` **and** :class:`~pipeswift_lab.Topology`: what one GPU
sustains in one direction (NCCL's bus bandwidth of a ring collective). NVIDIA quotes NVLink per GPU in both
directions together (A100: 600 GB/s, H100 and H200: 900 GB/s), so ``nvlink_bandwidth`` is half of the datasheet's
number, 300 and 450 GB/s, the figure :data:`~pipeswift_lab.core.topology.DEFAULT_INTRA_NODE_LINK` uses; a network
card of ``G`` Gb/s per GPU gives ``G / 8`` GB/s each way.

**Memory** is the datasheet's capacity in decimal bytes (``80 GB`` is ``80e9``): CUDA reports 79.1 GiB (85.0e9
bytes) on an 80 GB H100, so ``80e9`` leaves room for the CUDA context and the allocator's fragmentation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .checks import check_fraction, check_int, check_time
from .link import Link
from .topology import DEFAULT_INTER_NODE_LINK, Topology

__all__ = ["A100_80GB", "DEVICES", "H100_SXM", "H200", "Hardware", "check_hardware"]

#: The numbers of a :class:`Hardware` that are rates or sizes (> 0 where given).
NUMBERS = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "nvlink_bandwidth", "inter_node_bandwidth")
#: The efficiencies, shares in ``(0, 1]`` of a peak.
EFFICIENCIES = ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency")

_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM), https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM), "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_H200_DATASHEET = "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM), https://www.nvidia.com/en-us/data-center/h200/"
_MAMF = (
    "Maximum Achievable Matmul FLOPS (MAMF) table, S. Bekman, Machine Learning Engineering Open Book, "
    "compute/accelerator/README.md, https://github.com/stas00/ml-engineering"
)
_FA2 = (
    "Dao, FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning, ICLR 2024 "
    "(arXiv:2307.08691): 50-73% of A100's peak in the forward pass"
)
_FA3 = (
    "Shah et al., FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision, NeurIPS 2024 "
    "(arXiv:2407.08608): up to 75% of H100's peak in the forward pass (BF16/FP16)"
)
_BANDWIDTH = (
    "assumption: streaming (elementwise) kernels sustain about 85% of the datasheet HBM bandwidth, the order "
    "STREAM-like copies reach on A100 and H100 (McCalpin's STREAM; Deakin et al., BabelStream, 2018); calibrate it"
)
_LATENCY = (
    "assumption: 2 us per ring step inside a node, as DEFAULT_INTRA_NODE_LINK (the order of NCCL's per-hop latency)"
)
_NET_LATENCY = "assumption: 10 us per ring step between nodes, as DEFAULT_INTER_NODE_LINK"


@dataclass(frozen=True)
class Hardware:
    """One GPU (see the module docs): ``Hardware(name, *, peak_flops, hbm_bytes, hbm_bandwidth, nvlink_bandwidth,
    inter_node_bandwidth=None, ...)``. Every number is optional at construction, and checked ``> 0`` where given;
    what uses the device refuses it, naming the field, where a number it needs is missing (:meth:`require`)."""

    name: str
    """What the device is called (a profile's ``meta["device"]``)."""
    peak_flops: float | None = None
    """Peak dense bf16 tensor-core throughput, FLOP/s (without structured sparsity)."""
    hbm_bytes: float | None = None
    """Device memory, bytes (the datasheet's, ``GB = 1e9``)."""
    hbm_bandwidth: float | None = None
    """Device memory bandwidth, bytes/s."""
    nvlink_bandwidth: float | None = None
    """Bandwidth one GPU sustains to the others of its node in one direction, bytes/s (half the datasheet's NVLink
    figure, which counts both directions)."""
    inter_node_bandwidth: float | None = None
    """Bandwidth one GPU sustains to other nodes in one direction, bytes/s (its network card's); None: unknown."""
    nvlink_latency_ms: float = 0.002
    """Latency of one ring step inside a node, ms."""
    inter_node_latency_ms: float = 0.01
    """Latency of one ring step between nodes, ms."""
    sm_count: int | None = None
    """Streaming multiprocessors; the time model's wave quantization needs it (None: no wave quantization)."""
    matmul_efficiency: float = 0.8
    """The share of ``peak_flops`` the best-shaped large bf16 GEMM reaches (its measured MAMF over the peak)."""
    attention_efficiency: float = 0.5
    """The share of ``peak_flops`` a fused (flash) attention forward reaches at head dimension 128 on long
    sequences."""
    bandwidth_efficiency: float = 0.85
    """The share of ``hbm_bandwidth`` streaming kernels (norms, activations, softmax) sustain."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each number comes from: ``{field: citation}``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string; got {self.name!r}")
        for key in NUMBERS:
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, _positive(key, value))
        for key in ("nvlink_latency_ms", "inter_node_latency_ms"):
            object.__setattr__(self, key, _nonnegative(key, getattr(self, key)))
        for key in EFFICIENCIES:
            object.__setattr__(self, key, _share(key, getattr(self, key)))
        if self.sm_count is not None:
            object.__setattr__(self, "sm_count", check_int("sm_count", self.sm_count, minimum=1))
        if not isinstance(self.sources, Mapping):
            raise TypeError(f"sources must be a mapping {{field: citation}}; got {type(self.sources).__name__}")
        object.__setattr__(self, "sources", {str(k): str(v) for k, v in self.sources.items()})

    # -- what uses it ---------------------------------------------------------------------------------------------
    def require(self, *fields: str, purpose: str = "this") -> Hardware:
        """This device, checked to have every number of ``fields``; raises ``ValueError`` naming the first missing
        one and ``purpose`` (what needs it). Returns the device."""
        for key in fields:
            if getattr(self, key, None) is None:
                raise ValueError(
                    f"Hardware {self.name!r} has no {key}: {purpose} needs it; give Hardware(..., {key}=...)"
                )
        return self

    @property
    def machine_balance(self) -> float:
        """FLOPs per byte of HBM traffic at which a kernel is as long computing as reading (``peak_flops /
        hbm_bandwidth``, the roofline's ridge point); raises ``ValueError`` where either is missing."""
        self.require("peak_flops", "hbm_bandwidth", purpose="the machine balance")
        assert self.peak_flops is not None and self.hbm_bandwidth is not None
        return self.peak_flops / self.hbm_bandwidth

    @property
    def intra_node_link(self) -> Link:
        """The :class:`~pipeswift_lab.Link` between GPUs of one node: ``nvlink_latency_ms`` and
        ``nvlink_bandwidth`` in GB/s. Raises ``ValueError`` where the bandwidth is missing."""
        self.require("nvlink_bandwidth", purpose="the intra-node link")
        assert self.nvlink_bandwidth is not None
        return Link(latency_ms=self.nvlink_latency_ms, bandwidth_GBps=self.nvlink_bandwidth / 1e9)

    @property
    def inter_node_link(self) -> Link | None:
        """The :class:`~pipeswift_lab.Link` between nodes, per GPU (None where ``inter_node_bandwidth`` is
        unknown)."""
        if self.inter_node_bandwidth is None:
            return None
        return Link(latency_ms=self.inter_node_latency_ms, bandwidth_GBps=self.inter_node_bandwidth / 1e9)

    def topology(self, gpus_per_node: int = 8, inter_node: Link | None = None) -> Topology:
        """The :class:`~pipeswift_lab.Topology` of nodes of ``gpus_per_node`` of these GPUs: :attr:`intra_node_link`
        inside a node, and between nodes ``inter_node`` if given, else :attr:`inter_node_link`, else
        :data:`~pipeswift_lab.core.topology.DEFAULT_INTER_NODE_LINK`. Returns the Topology."""
        between = inter_node if inter_node is not None else self.inter_node_link
        if between is not None and not isinstance(between, Link):
            raise TypeError(f"inter_node must be a pipeswift_lab.Link or None; got {type(between).__name__}")
        return Topology(
            gpus_per_node=gpus_per_node,
            intra_node=self.intra_node_link,
            inter_node=between if between is not None else DEFAULT_INTER_NODE_LINK,
        )

    def as_dict(self) -> dict[str, Any]:
        """Every field, ``sources`` included (JSON-friendly)."""
        out: dict[str, Any] = {key: getattr(self, key) for key in self.__dataclass_fields__}
        out["sources"] = dict(self.sources)
        return out

    def __str__(self) -> str:
        def number(value: float | None, unit: float, suffix: str) -> str:
            return "?" if value is None else f"{value / unit:g} {suffix}"

        return (
            f"Hardware({self.name}: {number(self.peak_flops, 1e12, 'TFLOP/s')} bf16, "
            f"{number(self.hbm_bytes, 1e9, 'GB')} at {number(self.hbm_bandwidth, 1e12, 'TB/s')}, "
            f"NVLink {number(self.nvlink_bandwidth, 1e9, 'GB/s')} each way)"
        )


def _positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0; ``ValueError`` naming ``name`` otherwise (a non-number too)."""
    try:
        return check_time(name, value, allow_zero=False)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _nonnegative(name: str, value: Any) -> float:
    try:
        return check_time(name, value)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _share(name: str, value: Any) -> float:
    try:
        return check_fraction(name, value, allow_zero=False, what="a share of a peak")
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def check_hardware(hardware: Any, name: str = "hardware") -> Hardware:
    """``hardware`` as a :class:`Hardware`: one, or the name of one of :data:`DEVICES`. Raises ``TypeError`` or
    ``ValueError`` naming ``name`` otherwise. Returns the Hardware."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        if hardware in DEVICES:
            return DEVICES[hardware]
        raise ValueError(f"{name}={hardware!r} is not a named device; valid names are {sorted(DEVICES)}")
    raise TypeError(f"{name} must be a pipeswift_lab.Hardware or a device name; got {type(hardware).__name__}")


A100_80GB = Hardware(
    "A100_80GB",
    peak_flops=312e12,
    hbm_bytes=80e9,
    hbm_bandwidth=2.039e12,
    nvlink_bandwidth=300e9,
    inter_node_bandwidth=25e9,
    sm_count=108,
    matmul_efficiency=0.869,
    attention_efficiency=0.6,
    sources={
        "peak_flops": f"{_A100_DATASHEET}: BF16 Tensor Core 312 TFLOPS (624 with sparsity)",
        "hbm_bytes": f"{_A100_DATASHEET}: 80GB HBM2e",
        "hbm_bandwidth": f"{_A100_DATASHEET}: 2,039 GB/s",
        "nvlink_bandwidth": f"{_A100_DATASHEET}: NVLink 600 GB/s per GPU (both directions), so 300 GB/s each way",
        "inter_node_bandwidth": "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand, one "
        "per GPU, so 25 GB/s each way",
        "sm_count": "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs",
        "matmul_efficiency": f"{_MAMF}: NVIDIA A100 SXM 271.2 of 312 TFLOPS (86.9%)",
        "attention_efficiency": _FA2,
        "bandwidth_efficiency": _BANDWIDTH,
        "nvlink_latency_ms": _LATENCY,
        "inter_node_latency_ms": _NET_LATENCY,
    },
)
"""NVIDIA A100 80GB SXM (numbers and sources in its ``sources``)."""

H100_SXM = Hardware(
    "H100_SXM",
    peak_flops=989e12,
    hbm_bytes=80e9,
    hbm_bandwidth=3.35e12,
    nvlink_bandwidth=450e9,
    inter_node_bandwidth=50e9,
    sm_count=132,
    matmul_efficiency=0.803,
    attention_efficiency=0.6,
    sources={
        "peak_flops": f"{_H100_DATASHEET}: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989 dense",
        "hbm_bytes": f"{_H100_DATASHEET}: 80GB HBM3",
        "hbm_bandwidth": f"{_H100_DATASHEET}: 3.35 TB/s",
        "nvlink_bandwidth": f"{_H100_DATASHEET}: NVLink 900 GB/s per GPU (both directions), so 450 GB/s each way",
        "inter_node_bandwidth": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per "
        "GPU, so 50 GB/s each way",
        "sm_count": "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (H100 SXM5)",
        "matmul_efficiency": f"{_MAMF}: NVIDIA H100 SXM 794.5 of 989 TFLOPS (80.3%)",
        "attention_efficiency": f"{_FA3}; 0.6 for causal attention at head dimension 128",
        "bandwidth_efficiency": _BANDWIDTH,
        "nvlink_latency_ms": _LATENCY,
        "inter_node_latency_ms": _NET_LATENCY,
    },
)
"""NVIDIA H100 SXM5 80GB (numbers and sources in its ``sources``)."""

H200 = Hardware(
    "H200",
    peak_flops=989e12,
    hbm_bytes=141e9,
    hbm_bandwidth=4.8e12,
    nvlink_bandwidth=450e9,
    inter_node_bandwidth=50e9,
    sm_count=132,
    matmul_efficiency=0.803,
    attention_efficiency=0.6,
    sources={
        "peak_flops": f"{_H200_DATASHEET}: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989 dense",
        "hbm_bytes": f"{_H200_DATASHEET}: 141GB HBM3e",
        "hbm_bandwidth": f"{_H200_DATASHEET}: 4.8 TB/s",
        "nvlink_bandwidth": f"{_H200_DATASHEET}: NVLink 900 GB/s per GPU (both directions), so 450 GB/s each way",
        "inter_node_bandwidth": "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU, so 50 GB/s each way",
        "sm_count": "the H100's GH100 die: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper)",
        "matmul_efficiency": f"{_MAMF}: H100 SXM's 80.3%, the same die and power limit (GH200 at 900 W: 83.8%)",
        "attention_efficiency": f"{_FA3}; 0.6 for causal attention at head dimension 128",
        "bandwidth_efficiency": _BANDWIDTH,
        "nvlink_latency_ms": _LATENCY,
        "inter_node_latency_ms": _NET_LATENCY,
    },
)
"""NVIDIA H200 SXM 141GB (numbers and sources in its ``sources``)."""

#: The named devices, by name.
DEVICES: dict[str, Hardware] = {hw.name: hw for hw in (A100_80GB, H100_SXM, H200)}
