"""Run a command in a network namespace of its own, with only a loopback interface:
`python -m hpcserve.engine_launch.private_net [--required] -- COMMAND...`.

vLLM's workers listen on TCP for torch.distributed (gloo's listeners on 127.0.0.1, one or
more per process group, even at TP=1; NCCL's bootstrap on GPUs), with no authentication:
on a shared node any other user could connect to them. In a namespace of its own, vLLM's
loopback is its own, so nobody outside it can reach them. vLLM's HTTP listener is made by
the engine in the node's namespace and handed over as an open socket (vllm_api.py): a
socket stays in the namespace it was made in, so clients reach it as before. Unix sockets
named by a path (vLLM's ZeroMQ and KV-event sockets) are reached through the file system,
not the network namespace: they work as before (and are closed to others by their 0700
directory).

Not for a replica across nodes or a NIXL side channel: those must be reached from other
nodes (the engine does not ask for it there: engine.py).

An unprivileged service account gets the namespace through a user namespace of its own,
in which its uid and gid map to themselves (nothing gains a privilege); root needs none.
Where the kernel refuses (user namespaces disabled by the site), the command runs in the
node's namespace after one warning line, or, with --required, does not run (exit 126).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import socket
import struct
import sys
from collections.abc import Sequence

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"
# Exit status when --required and the namespace cannot be made (as a shell's "cannot run").
CANNOT = 126


class PrivateNetError(OSError):
    pass


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        errno = ctypes.get_errno()
        raise PrivateNetError(errno, os.strerror(errno))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def enter_private_network() -> None:
    """Move this (single-threaded) process into a new network namespace whose loopback is
    up; through a user namespace mapping its own uid and gid when it is not root. Raises
    PrivateNetError naming the step the kernel refused."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        if uid == 0:
            _unshare(CLONE_NEWNET)
        else:
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as err:
        how = "a network namespace" if uid == 0 else "a user and network namespace"
        raise PrivateNetError(err.errno, f"cannot make {how}: {err.strerror}") from None
    try:
        _loopback_up()
    except OSError as err:
        raise PrivateNetError(
            err.errno, f"cannot bring up the namespace's loopback: {err.strerror}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcserve.engine_launch.private_net")
    parser.add_argument("--required", action="store_true", help="fail rather than run unshared")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    try:
        enter_private_network()
    except PrivateNetError as err:
        if args.required:
            print(f"private network: {err.strerror}; not starting {command[0]}", file=sys.stderr)
            return CANNOT
        print(
            f"private network: {err.strerror}; starting {command[0]} in the node's network "
            "namespace (its loopback listeners reachable by other users of the node)",
            file=sys.stderr,
        )
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"private network: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
