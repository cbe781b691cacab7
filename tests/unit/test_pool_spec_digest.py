"""A pool's spec digest: what replaces running replicas when it changes."""

from __future__ import annotations

from pathlib import Path

import msgspec

from hpcserve.config import parse_config
from hpcserve.poolmgr.spec import pool_spec_digest


def digest(tmp_path: Path, **pool: object) -> str:
    config = parse_config(
        {
            "state_dir": str(tmp_path),
            "pools": [{"name": "chat", "model_path": "/m", "engine": "sim", **pool}],
        }
    )
    return pool_spec_digest(config, config.pools[0])


def test_scaling_and_settings_left_at_their_default_keep_the_digest(tmp_path: Path) -> None:
    plain = digest(tmp_path)
    assert digest(tmp_path, replicas=5) == plain
    # A setting written out at its default is the same replica; a changed one is not.
    assert digest(tmp_path, role="interactive", scheduling_policy="priority") == plain
    assert digest(tmp_path, role="batch") != plain
    assert digest(tmp_path, engine_args=["--max-num-seqs", "8"]) != plain


def test_a_release_adding_a_setting_with_a_default_keeps_running_replicas(
    tmp_path: Path, monkeypatch
) -> None:
    import hpcserve.poolmgr.spec as spec

    before = digest(tmp_path)
    fields = msgspec.structs.fields
    # The same pool as a release without `role` saw it: one field fewer.
    monkeypatch.setattr(
        spec.msgspec.structs,
        "fields",
        lambda s: tuple(f for f in fields(s) if f.name != "role"),
    )
    assert digest(tmp_path) == before
