"""bench/results.py: every benchmark's results JSON gets the same meta block."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.results import RESULTS_DIR_ENV, ROOT, command, write_results


def test_results_keep_their_keys_under_one_meta_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "x.py"), "--routing", '{"a": 1}'])
    path = write_results(
        "x-64", {"rows": [{"n": 1}], "summary": {"ok": 3}}, {"replicas": 64}, directory=tmp_path
    )
    assert path == tmp_path / "x-64.json"
    data = json.loads(path.read_text())
    assert data["rows"] == [{"n": 1}] and data["summary"] == {"ok": 3}
    meta = data["meta"]
    assert {"date", "machine", "command", "load_average"} <= meta.keys()
    assert meta["replicas"] == 64
    assert meta["command"] == ".venv/bin/python bench/x.py --routing '{\"a\": 1}'"
    assert len(meta["load_average"]) == 3


def test_extra_meta_overrides_and_a_meta_key_in_results_is_refused(tmp_path: Path) -> None:
    path = write_results("y", {"rows": []}, {"date": "then"}, directory=tmp_path)
    assert json.loads(path.read_text())["meta"]["date"] == "then"
    with pytest.raises(ValueError, match="'meta' is written by write_results"):
        write_results("z", {"meta": {}}, directory=tmp_path)
    assert not (tmp_path / "z.json").exists()


def test_the_suites_results_directory_wins_over_a_benchmarks_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bench/suite.py's bounded runs must not overwrite the full runs in bench/results/,
    # whatever directory (an --out default) the benchmark names.
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "suite"))
    path = write_results("w", {"rows": []}, directory=tmp_path / "own")
    assert path == tmp_path / "suite" / "w.json" and path.exists()
    assert not (tmp_path / "own").exists()


def test_command_outside_the_repository_keeps_the_path() -> None:
    assert command(["/opt/elsewhere/run.py", "-n", "2"]) == (
        ".venv/bin/python /opt/elsewhere/run.py -n 2"
    )
