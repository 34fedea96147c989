"""Tamper suite, rollout input (issue 58): a value listed twice on any axis is refused in compare's one
line (it used to be folded without a word), and every bad value of every line is named - line and
field - not only the first one of each line, up to 20 lines and then "and N more problems".

In-process (CliRunner): every case stops before a model is built. On ed1fba1 the repeated values ran
the model (folded) and exited 0, and only the first problem of each line was named.
"""
import json

import pytest
from typer.testing import CliRunner

GOOD = {"input_ids": [1, 2, 3, 4], "prompt_len": 2, "logprobs": [-0.5, -0.25]}


def _file(tmp_path, lines, name="r.jsonl"):
    f = tmp_path / name
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(f)


def _rollout(*args):
    from tpdiag.cli import app

    r = CliRunner().invoke(app, ["rollout", *args, "--model", "tiny-llama", "--device", "cpu"])
    return r.exit_code, [ln for ln in r.output.splitlines() if ln.strip()]


# --tp and the others are rollout's own axes; the first value of each is the reference configuration
@pytest.mark.parametrize("args,what", [
    (["--tp", "1,1"], "--tp '1,1': 1 is listed twice"),
    (["--micro-batch", "2,2"], "--micro-batch '2,2': 2 is listed twice"),
    (["--mode", "prefill,prefill"], "--mode 'prefill,prefill': prefill is listed twice"),
    (["--fix", "none,stock"], "--fix 'none,stock': stock is the same fix set as none"),
    (["--fix", "all,all"], "--fix 'all,all': all is listed twice"),
    (["--flags", "default,default"], "--flags 'default,default': default is listed twice"),
    (["--attention", "eager,eager"], "--attention 'eager,eager': eager is listed twice"),
    (["--padding", "left,left"], "--padding 'left,left': left is listed twice"),
])
def test_a_repeated_axis_value_is_refused_in_one_line(tmp_path, args, what):
    f = _file(tmp_path, [GOOD])
    base = ["--tp", "1", "--micro-batch", "1", "--mode", "prefill", "--fix", "none"]
    code, lines = _rollout(f, *base, *args)  # the later option wins: only `args` repeats a value
    assert code == 2 and len(lines) == 1 and what in lines[0], lines


def test_every_bad_value_of_every_line_is_named(tmp_path):
    f = _file(tmp_path, [
        {"input_ids": [1, 2, 3, 4, 5], "prompt_len": 2, "logprobs": [0.5, -1.0, "x"]},
        GOOD,
        {"input_ids": [1, -2, 3, 4], "prompt_len": 2, "logprobs": [-0.1, 2.0],
         "prompt_logprobs": [0.25]},
        {"input_ids": [1, 2, 3, 4], "prompt_len": 2, "logprobs": [-0.1]},  # a broken shape: stops its line
    ])
    code, lines = _rollout(f, "--tp", "1")
    assert code == 2, lines
    assert [ln.split(f"{f} ", 1)[1].split(":")[0] + ":" + ln.split("field ", 1)[1].split(":")[0]
            for ln in lines] == ["line 1:'logprobs[0]'", "line 1:'logprobs[2]'", "line 3:'input_ids[1]'",
                                 "line 3:'logprobs[1]'", "line 3:'prompt_logprobs[0]'", "line 4:'logprobs'"], lines


def test_the_list_is_capped_with_how_many_more(tmp_path):
    f = _file(tmp_path, [{"input_ids": [1, 2] + [3] * 30, "prompt_len": 2, "logprobs": [1.0] * 30}])
    code, lines = _rollout(f, "--tp", "1")
    assert code == 2 and len(lines) == 21, lines
    assert all("field 'logprobs[" in ln for ln in lines[:20]) and lines[20].endswith("and 10 more problems"), lines


# rollout's --fix takes fix sets; compare's `auto` (fix and rerun until nothing diverges) is not
# one. Before: both lines read "unknown fix; expected all, auto, none or ..." - offering `auto`,
# which the same option had just refused.
@pytest.mark.parametrize("value,what", [
    ("auto", "--fix 'auto': auto is compare's (fix and rerun until nothing diverges); rollout tries fix sets: "
             "none, all, or fixes joined with '+'"),
    ("al", "--fix 'al': unknown fix 'al'; expected none, all, or any of tp-invariant-linear,"),
    ("none,tp-invariant-linear+invariant-gem", "unknown fix 'invariant-gem'; expected none, all, or any of"),
])
def test_a_wrong_fix_names_what_rollout_takes(tmp_path, value, what):
    f = _file(tmp_path, [GOOD])
    code, lines = _rollout(f, "--tp", "1", "--micro-batch", "1", "--mode", "prefill", "--fix", value)
    assert code == 2 and len(lines) == 1 and what in lines[0], lines
    assert "auto," not in lines[0], lines
