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
from partitioners.memory_model import SETTINGS
from partitioners.planners.layout import SEARCHED_ZERO
from pipetrain.apps.run_config import OPTIMIZERS
from pipetrain.options import PARTITIONERS, PRECISIONS, SCHEDULES, STALENESS, PipelineOptions

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


def test_api_reference_lists_exactly_pipetrains_all():
    # the sentence that ends "(`pipetrain.__all__`)" names every export once, and nothing else
    paragraph = next(p for p in (DOCS / "api.md").read_text().split("\n\n") if "(`pipetrain.__all__`)" in p)
    listed = re.findall(r"`([A-Za-z_]\w*)`", paragraph.partition("(`pipetrain.__all__`)")[0])
    assert sorted(listed) == sorted(pipetrain.__all__)


def test_api_names_are_real():
    # the reference's headings name only what exists: a renamed method fails here, not in a user's editor
    text = (DOCS / "api.md").read_text()
    for heading in re.findall(r"^#### `([A-Za-z_]+)", text, flags=re.M):
        assert hasattr(pipetrain.Pipeline, heading), heading


# ----- option vocabularies -------------------------------------------------------------------------------
# A page marks a list of an option's values as whole, visible to no reader:
#     <!-- vocabulary: NAME -->the list<!-- /vocabulary -->
# or <!-- vocabulary: NAME except VALUE ... --> for a list that leaves those values out on purpose. The list must
# then name every value the code takes, by its own spelling or one of SPELLINGS (case ignored), and none it leaves
# out: a schedule, policy or level added to the code fails here until every such list names it.
VOCABULARIES: dict[str, tuple[str, ...]] = {
    "schedules": SCHEDULES, "staleness": STALENESS, "precisions": PRECISIONS, "partitioners": PARTITIONERS,
    "optimizers": OPTIMIZERS,  # pipetrain compare's, the demo's and the example scripts' --optimizer
    "zero-auto": tuple(map(str, SEARCHED_ZERO)),  # the levels `pipetrain plan --zero auto` tries
    "recompute-settings": SETTINGS,  # those `--recompute auto` tries
}
SPELLINGS = {"interleaved-1f1b": ("interleaved 1f1b",), "zb-h1": ("zero-bubble h1",), "zbv": ("zb-v",),
             "interleaved-zb": ("interleaved zero-bubble",), "async-1f1b": ("async 1f1b", "asynchronous 1f1b"),
             "stash": ("stashed", "stashing"), "2bw": ("pipedream-2bw",)}
MARKED_LIST = re.compile(r"<!--\s*vocabulary:\s*([\w-]+)((?:\s+except(?:\s+[\w-]+)+)?)\s*-->(.*?)"
                         r"<!--\s*/vocabulary\s*-->", re.S)


def named(text: str, vocabulary: tuple[str, ...]) -> set[str]:
    """The values of ``vocabulary`` that ``text`` names. Longer spellings are read first and taken out, so that
    "interleaved 1F1B" names interleaved-1f1b and not 1f1b as well."""
    text = " ".join(text.split())
    spellings = sorted(((s, v) for v in vocabulary for s in (v, *SPELLINGS.get(v, ()))), key=lambda p: -len(p[0]))
    found = set()
    for spelling, value in spellings:
        pattern = re.compile(r"(?<![\w-])" + re.escape(spelling) + r"(?!\w)", re.I)
        if pattern.search(text):
            found.add(value)
            text = pattern.sub(" ", text)
    return found


def marked_lists() -> list[tuple[str, str, set[str], str]]:
    """(where, vocabulary, values left out, text) of every marked list of every page."""
    lists = []
    for page in PAGES:
        text = page.read_text()
        for m in MARKED_LIST.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            lists.append((where, m.group(1), set(m.group(2).split()[1:]), m.group(3)))
    return lists


def test_marked_lists_name_every_value_the_code_takes():
    wrong = []
    for where, name, left_out, text in marked_lists():
        assert name in VOCABULARIES, f"{where}: no vocabulary {name!r}; choose from {sorted(VOCABULARIES)}"
        values = set(VOCABULARIES[name])
        assert left_out <= values, f"{where}: {name} has no {sorted(left_out - values)}"
        got, expected = named(text, VOCABULARIES[name]), values - left_out
        if expected - got:
            wrong.append(f"{where}: the {name} list lacks {sorted(expected - got)}")
        if got - expected:
            wrong.append(f"{where}: the {name} list names {sorted(got - expected)}, which it says it leaves out")
    assert not wrong, "\n".join(wrong)


def test_markers_pair_up_and_every_vocabulary_has_a_list():
    for page in PAGES:
        text = page.read_text()
        opened, closed = len(re.findall(r"<!--\s*vocabulary:", text)), len(re.findall(r"<!--\s*/vocabulary", text))
        assert opened == closed == len(MARKED_LIST.findall(text)), f"{page.name}: an unpaired or nested marker"
    # a marker lost in an edit must not switch the check off: each vocabulary keeps its lists
    assert {name for _, name, _, _ in marked_lists()} == set(VOCABULARIES)
    # README's intro and features, the docs' index, options.md, schedules.md
    assert sum(name == "schedules" for _, name, _, _ in marked_lists()) >= 5


def test_the_package_docstring_names_every_schedule():
    assert named(pipetrain.__doc__, SCHEDULES) == set(SCHEDULES)
    assert named(pipetrain.__doc__, STALENESS) == set(STALENESS) - {"none", "vanilla"}  # the policies that correct


def test_the_readme_gives_the_demos_micro_batches():
    from pipetrain.apps.demo import DEMOS

    per_model = {name: int(next(a.partition("=")[2] for a in argv if a.startswith("--micro-batches=")))
                 for name, argv in DEMOS.items()}
    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"at (\d+) micro-batches per update \((\d+) for ResNet\)", text)
    assert said, "README no longer says the demo's micro-batches per update the way this test reads them"
    assert per_model == {name: int(said.group(2) if name == "resnet" else said.group(1)) for name in per_model}


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
    """Run every block of ``page`` in order in one namespace (the working directory is the caller's); a block in
    test_doc_commands.BLOCKS_NOT_RUN is compiled only, so its syntax cannot rot either. Returns the namespace."""
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
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    # it starts with the two commands, then installing and the quick start; the research is linked further down
    first_block = re.search(r"^```\n(.*?)^```", text, flags=re.S | re.M)
    assert first_block.start() < text.index("\n## ")
    assert [line.partition("#")[0].strip() for line in first_block.group(1).splitlines()] == ["make demo", "make test"]
    sections = re.findall(r"^## (.*)$", text, flags=re.M)
    assert sections[:2] == ["Installing it as a library", "Quick start"]
    assert {"Features", "Limitations"} <= set(sections)
