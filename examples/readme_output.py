"""Regenerate README.md's "What you see" block from a real run.

    python examples/readme_output.py                # a real run, then the README
    python examples/readme_output.py --render-only  # the README from the stored run

Runs `tpdiag compare --tp 1,2,4,8` with its output piped (as in a CI log), stores the run's
summary.json in examples/readme_run.json, and writes the printed text and the measured wall time
between the README's markers. tests/test_readme_output.py re-renders the stored summary with the
current code and fails when it no longer matches the README (the output format changed: rerun
this script).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["compare", "--tp", "1,2,4,8"]
RUN_DIR = "runs/readme"
STORED = os.path.join(ROOT, "examples", "readme_run.json")
BEGIN, END = "<!-- readme_output: begin -->", "<!-- readme_output: end -->"


def block(stored: dict) -> str:
    from tpdiag.cli.render import render_text

    m = stored["measured"]
    return (f"On a {m['machine']} (gloo, float32, `tiny-llama`), `tpdiag {' '.join(stored['args'])}`:\n\n"
            "```\n" + render_text(stored["summary"]) + "```\n\n"
            f"Wall time of that command: {m['wall_s']:.1f} s (measured by examples/readme_output.py on "
            f"{m['date']}, torch {m['torch']}). It runs one world per degree, a rerun of the reference, "
            "a second pass that re-executes the divergent modules in float64 (the `rounding at` lines: "
            "each first divergence and the modules after it, judged on their own inputs) and one "
            "confirmation rerun per divergent degree, one after another, so it grows with the number "
            "of degrees and with whatever else the machine is running (57 s once while another test "
            "suite ran)"
            + (" - the figure above was taken while several other jobs shared the two cores"
               if m["wall_s"] > 60 else "") + ".\n")


def splice(readme: str, text: str) -> str:
    a, b = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:a] + "\n" + text + readme[b:]


def write_readme(stored: dict) -> None:
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        readme = f.read()
    with open(path, "w") as f:
        f.write(splice(readme, block(stored)))


def main() -> None:
    if "--render-only" in sys.argv[1:]:  # the text around the block changed, not the run
        sys.path.insert(0, ROOT)
        with open(STORED) as f:
            write_readme(json.load(f))
        return
    out = os.path.join(ROOT, RUN_DIR)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tpdiag.cli", *ARGS, "--out", RUN_DIR], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"compare failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    summary["run_dir"] = RUN_DIR
    sys.path.insert(0, ROOT)
    from tpdiag.cli.render import render_text

    printed = "\n".join(line.rstrip() for line in p.stdout.splitlines()) + "\n"
    if printed != render_text(summary):
        sys.exit("the printed text differs from the summary rendered again: not writing the README")
    stored = {"args": ARGS, "summary": summary, "measured": {
        "wall_s": round(wall, 1), "date": time.strftime("%Y-%m-%d"), "torch": manifest["versions"]["torch"],
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU machine"}}
    with open(STORED, "w") as f:
        json.dump(stored, f, indent=1)
        f.write("\n")
    write_readme(stored)
    print(f"README.md updated ({wall:.1f} s run)")


if __name__ == "__main__":
    main()
