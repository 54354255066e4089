"""transfer.sweep: Tune sweeps retry failed trials, resume from any kill, and refuse changed flags."""
import io
import os
import shutil
from pathlib import Path

import pytest

from common.config import ConfigError
from training.ray_utils import init_ray
from transfer.sweep import open_sweep_state, save_sweep_state, tune_sweep


def test_a_resumed_sweep_refuses_changed_flags_but_not_where_it_runs(tmp_path):
    config = {"lrs": [0.01, 0.03], "steps": 5, "max_concurrent": 0, "dev_fractions": None, "sizes": (1, 2)}
    assert open_sweep_state(tmp_path, config, stage="finetune") is None
    save_sweep_state(tmp_path, config, "run-1", stage="finetune")
    resumed = open_sweep_state(tmp_path, {**config, "ray_address": "auto"}, stage="finetune",
                               fresh_keys={"ray_address", "max_concurrent"})
    assert resumed["mlflow_run_id"] == "run-1"  # a tuple saved as a JSON list is the same flag
    with pytest.raises(ConfigError, match=r"other flags \(max_concurrent: sweep 0, now 4\)"):
        # Tune's restore would keep the old value without a word.
        open_sweep_state(tmp_path, {**config, "max_concurrent": 4}, stage="finetune", fresh_keys={"max_concurrent"})
    with pytest.raises(ConfigError) as refused:
        open_sweep_state(tmp_path, {**config, "steps": 10, "lrs": [0.1]}, stage="finetune")
    assert str(refused.value) == (
        f"output: {tmp_path} holds a finetune sweep run with other flags (lrs: sweep [0.01, 0.03], now [0.1], "
        "steps: sweep 5, now 10); re-run with the same flags to resume it, or pass a new --output")
    assert open_sweep_state(tmp_path, config, stage="vtab") is None  # each stage has its own state


def test_a_sweep_state_from_before_states_were_per_stage_still_resumes(tmp_path):
    import json

    from transfer.sweep import LEGACY_STATE_FILE

    config = {"train": "/data/t", "lrs": [0.01]}
    (tmp_path / LEGACY_STATE_FILE).write_text(json.dumps({"config": config, "mlflow_run_id": "old"}))
    assert open_sweep_state(tmp_path, config, stage="finetune")["mlflow_run_id"] == "old"
    assert open_sweep_state(tmp_path, {"data_root": "/v"}, stage="vtab") is None


def test_a_failing_trial_is_retried_up_to_max_failures(tmp_path, monkeypatch):
    from ray import tune

    monkeypatch.delenv("TUNE_GLOBAL_CHECKPOINT_S", raising=False)

    def flaky(config):  # local: Tune ships it by value to its workers
        from ray import tune

        count = Path(config["dir"]) / f"attempts-{config['x']}"
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
        if n < config["fail_first"]:
            raise RuntimeError(f"attempt {n + 1} fails on purpose")
        tune.report({"score": float(config["x"])})

    init_ray(None)
    space = {"x": tune.grid_search([1, 2]), "dir": str(tmp_path), "fail_first": 1}
    grid = tune_sweep(flaky, space, name="retry", output=tmp_path / "out", resources={"cpu": 1},
                      metric="score", max_failures=1)
    assert sorted(r.metrics["score"] for r in grid) == [1.0, 2.0] and not grid.errors
    assert [(tmp_path / f"attempts-{x}").read_text() for x in (1, 2)] == ["2", "2"]
    assert "TUNE_GLOBAL_CHECKPOINT_S" not in os.environ  # the sweep's setting ends with it

    space["fail_first"] = 5  # more failures than retries: the trial ends in error, not silently
    grid = tune_sweep(flaky, {**space, "x": 3}, name="gives-up", output=tmp_path / "out", resources={"cpu": 1},
                      metric="score", max_failures=1)
    assert len(grid.errors) == 1 and (tmp_path / "attempts-3").read_text() == "2"


def _grid_trial(config):
    """Counts its runs; the second trial saves the grid's state as the sweep has saved it so far."""
    import glob
    import shutil

    from ray import tune

    runs = Path(config["dir"]) / f"runs-{config['x']}"
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    if config["x"] == 2:
        (Path(config["dir"]) / "early").mkdir()
        for f in glob.glob(str(Path(config["dir"]) / "out" / "ray" / "g" / "basic-variant-state-*.json")):
            shutil.copy(f, Path(config["dir"]) / "early")
    tune.report({"score": float(config["x"])})


def _grid_sweep(tmp_path, capsys=None):
    from ray import tune

    init_ray(None)
    grid = tune_sweep(_grid_trial, {"x": tune.grid_search([1, 2, 3]), "dir": str(tmp_path)}, name="g",
                      output=tmp_path / "out", resources={"cpu": 1}, metric="score", max_concurrent=1)
    assert sorted(r.metrics["score"] for r in grid) == [1.0, 2.0, 3.0] and not grid.errors
    return [(tmp_path / f"runs-{x}").read_text() for x in (1, 2, 3)]


