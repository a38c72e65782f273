"""The documentation checks itself: every ```python block of README.md and docs/*.md runs (in a
fresh process, in an empty folder) or is marked as not runnable with the reason, every
command-line flag the docs mention exists in the parser of the command it is given to, and every
relative link resolves.

Mark a block that cannot run here (it needs a model, a dataset, a process group, a GPU) with an
HTML comment on the line right above its fence; GitHub does not show it:

    <!-- not run: needs a trained model and an optimizer -->
    ```python
    ...
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the pages a newcomer reads: their python blocks run and their flags exist
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: every page whose links are checked
LINKED = PAGES + sorted((ROOT / "benchmarks").glob("*.md")) + sorted(
    p for p in ROOT.glob("*/**/README.md") if ".venv" not in p.parts)
NOT_RUN = re.compile(r"^<!--\s*not run:\s*\S.*-->\s*$")
FENCE = re.compile(r"^\s*```\s*([\w+-]*)")  # indented too (a block in a list item)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def blocks(path: Path) -> list[tuple[str, int, str, str | None]]:
    """``(language, first line, text, not-run reason or None)`` of every fenced block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith("```"):
            j += 1
        above = lines[i - 1].strip() if i else ""
        reason = above.split("not run:", 1)[1].rstrip("->").strip() if NOT_RUN.match(above) \
            else None
        out.append((m.group(1).lower(), i + 1, textwrap.dedent("\n".join(lines[i + 1:j])),
                    reason))
        i = j + 1
    return out


PY_BLOCKS = [(p, line, text, reason) for p in PAGES
             for lang, line, text, reason in blocks(p) if lang == "python"]


@pytest.mark.parametrize("page,line,text,reason", PY_BLOCKS,
                         ids=[f"{_rel(b[0])}:{b[1]}" for b in PY_BLOCKS])
def test_python_block_compiles(page, line, text, reason):
    # a block marked not runnable is still Python: a typo in it is a typo users copy
    compile(text, f"{_rel(page)}:{line}", "exec")


RUNNABLE = [b for b in PY_BLOCKS if b[3] is None]


@pytest.mark.parametrize("page,line,text,reason", RUNNABLE,
                         ids=[f"{_rel(b[0])}:{b[1]}" for b in RUNNABLE])
