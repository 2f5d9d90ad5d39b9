"""Performance: FLOP counts for MFU/HFU and per-device hardware peaks."""

from jaxperf.perf.flops import flops_per_token, matmul_params
from jaxperf.perf.hardware import CHIPS, Chip, chip_for, peak_flops

__all__ = ["CHIPS", "Chip", "chip_for", "flops_per_token", "matmul_params", "peak_flops"]
