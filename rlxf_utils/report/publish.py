"""The review bundle: one folder a publisher copies to any static host, for peer reviewers.

`publish_bundle(run_dir, out)` writes, from a run whose report is rendered (`rlxf report`):

    index.html                  what the run is (commit, dirty flag, profile, date, machine), links
    paper/rlxf_report.html|pdf  the working paper; every table and figure links to its sources
    notebooks/NN_*.html         each executed notebook, read-only (nbconvert, no kernel, no script)
    tables/<name>.html|csv      every table of the run, browsable and as its CSV
    artifacts/...               the summaries, figures and samples the paper reads beside tables
    sources.html                every table and figure of the paper: notebook cell, data
    manifest.json

Data and model text stay text: notebook pages (nbconvert's basic template, no JavaScript) go
through `clean_html` (a whitelist: no script, style, frame or form element, no event or style attribute,
no link but to an anchor, no image but an embedded one); table pages escape every cell. Every page
carries a Content-Security-Policy that allows no script and no request outside the bundle.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlxf_utils.artifacts import read_manifest, spreadsheet_safe
from rlxf_utils.report.sanitize import clean_html

__all__ = [
    "CSP",
    "PublishError",
    "Source",
    "clean_html",
    "paper_sources",
    "publish_bundle",
]

#: Every page of the bundle: no script, no frame, no request but images embedded or in the bundle.
CSP = (
    "default-src 'none'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'"
)
_HEAD = (
    '<meta charset="utf-8">\n'
    f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    '<meta name="referrer" content="no-referrer">\n'
    '<link rel="icon" href="data:,">\n'
)
_CSS = """
body{font-family:system-ui,sans-serif;max-width:72rem;margin:1rem auto;padding:0 1rem;
line-height:1.45;color:#1b1b1b}
nav.bundle{font-size:.9rem;border-bottom:1px solid #ccc;padding-bottom:.4rem;margin-bottom:1rem}
table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #ccc;padding:2px 6px;
vertical-align:top;text-align:left}.scroll{overflow-x:auto}
pre{white-space:pre-wrap;background:#f6f6f6;padding:.4rem;font-size:.8rem}
.cell{border-top:1px solid #e3e3e3;padding:.3rem 0}.input_area{background:#f4f6fa}
.prompt{color:#777;font-size:.75rem}.cell-link{font-size:.75rem;color:#777}
img{max-width:100%}a.anchor-link{font-size:.7em;text-decoration:none;margin-left:.3em}:target{outline:2px solid #f0b400}dt{font-weight:600}
"""
#: The provenance line placed above every table and figure of the paper.
_PROVENANCE_CSS = (
    "p.provenance{font-size:.8rem;margin:.6rem 0 .2rem;color:#555}"
    "p.provenance a{margin-right:.6rem}"
)


class PublishError(RuntimeError):
    """The bundle cannot be made; the message names what is missing and the command that makes it."""


def page(title: str, body: str, *, up: str = "", css: str = "") -> str:
    """A bundle page: the CSP, the bundle's style, a bar back to the index and the paper (`up` is
    the path from the page's folder to the bundle's root, `""` or `"../"`)."""
    nav = (
        f'<nav class="bundle"><a href="{up}index.html">Review bundle</a> · '
        f'<a href="{up}paper/rlxf_report.html">Paper</a> · '
        f'<a href="{up}sources.html">Sources of every table and figure</a></nav>'
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n{_HEAD}<title>{html.escape(title)}</title>\n'
        f"<style>{_CSS}{css}</style>\n</head>\n<body>\n{nav}\n{body}\n</body>\n</html>\n"
    )


def notebook_page(nb_path: Path, title: str) -> tuple[str, dict[str, str]]:
    """The executed notebook `nb_path` as a read-only page (nbconvert's basic template: no
    JavaScript, nothing fetched) and its cells' anchors (cell id -> `cell-id=<id>`, nbconvert's
    own anchor for a cell)."""
    import nbformat
    from nbconvert import HTMLExporter
    from pygments.formatters import HtmlFormatter  # nbconvert's highlighter: its colours

    nb = nbformat.read(nb_path, as_version=4)
    for i, cell in enumerate(nb.cells):  # an older notebook without ids: ids by position
        if not cell.get("id"):
            cell["id"] = f"cell-{i:02d}"
    # nbconvert's own sanitiser (`sanitize_html`) escapes headings and paragraphs of markdown into
    # visible tags; `clean_html`'s whitelist over the whole page is the sanitiser instead
    exporter = HTMLExporter(template_name="basic", sanitize_html=False)
    body, _ = exporter.from_notebook_node(nb)
    anchors = {c["id"]: f"cell-id={c['id']}" for c in nb.cells}
    head = (
        f"<h1>{html.escape(title)}</h1>\n<p>The executed notebook as the run left it "
        f"(<code>notebooks/{html.escape(nb_path.name)}</code>, read-only; every cell has an "
        "anchor: its link shows the cell's id).</p>\n"
    )
    css = HtmlFormatter(style="default").get_style_defs(".highlight")
    return page(title, head + clean_html(body), up="../", css=css), anchors


# ---------------------------------------------------------------------------------------------
# Where each table and figure of the paper comes from


@dataclass(frozen=True)
class Source:
    """One table or figure of the paper: its id (`tbl-x`, `fig-x`), the artifact it is read from,
    the step that wrote it, and the bundle's links to that step's notebook cell and to the data."""

    item: str
    artifact: str
    written_by: str
    notebook: str | None = None  # bundle path of the notebook page, e.g. notebooks/04_x.html
    cell: str | None = None  # the anchor on it
    data: tuple[tuple[str, str], ...] = ()  # (label, bundle path)

    @property
    def cell_href(self) -> str | None:
        if self.notebook is None:
            return None
        return self.notebook + (f"#{self.cell}" if self.cell else "")


_SOURCE_ROW = re.compile(r"^\|\s*@((?:tbl|fig)-[\w-]+)\s*\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*$")


def paper_sources(run_root: Path) -> list[tuple[str, str, str]]:
    """(item id, artifact, writer) of every table and figure of the rendered paper, from the
    report's own record (`sources.sources_table`, written to `report/_build/_generated/sources.md`
    by `rlxf report`)."""
    md = run_root / "report/_build/_generated/sources.md"
    if not md.is_file():
        raise PublishError(
            f"{md} is missing: render the report first (rlxf report --run-dir {run_root})"
        )
    rows = []
    for line in md.read_text(encoding="utf-8").splitlines():
        m = _SOURCE_ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3).replace("\\", "")))
    return rows


def _stem(artifact: str) -> str:
    return Path(artifact).stem


def _writer_notebook(written_by: str, notebooks: list[Path]) -> Path | None:
    """The executed notebook of a writer such as `notebook 04` (`sources.WRITER_BY_PREFIX`)."""
    m = re.search(r"notebook (\d\d)", written_by)
    if not m:
        return None
    return next((p for p in notebooks if p.name.startswith(m.group(1))), None)


#: Words of an artifact's name too common to find the cell that shows it.
_COMMON = frozenset(("table", "tables", "summary", "figure", "train", "model", "policy", "reward"))


def _tokens(names: list[str]) -> list[str]:
    """The words of `names` (`rl_algorithm_settings`, `rlsamples`), longest first, without a
    stage prefix glued on and without `_COMMON` words: what a cell may show it by."""
    words = set()
    for name in names:
        for w in re.split(r"[_\-]", name):
            words.add(re.sub(r"^(rl|eval|risk|reward|data|ilhf|rlgf)(?=[a-z]{5})", "", w))
    return sorted((w for w in words if len(w) >= 5 and w not in _COMMON), key=lambda w: -len(w))


def _cell_of(nb: dict, names: list[str], substring: bool = False) -> str | None:
    """The id of the first code cell that names one of `names` as a quoted string in its source
    (the notebooks show an artifact as `figure("x")` or `T["x"]`), else whose source or output
    mentions it as a word (with `substring`: contains it), else None."""
    cells = [(c.get("id") or f"cell-{i:02d}", c) for i, c in enumerate(nb.get("cells", []))
             if c.get("cell_type") == "code"]  # fmt: skip

    def source(c: dict) -> str:
        s = c.get("source", "")
        return s if isinstance(s, str) else "".join(s)

    if substring:
        return next((cid for name in names for cid, c in cells if name in source(c)), None)
    for name in names:
        quoted = re.compile(rf"[\"']{re.escape(name)}[\"']")
        for cid, c in cells:
            if quoted.search(source(c)):
                return cid
    for name in names:
        word = re.compile(rf"\b{re.escape(name)}\b")
        for cid, c in cells:
            if word.search(source(c)) or word.search(json.dumps(c.get("outputs", []))):
                return cid
    return None


def _sources(run_root: Path, notebooks: list[Path], data_links: dict[str, list]) -> list[Source]:
    loaded = {p: json.loads(p.read_text(encoding="utf-8")) for p in notebooks}
    out = []
    for item, artifact, by in paper_sources(run_root):
        nb = _writer_notebook(by, notebooks)
        # a table or figure of the run by its name, a summary's table by the paper's name first
        names = [_stem(artifact), item.split("-", 1)[1]]
        if not artifact.startswith(("tables/", "figures/")):
            names.reverse()
        if artifact == "manifest.json" or not nb:
            cell = None
        else:
            cell = _cell_of(loaded[nb], list(dict.fromkeys(names)))
            if cell is None:  # a summary (e.g. eval/summary.json): the cell that reads it
                cell = _cell_of(loaded[nb], [Path(artifact).name])
            if cell is None:  # `tbl-rlsettings`: the cell showing rl_tables["rl_..._settings"]
                cell = _cell_of(loaded[nb], _tokens(names), substring=True)
        links: list[tuple[str, str]] = []
        for name in dict.fromkeys(names):
            links += data_links.get(name, [])
        links += data_links.get(artifact, [])
        out.append(
            Source(
                item=item,
                artifact=artifact,
                written_by=by,
                notebook=f"notebooks/{nb.stem}.html" if nb else None,
                cell=f"cell-id={cell}" if cell else None,
                data=tuple(dict.fromkeys(links)),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Tables, artifacts, the paper, the index

#: Rows a table page shows (the CSV beside it has all of them).
MAX_TABLE_ROWS = 2000


def table_page(csv: Path) -> str:
    """The CSV `csv` as an escaped HTML table (every cell as text), with a link to the file."""
    try:
        frame = pd.read_csv(csv, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:  # a stage that had nothing for it wrote no header either
        frame = pd.DataFrame()
    shown = frame.head(MAX_TABLE_ROWS)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    rows = "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
        for row in shown.itertuples(index=False)
    )
    note = (
        f"<p>The first {MAX_TABLE_ROWS:,} of {len(frame):,} rows; the CSV has all of them.</p>"
        if len(frame) > MAX_TABLE_ROWS
        else f"<p>{len(frame):,} rows.</p>"
    )
    name = html.escape(csv.name)
    body = (
        f"<h1>Table <code>{html.escape(csv.stem)}</code></h1>\n<p>The run's "
        f'<code>tables/{name}</code>: <a href="{name}">download the CSV</a>.</p>\n{note}\n'
        f'<div class="scroll"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n'
        "</tbody></table></div>"
    )
    return page(f"Table {csv.stem}", body, up="../")


#: Artifacts beside the tables that the paper reads (summaries) or a reviewer checks (samples).
ARTIFACTS = (
    "data/summary.json",
    "reward/metrics.json",
    "eval/summary.json",
    "eval/samples.jsonl",
    "risk/summary.json",
    "report/render.json",
)


def _link_list(links: list[tuple[str, str]], up: str = "") -> str:
    return " ".join(f'<a href="{up}{html.escape(h)}">{html.escape(t)}</a>' for t, h in links)


def _provenance(src: Source, up: str) -> str:
    """The line above a table or figure: the notebook cell that wrote it and its data."""
    esc = html.escape
    if src.cell_href:
        what = "the cell that wrote it" if src.cell else "the notebook that wrote it"
        by = f'<a href="{up}{esc(src.cell_href)}">{esc(src.written_by)}: {what}</a>'
    else:
        by = esc(src.written_by.replace("`", ""))
    data = f" · data: {_link_list(list(src.data), up)}" if src.data else ""
    return (
        f'<p class="provenance" id="src-{esc(src.item)}">Source: {by}{data} '
        f"(<code>{esc(src.artifact)}</code>)</p>"
    )


#: The paper's appendix table of sources (`sources.sources_table`), which is not its own source.
SOURCES_TABLE = "tbl-sources"
_ID_TAG = re.compile(r"<(\w+)\b[^>]*\bid=\"((?:tbl|fig)-[\w-]+)\"")


def paper_page(report_html: str, sources: list[Source]) -> tuple[str, list[str]]:
    """The rendered paper with the bundle's CSP and, above every table and figure, a line linking
    the notebook cell that wrote it and its data. Returns the page and the ids of tables and
    figures the paper has but the record does not (an empty list when every one is linked)."""
    by_id = {s.item: s for s in sources}
    seen: list[str] = []

    def add(m: re.Match[str]) -> str:
        item = m.group(2)
        if item == SOURCES_TABLE:  # the record itself: its linked copy
            return (
                '<p class="provenance">With links to every notebook cell and its data: '
                '<a href="../sources.html">sources of every table and figure</a></p>' + m.group(0)
            )
        seen.append(item)
        src = by_id.get(item)
        return (_provenance(src, "../") if src else "") + m.group(0)

    text = _ID_TAG.sub(add, report_html)
    head = (
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="referrer" content="no-referrer">\n<link rel="icon" href="data:,">\n'
        f"<style>{_PROVENANCE_CSS}</style>\n"
    )
    text, n = re.subn(r"(<head[^>]*>)", lambda m: m.group(1) + "\n" + head, text, count=1)
    if not n:
        raise PublishError("the rendered paper has no <head>: rerun rlxf report")
    return text, sorted(set(seen) - set(by_id))


def _machine(env: dict) -> str:
    bf16 = {True: "native bf16", False: "no native bf16 ('auto' precisions ran fp32)"}
    bits = [env.get("platform", ""), f"{env.get('cpu_count', '?')} CPUs",
            f"{env.get('memory_gib', '?')} GiB memory", "CUDA" if env.get("cuda") else "no GPU",
            bf16.get(env.get("native_bf16"), ""), f"Python {env.get('python', '?')}"]  # fmt: skip
    return ", ".join(b for b in bits if b)


def index_page(manifest: dict, notebooks: list[tuple[str, str]], tables: list[str],
               artifacts: list[str], has_pdf: bool) -> str:  # fmt: skip
    """The bundle's front page: what the run is and a link to everything in it."""
    git = manifest.get("git", {})
    params = manifest.get("params", {})
    run = params.get("run", {})
    profile = Path(manifest.get("params_source") or manifest.get("params_file") or "").name
    facts = [
        ("Study", manifest.get("study", "")),
        ("Run", manifest.get("run_name", "")),
        ("Title", run.get("title", "")),
        ("Profile (parameters file)", profile),
        ("Commit", git.get("commit") or "unknown"),
        ("Uncommitted changes (dirty)", "yes" if git.get("dirty") else "no"),
        ("Date (last update)", manifest.get("updated", "")),
        ("Machine", _machine(manifest.get("environment", {}))),
        ("Data", f"{manifest.get('data', {}).get('sha256', '')} (sha256)"),
    ]
    dl = "\n".join(
        f"<dt>{html.escape(k)}</dt><dd><code>{html.escape(str(v))}</code></dd>" for k, v in facts
    )
    nbs = "\n".join(f'<li><a href="{html.escape(h)}">{html.escape(t)}</a></li>'
                    for t, h in notebooks)  # fmt: skip
    tabs = "\n".join(
        f'<li><a href="tables/{html.escape(t)}.html">{html.escape(t)}</a> '
        f'(<a href="tables/{html.escape(t)}.csv">CSV</a>)</li>'
        for t in tables
    )
    arts = "\n".join(f'<li><a href="{html.escape(a)}">{html.escape(a)}</a></li>'
                     for a in artifacts)  # fmt: skip
    pdf = ' · <a href="paper/rlxf_report.pdf">PDF</a>' if has_pdf else ""
    body = f"""<h1>Review bundle: {html.escape(str(run.get("title") or manifest.get("run_name", "")))}</h1>
<p>The working paper, the executed notebooks that computed it and the run's tables, from one run
of the study. Every table and figure of the paper links to the notebook cell that wrote it and to
its data.</p>
<h2 id="run">The run</h2>
<dl>
{dl}
</dl>
<h2 id="paper">The paper</h2>
<p><a href="paper/rlxf_report.html">HTML</a>{pdf} ·
<a href="sources.html">where every table and figure comes from</a> ·
<a href="manifest.json">manifest.json</a> (parameters, versions, timings)</p>
<h2 id="notebooks">Executed notebooks</h2>
<ol>
{nbs}
</ol>
<h2 id="tables">Tables</h2>
<ul>
{tabs}
</ul>
<h2 id="artifacts">Other artifacts</h2>
<ul>
{arts or "<li>none in this run</li>"}
</ul>"""
    return page(f"Review bundle: {manifest.get('run_name', '')}", body)


def sources_page(sources: list[Source]) -> str:
    rows = []
    for s in sources:
        nb = (f'<a href="{html.escape(s.cell_href)}">{html.escape(s.written_by)}'
              f"{', cell' if s.cell else ''}</a>" if s.cell_href
              else html.escape(s.written_by))  # fmt: skip
        paper = f'<a href="paper/rlxf_report.html#{html.escape(s.item)}">{html.escape(s.item)}</a>'
        rows.append(f"<tr><td>{paper}</td><td><code>{html.escape(s.artifact)}</code></td>"
                    f"<td>{nb}</td><td>{_link_list(list(s.data))}</td></tr>")  # fmt: skip
    body = (
        "<h1>Where every table and figure comes from</h1>\n<p>The paper's appendix table, with "
        "links: the item in the paper, the artifact it is read from, the notebook cell that "
        'wrote it and the data.</p>\n<div class="scroll"><table>\n<thead><tr><th>item</th>'
        "<th>artifact</th><th>written by</th><th>data</th></tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table></div>"
    )
    return page("Sources of every table and figure", body)


# ---------------------------------------------------------------------------------------------


@dataclass
class Bundle:
    root: Path
    pages: list[str]
    sources: list[Source]
    unlinked: list[str]  # paper items without a record (should be empty)


def publish_bundle(run_dir: str | Path, out: str | Path | None = None) -> Bundle:
    """Write the review bundle of the rendered run `run_dir` into `out` (default
    `<run_dir>/report/review`: beside the rendered paper, which `rlxf compare` leaves aside),
    replacing a bundle that was there."""
    root = Path(run_dir)
    manifest = read_manifest(root)  # NotARun when it is not a run
    report = root / "report/rlxf_report.html"
    if not report.is_file():
        raise PublishError(f"{report} is missing: render it first (rlxf report --run-dir {root})")
    dest = Path(out) if out is not None else root / "report/review"
    if dest.exists():
        if not (dest / "index.html").is_file() and any(dest.iterdir()):
            raise PublishError(f"{dest} exists and is not a review bundle: choose another --out")
        shutil.rmtree(dest)
    for sub in ("paper", "notebooks", "tables", "artifacts"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    pages: list[str] = []

    def write(rel: str, text: str) -> None:
        (dest / rel).write_text(text, encoding="utf-8")
        pages.append(rel)

    notebooks = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    nb_links = []
    for nb in notebooks:
        text, _ = notebook_page(nb, f"Notebook {nb.stem}")
        write(f"notebooks/{nb.stem}.html", text)
        nb_links.append((nb.stem, f"notebooks/{nb.stem}.html"))

    data_links: dict[str, list[tuple[str, str]]] = {}
    tables = sorted((root / "tables").glob("*.csv"))
    for csv in tables:
        shutil.copyfile(csv, dest / "tables" / csv.name)
        write(f"tables/{csv.stem}.html", table_page(csv))
        data_links[csv.stem] = [("table", f"tables/{csv.stem}.html"),
                                ("CSV", f"tables/{csv.name}")]  # fmt: skip
    artifacts = []
    for rel in ARTIFACTS:
        if (root / rel).is_file():
            (dest / "artifacts" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest / "artifacts" / rel)
            artifacts.append(f"artifacts/{rel}")
            data_links[rel] = [(Path(rel).name, f"artifacts/{rel}")]
    figures = root / "report/_build/figures"  # the report's figures (placeholders included)
    for png in sorted(figures.glob("*.png")) if figures.is_dir() else []:
        target = dest / "artifacts/figures" / png.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, target)
        artifacts.append(f"artifacts/figures/{png.name}")
        data_links.setdefault(png.stem, []).append(("PNG", f"artifacts/figures/{png.name}"))
        data_links[f"figures/{png.name}"] = []
    for _, artifact, _ in paper_sources(root):  # a parquet file the paper reads: as a CSV
        if artifact.endswith(".parquet") and (root / artifact).is_file():
            rel = f"artifacts/{artifact[: -len('.parquet')]}.csv"
            if rel not in artifacts:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                spreadsheet_safe(pd.read_parquet(root / artifact)).to_csv(dest / rel, index=False)
                artifacts.append(rel)
                data_links[artifact] = [("CSV", rel)]
    shutil.copyfile(root / "manifest.json", dest / "manifest.json")
    data_links["manifest.json"] = [("manifest.json", "manifest.json")]

    sources = _sources(root, notebooks, data_links)
    paper, unlinked = paper_page(report.read_text(encoding="utf-8"), sources)
    write("paper/rlxf_report.html", paper)
    pdf = root / "report/rlxf_report.pdf"
    if pdf.is_file():
        shutil.copyfile(pdf, dest / "paper/rlxf_report.pdf")
    write("sources.html", sources_page(sources))
    write("index.html", index_page(manifest, nb_links, [c.stem for c in tables], artifacts,
                                   pdf.is_file()))  # fmt: skip
    return Bundle(dest, pages, sources, unlinked)
