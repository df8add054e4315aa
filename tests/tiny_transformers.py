"""Small Hugging Face language models built from configs (no download), shared by the tests that need them."""

import torch

VOCAB = 64
#: A Llama-style config: 4 layers, width 32, grouped-query attention (4 query heads over 2 key/value heads), rotary.
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
#: GPT-2 without dropout, for runs compared with one process (dropout masks differ between processes).
NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def llama():
    """``LlamaForCausalLM`` of :data:`SMALL`, seeded."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def gpt2(**overrides):
    """``GPT2LMHeadModel`` (tied embedding and head), 4 layers of width 32 unless ``overrides`` say otherwise."""
    import transformers

    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def qwen2():
    """``Qwen2ForCausalLM`` of :data:`SMALL` with tied embeddings, seeded."""
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True))
