"""`jaxperf compile --topology`: the train step compiled for a TPU slice on this CPU machine (needs libtpu).

libtpu is found either in the test environment or in a directory named by JAXPERF_LIBTPU_PATH (a `pip install
--target` of the libtpu wheel), which is put on the subprocess's PYTHONPATH. Without it the compile tests are skipped
with the reason (failed under JAXPERF_REQUIRE_LIBTPU=1, as in CI). The error a user without libtpu gets is checked
by a subprocess that cannot see it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from _accelerators import NEWEST_TPU_COMPILER, libtpu_pythonpath

LIBTPU_IMPORTABLE = importlib.util.find_spec("libtpu") is not None


def _compile(args, *, libtpu: bool, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if libtpu:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (libtpu_pythonpath(), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "jaxperf.cli", "compile", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_compile_for_a_v5p_slice_reports_memory_and_flops_per_chip():
    common = ["model.d_model=256", "model.n_layers=2", "model.n_heads=4", "batch_size=16"]
    fsdp = _compile(["--topology", "v5p:2x2x1", "--json", *common], libtpu=True)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    r = json.loads(fsdp.stdout.strip().splitlines()[-1])
    assert r["chips"] == 4 and r["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "seq": 1, "tensor": 1}
    assert "v5" in r["device_kind"].lower() and r["hbm_bytes"] == 95 * 2**30 and r["fits"] is True
    b = r["bytes_per_chip"]
    assert 0 < b["arguments"] and 0 < b["temp"] and b["total"] < r["hbm_bytes"]
    assert r["flops_per_chip"] > 0
    # the default preset (tiny) runs its layers unrolled on CPU only: compiled for TPU, one layer per iteration
    assert r["layers"] == {"n": 2, "scanned": True, "per_iteration": 1}
    # the fields the platform decides, as the program was built: for TPU, not for the CPU host that compiled it
    # (the loss's output weights gathered once; the 1 MiB MLP weights under the size that gathers them whole)
    assert r["settled"] == {"matmul_grad_barrier": False, "scan_unroll": 1, "keep_head_dims": True,
                            "round_weights_before_cast": True, "layer_grads_in_compute_dtype": True,
                            "norm_grads_in_compute_dtype": True, "gather_mlp_weights": False,
                            "loss_gather_once": True, "ragged_all_to_all": True, "mlp_slices": 1}, r
    p = r["prediction"]  # the step time read off the compiled program (jaxperf.perf.predict)
    assert r["predicted_step_s"] == p["step_s"] == max(p["compute_s"], p["hbm_s"], p["collective_s"]) > 0
    assert 0 < r["predicted_mfu"] <= r["model_flops_per_chip"] / r["flops_per_chip"] + 1e-9
    assert p["collectives"]["all-gather"]["ops"] > 0 and not p["unknown_trip_counts"]  # fsdp gathers the weights
    assert p["hbm_bytes"] > b["arguments"]  # every weight and optimizer state is read at least once
    # The largest buffers by kind (--buffers 10 by default), read from the compiler's buffer-assignment dump
    # (jaxperf.perf.buffers; its parser is tested on an excerpt in tests/test_buffers.py): the kinds agree with the
    # memory analysis, the arguments are named by their pytree paths, and the largest temporaries are the scan's
    # saved activations, stacked over the two layers.
    k = r["buffers"]
    assert k["check"]["arguments_match"] and k["check"]["outputs_match"] and k["check"]["aliased_match"], k["check"]
    assert k["bytes"]["parameters"] == b["arguments"] and k["bytes"]["donated"] == b["aliased"] > 0, (k["bytes"], b)
    assert {"state.params", "state.opt_state", "batch"} <= set(k["arguments_by_group"]), k["arguments_by_group"]
    params, temp = k["largest"]["parameters"], k["largest"]["temp"]
    assert len(params) == 10 and all(e["name"].startswith(("state.", "batch")) for e in params), params
    assert len(temp) == 10 and k["bytes"]["temp"] >= temp[0]["bytes"] >= temp[-1]["bytes"] > 0, temp
    assert temp[0]["op"] == "fusion" and temp[0]["shape"].startswith("f32[2,"), temp[0]
    # The same run with the batch and the weights replicated (dp on one chip's worth of work per chip is the same
    # batch slice, but the parameters and Adam state are no longer split four ways): more argument bytes per chip.
    dp = _compile(["--topology", "v5p:2x2x1", "--json", *common, "strategy=dp", "data=4", "fsdp=1"], libtpu=True)
    assert dp.returncode == 0, dp.stderr[-3000:]
    rd = json.loads(dp.stdout.strip().splitlines()[-1])
    assert rd["bytes_per_chip"]["arguments"] > 2 * b["arguments"], (rd["bytes_per_chip"], b)


@pytest.mark.slow
def test_compile_for_two_slices_keeps_fsdp_inside_a_slice():
    out = _compile(["--topology", "v5p:2x2x1", "--slices", "2", "--json", "model.d_model=128", "model.n_layers=2",
                    "model.n_heads=4", "batch_size=16"], libtpu=True)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["chips"] == 8 and r["slices"] == 2
    assert r["mesh"] == {"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "seq": 1, "tensor": 1}
    assert r["slices_per_data_index"] == [[0], [1]]  # each fsdp group is one slice; only data crosses DCN


@pytest.mark.skipif(LIBTPU_IMPORTABLE, reason="libtpu is installed in this environment (not in a directory of its "
                                                "own), so no subprocess can be without it")
def test_compile_without_libtpu_says_how_to_install_it():
    out = _compile(["--topology", "v5p:2x2x1"], libtpu=False, timeout=120)
    assert out.returncode == 2
    assert "needs libtpu" in out.stderr and "pip install 'jax[tpu]'" in out.stderr, out.stderr


def test_the_report_says_when_several_layers_share_a_loop_iteration():
    from jaxperf.train.topology import _layers_line

    line = _layers_line({"n": 32, "scanned": True, "per_iteration": 4})
    assert "4 per iteration" in line and "model.scan_unroll=4" in line and "scan_unroll=1 needs the least" in line, line
    assert "scan_unroll" not in _layers_line({"n": 32, "scanned": True, "per_iteration": 1})


def test_compile_rejects_a_malformed_topology_before_anything_else():
    out = _compile(["--topology", "v5p"], libtpu=False, timeout=120)
    assert out.returncode == 2 and "should look like v5p:4x4x4" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not NEWEST_TPU_COMPILER, reason="16 chips: compiled with the TPU compiler jax 0.12 pins")
def test_compile_a_four_axis_mesh_for_a_v5p_slice():
    """data x stage x fsdp x seq on 16 chips compiles for TPU: the sequence split takes the ring attention and the
    stages pass activations on, both as collective-permutes in the compiled program, and the estimate made before
    compiling stays near XLA's figure."""
    out = _compile(["--topology", "v5p:2x2x4", "--json", "--preset", "gpt2-small", "model.n_layers=4", "batch_size=32",
                    "data=2", "stage=2", "fsdp=2", "seq=2", "microbatches=4"], libtpu=True)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["chips"] == 16 and r["mesh"] == {"data": 2, "stage": 2, "fsdp": 2, "expert": 1, "seq": 2, "tensor": 1}
    assert r["implementations"]["attention"]["impl"] == "ring", r["implementations"]
    # the ring's K/V blocks and the pipeline's activations between stages
    assert r["prediction"]["collectives"]["collective-permute"]["ops"] > 0, r["prediction"]["collectives"]
    assert r["bytes_per_chip"]["temp"] > 0 and not r["prediction"]["unknown_trip_counts"], r
    assert abs(r["estimated_bytes_per_chip"] / r["bytes_per_chip"]["total"] - 1) < 0.25, r


