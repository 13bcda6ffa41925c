"""Text from the data or a model is text in the published report: hostile statuses, descriptions
and generated responses go through the report's own table and quotation path (`markdown_table`,
`literal`, the include shortcodes, pandoc with the report's reader) and come out as text, with no
live element or attribute, no embedded local file and no fetch."""

from __future__ import annotations

import base64
import shutil
import socket
import threading
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.artifacts import RunDir
from rlxf_utils.markdown import literal, markdown_table
from rlxf_utils.report.data import area_range_sentence
from rlxf_utils.report.render import (
    REPORT_SRC,
    expand_shortcodes,
    for_reader,
    pandoc_html,
    pandoc_typst,
)
from rlxf_utils.report.risk import ngrams_text
from rlxf_utils.report.wording import short_text

SECRET = "rlxf-secret-4f1c9e"


def _hostile(secret: Path, port: int) -> list[str]:
    url = f"http://127.0.0.1:{port}/"
    return [
        "<script>alert(1)</script>",
        '<img src=x onerror="alert(2)">',
        '<b onmouseover="alert(3)">hover</b>',
        "[click](javascript:alert(4))",
        f'<img src="{secret}">',
        f"![x]({secret})",
        f'<iframe src="{url}"></iframe>',
        f"<{url}auto>",
        f"{{{{< include {secret} >}}}}",
        "`<script>alert(5)</script>`{=html}",
        "&lt;script&gt; @smith2020 $x^2$ *em* _u_ ~s~ ^p^ [span]{.c} \\",
    ]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))


