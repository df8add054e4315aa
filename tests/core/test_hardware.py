"""psl.hardware: the named devices carry their datasheet numbers and sources, bandwidths follow Link's convention
(per GPU, one direction), Hardware.topology() builds the Topology a plan prices on, and bad numbers are refused."""

import dataclasses
import json

import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.hardware import A100_80GB, DEVICES, H100_SXM, H200, Hardware, check_hardware
from pipeswift_lab.core.topology import DEFAULT_INTER_NODE_LINK, DEFAULT_INTRA_NODE_LINK


def test_the_package_exposes_the_module_and_the_type():
    assert psl.hardware.H100_SXM is H100_SXM and psl.Hardware is Hardware
    assert {"hardware", "Hardware"} <= set(psl.__all__)
    assert set(DEVICES) == {"A100_80GB", "H100_SXM", "H200"}


@pytest.mark.parametrize(
    ("device", "tflops", "gb", "tbps", "nvlink_total_gbps"),
    [(A100_80GB, 312, 80, 2.039, 600), (H100_SXM, 989, 80, 3.35, 900), (H200, 989, 141, 4.8, 900)],
)
def test_the_named_devices_hold_their_datasheet_numbers(device, tflops, gb, tbps, nvlink_total_gbps):
    assert device.peak_flops == pytest.approx(tflops * 1e12)
    assert device.hbm_bytes == pytest.approx(gb * 1e9)
    assert device.hbm_bandwidth == pytest.approx(tbps * 1e12)
    # NVIDIA quotes NVLink both ways together; a Link holds what one GPU sustains one way
    assert device.nvlink_bandwidth == pytest.approx(nvlink_total_gbps / 2 * 1e9)
    assert device.machine_balance == pytest.approx(tflops * 1e12 / (tbps * 1e12))


@pytest.mark.parametrize("device", list(DEVICES.values()), ids=list(DEVICES))
def test_every_number_of_a_named_device_says_where_it_comes_from(device):
    numbers = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "sources")]
    given = [key for key in numbers if getattr(device, key) is not None]
    assert set(given) <= set(device.sources), set(given) - set(device.sources)
    assert all(isinstance(text, str) and len(text) > 20 for text in device.sources.values())
    assert "datasheet" in device.sources["peak_flops"] and "http" in device.sources["peak_flops"]
    json.dumps(device.as_dict())  # meta of a profile keeps it


def test_the_h100_nvlink_link_is_the_default_intra_node_link():
    assert H100_SXM.intra_node_link == DEFAULT_INTRA_NODE_LINK
    assert A100_80GB.intra_node_link.bandwidth_GBps == pytest.approx(300.0)


def test_topology_puts_nvlink_inside_a_node_and_the_network_between():
    topo = H100_SXM.topology()
    assert isinstance(topo, psl.Topology) and topo.gpus_per_node == 8
    assert topo.intra_node.bandwidth_GBps == pytest.approx(450.0)
    assert topo.inter_node.bandwidth_GBps == pytest.approx(50.0)  # one 400 Gb/s NIC per GPU
    given = psl.Link(latency_ms=0.02, bandwidth_GBps=12.5)
    assert H100_SXM.topology(4, inter_node=given) == psl.Topology(4, H100_SXM.intra_node_link, given)
    bare = Hardware("bare", peak_flops=1e14, hbm_bandwidth=1e12, nvlink_bandwidth=100e9)
    assert bare.inter_node_link is None and bare.topology().inter_node == DEFAULT_INTER_NODE_LINK


def test_hardware_of_your_own():
    mine = psl.Hardware("mine", peak_flops=400e12, hbm_bytes=64e9, hbm_bandwidth=2e12, nvlink_bandwidth=200e9)
    assert mine.matmul_efficiency == 0.8 and mine.sm_count is None
    assert "400 TFLOP/s" in str(mine) and "200 GB/s" in str(mine)
    assert check_hardware("H200") is H200 and check_hardware(mine) is mine


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(peak_flops=0), r"peak_flops=0.0 is invalid; it must be > 0"),
        (dict(hbm_bytes=-1e9), r"hbm_bytes=-1000000000.0 is invalid; it must be > 0"),
        (dict(hbm_bandwidth=float("nan")), r"hbm_bandwidth=nan is invalid"),
        (dict(nvlink_bandwidth="fast"), r"nvlink_bandwidth must be a real number"),
        (dict(inter_node_bandwidth=0.0), r"inter_node_bandwidth=0.0 is invalid"),
        (dict(matmul_efficiency=1.5), r"matmul_efficiency=1.5 is invalid; it is a share of a peak"),
        (dict(attention_efficiency=0), r"attention_efficiency=0.0 is invalid"),
        (dict(nvlink_latency_ms=-1), r"nvlink_latency_ms=-1.0 is invalid"),
        (dict(sm_count=0), r"sm_count"),
    ],
)
def test_bad_numbers_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Hardware("bad", **kwargs)


def test_missing_numbers_are_refused_where_they_are_needed():
    with pytest.raises(ValueError, match=r"name must be a non-empty string"):
        Hardware("")
    partial = Hardware("partial", peak_flops=1e14)
    with pytest.raises(ValueError, match=r"Hardware 'partial' has no hbm_bandwidth: the machine balance needs it"):
        _ = partial.machine_balance
    with pytest.raises(ValueError, match=r"has no nvlink_bandwidth: the intra-node link needs it"):
        partial.topology()
    with pytest.raises(ValueError, match=r"'B300' is not a named device; valid names are \['A100_80GB'"):
        check_hardware("B300")
    with pytest.raises(TypeError, match=r"hardware must be a pipeswift_lab.Hardware"):
        check_hardware(3)
