"""Performance: timing, FLOP counts for MFU/HFU, the hardware table, roofline, memory, compilation and profiling.

matplotlib, an optional dependency (the plot extra), is imported only when a plot is drawn.
"""

from jaxperf.perf.buffers import buffer_report, format_buffers, parse_buffer_assignment, read_dump
from jaxperf.perf.compile import aot_compile, enable_compilation_cache, export_fn, export_forward, load_exported
from jaxperf.perf.flops import flops_per_token, matmul_params, recompute_flops_per_token
from jaxperf.perf.hardware import CHIPS, Chip, chip_for, describe, format_info, peak_bandwidth, peak_flops
from jaxperf.perf.cpu_host import HostMemory, host_memory, reexec_with_huge_pages
from jaxperf.perf.memory import (
    MemoryEstimate, OutOfMemoryAdvice, advise, check_fits, compiled_memory, estimate, live_device_memory,
)
from jaxperf.perf.profile import audit_host_syncs, step_annotation, trace
from jaxperf.perf.roofline import DeviceSpec, RooflinePoint, analyze, plot
from jaxperf.perf.timing import Timing, benchmark

__all__ = [
    "CHIPS", "Chip", "DeviceSpec", "HostMemory", "MemoryEstimate", "OutOfMemoryAdvice", "RooflinePoint", "Timing",
    "advise", "analyze", "aot_compile", "audit_host_syncs", "benchmark", "buffer_report", "check_fits", "chip_for",
    "compiled_memory", "describe", "enable_compilation_cache", "estimate", "export_fn", "export_forward",
    "flops_per_token", "format_buffers", "format_info", "host_memory", "live_device_memory", "load_exported",
    "matmul_params", "parse_buffer_assignment", "peak_bandwidth", "peak_flops", "plot", "read_dump",
    "recompute_flops_per_token", "reexec_with_huge_pages", "step_annotation", "trace",
]
