"""Everything compare checks before a world starts (bad input costs nothing): the device, the
memory preflight, the axes, attention and padding choices."""
from __future__ import annotations

import os

from tpdiag.config import CompareConfig
from tpdiag.errors import BadInput, EnvironmentProblem


def resolve_device(device: str, degrees) -> str:
    import torch

    need = max(degrees)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= need else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentProblem("--device cuda: no CUDA device is available here; use --device cpu")
        if torch.cuda.device_count() < need:
            raise EnvironmentProblem(f"--device cuda: TP={need} needs {need} GPUs, "
                                     f"{torch.cuda.device_count()} visible")
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise EnvironmentProblem("--device cuda: this torch build has no NCCL")
    else:
        import torch.distributed as dist

        if not dist.is_gloo_available():
            raise EnvironmentProblem("--device cpu: this torch build has no gloo backend")
    return device


def validate(cfg: CompareConfig) -> dict:
    """Everything checkable before a world starts: bad input costs nothing. Returns the memory
    preflight (models/preflight.py) for the manifest."""
    from tpdiag.models.spec import check_degrees, parse_spec

    spec = parse_spec(cfg.model, cfg.layers)
    # the axes need no model: checked before anything that builds one (an hf: plan check imports
    # transformers and builds the model on the meta device - seconds on a busy machine)
    check_axes(cfg, spec)
    if cfg.layers:
        from tpdiag.models.capacity import model_dims
        from tpdiag.models.slice import check_layers

        check_layers(spec, cfg.layers, model_dims(spec).get("total_layers") if spec.kind != "py" else None)
    check_degrees(spec, cfg.degrees)
    _check_sdpa(cfg, spec)
    from tpdiag.models.precheck import check_plan

    check_plan(spec, cfg.degrees, cfg.variant)
    from tpdiag.fixes.registry import catalogue

    checks = [f.check_plan for n, f in catalogue().items() if n in cfg.fixes and f.check_plan]
    if spec.kind == "hf" and checks and max(cfg.degrees) > 1:
        from tpdiag.models.precheck import hf_base_plan

        base = hf_base_plan(spec.value)[1]
        for check in checks:  # a layout a fix does not cover (MoE experts): one line, no world
            check(base)
    if cfg.steps < 1:
        raise BadInput(f"--steps {cfg.steps}: must be >= 1")
    from tpdiag.runner.recipe import parse

    parse(cfg.logprob, cfg.trainer_temperature, cfg.temperature_in, cfg.logprob_compiled)  # built without the CLI
    import math

    if not math.isfinite(cfg.timeout) or cfg.timeout <= 0 or cfg.timeout > 7 * 86400:
        raise BadInput(f"--timeout {cfg.timeout:g}: must be a number of seconds in (0, 604800]")
    from tpdiag.kernels.hash_buffer import batch_size, cap_bytes

    batch_size()  # TPDIAG_HASH_BATCH and TPDIAG_HASH_CAP_MB, read by every world's recorder
    cap_bytes()
    from tpdiag.kernels.record_hash import narrow_regs_knob

    narrow_regs_knob()  # TPDIAG_HASH_NARROW_REGS
    from tpdiag.probes.host_store import check_env

    check_env()  # TPDIAG_HOST_BUDGET, TPDIAG_HOST_CHUNK (full capture)
    from tpdiag.probes.host_budget import local_ranks

    local_ranks()  # LOCAL_WORLD_SIZE, TPDIAG_LOCAL_RANKS: the budget's share
    from tpdiag.base.files import max_read_mb
    from tpdiag.runner.anchor import max_mb
    from tpdiag.runner.gather import window_bytes

    # read inside every world: a bad value failed each rank (or read as the default, unsaid)
    max_mb(), max_read_mb(), window_bytes()
    from tpdiag.probes.optim_shadow import max_mb as opt_f64_mb

    opt_f64_mb()  # TPDIAG_OPT_F64_MAX_MB: the float64 re-run of a user's own optimizer class
    from tpdiag.kernels.tree_overlap import knob

    knob("TPDIAG_TREE_OVERLAP_CHUNKS", 4), knob("TPDIAG_TREE_OVERLAP_SMS", 16)
    if spec.kind in ("builtin", "hf"):
        from tpdiag.models.plans import HF_VARIANTS, VARIANTS

        offered = VARIANTS if spec.kind == "builtin" else HF_VARIANTS
        if cfg.variant not in offered:
            raise BadInput(f"--variant {cfg.variant!r}: expected one of {', '.join(offered)}"
                           f"{' for an hf: model' if spec.kind == 'hf' else ''}")
    if not 0 <= cfg.seed < 2 ** 63:
        raise BadInput(f"--seed {cfg.seed}: must be in [0, 2**63)")
    if cfg.batch_size < 1 or cfg.seq_len < 2:
        raise BadInput(f"--batch-size {cfg.batch_size} / --seq-len {cfg.seq_len}: need >= 1 and >= 2")
    from tpdiag.models.capacity import guess_device
    from tpdiag.models.preflight import preflight

    # Positions and memory before any world starts: a batch past them fails in seconds, not after
    # minutes of a rank growing until the OOM killer picks a process on a shared host; a model
    # whose reference cannot fit is told which slice (--layers) or reference degree does.
    device = guess_device(cfg.device, cfg.degrees)
    # activations: the fewest sequences any world runs in one call (a lower bound for all of them)
    rows = min(cfg.micro_batches) if cfg.micro_batches and spec.kind != "py" else cfg.batch_size
    from tpdiag.fixes.registry import catalogue

    # a fix that takes the loss over (the invariant vocab softmax) allocates otherwise than the
    # float32 cross-entropy: its [tokens, vocab] tensors are not counted then (still a lower bound)
    fixes = catalogue()
    own_loss = any("loss" in fixes[n].takes_over for n in cfg.fixes if n in fixes)
    # a py: Target's own inputs are counted at their batch (models/preflight.py), its calls at the smallest
    # --micro-batch's rows at most
    pre = preflight(spec, cfg.degrees, max(1, rows), cfg.seq_len, cfg.dtype, cfg.backward, device,
                    cfg.variant, gpus=_gpus(device), default_loss=not own_loss,
                    micro_batch=min(cfg.micro_batches) if cfg.micro_batches else None)
    from tpdiag.config import CAPTURES

    if cfg.capture not in CAPTURES:
        raise BadInput(f"--capture {cfg.capture!r}: expected one of {', '.join(CAPTURES)}")
    if cfg.out:
        from tpdiag.records.run_files import check_out

        check_out(cfg.out, "tpdiag compare")
    if not cfg.group_gemm:  # a rerun's config was resolved (and checked) with its parent run
        from tpdiag.fixes import groups

        groups.check(cfg.degrees, cfg.fixes, cfg.tree_groups)
    return pre


