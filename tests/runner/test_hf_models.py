"""Hugging Face language models, as they are, through profile → partition → run.

Models are built from small configs (no download). Each run must equal single-process training on the same
micro-batches (Adam, several steps) within 1e-5, with ``state_dict()`` keyed like the model's, tied aliases
included. Equality runs set dropout to 0 (masks differ between processes); a run with dropout on must train.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_transformers import (
    CLASSES,
    IMAGE,
    NO_DROPOUT_GPT2,
    OPT_SMALL,
    SEQ,
    SMALL,
    VOCAB,
    M,
    Seq2Seq,
    adam,
    bert,
    gpt2,
    llama,
    lm_loss,
    opt,
    qwen2,
    single_process,
    t5,
    vit,
)
from tiny_transformers import tokens as batch
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.profiling.units import auto_units
from pipeswift_lab.runner import make_spec, run
from pipeswift_lab.runner.stages.tied import TiedGroup, tied_groups

transformers = pytest.importorskip("transformers")


def assert_equal_training(result, want, atol=1e-5):
    got = result.state_dict()
    assert list(got) == list(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"max parameter difference {worst:.3g}"


def auto_partition(model, x, y, P, schedule, loss_fn=lm_loss):
    """The model's ``layers="auto"`` units split as a profile of equal units splits them: the same split every run,
    and no profile taken (measured times would move the cuts from run to run; HF models are profiled in
    tests/profiling/test_auto_layers.py, and go profile -> partition -> run in test_run_recompute.py)."""
    v = 1 if schedule in ("1F1B", "GPipe") else 2
    names = [name for name, _ in auto_units(model, announce=False)]
    prof = Profile.synthetic(fwd_ms=[1.0] * len(names), bwd_ms=[2.0] * len(names), name=names)
    return partition(prof, P=P, v=v, schedule=schedule)


CASES = [
    ("llama", llama, 3, "1F1B"),
    ("llama", llama, 2, "Interleaved1F1B"),  # four stages: rotary tables and mask handed on stage to stage
    ("gpt2-tied", lambda: gpt2(**NO_DROPOUT_GPT2), 3, "1F1B"),
    ("gpt2-tied", lambda: gpt2(**NO_DROPOUT_GPT2), 2, "ZBVZeroBubble"),  # both tied copies on rank 0
    ("qwen2-tied", qwen2, 3, "1F1B"),
    ("qwen2-tied", qwen2, 2, "Interleaved1F1B"),
]


#: single_process(build(), *batch(), 3) per family of CASES: a family's cases train the same model on the same batch
_TRAINED_IN_ONE_PROCESS = {}


def trained_in_one_process(family, model, x, y):
    if family not in _TRAINED_IN_ONE_PROCESS:
        _TRAINED_IN_ONE_PROCESS[family] = single_process(model, x, y, 3)
    return _TRAINED_IN_ONE_PROCESS[family]


@pytest.mark.processes
@pytest.mark.parametrize("family,build,P,schedule", CASES, ids=[f"{c[0]}-P{c[2]}-{c[3]}" for c in CASES])
def test_a_hf_model_trains_like_one_process(family, build, P, schedule):
    model = build()
    assert model.config.use_cache  # the config's default: the runner turns it off for the trace and the run only
    x, y = batch()
    part = auto_partition(model, x, y, P, schedule)
    result = run(model, (x, y), lm_loss, part, M, steps=3, optimizer=adam, progress=False, launch=Launch(timeout_s=240))
    assert model.config.use_cache
    assert_equal_training(result, trained_in_one_process(family, model, x, y))
    fresh = build()
    fresh.load_state_dict(result.state_dict(), strict=True)
    tied = result.tied_weights
    if family.endswith("tied"):
        embed, head = (
            ("transformer.wte.weight", "lm_head.weight")
            if "gpt2" in family
            else ("model.embed_tokens.weight", "lm_head.weight")
        )
        assert tied["names"].tolist() == [(embed, head)]
        assert tied["stages"].tolist() == [(0, part.P * part.v - 1)]
        assert result.state_dict()[head] is result.state_dict()[embed]
    else:
        assert tied.empty


def image_loss(out, y):
    return F.cross_entropy(out.logits, y)


def images(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def seq2seq_batch(n=8):
    """The source and the decoder's input side by side (``Seq2Seq`` splits them), and the decoder's targets."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (n, 2 * SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


#: Families that once failed (a non-contiguous mask or patch tokens sent, an aliased bias the tracer drops), and an
#: encoder-decoder fed one tensor: (build, batch, loss, schedule).
MORE_FAMILIES = {
    "opt": (opt, batch, lm_loss, "1F1B"),  # the causal mask crosses the cut as an expand (stride 0)
    "vit": (vit, images, image_loss, "GPipe"),  # patch tokens are a transposed view
    "bert": (bert, batch, lm_loss, "1F1B"),  # cls.predictions.bias is an alias of cls.predictions.decoder.bias
    "t5": (lambda: Seq2Seq(t5()), seq2seq_batch, lm_loss, "1F1B"),  # the encoder's output feeds every decoder block
}


