"""The host memory available now (Linux /proc/meminfo's MemAvailable), for the full-capture
budget (probes/host_budget.py) and the pre-launch memory check (models/capacity.py)."""
from __future__ import annotations


def mem_available() -> int | None:
    """Bytes available without swapping, or None where /proc/meminfo says nothing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
