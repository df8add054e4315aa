"""Models built on the meta device, run as pipelines in which each rank makes and fills only its own stages.

Every run is real (gloo worker processes). A meta model given ``weights=`` must train as single-process training of
the same weights loaded eagerly does, within 1e-6: an ``nn.Sequential`` (bit for bit), a traced Hugging Face Llama
from sharded safetensors, ``split="manual"``, tied embeddings, a DCP directory and one of the toolkit's checkpoints.
Those comparisons use SGD: summing micro-batches rounds differently from one batch (below 1e-8 here), and Adam's
normalized step makes that 1e-7 to 1e-6 after two steps, whatever builds the stages. Adam's own path through a meta
model is compared with the eager run's, bit for bit (replicas, recomputation, bf16) and with a resume.
Without weights each rank initializes its stage seeded by name, so P=2 and P=4 start from the same tensors.
"""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_transformers import M, adam, llama, lm_loss, qwen2, single_process, tokens
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.units import auto_units
from pipeswift_lab.runner import run
from pipeswift_lab.runner.weights import INDEX_FILE

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

transformers = pytest.importorskip("transformers")

PROFILE6 = psl.Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6)


def model6():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])


def on_meta(build, *args):
    with torch.device("meta"):
        return build(*args)


def batch(step):
    return torch.randn(8, 8), torch.randn(8, 8)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def worst(result, want):
    got = result.state_dict()
    assert list(got) == list(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def sharded(directory, state, shards=3):
    """``state`` written as Hugging Face writes a large model: shards and ``model.safetensors.index.json``."""
    keys = list(state)
    directory.mkdir()
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k].contiguous() for k in part}, str(directory / name))
        weight_map.update({k: name for k in part})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def eager_and_meta(tmp_path, part, **options):
    """The eager ``model6()`` run, and the same run of it built on meta and read from a safetensors file of its
    weights: ``(eager result, meta result)``."""
    eager = model6()
    save_file(eager.state_dict(), str(tmp_path / "w.safetensors"))
    want = run(eager, batch, F.mse_loss, part, M, progress=False, **options)
    got = run(
        on_meta(model6), batch, F.mse_loss, part, M, progress=False, weights=tmp_path / "w.safetensors", **options
    )
    return want, got


def hf_partition(model, x, y, P=2):
    prof = profile(model, x[:2], target=y[:2], loss_fn=lm_loss, layers="auto", warmup=1, repeats=1, progress=False)
    return partition(prof, P=P, schedule="1F1B")


def units_partition(model, P=2):
    """The model's ``layers="auto"`` units split as a profile of equal units splits them: where a test needs a split,
    not a profile (the same split every run; profiling a meta model is the test above's)."""
    names = [name for name, _ in auto_units(model, announce=False)]
    prof = psl.Profile.synthetic(fwd_ms=[1.0] * len(names), bwd_ms=[2.0] * len(names), name=names)
    return partition(prof, P=P, schedule="1F1B")


def test_a_meta_sequential_with_weights_trains_bit_for_bit_as_the_eager_model(tmp_path):
    want, got = eager_and_meta(tmp_path, psl.partition(PROFILE6, 3, m=M), steps=3, optimizer=sgd)
    assert got.losses == want.losses
    assert worst(got, want.state_dict()) == 0.0
    folder = got.save_pretrained(tmp_path / "trained")
    assert sorted(p.name for p in folder.iterdir()) == [
        *(f"model-0000{r}-of-00003.safetensors" for r in (1, 2, 3)),
        "model.safetensors.index.json",
    ]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    plain = model6()
    for shard in sorted(set(index["weight_map"].values())):
        plain.load_state_dict(load_file(str(folder / shard)), strict=False)
    assert all(torch.equal(plain.state_dict()[k], t) for k, t in want.state_dict().items())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in plain.state_dict().values())