@pytest.mark.slow
@pytest.mark.skipif(not NEWEST_TPU_COMPILER, reason="compiled with the TPU compiler jax 0.12 pins (libtpu 0.0.42's "
                    "program makes and loses the same copy)")
def test_rounding_the_weights_before_the_cast_takes_the_stacked_copy_out_of_the_tpu_program():
    """With bf16 compute over fp32 weights, a plain cast of each scanned layer's weight slice becomes, in the TPU
    compiler's hands, one cast of the whole stacked shard before the layer loop: a bf16 copy of every layer's
    weights (here bf16[8,128,2048] per MLP weight on each chip) live through the step. Rounding the fp32 slice to
    bf16's bits first (`model.round_weights_before_cast`, settled on for TPU) keeps the cast inside the loop. The
    estimate counts the copy only where the program makes it."""
    common = ["--topology", "v5p:2x2x1", "--json", "--buffers", "60", "--preset", "llama-1b", "model.d_model=512",
              "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8", "model.mlp_dim=2048",
              "model.vocab_size=1024", "model.max_seq_len=256", "seq_len=256", "batch_size=16"]
    runs = {}
    for name, extra in (("default", []), ("plain", ["model.round_weights_before_cast=false"])):
        out = _compile([*common, *extra], libtpu=True)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])

    def stacked_bf16_weights(r):
        return [e for e in r["buffers"]["largest"]["temp"] if e["shape"] in ("bf16[8,128,2048]", "bf16[8,2048,128]")]

    assert len(stacked_bf16_weights(runs["plain"])) == 3, runs["plain"]["buffers"]["largest"]["temp"]
    assert stacked_bf16_weights(runs["default"]) == [], runs["default"]["buffers"]["largest"]["temp"]
    # every layer weight in bf16: attention and MLP a quarter of it per chip, the two norm scales whole
    copy = 8 * (4 * 512 * 512 + 3 * 512 * 2048) * 2 // 4 + 8 * 2 * 512 * 2
    plain, default = runs["plain"], runs["default"]
    assert plain["estimated_parts"]["gathered"] - default["estimated_parts"]["gathered"] == copy
    # (the two temp totals: equal with libtpu 0.0.50.1 at these widths, where the block's packing hides 16 MiB)


