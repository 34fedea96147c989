"""`--logprob` of `tpdiag rollout` and `tpdiag compare`: the trainer's own logprob recipe - how it
turns logits rows into the logprob of each token - where it is not tpdiag's default (the float32
log-softmax gathered at the token: generate()'s output_logits as docs/rl.md writes them, NeMo RL,
verl's fallback).

Every recipe below is the same number in exact arithmetic; in floating point each rounds
differently, and a ratio built from two of them is not 1 bit for bit:
- `log-softmax`: `logits.float().log_softmax(-1).gather(-1, ids)` (tpdiag's default).
- `logsumexp`: `x = logits.float(); x.gather(-1, ids) - x.logsumexp(-1)` - TRL's
  `selective_log_softmax` and verl's `logprobs_from_logits_v2` for float32/float64 logits, OpenRLHF's
  `log_probs_from_logits`: the subtraction rounds once more than log_softmax's own
  `x - max - log(sum)`.
- `model-dtype`: `logits.log_softmax(-1).gather(-1, ids)` in the logits' own dtype, then upcast -
  TRL's and verl's v2 row loop for bf16/fp16 logits: every logprob rounded to 8 bits (bf16).
A trainer's temperature (`--trainer-temperature T`) divides the logits before the recipe: after the
float32 cast (`logits.float() / T`), or with `--temperature-in model` before it, in the logits'
dtype (`(logits / T).float()`: TRL's GRPO and verl divide the bf16 logits in place), which rounds
every quotient to bf16 first.
A recipe other than the default reads the whole vocabulary (a TP > 1 world gathers its shards
first) and takes the place of the fixes' invariant vocab softmax: it is the user's function.
One implementation for both commands: rollout applies `rows` and `token_logprobs` itself (generate()'s
processors run between them under --sampling); compare's recorded logprobs are `logprobs`.

`--compiled`: the recipe as one function under torch.compile(dynamic=True), as TRL and others
decorate their logprob function - the cast, the division and the log-softmax in one graph, which
inductor fuses into other bits than eager's (on the project's CPU, torch 2.13: 118 of 128 random
bf16 rows of vocabulary 256 kept eager's bits, 32 of 128 at 32000). A second torch.compile of the same
function gave the user's compiled bits at every shape tried (the whole batch, its rows flattened,
one sequence, a prefix: dynamic shapes, one kernel a row); a function written another way (TRL's
logsumexp row by row in a Python loop) is another graph, and may round otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpdiag.errors import BadInput

RECIPES = ("log-softmax", "logsumexp", "model-dtype")
DIVIDE_IN = ("float32", "model")


@dataclass(frozen=True)
class Recipe:
    name: str = "log-softmax"
    temperature: float = 1.0
    divide_in: str = "float32"  # DIVIDE_IN: the division after the float cast, or before it
    compiled: bool = False  # the whole recipe under torch.compile(dynamic=True), in one graph

    @classmethod
    def of(cls, cfg) -> "Recipe":
        """The recipe a compare or world config names (RunSettings.logprob and its temperature)."""
        return cls(cfg.logprob, float(cfg.trainer_temperature), cfg.temperature_in,
                   bool(getattr(cfg, "logprob_compiled", False)))

    @property
    def default(self) -> bool:
        return self.name == "log-softmax" and self.temperature == 1.0 and not self.compiled

    def to_dict(self) -> dict:
        return {"name": self.name, "temperature": self.temperature, "divide_in": self.divide_in,
                **({"compiled": True} if self.compiled else {})}

    def describe(self) -> str:
        plain = self._formula()
        return f"torch.compile(dynamic=True) of: {plain}" if self.compiled else plain

    def _formula(self) -> str:
        t = self.temperature
        if self.name == "model-dtype":
            lo = "logits" if t == 1.0 else f"(logits / {t:g})"
            return f"{lo}.log_softmax(-1).gather(-1, ids).float() (in the logits' dtype)"
        lo = "logits.float()" if t == 1.0 else (f"(logits / {t:g}).float()" if self.divide_in == "model"
                                                else f"(logits.float() / {t:g})")
        if self.name == "logsumexp":
            return f"x = {lo}; x.gather(-1, ids) - x.logsumexp(-1)"
        return f"{lo}.log_softmax(-1).gather(-1, ids)"


def parse(name: str = "log-softmax", temperature: float = 1.0, divide_in: str = "float32",
          compiled: bool = False) -> Recipe:
    n = str(name).strip().lower()
    if n not in RECIPES:
        raise BadInput(f"--logprob {name!r}: expected one of {', '.join(RECIPES)} (log-softmax: "
                       "logits.float().log_softmax(-1) gathered; logsumexp: gather - logsumexp in float32; "
                       "model-dtype: log_softmax in the logits' own dtype; docs/rl.md)")
    d = str(divide_in).strip().lower()
    if d not in DIVIDE_IN:
        raise BadInput(f"--temperature-in {divide_in!r}: expected float32 (logits.float() / T) or model "
                       "((logits / T).float(): the division in the logits' own dtype)")
    t = float(temperature)
    if not t > 0 or t != t or t == float("inf"):
        raise BadInput(f"--trainer-temperature {temperature!r}: must be a positive number (1: no division)")
    if n == "model-dtype" and t != 1.0 and d == "float32":
        raise BadInput("--logprob model-dtype takes the log-softmax in the logits' own dtype: its temperature is "
                       "divided in that dtype too; add --temperature-in model")
    return Recipe(n, t, d, bool(compiled))


def check_sampling(recipe: Recipe, sampling) -> None:
    """--sampling runs generate()'s processors (its temperature included) on float32 rows: a trainer's
    own division on top of them would divide twice, and a log-softmax in bf16 is no processor's input."""
    if not sampling:
        return
    if recipe.temperature != 1.0:
        raise BadInput("--trainer-temperature with --sampling: --sampling models the engine's processed scores, "
                       "its temperature included (--sampling temperature=T); name the temperature once")
    if recipe.name == "model-dtype":
        raise BadInput("--logprob model-dtype with --sampling: generate()'s processors run on float32 rows; "
                       "a log-softmax in the logits' dtype has no processed form")
    if recipe.compiled:
        raise BadInput("--compiled with --sampling: generate()'s processors run eagerly between the logits and "
                       "the log-softmax; a compiled recipe reads the logits themselves")


