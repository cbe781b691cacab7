"""Write small, real Hugging Face model directories with random weights.

The directories load with ``transformers`` and serve with vLLM (the CPU build
included), so tests and demos can run a real engine without downloading
anything. Nothing here imports torch or transformers: the control plane must
work without them. Only numpy, ``safetensors.numpy`` and ``tokenizers`` are
used.

Four kinds:

- ``chat``: a Llama-style causal LM (``LlamaForCausalLM``) with a byte-level BPE
  tokenizer, Llama-3 special tokens and a Llama-3 chat template.
- ``embed``: a BERT encoder (``BertModel``) with a lowercase WordPiece
  tokenizer; vLLM serves it on ``/v1/embeddings`` (CLS pooling).
- ``rerank``: ``BertForSequenceClassification`` with one label; vLLM serves it
  on ``/v1/rerank`` and ``/v1/score``.
- ``lora``: a PEFT LoRA adapter (``adapter_config.json`` and
  ``adapter_model.safetensors``) for the ``chat`` model of the same size: every
  attention and MLP projection of every layer, rank 8. vLLM serves it with
  ``--enable-lora`` (``--lora-modules`` or the runtime load endpoint). The seed
  makes different adapters; their weights are large enough that an adapter's
  greedy answers differ from the base model's.

Output is deterministic: the same kind, seed and size give byte-identical files
(with the same numpy, safetensors and tokenizers versions). The tokenizer does
not depend on the seed, only the weights do.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer, WordPieceTrainer

__all__ = ["KINDS", "SIZES", "Kind", "Size", "make_tiny_model"]

Kind = Literal["chat", "embed", "rerank", "lora"]
Size = Literal["tiny", "small"]
KINDS: tuple[str, ...] = ("chat", "embed", "rerank", "lora")
SIZES: tuple[str, ...] = ("tiny", "small")
# Weight dtypes of a chat model's file (numpy has no bfloat16): float16 holds the same
# weights rounded, a variant for dtype parity checks (hpcserve/onboarding/).
DTYPES: dict[str, type[np.floating[Any]]] = {"float32": np.float32, "float16": np.float16}

INIT_STD = 0.02
# Seeds the generated part of the tokenizer corpus; independent of the weight seed.
_CORPUS_SEED = 20240611

# Llama-3 special tokens, in id order (ids 0..4).
BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
CHAT_SPECIAL_TOKENS = [BOS, EOS_TEXT, START_HEADER, END_HEADER, EOT]

# BERT special tokens, in id order (ids 0..4).
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# The Llama-3 Instruct chat template, with Hermes-style tool calling (vLLM's "hermes"
# tool-call parser reads it): with `tools`, a system turn lists them and asks for
# <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks; an assistant turn's tool
# calls are written back that way, a tool result inside <tool_response>. Without tools the
# prompt is the plain Llama-3 one.
LLAMA3_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ bos_token + '<|start_header_id|>system<|end_header_id|>\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}"
    "{% set fn = tool['function'] %}"
    "{{ '\n' + {'type': 'function', 'function': {'name': fn['name'],"
    " 'description': fn['description'] or '', 'parameters': fn['parameters'] or {}}} | tojson }}"
    "{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|eot_id|>\' }}'
    "{% endif %}"
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set ns = namespace(text=(message['content'] or '') | trim) %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set args = call['function']['arguments'] %}"
    "{% set args = args if args is string else args | tojson %}"
    "{% set ns.text = ns.text + ('\n' if ns.text else '') + '<tool_call>\n{\"name\": '"
    " + call['function']['name'] | tojson + ', \"arguments\": ' + args + '}\n</tool_call>' %}"
    "{% endfor %}"
    "{% elif message['role'] == 'tool' %}"
    "{% set ns.text = '<tool_response>\n' + ns.text + '\n</tool_response>' %}"
    "{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + ns.text + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 and not tools %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class _LlamaShape:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    max_positions: int = 4096


@dataclass(frozen=True)
class _BertShape:
    vocab: int
    hidden: int
    heads: int
    layers: int
    intermediate: int
    max_positions: int = 512
    type_vocab: int = 2


# head_dim is 64 everywhere: vLLM's CPU attention rejects head_dim 16.
_LLAMA_SHAPES = {
    "tiny": _LlamaShape(vocab=512, hidden=256, heads=4, kv_heads=2, layers=2, intermediate=512),
    "small": _LlamaShape(vocab=2048, hidden=512, heads=8, kv_heads=4, layers=6, intermediate=1536),
}
_BERT_SHAPES = {
    "tiny": _BertShape(vocab=512, hidden=128, heads=2, layers=2, intermediate=512),
    "small": _BertShape(vocab=2048, hidden=256, heads=4, layers=4, intermediate=1024),
}


# ---------------------------------------------------------------------------
# Tokenizer corpus
# ---------------------------------------------------------------------------

_PARAGRAPHS = """\
The cluster wakes before dawn. Jobs that waited all night in the queue start one after \
another, and the scheduler fills every free node it can find. A serving pool asks for a few \
GPUs, loads its model, and tells the router that it is ready. From then on, requests arrive \
over the network, are split into tokens, and flow through the engine in small batches.

