"""The record format: what a run writes and every reader reads.

store.py      a degree's records (events.jsonl + records.safetensors): the event schema, `RecordSet`
hashing.py    the record hash (hash-first capture and the stored-tensor check)
layout.py     the shard rules: whole tensors rebuilt from stored shards
styles.py     a TP plan's ParallelStyle as the short label records carry
rundir.py     a run directory: completion marker, manifest, summary.json, diff.csv's columns and reader
frames.py     a run directory as pandas DataFrames (`tpdiag.load`); diff.csv is written from its records frame
provenance.py the versions every manifest carries
causes.py     the cause registry: each label's class (bug / non-finite / rounding / unknown),
              explanation, short name and advice; the bug exit code
keys.py       the record key as an object (RecordKey: format, parse; MalformedKey otherwise)
integrity.py  does a run directory agree with itself (per-rank markers, results, manifest, summary)
lock.py       one writer per run directory (an flock; a stale one is said)

Probes write through it; diff, gate and reports read through it. Nothing here imports probes,
diff or runner, and this file imports nothing (torch loads with store/layout, pandas with frames).
"""