@pytest.mark.processes
@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_opt_vit_bert_and_a_wrapped_t5_train_like_one_process(family):
    build, make_batch, loss_fn, schedule = MORE_FAMILIES[family]
    model = build()
    x, y = make_batch()
    part = auto_partition(model, x, y, 2, schedule, loss_fn=loss_fn)
    result = run(model, (x, y), loss_fn, part, M, steps=3, optimizer=adam, progress=False, launch=Launch(timeout_s=240))
    assert list(result.state_dict()) == list(model.state_dict())
    assert_equal_training(result, single_process(model, x, y, 3, loss_fn=loss_fn), atol=1e-4)
    if family == "bert":  # the alias comes back as the one tensor it is
        state = result.state_dict()
        assert state["cls.predictions.bias"] is state["cls.predictions.decoder.bias"]


def test_a_bare_encoder_decoder_is_refused_before_launch_saying_how_to_feed_it_one_tensor():
    model, (ids, y) = t5(), batch()
    with pytest.raises(ValueError, match=r"(?s)T5ForConditionalGeneration is an encoder–decoder model.*class Seq2Seq"):
        profile(model, ids[:2], target=y[:2], loss_fn=lm_loss, progress=False, layers="auto")
    prof = profile(  # with the decoder's input given, it profiles; the runner still feeds one tensor
        model,
        ids[:2],
        sample_kwargs={"decoder_input_ids": y[:2]},
        target=y[:2],
        loss_fn=lm_loss,
        layers="auto",
        warmup=1,
        repeats=1,
        progress=False,
    )
    with pytest.raises(ValueError, match=r"(?s)encoder–decoder.*split=\"manual\" cannot"):
        make_spec(model, (ids, y), lm_loss, partition(prof, P=2), M)


@pytest.mark.processes
def test_tied_gpt2_resumes_onto_another_partition_and_stores_the_tied_tensor_once(tmp_path):
    model = gpt2(**NO_DROPOUT_GPT2)
    x, y = batch()
    two, three = auto_partition(model, x, y, 2, "1F1B"), auto_partition(model, x, y, 3, "1F1B")
    kw = dict(optimizer=adam, progress=False, launch=Launch(timeout_s=240))
    run(model, (x, y), lm_loss, two, M, steps=2, checkpoint=tmp_path / "ck", **kw)
    from pipeswift_lab.runner.checkpoint import latest_checkpoint

    saved = latest_checkpoint(tmp_path / "ck")
    assert "lm_head.weight" not in saved.tensor_shapes()  # stored once, under the embedding's name
    assert list(saved.state_dict()) == list(model.state_dict())
    resumed = run(model, (x, y), lm_loss, three, M, steps=4, resume_from=tmp_path / "ck", **kw)
    assert resumed.first_step == 2
    assert_equal_training(resumed, single_process(model, x, y, 4))


@pytest.mark.processes
def test_a_hf_model_with_two_replicas_trains_like_one_process_on_the_global_batch():
    model = gpt2(**NO_DROPOUT_GPT2)
    x, y = batch(16)
    part = auto_partition(model, x, y, 2, "1F1B")
    result = run(
        model, (x, y), lm_loss, part, M, steps=2, D=2, optimizer=adam, progress=False, launch=Launch(timeout_s=240)
    )
    ref = copy.deepcopy(model)  # one process on the global batch: each replica's m micro-batches, averaged
    opt = adam(list(ref.parameters()))
    for _ in range(2):
        opt.zero_grad()
        chunks = [
            (a, b) for half_x, half_y in zip(x.chunk(2), y.chunk(2)) for a, b in zip(half_x.chunk(M), half_y.chunk(M))
        ]
        torch.stack([lm_loss(ref(a), b) for a, b in chunks]).mean().backward()
        opt.step()
    assert_equal_training(result, ref.state_dict())


@pytest.mark.processes
def test_gpt2_with_dropout_on_trains():
    model = gpt2()  # the config's defaults: dropout 0.1, KV cache on
    x, y = batch()
    part = auto_partition(model, x, y, 2, "1F1B")
    opt = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    result = run(model, (x, y), lm_loss, part, M, steps=4, optimizer=opt, progress=False, launch=Launch(timeout_s=240))
    assert result.losses[-1] < result.losses[0]


class DataDependentLM(nn.Module):
    """A language model torch.export cannot trace (an `if` on a tensor's value), tied head, dict output."""

    def __init__(self, vocab=VOCAB, d=32, n_blocks=4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                for _ in range(n_blocks)
            ]
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
            if h.abs().max() > 1e3:  # data-dependent control flow
                h = h / h.abs().max()
        return {"logits": self.head(self.norm(h))}


def dict_loss(out, y):
    return F.cross_entropy(out["logits"].flatten(0, 1), y.flatten())


def data_dependent_partition(P=2):
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    return named_partition(names, [(0, 3), (3, 7)] if P == 2 else [(0, 2), (2, 4), (4, 7)])


