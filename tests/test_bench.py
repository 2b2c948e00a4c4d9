"""The benchmark command's quick form, and the surrogate baseline it compares with."""

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import check_grad

from attnextract import Oracle
from attnextract.bench import fitted_slope, update_readme
from attnextract.report import held_out_sequences
from attnextract.oracle import by_length
from attnextract.learners.surrogate import _loss_and_grad, train_surrogate
from attnextract.adapters.targets import random_single_head

from conftest import run_cli


@pytest.mark.slow
def test_bench_quick_writes_json_table_and_plots(tmp_path):
    out = tmp_path / "bench"
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:begin -->\nold\n<!-- bench:end -->\nrest\n")
    proc = run_cli("bench", "--quick", "--out-dir", str(out), "--update-readme", str(readme),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "bench.json").read_text())
    single = [r for r in summary["rows"] if r["learner"] == "single-head" and "floor" in r]
    assert [r["recovery_queries"] for r in single] == [r["floor"] for r in single]
    assert max(r["W_error"] for r in single) < 1e-9
    surrogate = [r for r in summary["rows"] if r["learner"] == "surrogate"]
    assert len(surrogate) == 2 and all(r["label"].startswith("surrogate") for r in surrogate)
    for name in ("queries_vs_d.png", "error_vs_d.png", "time_split.png", "surrogate.png",
                 "error_vs_tau.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (out / name).with_suffix(".svg").read_bytes()[:2000]
    noisy = {(r["learner"], r["tau"]): r for r in summary["rows"] if "tau" in r}
    for (learner, tau), r in noisy.items():
        assert r["W_abs_error"] <= r["error_bar_W"], (learner, tau)
        if learner == "noisy (robust)":     # at equal queries, 10x better than the paper
            assert r["queries"] == noisy[("noisy (paper)", tau)]["queries"]
            assert 10 * r["W_abs_error"] < noisy[("noisy (paper)", tau)]["W_abs_error"]
    for r in summary["rows"]:
        if r["learner"].startswith("multi-head") and "vector_compare" not in r:
            assert r["recovery_queries"] <= r["paper_count"] and r["W_error"] < 1e-8
        if r["learner"] == "low-rank adaptive":
            assert r["recovery_queries"] <= 1.05 * r["floor"] + 32 and r["W_error"] < 1e-9
    grid = [r for r in summary["rows"] if r.get("grid")]
    assert grid and all(r["success_rate"] == 1.0 and r["wrong_models"] == 0
                        and r["recovery_median"] <= r["paper_count"] for r in grid)
    assert (out / "multi_head_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    biased = [r for r in summary["rows"] if r["learner"] == "single-head (biases)"]
    assert biased and all(r["recovery_queries"] == r["floor"] == r["d"] ** 2 + 2 * r["d"] + 1
                          and r["W_error"] < 1e-9 for r in biased)
    # a biased row per learner that takes --biases
    from attnextract.registry import LEARNERS
    with_biases = {n for n, e in LEARNERS.items() if "biases" in e.options and not e.vectors}
    rows_of = {"single-head": "single-head (biases)", "low-rank": "low-rank adaptive (biases)",
               "multi-head": "multi-head (biases", "multi-head-low-rank": "multi-head low-rank (biases"}
    assert with_biases == set(rows_of)
    for name, prefix in rows_of.items():
        rows = [r for r in summary["rows"] if r["learner"].startswith(prefix)]
        assert rows and all(r["W_error"] < 1e-9 and r["c_error"] < 1e-9 for r in rows), name
    pre_ln = [r for r in summary["rows"] if r["learner"].startswith("pre-ln")]
    assert {r["heads"] for r in pre_ln} == {1, 2, 4}
    assert all(r["W_error"] < 1e-9 and r["c_error"] < 1e-9 for r in pre_ln)
    assert all(r["recovery_queries"] <= 1.3 * r["floor"] for r in pre_ln if r["heads"] == 1)
    one_layer = [r for r in summary["rows"] if r["learner"] == "one-layer"]
    assert one_layer and max(r["W_error"] for r in one_layer) < 1e-9
    table = (out / "bench.md").read_text()
    assert "| single-head | 64 | 4160 |" in table and "surrogate 10x" in table
    text = readme.read_text()
    assert "old" not in text and "| single-head | 64 | 4160 |" in text and text.endswith("rest\n")


def test_bench_quick_runs_from_an_installed_package_without_the_source_tree(tmp_path):
    """A normal (non-editable) install has the package and nothing of the repository: the
    package alone, copied where no benchmarks/ folder is near, runs the quick multi-head
    grid (the section that once needed the checkout) and writes into --out-dir."""
    import os
    import shutil
    import subprocess
    import sys
    import attnextract
    site = tmp_path / "site"
    shutil.copytree(Path(attnextract.__file__).parent, site / "attnextract",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site), "OPENBLAS_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import attnextract.bench as b; "
                            "print(b.__file__)"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, check=True).stdout.strip()
    assert Path(where).is_relative_to(site)
    assert not any((parent / "benchmarks").exists() for parent in Path(where).parents)
    out = tmp_path / "out"
    proc = run_cli("bench", "--quick", "--sections", "multi-head-grid", "--out-dir", out,
                   cwd=tmp_path, env=env, check=0)
    summary = json.loads((out / "bench.json").read_text())
    grid = [r for r in summary["rows"] if r.get("grid")]
    assert [(r["H"], r["d"]) for r in grid] == [(2, 8), (4, 8)]
    assert all(r["success_rate"] == 1.0 and r["wrong_models"] == 0 for r in grid)
    assert "| 8 | 2 | full |" in (out / "bench.md").read_text()
    assert "wrote" in proc.stdout


def test_fitted_slope():
    ds = np.array([4, 8, 16, 32])
    assert abs(fitted_slope(ds, 3 * ds ** 2.0) - 2.0) < 1e-12


def test_update_readme_needs_markers(tmp_path):
    readme = tmp_path / "R.md"
    readme.write_text("no markers")
    try:
        update_readme(readme, "table", None)
    except ValueError as exc:
        assert "markers" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_surrogate_gradient_is_exact():
    d, rng = 5, np.random.default_rng(0)
    seqs = held_out_sequences(d, 40, rng, 0.7)
    groups, y = by_length(seqs), rng.standard_normal(40)
    theta = rng.standard_normal(d * d + d)
    err = check_grad(lambda t: _loss_and_grad(t, groups, y, d)[0],
                     lambda t: _loss_and_grad(t, groups, y, d)[1], theta)
    assert err < 1e-5 * np.linalg.norm(_loss_and_grad(theta, groups, y, d)[1])


def test_surrogate_counts_queries_and_fits_with_many_queries():
    d = 4
    target = random_single_head(d, seed=2)
    oracle = Oracle(target, d)
    result = train_surrogate(oracle, 400, seed=0, max_iter=400)
    assert result.queries == oracle.queries == 400 + 64
    assert result.report.kind == "surrogate"
    assert result.report.verification.max_relative_error < 1e-2


def _rows_with_many_series():
    """Bench rows like --quick's, with seven variants of one learner (one colour before)."""
    rows = []
    for learner, ds in [("single-head", [4, 8, 16]), ("low-rank rop", [16, 32]),
                        ("multi-head (H = 2)", [4, 8])]:
        for d in ds:
            rows.append({"learner": learner, "d": d, "recovery_queries": d * d + d,
                         "floor": d * d + d, "paper_count": d * d + d + 1, "W_error": 1e-14,
                         "output_error": 1e-13, "wall_s": 0.01, "black_box_s": 0.001,
                         "learner_s": 0.009})
    for i in range(7):
        rows.append({"learner": f"transformer-layer (variant {i})", "d": 8,
                     "recovery_queries": 1000 + 100 * i, "floor": 300, "paper_count": None,
                     "W_error": 1e-12, "output_error": 1e-11, "wall_s": 0.1,
                     "black_box_s": 0.01, "learner_s": 0.09})
    for learner in ("noisy (robust)", "noisy (paper)"):
        for tau in (1e-8, 1e-6):
            rows.append({"learner": learner, "d": 16, "tau": tau, "queries": 336,
                         "W_abs_error": tau, "error_bar_W": 2 * tau})
    for H in (1, 2, 4):
        rows.append({"grid": True, "H": H, "d": 8, "scale": 1.0, "rank": None,
                     "float32": False, "success_rate": 1.0, "error_median": 1e-12})
    return rows


def test_plots_one_colour_and_marker_per_series_legends_outside_log_axes_svg(
        tmp_path, monkeypatch):
    """Every axes of every plot: no two labelled series share a colour or a marker, the
    legend lies right of the data and inside the figure, log scales where the values span
    decades; SVG (and PNG, PDF) written; the grid's heads axis has whole-number ticks."""
    import matplotlib  # noqa: F401  (a test-all package: see conftest.py)
    matplotlib.use("Agg")
    from matplotlib.colors import to_hex
    from attnextract import bench, bench_grid, plotting
    figures = {}
    original = plotting.save

    def inspect(fig, path, *args, **kwargs):
        fig.canvas.draw()
        series = []
        for ax in fig.axes:
            lines = [line for line in ax.get_lines()
                     if line.get_label() and not line.get_label().startswith("_")
                     and line.get_marker() not in ("None", "", None)]
            styles = [(to_hex(line.get_color()), line.get_marker()) for line in lines]
            assert len({c for c, _ in styles}) == len(styles), (path, styles)
            assert len({m for _, m in styles}) == len(styles), (path, styles)
            series += [line.get_label() for line in lines]
            legend = ax.get_legend()
            if legend is not None:
                box, axes_box = legend.get_window_extent(), ax.get_window_extent()
                assert box.x0 >= axes_box.x1 - 1, (path, box.x0, axes_box.x1)
                assert box.height <= fig.bbox.height + 1 and box.y0 >= -1, path
        figures[Path(path).stem] = (fig, series)
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(bench, "save", inspect)
    monkeypatch.setattr(bench_grid, "save", inspect)
    rows = _rows_with_many_series()
    written = bench.plots(rows, tmp_path)
    # every learner is a series of the queries plot, its panel's axes log-log
    fig, series = figures["queries_vs_d"]
    learners = {r["learner"] for r in rows if "floor" in r and not r.get("grid")}
    assert {label.split(" (slope")[0] for label in series} == learners
    assert all(ax.get_xscale() == ax.get_yscale() == "log" for ax in fig.axes)
    # the time split spans decades (0.001 s to 0.09 s): a log time axis
    assert figures["time_split"][0].axes[0].get_yscale() == "log"
    # SVG, PNG and PDF of every plot
    for stem in figures:
        assert {f"{stem}.svg", f"{stem}.png", f"{stem}.pdf"} <= set(written)
        assert b"<svg" in (tmp_path / f"{stem}.svg").read_bytes()[:2000]
        assert (tmp_path / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
    # the multi-head grid's heads axis has whole-number ticks only
    for ax in figures["multi_head_grid"][0].axes:
        assert list(ax.get_xticks()) == [1, 2, 4]


def test_series_styles_refuse_more_series_than_stay_distinguishable():
    from attnextract.plotting import MARKERS, series_styles, spans_decades
    styles = series_styles(f"s{i}" for i in range(len(MARKERS)))
    assert len({s["color"] for s in styles.values()}) == len(MARKERS)
    with pytest.raises(ValueError, match="split them"):
        series_styles(f"s{i}" for i in range(len(MARKERS) + 1))
    assert spans_decades([1e-3, 1.0]) and not spans_decades([1.0, 20.0])
