"""pipelines.config: bad values are refused with the field named; the documented options files load."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import PrepareConfig
from common.config import ConfigError, from_dict, load_file

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
])
def test_bad_values_name_the_field(field, value, text):
    with pytest.raises(ConfigError, match=text):
        from_dict(PrepareConfig, {"input": ["/x"], "output": "/o", field: value})


@pytest.mark.parametrize("name", ["dataflow.yaml", "flink.yaml"])
def test_runner_options_files_are_valid_configs(name):
    data = load_file(REPO / "infra" / "beam" / name)
    cfg = from_dict(PrepareConfig, {**data, "input": ["gs://b/in"], "output": "gs://b/out"})
    assert cfg.runner != "DirectRunner" and all(o.startswith("--") for o in cfg.beam_options)
