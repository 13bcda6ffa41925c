"""What a reader follows in README.md and docs/ resolves: every relative link (and its #anchor, by
GitHub's heading slugs), every `make` target, every `rlxf` subcommand and option, every file path
and module a page shows; nothing points outside the project; the README stays short; and the
parameter files' comments stay short. The last test feeds each check a broken page, so none of
them passes vacuously."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220
#: The longest comment a parameters file may carry, in lines (a run of consecutive comment lines).
COMMENT_MAX_LINES = 2
#: Top-level folders of the project: a path in backticks that starts with one must exist. Paths in
#: a run directory (`tables/...`, `eval/...`, `<run>/data/...`) start with none of them.
PROJECT_DIRS = (
    "rlxf_utils",
    "params",
    "notebooks",
    "reports",
    "tests",
    "bench",
    "data",
    "docs",
    ".ci",
)

FENCE = re.compile(r"^ *(```|~~~)[^\n]*\n.*?^ *\1 *$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower-cased, every character that
    is not a letter, digit, space, hyphen or underscore dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor on a page (outside code blocks); repeats get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", text)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(text: str) -> str:
    """The page without its code blocks and code spans: where links live."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """Every line of code a page shows: each line of a fenced block (its comment removed) and each
    inline code span."""
    lines = []
    for block in FENCE.finditer(text):
        for line in block.group(0).splitlines()[1:-1]:
            lines.append(re.sub(r"(^|\s)#.*$", "", line))
    lines += [m.group(2) for m in INLINE_CODE.finditer(FENCE.sub("", text))]
    return lines


# -- the checks: each returns what is wrong, as messages --------------------------------------------


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links that name no file, and #anchors that name no heading of a markdown page."""
    bad = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: link to a missing file: {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text("utf-8")):
            bad.append(f"{page.name}: link to a missing heading: {target}")
    return bad


@cache
def make_targets() -> frozenset[str]:
    """The Makefile's targets (rules, not variable assignments)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return frozenset(re.findall(r"^([A-Za-z][\w.-]*)[ \t]*:(?!=)", text, flags=re.M))


def make_problems(page: str, text: str, targets: frozenset[str] | None = None) -> list[str]:
    """`make X` in code where X is no Makefile target."""
    targets = make_targets() if targets is None else targets
    bad = []
    for line in code(text):
        for m in re.finditer(r"(?:^|[\s;&|(])make((?:[ \t]+[^\s;&|#]+)*)", line):
            for word in m.group(1).split():
                if "=" not in word and not word.startswith("-") and word not in targets:
                    bad.append(f"{page}: `make {word}` is no Makefile target")
    return bad


@cache
def cli_parser():
    from rlxf_utils.cli import build_parser

    return build_parser()


def _subcommands(parser) -> dict:
    """A parser's subcommands, name -> parser (empty when it has none)."""
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return dict(action.choices)
    return {}


def rlxf_problems(page: str, text: str, parser=None) -> list[str]:
    """`rlxf <subcommand> [--option ...]` in code where the subcommand or an option is unknown."""
    parser = cli_parser() if parser is None else parser
    bad = []
    for line in code(text):
        for m in re.finditer(r"(?:^|[;&|(])\s*(?:[\w.-]*/)*rlxf[ \t]+([^;&|#]*)", line):
            words, current, name = m.group(1).split(), parser, "rlxf"
            while words and (subs := _subcommands(current)):
                word = words.pop(0)
                if word.startswith("-"):  # an option before the subcommand (`rlxf -v run`)
                    if word not in {o for a in current._actions for o in a.option_strings}:
                        bad.append(f"{page}: `{name}` has no option {word}")
                    continue
                if word not in subs:
                    bad.append(f"{page}: `{name} {word}` is no rlxf subcommand")
                    break
                current, name = subs[word], f"{name} {word}"
            else:
                options = {o for a in current._actions for o in a.option_strings}
                for word in words:
                    if word.startswith("--") and word.split("=")[0] not in options:
                        bad.append(f"{page}: `{name}` has no option {word.split('=')[0]}")
    return bad


