"""What every layer may import: the one configuration type and its names (configs.py), the
configurations a compare runs (points.py), file I/O with atomic writes and capped reads
(files.py), host memory (hostmem.py) and DTensor helpers (dtensors.py). Nothing here imports
another tpdiag package but errors and config."""
