"""The accessibility tree as OSWorld's prompt agent shows it to a model: which nodes it keeps,
the tab-separated table it linearizes them into, the cut at a size budget, and the
set-of-marks screenshot (numbered boxes drawn from the kept nodes' boxes). Our own code
after the rules of OSWorld's ``mm_agents`` (agent.py, accessibility_tree_wrap/
heuristic_retrieve.py); tests/unit/test_osworld_agent.py checks them on hand-made trees.

The input is the desktop server's tree (``DesktopProbe.accessibility_tree``: OSWorld's Linux
XML, its attributes in the ``accessibility.ubuntu.example.org`` namespaces)."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from cua_rollout.core.errors import DesktopError

__all__ = ["HEADER", "MARKS_HEADER", "Mark", "draw_marks", "kept_nodes", "linearize",
           "parse_tree", "trim"]

_STATE = "{https://accessibility.ubuntu.example.org/ns/state}"
_COMPONENT = "{https://accessibility.ubuntu.example.org/ns/component}"
_VALUE = "{https://accessibility.ubuntu.example.org/ns/value}"
# OSWorld reads a node's class and description from the *Windows* attributes namespace on
# every platform (its attributes_ns_ubuntu names the windows URI), so on a Linux tree those
# two columns are always empty. Models evaluated with OSWorld saw them empty: so do ours.
_CLASS_AND_DESCRIPTION = "{https://accessibility.windows.example.org/ns/attributes}"
_WINDOWS_CLASS = "{https://accessibility.windows.example.org/ns/class}"

HEADER = ("tag\tname\ttext\tclass\tdescription\tposition (top-left x&y)\tsize (w&h)")
MARKS_HEADER = "index\ttag\tname\ttext"
# What a cut tree ends with (OSWorld's marker).
TRIMMED = "[...]\n"

# Roles kept by the end of their tag, and whole tags kept (OSWorld's list; the Windows
# control types in it never occur in a Linux tree but cost nothing).
_KEPT_SUFFIXES = ("item", "button", "heading", "label", "scrollbar", "searchbox", "textbox",
                  "link", "tabelement", "textfield", "textarea", "menu")
_KEPT_TAGS = frozenset({
    "alert", "canvas", "check-box", "combo-box", "entry", "icon", "image", "paragraph",
    "scroll-bar", "section", "slider", "static", "table-cell", "terminal", "text",
    "netuiribbontab", "start", "trayclockwclass", "traydummysearchcontrol", "uiimage",
    "uiproperty", "uiribboncommandbar"})
_INTERACTIVE_STATES = ("enabled", "editable", "expandable", "checkable")
_PAIR = re.compile(r"^\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)$")


def parse_tree(xml: str) -> ET.Element:
    """The tree's root (an empty tree, as a desktop without AT-SPI gives: no nodes);
    ``DesktopError`` naming the problem when it is not XML: the desktop answered something
    that is not its tree, so the episode is an infra error retried on another desktop."""
    if not xml.strip():
        return ET.Element("desktop-frame")
    try:
        return ET.fromstring(xml)
    except ET.ParseError as exc:
        raise DesktopError(f"the desktop's accessibility tree is not XML: {exc}") from None


def _pair(node: ET.Element, attribute: str) -> tuple[int, int]:
    found = _PAIR.match(node.get(_COMPONENT + attribute, "").strip())
    return (int(found[1]), int(found[2])) if found else (-1, -1)


def _kept(node: ET.Element, with_images: bool) -> bool:
    tag = node.tag
    if not (tag.startswith("document") or tag.endswith(_KEPT_SUFFIXES) or tag in _KEPT_TAGS):
        return False
    if not (node.get(_STATE + "showing") == "true" and node.get(_STATE + "visible") == "true"):
        return False
    if not any(node.get(_STATE + s) == "true" for s in _INTERACTIVE_STATES):
        return False
    if not (node.get("name", "") != "" or node.text
            or (with_images and node.get("image") == "true")):
        return False
    (x, y), (w, h) = _pair(node, "screencoord"), _pair(node, "size")
    return x >= 0 and y >= 0 and w > 0 and h > 0


def kept_nodes(root: ET.Element, *, with_images: bool = False) -> list[ET.Element]:
    """The nodes a model is shown, in document order: a role OSWorld lists, showing and
    visible, enabled / editable / expandable / checkable, named or with text (or, for the
    marks, an image), on screen with a size."""
    return [node for node in root.iter() if _kept(node, with_images)]


def _quoted(text: str) -> str:
    # A field holding a double quote is quoted, its quotes doubled (as CSV does).
    return f'"{text.replace(chr(34), chr(34) * 2)}"' if '"' in text else text


def _text(node: ET.Element) -> str:
    if node.text:
        return _quoted(node.text)
    value = node.get(_VALUE + "value")
    if node.get(_WINDOWS_CLASS + "class", "").endswith("EditWrapper") and value:
        return _quoted(value)
    return '""'


def linearize(xml: str) -> str:
    """The tree as OSWorld's table: a header, then per kept node its tag, name, text, class,
    description, top-left position and size, tab-separated."""
    rows = [HEADER]
    for node in kept_nodes(parse_tree(xml)):
        rows.append("\t".join((
            node.tag, node.get("name", ""), _text(node),
            node.get(_CLASS_AND_DESCRIPTION + "class", ""),
            node.get(_CLASS_AND_DESCRIPTION + "description", ""),
            node.get(_COMPONENT + "screencoord", ""), node.get(_COMPONENT + "size", ""))))
    return "\n".join(rows)


def trim(table: str, max_chars: int) -> str:
    """``table`` cut to ``max_chars`` characters, marked as cut. (OSWorld cuts at 10,000
    GPT-4 tokens with tiktoken, whose vocabulary is downloaded at run time; a character
    budget needs nothing and is near 4 characters a token for these tables.)"""
    return table if len(table) <= max_chars else table[:max_chars] + TRIMMED


@dataclass(frozen=True)
class Mark:
    """One numbered box of the set-of-marks screenshot (screen pixels)."""

    index: int
    x: int
    y: int
    width: int
    height: int

    @property
    def center(self) -> tuple[int, int]:
        """Where ``tag_<index>`` points (OSWorld: the box's top-left plus half its size)."""
        return self.x + self.width // 2, self.y + self.height // 2


def draw_marks(png: bytes, xml: str, *, font_px: int = 15
               ) -> tuple[bytes, list[Mark], str]:
    """The set-of-marks observation: the screenshot with a red box and a white-on-black
    number under the top-left of every kept node (images included) whose box is not one
    flat colour, the marks, and their table (index, tag, name, text)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_px)
    marks: list[Mark] = []
    rows = [MARKS_HEADER]
    for node in kept_nodes(parse_tree(xml), with_images=True):
        (x, y), (w, h) = _pair(node, "screencoord"), _pair(node, "size")
        box = (x, y, x + w, y + h)
        colours = image.crop(box).getcolors(maxcolors=1)
        if colours is not None:  # one flat colour: nothing to point at
            continue
        index = len(marks) + 1
        draw.rectangle(box, outline="red", width=1)
        label = draw.textbbox((x, y + h), str(index), font=font, anchor="lb")
        draw.rectangle(label, fill="black")
        draw.text((x, y + h), str(index), font=font, anchor="lb", fill="white")
        marks.append(Mark(index, x, y, w, h))
        rows.append(f"{index}\t{node.tag}\t{node.get('name', '')}\t{_text(node)}")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), marks, "\n".join(rows)
