"""Compare every record of one degree against the reference, in execution order."""
from __future__ import annotations

from dataclasses import dataclass, field

from tpdiag.diff import flat_rows, flip_shares, measure, op_streams, pair_memo, partials, rank_local, reassembled
from tpdiag.diff.bits import masks_with_inf
from tpdiag.diff.pair_read import read_pair as _read_pair  # noqa: F401  (tests replace it here)
from tpdiag.diff.left_out import _inside_block, per_piece_blocks, per_rank_blocks
from tpdiag.diff.pair_assemble import assemble_pair, pair_tensors
from tpdiag.diff.packed_shards import PackedShards
from tpdiag.errors import NotComparable, ShortOfWhole
from tpdiag.records.layout import assemble, first_positions, local_shape, vocab_padded, vocab_padded_dim
from tpdiag.records.keys import OPT_F64, ROOTS
from tpdiag.records.store import RecordSet


@dataclass
class DegreeDiff:
    label: str
    rows: list[dict]
    unmatched: list[str]             # keys present at this degree only
    missing: list[str]               # keys present at the reference only
    tensors: dict = field(default_factory=dict)  # key -> (ref_full, other_full), for bounds/plots
    uncompared: list = field(default_factory=list)  # op records with no reference value (metas)
    # the reference's float64 re-executions (diff/oracle.py): record key -> float64 tensor, and
    # what its world noted (refusals, discrete choices) by oracle key
    oracle: dict = field(default_factory=dict)
    oracle_notes: dict = field(default_factory=dict)
    # what the reference world noted about its re-executions from THIS side's inputs (the own-input
    # pass: refusals, and "params": "this side's" where it ran them from this side's parameters)
    oracle_notes_own: dict = field(default_factory=dict)
    grad_in: dict = field(default_factory=dict)  # (step, module, input index) -> [float64 per call]
    # the same from THIS side's own inputs (diff/own_inputs.py): record key -> float64 tensor
    oracle_own: dict = field(default_factory=dict)
    grad_in_own: dict = field(default_factory=dict)
    # a child's output grad in its parent's float64 backward (probes/oracle_hooks.TAP), from the
    # reference's inputs and from this side's: (step, child, its call in the parent's call, output
    # index, the parent's call) -> float64
    grad_at: dict = field(default_factory=dict)
    grad_at_own: dict = field(default_factory=dict)
    # record key -> [||o||, ||y_ref - o||] of the reference's own re-execution o, where its world
    # kept only those (probes/oracle_hooks.NORMS: the inputs differed at every other world)
    oracle_norms: dict = field(default_factory=dict)
    # record key -> the figures of the reference's re-execution o_n from THIS side's inputs against
    # this side's record, where its world kept those (probes/own_side_norms.py), and the lane mix
    # their hash of that record is in
    oracle_own_norms: dict = field(default_factory=dict)
    hash_version: int | None = None
    _equal_index: dict | None = None  # diff/equal_inputs._index's lookups, built once
    _started: tuple | None = None  # diff/written_state._started's, built once
    _reexec: tuple | None = None  # diff/written_state._reexecuted's, built once
    # the reference's float64 re-executions noted the other modules' buffers each call read
    # (probes/float64.module_oracle's notes["reads"]; diff/written_state.read_after)
    oracle_reads_noted: bool = False
    _partials_ix: tuple | None = None  # diff/rank_partials._index's, built once
    _weight_rows: tuple | None = None  # diff/rank_partials._cut_weight's, built once
    world: int = 0  # the ranks whose partials this side sums (locate.add_bounds sets it)
    # record key -> its checked pair's content key (diff/pair_memo.py), where both sides have one
    contents: dict = field(default_factory=dict)
    # buffer record key -> (step, module) of the float64 re-execution its oracle value came from
    # (the nearest re-executed module holding the buffer: its owner where that was re-executed)
    oracle_writer: dict = field(default_factory=dict)
    captured: bool = False  # a diff of captures (tpdiag.capture): the user's own loss and optimizer
    # the trainer's logprob recipe the logprobs took (world.json config: logprob, trainer_temperature,
    # temperature_in; runner/recipe.py): their bound's (diff/loss_bounds.py); {} the default
    recipe: dict = field(default_factory=dict)
    # the first record the ranks hold only part of (records/layout.ShortOfWhole): {key, why}; every
    # record after it is left uncompared (diff/shape_break.py names it a finding)
    shape_break: dict | None = None
    # the steps re-anchored at the reference's state whose rows diff_degree marked `anchored`: their
    # forwards read the reference's weights at both sides (diff/anchored.read_pair)
    anchored: frozenset = frozenset()


