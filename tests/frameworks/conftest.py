"""Plans of a Llama of torchtitan's ``debugmodel`` shape (6 blocks of width 256): an uneven split, an interleaved
one, a 3-D layout with tensor parallelism and FSDP."""

import pytest

import pipeswift_lab as psl

#: torchtitan 0.3's llama3 ``debugmodel``: its registered flavor, so its own loader builds the exported config.
SPEC = psl.TransformerSpec(
    layers=6, hidden=256, heads=16, seq_len=2048, vocab=2048, ffn=768, kv_heads=4, gated_mlp=True, bias=False,
    rms_norm=True, learned_positions=False, name="llama",
)  # fmt: skip


@pytest.fixture(scope="session")
def llama_profile():
    return psl.analytic_profile(SPEC, "H100_SXM", micro_batch=1)


def _plan(profile, **kwargs):
    kwargs = {"global_batch": 64, "steps": 100, "precision": "bf16-mixed", "progress": False, **kwargs}
    return psl.plan(profile, microbatch_sizes=[1], **kwargs)


@pytest.fixture(scope="session")
def plans(llama_profile):
    """``{"uneven": P3 1F1B (8 layers on 3 ranks), "interleaved": P2 v2, "3d": P2 × fsdp2 × tp2}``."""
    return {
        "uneven": _plan(llama_profile, gpus=6, P=[3], schedules=["1F1B"]),
        "interleaved": _plan(llama_profile, gpus=8, P=[2], schedules=["Interleaved1F1B"]),
        "3d": _plan(llama_profile, gpus=8, P=[2], tp=[2], fsdp=[2], schedules=["1F1B"]),
    }
