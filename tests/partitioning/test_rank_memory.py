"""A partition's predicted memory per rank: terms, micro-batch scaling, the optimizer, the profile's own bytes."""

import pytest

from pipeswift_lab.core.memory_model import MEMORY_TERMS, OptimizerMemory
from pipeswift_lab.models import reference
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.rank_memory import RANK_MEMORY_COLUMNS
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile


@pytest.fixture(scope="module")
def gpt():
    setup = reference("gpt", batch_size=2, vocab_size=1024, seq_len=16, d_model=32)
    return profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, repeats=1, progress=False)


def test_terms_add_up_and_the_last_rank_holds_the_loss(gpt):
    part = partition(gpt, 2, schedule="1F1B", m=4)
    mem = part.memory()
    assert list(mem.columns) == [*RANK_MEMORY_COLUMNS, *(f"{t}_before_backward_bytes" for t in MEMORY_TERMS)]
    before = mem[[f"{t}_before_backward_bytes" for t in MEMORY_TERMS]]
    assert (before.sum(axis=1) <= mem["predicted_peak_bytes"]).all() and (
        before["transient_before_backward_bytes"] == 0
    ).all()
    terms = mem[["weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes"]]
    assert (terms.sum(axis=1) + mem["transient_bytes"]).tolist() == pytest.approx(mem["predicted_peak_bytes"].tolist())
    assert part.rank_mem_bytes == tuple(mem["predicted_peak_bytes"])
    assert mem["weights_bytes"].tolist() == [sum(part.stage_param_bytes[s] for s in st) for st in mem["stages"]]
    # the last stage keeps, per micro-batch, the logits (2 x 16 x 1024 floats) and the loss's log-softmax as big
    logits = 2 * 16 * 1024 * 4
    assert gpt.meta["loss_activation_bytes"] >= logits and gpt.df["output_bytes"].iloc[-1] == logits


def test_activations_scale_with_the_micro_batch_and_weights_do_not(gpt):
    part = partition(gpt, 2, schedule="GPipe", m=4)
    small, large = part.memory(micro_batch_size=2), part.memory(micro_batch_size=8)
    assert (large["weights_bytes"] == small["weights_bytes"]).all()
    at_first_backward = (small["peak_at"] == "B stage 0 mb 0") & (large["peak_at"] == small["peak_at"])
    assert (
        large.loc[at_first_backward, "activations_bytes"] == 4 * small.loc[at_first_backward, "activations_bytes"]
    ).all()
    assert (large["predicted_peak_bytes"] > small["predicted_peak_bytes"]).all()


def test_the_optimizer_counts(gpt):
    part = partition(gpt, 2, m=2)
    sgd = part.memory(optimizer="sgd")
    adam = part.memory(optimizer="adam")
    assert (sgd["optimizer_bytes"] == 0).all() and (adam["optimizer_bytes"] == 2 * adam["weights_bytes"]).all()
    fused = part.memory(optimizer=OptimizerMemory(states=2.0, name="AdamW (fused)"))
    assert (fused["predicted_peak_bytes"] <= adam["predicted_peak_bytes"]).all()
    with pytest.raises(ValueError, match="optimizer='lion' is not one of"):
        part.memory(optimizer="lion")


def test_a_profile_without_memory_columns_has_no_prediction():
    part = partition(Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[1.0, 1.0]).df[["fwd_ms", "bwd_ms"]], 2)
    assert all(x != x for x in part.rank_mem_bytes)  # NaN
