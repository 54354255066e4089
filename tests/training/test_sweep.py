"""training.sweep: Tune sweeps retry failed trials, and a resumed sweep refuses changed flags."""
from pathlib import Path

import pytest

from common.config import ConfigError
from training.ray_utils import init_ray
from training.sweep import open_sweep_state, save_sweep_state, tune_sweep


def test_a_resumed_sweep_refuses_changed_flags_but_not_where_it_runs(tmp_path):
    config = {"lrs": [0.01, 0.03], "steps": 5, "max_concurrent": 0}
    assert open_sweep_state(tmp_path, config) is None
    save_sweep_state(tmp_path, config, "run-1")
    resumed = open_sweep_state(tmp_path, {**config, "max_concurrent": 4}, fresh_keys={"max_concurrent"})
    assert resumed["mlflow_run_id"] == "run-1"
    with pytest.raises(ConfigError, match=r"output: .* holds a sweep run with steps=5, not 10; re-run with the "
                                          r"same flags to resume it, or pass a new --output"):
        open_sweep_state(tmp_path, {**config, "steps": 10})


def test_a_failing_trial_is_retried_up_to_max_failures(tmp_path):
    from ray import tune

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

    space["fail_first"] = 5  # more failures than retries: the trial ends in error, not silently
    grid = tune_sweep(flaky, {**space, "x": 3}, name="gives-up", output=tmp_path / "out", resources={"cpu": 1},
                      metric="score", max_failures=1)
    assert len(grid.errors) == 1 and (tmp_path / "attempts-3").read_text() == "2"