def _recipe(world) -> dict:
    """The logprob recipe a world's config names, where it is not the default (config.py leaves the
    default's keys out: an older world.json reads as the default)."""
    cfg = (world.get("config") or {}) if isinstance(world, dict) else {}
    keys = ("logprob", "trainer_temperature", "temperature_in")
    return {k: cfg[k] for k in keys if k in cfg}


def _in_flight(op_name: str) -> bool:
    if op_name.startswith("c10d::"):
        # an in-place collective of user code (dist.all_reduce): the op returns before its work
        # completes, so the recorded copy holds the rank's partial or the result, by timing
        return True
    return op_name.startswith("_c10d_functional::") and not op_name.startswith("_c10d_functional::wait_tensor")


def _hash_row(rm: dict, om: dict, label: str, values: bool = True):
    """(row, None) comparing two hash-mode records by their whole-tensor hashes, or (None, why)."""
    if rm.get("stored") != om.get("stored"):
        return None, "captured as a hash at one side only"
    if rm.get("full_hash") is None or om.get("full_hash") is None:
        if "stale" in (rm.get("hash_layout"), om.get("hash_layout")):
            return None, "changed in place before its queued hash ran (TPDIAG_HASH_BATCH=1 hashes at once)"
        return None, "shard layout unknown in hash mode"
    if rm["dtype"] != om["dtype"] or rm["full_shape"] != om["full_shape"]:
        if om["kind"] == "op":
            return None, "no reference op of the same shape"
        raise NotComparable(f"TP={label}: {om['key']}: {rm['dtype']}{rm['full_shape']} at the "
                            f"reference vs {om['dtype']}{om['full_shape']}")
    row = {k: om.get(k) for k in ("idx", "key", "step", "phase", "module", "kind", "call", "name",
                                 "cls", "style", "dtype")}
    sa, sb = rm["stats"], om["stats"]
    layout = om.get("hash_layout")
    row.update(degree=label, layout=layout, shape=list(om["full_shape"]), hash_only=True,
               rank_consistent=(om.get("ranks_equal") if om.get("world", 1) > 1
                                and not (layout or "").startswith(("shard:", "strided:")) else None),
               consumers=om.get("consumers"), bitwise=rm["full_hash"] == om["full_hash"],
               max_abs=None, max_rel=None, max_ulp=None, mismatch_fraction=None, bound=None,
               beyond_bound=None, nonfinite_mismatch=sa["nonfinite"] != sb["nonfinite"])
    if values and not masks_with_inf(row) and (sa["nonfinite"] or sb["nonfinite"]) and not row["nonfinite_mismatch"]:
        # the hash's statistics count NaN and Inf together, so a record whose -inf may be a mask (an
        # attention mask, a masked vocabulary's logits) is judged where it reaches a loss, a gradient
        # or an update
        row.update(nonfinite_mismatch=True, bitwise=False)
    if row["nonfinite_mismatch"]:
        row["nonfinite_side"] = ("both" if sa["nonfinite"] and sb["nonfinite"]
                                 else "reference" if sa["nonfinite"] else "degree")
    if not row["bitwise"]:
        na, nb = sa["sumsq"] ** 0.5, sb["sumsq"] ** 0.5
        # |(|b| - |a|)| / |a| <= |b - a| / |a|: a lower bound on the relative error, from statistics
        row["norm_rel_diff"] = abs(nb - na) / na if na > 0 else (0.0 if nb == 0 else float("inf"))
    return row, None


def _after_flip(rows: list[dict]) -> bool:
    from tpdiag.diff.router import flipped

    return any(flipped(r) for r in rows)



