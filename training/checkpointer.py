"""The pre-training checkpoint: what it holds, when one is due, and whether a run may continue from it.

A checkpoint folder holds :data:`TRAIN_STATE` (model, optimiser, step, data position, every
rank's RNG states and the config, in :data:`STATE_FORMAT`) and ``vitcore.checkpoint.MODEL_FILE``, the plain
vitcore model; with few-shot scoring, also the best step's model (:mod:`training.best`). With the RNG states and the data position restored, a worker group restarted
after a failure, or the same run submitted again, continues without replaying or skipping a batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

from common.config import ConfigError, changed_fields, free_on_resume, off_values

TRAIN_STATE = "train_state.pt"
STATE_FORMAT = "vitscale-pretrain/2"
# Written beside the state: read before Ray starts (the config check, the newest complete checkpoint).
RECORD = "checkpoint.json"


def check_resumable(saved: dict, current: dict, free: Iterable[str], absent: dict | None = None) -> None:
    """Refuse to continue a checkpoint under a different recipe, which would silently mix two runs;
    ``free`` names the fields a resume may change (:func:`common.config.free_on_resume`), ``absent``
    what a field the checkpoint predates reads as (:func:`common.config.off_values`)."""
    changed = changed_fields(saved, current, free, absent)
    if changed:
        diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in changed)
        raise ConfigError(
            f"run_name {current.get('run_name')!r}: cannot resume a run trained with a different config ({diffs}); "
            "re-run with the same flags to resume it, pass --overwrite to start it again, or use another --output"
        )


def read_record(folder: Path) -> dict | None:
    """The record of a complete checkpoint folder; None when a file it lists is missing or of
    another size, or the record itself is missing or torn (a write or upload cut short)."""
    try:
        record = json.loads((folder / RECORD).read_text())
        files = record["files"]
        if all((folder / name).stat().st_size == size for name, size in files.items()):
            return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_record(folder: Path, names: Iterable[str], step: int, **extra: Any) -> None:
    """The record of the checkpoint in ``folder``: its ``step``, and the size and sha256 of each
    file in ``names``, with ``extra`` fields; written last, so a record means a whole folder."""
    names = list(names)
    files = {name: (folder / name).stat().st_size for name in names}
    digests = {name: sha256_of(folder / name) for name in names}
    (folder / RECORD).write_text(json.dumps({"step": step, "files": files, "sha256": digests, **extra}, default=str))


def corrupt_file(folder: Path, record: dict) -> str | None:
    """The first file of a complete checkpoint whose bytes differ from the sha256 its record holds
    (a disk or copy error the size check cannot see); None when all match, or the record, written
    before checkpoints carried digests, has none."""
    for name, digest in (record.get("sha256") or {}).items():
        try:
            if sha256_of(folder / name) != digest:
                return name
        except OSError:
            return name
    return None


def _folders(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir()) if run_dir.is_dir() else []


def newest_checkpoint(run_dir: Path) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint folder in ``run_dir`` (a local Ray Train run folder) and its
    record, by step (then name); (None, None) when it has none."""
    complete = [(rec["step"], p.name, p, rec) for p in _folders(run_dir) if (rec := read_record(p)) is not None]
    newest = max(complete, key=lambda c: (c[0], c[1]), default=None)
    return (newest[2], newest[3]) if newest else (None, None)


def newest_verified(run_dir: Path) -> tuple[Path | None, dict | None, list[Path]]:
    """The newest complete checkpoint whose files match their sha256, its record, and the newer
    complete ones that did not match, newest first; (None, None, bad) when none matches."""
    complete = [(rec["step"], p.name, p, rec) for p in _folders(run_dir) if (rec := read_record(p)) is not None]
    bad = []
    for _, _, folder, record in sorted(complete, key=lambda c: (c[0], c[1]), reverse=True):
        if corrupt_file(folder, record) is None:
            return folder, record, bad
        bad.append(folder)
    return None, None, bad


class Scan(NamedTuple):
    folder: Path | None
    record: dict | None
    removed: list[Path]
    corrupt: list[Path]  # newer complete folders that failed their sha256 (with ``verify``)


