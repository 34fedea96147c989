"""The record key as an object (records/keys.py): format and parse are inverse on every key a
real run writes, a malformed key is a typed error (never a silent miss of a lookup), and no
module of tpdiag builds or splits a key by hand any more (the grep below fails on the old code).
"""
import csv
import os
import re

import pytest
from conftest import ROOT

from tpdiag.errors import Inconclusive, MalformedKey
from tpdiag.records.keys import RecordKey, record_key


def test_every_key_of_a_real_run_parses_and_formats_back(tp12_run):
    rows = list(csv.DictReader(open(tp12_run / "diff.csv")))
    assert len(rows) > 50
    for r in rows:
        k = RecordKey.parse(r["key"])
        assert k.format() == r["key"] == str(k)
        # the row's own columns are the key's parts
        assert k == RecordKey.of(r), r["key"]


@pytest.mark.parametrize("key,parts", [
    ("s0/forward/layers.0.mlp.w2/out#3/0", (0, "forward", "layers.0.mlp.w2", "out", 3, "0")),
    ("s12/backward/layers.0.attention.wq/param_grad#0/weight",
     (12, "backward", "layers.0.attention.wq", "param_grad", 0, "weight")),
    # an op record's name holds '#' (the op's call and output index)
    ("s0/forward/layers.0.attention/op#0/aten::_scaled_dot_product_flash_attention_for_cpu#0.1",
     (0, "forward", "layers.0.attention", "op", 0, "aten::_scaled_dot_product_flash_attention_for_cpu#0.1")),
    # an oracle note of a whole module call has no name
    ("s1/forward/layers.0.feed_forward/oracle#2", (1, "forward", "layers.0.feed_forward", "oracle", 2, None)),
    ("s0/loss/model/logits#0/logits", (0, "loss", "model", "logits", 0, "logits")),
])
def test_parse_and_format_are_inverse(key, parts):
    k = RecordKey.parse(key)
    assert (k.step, k.phase, k.module, k.kind, k.call, k.name) == parts
    assert k.format() == key == record_key(*parts)


def test_prefix_is_what_every_name_of_the_call_shares():
    k = RecordKey(0, "init", "layers.0.attention.wq", "param_init")
    assert k.prefix() == "s0/init/layers.0.attention.wq/param_init#0/"
    assert record_key(0, "init", "layers.0.attention.wq", "param_init", 0, "weight").startswith(k.prefix())


@pytest.mark.parametrize("bad", [
    "s0/forward/m/out/0",          # no call
    "0/forward/m/out#0/0",         # no step marker
    "sX/forward/m/out#0/0",        # a step that is no number
    "s0/forward/m/out#one/0",      # a call that is no number
    "s0/forward/out#0/0",          # no module
    "",
    None,
])
def test_a_malformed_key_is_a_typed_error(bad):
    with pytest.raises(MalformedKey, match="record key"):
        RecordKey.parse(bad)
    assert issubclass(MalformedKey, Inconclusive)  # corrupt evidence: exit 2, as an edited record


# Writing a key by hand: an f-string starting with the step marker, a '/kind#' segment, or a
# split / rpartition on '/' (the module is not always the third part).
HAND_MADE = (re.compile(r"""f["']s\{"""),
             re.compile(r"""/(?:in|out|grad_out|param_grad|param|param_init|oracle|op|logits)#"""),
             re.compile(r"""\.split\(["']/["']\)"""),
             re.compile(r"""\.r?partition\(["']/["']\)"""))


def _hand_made(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if any(p.search(line) for p in HAND_MADE) and not line.strip().startswith(("#", '"""'))]


def test_the_grep_catches_the_old_hand_made_keys():
    """Negative control: the lines this change replaced are caught."""
    old = '''
    key = f"s{step}/{phase}/{module}/{kind}#{call}/{name}"
    xk = f"s{row['step']}/forward/{row['module']}/in#{row['call']}/0"
    return fd["key"].split("/")[2]
    head, _, name = oracle_key.rpartition("/")
    head = head.replace("/oracle#", "/op#")
'''
    assert len(_hand_made(old)) == 5


def test_no_module_builds_or_splits_a_key_by_hand():
    pkg = os.path.join(ROOT, "tpdiag")
    hits = []
    for d, _, files in os.walk(pkg):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and path != os.path.join(pkg, "records", "keys.py"):
                # docstrings may show a key; code may not build one
                code = re.sub(r'"""(?:.|\n)*?"""', "", open(path).read())
                hits += [f"{os.path.relpath(path, ROOT)}: {h}" for h in _hand_made(code)]
    assert not hits, hits