@pytest.fixture
def listener():
    """A local address that records whether anything connects to it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    hits: list[int] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            hits.append(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], hits
    done.set()
    t.join()
    srv.close()


def _report_markdown(tmp_path: Path, bad: list[str]) -> Path:
    """The report's path for tables and quotations: a run writes the tables (`write_table`), the
    report copies them through `for_reader` into `_generated/` and expands the includes."""
    run = RunDir(tmp_path / "run")
    n = len(bad)
    run.write_table("status_mapping", pd.DataFrame({
        "status_raw": bad, "status": bad, "meaning": ["UNKNOWN CODE"] * n,
        "label": ["Non-MET"] * n, "count": range(n)}))  # fmt: skip
    run.write_table("table2_sample", pd.DataFrame({"Country": bad, "Description": bad}))
    samples = markdown_table(pd.DataFrame({
        "prompt": [short_text(b, 70) for b in bad], "policy": ["ppo"] * n,
        "response": [short_text(b) for b in bad], "reward": [0.5] * n}))  # fmt: skip
    areas = pd.DataFrame(
        {"econ_descriptor": [bad[0], bad[4]], "met_rate": [0.2, 0.8], "n": [50, 60]}
    )
    finding = ngrams_text({"ppo": bad})
    build = tmp_path / "build"
    shutil.copytree(REPORT_SRC, build)
    gen = build / "_generated"
    gen.mkdir()
    for name in ("status_mapping", "table2_sample"):
        (gen / f"{name}.md").write_text(for_reader((run.root / f"tables/{name}.md").read_text()))
    (gen / "samples.md").write_text(for_reader(samples))
    prose = area_range_sentence(areas, 10) + "\n\n" + finding.lead + "\n\n"
    prose += "".join(f"- {item}\n" for item in finding.items)
    (gen / "prose.md").write_text(for_reader(prose))
    qmd = "# Data {#sec-data}\n\n" + "".join(
        f"{{{{< include _generated/{name}.md >}}}}\n\n: {name}. {{#tbl-{name}}}\n\n"
        for name in ("status_mapping", "table2_sample", "samples")
    )
    qmd += "{{< include _generated/prose.md >}}\n"
    md = build / "rlxf_report.md"
    md.write_text(expand_shortcodes(qmd, {}, build), encoding="utf-8")
    return md


def test_hostile_text_is_text_in_the_html_and_the_typst_source(tmp_path: Path, listener) -> None:
    port, hits = listener
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    md = _report_markdown(tmp_path, _hostile(secret, port))
    html = pandoc_html(md, tmp_path / "out.html").read_text(encoding="utf-8")
    parser = _Tags()
    parser.feed(html)
    live = [(t, a) for t, a in parser.tags if t in ("script", "img", "iframe", "object", "embed")]
    events = [(t, k) for t, a in parser.tags for k, _ in a if k.startswith("on")]
    links = [v for _, a in parser.tags for k, v in a if k in ("href", "src") and v
             and (v.startswith(("javascript:", "http://127.0.0.1", "data:")) or SECRET in v)]  # fmt: skip
    assert not live and not events and not links, (live, events, links)
    assert SECRET not in html and base64.b64encode(SECRET.encode()).decode()[:12] not in html
    assert "data:" not in html  # nothing embedded (the test places no figure)
    assert not hits, "pandoc fetched a URL from the text"
    # ... and the text is there, as written
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "[click](javascript:alert(4))" in html and "{{&lt; include" in html
    assert "@smith2020" in html and "$x^2$" in html and "*em* _u_" in html
    typ = pandoc_typst(md)
    source = typ.read_text(encoding="utf-8")
    assert SECRET not in source and "#image(" not in source and "secret.txt" in source
    import pypdf
    import typst

    typst.compile(str(typ), output=str(tmp_path / "out.pdf"), root=str(md.parent))
    text = " ".join(p.extract_text() for p in pypdf.PdfReader(tmp_path / "out.pdf").pages)
    assert "<script>alert(1)</script>" in text and SECRET not in text


def test_literal_leaves_ids_and_plain_words_alone() -> None:
    assert (
        literal("sft_met under ppo, 2024-05-14 (n = 3)") == "sft_met under ppo, 2024-05-14 (n = 3)"
    )
    assert literal("a <b> & `c`\n_d_ [e](f)") == r"a \<b\> \& \`c\` \_d\_ \[e\](f)"
    assert markdown_table(pd.DataFrame({"x|y": ["<i>"]})).splitlines()[::2] == [
        r"| x\|y |",
        r"| \<i\> |",
    ]


def test_an_include_inside_an_included_file_resolves_from_the_main_folder(tmp_path: Path) -> None:
    """As in Quarto, a nested include's path is read from the main file's folder, so a section's
    optional table (`_generated/<name>_table.md`) can include its table by the same path."""
    gen = tmp_path / "_generated"
    gen.mkdir()
    (gen / "t.md").write_text("| a |\n|---|\n| 1 |\n", encoding="utf-8")
    (gen / "t_table.md").write_text("{{< include _generated/t.md >}}\n\n: cap {#tbl-t}\n")
    out = expand_shortcodes("{{< include _generated/t_table.md >}}\n", {}, tmp_path)
    assert out == "| a |\n|---|\n| 1 |\n\n\n: cap {#tbl-t}\n\n"


def test_a_table_a_stage_had_nothing_for_publishes_as_an_empty_page(tmp_path) -> None:
    """Issue 80: a run of `rl.algorithm: [ppo, grpo, rft]` wrote `tables/ilhf_training.csv` as a
    single newline and `rlxf publish` stopped with pandas' EmptyDataError. The ILHF table now
    keeps its header without ILHF, and a table written with nothing at all still publishes."""
    import pandas as pd

    from rlxf_utils.report.publish import table_page
    from rlxf_utils.rl.tables import ILHF_TRAINING_COLUMNS, training_table

    logs = pd.DataFrame({"algo": ["ppo", "grpo"], "step": [1, 1]})
    assert list(training_table(logs).columns) == list(ILHF_TRAINING_COLUMNS)
    assert training_table(logs).empty
    bare = tmp_path / "ilhf_training.csv"
    bare.write_text("\n", encoding="utf-8")
    page = table_page(bare)
    assert "<p>0 rows.</p>" in page and "ilhf_training" in page
    header = tmp_path / "header.csv"
    training_table(logs).to_csv(header, index=False)
    assert "<th>pairs_per_step</th>" in table_page(header) and "<p>0 rows.</p>" in table_page(
        header
    )
