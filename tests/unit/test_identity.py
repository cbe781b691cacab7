import pytest

from hpcserve.poolmgr.identity import JobIdentity, new_identity, parse_comment


def test_round_trip_and_unique_nonce():
    a, b = new_identity("chat", "llama", spec="0badcafe"), new_identity("chat", "llama")
    assert a.nonce != b.nonce
    assert parse_comment(a.comment()) == a and parse_comment(b.comment()) == b


@pytest.mark.parametrize(
    ("comment", "expected"),
    [
        ("hpcserve:pool=chat;model=llama;nonce=ab12", JobIdentity("chat", "llama", "ab12")),
        (
            "hpcserve:model=llama;nonce=ab12;pool=chat;future=1",
            JobIdentity("chat", "llama", "ab12"),
        ),
        ("hpcserve:pool=chat;model=m;spec=abc;nonce=1", JobIdentity("chat", "m", "1", "abc")),
        ("hpcserve:pool=chat", None),
        ("my own job", None),
        ("", None),
    ],
)
def test_parse_comment(comment, expected):
    assert parse_comment(comment) == expected
