"""A sequence's `status` and `num_computed_tokens` have one writer: `set_progress`
(tessera/core/progress.py), called only by the scheduler. An AST scan of the package fails on any
other assignment, so the rule stated in the docstrings stays true."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tessera"
FIELDS = {"status", "num_computed_tokens"}
WRITER = ("core/progress.py", "set_progress")
CALLERS = {
    "core/scheduler.py", "core/step_update.py", "core/remote_kv.py", "core/preemption.py",
    "core/waiting_admission.py",
}
# Modules whose objects merely share a field name with Sequence; each owns a different object.
OTHER_OBJECTS = {
    "worker/input_batch.py": "the runner's own copy of a request, set from the scheduler's "
    "messages",
    "worker/static_batch.py": "the static-batching baseline's StaticSeq",
    "entrypoints/openai/errors.py": "an HTTP error's status code",
}


def writes(source: str, fields: set[str] = FIELDS) -> list[tuple[int, str, str]]:
    """(line, enclosing function, field) of each assignment to `<x>.status` or
    `<x>.num_computed_tokens`, and of each `setattr(<x>, "status" | "num_computed_tokens", ...)`."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, ast.AugAssign | ast.AnnAssign):
                targets = [child.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr in fields:
                        found.append((child.lineno, func, t.attr))
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "setattr" and len(child.args) >= 2
                    and isinstance(child.args[1], ast.Constant) and child.args[1].value in fields):
                found.append((child.lineno, func, child.args[1].value))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def calls_of(source: str, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == name]


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_only_set_progress_writes_status_and_num_computed_tokens():
    bad = []
    writer_fields = set()
    for rel, source in _sources():
        if rel in OTHER_OBJECTS:
            continue
        for line, func, field in writes(source):
            if (rel, func) == WRITER:
                writer_fields.add(field)
            else:
                bad.append(f"tessera/{rel}:{line} ({func}) assigns .{field}")
    assert not bad, "use set_progress (tessera/core/progress.py):\n" + "\n".join(bad)
    assert writer_fields == FIELDS, "set_progress should be the writer of both fields"


def test_only_the_scheduler_calls_set_progress():
    callers = {rel for rel, source in _sources() if calls_of(source, "set_progress")}
    assert callers and callers <= CALLERS, f"set_progress called outside the scheduler: {callers}"


# A sequence's drafts: set by update_from_output, trimmed by schedule(), cleared on preemption; only
# the scheduler's files write them. ModelRunnerOutput has a field of the same name (the runner's
# proposals), written where that message is built.
DRAFT_WRITERS = CALLERS | {
    "worker/model_runner.py", "simulator/batch.py", "engine/step_recovery.py",
}


def test_only_the_scheduler_writes_a_sequences_drafts():
    bad = []
    for rel, source in _sources():
        tree_writes = writes(source, fields={"spec_token_ids"})
        if tree_writes and rel not in DRAFT_WRITERS:
            bad += [f"tessera/{rel}:{line} ({func})" for line, func, _ in tree_writes]
    assert not bad, "spec_token_ids written outside the scheduler:\n" + "\n".join(bad)


def test_the_scan_sees_every_form_of_write():
    source = (
        "def f(seq, other):\n"
        "    seq.status = 1\n"
        "    seq.num_computed_tokens += 2\n"
        "    other.x, seq.num_computed_tokens = 3, 4\n"
        "    setattr(seq, 'status', 5)\n"
        "    seq.status == 6\n"  # a comparison, not a write
    )
    assert [(line, field) for line, _, field in writes(source)] == [
        (2, "status"), (3, "num_computed_tokens"), (4, "num_computed_tokens"), (5, "status"),
    ]
