"""benchmarks/_results.py: the one results file of a benchmark script."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("_results", BENCHMARKS / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_path_is_the_script_stem_in_results(results):
    assert results.default_path(BENCHMARKS / "bench_noisy.py") == (
        BENCHMARKS / "results" / "bench_noisy.md")
    assert results.out_from_argv("bench_x.py", ["--port", "1"]).name == "bench_x.md"
    assert results.out_from_argv("bench_x.py", ["--out", "/tmp/y.md"]) == Path("/tmp/y.md")


def test_run_writes_header_then_tables_and_captured_output(results, tmp_path, capsys):
    out = tmp_path / "r.md"
    script = BENCHMARKS / "bench_demo.py"
    with results.Run(script, out, argv=["--seeds", "2"]) as run:
        run.add("| a |\n|---|\n| 1 |")
        run.capture()
        print("a printed line")
    text = out.read_text()
    assert text.startswith("# bench_demo\n")
    assert "- command: `" in text and "python benchmarks/bench_demo.py --seeds 2`" in text
    assert re.search(r"- date: \d{4}-\d\d-\d\d \d\d:\d\d UTC, \d+ s wall", text)
    assert re.search(r"- load average \(1, 5, 15 min\): [\d.]+ [\d.]+ [\d.]+ at the start", text)
    assert "logical cores" in text and "numpy" in text and "BLAS threads" in text
    assert text.index("| a |") < text.index("```\na printed line\n```")
    assert "a printed line" in capsys.readouterr().out      # still shown while it runs
    assert sys.stdout is not None and not isinstance(sys.stdout, results._Tee)


def test_a_failed_run_keeps_the_previous_file(results, tmp_path):
    out = tmp_path / "r.md"
    out.write_text("previous\n")
    with pytest.raises(RuntimeError):
        with results.Run("bench_demo.py", out) as run:
            run.capture()
            raise RuntimeError("stopped")
    assert out.read_text() == "previous\n"
    assert not isinstance(sys.stdout, results._Tee)


def test_sections_replace_only_their_own(results, tmp_path):
    out = tmp_path / "r.md"
    for name, body in (("memory", "first memory"), ("flood", "flood rows"),
                       ("memory", "second memory")):
        with results.Run("bench_demo.py", out, section=name) as run:
            run.add(body)
    text = out.read_text()
    assert text.count("# bench_demo\n") == 1
    assert "flood rows" in text and "second memory" in text and "first memory" not in text
    assert text.index("## flood") < text.index("## memory")          # in name order
    assert text.count("- command:") == 2


def test_every_script_writes_through_the_shared_writer():
    """Each script in benchmarks/ (and parsers/h11_heads.py) takes --out through
    _results and names no other file under benchmarks/results."""
    scripts = [p for p in BENCHMARKS.glob("*.py") if p.name != "_results.py"]
    scripts.append(BENCHMARKS / "parsers" / "h11_heads.py")
    for script in scripts:
        text = script.read_text()
        assert "_results." in text, script.name
        named = {n.rstrip(".") for n in re.findall(r"benchmarks/results/([\w./-]+)", text)}
        assert named <= {f"{script.stem}.md"}, (script.name, named)


# Where the project cites benchmark results: the user and maintainer docs, the top-level
# pages, the tests, the library's comments and the benchmark scripts with their README.
ROOT = BENCHMARKS.parent
CITING_GLOBS = ("docs/**/*.md", "docs/**/*.py", "README.md", "CONTRIBUTING.md",
                "tests/**/*.py", "src/**/*.py", "benchmarks/*.py", "benchmarks/parsers/*.py",
                "benchmarks/README.md")
RESULTS_PATH = re.compile(r"benchmarks/results/([\w./*{}-]*[\w*}])")
README_LINK = re.compile(r"\]\(results/([^)\s]+)\)")
# A results file whose script is not directly in benchmarks/ (parsers/ holds the HTTP
# parser experiments; the README's table names it).
RESULTS_OF_SUBFOLDER_SCRIPTS = {"h11_heads": "parsers/h11_heads.py"}


def citing_files():
    here = Path(__file__).resolve()
    for pattern in CITING_GLOBS:
        for path in sorted(ROOT.glob(pattern)):
            if path.resolve() != here:          # this file names patterns, not results
                yield path


def test_every_cited_results_file_exists():
    """A path under benchmarks/results in the docs, tests, sources or benchmark scripts
    (and a results/ link of benchmarks/README.md) names a file that is there: results
    are one file per script, benchmarks/results/<script stem>.md, and runs before that
    layout are cited in words (their files are in git's history only)."""
    missing = []
    for path in citing_files():
        text = path.read_text(encoding="utf-8")
        names = set(RESULTS_PATH.findall(text))
        if path.name == "README.md" and path.parent == BENCHMARKS:
            names |= set(README_LINK.findall(text))
        missing += [f"{path.relative_to(ROOT)}: benchmarks/results/{name}"
                    for name in sorted(names)
                    if not (BENCHMARKS / "results" / name).is_file()]
    assert not missing, "results files cited but not in benchmarks/results:\n" + "\n".join(
        missing)


def test_every_cited_benchmark_script_exists():
    """Scripts named as benchmarks/<name>.py are there (one-off investigations were
    removed with their results files: they are cited in words)."""
    missing = [f"{path.relative_to(ROOT)}: {name}" for path in citing_files()
               for name in sorted(set(re.findall(r"benchmarks/[\w/]+\.py", path.read_text())))
               if not (ROOT / name).is_file()]
    assert not missing, "benchmark scripts cited but not in benchmarks/:\n" + "\n".join(missing)


def test_the_citation_pattern_reads_paths_as_written():
    text = ("see `benchmarks/results/bench_noisy.md`. Old: benchmarks/results/mh4_*.md, "
            "(benchmarks/results/a/b.json) and benchmarks/results/<script stem>.md")
    assert RESULTS_PATH.findall(text) == ["bench_noisy.md", "mh4_*.md", "a/b.json"]
    assert README_LINK.findall("| [x.md](results/x.md) |") == ["x.md"]


def test_results_hold_one_markdown_file_per_script():
    """benchmarks/results holds <stem>.md files only, each the results file of a script
    in benchmarks/ (or of a documented script in a subfolder), and no folders."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    for stem, script in RESULTS_OF_SUBFOLDER_SCRIPTS.items():
        assert (BENCHMARKS / script).is_file(), script
        scripts.add(stem)
    strays = [p.name for p in sorted((BENCHMARKS / "results").iterdir())
              if not (p.is_file() and p.suffix == ".md" and p.stem in scripts)]
    assert not strays, f"not the results file of a benchmark script: {strays}"