def diff_degree(ref: RecordSet, other: RecordSet, label: str, keep=None, values: bool = True) -> DegreeDiff:
    """keep(meta) -> bool: which assembled pairs to keep in memory (for bounds and plots).
    values: judge NaN/Inf held at both sides as findings (False for a reference rerun, whose question
    is only whether the bits reproduce)."""
    rows, unmatched, uncompared = [], [], []
    tensors, contents = {}, {}
    ref_values = None  # diff/reassembled.index(ref), built at the first op only this degree runs
    seen = set()
    oracle_metas = [m for m in ref.events if m["kind"] == "oracle"]
    other_algorithm = op_streams.other_algorithm(ref, other)
    # a capture has no float64 re-execution to judge its records past the first divergence
    captured = any(rs.world.get("tool") == "tpdiag.capture" for rs in (ref, other))
    shape_break = None
    flips = flip_shares.Flips()  # the router flips so far: a share grad behind one is judged on the other rows
    packed = PackedShards()  # hand-cut packed weights (gate|up), learned at init
    updates = None
    if captured and values:
        from tpdiag.diff.scale import Updates

        updates = Updates()  # the user's own optimizer: its update judged by one factor
    for om in other.events:
        key = om["key"]
        if om["kind"] == OPT_F64:
            continue  # each side's own float64 re-execution of its optimizer step (diff/optim_own.py)
        rm = ref.by_key.get(key)
        if rm is None:
            unmatched.append(key)
            if om["kind"] == "op":
                extra = {**om, "why": "only at this degree"}
                if ref.hash_version == other.hash_version and om.get("ranks_equal") is True:
                    if ref_values is None:
                        ref_values = reassembled.index(ref)
                    same = reassembled.same_as(om, ref_values)
                    if same:
                        extra["same_as"] = same
                uncompared.append(extra)
            continue
        seen.add(key)
        if shape_break is not None:
            # past a record that holds part of the reference's: what follows was computed from it at
            # this degree (or by a plan already shown wrong) - no comparison of it is evidence either way
            uncompared.append({**om, "why": f"past the first record the ranks hold only part of ({shape_break['key']})"})
            continue
        if om["kind"] == "op" and key in other_algorithm:
            # the n-th add of one algorithm is not the n-th add of another: the phase's own records
            # (loss, logprobs, grad norm, params) compare what both computed
            uncompared.append({**om, "why": "the degrees ran other ops in this phase (another algorithm)"})
            continue
        if any((p or "").startswith("partial") for p in (om.get("placement"), rm.get("placement"))):
            # an unreduced partial sum (a DTensor op before its all-reduce) is not a value of
            # the reference's computation; its reduced result is compared where it appears
            uncompared.append({**om, "why": "unreduced partial sum"})
            continue
        if om["kind"] == "op" and _in_flight(om["name"]):
            # a collective's own record: in-place c10d ones hold the partial or the result, by
            # timing; functional ones (waited for before recording since session 8; earlier runs
            # recorded them in flight) duplicate wait_tensor's, which is compared
            uncompared.append({**om, "why": "collective output before wait_tensor"})
            continue
        if "hash" in (om.get("stored"), rm.get("stored")):
            if vocab_padded_dim(rm, local_shape(rm), om, ref.world.get("vocab_padding"),
                                other.world.get("vocab_padding")) is not None:
                # its ranks' hashes are of shards no hash rule places in the padded whole: compared
                # where values are captured (the region pass), and through the logits and the loss
                uncompared.append({**om, "why": "a padded vocab shard (Megatron's padding differs with TP): "
                                                "hashes cannot be gathered"})
                continue
            try:
                row, why = _hash_row(rm, om, label, values)
            except NotComparable:
                if not _after_flip(rows):
                    raise
                row, why = None, "after a router flip: expert token counts differ"
            if row is None:
                uncompared.append({**om, "why": why})
            else:
                flips.note(row)
                rows.append(row)
            continue
        try:
            rt, ot = _read_pair(ref, rm, other, om)
            flat = flat_rows.rows_of(om, rm, other, ref) if om["kind"] == "op" else None
            if flat is not None:
                # an op on a sequence shard's flattened rows: put back as its module's activation is,
                # unless the ranks' blocks stacked are the nearer (rows flattened position-major)
                ra, oa = flat_rows.nearer(lambda: assemble_pair(rm, rt, om, ot),
                                          (assemble(rm, rt, flat[1]), flat_rows.assemble_rows(ot, flat)))
            else:
                ra, oa = vocab_padded(rm, rt, om, ot, ref.world.get("vocab_padding"),
                                      other.world.get("vocab_padding")) or assemble_pair(rm, rt, om, ot)
                oa = packed.regather(om, ra, oa)
            a, b = pair_tensors(ra, oa)
            a = first_positions(a, b, om.get("positions"))
            if om["kind"] == "op" and (a.shape != b.shape or a.dtype != b.dtype):
                raise NotComparable("shapes differ")
        except NotComparable as e:
            if om["kind"] == "op":
                # op sequences differ between degrees (fixes, redistributes): an op whose
                # occurrence lines up with a different reference op is left uncompared
                uncompared.append({**om, "why": "no reference op of the same shape"})
                continue
            if _after_flip(rows):
                uncompared.append({**om, "why": "after a router flip: expert token counts differ"})
                continue
            if isinstance(e, ShortOfWhole) and not om.get("positions"):
                # no rounding changes a shape: the ranks computed part of what the reference did here
                shape_break = {"key": key, "why": str(e), "idx": om["idx"]}
                uncompared.append({**om, "why": "the ranks hold only part of the reference's record"})
                continue
            raise NotComparable(f"TP={label}: {e}") from None
        if om["kind"] == "op" and oa.rank_consistent is False and not om.get("placement"):
            # an op on plain local tensors (inside a fixed kernel or hand-written TP code: no
            # DTensor placement) whose ranks hold different numbers computed each rank's own part
            # - a column group, a partial sum - not copies of one replica; its occurrence at TP=1
            # is one part of the whole. Were the module's output wrong, its own record says so.
            uncompared.append({**om, "why": "each rank computed its own part (an op on local tensors, "
                                            "no placement to gather it by)"})
            continue
        row = {k: om.get(k) for k in ("idx", "key", "step", "phase", "module", "kind", "call", "name",
                                     "cls", "style", "dtype")}
        row["degree"] = label
        row["layout"] = oa.layout
        row["shape"] = list(b.shape)
        row["rank_consistent"] = oa.rank_consistent
        row["consumers"] = om.get("consumers")
        if om.get("at"):
            row["at"] = om["at"]  # an op's line in the user's code (probes/op_probe.py)
        if om.get("positions"):
            row["positions"] = om["positions"]  # a decode run of the first positions (runner/prefix.py)
        if (a.shape != b.shape or a.dtype != b.dtype) and _after_flip(rows):
            uncompared.append({**om, "why": "after a router flip: expert token counts differ"})
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            raise NotComparable(f"TP={label}: {key}: {a.dtype}{list(a.shape)} at the reference vs "
                                f"{b.dtype}{list(b.shape)}")
        # both tensors were checked (pair_read.py): a pair of the same content measured earlier in
        # this process (the region pass's, diffed again by the own-input pass) is not measured again
        # what besides the two records' bytes and entries decides the pair assembled and measured: a
        # gate re-diffs a run's every pass in one memo (gate/once.py), whose worlds may differ in these
        content = pair_memo.pair_key(ref, rm, other, om, values, captured,
                                     pair_memo.context(ref.world.get("vocab_padding"),
                                                       other.world.get("vocab_padding"), flat,
                                                       packed.of(om)))
        measured = pair_memo.get(content)
        if measured is None:
            before = dict(row)
            # the grad of an output no module consumed (the logits of the user's own loss): nothing
            # bounds or re-executes it in compare, and a hand-written vocab-parallel loss whose
            # backward scales every grad (its loss through Megatron's copy by mistake) read as the
            # vocab-parallel softmax's rounding; a grad with a consumer is judged from it instead
            measure.measure(row, a, b, oa, values, captured or (row["phase"] == "backward" and row["kind"] == "grad_out"
                                                           and not row.get("consumers")))
            measured = {k: v for k, v in row.items() if k not in before or v is not before[k]}
            pair_memo.put(content, measured)
        row.update(measured)
        flips.note(row, a, b)
        if oa.rank_consistent is False:
            flips.mark(row, a, oa.shards)
        if updates is not None and om["kind"] in ("param_init", "param") and not row.get("nonfinite_mismatch"):
            updates.judge(row, a, b)
        if content is not None:
            contents[key] = content
        if oa.rank_consistent is False:
            if om["phase"] == "forward":
                # the ranks' bytes: a module output that is the very input its consumer reduces
                # (partials.reduced_outputs) is told by them - shares that add up to the reference, or
                # at a step whose weights differ any (partials.updated_steps: they add up to this side's sum)
                row["shares_hash"] = (om.get("hash"), om.get("stored_hash"))
            if row.get("rank_partial_sum") and om["kind"] == "grad_out":
                # an activation grad each rank holds as its share of a sum reduced later in
                # backward (the rope path behind MLA's kv_a_proj, whose style all-reduces it):
                # a partial, not a replica; left uncompared as DTensor partials are - were it
                # never reduced, the grads computed from it would show it
                uncompared.append({**om, "why": "unreduced partial sum (the ranks' copies add up "
                                                "to the reference)"})
                continue
        rows.append(row)
        if keep is None or keep(om):
            tensors[key] = (a, b)
    from tpdiag.records.anchor import anchored_steps

    anchored = anchored_steps(other.world)
    marked = set()
    for row in rows if anchored else ():
        if isinstance(row.get("step"), int) and row["step"] in anchored:
            row["anchored"] = True  # its forward read the reference's weights (diff/anchored.py)
            marked.add(row["step"])
    partials.reduced(rows, tensors, uncompared)
    partials.reduced_outputs(rows, tensors, uncompared)
    partials.reduced_after_backward(rows, tensors, uncompared)
    partials.drifted_grad_shares(rows, uncompared)
    rank_local.inside_combined(rows, tensors, uncompared)
    if shape_break is not None:
        # every row is of a record before the break (all after it are uncompared): the first that
        # differed, if any, is a rounding difference a shape the model computes from values may follow
        shape_break["after"] = next((r["key"] for r in rows if not r["bitwise"] or r.get("rank_consistent") is False),
                                    None)
    # a forward-only world (a decode configuration beside a reference that ran the whole step)
    # has no backward or optimizer records to miss
    skip = () if (other.world.get("config") or {}).get("backward", True) else ("backward", "optimizer")
    per_rank = {**per_rank_blocks(other), **per_piece_blocks(other)}
    missing = [m["key"] for m in ref.events if m["key"] not in seen and m["kind"] not in ("oracle", OPT_F64)
               and m["phase"] not in skip and not _inside_block(m, per_rank)]
    dd = DegreeDiff(label, rows, unmatched, missing, tensors, uncompared, contents=contents,
                    hash_version=ref.hash_version, captured=captured, recipe=_recipe(other.world),
                    shape_break=shape_break, anchored=frozenset(marked))
    if oracle_metas:
        from tpdiag.diff.oracle_load import load

        load(dd, ref, oracle_metas, label)
    _mark_piece_state(rows, ref.world, other.world)
    notes = ref.world.get("oracle_notes") if isinstance(ref.world, dict) else None
    if isinstance(notes, dict):
        dd.oracle_notes = notes
    own_notes = ref.world.get("oracle_notes_own") if isinstance(ref.world, dict) else None
    if isinstance(own_notes, dict) and isinstance(own_notes.get(label), dict):
        dd.oracle_notes_own = own_notes[label]
    dd.oracle_reads_noted = isinstance(ref.world, dict) and ref.world.get("oracle_reads_noted") is True
    if shape_break is not None:
        from tpdiag.diff import shape_break as breaks

        breaks.settle(dd, ref)  # a break after a difference that is a bug all the same (its `by`)
    return dd


def _mark_piece_state(rows: list[dict], ref_world, other_world) -> None:
    """A forward record of a module holding a buffer that a micro-batch's forward wrote before a
    later micro-batch of the step ran (world.json piece_state, runner/step.py): row["piece_state"]
    names the buffers and the side(s) whose later pieces read them. Such a piece reads what the one
    before it wrote, where one call over the whole batch read the value the step started with - a
    real difference between micro-batch sizes, which "depends on the other rows of its call" misnamed
    (an FP8 amax written by every forward)."""
    sides = [(w.get("piece_state") or {}) if isinstance(w, dict) else {} for w in (ref_world, other_world)]
    if not any(sides):
        return
    for r in rows:
        if r["phase"] != "forward":
            continue
        m = r["module"]
        hit = {}
        for label, state in zip(("at the reference", "in this configuration"), sides):
            for b in state.get(str(r["step"])) or ():
                if m in ROOTS or b.startswith(m + "."):
                    hit.setdefault(b, []).append(label)
        if hit:
            r["piece_state"] = {b: hit[b] for b in sorted(hit)}

