"""Bad input to cluster.simulate: clear errors, or a stated and counted handling."""

import warnings

import numpy as np
import pandas as pd
import pytest

from pipeswift_lab import cluster
from pipeswift_lab.cluster.inputs import check_capacity, check_jobs, read_capacity


def table(**columns):
    base = {"submit_s": [0.0, 10.0], "gpus": [1, 2], "duration_s": [100.0, 200.0]}
    base.update(columns)
    return pd.DataFrame(base)


@pytest.mark.parametrize(
    "jobs, error, message",
    [
        ([1, 2], TypeError, "jobs must be a pandas DataFrame"),
        (table().drop(columns="gpus"), ValueError, r"missing the columns \['gpus'\]"),
        (table().iloc[:0], ValueError, "jobs has no rows"),
        (table(submit_s=["0", "x"]), TypeError, r"jobs\['submit_s'\] must be numeric; found '0'"),
        (table(submit_s=[-5.0, 1.0]), ValueError, r"jobs\['submit_s'\]=-5 at row 0 is invalid; it must be >= 0"),
        (table(duration_s=[100.0, 0.0]), ValueError, r"jobs\['duration_s'\]=0 at row 1 is invalid; it must be > 0"),
        (table(duration_s=[100.0, np.nan]), ValueError, r"non-finite value nan at row 1"),
        (table(gpus=[1, 0]), ValueError, r"jobs\['gpus'\]=0 at row 1 is invalid; it must be >= 1"),
        (table(gpus=[1.5, 2]), ValueError, "must be a whole number of GPUs"),
        (table(gpus=[True, False]), TypeError, r"jobs\['gpus'\] must be numeric"),
        (table(name=["a", "a"]), ValueError, "'a' appears more than once"),
        (table(min_gpus=[2, 1], max_gpus=[1, 2]), ValueError, "min_gpus=2 exceeds max_gpus=1"),
        (table(profile=[3, None]), TypeError, r"jobs\['profile'\] row 0 is float 3.0"),
    ],
)
def test_bad_jobs(jobs, error, message):
    with pytest.raises(error, match=message):
        check_jobs(jobs)


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="profile='gpt-9' is not in the library"):
        cluster.simulate(table(profile=["gpt-9", None]), 4, progress=False)