@pytest.mark.slow
@pytest.mark.extended  # two compiles, 2-3 minutes; run it after touching model.layer_grads_in_compute_dtype
@pytest.mark.skipif(not NEWEST_TPU_COMPILER, reason="compiled with the TPU compiler jax 0.12 pins (libtpu 0.0.42's "
                    "program shrinks the same way; it passed there too, at the cost of two compiles)")
def test_layer_gradient_stacks_in_bf16_shrink_the_tpu_program():
    """Remat full over scanned bf16 layers: the TPU default (`model.layer_grads_in_compute_dtype`) stacks the cast
    weights' gradients in bf16 inside the backward loop (bf16[8,128,2048] per MLP weight on each chip), the fp32
    stacks of the plain scan are gone from the loop, the temporaries shrink, and the estimate's gradients part drops
    by exactly those stacks' halves."""
    common = ["--topology", "v5p:2x2x1", "--json", "--buffers", "60", "--preset", "llama-1b", "model.d_model=512",
              "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8", "model.mlp_dim=2048", "model.remat=full",
              "model.vocab_size=1024", "model.max_seq_len=256", "seq_len=256", "batch_size=16"]
    runs = {}
    for name, extra in (("default", []), ("fp32", ["model.layer_grads_in_compute_dtype=false"])):
        out = _compile([*common, *extra], libtpu=True)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])

    def stacked(r, dtype):
        return [e for e in r["buffers"]["largest"]["temp"]
                if e["shape"] in (f"{dtype}[8,128,2048]", f"{dtype}[8,2048,128]")]

    assert len(stacked(runs["default"], "bf16")) == 3, runs["default"]["buffers"]["largest"]["temp"]
    assert stacked(runs["fp32"], "bf16") == [], runs["fp32"]["buffers"]["largest"]["temp"]
    assert runs["default"]["bytes_per_chip"]["temp"] < runs["fp32"]["bytes_per_chip"]["temp"]
    # the attention's four and the MLP's three weights of 8 layers, a quarter of each per chip, 2 bytes less a value
    halves = 8 * (4 * 512 * 512 + 3 * 512 * 2048) * 2 // 4
    assert runs["fp32"]["estimated_parts"]["grads"] - runs["default"]["estimated_parts"]["grads"] == halves


