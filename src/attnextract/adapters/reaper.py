"""A watchdog that kills a process's descendants once that process is gone.

Run as a script (``python reaper.py PARENT_PID [PID,...]``) by :class:`ProcessReaper`:
it imports nothing beyond the standard library, so it starts in milliseconds and holds
a few MiB. It notes the parent's descendants every REAP_INTERVAL seconds (from /proc,
Linux) and, when its stdin (a pipe only the parent writes to) ends without a ``q``,
the parent is gone (``kill -9`` included): it kills every descendant it last saw and
theirs. Processes the parent already had when the watch began are left alone.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

REAP_INTERVAL = 0.5          # seconds between snapshots of the parent's descendants


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                  # exists, another user's
        return True
    return True


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc: {ppid: [pid, ...]}."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue                 # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with the pid, its identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _walk(children: dict[int, list[int]], roots, exclude: int | None = None
          ) -> set[tuple[int, int]]:
    """(pid, start time) of every descendant of the pids ``roots`` in ``children``,
    ``exclude``'s subtree left out."""
    found: set[tuple[int, int]] = set()
    todo = list(roots)
    while todo:
        for pid in children.get(todo.pop(), []):
            start = start_time(pid)
            if pid != exclude and start is not None and (pid, start) not in found:
                found.add((pid, start))
                todo.append(pid)
    return found


def descendants(root: int, exclude: int | None = None) -> set[tuple[int, int]]:
    """(pid, start time) of every descendant of ``root`` now, ``exclude``'s subtree left
    out."""
    return _walk(_children(), [root], exclude)


def _closure(roots: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """``roots`` that are still the same processes, and all their descendants now (one
    scan of /proc)."""
    found = {(pid, start) for pid, start in roots if start_time(pid) == start}
    return found | _walk(_children(), [pid for pid, _ in found])


def _signal_all(targets: set[tuple[int, int]], sig: int) -> int:
    """Send ``sig`` to the processes of ``targets`` that are still the same processes."""
    sent = 0
    for pid, start in targets:
        if start_time(pid) == start:
            try:
                os.kill(pid, sig)
                sent += 1
            except OSError:
                pass
    return sent


def kill_tree(snapshot: set[tuple[int, int]], rounds: int = 20) -> int:
    """SIGKILL the processes of ``snapshot`` that are still the same processes, and their
    descendants; how many were killed.

    They are stopped (SIGSTOP) first, round after round until a scan finds no new
    descendant, then killed: a supervisor killed before its workers (Ray's raylet
    restarts workers) or a process forking meanwhile leaves nothing behind."""
    targets = _closure(snapshot)
    for _ in range(rounds):
        _signal_all(targets, signal.SIGSTOP)
        grown = _closure(targets)
        if grown <= targets:
            break
        targets |= grown
    return _signal_all(targets, signal.SIGKILL)


def watch(parent: int, before: set[int]) -> None:
    """The watchdog's loop (see the module's docstring)."""
    me = os.getpid()
    snapshot: set[tuple[int, int]] = set()
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], REAP_INTERVAL)
        if readable:
            data = os.read(stdin, 64)
            if b"q" in data:
                return               # a clean stop: the parent stopped them itself
            if not data:
                break                # the parent is gone
        if not alive(parent):
            break
        now = {(pid, start) for pid, start in descendants(parent, exclude=me)
               if pid not in before}
        snapshot = now or snapshot
    kill_tree(snapshot)


class ProcessReaper:
    """A watchdog process that kills this process's descendants once this process is
    gone, ``kill -9`` included; :meth:`stop` (a clean shutdown, after the descendants
    were stopped) lets it exit without killing anything.

    Linux only (/proc); elsewhere :attr:`active` is False and nothing is watched."""

    def __init__(self):
        self.active = sys.platform.startswith("linux") and os.path.isdir("/proc")
        self.process = None
        if not self.active:
            return
        before = ",".join(str(pid) for pid, _ in descendants(os.getpid())) or "-"
        self.process = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), before],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)     # a kill of our process group leaves it standing

    def stop(self) -> None:
        """A clean stop: the watchdog exits without killing anything."""
        if self.process is None:
            return
        try:
            self.process.stdin.write(b"q")
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.process = None


if __name__ == "__main__":
    watch(int(sys.argv[1]), {int(p) for p in sys.argv[2].split(",") if p.isdigit()})
