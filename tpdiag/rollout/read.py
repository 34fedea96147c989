"""Reading a rollout engine's per-token logprobs: vLLM, SGLang, or tpdiag's JSONL of token ids.

Every format becomes a list of `Sequence`s: the token ids (prompt then generated), the prompt
length, and the engine's logprob of each generated token (and of prompt tokens where it gave
them). A file holds one JSON document (an object or an array of objects) or JSON lines, one
object per line; each object is recognised by its keys:

- tpdiag JSONL: `{"input_ids": [...], "prompt_len": P, "logprobs": [...]}` - `logprobs[j]` is
  the logprob the engine assigned to `input_ids[P + j]`, so len(logprobs) = len(input_ids) - P.
  Optional: `"prompt_logprobs"` (P - 1 numbers, for input_ids[1..P-1]), `"top_logprobs"` (per
  generated token, the engine's reported top-k as [[token_id, logprob], ...]), `"id"`.
- vLLM (OpenAI-compatible `/v1/completions` or `/v1/chat/completions` response): the token ids
  come from `prompt_token_ids` and each choice's `token_ids` (vLLM's `return_token_ids`), or from
  tokens spelled `token_id:N` (`return_tokens_as_token_ids`); logprobs from a choice's
  `logprobs.content[].logprob` (chat) or `logprobs.token_logprobs` (completions); prompt
  logprobs from `prompt_logprobs` (top level or in the choice). One sequence per choice.
- SGLang (`/generate` response): `meta_info.input_token_logprobs` and
  `meta_info.output_token_logprobs`, entries `[logprob, token_id, text]` (the input list must
  cover the whole prompt: `logprob_start_len=0`); `meta_info.output_top_logprobs` optional.

A malformed file is one BadInput naming the line (or array item) and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tpdiag.errors import BadInput

FORMATS = ("jsonl", "vllm", "sglang")


@dataclass
class Sequence:
    input_ids: list[int]
    prompt_len: int
    logprobs: list[float]                           # for input_ids[prompt_len:]
    prompt_logprobs: list[float | None] | None = None  # for input_ids[1:prompt_len]
    top: list[list[tuple[int, float]]] | None = None   # reported top-k per generated token
    where: str = ""                                 # 'line 3' / 'item 0 choice 1'

    @property
    def n_generated(self) -> int:
        return len(self.input_ids) - self.prompt_len


@dataclass
class Rollout:
    path: str
    format: str
    sequences: list[Sequence] = field(default_factory=list)


class _Bad(Exception):
    """A field problem inside one object; the reader adds the file and the line."""


# The value problems found in the object being read. A bad value (a logprob > 0, a negative token id)
# leaves the object's shape intact, so reading goes on and every such field is named at once; a
# broken shape (a missing field, a list of the wrong length) still stops the object (_Bad).
_found: list[str] | None = None


def _value_problem(msg: str, placeholder):
    if _found is None:
        raise _Bad(msg)
    _found.append(msg)
    return placeholder


def read_rollout(path: str) -> Rollout:
    from tpdiag.base import files as io

    try:
        with io.open_regular(path, limit=io.LIMIT_LINES, error=BadInput) as f:
            text = f.read()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file; expected an engine's logprobs (vLLM or SGLang JSON, "
                       "or tpdiag's JSONL)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    objects = _objects(path, text)
    if not objects:
        raise BadInput(f"{path}: empty; expected an engine's logprobs (vLLM or SGLang JSON, or "
                       "tpdiag's JSONL)")
    global _found
    fmt, seqs, bad = None, [], []
    for where, obj in objects:
        kind = _kind(obj)
        if kind is None:
            keys = ", ".join(list(obj)[:6]) if isinstance(obj, dict) else type(obj).__name__
            raise BadInput(f"{path} {where}: not a recognised record (has {keys or 'nothing'}); "
                           "expected tpdiag JSONL (input_ids, prompt_len, logprobs), a vLLM "
                           "response (choices) or an SGLang response (meta_info)")
        if fmt is not None and kind != fmt:
            raise BadInput(f"{path} {where}: a {kind} record in a file of {fmt} records")
        fmt = kind
        _found = []
        try:
            # a sequence with nothing generated has nothing to compare (its `where` keeps its line)
            got = [q for q in _READERS[kind](obj, where) if q.n_generated]
        except _Bad as e:
            _found.append(str(e))
        finally:
            found, _found = _found, None
        if found:
            bad += [f"{path} {where}: {e}" for e in found]  # every problem of every line, not the first
        else:
            seqs.extend(got)
    if bad:
        more = [f"... and {len(bad) - MAX_LISTED} more problems"] if len(bad) > MAX_LISTED else []
        raise BadInput("\n".join(bad[:MAX_LISTED] + more), lines=True)
    if not seqs:
        raise BadInput(f"{path}: no sequences with generated tokens")
    return Rollout(path=path, format=fmt, sequences=seqs)


MAX_LISTED = 20  # problem lines listed before "... and N more"


def _objects(path: str, text: str) -> list[tuple[str, object]]:
    stripped = text.strip()
    if not stripped:
        return []
    try:
        doc = json.loads(stripped)
    except json.JSONDecodeError:
        doc = None
    except RecursionError:
        raise BadInput(f"{path}: JSON nested too deeply (deeper than Python's recursion limit); an "
                       "engine's response is a few levels deep") from None
    else:
        if isinstance(doc, list):
            return [(f"item {i}", o) for i, o in enumerate(doc)]
        return [("line 1" if "\n" not in stripped else "document", doc)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise BadInput(f"{path} line {n}: not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise BadInput(f"{path} line {n}: JSON nested too deeply (deeper than Python's recursion "
                           "limit); an engine's response is a few levels deep") from None
    return out


def _kind(obj) -> str | None:
    if not isinstance(obj, dict):
        return None
    if "input_ids" in obj or "prompt_len" in obj:
        return "jsonl"
    if "choices" in obj:
        return "vllm"
    if "meta_info" in obj:
        return "sglang"
    return None


# --- field checks: each names the field it found wrong -------------------------------------

def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return _value_problem(f"field {name!r}: expected a token id (an integer >= 0), got {v!r}"[:200], 0)
    return v


def _ids(v, name: str) -> list[int]:
    if not isinstance(v, list):
        raise _Bad(f"field {name!r}: expected a list of token ids, got {type(v).__name__}")
    return [_int(x, f"{name}[{i}]") for i, x in enumerate(v)]


def _lp(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _value_problem(f"field {name!r}: expected a logprob (a number <= 0), got {v!r}"[:200], 0.0)
    v = float(v)
    if not math.isfinite(v) or v > 1e-6:
        # -Infinity too: a sampled token had probability > 0, and one infinite number makes every
        # metric infinite or NaN (token_mult_prob_error inf, k3 KL nan) after the model has run
        return _value_problem(f"field {name!r}: {v!r} is not a logprob (a finite number <= 0)", 0.0)
    return v


def _lps(v, name: str, n: int | None = None, what: str = "") -> list[float]:
    if not isinstance(v, list):
        raise _Bad(f"field {name!r}: expected a list of logprobs, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise _Bad(f"field {name!r}: {len(v)} logprobs, expected {n}{what}")
    return [_lp(x, f"{name}[{i}]") for i, x in enumerate(v)]


def _get(obj: dict, key: str, name: str | None = None, what: str = ""):
    if not isinstance(obj, dict) or key not in obj:
        raise _Bad(f"missing field {name or key!r}" + (f" ({what})" if what else ""))
    return obj[key]


# what each field of tpdiag's JSONL holds, for a line that lacks it (docs/rl.md, 'What it reads')
JSONL_FIELDS = {
    "input_ids": "the prompt's token ids followed by the generated ones, without padding",
    "prompt_len": "the number of prompt tokens at the start of input_ids",
    "logprobs": "the engine's logprob of each generated token, input_ids[prompt_len:]",
}


# --- tpdiag JSONL ---------------------------------------------------------------------------

def _read_token_lines(obj: dict, where: str) -> list[Sequence]:
    ids = _ids(_get(obj, "input_ids", what=JSONL_FIELDS["input_ids"]), "input_ids")
    p = _get(obj, "prompt_len", what=JSONL_FIELDS["prompt_len"])
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= len(ids):
        raise _Bad(f"field 'prompt_len': {p!r}, expected an integer in 1..len(input_ids)={len(ids)}")
    lps = _lps(_get(obj, "logprobs", what=JSONL_FIELDS["logprobs"]), "logprobs", len(ids) - p,
               " (len(input_ids) - prompt_len)")
    plp = None
    if obj.get("prompt_logprobs") is not None:
        plp = _lps(obj["prompt_logprobs"], "prompt_logprobs", p - 1, " (prompt_len - 1)")
    top = None
    if obj.get("top_logprobs") is not None:
        raw = obj["top_logprobs"]
        if not isinstance(raw, list) or len(raw) != len(lps):
            raise _Bad(f"field 'top_logprobs': expected a list of {len(lps)} lists of [token_id, logprob]")
        top = []
        for j, pos in enumerate(raw):
            if not isinstance(pos, list):
                raise _Bad(f"field 'top_logprobs[{j}]': expected a list of [token_id, logprob]")
            row = []
            for k, e in enumerate(pos):
                if not isinstance(e, list) or len(e) != 2:
                    raise _Bad(f"field 'top_logprobs[{j}][{k}]': expected [token_id, logprob]")
                row.append((_int(e[0], f"top_logprobs[{j}][{k}][0]"), _lp(e[1], f"top_logprobs[{j}][{k}][1]")))
            top.append(row)
    return [Sequence(ids, p, lps, plp, top, where)]


# --- vLLM (OpenAI-compatible) ----------------------------------------------------------------

def _token_id(tok, name: str) -> int:
    """vLLM's `return_tokens_as_token_ids` spelling: 'token_id:1234'."""
    if isinstance(tok, str) and tok.startswith("token_id:") and tok[9:].isdigit():
        return int(tok[9:])
    raise _Bad(f"field {name!r}: token {tok!r}"[:120] + " has no id; ask vLLM with return_token_ids "
               "(prompt_token_ids, token_ids) or return_tokens_as_token_ids")


