"""Each option's help lists exactly what its parser accepts: for every option of every command whose
help writes its choices as `a | b | c`, the parser's own refusal of a value outside them (one
line, exit 2, naming what it accepts) names the same set; and no help says a feature is coming
("for now", "yet", "today") - the CLI states what holds. In-process (CliRunner), no world starts."""
import re

import typer.main
from typer.testing import CliRunner

from tpdiag.cli import app

runner = CliRunner()
# the arguments a command needs before it reads its options (none of them is opened: each command
# refuses the bad option value first)
NEEDS = {"rollout": ["x.jsonl", "--model", "tiny-llama"], "gate": ["/nonexistent"],
         "confirm": ["/nonexistent"], "diff": ["/nonexistent", "/nonexistent"]}
# placeholders a help names for an open-ended value (a path, a fix name), not a literal choice
OPEN = {"hf:DIR", "py:FILE.py:FUNC", "NAME[,NAME]"}
STALE = re.compile(r"\b(for now|yet|today|coming|not implemented)\b", re.I)


def _options():
    for name, cmd in typer.main.get_command(app).commands.items():
        for p in cmd.params:
            if p.param_type_name == "option":
                yield name, p


def _listed(help_text: str) -> set:
    """The choices a help writes as `a | b (why) | c`: the word beside each ' | '."""
    segs = help_text.split(" | ")
    if len(segs) < 2:
        return set()
    first = segs[0]
    out = {first.split()[0] if "(" in first else first.split()[-1]}
    for s in segs[1:]:
        out.add(s.split()[0])
        if ";" in s and s is not segs[-1]:
            out.add(s.split(";")[-1].split()[-1])  # 'b (why); hf: models c | d': a second list
    return {c.rstrip(":;,)") for c in out}


def _accepted(name: str, opt: str) -> set:
    r = runner.invoke(app, [name, *NEEDS.get(name, []), opt, "bogus-value"])
    msg = (r.output or "").strip()
    assert r.exit_code == 2 and len(msg.splitlines()) == 1, (name, opt, r.exit_code, msg)
    tail = re.split(r"expected(?: one of)?", msg, maxsplit=1)[-1]
    tail = tail.replace(" or any of ", ", ").replace(" or both (prefill,decode)", "").replace(" or ", ", ")
    return {w.strip(" .;()") for w in tail.split(",") if w.strip(" .;()")}


def test_every_listed_choice_is_what_the_parser_accepts():
    checked = []
    for name, p in _options():
        listed = _listed(p.help or "")
        if not listed:
            continue
        accepted = _accepted(name, p.opts[0])
        if name == "compare" and p.name in ("variant", "variants"):
            from tpdiag.models.plans import HF_VARIANTS, VARIANTS

            # hf: models take their own variants; --variants adds fix:NAME items (its own test)
            plans = set(HF_VARIANTS) | set(VARIANTS)
            accepted, listed = (accepted & plans) | set(HF_VARIANTS), listed & plans
        if name == "compare" and p.name == "fix":
            from tpdiag.fixes.registry import catalogue

            listed |= set(catalogue())  # listed after 'NAME one of', comma-separated
        assert listed - OPEN == accepted - OPEN, (name, p.opts[0], sorted(listed), sorted(accepted))
        checked.append((name, p.opts[0]))
    # the closed choices of compare and every --format are among what was compared
    for want in [("compare", "--dtype"), ("compare", "--device"), ("compare", "--mode"),
                 ("compare", "--granularity"), ("compare", "--capture"), ("compare", "--model"),
                 ("rollout", "--device"), ("gate", "--format"), ("diff", "--format")]:
        assert want in checked, (want, checked)


def test_listed_parses_a_help_the_way_a_reader_does():
    # the negative control of the extraction: a choice dropped from or added to a help is seen
    assert _listed("float32 | bfloat16 | float16") == {"float32", "bfloat16", "float16"}
    assert _listed("full (every record) | hash (hashes) | auto (big)") == {"full", "hash", "auto"}
    assert _listed("how: prefill | decode (decode: one token per call)") == {"prefill", "decode"}
    assert _listed("plan variant: built-in models a | b (b: x); hf: models c | d (why)") == {"a", "b", "c", "d"}


def test_no_help_promises_what_is_not_there():
    for name, cmd in typer.main.get_command(app).commands.items():
        for text in [cmd.help or ""] + [p.help or "" for p in cmd.params if p.param_type_name == "option"]:
            assert not STALE.search(text), (name, STALE.search(text).group(0), text[:200])
