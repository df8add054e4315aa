"""Hugging Face families in PP x FSDP x TP layouts with their own tensor-parallel plans: each trains equal to one
process (SGD, 1e-5) with every process's memory predicted within 10%, eager (the caller's model) or on the meta
device from its checkpoint. Llama at P2 x tp2 x fsdp2 is in test_layouts.py."""

import pytest
from model_zoo import build
from test_layouts import LAYOUTS, assert_memory_predicted, sgd, worst
from tiny_transformers import M, lm_loss, single_process, tokens

import pipeswift_lab as psl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


#: (family, layout, meta): each family in several layouts, eager (the caller's model) or on meta from its checkpoint.
HF_RUNS = [
    ("Llama", "P2xtp2", False),
    ("Llama", "P2xfsdp2", True),
    ("Qwen3", "P1xtp2xfsdp2", True),  # q_norm, k_norm: replicated, gradients summed over the tensor-parallel ranks
    ("Mixtral", "P2xtp2", False),  # tensor parallelism on attention, the experts whole
    ("GPTNeoX", "P2xtp2", True),  # a fused qkv cut by heads, a head stored under another name
    ("Phi3", "P2xtp2", False),  # fused qkv and gate_up gathered (colwise_gather_output, rowwise_split_input)
]


@pytest.mark.processes
@pytest.mark.parametrize(
    ("family", "layout", "meta"), HF_RUNS, ids=[f"{f}-{lay}-{'meta' if m else 'eager'}" for f, lay, m in HF_RUNS]
)
def test_a_hugging_face_family_trains_like_one_process_with_its_own_plan(family, layout, meta, tmp_path):
    P, fsdp, tp = LAYOUTS[layout]
    model = build(family)
    model.config.tie_word_embeddings = False
    x, y = tokens()
    prof = psl.profile(model, x[: 8 // (M * fsdp)], layers="auto", progress=False)
    part = psl.partition(prof, P=P)
    kw = dict(fsdp=fsdp, tp=tp, steps=2, optimizer=sgd, progress=False)
    if meta:
        model.save_pretrained(tmp_path / "hf")
        result = psl.run(build(family, "meta"), (x, y), lm_loss, part, M, weights=tmp_path / "hf", **kw)
    else:
        result = psl.run(model, (x, y), lm_loss, part, M, **kw)
    assert result.meta["tp_plan"] == (model.tp_plan if tp > 1 else None)
    assert worst(result.state_dict(), single_process(model, x, y, 2, optimizer=sgd)) <= 1e-5
    assert_memory_predicted(result, P, 1, fsdp, tp)