def rows(r, recipe: Recipe):
    """The rows the recipe's log-softmax reads: float32 (or the logits' dtype for model-dtype),
    divided by the trainer's temperature where the trainer divides."""
    return _rows(r, recipe.name, recipe.temperature, recipe.divide_in)


def token_logprobs(r, labels, recipe: Recipe):
    """float32 [n]: the logprob of labels[i] at rows r[i], as the recipe takes it."""
    return _token(r, labels, recipe.name)


def whole(logits, labels, recipe: Recipe):
    """float32 [n]: the recipe from the logits as the model returned them (rows [n, V], labels [n]);
    under --compiled the whole function in one torch.compile'd graph, as the user's decorator."""
    if not recipe.compiled:
        return token_logprobs(rows(logits, recipe), labels, recipe)
    fn = _COMPILED.get(recipe)
    if fn is None:
        import torch

        name, t, divide_in = recipe.name, recipe.temperature, recipe.divide_in
        in_model, in_float = _divisions(name, t, divide_in)

        # t only divides, never compared: a trainer's temperature is a variable (a global, an
        # attribute), which dynamo under dynamic=True lifts to a symbolic float, and inductor's
        # division by a runtime scalar rounds otherwise than by the literal 0.7 (2 of 8 sequences
        # at T=0.7, bf16, on a cold inductor cache). `t != 1.0` inside the graph made dynamo
        # specialize t to that literal - the user's bits only where a warm on-disk cache hid it
        def fn(logits, labels):
            return _token(_divided(logits, name, t, in_model, in_float), labels, name)

        import torch._inductor.config as inductor_config

        # one small graph: inductor's pool of compile worker processes buys it nothing but their
        # start-up in every rank. The pool only compiles; the kernels, so the bits, are the same.
        # (The "leaked semaphore" warning once blamed on it was tqdm's lock: runner/rank_exit.py)
        inductor_config.compile_threads = 1
        fn = _COMPILED[recipe] = torch.compile(fn, dynamic=True)
    return fn(logits, labels)


_COMPILED: dict = {}  # Recipe -> its compiled function, once a process


def _rows(r, name: str, t: float, divide_in: str):
    return _divided(r, name, t, *_divisions(name, t, divide_in))


def _divisions(name: str, t: float, divide_in: str) -> tuple[bool, bool]:
    """(whether T divides the logits in their own dtype, whether it divides them in float32), decided
    outside any compiled graph: a comparison of T inside one specializes it (whole())."""
    in_model = t != 1.0 and (divide_in == "model" or name == "model-dtype")
    return in_model, t != 1.0 and not in_model


def _divided(r, name: str, t, in_model: bool, in_float: bool):
    """The rows the recipe's log-softmax reads, eager or inside whole()'s compiled graph alike."""
    if in_model:
        r = r / t  # rounded to the logits' dtype, as the trainer's own division
    if name != "model-dtype":
        r = r.float()
    return r / t if in_float else r


def _token(r, labels, name: str):
    lab = labels.unsqueeze(-1)
    if name == "logsumexp":
        return r.gather(-1, lab).squeeze(-1) - r.logsumexp(-1)
    return r.log_softmax(-1).gather(-1, lab).squeeze(-1).float()



def logprobs(logits, labels, recipe: Recipe):
    """float32, one per label (flattened): compare's recorded logprobs under a recipe other than the
    default. The logits gathered whole first (a vocab-sharded DTensor at TP > 1: the recipe reads
    every id, as the user's function does on its whole logits); a label IGNORE (no next token) is
    0, as the default's cross-entropy gives it. In blocks of rows, as the default (each row's
    logprob is its own: the whole tensor's bits, never a float32 copy of all of it)."""
    import torch
    from torch.distributed.tensor import DTensor

    from tpdiag.runner.batch import IGNORE
    from tpdiag.runner.losses import CHUNK_ELEMENTS

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    lo, lab = logits.flatten(0, -2), labels.flatten()
    n = max(1, CHUNK_ELEMENTS // max(lo.shape[-1], 1))
    lp = torch.cat([whole(lo[a:a + n], lab[a:a + n].clamp_min(0), recipe) for a in range(0, lo.shape[0], n)])
    return torch.where(lab != IGNORE, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
