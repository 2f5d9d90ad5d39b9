"""`jaxperf info [--preset NAME] [--platform tpu] [key=value ...]`: versions, devices, the mesh a run would use, the
implementation each hot op would get and why, peak FLOP/s."""

from __future__ import annotations

import argparse
import sys

import flax
import jax
import optax

from jaxperf.config import MESH_AXES, ConfigError, get_config, mesh_shape
from jaxperf.models.platform import PLATFORMS, implementation_choices
from jaxperf.parallel.mesh import normalize_platform
from jaxperf.perf.hardware import describe, format_info
from jaxperf.perf.cpu_host import host_memory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf info", description="Devices, the mesh a run would use, peak FLOP/s.")
    p.add_argument("--preset", default=None, help="tiny (default), gpt2-small, gpt2-medium, llama-1b")
    p.add_argument("--platform", choices=PLATFORMS, default=None,
                   help="the platform to report implementations for (default: this machine's devices)")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. fsdp=4 tensor=2)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = get_config(args.preset, args.overrides)  # an unknown preset or key: one line, exit 2 (cli._errors)
    devices = jax.devices()
    print(f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, python {sys.version.split()[0]}")
    print(f"platform {jax.default_backend()}: {len(devices)} devices ({devices[0].device_kind}), "
          f"{jax.process_count()} process(es), {len(jax.local_devices())} local")
    try:  # a mesh this machine cannot hold is reported, not refused: that is what info is asked
        shape = mesh_shape(cfg.parallel, len(devices))
        print(f"mesh for preset {args.preset or 'tiny'}: " + " ".join(f"{a}={shape[a]}" for a in MESH_AXES)
              + f", strategy {cfg.parallel.strategy}")
        platform = args.platform or normalize_platform(devices[0].platform)
        for choice in implementation_choices(cfg, shape, platform):
            print(f"{choice.op} on {platform}: {choice.impl} ({choice.why})")
    except ConfigError as e:
        print(f"mesh: {e}")
    print(format_info(describe(devices[0])))
    if jax.default_backend() == "cpu":
        print(host_memory().describe())
    return 0
