"""A run directory as pandas DataFrames: what `tpdiag.load(run_dir)` returns (api/load.py checks it first).

`records` is the one table of compared records: `compare` writes diff.csv from it
(`records_frame` + `write_diff_csv`) and the HTML report renders its records, module and
per-step tables from the frames `load` returns. pandas is imported here only, on first use,
so `import tpdiag` stays cheap.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tpdiag.errors import BadInput
from tpdiag.records.rundir import ROW_FIELDS, load_run, records_dir
from tpdiag.records.scored import scored_mask

_INT = ("idx", "step", "call", "max_ulp")
_FLOAT = ("max_abs", "max_rel", "mismatch_fraction", "bound")
_BOOL = ("bitwise", "rank_consistent", "beyond_bound")
# Columns `records` adds to diff.csv's: whether the record differs (bits or ranks), whether it
# is the degree's first divergence, and the cause summary.json names for it (the first
# divergence's, or a finding's), None for records that only inherit a difference.
EXTRA = ("divergent", "first", "cause")
_FINDING_KEY = ("step", "phase", "module", "kind", "name")


def _cell(k: str, v):
    if isinstance(v, list):
        return "x".join(map(str, v))  # a shape, as diff.csv spells it
    return v


def records_frame(rows: list[dict], summary: dict | None = None):
    """One row per compared record and degree: diff.csv's columns, typed (nullable Int64 and
    boolean where a value may be absent), plus `divergent`, `first` and `cause` from summary."""
    import pandas as pd

    data = {k: [_cell(k, r.get(k)) for r in rows] for k in ROW_FIELDS}
    df = pd.DataFrame(data, columns=list(ROW_FIELDS))
    for k in _INT:
        df[k] = pd.array(data[k], dtype="Int64")
    for k in _FLOAT:
        df[k] = pd.array([math.nan if v is None else float(v) for v in data[k]], dtype="float64")
    for k in _BOOL:
        df[k] = pd.array(data[k], dtype="boolean")
    for k in ROW_FIELDS:
        if k not in _INT + _FLOAT + _BOOL:
            df[k] = pd.Series([None if v is None else str(v) for v in data[k]], dtype=object)
    df["divergent"] = (~df["bitwise"].fillna(True) | ~df["rank_consistent"].fillna(True)).astype(bool)
    from tpdiag.records.axes import axis_of_entry, entries

    degrees = entries(summary)
    first_keys = {str(lab): (d.get("first_divergence") or {}).get("key")
                  for lab, d in degrees.items() if isinstance(d, dict)}
    df["first"] = [first_keys.get(str(lab)) == key and key is not None
                   for lab, key in zip(df["degree"], df["key"])]
    # the axis each compared configuration differs from the reference in (tp, micro_batch, ...)
    axes = {str(lab): axis_of_entry(lab, d) for lab, d in degrees.items()}
    df["axis"] = pd.Series([axes.get(str(lab), "tp") for lab in df["degree"]], dtype=object)
    causes = {}
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        for f in d.get("findings") or []:
            causes[(str(lab), *(f.get(k) for k in _FINDING_KEY))] = f.get("cause")
        fd = d.get("first_divergence") or {}
        if fd.get("key"):
            causes[(str(lab), fd["key"])] = fd.get("cause")
    df["cause"] = pd.Series(
        [causes.get((str(r.degree), r.key)) or causes.get(
            (str(r.degree), None if pd.isna(r.step) else int(r.step), r.phase, r.module, r.kind, r.name))
         for r in df[["degree", "key", "step", "phase", "module", "kind", "name"]].itertuples(index=False)],
        dtype=object)
    return df


def write_diff_csv(path: str, df) -> None:
    """diff.csv from the records frame: diff.csv's columns only, absent values empty, the
    csv module's line ends (what read_rows and earlier runs expect)."""
    from tpdiag.base import files as io

    text = df[list(ROW_FIELDS)].to_csv(index=False, lineterminator="\r\n")
    io.write_bytes(path, text.encode())


def rows_of(df) -> list[dict]:
    """The frame back as plain dicts (None for absent values), for code that renders rows."""
    import pandas as pd

    out = []
    for rec in df.to_dict("records"):
        out.append({k: (None if v is None or (not isinstance(v, (list, dict, str)) and pd.isna(v))
                        else v.item() if hasattr(v, "item") else v) for k, v in rec.items()})
    return out


