"""What a run asks of this machine's memory, checked before anything is allocated.

A population that cannot fit used to start allocating and end minutes later by the kernel's OOM killer, with
nothing written; worker processes (each imports numpy and numba and loads the kernels) did the same when
asked for by the thousand. :func:`check_memory` refuses such a run with one line, from two measured floors:
a simulated device costs at least :data:`BYTES_PER_DEVICE` (1BitRRPM at 100M devices x 31 rounds peaked at
132 bytes a device, README "100 million devices"), and a worker process :data:`BYTES_PER_PROCESS`
(about 165 MB measured).
"""

from __future__ import annotations

from scenarios.schema import ScenarioError

__all__ = ["BYTES_PER_DEVICE", "BYTES_PER_PROCESS", "available_memory", "check_memory"]

BYTES_PER_DEVICE = 130
BYTES_PER_PROCESS = 150_000_000


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none to read: not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(devices: int, processes: int = 1, workers_field: str = "simulation.workers") -> None:
    """A ScenarioError when ``devices`` (all the run's processes hold between them, each process holding
    per-device arrays of its whole population: a live shard builds its world and ledger whole) and
    ``processes - 1`` worker processes need more than the memory available. It names population.devices, or
    ``workers_field`` when the workers alone take more than the devices."""
    available = available_memory()
    need = devices * BYTES_PER_DEVICE + (processes - 1) * BYTES_PER_PROCESS
    if available is not None and need > available:
        extra = processes - 1
        workers = f" and {extra:,} worker process{'es' if extra > 1 else ''}" if extra else ""
        field = workers_field if extra * BYTES_PER_PROCESS > devices * BYTES_PER_DEVICE else "population.devices"
        raise ScenarioError(f"{field}: {devices:,} devices{workers} need at least {need / 1e9:.3g} GB of "
                            f"memory ({BYTES_PER_DEVICE} bytes a device, {BYTES_PER_PROCESS / 1e9:g} GB a process), "
                            f"and {available / 1e9:.3g} GB is available")
