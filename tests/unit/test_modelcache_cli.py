"""`hpcserve models ...` (registry) and `hpcserve cache ...` through argparse."""

from __future__ import annotations

import argparse
import getpass
import json
from pathlib import Path

import pytest

from hpcserve.modelcache.cli import add_cache_parser, add_models_registry_parsers, parse_size
from hpcserve.modelcache.errors import CacheError
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.registry import Registry
from tests.unit.modelcache_util import make_model


def gate_passed(tmp_path: Path, *refs: str) -> None:
    """Record a passing evaluation of each version: `alias`/`promote` allow it then."""
    with Registry(tmp_path / "registry.sqlite3") as reg:
        for ref in refs:
            reg.record_evaluation(
                Evaluation(ref=ref, suite="s", suite_digest="0" * 64, suite_path="s.jsonl",
                           cases=1, scores={"m": 100.0}, key_metrics=["m"], passed=True)
            )  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """What hpcserve/cli.py does with these two functions."""
    p = argparse.ArgumentParser(prog="hpcserve")
    sub = p.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models")
    add_models_registry_parsers(models.add_subparsers(dest="models_command", required=True))
    add_cache_parser(sub)
    return p


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    registry, cache = str(tmp_path / "registry.sqlite3"), str(tmp_path / "cache")

    def run(*argv: str) -> tuple[int, str, str]:
        args = list(argv)
        args += ["--registry", registry] if args[0] == "models" or args[1] == "prefetch" else []
        args += ["--cache-dir", cache] if args[0] == "cache" else []
        ns = parser().parse_args(args)
        code = ns.func(ns)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_models_add_list_show_alias_promote_rm(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    code, out, _ = cli("models", "add", "llama", src, "--engine-args", "--max-model-len 8192")
    assert code == 0 and out.startswith("added llama@1 (bf16, 5.60 MB in 5 files, blake3 manifest ")
    assert cli("models", "add", "llama", src, "--quantization=awq", "--engine-args=--enforce-eager",
               "--digest", "sha256")[0] == 0  # fmt: skip
    gate_passed(tmp_path, "llama@1", "llama@2")
    assert cli("models", "alias", "extraction", "llama@1")[1] == "extraction -> llama@1\n"
    code, out, _ = cli("models", "promote", "extraction", "llama@2", "--share", "10")
    assert out == "extraction -> llama@1 (90%), canary llama@2 (10%)\n"
    code, out, _ = cli("models", "list")
    assert out.splitlines()[0].split() == [
        "VERSION", "QUANT", "SIZE", "REPLICAS", "GATE", "SOURCE"
    ]  # fmt: skip
    assert out.splitlines()[2].split()[:6] == ["llama@2", "awq", "5.60", "MB", "0", "pass"]
    assert "llama@2  awq" in out and "extraction  llama@1 (90%)  llama@2 (10%)" in out
    listing = json.loads(cli("models", "list", "--json")[1])
    assert listing["versions"][0]["engine_args"] == ["--max-model-len", "8192"]
    shown = json.loads(cli("models", "show", "llama@2", "--files")[1])
    assert shown["manifest"]["algorithm"] == "sha256" and shown["in_use_by"] == []
    assert shown["version"]["engine_args"] == ["--enforce-eager"]
    assert json.loads(cli("models", "show", "extraction")[1])["alias"]["canary_percent"] == 10
    assert [
        v["version"] for v in json.loads(cli("models", "show", "llama")[1])["model"]["versions"]
    ] == [1, 2]
    code, _, err = cli("models", "rm", "llama@2")
    assert (
        code == 2
        and err == "hpcserve models rm: llama@2 is the target or canary of aliases: extraction\n"
    )
    assert cli("models", "promote", "extraction", "llama@2")[0] == 0
    assert cli("models", "rm", "llama@1") == (0, "removed llama@1\n", "")


def test_models_errors_are_one_line_and_exit_2(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    assert cli("models", "show", "nope")[2] == "hpcserve models show: no model named 'nope'\n"
    assert cli("models", "add", "x", str(tmp_path / "missing"))[0] == 2
    assert cli("models", "add", "llama", src)[0] == 0
    gate_passed(tmp_path, "llama@1")
    assert cli("models", "alias", "extraction", "llama@1")[0] == 0
    code, _, err = cli("models", "promote", "extraction", "llama@1", "--share", "150")
    assert code == 2 and "from 0 to 100, got 150" in err
    code, _, err = cli("models", "add", "extraction", src)
    assert code == 2 and "'extraction' is already the name of an alias" in err
    with pytest.raises(SystemExit):  # argparse's own refusal of a bad choice
        parser().parse_args(["models", "add", "m", src, "--quantization", "int2"])


def test_alias_and_promote_are_gated_and_a_forced_move_is_audited(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    for _ in range(2):
        assert cli("models", "add", "llama", src)[0] == 0
    code, out, err = cli("models", "alias", "extraction", "llama@1")
    assert (code, out) == (2, "")
    assert err == (
        "hpcserve models alias: llama@1 has no evaluation (`hpcserve models eval llama@1 "
        "--suite FILE`); to move traffic anyway give --force --reason TEXT\n"
    )
    gate_passed(tmp_path, "llama@1")
    assert cli("models", "alias", "extraction", "llama@1")[0] == 0
    assert cli("models", "promote", "extraction", "llama@2", "--share", "5")[0] == 2
    code, _, err = cli("models", "promote", "extraction", "llama@2", "--force")
    assert code == 2 and "--force needs --reason TEXT" in err
    code, _, err = cli("models", "promote", "extraction", "llama@2", "--reason", "why")
    assert code == 2 and "--reason goes with --force" in err
    code, out, err = cli(
        "models", "promote", "extraction", "llama@2", "--force", "--reason", "INC-7 hotfix"
    )
    assert (code, out) == (0, "extraction -> llama@2\n")
    assert err.startswith("audit: promote extraction -> llama@2: share 100%; gate overridden: ")
    assert err.endswith(f" FORCED (INC-7 hotfix) by {getpass.getuser()}\n")
    shown = json.loads(cli("models", "show", "extraction")[1])
    assert shown["audit"][0].startswith("alias extraction -> llama@1: gate passed: evaluation 1")
    version = json.loads(cli("models", "show", "llama@1")[1])
    assert version["gate"]["passed"] and version["evaluation"]["suite"] == "s"
    assert json.loads(cli("models", "show", "llama@2")[1])["gate"]["passed"] is False


def test_models_gate_shows_and_sets_a_models_rule(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    assert cli("models", "add", "llama", src)[0] == 0
    assert cli("models", "gate", "llama")[1] == (
        "llama: a version passes when no key metric of its suite is more than 1 points below "
        "its baseline's (the default)\n"
    )
    assert cli("models", "gate", "llama", "--max-drop", "2.5")[1].startswith(
        "llama: a version passes when no key metric of its suite is more than 2.5 points"
    )
    assert json.loads(cli("models", "show", "llama")[1])["gate_rule"]["max_drop"] == 2.5
    assert cli("models", "gate", "nope")[2] == "hpcserve models gate: no model named 'nope'\n"
    assert "points >= 0" in cli("models", "gate", "llama", "--max-drop", "-1")[2]


def test_models_add_registers_a_lora_adapter_with_its_rank(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    (lora / "adapter_model.safetensors").write_bytes(b"\0" * 4096)
    assert cli("models", "add", "llama", src)[0] == 0
    assert cli("models", "add", "docs", str(lora), "--lora-base", "llama")[1] == (
        "added adapter docs (base llama@1, rank 16)\n"
    )
    code, _, err = cli("models", "add", "other", str(lora), "--lora-base", "qwen")
    assert code == 2 and "no model named 'qwen'" in err
    assert "ADAPTER" in cli("models", "list")[1]


def test_cache_prefetch_ls_pin_evict_verify(cli, tmp_path: Path) -> None:
    src = make_model(tmp_path / "src")
    cli("models", "add", "llama", str(src))
    gate_passed(tmp_path, "llama@1")
    cli("models", "alias", "extraction", "llama@1")
    code, out, _ = cli("cache", "prefetch", "extraction", "--pin")
    assert code == 0 and out.startswith("staged: ") and "llama@1-" in out
    assert cli("cache", "prefetch", "llama@1")[1].startswith("already cached: ")
    code, out, _ = cli("cache", "ls")
    assert out.splitlines()[0].split() == ["KEY", "SIZE", "LAST", "USE", "PINNED", "IN", "USE"]
    assert "yes" in out.splitlines()[1] and out.splitlines()[-1] == "total 5.60 MB in 1 entries"
    [entry] = json.loads(cli("cache", "ls", "--json")[1])
    assert entry["pinned"] and entry["source"] == str(src)
    code, _, err = cli("cache", "evict", "llama@1")
    assert code == 2 and "is pinned; not evicted" in err
    assert cli("cache", "unpin", "llama@1")[1] == f"unpinned {entry['key']}\n"
    assert cli("cache", "verify")[1] == f"ok {entry['key']}\n"
    shard = tmp_path / "cache" / entry["key"] / "model-00001-of-00002.safetensors"
    shard.chmod(0o644)
    shard.write_bytes(b"\0" * shard.stat().st_size)
    code, out, _ = cli("cache", "verify", "llama@1")
    assert code == 1 and "model-00001-of-00002.safetensors: digest mismatch" in out
    assert f"re-staged {entry['key']}" in out
    assert cli("cache", "verify")[0] == 0
    assert cli("cache", "evict", "--to", "1M")[1] == f"evicted {entry['key']}\n"
    assert cli("cache", "evict")[2] == "hpcserve cache evict: give either entry keys or --to SIZE\n"


def test_cache_commands_do_not_create_a_mistyped_cache_dir(cli, tmp_path: Path) -> None:
    code, _, err = cli("cache", "ls")
    assert code == 2 and err == f"hpcserve cache ls: no cache directory at {tmp_path / 'cache'}\n"
    assert not (tmp_path / "cache").exists()


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("500", "200G", "1.5T", "200GiB", "4kib", "10MB")] == [
        500, 200 * 10**9, 1_500_000_000_000, 200 * 2**30, 4096, 10**7,
    ]  # fmt: skip
    with pytest.raises(CacheError, match="size '12 parsecs' is not understood"):
        parse_size("12 parsecs")
