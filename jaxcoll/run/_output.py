"""What a worker's output says: the launcher's line pump and how it names a failure's cause.

Each worker's stdout and stderr are copied line by line with its ``[k]`` prefix (gloo's
per-rank connection reports dropped); every stderr line is read for why the process may stop
(:class:`Proc`), so that the launcher names the root cause of a failed job, not a process that
failed because of it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO

# A line that says why a process stopped: ``RuntimeError: ...``, ``jaxcoll: ...``,
# ``dist.all_reduce: ...``, ``init: ...`` (a name, a colon, a message), not a stack frame.
_CAUSE = re.compile(r"^[A-Za-z_][\w.]*: \S")
# jaxcoll's own last words (watchdog, SIGTERM): the process exits right after this line, so it
# counts as failing from here (a peer may die of it sooner, e.g. from a closed connection).
_ANNOUNCE = re.compile(r"^jaxcoll: process \d+ .*[Ee]xiting with code \d+")
# A failure caused by another process's: jaxcoll saw another process fail or leave, the
# peers' transport broke (gloo), or JAX lost the job's coordination service. Never named as
# the cause while a failure of another kind is there.
_FOLLOW_ON = re.compile(
    r"stops: process \d+ failed|exited while this one waits|[Cc]onnection (reset|closed) by "
    r"peer|Socket closed|Broken pipe|JAX distributed service detected fatal errors"
)
# Lines that never say why a process stopped: C++ log lines (``E1123 16:40:06.048386 ...``),
# traceback frames, blank lines.
_NOT_A_CAUSE = re.compile(r"^([EWIF]\d{4} |\s|Traceback|$|jaxcoll: process \d+ wrote its flight)")
# Gloo's connection report: one line per local rank, written by several threads at once, so
# fragments of two can share a line ("[Gloo] Rank 3[Gloo] Rank 2 is connected to  is connected
# to 77 peer ranks. ..."). The launcher drops these lines.
_GLOO_PARTS = re.compile(
    r"\[Gloo\] Rank|\[Gloo\]|is connected to|Expected number of connected peer ranks is :|"
    r"peer ranks|\d+"
)


def gloo_report(line: str) -> bool:
    """True for a line made only of (fragments of) gloo's connection report."""
    return ("[Gloo]" in line or "peer ranks" in line) and not _GLOO_PARTS.sub("", line).strip(
        " .:\n"
    )


def pump(
    stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock, proc: Proc | None = None
) -> None:
    """Copy ``stream`` line by line to ``out``, each line prefixed; remember causes."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        if gloo_report(line):
            continue
        if proc is not None:
            proc.note(line.strip())
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


@dataclass
class Proc:
    index: int
    popen: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    exited_at: float | None = None  # monotonic time the reaper saw the exit
    cause: str | None = None  # the last "Name: message" line it wrote to stderr
    last: str | None = None  # the last line it wrote to stderr that may say why it stopped
    announced_at: float | None = None  # when it said it fails (see note), if it did
    follow_on: bool = False  # it reported another process's failure (see _FOLLOW_ON)
    traceback: bool = False  # inside a Python traceback it is printing

    def note(self, line: str) -> None:
        """Remember what a line of stderr says about why this process stops."""
        if _FOLLOW_ON.search(line):
            self.follow_on = True
        if line.startswith("Traceback"):
            self.traceback = True
        if _NOT_A_CAUSE.match(line):
            return
        self.last = line[:400]
        if _CAUSE.match(line):
            self.cause = line[:400]
            # jaxcoll's exit line, or the last line of a traceback (jaxcoll's fail-fast hook
            # ends the process right after an uncaught error's): it fails from here.
            if self.announced_at is None and (self.traceback or _ANNOUNCE.match(line)):
                self.announced_at = time.monotonic()
            self.traceback = False

    def why(self) -> str | None:
        """Its cause line, else the last line that may say why (``SystemExit("...")``)."""
        return self.cause or self.last

    def failed_at(self) -> float:
        return min(t for t in (self.exited_at, self.announced_at) if t is not None)

    def reap(self) -> None:
        """Wait for the process in a thread, so exits are ordered by when they happened."""
        self.popen.wait()
        self.exited_at = time.monotonic()


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL``, from a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def because(proc: Proc) -> str:
    why = proc.why()
    return f": {why.rstrip('.')}" if why else ""