def test_python_block_runs(page, line, text, reason, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (
        f"{_rel(page)}:{line}: this python block fails (make it run, small and hermetic, or "
        f"mark it with '<!-- not run: REASON -->' on the line above its fence):\n{r.stderr}")


# ---- flags ---------------------------------------------------------------------------------
class _Parser(Exception):
    """Carries the parser a command builds, caught before it parses anything."""


def _catch(monkeypatch, call) -> argparse.ArgumentParser:
    def grab(self, *a, **k):
        raise _Parser(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    try:
        call()
    except _Parser as e:
        return e.args[0]
    raise AssertionError(f"{call} built no parser")


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def parsers():
    """``{"balancer <command>": flags, "tools/<name>.py": flags}`` from the real parsers."""
    mp = pytest.MonkeyPatch()
    try:
        from balancer.cli import app
        top = _catch(mp, lambda: app.main(["--help"]))
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        out = {f"balancer {name}": _options(p) for name, p in sub.choices.items()}
        for f in sorted((ROOT / "tools").glob("*.py")):
            mod = importlib.import_module(f"tools.{f.stem}")
            entry = getattr(mod, "parse_args", None) or getattr(mod, "main", None)
            if entry is not None:
                out[f"tools/{f.name}"] = _options(_catch(mp, lambda: entry([])))
    finally:
        mp.undo()
    return out


#: flags of other programs the docs show (torchrun, accelerate, pip, pytest)
EXTERNAL = {"--standalone", "--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint",
            "--rdzv-backend", "--rdzv-id", "--master-addr", "--master-port", "--multi_gpu",
            "--num_processes", "--cpu", "--index-url", "--extra-index-url", "--no-deps",
            "--upgrade", "--help"}
FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")
COMMAND = re.compile(r"(?:-m balancer|^balancer|\sbalancer)\s+([a-z]+)|(tools/\w+\.py)")


def _commands(page: Path) -> list[tuple[int, str]]:
    """Shell commands of a page, continuation lines joined: fenced blocks that are not Python
    and inline code spans."""
    out = []
    for lang, line, text, _ in blocks(page):
        if lang in ("python", "json", "yaml"):
            continue
        joined, start = "", line + 1
        for k, row in enumerate(text.splitlines()):
            if not joined:
                start = line + 1 + k
            joined += " " + row.rstrip("\\").strip()
            if not row.rstrip().endswith("\\"):
                out.append((start, joined.strip()))
                joined = ""
    for n, span in _spans(page):
        out.append((n, " ".join(span.split())))
    return out


def _prose(page: Path) -> str:
    """The page with its fenced blocks blanked (line numbers kept)."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", lambda m: "\n" * m.group(0).count("\n"),
                  page.read_text(), flags=re.S | re.M)


def _spans(page: Path) -> list[tuple[int, str]]:
    """Inline code spans (they may wrap over lines) with their first line."""
    prose = _prose(page)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"`([^`]+)`", prose) if "\n\n" not in m.group(1)]


MENTIONS = [(p, n, cmd) for p in PAGES for n, cmd in _commands(p) if FLAG.search(cmd)]


def test_every_flag_exists(parsers):
    every = set().union(*parsers.values()) | EXTERNAL
    bad = []
    for page, n, cmd in MENTIONS:
        m = COMMAND.search(cmd)
        key = None if m is None else (f"balancer {m.group(1)}" if m.group(1) else m.group(2))
        # a comment after '#' in a command line is prose: check its flags against every parser
        code, _, comment = cmd.partition(" # ")
        if key in parsers:
            bad += [(page, n, f, key) for f in FLAG.findall(code)
                    if f not in parsers[key] and f not in EXTERNAL]
            bad += [(page, n, f, "any command") for f in FLAG.findall(comment) if f not in every]
        else:
            if key is not None and key.startswith("balancer "):
                bad.append((page, n, key, "the command table"))
            bad += [(page, n, f, "any command") for f in FLAG.findall(cmd) if f not in every]
    assert not bad, "flags the parsers do not have:\n" + "\n".join(
        f"{_rel(p)}:{n}: {f} (not in {where})" for p, n, f, where in bad)


# ---- links ---------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_resolves():
    bad = []
    for page in LINKED:
        text = _prose(page)
        anchors = {_anchor(h) for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, frag = target.partition("#")
            if path and not (page.parent / path).exists():
                bad.append(f"{_rel(page)}: {target} (no such file)")
            elif not path and frag not in anchors:
                bad.append(f"{_rel(page)}: #{frag} (no such heading)")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+\s+(.*)$", _prose(page), flags=re.M)}


def test_every_link_into_another_page_finds_its_heading():
    """``[x](docs/runtime.md#heading)``: the page exists and has the heading (a section that
    moved to another page breaks such a link silently otherwise)."""
    bad = []
    for page in LINKED:
        for m in LINK.finditer(_prose(page)):
            target = m.group(1)
            path, _, frag = target.partition("#")
            if re.match(r"[a-z]+:", target) or not path or not frag:
                continue
            dest = (page.parent / path).resolve()
            if dest.suffix == ".md" and dest.is_file() and frag not in _anchors(dest):
                bad.append(f"{_rel(page)}: {target} (no such heading in {_rel(dest)})")
    assert not bad, "broken links to headings:\n" + "\n".join(bad)


#: prose that sends the reader to a section by its title: `README, section "X"` / `sections
#: "X" and "Y"` (the page named before it); every such title must be a heading of that page
SECTION_REF = re.compile(r"(\S+?\.md|README)\b[^.\n]{0,40}?\bsections?\s+((?:\"[^\"]+\"(?:,\s*|\s+and\s+)?)+)")


def test_every_section_named_in_prose_exists():
    bad = []
    for page in LINKED:
        text = " ".join(_prose(page).split())
        for m in SECTION_REF.finditer(text):
            name = m.group(1)
            dest = ROOT / "README.md" if name == "README" else (page.parent / name).resolve()
            heads = [h.strip() for h in re.findall(r"^#+\s+(.*)$", _prose(dest), flags=re.M)] \
                if dest.is_file() else []
            for title in re.findall(r"\"([^\"]+)\"", m.group(2)):
                stem = title.rstrip(". ").strip()
                if not any(h.startswith(stem) for h in heads):
                    bad.append(f"{_rel(page)}: section {title!r} of {name} (no such heading)")
    assert not bad, "sections named that do not exist:\n" + "\n".join(bad)
