"""Implementations by the platform a step is compiled for: the table of jaxperf.models.platform, the model config
settled once from it (what the model then traces), the reports that name each choice, and a train step compiled for a
TPU slice on this CPU machine that gets the Mosaic flash-attention kernel and the chunked loss by default."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxperf.config import ConfigError, get_config
from jaxperf.models import GPT, attention
from jaxperf.models import platform as plat

from _accelerators import tpu_devices


def _attn(platform, **kw):
    shapes = dict(dtype=jnp.bfloat16, head_dim=64, heads=8, kv_heads=2, q_len=1024, kv_len=1024, segment_ids=False)
    return plat.attention_choice(platform, **{**shapes, **kw})


def test_attention_table_picks_by_platform_and_says_why_it_falls_back():
    assert _attn("tpu").impl == "pallas"
    assert _attn("gpu").impl == "cudnn"
    assert _attn("cpu").impl == "xla"
    odd = _attn("tpu", head_dim=80)
    assert odd.impl == "xla" and "head dim 80" in odd.why
    assert _attn("gpu", dtype=jnp.float32).impl == "xla" and "float32" in _attn("gpu", dtype=jnp.float32).why
    assert _attn("gpu", segment_ids=True).impl == "xla"
    assert _attn("gpu", q_len=1, kv_len=64).impl == "xla"
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        _attn("metal")


def test_loss_table_chunks_large_logits_on_accelerators_only():
    for platform in ("tpu", "gpu"):
        big = plat.chunked_loss_bytes(platform) // (4 * 50304) + 1  # rows whose fp32 logits just pass the threshold
        assert plat.loss_choice(platform, rows_per_device=big, vocab=50304).impl == "chunked"
        assert plat.loss_choice(platform, rows_per_device=big - 1, vocab=50304).impl == "xla"
        assert plat.loss_choice(platform, rows_per_device=big, vocab=50304, vocab_split=True).impl == "xla"
        assert plat.loss_choice(platform, rows_per_device=big, vocab=50304, seq_split=True).impl == "xla"
    assert plat.loss_choice("cpu", rows_per_device=100 * big, vocab=50304).impl == "xla"
    # gpt2-small's preset batch on one GPU (32 x 1024 rows, 6.6 GB of logits) keeps the full logits, as on TPU it
    # would not: the faster program on an H200 (jaxperf.models.platform)
    assert plat.loss_choice("gpu", rows_per_device=32 * 1024, vocab=50304).impl == "xla"
    assert plat.loss_choice("tpu", rows_per_device=32 * 1024, vocab=50304).impl == "chunked"


def test_implementation_choices_follow_the_mesh_and_explicit_settings():
    cfg = get_config("gpt2-small")
    mesh = {"data": 1, "stage": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    by_op = {c.op: c for c in plat.implementation_choices(cfg, mesh, "tpu")}
    assert (by_op["attention"].impl, by_op["loss"].impl, by_op["norm"].impl) == ("pallas", "chunked", "xla")
    assert "MiB of fp32 logits" in by_op["loss"].why
    ring = {c.op: c.impl for c in plat.implementation_choices(cfg, {**mesh, "seq": 2}, "tpu")}
    assert ring["attention"] == "ring" and ring["loss"] == "xla"
    piped = {c.op: c.impl for c in plat.implementation_choices(cfg, {**mesh, "stage": 2}, "tpu")}
    assert piped["loss"] == "xla"
    tp = {c.op: c.impl for c in plat.implementation_choices(cfg, {**mesh, "tensor": 2}, "tpu")}
    assert tp["loss"] == "xla"
    forced = get_config("gpt2-small", ["model.attention_impl=xla", "model.loss_impl=xla"])
    chosen = {c.op: c for c in plat.implementation_choices(forced, mesh, "tpu")}
    assert chosen["attention"].impl == "xla" and chosen["attention"].why == "model.attention_impl"
    assert {c.op: c.impl for c in plat.implementation_choices(cfg, mesh, "cpu")} == {
        "attention": "xla", "loss": "xla", "norm": "xla"}


def _traced_text(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_scan_unroll_is_the_platforms_unless_set():
    """On GPU the whole stack runs in one scan iteration, whatever its depth (faster and leaner there); tiny's four
    layers run unrolled on CPU as well, a deeper stack there and every stack on TPU keeps the scan rolled (one layer's
    recomputed activations live at a time); a set value stays."""
    tiny = get_config("tiny").model
    assert tiny.scan_unroll is None
    assert plat.for_platform(tiny, "cpu").scan_unroll == 4 and plat.for_platform(tiny, "gpu").scan_unroll == 4
    assert plat.for_platform(tiny, "tpu").scan_unroll == 1
    deep = get_config("tiny", ["model.n_layers=32", "model.d_model=4096"]).model
    assert plat.for_platform(deep, "cpu").scan_unroll == 1 and plat.for_platform(deep, "tpu").scan_unroll == 1
    assert plat.for_platform(deep, "gpu").scan_unroll == 32
    assert plat.for_platform(get_config("tiny", ["model.scan_unroll=2"]).model, "tpu").scan_unroll == 2


def test_layer_weights_are_rounded_before_the_cast_on_tpu_unless_set():
    """On TPU the layers round an fp32 weight slice to bf16's bits before casting it (the compiler then makes no bf16
    copy of the stacked weights: tests/test_topology.py); elsewhere the plain cast; a set value stays."""
    tiny = get_config("tiny").model
    assert tiny.round_weights_before_cast is None
    assert plat.for_platform(tiny, "tpu").round_weights_before_cast is True
    assert plat.for_platform(tiny, "cpu").round_weights_before_cast is False
    assert plat.for_platform(tiny, "gpu").round_weights_before_cast is False
    off = get_config("tiny", ["model.round_weights_before_cast=false"]).model
    assert plat.for_platform(off, "tpu").round_weights_before_cast is False
    on = get_config("tiny", ["model.round_weights_before_cast=true"]).model
    assert plat.for_platform(on, "cpu").round_weights_before_cast is True


def test_mlp_weights_are_gathered_whole_on_tpu_from_4_mib_unless_set():
    """On TPU the MLP gathers each weight of 4 MiB or more (in the compute dtype) whole before its matmul
    (`jaxperf.parallel.rules.gather_weight`, its numbers checked in tests/test_parallel.py); smaller ones, and every
    weight elsewhere, the compiler gathers its own way; a set value stays."""
    small = get_config("tiny").model  # 128 x 512 fp32: 256 KiB
    big = get_config("gpt2-small").model  # 768 x 3072 bf16: 4.5 MiB
    assert small.gather_mlp_weights is None and big.gather_mlp_weights is None
    assert plat.mlp_weight_bytes(big) == 768 * 3072 * 2 >= plat.GATHER_MLP_MIN_BYTES > plat.mlp_weight_bytes(small)
    assert plat.for_platform(big, "tpu").gather_mlp_weights is True
    assert plat.for_platform(small, "tpu").gather_mlp_weights is False
    assert plat.for_platform(big, "cpu").gather_mlp_weights is False
    assert plat.for_platform(big, "gpu").gather_mlp_weights is False
    assert plat.for_platform(get_config("gpt2-small", ["model.gather_mlp_weights=false"]).model, "tpu") \
        .gather_mlp_weights is False
    assert plat.for_platform(get_config("tiny", ["model.gather_mlp_weights=true"]).model, "cpu").gather_mlp_weights


def test_the_chunked_loss_gathers_its_output_weights_once_on_tpu_unless_set():
    """On TPU the chunked loss under FSDP gathers the output weights whole once, for its forward and backward (the
    one all-gather checked in tests/test_kernels_cross_entropy.py); elsewhere block by block in each pass; a set
    value stays."""
    cfg = get_config("llama-1b").model
    assert cfg.loss_gather_once is None
    assert plat.for_platform(cfg, "tpu").loss_gather_once is True
    assert plat.for_platform(cfg, "cpu").loss_gather_once is False
    assert plat.for_platform(cfg, "gpu").loss_gather_once is False
    assert plat.for_platform(get_config("llama-1b", ["model.loss_gather_once=false"]).model, "tpu") \
        .loss_gather_once is False


def test_expert_parallelism_sends_ragged_on_tpu_and_cpu_refuses_it_in_one_line():
    """The ragged all-to-all is settled on for TPU only (no GPU run has checked it; asked for, a GPU takes it) and
    never for CPU, whose XLA has none: set there, an MoE config is refused before anything is traced; a dense model
    ignores the flag."""
    moe = get_config("moe-tiny").model
    assert moe.ragged_all_to_all is None
    assert [plat.for_platform(moe, p).ragged_all_to_all for p in ("tpu", "gpu", "cpu")] == [True, False, False]
    assert plat.for_platform(dataclasses.replace(moe, ragged_all_to_all=True), "gpu").ragged_all_to_all is True
    off = dataclasses.replace(moe, ragged_all_to_all=False)
    assert plat.for_platform(off, "tpu").ragged_all_to_all is False
    with pytest.raises(ConfigError, match=r"^model.ragged_all_to_all=true but XLA:CPU has no ragged all-to-all"):
        plat.for_platform(dataclasses.replace(moe, ragged_all_to_all=True), "cpu")
    dense = get_config("tiny", ["model.ragged_all_to_all=true"]).model
    assert plat.for_platform(dense, "cpu").ragged_all_to_all is True


def test_layer_gradients_stack_in_the_compute_dtype_on_tpu_unless_set():
    """On TPU remat full stacks the weight gradients in the compute dtype (jaxperf.models.layer_scan); elsewhere
    autodiff's scan; a set value stays. The model takes that path only with remat full and a narrower compute
    dtype."""
    from jaxperf.models.gpt import compact_layer_grads

    tiny = get_config("tiny", ["model.remat=full", "model.dtype=bfloat16"]).model
    assert tiny.layer_grads_in_compute_dtype is None and not compact_layer_grads(tiny)
    assert [plat.for_platform(tiny, p).layer_grads_in_compute_dtype for p in ("tpu", "cpu", "gpu")] == [
        True, False, False]
    assert compact_layer_grads(plat.for_platform(tiny, "tpu"))
    off = get_config("tiny", ["model.layer_grads_in_compute_dtype=false"]).model
    assert plat.for_platform(off, "tpu").layer_grads_in_compute_dtype is False
    tpu = plat.for_platform(tiny, "tpu")
    assert not compact_layer_grads(dataclasses.replace(tpu, remat="save_dots"))
    assert not compact_layer_grads(dataclasses.replace(tpu, dtype="float32"))


def test_norm_gradients_in_the_compute_dtype_on_tpu_unless_set_or_the_pallas_norm():
    """On TPU the XLA norms sum their scales' gradients over the rows in bf16; elsewhere in fp32; a set value stays;
    the Pallas norm, whose kernel sums them itself, is not given the setting, and asked for it together is refused."""
    tiny = get_config("tiny").model
    assert [plat.for_platform(tiny, p).norm_grads_in_compute_dtype for p in ("tpu", "cpu", "gpu")] == [
        True, False, False]
    off = get_config("tiny", ["model.norm_grads_in_compute_dtype=false"]).model
    assert plat.for_platform(off, "tpu").norm_grads_in_compute_dtype is False
    pallas = get_config("tiny", ["model.norm_impl=pallas"]).model
    assert plat.for_platform(pallas, "tpu").norm_grads_in_compute_dtype is False
    both = get_config("tiny", ["model.norm_impl=pallas", "model.norm_grads_in_compute_dtype=true"]).model
    with pytest.raises(ConfigError, match="norm_grads_in_compute_dtype=true needs the XLA norm"):
        plat.for_platform(both, "tpu")


def test_mlp_slices_settled_from_the_hidden_values_per_device_on_tpu():
    """On TPU under remat full the MLP runs in the fewest slices of whole 128-lane tiles that keep one slice's hidden
    values per device at MLP_SLICE_BYTES or less; not with other remats, a tensor-split width, or off TPU."""
    llama = get_config("tiny", ["model.d_model=4096", "model.mlp_dim=11008", "model.dtype=bfloat16",
                                "model.remat=full"]).model.resolved()
    choice = lambda tokens, **kw: plat.mlp_slices_choice(  # noqa: E731
        kw.pop("platform", "tpu"), tokens_per_device=tokens, model=kw.pop("model", llama), **kw)
    assert choice(2048) == 1 and choice(4096) == 1  # 86 MiB
    assert choice(8192) == 2  # 172 MiB in two slices of 5504 (11008 cuts into tiles only by 2 up to 8)
    assert choice(32768) == 2  # no more tiled slices to take
    mistral = dataclasses.replace(llama, mlp_dim=14336)
    assert choice(16384, model=mistral) == 4  # 448 MiB: 4 x 112
    assert choice(8192, platform="gpu") == choice(8192, platform="cpu") == 1
    assert choice(8192, tensor=2) == 1
    assert choice(8192, model=dataclasses.replace(llama, remat="save_dots")) == 1
    cfg = get_config("tiny", ["model.d_model=4096", "model.mlp_dim=11008", "model.dtype=bfloat16", "model.remat=full",
                              "batch_size=128", "seq_len=4096", "model.max_seq_len=4096"])
    assert plat.settle(cfg, {"fsdp": 64}, "tpu").mlp_slices == 2  # 2 rows of 4096 a device
    assert plat.settle(cfg, {"fsdp": 64}, "cpu").mlp_slices == 1
    fixed = get_config("tiny", ["model.mlp_slices=4"])
    assert plat.settle(fixed, {"fsdp": 8}, "tpu").mlp_slices == 4  # a set value stays


def test_settle_leaves_nothing_to_the_platform_and_the_log_line_names_it():
    cfg = get_config("gpt2-small")
    mesh = {"data": 1, "stage": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    settled = plat.settle(cfg, mesh, "tpu")
    assert (settled.platform, settled.attention_impl, settled.loss_impl, settled.norm_impl) == (
        "tpu", "pallas", "chunked", "xla")
    assert (settled.scan_unroll, settled.matmul_grad_barrier) == (1, False)
    on_cpu = plat.settle(get_config("tiny"), {"data": 8}, "cpu")
    assert (on_cpu.platform, on_cpu.attention_impl, on_cpu.loss_impl, on_cpu.norm_impl) == ("cpu", "xla", "xla", "xla")
    assert (on_cpu.scan_unroll, on_cpu.matmul_grad_barrier) == (4, True)
    # ring attention where the sequence is split; the settled attention is what a model without the ring runs
    ring = plat.settle(cfg, {**mesh, "seq": 2}, "tpu")
    assert ring.attention_impl == "pallas" and ring.loss_impl == "xla"
    line = plat.describe_settled(cfg, {**mesh, "seq": 2}, "tpu")
    assert line.startswith("settled for tpu: attention=ring") and "loss=xla" in line and "scan_unroll=1" in line
    with pytest.raises(ConfigError, match="model.platform='gpu' but the mesh's devices are 'tpu'"):
        plat.settle(get_config("gpt2-small", ["model.platform=gpu"]), mesh, "tpu")
    # PLATFORM_FIELDS (what `jaxperf compile` reports as settled) names every field for_platform decides
    for platform in plat.PLATFORMS:
        for model in (cfg.model, get_config("moe-tiny").model):
            done = plat.for_platform(model, platform)
            moved = {f.name for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(done, f.name)}
            assert moved - {"platform"} <= set(plat.PLATFORM_FIELDS), (platform, moved)
            assert all(getattr(done, f) is not None for f in plat.PLATFORM_FIELDS), (platform, done)


def test_a_model_settled_for_tpu_traces_the_mosaic_kernel_on_this_host():
    cfg = get_config("tiny", ["model.d_model=256", "model.n_heads=4", "model.dtype=bfloat16", "model.n_layers=1"])
    tokens = jnp.zeros((1, 128), jnp.int32)
    traced = {}
    for platform in ("cpu", "tpu"):
        model = GPT(plat.settle(cfg, {"data": 1}, platform), rngs=__import__("flax").nnx.Rngs(0))
        traced[platform] = _traced_text(lambda t: model(t), tokens)
    assert "pallas_call" not in traced["cpu"]
    assert "pallas_call" in traced["tpu"]
    # Built for TPU, not for the CPU interpreter: the kernel's tiles live in VMEM.
    assert "Ref<vmem>" in traced["tpu"]
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    assert "pallas_call" not in _traced_text(lambda q, k, v: attention(q, k, v, causal=True), q, kv, kv)
    assert "Ref<vmem>" in _traced_text(lambda q, k, v: attention(q, k, v, platform="tpu"), q, kv, kv)
    with pytest.raises(RuntimeError, match="cuDNN attention needs an NVIDIA GPU.*'tpu'"):
        attention(q, kv, kv, impl="cudnn", platform="tpu")


def test_the_settled_loss_chunks_the_logits_on_an_accelerator():
    cfg = get_config("tiny", ["model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.vocab_size=4096",
                              "model.max_seq_len=256", "batch_size=8"])
    batch = {"inputs": jnp.zeros((8, 256), jnp.int32), "targets": jnp.zeros((8, 256), jnp.int32)}
    full = "f32[8,256,4096]"  # the materialised fp32 logits

    def traced(platform):
        model = GPT(plat.settle(cfg, {"data": 1}, platform), rngs=__import__("flax").nnx.Rngs(0))
        return _traced_text(lambda b: model.next_token_loss(b)[0], batch)

    assert full in traced("cpu")
    assert full in traced("tpu")  # 8 x 256 rows x 4096 x 4 bytes = 32 MiB: under the threshold, full logits
    small = plat.CHUNKED_LOSS_BYTES
    try:
        plat.CHUNKED_LOSS_BYTES = 16 * 2**20
        chunked = traced("tpu")
    finally:
        plat.CHUNKED_LOSS_BYTES = small
    assert full not in chunked and "f32[2048,4096]" not in chunked


TINY_TPU = ["model.d_model=128", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=256", "batch_size=8"]


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["jit", "shard_map"])
def test_default_train_step_compiled_for_tpu_runs_the_mosaic_kernel(flavour):
    from jaxperf.config import mesh_shape
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.step.task import build_task
    from jaxperf.explicit.flavours import build_train_step

    devices = tpu_devices("v5p:2x2x1")
    cfg = get_config("tiny", TINY_TPU + ["fsdp=4", f"parallel.flavour={flavour}"])
    assert mesh_shape(cfg.parallel, len(devices))["fsdp"] == 4
    mesh = make_mesh(cfg.parallel, list(devices))
    task = build_task(cfg, mesh)
    step = build_train_step(task, task.loss_fn, flavour)
    B, L = cfg.batch_size, cfg.train_seq_len
    tok = task.batch_sharding(2)
    batch = {k: jax.ShapeDtypeStruct((B, L), jnp.float32 if k == "mask" else jnp.int32, sharding=tok)
             for k in ("inputs", "targets", "mask")}
    text = step.fn.lower(task.abstract_state(), batch).compile().as_text()
    # The flash kernel forward and its backward are Mosaic custom calls; the XLA path has none.
    assert text.count("tpu_custom_call") >= 2, flavour
