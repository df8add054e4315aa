"""Tests for pipeswift_lab.profiling.table: the Profile type, made up by Profile.synthetic, checked, saved as CSV and
shown as a card."""

import math

import pandas as pd
import pytest

from pipeswift_lab.profiling.table import Profile


def test_synthetic_round_trip_with_awkward_names(tmp_path):
    prof = Profile.synthetic(
        fwd_ms=[1, 2.5], bwd_ms=[2, 5.125], name=["NA", "a,b#c"], activation_bytes=[1e6, 10], wgrad_ms=[1, 2]
    )
    path = tmp_path / "s.csv"
    prof.to_csv(path)
    back = Profile.read_csv(path)
    assert back == prof and back.layer_names == ("NA", "a,b#c")
    assert list(back.df["activation_bytes"]) == [1_000_000, 10] and list(back.df["wgrad_ms"]) == [1.0, 2.0]


def test_synthetic_defaults():
    prof = Profile.synthetic(fwd_ms=[1, 2, 3], bwd_ms=[2, 4, 6], param_bytes=[10, 20, 30], output_bytes=64)
    df = prof.df
    assert prof.n_layers == 3 and prof.layer_names == ("layer_0", "layer_1", "layer_2")
    assert list(df["type"]) == ["synthetic"] * 3 and list(df["layer"]) == [0, 1, 2]
    assert list(df["total_ms"]) == [3.0, 6.0, 9.0] and prof.total_ms == 18.0
    assert list(df["params"]) == [0, 0, 0] and list(df["param_bytes"]) == [10, 20, 30]
    assert list(df["output_bytes"]) == [64, 64, 64] and list(df["activation_bytes"]) == [0, 0, 0]
    assert list(df["fwd_ms_iqr"]) == [0.0] * 3 and df["peak_bytes"].isna().all()
    assert math.isnan(prof.coverage) and math.isnan(prof.cv) and math.isnan(prof.step_ms)
    assert prof.meta == {"source": "synthetic"}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(fwd_ms=[1, 2], bwd_ms=[1]), ValueError, "fwd_ms has 2 layers but bwd_ms has 1"),
        (dict(fwd_ms=[1, -2], bwd_ms=[1, 1]), ValueError, r"fwd_ms\[1\]=-2.0 is invalid; it must be >= 0"),
        (
            dict(fwd_ms=[1, float("nan")], bwd_ms=[1, 1]),
            ValueError,
            r"fwd_ms\[1\]=nan is invalid; it must be a finite number",
        ),
        (dict(fwd_ms=[1], bwd_ms=[float("inf")]), ValueError, "finite"),
        (dict(fwd_ms=[], bwd_ms=[]), ValueError, r"fwd_ms=\[\] is invalid"),
        (dict(fwd_ms=3, bwd_ms=[1]), TypeError, "fwd_ms must be a sequence"),
        (
            dict(fwd_ms=[1], bwd_ms=[1], param_bytes=[1, 2]),
            ValueError,
            "param_bytes has 2 values but the profile has 1 layers",
        ),
        (dict(fwd_ms=[1], bwd_ms=[1], activation_bytes=[1.5]), ValueError, "activation_bytes counts whole units"),
        (dict(fwd_ms=[1], bwd_ms=[1], wgrad_ms=[2]), ValueError, r"wgrad_ms\[0\]=2.0 exceeds bwd_ms\[0\]=1.0"),
        (dict(fwd_ms=[1], bwd_ms=[1], total_ms=[2]), ValueError, "total_ms is derived"),
        (dict(fwd_ms=[1, 1], bwd_ms=[1, 1], name=["a", "a"]), ValueError, "name must be distinct"),
    ],
)
def test_synthetic_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        Profile.synthetic(**kwargs)


def test_read_csv_refuses_other_files(tmp_path):
    path = tmp_path / "plain.csv"
    pd.DataFrame({"a": [1]}).to_csv(path, index=False)
    with pytest.raises(ValueError, match="is not a Profile CSV"):
        Profile.read_csv(path)


