"""A capture's layouts, plans and process group (api/capture.py): the user's plan and layouts read
and checked, which ranks record and over which device they gather, the records' layouts, and the
model fingerprint that lets `tpdiag diff` refuse captures that cannot be compared."""
from __future__ import annotations

import fnmatch

import torch

from tpdiag.errors import BadInput

# String plans (transformers' tp_plan names or tpdiag's labels) -> the torch style whose label
# tpdiag's classifier reads. Used for labels only: a capture never applies a plan.
_STYLE_WORDS = {
    "colwise": "colwise", "colwise_rep": "colwise", "colwise_gather_output": "colwise",
    "packed_colwise": "colwise", "embedding_colwise": "colwise",
    "colwise-gathered": "colwise-gathered",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "rowwise_split_input": "rowwise",
    "packed_rowwise": "rowwise", "embedding_rowwise": "rowwise",
    "sequence": "sequence", "sequence_parallel": "sequence",
}


def check_layout(key: str, value: str) -> str:
    v = str(value).strip().lower()
    if v == "replicate":
        return v
    if v.startswith("shard:"):
        try:
            int(v.split(":", 1)[1])
            return v
        except ValueError:
            pass
    raise BadInput(f"capture(layouts={{{key!r}: {value!r}}}): expected 'shard:D' or 'replicate'")


# Style names with no label of tpdiag's (transformers' and tpdiag's own hf plans, and transformers
# 4.x's local_* names): a plan of model.tp_plan passes them through unlabelled, never refused.
_NO_LABEL = {"all_reduce", "ep_dispatch_experts", "grouped_gemm", "local_params", "mla_kv_a_proj",
             "moe_identity_expert", "moe_tp_experts", "replicate", "replicated_with_grad_allreduce",
             "replicated_once", "colwise_gather_input", "local", "gather", "isolated", "ep_router",
             "local_colwise", "local_rowwise", "local_packed_rowwise", "local_packed_colwise"}


def _transformers_words() -> set:
    try:
        from transformers.integrations.tensor_parallel import ParallelInterface

        return set(ParallelInterface._global_mapping)
    except Exception:  # noqa: BLE001 - no transformers (or another layout of it): our table alone
        return set()


def _typo_of(word: str) -> str | None:
    """The label word `word` misspells ('colwsie' -> 'colwise'), or None. A misspelt style was
    dropped without a word: its module then had no layout label, which the cause classification
    reads (docs/capture.md: `row-parallel-reduction` needs to know a module is row-parallel)."""
    import difflib

    if word in _STYLE_WORDS or word in _NO_LABEL:
        return None
    close = difflib.get_close_matches(word, list(_STYLE_WORDS), n=1, cutoff=0.8)
    return close[0] if close and word not in _transformers_words() else None


def style_plan(plan: dict) -> dict:
    out = {}
    for k, v in plan.items():
        if isinstance(v, str):
            word = _STYLE_WORDS.get(v.strip().lower())
            typo = None if word is not None else _typo_of(v.strip().lower())
            if typo is not None:
                raise BadInput(f"capture(plan={{{k!r}: {v!r}}}): unknown style name; did you mean {typo!r}? "
                               f"(labelled: {', '.join(sorted(_STYLE_WORDS))}; transformers' other names "
                               "pass unlabelled)")
            if word is not None:
                out[k] = _style_for(word)
        else:
            out[k] = v
    return out


def _style_for(word: str):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel,
            "colwise-gathered": lambda: ColwiseParallel(input_layouts=Shard(-1))}[word]()


def plan_label(style) -> str | None:
    from tpdiag.records.styles import style_label

    return style_label(style)


def group_of(group):
    if group is None:
        return None
    if type(group).__name__ == "DeviceMesh":
        if group.ndim != 1:
            raise BadInput(f"capture(group=mesh): the mesh has {group.ndim} dims; pass the TP "
                           "dimension, e.g. mesh['tp']")
        return group.get_group()
    return group


def records_here(group) -> bool:
    """Whether this rank records: every rank of the default group, else the ranks of the one
    TP group that holds global rank 0 (one capture per job, not one per data-parallel replica)."""
    import torch.distributed as dist

    if not dist.is_initialized() or group is None:
        return True
    ranks = dist.get_process_group_ranks(group)
    return dist.get_rank() in ranks and 0 in ranks


def collective_device(group) -> torch.device:
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def included(model, globs) -> set[str] | None:
    if not globs:
        return None
    from tpdiag.records.keys import root_record_name

    root = root_record_name(n for n, _ in model.named_children())  # as probes/model_walk.Walk names it
    names = {(n or root) for n, _ in model.named_modules()}
    return {n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)}


def _layout_for(meta: dict, layouts: dict[str, str]) -> str | None:
    if meta["kind"] in ("out", "grad_out"):
        name = meta["module"]
    elif meta["kind"] in ("param_init", "param", "param_grad"):
        name = f"{meta['module']}.{meta['name']}"
    else:
        return None
    for pattern, layout in layouts.items():
        if fnmatch.fnmatchcase(name, pattern):
            return layout
    return None


def apply_layouts(records, layouts: dict[str, str]) -> None:
    """Give plain-tensor records the user's layout (a DTensor's own placement always wins)."""
    if not layouts:
        return
    for meta, t in records:
        if meta.get("placement") is not None:
            continue
        lay = _layout_for(meta, layouts)
        if lay and lay.startswith("shard:") and t.dim():
            lay = f"shard:{int(lay.split(':')[1]) % t.dim()}"
        if lay:
            meta["placement"] = lay


def fingerprint(model, layouts: dict[str, str], degree: int) -> dict:
    """Param names, global shapes (DTensor, or a plain shard with a layout) and dtypes."""
    from torch.distributed.tensor import DTensor

    from tpdiag.records.keys import root_record_name

    # the root's own parameters under the name their records have ("(root)" above HF's `model` child)
    root = root_record_name(n for n, _ in model.named_children())
    params = {}
    for name, p in model.named_parameters():
        shape, local = list(p.shape), False
        if not isinstance(p, DTensor):
            mname, _, short = name.rpartition(".")
            lay = _layout_for({"kind": "param", "module": mname or root, "name": short}, layouts)
            if lay and lay.startswith("shard:") and p.dim():
                shape[int(lay.split(":")[1]) % p.dim()] *= degree
            elif lay != "replicate":
                local = degree > 1  # a plain tensor at TP > 1 may be a shard: shape is local
        params[name] = {"shape": shape, "dtype": str(p.dtype).replace("torch.", ""), "local": local}
    # A weight shared by two modules is listed once; its other names are kept so that a tie one
    # run has and the other lost (a plan's new Parameter in one of the modules) is named as such.
    first = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return {"n_params": len(params), "params": params, "tied": tied}
