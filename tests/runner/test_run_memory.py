"""Measured memory in every run, against the memory model's prediction for that run.

Real runs (gloo, one CPU process per rank) of the reference GPT at a fixed micro-batch of 2 sequences, so a step
of m micro-batches holds more the larger m is under GPipe and not under 1F1B; a Hugging Face Llama, Mixtral and
Qwen2-MoE. The tensor
level measure (every storage alive in the second step, :mod:`pipeswift_lab.runner.rank.memory_probe`) must be
within 10% of the prediction on every rank.
"""

import pytest
import torch
import torch.nn.functional as F

from pipeswift_lab import Checkpointing, Launch
from pipeswift_lab.models import reference
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import run

MICRO = 2
GPT = dict(vocab_size=2048, seq_len=32, d_model=64, n_layers=4)
TOLERANCE = 0.10

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.fixture(scope="module")
def gpt_profile():
    setup = reference("gpt", batch_size=MICRO, **GPT)
    return profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, repeats=2, progress=False)


#: The grid's run that test_compare_reports_memory_and_the_probed_step_is_not_the_steady_one reads too: four steps
#: (the probed step 1 and two steady ones after the warm-up step), the others two
COMPARED = ("1F1B", 4)


def run_gpt(prof, schedule, m, P=2):
    setup = reference("gpt", batch_size=MICRO * m, **GPT)
    v = 2 if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1
    part = partition(prof, P, v=v, schedule=schedule, m=m)
    batch = (setup.inputs, setup.targets)
    steps = 4 if (schedule, m) == COMPARED else 2
    return run(setup.model, batch, setup.loss_fn, part, m, schedule=schedule, steps=steps, optimizer=adam,
               progress=False)  # fmt: skip


def gpt_run(prof, runs, schedule, m):
    """The grid's run of ``(schedule, m)``, from ``runs`` (the module's) or run now and kept there."""
    if (schedule, m) not in runs:
        runs[(schedule, m)] = run_gpt(prof, schedule, m)
    return runs[(schedule, m)]


def assert_predicted_within_tolerance(result):
    memory = result.memory
    assert len(memory) == result.P * result.D
    assert memory["measured_peak_bytes"].gt(0).all() and memory["predicted_peak_bytes"].gt(0).all()
    worst = memory.loc[memory["error"].abs().idxmax()]
    assert abs(worst["error"]) <= TOLERANCE, memory[["rank", "measured_peak_bytes", "predicted_peak_bytes", "peak_at"]]
    # each rank holds its own stages' weights only (the rest of the model is released in the worker), exactly as
    # predicted, with gradients and Adam's two moments of the same size
    assert (memory["state_param_bytes"] == memory["weights_bytes"]).all()
    assert (memory["state_optimizer_bytes"] == 2 * memory["state_param_bytes"]).all()
    assert memory["resident_peak_bytes"].gt(0).all()