def _vllm_prompt_lps(raw, prompt: list[int], name: str) -> list[float | None]:
    """vLLM's prompt_logprobs: [None, {token_id: {"logprob": x, ...} | x}, ...] per prompt token;
    the prompt token's own entry is always there (with the requested top-k beside it)."""
    if not isinstance(raw, list) or len(raw) != len(prompt):
        raise _Bad(f"field {name!r}: expected {len(prompt)} entries (one per prompt token), got "
                   f"{len(raw) if isinstance(raw, list) else type(raw).__name__}")
    out = []
    for t in range(1, len(prompt)):
        d = raw[t]
        if not isinstance(d, dict):
            raise _Bad(f"field '{name}[{t}]': expected {{token_id: logprob}}, got {type(d).__name__}")
        e = d.get(str(prompt[t]), d.get(prompt[t]))
        if e is None:
            raise _Bad(f"field '{name}[{t}]': no entry for the prompt token {prompt[t]}")
        out.append(_lp(e.get("logprob") if isinstance(e, dict) else e, f"{name}[{t}]"))
    return out


def _read_vllm(obj: dict, where: str) -> list[Sequence]:
    choices = _get(obj, "choices")
    if not isinstance(choices, list) or not choices:
        raise _Bad("field 'choices': expected a non-empty list")
    seqs = []
    for c, ch in enumerate(choices):
        name = f"choices[{c}]"
        if not isinstance(ch, dict):
            raise _Bad(f"field {name!r}: expected an object")
        prompt = ch.get("prompt_token_ids", obj.get("prompt_token_ids"))
        if prompt is None:
            raise _Bad("missing field 'prompt_token_ids': ask vLLM with return_token_ids, so the "
                       "prompt's token ids come back")
        prompt = _ids(prompt, "prompt_token_ids")
        if not prompt:
            raise _Bad("field 'prompt_token_ids': empty")
        lp = ch.get("logprobs")
        if not isinstance(lp, dict):
            raise _Bad(f"missing field '{name}.logprobs': ask vLLM with logprobs (chat: logprobs=true)")
        top = None
        if "content" in lp:  # chat completions
            content = lp["content"]
            if not isinstance(content, list):
                raise _Bad(f"field '{name}.logprobs.content': expected a list")
            lps = [_lp(_get(e, "logprob", f"{name}.logprobs.content[{j}].logprob"),
                       f"{name}.logprobs.content[{j}].logprob") for j, e in enumerate(content)]
            toks = [e.get("token") for e in content]
            tops = [e.get("top_logprobs") for e in content]
            if all(isinstance(t, list) and t for t in tops) and tops:
                top = [[(_token_id(x.get("token"), f"{name}.logprobs.content[{j}].top_logprobs"),
                         _lp(x.get("logprob"), f"{name}.logprobs.content[{j}].top_logprobs"))
                        for x in t] for j, t in enumerate(tops)]
        elif "token_logprobs" in lp:  # completions
            lps = _lps(lp["token_logprobs"], f"{name}.logprobs.token_logprobs")
            toks = lp.get("tokens") or [None] * len(lps)
            tops = lp.get("top_logprobs")
            if isinstance(tops, list) and tops and all(isinstance(t, dict) and t for t in tops):
                top = [[(_token_id(k, f"{name}.logprobs.top_logprobs[{j}]"), _lp(v, f"{name}.logprobs.top_logprobs[{j}]"))
                        for k, v in t.items()] for j, t in enumerate(tops)]
        else:
            raise _Bad(f"field '{name}.logprobs': expected 'content' (chat) or 'token_logprobs' (completions)")
        if ch.get("token_ids") is not None:
            gen = _ids(ch["token_ids"], f"{name}.token_ids")
        else:
            gen = [_token_id(t, f"{name}.logprobs tokens[{j}]") for j, t in enumerate(toks)]
        if len(gen) != len(lps):
            raise _Bad(f"field '{name}.token_ids': {len(gen)} tokens but {len(lps)} logprobs")
        if top is not None and len(top) != len(lps):
            top = None
        plp_raw = ch.get("prompt_logprobs", obj.get("prompt_logprobs"))
        plp = None if plp_raw is None else _vllm_prompt_lps(plp_raw, prompt, "prompt_logprobs")
        if gen:
            seqs.append(Sequence(prompt + gen, len(prompt), lps, plp, top, f"{where} {name}"))
    return seqs


