"""What a long job shows on the console: progress lines, and nothing that tells the user nothing.

Two pieces, both set up once per entrypoint by :func:`common.cli.run_job`:

- **The console.** :func:`quiet_console` sends file descriptor 2 (this process and every
  child it starts: Beam workers, Ray's C++ core worker) through a small filter process that
  drops lines matching :data:`NOISE` and passes everything else on. A filter process, not a
  thread, so that a crash's last words still get through. ``--verbose`` leaves stderr alone.
- **Progress lines.** :class:`ProgressLine` writes status text to the real console: on a
  terminal one line redrawn in place at most once a second, elsewhere (a log file, ``ray job
  logs``) a plain line every ``--progress-every`` seconds. Numbers in these lines are counts
  the caller measured; only the ETA is an estimate (:func:`eta`).

Settings travel in environment variables so that worker processes and library calls see
the entrypoint's flags without a parameter at every layer.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

VERBOSE_ENV = "VITSCALE_VERBOSE"
PROGRESS_ENV = "VITSCALE_PROGRESS_EVERY"
#: Seconds between plain progress lines when stderr is not a terminal.
DEFAULT_EVERY = 15.0
#: Seconds between redraws of the progress line on a terminal.
TTY_EVERY = 1.0

#: Console lines that say nothing a user of an embedded run can act on (regular expressions,
#: searched in each line). Real warnings and errors pass; ``--verbose`` shows these too.
NOISE = (
    # Beam: optional cloud clients that are not installed (driver and each DirectRunner worker).
    r"Failed to import (GCS|S3|Hadoop|BlobStorage)FileSystem; loading of this filesystem will be skipped",
    r"apitools not found, and bigquery client libraries are not available",
    r"^INFO:__main__:Logging handler created\.",
    # MLflow creating a fresh local store.
    r"INFO mlflow\.store\.db\.utils: (Creating initial MLflow database tables|Updating database tables)",
    r"^INFO  \[alembic\.runtime\.migration\]",
    # Ray's notice that token auth is on: it is, on purpose (README, "Security").
    r"Token authentication is enabled for this Ray cluster",
    # Ray Train V2: its placement-group watchdog (whole tracebacks when it cannot query the
    # controller as a fit ends), an internal actor's restart note, start-up steps, and every
    # rank's report of every checkpoint; pretrain prints its own lines for these.
    r"\(PlacementGroupCleaner pid=",
    r"core_worker\.cc.*PreemptionWatcher",
    r"Failed to send resource request for train-.*safe to ignore",
    r"\(TrainController pid=[^)]*\)\S* (Requesting resources|- \(ip=)",
    r"\(RayTrainWorker pid=[^)]*\)\S* (Setting up process group|Moving model to device|Wrapping provided model"
    r"|Reporting training result)",
    # Every report with a checkpoint, from Train workers and Tune trials alike.
    r"pid=[^)]*\)\S* Checkpoint successfully created at: ",
    r"TrainingReport\(",
    # MLflow's system-metrics monitor announcing itself (the metrics land in the run).
    r"INFO mlflow\.system_metrics\.system_metrics_monitor: ",
    # Ray Tune's pointer to TensorBoard logs this project does not write.
    r"To visualize your results with TensorBoard",
    r"tensorboard --logdir",
)

# A dropped line takes the traceback that follows it along: the lines after it with the
# same Ray prefix ("(TrainController pid=1)") that are a traceback's header, frames or
# final exception line.
_FILTER = r"""
import os, re, sys
noise = re.compile("|".join(sys.argv[1:]))
prefix = re.compile(r"^(\x1b\[[0-9;]*m)?(\([^)]*pid=[0-9]+[^)]*\))(\x1b\[0m)? ?")
follow = re.compile(r"^(Traceback |\s|[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b)")
out = os.fdopen(1, "wb", buffering=0)
dropped = None
for raw in sys.stdin.buffer:
    line = raw.decode("utf-8", "replace")
    m = prefix.match(line)
    if dropped is not None and m is not None and m.group(2) == dropped and follow.match(line[m.end():]):
        continue
    if noise.search(line):
        dropped = m.group(2) if m is not None else None
        continue
    dropped = None
    out.write(raw)
