"""Ctrl-C while the ``attnextract`` command starts: one line, not a traceback.

The command's first second or two go to imports (numpy, scipy, the learners). A
KeyboardInterrupt there would surface as a traceback from deep inside an import, before
:func:`attnextract.cli.main` (which turns Ctrl-C into one line) runs. When the process is
the ``attnextract`` command (the installed script or ``python -m attnextract``),
:func:`quiet_interrupts_while_starting` makes SIGINT print one line and end the process
(exit 130) until :func:`interrupts_as_usual` hands Ctrl-C back to Python; importing this
module does that (``attnextract/__init__.py`` imports it first). Imported as a library,
nothing changes. Standard library only: this runs before anything else loads.
"""

from __future__ import annotations

import os
import signal
import sys
from itertools import pairwise

INTERRUPTED = b"attnextract: interrupted while starting; nothing was sent\n"


def started_as_program() -> bool:
    """Whether this process is the ``attnextract`` command: the installed script, or
    ``python -m attnextract`` (whose package loads while ``sys.argv[0]`` is still "-m")."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    if name.lower() in ("attnextract", "attnextract.exe", "attnextract-script.py"):
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == "attnextract" for a, b in pairwise(argv))


def _interrupted(signum, frame) -> None:
    os.write(2, INTERRUPTED)
    os._exit(130)                       # no interpreter shutdown: the imports are half done


def quiet_interrupts_while_starting() -> None:
    """Ctrl-C ends the command with one line until :func:`interrupts_as_usual`."""
    if started_as_program() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _interrupted)
        except ValueError:              # not the main thread: leave Python's handler
            pass


def interrupts_as_usual() -> None:
    """Ctrl-C raises KeyboardInterrupt again (the command's own handling takes over)."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


quiet_interrupts_while_starting()
