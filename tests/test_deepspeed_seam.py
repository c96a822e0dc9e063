"""DeepSpeed's internals are reached through one module, :mod:`ds_paci.core.seam.deepspeed_internals` (the seam).

The rules the scan enforces, on every ``.py`` file of ``ds_paci/``, ``launch/`` and ``scripts/`` except the seam:

1. **Private DeepSpeed names.** The set is derived from the installed DeepSpeed's source by AST: every
   non-dunder ``_name`` that DeepSpeed defines as a function or method, a class attribute, a module-level name,
   or an attribute it assigns (``self._x = ...``, ``param._x = ...``). A use is an attribute access ``x._name``
   or a member reached by string (``getattr(x, "_name")`` and ``hasattr``/``setattr``/``delattr``,
   ``"_name" in vars(C)``). The whole ``deepspeed`` package is read.
2. **Collisions** (a ``_name`` both DeepSpeed and ds_paci define) are decided by who defines it in ds_paci:
   a name defined by one of ds_paci's own classes (not a DeepSpeed subclass) or at module level is ds_paci's
   own and is not reported anywhere (``_stream``, ``_lock``, ``_post``, ... name different things in
   DeepSpeed's unrelated classes). A name a ds_paci *subclass of a DeepSpeed class* (the engine) defines is no
   exemption: if DeepSpeed's base classes define it too, the subclass overrides or overwrites DeepSpeed's own
   member, so it must be a declared override (:data:`~ds_paci.core.seam.deepspeed_internals.OVERRIDDEN_ENGINE_METHODS`)
   and never a field (test 2). Accesses through an imported module that is not DeepSpeed's (``os._exit``,
   ``torch._foreach_mul``) and the namedtuple API (``_replace``, ``_asdict``, ...) are not DeepSpeed names.
3. **Internal fields** (:data:`~ds_paci.core.seam.deepspeed_internals.INTERNAL_FIELDS`, public names of DeepSpeed's
   objects that are not its documented API): an attribute access ``x.field`` or ``getattr(x, "field")``,
   except ``self.field`` inside a ds_paci class that is not a DeepSpeed subclass (that class's own field) and
   the seam's own functions (``ds.clip_grad(...)``).

A violation is reported as ``path:line name``.
"""

import ast
import functools
import importlib
import inspect
import pathlib

import pytest

from ds_paci.core.seam import deepspeed_internals
from harness import REPO_ROOT as ROOT, run_world

SCANNED = ("ds_paci", "launch", "scripts")
SEAM = ROOT / "ds_paci" / "core" / "seam" / "deepspeed_internals"  # the seam: one package (the list in its __init__)
SEAM_FILES = sorted(SEAM.glob("*.py"))
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
ACCESSORS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree):
    """``(names defined at module level or in classes, names assigned as attributes)``, private ones only."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and _private(sub.attr):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name) and _private(sub.id):
                        names.add(sub.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            names.add(node.args[1].value)
    return names


@functools.lru_cache(maxsize=None)
def _parse(path):
    return ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))


@functools.lru_cache(maxsize=None)
def deepspeed_private_names():
    import deepspeed
    names = set()
    top = pathlib.Path(deepspeed.__file__).parent
    paths = sorted(top.rglob("*.py"))
    assert len(paths) > 100, f"DeepSpeed's source not found under {top}"
    for path in paths:
        try:
            names |= _defined_names(_parse(path))
        except SyntaxError:  # DeepSpeed ships a few files for other Python versions
            continue
    return frozenset(names)


def _imports(tree):
    """``{bound name: top-level package}`` of a file's imports (``None`` for relative imports)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            top = None if node.level else node.module.split(".")[0]
            for alias in node.names:
                bound[alias.asname or alias.name] = (f"{top}.{alias.name}" if top == "ds_paci" else top, node.module,
                                                     alias.name)
    return bound


def _seam_aliases(bound):
    return {name for name, origin in bound.items()
            if isinstance(origin, tuple) and origin[2] == "deepspeed_internals"}


def _foreign_modules(bound):
    """Names bound to modules (or objects) of packages that are neither DeepSpeed nor ds_paci."""
    out = set()
    for name, origin in bound.items():
        top = origin[0] if isinstance(origin, tuple) else origin
        if top is not None and top not in ("deepspeed", "ds_paci") and not str(top).startswith("ds_paci."):
            out.add(name)
    return out


