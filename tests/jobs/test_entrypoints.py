"""Every stage is its own entrypoint: --help and clear usage errors. (`ray job submit` of a
stage runs on the two-node cluster of tests/jobs/test_pretrain_cluster.py.)

Each entrypoint runs as its own process in ``test_help`` (and where the test is about another
process); a test about a refusal's message calls the job's ``main(argv)`` in this process, which
parses, refuses and exits the same way without paying for a fresh interpreter's imports
(the ``job_main`` fixture)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = ["prepare", "dedup", "pretrain", "finetune", "demo", "vtab", "vtab_prepare", "fewshot", "export", "study"]


def run_job(name, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "jobs" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def error_lines(out, name):
    """The job's own error lines on stderr (libraries may log warnings at import)."""
    return [line for line in out.stderr.splitlines() if line.startswith(f"{name}: ")]


def assert_one_line_exit_2(out, name, message):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr, out.stderr
    lines = error_lines(out, name)
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize("name", JOBS)
def test_help(name):
    out = run_job(name, "--help")
    assert out.returncode == 0, out.stderr
    assert "--config FILE" in out.stdout


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("pretrain", ["--data", "/x", "--objective", "nope"], "objective: expected one of 'classification', 'mpp'"),
        ("pretrain", ["--data", "/no/such/shards"], "data: /no/such/shards has no manifest.json"),
        ("finetune", ["--train", "/a", "--test", "/b", "--lrs", "-1"], "lrs: every learning rate must be positive"),
        ("demo", ["--epochs", "0"], "epochs: must be positive"),
        ("finetune", ["--train", "/a", "--test", "/b", "--microbatch", "100"],
         "microbatch: --batch-size 512 must be a multiple of --microbatch 100"),
        ("vtab", ["--output", "/tmp/x"], "task: give --data-root DIR or at least one --task NAME=DIR"),
        ("vtab", ["--task", "dtd"], "task: 'dtd': expected NAME=SRC"),
        ("vtab", ["--task", "dtd=/no/such/dtd"], "task dtd: /no/such/dtd does not exist; prepare it with: "
                                                 "python jobs/vtab_prepare.py --source tfds --task dtd"),
        ("vtab_prepare", ["--source", "tfds", "--task", "nope", "--output", "/tmp/x"], "task: 'nope' is not a registry task"),
        ("fewshot", ["--pretrained", "/no/m.safetensors", "--task", "dtd=/x"], "pretrained: /no/m.safetensors does not exist"),
    ],
)
def test_usage_errors_exit_2_and_name_the_problem(name, args, message, job_main):
    out = job_main(name, *args)
    assert_one_line_exit_2(out, name, message)


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("prepare", ["--input", "{tmp}/no_corpus", "--output", "{tmp}/out"], "input: {tmp}/no_corpus: input not found"),
        ("dedup", ["--shards", "{tmp}/no_shards", "--test-set", "cifar10={tmp}"], "{tmp}/no_shards: no manifest.json"),
        ("pretrain", ["--data", "{tmp}/no_shards"], "data: {tmp}/no_shards has no manifest.json"),
        ("finetune", ["--train", "{tmp}/no_train", "--test", "{tmp}/no_test"], "train: {tmp}/no_train has no manifest.json"),
        ("demo", ["--workdir", "{tmp}/a_file"], "workdir: {tmp}/a_file is an existing file"),
    ],
)
def test_a_missing_input_is_one_line_that_names_it_exit_2(name, args, message, tmp_path, job_main):
    (tmp_path / "a_file").write_text("not a folder")
    out = job_main(name, *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_exit_2(out, name, message.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("name", JOBS)
def test_an_unknown_flag_is_one_line_with_a_pointer_to_help(name, job_main):
    out = job_main(name, "--no-such-flag", "1")
    assert_one_line_exit_2(out, name, "unrecognized arguments: --no-such-flag 1")
    assert f"run {name} --help" in error_lines(out, name)[0]


@pytest.mark.parametrize("lrs", [["--lrs", "-0.1,0.01"], ["--lrs=-0.1,0.01"]])
def test_a_negative_value_reaches_its_fields_check(lrs, job_main):
    # argparse alone reads "-0.1,0.01" as a flag and says "expected one argument".
    out = job_main("finetune", "--train", "/a", "--test", "/b", *lrs)
    assert_one_line_exit_2(out, "finetune", "lrs: every learning rate must be positive, got [-0.1, 0.01]")


@pytest.mark.parametrize("name", ["pretrain", "finetune"])
def test_an_output_that_is_a_file_is_one_line_exit_2(name, tiny_shards, tmp_path, job_main):
    output = tmp_path / "model_out"
    output.write_text("an existing file")
    data = ["--data", str(tiny_shards), "--batch-size", "4", "--num-workers", "1"] if name == "pretrain" else \
        ["--train", str(tiny_shards), "--test", str(tiny_shards)]
    out = job_main(name, *data, "--output", str(output))
    assert_one_line_exit_2(out, name, f"output: {output} is an existing file; give a directory")
    assert output.read_text() == "an existing file"


def test_an_image_size_the_patch_does_not_divide_is_refused_by_the_config(tmp_path, job_main):
    # It used to reach the model inside Ray's workers: 25 s, exit 1 and 68 lines.
    from common.config import ConfigError
    from training.pretrain import PretrainConfig

    with pytest.raises(ConfigError, match="img_size: 30 is not a multiple of the patch size 8 of Ti/8; use e.g. 32"):
        PretrainConfig(data=str(tmp_path), variant="Ti/8", img_size=30)
    out = job_main("pretrain", "--data", str(tmp_path), "--variant", "Ti/8", "--img-size", "30")
    assert_one_line_exit_2(out, "pretrain", "img_size: 30 is not a multiple of the patch size 8")
    assert "Ray" not in out.stderr
    # Refused from the flags alone: Ray is not even imported (starting it is what took the 25 s).
    probe = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom common.config import ConfigError\nfrom training.pretrain import PretrainConfig\n"
        "try:\n    PretrainConfig(data='/x', variant='Ti/8', img_size=30)\nexcept ConfigError:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")], cwd=REPO, capture_output=True, text=True,
        timeout=120)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


