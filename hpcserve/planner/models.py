"""Model specs: the architecture figures the planner needs, a small catalog, HF config.json.

Parameter counts are derived from the architecture (Llama-style: gated MLP with three
matrices, no biases, RMSNorm), which reproduces the published counts of the catalog models
(8.03 B, 70.6 B, Mixtral 46.7 B total / 12.9 B active).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.planner.errors import PlanError


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decoder-only transformer with grouped-query attention, dense or mixture-of-experts.

    ``intermediate_size`` is per expert for MoE models; ``experts == 1`` means dense. Fails
    with PlanError naming the field when a size is not positive or heads do not group.
    """

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    experts: int = 1
    experts_per_token: int = 1
    max_context: int = 0  # max_position_embeddings; 0 = unknown
    sliding_window: int = 0  # 0 = full attention (the KV estimate assumes full attention)
    source: str = "catalog"

    def __post_init__(self) -> None:
        for field in ("layers", "hidden_size", "heads", "kv_heads", "head_dim"):
            _require_positive(f"{self.name}: {field}", getattr(self, field))
        for field in ("intermediate_size", "vocab_size", "experts", "experts_per_token"):
            _require_positive(f"{self.name}: {field}", getattr(self, field))
        if self.heads % self.kv_heads:
            raise PlanError(
                f"{self.name}: heads ({self.heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )
        if self.experts_per_token > self.experts:
            raise PlanError(
                f"{self.name}: experts_per_token ({self.experts_per_token}) exceeds "
                f"experts ({self.experts})"
            )

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def attention_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden_size * self.heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def expert_params_per_layer(self) -> int:
        """One gated MLP (gate, up, down): the whole MLP of a dense model."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def shared_layer_params(self) -> int:
        """Transformer-layer weights every token uses: attention, norms, MoE router."""
        router = self.hidden_size * self.experts if self.is_moe else 0
        return self.layers * (self.attention_params_per_layer + 2 * self.hidden_size + router)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus lm_head (one matrix when tied), plus the final norm."""
        tables = 1 if self.tie_embeddings else 2
        return tables * self.lm_head_params + self.hidden_size

    @property
    def layer_params_total(self) -> int:
        return self.shared_layer_params + self.layers * self.experts * self.expert_params_per_layer

    @property
    def params_total(self) -> int:
        return self.layer_params_total + self.embedding_params

    @property
    def params_active(self) -> int:
        """Parameters one token computes with: all of a dense model, top-k experts of a MoE."""
        routed = self.layers * self.experts_per_token * self.expert_params_per_layer
        return self.shared_layer_params + routed + self.embedding_params


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name}: expected a positive integer, got {value!r}")


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b",
        layers=32,
        hidden_size=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_context=131072,
    ),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": ModelSpec(
        "llama-3.1-70b",
        layers=80,
        hidden_size=8192,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_context=131072,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json (its sliding_window is null: full attention)
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b",
        layers=32,
        hidden_size=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        experts=8,
        experts_per_token=2,
        max_context=32768,
    ),
}

# config.json keys whose architecture the formulas above do not describe.
_UNMODELLED_KEYS = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek-style) caches a compressed KV",
    "shared_expert_intermediate_size": "shared experts are not counted",
    "n_shared_experts": "shared experts are not counted",
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (or a model directory holding one).

    Reads ``num_key_value_heads`` (default: ``num_attention_heads``), ``head_dim`` (default:
    hidden / heads), MoE ``num_local_experts`` or ``num_experts`` with ``num_experts_per_tok``
    and ``moe_intermediate_size``; a multimodal config's ``text_config``. Raises PlanError
    naming the file and key when the file is unreadable, a key is missing or not a positive
    integer, or the architecture is one the formulas do not model (latent attention, shared
    experts).
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlanError(f"--model: cannot read {file}: {err}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    text_config = raw.get("text_config")
    cfg = text_config if isinstance(text_config, dict) else raw
    return _spec_from_config(cfg, file, name=str(raw.get("_name_or_path") or file.parent.name))


def _spec_from_config(cfg: dict[str, Any], file: Path, *, name: str) -> ModelSpec:
    for key, why in _UNMODELLED_KEYS.items():
        if cfg.get(key):
            raise PlanError(f"{file}: {key}={cfg[key]!r} is not modelled: {why}")

    def get(key: str, default: int | None = None) -> int:
        value = cfg.get(key)
        if value is None:
            value = default
        if value is None:
            raise PlanError(f"{file}: missing required key {key!r}")
        _require_positive(f"{file}: {key}", value)
        return int(value)

    def optional(key: str) -> int:
        return get(key) if cfg.get(key) else 0

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    experts = get("num_local_experts", get("num_experts", 1))
    expert_size_key = "moe_intermediate_size" if cfg.get("moe_intermediate_size") else None
    return ModelSpec(
        name=name,
        layers=get("num_hidden_layers"),
        hidden_size=hidden,
        heads=heads,
        kv_heads=get("num_key_value_heads", heads),
        head_dim=get("head_dim", hidden // heads),
        intermediate_size=get(expert_size_key or "intermediate_size"),
        vocab_size=get("vocab_size"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        experts=experts,
        experts_per_token=get("num_experts_per_tok", 1) if experts > 1 else 1,
        max_context=optional("max_position_embeddings"),
        sliding_window=optional("sliding_window"),
        source=str(file),
    )


def resolve_model(name_or_path: str) -> ModelSpec:
    """A catalog model by name (case-insensitive), else a config.json path or model directory."""
    spec = MODELS.get(name_or_path.strip().lower())
    if spec is not None:
        return spec
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise PlanError(
        f"--model: {name_or_path!r} is neither a catalog model "
        f"({', '.join(MODELS)}) nor a path to a config.json"
    )
