"""pipelines.config: bad values are refused with the field named; the documented options files load."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, from_dict, load_file
from pipelines.config import PrepareConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("field,value,text", [
    ("size", 0, "size"),
    ("quality", 0, "quality"),
    ("workers", 0, "workers"),
    ("max_long_side", 100, "max_long_side"),
    ("test_set", ["a=/x", "a=/y"], "given twice"),
    ("test_set", ["corpus=/x"], "reserved"),
    ("store", "png", "store"),
    ("beam_options", ["project=x"], "--name=value"),
    ("format", "wds", "use auto or one of shard_set, webdataset, hf_parquet, folder"),
    ("split", " ", "split"),
])
def test_bad_values_name_the_field(field, value, text):
    with pytest.raises(ConfigError, match=text):
        from_dict(PrepareConfig, {"input": ["/x"], "output": "/o", field: value})


@pytest.mark.parametrize("name", ["dataflow.yaml", "flink.yaml"])
def test_runner_options_files_are_valid_configs(name):
    data = load_file(REPO / "infra" / "beam" / name)
    cfg = from_dict(PrepareConfig, {**data, "input": ["gs://b/in"], "output": "gs://b/out"})
    assert cfg.runner != "DirectRunner" and all(o.startswith("--") for o in cfg.beam_options)


@pytest.mark.parametrize("field,value", [
    ("max_file_mb", "Infinity"), ("max_file_mb", ".inf"), ("max_file_mb", 1e308), ("max_file_mb", float("nan")),
    ("shard_mb", 1e-320), ("shard_mb", 1e308), ("max_megapixels", 1e308),
])
def test_out_of_range_sizes_are_refused_before_anything_runs(field, value):
    with pytest.raises(ConfigError, match=field):
        from_dict(PrepareConfig, {"input": ["/x"], "output": "/o", field: value})


@pytest.mark.parametrize("flags,yaml_text", [
    (["--max-file-mb", "1e308"], None),
    (["--shard-mb", "1e-320"], None),
    ([], "max_file_mb: .inf\n"),
])
def test_a_bad_size_exits_2_and_leaves_the_old_shard_set_alone(tmp_path, flags, yaml_text):
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"old": true}')
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("x")
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        flags = ["--config", str(tmp_path / "c.yaml")]
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "prepare.py"), "--input", str(tmp_path / "in"),
                           "--output", str(out), *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert ("max_file_mb" in line or "shard_mb" in line) and "Traceback" not in proc.stderr
    assert (out / "manifest.json").read_text() == '{"old": true}'
