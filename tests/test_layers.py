"""The import graph keeps the layer order of docs/design.md ("Layers"), and has no circle.

Every `import tessera...` in the package is read with `ast` (imports inside functions and under
TYPE_CHECKING count: a lazy import is still an arrow) and checked against the order below. A
module may import its own part, the parts below it, `core`, and the shared vocabulary.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tessera"

# Top to bottom; parts on one line are siblings (they may import one another, without a circle).
LAYERS: list[tuple[str, ...]] = [
    ("entrypoints",),
    ("simulator", "bench"),
    ("engine",),
    ("executor",),
    ("worker",),
    ("model",),
    ("attention", "sampling", "distributed"),
    ("kernels", "lora"),
]
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# The shared, torch-free vocabulary every part may import: request state, configs, outputs,
# helpers, and the request's SamplingParams (with the structured-output spec it holds).
VOCABULARY = {
    "tessera.config", "tessera.sequence", "tessera.utils", "tessera.outputs", "tessera.inputs",
    "tessera.sampling.params", "tessera.sampling.structured_outputs", "tessera.pooling_params",
    "tessera.lora.request",
}
# What `core` (torch-free, beside the layers) may import besides itself.
CORE_MAY_IMPORT = VOCABULARY
# The tokenizer wrapper (transformers) sits just above the vocabulary: any layer may use it.
SHARED = VOCABULARY | {"tessera.tokenizer", "tessera.chat_templates"}
# The simulator runs the real core on a virtual clock: it never loads a model or a runner.
SIMULATOR_NEVER = ("worker", "model")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
# The configs are a package of the vocabulary (tessera/config/: one module a part's config); its
# modules are vocabulary too, and import only one another
_CONFIG_MODULES = {m for m in MODULES if m.startswith("tessera.config.")}
VOCABULARY |= _CONFIG_MODULES
SHARED |= _CONFIG_MODULES


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str, source: str) -> set[str]:
    """The tessera modules `module` imports (`from pkg import sub` names the submodule)."""
    is_pkg = MODULES.get(module, Path()).name == "__init__.py"
    package = module if is_pkg else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in MODULES else base)
        else:
            continue
        for name in names:
            if name == "tessera" or name.startswith("tessera."):
                target = _resolve(name)
                if target != module:
                    found.add(target)
    return found


def part_of(module: str) -> str:
    """`tessera.worker.model_runner` -> `worker`; top-level modules are their own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tessera"


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        src = part_of(module)
        for target in sorted(targets):
            dst = part_of(target)
            if module == "tessera" or target in SHARED or dst == src:
                continue  # the package facade re-exports lazily; the vocabulary is everyone's
            if module in VOCABULARY:
                bad.append(f"{module} -> {target}: the vocabulary imports only itself")
            elif src == "core":
                if target not in CORE_MAY_IMPORT:
                    bad.append(f"{module} -> {target}: core imports only the vocabulary")
            elif dst == "core":
                continue  # core sits beside the layers: any of them may ask it
            elif src not in RANK or dst not in RANK:
                bad.append(f"{module} -> {target}: {src} or {dst} has no place in the layers")
            elif RANK[dst] < RANK[src]:
                bad.append(f"{module} -> {target}: {src} is below {dst}")
            elif src == "simulator" and dst in SIMULATOR_NEVER:
                bad.append(f"{module} -> {target}: the simulator never imports {dst}")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {m: imports_of(m, p.read_text()) for m, p in MODULES.items()}


def test_every_part_has_a_place():
    unplaced = set()
    for module, path in MODULES.items():
        if module == "tessera":
            continue
        if module.count(".") == 1 and path.name != "__init__.py":
            if module not in SHARED:
                unplaced.add(module)  # a top-level module: vocabulary or nothing
        elif part_of(module) not in RANK and part_of(module) != "core" and module not in SHARED:
            unplaced.add(part_of(module))
    assert not unplaced, f"missing from LAYERS or VOCABULARY (and docs/design.md): {unplaced}"


def test_imports_follow_the_layers(graph):
    bad = violations(graph)
    assert not bad, "imports against the layer order of docs/design.md:\n" + "\n".join(bad)


def test_no_circles(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_can_fail():
    """The checker itself sees an upward arrow, a core import of a layer, and a circle."""
    fake = {
        "tessera.kernels.x": {"tessera.attention.backend"},
        "tessera.core.y": {"tessera.worker.cache_engine"},
        "tessera.simulator.z": {"tessera.model.llama"},
        "tessera.attention.backend": {"tessera.kernels.x"},
    }
    bad = violations(fake)
    assert len(bad) == 3, bad
    assert circles(fake) == [["tessera.attention.backend", "tessera.kernels.x"]]


def test_design_doc_states_the_order():
    text = (ROOT.parent / "docs" / "design.md").read_text()
    order = " → ".join(", ".join(f"`{p}`" for p in parts) for parts in LAYERS)
    assert order in text, f"docs/design.md should state the layer order: {order}"


# Arrows the package once had, each of which made a circle; put back, each must be reported.
FORMER_ARROWS = [
    ("tessera.kernels.paged_attention", "tessera.attention.backend"),  # a kernel needs no backend
    ("tessera.distributed.kv_transfer.base",  # the factory lives above the connectors
     "tessera.distributed.kv_transfer.tcp_connector"),
    ("tessera.worker.tp_worker", "tessera.engine.loading"),  # a worker needs no engine
    ("tessera.simulator.cli", "tessera.entrypoints.cli"),  # engine flags: engine/arg_utils.py
    ("tessera.simulator.serving", "tessera.simulator.cli"),
]


@pytest.mark.parametrize(("module", "target"), FORMER_ARROWS)
def test_a_former_arrow_put_back_is_caught(graph, module, target):
    assert module in MODULES and target in MODULES, "renamed: update FORMER_ARROWS"
    assert target not in graph[module]
    with_arrow = {m: set(t) for m, t in graph.items()}
    with_arrow[module].add(target)
    assert violations(with_arrow) or circles(with_arrow)
