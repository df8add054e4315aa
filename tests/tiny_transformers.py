"""Small Hugging Face language models built from configs (no download), shared by the tests that need them, with
their loss, token batches and the single-process training a pipeline run must equal."""

import copy

import torch
import torch.nn.functional as F

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


#: An OPT config: 4 layers of width 32.
OPT_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    ffn_dim=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=64,
    word_embed_proj_dim=32,
)


def opt():
    """``OPTForCausalLM`` of :data:`OPT_SMALL`, dropout 0 (its decoder registers its final norm before its layers and
    runs it after them; its causal mask is an ``expand``, stride 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.OPTConfig(**OPT_SMALL, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return transformers.OPTForCausalLM(config)


#: The images :func:`vit` classifies: 3 × 16 × 16, 4 × 4 patches, 5 classes.
IMAGE, CLASSES = (3, 16, 16), 5


def vit():
    """``ViTForImageClassification``, 4 layers of width 32, dropout 0 (its patch tokens are a transposed view)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=IMAGE[1],
        patch_size=4,
        num_channels=IMAGE[0],
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def bert():
    """``BertForMaskedLM``, 4 layers of width 32, dropout 0 (its decoder's bias is an alias of
    ``cls.predictions.bias``; the decoder's weight is tied to the word embedding)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def t5():
    """``T5ForConditionalGeneration``, 2 encoder and 2 decoder blocks of width 32, dropout 0 (an encoder–decoder:
    its forward needs the decoder's input beside ``input_ids``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


class Seq2Seq(torch.nn.Module):
    """An encoder–decoder fed one tensor: the source and the decoder's input side by side, as the refusal of a bare
    encoder–decoder suggests (:func:`pipeswift_lab.profiling.units.decoder_inputs_refusal`)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        source, decoder_input = ids.chunk(2, dim=1)
        return self.model(input_ids=source, decoder_input_ids=decoder_input)


#: Tokens per sequence and micro-batches per step of the token batches below.
SEQ, M = 16, 4


def lm_loss(out, y):
    """Cross-entropy of a causal LM's ``ModelOutput`` against token targets."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def tokens(n=8):
    """``n`` sequences of :data:`SEQ` random tokens and their targets, seeded."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def single_process(model, x, y, steps, loss_fn=lm_loss, optimizer=adam):
    """The model trained in this process on the same :data:`M` micro-batches per step; returns its state dict."""
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        torch.stack([loss_fn(ref(a), b) for a, b in zip(x.chunk(M), y.chunk(M))]).mean().backward()
        opt.step()
    return ref.state_dict()
