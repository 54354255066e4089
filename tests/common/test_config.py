"""Typed stage configs: files, CLI overrides and errors that name the field."""
import json

import pytest

from common.config import ConfigError, changed_fields, from_dict, parse_args
from training.pretrain import PretrainConfig
from transfer.finetune import FinetuneConfig


def test_file_then_flags_override(tmp_path):
    path = tmp_path / "pre.yaml"
    path.write_text("data: /d\nvariant: S/16\nepochs: 3\nlr: 0.0005\n")
    cfg = parse_args(PretrainConfig, ["--config", str(path), "--epochs", "7"])
    assert (cfg.data, cfg.variant, cfg.epochs, cfg.lr) == ("/d", "S/16", 7, 0.0005)


def test_json_config_and_list_fields(tmp_path):
    path = tmp_path / "ft.json"
    path.write_text(json.dumps({"train": "/a", "test": "/b", "lrs": [0.001, 0.01]}))
    assert parse_args(FinetuneConfig, ["--config", str(path)]).lrs == [0.001, 0.01]
    assert parse_args(FinetuneConfig, ["--config", str(path), "--lrs", "0.1,0.3"]).lrs == [0.1, 0.3]
    assert parse_args(FinetuneConfig, ["--config", str(path), "--lrs", "0.1", "--lrs", "0.3"]).lrs == [0.1, 0.3]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"data": "/d", "objective": "contrastive"}, "objective: expected one of 'classification', 'mpp'"),
        ({"data": "/d", "epochs": "many"}, "epochs: expected an integer (or null), got 'many'"),
        ({"data": "/d", "epochs": 0}, "epochs: must be a positive integer"),
        ({"data": "/d", "dropout": 1.5}, "dropout: must be in [0, 1)"),
        ({"data": "/d", "lerning_rate": 0.1}, "unknown field(s) lerning_rate"),
        ({"variant": "B/16"}, "required field(s) missing: data"),
    ],
)
def test_invalid_values_name_the_field(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(PretrainConfig, data)
    assert message in str(err.value)


def test_cli_error_exits_2_with_the_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(PretrainConfig, ["--data", "/d", "--loss", "hinge"], prog="pretrain")
    assert exit_.value.code == 2
    assert "loss: expected one of 'softmax', 'sigmoid', got 'hinge'" in capsys.readouterr().err


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(PretrainConfig, ["--config", str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        from common.config import load_file

        load_file(bad)


def test_a_field_is_marked_once_as_recipe_length_or_where():
    import dataclasses

    from common.config import free_on_resume, not_recipe, recipe_of

    @dataclasses.dataclass
    class Stage:
        lr: float = 0.1
        steps: int = dataclasses.field(default=10, metadata={"recipe": "length"})
        output: str = dataclasses.field(default="out", metadata={"recipe": False})

    assert not_recipe(Stage) == {"output"}
    assert free_on_resume(Stage()) == {"steps", "output"}
    assert recipe_of(Stage(output="elsewhere")) == {"lr": 0.1, "steps": 10}

    @dataclasses.dataclass
    class Bad:
        x: int = dataclasses.field(default=0, metadata={"recipe": "maybe"})

    with pytest.raises(TypeError, match="Bad.x: recipe mark 'maybe'"):
        not_recipe(Bad)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    import time

    from common.config import load_file

    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 600
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="alias"):
        load_file(path)
    assert time.monotonic() - t0 < 5


def test_a_plain_yaml_config_still_loads_and_a_huge_one_is_refused(tmp_path):
    from common.config import load_file

    path = tmp_path / "ok.yaml"
    path.write_text("size: 64\nname: run\ntags: [a, b]\n")
    assert load_file(path) == {"size": 64, "name": "run", "tags": ["a", "b"]}
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "a" * 2_000_000 + "\n")
    with pytest.raises(ConfigError, match="too large"):
        load_file(big)


def test_a_resume_sees_every_changed_field_but_the_free_ones():
    saved = {"lr": 0.1, "steps": 40, "output": "/a", "dropout": None}
    assert changed_fields(saved, {"lr": 0.3, "steps": 80, "output": "/b", "seed": 1}, free=["output"]) == [
        "lr", "seed", "steps"]  # absent reads as None: "dropout" is unchanged, a new "seed" is not
    assert changed_fields(saved, dict(saved)) == []
