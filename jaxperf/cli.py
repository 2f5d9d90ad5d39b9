"""Command line: `jaxperf train [--preset NAME] [key=value ...]`, `info`, `bench`, `compile`, `generate`, `serve`."""

from __future__ import annotations

import argparse
import os
import sys


def _quiet_platform() -> None:
    # Without an accelerator plugin, JAX's probing of TPU/GPU backends prints warnings; an explicit JAX_PLATFORMS wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def cmd_train(args: argparse.Namespace) -> int:
    from jaxperf import distributed
    from jaxperf.config import ConfigError, get_config
    from jaxperf.train.trainer import Trainer

    try:
        cfg = get_config(args.preset, args.overrides)
        distributed.initialize()  # a no-op unless the environment describes several processes
        trainer = Trainer(cfg)
    except (ConfigError, ValueError) as e:
        print(f"jaxperf train: {e}", file=sys.stderr)
        return 2
    from jaxperf.train.checkpoint import IncompatibleCheckpointError

    try:
        summary = trainer.fit()
    except IncompatibleCheckpointError as e:
        print(f"jaxperf train: cannot resume: {e}", file=sys.stderr)
        return 2
    if "stopped_at" in summary:
        return 0  # preempted or interrupted: the checkpoint is saved, the next start continues from it
    import jax

    main_process = jax.process_index() == 0  # every process trains; only the first one reports
    losses = summary["losses"]
    if losses and main_process:
        first, last = losses[min(losses)], losses[max(losses)]
        print(f"loss {first:.4f} -> {last:.4f} over {len(losses)} steps; checkpoint in {trainer.run_dir / 'checkpoints'}")
    if cfg.sample_tokens and trainer.tokenizer is not None:
        text = trainer.sample(summary["state"], cfg.sample_prompt, cfg.sample_tokens)  # a collective: all processes
        if main_process:
            print("---- sample ----")
            print(text)
            print("----------------")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import jax

    from jaxperf.config import ConfigError, get_config
    from jaxperf.parallel.mesh import MESH_AXES, mesh_shape
    from jaxperf.perf.hardware import describe, format_info

    import flax
    import optax

    devices = jax.devices()
    print(f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, python {sys.version.split()[0]}")
    print(f"platform {jax.default_backend()}: {len(devices)} devices ({devices[0].device_kind}), "
          f"{jax.process_count()} process(es), {len(jax.local_devices())} local")
    try:
        cfg = get_config(args.preset, args.overrides)
        shape = mesh_shape(cfg.parallel, len(devices))
        print(f"mesh for preset {args.preset or 'tiny'}: " + " ".join(f"{a}={shape[a]}" for a in MESH_AXES)
              + f", strategy {cfg.parallel.strategy}")
    except ConfigError as e:
        print(f"mesh: {e}")
    print(format_info(describe(devices[0])))
    if jax.default_backend() == "cpu":
        from jaxperf.perf.hostmem import host_memory

        print(host_memory().describe())
    return 0


def cmd_bench(argv: list[str]) -> int:
    from jaxperf.perf.bench import main as bench_main

    return int(bench_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    _quiet_platform()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark runner has its own arguments
        return cmd_bench(argv[1:])
    if argv[:1] == ["generate"]:
        from jaxperf.generate.cli import main as generate_main

        return int(generate_main(argv[1:]) or 0)
    if argv[:1] == ["compile"]:
        from jaxperf.perf.topology import main as compile_main

        return int(compile_main(argv[1:]) or 0)
    if argv[:1] == ["serve"]:
        from jaxperf.generate.server import main as serve_main

        return int(serve_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="jaxperf", description="Train and measure Transformers with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="run the benchmark suite (jaxperf bench --help)")
    sub.add_parser("generate", help="generate text from a run's checkpoint (jaxperf generate --help)")
    sub.add_parser("compile", help="compile the train step for a TPU slice here (jaxperf compile --help)")
    sub.add_parser("serve", help="serve a run's checkpoint over HTTP (jaxperf serve --help)")
    for name, fn, help_ in (("train", cmd_train, "train a model"), ("info", cmd_info, "devices, mesh and peaks")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--preset", default=None, help="tiny (default), gpt2-small, gpt2-medium, llama-1b")
        p.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. max_steps=20 model.n_layers=2)")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


def run() -> None:
    """The `jaxperf` command: on XLA:CPU hosts restart once with huge pages (jaxperf.perf.hostmem), then main()."""
    from jaxperf.perf.hostmem import reexec_with_huge_pages

    reexec_with_huge_pages()
    sys.exit(main())


if __name__ == "__main__":
    run()
