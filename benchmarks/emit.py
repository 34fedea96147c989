"""The attention benchmarks' common tail: the run's table printed and the whole result written as
JSON where asked (benchmarks.attention, attention_configs, attention_sass, attention_passes)."""
from __future__ import annotations

import json


def emit(result: dict, lines: list[str], json_path: str | None) -> dict:
    """The run's table printed and kept in `result`, and the whole of it written as JSON where
    asked (the attention benchmarks' common tail)."""
    result["table"] = "\n".join(lines)
    print(result["table"], flush=True)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return result