Large language models predict the next token from the ones before it. A prompt goes in, the \
model reads it once to fill its key and value cache, and then it writes one token at a time. \
When many prompts share the same beginning, a cache can keep that shared prefix, so the \
second request starts much faster than the first. Good routing sends each request to the \
engine that already holds most of its prefix.

She walked along the river in the late afternoon, counting the boats and the birds. The \
water was green and slow, and the light came low through the trees. At the bridge she \
stopped, bought a cup of tea from a small stand, and watched a group of children throw \
bread to the ducks. Nobody was in a hurry, and the city seemed, for once, to be quiet.

To make bread, mix four cups of flour with a spoon of salt, a little yeast and warm water. \
Knead the dough for ten minutes until it is smooth, then let it rise for an hour in a warm \
place. Shape it into a loaf, bake it at two hundred degrees for about forty minutes, and let \
it cool before you cut it. The crust should be brown and the inside soft.

Questions and answers are the heart of a chat assistant. The user writes a message, the \
system sets the rules, and the assistant replies. What is the capital of France? Paris is \
the capital of France. How many days are in a week? There are seven days in a week. Can you \
help me write a short poem about the sea? Of course: the sea is wide, the sea is deep, it \
sings the sailors off to sleep.

Every experiment needs a control. Measure twice, write down what you saw, and keep the \
numbers that surprised you. A result that nobody can repeat is not yet a result. Share the \
code, the data and the seed, and let others check the work; science moves forward when \
people can build on each other with trust.
"""


def _phrases(text: str) -> list[str]:
    return text.split("|")


def _words(text: str) -> list[str]:
    return text.split()


_SUBJECTS = _phrases(
    "the model|a user|the router|my friend|the teacher|a small dog|the old engine|"
    "our team|the scheduler|a student|the city|this node|the gateway|a traveller|"
    "the kitchen|every worker|the server|her brother"
)
_VERBS = _words(
    "reads writes answers sends finds keeps builds loads counts opens moves checks "
    "learns sees likes needs starts stops returns caches serves measures follows "
    "remembers"
)
_OBJECTS = _phrases(
    "a long prompt|the next token|every request|a cup of coffee|the blue book|"
    "three questions|the whole queue|a warm loaf|the last message|two replies|"
    "the morning train|a quiet room|the shared prefix|many small batches|"
    "the weather report|a new job|the green river|forty numbers"
)
_ADVERBS = _phrases(
    "quickly|slowly|again|today|at night|before lunch|in the morning|without a sound|"
    "with great care|every hour|once more|by the window"
)
_CONNECTORS = _phrases("and then|because|while|although|so|but|after that|when")
_ONSETS = _words("b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl qu sh st th tr")
_NUCLEI = _words("a e i o u ai ea ee io oo ou y")
_CODAS = ["", "", "", *_words("n r s t l m nd ng rk st x")]


def _pseudo_word(rng: np.random.Generator) -> str:
    syllables = int(rng.integers(1, 4))
    parts = []
    for _ in range(syllables):
        parts.append(_ONSETS[int(rng.integers(len(_ONSETS)))])
        parts.append(_NUCLEI[int(rng.integers(len(_NUCLEI)))])
        parts.append(_CODAS[int(rng.integers(len(_CODAS)))])
    return "".join(parts)


def _pick(rng: np.random.Generator, words: list[str]) -> str:
    return words[int(rng.integers(len(words)))]


def _generated_lines(n_lines: int) -> Iterator[str]:
    """Deterministic English-like sentences, numbers and invented words."""
    rng = np.random.default_rng(_CORPUS_SEED)
    lexicon = [_pseudo_word(rng) for _ in range(1500)]
    for i in range(n_lines):
        clause = f"{_pick(rng, _SUBJECTS)} {_pick(rng, _VERBS)} {_pick(rng, _OBJECTS)}"
        if rng.random() < 0.5:
            clause += f" {_pick(rng, _ADVERBS)}"
        if rng.random() < 0.4:
            clause += (
                f", {_pick(rng, _CONNECTORS)} {_pick(rng, _SUBJECTS)} "
                f"{_pick(rng, _VERBS)} {_pick(rng, _OBJECTS)}"
            )
        sentence = clause[0].upper() + clause[1:] + _pick(rng, [".", ".", ".", "!", "?"])
        names = " ".join(lexicon[int(rng.integers(len(lexicon)))] for _ in range(4))
        number = int(rng.integers(0, 100_000))
        yield f"{sentence} Line {i}: {names.capitalize()} cost {number} units ({number / 7:.2f})."


def _corpus(size: str) -> list[str]:
    lines = [p for p in _PARAGRAPHS.split("\n\n") if p.strip()]
    lines.extend(_generated_lines(3000 if size == "tiny" else 8000))
    return lines


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------


def _train_chat_tokenizer(vocab_size: int, size: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(size), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def _bert_pipeline(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")


def _train_bert_tokenizer(vocab_size: int, size: str) -> Tokenizer:
    corpus = _corpus(size)
    trainer_tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    _bert_pipeline(trainer_tok)
    # The trainer gives "##x" continuation characters ids in hash-map order, which
    # varies between processes and then breaks ties between equally frequent merges
    # differently. Fixing those ids up front (as extra "special" tokens, sorted)
    # makes training deterministic; the real tokenizer is rebuilt from the vocab.
    norm = trainer_tok.normalizer
    assert norm is not None
    chars = sorted({c for line in corpus for c in norm.normalize_str(line) if not c.isspace()})
    trainer = WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=[*BERT_SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)],
        continuing_subword_prefix="##",
        show_progress=False,
    )
    trainer_tok.train_from_iterator(corpus, trainer=trainer)
    vocab = trainer_tok.get_vocab(with_added_tokens=False)

    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    _bert_pipeline(tok)
    tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))
    sep, cls = tok.token_to_id("[SEP]"), tok.token_to_id("[CLS]")
    assert sep is not None and cls is not None  # added just above
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok


def _added_tokens_decoder(tok: Tokenizer, specials: list[str]) -> dict[str, dict[str, Any]]:
    return {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in specials
    }


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


class _Init:
    """Draws tensors in a fixed order from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def normal(self, name: str, *shape: int) -> None:
        arr = self.rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(INIT_STD)
        self.tensors[name] = arr

    def ones(self, name: str, n: int) -> None:
        self.tensors[name] = np.ones((n,), dtype=np.float32)

    def zeros(self, name: str, n: int) -> None:
        self.tensors[name] = np.zeros((n,), dtype=np.float32)

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
        self.normal(f"{name}.weight", out_f, in_f)
        if bias:
            self.zeros(f"{name}.bias", out_f)

    def layer_norm(self, name: str, n: int) -> None:
        self.ones(f"{name}.weight", n)
        self.zeros(f"{name}.bias", n)


