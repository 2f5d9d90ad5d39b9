"""Peak host memory of loading a Hugging Face checkpoint into its shards (the weights path of `init_from`) and of
exporting it again, in a process of its own: `python tests/_peak_memory.py SRC OUT MAX_SHARD_BYTES` prints one JSON
line (tests/test_finetune.py runs it with 8 simulated CPU devices).

On CPU the devices' buffers live in host memory too, so each phase reports the growth of the resident set's peak
(VmHWM, reset between phases through /proc/self/clear_refs) beyond what the devices hold afterwards: the host memory
the phase needed on top of the model itself. tracemalloc's peak over what stays allocated (numpy buffers) is reported
beside it.
"""

import gc
import json
import re
import sys
import tracemalloc

import jax

from jaxperf.config import ParallelConfig, TrainConfig
from jaxperf.interop import export_hf, hf_model_config, load_hf_params
from jaxperf.parallel.mesh import make_mesh
from jaxperf.step.task import build_task


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def _start_phase() -> int:
    """Reset the peak resident set to the current one; returns the current one in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    tracemalloc.reset_peak()
    return _status_kb("VmRSS") * 1024


def _device_bytes(tree) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards)


def main(src: str, out: str, max_shard_bytes: int) -> dict:
    cfg = TrainConfig(model=hf_model_config(src), parallel=ParallelConfig(strategy="fsdp", fsdp=-1))
    task = build_task(cfg, make_mesh(cfg.parallel), with_optimizer=False)
    tracemalloc.start()

    base = _start_phase()
    traced_base = tracemalloc.get_traced_memory()[0]
    params = jax.block_until_ready(load_hf_params(src, cfg.model, task.param_shardings))
    held = _device_bytes(params)
    traced_now, traced_peak = tracemalloc.get_traced_memory()
    load = {"rss_peak_over_devices": _status_kb("VmHWM") * 1024 - base - held, "device_bytes": held,
            "traced_peak_over_final": traced_peak - traced_now, "traced_final": traced_now - traced_base}

    base = _start_phase()
    traced_base = tracemalloc.get_traced_memory()[0]
    files = export_hf(cfg.model, params, out, max_shard_size=max_shard_bytes)
    traced_peak = tracemalloc.get_traced_memory()[1]
    export = {"rss_peak": _status_kb("VmHWM") * 1024 - base, "traced_peak": traced_peak - traced_base,
              "files": len(files)}
    return {"model_bytes": sum(x.nbytes for x in jax.tree.leaves(params)), "load": load, "export": export}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
