import dataclasses
import math

import pytest

from pipeswift_lab.core.link import Link, check_link, fit_latency_bandwidth


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    link = Link(latency_ms=0.5, bandwidth_GBps=10.0)
    # 10 GB/s moves 1e7 bytes in 1 ms
    assert link.transfer_ms(10_000_000) == pytest.approx(1.5)
    assert link.transfer_ms(0) == 0.5
    assert Link(0.0, 25.0).transfer_ms(25e9) == pytest.approx(1000.0)


def test_link_is_frozen_and_json_friendly():
    link = Link(0.02, 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        link.latency_ms = 1.0
    assert link.as_dict() == {"latency_ms": 0.02, "bandwidth_GBps": 100.0}
    assert "bandwidth_GBps=100" in str(link)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(latency_ms=-1, bandwidth_GBps=1), ValueError, "latency_ms=-1"),
        (dict(latency_ms=0, bandwidth_GBps=0), ValueError, "bandwidth_GBps=0"),
        (dict(latency_ms=math.nan, bandwidth_GBps=1), ValueError, "latency_ms=nan"),
        (dict(latency_ms=0, bandwidth_GBps=math.inf), ValueError, "bandwidth_GBps=inf"),
        (dict(latency_ms="1", bandwidth_GBps=1), TypeError, "latency_ms"),
    ],
)
def test_bad_links_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        Link(**kwargs)


def test_bad_transfer_sizes_and_link_types():
    with pytest.raises(ValueError, match="nbytes=-5"):
        Link(0, 1).transfer_ms(-5)
    with pytest.raises(TypeError, match="pipeswift_lab.Link"):
        check_link({"latency_ms": 1})
    assert check_link(None) is None


def test_the_alpha_beta_line_is_fitted_or_refused_when_unphysical():
    latency, per_byte = fit_latency_bandwidth([1e6, 2e6, 4e6], [1.5, 2.5, 4.5])  # 0.5 + 1e-6 per byte
    assert latency == pytest.approx(0.5) and per_byte == pytest.approx(1e-6)
    assert fit_latency_bandwidth([1e6, 2e6], [2.0, 1.0]) is None  # slower for fewer bytes: no bandwidth
    assert fit_latency_bandwidth([1e6, 2e6], [0.5, 2.5]) is None  # a negative latency
    assert fit_latency_bandwidth([1e6, 1e6], [1.0, 2.0]) is None  # one size: nothing to fit