def _exports(package: Path, name: str) -> bool:
    """Whether a package's `__init__` names `name` (an attribute it re-exports)."""
    init = package / "__init__.py"
    return (
        init.is_file() and re.search(rf"\b{name}\b", init.read_text(encoding="utf-8")) is not None
    )


def _module_problem(name: str) -> str | None:
    """Why `rlxf_utils.a.b[:f]` names nothing of the package: each part is a subpackage, a module
    (what follows it are its attributes) or a name its package's `__init__` exports."""
    here = ROOT / "rlxf_utils"
    for part in name.split(":")[0].split(".")[1:]:
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file() or _exports(here, part):
            return None
        return f"no module {name}"
    return None


def path_problems(page: str, text: str) -> list[str]:
    """Paths in code that start with a project folder but name nothing, and `rlxf_utils.x` names
    that are no module."""
    bad = []
    for line in code(text):
        for token in re.split(r"[\s=,()\"']+", line):
            token = re.sub(r"^(\$PWD/|\./)", "", token).rstrip(".:;")
            if not token or re.search(r"[<>*{}\[\]$|]", token):
                continue
            if "/" in token and token.split("/")[0] in PROJECT_DIRS:
                if not (ROOT / token).exists():
                    bad.append(f"{page}: `{token}` does not exist")
            elif re.fullmatch(r"rlxf_utils(\.\w+)+(:\w+)?", token) and (
                problem := _module_problem(token)
            ):
                bad.append(f"{page}: {problem}")
    return bad


#: A name in code that reads like a config key: dotted lower-case identifiers, `key: value` kept
#: to its key; not a module of the package (`rlxf_utils.x`) nor a file (`a.json`).
DOTTED = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+")
FILE_END = re.compile(
    r"\.(py|md|ya?ml|json|jsonl|csv|parquet|png|txt|toml|ipynb|html|pdf|qmd|lock)$"
)


@cache
def _config() -> tuple[object, frozenset[str], frozenset[str]]:
    """The default profile's resolved config, its sections and every other field name in it."""
    from pydantic import BaseModel

    from rlxf_utils.config import load_config

    cfg = load_config(ROOT / "params" / "default.yaml")
    sections = frozenset(type(cfg).model_fields)
    leaves: set[str] = set()

    def walk(model: BaseModel) -> None:
        for name in type(model).model_fields:
            leaves.add(name)
            if isinstance(value := getattr(model, name), BaseModel):
                walk(value)

    walk(cfg)
    return cfg, sections, frozenset(leaves - sections)


def _is_key(name: str) -> bool:
    """`name` is a field (or property) of the config, section by section."""
    node: object = _config()[0]
    for part in name.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif not isinstance(node, dict) and hasattr(node, part) and not part.startswith("_"):
            node = getattr(node, part)
        else:
            return False
    return True


def key_problems(page: str, text: str) -> list[str]:
    """Names in code that read as config keys but are none: a dotted name that starts with a
    section (`rl.`, `evaluation.`, ...) and is neither a key nor a module or object of the
    package, or one that ends with a key's name under another path (`algorithms.algorithm`)."""
    _, sections, leaves = _config()
    bad = []
    for span in (m.group(2) for m in INLINE_CODE.finditer(FENCE.sub("", text))):
        head = re.split(r"[\s:=(]", span.strip(), maxsplit=1)[0].rstrip(".,;")
        if not DOTTED.fullmatch(head) or head.startswith("rlxf_utils.") or FILE_END.search(head):
            continue
        first, last = head.split(".")[0], head.split(".")[-1]
        if _is_key(head):
            continue
        if last in leaves or (first in sections and _module_problem(f"rlxf_utils.{head}")):
            bad.append(f"{page}: `{head}` is no config key")
    return bad


def outside_problems(page: str, text: str) -> list[str]:
    """References to what a clone of the project does not have: the workspace's shared folder,
    absolute paths of this machine, issue numbers."""
    bad = []
    for pattern, what in ((r"\.\./shared", "../shared"), (r"(?<![\w.~-])/work/", "an absolute /work path"),
                          (r"\bissues? #?\d+", "an issue number")):  # fmt: skip
        if re.search(pattern, text, flags=re.I):
            bad.append(f"{page}: refers to {what}")
    return bad


