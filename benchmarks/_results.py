"""The one results file of a benchmark script: benchmarks/results/<script stem>.md.

Every script in benchmarks/ writes its latest run there and nowhere else (``--out``
overrides the path): a header saying how and where it ran (the command line, the UTC
date, the CPU, the load average, the Python and numpy versions and the BLAS threads),
then the script's own tables. Earlier runs live in git's history.

    parser = argparse.ArgumentParser(...)
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as run:    # the header's clock starts here
        ...
        run.add(markdown_table)                      # text for the file (Markdown)

``Run.capture()`` instead keeps everything the script prints (a fenced block), for
scripts whose report is their printed output. A script of several independent sections
(``bench_http.py memory``) passes ``section=``: its run replaces that section of the file
and keeps the others, each with its own header.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SECTION_MARK = "<!-- section: "
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def default_path(script: str | os.PathLike) -> Path:
    """benchmarks/results/<script stem>.md."""
    return RESULTS / (Path(script).stem + ".md")


def add_out_option(parser, script: str | os.PathLike) -> None:
    """``--out FILE``: where the results go (default benchmarks/results/<stem>.md)."""
    parser.add_argument("--out", default=str(default_path(script)), metavar="FILE.md",
                        help="the results file (default: %(default)s)")


def out_from_argv(script: str | os.PathLike, argv: list[str] | None = None) -> Path:
    """The ``--out`` of a command line (the default path without one), for a script whose
    ``main(argv)`` is also called by the tests, which must not write the results file."""
    parser = argparse.ArgumentParser(add_help=False)
    add_out_option(parser, script)
    return Path(parser.parse_known_args(sys.argv[1:] if argv is None else argv)[0].out)


def command_line(script: str | os.PathLike, argv: list[str] | None = None) -> str:
    """The command that ran the script, as a user would type it from the repository."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        shown = Path(script).resolve().relative_to(RESULTS.parents[1])
    except ValueError:
        shown = Path(script)
    blas = [f"{v}={os.environ[v]}" for v in BLAS_VARIABLES if v in os.environ]
    return " ".join(blas + ["python", shlex.quote(str(shown))] + [shlex.quote(a) for a in argv])


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_threads() -> str:
    """The BLAS thread count numpy's BLAS uses (threadpoolctl when installed), and the
    environment variables that pin it."""
    pinned = ", ".join(f"{v}={os.environ[v]}" for v in BLAS_VARIABLES if v in os.environ)
    try:
        from threadpoolctl import threadpool_info  # optional: the live pool sizes
        pools = sorted({f"{p.get('internal_api')} {p.get('num_threads')}" for p in threadpool_info()
                        if p.get("user_api") == "blas"})
    except ImportError:
        pools = []
    return "; ".join(filter(None, [", ".join(pools), pinned or "not pinned"]))


def numpy_version() -> str:
    """The version of the numpy the script loaded (not imported here: a script may set
    its BLAS threads before numpy loads)."""
    numpy = sys.modules.get("numpy")
    return numpy.__version__ if numpy is not None else "not loaded"


def load() -> str:
    """The 1, 5 and 15-minute load averages."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def header(command: str, started: float, seconds: float, load_start: str,
           load_end: str) -> str:
    """The Markdown lines heading a results file."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    return "\n".join([
        f"- command: `{command}`",
        f"- date: {date}, {seconds:.0f} s wall",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical cores, {platform.system()} "
        f"{platform.machine()}",
        f"- load average (1, 5, 15 min): {load_start} at the start, {load_end} at the end",
        f"- Python {platform.python_version()}, numpy {numpy_version()}, "
        f"BLAS threads: {blas_threads()}",
    ])


class _Tee(io.TextIOBase):
    """A stdout that also keeps what is written."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text):
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


class Run:
    """One run of a script, written to its results file when the ``with`` block ends
    without an error (a failed run leaves the previous results in place)."""

    def __init__(self, script: str | os.PathLike, out: str | os.PathLike | None = None,
                 title: str | None = None, argv: list[str] | None = None,
                 section: str | None = None):
        self.script, self.out = Path(script), Path(out) if out else default_path(script)
        self.section = section
        self.title = title or self.script.stem
        self.command = command_line(script, argv)
        self.parts: list[str] = []
        self._tee: _Tee | None = None

    def __enter__(self) -> "Run":
        self.started, self.clock, self.load_start = time.time(), time.perf_counter(), load()
        return self

    def add(self, markdown: str) -> None:
        """Text for the results file, after the header (Markdown)."""
        self.parts.append(markdown.strip("\n"))

    def capture(self, markdown: bool = False) -> None:
        """Keep everything printed from here on, written at the end as a fenced block
        (``markdown``: as it is, for scripts that print Markdown tables)."""
        self._fenced = not markdown
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee

    def __exit__(self, kind, error, trace) -> None:
        if self._tee is not None:
            sys.stdout = self._tee.stream
            printed = self._tee.kept.getvalue().strip("\n")
            if printed:
                self.parts.append("```\n" + printed + "\n```" if self._fenced else printed)
        if kind is None:
            self.save()

    def save(self) -> None:
        """Write the results file now (a long script may save after every row, so a run
        stopped early keeps what it measured; the ``with`` block's end saves again)."""
        text = header(self.command, self.started, time.perf_counter() - self.clock,
                      self.load_start, load())
        body = f"{text}\n\n" + "\n\n".join(self.parts) + "\n"
        if self.section is not None:
            body = self._merged(body)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(f"# {self.title}\n\n{body}")
        print(f"wrote {self.out}", file=sys.stderr)

    def _merged(self, body: str) -> str:
        """This run's section in place of its earlier run, the other sections kept (in
        name order), each headed ``## NAME``."""
        sections = {}
        if self.out.exists():
            for block in self.out.read_text().split(SECTION_MARK)[1:]:
                name, _, text = block.partition("\n")
                sections[name.replace("-->", "").strip()] = text.strip("\n") + "\n"
        sections[self.section] = f"## {self.section}\n\n{body}"
        return "\n".join(f"{SECTION_MARK}{name} -->\n{sections[name]}"
                         for name in sorted(sections))