def _check_sdpa(cfg: CompareConfig, spec) -> None:
    """An SDPA choice (`sdpa`, `sdpa-math`, ...) for an hf: model whose own attention is not SDPA
    (Gemma2: eager): refused here in one line, where every world would raise it (runner/step.py)
    after the reference had run."""
    sdpa = [a for a in cfg.attentions if a not in ("auto", "eager", "flex")]
    if spec.kind != "hf" or not sdpa:
        return
    from tpdiag.models.hf import _config, attention_of

    impl = attention_of(spec.value, cfg.layers)
    if impl != "sdpa":
        from tpdiag.runner.attention import not_sdpa

        arch = (getattr(_config(spec.value, cfg.layers), "architectures", None) or ["the model"])[0]
        raise BadInput(not_sdpa(sdpa[0], arch, impl))


def _gpus(device: str) -> int | None:
    if device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return None


def check_axes(cfg: CompareConfig, spec) -> None:
    """The micro-batch and mode axes, before any world starts."""
    from tpdiag.base.points import MODES, check_micro_batches

    if len(cfg.worlds()) < 2:
        raise BadInput(f"--tp {','.join(map(str, cfg.degrees))} --micro-batch "
                       f"{','.join(map(str, cfg.micro_batches)) or '(none)'}: need at least two "
                       "configurations (a reference and one to compare), e.g. --tp 1,2 or --micro-batch 4,1")

    for m in cfg.modes:
        if m not in MODES:  # a CompareConfig built in code, not parsed by axes.parse_modes
            raise BadInput(f"--mode {m}: not a mode; expected one of {', '.join(MODES)}")
    if "decode" in cfg.modes:
        if cfg.modes[0] != "prefill":
            raise BadInput(f"--mode {','.join(cfg.modes)}: the reference must be prefill (decode's calls "
                           "are placed as positions of prefill's records); list prefill first, e.g. "
                           "--mode prefill,decode")
        if cfg.micro_batches:
            raise BadInput("--mode decode with --micro-batch: not supported yet (a decode world "
                           "runs the whole batch, one position per call); compare them in two runs")
        sp = [w.label for w in cfg.worlds() if w.point.mode == "decode" and w.point.tp > 1]
        if cfg.variant == "sp" and sp:
            raise BadInput(f"--variant sp --mode decode: the decode configuration {sp[0]} would shard a "
                           "one-token call along the sequence over several ranks (sequence parallelism "
                           "splits positions; engines decode without it); run decode at TP=1 (a first "
                           "degree of 1, without --grid) or with the stock variant")
    _check_attention_padding(cfg, spec.kind)
    if not cfg.micro_batches:
        return
    if spec.kind == "py":
        # a Target.inputs batch has its own size: checked by the world (runner/micro.py)
        if any(n < 1 for n in cfg.micro_batches):
            raise BadInput(f"--micro-batch {cfg.micro_batches}: every size must be >= 1")
    else:
        check_micro_batches(cfg.micro_batches, cfg.batch_size)


