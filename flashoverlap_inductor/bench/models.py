"""Model presets for the end-to-end benchmark: HuggingFace ``transformers`` configs, random init, no downloads.

A preset names the layer shapes of a published model (``llama3-8b``, ``llama3-70b``, ``qwen3-32b``, ``gemma3-12b``,
``qwen3-moe`` (Qwen3-30B-A3B), ``mixtral-8x7b``) or a ``tiny-*`` form of each family for CPU runs. ``--layers`` cuts
depth, and every other shape can be overridden (``ModelSpec.with_overrides``). ``build`` makes the ``*ForCausalLM``
module with ``AutoModelForCausalLM.from_config`` on the target device, every rank from the same seed, so all ranks
start with identical full weights before the parallel plan shards them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of one decoder-only model. ``intermediate``: the dense MLP width, or each expert's width for MoE
    families; ``experts`` / ``top_k``: 0 for dense models. ``head_dim`` None: ``hidden // heads``."""

    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    experts: int = 0
    top_k: int = 0
    rope_theta: float = 500000.0

    @property
    def moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def tiny(self) -> bool:
        return self.name.startswith("tiny-")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def with_overrides(self, **changes: int | None) -> ModelSpec:
        """A copy with every non-None change applied (keys are field names)."""
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def params(self) -> int:
        """Parameter count of the unsharded model (embedding and lm_head untied)."""
        h, d = self.hidden, self.head_size
        attn = h * d * (2 * self.heads + 2 * self.kv_heads)
        if self.moe:
            ffn = self.experts * 3 * h * self.intermediate + self.experts * h
        else:
            ffn = 3 * h * self.intermediate
        norms = (4 if self.family == "gemma3" else 2) * h  # Gemma 3: a norm before and after each sublayer
        norms += 2 * d if self.family in ("qwen3", "qwen3_moe", "gemma3") else 0  # per-head q/k norms
        return self.layers * (attn + ffn + norms) + 2 * self.vocab * h + h

    def describe(self) -> str:
        moe = f", {self.experts} experts top-{self.top_k}" if self.moe else ""
        return (f"{self.name} ({self.family}: hidden {self.hidden}, intermediate {self.intermediate}, "
                f"{self.layers} layers, heads {self.heads}/{self.kv_heads} kv x {self.head_size}, vocab {self.vocab}"
                f"{moe}; {_count(self.params())} params)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


PRESETS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("llama3-8b", "llama", 4096, 14336, 32, 32, 8, 128256),
    ModelSpec("llama3-70b", "llama", 8192, 28672, 80, 64, 8, 128256),
    ModelSpec("qwen3-32b", "qwen3", 5120, 25600, 64, 64, 8, 151936, head_dim=128, rope_theta=1e6),
    # Gemma 3 12B's text stack (its sliding-window and global layers, 5:1, as transformers' config gives them)
    ModelSpec("gemma3-12b", "gemma3", 3840, 15360, 48, 16, 8, 262208, head_dim=256, rope_theta=1e6),
    # Qwen3-30B-A3B: 4 kv heads (use --kv-heads 8 for 8 ranks), 128 experts of width 768, top-8
    ModelSpec("qwen3-moe", "qwen3_moe", 2048, 768, 48, 32, 4, 151936, head_dim=128, experts=128, top_k=8,
              rope_theta=1e6),
    ModelSpec("mixtral-8x7b", "mixtral", 4096, 14336, 32, 32, 8, 32000, experts=8, top_k=2, rope_theta=1e6),
    ModelSpec("tiny-llama", "llama", 64, 128, 2, 4, 2, 256),
    ModelSpec("tiny-qwen3", "qwen3", 64, 128, 2, 4, 2, 256, head_dim=16, rope_theta=1e6),
    ModelSpec("tiny-gemma3", "gemma3", 64, 128, 2, 4, 2, 256, head_dim=16, rope_theta=1e6),
    ModelSpec("tiny-moe", "qwen3_moe", 64, 32, 2, 4, 2, 256, head_dim=16, experts=4, top_k=2, rope_theta=1e6),
    ModelSpec("tiny-mixtral", "mixtral", 64, 64, 2, 4, 2, 256, experts=4, top_k=2, rope_theta=1e6),
)}


def hf_config(spec: ModelSpec, max_positions: int):
    """The ``transformers`` config of ``spec`` (sdpa attention, untied embeddings, no KV cache, no dropout)."""
    import transformers

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=max(max_positions, 128), tie_word_embeddings=False, use_cache=False,
                  attn_implementation="sdpa", rope_theta=spec.rope_theta)
    if spec.family == "llama":
        return transformers.LlamaConfig(intermediate_size=spec.intermediate, head_dim=spec.head_size, **common)
    if spec.family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=spec.intermediate, head_dim=spec.head_size, **common)
    if spec.family == "gemma3":  # GeLU MLP, a norm before and after the attention and the MLP, q/k norms
        return transformers.Gemma3TextConfig(intermediate_size=spec.intermediate, head_dim=spec.head_size,
                                             query_pre_attn_scalar=spec.head_size, **common)
    if spec.family == "qwen3_moe":  # every layer sparse; intermediate_size is unused by sparse layers
        return transformers.Qwen3MoeConfig(moe_intermediate_size=spec.intermediate, intermediate_size=spec.intermediate,
                                           num_experts=spec.experts, num_experts_per_tok=spec.top_k,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                           head_dim=spec.head_size, output_router_logits=False, **common)
    if spec.family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=spec.intermediate, num_local_experts=spec.experts,
                                          num_experts_per_tok=spec.top_k, head_dim=spec.head_size,
                                          output_router_logits=False, router_jitter_noise=0.0, **common)
    raise ValueError(f"unknown model family {spec.family!r}")


def build(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int, max_positions: int) -> nn.Module:
    """The unsharded ``*ForCausalLM`` of ``spec`` on ``device`` in ``dtype``, initialized by transformers' own
    ``_init_weights`` from ``torch.manual_seed(seed)`` (the same on every rank)."""
    import transformers
    from packaging.version import Version

    cfg = hf_config(spec, max_positions)
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, **{key: dtype})
    model = model.to(device=device, dtype=dtype)
    model.config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``*ForCausalLM`` (``model.model.layers``)."""
    return model.model.layers