# ---------------------------------------------------------------------------------------------------------------------
# Train steps compiled in this process for four v5p chips (two layers deep): every strategy as the jit step (GSPMD) and
# as the shard_map step (collectives by hand) at tiny widths, and every preset once at its own widths and vocabulary.
# 5-40 s a compile on two CPU cores.

PRESET_NAMES = ("tiny", "gpt2-small", "gpt2-medium", "llama-1b", "moe-tiny", "mixtral-8x7b")  # presets.PRESETS
# Left out of the per-preset compile: tiny (the strategy matrix compiles it) and mixtral-8x7b, whose two layers hold
# 2.8B expert weights (a long compile on two CPU cores); its MoE layers are moe-tiny's code at other widths, and
# tests/test_interop.py checks its shapes against Mixtral-8x7B's config.json.
NOT_COMPILED = ("tiny", "mixtral-8x7b")
MESHES = {  # four chips, split as each strategy splits them
    "dp": {"parallel.data": 4, "parallel.fsdp": 1},
    "fsdp": {"parallel.fsdp": 4},
    "tp": {"parallel.tensor": 4, "parallel.fsdp": 1},
    "fsdp_tp": {"parallel.fsdp": 2, "parallel.tensor": 2},
}


def test_the_preset_list_is_the_shipped_one():
    from jaxperf.config.presets import PRESETS

    assert set(PRESETS) == set(PRESET_NAMES), "add the new preset to PRESET_NAMES so its TPU compile is tested"


def _state_bytes_per_chip(cfg, topology: str) -> tuple[int, int]:
    """(bytes of one chip's share of the train state, bytes of the whole state) from the shardings jaxperf asks for."""
    import math

    import jax

    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.step.task import build_task
    from jaxperf.train.topology import topology_devices

    task = build_task(cfg, make_mesh(cfg.parallel, topology_devices(topology)))
    leaves = jax.tree.leaves(task.abstract_state())
    shard = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    return shard, whole


def _compile_preset(preset: str, strategy: str, flavour: str, mesh: dict | None = None) -> dict:
    from jaxperf.config import get_config
    from jaxperf.train.topology import compile_for_topology

    libtpu_pythonpath()  # skips (or fails under JAXPERF_REQUIRE_LIBTPU=1) without libtpu; puts it on sys.path
    mesh = mesh or MESHES[strategy]
    cfg = get_config(preset, {"model.n_layers": 2, "batch_size": 8, "seq_len": 128, "parallel.strategy": strategy,
                              "parallel.flavour": flavour, **mesh})
    r = compile_for_topology(cfg, "v5p:2x2x1")
    want = {"data": 1, "stage": 1, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 1}
    want.update({k.split(".")[1]: v for k, v in mesh.items()})
    assert r["chips"] == 4 and r["mesh"] == want and r["flavour"] == flavour, r
    b = r["bytes_per_chip"]
    assert b["arguments"] > 0 and b["temp"] > 0 and b["code"] > 0, b
    # The compiled program takes the state shards jaxperf placed, plus the batch and TPU tile padding: at least one
    # chip's share; under a strategy that splits weights, less than the whole state (a step that silently replicated
    # them would take at least that); under dp, the whole state on every chip.
    shard, whole = _state_bytes_per_chip(cfg, "v5p:2x2x1")
    assert b["arguments"] >= shard, (b["arguments"], shard)
    if strategy == "dp":
        assert shard == whole and b["arguments"] >= whole, (shard, whole, b["arguments"])
    else:
        assert shard < 0.6 * whole and b["arguments"] < whole, (strategy, shard, whole, b["arguments"])
    return r


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["jit", "shard_map"])
@pytest.mark.parametrize("strategy", list(MESHES))
def test_every_strategy_and_flavour_compiles_for_a_v5p_slice(strategy, flavour):
    """Each rule table and each way of writing the step, at tiny widths. An older jax's TPU compiler takes the jit
    step under every strategy and the shard_map step under fsdp (its collectives are the other strategies' too)."""
    if not NEWEST_TPU_COMPILER and flavour == "shard_map" and strategy != "fsdp":
        pytest.skip("compiled with the TPU compiler jax 0.12 pins; an older jax's compiles the jit matrix and "
                    "shard_map under fsdp")
    _compile_preset("tiny", strategy, flavour)


