"""The README's and the docs' code blocks run, as a reader would run them.

Every ```python and ```bash block of README.md and docs/ is executed, in order, in a
fresh folder per page: the Python blocks of a page share one namespace (like a
notebook), a Python block whose first line is ``# NAME.py`` is written to that file
instead (a target file used by the blocks after it), and bash blocks run with
``attnextract`` on the PATH. A block that must not run (it installs packages, starts a
server or needs a remote API) is preceded by the line ``<!-- not run: REASON -->``.
```text blocks (command synopses with placeholders) are not run.
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
                       "line": start + 1, "run": not NOT_RUN.match(before)})
        i += 1
    return blocks


def runnable(path: Path) -> list[dict]:
    return [b for b in code_blocks(path) if b["run"] and b["lang"] in ("python", "bash")]


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
            exec(compile(block["code"], where, "exec"), namespace)
        else:
            assert not re.search(r"\bpip3?\b.*\binstall\b", block["code"]), \
                f"{where}: an install command in a block that runs; mark it <!-- not run: ... -->"
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]],
                                  cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stderr}"
    capsys.readouterr()


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
    from attnextract.cli import build_parser
    import argparse
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