# --- SGLang -----------------------------------------------------------------------------------

def _sgl_entries(raw, name: str, first_may_be_none: bool) -> tuple[list[int], list[float | None]]:
    if not isinstance(raw, list):
        raise _Bad(f"field {name!r}: expected a list of [logprob, token_id, text]")
    ids, lps = [], []
    for j, e in enumerate(raw):
        if not isinstance(e, (list, tuple)) or len(e) not in (2, 3):
            raise _Bad(f"field '{name}[{j}]': expected [logprob, token_id, text], got {e!r}"[:200])
        ids.append(_int(e[1], f"{name}[{j}][1]"))
        if e[0] is None and (first_may_be_none and j == 0):
            lps.append(None)
        else:
            lps.append(_lp(e[0], f"{name}[{j}][0]"))
    return ids, lps


def _read_sglang(obj: dict, where: str) -> list[Sequence]:
    meta = _get(obj, "meta_info")
    if not isinstance(meta, dict):
        raise _Bad("field 'meta_info': expected an object")
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key not in meta:
            raise _Bad(f"missing field 'meta_info.{key}': ask SGLang with return_logprob=true and "
                       "logprob_start_len=0")
    prompt, plp = _sgl_entries(meta["input_token_logprobs"], "meta_info.input_token_logprobs", True)
    gen, lps = _sgl_entries(meta["output_token_logprobs"], "meta_info.output_token_logprobs", False)
    n_prompt = meta.get("prompt_tokens")
    if isinstance(n_prompt, int) and n_prompt != len(prompt):
        raise _Bad(f"field 'meta_info.input_token_logprobs': {len(prompt)} entries but prompt_tokens is "
                   f"{n_prompt}: ask SGLang with logprob_start_len=0 so every prompt token is there")
    if not prompt:
        raise _Bad("field 'meta_info.input_token_logprobs': empty")
    if plp[0] is not None:
        # The first prompt token has no logprob: SGLang's list from position 0 starts with
        # [null, id, text]. A number there means it starts inside the prompt (logprob_start_len > 0),
        # and the generated tokens would be measured after a truncated prompt.
        raise _Bad(f"field 'meta_info.input_token_logprobs[0][0]': {plp[0]!r}, expected null (the first "
                   "prompt token has no logprob): the list does not start at the prompt's first token; "
                   "ask SGLang with logprob_start_len=0 so it covers the whole prompt")
    top = None
    raw_top = meta.get("output_top_logprobs")
    if isinstance(raw_top, list) and len(raw_top) == len(gen) and all(isinstance(t, list) and t for t in raw_top):
        top = []
        for j, t in enumerate(raw_top):
            ids_j, lps_j = _sgl_entries(t, f"meta_info.output_top_logprobs[{j}]", False)
            top.append(list(zip(ids_j, lps_j)))
    plp = plp[1:] if any(x is not None for x in plp[1:]) else None
    return [Sequence(prompt + gen, len(prompt), lps, plp, top, where)] if gen else []


_READERS = {"jsonl": _read_token_lines, "vllm": _read_vllm, "sglang": _read_sglang}
