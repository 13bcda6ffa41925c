"""The review bundle as readers meet it: its pages in a real browser, its PDF read for layout.

`browser_problems(bundle)` opens every page of a bundle (`publish.publish_bundle`) in headless
Chromium, from disk (`file://`) or from a static server (`base_url`), and lists every problem a
reader or a publisher would meet: a dialog (a script ran), a request that leaves the bundle, an
image that does not load, a link or `#anchor` that lands nowhere, a script element, a console
error, a contents link of the paper that does not bring its section into view. An empty list is
a bundle that passes. Playwright (PyPI) drives the browser; it finds Debian's `chromium`.

`pdf_problems(pdf)` reads the PDF's words with their positions (`pdftotext -bbox-layout`, from
poppler-utils): a word past the page's right margin or over its neighbour on the line is a table
that does not fit, and every "Table N" or "Figure N" the text refers to must exist as a caption.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

__all__ = ["browser_executable", "browser_problems", "pdf_problems", "pdf_words"]

#: Where a browser may be: $RLXF_CHROMIUM, then Debian's and other distributions' names.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser_executable() -> str | None:
    """A Chromium to drive, or None: `$RLXF_CHROMIUM`, else the first of `BROWSERS` on PATH."""
    env = os.environ.get("RLXF_CHROMIUM")
    if env and Path(env).is_file():
        return env
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            if (k == "id" or (k == "name" and tag == "a")) and v is not None:
                self.ids.add(v)


def _ids_of(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        parser = _Ids()
        parser.feed(path.read_text(encoding="utf-8", errors="replace"))
        cache[path] = parser.ids
    return cache[path]


def _bundle_file(url: str, bundle: Path, base_url: str | None) -> Path | None:
    """The file inside `bundle` that `url` names, or None when it names nothing inside it."""
    url = urldefrag(url).url
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = Path(unquote(parts.path))
    elif base_url and url.startswith(base_url):
        path = bundle / unquote(urlsplit(url).path[len(urlsplit(base_url).path) :])
    else:
        return None
    try:
        path = path.resolve()
        path.relative_to(bundle.resolve())
    except (OSError, ValueError):
        return None
    if path.is_dir():
        path = path / "index.html"
    return path


def _allowed(url: str, bundle: Path, base_url: str | None) -> bool:
    if url.startswith(("data:", "about:blank")):
        return True
    return _bundle_file(url, bundle, base_url) is not None


_DOM = """() => ({
  scripts: document.querySelectorAll('script').length,
  images: Array.from(document.images).map(i => [i.getAttribute('src') || '', i.complete,
                                                i.naturalWidth]),
  links: Array.from(document.querySelectorAll('a[href], area[href]')).map(a =>
           [a.getAttribute('href'), a.href]),
  frames: document.querySelectorAll('iframe, frame, object, embed').length,
  events: Array.from(document.querySelectorAll('*')).flatMap(e =>
            Array.from(e.attributes).filter(a => a.name.startsWith('on')).map(a =>
              e.tagName + ' ' + a.name)).slice(0, 5),
})"""

_IN_VIEW = """id => { const e = document.getElementById(id); if (!e) return null;
  const r = e.getBoundingClientRect();
  return r.top >= -1 && r.top < window.innerHeight && window.scrollY > 0; }"""


def browser_problems(
    bundle: str | Path,
    pages: list[str] | None = None,
    base_url: str | None = None,
    executable: str | None = None,
    toc_page: str | None = "paper/rlxf_report.html",
) -> list[str]:
    """Every problem a browser meets on the pages of `bundle` (paths relative to it; default:
    every .html file in it), opened from disk or, with `base_url` (e.g. `http://127.0.0.1:8000/`
    serving the bundle), from a server. `toc_page`: the page whose contents links are clicked."""
    from playwright.sync_api import sync_playwright

    bundle = Path(bundle).resolve()
    pages = pages or sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*.html"))
    exe = executable or browser_executable()
    if exe is None:
        raise FileNotFoundError(
            "no Chromium found (install Debian's chromium or set RLXF_CHROMIUM)"
        )
    problems: list[str] = []
    ids: dict[Path, set[str]] = {}
    current = {"page": ""}

    def url_of(rel: str) -> str:
        return base_url + rel if base_url else (bundle / rel).as_uri()

    def on_route(route) -> None:
        url = route.request.url
        if _allowed(url, bundle, base_url):
            route.continue_()
        else:
            problems.append(f"{current['page']}: request leaves the bundle: {url}")
            route.abort()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            context = browser.new_context(service_workers="block")
            context.route("**/*", on_route)
            context.on("request", lambda r: None if _allowed(r.url, bundle, base_url)
                       else problems.append(f"{current['page']}: request: {r.url}"))  # fmt: skip
            page = context.new_page()

            def on_dialog(d) -> None:
                problems.append(f"{current['page']}: a dialog fired ({d.type}: {d.message!r})")
                d.dismiss()

            page.on("dialog", on_dialog)
            page.on("console", lambda m: problems.append(f"{current['page']}: console "
                    f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)  # fmt: skip
            page.on("pageerror", lambda e: problems.append(f"{current['page']}: error: {e}"))
            for rel in pages:
                current["page"] = rel
                page.goto(url_of(rel), wait_until="load")
                page.wait_for_timeout(50)  # a timer's script would have run
                dom = page.evaluate(_DOM)
                problems += _dom_problems(rel, dom, bundle, base_url, ids)
            if toc_page and toc_page in pages:
                current["page"] = toc_page
                problems += _toc_problems(page, url_of(toc_page), toc_page)
        finally:
            browser.close()
    return list(dict.fromkeys(problems))


def _dom_problems(rel: str, dom: dict, bundle: Path, base_url: str | None,
                  ids: dict[Path, set[str]]) -> list[str]:  # fmt: skip
    out = []
    if dom["scripts"]:
        out.append(f"{rel}: {dom['scripts']} script element(s)")
    if dom["frames"]:
        out.append(f"{rel}: {dom['frames']} frame or embedded object(s)")
    out += [f"{rel}: event attribute {e}" for e in dom["events"]]
    for src, complete, width in dom["images"]:
        if not complete or not width:
            out.append(f"{rel}: image does not load: {src[:80]}")
    for raw, absolute in dom["links"]:
        if raw is None:
            continue
        scheme = urlsplit(absolute).scheme
        if scheme in ("http", "https") and not (base_url and absolute.startswith(base_url)):
            continue  # a link out (a reference's DOI): nothing is fetched unless followed
        if scheme == "mailto":
            continue
        target = _bundle_file(absolute, bundle, base_url)
        if target is None:
            out.append(f"{rel}: link leaves the bundle or is not a link: {raw[:80]}")
            continue
        if not target.is_file():
            out.append(f"{rel}: link to a missing file: {raw[:80]}")
            continue
        frag = urldefrag(absolute).fragment  # as the browser does: the id as written, or decoded
        if (frag and target.suffix == ".html"
                and not {frag, unquote(frag)} & _ids_of(target, ids)):  # fmt: skip
            out.append(f"{rel}: anchor #{frag} not on {target.relative_to(bundle)}")
    return out


def _toc_problems(page, url: str, rel: str) -> list[str]:
    """Click the paper's contents links (the first, a middle one and the last): each must change
    the address to its section and scroll that section into view."""
    page.goto(url, wait_until="load")
    links = page.locator("#TOC a[href^='#'], nav[role='doc-toc'] a[href^='#']")
    n = links.count()
    if n == 0:
        return [f"{rel}: no contents links"]
    out = []
    for i in sorted({n - 1, n // 2, 1 if n > 1 else 0}):
        page.goto(url, wait_until="load")
        link = links.nth(i)
        target = (link.get_attribute("href") or "#")[1:]
        link.click()
        page.wait_for_timeout(100)
        target = unquote(target)
        if unquote(page.evaluate("location.hash"))[1:] != target:
            out.append(f"{rel}: contents link #{target} did not land")
        elif page.evaluate(_IN_VIEW, target) is not True and i > 0:
            out.append(f"{rel}: contents link #{target}: its section is not in view")
    return out


# ---------------------------------------------------------------------------------------------
# The PDF


def pdf_words(pdf: str | Path) -> list[dict]:
    """Every word of `pdf` with its page and box in points: dicts with page, width (the page's),
    x0, y0, x1, y1 and text (`pdftotext -bbox-layout`)."""
    exe = shutil.which("pdftotext")
    if exe is None:
        raise FileNotFoundError("pdftotext not found (Debian: apt-get install poppler-utils)")
    res = subprocess.run([exe, "-bbox-layout", str(pdf), "-"], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"pdftotext failed on {pdf}: {res.stderr[-500:]}")
    words: list[dict] = []
    page_re = re.compile(r'<page width="([\d.]+)" height="([\d.]+)">')
    word_re = re.compile(
        r'<word xMin="([\d.]+)" yMin="([\d.]+)" xMax="([\d.]+)" yMax="([\d.]+)">(.*?)</word>'
    )
    line_re = re.compile(r"<line\b")
    page_no, width, line_no = 0, 0.0, 0
    for raw in res.stdout.splitlines():
        if m := page_re.search(raw):
            page_no += 1
            width = float(m.group(1))
        elif line_re.search(raw):
            line_no += 1
        elif m := word_re.search(raw):
            x0, y0, x1, y1 = (float(m.group(i)) for i in range(1, 5))
            text = m.group(5).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
            words.append({"page": page_no, "width": width, "line": line_no, "x0": x0, "y0": y0,
                          "x1": x1, "y1": y1, "text": text})  # fmt: skip
    return words


#: How far a line's last punctuation may hang past the right margin, in points.
HANG = 4.0
_HANGING = frozenset(",.;:!?-\u00ad\u2010\u2013\u2014)]\u201d\u2019\"'")
_REF = re.compile(r"\b(Table|Figure)[\s\u00a0]+(\d+)\b")
_CAPTION = re.compile(r"^(Table|Figure)[\s\u00a0]+(\d+)[:.]")
#: A number of the original paper quoted in the text ("the paper's Table 3"), not a reference.
_QUOTED = re.compile(r"(paper|Atashbar|WP)['\u2019]s\s*$|\b(in|of) the paper\s*$")


def pdf_problems(pdf: str | Path, overlap: float = 0.5, margin: float = 1.0) -> list[str]:
    """Every layout and numbering problem a reader of `pdf` meets: a word that runs past the
    right edge of the text (the left margin mirrored, plus `margin` points) or into its neighbour
    on the line (boxes overlapping by more than `overlap` points), and a "Table N" or "Figure N"
    of the text that has no caption of that number."""
    words = pdf_words(pdf)
    if not words:
        return [f"{pdf}: no text"]
    out: list[str] = []
    lefts = sorted(w["x0"] for w in words)
    left = lefts[len(lefts) // 100]  # the text's left edge (a few outliers aside)
    for w in words:
        # Typst hangs a line's last comma, stop or hyphen into the margin (`text.overhang`)
        right = w["width"] - left + margin + (HANG if w["text"][-1] in _HANGING else 0.0)
        if w["x1"] > right:
            out.append(f"page {w['page']}: {w['text']!r} runs past the right margin "
                       f"({w['x1']:.1f} > {right:.1f} pt)")  # fmt: skip
    rows: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for w in words:
        rows[(w["page"], round((w["y0"] + w["y1"]) / 2))].append(w)
    for (pg, _), row in rows.items():
        row.sort(key=lambda w: w["x0"])
        for a, b in zip(row, row[1:], strict=False):
            if a["x1"] - b["x0"] > overlap and min(a["y1"], b["y1"]) - max(a["y0"], b["y0"]) > 1:
                out.append(f"page {pg}: {a['text']!r} runs into {b['text']!r}")
    out += _numbering_problems(words)
    return out


def _numbering_problems(words: list[dict]) -> list[str]:
    lines: dict[int, list[dict]] = defaultdict(list)
    for w in words:
        lines[w["line"]].append(w)
    text_lines = [
        (ws[0]["page"], " ".join(w["text"] for w in ws)) for _, ws in sorted(lines.items())
    ]
    captions = {(m.group(1), m.group(2)) for _, t in text_lines if (m := _CAPTION.match(t))}
    flat = "\n".join(t for _, t in text_lines)
    missing = []
    for m in _REF.finditer(flat):
        key = (m.group(1), m.group(2))
        before = flat[max(0, m.start() - 30) : m.start()].replace("\n", " ")
        if key not in captions and not _QUOTED.search(before):
            missing.append(f"{key[0]} {key[1]} is referred to but has no caption "
                           f"(…{before[-25:]}{m.group(0)})")  # fmt: skip
    if not captions:
        missing.append("no table or figure caption found")
    return list(dict.fromkeys(missing))
