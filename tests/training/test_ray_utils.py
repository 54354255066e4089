"""The in-process Ray the stages start keeps every server on loopback."""
import pytest


def test_in_process_ray_listens_on_loopback_only(ray_session, tcp_listeners, loopback_addresses):
    if tcp_listeners is None:
        pytest.skip("reads listening sockets from /proc (Linux)")
    ray = ray_session
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}

    @ray.remote
    def ping() -> int:
        return 1

    assert ray.get([ping.remote() for _ in range(2)]) == [1, 1]  # worker processes up and serving
    found = tcp_listeners()
    # GCS, raylet (node manager and object manager), agents, the workers' own servers.
    assert len(found) >= 4
    assert {addr for addr, _ in found} <= loopback_addresses, sorted(found)


# -- resuming from a Ray Train snapshot ---------------------------------------------------------

def _snapshot(run_dir, names, *, latest=None):
    import json

    import ray

    run_dir.mkdir(parents=True, exist_ok=True)
    results = [{"version": 0, "checkpoint_dir_name": n, "metrics": {"step": i}} for i, n in enumerate(names)]
    state = {"ray_version": ray.__version__, "checkpoint_results": results,
             "checkpoint_report_indices": list(range(len(names))),
             "latest_checkpoint_result": results[-1] if latest is None else
             {"version": 0, "checkpoint_dir_name": latest, "metrics": {}},
             "pending_training_results": [], "pending_validation_specs": [], "current_report_index": len(names),
             "validated_checkpoint_dir_names": [], "timed_out_validation_checkpoint_dir_names": [],
             "failed_validation_checkpoint_dir_names": []}
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps(state))


@pytest.mark.parametrize("bad", ["/tmp/victim", "../../victim", "checkpoint_1/../../..", "~/data", "file:///etc"])
def test_a_snapshot_naming_a_folder_outside_the_run_is_refused(tmp_path, bad):
    from common.config import ConfigError
    from training.ray_utils import check_resume_snapshot

    victim = tmp_path / "victim"
    victim.mkdir()
    _snapshot(tmp_path / "ray" / "run1", ["checkpoint_2026-01-01_00-00-00.000000", bad])
    with pytest.raises(ConfigError, match=r"run_name 'run1': .*checkpoint_manager_snapshot.json names checkpoint "
                                          r"folder .*outside the run's folder"):
        check_resume_snapshot(str(tmp_path / "ray"), "run1")
    assert victim.is_dir()


def test_a_snapshot_of_ray_trains_own_names_passes_and_no_snapshot_is_no_resume(tmp_path):
    import pyarrow.fs

    from training.ray_utils import check_resume_snapshot

    _snapshot(tmp_path / "ray" / "run1", ["checkpoint_2026-01-01_00-00-00.000000",
                                          "checkpoint_2026-01-01_00-01-00.000000"])
    check_resume_snapshot(str(tmp_path / "ray"), "run1")
    check_resume_snapshot(str(tmp_path / "ray"), "run1", pyarrow.fs.LocalFileSystem())
    check_resume_snapshot(str(tmp_path / "ray"), "never-ran")
    check_resume_snapshot(str(tmp_path / "ray"), None)


@pytest.mark.parametrize("cut", [0, 100])
def test_a_snapshot_cut_short_is_moved_aside_in_one_line_and_a_garbled_one_is_refused(tmp_path, capsys, cut):
    from common.config import ConfigError
    from training.ray_utils import check_resume_snapshot

    _snapshot(tmp_path / "ray" / "run1", ["checkpoint_2026-01-01_00-00-00.000000"])
    path = tmp_path / "ray" / "run1" / "checkpoint_manager_snapshot.json"
    whole = path.read_bytes()
    path.write_bytes(whole[:cut])  # what a full disk leaves of it
    assert check_resume_snapshot(str(tmp_path / "ray"), "run1") == []
    assert not path.exists() and (path.parent / (path.name + ".unreadable")).read_bytes() == whole[:cut]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"pretrain: warning: run_name 'run1': {path} was cut short"), err

    path.write_bytes(whole.replace(b"[", b"[?", 1))  # not Ray's, and not cut short: refused as before
    with pytest.raises(ConfigError, match="is not a Ray Train snapshot Ray could have written"):
        check_resume_snapshot(str(tmp_path / "ray"), "run1")


def test_the_check_reads_a_snapshot_on_a_storage_filesystem(tmp_path):
    import pyarrow.fs

    from common.config import ConfigError
    from training.ray_utils import check_resume_snapshot

    _snapshot(tmp_path / "ray" / "run1", ["checkpoint_a"], latest="/elsewhere")
    with pytest.raises(ConfigError, match="'/elsewhere'"):
        check_resume_snapshot(str(tmp_path / "ray"), "run1", pyarrow.fs.LocalFileSystem())


# -- torch's rendezvous on one machine ----------------------------------------------------------

def test_two_torch_workers_on_one_machine_listen_on_loopback_only(ray_session, tcp_listeners, loopback_addresses,
                                                                  tmp_path):
    import threading

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from training.loopback_torch import LoopbackTorchConfig

    if tcp_listeners is None:
        pytest.skip("reads listening sockets from /proc (Linux)")

    def loop():
        import time

        import torch
        import torch.distributed as dist

        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert dist.get_world_size() == 2 and t.item() == 3.0
        time.sleep(4)  # the group stays up while the driver looks at its sockets
        dist.barrier()

    seen: set = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(tcp_listeners())
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        TorchTrainer(loop, torch_config=LoopbackTorchConfig(),
                     scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(name="loopback", storage_path=str(tmp_path / "ray"))).fit()
    finally:
        done.set()
        watcher.join()
    assert {addr for addr, _ in seen} <= loopback_addresses, sorted(seen)
