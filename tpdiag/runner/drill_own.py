"""The second pass's bookkeeping around its reruns (runner/drill.py): which finding a second-pass
finding follows, which own-input modules are left to judge after a confirmation, a first-pass
layout-bound finding the own-input re-execution found within rounding, the own-input files a rerun
reads, and whether a rerun computed another step than pass 1."""
from __future__ import annotations

import json
import os

from tpdiag.records.paths import RunDir


def inside_consumer(f: dict, findings: list) -> dict | None:
    """The bug a grad_out finding follows where the one module whose backward computed it holds a
    bug-class finding inside it (an MLP whose down projection is wrong hands its norm a wrong
    grad): that finding leads, as a parent's output follows its child's in locate.py."""
    from tpdiag.records.causes import cause_class
    from tpdiag.records.keys import sole_consumer

    from tpdiag.records.keys import ROOTS

    c = sole_consumer(f.get("consumers")) if f.get("kind") == "grad_out" else None
    # a grad judged by its enclosing module's float64 backward (diff/enclosing.py) follows a bug
    # inside that module: the re-execution runs the buggy child's correct math, so every grad the
    # backward passes through it moves with it (a wrong down projection moves the grads of the
    # up/gate outputs its MLP's own code multiplies, and of the attention the block's residual reads)
    c = c or (f.get("enclosing") if f.get("kind") == "grad_out" else None)
    if c is None:
        return None
    return next((g for g in findings if g is not f and "follows" not in g and g.get("step") == f.get("step")
                 and cause_class(g.get("cause")) == "bug" and isinstance(g.get("module"), str)
                 and g["module"] != f.get("module")
                 and (c in ROOTS or g["module"] == c or g["module"].startswith(c + "."))), None)




def own_left(region: dict, targets, sub_labels, confirmed: dict) -> dict | None:
    """The region pass's summary with each configuration's own-input modules cut to those its
    confirming fix left divergent (all of them where no fix confirmed a rounding cause); None when
    no module is left to judge."""
    from tpdiag.records.axes import entries
    from tpdiag.records.causes import cause_class
    from tpdiag.records.rundir import read_rows

    every, sub_every, left = entries(confirmed), entries(region), False
    for (label, _), sub_label in zip(targets, sub_labels[1:]):
        sub_entry = sub_every.get(sub_label) or {}
        mods = list(sub_entry.get("own_inputs") or [])
        conf = (every.get(label) or {}).get("confirmation") or {}
        fd = (every.get(label) or {}).get("first_divergence") or {}
        if mods and conf.get("verdict") == "confirmed" and cause_class(fd.get("cause")) == "rounding" \
                and conf.get("run_dir") and os.path.exists(RunDir(conf["run_dir"]).diff_csv):
            rows = [r for r in read_rows(RunDir(conf["run_dir"]).diff_csv) if r["degree"] == label]
            if rows or conf.get("status_after") == "bitwise":
                moved = {r["module"] for r in rows if r["bitwise"] is not True or r.get("rank_consistent") is False}
                mods = [m for m in mods if m in moved]
        sub_entry["own_inputs"] = mods
        left = left or bool(mods)
    return region if left else None




def near_on_own_inputs(entry: dict, sub_dir: str, sub_label: str) -> None:
    """A first-pass finding from a layout bound (which assumed equal inputs) that the second pass,
    re-executing its module in float64 from this side's own inputs, found within rounding (the
    same record no longer beyond its bound there): not a bug."""
    from tpdiag.records.rundir import read_rows

    path = RunDir(sub_dir).diff_csv
    if not os.path.exists(path):
        return
    near = {r["key"] for r in read_rows(path) if r["degree"] == sub_label and r.get("beyond_bound") is False}
    from tpdiag.diff.judge import settle

    fd = entry.get("first_divergence") or {}
    for f in entry.get("findings") or []:
        if f.get("key") in near and "from" not in f and \
                settle(f, own_near=fd.get("cause")).rule == "within rounding on its own inputs":
            f["follows"] = f.get("follows") or fd.get("key")




def own_files(run_dir: str, ref_label: str, own: dict, sub_label: dict, taps: dict | None = None) -> tuple:
    """Each target world's whole inputs and output grads of its own-input modules, from pass 1's
    records, in a file the second pass's reference reads (keyed by the label it has there). Every
    target has one, empty where it judges none: the reference keeps only the norms of its own
    re-execution of a module whose inputs differ at every world it is compared with
    (probes/oracle_hooks.inputs_differ), so it must see every one.
    taps: {label: the children whose output grads the modules' float64 backwards tap
    (diff/own_inputs.taps)}, in each file's metadata (probes/module_probe.py reads it); a label
    without a list (a summary from before it) leaves its file without, and every child tapped."""
    from safetensors.torch import save_file

    from tpdiag.diff.own_inputs import side_inputs
    from tpdiag.probes import own_side_norms

    # with their weight grads: the reference keeps its float64 weight grads from these inputs as
    # norms against them (probes/own_side_norms.py; TPDIAG_OWN_SIDE_NORMS=0: whole, nothing shipped)
    grads = own_side_norms.enabled()
    out = []
    for lab in sub_label:
        mods = own.get(lab) or ()
        tensors = side_inputs(RunDir(run_dir).world(ref_label), RunDir(run_dir).world(lab), set(mods),
                              grads=grads) if mods else {}
        if mods:
            # and their subtrees' parameters where this side's differ (from step 1 on: its own update),
            # for the reference to re-execute them from (diff/own_params.py)
            from tpdiag.diff.own_params import side_params

            tensors.update(side_params(RunDir(run_dir).world(ref_label), RunDir(run_dir).world(lab), set(mods)))
        path = RunDir(run_dir).own_inputs(lab)
        # TPDIAG_OWN_TAPS=0: every child tapped, as before (the A/B: tests/test_own_taps.py)
        wanted = None if taps is None or os.environ.get("TPDIAG_OWN_TAPS", "1") == "0" else taps.get(lab, [])
        save_file(tensors, path, metadata=None if wanted is None else {"taps": json.dumps(sorted(wanted))})
        out.append((sub_label[lab], path))
    return tuple(out)




def step_differs(run_dir: str, label: str, sub_dir: str, sub_label: str, keys=None) -> str | None:
    """Where the region pass's world first computed another step than pass 1's at the same
    degree (runner/fingerprint.py), with its TP label; None when every rank's fingerprint
    matches."""
    from tpdiag.base import files as io
    from tpdiag.records.paths import WORLD
    from tpdiag.runner.fingerprint import first_difference

    try:
        a = io.read_json(RunDir(run_dir).world_file(label, WORLD)).get("fingerprint")
        b = io.read_json(RunDir(sub_dir).world_file(sub_label, WORLD)).get("fingerprint")
    except Exception:  # a failed world wrote no world.json: its own status says why (below)
        return None
    if keys and a and b:
        a, b = ([{k: v for k, v in (f or {}).items() if k in keys} for f in x] for x in (a, b))
    where = first_difference(a, b)
    return f"TP={label} {where}" if where else None
