"""The ingest benchmark and the DirectRunner check still run and report what the README says."""
import io
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ingest_benchmark_prints_one_json_line_last():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ingest.py"), "--n", "2", "--repeats", "1",
                          "--megapixels", "2"], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "ingest_decode_resize_encode"
    assert set(report["results"]) == {"grain", "mosaic"}
    for corpus, results in report["results"].items():
        r = results["2MP"]
        assert report[f"speedup_vs_naive_{corpus}_2MP"] == r["speedup_vs_naive"] > 0
        for figure in ("project", "naive", "decode_only", "full_item", "entropy_decode"):
            assert r[f"{figure}_img_s_per_core"] > 0
        ratio = r["project_img_s_per_core"] / r["naive_img_s_per_core"]
        assert abs(r["speedup_vs_naive"] - ratio) < 0.02  # both sides are rounded
        assert 0 < r["entropy_share_of_project"] < 1  # the project decodes more than the 1/8-scale floor does
        assert 1.9 < r["megapixels"] < 2.1 and 0.1 < r["bytes_per_pixel"] < 1  # full frames of photographic JPEG
        # The entropy-only ceiling bounds the project's speed-up, and the two budgets agree with it.
        assert r["entropy_only_speedup_ceiling"] > r["speedup_vs_naive"]
        ms = r["ms_per_image"]
        assert r["project_beyond_entropy_ms"] > 0
        assert abs(r["project_beyond_entropy_ms"] - (ms["project"] - ms["entropy_floor"])) < 0.003  # all rounded
        assert abs(r["budget_beyond_entropy_for_3x_ms"] - (ms["naive"] / 3 - ms["entropy_floor"])) < 0.003
    assert report["machine"]["cpu"]["name"] and report["machine"]["cores"] >= 1


def test_ingest_benchmark_times_each_reader_against_the_folder_reader():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ingest.py"), "--readers", "--n", "2",
                          "--repeats", "1", "--megapixels", "1"], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    r = report["results"]["1MP"]
    assert report["benchmark"] == "ingest_readers" and r["folder_img_s_per_core"] > 0
    for name in ("webdataset", "hf_parquet"):
        assert abs(r[f"{name}_ratio_to_folder"] - r[f"{name}_img_s_per_core"] / r["folder_img_s_per_core"]) < 0.01


def test_mosaic_corpus_fills_the_frame_with_photographs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    from ingest import make_mosaics
    from PIL import Image

    datas = make_mosaics(4, 1.0)
    assert datas == make_mosaics(4, 1.0)  # deterministic
    for data in datas:
        img = Image.open(io.BytesIO(data))
        lum = np.asarray(img.convert("L"), dtype=np.float32)
        assert img.format == "JPEG" and abs(img.width * img.height - 1e6) < 3e3
        # No uncovered (black) strip at the right or bottom edge.
        assert lum[:, -8:].mean() > 10 and lum[-8:, :].mean() > 10


def test_direct_runner_check_runs_with_prepares_setting():
    out = subprocess.run([sys.executable, str(ROOT / "infra" / "beam" / "direct_runner_check.py"), "--runs", "1",
                          "--mode", "multi_threading", "--units", "4", "--payload-kb", "1", "--as-prepare"],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["as_prepare"] and report["elements_per_run"] == 64 and report["lost_per_run"] == [0]


def test_ingest_scale_benchmark_reports_the_slope_per_input_last(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ingest_scale.py"), "--sizes", "20,40",
                          "--size", "64", "--workers", "1", "--keep", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "ingest_scale" and report["figure"] == "slope_kb_per_input"
    assert [s["written"] for s in report["sizes"].values()] == [20, 40]
    assert all(s["peak_rss_mb"] >= s["peak_rss_mb_by_process"]["driver"] > 0 for s in report["sizes"].values())
    assert "slope_kb_per_input" in report and "extrapolated_imagenet_gb" in report
    for s in report["sizes"].values():
        # The resident set splits into anonymous, shared-memory and file-backed pages (each its own
        # peak, so within a sample's rounding of the whole); a Python process holds both of the others.
        assert 0 < s["peak_anon_mb"] < s["peak_rss_mb"] and 0 < s["peak_file_mb"] < s["peak_rss_mb"]
        assert s["peak_anon_mb"] + s["peak_shmem_mb"] + s["peak_file_mb"] >= s["peak_rss_mb"] - 2
        assert 0 < s["peak_pss_mb"] <= s["peak_rss_mb"] * 1.05  # status and smaps_rollup are read apart
        assert s["peak_mb_by_process_and_kind"]["driver"]["anon"] > 0
    for kind in ("anon", "shmem", "file", "pss"):
        assert isinstance(report[f"slope_{kind}_kb_per_input"], float)
    assert report["baseline"]["slope_kb_per_input"] == 15.0  # the figure, before the change


def test_chain_scale_benchmark_runs_dedup_pretrain_and_reads_after_the_ingest(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chain_scale.py"), "--sizes", "150,300",
                          "--test-size", "40", "--planted", "4", "--pretrain-steps", "2", "--size", "64",
                          "--workers", "1", "--rows", "50", "--keep", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "chain_scale" and set(report["sizes"]) == {"150", "300"}
    for n, run in report["sizes"].items():
        assert run["ingest"]["written"] == run["dedup"]["rows_scanned"] == int(n)
        assert run["dedup"]["test_images"] == {"test": 40}
        assert run["dedup"]["planted_found"] == 4  # every planted near-copy is found, at both sizes
        assert run["pretrain"]["steps"] == 2
        # The probe reads the set as dedup left it: the removed rows are gone.
        assert run["shardset"]["rows"] == int(n) - run["dedup"]["removed"]
        for step in ("ingest", "dedup", "pretrain", "shardset"):
            assert run[step]["peak_rss_mb"] > 0 and run[step]["peak_anon_mb"] > 0 and run[step]["peak_file_mb"] > 0
        assert run["pretrain"]["peak_mb_by_process_and_kind"]["ray"]["anon"] > 0  # the Ray workers, by name
        probe = run["shardset"]["after_rows"]
        assert probe["anon_mb"] + probe["shmem_mb"] + probe["file_mb"] == pytest.approx(probe["rss_mb"], abs=2)
    for kind in ("", "anon_", "shmem_", "file_", "pss_"):
        assert set(report[f"growth_{kind}kb_per_input"]) == {"ingest", "dedup", "pretrain", "shardset"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_benchmark_times_each_mode_against_the_default():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mmap_threshold.py"), "--repeats", "1",
                          "--steps", "2"], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "mmap_threshold" and report["baseline"] == "default"
    assert set(report["ms_per_step"]) == {"default", "pinned", "ceiling"}
    assert all(ms > 0 for ms in report["ms_per_step"].values())