@pytest.mark.parametrize("job,flag", [("pretrain", "--data"), ("finetune", "--train")])
def test_an_image_folder_given_as_shards_gets_a_prepare_command_that_works(tmp_path, job, flag, job_main):
    # It used to suggest `jobs/prepare.py --output <the same folder>`, which prepare refuses.
    folder = tmp_path / "photos"
    (folder / "cat").mkdir(parents=True)
    (folder / "cat" / "a.jpg").write_bytes(b"\xff\xd8\xff")
    extra = ["--test", str(folder)] if job == "finetune" else []
    out = job_main(job, flag, str(folder), *extra)
    assert_one_line_exit_2(out, job, f"--input {folder} --output {folder}-shards")


@pytest.fixture(scope="module")
def not_checkpoints(tmp_path_factory):
    """Files a user might pass as --pretrained that are not vitcore checkpoints."""
    import torch

    root = tmp_path_factory.mktemp("not_checkpoints")
    (root / "config.json").write_text('{"variant": "Ti/16"}')
    torch.save({"weight": torch.zeros(4, 4)}, root / "model.pt")
    (root / "renamed.safetensors").write_bytes((root / "model.pt").read_bytes())
    return root


@pytest.mark.parametrize("job", ["finetune", "vtab", "fewshot"])
@pytest.mark.parametrize("file", ["config.json", "model.pt", "renamed.safetensors"])
def test_a_pretrained_file_that_is_not_a_checkpoint_is_refused_before_ray(job, file, not_checkpoints, tiny_shards,
                                                                          tmp_path, job_main):
    # It used to fail inside every Ray Tune trial, retries included: 24 s, exit 1, 172 lines.
    path = not_checkpoints / file
    data = {"finetune": ["--train", str(tiny_shards), "--test", str(tiny_shards)],
            "vtab": ["--task", f"dtd={tmp_path}"], "fewshot": ["--task", f"dtd={tmp_path}"]}[job]
    out = job_main(job, "--pretrained", str(path), *data, "--output", str(tmp_path / "out"))
    assert_one_line_exit_2(out, job, f"pretrained: {path}: not a readable safetensors checkpoint")
    assert "model.safetensors that jobs/pretrain.py" in error_lines(out, job)[0]
    assert "Ray" not in out.stderr and not (tmp_path / "out").exists()



@pytest.mark.parametrize("job", ["finetune", "vtab", "fewshot"])
def test_a_pretrained_model_that_fails_its_recorded_sha256_is_refused_before_ray(job, tiny_shards, tmp_path, job_main,
                                                                                 build_pretrained):
    (tmp_path / "pre").mkdir()
    model = build_pretrained(tmp_path / "pre" / "model.safetensors", img_size=32, representation_size=16)
    (tmp_path / "pre" / "pretrain_summary.json").write_text(json.dumps({"sha256": {"model.safetensors": "0" * 64}}))
    data = {"finetune": ["--train", str(tiny_shards), "--test", str(tiny_shards)],
            "vtab": ["--task", f"dtd={tmp_path}"], "fewshot": ["--task", f"dtd={tmp_path}"]}[job]
    out = job_main(job, "--pretrained", str(tmp_path / "pre"), *data, "--output", str(tmp_path / "out"))
    assert_one_line_exit_2(out, job, f"pretrained: {model} does not match the sha256 "
                                     f"{tmp_path / 'pre' / 'pretrain_summary.json'} records for it (record 000000000000…, "
                                     "file ")
    assert "copy the file again from where pretrain wrote it, or re-run pretrain" in error_lines(out, job)[0]
    assert "Ray" not in out.stderr and not (tmp_path / "out").exists()


