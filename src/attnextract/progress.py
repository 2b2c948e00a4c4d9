"""Progress, logging and thread control for long runs (the CLI's, and a notebook's).

- :class:`ProgressBar`: an :class:`~attnextract.oracle.Oracle` ``progress`` callback
  drawn with tqdm (elapsed time, rate, ETA). Its total never moves backwards while a
  forecast stands, and ends at the queries sent (a run that needed fewer); when
  a learner's query total is not known up front (adaptive low-rank) it counts
  queries without a total and shows the learner's phase ("columns 37/384, rank so
  far 12", sent through :meth:`Oracle.phase`). Without a terminal it writes one
  plain line every few seconds instead of redrawing a bar.
- :func:`configure_logging`: the ``attnextract`` loggers (every module logs its
  stages to ``attnextract.<module>``) on stderr, at a level from ``-v``/``-vv``
  or ``--log-level``; lines do not tear a bar that is being drawn.
- :func:`thread_limits`: BLAS/OpenMP threads of this process (threadpoolctl). One
  thread is the CLI's default: on a shared machine, many processes each running
  as many BLAS threads as there are cores oversubscribe it (10x slower measured).
"""

from __future__ import annotations

import logging
import sys
import time

LINE_INTERVAL = 5.0      # seconds between progress lines when stderr is not a terminal


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """Progress of an extraction in queries, for ``Oracle(progress=...)``.

    Parameters
    ----------
    label : str
        Shown before the bar ("extracting").
    enabled : bool, optional
        True: draw a bar on ``stream``; False: nothing; None (default): a bar on a
        terminal, otherwise one line every ``interval`` seconds (none for short runs).
    stream : file, optional
        Default ``sys.stderr``.
    interval : float
        Seconds between lines without a terminal.
    """

    def __init__(self, label: str, enabled: bool | None = None, stream=None,
                 interval: float = LINE_INTERVAL):
        self.stream = stream or sys.stderr
        self.label, self.interval = label, interval
        self.mode = ("off" if enabled is False else
                     "bar" if enabled or _isatty(self.stream) else "lines")
        self.enabled = self.mode != "off"
        self.total: int | None = None       # None: not known (yet, or any more)
        self.done, self.text = 0, ""
        self.start = time.perf_counter()
        self.last_line = self.start
        self.lines = 0
        self.bar = None
        if self.mode == "bar":
            import shutil

            from tqdm import tqdm
            # a terminal that reports no size (some ptys) would get no bar at all
            size = shutil.get_terminal_size((100, 24))
            self.bar = tqdm(total=None, desc=label, unit="q", file=self.stream,
                            ncols=size.columns, nrows=max(size.lines, 2), mininterval=0.1,
                            leave=True)

    # -- Oracle callbacks ----------------------------------------------------------
    def __call__(self, done: int, total: int) -> None:
        """``done`` queries sent of ``total`` announced (``total == done``: no forecast left)."""
        if total > done:                       # a forecast: the total only grows
            self.total = max(total, self.total or 0)
        elif self.total is not None and done > self.total:
            self.total = None                  # past every forecast: count without a total
        self.done = done
        self._draw()

    def finish(self, done: int) -> None:
        """The run is over after ``done`` queries: the total becomes ``done`` (a forecast
        sized for more than the learner needed is withdrawn)."""
        self.done, self.total = done, done
        self._draw(force=True)

    def phase(self, text: str) -> None:
        """What the learner is doing now, shown beside the count."""
        self.text = text
        self._draw(force=self.bar is not None and self.bar.n == 0)

    def fitting(self, iteration: int, fit: float) -> None:
        """Solver progress (ROP fit): iteration and relative measurement residual."""
        self.phase(f"fitting: iteration {iteration}, relative residual {fit:.1e}")

    def close(self) -> None:
        if self.bar is not None:
            self._draw(force=True)
            self.bar.close()
        elif self.mode == "lines" and self.lines:
            self._line()                      # the last state, so the log shows the end

    # -- drawing --------------------------------------------------------------------
    def _draw(self, force: bool = False) -> None:
        if self.bar is not None:
            bar = self.bar
            if bar.total != self.total:
                bar.total = self.total
            bar.set_postfix_str(self.text, refresh=False)
            if self.done != bar.n:
                bar.update(self.done - bar.n)     # throttled by tqdm's mininterval
            if force:
                bar.refresh()
        elif self.mode == "lines":
            now = time.perf_counter()
            if now - self.last_line >= self.interval:
                self.last_line = now
                self._line()

    def _line(self) -> None:
        from tqdm import tqdm
        elapsed = time.perf_counter() - self.start
        if self.total:
            fmt = "{desc}: {n_fmt}/{total_fmt} queries [{elapsed}<{remaining}, {rate_fmt}]{postfix}"
        else:
            fmt = "{desc}: {n_fmt} queries [{elapsed}, {rate_fmt}]{postfix}"
        text = tqdm.format_meter(self.done, self.total, elapsed, prefix=self.label, unit="q",
                                 bar_format=fmt, postfix=self.text or None)
        self.stream.write(text.replace(", ]", "]") + "\n")
        self.stream.flush()
        self.lines += 1


class _TqdmHandler(logging.StreamHandler):
    """Log lines written through tqdm.write, so that a bar being drawn is not torn."""

    def emit(self, record):
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=self.stream)
        except Exception:                      # logging must never break a run
            self.handleError(record)


def configure_logging(verbosity: int = 0, level: str | None = None, stream=None) -> None:
    """Send the ``attnextract`` loggers to stderr: WARNING, -v INFO, -vv DEBUG, or ``level``."""
    logger = logging.getLogger("attnextract")
    chosen = (level.upper() if level else
              "DEBUG" if verbosity >= 2 else "INFO" if verbosity == 1 else "WARNING")
    logger.setLevel(chosen)
    for handler in list(logger.handlers):
        if isinstance(handler, _TqdmHandler):
            logger.removeHandler(handler)
    handler = _TqdmHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False


def thread_limits(threads: int | None):
    """Context manager limiting BLAS/OpenMP threads to ``threads`` (None: unchanged)."""
    if threads is None:
        from contextlib import nullcontext
        return nullcontext()
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=int(threads))
