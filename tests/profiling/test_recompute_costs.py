"""What the profiler measures of recomputation and of bf16 autocast, and a profile as its layers cost recomputed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.recompute_costs import FORWARD_COLUMNS, RECOMPUTE_COLUMNS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H, B, T = 32, 128, 2, 16


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = nn.Sequential(*[FFN() for _ in range(3)])
    x, y = torch.randn(B, T, D), torch.randn(B, T, D)
    return model, x, y, profile(model, x, target=y, loss_fn=F.mse_loss, warmup=1, repeats=3, progress=False,
                                recompute=True)  # fmt: skip


HIDDEN, WIDE = B * T * D * 4, B * T * H * 4


def test_each_layer_keeps_less_recomputed(measured):
    _, _, _, prof = measured
    df = prof.df
    added = [*RECOMPUTE_COLUMNS, *FORWARD_COLUMNS.values(), "full_weight_pass_bytes", "selective_weight_pass_bytes"]
    assert set(added) <= set(df.columns)
    # plain: up's and GELU's outputs and the block's own (the next block's input); full: only the block's output,
    # which the next (recomputed) block keeps as its input; selective: the matrix multiplications' results too (up's
    # and down's), GELU's output recomputed
    assert df["activation_bytes"].tolist() == [2 * WIDE + HIDDEN] * 3
    assert df["full_activation_bytes"].tolist() == [HIDDEN] * 3
    assert df["selective_activation_bytes"].tolist() == [WIDE + 2 * HIDDEN] * 3
    assert (df["recompute_ms"] >= 0).all() and (df["selective_recompute_ms"] >= 0).all()
    assert (df["full_transient_bytes"] > df["accumulate_transient_bytes"]).all()  # the backward makes them again
    # torch's I pass keeps the gradients at up's and down's outputs for W (down's is the block's output gradient,
    # passed on by the residual add); the first block is fed the batch, which requires no gradient: no I
    assert df["weight_pass_bytes"].tolist() == [0, WIDE + HIDDEN, WIDE + HIDDEN]
    # while it runs it holds at once the gradient it was given, down's input gradient and GELU's (kept for up's W);
    # recomputed, what it recomputed as well
    assert df["input_pass_peak_bytes"].tolist() == [0, 2 * WIDE + HIDDEN, 2 * WIDE + HIDDEN]
    assert (df["full_input_pass_peak_bytes"] > df["input_pass_peak_bytes"]).iloc[1:].all()
    # each pass timed with torch's own functions on the layer alone; none for the first, which has no I
    assert df["input_pass_ms"].isna().tolist() == [True, False, False]
    assert (df["input_pass_ms"].iloc[1:] > 0).all() and (df["weight_pass_ms"].iloc[1:] > 0).all()


def test_a_profile_as_its_layers_cost_recomputed(measured):
    _, _, _, prof = measured
    full = prof.with_recompute("full")
    assert full.df["activation_bytes"].tolist() == prof.df["full_activation_bytes"].tolist()
    assert full.df["bwd_ms"].tolist() == pytest.approx((prof.df["bwd_ms"] + prof.df["recompute_ms"]).tolist())
    assert full.df["fwd_ms"].tolist() == pytest.approx((prof.df["fwd_ms"] + prof.df["recompute_forward_ms"]).tolist())
    assert full.df["weight_pass_bytes"].tolist() == prof.df["weight_pass_bytes"].tolist()  # I holds them
    one = prof.with_recompute({"0": "selective"})
    assert one.df["activation_bytes"].tolist() == [WIDE + 2 * HIDDEN, 2 * WIDE + HIDDEN, 2 * WIDE + HIDDEN]
    assert one.meta["recompute"] == {"0": "selective"} and prof.with_recompute(None) is prof
    # a split's memory follows: the first rank of 1F1B holds two micro-batches, each a third smaller per layer here
    plain, less = (Partition.from_bounds(p, [(0, 2), (2, 3)], schedule="1F1B", m=4).memory() for p in (prof, full))
    assert (less["activations_bytes"] < plain["activations_bytes"]).all()


def test_recomputation_asked_of_a_profile_without_it_or_wrongly_is_refused(measured):
    model, x, y, prof = measured
    plain = profile(model, x, target=y, loss_fn=F.mse_loss, warmup=0, repeats=1, progress=False)
    with pytest.raises(ValueError, match=r"profile\(\.\.\., recompute=True\)"):
        plain.with_recompute("full")
    with pytest.raises(ValueError, match="recompute mode 'some' is not one of"):
        prof.with_recompute({"0": "some"})
    with pytest.raises(ValueError, match="recompute names 'blocks.0', which matches no layer"):
        prof.with_recompute({"blocks.0": "full"})


def test_bf16_autocast_profiles_what_autocast_keeps():
    torch.manual_seed(0)
    model = nn.Sequential(*[FFN() for _ in range(2)])
    x, y = torch.randn(B, T, D), torch.randn(B, T, D)
    fp32 = profile(model, x, target=y, loss_fn=F.mse_loss, warmup=0, repeats=1, progress=False)
    bf16 = profile(model, x, target=y, loss_fn=F.mse_loss, warmup=0, repeats=1, progress=False, precision="bf16-mixed")
    assert bf16.meta["precision"] == "bf16-mixed" and fp32.meta["precision"] == "fp32"
    # the matmuls' results are bf16, and autocast keeps a bf16 copy of each weight for the backward (half its bytes):
    # at this small a micro-batch the copies outweigh what the activations save
    copies = bf16.df["param_bytes"] / 2
    assert (bf16.df["activation_bytes"] - copies < fp32.df["activation_bytes"]).all()
    assert (bf16.df["activation_bytes"] >= copies).all()
    with pytest.raises(ValueError, match=r"precision='fp16' is not one of \['fp32', 'bf16-mixed'\]"):
        profile(model, x, target=y, loss_fn=F.mse_loss, progress=False, precision="fp16")
