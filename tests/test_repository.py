"""The repository stands alone: no file refers to a path outside it, every "spec §n" names a
section of docs/spec.md, and every relative link of the Markdown files resolves."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        names = out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:  # an unpacked sdist: no git metadata of its own
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part == "build" for part in p.relative_to(ROOT).parts)]
    files = {}
    for name in names:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".safetensors", ".png", ".pt", ".so"):
            continue
        try:
            files[name] = path.read_text()
        except UnicodeDecodeError:
            continue
    assert len(files) > 50
    return files


FILES = tracked_text_files()
# Places outside the repository the project must not depend on or mention.
OUTSIDE = re.compile(r"\.\./(shared|golden|design)\b|(?<![\w.])/work/(main|shared|\.library)\b"
                     r"|design/SPEC|ARCHITECTURE\.md|GOODPUT\.md")


@pytest.mark.parametrize("name", sorted(FILES))
def test_no_reference_to_paths_outside_the_repository(name):
    if name == "tests/test_repository.py":
        return  # the patterns themselves
    hits = [m.group(0) for m in OUTSIDE.finditer(FILES[name])]
    assert not hits, f"{name} refers outside the repository: {hits}"


def test_every_spec_section_reference_resolves():
    spec = (ROOT / "docs" / "spec.md").read_text()
    sections = set(re.findall(r"^## §(\d+)", spec, re.M))
    assert sections == {str(i) for i in range(1, 10)}
    cited = set()
    for name, text in FILES.items():
        if name == "tests/test_repository.py":
            continue  # the patterns themselves
        assert "SPEC §" not in text, f"{name}: cite docs/spec.md as 'spec §n'"
        for n in re.findall(r"spec §(\d+)", text):
            assert n in sections, f"{name} cites spec §{n}, which docs/spec.md does not have"
            cited.add(n)
    assert len(cited) >= 7


def test_markdown_links_resolve():
    for name, text in FILES.items():
        if not name.endswith(".md"):
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            assert (ROOT / name).parent.joinpath(target).resolve().exists(), f"{name}: broken link {target}"