def test_profile_rejects_incomplete_frames():
    with pytest.raises(ValueError, match=r"missing the Profile columns \['name', 'type', 'fwd_ms'"):
        Profile(pd.DataFrame({"layer": [0]}))
    with pytest.raises(ValueError, match=r"df\['layer'\] must be 0..1 in order; got \[1, 0\]"):
        Profile(Profile.synthetic(fwd_ms=[1, 2], bwd_ms=[1, 2]).df.assign(layer=[1, 0]))
    minimal = Profile(Profile.synthetic(fwd_ms=[1, 2], bwd_ms=[1, 2]).df.drop(columns="calls"))  # calls is optional
    assert minimal.total_ms == 6.0


def test_one_noise_rule_for_profile_cards_and_the_report():
    from pipeswift_lab.core.display import NOISE_CV, noise_note, noise_warning

    assert noise_note(NOISE_CV) == "" and noise_note(float("nan")) == ""
    note = noise_note(0.25, "the profiled step")
    assert "the profiled step varied by 25%" in note and "pin threads" in note and "nothing else on the machine" in note
    assert noise_warning(0.25).startswith("<p><strong>Noisy machine:</strong>")
    noisy = Profile.synthetic(fwd_ms=[1.0], bwd_ms=[2.0])
    assert "Noisy machine" not in noisy._repr_html_()  # NaN cv: nothing measured
    noisy = Profile(noisy.df, meta={**noisy.meta, "step_ms_samples": [10.0, 20.0, 10.0]})
    assert noisy.cv > NOISE_CV
    assert noise_warning(noisy.cv, "the profiled step") in noisy._repr_html_() and "Noisy machine" in repr(noisy)


@pytest.mark.parametrize(
    "column, value, message",
    [
        (
            "fwd_ms",
            float("nan"),
            r"df\['fwd_ms'\] of layer 1 \('layer_1'\) is nan; each value must be a finite number >= 0",
        ),
        ("bwd_ms", -1.0, r"df\['bwd_ms'\] of layer 1 \('layer_1'\) is -1.0; each value must be a finite number >= 0"),
        ("fwd_ms", "fast", r"df\['fwd_ms'\] of layer 1 \('layer_1'\) is 'fast'"),
        ("param_bytes", -5, r"df\['param_bytes'\] of layer 1 \('layer_1'\) is -5; each value must be a number >= 0"),
    ],
)
def test_profile_refuses_bad_layer_values(column, value, message):
    good = Profile.synthetic(fwd_ms=[1.0, 2.0], bwd_ms=[2.0, 4.0])
    df = good.df.copy()
    df[column] = df[column].astype(object)
    df.loc[1, column] = value
    with pytest.raises(ValueError, match=message):
        Profile(df)


def test_read_csv_refuses_empty_and_negative_times(tmp_path):
    path = tmp_path / "p.csv"
    Profile.synthetic(fwd_ms=[1.0, 2.0], bwd_ms=[2.0, 4.0], meta={"batch_size": 2}).to_csv(path)
    lines = path.read_text().splitlines()
    header = lines[1].split(",")
    for value, message in (("", r"is nan; each value must be a finite number >= 0"), ("-3", r"is -3.0; each value")):
        row = lines[2].split(",")
        row[header.index("fwd_ms")] = value
        path.write_text("\n".join(lines[:2] + [",".join(row)] + lines[3:]) + "\n")
        with pytest.raises(ValueError, match=r"df\['fwd_ms'\] of layer 0 .*" + message):
            Profile.read_csv(path)
    path.write_text("\n".join(lines[:2]) + "\n")  # the header alone: no layers
    with pytest.raises(ValueError, match="df has no rows"):
        Profile.read_csv(path)


def test_cards_of_a_profile_of_times_alone_say_what_they_do_not_know():
    from pipeswift_lab.partitioning.balance import partition

    times = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    card, split = repr(times), repr(partition(times, 2))
    assert not times.has_bytes and "nan" not in card and "nan" not in split
    assert "not measured: a synthetic profile" in card and "memory       not measured: the profile has no byte" in card
    assert "max_rank_mem_bytes  not predicted: the profile has no byte columns" in split
    with_bytes = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, param_bytes=100)
    assert with_bytes.has_bytes and "max_rank_mem_bytes  " in repr(partition(with_bytes, 2))
    assert "not predicted" not in repr(partition(with_bytes, 2)) and "memory " not in repr(with_bytes)
