"""Replicas stop with their server: the reaper kills a dead server's descendants (kill -9
included), and a real ``serve --replicas 2`` leaves no Ray process 5 s after kill -9."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from attnextract.adapters import reaper as reaper_module
from attnextract.adapters.reaper import REAP_INTERVAL, descendants

# a server stand-in: a reaper, then children like Ray's (one in a session of its own,
# with a child of its own), then it waits to be killed
SERVER = """
import subprocess, sys, time
sys.path.insert(0, {folder!r})     # the stdlib-only module alone: no package import
from reaper import ProcessReaper
reaper = ProcessReaper()
plain = subprocess.Popen(["sleep", "300"])
agent = subprocess.Popen([sys.executable, "-c",
    "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"],
    start_new_session=True)
print(plain.pid, agent.pid, reaper.process.pid, flush=True)
if sys.argv[1] == "stop":
    time.sleep({settle})
    reaper.stop()
    print("stopped", flush=True)
time.sleep(300)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("how", ["kill -9", "stop"])
def test_the_reaper_kills_what_a_dead_server_leaves(how):
    code = SERVER.format(settle=3 * REAP_INTERVAL,
                         folder=os.path.dirname(reaper_module.__file__))
    server = subprocess.Popen([sys.executable, "-c", code, "stop" if how == "stop" else "kill"],
                              stdout=subprocess.PIPE, text=True)
    plain, agent, reaper = map(int, server.stdout.readline().split())
    deadline = time.monotonic() + 30
    tree = set()
    while time.monotonic() < deadline and len(tree) < 4:   # sleep, agent, its sleep, reaper
        tree = {pid for pid, _ in descendants(server.pid)}
        time.sleep(0.05)
    assert {plain, agent, reaper} <= tree and len(tree) >= 4, tree
    watched = tree - {reaper}
    try:
        if how == "stop":
            assert server.stdout.readline().strip() == "stopped"
        time.sleep(6 * REAP_INTERVAL)                  # the reaper has noted them all
        server.kill()
        server.wait()
        end = time.monotonic() + (5 if how == "kill -9" else 4 * REAP_INTERVAL)
        while time.monotonic() < end and any(running(p) for p in watched):
            time.sleep(0.05)
        left = {p for p in watched if running(p)}
        if how == "kill -9":
            assert not left, left                       # within 5 s of the kill
            assert not running(reaper)
        else:                                           # a clean stop kills nothing
            assert left == watched
    finally:
        kill_all(watched | {reaper})
        server.stdout.close()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_no_ray_process_of_a_killed_server_is_left_after_5_s(tmp_path):
    import ray  # noqa: F401  (a test-all package: see conftest.py)
    np.savez(tmp_path / "secret.npz", W=np.eye(4) / 3, v=np.ones(4))
    server = subprocess.Popen([sys.executable, "-m", "attnextract", "serve", "--secret",
                               str(tmp_path / "secret.npz"), "--port", "0", "--replicas", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = set()
    try:
        banner = server.stdout.readline()
        assert "2 Ray replicas" in banner, server.stderr.read()
        time.sleep(3 * REAP_INTERVAL + 2)
        watched = {pid for pid, _ in descendants(server.pid)}
        assert len(watched) >= 4, watched                # Ray's processes and the actors
        server.kill()
        server.wait()
        end = time.monotonic() + 5
        while time.monotonic() < end and any(running(p) for p in watched):
            time.sleep(0.1)
        assert not {p for p in watched if running(p)}
    finally:
        kill_all(watched)
        server.kill()


# a process that keeps forking: every few ms it kills its oldest child and starts a new
# one (a supervisor restarting workers does the same); its children carry a marker
CHURN = """
import subprocess, sys, time
kids = []
print("ready", flush=True)
while True:
    kids.append(subprocess.Popen(["sleep", sys.argv[1]]))
    if len(kids) > 3:
        kids.pop(0).kill()
    time.sleep(0.002)
"""


def marked(marker: str) -> set[int]:
    """Live (not zombie) processes whose command line holds ``marker``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and running(int(entry)):
                        found.add(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_process_forking_while_it_is_killed_leaves_no_child():
    """The reaper stops the whole tree before it kills it: a child born between the scan
    and the kill would outlive its parent (reparented away from every scan)."""
    for attempt in range(5):
        marker = f"{300 + attempt}.{os.getpid()}"
        churn = subprocess.Popen([sys.executable, "-c", CHURN, marker], stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert churn.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            snapshot = {(churn.pid, reaper_module.start_time(churn.pid))}
            assert reaper_module.kill_tree(snapshot) >= 2       # itself and children
            churn.wait(timeout=10)
            time.sleep(0.2)
            assert not marked(marker), f"attempt {attempt}: children outlived the kill"
        finally:
            churn.kill()
            kill_all(marked(marker))
            churn.stdout.close()