def _table(entries: list[dict], first_cols: tuple[str, ...]):
    import pandas as pd

    cols = list(first_cols)
    for e in entries:
        cols += [k for k in e if k not in cols]
    return pd.DataFrame(entries, columns=cols)


@dataclass(frozen=True)
class Run:
    """A finished compare's run directory. Frames (one row per ...):

    records   compared record and degree (diff.csv + divergent/first/cause/axis/configuration)
    degrees   compared configuration: its name and axes (configuration, tp, micro_batch, mode, flags,
              attention, padding), status, first divergence and its cause, counts, loss,
              confirmation
    findings  degree and finding (records beyond their rounding bound, inconsistent replicas)
    steps     degree and optimizer step: loss, grad norm, parameter drift, bitwise
    logprobs  degree: how far the token logprobs moved (summary.json's statistics)
    """

    run_dir: str
    manifest: dict
    summary: dict
    reference: str
    records: object
    degrees: object
    findings: object
    steps: object
    logprobs: object

    def batch(self, step: int = 0) -> dict:
        """{name: tensor}: the batch the reference ran at `step` (input_ids, labels, or the names a
        Target's inputs gave), as recorded - what to feed your own model to check the logprobs."""
        from tpdiag.records.layout import assemble
        from tpdiag.records.store import RecordSet

        rs = RecordSet(records_dir(self.run_dir, self.manifest, self.reference))
        return {e["name"]: assemble(e, rs.tensor(e), None).full for e in rs.events
                if e["kind"] == "batch" and e["step"] == step}

    def token_logprobs(self, step: int = 0):
        """Per token: the reference's and each degree's logprob (read from the records)."""
        import pandas as pd
        import torch

        from tpdiag.records.layout import assemble
        from tpdiag.records.store import RecordSet

        def whole(rs: RecordSet, kind: str, name: str | None = None):
            m = next((e for e in rs.events if e["kind"] == kind and e["step"] == step
                      and (name is None or e["name"] == name)), None)
            return None if m is None else assemble(m, rs.tensor(m), None).full

        ref = RecordSet(records_dir(self.run_dir, self.manifest, self.reference))
        a = whole(ref, "logprobs")
        labels = whole(ref, "batch", "labels")
        parts = []
        from tpdiag.records.axes import entries

        for lab, d in entries(self.summary).items():
            if not isinstance(d, dict) or d.get("status") == "failed":
                continue
            b = whole(RecordSet(records_dir(self.run_dir, self.manifest, str(lab))), "logprobs")
            if a is None or b is None:
                continue
            a64, b64 = a.to(torch.float64).flatten(), b.to(torch.float64).flatten()
            n = a64.numel()
            # the logprobs record is flat (one per token of the batch): its rows are the labels'
            # (batch x positions); read from its own shape, a batch of 2 x 16 was one sequence of 32
            lab_ok = labels is not None and labels.dim() > 1 and labels.numel() == n
            seq = int(labels.shape[-1]) if lab_ok else (int(a.shape[-1]) if a.dim() > 1 else n)
            m = scored_mask(labels, a64)
            scored = m.tolist() if m is not None else [True] * n
            parts.append(pd.DataFrame({
                "degree": str(lab), "step": step, "sequence": [i // seq for i in range(n)],
                "position": [i % seq for i in range(n)], "scored": scored,
                # the token each logprob is of (the label; -100 where unscored): with run.batch()'s
                # input_ids, what a user's own logits are gathered at to check these bits
                "token": labels.flatten().tolist() if lab_ok else [None] * n,
                "reference": a64.tolist(), "value": b64.tolist(), "abs_diff": (b64 - a64).abs().tolist(),
                "bitwise": _bits(a).eq(_bits(b)).tolist()}))
        cols = ["degree", "step", "sequence", "position", "scored", "token", "reference", "value", "abs_diff",
                "bitwise"]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)


