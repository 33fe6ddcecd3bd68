"""The module's layering, read from its AST: banners in dependency order (a
banner uses only what stands above it), engine differences only in the engine
layer, one writer of the outbox.  Issue 25 brings each figure to its goal;
until then each ceiling is today's figure, so a change can lower it and never
raise it (lower the ceiling with the change that lowers the figure)."""

import ast
import pathlib
import re

MODULE = pathlib.Path(__file__).resolve().parent.parent / "campaignapi.py"
SOURCE = MODULE.read_text()
TREE = ast.parse(SOURCE)
RULE = re.compile(r"^# -{20,}$")

#: (today's ceiling, the goal of issue 25)
FORWARD_NAMES = (0, 0)
ENGINE_TESTS_OUTSIDE = (0, 0)
OUTBOX_WRITERS = (1, 1)


def banners(lines=SOURCE.splitlines()):
    """[(first line, title)]: a rule line, comment lines (the title), a rule line."""
    found, i = [], 0
    while i < len(lines):
        if RULE.match(lines[i]):
            j = i + 1
            while j < len(lines) and lines[j].startswith("#") and not RULE.match(lines[j]):
                j += 1
            if j > i + 1 and j < len(lines) and RULE.match(lines[j]):
                found.append((i + 1, " ".join(line[2:] for line in lines[i + 1:j])))
                i = j
        i += 1
    return found


BANNERS = banners()


def banner_of(lineno):
    """The banner a line stands under; -1 above the first (imports, constants)."""
    return max((index for index, (start, _) in enumerate(BANNERS) if start <= lineno), default=-1)


def _bound_names(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) else [])
    return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]


def forward_references():
    """{(user banner, name, defining banner)} for every top-level name used
    above the banner that defines it."""
    defined = {}
    for node in TREE.body:
        for name in _bound_names(node):
            defined.setdefault(name, banner_of(node.lineno))
    title = {-1: "(the head)", **{index: text[:40] for index, (_, text) in enumerate(BANNERS)}}
    return {(title[banner_of(node.lineno)], name.id, title[defined[name.id]])
            for node in TREE.body for name in ast.walk(node)
            if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Load)
            and defined.get(name.id, -1) > banner_of(node.lineno)}


def engine_tests_outside_the_engine_layer():
    """Comparisons of an ``engine`` attribute outside the engine banner."""
    engine_banner = next(index for index, (_, title) in enumerate(BANNERS)
                         if title.startswith("Database"))
    return [node.lineno for node in ast.walk(TREE)
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "engine"
                for side in (node.left, *node.comparators))
            and banner_of(node.lineno) != engine_banner]


def outbox_writers():
    return [node.lineno for node in ast.walk(TREE)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.search(r"INSERT\s+INTO\s+outbox\b", node.value, re.I)]


def test_the_banners_are_found():
    assert len(BANNERS) >= 20 and BANNERS[0][1].startswith("Errors")


def test_no_new_reference_to_a_later_banner():
    found = sorted(forward_references())
    assert len(found) <= FORWARD_NAMES[0], "\n".join(map(str, found))


def test_no_new_engine_test_outside_the_engine_layer():
    found = engine_tests_outside_the_engine_layer()
    assert len(found) <= ENGINE_TESTS_OUTSIDE[0], f"lines {found}"


def test_no_new_writer_of_the_outbox():
    found = outbox_writers()
    assert len(found) <= OUTBOX_WRITERS[0], f"lines {found}"
