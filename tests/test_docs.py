"""The README is a front door and docs/ the reference: every relative link resolves (anchors
included), nothing points outside the repository, the CRD reference is what `make crds` writes, and
the InferenceService examples in the pages are valid specs."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH_PAGES = [ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "bench" / "history").glob("*.md"))]  # the current numbers, the journal
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks and spans hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES + BENCH_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http(s):, mailto: — not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not bad, bad


def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.startswith("docs/")}
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", "") and path.is_file():
            text = path.read_text(errors="replace")
            hits += [f"{name}: {m.group(0)}" for m in re.finditer(r"\.\./shared\b|\bshared/DESIGN\.md", text)]
    assert not hits, hits


def test_crd_reference_is_fresh_and_names_every_field():
    from kvpilot.operator.crd_gen import REFERENCE, crd, render_reference

    assert REFERENCE.read_text() == render_reference(), "docs/crd-reference.md is stale: run make crds"
    text = REFERENCE.read_text()

    def fields(schema: dict, path: str):
        for name, sub in schema.get("properties", {}).items():
            yield f"{path}.{name}"
            nested = sub.get("items", sub) if sub.get("type") == "array" else sub
            yield from fields(nested, f"{path}.{name}" + ("[]" if sub.get("type") == "array" else ""))

    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    missing = [f for part in ("spec", "status") for f in fields(root[part], part) if f"`{f}`" not in text]
    assert not missing, missing


def test_inference_service_examples_in_the_pages_are_valid():
    from kvpilot.operator.crd_types import InferenceServiceSpec

    found = 0
    for page in PAGES:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S):
            doc = yaml.safe_load(block)
            if isinstance(doc, dict) and doc.get("kind") == "InferenceService":
                InferenceServiceSpec.model_validate(doc["spec"])
                found += 1
    assert found >= 1


def test_coming_from_vllm_is_fresh_and_names_every_vllm_flag():
    from kvpilot.server.vllm_compat import PAGE, render_page, vllm_flags

    assert PAGE.read_text() == render_page(), "docs/coming-from-vllm.md is stale: run python -m kvpilot.server.vllm_compat"
    text = PAGE.read_text()
    _, flags = vllm_flags()
    assert len(flags) > 400 and all(f"| `{flag}` |" in text for flag in flags)
    assert "| `--trust-remote-code` | not supported" in text and "| `--dtype` | `--dtype`: half = float16" in text
    assert "| `--kv-cache-memory-bytes` | `--kv-cache-memory-bytes` = `--kv-cache-memory`" in text


# A figure the README quotes: a number (not part of a name such as SmolLM2-135M), with its unit when one follows.
FIGURE = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?:\s?(×|%|ms|s|MiB|GiB|MB|GB/s|GB|tok/s))?(?![\w.])")


def results_sections(results: str) -> dict[str, str]:
    """bench/RESULTS.md's sections by their GitHub anchor."""
    sections, anchor = {}, None
    for line in results.splitlines():
        if line.startswith("## "):
            anchor = slug(line.lstrip("#"))
            sections[anchor] = ""
        elif anchor is not None:
            sections[anchor] += line + "\n"
    return sections


def stale_figures(readme: str, results: str) -> list[str]:
    """The figures in the bullets of the README's Figures section that no run it links to recorded: each
    figure (the same number, with its unit when it has one) must be in one of the bench/RESULTS.md
    sections its bullet links; a bullet with figures and no such link is stale as a whole. (Which figure goes
    with which condition is the reader's to check: two swapped figures of one run still pass.)"""
    section = readme.split("\n## Figures\n", 1)[1].split("\n## ", 1)[0]
    sections = results_sections(results)
    stale = []
    for bullet in re.findall(r"^- .*(?:\n  .*)*", section, flags=re.M):  # a bullet: its line and the indented ones after it
        runs = [sections.get(t.partition("#")[2], "") for t in LINK.findall(bullet) if t.startswith("bench/RESULTS.md#")]
        text = re.sub(r"\[[^\]]*\]\([^)]*\)|`[^`]*`", "", bullet)  # the figures, not the links' or code's characters
        for m in FIGURE.finditer(text):
            number, unit = m.group(1), m.group(2)
            pattern = rf"(?<![\d.]){re.escape(number)}" + (rf"\s?{re.escape(unit)}" if unit else r"(?!\d|\.\d)")
            if not any(re.search(pattern, run) for run in runs):
                stale.append(m.group(0))
    return stale


def test_every_figure_the_readme_quotes_is_in_a_run_it_links():
    readme, results = (ROOT / "README.md").read_text(), (ROOT / "bench" / "RESULTS.md").read_text()
    assert readme.count("](bench/RESULTS.md#") >= 5
    assert not stale_figures(readme, results)
    assert len(stale_figures(readme, "")) >= 12  # what it checks: every figure of those bullets, against no results all stale
    # a planted figure no linked run recorded is caught beside the real ones, and so is a bullet that links no run
    planted = readme.replace("\n## Figures\n", "\n## Figures\n\n- planted: 9.87× and 4321 ms ([run](bench/RESULTS.md#engine-against-its-peers-on-cpu));"
                                               "\n- unlinked: 1.79×\n", 1)
    assert stale_figures(planted, results) == ["9.87×", "4321 ms", "1.79×"]
