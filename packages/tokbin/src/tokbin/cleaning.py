"""Optional cleaning before encoding (``--clean``): HTML tags, bracketed citation marks, whitespace runs."""

from __future__ import annotations

import re

# a tag is '<', a letter or '/', then no '<', '>' or newline: keeps comparisons like "a < b > c" intact
_HTML_TAG = re.compile(r"</?[A-Za-z][^<>\n]{0,500}>")
# Wikipedia-style marks: [1], [12, 13], [3-5], [citation needed], [note 2]
_CITATION = re.compile(r"\[(?:\d+(?:\s*[,\u2013-]\s*\d+)*|citation needed|note \d+|clarification needed)\]")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_AT_EOL = re.compile(r" +\n")
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Strip HTML tags and citation marks, squeeze runs of spaces/tabs and of blank lines (paragraphs survive).

    Meant for prose (web or Wikipedia text), not code: ``x[0]`` reads as a citation mark and is removed.

    Example:
        >>> clean_text("<b>Paris</b>[1]  is\\n\\n\\n\\nbig")
        'Paris is\\n\\nbig'
    """
    text = _HTML_TAG.sub("", text)
    text = _CITATION.sub("", text)
    text = _SPACES.sub(" ", text)
    text = _SPACE_AT_EOL.sub("\n", text)
    return _BLANK_RUNS.sub("\n\n", text)
