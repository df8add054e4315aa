"""A transformer described by its shape alone: what the analytic profiles, memory and FLOPs are computed from.

:class:`TransformerSpec` is the model a planner reasons about before any weight exists: ``layers`` blocks of width
``hidden`` over ``seq_len`` tokens and a ``vocab``-sized embedding. The defaults are GPT's (Radford et al. 2019, and
the model of Narayanan et al., SC'21, and Korthikanti et al., 2022): ``ffn = 4 · hidden``, a GeLU MLP, LayerNorm,
learned positions, biases. ``from_config`` reads a Hugging Face config (Llama, Qwen, Mistral, Mixtral and the
others with the same names): grouped-query attention (``kv_heads``), a gated MLP (SwiGLU: gate, up and down
projections), RMSNorm, rotary positions, no biases, mixtures of experts (``experts``, ``top_k``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .checks import check_flag, check_int

__all__ = ["TransformerSpec"]


#: Model types whose blocks are GPT's: LayerNorm, biases, multi-head attention (Falcon's keys and values aside).
_GPT_STYLE = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon")
#: Model types whose MLP is two projections around an activation, not gated, whatever the activation's name.
_UNGATED = _GPT_STYLE + ("starcoder2", "phi", "gpt_bigcode", "codegen", "gpt_neo", "mpt")
#: Activations of gated MLPs (SwiGLU; GeGLU in Gemma's ``hidden_activation``).
_GATED_ACTIVATIONS = ("silu", "swish", "swiglu", "gelu_pytorch_tanh", "gelu")
#: Model types whose blocks have terms a spec does not describe, and which.
_OTHER_BLOCKS = {"jetmoe": "a mixture of attention heads", "llama4": "dense and expert layers interleaved"}
#: Model types with a learned position table.
_LEARNED_POSITIONS = ("gpt2", "opt", "gpt_bigcode", "gpt_neo")


def _refuse_what_a_spec_cannot_describe(config: Any, model_type: str) -> None:
    """``ValueError`` naming the config's fields a :class:`TransformerSpec` has no term for: latent attention
    (DeepSeek's MLA), shared experts beside the routed ones, dense layers among mixture-of-experts ones."""
    found = {
        key: _config_value(config, key)
        for key in (
            "kv_lora_rank",
            "q_lora_rank",
            "n_shared_experts",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "first_k_dense_replace",
            "mlp_only_layers",
        )
    }
    found = {key: value for key, value in found.items() if value}
    if model_type in _OTHER_BLOCKS:
        found["model_type"] = f"{model_type} ({_OTHER_BLOCKS[model_type]})"
    sparse_step = _config_value(config, "decoder_sparse_step", default=1)
    if sparse_step not in (None, 1):
        found["decoder_sparse_step"] = sparse_step
    if found:
        raise ValueError(
            f"the {model_type or type(config).__name__} config has {found}: latent attention, shared experts or "
            "dense layers among expert ones, which TransformerSpec does not describe (its blocks are all alike: "
            "multi-head or grouped-query attention and one MLP or routed experts); build the spec by hand for the "
            "closest shape"
        )


def _falcon_kv_heads(config: Any) -> int | None:
    """Falcon's key/value heads: ``num_kv_heads`` with its new decoder architecture, one with multi-query
    attention, else one per head."""
    if _config_value(config, "new_decoder_architecture", default=False):
        return _config_value(config, "num_kv_heads")
    return 1 if _config_value(config, "multi_query", default=True) else None


def _config_value(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer's shape (see the module docs): ``TransformerSpec(layers, hidden, heads, seq_len,
    vocab, *, ffn=None, kv_heads=None, gated_mlp=False, experts=None, top_k=None, tied=False)``."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """The hidden size ``h``."""
    heads: int
    """Attention (query) heads ``a``."""
    seq_len: int
    """Tokens per sequence ``s``."""
    vocab: int
    """Vocabulary size ``V``."""
    ffn: int | None = None
    """The MLP's inner size (per expert with ``experts``); ``None``: ``4 · hidden``."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None``: ``heads`` (multi-head attention)."""
    gated_mlp: bool = False
    """A gated MLP (SwiGLU: gate and up projections, then down) instead of two projections around a GeLU."""
    experts: int | None = None
    """Experts of a mixture-of-experts MLP in every block; ``None``: a dense MLP."""
    top_k: int | None = None
    """Experts each token is routed to (with ``experts``; ``None``: 1)."""
    tied: bool = False
    """The output head shares the embedding's weights."""
    head_dim: int | None = None
    """Each head's width; ``None``: ``hidden / heads``."""
    bias: bool = True
    """The linear layers and norms carry biases (GPT's); Llama-style models have none."""
    rms_norm: bool = False
    """RMSNorm (a scale only) instead of LayerNorm (scale and shift)."""
    learned_positions: bool = True
    """A learned position embedding of ``seq_len × hidden`` (GPT's); rotary positions have no parameters."""
    qk_norm: bool = False
    """A norm over each head's queries and keys (Qwen3's ``q_norm``, ``k_norm``)."""
    max_positions: int | None = None
    """Rows of the learned position table (with ``learned_positions``); ``None``: ``seq_len``."""
    name: str = field(default="", compare=False)
    """A label (the config's model type, or yours)."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq_len", "vocab"):
            object.__setattr__(self, key, check_int(key, getattr(self, key), minimum=1))
        for key in ("ffn", "kv_heads", "experts", "top_k", "head_dim", "max_positions"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, check_int(key, getattr(self, key), minimum=1))
        for key in ("gated_mlp", "tied", "bias", "rms_norm", "learned_positions", "qk_norm"):
            check_flag(key, getattr(self, key))
        if self.heads % self.kv_heads_:
            raise ValueError(
                f"heads={self.heads} is not divisible by kv_heads={self.kv_heads_}: grouped-query attention shares "
                "each key/value head among an equal number of query heads"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads} (or give head_dim=)")
        if self.top_k is not None and self.experts is None:
            raise ValueError("top_k needs experts= (a mixture of experts)")
        if self.experts is not None and self.top_k_ > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")

    # -- resolved sizes -------------------------------------------------------------------------------------------
    @property
    def ffn_(self) -> int:
        """The MLP's inner size (per expert)."""
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def kv_heads_(self) -> int:
        """Key/value heads."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim_(self) -> int:
        """Each head's width."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def top_k_(self) -> int:
        """Experts per token (1 for a dense MLP)."""
        return self.top_k if self.top_k is not None else 1

    @property
    def q_width(self) -> int:
        """The queries' width, ``heads · head_dim``."""
        return self.heads * self.head_dim_

    @property
    def kv_width(self) -> int:
        """The keys' (and the values') width, ``kv_heads · head_dim``."""
        return self.kv_heads_ * self.head_dim_

    # -- parameters -----------------------------------------------------------------------------------------------
    def attention_params(self) -> int:
        """Parameters of one block's attention: the q, k, v and output projections (with biases if any)."""
        weights = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        norms = 2 * self.head_dim_ * (1 if self.rms_norm else 2) if self.qk_norm else 0
        return weights + norms + (self.q_width + 2 * self.kv_width + self.hidden if self.bias else 0)

    def expert_params(self) -> int:
        """Parameters of one MLP (one expert): two projections (three, gated), with biases if any."""
        projections = 3 if self.gated_mlp else 2
        weights = projections * self.hidden * self.ffn_
        return weights + ((projections - 1) * self.ffn_ + self.hidden if self.bias else 0)

    def mlp_params(self) -> int:
        """Parameters of one block's MLP: one, or every expert and the router."""
        if self.experts is None:
            return self.expert_params()
        return self.experts * self.expert_params() + self.hidden * self.experts

    def norm_params(self) -> int:
        """Parameters of one norm: a scale (and a shift, LayerNorm)."""
        return self.hidden if self.rms_norm else 2 * self.hidden

    def layer_params(self) -> int:
        """Parameters of one block: attention, MLP and two norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def position_params(self) -> int:
        """Parameters of the learned position table (0 without one): ``max_positions · hidden``."""
        return (self.max_positions or self.seq_len) * self.hidden if self.learned_positions else 0

    def embedding_params(self) -> int:
        """Parameters of the embedding: the token table (and the learned positions)."""
        return self.vocab * self.hidden + self.position_params()

    def head_params(self) -> int:
        """Parameters of the output: the final norm and, untied, the projection to the vocabulary."""
        return self.norm_params() + (0 if self.tied else self.vocab * self.hidden)

    def params(self) -> int:
        """Every parameter of the model."""
        return self.embedding_params() + self.layers * self.layer_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters a token computes with: a mixture of experts counts its ``top_k`` experts only."""
        if self.experts is None:
            return self.params()
        idle = (self.experts - self.top_k_) * self.expert_params()
        return self.params() - self.layers * idle

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, *, seq_len: int | None = None, **overrides: Any) -> TransformerSpec:
        """The spec of a Hugging Face config (a ``PretrainedConfig``, its ``to_dict()``, or a model carrying one):
        Llama, Qwen, Mistral, Mixtral and the families that use their names. ``seq_len`` defaults to the config's
        ``max_position_embeddings``; ``overrides`` replace any field. Raises ``ValueError`` naming what the config
        lacks."""
        config = getattr(config, "config", config)
        if isinstance(config, dict):
            from types import SimpleNamespace

            config = SimpleNamespace(**config)
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        model_type = str(_config_value(config, "model_type", default=""))
        _refuse_what_a_spec_cannot_describe(config, model_type)
        gpt_style = model_type in _GPT_STYLE
        act = str(_config_value(config, "hidden_activation", "hidden_act", "activation_function", default="gelu"))
        experts = _config_value(config, "num_local_experts", "num_experts", "n_routed_experts")
        ffn = _config_value(config, "moe_intermediate_size") if experts else None
        ffn = ffn or _config_value(config, "intermediate_size", "n_inner", "ffn_dim")
        positions = _config_value(config, "max_position_embeddings", "n_positions")
        fields: dict[str, Any] = dict(
            layers=_config_value(config, "num_hidden_layers", "n_layer", "num_layers"),
            hidden=_config_value(config, "hidden_size", "n_embd", "d_model"),
            heads=_config_value(config, "num_attention_heads", "n_head"),
            seq_len=seq_len if seq_len is not None else positions,
            vocab=_config_value(config, "vocab_size"),
            ffn=ffn,
            kv_heads=_falcon_kv_heads(config)
            if model_type == "falcon"
            else (None if gpt_style else _config_value(config, "num_key_value_heads")),
            gated_mlp=model_type not in _UNGATED and act in _GATED_ACTIVATIONS,
            experts=experts,
            top_k=_config_value(config, "num_experts_per_tok", "num_experts_per_token") if experts else None,
            tied=bool(_config_value(config, "tie_word_embeddings", default=False)),
            head_dim=_config_value(config, "head_dim"),
            bias=bool(_config_value(config, "attention_bias", "use_bias", default=gpt_style)),
            rms_norm=not gpt_style,
            learned_positions=model_type in _LEARNED_POSITIONS,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3", "gemma3_text"),
            # OPT's table has two rows more than its positions (its padding offset)
            max_positions=None if positions is None else positions + (2 if model_type == "opt" else 0),
            name=model_type,
        )
        fields.update(overrides)
        missing = [key for key in ("layers", "hidden", "heads", "seq_len", "vocab") if fields.get(key) is None]
        if missing:
            raise ValueError(
                f"the config ({type(config).__name__}) gives no {missing}; pass them as keyword overrides, e.g. "
                f"TransformerSpec.from_config(config, {missing[0]}=...)"
            )
        if not fields["learned_positions"]:
            fields["max_positions"] = None
        return cls(**fields)
