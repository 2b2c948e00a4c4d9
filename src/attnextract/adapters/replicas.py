"""A black box evaluated by N replicas on Ray: ``attnextract serve --replicas N``.

:class:`RayReplicas` wraps a model (any callable (B, N, d) -> (B,) with ``dim``) or a
target spec (``FILE.npz``, ``FILE.py:NAME``) and is itself such a callable: every
batch is cut into N contiguous parts, part i is evaluated by actor i, and the answers
are put back in order. The HTTP server calls it from its worker threads, so several
requests keep all actors busy. Vector answers, (B, m) or (B, N, m), are put back in order
the same way, and what the model declares (``output_kind``, ``out_dim``, ``causal``) is
declared by the replicas.

Ray is an optional extra (``pip install 'attnextract[ray]'``), imported only here. With
no ``address`` a single-machine cluster of N CPUs is started; with ``address`` (e.g.
``ray://head:10001`` or ``auto``) an existing cluster is joined. A model object is
shipped once to the object store (``ray.put``) and every actor reads it from there; a
spec string is loaded by each actor on its own node (the file must exist there: see
docs/distributed.md). Each actor pins its BLAS and torch to one thread, so N replicas
use N cores.

**Replicas stop with the server.** A local cluster's processes (Ray's own agents and
the actors) would outlive a ``kill -9`` of the server and keep evaluating batches nobody
is charged for. So a server that starts a local cluster also starts a
:class:`ProcessReaper`: a small watchdog process, in a session of its own, that notes
the server's descendant processes every REAP_INTERVAL seconds and kills them all the
moment the server is gone (its end of a pipe closes, whatever killed it; see
:mod:`attnextract.adapters.reaper`). Each actor
also watches the server's pid and exits when it is gone, so an evaluation in progress
is abandoned. A joined cluster (``address``) is left to Ray: its actors are owned by
the server and die with it, its nodes are not the server's to stop.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np

from ..errors import BlackBoxError, InputError, TargetLoadError
from ..oracle import Oracle
from ..report import load_model
from .reaper import ProcessReaper, alive
from .targets import load_target

OWNER_POLL = 0.5             # seconds between an actor's checks that its server lives


def _ray():
    try:
        import ray
    except ImportError as exc:        # an optional extra: say how to get it
        raise InputError("--replicas needs Ray: pip install 'attnextract[ray]' "
                         "(or pip install ray)") from exc
    return ray


class _Replica:
    """One actor: the model, loaded or unpickled once, evaluated on parts of batches.

    ``owner`` (pid, host) is the server's: an actor on the same host exits when that
    process is gone, abandoning any evaluation in progress."""

    def __init__(self, model, owner: tuple[int, str] | None = None):
        if owner is not None and owner[1] == socket.gethostname():
            threading.Thread(target=_exit_with, args=(owner[0],), daemon=True,
                             name="attnextract-owner").start()
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
        except ImportError:           # pragma: no cover - threadpoolctl is a core extra
            pass
        try:
            import torch
            torch.set_num_threads(1)
        except ImportError:
            pass
        if isinstance(model, str):
            model = load_spec(model)
        self.model = model

    def evaluate(self, X):
        return np.asarray(self.model(X), dtype=np.float64)


def _exit_with(pid: int) -> None:
    """End this process as soon as process ``pid`` is gone (an actor's watch)."""
    while alive(pid):
        time.sleep(OWNER_POLL)
    os._exit(0)


def load_spec(spec: str):
    """A model from ``FILE.npz`` (a result or W, v) or ``FILE.py:NAME``."""
    if spec.endswith(".npz"):
        return load_model(spec)
    model = load_target(spec)
    if not hasattr(model, "dim"):
        raise TargetLoadError(f"{spec} has no dim: a served black box must say its token width")
    return ServedBox(model)


DECLARED = ("output_kind", "out_dim", "causal")   # what a vector model says it answers


def joined(answers: list, vectors: bool = False) -> np.ndarray:
    """The parts' answers in order: B numbers (each part's flattened, as always), or the
    vectors (b_i, m) / (b_i, N, m) of each part stacked along the batch (``vectors``: the
    model declares them; else found from the parts' shapes)."""
    parts = [np.asarray(a, dtype=np.float64) for a in answers]
    if vectors or any(p.ndim >= 2 and p.shape[1:] != (1,) for p in parts):
        return np.concatenate(parts)
    return np.concatenate([p.reshape(-1) for p in parts])


class ServedBox:
    """A ``FILE.py:NAME`` black box as the server calls it: a batch (B, N, d) in, B float64
    numbers out, asked the way :class:`attnextract.oracle.Oracle` asks it. So a function
    written for one sequence (N, d) -> one number, a box answering a list, float32 or a
    torch tensor (even one that requires grad) and a ``torch.nn.Module`` are served as
    they are extracted from, not failed with HTTP 500 on their first batch."""

    def __init__(self, box):
        self.box, self.dim = box, int(box.dim)
        self.kind = getattr(box, "kind", "custom")
        self._oracle = Oracle(box, self.dim)
        # what the box declares it answers (vectors), passed on to the server
        for name in DECLARED:
            setattr(self, name, getattr(box, name, None))

    def __call__(self, X) -> np.ndarray:
        return self._oracle._ask_black_box(np.asarray(X, dtype=np.float64))


class RayReplicas:
    """``model`` evaluated on ``replicas`` Ray actors; a callable (B, N, d) -> (B,).

    Parameters
    ----------
    model : callable or str
        The black box (with ``dim``), or a spec each actor loads on its node.
    replicas : int
        Number of actors.
    address : str, optional
        An existing Ray cluster; None starts a local one with ``replicas`` CPUs.
    ray_module : module, optional
        Ray itself (default: ``import ray``); tests pass a stand-in.
    reap : bool, optional
        Start a :class:`ProcessReaper` and have each actor watch this process, so that
        the local cluster stops with it (default: when this object starts the cluster).
    """

    # what the model declares (DECLARED), copied from it at the start (None: not declared)
    output_kind: str | None
    out_dim: int | None
    causal: bool | None

    def __init__(self, model, replicas: int, *, address: str | None = None, ray_module=None,
                 reap: bool | None = None):
        if not isinstance(replicas, int) or replicas < 1:
            raise InputError(f"replicas must be a positive integer, got {replicas!r}")
        local = load_spec(model) if isinstance(model, str) else model
        if not callable(local) or not hasattr(local, "dim"):
            raise InputError("a replicated model must be callable and have a dim")
        self.ray = ray = ray_module or _ray()
        self.dim, self.kind = int(local.dim), getattr(local, "kind", "custom")
        for name in DECLARED:
            setattr(self, name, getattr(local, name, None))
        self.replicas = replicas
        self.started = False
        self.reaper = None
        if not ray.is_initialized():
            options = {"address": address} if address else {"num_cpus": replicas}
            # a stand-in (ray_module) has no processes of its own to reap
            if reap if reap is not None else (not address and ray_module is None):
                # before ray.init: the cluster's processes are noted from their first second
                self.reaper = ProcessReaper()
            try:
                ray.init(include_dashboard=False, log_to_driver=False, **options)
            except BaseException:
                if self.reaper is not None:
                    self.reaper.stop()
                raise
            self.started = True
        owner = (os.getpid(), socket.gethostname()) if self.reaper is not None else None
        actor = ray.remote(num_cpus=1)(_Replica)
        shipped = model if isinstance(model, str) else ray.put(local)
        watch = (owner,) if owner is not None else ()
        self.actors = [actor.remote(shipped, *watch) for _ in range(replicas)]

    def __call__(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        parts = np.array_split(X, min(len(self.actors), max(1, len(X))))
        try:
            answers = self.ray.get([a.evaluate.remote(p) for a, p in zip(self.actors, parts)])
        except Exception as exc:      # an actor died or the model raised on a node
            raise BlackBoxError(f"a Ray replica failed: {type(exc).__name__}: {exc}") from exc
        return joined(answers, self.output_kind in ("last", "all"))

    def close(self) -> None:
        """Stop the actors (and the local cluster this object started)."""
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None

    def __repr__(self) -> str:
        return f"RayReplicas({self.replicas} actors, d={self.dim})"
