"""Tensor-parallel ranks read only their slice of the weights (``pipeswift_lab/runner/tp_slices.py``).

The reader is checked against safetensors files directly: a part asked for is ``torch.chunk``'s piece, read alone
(the tally of what came off the disk counts the slice's bytes, not the tensor's), through a Hugging Face index and
a renamed key; a tensor transformers makes from several stored ones (fused experts), and a DCP checkpoint's, are read
whole and cut. A real run (2 gloo processes, ``tp=2``) of a meta Llama from its ``save_pretrained`` directory trains
equal to one process (its layers recomputed), and each rank's log of what it read holds, to the byte, its half of
every tensor the plan shards and the whole of the others."""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from model_zoo import build, halves
from safetensors.torch import save_file
from test_weights import sharded
from tiny_transformers import M, lm_loss, single_process, tokens

import pipeswift_lab as psl
from pipeswift_lab.core.meta_device import shard_box
from pipeswift_lab.core.tp_plan import tp_targets
from pipeswift_lab.runner.tp_slices import ReadTally
from pipeswift_lab.runner.weights import check_weights, open_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

transformers = pytest.importorskip("transformers")

#: The styles whose parameters a rank holds a slice of.
SHARDING = (
    *("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep"),
    *("embedding_rowwise", "embedding_colwise"),
)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def chunk(tensor, dim, rank, n):
    """torch.chunk's piece ``rank`` of ``n`` (empty where torch.chunk gives fewer pieces)."""
    pieces = torch.chunk(tensor, n, dim)
    return pieces[rank] if rank < len(pieces) else tensor.narrow(dim, tensor.shape[dim], 0)


def nbytes(t):
    return t.numel() * t.element_size()


def test_a_safetensors_part_is_torch_chunks_piece_read_alone(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "up.weight": torch.randn(8, 6, generator=g),
        "up.bias": torch.randn(8, generator=g),
        "odd.weight": torch.randn(7, 5, generator=g),  # pieces of 3, 3, 1 (and of 2, 2, 1, none for n=4)
        "norm.weight": torch.randn(6, generator=g),
    }
    source = open_weights(sharded(tmp_path, state, 2))
    assert len(set(source.files.values())) == 2
    for n in (2, 3, 4):
        for rank in range(n):
            for dim in (0, 1):
                parts = {k: shard_box(state[k].shape, dim, rank, n) for k in ("up.weight", "odd.weight")}
                parts["up.bias"] = shard_box((8,), 0, rank, n)
                tally = ReadTally()
                got = source.read(list(state), slices=parts, tally=tally)
                for key in ("up.weight", "odd.weight"):
                    assert torch.equal(got[key], chunk(state[key], dim, rank, n)), (key, dim, rank, n)
                assert torch.equal(got["up.bias"], chunk(state["up.bias"], 0, rank, n))
                assert torch.equal(got["norm.weight"], state["norm.weight"])  # no part asked: whole
                want = sum(nbytes(got[k]) for k in parts) + nbytes(state["norm.weight"])
                assert (tally.bytes, tally.sliced, tally.whole) == (want, 3, 1)
    assert source.read(["up.weight"], slices={"up.weight": shard_box((8, 6), 0, 1, 2)})["up.weight"].is_contiguous()


def test_a_renamed_key_is_read_as_a_slice_and_fused_experts_whole_then_cut(tmp_path):
    neox = build("GPTNeoX")
    neox.save_pretrained(tmp_path / "neox")
    meta = build("GPTNeoX", "meta")
    source = check_weights(open_weights(tmp_path / "neox"), meta.state_dict(), {}, model=meta)
    (key, stored), *_ = source.renamed.items()  # the head, stored under GPT-NeoX's own name
    assert key != stored
    whole = neox.state_dict()[key]
    tally = ReadTally()
    got = source.read([key], slices={key: shard_box(whole.shape, 0, 1, 2)}, tally=tally)[key]
    assert torch.equal(got, chunk(whole, 0, 1, 2)) and (tally.sliced, tally.whole, tally.keys) == (1, 0, [stored])
    assert tally.bytes == nbytes(whole) // 2

    mixtral = build("Mixtral")
    mixtral.save_pretrained(tmp_path / "mixtral")
    meta = build("Mixtral", "meta")
    source = check_weights(open_weights(tmp_path / "mixtral"), meta.state_dict(), {}, model=meta)
    key = next(k for k in source.converted if k.startswith("model.layers.0."))
    whole = mixtral.state_dict()[key]
    tally = ReadTally()
    got = source.read([key], model=meta, slices={key: shard_box(whole.shape, 1, 0, 2)}, tally=tally)[key]
    assert torch.equal(got, chunk(whole, 1, 0, 2))
    made_of = source.converted[key].sources
    assert (tally.sliced, tally.whole) == (0, len(made_of)) and len(made_of) > 1  # every expert's tensor, whole


def test_a_dcp_checkpoint_is_read_whole_and_cut(tmp_path):
    state = {"w": torch.arange(24.0).reshape(6, 4)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    tally = ReadTally()
    got = open_weights(tmp_path).read(["w"], slices={"w": shard_box((6, 4), 1, 1, 2)}, tally=tally)["w"]
    assert torch.equal(got, chunk(state["w"], 1, 1, 2)) and (tally.bytes, tally.whole) == (nbytes(state["w"]), 1)


def test_a_file_written_by_save_file_reads_an_empty_part(tmp_path):
    save_file({"w": torch.ones(5, 2)}, str(tmp_path / "model.safetensors"))
    got = open_weights(tmp_path).read(["w"], slices={"w": shard_box((5, 2), 0, 3, 4)})["w"]
    assert got.shape == (0, 2)


@pytest.mark.processes
def test_a_meta_llama_under_tp2_reads_half_of_each_sharded_tensor_and_trains_like_one_process(tmp_path):
    model = build("Llama")
    model.config.tie_word_embeddings = False
    model.save_pretrained(tmp_path / "hf")
    log = tmp_path / "reads.jsonl"
    weights = replace(open_weights(tmp_path / "hf"), read_log=str(log))
    x, y = tokens()
    meta = build("Llama", "meta")
    # split on meta, made from the slices, then recomputed
    kw = dict(tp=2, weights=weights, steps=2, optimizer=sgd, recompute="full", progress=False)
    result = psl.run(meta, (x, y), lm_loss, halves(meta, P=1), M, **kw)
    got, want = result.state_dict(), single_process(model, x, y, 2, optimizer=sgd)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5

    state = model.state_dict()
    targets = tp_targets(model, model.tp_plan, strict=False)
    sharded_keys = {f"{name}.weight" for name, style in targets.items() if style in SHARDING}  # Llama has no biases
    records = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["tp"])
    assert [(r["tp"], r["stage"], r["sliced_tp"]) for r in records] == [(0, 0, True), (1, 0, True)]
    for record in records:
        assert sorted(record["keys"]) == sorted(state)  # every tensor of the stage, each once
        assert record["sliced"] == len(sharded_keys & set(state)) > 0
        half = sum(nbytes(t) // 2 if k in sharded_keys else nbytes(t) for k, t in state.items())
        assert record["bytes"] == half < sum(nbytes(t) for t in state.values())