def _llama_weights(s: _LlamaShape, vocab: int, seed: int) -> dict[str, np.ndarray]:
    head_dim = s.hidden // s.heads
    kv_dim = s.kv_heads * head_dim
    w = _Init(seed)
    w.normal("model.embed_tokens.weight", vocab, s.hidden)
    for i in range(s.layers):
        p = f"model.layers.{i}"
        w.linear(f"{p}.self_attn.q_proj", s.hidden, s.hidden, bias=False)
        w.linear(f"{p}.self_attn.k_proj", kv_dim, s.hidden, bias=False)
        w.linear(f"{p}.self_attn.v_proj", kv_dim, s.hidden, bias=False)
        w.linear(f"{p}.self_attn.o_proj", s.hidden, s.hidden, bias=False)
        w.linear(f"{p}.mlp.gate_proj", s.intermediate, s.hidden, bias=False)
        w.linear(f"{p}.mlp.up_proj", s.intermediate, s.hidden, bias=False)
        w.linear(f"{p}.mlp.down_proj", s.hidden, s.intermediate, bias=False)
        w.ones(f"{p}.input_layernorm.weight", s.hidden)
        w.ones(f"{p}.post_attention_layernorm.weight", s.hidden)
    w.ones("model.norm.weight", s.hidden)
    w.normal("lm_head.weight", vocab, s.hidden)
    return w.tensors


