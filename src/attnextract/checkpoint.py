"""A whole checkpoint, layer by layer: ``extract_checkpoint(path, layers=..., outputs=...)``.

Every attention layer of a model folder (:mod:`attnextract.adapters.checkpoint`) is an
independent job: the layer's black box (the checkpoint's own forward code), an oracle
with the layer's journal, a learner, and the canonical heads it returns. Jobs run one
after another, or as Ray tasks (``ray=True`` starts a local cluster with as many CPUs
as the machine has, ``ray="ADDRESS"`` joins one). Either way a job is the same function
of the same arguments, with BLAS and torch pinned to one thread, so the results are
identical bit for bit.

The run folder holds, per layer, its query journals (``layer-I.vectors.sqlite`` for
vector answers, ``layer-I.sqlite`` for a scalar readout: a killed job or run resumes
where it stopped, answering what was asked from the journal),
``layer-I.progress`` (queries done, for the one progress display) and, once the layer
is done, ``layer-I.json`` (its result: a rerun skips finished layers). A job that
fails is retried once (Ray: ``max_retries=1``, also when its worker dies); a layer that
fails twice is reported in the bundle with its reason, never left out.

What each layer's job runs (``outputs``):

- ``"scalar"``: the seeded readout r^T F at the last position; BERT-style layers with
  the low-rank multi-head learner with biases (``multi-head-low-rank``), GPT-2 layers
  with the pre-LayerNorm learner on the sphere (``pre-ln``). The heads are
  (W_h, b_h, v_h = O_h^T r) and c = r^T c.
- ``"last"``: the output vectors at the last position. The score circuits (W_h, b_h)
  come from the scalar learner above (one readout of the same vectors), then the whole
  O_h and c from one designed batch of vectors
  (:mod:`attnextract.learners.values_given_scores`). Where the family's vector learner is
  registered (:data:`VECTOR_LEARNERS`: ``vector-single-head`` for a one-head BERT-style
  layer, ``vector-layer`` for several heads, ``vector-pre-ln`` with the layer's head
  count for a GPT-2 layer of several heads, its heads on the sphere with the radius
  recorded) it replaces both stages; ``learner=`` names another registered learner.
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import registry
from .adapters.journal import QueryJournal
from .errors import AttnExtractError, InputError
from .learners.values_given_scores import extract_values
from .oracle import Oracle
from .sphere import hyperplane_basis

RESULT_SCHEMA = 1
OUTPUTS = ("scalar", "last", "all")
# the scalar learner of each family and its options (the layer's H is added)
SCALAR_LEARNERS = {"bert": ("multi-head-low-rank", {"biases": True}),
                   "gpt2": ("pre-ln", {})}
# the vector learner of each family at the last position (by its head count), used as
# soon as it is registered; until then a scalar stage and the value stage stand in for it
VECTOR_LEARNERS = {"bert": lambda heads: "vector-single-head" if heads == 1 else "vector-layer",
                   # one head: the scalar stage and the value stage (measured to 1e-12 on
                   # default-initialised layers, where vector-pre-ln's one-head chord
                   # leaves W at 1e-8)
                   "gpt2": lambda heads: "vector-pre-ln" if heads >= 2 else None}
# what each family's vector learner is told of the layer (by its head count)
VECTOR_OPTIONS = {"bert": lambda heads: {}, "gpt2": lambda heads: {"heads": heads}}
RETRIES = 1
# singular values of a head's W_h or O_h below this x the largest are rounding (a learner's
# rank-d_h product, a least-squares fit's noise near 1e-15): the bundle stores the factors
LOW_RANK_TOL = 1e-12
POLL_SECONDS = 0.5


# -- arrays in JSON, exactly ----------------------------------------------------------
def pack(array) -> dict:
    """A float64 array as JSON: shape and the base64 of its little-endian bytes (exact)."""
    a = np.ascontiguousarray(np.asarray(array, dtype="<f8"))
    return {"shape": list(a.shape), "float64": base64.b64encode(a.tobytes()).decode()}


def unpack(entry: dict) -> np.ndarray:
    """The array :func:`pack` or :func:`pack_low_rank` wrote."""
    if "low_rank" in entry:
        return np.stack([unpack(h["left"]) @ unpack(h["right"]).T for h in entry["low_rank"]])
    return np.frombuffer(base64.b64decode(entry["float64"]), dtype="<f8").reshape(
        entry["shape"]).copy()


def pack_low_rank(stack: np.ndarray) -> dict:
    """A stack of matrices (H, p, q) of low rank (a layer's W_h or O_h: rank d_h of d) as
    each one's SVD factors at its numerical rank (singular values above LOW_RANK_TOL of
    the largest): a MiniLM layer's heads take 4.7 MB instead of 28 MB."""
    heads = []
    for M in np.asarray(stack, dtype=np.float64):
        s = np.linalg.svd(M, compute_uv=False)
        rank = int(np.sum(s > LOW_RANK_TOL * s[0])) if s.size and s[0] > 0 else 0
        left, right = low_rank_factors(M, rank)
        heads.append({"left": pack(left), "right": pack(right)})
    return {"low_rank": heads}


