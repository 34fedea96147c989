"""Rerun a finished compare's second-pass diffs offline - the region diff, then the own-input diff
after it, in one process with the compare's per-session memos (diff/pair_memo.py,
records/checked.py) as `tpdiag compare` has them - and time or profile them; no world runs.

    PYTHONPATH=TREE python3 benchmarks/second_pass_diff.py RUN_DIR WORK_DIR [--profile]

WORK_DIR gets a copy of RUN_DIR/region whose record files are hard links (nothing in RUN_DIR is
written). Prints each diff's wall and process CPU seconds, with --profile cProfile's top entries
(WORK_DIR/prof.out), and whether each diff.csv and summary.json came out as the compare wrote them
(summary.json less `slice`, which compare_pass adds after the diff): the same check, with two trees,
shows a change to the diff kept every verdict and record byte. Run it with TREE = a `git archive`
of the commit before a change and TREE = the change, on the same RUN_DIR, one after the other.
On a loaded host with torch's intra-op threads the CPU seconds are mostly threads waiting
(docs/scale.md): set OMP_NUM_THREADS=1 for an A/B.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

SUBS = ("region", "region/ops")


def _link_copy(src: str, dst: str) -> None:
    os.makedirs(dst)
    for name in os.listdir(src):
        p = os.path.join(src, name)
        if os.path.isdir(p):
            if name == "ops" or name.startswith("tp"):
                _link_copy(p, os.path.join(dst, name))
        elif name.endswith((".safetensors", ".jsonl", ".done")) or name in ("world.json", "result.json",
                                                                           "manifest.json"):
            os.link(p, os.path.join(dst, name))


def _diff(d: str) -> tuple[dict, float, float]:
    from tpdiag.config import CompareConfig
    from tpdiag.diff.analyse import analyse_run

    m = json.load(open(os.path.join(d, "manifest.json")))
    cfg = CompareConfig.from_dict(m["config"])
    configs = cfg.worlds()
    labels = [w.label for w in configs]
    # a world linked from the region pass is read without its op records, as the compare read it
    without = tuple(k for k, v in m["worlds"].items() if v.get("records_read") == "without its op records")
    t, c = time.perf_counter(), time.process_time()
    s = analyse_run(d, labels[0], labels[1:], {}, cfg.degrees[0], None, axes={w.label: w for w in configs},
                    without_ops=without)
    return s, time.perf_counter() - t, time.process_time() - c


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    src, work, profile = argv[0], argv[1], "--profile" in argv[2:]
    if not os.path.isdir(os.path.join(src, "region")):
        print(f"{src}: no region/ (a compare whose second pass ran)")
        return 2
    if os.path.exists(work):
        shutil.rmtree(work)
    _link_copy(os.path.join(src, "region"), os.path.join(work, "region"))
    from tpdiag.diff import pair_memo
    from tpdiag.records import checked

    subs = [s for s in SUBS if os.path.isfile(os.path.join(src, s, "manifest.json"))]
    out: dict = {}

    def run() -> None:
        with pair_memo.session(), checked.session():
            for sub in subs:
                out[sub] = _diff(os.path.join(work, sub))
                print(f"{sub}: diff {out[sub][1]:.2f} s wall, {out[sub][2]:.2f} s CPU", flush=True)

    if profile:
        import cProfile
        import pstats

        cProfile.runctx("run()", globals(), locals(), os.path.join(work, "prof.out"))
        pstats.Stats(os.path.join(work, "prof.out")).sort_stats("cumulative").print_stats(40)
    else:
        run()
    same = True
    for sub in subs:
        a = open(os.path.join(src, sub, "diff.csv"), "rb").read()
        b = open(os.path.join(work, sub, "diff.csv"), "rb").read()
        was = json.load(open(os.path.join(src, sub, "summary.json")))
        was.pop("slice", None)
        now = json.loads(json.dumps(out[sub][0], default=str))
        now.pop("slice", None)
        print(f"{sub}: diff.csv {'same' if a == b else 'DIFFERS'}, summary.json {'same' if was == now else 'DIFFERS'}")
        same = same and a == b and was == now
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