GRID = [(schedule, m) for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble") for m in (2, 4, 8)]


@pytest.fixture(scope="module")
def gpt_runs(gpt_profile):
    return {}


@pytest.mark.parametrize("schedule, m", GRID)
def test_measured_peak_per_rank_is_predicted_within_10_percent(gpt_profile, gpt_runs, schedule, m):
    result = gpt_run(gpt_profile, gpt_runs, schedule, m)
    assert_predicted_within_tolerance(result)
    assert result.memory["probed_step"].eq(1).all()


def test_a_zero_bubble_input_pass_through_many_layers():
    """torch's I pass keeps the stage's graph for W: through a last stage of every block it frees nothing as it goes
    and holds each block's kept gradients beside the next block's pass, where the fullest rank peaks (predicted
    from each layer's whole backward, as if it freed what it had read, it was 19% low)."""
    shape = dict(vocab_size=256, seq_len=128, d_model=64, n_layers=4)  # activations outweigh the training state
    micro = reference("gpt", batch_size=4, **shape)
    prof = profile(micro.model, micro.inputs, target=micro.targets, loss_fn=micro.loss_fn, repeats=1, progress=False)
    setup = reference("gpt", batch_size=4 * 4, **shape)
    n = len(prof.df)
    part = Partition.from_bounds(prof, [(0, 1), (1, 2), (2, 3), (3, n)], v=2, schedule="ZBVZeroBubble", m=4)
    result = run(setup.model, (setup.inputs, setup.targets), setup.loss_fn, part, 4, steps=2, optimizer=adam,
                 progress=False)  # fmt: skip
    assert_predicted_within_tolerance(result)
    first = result.memory.set_index("rank").loc[0]  # ZBV's rank 0 holds the first stage and the last
    assert first["measured_peak_at"].startswith("I stage 3") and first["peak_at"].startswith("I stage 3")


def test_gpipe_first_rank_grows_with_m_and_1f1b_does_not(gpt_profile, gpt_runs):
    def first_rank(schedule, m):
        result = gpt_run(gpt_profile, gpt_runs, schedule, m)
        return float(result.memory.set_index("rank").loc[0, "measured_peak_bytes"])

    gpipe = [first_rank("GPipe", m) for m in (2, 4, 8)]
    ofob = [first_rank("1F1B", m) for m in (2, 4, 8)]
    assert gpipe[0] < gpipe[1] < gpipe[2]
    # 1F1B's rank 0 holds P = 2 micro-batches' activations whatever m is; only its m receive buffers grow
    assert ofob[2] - ofob[0] < 0.2 * (gpipe[2] - gpipe[0])
    # at m = 8 GPipe holds six micro-batches' activations more than 1F1B: most of what it gained from m = 2 (the
    # weights and optimizer state are the same, and their share depends on the split the measured profile gives)
    assert gpipe[2] - ofob[2] > 0.7 * (gpipe[2] - gpipe[0])


def test_the_rank_with_the_lm_head_and_loss_is_fullest():
    # a model that makes it so: a wide vocabulary on narrow blocks, so that the head's logits, the loss's softmax and
    # their gradients (8 MiB each at 4 sequences of 64 tokens) outweigh everything the other rank holds
    shape = dict(vocab_size=8192, seq_len=64, d_model=64, n_layers=4)
    setup = reference("gpt", batch_size=4 * 8, **shape)
    prof = profile(
        setup.model, setup.inputs[:4], target=setup.targets[:4], loss_fn=setup.loss_fn, repeats=2, progress=False
    )
    part = partition(prof, 2, schedule="1F1B", m=8)
    result = run(
        setup.model, (setup.inputs, setup.targets), setup.loss_fn, part, 8, steps=2, optimizer=adam, progress=False
    )
    memory = result.memory.set_index("rank")
    head_rank = result.meta["stage_to_rank"][-1]
    assert memory["measured_peak_bytes"].idxmax() == head_rank == memory["predicted_peak_bytes"].idxmax()
    assert memory.loc[head_rank, "activations_bytes"] >= 2 * 4 * 64 * 8192 * 4  # the logits and their softmax
    assert memory["error"].abs().max() <= TOLERANCE


def test_four_ranks(gpt_profile):
    setup = reference("gpt", batch_size=MICRO * 4, **{**GPT, "n_layers": 6})
    prof = profile(
        setup.model,
        setup.inputs[:MICRO],
        target=setup.targets[:MICRO],
        loss_fn=setup.loss_fn,
        repeats=2,
        progress=False,
    )
    part = partition(prof, 4, schedule="1F1B", m=4)
    result = run(
        setup.model, (setup.inputs, setup.targets), setup.loss_fn, part, 4, steps=2, optimizer=adam, progress=False
    )
    assert_predicted_within_tolerance(result)


@pytest.mark.parametrize("family", ["Llama", "Mixtral", "Qwen2Moe"])
def test_a_hugging_face_model_dense_or_mixture_of_experts(family):
    """The same tolerance for a dense Llama and two mixture-of-experts families (whose experts hold their weights
    fused and route each token to two of four: activations the profile measured as they fell)."""
    pytest.importorskip("transformers")
    from model_zoo import build
    from tiny_transformers import VOCAB

    model = build(family)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (8, 16), generator=g), torch.randint(0, VOCAB, (8, 16), generator=g)

    def lm_loss(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    prof = profile(model, x[:2], target=y[:2], loss_fn=lm_loss, layers="auto", repeats=2, progress=False)
    part = partition(prof, 2, schedule="1F1B", m=4)
    result = run(model, (x, y), lm_loss, part, 4, steps=2, optimizer=adam, progress=False)
    memory = result.memory
    assert memory["error"].abs().max() <= TOLERANCE, memory


def test_an_uninstrumented_run_measures_nothing(gpt_profile):
    setup = reference("gpt", batch_size=MICRO * 2, **GPT)
    part = partition(gpt_profile, 2, m=2)
    result = run(
        setup.model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        2,
        steps=2,
        launch=Launch(instrument=False),
        progress=False,
    )
    assert result.memory.empty


def test_compare_reports_memory_and_the_probed_step_is_not_the_steady_one(gpt_profile, gpt_runs):
    from pipeswift_lab.fidelity.comparison import compare
    from pipeswift_lab.simulation.simulator import simulate

    part = partition(gpt_profile, 2, schedule="1F1B", m=4)
    result = gpt_run(gpt_profile, gpt_runs, *COMPARED)  # the grid's run of this partition, four steps
    assert len(result.step_ms) == 4
    assert result.probed_steps == (1,) and result.steady_step in (2, 3)
    whole = result.step_stats().iloc[-1]  # the warm-up step and the probed one left out: steps 2 and 3
    assert whole["steps"] == 2 and whole["first_step"] == 2
    memory = compare(simulate(part, 4), result).memory
    assert memory["rank"].tolist() == [0, 1]
    assert memory["measured"].tolist() == result.memory["measured_peak_bytes"].tolist()
    assert memory["predicted"].tolist() == result.memory["predicted_peak_bytes"].tolist()
    assert (memory["rel_error"].abs() <= TOLERANCE).all()


def test_a_run_with_checkpoints_holds_one_staged_copy_of_its_training_state(gpt_profile, gpt_runs, tmp_path):
    setup = reference("gpt", batch_size=MICRO * 4, **GPT)
    part = partition(gpt_profile, 2, schedule="1F1B", m=4)
    saving = run(
        setup.model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        4,
        steps=2,
        optimizer=adam,
        progress=False,
        checkpoint=Checkpointing(tmp_path, every=1),
    )
    assert_predicted_within_tolerance(saving)
    memory = saving.memory.set_index("rank")
    staged = memory["checkpoint_staging_bytes"]
    assert (staged == memory["weights_bytes"] + memory["optimizer_bytes"]).all()
    plain = gpt_run(gpt_profile, gpt_runs, "1F1B", 4).memory.set_index("rank")["measured_peak_bytes"]
    grown = memory["measured_peak_bytes"] - plain  # the staging buffer, allocated before the first step
    assert ((grown - staged).abs() <= 0.1 * staged).all(), (grown, staged)