def _bits(t):
    """The raw bits of a float tensor, flattened: equal bits, not equal values (-0.0, NaN)."""
    import torch

    return t.contiguous().flatten().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def configuration_columns(manifest: dict, summary: dict, degrees: dict) -> dict:
    """{label: {'configuration': its folder name, 'tp': ..., 'micro_batch': ..., every axis}} of each
    compared configuration (tpdiag.base.configs): the axes its summary entry records, the others
    the reference's - the run's own fix and flags - for runs of any age (a TP-only run's entries
    record no axes: their labels are their degrees)."""
    from tpdiag.base.configs import AXES, Config, parse

    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    ref_cfg = summary.get("reference_config") if isinstance(summary.get("reference_config"), dict) else {}
    try:
        base = Config(int(ref_cfg.get("tp", summary.get("reference"))),
                      fix="+".join(cfg.get("fixes") or ()) or "none", flags=str(cfg.get("flags") or "deterministic"))
        base = base.with_(**{k: v for k, v in ref_cfg.items() if k in AXES})
    except (TypeError, ValueError):
        return {}
    out = {}
    for lab, d in degrees.items():
        try:
            c = parse(lab, base).with_(**{k: v for k, v in (d.get("config") or {}).items() if k in AXES})
        except BadInput:  # a label of a newer tpdiag: its columns stay empty
            continue
        # every axis but the fix: compare's fix is the run's own (manifest.json), and the frame's
        # `fix` column has always been the fix its confirmation tried
        out[str(lab)] = {"configuration": c.compare_name(base), **c.to_dict([a for a in AXES if a != "fix"])}
    return out


def read(run_dir: str) -> Run:
    """A finished compare's RUN_DIR as DataFrames, its evidence unchecked: a missing directory is
    BadInput, an unfinished run Inconclusive. `tpdiag.load` (api/load.py) and `tpdiag report` check
    the evidence too (an edited run is Inconclusive there)."""
    import pandas as pd

    manifest, summary, rows = load_run(run_dir)
    ref = str(summary.get("reference_label") or manifest.get("reference") or summary.get("reference"))
    from tpdiag.records.axes import axis_of_entry, entries

    degrees = {k: v for k, v in entries(summary).items() if isinstance(v, dict)}
    configs = configuration_columns(manifest, summary, degrees)
    rec = records_frame(rows, summary)
    rec["configuration"] = pd.Series([configs.get(str(lab), {}).get("configuration") for lab in rec["degree"]],
                                     dtype=object)
    deg, findings, steps, logprobs = [], [], [], []
    for lab, d in degrees.items():
        fd = d.get("first_divergence") or {}
        loss = d.get("loss") or {}
        conf = d["confirmation"] if isinstance(d.get("confirmation"), dict) else {}
        deg.append({"degree": lab, "axis": axis_of_entry(lab, d), **configs.get(str(lab), {}),
                    "status": d.get("status"), "cause": fd.get("cause"),
                    "first_module": fd.get("module"), "first_op": fd.get("op"), "first_phase": fd.get("phase"),
                    "first_key": fd.get("key"), "first_max_ulp": fd.get("max_ulp"),
                    "first_max_abs": fd.get("max_abs"), "n_records": d.get("n_records"),
                    "n_divergent": d.get("n_divergent"), "n_findings": len(d.get("findings") or []),
                    "loss_reference": loss.get("reference"), "loss": loss.get("value"),
                    "fix": conf.get("fix"), "confirmation": conf.get("verdict"),
                    "error": d.get("error")})
        findings += [{"degree": lab, **f} for f in d.get("findings") or []]
        if d.get("steps"):
            steps += [{"degree": lab, **s} for s in d["steps"]]
        elif d.get("status") != "failed":
            # One step: summary.json keeps its loss and grad norm beside the degree, and the
            # drift follows from the records as analyse's step_drift computes it.
            mine = rec[(rec["degree"] == lab) & (rec["step"] == 0)]
            gn = d.get("grad_norm") or {}
            steps.append({"degree": lab, "step": 0,
                          "bitwise": not bool(mine.loc[mine["phase"] != "init", "bitwise"].eq(False).any()),
                          "param_max_abs": float(mine.loc[mine["kind"] == "param", "max_abs"].fillna(0).max()
                                                 if (mine["kind"] == "param").any() else 0.0),
                          "loss_reference": loss.get("reference"), "loss": loss.get("value"),
                          "grad_norm_reference": gn.get("reference"), "grad_norm": gn.get("value")})
        if isinstance(d.get("logprobs"), dict):
            logprobs.append({"degree": lab, **d["logprobs"]})
    return Run(os.path.abspath(run_dir), manifest, summary, ref, rec,
               _table(deg, ("degree", "status", "cause")),
               _table(findings, ("degree", "step", "phase", "module", "kind", "name", "cause")),
               _table(steps, ("degree", "step", "bitwise")),
               _table(logprobs, ("degree", "bitwise", "max_abs", "mean_abs", "token_mult_prob_error", "tokens")))
