"""One reconciliation of partition x schedule x v x m: what the simulator, the sweep and the runner accept."""

from types import SimpleNamespace

import pandas as pd
import pytest

from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation import Reconciled, reconcile
from pipeswift_lab.simulation.simulator import simulate

PROFILE = Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8)


def test_the_defaults_follow_the_partition():
    one = reconcile(partition(PROFILE, 2))
    assert one == Reconciled(schedule="1F1B", v=1, P=2, m=None, placement=(0, 1))
    two = reconcile(partition(PROFILE, 2, v=2), m=4)
    assert (two.schedule, two.v, two.P, two.m, two.placement, two.S) == ("Interleaved1F1B", 2, 2, 4, (0, 1, 0, 1), 4)
    vee = reconcile(partition(PROFILE, 2, v=2, schedule="ZBVZeroBubble"))
    assert vee.schedule == "ZBVZeroBubble" and vee.placement == (0, 1, 1, 0)
    # a partition without a schedule of its own (any object with P, v and stage_to_rank) takes partition()'s default
    assert reconcile(SimpleNamespace(P=2, v=2, stage_to_rank=(0, 1, 0, 1))).schedule == "Interleaved1F1B"


def test_a_schedule_of_the_same_placement_runs_unless_the_same_schedule_is_required():
    interleaved = partition(PROFILE, 2, v=2, schedule="Interleaved1F1B")
    assert reconcile(interleaved, "loopedbfs").schedule == "LoopedBFS"
    assert reconcile(partition(PROFILE, 2, schedule="1F1B"), "GPipe").schedule == "GPipe"
    with pytest.raises(ValueError, match=r"schedule='GPipe' differs from the partition's schedule '1F1B'"):
        reconcile(partition(PROFILE, 2, schedule="1F1B"), "GPipe", same_schedule=True)


def test_every_disagreement_names_the_fix():
    interleaved = partition(PROFILE, 2, v=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match=r"v=2 is not allowed for schedule='1F1B', which runs one stage per rank"):
        reconcile(interleaved, "1F1B")
    with pytest.raises(ValueError, match=r"re-partition with partition\(profile, 2, v=1, schedule='GPipe'\)"):
        reconcile(interleaved, "GPipe")
    with pytest.raises(ValueError, match="v=3 does not match the partition's v=2"):
        reconcile(interleaved, v=3)
    with pytest.raises(ValueError, match=r"places stages on ranks as \[0, 1, 1, 0\] but the partition"):
        reconcile(interleaved, "ZBVZeroBubble")
    looped = partition(PROFILE, 2, v=4, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match="exactly 2 stages per rank in a V"):
        reconcile(looped, "DualPipeV")
    with pytest.raises(ValueError, match="Schedule1F1B needs m >= P"):
        reconcile(partition(PROFILE, 4), m=2)
    with pytest.raises(TypeError, match="list has no 'P'"):
        reconcile([1, 2])
    with pytest.raises(TypeError, match="partition.P must be an integer"):
        reconcile(SimpleNamespace(P=2.0, v=1, stage_to_rank=(0, 1)))
    with pytest.raises(ValueError, match="stage_to_rank has 3 stages"):
        reconcile(SimpleNamespace(P=2, v=1, stage_to_rank=(0, 1, 0)))


def test_a_stage_table_gets_its_shape_from_its_rows():
    table = pd.DataFrame({"fwd_ms": [1.0] * 4, "bwd_ms": [2.0] * 4})
    assert reconcile(table).placement == (0, 1, 2, 3)
    assert reconcile(table, "DualPipeV", m=4).placement == (0, 1, 1, 0)
    assert reconcile(table, "Interleaved1F1B", v=2).P == 2
    with pytest.raises(ValueError, match="needs v"):
        reconcile(table, "Interleaved1F1B")
    with pytest.raises(ValueError, match="a positive multiple of 3"):
        reconcile(table, "Interleaved1F1B", v=3)


def test_the_simulator_gives_the_reconciliations_messages():
    interleaved = partition(PROFILE, 2, v=2, schedule="Interleaved1F1B")
    for schedule in ("1F1B", "ZBVZeroBubble"):
        with pytest.raises(ValueError) as simulated:
            simulate(interleaved, 4, schedule)
        with pytest.raises(ValueError) as reconciled:
            reconcile(interleaved, schedule, m=4)
        assert str(simulated.value) == str(reconciled.value)
