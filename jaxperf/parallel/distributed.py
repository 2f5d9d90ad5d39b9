"""Starting JAX's multi-controller runtime: every process runs the same program and sees all devices of the job.

    jaxperf.parallel.distributed.initialize()   # before anything touches jax.devices()

Where the process count and rank come from, first match wins:
1. arguments: `initialize(coordinator="host:port", num_processes=N, process_id=i)`;
2. environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (any launcher can set these);
3. a cluster JAX detects by itself (a SLURM job step with more than one task, a multi-host Cloud TPU slice):
   `jax.distributed.initialize()` with no arguments;
4. otherwise one process, nothing to start.
On CPU the cross-process collectives go through gloo. The call is idempotent.

If a process dies, the others notice through the coordination service's heartbeats and exit with an error instead of
waiting forever: after `heartbeat_timeout_s` seconds (argument, or JAXPERF_HEARTBEAT_TIMEOUT_S; JAX's default is 100).
"""

from __future__ import annotations

import os

import jax

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _cluster_detected() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int | None = None) -> bool:
    """Starts the distributed runtime when this process is one of several; returns whether it did (or had)."""
    # Private, so imported where used: the only place that says whether initialize() already ran.
    from jax._src import distributed as _dist

    if getattr(_dist.global_state, "client", None) is not None:
        return True
    env = {k: os.environ.get(k) for k in _ENV}
    given = [coordinator, num_processes, process_id]
    if any(v is not None for v in given) or env["JAX_NUM_PROCESSES"] is not None:
        coordinator = coordinator or env["JAX_COORDINATOR_ADDRESS"]
        num_processes = num_processes if num_processes is not None else _int(env, "JAX_NUM_PROCESSES")
        process_id = process_id if process_id is not None else _int(env, "JAX_PROCESS_ID")
        missing = [n for n, v in zip(_ENV, (coordinator, num_processes, process_id)) if v is None]
        if missing:
            raise ValueError(f"multi-process start needs a coordinator address, a process count and a process id; "
                             f"missing {missing}: set them as environment variables or pass them to initialize()")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"JAX_PROCESS_ID={process_id} is not in [0, {num_processes}) for "
                             f"JAX_NUM_PROCESSES={num_processes}")
        if num_processes == 1:
            return False
        _use_gloo_on_cpu()
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   **_timeouts(heartbeat_timeout_s))
        return True
    if _cluster_detected():
        _use_gloo_on_cpu()
        jax.distributed.initialize(**_timeouts(heartbeat_timeout_s))
        return True
    return False


def _timeouts(heartbeat_timeout_s: int | None) -> dict:
    if heartbeat_timeout_s is None and os.environ.get("JAXPERF_HEARTBEAT_TIMEOUT_S"):
        heartbeat_timeout_s = _int({"JAXPERF_HEARTBEAT_TIMEOUT_S": os.environ["JAXPERF_HEARTBEAT_TIMEOUT_S"]},
                                   "JAXPERF_HEARTBEAT_TIMEOUT_S")
    if heartbeat_timeout_s is None:
        return {}
    if heartbeat_timeout_s < 1:
        raise ValueError(f"the heartbeat timeout must be >= 1 s, got {heartbeat_timeout_s}")
    return {"heartbeat_timeout_seconds": int(heartbeat_timeout_s)}


def _int(env: dict, key: str) -> int | None:
    value = env[key]
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not an integer") from None


def _use_gloo_on_cpu() -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except AttributeError:  # pragma: no cover - a JAX without the option uses gloo already
            pass