def test_unsorted_submissions_are_sorted_and_said_so():
    jobs = table(submit_s=[50.0, 10.0], name=["late", "early"])
    with pytest.warns(UserWarning, match="not sorted by submit_s; sorted them .stable., which moved 2 of 2 rows"):
        out = check_jobs(jobs)
    assert out["name"].tolist() == ["early", "late"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_jobs(table())  # sorted input: no warning


@pytest.mark.parametrize(
    "gpus, error, message",
    [
        (0, ValueError, "gpus=0 is invalid; a fixed capacity must be >= 1"),
        (True, TypeError, "got bool"),
        ("64", TypeError, "gpus must be an int or .* got str '64'"),
        ([], ValueError, "empty capacity series"),
        ([(0, 8), (10, -2)], ValueError, r"gpus\[1\] gpus=-2 is invalid; a capacity must be >= 0"),
        ([(0, 8), (10, 2.5)], TypeError, r"gpus\[1\] gpus=2.5 is invalid; it must be a whole number"),
        ([(0, 8), (-1, 4)], ValueError, r"gpus\[1\] time_s=-1.0 is invalid; it must be >= 0"),
        ([(0, 8), (9, 4), (5, 2)], ValueError, r"gpus\[2\] time_s=5.0 is before gpus\[1\] time_s=9.0; .*not decrease"),
        ([(0, 8, 1)], ValueError, "is not a .time_s, gpus. pair"),
        ([(0, 0)], ValueError, "0 at every time"),
        (pd.DataFrame({"t": [0], "gpus": [4]}), ValueError, r"missing \['time_s'\]"),
    ],
)
def test_bad_capacity(gpus, error, message):
    with pytest.raises(error, match=message):
        check_capacity(gpus)


def test_capacity_forms_agree():
    frame = pd.DataFrame({"time_s": [0.0, 100.0], "gpus": [8, 4]})
    assert check_capacity(frame) == check_capacity([(0, 8), (100, 4)]) == ((0.0, 8), (100.0, 4))
    assert check_capacity(16) == ((0.0, 16),)
    assert check_capacity([(50, 4)]) == ((0.0, 4),)  # the first count holds before its time


@pytest.mark.parametrize(
    "every, error, message",
    [
        (0, ValueError, "checkpoint_every_s=0.0 is invalid; it must be > 0"),
        (-5, ValueError, "checkpoint_every_s=-5.0 is invalid; it must be > 0"),
        (float("inf"), ValueError, "checkpoint_every_s=inf is invalid; it must be a finite number"),
        ("60", TypeError, "checkpoint_every_s must be a real number; got str '60'"),
    ],
)
def test_bad_checkpoint_interval(every, error, message):
    with pytest.raises(error, match=message):
        cluster.simulate(table(), 4, checkpoint_every_s=every, progress=False)


def test_bad_seed():
    with pytest.raises(TypeError, match="seed must be an integer"):
        cluster.simulate(table(), 4, seed=1.5, progress=False)


# --------------------------------------------------------------------------- capacity traces (step functions)
@pytest.mark.parametrize(
    "points, steps",
    [
        # two points per change, as spot traces are published: (t, old), (t, new)
        ([(0, 8), (10, 8), (10, 4), (20, 4), (20, 8)], ((0.0, 8), (10.0, 4), (20.0, 8))),
        ([(0, 8), (0, 4)], ((0.0, 4),)),  # the last count at a time holds
        ([(0, 8), (10, 4), (10, 2), (10, 6)], ((0.0, 8), (10.0, 6))),  # three at one time: the last holds
        ([(0, 8), (10, 4), (10, 8)], ((0.0, 8),)),  # a change undone at the same instant is no change
        ([(0, 8), (5, 8), (9, 8), (12, 2)], ((0.0, 8), (12.0, 2))),  # repeated counts are not changes
        ([(0, 4), (0, 0), (7, 0), (7, 2)], ((0.0, 0), (7.0, 2))),
    ],
)
def test_capacity_steps_are_deduplicated(points, steps):
    assert check_capacity(points) == steps
    frame = pd.DataFrame(points, columns=["time_s", "gpus"])
    assert check_capacity(frame) == steps


@pytest.mark.parametrize(
    "gpus, error, message",
    [
        ([(0, 8), (200, 4), (200, 6), (10, 2)], ValueError, r"gpus\[3\] time_s=10.0 is before gpus\[2\] time_s=200.0"),
        ([(0, 8), (10, 8), (10, -1)], ValueError, r"gpus\[2\] gpus=-1 is invalid; a capacity must be >= 0"),
        ([(0, 8), (float("inf"), 4)], ValueError, r"gpus\[1\] time_s=inf is invalid; it must be a finite number"),
        ([(0, 8), (float("nan"), 4)], ValueError, r"gpus\[1\] time_s=nan is invalid; it must be a finite number"),
        ([(0, 8), (3, float("nan"))], TypeError, r"gpus\[1\] gpus=nan is invalid; it must be a whole number"),
        ([(0, 4), (0, 0)], ValueError, "0 at every time"),  # the 4 is replaced at once
    ],
)
def test_bad_capacity_rows_are_named(gpus, error, message):
    with pytest.raises(error, match=message):
        check_capacity(gpus)


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_read_capacity_minutes_and_scale(tmp_path):
    path = write(tmp_path, "minute,instances\n0,4\n30,4\n30,2\n90,2\n90,4\n120,4\n")
    capacity = read_capacity(path, time_column="minute", gpus_column="instances", time_unit="min", scale=8)
    assert capacity["time_s"].tolist() == [0.0, 1800.0, 5400.0]
    assert capacity["gpus"].tolist() == [32, 16, 32]
    assert capacity["time_s"].dtype == np.float64 and capacity["gpus"].dtype == np.int64
    assert check_capacity(capacity) == ((0.0, 32), (1800.0, 16), (5400.0, 32))
    assert cluster.read_capacity is read_capacity
    hours = read_capacity(str(path), time_column="minute", gpus_column="instances", time_unit="h")
    assert hours["time_s"].tolist() == [0.0, 30 * 3600.0, 90 * 3600.0] and hours["gpus"].tolist() == [4, 2, 4]


def test_read_capacity_starts_at_the_first_time(tmp_path):
    path = write(tmp_path, "time_s,gpus\n1000,16\n1000,12\n1600,12\n1600,16\n")
    capacity = read_capacity(path)
    assert capacity["time_s"].tolist() == [0.0, 600.0] and capacity["gpus"].tolist() == [12, 16]


def test_read_capacity_datetimes(tmp_path):
    text = (
        "timestamp,gpus\n"
        "2024-03-01 08:00:00+00:00,64\n"
        "2024-03-01 09:30:00+00:00,64\n"
        "2024-03-01 09:30:00+00:00,48\n"
        "2024-03-01 11:00:00+01:00,48\n"  # 10:00 UTC: offsets are honoured
        "2024-03-01 11:00:00+01:00,64\n"
    )
    capacity = read_capacity(write(tmp_path, text), time_column="timestamp")
    assert capacity["time_s"].tolist() == [0.0, 5400.0, 7200.0]
    assert capacity["gpus"].tolist() == [64, 48, 64]
    frame = pd.DataFrame(
        {"when": pd.to_datetime(["2024-03-01 08:00", "2024-03-01 08:00", "2024-03-01 08:15"]), "n": [1, 2, 1]}
    )
    capacity = read_capacity(frame, time_column="when", gpus_column="n", scale=8)
    assert capacity["time_s"].tolist() == [0.0, 900.0] and capacity["gpus"].tolist() == [16, 8]


@pytest.mark.parametrize(
    "text, kwargs, error, message",
    [
        ("t,n\n0,4\n", {}, ValueError, r"missing the columns \['time_s', 'gpus'\]; it has \['t', 'n'\]"),
        ("time_s,n\n0,4\n", {}, ValueError, r"missing the columns \['gpus'\]; it has \['time_s', 'n'\]"),
        ("time_s,gpus\n", {}, ValueError, "the capacity trace has no rows"),
        ("", {}, ValueError, "is empty"),
        ("time_s,gpus\n0,4\n", {"time_unit": "days"}, ValueError, r"time_unit='days' is invalid; give one of \['s'"),
        ("time_s,gpus\n0,4\n", {"scale": 0}, ValueError, "scale=0.0 is invalid; it must be > 0"),
        ("time_s,gpus\n0,4\n10,many\n20,4\n", {}, ValueError, r"trace\['gpus'\]='many' at row 1 is not a number"),
        ("time_s,gpus\n0,4\n10,\n", {}, ValueError, r"trace\['gpus'\]=nan at row 1 is not a number"),
        ("time_s,gpus\n0,4\n10,-2\n", {}, ValueError, r"trace\['gpus'\]=-2 at row 1 is invalid; a count must be >= 0"),
        ("time_s,gpus\n0,4\n10,2.5\n", {}, ValueError, r"at row 1 is invalid; times scale=1 it is 2.5 GPUs"),
        ("time_s,gpus\n0,4\n200,2\n200,3\n100,4\n", {}, ValueError, r"\['time_s'\]=100 at row 3 is before row 2's 200"),
        ("time_s,gpus\n0,4\n,2\n", {}, ValueError, r"trace\['time_s'\]=nan at row 1 is invalid; a time must be finite"),
        ("time_s,gpus\n2024-01-01,4\nsoon,2\n", {}, ValueError, r"trace\['time_s'\]='soon' at row 1 is not a time"),
        ("time_s,gpus\n0,0\n5,0\n", {}, ValueError, "0 GPUs at every time"),
    ],
)
def test_read_capacity_errors(tmp_path, text, kwargs, error, message):
    with pytest.raises(error, match=message):
        read_capacity(write(tmp_path, text), **kwargs)


def test_read_capacity_needs_a_path_or_frame():
    with pytest.raises(TypeError, match="source must be a CSV path or a pandas DataFrame; got list"):
        read_capacity([(0, 4)])


#: The policies a capacity trace must give the same result for, raw or deduplicated.
CAPACITY_POLICIES = ("static", "elastic", "preemptive", "jct")

#: A 32-GPU cluster that falls to 8 GPUs at 3 h and to 12 at 6 h, published with two points per change,
#: a change undone at the same instant and a point that repeats the count.
RAW_TRACE = [
    (0.0, 32),
    (5000.0, 32),
    (10800.0, 32),
    (10800.0, 8),
    (14400.0, 8),
    (14400.0, 32),
    (18000.0, 32),
    (18000.0, 4),
    (18000.0, 32),
    (21600.0, 32),
    (21600.0, 12),
    (25200.0, 12),
    (25200.0, 32),
]
DEDUPLICATED = [(0.0, 32), (10800.0, 8), (14400.0, 32), (21600.0, 12), (25200.0, 32)]


@pytest.fixture(scope="module")
def forty_jobs():
    rng = np.random.default_rng(2025)
    return pd.DataFrame(
        {
            "submit_s": np.sort(rng.uniform(0.0, 24000.0, 40)).round(1),
            "gpus": rng.choice([1, 2, 4, 8], 40),
            "duration_s": rng.uniform(1800.0, 9000.0, 40).round(1),
        }
    )


@pytest.mark.parametrize("policy", CAPACITY_POLICIES)
def test_repeated_timestamps_simulate_as_the_deduplicated_trace(forty_jobs, policy):
    assert check_capacity(RAW_TRACE) == tuple(DEDUPLICATED)
    raw = cluster.simulate(forty_jobs, RAW_TRACE, policy=policy, checkpoint_every_s=1800.0, progress=False)
    frame = pd.DataFrame(RAW_TRACE, columns=["time_s", "gpus"])
    raw_frame = cluster.simulate(forty_jobs, frame, policy=policy, checkpoint_every_s=1800.0, progress=False)
    dedup = cluster.simulate(forty_jobs, DEDUPLICATED, policy=policy, checkpoint_every_s=1800.0, progress=False)
    for result in (raw, raw_frame):
        pd.testing.assert_frame_equal(result.jobs, dedup.jobs)
        pd.testing.assert_frame_equal(result.usage, dedup.usage)
    assert (dedup.usage["gpus_used"] <= dedup.usage["capacity"]).all()
    assert dedup.usage["capacity"].min() == 8  # the drop is in the result
    if policy == "preemptive":
        assert dedup.jobs["preemptions"].sum() > 0  # the drops take GPUs from running jobs


def test_read_capacity_trace_simulates_as_the_deduplicated_trace(tmp_path, forty_jobs):
    text = "hour,instances\n" + "".join(f"{t / 3600:g},{n // 4}\n" for t, n in RAW_TRACE)
    capacity = read_capacity(write(tmp_path, text), time_column="hour", gpus_column="instances", time_unit="h", scale=4)
    assert list(capacity.itertuples(index=False, name=None)) == DEDUPLICATED
    a = cluster.simulate(forty_jobs, capacity, policy="preemptive", progress=False)
    b = cluster.simulate(forty_jobs, DEDUPLICATED, policy="preemptive", progress=False)
    pd.testing.assert_frame_equal(a.jobs, b.jobs)


def test_read_capacity_numbers_held_as_objects_and_timedeltas():
    as_objects = pd.DataFrame({"time_s": pd.Series([0, 1800, 5400], dtype=object), "gpus": [8, 4, 8]})
    assert cluster.read_capacity(as_objects)["time_s"].tolist() == [0.0, 1800.0, 5400.0]
    as_timedeltas = pd.DataFrame({"time_s": pd.to_timedelta([0, 30, 90], unit="min"), "gpus": [8, 4, 8]})
    assert cluster.read_capacity(as_timedeltas)["time_s"].tolist() == [0.0, 1800.0, 5400.0]
