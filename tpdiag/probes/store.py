"""A degree's records on disk: events.jsonl (one line per record) + records.safetensors."""
from __future__ import annotations

import os

import torch

from tpdiag import io
from tpdiag.errors import Inconclusive

EVENTS = "events.jsonl"
TENSORS = "records.safetensors"


def write(out_dir: str, stored: list[tuple[dict, torch.Tensor]], world_meta: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tensors = {str(m["idx"]): t.contiguous() for m, t in stored}
    # Tensors first, index last: an index that exists always points at complete tensors.
    io.write_safetensors(os.path.join(out_dir, TENSORS), tensors, metadata={"schema": "1"})
    io.write_jsonl(os.path.join(out_dir, EVENTS), [m for m, _ in stored])
    io.write_json(os.path.join(out_dir, "world.json"), world_meta)


class RecordSet:
    """Read side. Tensors load lazily; a truncated or edited file is Inconclusive, never misread."""

    def __init__(self, out_dir: str):
        self.dir = out_dir
        self.events = io.read_jsonl(os.path.join(out_dir, EVENTS))
        self.world = io.read_json(os.path.join(out_dir, "world.json"))
        path = os.path.join(out_dir, TENSORS)
        if not os.path.isfile(path):
            raise Inconclusive(f"{path}: missing")
        try:
            from safetensors import safe_open

            self._f = safe_open(path, framework="pt")
            keys = set(self._f.keys())
        except Exception as e:
            raise Inconclusive(f"{path}: unreadable or truncated safetensors ({e})") from None
        missing = [str(m["idx"]) for m in self.events if str(m["idx"]) not in keys]
        if missing:
            raise Inconclusive(f"{path}: {len(missing)} records listed in {EVENTS} are missing "
                               f"(first: {missing[0]})")
        self.by_key = {m["key"]: m for m in self.events}

    def tensor(self, meta: dict) -> torch.Tensor:
        try:
            return self._f.get_tensor(str(meta["idx"]))
        except Exception as e:
            raise Inconclusive(f"{self.dir}: record {meta['key']} unreadable ({e})") from None
