"""`tpdiag report`: one self-contained HTML file; failed degrees render; broken run dirs exit 2."""
import base64
import csv
import json
import os
import re
import shutil
import subprocess

import pytest
from conftest import run_cli

from tpdiag.records.rundir import ROW_FIELDS

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tp12_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    p = run_cli("report", str(tp12_run), "-o", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert str(out) in p.stdout
    return out


def _first_module(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["degrees"]["2"]["first_divergence"]["module"]


def test_report_is_self_contained(report, tp12_run):
    html = report.read_text()
    assert _first_module(tp12_run) in html
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(script|link|iframe)[^>]+(src|href)=", html)
    srcs = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", html)
    assert len(srcs) >= 4  # divergence, heatmap, ULP histogram, logprobs
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert "What to do" in html and "token_mult_prob_error" in html
    # a TP-only run's tables name degrees as ever (tests/test_configs.py: other axes)
    assert "Degree x module" in html and "max ULP TP=2" in html


def test_default_output_is_in_the_run_dir(tp12_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run)
    p = run_cli("report", str(run))
    assert p.returncode == 0, p.stderr
    assert (run / "report.html").is_file()


def test_failed_degree_still_renders(tp12_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run)
    s = json.loads((run / "summary.json").read_text())
    s["status"] = "inconclusive"
    s["degrees"]["2"] = {"status": "failed", "error": "rank 1 died (exit code 7) <boom>"}
    (run / "summary.json").write_text(json.dumps(s))
    m = json.loads((run / "manifest.json").read_text())
    m["status"] = "inconclusive"  # compare's last write: the summary's status (a manifest saying otherwise is an edit)
    (run / "manifest.json").write_text(json.dumps(m))
    p = run_cli("report", str(run), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "r.html").read_text()
    assert "rank 1 died (exit code 7) &lt;boom&gt;" in html  # shown, and escaped


def test_broken_run_dir_is_exit_2(tp12_run, tmp_path):
    p = run_cli("report", str(tmp_path / "nope"))
    assert p.returncode == 2 and "not a directory" in p.stderr and "Traceback" not in p.stderr
    run = tmp_path / "run"
    shutil.copytree(tp12_run, run)
    (run / "summary.json").write_text('{"schema": 1, "deg')
    p = run_cli("report", str(run))
    assert p.returncode == 2 and "summary.json" in p.stderr and p.stderr.strip().count("\n") == 0


def test_hundreds_of_modules_without_records(tmp_path):
    """Only the verdict files (no tp*/ records): renders, says records are unreadable, caps the tables."""
    from tpdiag.reports.html import MAX_RECORD_ROWS, write_report

    run = tmp_path / "big"
    run.mkdir()
    mods = [f"layers.{i // 4}.block.w{i % 4}" for i in range(400)]
    rows = []
    for lab in ("2", "4"):
        for i in range(MAX_RECORD_ROWS + 200):
            m = mods[i % len(mods)]
            div = i >= 37
            rows.append({"degree": lab, "idx": i, "key": f"s0/forward/{m}/out#{i}/0", "step": 0, "phase": "forward",
                         "module": m, "kind": "out", "call": i, "name": "0", "cls": "Linear", "style": "rowwise",
                         "layout": "replicate", "dtype": "float32", "shape": "4x4", "bitwise": not div,
                         "rank_consistent": True, "max_abs": 1e-7 * i if div else 0.0, "max_rel": 0.0,
                         "max_ulp": 3 * i if div else 0, "mismatch_fraction": 0.5 if div else 0.0})
    with open(run / "diff.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    fd = {"phase": "forward", "module": mods[37], "op": None, "kind": "out", "name": "0", "step": 0,
          "key": rows[37]["key"], "cause": "row-parallel-reduction", "max_abs": 3.7e-6, "max_ulp": 111,
          "mismatch_fraction": 0.5, "bound": 1e-5}
    deg = {"status": "divergent", "first_divergence": fd, "findings": [], "confirmation": None}
    (run / "summary.json").write_text(json.dumps({"schema": 1, "status": "divergent", "reference": 1,
                                                  "reference_label": "1", "degrees": {"2": deg, "4": deg}}))
    manifest = {"model": "synthetic", "labels": ["1", "2", "4"], "reference": "1"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    html = open(write_report(str(run))).read()
    assert "Records could not be read back" in html
    assert f"showing {MAX_RECORD_ROWS}" in html
    assert mods[37] in html


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(not _chromium(), reason="chromium not installed (CI installs it: apt-get install -y chromium)")
def test_report_in_headless_chromium(report, tp12_run, tmp_path):
    args = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--window-size=1280,900"]
    url = f"file://{report}"
    shot = tmp_path / "shot.png"
    p = subprocess.run(args + [f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), p.stderr[-2000:]
    d = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    for log in (p.stderr, d.stderr):
        console = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
        assert not console, console
    # The script ran: it hid the bitwise rows of the records table ("only divergent" is on by default).
    assert 'style="display: none;"' in d.stdout and _first_module(tp12_run) in d.stdout
    from matplotlib.image import imread

    px = imread(str(shot))
    assert px.shape[0] == 900 and px.shape[1] == 1280
    rgb = (px[..., :3] * 255).astype("uint8").reshape(-1, 3)
    colours = {tuple(c) for c in rgb[:: 97]}
    assert len(colours) > 20  # text, badges and cards drawn, not a blank page
    assert (rgb < 128).any(axis=1).mean() > 0.005


@pytest.mark.parametrize("degrees", [1, 3])
def test_heatmap_fits_long_module_names(degrees):
    """An hf: model's names ('model.layers.0.self_attn.o_proj') rotated under a one-row heatmap:
    the figure was 2 inches tall, constrained layout collapsed the axes and `tpdiag report`
    printed matplotlib's 'constrained_layout not applied' warning (tpdiag compare --model hf:DIR
    --tp 1,2, then tpdiag report)."""
    import warnings

    from tpdiag.reports import plots

    mods = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in range(2) for m in
                                     ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj",
                                      "post_attention_layernorm", "mlp.gate_proj", "mlp.down_proj")]
    labels = [str(2 ** (i + 1)) for i in range(degrees)]
    vals = [[0.0] * 3 + [float(j) for j in range(len(mods) - 3)] for _ in labels]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        uri = plots.module_heatmap(labels, mods, vals, {"2": mods[3]})
    assert base64.b64decode(uri.split(",", 1)[1]).startswith(PNG)
