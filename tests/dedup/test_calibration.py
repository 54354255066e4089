import pytest

from dedup.calibration import HOLDOUT_PHOTOS, calibrate, main, plot, split_pool
from neardup.index import DEFAULT_THRESHOLD


def test_calibration_reports_every_transform_and_plots(tmp_path, tiles):
    images = tiles[::8][:30]
    cal = calibrate(images, transforms=["jpeg_q30", "grayscale", "crop_10_left"], thresholds=[0, 16, DEFAULT_THRESHOLD])
    assert cal.transforms == ["jpeg_q30", "grayscale", "crop_10_left"]
    assert cal.recall["grayscale"] == [1.0, 1.0, 1.0]  # luminance-only signature
    assert all(0 <= r <= 1 for rs in cal.recall.values() for r in rs)
    assert cal.overall_recall[0] <= cal.overall_recall[-1]
    assert cal.overall_fmr[-1] <= 1e-3
    png = plot(cal, tmp_path / "cal.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_holdout_split_keeps_each_source_photo_on_one_side(pool):
    design, held = split_pool(pool)
    source = lambda name: name.split("@")[0]  # noqa: E731
    assert {source(n) for n, _ in held} == set(HOLDOUT_PHOTOS)
    assert not {source(n) for n, _ in design} & {source(n) for n, _ in held}
    assert len(design) + len(held) == len(pool)
    with pytest.raises(ValueError, match="not in the pool"):
        split_pool(pool, ["nope.png"])


def test_random_transforms_are_sampled_repeatedly_and_plain_recall_bounds_the_rule(tiles):
    images = tiles[1::9][:20]
    cal = calibrate(images, transforms=["crop_random", "jpeg_q30"], thresholds=[8, DEFAULT_THRESHOLD], repeats=3)
    assert cal.positives == {"crop_random": 60, "jpeg_q30": 20}
    for t in cal.transforms:  # the block condition only removes matches
        assert all(p >= r for p, r in zip(cal.plain_recall[t], cal.recall[t]))
    assert "crop_random" in cal.transform_table(DEFAULT_THRESHOLD)


def test_cli_refuses_holdout_with_a_custom_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--source", str(tmp_path), "--holdout", "--no-mlflow"])
    assert "--holdout" in capsys.readouterr().err
