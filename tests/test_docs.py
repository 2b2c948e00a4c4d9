"""The README's and the docs' code blocks run, as a reader would run them.

Every ```python and ```bash block of README.md and docs/ is executed, in order, in a
fresh folder per page: the Python blocks of a page share one namespace (like a
notebook), a Python block whose first line is ``# NAME.py`` is written to that file
instead (a target file used by the blocks after it), and bash blocks run with
``attnextract`` on the PATH. A block that must not run (it installs packages, starts a
server or needs a remote API) is preceded by the line ``<!-- not run: REASON -->``.
```text blocks (command synopses with placeholders) are not run.

A page's numbers stay its commands' numbers: a ```text block preceded by the line
``<!-- output -->`` is the output of the run block just before it, and each of its lines
(but ``...``, which stands for lines left out) must appear, in order and with the same
words and numbers, in what that block printed; a line ending in ``...`` stands for the
printed line that starts with it (the rest, e.g. an error in the last bits, not shown).
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                      if p.parent.name != "bench")
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: .+ -->$")
OUTPUT = "<!-- output -->"
TARGET_FILE = re.compile(r"^# ([\w.-]+\.py)\s*$")


def code_blocks(path: Path) -> list[dict]:
    """The fenced blocks of a Markdown file: language, code, first line, whether marked not run."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        before = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        blocks.append({"lang": opening.group(1), "code": "\n".join(lines[start + 1:i]) + "\n",
                       "line": start + 1, "run": not NOT_RUN.match(before),
                       "output": before == OUTPUT})
        i += 1
    return blocks


def runnable(path: Path) -> list[dict]:
    """The blocks that run, each with the output block that follows it (or None)."""
    blocks = code_blocks(path)
    runs = []
    for k, block in enumerate(blocks):
        if block["run"] and block["lang"] in ("python", "bash"):
            shown = blocks[k + 1] if k + 1 < len(blocks) and blocks[k + 1]["output"] else None
            runs.append(dict(block, shown=shown))
    return runs


def _words(line: str) -> list[str]:
    return line.split()


def _same(shown: list[str], printed: list[str]) -> bool:
    """A shown line ending in ``...`` stands for every printed line that starts with it
    (spaces normalised)."""
    shown_line = " ".join(shown)
    if shown_line.endswith("..."):
        return " ".join(printed).startswith(shown_line[:-3].rstrip())
    return printed == shown


def assert_shown_in(shown: dict, printed: str, where: str) -> None:
    """Each line of the page's output block (but ``...``) appears in the printed output, in
    order: the page's numbers are the command's."""
    actual = [_words(line) for line in printed.splitlines() if line.strip()]
    k = 0
    for line in shown["code"].splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        while k < len(actual) and not _same(_words(line), actual[k]):
            k += 1
        assert k < len(actual), (f"{where}: the page shows a line its command did not print "
                                 f"(or not in this order):\n  {line}\nprinted:\n{printed}")
        k += 1


def _shim(folder: Path) -> dict:
    """An environment whose ``attnextract`` (and ``python3``) run this checkout's package."""
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, line in (("attnextract", f'exec "{sys.executable}" -m attnextract "$@"'),
                       ("python3", f'exec "{sys.executable}" "$@"')):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{line}\n")
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


# pages whose blocks start several processes that import torch (seconds each)
SLOW_PAGES = {"docs/bring-your-own-model.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.slow) if str(p.relative_to(ROOT)) in SLOW_PAGES else p
    for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, tmp_path, monkeypatch, capsys):
    blocks = runnable(page)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = _shim(tmp_path)
    namespace = {"__name__": "__docs__"}
    for block in blocks:
        where = f"{page.relative_to(ROOT)}:{block['line']}"
        first = block["code"].splitlines()[0] if block["code"].strip() else ""
        if block["lang"] == "python" and TARGET_FILE.match(first):
            (tmp_path / TARGET_FILE.match(first).group(1)).write_text(block["code"])
        elif block["lang"] == "python":
            capsys.readouterr()
            exec(compile(block["code"], where, "exec"), namespace)
            if block["shown"]:
                assert_shown_in(block["shown"], capsys.readouterr().out, where)
        else:
            assert not re.search(r"\bpip3?\b.*\binstall\b", block["code"]), \
                f"{where}: an install command in a block that runs; mark it <!-- not run: ... -->"
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]],
                                  cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stderr}"
            if block["shown"]:
                assert_shown_in(block["shown"], proc.stdout, where)
    capsys.readouterr()


def test_every_output_block_follows_a_block_that_runs():
    """An output block after a block that does not run would never be checked."""
    for page in PAGES:
        blocks = code_blocks(page)
        for k, block in enumerate(blocks):
            if block["output"]:
                assert block["lang"] == "text", f"{page}:{block['line']}: an output block is ```text"
                before = blocks[k - 1] if k else None
                assert before and before["run"] and before["lang"] in ("python", "bash"), \
                    f"{page}:{block['line']}: output of a block that does not run"


