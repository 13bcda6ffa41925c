"""The review bundle in a real browser (headless Chromium, driven by Playwright): no dialog, no
request out of the bundle, every image loaded, every link and anchor landing, the paper's contents
working, no console error; from disk and from a static server. Here on a small run whose data,
notebook outputs and paper carry the suite's hostile text (`test_report_safety`); the smoke run's
bundle is checked in `test_smoke_study.py`. The checker (`publish_check.browser_problems`) must
report a bundle with a live script or an outside image: the negative tests below."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import shutil
import struct
import threading
import time
import zlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import (
    new_code_cell,
    new_markdown_cell,
    new_notebook,
    new_output,
)
from test_report_safety import SECRET, _hostile, _report_markdown, _Tags, listener  # noqa: F401

from rlxf_utils.artifacts import RunDir
from rlxf_utils.report.publish import clean_html, publish_bundle
from rlxf_utils.report.publish_check import browser_executable, browser_problems, pdf_problems
from rlxf_utils.report.render import pandoc_html, pandoc_typst


def need_browser() -> None:
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip "
                        "install -e '.[dev]'): the browser checks need it")  # fmt: skip
    if browser_executable() is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium, as .ci/run "
                    "does; or set RLXF_CHROMIUM to a Chrome/Chromium binary)")  # fmt: skip


@contextlib.contextmanager
def static_server(root: Path):
    """`root` served on 127.0.0.1 at a free port (Python's http.server): yields the base URL."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _png(width: int = 8, height: int = 4) -> bytes:
    """A small grey PNG, made here (valid chunks and checksums)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))  # fmt: skip


PNG = _png()


def _notebook(path: Path, bad: list[str], secret: Path) -> str:
    """An executed notebook whose markdown and outputs carry `bad`: returns the id of the cell
    that shows the table `status_mapping`."""
    text = "\n\n".join(bad)
    png = base64.b64encode(PNG).decode()
    shows = new_code_cell('figure("status_mapping")\nT["status_mapping"]', execution_count=2)
    shows.outputs = [
        new_output("display_data", data={"image/png": png, "text/plain": "<Figure>"}),
        new_output(
            "execute_result",
            execution_count=2,
            data={
                "text/html": "<table><tr><td>" + "</td><td>".join(bad) + "</td></tr></table>"
                "<style>body{background:url(http://127.0.0.1:9/x)}</style>",
                "text/plain": text,
            },
        ),  # fmt: skip
    ]
    other = new_code_cell("print(x)", execution_count=3)
    other.outputs = [
        new_output("stream", name="stdout", text=text),
        new_output("display_data", data={"text/markdown": text, "text/plain": "md"}),
        new_output("display_data", data={"application/javascript": "alert(9)"}),
        new_output(
            "display_data", data={"image/svg+xml": "<svg><script>alert(10)</script></svg>"}
        ),  # fmt: skip
        new_output(
            "display_data",
            data={
                "text/html": f'<img src="{secret}">'
                '<iframe src="http://127.0.0.1:9/"></iframe>'
                '<a href="javascript:alert(11)">x</a>'
                f'<a href="file://{secret}">y</a>'
            },
        ),  # fmt: skip
        new_output("error", ename="ValueError", evalue=bad[0], traceback=[bad[1]]),
    ]
    nb = new_notebook(cells=[
        new_markdown_cell("# Hostile\n\n" + text + f"\n\n![local]({secret})\n\n## Second"),
        new_code_cell("params_file = 'x'", execution_count=1),
        shows, other])  # fmt: skip
    nbformat.write(nb, path)
    return shows.id


def _hostile_run(tmp_path: Path, secret: Path, port: int) -> tuple[Path, str]:
    """A rendered run (manifest, tables, one executed notebook, the paper in HTML and PDF and its
    record of sources) whose data carry the suite's hostile text."""
    bad = _hostile(secret, port)
    md = _report_markdown(tmp_path, bad)  # tmp_path/run with tables, tmp_path/build
    root = tmp_path / "run"
    build = md.parent
    (build / "figures").mkdir(exist_ok=True)
    (build / "figures/met_rate.png").write_bytes(PNG)
    extra = "\n\n# Figures {#sec-figures}\n\nSee @fig-met_rate and @tbl-status_mapping.\n\n"
    extra += "![The rates.](figures/met_rate.png){#fig-met_rate}\n\n# End {#sec-end}\n\nDone.\n"
    md.write_text(md.read_text(encoding="utf-8") + extra, encoding="utf-8")
    formulas = ['=HYPERLINK("http://127.0.0.1:9/","x")', "+cmd", "@SUM(A1)", bad[0]]
    RunDir(root).write_table("formula_cells", pd.DataFrame({"cell": formulas}))
    (root / "report").mkdir()
    pandoc_html(md, root / "report/rlxf_report.html")
    import typst

    typst.compile(str(pandoc_typst(md)), output=str(root / "report/rlxf_report.pdf"),
                  root=str(build))  # fmt: skip
    gen = root / "report/_build/_generated"
    gen.mkdir(parents=True)
    (gen / "sources.md").write_text(
        "| item | artifact | written by |\n|---|---|---|\n"
        "| @tbl-status_mapping | `tables/status_mapping.csv` | notebook 01 |\n"
        "| @tbl-table2_sample | `tables/table2_sample.csv` | notebook 01 |\n"
        "| @tbl-samples | `eval/summary.json` | notebook 04 |\n"
        "| @fig-met_rate | `figures/met_rate.png` | notebook 01 |\n",
        encoding="utf-8",
    )
    (root / "notebooks").mkdir()
    cell = _notebook(root / "notebooks/01_data_exploration.ipynb", bad, secret)
    manifest = {
        "study": bad[0], "run_name": "hostile", "updated": "2026-11-28T10:00:00+00:00",
        "params_source": "params/smoke.yaml", "git": {"commit": bad[1], "dirty": True},
        "data": {"sha256": bad[2]}, "params": {"run": {"title": bad[3], "authors": [bad[5]], "wp_number": "1"}},
        "environment": {"platform": bad[4], "cpu_count": 2, "memory_gib": 8, "python": "3.11",
                        "packages": {"pandas": "2"}},
        "notebooks": [{"name": "01_data_exploration", "status": "ok"}],
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root, cell


@pytest.fixture
def hostile_bundle(tmp_path: Path, listener) -> tuple[Path, str, list]:  # noqa: F811
    port, hits = listener
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    root, cell = _hostile_run(tmp_path, secret, port)
    bundle = publish_bundle(root, tmp_path / "bundle")
    assert not bundle.unlinked, bundle.unlinked
    return bundle.root, cell, hits


def test_the_bundle_links_every_table_and_figure_to_its_cell_and_data(hostile_bundle) -> None:
    root, cell, _ = hostile_bundle
    paper = (root / "paper/rlxf_report.html").read_text(encoding="utf-8")

    def provenance(item: str) -> str:
        return paper[paper.index(f'id="src-{item}"') :].split("</p>", 1)[0]

    line = provenance("tbl-status_mapping")  # the cell that shows it: T["status_mapping"]
    assert f'href="../notebooks/01_data_exploration.html#cell-id={cell}"' in line, line
    assert 'href="../tables/status_mapping.csv"' in line, line
    assert 'href="../tables/status_mapping.html"' in line, line
    for item in ("tbl-table2_sample", "fig-met_rate"):  # no cell names them: the notebook
        assert 'href="../notebooks/01_data_exploration.html"' in provenance(item), item
    assert 'href="../artifacts/figures/met_rate.png"' not in provenance("fig-met_rate")
    assert "notebook 04" in provenance("tbl-samples")  # no such notebook in this run: named
    index = (root / "index.html").read_text(encoding="utf-8")
    assert "hostile" in index and "params/smoke.yaml" not in index and "smoke.yaml" in index
    assert "Uncommitted changes (dirty)</dt><dd><code>yes" in index
    for rel in ("manifest.json", "paper/rlxf_report.pdf", "tables/status_mapping.csv",
                "notebooks/01_data_exploration.html", "sources.html"):  # fmt: skip
        assert (root / rel).is_file(), rel


def test_hostile_text_stays_text_in_every_page(hostile_bundle) -> None:
    root, _, _ = hostile_bundle
    for page in root.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert SECRET not in text, page
        parser = _Tags()
        parser.feed(text.split("</head>", 1)[1])
        live = [
            t
            for t, _ in parser.tags
            if t in ("script", "iframe", "frame", "object", "embed", "svg", "style", "base")
        ]
        events = [(t, k) for t, a in parser.tags for k, _ in a if k.startswith("on")]
        styles = [
            (t, k)
            for t, a in parser.tags
            for k, _ in a
            if k == "style" and page.name != "rlxf_report.html"
        ]  # pandoc's column widths there
        urls = [
            v
            for _, a in parser.tags
            for k, v in a
            if k in ("href", "src")
            and v
            and (v.startswith(("javascript:", "file:", "http://127.0.0.1", "/")) or "secret" in v)
        ]
        imgs = [v for t, a in parser.tags if t == "img" for k, v in a
                if k == "src" and not (v or "").startswith("data:image/")]  # fmt: skip
        assert not (live or events or styles or urls or imgs), (page, live, events, urls, imgs)
    nb = (root / "notebooks/01_data_exploration.html").read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in nb  # the text, as text
    assert "[image not embedded:" in nb and "data:image/png;base64," in nb
    csv = (root / "tables/formula_cells.csv").read_text(encoding="utf-8")
    assert "'=HYPERLINK" in csv and "'+cmd" in csv and "'@SUM" in csv  # as `write_table` quoted
    page = (root / "tables/formula_cells.html").read_text(encoding="utf-8")
    assert "&#x27;=HYPERLINK(&quot;http://127.0.0.1:9/&quot;,&quot;x&quot;)" in page
    table = (root / "tables/table2_sample.html").read_text(encoding="utf-8")
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in table


def test_clean_html_keeps_text_and_drops_what_could_act() -> None:
    dirty = ('<div id="cell-id=a1" onclick="x()"><script>alert(1)</script><p style="color:red">'
             '<a href="javascript:alert(2)">j</a><a href="#h">h</a><img src="/etc/passwd" alt="p">'
             '<img src="data:image/png;base64,AAAA"><iframe src="http://x/">f</iframe>'
             "<svg><script>alert(3)</script></svg>&lt;b&gt;</p></div>")  # fmt: skip
    assert clean_html(dirty) == (
        '<div id="cell-id=a1"><a class="cell-link" href="#cell-id=a1">cell a1</a><p><a>j</a>'
        '<a href="#h">h</a>[image not embedded: p]<img src="data:image/png;base64,AAAA">'
        "&lt;b&gt;</p></div>"
    )


def test_the_bundle_in_a_browser_from_disk_and_from_a_server(hostile_bundle) -> None:
    need_browser()
    root, _, hits = hostile_bundle
    t0 = time.perf_counter()
    assert browser_problems(root) == []
    with static_server(root) as url:
        assert browser_problems(root, base_url=url) == []
    assert not hits, "a page fetched the hostile text's local address"
    print(f"browser checks of {len(list(root.rglob('*.html')))} pages, twice: "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip


def _broken(root: Path, tmp_path: Path, name: str, snippet: str, csp: bool = True) -> Path:
    copy = tmp_path / name
    shutil.copytree(root, copy)
    index = copy / "index.html"
    text = index.read_text(encoding="utf-8")
    if not csp:
        text = "\n".join(
            line for line in text.splitlines() if "Content-Security-Policy" not in line
        )
    index.write_text(text.replace("</h1>", "</h1>" + snippet, 1), encoding="utf-8")
    return copy


def test_the_checker_reports_a_live_script_and_an_outside_image(hostile_bundle, tmp_path) -> None:
    """A deliberately broken page fails the check: a script (blocked by the bundle's policy, or
    running where the policy is gone), an image from outside, a link to a missing anchor."""
    need_browser()
    root, _, _ = hostile_bundle
    pages = ["index.html"]
    live = browser_problems(_broken(root, tmp_path, "a", "<script>alert(1)</script>", csp=False),
                            pages)  # fmt: skip
    assert any("a dialog fired (alert: '1')" in p for p in live), live
    assert any("script element" in p for p in live), live
    blocked = browser_problems(_broken(root, tmp_path, "b", "<script>alert(1)</script>"), pages)
    assert any("script element" in p for p in blocked), blocked
    assert any("console error" in p and "Content Security Policy" in p for p in blocked), blocked
    img = '<img src="http://example.com/x.png">'
    out = browser_problems(_broken(root, tmp_path, "c", img, csp=False), pages)
    assert any("request leaves the bundle: http://example.com/x.png" in p for p in out), out
    assert any("image does not load" in p for p in out), out
    out = browser_problems(_broken(root, tmp_path, "d", img), pages)
    assert any("image does not load" in p for p in out), out
    anchor = '<a href="sources.html#nowhere">x</a><a href="gone.html">y</a>'
    out = browser_problems(_broken(root, tmp_path, "e", anchor), pages)
    assert any("anchor #nowhere not on sources.html" in p for p in out), out
    assert any("link to a missing file: gone.html" in p for p in out), out


def test_the_pdf_of_the_hostile_run_reads_whole(hostile_bundle) -> None:
    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext not found (Debian: apt-get install poppler-utils, as .ci/run does)")
    root, _, _ = hostile_bundle
    assert pdf_problems(root / "paper/rlxf_report.pdf") == []


def test_the_pdf_check_reports_a_table_past_the_margin_and_a_missing_number(tmp_path) -> None:
    """A deliberately broken PDF fails the check: a table of long unbreakable cells runs off the
    page, and the text refers to a Table 7 that has no caption."""
    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext not found (Debian: apt-get install poppler-utils, as .ci/run does)")
    import typst

    from rlxf_utils.report.render import REPORT_SRC

    build = tmp_path / "build"
    shutil.copytree(REPORT_SRC, build)
    wide = "| " + " | ".join(f"c{i}" for i in range(5)) + " |\n|" + "---|" * 5 + "\n"
    wide += "| " + " | ".join(f"{i}" + "x" * 40 for i in range(5)) + " |\n"
    md = build / "wide.md"
    md.write_text(
        "# Wide {#sec-wide}\n\nAs @tbl-wide shows, and as Table 7 does not.\n\n"
        f"{wide}\n: A table wider than the page. {{#tbl-wide}}\n",
        encoding="utf-8",
    )
    typst.compile(str(pandoc_typst(md)), output=str(tmp_path / "wide.pdf"), root=str(build))
    problems = pdf_problems(tmp_path / "wide.pdf")
    assert any("runs past the right margin" in p for p in problems), problems
    assert any("Table 7 is referred to but has no caption" in p for p in problems), problems
    assert not any("Table 1 is referred" in p for p in problems), problems


def test_rlxf_publish_writes_the_bundle_and_refuses_what_it_cannot(
    hostile_bundle, tmp_path
) -> None:
    """`rlxf publish`: 0 and the bundle for a rendered run (replacing an earlier bundle); 2 for
    a folder that is no run, a run without its rendered paper, or an --out that holds other
    files (never deleted)."""
    from rlxf_utils.cli import main

    root = hostile_bundle[0].parent / "run"
    out = tmp_path / "site"
    assert main(["publish", "--run-dir", str(root), "--out", str(out)]) == 0
    assert main(["publish", "--run-dir", str(root), "--out", str(out)]) == 0  # replaced
    assert (out / "index.html").is_file() and (out / "notebooks").is_dir()
    assert main(["publish", "--run-dir", str(tmp_path / "nothing")]) == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["publish", "--run-dir", str(root), "--out", str(other)]) == 2
    assert (other / "keep.txt").read_text() == "mine"
    (root / "report/rlxf_report.html").unlink()
    assert main(["publish", "--run-dir", str(root), "--out", str(tmp_path / "x")]) == 2
