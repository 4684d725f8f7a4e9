"""README.md and docs/ cannot rot: the options table equals PipelineOptions, the API reference names every public
member and docs/api.md's list of ``pipetrain.__all__`` is that list, every list of an option's values that a page
marks as whole names every value the code takes, every ```python block runs (or, listed in
test_doc_commands.BLOCKS_NOT_RUN with its reason, at least compiles) and every relative link reaches its file and
heading."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import pipetrain
from pipetrain.options import PipelineOptions

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Pages whose examples load transformers or train several models: over ~8 s here.
SLOW_PAGES = {"language-models.md", "big-models.md"}


# ----- the options table ---------------------------------------------------------------------------------
def rendered_default(field: dataclasses.Field) -> str:
    """How docs/options.md writes a field's default: repr() of the value (of what default_factory makes), and
    a function by its importable name (its repr holds an address)."""
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def options_table() -> list[tuple[str, str]]:
    """(name, default) of every row of docs/options.md's table, in order, each cell's backticks removed."""
    rows = []
    for line in (DOCS / "options.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1].strip("`")))
    return rows


def test_options_table_lists_every_field_in_order_with_its_default():
    expected = [(f.name, rendered_default(f)) for f in dataclasses.fields(PipelineOptions)]
    assert options_table() == expected


def test_wrap_takes_the_options_the_table_lists():
    # the table is checked against PipelineOptions; wrap's signature must be the same list (test_errors holds it too)
    keyword_only = [p.name for p in inspect.signature(pipetrain.wrap).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == [name for name, _ in options_table()]


# ----- the API reference ---------------------------------------------------------------------------------
def public_names(cls: type) -> list[str]:
    return [name for name, _ in inspect.getmembers(cls) if not name.startswith("_")]


def documented_names(text: str) -> set[str]:
    """Names that head a section, start a code span (`name`, `name(...)`, `pipe.name`, `pipetrain.name`) or
    start a table row's first cell."""
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    names = set()
    for span in spans:
        head = re.match(r"(?:pipe\.|pipetrain\.|Pipeline\.|StepResult\.)?([A-Za-z_][A-Za-z0-9_]*)", span)
        if head:
            names.add(head.group(1))
    return names


@pytest.mark.parametrize("owner, names", [
    ("Pipeline", public_names(pipetrain.Pipeline)),
    ("StepResult", sorted({f.name for f in dataclasses.fields(pipetrain.StepResult)}
                          | set(public_names(pipetrain.StepResult)))),
    ("pipetrain", list(pipetrain.__all__)),
])
def test_api_reference_documents_every_public_name(owner, names):
    text = (DOCS / "api.md").read_text()
    headings = " ".join(line for line in text.splitlines() if line.startswith("#"))
    missing = [n for n in names if n not in documented_names(text)]
    assert not missing, f"docs/api.md does not document {owner}'s {missing}"
    if owner == "Pipeline":  # every method and property has its own heading
        assert not [n for n in names if f"`{n}" not in headings]


def test_api_names_are_real():
    # the reference's headings name only what exists: a renamed method fails here, not in a user's editor
    text = (DOCS / "api.md").read_text()
    for heading in re.findall(r"^#### `([A-Za-z_]+)", text, flags=re.M):
        assert hasattr(pipetrain.Pipeline, heading), heading


# ----- the code blocks ------------------------------------------------------------------------------------
def block_sources(page: Path) -> list[tuple[int, str]]:
    """(line, source) of each ```python block of ``page``, in order."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, source, reason not run or None) of each ```python block of ``page``, in order; the reasons are
    test_doc_commands.BLOCKS_NOT_RUN's, by the page and the block's first line (pages carry no such notes)."""
    from test_doc_commands import BLOCKS_NOT_RUN  # imported here: that module imports this one

    name = str(page.relative_to(ROOT))
    return [(line, source, BLOCKS_NOT_RUN.get((name, source.splitlines()[0])))
            for line, source in block_sources(page)]


def _page_params():
    for page in PAGES[1:]:  # README.md: test_the_quick_start_trains runs it
        if block_sources(page):
            marks = [pytest.mark.slow] if page.name in SLOW_PAGES else []
            yield pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks)


def run_page(page: Path) -> dict:
    """Run every block of ``page`` in order in one namespace (the working directory is the caller's); a block
    marked not run is compiled only, so its syntax cannot rot either. Returns the namespace."""
    namespace: dict = {"__name__": "__docs__"}
    for line, source, reason in python_blocks(page):
        code = compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")
        if reason is None:
            exec(code, namespace)
    return namespace


@pytest.mark.parametrize("page", list(_page_params()))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)


def test_the_quick_start_trains(tmp_path, monkeypatch):
    # README's quick start is real: its 3-class toy problem starts at a loss near ln 3 = 1.10 and learns
    monkeypatch.chdir(tmp_path)
    namespace = run_page(ROOT / "README.md")
    assert namespace["loss"] < 0.8  # 0.56 after its 5 epochs here
    assert namespace["result"].step == len(namespace["loader"])  # the async stream trained every mini-batch
    assert (tmp_path / "checkpoints" / "mynet" / "latest").exists()
    assert namespace["state"].keys() == namespace["model"].state_dict().keys()


# ----- links ----------------------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_their_file_and_heading(page):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_every_docs_page_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    assert [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index] == []


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