def test_a_resume_follows_the_trials_recorded_not_an_older_grid_state(tmp_path):
    # A kill between Tune's copies of its two state files left the grid's position behind the
    # trials recorded: the resumed grid generated a finished trial again, or waited on it forever.
    assert _grid_sweep(tmp_path) == ["x", "x", "x"]
    folder = tmp_path / "out" / "ray" / "g"
    [saved] = folder.glob("basic-variant-state-*.json")
    early = list((tmp_path / "early").iterdir())
    assert early and early[0].read_bytes() != saved.read_bytes()
    shutil.copy(early[0], saved)  # the grid as saved before trial 3 was made, beside the whole experiment state
    assert _grid_sweep(tmp_path) == ["x", "x", "x"]  # nothing ran again


def test_a_state_file_cut_short_moves_the_sweep_aside_in_one_line_and_runs_it_again(tmp_path, capsys):
    # Tune copied its state files by truncating and writing them: a kill mid-copy left an empty
    # grid state, and the resume started an experiment of one trial with no config (KeyError).
    assert _grid_sweep(tmp_path) == ["x", "x", "x"]
    folder = tmp_path / "out" / "ray" / "g"
    [saved] = folder.glob("basic-variant-state-*.json")
    saved.write_bytes(b"")  # as the kill left it before Tune's files were written whole
    shutil.rmtree(tmp_path / "early")
    capsys.readouterr()
    assert _grid_sweep(tmp_path) == ["xx", "xx", "xx"]
    err = capsys.readouterr().err
    [aside] = (tmp_path / "out" / "ray").glob("g.unreadable-*")
    line = (f"finetune g: the sweep's saved state in {folder} cannot be read (EOFError); moved it to "
            f"{aside.name} and running every trial again")
    assert line in err.splitlines()


def test_tunes_storage_writes_a_file_whole_or_not_at_all(tmp_path):
    import pickle

    from transfer.tune_state import storage

    fs = pickle.loads(pickle.dumps(storage()))  # as Tune ships it to its trial actors
    target = tmp_path / "state.json"
    target.write_text("old")
    stream = fs.open_output_stream(str(target))
    stream.write(b"new, half writ")
    assert target.read_text() == "old"  # a kill here leaves the old file
    stream.write(b"ten")
    stream.close()
    assert target.read_text() == "new, half written" and os.listdir(tmp_path) == ["state.json"]



class _ReadFails(io.RawIOBase):
    """A source file whose reads fail after 8 bytes, as a connection reset partway through a copy."""

    def __init__(self):
        self.reads = 0

    def readable(self):
        return True

    def read(self, n=-1):
        self.reads += 1
        if self.reads > 2:
            raise OSError("connection reset")
        return b"half"


def test_a_copy_that_fails_partway_leaves_the_old_file_and_no_debris(tmp_path):
    import gc

    import fsspec
    import pyarrow
    import pyarrow.fs

    from transfer.tune_state import storage

    class Source(pyarrow.fs.FSSpecHandler):
        def open_input_stream(self, path):
            return pyarrow.PythonFile(_ReadFails(), mode="r")

        def get_file_info(self, paths):
            return [pyarrow.fs.FileInfo(p, pyarrow.fs.FileType.File, size=64) for p in paths]

    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(OSError, match="connection reset"):  # as Tune uploads its state: copy_files
        pyarrow.fs.copy_files("/state.json", str(target), chunk_size=4, destination_filesystem=storage(),
                              source_filesystem=pyarrow.fs.PyFileSystem(Source(fsspec.filesystem("memory"))))
    gc.collect()  # the collector's close of the dropped file must not put it in place
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def _saved_sweep(folder, runner_data, grid_state=None):
    """A sweep's folder as Tune saves it: one finished trial, the runner's data, the grid's pickle."""
    import json

    import ray.cloudpickle as cloudpickle

    folder.mkdir()
    trial = json.dumps({"trial_id": "a_00000", "status": "TERMINATED"})
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text(
        json.dumps({"trial_data": [[trial, "{}"]], "runner_data": runner_data}))
    if grid_state is not None:
        (folder / "basic-variant-state-2026-01-01_00-00-00.json").write_bytes(cloudpickle.dumps(grid_state))


class _Mkdir:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_resume_reads_the_experiment_state_as_json_and_runs_none_of_its_pickles(tmp_path):
    import ray.cloudpickle as cloudpickle

    from transfer.tune_state import prepare_resume

    marker = tmp_path / "unpickled"
    payload = {"_type": "CLOUDPICKLE_FALLBACK", "value": cloudpickle.dumps(_Mkdir(str(marker))).hex()}
    _saved_sweep(tmp_path / "g", payload)
    assert prepare_resume(tmp_path / "g", "finetune") and not marker.exists()


def test_a_grid_state_laid_out_otherwise_is_resumed_as_saved_in_one_line(tmp_path, capsys):
    import types

    from transfer.tune_state import prepare_resume

    _saved_sweep(tmp_path / "g", {}, {"_iterators": [types.SimpleNamespace(counter=0)]})  # another Ray's grid
    [grid] = (tmp_path / "g").glob("basic-variant-state-*")
    before = grid.read_bytes()
    assert prepare_resume(tmp_path / "g", "finetune") and grid.read_bytes() == before
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"finetune g: cannot adjust the grid's saved position in {grid.name}, laid out as this "
                           "code does not know (AttributeError: ") and line.endswith("resuming it as Tune saved it")


