"""The layout holds: imports go one way (docs/ARCHITECTURE.md), nothing is imported lazily to dodge a circle, model
code never asks which backend it runs on, and pyproject lists every package."""

from __future__ import annotations

import ast
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxperf"

# What each part of jaxperf may import (besides itself). The same table is in docs/ARCHITECTURE.md.
ALLOWED = {
    "_compat": set(),
    "checkpoint": set(),
    "config": set(),
    "data": {"config"},
    "parallel": {"_compat", "config"},
    "models": {"_compat", "config", "parallel"},
    "perf": {"_compat", "config", "parallel", "models"},
    "step": {"_compat", "config", "parallel", "models", "perf"},
    "explicit": {"_compat", "config", "parallel", "models", "step"},
    "train": {"_compat", "checkpoint", "config", "data", "parallel", "models", "perf", "step", "interop", "generate"},
    "generate": {"_compat", "checkpoint", "config", "data", "parallel", "models", "perf", "step"},
    "interop": {"_compat", "config", "data", "parallel", "models", "step"},
    "cli": {"_compat", "checkpoint", "config", "data", "parallel", "models", "perf", "step", "explicit", "train",
            "generate", "interop"},
    "": {"config", "models", "step", "train", "explicit"},  # jaxperf/__init__.py: the public names; explicit registers
    # the shard_map and pmap step flavours
}
# Imported inside functions on purpose: optional extras, and private jax modules that may move between versions.
DEFERRED_OK = ("tensorboardX", "starlette", "uvicorn", "matplotlib", "jax._src", "jax.experimental.shard_map",
               "jax.sharding")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        part = "" if rel == ("__init__.py",) else rel[0].removesuffix(".py")
        yield path, part, ast.parse(path.read_text())


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative imports stay inside a package
        return []
    if node.module == "jaxperf":
        return [f"jaxperf.{a.name}" for a in node.names]
    return [node.module or ""]


def test_imports_go_one_way():
    wrong = []
    for path, part, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node):
                    if name.startswith("jaxperf."):
                        target = name.split(".")[1]
                        if target != part and target not in ALLOWED[part]:
                            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_the_allowed_imports_have_no_cycle():
    seen, done = set(), set()

    def visit(part, trail):
        assert part not in seen - done, f"import cycle: {' -> '.join([*trail, part])}"
        if part in done:
            return
        seen.add(part)
        for dep in ALLOWED[part]:
            visit(dep, [*trail, part])
        done.add(part)

    for part in ALLOWED:
        visit(part, [])


def test_no_lazy_imports_of_the_library_or_its_core_dependencies():
    lazy = []
    for path, _, tree in _modules():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for name in _imported(node):
                        if not name.startswith(DEFERRED_OK):
                            lazy.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name} inside {fn.name}")
    assert not lazy, "move these imports to the top of the module:\n" + "\n".join(lazy)


def test_model_code_never_asks_the_backend_or_the_mesh_which_platform_it_is_for():
    """Platform choices are settled once into the model config (jaxperf.models.platform.settle): nothing in models/
    looks up the backend, a device's platform or a platform set by a surrounding context while a step is traced."""
    lookups = ("default_backend", "target_platform", "compiling_for", "platform_of", ".platform ==", "devices(")
    found = [f"jaxperf/models/{path.name}: {word}" for path in sorted((PACKAGE / "models").glob("*.py"))
             for word in lookups if word in path.read_text()]
    assert not found, "model code looks up its platform; settle the choice in jaxperf/models/platform.py and read " \
                      "it from the model config instead:\n" + "\n".join(found)


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(ROOT).parts[:-1]) for p in ROOT.glob("jaxperf/**/__init__.py")}
    found |= {".".join(p.relative_to(ROOT).parts[:-1]) for p in ROOT.glob("pallas_kernels/**/__init__.py")}
    found |= {"jaxperf.benchmarks" + "".join(f".{x}" for x in p.relative_to(ROOT / "benchmarks").parts[:-1])
              for p in (ROOT / "benchmarks").glob("**/__init__.py")}
    assert listed == found, f"pyproject.toml [tool.setuptools] packages: missing {found - listed}, extra {listed - found}"


def test_every_flavour_has_a_step_builder_and_train_gets_it_from_step():
    """`parallel.flavour` names a builder in jaxperf.step.flavours: jit there, shard_map and pmap registered by
    jaxperf.explicit when the package is imported; train/ (ALLOWED above) never imports explicit."""
    import jaxperf  # noqa: F401
    from jaxperf.config import FLAVOURS
    from jaxperf.step.flavours import registered_flavours

    assert sorted(registered_flavours()) == sorted(FLAVOURS)
    assert "explicit" not in ALLOWED["train"]
    assert "train" not in ALLOWED["generate"]  # generation restores parameters through jaxperf.checkpoint


def test_the_strategy_names_of_the_config_are_the_rule_tables():
    """`parallel.strategy` accepts exactly the strategies jaxperf.parallel.rules has a table for."""
    import typing

    from jaxperf.config.schema import Strategy
    from jaxperf.parallel.rules import STRATEGIES

    assert set(typing.get_args(Strategy)) == set(STRATEGIES)
