"""The time of the emulated hardware: its constants (``Hardware``), the compute model calibrated on
the fabric simulator (``calibration``), cost functions (``model``), and the latency of serving a
language model (``inference``). See docs/design.md section 6."""
from wse_core.perf.hardware import Hardware
from wse_core.perf.model import UnitWork, gemm_cycles, gemm_seconds, memoryx_update_seconds, unit_seconds, unit_work

__all__ = ["Hardware", "UnitWork", "gemm_cycles", "gemm_seconds", "memoryx_update_seconds",
           "unit_seconds", "unit_work"]
