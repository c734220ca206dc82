"""offload: an activation memory manager for PyTorch training.

Profile a step to learn when each saved tensor is created and last used, plan where each one
waits (GPU, pinned host memory, NVMe, or recomputed), and run that plan with overlapped copies.
``import offload`` is all a user needs.
"""

from offload._activations import activations
from offload._errors import (
    BudgetInfeasibleError,
    ChecksumError,
    OffloadError,
    StorageError,
    StorageFullError,
)
from offload._offloader import ActivationOffloader
from offload._planning import plan
from offload._probe import probe_hardware
from offload._profile import profile
from offload._stats import OffloadStats, StepStats
from offload.lifecycle import (
    Event,
    EventKind,
    Family,
    HardwareModel,
    ModuleSpan,
    Plan,
    Recorder,
    TensorRecord,
    Trace,
    write_memory_png,
    write_perfetto,
)

__version__ = "0.1.0"

__all__ = [
    # offloading
    "ActivationOffloader",
    "activations",
    "OffloadStats",
    "StepStats",
    # profiling and planning
    "Recorder",
    "profile",
    "plan",
    "probe_hardware",
    # data
    "Event",
    "EventKind",
    "Family",
    "ModuleSpan",
    "TensorRecord",
    "Trace",
    "Plan",
    "HardwareModel",
    # exports
    "write_memory_png",
    "write_perfetto",
    # errors
    "OffloadError",
    "BudgetInfeasibleError",
    "StorageError",
    "ChecksumError",
    "StorageFullError",
]
