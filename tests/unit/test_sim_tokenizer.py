"""The simulator tokenizes as vLLM does: the model's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.sim.tokenizer import HFTokenizer, TokenizerError, WordTokenizer, load_tokenizer
from hpcserve.tinymodels import make_tiny_model

MESSAGES = [
    {"role": "system", "content": "You extract fields.  "},
    {"role": "user", "content": [{"type": "text", "text": "Bill of lading 4711, ACME GmbH"}]},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim-tok") / "chat"
    make_tiny_model("chat", path)
    return path


def test_chat_and_prompt_ids_match_transformers(chat_model: Path) -> None:
    from transformers import PreTrainedTokenizerFast  # the reference, in tests only

    ref = PreTrainedTokenizerFast.from_pretrained(str(chat_model))
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else
             m["content"][0]["text"]} for m in MESSAGES]  # fmt: skip
    expected = ref.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    ours = HFTokenizer(chat_model)
    assert ours.chat_ids(MESSAGES) == ref(expected, add_special_tokens=False)["input_ids"]
    assert ours.prompt_ids("hello there") == ref("hello there")["input_ids"]
    assert ours.decode(ours.filler_ids()).strip().startswith("The quick brown fox")


def test_without_a_model_directory_words_stand_in(tmp_path: Path) -> None:
    tok = load_tokenizer(str(tmp_path / "missing"))
    assert isinstance(tok, WordTokenizer)
    a, b = tok.prompt_ids("a b")
    assert tok.prompt_ids("a b a") == [a, b, a] and a != b
    assert tok.chat_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == [
        a,
        b,
    ]
    assert tok.decode(tok.filler_ids()[:3]) == " tok0 tok1 tok2"


def test_a_template_error_and_bad_content_are_clear(tmp_path: Path, chat_model: Path) -> None:
    with pytest.raises(TokenizerError, match="string or a list of parts"):
        HFTokenizer(chat_model).chat_ids([{"role": "user", "content": 5}])
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        HFTokenizer(tmp_path)
