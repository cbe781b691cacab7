"""hpcserve.tinymodels writes real HF model dirs that transformers loads without complaint."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer

from hpcserve.tinymodels import make_tiny_model

KINDS = ["chat", "embed", "rerank"]
COMMON_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
}
FILES = {
    "chat": COMMON_FILES | {"generation_config.json"},
    "embed": COMMON_FILES | {"vocab.txt"},
    "rerank": COMMON_FILES | {"vocab.txt"},
}
ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
TEXT = "The model reads the next token quickly, and then it writes 42 more!"


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers() -> None:
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tinymodels")
    return {kind: make_tiny_model(kind, root / kind, seed=0) for kind in KINDS}  # type: ignore[arg-type]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def tensor_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str] | None]:
    with safe_open(str(path), framework="numpy") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
        assert dtypes == {"F32"}
        return shapes, f.metadata()


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def expected_llama_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight": (h, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    return out


def expected_bert_shapes(c: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    e = f"{prefix}embeddings"
    out: dict[str, tuple[int, ...]] = {
        f"{e}.word_embeddings.weight": (c["vocab_size"], h),
        f"{e}.position_embeddings.weight": (c["max_position_embeddings"], h),
        f"{e}.token_type_embeddings.weight": (c["type_vocab_size"], h),
        f"{e}.LayerNorm.weight": (h,),
        f"{e}.LayerNorm.bias": (h,),
        f"{prefix}pooler.dense.weight": (h, h),
        f"{prefix}pooler.dense.bias": (h,),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}encoder.layer.{i}"
        for lin, shape in [
            ("attention.self.query", (h, h)),
            ("attention.self.key", (h, h)),
            ("attention.self.value", (h, h)),
            ("attention.output.dense", (h, h)),
            ("intermediate.dense", (inter, h)),
            ("output.dense", (h, inter)),
        ]:
            out[f"{p}.{lin}.weight"] = shape
            out[f"{p}.{lin}.bias"] = (shape[0],)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{p}.{ln}.weight"] = (h,)
            out[f"{p}.{ln}.bias"] = (h,)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_files_and_safetensors_match_config(models: dict[str, Path], kind: str) -> None:
    d = models[kind]
    assert {p.name for p in d.iterdir()} == FILES[kind]
    assert "random" in (d / "README.md").read_text(encoding="utf-8").lower()
    config = read_json(d / "config.json")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size() == 512
    assert config["torch_dtype"] == "float32"
    shapes, metadata = tensor_shapes(d / "model.safetensors")
    assert metadata == {"format": "pt"}
    if kind == "chat":
        expected = expected_llama_shapes(config)
    else:
        prefix = "bert." if kind == "rerank" else ""
        expected = expected_bert_shapes(config, prefix)
        if kind == "rerank":
            expected |= {"classifier.weight": (1, config["hidden_size"]), "classifier.bias": (1,)}
        vocab_txt = (d / "vocab.txt").read_text(encoding="utf-8").splitlines()
        assert vocab_txt == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    assert shapes == expected


def test_chat_config(models: dict[str, Path]) -> None:
    d = models["chat"]
    c = read_json(d / "config.json")
    assert c["model_type"] == "llama"
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (256, 4, 2)
    assert (c["num_hidden_layers"], c["intermediate_size"], c["head_dim"]) == (2, 512, 64)
    assert c["rope_theta"] == 10000
    assert c["rms_norm_eps"] == 1e-5
    assert c["tie_word_embeddings"] is False
    assert c["max_position_embeddings"] == 4096

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tc = read_json(d / "tokenizer_config.json")
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tc["model_max_length"] == 4096
    assert (
        c["bos_token_id"]
        == tok.token_to_id(tc["bos_token"])
        == tok.token_to_id("<|begin_of_text|>")
    )
    assert c["eos_token_id"] == tok.token_to_id(tc["eos_token"])
    gen = read_json(d / "generation_config.json")
    assert tok.token_to_id("<|eot_id|>") in gen["eos_token_id"]
    assert tok.token_to_id("<|end_of_text|>") in gen["eos_token_id"]
    assert read_json(d / "special_tokens_map.json")["eos_token"] == tc["eos_token"]


@pytest.mark.parametrize("kind", ["embed", "rerank"])
def test_bert_config(models: dict[str, Path], kind: str) -> None:
    c = read_json(models[kind] / "config.json")
    assert c["model_type"] == "bert"
    assert (c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]) == (128, 2, 2)
    assert (c["intermediate_size"], c["max_position_embeddings"]) == (512, 512)
    assert c["type_vocab_size"] == 2
    tc = read_json(models[kind] / "tokenizer_config.json")
    assert tc["tokenizer_class"] == "BertTokenizerFast"
    assert tc["do_lower_case"] is True
    if kind == "embed":
        assert c["architectures"] == ["BertModel"]
        assert "id2label" not in c
    else:
        assert c["architectures"] == ["BertForSequenceClassification"]
        assert c["id2label"] == {"0": "LABEL_0"}


def test_chat_tokenizer_round_trips(models: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(str(models["chat"] / "tokenizer.json"))
    enc = tok.encode(TEXT)
    assert enc.ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.decode(enc.ids, skip_special_tokens=True) == TEXT
    odd = "naïve café — 東京 🙂 tabs\tand\nnewlines"  # byte-level BPE covers any text
    assert tok.decode(tok.encode(odd).ids, skip_special_tokens=True) == odd

    hf = transformers.AutoTokenizer.from_pretrained(models["chat"])
    assert hf.decode(hf(TEXT)["input_ids"], skip_special_tokens=True) == TEXT


def render_chat(models: dict[str, Path], messages: list[dict[str, str]], gen: bool) -> str:
    tc = read_json(models["chat"] / "tokenizer_config.json")
    # the same environment transformers and vLLM use for chat templates
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tc["chat_template"])
    return template.render(messages=messages, add_generation_prompt=gen, bos_token=tc["bos_token"])


def test_chat_template_renders(models: dict[str, Path]) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? "},
    ]
    prompt = render_chat(models, messages, gen=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert prompt.endswith("And of Italy?<|eot_id|>" + ASSISTANT_HEADER)
    assert prompt.count("<|begin_of_text|>") == 1
    assert prompt.count("<|eot_id|>") == 4
    for m in messages:
        assert (
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}" in prompt
        )
    assert render_chat(models, messages[1:2], gen=False).endswith("France?<|eot_id|>")

    # special tokens encode to single ids (vLLM tokenizes the rendered prompt this way)
    tok = Tokenizer.from_file(str(models["chat"] / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.token_to_id("<|end_header_id|>") in ids[-3:]
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 4

    hf = transformers.AutoTokenizer.from_pretrained(models["chat"])
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt


@pytest.mark.parametrize("kind", ["embed", "rerank"])
def test_bert_tokenizer_round_trips(models: dict[str, Path], kind: str) -> None:
    tok = Tokenizer.from_file(str(models[kind] / "tokenizer.json"))
    enc = tok.encode(TEXT)
    assert enc.tokens[0] == "[CLS]"
    assert enc.tokens[-1] == "[SEP]"
    assert "[UNK]" not in enc.tokens
    assert tok.decode(enc.ids) == TEXT.lower()
    pair = tok.encode("what is bread", "bread is made of flour")
    assert pair.tokens.count("[SEP]") == 2
    assert pair.type_ids[0] == 0
    assert pair.type_ids[-1] == 1

    hf = transformers.AutoTokenizer.from_pretrained(models[kind])
    assert hf(TEXT)["input_ids"] == enc.ids
    assert hf.decode(enc.ids, skip_special_tokens=True) == TEXT.lower()


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_loads_and_runs(models: dict[str, Path], kind: str) -> None:
    auto = {
        "chat": transformers.AutoModelForCausalLM,
        "embed": transformers.AutoModel,
        "rerank": transformers.AutoModelForSequenceClassification,
    }[kind]
    model, info = auto.from_pretrained(models[kind], output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(models[kind])
    if kind == "rerank":
        batch = tok(
            ["what is bread", "what is rain"],
            ["bread is made of flour"] * 2,
            return_tensors="pt",
            padding=True,
        )
    else:
        batch = tok([TEXT, "a short one"], return_tensors="pt", padding=True)
    n, seq = batch["input_ids"].shape
    with torch.no_grad():
        out = model(**batch)
    config = read_json(models[kind] / "config.json")
    if kind == "chat":
        assert out.logits.shape == (n, seq, config["vocab_size"])
        outputs = [out.logits]
    elif kind == "embed":
        assert out.last_hidden_state.shape == (n, seq, config["hidden_size"])
        assert out.pooler_output.shape == (n, config["hidden_size"])
        outputs = [out.last_hidden_state, out.pooler_output]
    else:
        assert out.logits.shape == (n, 1)
        outputs = [out.logits]
    for t in outputs:
        assert torch.isfinite(t).all()
        assert t.abs().max() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic(models: dict[str, Path], tmp_path: Path, kind: str) -> None:
    again = make_tiny_model(kind, tmp_path / "again", seed=0)  # type: ignore[arg-type]
    assert digests(again) == digests(models[kind])


def test_seed_changes_only_weights(models: dict[str, Path], tmp_path: Path) -> None:
    other = make_tiny_model("chat", tmp_path / "other", seed=1)
    d0, d1 = digests(models["chat"]), digests(other)
    assert d1["model.safetensors"] != d0["model.safetensors"]
    assert d1["tokenizer.json"] == d0["tokenizer.json"]  # the tokenizer ignores the seed


def test_weight_init_statistics(models: dict[str, Path]) -> None:
    with safe_open(str(models["chat"] / "model.safetensors"), framework="numpy") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
    assert abs(float(emb.std()) - 0.02) < 0.001
    assert abs(float(emb.mean())) < 0.001
    assert np.array_equal(norm, np.ones_like(norm))


def test_small_chat_shapes(tmp_path: Path) -> None:
    d = make_tiny_model("chat", tmp_path / "small", size="small", seed=3)
    c = read_json(d / "config.json")
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]) == (6, 512, 8)
    assert (c["num_key_value_heads"], c["intermediate_size"], c["head_dim"]) == (4, 1536, 64)
    assert c["vocab_size"] == 2048
    shapes, _ = tensor_shapes(d / "model.safetensors")
    assert shapes == expected_llama_shapes(c)


def test_progress_and_no_leftovers(tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "m"
    out.mkdir()  # an existing empty directory is fine
    assert make_tiny_model("embed", out, progress=lines.append) == out
    assert len(lines) >= 4
    assert all(isinstance(line, str) and line for line in lines)
    assert str(out) in lines[-1]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # the temporary sibling is gone
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_refuses_non_empty_out_dir(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=re.escape(str(out))):
        make_tiny_model("chat", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=re.escape(str(a_file))):
        make_tiny_model("embed", a_file)


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        make_tiny_model("vision", tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size"):
        make_tiny_model("chat", tmp_path / "x", size="huge")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_module_imports_no_torch() -> None:
    code = (
        "import sys, hpcserve.tinymodels; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# -- the LoRA kind


def test_lora_adapter_fits_the_chat_model_and_changes_its_answers(
    models: dict[str, Path], tmp_path: Path
) -> None:
    adapter = make_tiny_model("lora", tmp_path / "lora", seed=1)
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "README.md",
    }
    config = read_json(adapter / "adapter_config.json")
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", "CAUSAL_LM", 8)
    model = transformers.AutoModelForCausalLM.from_pretrained(models["chat"])
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits.argmax(-1)
    shapes, _ = tensor_shapes(adapter / "adapter_model.safetensors")
    modules = dict(model.named_modules())
    scale = config["lora_alpha"] / config["r"]
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        a_names = [n for n in shapes if n.endswith(".lora_A.weight")]
        assert len(a_names) == 2 * len(config["target_modules"])  # every target of 2 layers
        for a_name in a_names:
            target = a_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            linear = modules[target]
            assert target.rsplit(".", 1)[1] in config["target_modules"]
            a, b = f.get_tensor(a_name), f.get_tensor(a_name.replace("lora_A", "lora_B"))
            assert a.shape == (8, linear.in_features) and b.shape == (linear.out_features, 8)
            with torch.no_grad():
                linear.weight += scale * b @ a  # what PEFT and vLLM compute, merged
    with torch.no_grad():
        after = model(ids).logits.argmax(-1)
    assert not torch.equal(before, after), "the adapter should change greedy answers"


def test_lora_seeds_make_different_adapters(tmp_path: Path) -> None:
    one = make_tiny_model("lora", tmp_path / "a", seed=1)
    again = make_tiny_model("lora", tmp_path / "b", seed=1)
    other = make_tiny_model("lora", tmp_path / "c", seed=2)
    weights = "adapter_model.safetensors"
    assert (one / weights).read_bytes() == (again / weights).read_bytes()
    assert (one / weights).read_bytes() != (other / weights).read_bytes()


def test_chat_variants_for_the_parity_gate(models: dict[str, Path], tmp_path: Path) -> None:
    """float16: the same weights rounded; perturbed: every matrix moved, vectors kept."""
    half = make_tiny_model("chat", tmp_path / "half", dtype="float16")
    moved = make_tiny_model("chat", tmp_path / "moved", perturb=0.5)
    assert read_json(half / "config.json")["torch_dtype"] == "float16"
    assert read_json(moved / "config.json")["torch_dtype"] == "float32"
    weights = "model.safetensors"
    with (
        safe_open(str(models["chat"] / weights), framework="numpy") as base,
        safe_open(str(half / weights), framework="numpy") as f16,
        safe_open(str(moved / weights), framework="numpy") as noisy,
    ):
        for name in base.keys():  # noqa: SIM118 (safe_open is no dict)
            w = base.get_tensor(name)
            assert f16.get_tensor(name).dtype == np.float16
            assert np.array_equal(f16.get_tensor(name), w.astype(np.float16))
            changed = not np.array_equal(noisy.get_tensor(name), w)
            assert changed == (w.ndim == 2), name
    for bad, message in (
        ({"dtype": "bfloat16"}, "unknown dtype"),
        ({"perturb": -1.0}, "perturb must be a number >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            make_tiny_model("chat", tmp_path / "bad", **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chat models only"):
        make_tiny_model("embed", tmp_path / "bad", dtype="float16")
