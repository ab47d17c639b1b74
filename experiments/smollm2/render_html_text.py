#!/usr/bin/env python3
"""Concatenates HTML pages as plain text (paragraphs on their own lines, no markup, scripts,
navigation or footers). Standard library only.

Usage: render_html_text.py PAGE.html... > OUT.txt"""
import html.parser
import re
import sys

SKIP = {"script", "style", "head", "nav"}
BLOCK = {"p", "div", "li", "h1", "h2", "h3", "h4", "h5", "pre", "tr", "dt", "dd", "br", "table", "blockquote"}


class Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.classes = [], 0, []

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        # Navigation bars and the docbook footer are not part of the book's text.
        hidden = tag in SKIP or any(c in cls.split() for c in ("navheader", "navfooter", "docnav", "toc"))
        self.classes.append(hidden)
        self.skip += hidden
        if tag in BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if self.classes:
            self.skip -= self.classes.pop()
        if tag in BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data)


pages = []
for path in sys.argv[1:]:
    parser = Text()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    text = "".join(parser.out)
    text = re.sub(r"[ \t\r\f\v]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    pages.append(re.sub(r"\n{3,}", "\n\n", text).strip())
sys.stdout.write("\n\n".join(pages) + "\n")
