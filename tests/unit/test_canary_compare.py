"""contracts/canary.py: the comparison with a golden record (tables), the answer parser and
the record's format."""

from __future__ import annotations

import math

import pytest

from hpcserve.contracts.canary import (
    CanaryAnswer,
    CanaryError,
    CanarySettings,
    CanaryToken,
    GoldenRecord,
    Mismatch,
    check_settings,
    compare,
    decode_record,
    encode_record,
    parse_answer,
    request_body,
)

TOL = 0.1


def tok(token_id: int, logprob: float, **alternatives: float) -> CanaryToken:
    """A token with its top alternatives (`t7=-2.0`: token 7 at -2.0); the token itself is
    always among them, as vLLM returns it."""
    top = {int(k[1:]): v for k, v in alternatives.items()}
    return CanaryToken(token_id, logprob, {token_id: logprob, **top})


GOLD = [
    tok(10, -0.5, t11=-1.5, t12=-3.0),
    tok(20, -0.7, t21=-0.75, t22=-4.0),  # 20 and 21 nearly tied
    tok(30, -0.2, t31=-2.5, t32=-5.0),
]


def record(tokens: list[CanaryToken], *, positions: int = 0) -> GoldenRecord:
    settings = CanarySettings(prompts=("p0",), max_tokens=3, positions=positions, logprob_tol=TOL)
    return GoldenRecord("m@1", settings, [CanaryAnswer("p0", tokens)])


def answer(tokens: list[CanaryToken]) -> list[CanaryAnswer]:
    return [CanaryAnswer("p0", tokens)]


@pytest.mark.parametrize(
    ("name", "seen", "positions", "expected"),
    [
        ("identical", GOLD, 0, None),
        (
            "logprobs within the tolerance",
            [tok(10, -0.55, t11=-1.45, t12=-3.05), GOLD[1], tok(30, -0.25, t31=-2.45)],
            0,
            None,
        ),
        (
            "another token first",
            [tok(11, -0.5, t10=-1.5), *GOLD[1:]],
            0,
            Mismatch(0, 0, "token 11, golden 10"),
        ),
        (
            "a near tie on both sides parts the decodes: passed from there on",
            [GOLD[0], tok(21, -0.72, t20=-0.74), tok(99, -0.1)],
            0,
            None,
        ),
        (
            "a tie only on the golden side is a mismatch",
            [GOLD[0], tok(21, -0.3, t20=-2.0), GOLD[2]],
            0,
            Mismatch(0, 1, "token 21, golden 20"),
        ),
        (
            "the chosen token's logprob beyond the tolerance",
            [GOLD[0], GOLD[1], tok(30, -0.35, t31=-2.5, t32=-5.0)],
            0,
            Mismatch(0, 2, "token 30 logprob -0.3500, golden -0.2000 (tolerance 0.1)"),
        ),
        (
            "an alternative beyond the tolerance",
            [tok(10, -0.5, t11=-1.8, t12=-3.0), *GOLD[1:]],
            0,
            Mismatch(0, 0, "alternative 11 logprob -1.8000, golden -1.5000 (tolerance 0.1)"),
        ),
        (
            "an alternative clearly inside the top is missing",
            [tok(10, -0.5, t12=-3.0, t13=-3.1), *GOLD[1:]],
            0,
            Mismatch(0, 0, "alternative 11 (golden logprob -1.5000) not among the top"),
        ),
        (
            "the least alternative may leave the top",
            [tok(10, -0.5, t11=-1.5, t13=-2.9), *GOLD[1:]],
            0,
            None,
        ),
        (
            "the answer ends early",
            GOLD[:2],
            0,
            Mismatch(0, 2, "the answer ends after 2 tokens"),
        ),
        (
            "positions past N are not compared",
            [*GOLD[:2], tok(31, -0.2)],
            2,
            None,
        ),
        (
            "positions up to N are",
            [*GOLD[:2], tok(31, -0.2)],
            3,
            Mismatch(0, 2, "token 31, golden 30"),
        ),
        (
            "no logprob tolerance beyond the stated one",
            [tok(10, -0.5 - TOL * 1.01), *GOLD[1:]],
            0,
            Mismatch(0, 0, "token 10 logprob -0.6010, golden -0.5000 (tolerance 0.1)"),
        ),
    ],
)
def test_compare(name, seen, positions, expected):
    assert compare(record(GOLD, positions=positions), answer(seen)) == expected, name