def _trial_checkpoints(trial, n):
    from training.checkpointer import write_record

    for i in range(n):
        folder = trial / f"checkpoint_{i:06d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([i]) * 64)
        write_record(folder, ["model.safetensors"], 4)
    return sorted(trial.iterdir())


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))  # the same size: only the sha256 can tell


def test_a_trial_checkpoint_that_fails_its_sha256_falls_back_in_one_line_or_is_refused(tmp_path, capsys):
    from transfer.sweep import verified_checkpoint

    trial = tmp_path / "ray" / "final" / "trial_0"
    older, newer = _trial_checkpoints(trial, 2)
    assert verified_checkpoint(trial, "finetune") == newer
    _flip_a_byte(newer / "model.safetensors")
    assert verified_checkpoint(trial, "finetune") == older
    assert capsys.readouterr().err.splitlines() == [
        f"finetune: warning: checkpoint: {newer} does not match the sha256 its checkpoint.json records; using "
        f"{older} instead (remove the bad folder once you have looked at it)"]
    (older / "model.safetensors").write_bytes(b"cut")
    with pytest.raises(ConfigError) as refused:
        verified_checkpoint(trial, "finetune")
    assert str(refused.value) == (
        f"checkpoint: no checkpoint of finetune trial trial_0 matches the sizes and sha256 its checkpoint.json "
        f"records ({newer}, {older}); remove {tmp_path / 'ray' / 'final'} and re-run the same command to run that "
        "sweep's trials again")
    for folder in (older, newer):
        (folder / "checkpoint.json").unlink()
    assert verified_checkpoint(trial, "finetune") is None  # written before records: Tune's pick stands

def test_a_trial_in_a_reused_process_gives_the_metrics_of_one_in_a_fresh_process(tiny_shards, build_pretrained,
                                                                                   tmp_path, ray_session, mlflow_store):
    # A sweep runs a trial in the process of a finished one: two trials with the same config, one
    # after the other, must agree, the first in a new process and the second in the reused one.
    from transfer.finetune import FinetuneConfig, run_finetune

    pretrained = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    summary = run_finetune(FinetuneConfig(train=str(tiny_shards), test=str(tiny_shards), pretrained=str(pretrained),
                                          output=str(tmp_path / "out"), lrs=[0.1, 0.1], steps=4, batch_size=4,
                                          warmup_steps=1, val_fraction=0.25, max_concurrent=1))
    first, second = summary["trials"]
    assert first == second


def test_a_sweep_resumed_on_a_replaced_split_is_refused_unless_data_changed_ok(tmp_path, capsys):
    from transfer.sweep import manifest_digests

    config = {"lrs": [0.01], "steps": 5}
    started = manifest_digests({"train": {"url": "/sets/train", "manifest_sha256": "1" * 64, "num_rows": 9}})
    replaced = {"train": {**started["train"], "manifest_sha256": "2" * 64}}
    save_sweep_state(tmp_path, config, "run-1", stage="finetune", data=started)
    assert open_sweep_state(tmp_path, config, stage="finetune", data=started)["mlflow_run_id"] == "run-1"
    with pytest.raises(ConfigError) as refused:
        open_sweep_state(tmp_path, config, stage="finetune", data=replaced)
    assert str(refused.value) == (
        f"train /sets/train: its manifest.json is not the one this finetune sweep started on (sha256 {'1' * 16}… "
        f"then, {'2' * 16}… now: the set was replaced); pass a new --output to sweep it afresh, or pass "
        "--data-changed-ok to resume on the new data")
    assert open_sweep_state(tmp_path, config, stage="finetune", data=replaced, data_changed_ok=True)
    assert "resuming on the new data (--data-changed-ok)" in capsys.readouterr().err


def test_a_sweep_reopened_on_a_replaced_split_is_tagged_with_it(tmp_path, mlflow_store):
    from common import tracking
    from transfer.sweep import sweep_run

    config = {"lrs": [0.01], "steps": 5}
    started = {"name": "train", "url": "/sets/train", "manifest_sha256": "1" * 64, "role": "training"}
    replaced = {**started, "manifest_sha256": "2" * 64}
    with sweep_run("finetune", tmp_path, config, None, records=[started],
                   new={"tags": tracking.run_tags(config, data=[started])}) as run:
        run_id = run.info.run_id
    state = open_sweep_state(tmp_path, config, stage="finetune")
    with sweep_run("finetune", tmp_path, config, state, records=[replaced],
                   new={"tags": tracking.run_tags(config, data=[replaced])}) as run:
        assert run.info.run_id == run_id
    tags = tracking.get_run(run_id).data.tags
    assert tags[tracking.TAG_INPUT_MANIFEST] == "2" * 64 and tags[tracking.TAG_EARLIER_INPUT] == "1" * 64