def test_a_meta_llama_profiled_unit_by_unit_trains_from_sharded_safetensors_as_one_process(tmp_path):
    x, y = tokens()
    eager = llama()
    shards = sharded(tmp_path / "llama", eager.state_dict())
    meta = on_meta(llama)  # profiled unit by unit, partitioned and run: no process ever holds the whole model
    result = run(
        meta,
        (x, y),
        lm_loss,
        hf_partition(meta, x, y),
        M,
        steps=2,
        optimizer=sgd,
        progress=False,
        weights=shards,
    )
    assert worst(result, single_process(eager, x, y, 2, optimizer=sgd)) <= 1e-6


#: single_process(qwen2(), *tokens(), 2, optimizer=sgd), computed once for both splits below
_QWEN2_TRAINED = []


@pytest.mark.parametrize("split", [None, "manual"])
def test_tied_embeddings_on_meta_train_as_one_process(tmp_path, split):
    """The checkpoint holds the tied tensor once (safetensors' save_model), under the head's name."""
    from safetensors.torch import save_model

    x, y = tokens()
    eager = qwen2()
    save_model(eager, str(tmp_path / "model.safetensors"))
    result = run(
        on_meta(qwen2),
        (x, y),
        lm_loss,
        units_partition(eager),
        M,
        steps=2,
        optimizer=sgd,
        progress=False,
        weights=tmp_path,
        split=split,
    )
    assert len(result.tied_weights) == 1
    if not _QWEN2_TRAINED:
        _QWEN2_TRAINED.append(single_process(eager, x, y, 2, optimizer=sgd))
    assert worst(result, _QWEN2_TRAINED[0]) <= 1e-6
    back = transformers.AutoModelForCausalLM.from_pretrained(result.save_pretrained(tmp_path / "trained"))
    assert back.model.embed_tokens.weight is back.lm_head.weight
    assert all(torch.equal(back.state_dict()[k], t) for k, t in result.state_dict().items())


def test_default_init_starts_p2_and_p4_from_the_same_tensors():
    """A zero learning rate leaves the start as it was: each tensor is seeded by its module's name, not its rank."""
    x, y = tokens()
    eager = llama()
    frozen = {"optimizer": lambda params: torch.optim.SGD(params, lr=0.0), "progress": False, "steps": 1}
    starts = [run(on_meta(llama), (x, y), lm_loss, units_partition(eager, P), M, **frozen).state_dict() for P in (2, 4)]
    assert list(starts[0]) == list(starts[1])
    assert all(torch.equal(starts[0][k], starts[1][k]) for k in starts[0])
    inv_freq = eager.model.rotary_emb.inv_freq
    assert torch.isfinite(torch.stack([t.abs().max() for t in starts[0].values()])).all()
    assert starts[0]["model.norm.weight"].eq(1).all()  # Hugging Face's _init_weights: norms start at one
    std = starts[0]["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.004 and inv_freq.numel() > 0


def test_weights_from_dcp_and_from_a_toolkit_checkpoint_resume_on_another_p(tmp_path):
    eager = model6()
    dcp.save({"model": eager.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    two, three = psl.partition(PROFILE6, 2, m=M), psl.partition(PROFILE6, 3, m=M)
    want = run(eager, batch, F.mse_loss, three, M, steps=4, optimizer=sgd, progress=False)
    first = run(
        on_meta(model6),
        batch,
        F.mse_loss,
        three,
        M,
        steps=2,
        optimizer=sgd,
        progress=False,
        weights=tmp_path / "dcp",
        checkpoint=tmp_path / "ck",
    )
    assert first.losses == want.losses[:2]
    frozen = run(
        on_meta(model6),
        batch,
        F.mse_loss,
        two,
        M,
        steps=1,
        progress=False,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        weights=tmp_path / "ck",
    )
    assert worst(frozen, first.state_dict()) == 0.0  # the checkpoint's model part, read on another P
    resumed = run(
        on_meta(model6), batch, F.mse_loss, two, M, steps=4, optimizer=sgd, progress=False, resume_from=tmp_path / "ck"
    )
    assert resumed.losses[-2:] == pytest.approx(want.losses[2:], rel=1e-5)
    assert worst(resumed, want.state_dict()) <= 1e-6


def test_no_rank_holds_the_whole_model():
    """8 layers of 64 MiB: a rank of P=4 holds its two layers, their gradients, one layer's gradient in flight and a
    fixed share of libraries (40-110 MB, more when the fork server has preloaded transformers), under the model's
    512 MiB of weights alone, and its resident peak says so (measured from /proc, RunResult.ranks)."""
    width = 4096

    def wide():
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])

    layer = width * width * 4
    part = psl.partition(psl.Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[1.0] * 8), 4, m=M)
    data = (torch.randn(8, width), torch.randn(8, width))
    # one step: its forward, backward and update hold the stage, its gradients and the one in flight (a second step
    # repeats them, probes memory and adds nothing to the peak: the same growth, measured)
    result = run(on_meta(wide), data, F.mse_loss, part, M, steps=1, optimizer=sgd, progress=False)
    grew = result.ranks["resident_peak_bytes"] - result.ranks["resident_start_bytes"]
    assert (grew >= 4 * layer).all()  # two layers' weights and gradients: it did hold its stage
    assert (grew < 8 * layer).all(), grew.tolist()  # less than the model's weights alone, the 8 layers