def _comment_start(line: str) -> int | None:
    """Where a YAML line's comment starts (a '#' at the start or after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"" and (i == 0 or line[i - 1] in " \t:[{,-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
    return None


def comment_runs(text: str) -> list[tuple[int, int]]:
    """(first line, length) of each comment: a run of consecutive full-line comments, where a key
    line's trailing comment counts as a line and starts a run that full-line comments below it
    continue. Lines inside a block scalar (`|`, `>`) are text, not comments."""
    runs: list[tuple[int, int]] = []
    start, length, block_indent = 0, 0, None

    def close() -> None:
        nonlocal length
        if length:
            runs.append((start, length))
        length = 0

    for n, line in enumerate(text.splitlines(), 1):
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:
            if not line.strip() or indent > block_indent:
                continue
            block_indent = None
        at = _comment_start(line)
        body = line if at is None else line[:at]
        if not line.strip():
            close()
        elif at is not None and not body.strip():  # a full-line comment
            if not length:
                start = n
            length += 1
        else:
            close()
            if at is not None:
                start, length = n, 1
            if re.search(r":\s*[|>][-+0-9]*\s*$", body):
                block_indent = indent
    close()
    return runs


def comment_problems(name: str, text: str, limit: int = COMMENT_MAX_LINES) -> list[str]:
    return [f"{name}:{line}: a comment of {n} lines (at most {limit})"
            for line, n in comment_runs(text) if n > limit]  # fmt: skip


#: A timing the README quotes: `**figure** (commit, date)`.
TIMING = re.compile(r"\*\*([^*]+)\*\*\s*\(([0-9a-f]{7,40}),\s*(\d{4}-\d{2}-\d{2})\)")
TIMINGS_HEADING = "How long on my machine"


def _section(text: str, heading: str) -> str:
    """A page's section under `heading`, to the next heading of any level."""
    m = re.search(rf"^#+ +{re.escape(heading)} *$(.*?)(?=^#|\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


def timing_problems(readme: str, measurements: str) -> list[str]:
    """The README's timing table: each cell a figure with its commit and date, or "not measured",
    and each figure in a row of measurements.md of that date and commit (quoted, not derived)."""
    rows = [ln for ln in _section(readme, TIMINGS_HEADING).splitlines() if ln.startswith("|")]
    cells = [c.strip() for ln in rows[2:] for c in ln.strip().strip("|").split("|")[1:]]
    if len(rows) < 3 or not cells:
        return [f"README.md: no table under '{TIMINGS_HEADING}'"]
    measured = [ln for ln in measurements.splitlines() if re.match(r"\| \d{4}-\d{2}-\d{2},", ln)]
    bad = []
    for cell in cells:
        m = TIMING.fullmatch(cell)
        if cell == "not measured":
            continue
        if not m:
            bad.append(
                f"README.md: a timing is neither '**figure** (commit, date)' nor 'not measured': {cell}"
            )
            continue
        figure, commit, date = m.groups()
        if not any(
            ln.startswith(f"| {date},") and commit in ln and figure in ln for ln in measured
        ):
            bad.append(
                f"README.md: {figure} ({commit}, {date}) is in no row of measurements.md of that date and commit"
            )
    return bad  # fmt: skip


def date_order_problems(page: str, text: str) -> list[str]:
    """Rows of a page's tables that are older than a row below them (each table newest first)."""
    bad = []
    for table in re.split(r"\n(?!\|)", text):
        dates = re.findall(r"^\| (\d{4}-\d{2}-\d{2}),", table, re.M)
        bad += [
            f"{page}: a {b} row below a {a} row"
            for a, b in zip(dates, dates[1:], strict=False)
            if b > a
        ]
    return bad


# -- the tests ----------------------------------------------------------------------------------------


def _pages() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in PAGES]


def test_the_pages_exist() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "architecture.md", "reruns.md", "measurements.md"} <= names, names