def _deepspeed_bases(node, bound):
    """The DeepSpeed classes among a class statement's bases (a base named by ``from deepspeed... import X``)."""
    found = []
    for base in node.bases:
        origin = bound.get(base.id) if isinstance(base, ast.Name) else None
        if isinstance(origin, tuple) and origin[0] == "deepspeed":
            found.append(getattr(importlib.import_module(origin[1]), origin[2]))
    return found


def _classes(tree, bound):
    """``[(class node, subclasses DeepSpeed?)]``."""
    return [(node, bool(_deepspeed_bases(node, bound))) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _scanned_files():
    files = []
    for folder in SCANNED:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if SEAM.resolve() not in p.resolve().parents)
    assert files, f"nothing to scan under {ROOT}"
    return files


@functools.lru_cache(maxsize=None)
def ds_paci_own_names():
    """Private names ds_paci defines: at module level and in its own classes; in its DeepSpeed subclasses, those
    their DeepSpeed bases do not define (the others are DeepSpeed's members: test 2 decides about them)."""
    own = set()
    for path in _scanned_files():
        tree = _parse(path)
        bound = _imports(tree)
        ds_classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and _deepspeed_bases(node, bound)]
        for cls in ds_classes:
            theirs = set().union(*(_deepspeed_base_private_names(b) for b in _deepspeed_bases(cls, bound)))
            own |= _defined_names(cls) - {cls.name} - theirs
        inside = {id(n) for c in ds_classes for n in ast.walk(c) if n is not c}
        for node in ast.walk(tree):
            if id(node) in inside:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                own |= _defined_names(ast.Module(body=[node], type_ignores=[]))
    return frozenset(own)


def _self_fields_of_own_classes(tree, bound):
    """ids of ``self.x`` Attribute nodes inside methods of ds_paci classes that do not subclass DeepSpeed."""
    ids = set()
    for cls, ds_base in _classes(tree, bound):
        if ds_base:
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                ids.add(id(node))
    return ids


def _names_by_string(node):
    """Member names a node reaches by string: ``getattr(x, "n")`` (and has/set/delattr), ``"n" in vars(x)``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return [node.args[1].value]
    if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
            and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in ("vars", "dir")
                    for c in node.comparators)):
        return [node.left.value]
    return []


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def violations():
    """``["path:line name (rule)", ...]`` for every use of a DeepSpeed internal outside the seam."""
    private = deepspeed_private_names() - ds_paci_own_names() - NAMEDTUPLE_API
    fields = set(deepspeed_internals.INTERNAL_FIELDS)
    found = []
    for path in _scanned_files():
        tree = _parse(path)
        bound = _imports(tree)
        seam, foreign = _seam_aliases(bound), _foreign_modules(bound)
        own_self = _self_fields_of_own_classes(tree, bound)
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                root = _root_name(node.value)
                if root in seam or root in foreign:
                    continue
                if node.attr in private:
                    found.append(f"{where}:{node.lineno} {node.attr} (private DeepSpeed name)")
                elif node.attr in fields and id(node) not in own_self:
                    found.append(f"{where}:{node.lineno} {node.attr} (DeepSpeed internal field)")
            for name in _names_by_string(node):
                if name in private:
                    found.append(f"{where}:{node.lineno} {name!r} (private DeepSpeed name as a string)")
                elif name in fields:
                    found.append(f"{where}:{node.lineno} {name!r} (DeepSpeed internal field by name)")
    return found


def test_the_private_name_set_comes_from_deepspeeds_source():
    names = deepspeed_private_names()
    # the names the engine runs on are in it: the derivation works on this DeepSpeed
    for name in ("_exec_forward_pass", "_reserve_pipe_buffers", "_next_batch", "_param_dict", "_INSTRUCTION_MAP",
                 "_take_model_step", "_global_grad_norm", "_step_applied", "_hp_mapping", "_topo", "_layer_specs"):
        assert name in names, name
    assert not any(n.startswith("__") and n.endswith("__") for n in names)
    own = ds_paci_own_names()
    assert "_stream" in own and "_next_batch" not in own and "_step_applied" not in own


def test_no_deepspeed_internal_is_used_outside_the_seam():
    found = violations()
    assert not found, (f"{len(found)} use(s) of DeepSpeed internals outside ds_paci/core/seam/deepspeed_internals/ "
                       "(add a named function there and call it):\n" + "\n".join(found))


def _engine_class_members():
    """Methods and ``self.<field>`` assignments of the PACI engine and of its parts (its ds_paci base classes)."""
    from ds_paci.core.engine.pipeline_engine import PACIPipelineEngine
    methods, fields = set(), set()
    for part in PACIPipelineEngine.__mro__:
        if part.__module__.split(".")[0] != "ds_paci":
            continue
        cls = ast.parse(inspect.getsource(part)).body[0]
        methods |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                            fields.add(sub.attr)
    return PACIPipelineEngine, methods, fields


def _deepspeed_base_private_names(cls):
    """Private names DeepSpeed's classes in ``cls``'s MRO define (methods, class attributes, ``self._x``)."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "deepspeed":
            names |= {n for n in vars(base) if _private(n)}
            names |= _defined_names(ast.parse(inspect.getsource(base)))
    return names


