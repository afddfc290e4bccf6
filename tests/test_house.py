"""The house rules a reader can check by eye, checked by reading the files: no dated results
in the code, module headers that say what a module is for in a few lines, functions short
enough to read on their own, `--help` docstrings that show their line continuations,
docs whose relative links resolve, and every test file described in docs/test-files.md. Reads
files only: no JAX, well under a second.
"""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CODE = sorted([*REPO.glob("vit_pure/**/*.py"), *REPO.glob("train_*.py")])
MODULES = sorted([*CODE, *REPO.glob("benchmarks/**/*.py")])
DOCS = sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("docs/notes/*.md")])

MAX_HEADER_LINES = 15
DATE = re.compile(r"20\d\d-\d\d-\d\d")
# A path that names a dated file (a note, a data file) is a link to the evidence, not a date.
DATED_PATH = re.compile(r"[\w.-]*/[\w./-]*20\d\d-\d\d-\d\d[\w./-]*")
MAX_FUNCTION_LINES = 80
# Functions still over MAX_FUNCTION_LINES, as "path:qualified name": each is to be split,
# then leaves this list (the check fails for one that is no longer over), until it is empty.
LONG_FUNCTIONS_ALLOWED: set[str] = set()
# [text](target): a markdown link; the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_the_checks_see_the_files():
    assert len(CODE) > 50 and len(MODULES) > len(CODE) and len(DOCS) > 5
    assert REPO / "vit_pure" / "model.py" in CODE and REPO / "docs" / "training.md" in DOCS


@pytest.mark.parametrize("path", CODE, ids=_rel)
def test_no_dates_in_the_code(path):
    """Dated results, machines and wall times live in docs/, where they carry their command;
    the code says what a constant is and where its evidence lives."""
    lines = path.read_text().splitlines()
    dated = [f"{_rel(path)}:{i}: {line.strip()}" for i, line in enumerate(lines, 1)
             if DATE.search(DATED_PATH.sub("", line))]
    assert not dated, "\n".join(dated)


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_header_is_short(path):
    """A module's docstring says what the module is for; the detail belongs to the
    functions it describes, or to docs/."""
    body = ast.parse(path.read_text()).body
    header = body[0] if body and isinstance(body[0], ast.Expr) else None
    if header is None or not isinstance(header.value, ast.Constant):
        return  # no docstring: nothing to measure (an empty package face)
    lines = header.end_lineno - header.lineno + 1
    assert lines <= MAX_HEADER_LINES, f"{_rel(path)}: a {lines}-line module header"


def _function_lines(source: str) -> dict[str, int]:
    """Lines of each function of a module (its `def` line to its last, decorators not
    counted), by qualified name: `Class.method`, `outer.inner`."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)
    visit(ast.parse(source), "")
    return lengths


def _long_functions() -> dict[str, int]:
    """Every function of the code over MAX_FUNCTION_LINES, as "path:name" -> lines."""
    return {f"{_rel(path)}:{name}": lines for path in CODE
            for name, lines in _function_lines(path.read_text()).items()
            if lines > MAX_FUNCTION_LINES}


def test_the_length_check_counts_nested_functions_and_methods():
    source = ("@decorator\ndef f():\n    def g():\n        pass\n    return g\n\n\n"
              "class C:\n    async def m(self):\n\n        pass\n")
    assert _function_lines(source) == {"f": 4, "f.g": 2, "C.m": 3}


def test_functions_are_short():
    """A function over MAX_FUNCTION_LINES does several things: split it into named pieces
    that each read on their own."""
    over = sorted(f"{name}: {lines} lines" for name, lines in _long_functions().items()
                  if name not in LONG_FUNCTIONS_ALLOWED)
    assert not over, "\n".join(over)


def test_the_long_function_allow_list_is_current():
    """Every allowed function exists and is still over the limit: one split (or renamed)
    leaves LONG_FUNCTIONS_ALLOWED, which cannot then go stale."""
    stale = sorted(LONG_FUNCTIONS_ALLOWED - set(_long_functions()))
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines (or gone): {stale}; " \
                      "remove from LONG_FUNCTIONS_ALLOWED"


def _joined_lines(source: str) -> list[int]:
    """Lines of triple-quoted, non-raw strings that end in a backslash: Python joins such a
    line to the next, so a usage example printed by --help loses its continuation."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.STRING:
            continue
        prefix = tok.string[:tok.string.index(tok.string.lstrip("rRbBuUfF")[0])]
        body = tok.string[len(prefix):]
        if "r" in prefix.lower() or not body.startswith(('"""', "'''")):
            continue
        for i, line in enumerate(body.splitlines()):
            backslashes = len(line) - len(line.rstrip("\\"))
            if backslashes % 2:
                found.append(tok.start[0] + i)
    return found


def test_the_backslash_check_finds_a_joined_line():
    assert _joined_lines('x = """a \\\n b"""\n') == [1]
    assert _joined_lines('x = r"""a \\\n b"""\n') == []
    assert _joined_lines('x = """a \\\\\n b"""\n') == []  # an escaped backslash, shown


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_docstrings_keep_their_line_continuations(path):
    joined = _joined_lines(path.read_text())
    assert not joined, f"{_rel(path)}: lines {joined} end in a backslash that Python joins " \
                       "(make the string raw: r\"\"\"...\"\"\")"


def _links(text: str) -> list[str]:
    """The relative link targets of a markdown text, outside code blocks and spans."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def test_the_link_check_reads_relative_links_only():
    text = ("[a](docs/a.md#x) [b](https://x.org) [c](#here) `[d](no.md)`\n"
            "```\n[e](no.md)\n```\n[f](../g.py)")
    assert _links(text) == ["docs/a.md#x", "../g.py"]


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path):
    """Every relative link in README.md and docs/ points to a file or folder that exists."""
    missing = [t for t in _links(path.read_text())
               if not (path.parent / t.split("#")[0]).exists()]
    assert not missing, f"{_rel(path)}: {missing}"


def test_every_test_file_says_what_it_proves_in_test_files_md():
    """docs/test-files.md's "What each file proves" names every tests/test_*.py."""
    text = (REPO / "docs" / "test-files.md").read_text()
    section = text.split("## What each file proves", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py)`", section))
    missing = sorted(p.name for p in REPO.glob("tests/test_*.py") if p.name not in named)
    assert not missing, missing
