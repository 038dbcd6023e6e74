"""Local scratch directories that a later run cleans up when the process that made them died.

A stage removes its scratch in a `finally`, which `kill -9`, an out-of-memory kill or a node reboot skip:
each left tens of MB to GB of downloaded shards and half-written files that no run would ever read again.
Every scratch directory therefore names its owner (host, pid and the process's start time, so that a reused
pid does not pass for the owner), and a new one of the same stage first removes those whose owner is gone.
Only directories of this host are judged: on a volume shared by pods, another pod's pids mean nothing here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile

log = logging.getLogger(__name__)
OWNER_FILE = ".dflash-owner.json"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # Fields after the parenthesised command name (which may hold spaces): state is field 3, starttime 22.
    return stat.rsplit(")", 1)[-1].split()[19]


def _owner() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _alive(owner: dict[str, object]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return True  # not ours to judge
    if owner.get("start") is not None and os.path.isdir("/proc"):
        return _start_time(pid) == owner["start"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(path: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def clean_stale(prefix: str, root: str | None = None) -> int:
    """Remove the directories named `prefix`* under `root` whose owner process on this host is gone; bytes freed."""
    root = root or tempfile.gettempdir()
    host = socket.gethostname()
    freed, removed = 0, 0
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return 0
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(prefix) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as handle:
                owner = json.load(handle)
        except (OSError, ValueError):
            continue  # no owner recorded (made by something else, or being created): leave it
        if not isinstance(owner, dict) or owner.get("host") != host or _alive(owner):
            continue
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            freed, removed = freed + size, removed + 1
    if removed:
        log.info("removed %d scratch director%s left by earlier runs that were killed (%.1f MB)", removed,
                 "y" if removed == 1 else "ies", freed / 1e6)
    return freed


def make_scratch(prefix: str, root: str | None = None) -> str:
    """A new scratch directory `root`/`prefix`XXXX recording its owner, after removing stale ones of `prefix`."""
    clean_stale(prefix, root)
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    with open(os.path.join(path, OWNER_FILE), "w", encoding="utf-8") as handle:
        json.dump(_owner(), handle)
    return path
