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
import functools
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence, TextIO

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
    # Ray's notice that token auth is on: it is, on purpose (docs/security.md).
    r"Token authentication is enabled for this Ray cluster",
    # Ray Train V2: its placement-group watchdog (whole tracebacks when it cannot query the
    # controller as a fit ends), an internal actor's restart note, start-up steps, and every
    # rank's report of every checkpoint; pretrain prints its own lines for these.
    r"\(PlacementGroupCleaner pid=",
    r"core_worker\.cc.*PreemptionWatcher",
    r"Failed to send resource request for train-.*safe to ignore",
    r"\(TrainController pid=[^)]*\)\S* (Requesting resources|Attempting to start training worker group|- \(ip=)",
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
# final exception line. A Ray process's traceback (or Ray Train's failure report) is held until
# its block ends (another process's line, or a second of quiet): a block that tells of a full or
# read-only disk, and every block after one, is dropped, for the stage says it in one line
# (common.disk); any other block is passed on whole.
_FILTER = r"""
import os, re, select, sys
noise = re.compile("|".join(sys.argv[1:]))
prefix = re.compile(r"^(\x1b\[[0-9;]*m)?(\([^)]*pid=[0-9]+[^)]*\))(\x1b\[0m)? ?")
follow = re.compile(r"^(Traceback |\s|[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b)")
opens = re.compile(r"^(Error in training function:|Traceback \(most recent call last\)|\[FailurePolicy\])")
disk = re.compile(r"No space left on device|Read-only file system|\[errno (28|30)\]", re.I)
out = os.fdopen(1, "wb", buffering=0)
state = {"dropped": None, "owner": None, "held": [], "disk": False}

def release():
    block = b"".join(state["held"])
    state["disk"] = state["disk"] or bool(disk.search(block.decode("utf-8", "replace")))
    if not state["disk"]:
        out.write(block)
    state["owner"], state["held"] = None, []

def take(raw):
    line = raw.decode("utf-8", "replace")
    m = prefix.match(line)
    who, rest = (m.group(2), line[m.end():]) if m else (None, line)
    if state["owner"] is not None:
        if who == state["owner"]:
            state["held"].append(raw)
            return
        release()
    if state["dropped"] is not None and who == state["dropped"] and follow.match(rest):
        return
    if noise.search(line):
        state["dropped"] = who
        return
    state["dropped"] = None
    if who is not None and opens.match(rest):
        state["owner"], state["held"] = who, [raw]
        return
    out.write(raw)

pending = b""
while True:
    if state["owner"] is not None and not select.select([0], [], [], 1.0)[0]:
        release()
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    *lines, pending = (pending + chunk).split(b"\n")
    for raw in lines:
        take(raw + b"\n")
if pending:
    take(pending)
if state["owner"] is not None:
    release()
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


# -- the ingest ---------------------------------------------------------------------------------

class IngestProgress:
    """The ``prepare`` progress line: the workers' counts, a rate and an ETA.

    ``poll`` returns the counts so far (``units``, ``inputs``, ``processed``, ``written``,
    ``rejected``, ``duplicates``: :class:`pipelines.counts.Totals`), or is None where the workers
    cannot share a channel with the driver. The rate is items decoded and validated per second
    since the last look that found no work started (worker start-up excluded); the ETA is the
    items left at that rate, shown while the total is known (``inputs_total`` from the plan, else
    extrapolated from the ``units`` read) and items are left to process.
    """

    def __init__(self, line: ProgressLine, poll: Callable[[], dict[str, int]] | None, units: int,
                 inputs_total: int | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.line, self.poll = line, poll
        self.units, self.inputs_total = units, inputs_total
        self._clock = clock
        self.t0 = self._clock()
        self._first: float | None = None
        self._empty = self.t0
        self._processed = (0, 0.0)  # the last processed count and when it was first seen

    def text(self) -> str:
        now = self._clock()
        if self.poll is None:
            return f"running for {duration(now - self.t0)} (live counts need the staging folder on a local or mounted filesystem)"
        c = self.poll()
        if not c["units"]:
            self._empty = now
            return f"starting ({duration(now - self.t0)})"
        if self._first is None:
            self._first = self._empty  # the work began after the last look that found none
        if c["processed"] != self._processed[0]:
            self._processed = (c["processed"], now)
        # The rate of decoding while it lasts; it stays put while the shards are written.
        elapsed = self._processed[1] - self._first
        rate = c["processed"] / elapsed if elapsed > 0 else 0.0
        seen = f"{c['inputs']}/{self.inputs_total}" if self.inputs_total is not None else f"{c['inputs']}"
        parts = [f"{seen} inputs seen" + ("" if self.inputs_total is not None else f" ({c['units']}/{self.units} units)"),
                 f"{c['processed']} processed", f"{c['written']} written", f"{c['rejected']} quarantined",
                 f"{c['duplicates']} duplicates"]
        text = ", ".join(parts) + f"; {rate:.1f} img/s"
        total = self.inputs_total if self.inputs_total is not None else (
            c["inputs"] * self.units / c["units"] if c["units"] else None)
        if c["processed"] < (total or 0):
            text += eta_text(c["processed"], total, now - self._first)
        elif c["units"] == self.units and c["processed"] >= c["inputs"]:
            accounted = c["written"] + c["rejected"] + c["duplicates"] >= c["inputs"]
            text += "; every item accounted for, the runner is finishing" if accounted else "; writing shards"
        return text + f" ({duration(now - self.t0)} in)"

    def tick(self) -> None:
        self.line.update(self.text())

    def finish(self) -> dict[str, int] | None:
        """Write the last line: the totals the workers counted over the whole run (None without a channel)."""
        wall = self._clock() - self.t0
        if self.poll is None:
            self.line.close(f"done in {duration(wall)}")
            return None
        c = dict(self.poll())
        self.line.close(
            f"done in {duration(wall)}: {c['inputs']} inputs, {c['written']} written, {c['rejected']} quarantined, "
            f"{c['duplicates']} duplicates; {c['inputs'] / wall if wall > 0 else 0.0:.1f} img/s overall")
        return c


# -- a Ray Tune sweep -----------------------------------------------------------------------------

def _lookup(config: dict, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class _TrialLines:
    """Trial lines for sweep ``name``: trials labelled by config ``keys`` (dotted for nested), scored by ``metric``.

    Tune's own output (experiment boxes, trial tables, the TensorBoard hint) is off
    (``verbose=0``); this prints, on the driver, a line when a trial finishes or fails (trial,
    state, its metric) and a status line in between with the trials per state and the latest
    result or start. Saved with the sweep's state so that a resumed sweep prints the same; the
    console stream is opened again after a restore, never pickled. Used as :data:`TrialLines`,
    the ``ray.tune.Callback`` built on it.
    """

    def __init__(self, name: str, keys: Sequence[str], metric: str) -> None:
        self.name, self.keys, self.metric = name, tuple(keys), metric
        self._line: ProgressLine | None = None

    def __getstate__(self) -> dict:
        return {"name": self.name, "keys": self.keys, "metric": self.metric, "_line": None}

    @property
    def line(self) -> ProgressLine:
        if self._line is None:
            self._line = ProgressLine(self.name)
        return self._line

    def label(self, trial) -> str:
        return " ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(_lookup(trial.config, k))}" for k in self.keys)

    def score(self, result: dict | None) -> str:
        result = result or {}
        parts = [f"step {result['step']}"] if "step" in result else []
        if self.metric in result:
            parts.append(f"{self.metric} {result[self.metric]:.4f}")
        return ", ".join(parts) or "no result yet"

    def _states(self, trials, starting=None) -> str:
        counts: dict[str, int] = {}
        for t in trials:
            status = "RUNNING" if t is starting else t.status  # Tune calls on_trial_start just before
            counts[status] = counts.get(status, 0) + 1
        order = ("TERMINATED", "RUNNING", "PENDING", "PAUSED", "ERROR")
        words = {"TERMINATED": "done", "RUNNING": "running", "PENDING": "pending", "PAUSED": "paused", "ERROR": "failed"}
        return ", ".join(f"{counts[s]} {words[s]}" for s in order if counts.get(s)) + f" of {len(trials)}"

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.line.update(f"{self._states(trials, trial)} | {self.label(trial)}: started")

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.line.update(f"{self._states(trials)} | {self.label(trial)}: {self.score(result)}")

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: TERMINATED, {self.score(trial.last_result)}")

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: failed, retrying ({trial.num_failures} failure(s) so far)")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: ERROR after {trial.num_failures} failure(s); "
                        f"see {trial.error_file or 'its log'}")

    def on_experiment_end(self, trials, **info) -> None:
        self.line.close(self._states(trials))


@functools.cache
def trial_lines_class() -> type:
    """:class:`_TrialLines` as a ``ray.tune.Callback``, built on first use so that this module does not import Ray.

    Named ``common.progress.TrialLines`` so that a sweep's pickled state finds it again.
    """
    from ray import tune

    return type("TrialLines", (_TrialLines, tune.Callback), {"__module__": __name__, "__qualname__": "TrialLines",
                                                             "__doc__": _TrialLines.__doc__})


def __getattr__(name: str) -> Any:
    if name == "TrialLines":
        return trial_lines_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            # The loop counts epochs from 0; the console counts them as --epochs does, from 1.
            self.line.above(f"epoch {row['epoch'] + 1} to step {row['step']}/{row['total']}: train loss "
                            f"{row['train_loss']:.4f} accuracy {row['train_accuracy']:.3f}{held}; "
                            f"{row['images_per_second']:.1f} img/s, checkpoint saved")

    def finish(self) -> None:
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - the run's own error, if any, is the one to show
            pass
        self.line.close()