def test_the_engines_overrides_of_deepspeed_are_the_declared_ones_and_still_exist():
    from deepspeed.runtime.pipe.engine import PipelineEngine
    engine_cls, methods, fields = _engine_class_members()
    overrides = {m for m in methods if hasattr(PipelineEngine, m) and (not m.startswith("__") or m == "__init__")}
    declared = set(deepspeed_internals.OVERRIDDEN_ENGINE_METHODS)
    assert overrides == declared, (f"PACIPipelineEngine overrides {sorted(overrides - declared)} not declared in "
                                   f"OVERRIDDEN_ENGINE_METHODS; declared but not overridden: {sorted(declared - overrides)}")
    missing = [m for m in declared if not callable(getattr(PipelineEngine, m, None))]
    assert not missing, f"the installed DeepSpeed's PipelineEngine no longer has {missing}"
    # the engine never writes a private field of DeepSpeed's engine itself (only through the seam)
    shadowed = sorted((fields | methods) & _deepspeed_base_private_names(PipelineEngine) - declared)
    assert not shadowed, f"PACIPipelineEngine defines DeepSpeed's own private members {shadowed}: use the seam"


def test_the_seam_module_documents_every_function_and_imports_only_torch_and_deepspeed():
    assert [p.name for p in SEAM_FILES] == ["__init__.py", "engine.py", "wrappers.py"], SEAM_FILES
    trees = [_parse(p) for p in SEAM_FILES]
    functions = [n for tree in trees for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert all(ast.get_docstring(f) for f in functions), [f.name for f in functions if not ast.get_docstring(f)]
    # every function of the two halves is reached as deepspeed_internals.<name>
    assert all(getattr(deepspeed_internals, f.name, None) is not None for f in functions), "not re-exported"
    for name in ("exec_load_micro_batch", "exec_forward_pass", "exec_backward_pass", "exec_send_activations",
                 "exec_recv_activations", "exec_send_grads", "exec_recv_grads", "exec_reduce_grads",
                 "exec_reduce_tied_grads", "exec_optimizer_step", "reserve_pipe_buffers", "stock_next_batch",
                 "param_dict"):
        assert callable(getattr(deepspeed_internals, name)), name
    tops = {a.name.split(".")[0] for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    tops |= {n.module.split(".")[0] for tree in trees for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and not n.level}  # (relative: the package's own halves)
    assert tops <= {"torch", "deepspeed"}, tops
    doc = ast.get_docstring(trees[0])
    for field in deepspeed_internals.INTERNAL_FIELDS:  # the module docstring is the list to re-check
        assert f"``{field}" in doc, field


@pytest.mark.process
def test_the_benchmark_tracer_leaves_deepspeeds_instruction_table_unchanged():
    import seam_workers
    results = run_world(seam_workers.traced_stock_engine, 2, 2, timeout=240)
    for r in results:
        assert r["type"] == "PipelineEngine"
        assert r["after"] == r["before"], "the tracer changed PipelineEngine._INSTRUCTION_MAP for the whole class"
        assert r["records_of_other_engine"] == 0, "a second engine was traced: the table was not the engine's own"
        # it did trace: every micro-batch's forward and backward, and the step, of the two calls
        assert sum(t.startswith("F") for t in r["records"]) == 4 and sum(t.startswith("B") for t in r["records"]) == 4
        assert "STEP2" in r["records"]
