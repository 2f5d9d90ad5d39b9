"""Starting a run from weights that already exist, and handing the trained weights back.

    cfg = get_config("tiny", ["init_from=path/to/llama", "data.source=notes.txt", "seq_len=256"])
    Trainer(cfg).fit()                                # the model, its weights and tokenizer come from the directory
    export_run(cfg.run_dir, "out/")                   # the newest checkpoint as a Hugging Face directory

`init_from` names a Hugging Face GPT-2 / Llama directory (config.json with `model_type`, model*.safetensors,
tokenizer.json) or a jaxperf run directory (config.json with the TrainConfig sections, checkpoints/); the contents of
config.json tell them apart (`checkpoint_kind`). Then:

- **The model** is the checkpoint's (`InitSource.configure`). Settings that change how it runs but not what it
  computes (dtype, remat, kernels, scan_layers for Hugging Face weights) can be set; any other model setting that
  was set and disagrees with the checkpoint is a ConfigError naming both values, raised before anything compiles.
  A model field counts as set when it differs from `ModelConfig()`'s default or, from the command line, when an
  override names it.
- **The weights** go straight into their shards on the run's mesh: a Hugging Face tensor is read slice by slice, each
  device reading only its block (`jaxperf.interop.load_hf_params`); a run's checkpoint is restored by Orbax into the
  run's shardings. No device or host holds a whole copy of the model. The source run is only read: a corrupt step
  is skipped where it lies (the newest intact one is used, and a warning says so), and a source with no intact step
  is a NoIntactCheckpointError naming its directory and corrupt steps; the new run then holds no checkpoints/,
  config.json or tokenizer.
- **The tokenizer** is the directory's tokenizer.json (`data.tokenizer=hf`), or the source run's tokenizer (a BPE the
  source trained on its own corpus is saved as run_dir/tokenizer.json so that the new run holds it).
- **The optimizer** starts fresh at step 0 (`Task.init_state_from`). The run records where it started: `init_from`
  (made absolute) in config.json, and in every checkpoint's metadata the source, its special token ids and
  generation config, which `export_run` writes back out.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax

from jaxperf.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, from_dict, validate_model
from jaxperf.data import HFTokenizer, special_token_ids, tokenizer_for
from jaxperf.interop import (
    RUNTIME_FIELDS, default_arch, export_hf, hf_model_config, load_hf_params, read_generation_config,
)
from jaxperf.parallel.mesh import make_mesh
from jaxperf.step.task import Task, TrainState, build_task
from jaxperf.checkpoint import Checkpointer

# Model fields a run's own checkpoint fixes beyond the Hugging Face ones: the saved tree has their layout and dtype.
_RUN_FIXED = ("scan_layers", "param_dtype", "router_bias")  # a jaxperf run's checkpoint holds its bias, or none


def checkpoint_kind(path: str | Path) -> str:
    """"hf" for a Hugging Face model directory, "run" for a jaxperf run directory.

    Told apart by config.json: a run's holds the TrainConfig sections (model, optim...), a Hugging Face one
    `model_type` / `architectures`; then the weights must be there (checkpoints/, or model*.safetensors). Anything
    else is a ConfigError that says what is missing.
    """
    p = Path(path).expanduser()
    file = p / "config.json"
    if not file.is_file():
        raise ConfigError(f"{p} has no config.json: give a Hugging Face model directory (config.json, "
                          f"model*.safetensors) or a jaxperf run directory (config.json, checkpoints/)")
    try:
        content = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{file} is not JSON ({e})") from None
    content = content if isinstance(content, dict) else {}
    if "model" in content and "optim" in content:
        if not (p / "checkpoints").is_dir():
            raise ConfigError(f"{p} is a jaxperf run without checkpoints/ yet: train it first, or give the run "
                              f"directory that holds them")
        return "run"
    if "model_type" in content or "architectures" in content:
        if not any(p.glob("model*.safetensors")):
            raise ConfigError(f"{p} is a Hugging Face model without model*.safetensors: save it with "
                              f"save_pretrained(dir, safe_serialization=True) (PyTorch .bin files are not read)")
        return "hf"
    raise ConfigError(f"{file} is neither a jaxperf run's config (model, optim, ...) nor a Hugging Face model's "
                      f"(model_type, architectures)")


def merge_model(requested: ModelConfig, checkpoint: ModelConfig, changeable: Collection[str],
                explicit: Collection[str] | None = None, source: str = "") -> ModelConfig:
    """The checkpoint's model with the `changeable` fields that `requested` sets; ConfigError when another field
    is set to a value the checkpoint contradicts (both values named).

    A field is set when its name is in `explicit` (the model keys an override named) or, with `explicit` None, when
    `requested` differs from ModelConfig()'s default.
    """
    default = ModelConfig()
    changes, clashes = {}, []
    for f in dataclasses.fields(ModelConfig):
        want, have = getattr(requested, f.name), getattr(checkpoint, f.name)
        named = f.name in explicit if explicit is not None else want != getattr(default, f.name)
        if not named:
            continue
        if f.name in changeable:
            changes[f.name] = want
        elif want != have:
            clashes.append(f"model.{f.name}={want!r} contradicts the checkpoint's {f.name}={have!r}")
    if clashes:
        more = f" (and {len(clashes) - 1} more)" if len(clashes) > 1 else ""
        raise ConfigError(f"init_from={source}: {clashes[0]}{more}; the model comes from the checkpoint: drop that "
                          f"setting (only {', '.join(changeable)} may differ)")
    return validate_model(dataclasses.replace(checkpoint, **changes))


@dataclasses.dataclass
class InitSource:
    """What `init_from` points at, read without loading any weights: its kind and its model config."""

    path: Path  # absolute
    kind: str  # "hf" | "run"
    model: ModelConfig  # resolved, as the checkpoint holds it
    run_cfg: TrainConfig | None = None  # the source run's config (kind "run")
    tokenizer_file: Path | None = None  # where this run keeps a tokenizer the source trained (kind "run", bpe)

    @classmethod
    def open(cls, path: str | Path) -> InitSource:
        p = Path(path).expanduser().resolve()
        kind = checkpoint_kind(p)
        if kind == "hf":  # config and tensor shapes checked now, before anything compiles
            return cls(p, kind, hf_model_config(str(p), check_weights=True))
        run_cfg = from_dict(json.loads((p / "config.json").read_text()))
        return cls(p, kind, validate_model(run_cfg.model), run_cfg)

    @property
    def arch(self) -> str:
        """The Hugging Face architecture the source's model exports as (`jaxperf.interop.hf.default_arch`)."""
        return default_arch(self.model)

    @property
    def changeable(self) -> tuple[str, ...]:
        """Model fields this run may set differently from the checkpoint."""
        return RUNTIME_FIELDS if self.kind == "hf" else tuple(f for f in RUNTIME_FIELDS if f not in _RUN_FIXED)

    def describe(self) -> str:
        return f"{self.path} ({'Hugging Face ' + self.arch if self.kind == 'hf' else 'jaxperf run'})"

    def configure(self, cfg: TrainConfig, explicit: Collection[str] | None = None) -> TrainConfig:
        """cfg with init_from made absolute, the checkpoint's model (`merge_model`) and its tokenizer.

        The tokenizer is the source's unless `data.tokenizer_path` names another one (then read as `hf`)."""
        model = merge_model(cfg.model, self.model, self.changeable, explicit, str(self.path))
        data, src = cfg.data, self.run_cfg.data if self.run_cfg is not None else None
        if src is not None and src.tokenizer == "bpe" and not src.tokenizer_path:
            # trained on the source's corpus: this run keeps a copy (written once the run directory is locked)
            self.tokenizer_file = Path(cfg.run_dir).expanduser().resolve() / "tokenizer.json"
        if data.tokenizer_path and Path(data.tokenizer_path) != self.tokenizer_file:
            data = dataclasses.replace(data, tokenizer="hf" if data.tokenizer == "byte" else data.tokenizer)
        elif src is None:
            if not (self.path / "tokenizer.json").is_file():
                raise ConfigError(f"init_from={self.path} has no tokenizer.json: save the model's tokenizer there "
                                  f"(tokenizer.save_pretrained(dir)) or give data.tokenizer_path")
            data = dataclasses.replace(data, tokenizer="hf", tokenizer_path=str(self.path / "tokenizer.json"))
        else:
            path = str(self.tokenizer_file) if self.tokenizer_file is not None else src.tokenizer_path
            data = dataclasses.replace(data, tokenizer=src.tokenizer, tokenizer_path=path)
        return dataclasses.replace(cfg, init_from=str(self.path), model=model, data=data)

    def tokenizer(self, cfg: TrainConfig):
        """The tokenizer of a run `configure` prepared: the file it names, or the source run's own BPE."""
        if self.tokenizer_file is not None and not self.tokenizer_file.exists():
            return tokenizer_for(self.run_cfg)  # the source's cached BPE (trained again on its corpus if evicted)
        return tokenizer_for(cfg)

    def save_tokenizer(self, tokenizer) -> None:
        """Keep the source's trained BPE in this run (run_dir/tokenizer.json), once."""
        if self.tokenizer_file is not None and not self.tokenizer_file.exists():
            tokenizer.save(self.tokenizer_file)

    def special_tokens(self) -> dict[str, int | None]:
        """bos/eos/pad ids a Hugging Face source declares (config files, else tokenizer_config.json's tokens)."""
        if (self.path / "tokenizer.json").is_file():
            tok = HFTokenizer.from_file(self.path)
            return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        return special_token_ids(self.path)

    def load(self, task: Task, model: ModelConfig) -> tuple[TrainState, dict]:
        """(a fresh TrainState holding the checkpoint's parameters in `task`'s shardings, the record of where they
        came from for checkpoint metadata)."""
        record: dict[str, Any] = {"path": str(self.path), "format": "hf" if self.kind == "hf" else "jaxperf"}
        if self.kind == "hf":
            params = load_hf_params(str(self.path), model, task.param_shardings)
            record.update(arch=self.arch, special_tokens=self.special_tokens(),
                          generation_config=read_generation_config(str(self.path)))
        else:
            with Checkpointer(self.path / "checkpoints", read_only=True) as ckpt:
                restored, meta, step = ckpt.restore_latest({"params": task.abstract_params_sharded()})
            params = restored["params"]
            earlier = meta.get("init_from") or {}
            record.update(step=step, special_tokens=earlier.get("special_tokens"),
                          generation_config=earlier.get("generation_config"))
        return task.init_state_from(params), record


