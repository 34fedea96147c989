"""`tpdiag gate --junit`: JUnit XML, one testcase per compared degree."""
from __future__ import annotations

import time

from tpdiag.gate.result import DegreeResult, GateResult


# how every file junit_xml writes begins (the suite's name is its first attribute): what an existing
# --junit file must hold to be written over (base/files.refuse_replacing)
JUNIT_MARK = b'<testsuite name="tpdiag gate"'


def junit_xml(res: GateResult) -> bytes:
    """One testcase per compared degree; evidence problems are <error>, policy violations <failure>."""
    import xml.etree.ElementTree as ET

    suite = ET.Element("testsuite", name="tpdiag gate", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    run_level = [p for p in res.problems if not any(p.startswith(f"TP={lab}:") for lab in res.degrees)]
    cases = res.degrees or {"run": DegreeResult("run", "error", error=res.problems[0] if res.problems else "")}
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    for lab, d in cases.items():
        name = f"TP={lab} vs TP={res.reference}" if lab != "run" else "run directory"
        case = ET.SubElement(suite, "testcase", classname="tpdiag.gate", name=name)
        if d.status == "error" or (run_level and lab != "run"):
            msg = d.error or run_level[0]
            ET.SubElement(case, "error", message=msg, type="inconclusive").text = "\n".join(
                ([d.error] if d.error else []) + run_level)
            counts["errors"] += 1
        elif d.violations:
            ET.SubElement(case, "failure", message=d.violations[0].line(), type=d.violations[0].cause).text = \
                "\n".join(v.line() for v in d.violations)
            counts["failures"] += 1
        elif d.status == "skipped":
            ET.SubElement(case, "skipped", message="not gated by the policy")
            counts["skipped"] += 1
    suite.set("tests", str(len(cases)))
    for k, v in counts.items():
        suite.set(k, str(v))
    root = ET.Element("testsuites")
    root.append(suite)
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8")