def _bert_weights(s: _BertShape, vocab: int, seed: int, prefix: str) -> _Init:
    w = _Init(seed)
    e = f"{prefix}embeddings"
    w.normal(f"{e}.word_embeddings.weight", vocab, s.hidden)
    w.normal(f"{e}.position_embeddings.weight", s.max_positions, s.hidden)
    w.normal(f"{e}.token_type_embeddings.weight", s.type_vocab, s.hidden)
    w.layer_norm(f"{e}.LayerNorm", s.hidden)
    for i in range(s.layers):
        p = f"{prefix}encoder.layer.{i}"
        w.linear(f"{p}.attention.self.query", s.hidden, s.hidden)
        w.linear(f"{p}.attention.self.key", s.hidden, s.hidden)
        w.linear(f"{p}.attention.self.value", s.hidden, s.hidden)
        w.linear(f"{p}.attention.output.dense", s.hidden, s.hidden)
        w.layer_norm(f"{p}.attention.output.LayerNorm", s.hidden)
        w.linear(f"{p}.intermediate.dense", s.intermediate, s.hidden)
        w.linear(f"{p}.output.dense", s.hidden, s.intermediate)
        w.layer_norm(f"{p}.output.LayerNorm", s.hidden)
    w.linear(f"{prefix}pooler.dense", s.hidden, s.hidden)
    return w


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _n_params(tensors: dict[str, np.ndarray]) -> int:
    return int(sum(t.size for t in tensors.values()))


def _variant(
    tensors: dict[str, np.ndarray], dtype: str, perturb: float, seed: int
) -> dict[str, np.ndarray]:
    """The same weights stored as `dtype`; with `perturb` > 0, every matrix plus seeded
    Gaussian noise of `perturb` times its own standard deviation (a corrupted variant)."""
    if perturb > 0:
        rng = np.random.default_rng(seed + 1_000_003)  # apart from the weights' generator
        for name in sorted(tensors):
            arr = tensors[name]
            if arr.ndim == 2:
                noise = rng.standard_normal(arr.shape, dtype=np.float32)
                tensors[name] = arr + noise * np.float32(perturb * float(arr.std()))
    return {name: arr.astype(DTYPES[dtype]) for name, arr in tensors.items()}