def _stage_args(job: str, shards, tmp_path) -> list[str]:
    """A small run of ``job`` (pretrain, finetune or vtab) on ``shards``, less its --output."""
    task = tmp_path / "task"
    task.mkdir()
    for split in ("train800", "val200", "test"):
        (task / split).symlink_to(shards, target_is_directory=True)
    return {"pretrain": ["--data", str(shards), "--variant", "Ti/8", "--depth", "1", "--img-size", "32",
                         "--batch-size", "4", "--num-workers", "1", "--holdout", "0"],
            "finetune": ["--train", str(shards), "--test", str(shards)],
            "vtab": ["--task", f"natural/mine={task}"]}[job]

@pytest.mark.parametrize("job", ["pretrain", "finetune", "vtab"])
def test_a_second_run_into_an_output_folder_in_use_is_refused_naming_the_holder(job, tiny_shards, tmp_path):
    # Two pretrain runs into one --output resumed the same run into the same checkpoint folders;
    # two sweeps restored the same Tune experiment and ran its trials twice.
    from common.locks import FolderLock

    data = _stage_args(job, tiny_shards, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with FolderLock(out_dir, job):
        out = run_job(job, *data, "--output", str(out_dir))
    assert_one_line_exit_2(out, job, f"output {out_dir}: another {job} run is writing there (pid {os.getpid()} on ")
    assert "Ray" not in out.stderr and sorted(os.listdir(out_dir)) == []  # released, nothing written


@pytest.mark.parametrize("job", ["pretrain", "finetune", "vtab", "fewshot"])
def test_a_reader_of_a_set_that_prepare_is_rewriting_is_refused_naming_it(job, tiny_shards, tmp_path, job_main,
                                                                          mlflow_store, build_pretrained, monkeypatch):
    # A pretrain started while a prepare --overwrite replaced its set trained on a mix of the two.
    import shutil

    from common import locks

    monkeypatch.setattr(locks, "READERS_WAIT_S", 0.1)
    shards = tmp_path / "set"
    shutil.copytree(tiny_shards, shards, ignore=shutil.ignore_patterns(".readers*"))  # the session's set stays free
    data = _stage_args("vtab" if job == "fewshot" else job, shards, tmp_path)
    if job == "fewshot":
        data += ["--pretrained", str(build_pretrained(tmp_path / "m.safetensors", img_size=32, representation_size=None))]
    with locks.FolderLock(shards, "prepare"), locks.DataLock(shards, "prepare", exclusive=True):
        out = job_main(job, *data, "--output", str(tmp_path / "out"))
    name = {"pretrain": "data", "finetune": "train"}.get(job, "mine/train800")
    assert_one_line_exit_2(out, job, f"a prepare run is rewriting this shard set (pid {os.getpid()} on ")
    assert error_lines(out, job)[0].startswith(f"{job}: error: {name} ")
    assert error_lines(out, job)[0].endswith(f"; wait for it to finish, then run {job} again")
    assert "Ray" not in out.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("job", "owner"), [("vtab", "finetune"), ("finetune", "vtab"), ("pretrain", "finetune")])
def test_a_stage_into_a_folder_another_stage_owns_is_refused_before_it_writes(job, owner, tiny_shards, tmp_path):
    # A vtab started beside a finetune in one --output replaced the finetune's sweep state and Tune folders.
    from common.locks import OWNER_FILE, claim_folder

    data = _stage_args(job, tiny_shards, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    claim_folder(out_dir, owner)
    out = run_job(job, *data, "--output", str(out_dir))
    assert_one_line_exit_2(out, job, f"output {out_dir}: belongs to a {owner} run (its state is there, which this "
                           f"{job} run would overwrite); give this {job} run another --output")
    assert "Ray" not in out.stderr and sorted(os.listdir(out_dir)) == [OWNER_FILE]  # nothing written


def test_pretraining_a_classifier_on_one_class_warns_in_one_line_and_trains(tmp_path, mlflow_store):
    from common.photos import CROP_CLASSES, crop_folder
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    crop_folder(tmp_path / "src", classes=CROP_CLASSES[:1])
    run_prepare(PrepareConfig(input=[str(tmp_path / "src")], output=str(tmp_path / "shards"), size=32, workers=1))
    out = run_job("pretrain", "--data", str(tmp_path / "shards"), "--output", str(tmp_path / "out"), "--variant",
                  "Ti/8", "--depth", "1", "--img-size", "32", "--batch-size", "4", "--num-workers", "1", "--steps", "1",
                  "--holdout", "0", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in error_lines(out, "pretrain") if "warning" in line]
    assert warnings == [f"pretrain: warning: data: {tmp_path / 'shards'} has 1 classes (cat); a classifier learns "
                        "nothing from it. Prepare a corpus with several class folders, or use --objective mpp"]
