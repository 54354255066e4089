from dedup.calibration import DEFAULT_THRESHOLD, calibrate, plot


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
