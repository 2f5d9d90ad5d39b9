"""Config overrides and the errors raised before anything compiles."""

from __future__ import annotations

import pytest

from jaxperf.config import ConfigError, ModelConfig, ParallelConfig, get_config, mesh_shape, validate
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
    with pytest.raises(ConfigError, match=r"12.*not divisible by the data-parallel size data\*fsdp=1\*8=8.*batch_size=16"):
        validate(cfg, 8)


def test_heads_kv_heads_mlp_not_divisible_by_tensor():
    cfg = get_config("tiny", ["parallel.strategy=tp", "parallel.fsdp=1", "parallel.tensor=8"])
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by .*parallel.tensor=8"):
        validate(cfg, 8)
    cfg = get_config("tiny", ["style=llama", "n_heads=8", "n_kv_heads=2", "strategy=tp", "fsdp=1", "tensor=4"])
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 is not divisible by .*parallel.tensor=4"):
        validate(cfg, 8)
    cfg = get_config("tiny", ["n_heads=8", "mlp_dim=100", "strategy=tp", "fsdp=1", "tensor=8"])
    with pytest.raises(ConfigError, match=r"model.mlp_dim=100 is not divisible .*tensor=8"):
        validate(cfg, 8)


def test_mesh_larger_than_devices():
    with pytest.raises(ConfigError, match=r"2\*4\*2 = 16 is larger than the 8 available devices"):
        mesh_shape(ParallelConfig(data=2, fsdp=4, tensor=2), 8)
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        mesh_shape(ParallelConfig(data=3, fsdp=-1), 8)
    assert mesh_shape(ParallelConfig(data=2, fsdp=-1, tensor=2), 8) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_seq_len_above_model_max():
    cfg = get_config("tiny", ["seq_len=256"])
    with pytest.raises(ConfigError, match=r"seq_len=256 is above the model's maximum model.max_seq_len=128"):
        validate(cfg, 1)


def test_unused_mesh_axis_is_an_error():
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.parallel.rules import get_rules

    mesh = make_mesh(ParallelConfig(strategy="fsdp", fsdp=4, tensor=2))
    with pytest.raises(ConfigError, match=r"tensor=2 but strategy 'fsdp' maps nothing onto it.*'tp' or 'fsdp_tp'"):
        get_rules("fsdp", mesh)


def test_presets_have_their_documented_sizes():
    # GPT-2 small is 124M with the 50257-token vocabulary (nanoGPT pads it to 50304; so do we).
    assert round(count_params(get_config("gpt2-small").model) / 1e6) == 124
    assert round(count_params(get_config("gpt2-medium").model) / 1e6) == 355
    assert 0.95e9 < count_params(get_config("llama-1b").model) < 1.1e9
    assert ModelConfig(style="llama", d_model=96).resolved().mlp_dim == 256
