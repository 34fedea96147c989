"""Does one world's step record the same in two tpdiag trees? (issue 62 item 5: the step split
keeps every record.) same_rundirs.py runs one step per compare; this runs runner.step.run in
process at TP=1 on cases it does not: two steps at op granularity with micro-batches, forward
only, a fix with one sequence per piece, decode - and compares every record's key, order and
hash, and the step fingerprint.

    python3 benchmarks/same_step_records.py OLD_TREE NEW_TREE
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CASES = [dict(granularity="op", steps=2, micro_batch=2, batch_size=4, seq_len=8),
         dict(granularity="op", steps=2, batch_size=2, seq_len=8, backward=False),
         dict(granularity="module", steps=2, micro_batch=1, batch_size=2, seq_len=8, fixes=["invariant-gemm"]),
         dict(granularity="op", steps=1, batch_size=1, seq_len=8, mode="decode", backward=False)]

CHILD = r"""
import json, sys, tempfile, torch
from tpdiag.config import WorldConfig
from tpdiag.probes.recorder import Recorder
from tpdiag.records.hashing import tensor_hash
from tpdiag.runner import step
from tpdiag.runner.determinism import setup
out = []
for kw in json.loads(sys.argv[2]):
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
    setup(1234, "cpu")
    # WorldConfig.of: the nested config (flat keys); a tree before it took them directly
    cfg = getattr(WorldConfig, "of", WorldConfig)(model="tiny-llama", degree=1, label="1", out_dir=tempfile.mkdtemp(), capture="full",
                      layers=1, **kw)
    rec = Recorder()
    step.run(cfg, torch.device("cpu"), 1, rec, fingerprint=True)
    # each record's own bits, hashed here (a full-capture record is held on the host: .get())
    recs = [[m["key"], m.get("hash"), None if v is None else
             tensor_hash(v if isinstance(v, torch.Tensor) else v.get())] for m, v in rec.records]
    out.append({"records": recs, "fingerprint": json.dumps(rec.fingerprint, sort_keys=True, default=str)})
json.dump(out, open(sys.argv[1], "w"))
"""


def _run(tree: str) -> list:
    tree = os.path.abspath(tree)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-c", CHILD, f.name, json.dumps(CASES)], check=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": tree})
        with open(f.name) as g:
            return json.load(g)


def main(argv: list[str]) -> int:
    old, new = _run(argv[1]), _run(argv[2])
    bad = 0
    for case, a, b in zip(CASES, old, new):
        same = a == b
        print(f"{case}: {len(a['records'])} records, {'same' if same else 'DIFFERENT'}")
        if not same:
            bad += 1
            ka, kb = {tuple(r) for r in a["records"]}, {tuple(r) for r in b["records"]}
            print(f"  only old: {sorted(ka - kb)[:5]}\n  only new: {sorted(kb - ka)[:5]}"
                  f"\n  fingerprint {'same' if a['fingerprint'] == b['fingerprint'] else 'different'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
