"""`tpdiag diff RUN_A RUN_B`: compare two captures with compare's own analysis.

Each side is an in-process capture (tpdiag.capture(model, out=DIR)) or one degree of a
`tpdiag compare` run (RUN_DIR/tpN): the second is how a user diffs the same run made on two
machines (an H100 and an H200, two driver or library versions) - docs/cross-machine.md.

RUN_A is the reference. Two sides are compared only when they can be: the same model
(parameter names, shapes up to sharding, dtypes), the same seed and the same capture options.
Anything else is refused with one line naming the first mismatch (NotComparable, exit 2) -
a diff of different models would name a 'first divergence' that is no divergence at all.
"""
from __future__ import annotations

import os
import time

from tpdiag.base import files as io
from tpdiag.errors import Inconclusive, NotComparable
from tpdiag.records.paths import WORLD, RunDir, rank_marker, world_file

CAPTURE_TOOL = "tpdiag.capture"


# What decides a compare world's numerics, beside the model: the runs must agree on all of it
# (the device, backend and library versions are what a cross-machine diff is about).
COMPARE_KEYS = ("dtype", "seed", "batch_size", "seq_len", "steps", "backward", "lr", "clip_norm",
                "fixes", "variant", "granularity", "op_include", "module_include")


# what must be equal for two same-degree sides to count as one setup run twice: the machine
# (compare's device info: host, CPU, GPU names - a capture records only "cuda:0", so captures
# never count), backend, library versions and numerics environment
SAME_SETUP = ("device_info", "backend", "versions", "env")


def read_side(path: str) -> dict:
    """A capture's manifest, or a compare run's degree directory (RUN_DIR/tpN) as one."""
    w = None if os.path.isfile(RunDir(path).manifest) else _compare_world(path)
    return read_compare_degree(path, w) if w is not None else read_capture(path)


def _compare_world(path: str) -> dict | None:
    """world.json of a compare world - it carries its WorldConfig (a capture's has no model
    spec): a capture that lost its manifest stays an incomplete capture, not a compare degree."""
    wpath = world_file(path, WORLD)
    if not os.path.isfile(wpath):
        return None
    try:
        w = io.read_json(wpath)
    except Exception:  # noqa: BLE001 - unreadable: read_capture says what is missing
        return None
    ok = isinstance(w, dict) and isinstance(w.get("config"), dict) and "model" in w["config"] and "label" in w
    return w if ok else None


def read_compare_degree(path: str, w: dict) -> dict:
    from tpdiag.records.rundir import read_manifest

    parent = os.path.dirname(os.path.abspath(path.rstrip(os.sep)))
    ranks = int(w.get("degree", 1))
    from tpdiag.records.markers import undone

    gone = undone(path, ranks)
    if gone:
        raise Inconclusive(f"{path}: rank {gone[0]} did not finish this world ({rank_marker(gone[0], 'done')} "
                           f"{gone[1]}); rerun the compare")
    try:
        m = read_manifest(parent)
    except Exception:  # noqa: BLE001 - a copied-out degree dir: its own world.json still says enough
        m = {}
    from tpdiag.records.nested import world_pass

    why = world_pass(path, w, m, parent)  # a world of a confirmation, a fix chain's round, a matrix variant
    if why:
        raise Inconclusive(why)
    cfg = w["config"]
    model = str(cfg.get("model", ""))
    # hf:/py: paths differ across machines: the directory's or file's name (and py:'s FUNC)
    # stands for the model
    name = model
    if model.startswith("hf:"):
        name = "hf:" + os.path.basename(model[3:].rstrip(os.sep))
    elif model.startswith("py:"):
        src, _, func = model[3:].rpartition(":")
        name = f"py:{os.path.basename(src)}:{func}"
    return {"tool": "tpdiag compare", "kind": "compare-degree", "degree": ranks,
            "world_size": ranks, "seed": cfg.get("seed"), "dtype": cfg.get("dtype"),
            "model": {"class": name}, "capture": w.get("capture"), "config": cfg,
            "device": w.get("device"), "device_info": m.get("device"), "backend": w.get("backend"),
            "versions": m.get("versions"), "env": m.get("env"), "created": m.get("started")}