# compare records every module's inputs; eager attention is given other inputs than SDPA (rollout,
# which compares logprobs only, has it). Eager alone - every configuration eager, as a trainer that
# loads with attn_implementation="eager" runs at each of its degrees - compares like with like
EAGER_REFUSED = (
    "--attention eager: not an axis of compare - transformers builds eager attention another mask than "
    "SDPA's (a float mask tensor where SDPA takes none and masks causally itself), so the decoder layers' "
    "recorded inputs are not the same records; `--attention eager` alone runs every configuration eager "
    "(an hf: model, as from_pretrained(..., attn_implementation=\"eager\") loads it); compare SDPA backends "
    "here (e.g. --attention sdpa-math,sdpa-flash) and eager against SDPA on logprobs with tpdiag rollout "
    "FILE --attention eager,sdpa")
FLEX_REFUSED = (
    "--attention flex: not an axis of compare - transformers' flex_attention builds a BlockMask where SDPA "
    "takes none, and compiles its kernel per shape; compare an engine's flex_attention logprobs with "
    "tpdiag rollout FILE --attention auto,flex")
EAGER_NOT_HF = (
    "--attention eager: only hf: models switch their attention implementation (transformers' "
    "set_attn_implementation); the built-in presets run SDPA and a py: model runs its own code")


def _check_attention_padding(cfg: CompareConfig, kind: str) -> None:
    """--attention: SDPA backends, or eager alone for an hf: model (beside others refused:
    EAGER_REFUSED); --padding: refused (nothing to pad), so a comparison that would change nothing
    is not run as if it tested something. kind: the model spec's (hf, py, builtin)."""
    from tpdiag.base.configs import ATTENTIONS, PADDINGS

    bad = [p for p in cfg.paddings if p not in PADDINGS]
    if bad:
        raise BadInput(f"--padding {bad[0]}: expected one of {', '.join(PADDINGS)}")
    if any(p != "auto" for p in cfg.paddings):
        raise BadInput(f"--padding {','.join(cfg.paddings)}: not an axis of compare - its sequences fill "
                       "--seq-len (and decode's prompts are all one length), so there is no padding whose side "
                       "could change a bit; compare padding sides on an engine's rollout with tpdiag rollout "
                       "FILE --padding left,right")
    for a in cfg.attentions:
        if a not in ATTENTIONS:
            raise BadInput(f"--attention {a}: expected one of {', '.join(ATTENTIONS)}")
    if "flex" in cfg.attentions:
        raise BadInput(FLEX_REFUSED)
    if "eager" in cfg.attentions and len(cfg.attentions) > 1:
        raise BadInput(EAGER_REFUSED)
    if "eager" in cfg.attentions and kind != "hf":
        raise BadInput(EAGER_NOT_HF)