def test_a_meta_llama_resumed_on_another_p_trains_as_the_uninterrupted_run(tmp_path):
    """The resumed stages take their weights from the checkpoint and their rotary tables (in no checkpoint) from
    Hugging Face's own init."""
    x, y = tokens()
    meta, eager = on_meta(llama), llama()
    two, three = units_partition(eager, P=2), units_partition(eager, P=3)
    kwargs = dict(optimizer=adam, progress=False)
    # the uninterrupted run saves at step 2 on its way (saving changes nothing, bit for bit: test_job.py), and the
    # resumed run starts from that save: one run fewer than a separate 2-step run to a checkpoint
    whole = run(meta, (x, y), lm_loss, two, M, steps=4, checkpoint=psl.Checkpointing(tmp_path, every=2), **kwargs)
    resumed = run(meta, (x, y), lm_loss, three, M, steps=4, resume_from=tmp_path / "step-00000002", **kwargs)
    assert resumed.first_step == 2
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-5)
    assert worst(resumed, whole.state_dict()) <= 1e-5


class Scaled(nn.Module):
    """A traced model (not an nn.Sequential) with a non-persistent buffer and no reset_parameters of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h)) * self.scale
        return self.head(h)


def test_a_buffer_that_travels_by_value_reaches_the_traced_stages():
    model = Scaled()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    prof = profile(model, x[:2], target=y[:2], loss_fn=F.mse_loss, layers=["embed", "blocks.*", "head"], warmup=0,
                   repeats=1, progress=False)  # fmt: skip
    result = run(model, (x, y), F.mse_loss, partition(prof, P=2, schedule="1F1B"), M, steps=2, optimizer=sgd,
                 progress=False)  # fmt: skip
    assert worst(result, single_process(model, x, y, 2, loss_fn=F.mse_loss, optimizer=sgd)) <= 1e-6


def test_a_meta_model_with_replicas_recomputation_and_bf16_trains_as_the_eager_one(tmp_path):
    """D=2 replicas, full recomputation and bf16-mixed-zero1 on a meta model read from safetensors: the same run as
    the eager model's (which travels as a safetensors file too), bit for bit."""
    options = dict(steps=2, optimizer=adam, D=2, recompute="full", precision="bf16-mixed-zero1")
    want, got = eager_and_meta(tmp_path, psl.partition(PROFILE6, 2, m=M), **options)
    assert got.losses == want.losses
    assert worst(got, want.state_dict()) == 0.0


def test_a_meta_model_resizes_through_its_checkpoints(tmp_path):
    """resize_at builds the new stages from the structure and the checkpoint: the job ends as the eager one does."""
    options = dict(steps=6, optimizer=sgd, elastic=psl.Elastic(resize_at={3: 3}, profile=PROFILE6))
    want, got = eager_and_meta(tmp_path, psl.partition(PROFILE6, 2, m=M), **options)
    assert list(got.segments["P"]) == [2, 3]
    assert got.losses == want.losses
    assert worst(got, want.state_dict()) == 0.0
