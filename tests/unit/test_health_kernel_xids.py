"""Xids from the kernel log (/dev/kmsg records) for the one-shot check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.cli import main
from hpcserve.health.kernel_xids import (
    KernelXid,
    normalise_pci,
    parse_kmsg_record,
    parse_xids,
    xids_since,
)

XID79 = (
    "3,1201,5318899123,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
    "GPU has fallen off the bus."
)
RECORDS = [
    "6,1199,5318000000,-;usb 1-1: new high-speed USB device",
    "4,1200,5318800000,-;NVRM: Xid (PCI:0000:86:00): 13, pid=4242, name=python, Graphics Exception",
    XID79,
    "garbage without a header",
    "4,1202,5318900000,c;NVRM: GPU at PCI:0000:3b:00: GPU-1234",
]


@pytest.mark.parametrize(
    ("bus", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:3b:00", "0000:3b:00"),
        ("0001:AF:1F.0", "0001:af:1f"),
        ("3b:00", "3b:00"),
    ],
)
def test_normalise_pci(bus: str, expected: str) -> None:
    assert normalise_pci(bus) == expected


def test_parse_records() -> None:
    assert parse_kmsg_record(XID79) == (1201, XID79.split(";", 1)[1])
    assert parse_kmsg_record("garbage") is None
    assert parse_kmsg_record("6,x,1,-;msg") is None
    assert parse_xids(RECORDS, 0) == [
        KernelXid(1200, "0000:86:00", 13),
        KernelXid(1201, "0000:3b:00", 79),
    ]
    assert parse_xids(RECORDS, 1200) == [KernelXid(1201, "0000:3b:00", 79)]


@pytest.mark.parametrize(
    ("stored", "expected_xids", "expected_next"),
    [
        (None, [], 1202),  # the first check only sets the baseline
        (1199, [13, 79], 1202),
        (1201, [], 1202),
        (5000, [13, 79], 1202),  # beyond the log: the node rebooted, all of it is new
    ],
)
def test_xids_since(stored: int | None, expected_xids: list[int], expected_next: int) -> None:
    xids, following = xids_since(RECORDS, stored)
    assert [x.xid for x in xids] == expected_xids and following == expected_next


def test_health_check_reports_logged_xids_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = tmp_path / "nvml.json"
    gpus.write_text(json.dumps({"gpus": [{}, {"pci": "00000000:3B:00.0"}]}))
    log = tmp_path / "kmsg"
    log.write_text(RECORDS[0] + "\n")
    args = ["health", "check", "--node", "n1", "--fake-nvml", str(gpus), "--xid-window-s", "0"]
    args += ["--kernel-log", str(log), "--state-dir", str(tmp_path / "state")]
    assert main(args) == 0, "the first check sets the baseline"
    log.write_text("\n".join(RECORDS) + "\n")
    assert main(args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [
        "log xid: xid 13 pci 0000:86:00 (application error)",
        "drain xid: xid 79 gpu 1",
    ]
    assert main(args) == 0, "each logged Xid once"