def check_compare_comparable(a: dict, b: dict, name_a: str, name_b: str) -> None:
    def refuse(what: str, va, vb):
        raise NotComparable(f"runs not comparable: {what}: {va} in {name_a} vs {vb} in {name_b}")

    if a["model"]["class"] != b["model"]["class"]:
        refuse("model", a["model"]["class"], b["model"]["class"])
    if a.get("capture") != b.get("capture"):
        refuse("capture mode", a.get("capture"), b.get("capture"))
    for key in COMPARE_KEYS:
        va, vb = a["config"].get(key), b["config"].get(key)
        if va != vb:
            refuse(key, va, vb)
    from tpdiag.fixes import groups

    if groups.uses_groups(a["config"].get("fixes")):
        # the fixes reduce in a tree of G groups: another G (or group GEMM) is another order
        (ga, ka), (gb, kb) = groups.of_config(a["config"]), groups.of_config(b["config"])
        if ga != gb:
            refuse("tree groups", ga, gb)
        if ka != kb:
            refuse("group GEMM", ka, kb)


def read_capture(path: str) -> dict:
    if not os.path.isdir(path):
        raise Inconclusive(f"{path}: not a directory; expected a capture directory made by "
                           "tpdiag.capture(model, out=DIR)")
    mpath = RunDir(path).manifest
    if not os.path.isfile(mpath):
        raise Inconclusive(f"{path}: not a capture directory (no manifest.json) nor a compare "
                           "degree (RUN_DIR/tpN); make one with tpdiag.capture(model, out=DIR) in "
                           "your job - or it was interrupted (the manifest is written last)")
    m = io.read_json(mpath)
    if isinstance(m, dict) and m.get("tool") == "tpdiag compare":
        tps = ", ".join(RunDir(path).world(lab) for lab in m.get("labels") or ())
        raise Inconclusive(f"{path}: a tpdiag compare run directory: name one of its degrees "
                           f"({tps or 'RUN_DIR/tpN'}); tpdiag diff compares a degree of one run with "
                           "a degree of another, or two tpdiag.capture directories")
    if m.get("tool") != CAPTURE_TOOL or not m.get("complete"):
        raise Inconclusive(f"{mpath}: not a complete tpdiag.capture manifest")
    return m


def _fmt_shape(s) -> str:
    return "[" + ",".join(map(str, s)) + "]"


def _full_sizes(p: dict, degree: int, d: int) -> set[int]:
    n = p["shape"][d]
    # A plain tensor of unknown layout at TP > 1 is either replicated or this dim's shard.
    return {n, n * degree} if p.get("local") else {n}


def _shape_mismatch(pa: dict, pb: dict, da: int, db: int) -> bool:
    if len(pa["shape"]) != len(pb["shape"]):
        return True
    return any(not (_full_sizes(pa, da, d) & _full_sizes(pb, db, d)) for d in range(len(pa["shape"])))


def _refuse_lost_tie(a: dict, b: dict, name_a: str, name_b: str) -> None:
    """A parameter that is one weight shared by two modules in one capture and a weight of its own
    in the other: the tie was lost - `parallelize_module` gives each module it shards a new
    Parameter, so a weight tied before the plan is two weights after it (trained apart)."""
    from tpdiag.diff.weight_ties import split_pairs

    for (x, nx), (y, ny) in (((a, name_a), (b, name_b)), ((b, name_b), (a, name_a))):
        for first, alias in split_pairs(x, y):
            raise NotComparable(
                f"captures not comparable: parameter {alias!r}: the same weight as {first!r} "
                f"(tied) in {nx}, a weight of its own in {ny} (TP={y.get('degree', 1)}): the tie "
                "was lost there - parallelize_module puts a new Parameter in each module it "
                "shards, so weights tied before the plan are two weights after it; tie them "
                "after the plan (docs/capture.md, 'Tied embeddings')")


