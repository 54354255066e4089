"""Export a vitscale model as a timm model folder (docs/models.md). Run with --help for every option.

    python jobs/export.py --model finetune_output/model.safetensors --output my_vit [--label-map classes.txt]

then ``timm.create_model('local-dir:my_vit', pretrained=True)`` loads it (timm 1.0).
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from common.config import InputError  # noqa: E402
from vitcore.checkpoint import MODEL_FILE, CheckpointMismatch  # noqa: E402
from vitcore.timm_export import TimmExportError, export_timm  # noqa: E402


@dataclass
class ExportConfig:
    """Write a vitscale model file as a timm model folder: model.safetensors and config.json."""

    model: str = field(metadata={"help": f"the vitscale model: a {MODEL_FILE} a stage wrote, or its folder",
                                 "recipe": False})
    output: str = field(metadata={"help": "the folder to write (new or empty)", "recipe": False})
    label_map: str | None = field(default=None, metadata={
        "help": "class names in head order: one a line, a JSON list or a JSON {name: id} (the forms jobs/prepare.py "
                "takes); by default those in the model file, else generic names (class_0, ...)", "recipe": False})


def export(cfg: ExportConfig) -> None:
    model = Path(cfg.model).expanduser()
    if model.is_dir():
        model = model / MODEL_FILE
    if not model.is_file():
        raise InputError(f"model: {model} does not exist; pass the {MODEL_FILE} that jobs/pretrain.py or "
                         "jobs/finetune.py wrote, or its folder")
    try:
        r = export_timm(model, Path(cfg.output).expanduser(), label_map=cfg.label_map)
    except (FileNotFoundError, CheckpointMismatch) as exc:
        raise InputError(f"model: {exc}") from None
    except TimmExportError as exc:
        raise InputError(f"{exc.input}: {exc}") from None
    if r.label_names == "generic" and r.num_classes:
        print(f"note: {model} carries no class names; label_names are class_0..class_{r.num_classes - 1} "
              "(pass --label-map FILE to name them)", file=sys.stderr)
    print(f"exported {model} to {r.output} ({r.architecture} arguments, {r.num_classes} classes); "
          f"load it with timm.create_model('local-dir:{r.output}', pretrained=True)")


def main(argv: list[str] | None = None) -> int:
    return run_job(ExportConfig, export, argv, prog="export")


if __name__ == "__main__":
    sys.exit(main())