def low_rank_factors(M: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """M (p, q) ~ L R^T with L (p, rank), R (q, rank), by SVD (singular values split evenly)."""
    U, s, Vt = np.linalg.svd(M, full_matrices=False)
    root = np.sqrt(s[:rank])
    return U[:, :rank] * root, Vt[:rank].T * root


# -- one layer --------------------------------------------------------------------------
@dataclass
class LayerJob:
    """Everything one layer's job needs (picklable: a Ray task's argument)."""

    path: str
    layer: int
    outputs: str
    seed: int
    readout_seed: int
    run_dir: str | None
    learner: str | None = None
    options: dict = field(default_factory=dict)
    budget: int | None = None


def _pin_threads() -> None:
    """One BLAS and one torch thread: N jobs on N cores, and the same sums in every job
    (a BLAS with another thread count may add in another order)."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    import torch
    torch.set_num_threads(1)


def _progress_writer(path: Path | None):
    """A progress callback writing ``done total`` to the layer's progress file (throttled)."""
    if path is None:
        return None
    last = [0.0]

    def write(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < POLL_SECONDS and done < total:
            return
        last[0] = now
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{done} {total}")
        os.replace(tmp, path)
    return write


def run_layer(job: LayerJob) -> dict:
    """Extract one layer; the layer's result as a JSON-ready dict (heads packed exactly).

    Raises what the learner raises (a refusal, a black-box failure): the caller retries
    once and reports."""
    _pin_threads()
    # imported here, not at the top: transformers and torch are optional, and importing
    # attnextract.checkpoint must not need them (the CLI's --help, the docs)
    from .adapters.checkpoint import Checkpoint, ScalarReadout, readout_vector

    cpu, wall = time.process_time(), time.perf_counter()
    ck = Checkpoint(job.path)
    info = ck.info
    # --outputs all: the box answers every position (GPT-2's causal); BERT-style layers'
    # learners read every position, vector-pre-ln reads the last
    box = ck.black_box(job.layer, "all" if job.outputs == "all" else "last")
    run_dir = Path(job.run_dir) if job.run_dir else None
    if run_dir is not None:
        (run_dir / f"layer-{job.layer}.pid").write_text(str(os.getpid()))
    progress_file = run_dir / f"layer-{job.layer}.progress" if run_dir else None
    vector_learner = VECTOR_LEARNERS[info.family](info.heads)
    if (job.outputs in ("last", "all") and job.learner is None
            and vector_learner in registry.LEARNERS):
        return _run_vector_learner(job, ck, box, vector_learner, run_dir, progress_file,
                                   cpu, wall)
    # the scalar stage's journal (a vector learner keeps only the vectors journal)
    journal = None if run_dir is None else QueryJournal(
        run_dir / f"layer-{job.layer}.sqlite", context={
            "target": f"checkpoint {info.path} layer {job.layer} readout {job.readout_seed}",
            "dim": info.width, "seed": job.seed})
    r = readout_vector(info.width, job.readout_seed)
    progress = _progress_writer(progress_file)
    oracle = Oracle(ScalarReadout(box, r), info.width, journal=journal, progress=progress,
                    budget=job.budget)
    model, options = SCALAR_LEARNERS[info.family]
    if job.learner is not None:
        model = job.learner
    options = {**options, "heads": info.heads, **job.options}
    try:
        result = registry.extract(oracle, model=model, seed=job.seed, **options)
    finally:
        if journal is not None:
            journal.close()
    heads = _scalar_heads(result.model)
    out = _layer_entry(job, result.options["model"],
                       {k: v for k, v in result.options.items() if k not in ("model", "seed")},
                       result, oracle)
    if info.pre_layer_norm:
        out["radius"] = float(result.model.radius)
        out["residual_readout_norm"] = float(np.linalg.norm(result.model.r))
    if job.outputs in ("last", "all"):
        basis = hyperplane_basis(info.width) if info.pre_layer_norm else None
        # the vectors through their own oracle (counted, validated) and journal (a journal
        # holds one kind of answer: the scalar stage's is another file)
        vectors_journal = None if run_dir is None else QueryJournal(
            run_dir / f"layer-{job.layer}.vectors.sqlite", context={
                "target": f"checkpoint {info.path} layer {job.layer} vectors",
                "dim": info.width, "seed": job.seed})
        vectors = Oracle(box, info.width, outputs="last", out_dim=info.width,
                         journal=vectors_journal)
        try:
            values = extract_values(vectors.query, heads["W"], heads["b"], seed=job.seed,
                                    basis=basis, radius=out.get("radius"))
        finally:
            if vectors_journal is not None:
                vectors_journal.close()
        out["journal_queries"] += int(vectors.journal_queries)
        out["check_queries"] += int(vectors.check_queries)
        out["black_box_queries"] += int(vectors.check_queries)
        out["black_box_seconds"] += float(vectors.black_box_seconds)
        heads.update(O=values["O"], c=values["c"])
        heads.pop("v")
        out["values_stage"] = {k: values[k] for k in ("queries", "condition", "error_bar",
                                                      "held_out_error")}
        out["queries"] += values["queries"] + vectors.check_queries
        out["black_box_queries"] += vectors.black_box_queries
        # the value stage's unknowns [c | O_1 .. O_H] over the m numbers of an answer
        out["floor"] = int(out["floor"]) + info.heads * info.width + 1
    out["heads"] = {k: pack_low_rank(v) if k in ("W", "O") else pack(v)
                    for k, v in heads.items()}
    out["heads_found"] = int(heads["W"].shape[0])
    out["cpu_seconds"] = time.process_time() - cpu
    out["wall_seconds"] = time.perf_counter() - wall
    return out


def _run_vector_learner(job: LayerJob, ck, box, name: str, run_dir, progress_file, cpu,
                        wall) -> dict:
    """One layer through a registered vector learner: the box's output vectors at the last
    position, through a vector Oracle with the layer's vectors journal."""
    info = ck.info
    journal = None if run_dir is None else QueryJournal(
        run_dir / f"layer-{job.layer}.vectors.sqlite", context={
            "target": f"checkpoint {info.path} layer {job.layer} vectors",
            "dim": info.width, "seed": job.seed})
    # every position: the mask is the family's (BERT sees both ways, GPT-2 is causal)
    oracle = Oracle(box, info.width, outputs=job.outputs, out_dim=info.width, journal=journal,
                    budget=job.budget,
                    causal=bool(info.causal) if job.outputs == "all" else None,
                    progress=_progress_writer(progress_file))
    options = {**VECTOR_OPTIONS[info.family](info.heads), **job.options}
    try:
        result = registry.extract(oracle, model=name, seed=job.seed, **options)
    finally:
        if journal is not None:
            journal.close()
    model = result.model
    heads = {"W": np.asarray(model.W), "b": np.asarray(model.b), "O": np.asarray(model.O),
             "c": np.asarray(model.c)}
    sphere = {}
    if info.pre_layer_norm:
        # the heads live on the sphere of this radius (the export and the check fold the
        # weights there); the sublayer has no residual, so R is the rounding's
        sphere = {"radius": float(model.radius),
                  "residual_norm": float(np.linalg.norm(model.R))}
    return {**_layer_entry(job, name, options, result, oracle), **sphere,
            "heads": {k: pack_low_rank(v) if k in ("W", "O") else pack(v)
                      for k, v in heads.items()},
            "heads_found": int(heads["W"].shape[0]),
            "cpu_seconds": time.process_time() - cpu,
            "wall_seconds": time.perf_counter() - wall}


def _layer_entry(job, learner: str, options: dict, result, oracle) -> dict:
    """What every layer's entry in the bundle states: the job, the learner, its queries
    (the learner's, answered live or by the journal, a resumed run asking the same ones;
    the journal's own checks of the box apart), error bar and verification."""
    report = result.report
    return {"layer": job.layer, "outputs": job.outputs, "learner": learner,
            "options": options, "readout_seed": job.readout_seed, "seed": job.seed,
            "queries": int(result.queries), "recovery_queries": int(report.recovery_queries),
            "floor": int(report.floor), "learner_queries": int(oracle.queries),
            "journal_queries": int(oracle.journal_queries),
            "check_queries": int(oracle.check_queries),
            "black_box_queries": int(oracle.black_box_queries + oracle.check_queries),
            "error_bar": _error_bar(report),
            "verification": None if report.verification is None else {
                "passed": bool(report.verification.passed),
                "max_relative_error": float(report.verification.max_relative_error),
                "queries": int(report.breakdown.get("verification", 0))},
            "black_box_seconds": float(oracle.black_box_seconds)}


def _scalar_heads(model) -> dict:
    """(W, b, v, c) of a scalar learner's model (a biased or sphere multi-head model)."""
    return {"W": np.asarray(model.W), "b": np.asarray(model.b), "v": np.asarray(model.v),
            "c": np.asarray(float(model.c))}


def _error_bar(report) -> float | None:
    for key in ("error bar", "predicted error"):
        value = report.details.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


def layer_heads(entry: dict) -> dict[str, np.ndarray]:
    """The canonical heads of one layer's result entry, unpacked."""
    return {k: unpack(v) for k, v in entry["heads"].items()}


# -- comparison with the weights -----------------------------------------------------------
def canonical_errors(entry: dict, truth, readout_seed: int | None = None) -> dict:
    """Errors of one layer's heads against the truth (a CanonicalLayer from the weights).

    Heads are matched by W (Hungarian assignment); each head's W_h, b_h and O_h (or v_h) is
    compared relative to its own norm, c relative to its norm. ``canonical_error`` is the
    largest. A pre-LayerNorm truth is folded onto the sphere of the extraction's radius."""
    from scipy.optimize import linear_sum_assignment

    from .adapters.checkpoint import readout_vector
    found = layer_heads(entry)
    if truth.norm is not None:
        truth = truth.on_sphere(entry["radius"])
    W, b, O, c = truth.W, truth.b, truth.O, truth.c
    if "v" in found:
        r = readout_vector(O.shape[1], entry["readout_seed"] if readout_seed is None
                           else readout_seed)
        values, c = np.einsum("hmd,m->hd", O, r), np.asarray(float(c @ r))
        got = found["v"]
    else:
        values, got = O, found["O"]
    if found["W"].shape[0] != W.shape[0]:
        return {"canonical_error": math.inf, "heads_found": int(found["W"].shape[0]),
                "heads_true": int(W.shape[0])}
    norm = np.linalg.norm(W, axis=(1, 2))
    cost = np.linalg.norm(found["W"][None] - W[:, None], axis=(2, 3)) / norm[:, None]
    rows, cols = linear_sum_assignment(np.nan_to_num(cost, nan=1e300, posinf=1e300))
    order = cols[np.argsort(rows)]

    def rel(a, t):
        scale = np.linalg.norm(t)
        return float(np.linalg.norm(a - t) / (scale if scale > 0 else 1.0))

    per_head = [{"W": rel(found["W"][o], W[h]), "b": rel(found["b"][o], b[h]),
                 "O" if "O" in found else "v": rel(got[o], values[h])}
                for h, o in enumerate(order)]
    c_error = rel(found["c"], c)
    worst = max([max(p.values()) for p in per_head] + [c_error])
    return {"canonical_error": worst, "c_error": c_error, "per_head": per_head,
            "order": [int(o) for o in order]}


# -- the whole checkpoint -------------------------------------------------------------------
def _default_run_dir(path) -> Path:
    return Path(f"{Path(path).name or 'checkpoint'}.attnextract-run")


class _Display:
    """One progress display for every layer, drawn from the layers' progress files."""

    def __init__(self, layers: list[int], run_dir: Path | None, stream=None, enabled=None):
        self.layers, self.run_dir = layers, run_dir
        self.stream = stream or sys.stderr
        self.enabled = (self.stream.isatty() if enabled is None else enabled) and run_dir
        self.state = {i: "waiting" for i in layers}
        self._last = ""

    def mark(self, layer: int, text: str) -> None:
        self.state[layer] = text
        self.draw(force=True)

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        assert self.run_dir is not None       # enabled only with a run folder
        parts = []
        for i in self.layers:
            text = self.state[i]
            if text == "running":
                try:
                    done, total = (self.run_dir / f"layer-{i}.progress").read_text().split()
                    text = f"{int(done) / max(int(total), 1):.0%}"
                except (OSError, ValueError):
                    text = "started"
            parts.append(f"{i}:{text}")
        line = "layers " + "  ".join(parts)
        if line != self._last or force:
            self.stream.write("\r" + line[:200] + "\033[K")
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class CheckpointResult:
    """The bundle of a checkpoint run: ``data`` is the JSON written to ``out``."""

    data: dict

    @property
    def layers(self) -> list[dict]:
        return self.data["layers"]

    @property
    def failed(self) -> list[dict]:
        return [e for e in self.layers if "error" in e]

    def heads(self, layer: int) -> dict[str, np.ndarray]:
        for entry in self.layers:
            if entry["layer"] == layer and "heads" in entry:
                return layer_heads(entry)
        raise InputError(f"layer {layer} has no result in this bundle")

    def save(self, path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path) -> CheckpointResult:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"cannot read the checkpoint result {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("kind") != "attnextract-checkpoint":
            raise InputError(f"{path} is not an attnextract checkpoint result")
        return cls(data)

    def summary(self) -> str:
        """One line per layer and a total, for people."""
        lines = [f"{self.data['checkpoint']}: {self.data['family']}, outputs "
                 f"{self.data['outputs']}, {len(self.layers)} layer(s)"
                 + (f" on Ray ({self.data['ray']})" if self.data.get("ray") else "")]
        for e in self.layers:
            if "error" in e:
                lines.append(f"  layer {e['layer']}: FAILED after {e['attempts']} attempts: "
                             f"{e['error']}")
                continue
            check = e.get("check") or {}
            err = check.get("canonical_error")
            passed = (e["verification"] or {}).get("passed")
            lines.append(
                f"  layer {e['layer']}: {e['queries']} queries (floor {e['floor']}), "
                f"{e['heads_found']} heads, held-out "
                f"{(e['verification'] or {}).get('max_relative_error', float('nan')):.1e} "
                f"{'PASSED' if passed else 'FAILED'}"
                + (f", canonical error {err:.1e}" if err is not None else "")
                + f", {e['cpu_seconds']:.1f} s CPU, {e['wall_seconds']:.1f} s wall"
                + (" (resumed)" if e.get("journal_queries") else ""))
        t = self.data["total"]
        lines.append(f"  total: {t['queries']} queries (floor {t['floor']}), "
                     f"{t['cpu_seconds']:.1f} s CPU in the jobs, {t['wall_seconds']:.1f} s wall"
                     + (f", worst canonical error {t['canonical_error']:.1e}"
                        if t.get("canonical_error") is not None else ""))
        return "\n".join(lines)


def _ray_module():
    try:
        import ray
    except ImportError as exc:        # an optional extra: say how to get it
        raise InputError("--ray needs Ray: pip install 'attnextract[ray]' (or pip install "
                         "ray)") from exc
    return ray


def extract_checkpoint(path, *, layers="all", outputs: str = "last", seed: int = 0,
                       readout_seed: int = 0, learner: str | None = None,
                       options: dict | None = None, run_dir=None, ray=None,
                       check_against=None, budget: int | None = None, progress=None,
                       out=None) -> CheckpointResult:
    """Extract the attention of every chosen layer of a local model folder.

    Parameters
    ----------
    path : str or Path
        Model folder: config.json and model.safetensors (nothing is downloaded).
    layers : "all", "0,3,5" or list of int
    outputs : {"last", "scalar", "all"}
        What the layer's box answers: the whole vector F at the last position (default),
        r^T F at the last position (seeded readout r: one direction of the output, at
        far more queries), or at every position ("all": BERT-style layers, every
        position read; GPT-2 layers of several heads, causal, read at the last position
        by ``vector-pre-ln``; a GPT-2 layer of one head is refused before any query).
    seed, readout_seed : int
        Seeds of the learners and of the readout r (the same for every layer).
    learner : str, optional
        A registered learner replacing the family's scalar learner; ``options`` its
        options (H is passed as ``heads``).
    run_dir : str or Path, optional
        The run folder (journals, progress, finished layers); default
        ``<folder name>.attnextract-run`` in the working directory. A rerun resumes it.
    ray : None, True or str
        None/False: the layers one after another in this process. True: Ray tasks on a
        local cluster started for the run (as many CPUs as cores). A string: the address
        of an existing cluster (``auto``, ``ray://HOST:10001``).
    check_against : str or Path, optional
        A model folder with the true weights (usually ``path`` itself): each layer's
        canonical error against them is added (``check``).
    budget : int, optional
        Query budget of each layer's scalar stage.
    progress : bool, optional
        Draw the per-layer progress display (default: when stderr is a terminal).
    out : str or Path, optional
        Write the bundle (JSON) there.

    Returns
    -------
    CheckpointResult
        ``data["layers"]``: per layer the canonical heads (packed float64), queries,
        floor, error bar, verification, CPU and wall time; failed layers with ``error``.

    Raises
    ------
    TargetLoadError, RotaryModelError, InputError
        Before any query: a folder that is not a model folder, a rotary model, bad options.
    """
    # the adapter needs torch and transformers: imported on use, never by the core
    from .adapters.checkpoint import Checkpoint, inspect_checkpoint, parse_layers

    if outputs not in OUTPUTS:
        raise InputError(f"outputs must be one of {', '.join(OUTPUTS)}, got {outputs!r}")
    info = inspect_checkpoint(path)                  # a refusal here costs no query
    if outputs == "all" and (VECTOR_LEARNERS[info.family](info.heads) is None
                             or learner is not None):
        raise InputError("--outputs all needs a learner of every position's vectors: "
                         "BERT-style layers and GPT-2 layers of several heads have one "
                         "(a GPT-2 layer of one head has not); use --outputs last or scalar")
    chosen = parse_layers(layers, info.layers)
    run_dir = Path(run_dir) if run_dir is not None else _default_run_dir(info.path)
    run_dir.mkdir(parents=True, exist_ok=True)
    jobs = [LayerJob(str(info.path), i, outputs, seed, readout_seed, str(run_dir), learner,
                     dict(options or {}), budget) for i in chosen]
    display = _Display(chosen, run_dir, enabled=progress)
    wall = time.perf_counter()
    entries: dict[int, dict] = {}
    todo = []
    for job in jobs:
        done = _finished(run_dir, job)
        if done is not None:
            entries[job.layer] = done
            display.state[job.layer] = "done"
        else:
            todo.append(job)
    try:
        if ray:
            address = None if ray is True else str(ray)
            entries.update(_run_on_ray(todo, address, display))
        else:
            entries.update(_run_serially(todo, display))
    finally:
        display.close()
    layer_entries = [entries[i] for i in chosen]
    if check_against is not None:
        truth = Checkpoint(check_against)
        if truth.info.width != info.width or truth.info.layers < max(chosen) + 1:
            raise InputError(f"{check_against} is not the same architecture as {path}")
        for entry in layer_entries:
            if "heads" in entry:
                entry["check"] = canonical_errors(entry, truth.truth(entry["layer"]))
    good = [e for e in layer_entries if "heads" in e]
    checks = [e["check"]["canonical_error"] for e in good if "check" in e]
    data = {"kind": "attnextract-checkpoint", "schema_version": RESULT_SCHEMA,
            "checkpoint": str(info.path), "model_type": info.model_type,
            "family": info.family, "width": info.width, "heads": info.heads,
            "head_dim": info.head_dim, "causal": info.causal, "outputs": outputs,
            "seed": seed, "readout_seed": readout_seed,
            "ray": (None if not ray else "local" if ray is True else str(ray)),
            "run_dir": str(run_dir), "layers": layer_entries,
            "total": {"queries": sum(e["queries"] for e in good),
                      "floor": sum(e["floor"] for e in good),
                      "cpu_seconds": sum(e["cpu_seconds"] for e in good),
                      "wall_seconds": time.perf_counter() - wall,
                      "failed_layers": [e["layer"] for e in layer_entries if "error" in e],
                      "canonical_error": max(checks) if checks else None}}
    result = CheckpointResult(data)
    if out is not None:
        result.save(out)
    return result


def _finished(run_dir: Path, job: LayerJob) -> dict | None:
    """A layer finished by an earlier run with the same settings, or None."""
    path = run_dir / f"layer-{job.layer}.json"
    try:
        entry = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = (entry.get("outputs") == job.outputs and entry.get("seed") == job.seed
            and entry.get("readout_seed") == job.readout_seed and "heads" in entry
            and (job.learner is None or entry.get("learner") == job.learner))
    return entry if same else None


def _keep(run_dir: str | None, entry: dict) -> dict:
    if run_dir is not None:
        path = Path(run_dir) / f"layer-{entry['layer']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    return entry


def _failure(job: LayerJob, exc: BaseException, attempts: int) -> dict:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return {"layer": job.layer, "outputs": job.outputs, "error": f"{type(exc).__name__}: "
            f"{reason}", "attempts": attempts}


def _run_serially(jobs: list[LayerJob], display: _Display) -> dict[int, dict]:
    """Each layer in this process, retried once; the display redrawn from a thread."""
    import threading
    entries = {}
    stop = threading.Event()

    def redraw():
        while not stop.wait(POLL_SECONDS):
            display.draw()
    thread = threading.Thread(target=redraw, daemon=True)
    thread.start()
    try:
        for job in jobs:
            display.mark(job.layer, "running")
            for attempt in range(1 + RETRIES):
                try:
                    entries[job.layer] = _keep(job.run_dir, run_layer(job))
                    display.mark(job.layer, "done")
                    break
                except (AttnExtractError, RuntimeError, OSError, ValueError) as exc:
                    if attempt == RETRIES:
                        entries[job.layer] = _failure(job, exc, attempt + 1)
                        display.mark(job.layer, "FAILED")
    finally:
        stop.set()
        thread.join()
    return entries


def _ray_layer(job: LayerJob) -> dict:
    """The Ray task: one layer's job, its result kept in the run folder by the worker."""
    return _keep(job.run_dir, run_layer(job))


def _run_on_ray(jobs: list[LayerJob], address: str | None, display: _Display) -> dict[int, dict]:
    """Every layer a Ray task (retried once, also when its worker dies)."""
    ray = _ray_module()
    if not jobs:
        return {}
    started = not ray.is_initialized()
    if started:
        if address is None:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR")
        else:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=True)(_ray_layer)
    pending = {task.remote(job): job for job in jobs}
    for job in jobs:
        display.mark(job.layer, "running")
    entries = {}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
            display.draw()
            for ref in ready:
                job = pending.pop(ref)
                try:
                    entries[job.layer] = ray.get(ref)
                    display.mark(job.layer, "done")
                except ray.exceptions.RayError as exc:   # a task's error, after its retry
                    cause = getattr(exc, "cause", None) or exc
                    entries[job.layer] = _failure(job, cause, 1 + RETRIES)
                    display.mark(job.layer, "FAILED")
    finally:
        if started:
            ray.shutdown()
    return entries