def test_the_tracer_refuses_a_data_dependent_model_and_offers_the_manual_path():
    x, y = batch()
    with pytest.raises(ValueError, match=r'cannot split the DataDependentLM.*split="manual"'):
        make_spec(DataDependentLM(), (x, y), dict_loss, data_dependent_partition(), M)
    spec = make_spec(DataDependentLM(), (x, y), dict_loss, data_dependent_partition(3), M, split="manual")
    assert spec.tied == (TiedGroup(("embed.weight", "head.weight"), (0, 2)),)
    assert [str(i) for i, _ in spec.boundaries] == ["(2, 16) int64", "(2, 16, 32) float32", "(2, 16, 32) float32"]


@pytest.mark.processes
def test_the_manual_path_trains_a_model_the_tracer_cannot_capture_like_one_process():
    model = DataDependentLM()
    x, y = batch()
    kw = dict(optimizer=adam, progress=False, launch=Launch(timeout_s=240), split="manual")
    result = run(model, (x, y), dict_loss, data_dependent_partition(), M, steps=3, **kw)
    assert_equal_training(result, single_process(model, x, y, 3, loss_fn=dict_loss))
    assert result.tied_weights["names"].tolist() == [("embed.weight", "head.weight")]


FAMILIES = {  # Llama, Qwen2 and GPT-2 run for real above
    "Mistral": dict(SMALL),
    "Gemma": dict(SMALL, head_dim=8),
    "Phi3": dict(SMALL, pad_token_id=0),
    "GPTNeoX": {k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
    "OPT": dict(OPT_SMALL, pad_token_id=0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_families_with_their_defaults_are_split_at_three_stages_before_launch(family):
    """Any decoder-only family from a small config, its defaults kept (KV cache on, its own output type, tied or not
    embeddings): traced, cut in three stages with the values that skip a stage handed on, the loss checked. With
    Llama, Qwen2 and GPT-2, eight families."""
    config = getattr(transformers, f"{family}Config")(**FAMILIES[family])
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    x, y = batch()
    spec = make_spec(model, (x, y), lm_loss, auto_partition(model, x, y, 3, "1F1B"), M)
    assert spec.traced is not None and spec.traced.output is not None
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in spec.tied:  # a tied group is one tensor of the model, held by the first and the last stage
        assert len({id(params[n]) for n in group.names}) == 1 and group.stages == (0, 2)


def named_partition(names, bounds):
    prof = Profile.synthetic(fwd_ms=[1.0] * len(names), bwd_ms=[2.0] * len(names))
    return Partition.from_bounds(Profile(prof.df.assign(name=names), prof.meta), bounds, schedule="1F1B", m=M)


LLAMA_LAYERS = ["model.embed_tokens", *[f"model.layers.{i}" for i in range(4)], "model.norm", "lm_head"]


def test_a_model_without_a_floating_output_or_a_loss_that_cannot_read_it_is_refused_before_launch():
    x, y = batch()

    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = llama()

        def forward(self, tokens):
            return self.lm(tokens).logits.argmax(-1)

    wrapped = named_partition(["lm." + n for n in LLAMA_LAYERS], [(0, 3), (3, 7)])
    with pytest.raises(ValueError, match=r"no floating-point tensor for loss_fn"):
        make_spec(Argmax(), (x, y), lambda out, t: out.float().mean(), wrapped, M)
    part = named_partition(LLAMA_LAYERS, [(0, 3), (3, 7)])
    with pytest.raises(
        ValueError,
        match=r"loss_fn\(output, target\) raised .* It received the model's output, a CausalLMOutputWithPast .*"
        r"\[2, 16, 64\] float32",
    ):
        make_spec(llama(), (x, y), lambda out, t: F.cross_entropy(out, t), part, M)


def test_tied_copies_of_different_shapes_are_refused():
    model = gpt2(**NO_DROPOUT_GPT2)
    stage_tensors = [
        {"transformer.wte.weight": torch.zeros(VOCAB, 32)},
        {"lm_head.weight": torch.zeros(32, VOCAB)},  # a transposed copy cannot be kept in sync
    ]
    with pytest.raises(ValueError, match=r"tied weights .*stage 1 holds 'lm_head.weight' with shape \[32, 64\]"):
        tied_groups(model, stage_tensors)


def test_the_fork_server_preloads_the_sessions_model_library():
    from pipeswift_lab.runner.launcher import model_library_modules

    llama()
    libraries, families = model_library_modules()
    assert libraries == ["transformers", "transformers.modeling_utils"]  # seconds to import: once per fork server
    assert "transformers.models.llama.modeling_llama" in families


def test_a_parameter_the_tracer_keeps_under_one_of_its_two_names_counts_as_held():
    from pipeswift_lab.runner.stages.tied import unheld_keys

    model = bert()
    x, y = batch()
    spec = make_spec(model, (x, y), lm_loss, auto_partition(model, x, y, 2, "1F1B"), M)
    assert spec.traced is not None
    state = model.state_dict()
    held = {k: v for k, v in state.items() if k != "cls.predictions.bias"}  # what torch's trace of BERT keeps
    assert unheld_keys(model, [held]) == []
    assert unheld_keys(model, [{k: v for k, v in held.items() if k != "cls.predictions.decoder.bias"}]) == [
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
    ]
