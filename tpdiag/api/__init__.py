"""The public Python API, re-exported lazily by `tpdiag` itself: record a run in your own job
(capture.py: `tpdiag.capture`), train with the invariant kernels on (invariant.py:
`tpdiag.invariant`, `tpdiag.clip_grad_norm_`, `tpdiag.accumulate_grads`), set PyTorch's
determinism flags (determinism.py: `tpdiag.set_deterministic`, `tpdiag.deterministic`).
read a run directory into DataFrames, its evidence checked first (load.py: `tpdiag.load`; the
frames themselves live with the record format in tpdiag/records/frames.py). Everything outside tpdiag/api/ and tpdiag/cli/ is internal."""
