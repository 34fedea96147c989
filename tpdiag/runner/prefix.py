"""Decode reruns on the first positions only: the region pass and the confirmation of a decode
configuration run the prompt call and the first one-token calls, not all of them.

A decode world is sequential and host-bound (llama-1b at batch 1 on an H100: 26 ms a call
unprobed, ~55 ms probed), so at 1 x 2048 each of the default flow's three passes paid ~1,000
calls. The first pass still runs every call and finds the first divergent record over all
positions; the reruns then run positions [0, n) with n = the prompt + DECODE_SELFCHECK_CALLS:
  - the decode world makes exactly the first calls of the whole run (the same prompt, the same
    cache): its records are the whole run's first n positions, bit for bit (the same property
    the decode self-check rests on);
  - the prefill reference runs the whole sequence, as in the first pass, and records the first
    n positions of every record the first pass's decode world placed along the sequence (its
    dim and rows: probes/pieces.place), its batch, and its logits, logprobs and loss computed on
    those positions (the decode world's are);
  - full capture's records the reference did not cut (ops of the region pass) are cut by the
    diff, by the decode record's own place (meta "positions").
The rerun is used only where it reproduces the first pass's first divergence on those positions
(else the region pass runs every position again); the confirmation then runs the same
positions, and says so.
"""
from __future__ import annotations

from tpdiag.config import CompareConfig
from tpdiag.records.paths import WORLD, RunDir


def region_positions(cfg: CompareConfig, labels: list[str]) -> int:
    """n for a rerun of these decode configurations on their first positions, 0 for the whole
    sequence (n would not be shorter, the reference is not a TP=1 prefill, or a target is not a
    TP=1 decode configuration)."""
    from tpdiag.runner.decode import DECODE_SELFCHECK_CALLS, default_prompt_len

    worlds = cfg.worlds()
    points = {w.label: w.point for w in worlds}
    ref = worlds[0].point
    if ref.tp != 1 or ref.mode != "prefill" or ref.micro_batch or cfg.backward:
        return 0
    # TP = 1 decode worlds only: a TP shard of a cut record is not placed against the whole yet
    if not labels or any(points.get(lab) is None or points[lab].mode != "decode"
                         or points[lab].tp != 1 for lab in labels):
        return 0
    n = default_prompt_len(cfg.seq_len) + DECODE_SELFCHECK_CALLS
    return n if n < cfg.seq_len else 0


def prefix_map(decode_dir: str, seq_len: int) -> dict:
    """key -> (sequence dim, rows, L) of an earlier decode world's records placed along the
    sequence, and of the batch's token ids and labels ([B, L]: dim 1)."""
    from tpdiag.records.store import read_index

    _, events = read_index(decode_dir)
    out = {}
    for m in events:
        shape = m.get("full_shape") or m.get("local_shape") or []
        if m.get("piece_dim") is not None:
            out[m["key"]] = (m["piece_dim"], m.get("piece_fold") or 1, seq_len)
        elif m["kind"] == "batch" and len(shape) >= 2 and shape[1] == seq_len:
            out[m["key"]] = (1, 1, seq_len)
    return out


def setup(cfg, rec, batch, labels, prompt_len, L: int):
    """The world's batch, labels and prompt length for a run of cfg.rerun.positions positions: a
    decode world keeps the first n tokens (the whole sequence's prompt length); the reference
    records the first n positions of prefix_from's placed records."""
    import torch

    n = cfg.rerun.positions
    if not n or not isinstance(batch, torch.Tensor) or not L:
        return batch, labels, prompt_len
    if cfg.mode == "decode":
        from tpdiag.runner.decode import default_prompt_len

        rec.piece_prefix = (n, L)
        return batch[:, :n], labels[:, :n], prompt_len or default_prompt_len(L)
    if cfg.rerun.prefix_from:
        rec.prefix = prefix_map(cfg.rerun.prefix_from, L)
        rec.prefix_n = n
    return batch, labels, prompt_len


def cut_loss_inputs(cfg, logits, local_logits, labels):
    """The reference's logits and labels for its loss-phase records on a run of the first
    positions: the decode world's logprobs and loss are over those positions only."""
    n = cfg.rerun.positions
    if not n or cfg.mode != "prefill" or not cfg.rerun.prefix_from:
        return logits, local_logits, labels
    return logits[:, :n], local_logits[:, :n], labels[:, :n]


def reproduces(run_dir: str, sub_dir: str, labels, every: dict, sub_every: dict) -> bool:
    """Whether a rerun on the first positions stands for the whole run: for every target, the
    same first divergence, the same logits over those positions as pass 1's decode world (the
    hash both probed runs took for their self-checks), and every record the first pass found
    different that the rerun recorded too different again - a divergence past the first
    positions (a late bug beside an early rounding difference) must not vanish from the findings
    and the verdict."""
    from tpdiag.base import files as io
    from tpdiag.records.rundir import read_rows

    for lab in labels:
        fd, sfd = every[lab].get("first_divergence") or {}, sub_every.get(lab, {}).get("first_divergence") or {}
        if not fd or sfd.get("key") != fd.get("key"):
            return False
        try:
            a, b = (io.read_json(RunDir(d).world_file(lab, WORLD)).get("probe_selfcheck") or {}
                    for d in (run_dir, sub_dir))
        except Exception:
            return False
        if not a.get("logits_hash") or (a.get("positions"), a.get("logits_hash")) != (
                b.get("positions"), b.get("logits_hash")):
            return False
    try:
        before = read_rows(RunDir(run_dir).diff_csv)
        after = read_rows(RunDir(sub_dir).diff_csv)
    except Exception:  # no evidence that the first positions hold every difference
        return False
    again = {(r["degree"], r["key"]): r["bitwise"] for r in after}
    wanted = set(labels)
    # the loss is a mean over the positions: on the first ones it is another value, not a part
    return all(again.get((r["degree"], r["key"])) is not True
               for r in before if r["degree"] in wanted and r["bitwise"] is False and r["kind"] != "loss")


def decode_dir(run_dir: str, label: str) -> str:
    """A configuration's world directory in a run directory."""
    return RunDir(run_dir).world(label)