def check_comparable(a: dict, b: dict, name_a: str = "RUN_A", name_b: str = "RUN_B") -> list[list[str]]:
    """Raise NotComparable naming the first difference that makes a diff meaningless; return the
    weight ties the reference holds that b's plan split (lost_ties), which the diff names a finding."""
    def refuse(what: str, va, vb):
        raise NotComparable(f"captures not comparable: {what}: {va} in {name_a} vs {vb} in {name_b}")

    if a.get("schema") != b.get("schema"):
        refuse("capture schema", a.get("schema"), b.get("schema"))
    ca, cb = a["model"]["class"], b["model"]["class"]
    if ca != cb:
        refuse("model class", ca, cb)
    fa, fb = a["model"]["fingerprint"]["params"], b["model"]["fingerprint"]["params"]
    na, nb = list(fa), list(fb)
    from tpdiag.diff.weight_ties import lost_ties

    split = lost_ties(a, b) if na != nb else []
    if na != nb and not split:
        _refuse_lost_tie(a, b, name_a, name_b)
        missing = next((n for n in na if n not in fb), None)
        extra = next((n for n in nb if n not in fa), None)
        if missing is not None:
            refuse("parameter", repr(missing), "absent")
        if extra is not None:
            refuse("parameter", "absent", repr(extra))
        i = next(i for i, (x, y) in enumerate(zip(na, nb)) if x != y)
        refuse(f"parameter #{i}", repr(na[i]), repr(nb[i]))
    da, db = int(a.get("degree", 1)), int(b.get("degree", 1))
    for n in na:
        if fa[n]["dtype"] != fb[n]["dtype"]:
            refuse(f"dtype of {n}", fa[n]["dtype"], fb[n]["dtype"])
        if _shape_mismatch(fa[n], fb[n], da, db):
            refuse(f"shape of {n}", _fmt_shape(fa[n]["shape"]) + f" (TP={da})",
                   _fmt_shape(fb[n]["shape"]) + f" (TP={db})")
    if a.get("seed") != b.get("seed"):
        refuse("seed", *("not given" if m.get("seed") is None else m["seed"] for m in (a, b)))
    if a.get("dtype") != b.get("dtype"):
        refuse("dtype", a.get("dtype"), b.get("dtype"))
    for key in ("backward", "params", "modules", "steps"):
        va, vb = a.get("config", {}).get(key), b.get("config", {}).get(key)
        if va != vb:
            refuse(f"capture option {key}", va, vb)
    return split


def default_out(run_b: str) -> str:
    parent = os.path.dirname(os.path.abspath(run_b.rstrip(os.sep)))
    if os.path.isfile(world_file(run_b, WORLD)) and os.path.isfile(RunDir(parent).manifest):
        parent = os.path.dirname(parent)  # beside the compare run, not inside it
    return os.path.join(parent, "diff-" + time.strftime("%Y%m%d-%H%M%S"))


