"""lifecycle: what happens to each saved tensor during a step, as plain data.

Pure data and pure functions: the :class:`Recorder` (clock and memory probe injected), the frozen
:class:`Trace` it produces, the exporters, the :class:`HardwareModel`, the step simulator and the
planner (:func:`plan` -> :class:`Plan`). No CUDA calls; never imports ``offload`` or ``storage``.
"""

from offload.lifecycle._anchors import checkpoint_blocks, offload_all, predict_anchors
from offload.lifecycle._clock import Clock, MonotonicClock
from offload.lifecycle._export import write_memory_png, write_perfetto, write_plan_png
from offload.lifecycle._hardware import HARDWARE_SCHEMA_VERSION, HardwareModel
from offload.lifecycle._pipeline import StagePrediction, pipeline_trace, predict_1f1b, schedule_1f1b
from offload.lifecycle._placement import Decision, Placement
from offload.lifecycle._plan import (
    PLAN_SCHEMA_VERSION,
    BudgetInfeasibleError,
    Plan,
    PlanEntry,
    Prediction,
    Trigger,
)
from offload.lifecycle._planner import plan
from offload.lifecycle._profile import profile
from offload.lifecycle._recorder import MemoryProbe, Recorder, StepBoundary
from offload.lifecycle._sim_engine import Simulation
from offload.lifecycle._simulate import simulate
from offload.lifecycle._synthetic import transformer_trace
from offload.lifecycle._trace import (
    SCHEMA_VERSION,
    Event,
    EventKind,
    Family,
    ModuleSpan,
    TensorRecord,
    Trace,
)

__all__ = [
    # recording
    "Clock",
    "MemoryProbe",
    "MonotonicClock",
    "Recorder",
    "StepBoundary",
    "profile",
    # the trace
    "SCHEMA_VERSION",
    "Event",
    "EventKind",
    "Family",
    "ModuleSpan",
    "TensorRecord",
    "Trace",
    # exports
    "write_memory_png",
    "write_perfetto",
    "write_plan_png",
    # hardware
    "HARDWARE_SCHEMA_VERSION",
    "HardwareModel",
    # simulation
    "Placement",
    "Decision",
    "Simulation",
    "simulate",
    "offload_all",
    "checkpoint_blocks",
    "predict_anchors",
    # planning
    "PLAN_SCHEMA_VERSION",
    "BudgetInfeasibleError",
    "Plan",
    "PlanEntry",
    "Prediction",
    "Trigger",
    "plan",
    "transformer_trace",
    # pipelines
    "StagePrediction",
    "schedule_1f1b",
    "pipeline_trace",
    "predict_1f1b",
]
