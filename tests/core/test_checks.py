"""Tests for pipeswift_lab.core.checks and core.vocabulary: the one place arguments are checked, and the names and
placements of torch's schedules."""

from enum import Enum

import pytest

from pipeswift_lab.core import JCT, bubble_ratio
from pipeswift_lab.core.checks import check_choice, check_flag, check_fraction, check_int, check_time
from pipeswift_lab.core.vocabulary import accepts, canonical_schedule, stage_to_rank


class Color(str, Enum):
    RED = "red"
    BLUE = "blue"


def test_numbers_are_returned_converted_and_refused_with_the_argument_named():
    assert check_int("P", 4, minimum=1) == 4 and check_time("t", 2) == 2.0 and check_fraction("f", 1) == 1.0
    with pytest.raises(TypeError, match="P must be an integer; got bool True"):
        check_int("P", True)
    with pytest.raises(ValueError, match="P=9 is invalid; it must be <= 8"):
        check_int("P", 9, maximum=8)
    with pytest.raises(ValueError, match="t=0.0 is invalid; it must be > 0"):
        check_time("t", 0, allow_zero=False)
    with pytest.raises(ValueError, match="f=1.0 is invalid; it is a fraction and must be < 1"):
        check_fraction("f", 1.0, allow_one=False)
    with pytest.raises(TypeError, match="progress must be True or False; got int 1"):
        check_flag("progress", 1)


def test_choices_name_the_valid_spellings():
    assert check_choice("color", "red", ("red", "blue")) == "red"
    assert check_choice("color", Color.BLUE, Color) == "blue"  # a member reads as its value
    with pytest.raises(ValueError, match=r"color='green' is not known; valid values are \['red', 'blue'\]"):
        check_choice("color", "green", Color)
    with pytest.raises(ValueError, match=r"valid colors are \['red', 'blue'\] or None \(no color\)"):
        check_choice("color", "green", ("red", "blue"), noun="colors", hint=" or None (no color)")
    with pytest.raises(TypeError, match="color must be a str"):
        check_choice("color", 3, ("red", "blue"))


def test_schedule_names_are_matched_as_torch_spells_them():
    assert canonical_schedule("ScheduleInterleaved1F1B") == "Interleaved1F1B"
    assert canonical_schedule("schedule_1f1b") == canonical_schedule("1F1B") == "1F1B"
    assert canonical_schedule("dualpipe-v") == "DualPipeV"
    with pytest.raises(ValueError, match="schedule='Pipedream' is not known"):
        canonical_schedule("Pipedream")


def test_stages_go_to_ranks_round_robin_or_in_a_v():
    assert stage_to_rank(3, 2) == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank(3, 2, "ZBVZeroBubble") == (0, 1, 2, 2, 1, 0)
    assert accepts(4, 8, "1F1B") and not accepts(4, 2, "1F1B") and not accepts(2, 3, "DualPipeV", v=2)


def test_the_room_docstring_example():
    assert bubble_ratio(P=4, m=8) == pytest.approx(3 / 11)
    assert JCT(queue_s=600, training_s=7200).total_s == 7800.0


def test_moved_keywords_names_the_new_home_and_keeps_warnings_at_the_callers_line():
    import warnings

    from pipeswift_lab.core.checks import moved_keywords

    @moved_keywords({"old": "new=Record(old=...)"})
    def verb(new=None):
        warnings.warn("to the caller", UserWarning, stacklevel=2)
        warnings.warn("from inside", RuntimeWarning, stacklevel=1)
        return new

    with pytest.raises(TypeError, match=r"verb\(\) got the keyword \['old'\]: old= is now new=Record\(old=...\)"):
        verb(old=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert verb(new=3) == 3
    assert [(type(w.message), w.filename) for w in caught] == [(UserWarning, __file__), (RuntimeWarning, __file__)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert verb(new=4) == 4  # the caller's filters still decide
