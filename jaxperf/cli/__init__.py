"""The `jaxperf` command: one module per subcommand, each with `main(argv) -> exit code`.

    jaxperf train [--preset NAME] [key=value ...]     jaxperf.cli.train
    jaxperf export --checkpoint DIR --out HF_DIR      jaxperf.cli.export
    jaxperf info  [--preset NAME] [key=value ...]     jaxperf.cli.info
    jaxperf compile --topology v5p:4x4x4 ...          jaxperf.cli.compile
    jaxperf generate --checkpoint DIR --prompt ...    jaxperf.cli.generate
    jaxperf serve --checkpoint DIR                    jaxperf.cli.serve
    jaxperf quantize --checkpoint DIR --out DIR2      jaxperf.cli.quantize
    jaxperf bench [names] [--tiny]                    jaxperf.benchmarks.run

Subcommand modules are imported only when chosen, so `jaxperf --help` starts fast. Every command runs through
`jaxperf.cli._errors.run_command`: a user error is one line and a documented exit status, a traceback is a bug.
"""

from __future__ import annotations

import importlib
import os
import sys

from jaxperf.cli._errors import run_command
from jaxperf.perf import cpu_host

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("jaxperf.cli.train", "train a model (init_from=DIR: fine-tune a Hugging Face model or a run)"),
    "export": ("jaxperf.cli.export", "write a run's checkpoint as a Hugging Face model directory"),
    "info": ("jaxperf.cli.info", "devices, the mesh a run would use, peak FLOP/s, versions"),
    "compile": ("jaxperf.cli.compile", "compile the train step for a TPU slice on this machine"),
    "generate": ("jaxperf.cli.generate", "continue a prompt from a run's checkpoint"),
    "serve": ("jaxperf.cli.serve", "serve a run's checkpoint over HTTP"),
    "quantize": ("jaxperf.cli.quantize", "write int8 weights of a run's checkpoint"),
    "bench": ("jaxperf.benchmarks.run", "run the benchmark suite"),
}


def _usage() -> str:
    lines = ["usage: jaxperf {" + ",".join(COMMANDS) + "} ...", "", "Train and measure Transformers with JAX.", ""]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`jaxperf COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (2 for a usage error; the codes are in jaxperf.cli._errors)."""
    # Without an accelerator plugin JAX's backend probing prints warnings; an explicit JAX_PLATFORMS still wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.update(cpu_host.cpu_threads_env(dict(os.environ)))  # before JAX makes its CPU client
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxperf: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run_command(name, module.main, rest)


# The commands that run compiled programs on this host, which XLA:CPU runs faster with huge pages; the others (help,
# info, export, compile for a TPU slice) start as they are.
HUGE_PAGE_COMMANDS = frozenset({"train", "generate", "serve", "quantize", "bench"})


def run() -> None:
    """The console script: a command that runs programs here restarts once with huge pages on a CPU-only host
    (jaxperf.perf.cpu_host), then main()."""
    if sys.argv[1:2] and sys.argv[1] in HUGE_PAGE_COMMANDS:
        cpu_host.reexec_with_huge_pages()
    sys.exit(main())