def _write_chat(
    d: Path,
    size: str,
    seed: int,
    say: Callable[[str], None],
    dtype: str = "float32",
    perturb: float = 0.0,
) -> dict[str, Any]:
    s = _LLAMA_SHAPES[size]
    say(f"training byte-level BPE tokenizer (target vocab {s.vocab})")
    tok = _train_chat_tokenizer(s.vocab, size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in CHAT_SPECIAL_TOKENS}
    say(f"writing tokenizer files (vocab {vocab})")
    tok.save(str(d / "tokenizer.json"))
    _write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,
            "pad_token": EOS_TEXT,
            "model_max_length": s.max_positions,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "added_tokens_decoder": _added_tokens_decoder(tok, CHAT_SPECIAL_TOKENS),
            "chat_template": LLAMA3_CHAT_TEMPLATE,
        },
    )
    _write_json(
        d / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOT, "pad_token": EOS_TEXT},
    )
    say("writing config.json and generation_config.json")
    _write_json(
        d / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": s.hidden,
            "intermediate_size": s.intermediate,
            "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads,
            "head_dim": s.hidden // s.heads,
            "hidden_act": "silu",
            "max_position_embeddings": s.max_positions,
            "initializer_range": INIT_STD,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[EOT],
            "pad_token_id": ids[EOS_TEXT],
            "torch_dtype": dtype,
        },
    )
    _write_json(
        d / "generation_config.json",
        {
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[EOS_TEXT], ids[EOT]],
            "pad_token_id": ids[EOS_TEXT],
        },
    )
    say(f"initialising Llama weights (seed {seed})")
    tensors = _variant(_llama_weights(s, vocab, seed), dtype, perturb, seed)
    if perturb > 0:
        say(f"perturbed: noise of {perturb:g} x each matrix's standard deviation")
    say(f"writing model.safetensors ({_n_params(tensors):,} parameters, {dtype})")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return {
        "architecture": "LlamaForCausalLM",
        "shape": f"{s.layers} layers, hidden {s.hidden}, {s.heads} heads "
        f"({s.kv_heads} KV heads, head_dim {s.hidden // s.heads}), "
        f"intermediate {s.intermediate}",
        "tokenizer": f"byte-level BPE, vocab {vocab}, Llama-3 special tokens and chat template",
        "params": _n_params(tensors),
        "dtype": dtype + (f", perturbed by {perturb:g}" if perturb > 0 else ""),
    }


def _write_bert(
    d: Path, kind: str, size: str, seed: int, say: Callable[[str], None]
) -> dict[str, Any]:
    s = _BERT_SHAPES[size]
    say(f"training WordPiece tokenizer (target vocab {s.vocab})")
    tok = _train_bert_tokenizer(s.vocab, size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    say(f"writing tokenizer files (vocab {vocab})")
    tok.save(str(d / "tokenizer.json"))
    id_to_token = [tok.id_to_token(i) for i in range(vocab)]
    (d / "vocab.txt").write_text("".join(f"{t}\n" for t in id_to_token), encoding="utf-8")
    specials = {
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    _write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "BertTokenizerFast",
            "do_lower_case": True,
            "tokenize_chinese_chars": True,
            "strip_accents": None,
            **specials,
            "model_max_length": s.max_positions,
            "clean_up_tokenization_spaces": True,
            "added_tokens_decoder": _added_tokens_decoder(tok, BERT_SPECIAL_TOKENS),
        },
    )
    _write_json(d / "special_tokens_map.json", specials)

    rerank = kind == "rerank"
    arch = "BertForSequenceClassification" if rerank else "BertModel"
    say("writing config.json")
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "intermediate_size": s.intermediate,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": s.max_positions,
        "type_vocab_size": s.type_vocab,
        "initializer_range": INIT_STD,
        "layer_norm_eps": 1e-12,
        "pad_token_id": tok.token_to_id("[PAD]"),
        "position_embedding_type": "absolute",
        "classifier_dropout": None,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if rerank:
        config["id2label"] = {"0": "LABEL_0"}
        config["label2id"] = {"LABEL_0": 0}
    _write_json(d / "config.json", config)

    say(f"initialising BERT weights (seed {seed})")
    # BertModel checkpoints carry no prefix (vLLM's BertModel loader adds its own
    # "model." and would not find "bert.*"); task heads nest the encoder under "bert.".
    w = _bert_weights(s, vocab, seed, prefix="bert." if rerank else "")
    if rerank:
        w.linear("classifier", 1, s.hidden)
    tensors = w.tensors
    say(f"writing model.safetensors ({_n_params(tensors):,} parameters, float32)")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return {
        "architecture": arch,
        "shape": f"{s.layers} layers, hidden {s.hidden}, {s.heads} heads, "
        f"intermediate {s.intermediate}",
        "tokenizer": f"lowercase WordPiece, vocab {vocab}",
        "params": _n_params(tensors),
    }


