"""Writes ``tests/file_seconds.json``, each test file's and notebook's seconds in one run, from that run's JUnit XML::

    pytest --junitxml=/tmp/junit.xml && python tests/file_seconds.py /tmp/junit.xml

The root ``conftest.py`` hands the files to the xdist workers longest first (longest-processing-time-first
scheduling), so that no long file starts last while the other workers idle; a file missing from the record counts as
the median. A stale record only orders the files less well.
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def file_of(classname: str) -> str:
    """A JUnit classname's file: ``tests.runner.test_job`` is ``tests/runner/test_job.py``, ``notebooks.04_x.ipynb``
    is ``notebooks/04_x.ipynb``."""
    if classname.endswith(".ipynb"):
        folder, _, name = classname.partition(".")
        return f"{folder}/{name}"
    return classname.replace(".", "/") + ".py"


def main(junit: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        seconds[file_of(case.get("classname", ""))] += float(case.get("time", 0.0))
    record = {name: round(s, 1) for name, s in sorted(seconds.items())}
    Path(__file__).with_name("file_seconds.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
