"""The replay of a rank's actions: which moment is the peak, and what each term is there."""

import pytest

from pipeswift_lab.core.memory_model import OptimizerMemory, StageBytes, default_optimizer_memory, rank_peak
from pipeswift_lab.core.schedule_orders import compute_orders

SGD = OptimizerMemory(states=0.0)


def stage(**kw):
    base = dict(weights=100.0, grads=100.0, optimizer=0.0, activations=10.0, transient=5.0, first_transient=105.0)
    return StageBytes(**{**base, **kw})


def test_gpipe_holds_every_micro_batch_and_1f1b_only_its_warm_up():
    order = compute_orders(2, 8, "GPipe")[0]
    peak = rank_peak({0: stage()}, order, 8, SGD)
    # the first backward: all 8 micro-batches held, the gradients growing (first_transient), no .grad yet
    assert peak["peak_at"] == "B stage 0 mb 0" and peak["activations_bytes"] == 80 and peak["grads_bytes"] == 0
    assert peak["peak_bytes"] == 100 + 80 + 105
    one_f_one_b = rank_peak({0: stage()}, compute_orders(2, 8, "1F1B")[0], 8, SGD)
    # rank 0 of P=2 holds 2 micro-batches; later backwards add 5 to the gradients already there
    assert one_f_one_b["activations_bytes"] == 20
    assert one_f_one_b["peak_bytes"] == max(100 + 20 + 105, 100 + 100 + 20 + 5)


def test_zero_bubble_keeps_activations_until_the_weight_gradient():
    order = compute_orders(2, 4, "InterleavedZeroBubble", v=2)[1]
    bare = dict(grads=0.0, transient=0.0, first_transient=0.0)
    peak = rank_peak({1: stage(**bare), 3: stage(**bare)}, order, 4, SGD)  # rank 1 holds stages 1 and 3

    def most_held(released_by):
        held, most = 0, 0
        for kind, _, _ in order:
            held += kind == "F"
            most = max(most, held)
            held -= kind in released_by
        return most

    assert peak["peak_bytes"] == 100 + 100 + 10 * most_held(("B", "W"))  # both stages' weights, chunks until W
    assert most_held(("B", "W")) > most_held(("B", "I"))  # released at I instead, it would be less


def test_the_optimizer_step_can_be_the_peak():
    adam = OptimizerMemory(states=2.0, per_largest=2.0)
    peak = rank_peak({0: stage(largest_param=60.0, optimizer=200.0)}, compute_orders(2, 2, "1F1B")[0], 2, adam)
    assert peak["peak_at"] == "optimizer step"
    assert peak["peak_bytes"] == 100 + 100 + 200 + 2 * 60
    assert peak["transient_bytes"] == 120 and peak["activations_bytes"] == 0


def test_receive_buffers_and_ddp_buckets_are_held_all_step():
    peak = rank_peak({1: stage(recv=3.0, grad_recv=2.0, buckets=100.0)}, compute_orders(2, 4, "1F1B")[1], 4, SGD)
    # 4 micro-batches of input and output-gradient buffers, the input gradients made so far, the buckets
    assert peak["buffers_bytes"] >= 4 * (3 + 2) + 100


def test_default_optimizer_memory_follows_torch_defaults():
    assert default_optimizer_memory("adam", "cuda").per_total == 1.0
    cpu = default_optimizer_memory("adamw", "cpu")
    assert cpu.states == 2 and cpu.per_largest == pytest.approx(5 / 3) and cpu.per_total == pytest.approx(1 / 3)
    assert default_optimizer_memory("sgd").transient(10, 100) == 0
    assert default_optimizer_memory("sgd_momentum").states == 1