"""

_state: dict = {"console": None, "tty": None}
_lock = threading.Lock()


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def progress_every() -> float:
    """Seconds between plain progress lines (``--progress-every``); 0 turns progress off."""
    try:
        return max(0.0, float(os.environ.get(PROGRESS_ENV, DEFAULT_EVERY)))
    except ValueError:
        return DEFAULT_EVERY


def configure(*, verbose: bool | None = None, every: float | None = None) -> None:
    """Record the console flags for this process and the processes it starts."""
    if verbose is not None:
        os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    if every is not None:
        os.environ[PROGRESS_ENV] = repr(float(every))


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No progress lines for the duration (short steps of a longer job, which reports them its own way)."""
    before = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = before


def console() -> tuple[TextIO, bool]:
    """The stream progress goes to and whether it is a terminal: the real stderr, filter or not."""
    if _state["console"] is not None:
        return _state["console"], _state["tty"]
    return sys.stderr, _isatty(sys.stderr)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def quiet_console(patterns: tuple[str, ...] = NOISE) -> bool:
    """Filter this process's fd 2 (inherited by its children) through :data:`NOISE`; False if not done.

    Idempotent; a no-op with ``--verbose``. Progress keeps the unfiltered console (:func:`console`).
    """
    with _lock:
        if _state["console"] is not None or verbose():
            return False
        sys.stderr.flush()
        tty = os.isatty(2)
        real = os.dup(2)
        read, write = os.pipe()
        proc = subprocess.Popen([sys.executable, "-S", "-c", _FILTER, *patterns], stdin=read, stdout=real,
                                stderr=real, close_fds=True, start_new_session=True)
        os.close(read)
        os.dup2(write, 2)
        os.close(write)
        os.set_inheritable(real, False)
        _state["console"] = os.fdopen(real, "w", buffering=1, encoding="utf-8", errors="replace")
        _state["tty"] = tty
        _state["filter"] = proc
        atexit.register(_drain, real, proc)
        return True


def _drain(real: int, proc: subprocess.Popen) -> None:
    """At exit: hand fd 2 back and give the filter a moment to pass on what is still in the pipe."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(real, 2)  # closes this process's end of the pipe; children that still hold it end soon
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        pass


# -- formatting ---------------------------------------------------------------------------------

def duration(seconds: float) -> str:
    """``3723`` -> ``1h02m``, ``185`` -> ``3m05s``, ``42.3`` -> ``42s``."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def eta(done: float, total: float | None, elapsed: float) -> float | None:
    """Seconds left at the average rate so far, or None while there is nothing to go on."""
    if not total or done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - done) * elapsed / done)


def eta_text(done: float, total: float | None, elapsed: float) -> str:
    left = eta(done, total, elapsed)
    return "" if left is None else f", ETA {duration(left)}"


# -- the line -----------------------------------------------------------------------------------

