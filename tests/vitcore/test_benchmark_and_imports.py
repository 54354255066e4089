import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_benchmark_prints_one_json_line_last():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vit_step.py"), "--variants", "mu/16",
                          "--img-size", "32", "--batch", "2", "--steps", "1", "--warmup", "0", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    r = report["results"]["mu/16"]
    assert report["benchmark"] == "vit_step" and r["ours_img_s"] > 0 and r["reference_img_s"] > 0
    assert r["speedup"] == round(r["ours_img_s"] / r["reference_img_s"], 3)
    assert r["max_abs_logit_diff_fp32"] < 1e-4  # the baseline computes the same function


def test_vitcore_imports_no_ray_beam_or_mlflow():
    code = ("import sys, vitcore, vitcore.inspection; "
            "print([m for m in sys.modules if m.split('.')[0] in ('ray', 'apache_beam', 'mlflow')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    pattern = re.compile(r"^\s*(import|from)\s+(ray|apache_beam|mlflow)\b", re.M)
    offenders = [p.name for p in (ROOT / "vitcore").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