# --------------------------------------------------------------------------------------------------------------------
# Out again


def _special_tokens(record: dict, tokenizer) -> dict[str, int | None]:
    """The ids the run started with, else the tokenizer's (a jaxperf BPE's <|endoftext|> is GPT-2's bos and eos)."""
    if record.get("special_tokens"):
        return record["special_tokens"]
    eos = getattr(tokenizer, "eos_id", None)
    return {"bos_token_id": getattr(tokenizer, "bos_id", eos), "eos_token_id": eos,
            "pad_token_id": getattr(tokenizer, "pad_id", None)}


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, arch: str | None = None,
               max_shard_size: int | str = "2GB", dtype: str = "float32", devices=None) -> list[str]:
    """A run's newest checkpoint (or `step`) as a Hugging Face directory that `transformers` loads and generates from.

    The parameters are restored sharded over `devices` (default: this process's) under fsdp and streamed out one
    tensor at a time (`jaxperf.interop.export_hf`), so the host never holds the whole model. The special token ids and
    generation config are those the run started from (checkpoint metadata), else the tokenizer's; the tokenizer goes
    along as tokenizer.json (the byte tokenizer as the byte-level tokenizer.json that encodes the same ids), so
    `init_from` of the export starts from the same model and tokens. The run is only read: a corrupt newest step is
    skipped, never moved. Returns the weight files written.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir}/config.json not found: give the run_dir of a `jaxperf train` run")
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    devices = list(jax.local_devices() if devices is None else devices)
    parallel = ParallelConfig(strategy="fsdp", data=1, fsdp=len(devices), tensor=1)
    cfg = dataclasses.replace(cfg, parallel=parallel)
    task = build_task(cfg, make_mesh(parallel, devices), with_optimizer=False)
    target = {"params": task.abstract_params_sharded()}
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        restored, meta, _ = ckpt.restore_step_or_latest(step, target)
    record = meta.get("init_from") or {}
    tokenizer = tokenizer_for(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_file = cfg.data.tokenizer_path if cfg.data.tokenizer != "byte" else None
    if not tokenizer_file:  # bytes, or a BPE trained on the corpus (its file is in the cache): write it out
        tokenizer.save(out_dir / "tokenizer.json")
        tokenizer_file = str(out_dir / "tokenizer.json")
    return export_hf(cfg.model, restored["params"], str(out_dir), arch,
                     special_tokens=_special_tokens(record, tokenizer),
                     generation_config=record.get("generation_config"), tokenizer=tokenizer_file,
                     max_shard_size=max_shard_size, dtype=dtype)


def load_hf_tokenizer(directory: str | Path) -> HFTokenizer:
    """A Hugging Face directory's tokenizer.json with its special token ids (ConfigError when there is none)."""
    try:
        return HFTokenizer.from_file(directory)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
