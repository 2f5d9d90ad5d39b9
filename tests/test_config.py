"""Config overrides and the errors raised before anything compiles."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxperf.config import (
    PRESETS, ConfigError, ModelConfig, ParallelConfig, TrainConfig, apply_overrides, from_dict, get_config, mesh_shape,
    register_preset, to_dict, validate,
)
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel.rules import get_rules
from jaxperf.models import count_params


def test_overrides_dotted_bare_and_types():
    cfg = get_config("tiny", ["max_steps=20", "model.n_layers=2", "lr=0.01", "scan_layers=false", "seq_len=none"])
    assert cfg.max_steps == 20 and cfg.model.n_layers == 2 and cfg.optim.lr == 0.01
    assert cfg.model.scan_layers is False and cfg.seq_len is None
    assert get_config("tiny", {"model.d_model": 64}).model.d_model == 64


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'max_step'.*'max_steps'"):
        get_config("tiny", ["max_step=3"])
    with pytest.raises(ConfigError, match=r"'model.n_layer'.*'model.n_layers'"):
        get_config("tiny", ["model.n_layer=3"])


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"'max_steps' wants int, got 'ten'"):
        get_config("tiny", ["max_steps=ten"])
    with pytest.raises(ConfigError, match=r"'model.scan_layers' wants bool"):
        get_config("tiny", {"model.scan_layers": 3})
    with pytest.raises(ConfigError, match="unknown preset 'tinny'.*tiny"):
        get_config("tinny")


def test_batch_not_divisible_by_data_parallel():
    cfg = get_config("tiny", ["batch_size=12", "parallel.fsdp=8"])
    with pytest.raises(ConfigError, match=r"12.*not divisible by the data-parallel size "
                                          r"data\*fsdp\*expert=1\*8\*1=8.*batch_size=16"):
        validate(cfg, 8)


def test_heads_kv_heads_mlp_not_divisible_by_tensor():
    cfg = get_config("tiny", ["parallel.strategy=tp", "parallel.fsdp=1", "parallel.tensor=8"])
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by .*parallel.tensor=8"):
        validate(cfg, 8)
    cfg = get_config("tiny", ["style=llama", "n_heads=8", "n_kv_heads=2", "strategy=tp", "fsdp=1", "tensor=4"])
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 is not divisible by .*parallel.tensor=4"):
        validate(cfg, 4)
    cfg = get_config("tiny", ["n_heads=8", "mlp_dim=100", "strategy=tp", "fsdp=1", "tensor=8"])
    with pytest.raises(ConfigError, match=r"model.mlp_dim=100 is not divisible .*tensor=8"):
        validate(cfg, 8)


def test_mesh_larger_than_devices():
    with pytest.raises(ConfigError, match=r"data\*stage\*fsdp\*expert\*seq\*tensor = 2\*1\*4\*1\*1\*2 = 16 is larger "
                                          r"than the 8 available devices"):
        mesh_shape(ParallelConfig(data=2, fsdp=4, tensor=2), 8)
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        mesh_shape(ParallelConfig(data=3, fsdp=-1), 8)
    assert mesh_shape(ParallelConfig(data=2, fsdp=-1, tensor=2), 8) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1,
                                                                        "seq": 1, "tensor": 2}


def test_seq_len_above_model_max():
    cfg = get_config("tiny", ["seq_len=256"])
    with pytest.raises(ConfigError, match=r"seq_len=256 is above the model's maximum model.max_seq_len=128"):
        validate(cfg, 1)


def test_unused_mesh_axis_is_an_error():
    mesh = make_mesh(ParallelConfig(strategy="fsdp", fsdp=4, tensor=2))
    with pytest.raises(ConfigError, match=r"tensor=2 but strategy 'fsdp' maps nothing onto it.*'tp' or 'fsdp_tp'"):
        get_rules("fsdp", mesh)


def test_presets_have_their_documented_sizes():
    # GPT-2 small is 124M with the 50257-token vocabulary (nanoGPT pads it to 50304; so do we).
    assert round(count_params(get_config("gpt2-small").model) / 1e6) == 124
    assert round(count_params(get_config("gpt2-medium").model) / 1e6) == 355
    assert 0.95e9 < count_params(get_config("llama-1b").model) < 1.1e9
    assert round(count_params(get_config("mixtral-8x7b").model) / 1e8) == 467  # 46.7B, Mixtral-8x7B
    assert ModelConfig(style="llama", d_model=96).resolved().mlp_dim == 256


def test_choices_come_from_the_annotations_and_suggest_the_closest():
    assert get_config("tiny", ["style=llama", "remat=full", "tokenizer=bpe"]).model.style == "llama"
    with pytest.raises(ConfigError, match=r"unknown model.remat 'ful'; choose one of none, full, .*Did you mean 'full'"):
        get_config("tiny", ["remat=ful"])
    with pytest.raises(ConfigError, match=r"unknown model.norm 'batchnorm'; choose one of layernorm, rmsnorm"):
        get_config("tiny", ["norm=batchnorm"])  # an Optional choice: none is allowed too
    assert get_config("tiny", ["norm=none"]).model.norm is None
    # A config built in Python (no parser) meets the same choices when it is validated.
    with pytest.raises(ConfigError, match=r"model.dtype='fp8' is not one of \('float32', 'bfloat16', 'float16'\)"):
        validate(dataclasses.replace(get_config("tiny"), model=ModelConfig(dtype="fp8")), 8)


def test_custom_remat_names_are_checked_before_compiling():
    cfg = get_config("tiny", ["remat=custom", "remat_save=query_proj,key_proj", "remat_offload=mlpwi"])
    validate(cfg, 1)
    assert cfg.model.remat_offload == ("mlpwi",)
    with pytest.raises(ConfigError, match=r"model.remat_save names 'attn_proj', which no layer tags: use names from "
                                          r"query_proj, key_proj"):
        validate(get_config("tiny", ["remat=custom", "remat_save=query_proj,attn_proj"]), 1)
    with pytest.raises(ConfigError, match=r"apply to model.remat=custom only \(remat is 'full'\)"):
        validate(get_config("tiny", ["remat=full", "remat_offload=mlpwo"]), 1)
    with pytest.raises(ConfigError, match=r"mlpwo is in both model.remat_save and model.remat_offload"):
        validate(get_config("tiny", ["remat=custom", "remat_save=mlpwo", "remat_offload=mlpwo"]), 1)


@dataclasses.dataclass(frozen=True)
class Inner:
    sizes: tuple[int, ...] = (1, 2)
    names: list[str] = dataclasses.field(default_factory=list)
    rate: float | None = None


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = Inner()
    flag: bool = False


def test_any_annotated_field_parses_including_tuples_and_nested_sections():
    cfg = apply_overrides(Outer(), ["inner.sizes=4,8,16", "names=[\"a\", \"b\"]", "rate=1e-3", "flag=yes"])
    assert cfg == Outer(Inner((4, 8, 16), ["a", "b"], 1e-3), True)
    assert apply_overrides(cfg, {"inner.sizes": [3], "rate": None}).inner == Inner((3,), ["a", "b"], None)
    with pytest.raises(ConfigError, match=r"'inner.sizes' wants tuple\[int, \.\.\.\], got '4,x'"):
        apply_overrides(Outer(), ["sizes=4,x"])
    with pytest.raises(ConfigError, match=r"'inner.rate' wants float \| None, got 'fast'"):
        apply_overrides(Outer(), ["rate=fast"])


def test_presets_are_functions_and_configs_round_trip_through_json():
    assert set(PRESETS) >= {"tiny", "gpt2-small", "gpt2-medium", "llama-1b", "moe-tiny", "mixtral-8x7b"}
    assert all(isinstance(make(), TrainConfig) for make in PRESETS.values())
    cfg = get_config("llama-1b", ["batch_size=8"])
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
    with pytest.raises(ConfigError, match=r"ModelConfig has no field\(s\) n_mixtures"):
        from_dict({**to_dict(cfg), "model": {**to_dict(cfg)["model"], "n_mixtures": 8}})
    register_preset("tiny-short", lambda: dataclasses.replace(PRESETS["tiny"](), max_steps=7))
    try:
        assert get_config("tiny-short", ["seed=3"]).max_steps == 7
    finally:
        PRESETS.pop("tiny-short")


def test_a_config_read_back_from_config_json_has_no_changes():
    # config.json holds tuples as lists: a resume must not see `() -> []` as a changed setting
    from jaxperf.train.rundir import config_changes

    saved = json.loads(json.dumps(to_dict(get_config("tiny", ["remat=custom", "remat_save=query_proj"]))))
    assert config_changes(saved, to_dict(get_config("tiny", ["remat=custom", "remat_save=query_proj"]))) == {}
    assert config_changes(saved, to_dict(get_config("tiny", ["remat=custom", "remat_save=key_proj"]))) == {
        "model.remat_save": (["query_proj"], ["key_proj"])}


def test_compiler_options_parse_to_typed_values_and_refuse_what_cannot_work():
    from jaxperf.config.validate import compiler_options

    cfg = get_config("tiny", ["compiler_options=xla_tpu_enable_windowed_einsum_for_reduce_scatter=false,"
                              "xla_tpu_scoped_vmem_limit_kib=98304"])
    assert compiler_options(cfg.compiler_options, "tpu") == {
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False, "xla_tpu_scoped_vmem_limit_kib": 98304}
    assert compiler_options(("a=0.5", "b=True", "c=some text", "d='1'", 'e="true"')) == {
        "a": 0.5, "b": True, "c": "some text", "d": "1", "e": "true"}  # quoted: text, as a string option needs
    for entries, message in [(("xla_tpu_foo",), "is not name=value"), (("=1",), "is not name=value"),
                             (("Bad-Name=1",), "is not name=value"), (("a=1", "a=2"), "names a twice")]:
        with pytest.raises(ConfigError, match=message):
            compiler_options(entries, "tpu")
    for platform in ("cpu", "gpu"):  # the TPU compiler's own options; XLA's common ones (xla_gpu_...) go anywhere
        with pytest.raises(ConfigError, match=f"TPU compiler and this step compiles for {platform.upper()}"):
            compiler_options(cfg.compiler_options, platform)
    assert compiler_options(("xla_gpu_enable_triton_gemm=false",), "tpu") == {"xla_gpu_enable_triton_gemm": False}
    with pytest.raises(ConfigError, match="is not name=value"):
        validate(get_config("tiny", ["compiler_options=oops"]), 1)


def test_mlp_slices_must_cut_the_width_evenly_and_keep_it_whole_on_a_device():
    validate(get_config("tiny", ["model.mlp_slices=4"]), 1)  # tiny's mlp_dim 512
    with pytest.raises(ConfigError, match=r"model.mlp_slices=3 does not cut model.mlp_dim=512 into equal slices: "
                                          r"use one of \[1, 2, 4, 8, 16, 32, 64\]"):
        validate(get_config("tiny", ["model.mlp_slices=3"]), 1)
    with pytest.raises(ConfigError, match=r"model.mlp_slices=0 does not cut"):
        validate(get_config("tiny", ["model.mlp_slices=0"]), 1)
    with pytest.raises(ConfigError, match=r"model.mlp_slices=2 slices the MLP's hidden width, which "
                                          r"parallel.tensor=2 splits"):
        validate(get_config("tiny", ["model.mlp_slices=2", "parallel.tensor=2", "parallel.strategy=tp"]), 2)