class ProgressLine:
    """Status text for a job, drawn in place on a terminal and as plain lines elsewhere.

    ``update(text)`` may be called as often as wanted; it writes only when the interval has
    passed (``force`` writes now). ``close(text)`` writes the final line and ends the in-place
    line so later output starts on a fresh one. ``every`` defaults to ``--progress-every``;
    0 disables the line (``close`` text included).
    """

    def __init__(self, prefix: str, *, stream: TextIO | None = None, every: float | None = None,
                 tty: bool | None = None) -> None:
        default_stream, default_tty = console()
        self.stream = stream or default_stream
        self.tty = (_isatty(self.stream) if stream is not None else default_tty) if tty is None else tty
        self.every = progress_every() if every is None else every
        self.prefix = prefix
        self.lines: list[str] = []  # every line written, for tests and summaries
        self._last = float("-inf")
        self._width = 0

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def _interval(self) -> float:
        return min(TTY_EVERY, self.every) if self.tty else self.every

    def update(self, text: str, *, force: bool = False) -> bool:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self._interval()):
            return False
        self._last = now
        self._write(f"{self.prefix}: {text}", final=False)
        return True

    def close(self, text: str | None = None) -> None:
        if not self.enabled:
            return
        if text is not None:
            self._write(f"{self.prefix}: {text}", final=True)
        elif self.tty and self._width:
            self._emit("\n")
        self._width = 0

    def _write(self, line: str, *, final: bool) -> None:
        self.lines.append(line)
        if self.tty:
            pad = " " * max(0, self._width - len(line))
            self._emit("\r" + line + pad + ("\n" if final else ""))
            self._width = 0 if final else len(line)
        else:
            self._emit(line + "\n")

    def _emit(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed console must not fail the job

    def above(self, line: str) -> None:
        """Print a permanent line (a trial that finished, say) without breaking the in-place line."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self._emit("\r" + " " * self._width + "\r")
            self._width = 0
            self._last = float("-inf")  # redraw the status on the next update
        self.lines.append(f"{self.prefix}: {line}")
        self._emit(f"{self.prefix}: {line}\n")


class Ticker:
    """Calls ``fn`` every ``period`` seconds on a daemon thread between ``start()`` and ``stop()``.

    For progress that must be polled (a side channel, an actor) while the main thread is
    blocked in a runner's ``run()`` or ``fit()``. An exception in ``fn`` stops the ticking,
    never the job.
    """

    def __init__(self, fn: Callable[[], None], period: float) -> None:
        self._fn, self._period = fn, max(0.05, period)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._fn()
            except Exception:  # noqa: BLE001 - progress is best effort; the job's own result is not
                return

    def __enter__(self) -> "Ticker":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- pre-training ------------------------------------------------------------------------------

class StepProgress:
    """The driver's console lines from what rank 0 posts to a :class:`~training.ray_utils.ProgressBoard`.

    A status line per log interval (step out of total, the interval's mean loss, images per
    second over all workers, ETA at the pace since the first interval this run saw) and a
    permanent line per report (epoch end or checkpoint): what Ray Train's per-rank
    ``TrainingReport`` lines said, once.
    """

    def __init__(self, line: ProgressLine, board) -> None:
        self.line, self.board = line, board
        self._anchor: tuple[float, int] | None = None
        self._reported = -1  # the step of the last report shown

    def tick(self) -> None:
        import ray

        latest = None  # of the step rows since the last tick, only the newest is worth a line
        for row in ray.get(self.board.take.remote(), timeout=30):
            if row["kind"] == "step":
                latest = row
            else:
                self.show(row)
        if latest is not None and latest["step"] > self._reported:
            self.show(latest)

    def show(self, row: dict) -> None:
        if row["kind"] == "step":
            step, end = row["step"], row["end"]
            if self._anchor is None:
                self._anchor = (row["time"], step)
            t0, s0 = self._anchor
            self.line.update(f"step {step}/{row['total']} ({100 * step // max(1, row['total'])}%), "
                             f"loss {row['loss']:.4f}, {row['images_per_second']:.1f} img/s"
                             + eta_text(step - s0, end - s0, row["time"] - t0))
        else:
            self._reported = row["step"]
            held = (f", held-out loss {row['holdout_loss']:.4f} accuracy {row['holdout_accuracy']:.3f}"
                    if "holdout_accuracy" in row else "")
            self.line.above(f"epoch {row['epoch']} to step {row['step']}/{row['total']}: train loss "
                            f"{row['train_loss']:.4f} accuracy {row['train_accuracy']:.3f}{held}; "
                            f"{row['images_per_second']:.1f} img/s, checkpoint saved")

    def finish(self) -> None:
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - the run's own error, if any, is the one to show
            pass
        self.line.close()