def scan_run(run_dir: Path, known: Iterable[str], *, verify: bool = False) -> Scan:
    """:func:`newest_checkpoint` (:func:`newest_verified` with ``verify``, which refuses in one line
    when checkpoints exist and none verifies), after removing the checkpoint folders nothing will
    read: those that Ray Train's snapshot does not list (``known``, folder names) and that are
    incomplete or older than the newest complete one. A folder that failed its sha256 stays, for
    its owner to look at."""
    known = set(known)
    bad: list[Path] = []
    if verify:
        newest, record, bad = newest_verified(run_dir)
        if newest is None and bad:
            names = ", ".join(str(p) for p in bad)
            raise ConfigError(f"checkpoint: no checkpoint of run {run_dir.name!r} matches the sha256 its "
                              f"checkpoint.json records ({names}); remove those folders to start again from "
                              "step 0, or pass --overwrite")
    else:
        newest, record = newest_checkpoint(run_dir)
    removed = [p for p in _folders(run_dir) if p.name not in known and p != newest and p not in bad]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return Scan(newest, record, removed, bad)


def has_peers() -> bool:
    """Whether this process is one rank of a process group of several."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank; ``obj`` itself outside a process group."""
    import torch.distributed as dist

    if not has_peers():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list:
    """``obj`` from every rank, in rank order; ``[obj]`` outside a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclasses.dataclass
class DataPosition:
    """Where this rank stands in the data: the epoch, the steps done in it, and the count, sum and
    sum of squares of the row ids trained on in it, which a resume that replayed or skipped a
    batch would change."""

    steps_per_epoch: int
    epoch: int = 0
    offset: int = 0
    rows_seen: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3, dtype=np.float64))

    @property
    def epoch_done(self) -> bool:
        return self.offset >= self.steps_per_epoch

    def next_epoch(self) -> None:
        self.epoch, self.offset, self.rows_seen = self.epoch + 1, 0, np.zeros(3, dtype=np.float64)

    def advance(self, rows: np.ndarray | None) -> None:
        """One step done, on ``rows`` (None where the stream cannot name them)."""
        if rows is not None:
            self.rows_seen += (len(rows), rows.sum(), (rows * rows).sum())
        self.offset += 1

    def state_dict(self, seen: list[float]) -> dict:
        """The position to resume from, with ``seen`` the rows summed over all ranks; a finished
        epoch is saved as the start of the next."""
        if self.epoch_done:
            return {"epoch": self.epoch + 1, "offset": 0, "rows_seen": [0.0, 0.0, 0.0]}
        return {"epoch": self.epoch, "offset": self.offset, "rows_seen": seen}

    def load_state_dict(self, state: dict, rank: int) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        # The saved rows are the sum over ranks: one rank holds them, so the sum stays right.
        if rank == 0:
            self.rows_seen = np.asarray(state["rows_seen"], dtype=np.float64)


def rng_states(device) -> dict:
    """Every rank's torch RNG states (a collective), so that each rank's dropout and MPP
    corruption streams continue where they were."""
    import torch

    rng = {"cpu": gather(torch.get_rng_state())}
    if device.type == "cuda":
        rng["cuda"] = [t.cpu() for t in gather(torch.cuda.get_rng_state(device))]
    return rng


def set_rng_states(rng: dict, rank: int, world: int, device) -> None:
    import torch

    # States saved by a different number of ranks do not map onto these; the seeds stand.
    if len(rng.get("cpu", [])) == world:
        torch.set_rng_state(rng["cpu"][rank])
    if device.type == "cuda" and len(rng.get("cuda", [])) == world:
        torch.cuda.set_rng_state(rng["cuda"][rank], device)


class Checkpointer:
    """Decides when a step checkpoint is due, writes it with Ray Train's report, and restores the
    latest one.

    A save is due every ``checkpoint_every`` steps (by default at the end of every epoch) and
    always at the last step of the submission: the end of the schedule, or ``stop_after``.
    """

    def __init__(self, cfg: Any, *, steps_per_epoch: int, total_steps: int, rank: int = 0, world: int = 1) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.every = cfg.checkpoint_every
        self.steps_per_epoch = steps_per_epoch
        self.last_step = min(total_steps, cfg.stop_after or total_steps)

    def due(self, step: int, offset: int) -> bool:
        """Whether the step just done (``offset`` steps into its epoch) ends with a checkpoint."""
        if step == self.last_step:
            return True
        return step % self.every == 0 if self.every else offset == self.steps_per_epoch

    def load(self, trainer) -> None:
        """Restore ``trainer`` from Ray Train's latest checkpoint of this run, if there is one.

        With several ranks, rank 0 alone reads the state file into host memory; the other ranks get
        its small fields in one broadcast and each tensor of the model, optimiser and average from
        rank 0, onto their device (:meth:`training.trainer.Trainer.load_state_dict`). A read that
        fails on rank 0 fails every rank, with its message.
        """
        ckpt = self._latest(trainer)
        if ckpt:
            self.restore(trainer, ckpt)

    def restore(self, trainer, ckpt) -> None:
        """Restore ``trainer`` from the Ray Train checkpoint ``ckpt`` (see :meth:`load`)."""
        spread = has_peers()
        reader = self.rank == 0 or not spread
        state, failed = {}, None
        if reader:
            try:
                with ckpt.as_directory() as d:
                    state = self._read(Path(d), trainer)
            except Exception as exc:  # the other ranks wait on rank 0's broadcast: tell them first
                if not spread:
                    raise
                failed = exc
        told = None if failed is None else (isinstance(failed, ConfigError), str(failed))
        small = broadcast({**small_state(state), "failed": told})
        if failed is not None:
            raise failed
        if small["failed"]:
            is_config, message = small["failed"]
            raise ConfigError(message) if is_config else RuntimeError(f"rank 0 could not restore {ckpt.path}: {message}")
        if not reader:  # the best step's scores; rank 0 keeps its model
            trainer.best.load_state_dict(small.get("best_fewshot"), Path(ckpt.path), rank=self.rank)
        trainer.load_state_dict(state if reader else small)
        trainer.position.load_state_dict(small, self.rank)
        set_rng_states(small.get("rng", {}), self.rank, self.world, trainer.device)

    def _latest(self, trainer):
        """The checkpoint to restore: the driver's pick from disk (see scan_run), unless this fit has
        checkpointed since; Ray's pick is newer than the driver's only when this fit wrote it, or
        when it failed its sha256."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        on_disk = trainer.run.get("resume_from")
        skip = set(trainer.run.get("resume_skip", ()))
        if on_disk and (not ckpt or _step_of(ckpt) < trainer.run.get("resume_step", 0)
                        or Path(ckpt.path).name in skip):
            ckpt = ray.train.Checkpoint(on_disk)
        return ckpt

    def _read(self, folder: Path, trainer) -> dict:
        """The state in ``folder``, checked against this run's config; the best few-shot model too."""
        import torch

        # Tensors and plain types only: nothing from storage is unpickled as code.
        state = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True)
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(f"run_name {self.cfg.run_name!r}: the checkpoint's state is {state.get('format')!r}, "
                              f"not {STATE_FORMAT!r}; use a new --run-name or --output to start fresh")
        check_resumable(state["cfg"], dataclasses.asdict(self.cfg), free_on_resume(self.cfg), off_values(self.cfg))
        trainer.best.load_state_dict(state.get("best_fewshot"), folder, rank=self.rank)
        return state

    def save(self, trainer, metrics: dict) -> None:
        """Report ``metrics`` to Ray Train with a checkpoint. Every rank calls it (gathering the
        state is a collective); rank 0 writes the folder."""
        import ray.train
        import torch

        import vitcore
        from training.loop import all_reduce_sum
        from vitcore.checkpoint import MODEL_FILE, label_metadata

        state = trainer.state_dict()
        rng = rng_states(trainer.device)
        position = trainer.position
        seen = all_reduce_sum(position.rows_seen.tolist(), trainer.device)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if self.rank == 0:
                torch.save({"format": STATE_FORMAT, **state, **position.state_dict(seen), "rng": rng,
                            "best_fewshot": trainer.best.state_dict(), "cfg": dataclasses.asdict(self.cfg)},
                           Path(d) / TRAIN_STATE)
                vitcore.save_checkpoint(trainer.published_model(state), Path(d) / MODEL_FILE,
                                        extra_metadata=label_metadata(trainer.label_names))
                names = (TRAIN_STATE, MODEL_FILE, *trainer.best.save_model(Path(d), trainer.label_names))
                write_record(Path(d), names, trainer.step, cfg=dataclasses.asdict(self.cfg))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({**metrics, "data_epoch": position.epoch, "data_offset": position.offset,
                              "rows_seen": seen[0], "rows_sum": seen[1], "rows_sumsq": seen[2]}, checkpoint=checkpoint)


# The state's fields that hold whole-model tensors: rank 0 broadcasts them tensor by tensor.
TENSOR_FIELDS = ("model", "optimizer", "ema")


def small_state(state: dict) -> dict:
    """``state`` less its whole-model tensors (the average's update count kept): what rank 0
    broadcasts to the other ranks in one message."""
    small = {k: v for k, v in state.items() if k not in TENSOR_FIELDS}
    if "ema" in state:
        small["ema"] = {"updates": state["ema"]["updates"]}
    return small


def _step_of(ckpt) -> int:
    """The step of a Ray Train checkpoint from its record; -1 for one without (written before records)."""
    with ckpt.as_directory() as d:
        record = read_record(Path(d))
    return record["step"] if record else -1
