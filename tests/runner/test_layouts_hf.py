"""Hugging Face families in PP x FSDP x TP layouts with their own tensor-parallel plans: each trains equal to one
process (SGD, 1e-5) with every process's memory predicted within 10%, eager (the caller's model) or on the meta
device from its checkpoint. Llama at P2 x tp2 x fsdp2 is in test_layouts.py."""

import pytest
from hf_layouts import train_in_layout
from test_layouts import LAYOUTS, assert_memory_predicted, sgd, worst
from tiny_transformers import single_process

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
    model, result, x, y = train_in_layout(family, layout, meta, tmp_path)
    assert result.meta["tp_plan"] == (model.tp_plan if tp > 1 else None)
    assert worst(result.state_dict(), single_process(model, x, y, 2, optimizer=sgd)) <= 1e-5
    assert_memory_predicted(result, P, 1, fsdp, tp)
