"""The local cluster's accounting switch (hpcserve/local_accounting.py): off, slurm.conf is
what every other test's cluster runs; on, it points at the cluster's own slurmdbd."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hpcserve.local_accounting import LocalAccounting
from hpcserve.localslurm import LocalSlurm, LocalSlurmSpec, preflight


def _conf(tmp_path: Path, accounting: bool) -> str:
    spec = LocalSlurmSpec(
        state_dir=tmp_path, ctld_port=26817, proctrack="linuxproc", accounting=accounting
    )
    return LocalSlurm(spec).render_config()[0]


def test_accounting_is_off_by_default_and_on_adds_slurmdbd(tmp_path: Path) -> None:
    plain = _conf(tmp_path, False)
    assert "AccountingStorage" not in plain
    with_acct = _conf(tmp_path, True).splitlines()
    assert [line for line in with_acct if line not in plain.splitlines()] == [
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        "AccountingStoragePort=26820",  # ctld_port + nodes + 1
        "AccountingStorageTRES=gres/gpu",
    ]
    assert len(with_acct) == len(plain.splitlines()) + 4


def test_slurmdbd_conf_is_owner_only_and_names_the_database_port(tmp_path: Path) -> None:
    acct = LocalAccounting(tmp_path, tmp_path, dbd_port=26820, db_port=26821, host="h")
    acct._write_dbd_conf("secret")
    mode = stat.S_IMODE(acct.dbd_conf.stat().st_mode)
    assert mode == 0o600
    lines = acct.dbd_conf.read_text().splitlines()
    assert {"DbdPort=26820", "StoragePort=26821", "StoragePass=secret", "DbdHost=h"} <= set(lines)


def test_preflight_names_the_accounting_packages_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hpcserve.localslurm as localslurm

    real = localslurm._which
    monkeypatch.setattr(localslurm, "_which", lambda n: None if n == "slurmdbd" else real(n))
    assert not any("slurmdbd" in p for p in preflight())
    assert any("slurmdbd" in p and "apt-get install" in p for p in preflight(accounting=True))