def diff_runs(run_a: str, run_b: str, out: str | None = None) -> dict:
    """Analyse capture B against reference capture A; write summary.json, diff.csv and
    manifest.json into `out`. Returns the summary (schema 1, as `tpdiag compare` writes it)."""
    from tpdiag.config import degree_labels
    from tpdiag.diff.analyse import SCHEMA, analyse_degree, same_degree, write_csv
    from tpdiag.records.store import RecordSet
    from tpdiag.records.provenance import versions

    out = out or default_out(run_b)
    if os.path.abspath(out) in {os.path.abspath(run_a), os.path.abspath(run_b)}:
        from tpdiag.errors import BadInput

        raise BadInput(f"--out {out!r}: is one of the two inputs; name a new directory")
    from tpdiag.records.run_files import check_out

    check_out(out, "tpdiag diff")  # before the analysis: a compare run or capture there is refused
    ma, mb = read_side(run_a), read_side(run_b)
    kinds = {m.get("kind", "capture") for m in (ma, mb)}
    if len(kinds) > 1:
        raise NotComparable(f"not comparable: {run_a} is a {ma.get('kind', 'capture')} and {run_b} a "
                            f"{mb.get('kind', 'capture')} (their records are keyed differently); "
                            "diff two compare degrees (RUN_DIR/tpN) or two captures")
    split = []
    if kinds == {"compare-degree"}:
        check_compare_comparable(ma, mb, run_a, run_b)
    else:
        split = check_comparable(ma, mb, run_a, run_b)
    da, db = int(ma["degree"]), int(mb["degree"])
    ref_label, label = degree_labels((da, db))
    # the compared side's float64 re-executions (tpdiag.capture(oracle=...) at both degrees, one
    # script) are no records to compare: only the reference's judge (diff/oracle.py)
    ref, other = RecordSet(run_a), RecordSet(run_b, drop_kinds=("oracle",))
    from tpdiag.records.hashing import check_same_hash_version

    check_same_hash_version(ref.hash_version, other.hash_version, run_a, run_b)
    entry, rows = analyse_degree(ref, other, label, split_ties=split)
    if split and not any(f.get("split_tie") for f in entry["findings"]):
        # no weight grad of the tie was compared (a capture without backward or parameters): nothing
        # shows the split, so the pair stays refused as before
        _refuse_lost_tie(ma, mb, run_a, run_b)
    if da == db and all(ma.get(k) is not None and ma.get(k) == mb.get(k) for k in SAME_SETUP):
        # the same layout, machine kind and software twice: a difference is run-to-run noise,
        # not a layout cause (across machines it may be the machine: left as located)
        same_degree(entry, label, da)
    summary = {"schema": SCHEMA, "status": entry["status"], "reference": da,
               "reference_label": ref_label, "degrees": {label: entry},
               "runs": {"reference": os.path.abspath(run_a), label: os.path.abspath(run_b)}}
    if kinds == {"capture"}:
        # the advice follows the source: a capture user turns fixes on with tpdiag.invariant in
        # their own loop; `tpdiag compare --fix` runs only models tpdiag builds
        summary["source"] = "capture"
    from tpdiag.diff.classes import add_classes

    add_classes(summary)
    if kinds == {"capture"}:
        from tpdiag.diff.capture_oracle import mark_unjudged

        mark_unjudged(summary, ref, run_a)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        from tpdiag.errors import BadInput

        raise BadInput(f"--out {out!r}: cannot create it ({io.why_unwritable(os.path.join(out, 'x'), e)})") from None
    write_csv(RunDir(out).diff_csv, rows)
    from tpdiag.records.run_files import write_manifest, write_summary

    write_summary(out, summary)
    write_manifest(out, {
        "schema": 1, "tool": "tpdiag diff", "versions": versions("cpu"),
        "runs": {ref_label: os.path.abspath(run_a), label: os.path.abspath(run_b)},
        "degrees": [da, db], "labels": [ref_label, label], "reference": ref_label,
        "seed": ma.get("seed"), "dtype": ma.get("dtype"), "model": ma["model"]["class"],
        # what a compare manifest's header shows: the device kind and backend, both sides'
        "device": {"type": _both(_device_type(ma), _device_type(mb))},
        "backend": _both(ma.get("backend"), mb.get("backend")),
        "captures": {ref_label: _brief(ma), label: _brief(mb)}, "status": summary["status"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    summary["run_dir"] = out
    return summary


def _device_type(m: dict) -> str | None:
    d = m.get("device")
    d = d.get("type") if isinstance(d, dict) else d
    return str(d).split(":")[0] if d else None


def _both(a, b):
    return a if a == b else f"{a} vs {b}"


def _brief(m: dict) -> dict:
    return {k: m.get(k) for k in ("degree", "world_size", "backend", "device", "versions", "env",
                                  "created", "config")}