LORA_RANK = 8
LORA_ALPHA = 16
# Each LoRA factor ~ normal(0, LORA_STD): the update scale * B @ A then has a spread of
# about 2 * sqrt(8) * 0.1^2 = 0.057, larger than the base weights' 0.02, so an adapter
# visibly changes the greedy output of the random base model.
LORA_STD = 0.1
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_weights(s: _LlamaShape, seed: int) -> dict[str, np.ndarray]:
    kv_dim = s.kv_heads * (s.hidden // s.heads)
    shapes = {  # target -> (out features, in features)
        "q_proj": (s.hidden, s.hidden),
        "k_proj": (kv_dim, s.hidden),
        "v_proj": (kv_dim, s.hidden),
        "o_proj": (s.hidden, s.hidden),
        "gate_proj": (s.intermediate, s.hidden),
        "up_proj": (s.intermediate, s.hidden),
        "down_proj": (s.hidden, s.intermediate),
    }
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for i in range(s.layers):
        for target in LORA_TARGETS:
            block = (
                "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            out_f, in_f = shapes[target]
            p = f"base_model.model.model.layers.{i}.{block}.{target}"
            for factor, shape in (("lora_A", (LORA_RANK, in_f)), ("lora_B", (out_f, LORA_RANK))):
                arr = rng.standard_normal(shape, dtype=np.float32)
                arr *= np.float32(LORA_STD)
                tensors[f"{p}.{factor}.weight"] = arr
    return tensors


def _write_lora(d: Path, size: str, seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    s = _LLAMA_SHAPES[size]
    _write_json(
        d / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": f"hpcserve-tiny-chat-{size}",
            "r": LORA_RANK,
            "lora_alpha": LORA_ALPHA,
            "lora_dropout": 0.0,
            "target_modules": list(LORA_TARGETS),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        },
    )
    say(f"initialising LoRA weights (rank {LORA_RANK}, seed {seed})")
    tensors = _lora_weights(s, seed)
    say(f"writing adapter_model.safetensors ({_n_params(tensors):,} parameters, float32)")
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    return {
        "architecture": f"PEFT LoRA for the {size} chat model (LlamaForCausalLM)",
        "shape": f"rank {LORA_RANK}, alpha {LORA_ALPHA}, on {', '.join(LORA_TARGETS)} "
        f"of {s.layers} layers",
        "tokenizer": "none (the base model's)",
        "params": _n_params(tensors),
    }


_USES = {
    "chat": "vLLM serves it on /v1/chat/completions and /v1/completions.",
    "embed": "vLLM serves it on /v1/embeddings (CLS pooling; `--runner auto` picks pooling).\n"
    "Its positions stop at 512: start vLLM with `--max-model-len 512` or less.",
    "rerank": "vLLM serves it on /v1/rerank and /v1/score (one-label cross-encoder).\n"
    "Its positions stop at 512: start vLLM with `--max-model-len 512` or less.",
    "lora": "vLLM serves it on the tiny chat model of the same size, started with\n"
    "`--enable-lora --max-lora-rank 8` and `--lora-modules NAME=DIR` or loaded at run time\n"
    "(POST /v1/load_lora_adapter, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).",
}


def _write_readme(d: Path, kind: str, size: str, seed: int, info: dict[str, Any]) -> None:
    weights = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    text = f"""\
# Random-weight test model ({kind}, {size}, seed {seed})

**This is not a trained model.** Its weights are random (normal(0, {INIT_STD}),
norms at one, biases at zero) and its output is meaningless. It exists so that
tests and demos can load and serve a real model without a download or a GPU.

- Architecture: `{info["architecture"]}`, {info["shape"]}
- Parameters: {info["params"]:,} ({info.get("dtype", "float32")}, `{weights}`)
- Tokenizer: {info["tokenizer"]}, trained with the `tokenizers` library on a small
  built-in English corpus plus deterministic generated text

{_USES[kind]}

Made by `hpcserve.tinymodels.make_tiny_model({kind!r}, out_dir, seed={seed}, size={size!r})`,
which uses only numpy, safetensors and tokenizers (no torch). The same kind, seed and size
give byte-identical files.
"""
    (d / "README.md").write_text(text, encoding="utf-8")


def make_tiny_model(
    kind: Kind,
    out_dir: Path,
    *,
    seed: int = 0,
    size: Size = "tiny",
    progress: Callable[[str], None] | None = None,
    dtype: str = "float32",
    perturb: float = 0.0,
) -> Path:
    """Write a random-weight Hugging Face model directory of the given kind to ``out_dir``.

    A chat model may be written with its weights stored as float16 (``dtype``: the same
    weights, rounded) or ``perturb``ed (each matrix plus noise of that many standard
    deviations): the variants model onboarding's parity gate tells apart.

    The files are written to a temporary sibling directory that is then renamed
    to ``out_dir``, so ``out_dir`` is either absent or complete. An existing
    empty ``out_dir`` is replaced; a non-empty one is refused with ValueError.
    Returns ``out_dir``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if isinstance(perturb, bool) or not isinstance(perturb, int | float) or perturb < 0:
        raise ValueError(f"perturb must be a number >= 0, got {perturb!r}")
    if kind != "chat" and (dtype != "float32" or perturb):
        raise ValueError(f"dtype and perturb apply to chat models only, not {kind!r}")
    out_dir = Path(out_dir)
    _check_target(out_dir)

    def say(line: str) -> None:
        if progress is not None:
            progress(line)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        say(f"building {size} {kind} model in {tmp}")
        if kind == "chat":
            info = _write_chat(tmp, size, seed, say, dtype, float(perturb))
        elif kind == "lora":
            info = _write_lora(tmp, size, seed, say)
        else:
            info = _write_bert(tmp, kind, size, seed, say)
        _write_readme(tmp, kind, size, seed, info)
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only files
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        _check_target(out_dir)
        say(f"moving into place: {out_dir}")
        try:
            os.replace(tmp, out_dir)  # replaces an empty directory, never a full one
        except OSError as exc:
            raise ValueError(
                f"cannot write tiny model to {out_dir}: it appeared meanwhile ({exc})"
            ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"done: {out_dir}")
    return out_dir


def _check_target(out_dir: Path) -> None:
    if out_dir.is_symlink():
        raise ValueError(f"refusing to write tiny model: {out_dir} is a symlink")
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            raise ValueError(f"refusing to write tiny model: {out_dir} exists and is not empty")
    elif out_dir.exists():
        raise ValueError(f"refusing to write tiny model: {out_dir} exists and is not a directory")
