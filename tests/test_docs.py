"""The documentation's shape: a short README, and links between README.md and docs/*.md that resolve.

Every relative link (``[text](path)``, ``![alt](path)``, ``[text](path#anchor)``, ``[text](#anchor)``, and a bare
``path.md#anchor`` in the text) must name an existing file, and an anchor into a markdown file one of its headings,
slugged as GitHub does (lowercase; punctuation other than ``-`` and ``_`` dropped; spaces to ``-``; a repeated
heading gets ``-1``, ``-2``, ...). Links inside code are not links. README lists the guides under "Guides"; each is
a page in docs/, and every page in docs/ is listed.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250
# The topics the guides cover: each must be a page of docs/ that README lists.
GUIDES = ("training", "sampling", "evaluation", "published-models", "elsewhere", "improved-ddpm", "cpu", "gpus",
          "development", "architecture")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
BARE = re.compile(r"(?<![\w/.#-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)*\.md#[\w-]+)")  # path.md#anchor in the text
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def markdown_files():
    return [README] + sorted(DOCS.glob("*.md"))


def prose(text):
    """``text`` without fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """The anchors of ``path``'s headings, repeated ones numbered as GitHub numbers them."""
    seen = {}
    result = set()
    for _, heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path):
    """(target, anchor) of every relative link of ``path``: target "" for an anchor into ``path`` itself."""
    text = prose(path.read_text(encoding="utf-8"))
    for target in LINK.findall(text) + BARE.findall(LINK.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        yield file_part, anchor


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for file_part, anchor in relative_links(path):
        target = (path.parent / file_part).resolve() if file_part else path
        if not target.exists():
            broken.append(f"{file_part}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file_part}#{anchor}: no such heading in {target.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_lists_the_guides_in_docs():
    text = prose(README.read_text(encoding="utf-8"))
    section = re.search(r"^## Guides\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Guides' section"
    listed = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(section.group(1))
              if target.startswith("docs/")}
    pages = {page.resolve() for page in DOCS.glob("*.md")}
    assert listed <= pages, f"listed but not in docs/: {sorted(str(p) for p in listed - pages)}"
    assert pages <= listed, f"in docs/ but not listed in README: {sorted(p.name for p in pages - listed)}"
    missing = [name for name in GUIDES if (DOCS / f"{name}.md").resolve() not in listed]
    assert not missing, f"guides missing from docs/ or from README's list: {missing}"


@pytest.mark.parametrize("heading, expected", [
    ("Speed against PyTorch", "speed-against-pytorch"),
    ("KID and precision/recall", "kid-and-precisionrecall"),
    ("The paper's CIFAR-10 FID", "the-papers-cifar-10-fid"),
    ("Measuring on a GPU: scripts/gpu_check.sh", "measuring-on-a-gpu-scriptsgpu_checksh"),
    ("GPUs: mixed precision, micro-batches", "gpus-mixed-precision-micro-batches"),
])
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected


# A commit hash (7 to 40 hex digits, with a letter and a digit, not part of a path or a longer word) or an issue number.
HISTORY = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])"
                     r"|\bissues? #?[0-9]+|(?<![\w&/])#[0-9]+\b", re.I)


@pytest.mark.parametrize("path", markdown_files() + [ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_code_not_of_its_history(path):
    """No commit hashes or issue numbers in the documentation (git keeps them); code blocks included."""
    found = [f"line {number}: {match.group()}" for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in HISTORY.finditer(line)]
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found)