def test_a_changed_number_in_an_output_block_fails():
    """The check is not vacuous: one digit changed in a shown line, or the lines swapped,
    is caught."""
    printed = "queries: 296 (recovery 272)\nerror 2.1e-14\nPASSED\n"
    assert_shown_in({"code": "queries: 296 (recovery 272)\n...\nPASSED\n"}, printed, "t")
    assert_shown_in({"code": "queries: 296 ...\n"}, printed, "t")
    assert_shown_in({"code": "queries: 296 (recovery...\n"}, printed, "t")
    for wrong in ("queries: 336 (recovery 272)\n", "PASSED\nerror 2.1e-14\n", "queries: 336 ...\n",
                  "queries: 29...\nqueries: 296...\n"):
        with pytest.raises(AssertionError):
            assert_shown_in({"code": wrong}, printed, "t")


def test_every_block_is_run_or_marked():
    """A python or bash block that is neither run nor marked would be a silent gap."""
    for page in PAGES:
        for block in code_blocks(page):
            assert block["lang"] in ("python", "bash", "text", ""), (page, block["line"])
            assert block["lang"] != "" , f"{page}:{block['line']}: give the block a language"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "https://arxiv.org/abs/2601.16873" in text and "https://arxiv.org/abs/2608.03294" in text


def test_readme_test_command_is_what_ci_runs():
    """The README's test install + run line is the one .ci/run executes."""
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("python3 -m pip install -e"))
    command = line.split("#")[0].strip()
    assert command in (ROOT / ".ci" / "run").read_text()


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference",
                                                  ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_lists_every_option_of_every_subcommand():
    import argparse

    from attnextract.cli import build_parser
    hook = _hook()
    parser = build_parser()
    text = hook.cli_reference_markdown(parser)
    subcommands = hook.subcommands(parser)
    assert set(subcommands) >= {"extract", "verify", "demo", "serve", "bench", "minilm", "twins"}
    for name, sub in subcommands.items():
        section = text.split(f"## attnextract {name}\n", 1)[1].split("\n## attnextract ", 1)[0]
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or not action.option_strings:
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            assert f"`{action.option_strings[-1]}`" in section, (name, action.option_strings)


def test_cli_reference_shows_a_default_for_every_option():
    """Every option row has a default in words (or "required"), as --help shows it."""
    text = _hook().cli_reference_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 60
    for row in rows:
        default = row.split(" | ")[1].strip()
        assert default, row
    assert "--model" in text and "models (--model):" in text      # the model table


def test_cli_reference_picks_up_a_new_option():
    """An option another module adds to the parser appears without touching the docs."""
    from attnextract.cli import build_parser
    hook = _hook()
    parser = build_parser()
    hook.subcommands(parser)["extract"].add_argument("--brand-new-option", default=7,
                                                    help="a | pipe and <angle> text")
    text = hook.cli_reference_markdown(parser)
    row = next(l for l in text.splitlines() if "`--brand-new-option`" in l)
    assert "| 7 |" in row and "a \\| pipe and &lt;angle&gt; text" in row


def test_readme_links_are_absolute_and_reach_a_page_of_the_site():
    """The README is also the package index's page, where relative links break: every link
    is absolute, and each one into the docs site names a page the site builds."""
    site = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M).group(1)
    links = re.findall(r"\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert links and all(link.startswith("https://") for link in links), links
    for link in (link for link in links if link.startswith(site)):
        page = link[len(site):].split("#")[0].rstrip("/") or "index"
        assert (ROOT / "docs" / f"{page}.md").is_file(), link


def test_single_head_cost_table_follows_the_learners_counts():
    """The single-head page's table comes from a benchmark too long to rerun here; its query
    columns are the learner's own counts (d^2 + d, plus the held-out verification the
    library sizes), so a change of either shows as drift."""
    from attnextract.report import verification_count
    page = (ROOT / "docs" / "learners" / "single-head.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \|", page, re.M)
    assert len(rows) >= 3
    for d, recovery, total in ((int(a), int(b), int(c)) for a, b, c in rows):
        floor = d * d + d
        assert recovery == floor and total == floor + verification_count(floor, floor), (d, total)


def test_multi_head_cost_table_names_the_papers_count():
    """Each cell of the multi-head page's cost table gives the multi-head paper's count
    4Hd^2 - 2H + 1 in parentheses, and the median it shows stays within it."""
    page = (ROOT / "docs" / "learners" / "multi-head.md").read_text()
    table = page.split("## What it costs", 1)[1].split("\n\n")[2]
    heads = [int(h) for h in re.findall(r"\$H = (\d+)\$", table.splitlines()[0])]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert heads and rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        d = int(cells[0])
        for H, cell in zip(heads, cells[1:]):
            median, count = map(int, re.match(r"(\d+) \((\d+)\)", cell).groups())
            assert count == 4 * H * d * d - 2 * H + 1 and median <= count, (d, H, cell)


def test_pages_hold_no_control_characters():
    """A LaTeX command written into a Python string without a raw prefix becomes a control
    character (\\t in \\times, \\f in \\frac, \\b in \\beta): the page then renders
    "imes" or "rac". Every page, the changelog included, is plain text and newlines."""
    control = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in PAGES + [ROOT / "CHANGELOG.md"]
           for i, line in enumerate(p.read_bytes().decode("utf-8").split("\n"), 1)
           if control.search(line)]
    assert not bad, bad
