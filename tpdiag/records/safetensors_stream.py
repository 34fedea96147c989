"""records.safetensors written one tensor at a time: the same bytes as safetensors.torch.save,
without building the whole file in memory (full capture at scale: tens of GB of records, most
of them still in host chunks or spill files - probes/host_store.py).

The layout safetensors writes: an 8-byte little-endian header length, a compact JSON header
({"__metadata__": ..., then every tensor's dtype, shape and data_offsets}) padded with spaces to a
multiple of 8, then the tensors' bytes back to back, ordered by dtype (widest first, the order
below) then by name. tests/test_full_stream.py checks the bytes against safetensors.torch.save
for every dtype here; any other dtype falls back to safetensors.torch.save itself.
"""
from __future__ import annotations

import json
import struct

import torch

# safetensors 0.8: the order save() lays tensors out in (its Dtype enum, descending)
_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
          "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_NAMES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64",
    torch.float32: "F32", torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16",
    torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def torch_dtype_name(code: str) -> str | None:
    """A header's dtype code as torch names the dtype ("F32" -> "float32"); None for a code not above."""
    d = next((t for t, c in _NAMES.items() if c == code), None)
    return None if d is None else str(d).replace("torch.", "")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def header(tensors: dict, metadata: dict | None) -> tuple[bytes, list]:
    """(length + header bytes, [(name, tensor)] in file order)."""
    items = sorted(tensors.items(), key=lambda kv: (_ORDER.index(_NAMES[kv[1].dtype]), kv[0]))
    head: dict = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, t in items:
        n = _nbytes(t)
        head[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    js = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, items


def write(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """tensors: name -> torch.Tensor (any device) or probes.host_store.Captured (anything with
    dtype, shape, numel(), element_size() and write_to(file))."""
    from tpdiag.base import files as io

    if any(t.dtype not in _NAMES for t in tensors.values()):
        io.write_safetensors(path, {k: (v if isinstance(v, torch.Tensor) else v.get()).contiguous()
                                    for k, v in tensors.items()}, metadata)
        return
    head, items = header(tensors, metadata)

    def body(f):
        f.write(head)
        for _, t in items:
            if not _nbytes(t):
                continue
            if isinstance(t, torch.Tensor):
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            else:
                t.write_to(f)

    # no fsync: a region pass writes GBs a world, and the fsync waited for the disk (the reader
    # checks every record's hash: a file lost in a crash fails closed, it does not pass)
    io._atomic(path, body, sync=False)
