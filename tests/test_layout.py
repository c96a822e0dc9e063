"""The package's layout is its architecture: no import circles, and dependencies point one way.

Reads every module of ``ds_paci`` as source (imports inside functions count too) and
checks the graph of imports between the package's own modules.
"""

import ast
import re

import pytest

from harness import REPO_ROOT

PACKAGE = REPO_ROOT / "ds_paci"

# part -> parts it must never import (``ds_paci`` alone is the public facade over core)
FORBIDDEN = {
    "core": {"tools", "workload", "integrations", "facade", "mainjob"},
    "workload": {"core", "tools", "integrations", "facade", "mainjob"},
    "tools": {"integrations", "mainjob"},
    "integrations": {"tools", "mainjob"},
    "mainjob": {"tools", "integrations"},  # the example job: a user of the engine and the workload, used by none
}


def module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name, path, known):
    """The package modules ``name`` imports (absolute, relative, module- or function-level)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()

    def add(target):
        # ``from a.b import c`` may import module a.b.c or name c of a.b; keep the longest known module
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}")
    return found


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def part_of(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "facade"


def test_the_graph_is_read_correctly(graph):
    # guards against a parser that silently finds nothing: known edges must be there
    assert "ds_paci.core.program.stream" in graph["ds_paci.core.engine.pipeline_engine"]
    assert "ds_paci.core.engine.pipeline_engine" in graph["ds_paci.core.initialize"]
    assert "ds_paci.tools.sim.records" in graph["ds_paci.tools.sim.simulate"]
    assert "ds_paci.workload.emulate" in graph["ds_paci.workload.gpt2"]
    assert "ds_paci.tools.bench.config" in graph["ds_paci.tools.bench.runner"]
    assert "ds_paci.mainjob.loop" in graph["ds_paci.mainjob.job"]


def test_no_import_circle(graph):
    """Depth-first search for a back edge; reports the circle it finds."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_dependencies_point_one_way(graph):
    wrong = [(src, dst) for src, targets in graph.items() for dst in targets
             if part_of(dst) in FORBIDDEN.get(part_of(src), set())]
    assert not wrong, "imports against the layering: " + ", ".join(f"{s} -> {d}" for s, d in wrong)


# core's packages (and top-level modules) -> the other parts of core each may import. One rule per package: the
# program is pure data, the seam and health stand alone, the engine is the only package that sees every concern.
CORE_RULES = {
    "program": set(),
    "seam": set(),
    "health": set(),
    "step": {"seam"},
    "checkpoint": {"seam", "health"},
    "tied": {"program", "seam", "step"},
    "lookahead": {"seam", "step"},
    "engine": {"program", "seam", "step", "tied", "lookahead", "checkpoint", "health", "config"},
    "config": {"seam", "tied", "model_checks"},
    "model_checks": {"tied"},
    "runtime": set(),
    "initialize": {"engine", "config", "health", "seam", "runtime"},
}


def core_package(module):
    """``ds_paci.core.step.guard`` -> ``step``; ``ds_paci.core.config`` -> ``config``; None outside core."""
    parts = module.split(".")
    if parts[:2] != ["ds_paci", "core"] or len(parts) < 3:
        return None
    return parts[2]


def core_arrows(graph):
    """{(package, package)}: every import between two different packages of core."""
    return {(core_package(src), core_package(dst)) for src, targets in graph.items() for dst in targets
            if core_package(src) and core_package(dst) and core_package(src) != core_package(dst)}


def test_every_core_module_is_in_a_package_with_a_rule(graph):
    unruled = sorted({core_package(m) for m in graph if core_package(m)} - set(CORE_RULES))
    assert not unruled, f"core packages or modules without an import rule in CORE_RULES: {unruled}"


def test_core_packages_import_only_what_their_rule_allows(graph):
    assert ("engine", "program") in core_arrows(graph)  # the reader sees arrows at all
    wrong = sorted((src, dst) for src, dst in core_arrows(graph) if dst not in CORE_RULES[src])
    assert not wrong, "core imports against the package rules: " + ", ".join(f"{s} -> {d}" for s, d in wrong)


