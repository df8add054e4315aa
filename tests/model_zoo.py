"""A standing zoo of Hugging Face decoder families, each tiny (built from a config, no download): what the runner is
checked against whenever transformers moves (tests/runner/test_model_zoo.py).

Each family keeps its defaults (KV cache on, its own attention, norm, rotary and tied-or-not head) at width 32,
2 layers, vocabulary 64; a mixture-of-experts family has 4 experts, 2 per token. They cover the shapes transformers 5
gives a decoder: grouped-query attention, parallel attention and MLP (GPT-NeoX, Phi, Cohere, Falcon), partial
rotary (Phi, StableLM, Persimmon-like), soft-capped logits (Gemma 2), a renamed head in the checkpoint (GPT-NeoX's
``embed_out``), fused experts stored one tensor per expert (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE,
OLMoE) or stored fused under other names (GraniteMoE), attention sinks with biased experts stored fused
(gpt-oss), and a router that reads token counts as values (JetMoE).
"""

import torch
from tiny_transformers import SMALL, M

#: What every config below starts from: tiny_transformers' Llama-sized config with 2 decoder layers, one per stage
#: of :func:`halves`: a family's layer types (Gemma 2's and gpt-oss's sliding and full attention) still alternate,
#: and tracing, which is most of a tiny run's time on each rank, costs a third less than with 4.
BASE = dict(SMALL, num_hidden_layers=2)
#: Four experts, two per token, in the names each family's config takes.
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_LOCAL_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

#: ``{family: config overrides}``: the family's ``{family}Config`` and ``{family}ForCausalLM`` in transformers.
DENSE = {
    "Llama": {},
    "Mistral": {},
    "Qwen2": dict(tie_word_embeddings=True),
    "Qwen3": dict(head_dim=8),
    "Gemma": dict(head_dim=8),
    "Gemma2": dict(head_dim=8),
    "Phi3": dict(pad_token_id=0),
    "Phi": {},
    "GPTNeoX": {},
    "StableLm": {},
    "Starcoder2": {},
    "Cohere": {},
    "Olmo2": {},
    "Granite": {},
    "Falcon": {},
}
MOE = {
    "Mixtral": _LOCAL_MOE,
    "Qwen2Moe": dict(_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "Qwen3Moe": dict(_MOE, moe_intermediate_size=32, head_dim=8),
    "Olmoe": _MOE,
    "GraniteMoe": _LOCAL_MOE,
    "GptOss": dict(_LOCAL_MOE, head_dim=8),
    "JetMoe": _LOCAL_MOE,  # its router reads token counts as values (.tolist()): checked with symbols for them
}
FAMILIES = {**DENSE, **MOE}
#: The families whose ``save_pretrained`` stores each expert's tensors apart (the module holds them fused).
STORED_PER_EXPERT = ("Mixtral", "Qwen2Moe", "Qwen3Moe", "Olmoe")


def model_class(family):
    import transformers

    return getattr(transformers, f"{family}ForCausalLM")


def config(family):
    import transformers

    return getattr(transformers, f"{family}Config")(**{**BASE, **FAMILIES[family]})


def build(family, device=None):
    """The family's tiny model, seeded (on ``device``: ``"meta"`` builds its structure alone)."""
    torch.manual_seed(0)
    with torch.device(device) if device is not None else torch.device("cpu"):
        return model_class(family)(config(family))


def halves(model, P=2, m=M):
    """The model's ``layers="auto"`` units cut into ``P`` runs of equal count, 1F1B over ``m`` micro-batches (no
    profile needed to test equality or refusals)."""
    from pipeswift_lab.partitioning.stages import Partition
    from pipeswift_lab.profiling.table import Profile
    from pipeswift_lab.profiling.units import auto_units

    names = [name for name, _ in auto_units(model, announce=False)]
    cuts = [round(i * len(names) / P) for i in range(P + 1)]
    prof = Profile.synthetic(fwd_ms=[1.0] * len(names), bwd_ms=[2.0] * len(names))
    named = Profile(prof.df.assign(name=names), prof.meta)
    return Partition.from_bounds(named, list(zip(cuts, cuts[1:])), schedule="1F1B", m=m)
