"""Model specs: `tiny-llama` (and other presets), `hf:DIR`, `py:FILE.py:FUNC` / `py:pkg.mod:FUNC`."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

from tpdiag.errors import BadInput

LOSS_MEANS = ("token", "sequence", "sum")  # Target.loss_mean


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # builtin | hf | py
    value: str
    layers: int = 0  # --layers N: the first N decoder layers only (tpdiag/models/slice.py); 0: all

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, **({"layers": self.layers} if self.layers else {})}

    def preset_overrides(self) -> dict:
        """A built-in preset's LlamaConfig overrides for the slice."""
        if not self.layers:
            return {}
        from tpdiag.models.presets import PRESETS

        return {"n_layers": self.layers, "init_depth": PRESETS[self.value].get("n_layers", 2)}


def parse_spec(spec: str, layers: int = 0) -> ModelSpec:
    from dataclasses import replace

    s = _parse_spec(spec)
    return replace(s, layers=int(layers)) if layers else s


def _parse_spec(spec: str) -> ModelSpec:
    from tpdiag.models.presets import PRESETS

    spec = str(spec).strip()
    if spec in PRESETS:
        return ModelSpec("builtin", spec)
    if spec.startswith("hf:"):
        path = spec[3:]
        if not os.path.exists(path):
            # a Hub id (`hf:meta-llama/Llama-3.2-1B`) is a new user's first try: tpdiag loads local
            # files only (no download in every rank of every world)
            hub = (path.count("/") == 1 and bool(os.path.dirname(path)) and bool(os.path.basename(path))
                   and not path.startswith((".", "~")))
            raise BadInput(f"--model {spec!r}: no directory {path!r}" + (
                "; tpdiag reads a local model directory only - if that is a Hugging Face Hub id, download it "
                f"first (`hf download {path} --local-dir DIR`) and pass --model hf:DIR" if hub else
                "; expected hf:DIR of a local Hugging Face model directory"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise BadInput(f"--model {spec!r}: no config.json in {path!r}; expected hf:DIR of a "
                           "local Hugging Face model directory")
        return ModelSpec("hf", os.path.abspath(path))
    if spec.startswith("py:"):
        body = spec[3:]
        src, sep, func = body.rpartition(":")
        if not sep or not src or not func.isidentifier():
            raise BadInput(f"--model {spec!r}: expected py:FILE.py:FUNC or py:package.module:FUNC")
        if src.endswith(".py"):
            if not os.path.exists(src):
                raise BadInput(f"--model {spec!r}: file {src!r} not found")
            from tpdiag.base import files as io

            try:  # a FIFO would block every rank's import, /dev/zero fill its memory
                io.check_regular(src, io.LIMIT_SMALL, BadInput)
            except BadInput as e:
                raise BadInput(f"--model {spec!r}: {e}") from None
            src = os.path.abspath(src)
        return ModelSpec("py", f"{src}:{func}")
    # the likeliest slip: a checkpoint directory or a model file named without its prefix
    hint = ""
    if os.path.isfile(os.path.join(spec, "config.json")):
        hint = f" (a model directory: --model hf:{spec})"
    elif spec.endswith(".py") and os.path.isfile(spec):
        hint = f" (a Python file: --model py:{spec}:FUNC, FUNC returning a tpdiag.Target)"
    raise BadInput(f"--model {spec!r}: unknown model; expected one of {', '.join(PRESETS)}, "
                   f"hf:DIR or py:FILE.py:FUNC{hint}")


def _load_py_func(value: str):
    src, _, func = value.rpartition(":")
    try:
        if src.endswith(".py"):
            _importable_beside(src)
            name = "tpdiag_user_" + os.path.splitext(os.path.basename(src))[0]
            mspec = importlib.util.spec_from_file_location(name, src)
            mod = importlib.util.module_from_spec(mspec)
            # registered like an imported module: dataclasses and pickle look their module up
            sys.modules[name] = mod
            # its top level sees the arguments `python FILE.py` gives it, not tpdiag's own: a script's
            # module-level argparse read `compare --model ...` and exited 2 with its usage
            argv, sys.argv = sys.argv, [src]
            try:
                mspec.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            finally:
                sys.argv = argv
        else:
            mod = importlib.import_module(src)
    except BadInput:
        raise
    except ModuleNotFoundError as e:
        raise BadInput(f"--model py:{value}: importing {src!r} failed: {_missing_module_hint(src, e)}") from e
    except Exception as e:  # user code: any failure is a bad spec, reported in one line
        raise BadInput(f"--model py:{value}: importing {src!r} failed: {type(e).__name__}: {e}") from e
    except SystemExit as e:
        # a script's top level run on import (argparse's parse_args() read tpdiag's own arguments and
        # exited 2 with its usage): the compare ended with the user's exit code and no word of why
        raise BadInput(f"--model py:{value}: importing {src!r} called sys.exit({e.code!r}): code at its top "
                       "level ran on import; put it under `if __name__ == \"__main__\":`") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise BadInput(f"--model py:{value}: {src!r} has no callable {func!r}")
    return fn


def _importable_beside(path: str) -> None:
    """Put FILE.py's directory first on sys.path, as `python FILE.py` does, so the file may
    import the modules beside it. Runs in every process that loads the file (the CLI and each
    rank), so the ranks need no PYTHONPATH either."""
    here = os.path.dirname(os.path.abspath(path))
    if here not in sys.path:
        sys.path.insert(0, here)


def _missing_module_hint(src: str, e: ModuleNotFoundError) -> str:
    """'no module named X' plus what to do: where tpdiag looked and how to make X importable."""
    missing = e.name or str(e)
    if not src.endswith(".py") and (os.sep in src or os.path.isfile(src)):  # a bare name may be a package
        # a path, not a module name: 'no module named '/x/model'' named no fix
        what = ("is a directory" if os.path.isdir(src) else "is not a .py file" if os.path.exists(src)
                else "does not exist")
        return f"{src} {what}; expected py:FILE.py:FUNC (a Python file) or py:package.module:FUNC"
    if src.endswith(".py"):
        here = os.path.dirname(os.path.abspath(src))
        return (f"no module named {missing!r} (imported by {os.path.basename(src)}; the import path has "
                f"{here} and PYTHONPATH): put {missing.split('.')[0]}.py or its package beside "
                f"{os.path.basename(src)}, install it, or add its directory to PYTHONPATH")
    if missing == src or src.startswith(missing + "."):
        return (f"no module named {missing!r}: add the directory that holds {missing.split('.')[0]} to "
                f"PYTHONPATH (e.g. PYTHONPATH=. from that directory) or name the file, py:FILE.py:FUNC")
    return (f"no module named {missing!r} (imported by {src}): install it or add its directory to "
            "PYTHONPATH")


def takes_device(fn) -> bool:
    """A py: FUNC with a `device` parameter opts in to the meta-device build."""
    import inspect

    try:
        return "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _quiet_transformers() -> None:
    """No transformers progress bar from the user's FUNC: it runs in every rank of every world, and
    each from_pretrained drew its 'Loading weights' bar into the compare's output (14 of them for a
    --tp 1,2 --micro-batch 2,1 run), which is plain text without progress (README). A FUNC that
    imports transformers itself reads the environment variable when it does."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    tf = sys.modules.get("transformers")
    if tf is not None:
        tf.utils.logging.disable_progress_bar()


def py_target(value: str, variant: str = "stock"):
    """FUNC() - or, for a FUNC that opts in, FUNC(device=meta) under the meta device - checked,
    with `variant`'s plan. An opted-in Target's model is still on the meta device."""
    import torch

    from tpdiag.models.target import Target

    fn = _load_py_func(value)
    import inspect

    import torch.nn as nn

    if inspect.isclass(fn) and issubclass(fn, nn.Module):
        # the model class named where its Target's function belongs: called with no arguments it
        # failed in every world with its own __init__'s TypeError
        raise BadInput(f"--model py:{value}: {fn.__name__} is an nn.Module class; name a function that "
                       f"returns tpdiag.Target(model={fn.__name__}(...), plan=..., vocab_size=...) "
                       "(docs/models-py.md)")
    _needs_no_arguments(fn, value)
    _quiet_transformers()
    try:
        if takes_device(fn):
            meta = torch.device("meta")
            with meta:
                t = fn(device=meta)
        else:
            t = fn()
    except SystemExit as e:  # as on import (_load_py_func): not the compare's exit code, unsaid
        raise BadInput(f"--model py:{value}: calling it called sys.exit({e.code!r})") from None
    if not isinstance(t, Target):
        import torch.nn as nn

        # the natural first try is to return the model itself: say what to wrap it in
        what = (f"{type(t).__name__} (an nn.Module: return tpdiag.Target(model=..., plan=..., "
                "vocab_size=...) around it, docs/models-py.md)" if isinstance(t, nn.Module)
                else type(t).__name__)
        raise BadInput(f"--model py:{value}: returned {what}, expected tpdiag.Target")
    if t.loss_mean not in LOSS_MEANS:
        raise BadInput(f"--model py:{value}: Target.loss_mean {t.loss_mean!r}: expected one of "
                       f"{', '.join(LOSS_MEANS)} (what the loss is a mean over)")
    if not isinstance(t.loss_label_free, bool):  # "no" would read as declared
        raise BadInput(f"--model py:{value}: Target.loss_label_free {t.loss_label_free!r}: expected True or False "
                       "(whether the loss adds a term that does not depend on the label)")
    if variant != "stock":
        if variant not in t.variants:
            raise BadInput(f"plan variant {variant!r}: this target offers "
                           f"{', '.join(['stock', *t.variants]) }")
        t.plan = t.variants[variant]
    if any(isinstance(v, str) for v in (t.plan or {}).values()):
        from tpdiag.models.hf_plan import named_styles

        t.plan = named_styles(t.model, t.plan, f"--model py:{value}")
    return t


def _needs_no_arguments(fn, value: str) -> None:
    """FUNC is called with no arguments (or device= alone): one that needs some is refused here, one
    line, before any world - the check before the worlds passes over any other failure of the
    user's code (models/precheck.py), and each world failed with FUNC's TypeError."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says
        return
    need = [p.name for p in params if p.default is p.empty and p.name != "device"
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if need:
        raise BadInput(f"--model py:{value}: it needs {', '.join(need)}, but tpdiag calls it with no arguments; "
                       "name a function of none that returns tpdiag.Target (docs/models-py.md)")


def load_target(spec: ModelSpec, variant: str = "stock"):
    """Build the full, unsharded Target on the CPU (a py: target that opts in to the meta build:
    on the meta device). Callers seed the RNG first (identical weights everywhere).
    The runner builds with tpdiag.models.build.build_target instead."""
    from tpdiag.models.target import Target

    if spec.kind == "builtin":
        from tpdiag.models import tiny_llama
        from tpdiag.models.plans import llama_plan

        model = tiny_llama.build(spec.value, **spec.preset_overrides())
        return Target(model=model, plan=llama_plan(variant), vocab_size=model.cfg.vocab_size,
                      divisors=model.cfg.divisors())
    if spec.kind == "py":
        return py_target(spec.value, variant)
    if spec.kind == "hf":
        from tpdiag.models.hf import load_hf_target

        return load_hf_target(spec.value, variant, layers=spec.layers)
    raise BadInput(f"unknown model kind {spec.kind!r}")


def builtin_target(name: str = "tiny-llama", variant: str = "stock"):
    """A built-in preset as a Target (whole model on the CPU from the global RNG the caller
    seeded, its plan, its vocab size): the public `tpdiag.builtin_target`, for examples and
    tests that need a small Llama without writing one."""
    from tpdiag.models.presets import PRESETS

    if name not in PRESETS:
        raise BadInput(f"builtin_target({name!r}): expected one of {', '.join(PRESETS)}")
    return load_target(ModelSpec("builtin", name), variant)


def model_divisors(spec: ModelSpec) -> dict[str, int]:
    """Dimensions every TP degree must divide, read without building the model where possible."""
    if spec.kind == "builtin":
        from tpdiag.models.presets import PRESETS
        from tpdiag.models.tiny_llama import LlamaConfig

        return LlamaConfig(**PRESETS[spec.value]).divisors()
    if spec.kind == "hf":
        path = os.path.join(spec.value, "config.json")
        try:
            from tpdiag.base import files as io

            with io.open_regular(path, limit=io.LIMIT_DOC, error=BadInput) as f:
                cfg = json.load(f)
        except BadInput as e:
            raise BadInput(f"--model hf:{spec.value}: {e}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise BadInput(f"--model hf:{spec.value}: config.json unreadable ({type(e).__name__})") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("text_config", cfg), dict):
            raise BadInput(f"--model hf:{spec.value}: config.json is not a JSON object")
        cfg = cfg.get("text_config", cfg)
        out = {}
        # moe_intermediate_size: transformers' moe_tp_experts splits every expert's width (qwen3_moe,
        # deepseek_v3): a degree that does not divide it failed in the reference-sized grouped GEMM
        # of each TP world ("strides should be multiple of 16 bytes") after TP=1 had run
        # - only where a layer is an MoE layer: deepseek's first_k_dense_replace dense layers (all of
        # them in a 1-layer slice), no routed experts, qwen3_moe's mlp_only_layers
        keys = ("num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size", "intermediate_size") \
            + (("moe_intermediate_size",) if _moe_layers(cfg, spec.layers) else ())
        for key in keys:
            if isinstance(cfg.get(key), int):
                out[key] = cfg[key]
        return out
    return {}


def _moe_layers(cfg: dict, layers: int | None) -> bool:
    """Whether an hf: config (sliced to `layers` where --layers says) has a layer with routed experts."""
    n = cfg.get("num_hidden_layers")
    n = layers if isinstance(layers, int) and layers > 0 else n
    experts = next((cfg[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in cfg), None)
    if experts is not None and not (isinstance(experts, int) and experts > 0):
        return False
    if not isinstance(n, int):
        return True
    dense = cfg.get("first_k_dense_replace")
    if isinstance(dense, int) and n <= dense:
        return False
    only = cfg.get("mlp_only_layers")
    if isinstance(only, list) and all(i in only for i in range(n)):
        return False
    return True


def check_degrees(spec: ModelSpec, degrees, divisors: dict[str, int] | None = None) -> None:
    import math

    divs = model_divisors(spec) if divisors is None else divisors
    for d in degrees:
        bad = [f"{k}={v}" for k, v in divs.items() if v % d]
        if bad:
            g = math.gcd(*divs.values())
            valid = [n for n in range(1, min(g, 64) + 1) if g % n == 0]
            raise BadInput(f"--tp {d}: does not divide {', '.join(bad)}; valid degrees for this model: "
                           f"{', '.join(map(str, valid))}")


def slice_changes(spec: ModelSpec) -> dict:
    """What --layers changed in the model's config ({key: description}): a preset's n_layers, an
    hf: config's num_hidden_layers and per-layer lists (tpdiag/models/slice.py)."""
    if not spec.layers:
        return {}
    if spec.kind == "builtin":
        from tpdiag.models.presets import PRESETS

        return {"n_layers": f"{PRESETS[spec.value].get('n_layers', 2)} -> {spec.layers}"}
    if spec.kind != "hf":
        return {}
    from tpdiag.models.hf import _config
    from tpdiag.models.hf_plan import text_config
    from tpdiag.models.slice import slice_text_config

    return slice_text_config(text_config(_config(spec.value)), spec.layers)
