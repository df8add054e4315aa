"""Small hand-built job tables for the cluster tests, and results indexed by job name."""

import pandas as pd


def jobs(*rows, **extra):
    """A job table from (submit_s, gpus, duration_s) rows; keyword arguments add columns."""
    df = pd.DataFrame(rows, columns=["submit_s", "gpus", "duration_s"])
    for k, v in extra.items():
        df[k] = v
    return df


def by_name(result):
    """A ClusterResult's jobs indexed by name."""
    return result.jobs.set_index("name")