@pytest.mark.slow
@pytest.mark.skipif(not NEWEST_TPU_COMPILER, reason="each preset at its own widths: compiled with the TPU compiler "
                                                    "jax 0.12 pins; an older jax's compiles the tiny-width matrix")
@pytest.mark.parametrize("preset", [  # gpt2-medium is gpt2-small's code at other widths: CI leaves it out for time
    pytest.param(p, marks=[pytest.mark.extended] if p == "gpt2-medium" else []) for p in PRESET_NAMES
    if p not in NOT_COMPILED])
def test_every_preset_compiles_for_a_v5p_slice_at_its_own_widths(preset):
    """Each preset's widths, heads and vocabulary split both ways at once (fsdp x tensor), with the collectives
    written by hand: the strictest of the strategies for widths that must divide over the chips. The MoE preset
    splits its experts over expert x fsdp instead (the jit flavour: validate refuses the others), its tokens sent
    with the ragged all-to-all TPU settles on."""
    if preset != "moe-tiny":
        _compile_preset(preset, "fsdp_tp", "shard_map")
        return
    r = _compile_preset(preset, "fsdp", "jit", {"parallel.expert": 2, "parallel.fsdp": 2})
    collectives = r["prediction"]["collectives"]
    assert collectives["ragged-all-to-all"]["ops"] > 0, collectives
    assert collectives.get("all-to-all", {"bytes": 0})["bytes"] < 1e4, collectives  # only sizes and offsets


@pytest.mark.parametrize("topology, wrap", [
    ("v5p:4x4x4", (True, True, True)), ("v5p:4x4x8", (True, True, True)), ("v4:4x4x4", (True, True, True)),
    ("v5p:2x4x4", (False, False, False)), ("v5p:2x2x1", (False, False, False)),
    ("v6e:8x8", (False, False, False)), ("v6e:8x16", (False, True, False)), ("v5e:16x16", (True, True, False)),
    ("v5p:4x4", None), ("tpu:axb", None),
])
def test_a_slice_wraps_where_a_provisioned_one_has_wraparound_links(topology, wrap):
    from jaxperf.train.topology import topology_wrap

    assert topology_wrap(topology) == wrap


