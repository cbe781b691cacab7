"""Node-local locks: exclusion between threads and processes, takeover from a dead holder,
and refusal of cache directories on shared filesystems."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hpcserve.modelcache.locks import (
    LockTimeout,
    NodeLock,
    SharedFilesystemError,
    check_local_filesystem,
    filesystem_type,
)
from hpcserve.modelcache.procs import Owner
from tests.unit.modelcache_util import Child

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /lustre rw,relatime shared:9 - lustre 10.0.0.1@o2ib:/scratch rw,flock
31 22 0:41 / /home rw shared:10 - nfs4 fs:/home rw,vers=4.2
32 22 259:1 / /local/nvme rw,noatime shared:11 - xfs /dev/nvme0n1 rw
33 22 0:42 / /mnt/my\\040disk rw - btrfs /dev/sdb rw
34 30 259:2 / /lustre/local-ssd rw - ext4 /dev/nvme1n1 rw
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/tmp/x", "ext4"),
        ("/lustre/models/llama", "lustre"),
        ("/lustre", "lustre"),
        ("/lustre-not/x", "ext4"),
        ("/home/alice/cache", "nfs4"),
        ("/local/nvme/hpcserve-cache", "xfs"),
        ("/mnt/my disk/c", "btrfs"),
        ("/lustre/local-ssd/c", "ext4"),
    ],
)
def test_filesystem_type_takes_the_longest_mount_prefix(path: str, fstype: str) -> None:
    assert filesystem_type(Path(path), MOUNTINFO) == fstype


def test_cache_dirs_on_shared_filesystems_are_refused() -> None:
    with pytest.raises(SharedFilesystemError, match="on a lustre filesystem"):
        check_local_filesystem(Path("/lustre/cache"), MOUNTINFO)
    with pytest.raises(SharedFilesystemError, match="nfs4"):
        check_local_filesystem(Path("/home/alice/cache"), MOUNTINFO)
    check_local_filesystem(Path("/local/nvme/cache"), MOUNTINFO)


def test_threads_of_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "k.lock"
    inside, overlaps = [0], []

    def work() -> None:
        for _ in range(10):
            with NodeLock(path, poll_s=0.001):
                inside[0] += 1
                overlaps.append(inside[0])
                time.sleep(0.0005)
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(overlaps) == 40 and set(overlaps) == {1}


def test_timeout_names_the_holder_and_waiters_are_told(tmp_path: Path) -> None:
    path = tmp_path / "k.lock"
    holder = NodeLock(path)
    assert holder.try_acquire()
    seen: list[Owner | None] = []
    waiter = NodeLock(path, on_wait=lambda owner, waited: seen.append(owner))
    with pytest.raises(LockTimeout, match=f"still held by pid {os.getpid()} on "):
        waiter.acquire(timeout_s=0.2)
    assert seen and seen[0] is not None and seen[0].pid == os.getpid()
    holder.release()
    waiter.acquire(timeout_s=1)
    assert waiter.held
    waiter.release()


def test_a_lock_of_a_killed_holder_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "k.lock"
    child = Child(
        "import time\n"
        "from pathlib import Path\n"
        "from hpcserve.modelcache.locks import NodeLock\n"
        f"NodeLock(Path({str(path)!r})).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(3600)\n"
    )
    child.wait_for("locked")
    assert not NodeLock(path).try_acquire()
    record = NodeLock(path).holder()
    assert record is not None and record.pid == child.proc.pid and record.alive()
    os.kill(child.proc.pid, signal.SIGKILL)
    child.finish()
    assert not record.alive()  # the record stays behind; the kernel dropped the flock
    lock = NodeLock(path)
    lock.acquire(timeout_s=5)
    assert lock.holder() is not None and lock.holder().pid == os.getpid()  # type: ignore[union-attr]
    lock.release()
