"""The README is the front door and docs/ the reference: every relative link and image in them resolves.

A link's file must exist inside the repository, and its `#anchor` must name a heading of the target, slugged as
GitHub does (lowercase; punctuation but `-` and `_` dropped; spaces to `-`; a repeated heading gets `-1`, `-2`).
Links with a scheme (`https:`, `mailto:`) are not the repository's and are left alone; code is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fence = [], None
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * 3
        elif fence is not None and line.lstrip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "``", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = None
    for line in path.read_text().splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * 3
            continue
        if fence is not None:
            fence = None if line.lstrip().startswith(fence) else fence
            continue
        if match := HEADING.match(line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """Each relative link of `path` that leaves the repository, names no file, or names no heading there."""
    problems = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if SCHEME.match(target):
                continue
            where = f"{path.relative_to(ROOT)}: ({target})"
            name, _, anchor = target.partition("#")
            file = (path.parent / name).resolve() if name else path
            if not file.is_relative_to(ROOT):
                problems.append(f"{where} leaves the repository")
            elif not file.exists():
                problems.append(f"{where} names no file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{where} names no heading of {file.relative_to(ROOT)}")
    return problems


def test_every_relative_link_resolves():
    problems = [problem for path in documents() for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_the_readme_stays_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; reference belongs in docs/"


def test_the_check_sees_a_broken_link(tmp_path, monkeypatch):
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Safe retries: `Idempotency-Key`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#safe-retries-idempotency-key) [ok](docs/a.md#twice-1) [ok](#top) `[code](nowhere.md)`\n"
        "# Top\n[bad](docs/a.md#missing) [bad](docs/b.md) [bad](../outside.md) ![bad](docs/a.png) [web](https://x.y)\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "README.md: (docs/a.md#missing) names no heading of docs/a.md",
        "README.md: (docs/b.md) names no file",
        "README.md: (../outside.md) leaves the repository",
        "README.md: (docs/a.png) names no file",
    ]
