"""Asking whether a model is a Hugging Face one (pipeswift_lab/runner/hf_conversion.py) answers without importing
transformers where the session has not: a run of a plain model neither imports it nor has the fork server preload
it."""

import subprocess
import sys

import pytest
from tiny_transformers import llama

from pipeswift_lab.models import gpt
from pipeswift_lab.runner.hf_conversion import is_hf_model


def test_a_plan_of_a_plain_model_does_not_import_transformers():
    script = (
        "import sys, torch\n"
        "from pipeswift_lab.models import reference\n"
        "from pipeswift_lab.partitioning.stages import Partition\n"
        "from pipeswift_lab.profiling.table import Profile\n"
        "from pipeswift_lab.runner import make_spec\n"
        "setup = reference('gpt', batch_size=4, vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4)\n"
        "part = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)])\n"
        "make_spec(setup.model, (setup.inputs, setup.targets), setup.loss_fn, part, 2)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_hugging_face_model_is_told_apart():
    pytest.importorskip("transformers")
    assert is_hf_model(llama())
    assert not is_hf_model(gpt(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4))