@pytest.mark.slow
def test_a_whole_slice_fsdp_axis_is_laid_along_the_torus_and_gathers_as_all_gathers():
    """On 64 v5p chips (4x4x4, a torus in all three dimensions) the fsdp axis runs through the physical axes in
    row-major order, each step along a ring of ICI neighbours, and the TPU compiler keeps a weight's gather an
    all-gather. Described without its wraparound links, or with the chips in libtpu's listing order (2 x 2 blocks),
    the compiler ran every such gather as a dynamic-update-slice into a zeroed buffer and an all-reduce (twice the ICI
    bytes, a zeroed copy of the weight in temporaries)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxperf.config import ParallelConfig
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.train.topology import topology_devices

    libtpu_pythonpath()  # skips (or fails under JAXPERF_REQUIRE_LIBTPU=1) without libtpu; puts it on sys.path
    mesh = make_mesh(ParallelConfig(strategy="fsdp"), topology_devices("v5p:4x4x4"))
    assert mesh.shape["fsdp"] == 64
    coords = np.array([d.coords for d in mesh.devices.flat]).reshape(4, 4, 4, 3)
    for axis in range(3):  # along each factor of the fsdp axis one physical coordinate moves by 1 (mod 4)
        step = (np.roll(coords, -1, axis=axis) - coords) % 4
        moved = (step != 0).sum(-1)
        assert (moved == 1).all() and set(step.max(-1).flat) <= {1, 3}, (axis, coords[..., :])

    w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    x = jax.ShapeDtypeStruct((64, 2048, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None, None)))

    def step(w, x):
        def loss(w):
            whole = jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), NamedSharding(mesh, P()))
            return jnp.sum(jnp.square((x @ whole).astype(jnp.float32)))
        return jax.grad(loss)(w)

    hlo = jax.jit(step, out_shardings=w.sharding).lower(w, x).compile().as_text()
    gathers = re.findall(r"= \S+ all-gather(?:-start)?\(", hlo)
    assert gathers, "the 64-chip weight gather was compiled as an all-reduce"


@pytest.mark.slow
def test_the_norm_scales_gradient_is_reduced_over_the_batch_in_bf16_on_tpu():
    """With grad_dtype (model.norm_grads_in_compute_dtype, the TPU default) the TPU program's all-reduce of a norm
    scale's gradient over the batch's devices sends bf16, half the bytes of the fp32 one autodiff's sum gives. (XLA:CPU
    runs every bf16 all-reduce in fp32, so only the TPU compiler shows it.)"""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxperf.config import ParallelConfig
    from jaxperf.models.layers import xla_norm
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.train.topology import topology_devices

    libtpu_pythonpath()
    mesh = make_mesh(ParallelConfig(strategy="fsdp"), topology_devices("v5p:2x2x2"))
    rows = NamedSharding(mesh, P("fsdp"))
    x = jax.ShapeDtypeStruct((16, 32, 256), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((16, 32, 256), jnp.float32, sharding=rows)
    scale = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=NamedSharding(mesh, P()))

    def scale_grad(scale, x, w, grad_dtype):
        def loss(scale):
            y = xla_norm(x, scale, None, kind="rmsnorm", eps=1e-6, grad_dtype=grad_dtype)
            return jnp.sum(y.astype(jnp.float32) * w)
        return jax.grad(loss)(scale)

    reduced = {}
    for grad_dtype in (None, jnp.bfloat16):
        hlo = jax.jit(scale_grad, static_argnums=3).lower(scale, x, w, grad_dtype).compile().as_text()
        reduced[grad_dtype] = re.findall(r"= (\w+)\[256\][^\n]*? all-reduce(?:-start)?\(", hlo)
    assert reduced == {None: ["f32"], jnp.bfloat16: ["bf16"]}, reduced


@pytest.mark.slow
@pytest.mark.parametrize("topology, chips", [("v4:2x2x2", 8), ("v5p:2x2x1", 4), ("v5e:2x4", 8)])
def test_a_described_slice_has_one_device_per_chip(topology, chips):
    """v4 and v5p chips run their two TensorCores as one device (megacore), as on an attached slice: libtpu's
    default description of v4 listed each core, twice the devices, each with half a chip's share of the program."""
    from jaxperf.train.topology import topology_devices

    libtpu_pythonpath()
    devices = topology_devices(topology)
    assert len(devices) == chips and len({tuple(d.coords) for d in devices}) == chips
