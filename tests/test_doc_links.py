"""The documentation's links and names resolve (issue 29): in-process, no launches.

* Every relative link and image in ``README.md``, ``docs/*.md`` and ``launch/**/README.md`` names a file that
  exists, and every ``#anchor`` (same file or another Markdown file) names a heading there, slugged as GitHub does.
* Every ``make X`` the README names (in code) is a target of the ``Makefile``.
* Every ``python -m ds_paci....`` / ``--module ds_paci....`` the README or ``docs/*.md`` names is a runnable module
  (a module, or a package with ``__main__``).
* Every dotted ``ds_paci.`` name written alone in inline code resolves (modules, then attributes); the README's
  "Import paths changed" list maps old names that no longer import to new names that do.
"""

import importlib
import importlib.util
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
IMPORT_PATHS_HEADING = "Import paths changed"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_MODULE = re.compile(r"(?:python3?\s+-m|--module|-m)\s+(ds_paci(?:\.\w+)+)")
_MAKE = re.compile(r"(?:^|[\s;&|(])make\s+((?:[A-Z_]+=\S+\s+)*)([a-z][\w-]*)")
_DOTTED = re.compile(r"ds_paci(?:\.\w+)+")
FILE_SUFFIXES = {"json", "py", "md", "txt", "pt", "sh", "jsonl"}


def doc_files():
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "launch").rglob("README.md"))]


def prose(text):
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    return _INLINE.sub("", _FENCE.sub("", text))


def code(text):
    """Fenced code blocks and inline code spans, one per element."""
    blocks = [m.group(0) for m in _FENCE.finditer(text)]
    return blocks + [m.group(2) for m in _INLINE.finditer(_FENCE.sub("", text))]


def slug(heading):
    """GitHub's anchor of a heading: rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(path):
    problems = []
    for target in _LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = path.relative_to(ROOT)
        if not dest.exists():
            problems.append(f"{rel}: ({target}) -> no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel}: ({target}) -> no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top `x` part\n\n[ok](#top-x-part) [bad](#nowhere) [gone](b.md) "
                                   "`[code](c.md)`\n\n```\n[fenced](d.md)\n```\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        problems = broken_links(tmp_path / "a.md")
    finally:
        ROOT = old
    assert len(problems) == 2 and "#nowhere" in problems[0] and "b.md" in problems[1], problems


def makefile_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, re.M))


def test_every_make_target_the_readme_names_exists():
    named = set()
    for snippet in code(README.read_text()):
        named |= {m.group(2) for m in _MAKE.finditer(snippet)}
    assert {"train", "test", "megatron"} <= named, named  # the quick start's and the Megatron section's
    missing = named - makefile_targets()
    assert not missing, f"README names make targets the Makefile lacks: {sorted(missing)}"


def runnable(module):
    """None if ``python -m module`` can start, else why not."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as e:
        return str(e)
    if spec is None:
        return "no such module"
    if spec.submodule_search_locations is not None and importlib.util.find_spec(module + ".__main__") is None:
        return "a package without __main__"
    return None


def test_every_python_dash_m_module_named_exists():
    named = {(path.relative_to(ROOT), m) for path in [README, *sorted((ROOT / "docs").glob("*.md"))]
             for m in _MODULE.findall(path.read_text())}
    assert any(m == "ds_paci.run" for _, m in named)
    problems = [f"{path}: python -m {m}: {why}" for path, m in sorted(named) if (why := runnable(m))]
    assert not problems, "\n".join(problems)


def resolves(dotted):
    """True if ``dotted`` is a module, or a module's attribute chain."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def import_paths_section():
    text = README.read_text()
    m = re.search(rf"^##+ {IMPORT_PATHS_HEADING}\n(.*?)(?=^## )", text, re.M | re.S)
    assert m, f"README has no '{IMPORT_PATHS_HEADING}' section"
    return m.group(1)


def test_import_paths_changed_maps_old_names_that_fail_to_new_names_that_resolve():
    rows = re.findall(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`", import_paths_section(), re.M)
    assert len(rows) >= 8, rows
    # an old flat module is gone, or its name is now a package (whose modules the new names are)
    still_there = [old for old, _ in rows
                   if (spec := importlib.util.find_spec(old)) is not None and spec.submodule_search_locations is None]
    assert not still_there, f"listed as moved but still a module: {still_there}"
    gone = [new for _, new in rows if not resolves(new)]
    assert not gone, f"new paths that do not resolve: {gone}"


def test_every_dotted_ds_paci_name_in_inline_code_resolves():
    moved = import_paths_section()
    problems = []
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        if path == README:
            text = text.replace(moved, "")
        for snippet in code(text):
            name = snippet.strip()
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # a file such as ds_paci.json, not a Python name
                continue
            if _DOTTED.fullmatch(name) and not resolves(name):
                problems.append(f"{path.relative_to(ROOT)}: `{name}` does not resolve")
    assert not problems, "\n".join(problems)