def test_the_first_differing_prompt_and_position_are_named():
    settings = CanarySettings(prompts=("a", "b"), max_tokens=3, logprob_tol=TOL)
    golden = GoldenRecord("m@1", settings, [CanaryAnswer("a", GOLD), CanaryAnswer("b", GOLD)])
    seen = [CanaryAnswer("a", GOLD), CanaryAnswer("b", [*GOLD[:2], tok(32, -0.1)])]
    mismatch = compare(golden, seen)
    assert mismatch == Mismatch(1, 2, "token 32, golden 30")
    assert mismatch.detail() == (
        "numerical canary mismatch at position 2 (prompt 1): token 32, golden 30"
    )
    assert compare(golden, seen[:1]) == Mismatch(0, 0, "1 answers to the 2 canary prompts")


def test_a_record_round_trips_and_is_checked():
    golden = record(GOLD)
    assert decode_record(encode_record(golden)) == golden
    with pytest.raises(CanaryError, match="not a golden record"):
        decode_record(b'{"model_ref": "m@1"}')
    bad = GoldenRecord("m@1", golden.settings, [])
    with pytest.raises(CanaryError, match="0 answers for 1 prompts"):
        decode_record(encode_record(bad))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (CanarySettings(prompts=()), "prompts: a list of non-empty strings"),
        (CanarySettings(prompts=("",)), "prompts: a list of non-empty strings"),
        (CanarySettings(max_tokens=0), "max_tokens: 0; allowed 1 to 256"),
        (CanarySettings(top_logprobs=21), "top_logprobs: 21; allowed 1 to 20"),
        (CanarySettings(max_tokens=4, positions=5), "positions: 5; allowed 0 (all) to max"),
        (CanarySettings(logprob_tol=-1.0), "logprob_tol: -1.0"),
        (CanarySettings(logprob_tol=math.nan), "logprob_tol: nan"),
    ],
)
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(CanaryError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_settings(settings)


def test_request_body_is_greedy_with_token_ids():
    body = request_body("tiny", "hello", CanarySettings(max_tokens=8, top_logprobs=3))
    assert body == {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 8,
        "temperature": 0,
        "n": 1,
        "logprobs": 3,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }


def vllm_answer(tokens, logprobs, tops):
    """The shape of vLLM's /v1/completions answer with logprobs and token ids."""
    return {
        "choices": [
            {
                "index": 0,
                "text": "...",
                "logprobs": {
                    "text_offset": [0] * len(tokens),
                    "token_logprobs": logprobs,
                    "tokens": tokens,
                    "top_logprobs": tops,
                },
            }
        ]
    }


def test_parse_answer_reads_token_ids_and_alternatives():
    body = vllm_answer(
        ["token_id:386", "token_id:17"],
        [-5.25, -5.5],
        [{"token_id:386": -5.25, "token_id:9": -5.3}, {"token_id:17": -5.5}],
    )
    assert parse_answer("p", body) == CanaryAnswer(
        "p", [CanaryToken(386, -5.25, {386: -5.25, 9: -5.3}), CanaryToken(17, -5.5, {17: -5.5})]
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"choices": []}, "no choices\\[0\\].logprobs"),
        ({"choices": [{"logprobs": None}]}, "no choices\\[0\\].logprobs"),
        (vllm_answer(["hello"], [-1.0], [{}]), "'hello' is not 'token_id:N'"),
        (vllm_answer(["token_id:1"], [None], [{}]), "logprob None is not a number"),
        (vllm_answer(["token_id:1"], [-1.0, -2.0], [{}]), "1 tokens, 2 logprobs, 1 tops"),
        (vllm_answer(["token_id:1"], [-1.0], [None]), "top_logprobs entry None"),
    ],
)
def test_parse_answer_refuses_what_it_cannot_compare(body, message):
    with pytest.raises(CanaryError, match=message):
        parse_answer("p", body)