def test_every_relative_link_and_anchor_resolves() -> None:
    bad = [msg for page, text in _pages() for msg in link_problems(page, text)]
    assert not bad, bad


def test_every_make_command_names_a_target() -> None:
    bad = [msg for page, text in _pages() for msg in make_problems(page.name, text)]
    assert not bad, bad


def test_every_rlxf_command_names_a_subcommand_and_its_options() -> None:
    bad = [msg for page, text in _pages() for msg in rlxf_problems(page.name, text)]
    assert not bad, bad


def test_every_project_path_and_module_shown_exists() -> None:
    bad = [msg for page, text in _pages() for msg in path_problems(page.name, text)]
    assert not bad, bad


def test_nothing_points_outside_the_project() -> None:
    bad = [msg for page, text in _pages() for msg in outside_problems(page.name, text)]
    assert not bad, bad


def _notebook_texts() -> list[tuple[str, str]]:
    """Each notebook's markdown, and its code cells' strings and comments, as one text."""
    import json

    out = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        out.append((nb.name, "\n\n".join("".join(c["source"]) for c in cells)))
    return out


def test_every_config_key_named_in_the_docs_and_notebooks_exists() -> None:
    """A page, a notebook or a parameters comment names a key the schema has (a renamed or
    mistyped key would send a reader to a setting that stops the run as unknown)."""
    params = [(f.name, "\n".join(f"`{c}`" for c in re.findall(r"#.*", f.read_text("utf-8"))))
              for f in sorted((ROOT / "params").glob("*.yaml"))]  # fmt: skip
    texts = [(p.name, t) for p, t in _pages()] + _notebook_texts() + params
    bad = [msg for name, text in texts for msg in key_problems(name, text)]
    assert not bad, bad


def method_problems(name: str, text: str) -> list[str]:
    """Sentences that name a statistical method for what the code does otherwise: Holm or
    Wilcoxon (`stats.REFERENCE_ONLY`) without saying they are for reference, or a bootstrap as
    the interval of a paired difference, which is `stats.PAIRED_INTERVAL`'s."""
    from rlxf_utils.stats import PAIRED_INTERVAL, REFERENCE_ONLY

    bad = []
    for sentence in re.split(r"(?<=[.;])\s+|\n\s*\n", FENCE.sub("", text)):
        said = " ".join(sentence.split())
        for method in REFERENCE_ONLY:
            if method in said and "for reference" not in said:
                bad.append(f"{name}: names {method} as if a verdict read it: {said[:120]}")
        paired = re.search(r"paired (difference|test|change|gain)", said)
        if paired and "bootstrap" in said and PAIRED_INTERVAL not in said:
            bad.append(f"{name}: a bootstrap for a paired difference: {said[:120]}")
    return bad


def test_the_notebooks_name_the_statistical_methods_the_code_uses() -> None:
    """Notebook 04 once promised "a Holm-adjusted Wilcoxon p-value" and "a cluster-bootstrap
    CI" for the paired gains, which the code reads from the cluster-robust t interval in
    Bonferroni families; a notebook's markdown now names what `rlxf_utils.stats` says."""
    import json

    bad = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        bad += method_problems(nb.name, text)
    assert not bad, bad
    said = ("Paired tests, Holm-corrected. Per-country tests (Holm-adjusted, for reference). "
            "The paired difference with a cluster-bootstrap CI. Ave(R) with a cluster-bootstrap "
            "CI. The paired difference with the cluster-robust t interval.")  # fmt: skip
    assert [m.split(":")[1].strip() for m in method_problems("x", said)] == [
        "names Holm as if a verdict read it", "a bootstrap for a paired difference"]  # fmt: skip


def test_the_readme_cites_from_the_bibliography_and_the_licence_is_pyprojects() -> None:
    """The README's BibTeX is `reports/references.bib`'s entries, character for character (not
    retyped), the paper's among them; LICENSE is the licence `pyproject.toml` names."""
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    bib = (ROOT / "reports" / "references.bib").read_text(encoding="utf-8")
    blocks = re.findall(r"```bibtex\n(.*?)```", readme, re.S)
    entries = [e.strip() for b in blocks for e in re.split(r"\n(?=@)", b.strip())]
    assert any(e.startswith("@techreport{atashbar2024rlxf,") for e in entries), entries
    assert entries and all(e in bib for e in entries), [e for e in entries if e not in bib]
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert meta["license"]["text"] == "MIT"
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License\n")