def test_the_program_imports_no_torch_or_deepspeed_at_module_level():
    """The program is data: the simulator and the validator run it without torch or DeepSpeed installed."""
    offenders = []
    for path in sorted((PACKAGE / "core" / "program").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("torch", "deepspeed")]
    assert not offenders, offenders


def test_entry_points_do_not_edit_sys_path():
    root = PACKAGE.parent
    offenders = [str(p.relative_to(root)) for folder in ("launch", "ds_paci") for p in (root / folder).rglob("*.py")
                 if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert not offenders, offenders


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_module_over_500_lines_and_no_function_over_80():
    """Small rooms (issue 18): every module of the package fits in 500 lines, every function in 80."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        rel = path.relative_to(PACKAGE.parent)
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {lines} lines (module limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {length} lines "
                                    f"(function limit {MAX_FUNCTION_LINES})")
    assert not too_long, "split these: " + "; ".join(too_long)


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
ARROWS_BEGIN, ARROWS_END = "<!-- core-arrows:begin -->", "<!-- core-arrows:end -->"


def core_arrow_lines(graph):
    """The imports between core's packages as the lines docs/architecture.md holds between its markers."""
    arrows = core_arrows(graph)
    return [f"- `{src}` -> " + ", ".join(f"`{dst}`" for dst in sorted(d for s, d in arrows if s == src))
            for src in sorted({s for s, _ in arrows})]


def documented_paths(part):
    """The module paths (``program/actions.py``, ``bench/``) in the tables of ``ds_paci.<part>``'s section."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"### `ds_paci.{part}`")
    end = text.find("\n### ", start + 1)
    return set(re.findall(r"^\| `([\w/]+(?:\.py|/))` \|", text[start:end if end > 0 else None], re.M))


@pytest.mark.parametrize("part", ["core", "tools"])
def test_the_architecture_tables_list_every_module_and_nothing_else(part):
    """Each module of core and tools is a row of its part's table in docs/architecture.md, by its path or under a
    folder row (``bench/``); every row names a file or folder that exists. The map cannot drift from the code."""
    root = PACKAGE / part
    rows = documented_paths(part)
    assert rows, f"no module table found for ds_paci.{part}"
    missing_files = sorted(r for r in rows if not (root / r).exists())
    assert not missing_files, f"docs/architecture.md lists what ds_paci/{part} does not have: {missing_files}"
    folders = tuple(r for r in rows if r.endswith("/"))
    unlisted = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                      if p.name not in ("__init__.py", "__main__.py") and str(p.relative_to(root)) not in rows
                      and not str(p.relative_to(root)).startswith(folders))
    assert not unlisted, f"modules of ds_paci/{part} missing from docs/architecture.md's table: {unlisted}"


def test_the_documented_core_arrows_are_the_code_s(graph):
    text = ARCHITECTURE.read_text()
    documented = text[text.index(ARROWS_BEGIN) + len(ARROWS_BEGIN):text.index(ARROWS_END)].strip().splitlines()
    assert documented == core_arrow_lines(graph), \
        "docs/architecture.md's core arrows differ from the code: run `python tests/test_layout.py --write`"


if __name__ == "__main__":  # python tests/test_layout.py [--write]: print (or write into the doc) core's arrows
    import sys
    mods = modules()
    lines = core_arrow_lines({name: imports_of(name, path, mods) for name, path in mods.items()})
    if "--write" in sys.argv:
        text = ARCHITECTURE.read_text()
        head, rest = text.split(ARROWS_BEGIN)
        ARCHITECTURE.write_text(head + ARROWS_BEGIN + "\n" + "\n".join(lines) + "\n" + ARROWS_END
                                + rest.split(ARROWS_END, 1)[1])
    print("\n".join(lines))
