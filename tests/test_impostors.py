"""The impostor zoo (attnextract.testing.impostors) against the single-head class.

Every impostor answers like a single head (W, v) on the short, ordinary sequences a
learner probes, and differs somewhere else; each carries the reason it is not a
single head. The single-head and low-rank learners, and ``verify`` with the true
head's parameters, must refuse each one (a typed error / a failed check), on 20 of 20
seeds at d in {8, 32} (the full sweep is marked slow; a fast subset runs always).
Honest heads, including hostile ones, must still pass. Other learners:
tests/test_impostors_learners.py.
"""

import pytest

from attnextract import Oracle
from attnextract.testing.impostors import impostor_names, recovery_queries, run_impostor
from attnextract.adapters.targets import (hostile_single_heads, random_low_rank_head,
                                          random_single_head)
from attnextract.learners.single_head import extract_single_head
from attnextract.report import verify_model
from conftest import grid

LEARNERS = ("single-head", "low-rank", "verify")
NAMES = impostor_names("single-head")
_RECOVERY = {}

# an overflow anywhere (outputs of 1e200 squared) is a bug here, not a warning
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def refused(learner: str, name: str, d: int, seed: int) -> bool:
    """True when ``learner`` refuses impostor ``name`` built on its honest model (seed)."""
    if (learner, d) not in _RECOVERY:
        _RECOVERY[learner, d] = recovery_queries(learner, d)
    outcome, _, _ = run_impostor(learner, name, d, seed, _RECOVERY[learner, d])
    assert not outcome.startswith("crash"), outcome
    return outcome.startswith("refused")


FAST = [("single-head", n, 8, 0) for n in NAMES] + [("low-rank", n, 32, 1) for n in NAMES] + \
       [("verify", n, 8, 2) for n in NAMES]


@pytest.mark.parametrize("learner, name, d, seed", FAST)
def test_impostor_refused(learner, name, d, seed):
    assert refused(learner, name, d, seed), (learner, name)


@pytest.mark.slow
@pytest.mark.parametrize("d", [8, 32])
@pytest.mark.parametrize("learner", LEARNERS)
@pytest.mark.parametrize("name", NAMES)
def test_impostor_refused_on_more_seeds(name, learner, d):
    """Seeds 3-6 in CI (FAST has seeds 0-2); all 20 in benchmarks/test_grids.py, and the
    zoo over every learner in benchmarks/bench_impostors.py (results/bench_impostors.md).
    KNOWN_MISSES are measured limits, kept visible: the assertion fails if one is refused
    too (then it leaves the list) or if anything else is accepted."""
    missed = [seed for seed in grid(range(20), range(3, 7))
              if not refused(learner, name, d, seed)]
    if (learner, name, d) in KNOWN_MISSES:
        assert missed, f"{learner} now refuses {name} at d = {d}: drop it from KNOWN_MISSES"
        return
    assert not missed, f"{learner} accepted {name} at d = {d} on seeds {missed}"


# none open: a check under about 40 held-out sequences (low-rank at d = 8) now asks a
# few queries more for its batch check, so float32 above batch 8 is refused there too
KNOWN_MISSES: set = set()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["second head 1e-8", "norm trigger"])
def test_label_only_impostors_refused_on_20_seeds(name):
    """The two a label check found hardest (one bit per query): the label hull and the
    large tokens asked alone must catch them every time."""
    missed = [seed for seed in range(20) if not refused("sign-only", name, 8, seed)]
    assert not missed, f"sign-only accepted {name} at d = 8 on seeds {missed}"


@pytest.mark.parametrize("d", [8, 32])
def test_honest_heads_pass(d):
    for seed in range(3):
        heads = {"random": random_single_head(d, seed),
                 "low rank": random_low_rank_head(d, 2, seed), **hostile_single_heads(d, seed)}
        for name, head in heads.items():
            result = extract_single_head(Oracle(head, d), seed=seed)
            v = result.report.verification
            assert v.passed and v.max_relative_error < 1e-8, (name, v)
            check = verify_model(Oracle(head, d), result.model, count=64, seed=seed, measure_v=True)
            assert check.passed, (name, check)


@pytest.mark.slow
def test_cli_verify_refuses_an_impostor(tmp_path):
    from conftest import run_cli
    target = tmp_path / "boxes.py"
    target.write_text(
        "import numpy as np\n"
        "from attnextract.adapters.targets import random_single_head\n"
        "honest = random_single_head(6, 4)\n"
        "def windowed(X):\n"
        "    X = np.asarray(X)[:, -16:, :]\n"
        "    return honest(X)\n")
    out = tmp_path / "r.npz"
    run_cli("extract", "--target", f"{target}:honest", "--dim", 6, "--out", out, check=0)
    run_cli("verify", "--target", f"{target}:honest", "--result", out, check=0)
    proc = run_cli("verify", "--target", f"{target}:windowed", "--result", out, check=1)
    assert "MISMATCH" in proc.stderr and "worst on" in proc.stderr   # names the family
