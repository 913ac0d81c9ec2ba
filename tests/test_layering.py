"""The layering of DESIGN.md section 1, as a test: arrows only point down.

Every `import` in the package (type-only and function-level ones too) is read from the source,
and each module is placed in a layer. A module may import its own layer and the layers below
it, never one above. `core/` is pure Python: importing it (or the checker) loads no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slotserve"

# Lowest first. Module prefixes; the longest match places a module.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Shared records every layer may use.
    ("base", ("slotserve.errors", "slotserve.config", "slotserve.sampling_params",
              "slotserve.gc_freeze", "slotserve.gil_switch", "slotserve.memory", "slotserve.model_config", "slotserve.spec_decode.config",
              "slotserve.lora.request")),
    # The scheduler-to-worker messages (DESIGN.md section 2): the contract between the two
    # layers sits beneath both, so the worker reads it without importing the scheduler.
    ("contract", ("slotserve.core.outputs",)),
    ("checkpoint", ("slotserve.checkpoint",)),
    ("models", ("slotserve.models", "slotserve.lora")),
    # The native runner (no torch) is a worker; engine/native_core.py builds it.
    ("worker", ("slotserve.worker", "slotserve.native")),
    # Speculative decoding's proposers and draft bookkeeping are the scheduler's (pure Python).
    ("core", ("slotserve.core", "slotserve.spec_decode")),
    ("check", ("slotserve.check",)),
    # The replica routing policy: block hashes with the core's function, no Ray, no torch.
    ("routing", ("slotserve.routing",)),
    # Grammars (llguidance): texts from constraints for the front, compiled matchers and the
    # per-step bitmask for the core; beneath the engine that uses both, above the core whose
    # StructuredOutputGrammar protocol it implements.
    ("structured", ("slotserve.structured_output",)),
    ("engine", ("slotserve.engine", "slotserve.outputs")),
    # slotserve.ray (Ray Serve replicas behind the prefix router) is a front like the server.
    ("entrypoints", ("slotserve.entrypoints", "slotserve.metrics", "slotserve.__init__",
                     "slotserve.ray")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    """The module's layer; a new package must be placed in LAYERS before it is used."""
    if module == "slotserve":
        module = "slotserve.__init__"  # the package facade, not a prefix of everything
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    assert best is not None, f"{module} is in no layer"
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    return PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py").is_file()


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            # `from slotserve.engine import core` imports the module slotserve.engine.core.
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if is_module(f"{node.module}.{alias.name}"))
    return found


def all_imports() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_layer_imports_a_higher_one() -> None:
    graph = all_imports()
    assert "slotserve.core.scheduler" in graph and "slotserve.engine.core" in graph
    upward = sorted(
        f"{mod} ({layer_of(mod)}) imports {dep} ({layer_of(dep)})"
        for mod, deps in graph.items() for dep in deps
        if dep.split(".")[0] == "slotserve" and RANK[layer_of(dep)] > RANK[layer_of(mod)])
    assert upward == []


def test_core_and_check_import_no_torch() -> None:
    graph = all_imports()
    offenders = sorted(f"{mod} imports {dep}" for mod, deps in graph.items()
                       if layer_of(mod) in ("base", "contract", "core", "check", "routing")
                       for dep in deps if dep.split(".")[0] in ("torch", "numpy"))
    assert offenders == []
    # And nothing they import pulls torch in at run time.
    modules = [m for m in graph if layer_of(m) in ("core", "check", "contract", "routing")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_the_checker_sees_a_violation() -> None:
    # The rule itself must be able to fail: a worker module importing the scheduler.
    assert RANK[layer_of("slotserve.core.scheduler")] > RANK[layer_of("slotserve.worker.slots")]
    assert layer_of("slotserve.core.outputs") == "contract"
    assert layer_of("slotserve.engine.core") == "engine"
