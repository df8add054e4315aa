"""psl.TransformerSpec: a transformer by its shape; from_config reads Hugging Face configs, counting the parameters the
family's model holds (built on the meta device here: no weights, no downloads), and refuses the blocks it cannot
describe, naming what it found."""

import pytest
import torch

import pipeswift_lab as psl

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SMALL = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=1000, max_position_embeddings=128,
)  # fmt: skip
#: (config class, its arguments, the largest relative miss): exact where the spec has every term; the misses are
#: terms it does not carry (Gemma2's two extra norms per block, Phi's and StarCoder2's biases, Falcon's single norm)
FAMILIES = {
    "Llama": ("LlamaConfig", SMALL, 0.0),
    "Mistral": ("MistralConfig", SMALL, 0.0),
    "Mixtral": ("MixtralConfig", SMALL, 0.0),
    "Qwen3": ("Qwen3Config", SMALL, 0.0),
    "Qwen3Moe": ("Qwen3MoeConfig", {**SMALL, "num_experts": 8, "moe_intermediate_size": 128}, 0.0),
    "Gemma": ("GemmaConfig", SMALL, 0.0),
    "Gemma2": ("Gemma2Config", SMALL, 0.001),
    "Granite": ("GraniteConfig", SMALL, 0.0),
    "GraniteMoe": ("GraniteMoeConfig", SMALL, 0.0),
    "GPTNeoX": ("GPTNeoXConfig", SMALL, 0.0),
    "Starcoder2": ("Starcoder2Config", SMALL, 0.005),
    "Phi": ("PhiConfig", SMALL, 0.005),
    "GPT2": ("GPT2Config", dict(n_layer=2, n_embd=256, n_head=8, vocab_size=1000, n_positions=128), 0.0),
    "OPT": ("OPTConfig", dict(num_hidden_layers=2, hidden_size=256, ffn_dim=1024, num_attention_heads=8), 0.0),
    "Falcon": ("FalconConfig", dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=8), 0.005),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_config_counts_the_parameters_the_family_holds(family):
    name, kwargs, miss = FAMILIES[family]
    config = getattr(transformers, name)(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    held = sum(p.numel() for p in model.parameters())
    spec = psl.TransformerSpec.from_config(config, seq_len=64)
    assert spec.params() == pytest.approx(held, rel=miss, abs=0)


def test_gated_mlps_are_told_by_family_not_by_the_activation_s_name():
    """Gemma2 names its GeGLU in ``hidden_activation``; StarCoder2's ``gelu_pytorch_tanh`` MLP is not gated."""
    assert psl.TransformerSpec.from_config(transformers.Gemma2Config(**SMALL)).gated_mlp
    assert not psl.TransformerSpec.from_config(transformers.Starcoder2Config(**SMALL)).gated_mlp


def test_falcon_s_keys_and_values_and_opt_s_position_table():
    multi_query = psl.TransformerSpec.from_config(transformers.FalconConfig(num_attention_heads=8, hidden_size=256))
    assert multi_query.kv_heads_ == 1
    grouped = transformers.FalconConfig(
        num_attention_heads=8, hidden_size=256, new_decoder_architecture=True, num_kv_heads=2
    )
    assert psl.TransformerSpec.from_config(grouped).kv_heads_ == 2
    opt = psl.TransformerSpec.from_config(transformers.OPTConfig(max_position_embeddings=2048), seq_len=512)
    assert opt.max_positions == 2050 and opt.position_params() == 2050 * opt.hidden  # OPT's offset of 2


@pytest.mark.parametrize(
    "name,kwargs,words",
    [
        ("DeepseekV3Config", {}, "kv_lora_rank"),
        ("Qwen2MoeConfig", SMALL, "shared_expert_intermediate_size"),
        ("JetMoeConfig", {}, "mixture of attention heads"),
    ],
)
def test_blocks_a_spec_cannot_describe_are_refused_naming_what_was_found(name, kwargs, words):
    with pytest.raises(ValueError, match=words):
        psl.TransformerSpec.from_config(getattr(transformers, name)(**kwargs))


def test_a_config_without_a_size_takes_it_from_the_overrides_or_names_it():
    spec = psl.TransformerSpec.from_config({"num_hidden_layers": 2}, hidden=64, heads=4, vocab=10, seq_len=16)
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (2, 64, 4, 10, 16)
    with pytest.raises(ValueError, match=r"gives no \['heads', 'seq_len', 'vocab'\]; pass them as keyword overrides"):
        psl.TransformerSpec.from_config({"num_hidden_layers": 2}, hidden=64)