def test_the_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, n


def test_the_readme_timings_are_rows_of_the_measurements() -> None:
    """Each figure of the README's "how long" table stands in docs/measurements.md with the same
    commit and date, so the table cannot drift from the record or re-derive a number."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    measurements = (ROOT / "docs" / "measurements.md").read_text(encoding="utf-8")
    assert len(TIMING.findall(_section(readme, TIMINGS_HEADING))) >= 3
    bad = timing_problems(readme, measurements)
    assert not bad, bad


def test_the_measurements_are_newest_first() -> None:
    bad = date_order_problems(
        "measurements.md", (ROOT / "docs" / "measurements.md").read_text("utf-8")
    )
    assert not bad, bad  # fmt: skip


RESULTS = ROOT / "docs" / "results"


def test_the_readme_shows_the_results_docs_results_holds() -> None:
    """The README's results section is what `rlxf publish --readme` writes from the stamp and
    table in docs/results/ (not edited by hand); rerun that command when this fails."""
    import json

    from rlxf_utils.report.readme import BEGIN, END, STAMP, TABLE, readme_section

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert BEGIN in readme and END in readme
    section = readme.split(BEGIN)[1].split(END)[0]
    stamp = json.loads((RESULTS / STAMP).read_text(encoding="utf-8"))
    assert section.strip() == readme_section(stamp, (RESULTS / TABLE).read_text("utf-8")).strip()
    assert stamp["dirty"] is False and stamp["profile"] and stamp["date"]


def test_the_stamped_results_commit_is_in_the_history() -> None:
    """The commit docs/results/ was made from is an ancestor of HEAD: a picture from a commit this
    history lacks (a rewritten branch, another fork) fails here instead of passing as current."""
    import json
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    try:
        inside = git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except OSError:
        inside = False
    if not inside:
        pytest.skip("not a git checkout: the stamped commit cannot be looked up")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: its history may end before the stamped commit")
    commit = json.loads((RESULTS / "run.json").read_text(encoding="utf-8"))["commit"]
    found = git("merge-base", "--is-ancestor", commit, "HEAD")
    assert found.returncode == 0, f"docs/results/run.json: commit {commit} is not in the history of HEAD: rerun rlxf publish --readme ({found.stderr.strip()})"  # fmt: skip


def test_parameter_comments_are_short() -> None:
    files = sorted((ROOT / "params").rglob("*.yaml"))
    assert files
    bad = [msg for f in files
           for msg in comment_problems(f.relative_to(ROOT).as_posix(), f.read_text("utf-8"))]  # fmt: skip
    assert not bad, bad


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Rerunning: what is skipped", "rerunning-what-is-skipped"),
        ("The policies' own rows", "the-policies-own-rows"),
        ("Power and the evaluation's design", "power-and-the-evaluations-design"),
        ("The reward model (notebook 02)", "the-reward-model-notebook-02"),
        ("`make study` and `rlxf_utils`", "make-study-and-rlxf_utils"),
        ("One-off checks", "one-off-checks"),
    ],
)
def test_slugs_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_each_check_catches_what_it_is_for(tmp_path: Path) -> None:
    """Every check above fails on a page that breaks it (none passes vacuously)."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n\n## A section\n")
    broken = (
        "# Page\n\nSee [missing](nowhere.md), [a heading](other.md#no-such-heading),\n"
        "[fine](other.md#a-section), [repeated](other.md#a-section-1), [here](#page).\n\n"
        "```bash\nmake no-such-target PARAMS=x   # make study\nrlxf no-such-command\n"
        "rlxf run --no-such-option\n.venv/bin/rlxf data no-such\n```\n\n"
        "`rlxf_utils/no_such_module.py`, `params/none.yaml`, `rlxf_utils.no_such`, "
        "`rlxf_utils.stats.intervals.cluster_t`, `tables/eval_summary.csv`, `<run>/data/x.json`\n\n"
        "See ../shared/DESIGN.md, /work/main/README.md and issue 44.\n"
    )
    page.write_text(broken)
    assert link_problems(page, broken) == [
        "page.md: link to a missing file: nowhere.md",
        "page.md: link to a missing heading: other.md#no-such-heading",
    ]
    assert make_problems("page.md", broken) == [
        "page.md: `make no-such-target` is no Makefile target"
    ]
    assert rlxf_problems("page.md", broken) == [
        "page.md: `rlxf no-such-command` is no rlxf subcommand",
        "page.md: `rlxf run` has no option --no-such-option",
        "page.md: `rlxf data no-such` is no rlxf subcommand",
    ]
    assert path_problems("page.md", broken) == [
        "page.md: `rlxf_utils/no_such_module.py` does not exist",
        "page.md: `params/none.yaml` does not exist",
        "page.md: no module rlxf_utils.no_such",
    ]
    assert len(outside_problems("page.md", broken)) == 3
    keys = ("`rl.algorithm`, `algorithms.algorithm` (notebook 03 before), `rl.steps: 16`, "
            "`rl.no_such_key`, `evaluation.lanes` (a module), `rl.core.AdaptiveKLController`, "
            "`rl.optimizer_steps_per_batch` (a property), `evaluation.kl_budgets.x`, `a.json`")  # fmt: skip
    assert key_problems("page.md", keys) == [
        "page.md: `algorithms.algorithm` is no config key",
        "page.md: `rl.no_such_key` is no config key",
        "page.md: `evaluation.kl_budgets.x` is no config key",
    ]
    yaml_text = (
        "# one\n# two\n# three\nkey: 1\n\n"  # three full lines: too long
        "a: 1  # trailing\n   # and a continuation\n   # and another\n"  # 1 + 2: too long
        "b: 2  # fine\n# fine too\n\n"  # a key's comment, then a new comment of one line
        "c: >-  # the block's own comment\n  # not a comment: text\n  # still text\n  more text\n"
        "d: 'a # in quotes'\n"
    )
    readme = (
        "# R\n\n### How long on my machine\n\n| machine | study | tests |\n| --- | --- | --- |\n"
        "| A | **62.0 min** (c6f1dc4, 2026-12-02) | not measured |\n"
        "| B | **61.0 min** (c6f1dc4, 2026-12-02) | **11.6 min** (e4ebda1, 2026-12-01) |\n"
        "| C | about an hour | **1,170 s** (52df052, 2026-12-02) |\n\n## Next\n"
    )
    measured = (
        "| 2026-12-02, f92378c and c6f1dc4 | the study | f92378c 63.7 min, c6f1dc4 **62.0 min** |\n"
        "| 2026-12-02, e4ebda1 | the suite | **11.6 min** of pytest |\n"
        "| 2026-12-02, b911b26 → 52df052 | the smoke | **1,430 → 1,170 s** |\n"
        "| 2026-12-03, 0000000 | out of order | |\n\n| 2026-11-01, x | another table | |\n"
    )
    assert timing_problems(readme, measured) == [
        "README.md: 61.0 min (c6f1dc4, 2026-12-02) is in no row of measurements.md of that date and commit",
        "README.md: 11.6 min (e4ebda1, 2026-12-01) is in no row of measurements.md of that date and commit",
        "README.md: a timing is neither '**figure** (commit, date)' nor 'not measured': about an hour",
    ]
    assert timing_problems("# R\n", measured) == [
        "README.md: no table under 'How long on my machine'"
    ]
    assert date_order_problems("m.md", measured) == [
        "m.md: a 2026-12-03 row below a 2026-12-02 row"
    ]
    assert comment_runs(yaml_text) == [(1, 3), (6, 3), (9, 2), (12, 1)]
    assert comment_problems("x.yaml", yaml_text) == [
        "x.yaml:1: a comment of 3 lines (at most 2)",
        "x.yaml:6: a comment of 3 lines (at most 2)",
    ]
