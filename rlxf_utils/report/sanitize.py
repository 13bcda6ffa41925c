"""Notebook pages made safe to publish: `clean_html` keeps a whitelist of elements and
attributes and escapes all text, so data and model text in an executed notebook stay text in the
review bundle (`report.publish`)."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

__all__ = ["clean_html"]


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_ALLOWED = _words("a abbr b blockquote br caption code col colgroup dd del details div dl dt "
    "em figcaption figure h1 h2 h3 h4 h5 h6 hr i img ins kbd li ol p pre q s samp section small "
    "span strong sub summary sup table tbody td tfoot th thead tr tt u ul var")  # fmt: skip
#: Elements dropped with everything inside them (their text would be code or a frame's content).
_DROPPED = _words("script style iframe frame frameset object embed applet template noscript "
    "svg math textarea select option form button input link meta base title head audio video "
    "source track canvas dialog portal xml")  # fmt: skip
_VOID = frozenset(("br", "col", "hr", "img"))
_ATTRS = frozenset(("class", "id", "title", "alt", "colspan", "rowspan", "scope", "lang", "dir",
                    "width", "height"))  # fmt: skip
_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*\Z")


class _Cleaner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.dropping: list[str] = []  # the open dropped elements

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, close=False)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs, close=True)

    def _start(self, tag: str, attrs: list[tuple[str, str | None]], close: bool) -> None:
        if self.dropping:
            if tag == self.dropping[-1] and not close and tag not in _VOID:
                self.dropping.append(tag)
            return
        if tag in _DROPPED:
            if not close and tag not in ("link", "meta", "base", "input", "source", "track"):
                self.dropping.append(tag)
            return
        if tag not in _ALLOWED:
            return
        kept = [(k, v) for k, v in attrs if k in _ATTRS and v is not None]
        if tag == "a":
            href = dict(attrs).get("href") or ""
            if href.startswith("#") and not re.search(r"[\s\"'<>]", href):
                kept.append(("href", href))
        if tag == "img":
            src = dict(attrs).get("src") or ""
            if not _IMAGE.match(src):
                alt = dict(attrs).get("alt") or ""
                self.out.append(html.escape(f"[image not embedded: {alt or src}]"))
                return
            kept.append(("src", src))
        text = "".join(f' {k}="{html.escape(v, quote=True)}"' for k, v in kept)
        self.out.append(f"<{tag}{text}>")
        if tag == "div":
            cell = dict(kept).get("id", "")
            if cell.startswith("cell-id="):
                self.out.append(
                    f'<a class="cell-link" href="#{html.escape(cell)}">'
                    f"cell {html.escape(cell[8:])}</a>"
                )

    def handle_endtag(self, tag: str) -> None:
        if self.dropping:
            if tag == self.dropping[-1]:
                self.dropping.pop()
            return
        if tag in _ALLOWED and tag not in _VOID:
            self.out.append(f"</{tag}>")

    def handle_data(self, data: str) -> None:
        if not self.dropping:
            self.out.append(html.escape(data, quote=False))

    def handle_comment(self, data: str) -> None:  # comments are dropped
        return


def clean_html(fragment: str) -> str:
    """`fragment` with only the `_ALLOWED` elements and attributes: text escaped, no script,
    style, frame or form (nor their content), no event or style attribute, links only to an
    anchor on the page, images only embedded (`data:image/...`); anything else stays as text."""
    cleaner = _Cleaner()
    cleaner.feed(fragment)
    cleaner.close()
    return "".join(cleaner.out)
