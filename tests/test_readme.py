"""Every snippet in README.md runs as pasted, as a new user would run it.

The fenced ```python, ```bash/```sh and ```console blocks are run in document order, in one
fresh empty directory (a user following the README top to bottom): python blocks as a
script (``python snippet.py``), bash blocks with ``bash -e``, console blocks command by
command (``$ `` lines); output lines printed under a console command must be exactly what
the command prints. ``python`` and ``fewbit`` are the ones of the environment running the
tests; the fewbit table cache goes to a temporary directory.

A block is changed by an HTML comment on the line before its fence:

- ``<!-- readme-test: in-repo -->``: the block runs in a fresh copy of the repository's
  tracked files instead (commands such as ``python scripts/...``);
- ``<!-- readme-test: skip(ID): REASON; covered by: TARGET, ... -->``: the block is not
  run, for the REASON given (it installs packages, trains for hours, ...); each TARGET
  (``tests/FILE.py::test_name`` or a repository path) must exist, and every ``--option``
  the block passes to a script or a ``fewbit`` command must still be in its ``--help``.

New blocks are picked up without touching this file; a block that cannot run as pasted
fails here, under the README line number of its fence.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_LANGS = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\((?P<id>[a-z0-9-]+)\):\s*(?P<reason>[^;]+?)\s*;\s*covered by:\s*(?P<covered>.+)$")
_TIMEOUT = 900


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # key of RUN_LANGS, or anything else (not run)
    text: str
    marker: str | None  # the marker comment's body, if any

    @property
    def kind(self) -> str:
        return RUN_LANGS.get(self.lang, "")

    @property
    def skip(self) -> re.Match | None:
        return _SKIP.match(self.marker) if self.marker else None

    @property
    def in_repo(self) -> bool:
        return self.marker == "in-repo"

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang}"


def parse(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, with the marker comment right above each."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = lines[i - 1] if i > 0 else ""
        mk = _MARKER.match(prev)
        blocks.append(Block(i + 1, m.group(1).lower(), "\n".join(lines[i + 1:j]) + "\n",
                            mk.group("body") if mk else None))
        i = j + 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))
RUNNABLE = [b for b in BLOCKS if b.kind and not b.skip]


def test_markers_are_well_formed_and_attached():
    lines = README.read_text(encoding="utf-8").splitlines()
    marker_lines = [n + 1 for n, ln in enumerate(lines) if "readme-test:" in ln]
    attached = {b.line - 1 for b in BLOCKS if b.marker is not None}
    assert set(marker_lines) == attached, "a readme-test marker must be the line right above a fence"
    for b in BLOCKS:
        if b.marker is None:
            continue
        assert b.kind, f"line {b.line}: marker on a ```{b.lang} block, which is never run"
        assert b.in_repo or b.skip, f"line {b.line - 1}: unknown marker {b.marker!r}"
    ids = [b.skip["id"] for b in BLOCKS if b.skip]
    assert len(ids) == len(set(ids)), ids
    assert len(RUNNABLE) >= 5, [b.id for b in RUNNABLE]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip], ids=lambda b: b.skip["id"])
def test_skipped_block_is_covered(block):
    assert len(block.skip["reason"]) >= 10, block.marker
    for target in (t.strip() for t in block.skip["covered"].split(",")):
        path, _, name = target.partition("::")
        assert (ROOT / path).exists(), f"{target}: no such file"
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), \
                f"{target}: no such test"


def test_two_setup_commands():
    """Exactly two set-up commands: the same install, then the main job or the tests."""
    setup = {b.skip["id"]: b.text.strip() for b in BLOCKS if b.skip and b.skip["id"].startswith("setup-")}
    assert set(setup) == {"setup-main-job", "setup-tests"}, setup
    install = "pip install torch==2.13.0 && pip install -e '.[dev]' && "
    assert setup["setup-main-job"] == install + "python scripts/main_job.py"
    assert setup["setup-tests"] == install + "python -m pytest -q"
    assert (ROOT / "scripts" / "main_job.py").is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "skip\\(setup-tests\\)" in ci and "-m venv" in ci  # .ci/run runs that block in a fresh venv


def _commands(text: str) -> list[list[str]]:
    """Shell words of each simple command in a block (split on newlines, &&, ;)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.removeprefix("$ ").split(" #")[0]
        for part in re.split(r"&&|;|\|\|", line):
            words = shlex.split(part)
            while words and words[0] in ("do", "then", "else", "time"):
                words = words[1:]
            if words:
                out.append(words)
    return out


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["FEWBIT_CACHE_DIR"] = str(tmp / "fewbit-cache")
    env["MPLBACKEND"] = "Agg"
    env.pop("PYTHONPATH", None)
    return env


def _help(words: list[str], env) -> str:
    proc = subprocess.run(words + ["--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (words, proc.stderr)
    return proc.stdout


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip], ids=lambda b: b.skip["id"])
def test_skipped_block_options_exist(block, tmp_path):
    """Options a skipped block passes to our scripts and commands are still accepted."""
    env = _env(tmp_path)
    for words in _commands(block.text):
        if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("scripts/"):
            prog, args = [sys.executable, words[1]], words[2:]
        elif words[:1] == ["fewbit"] and len(words) > 1:
            prog, args = [sys.executable, "-m", "fewbit.cli", words[1]], words[2:]
        else:
            continue
        assert (ROOT / prog[1]).is_file() if prog[1].startswith("scripts/") else True, words
        text = _help(prog, env)
        for opt in (a.split("=")[0] for a in args if a.startswith("--")):
            assert re.search(rf"(^|[\s,\[]){re.escape(opt)}\b", text), f"{' '.join(words)}: {opt} not in --help"


class _Walkthrough:
    """Runs the README's blocks in order: user blocks in one empty directory, in-repo blocks
    in one fresh copy of the repository. A block's earlier blocks run first (once)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.user_dir = tmp / "fresh"
        self.user_dir.mkdir()
        self.repo_dir = None
        self.env = _env(tmp)
        self.done: dict[int, str | None] = {}  # fence line -> failure message or None

    def _repo(self) -> Path:
        if self.repo_dir is None:
            self.repo_dir = self.tmp / "repo"
            files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
            for rel in filter(None, files.decode().split("\0")):
                if (ROOT / rel).is_file():
                    (self.repo_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, self.repo_dir / rel)
        return self.repo_dir

    def run(self, block: Block) -> None:
        for b in RUNNABLE:
            if b.line >= block.line:
                break
            if b.line not in self.done and b.in_repo == block.in_repo:
                self._run_once(b)
        msg = self._run_once(block)
        assert msg is None, msg

    def _run_once(self, block: Block) -> str | None:
        if block.line not in self.done:
            try:
                self._execute(block)
                self.done[block.line] = None
            except AssertionError as exc:
                self.done[block.line] = f"README.md line {block.line} ({block.lang}):\n{exc}"
        return self.done[block.line]

    def _shell(self, script: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=_TIMEOUT)

    def _execute(self, block: Block) -> None:
        cwd = self._repo() if block.in_repo else self.user_dir
        if block.kind == "python":
            path = cwd / f"readme_snippet_L{block.line}.py"
            path.write_text(block.text)
            proc = subprocess.run([sys.executable, path.name], cwd=cwd, env=self.env, capture_output=True,
                                  text=True, timeout=_TIMEOUT)
            assert proc.returncode == 0, f"{block.text}\n--- stderr:\n{proc.stderr[-4000:]}"
        elif block.kind == "bash":
            proc = self._shell(block.text, cwd)
            assert proc.returncode == 0, f"{block.text}\n--- stderr:\n{proc.stderr[-4000:]}"
        else:  # console: "$ cmd" lines, each followed by its expected output (if any)
            steps: list[tuple[str, list[str]]] = []
            for ln in block.text.splitlines():
                if ln.startswith("$ "):
                    steps.append((ln[2:], []))
                else:
                    assert steps, f"console block starts with output, not a '$ ' command: {ln!r}"
                    steps[-1][1].append(ln.rstrip())
            for cmd, expected in steps:
                proc = self._shell(cmd, cwd)
                assert proc.returncode == 0, f"$ {cmd}\n--- stderr:\n{proc.stderr[-4000:]}"
                if expected:
                    got = [ln.rstrip() for ln in proc.stdout.rstrip("\n").splitlines()]
                    assert got == expected, f"$ {cmd}\n--- README shows:\n" + "\n".join(expected) + \
                        "\n--- it prints:\n" + "\n".join(got)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    return _Walkthrough(tmp_path_factory.mktemp("readme"))


@pytest.mark.slow  # the whole walkthrough is about a minute of CPU (fits, a small GPT-2, plots)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_readme_block_runs_as_pasted(block, walkthrough):
    walkthrough.run(block)


@pytest.mark.parametrize("doc", ["README.md", "docs/method.md", "docs/compression.md", "docs/kernels.md"])
def test_links_and_paths_exist(doc):
    """Relative links, and repository paths in text or code, point at files that exist."""
    path = ROOT / doc
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{doc} links to missing {target}"
    for name in set(re.findall(r"(?<![\w/.-])((?:docs|scripts|tests|notebooks|fewbit|solver|tables)/[\w./-]*\w)", text)):
        assert (ROOT / name).exists(), f"{doc} names missing {name}"


_DOC_REF = re.compile(r"docs/(method|compression|kernels)\.md(?: §(\d+)(?:[-–](\d+))?)?")


def test_repository_cites_only_files_users_have():
    """Every ``docs/X.md §N`` in the tracked files exists with that section, and nothing cites
    a notes file outside the repository."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    heads = {}
    for name in ("method", "compression", "kernels"):
        doc = ROOT / "docs" / f"{name}.md"
        assert doc.is_file(), doc
        heads[name] = {int(n) for n in re.findall(r"^## §(\d+) ", doc.read_text(), re.M)}
    bad = []
    for rel in files.stdout.split():
        if not rel.endswith((".py", ".md", ".ipynb", ".toml")) or rel == "tests/test_readme.py":
            continue
        text = (ROOT / rel).read_text(encoding="utf-8")
        for m in _DOC_REF.finditer(text):
            for n in filter(None, (m.group(2), m.group(3))):
                if int(n) not in heads[m.group(1)]:
                    bad.append(f"{rel}: {m.group(0)} (no section §{n})")
        for m in re.finditer(r"(?<![\w/])(?:method|compression|kernels-notes|style)\.md", text):
            if text[max(0, m.start() - 5):m.start()] != "docs/":
                bad.append(f"{rel}: {m.group(0)} (not a file users have; cite docs/...)")
        if re.search(r"/work/|shared/docs", text):
            bad.append(f"{rel}: names a path outside the repository")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_benchmark_scripts_run_at_tiny_sizes(tmp_path):
    """The README's benchmark commands (skipped above: minutes each) at tiny sizes."""
    env = _env(tmp_path)
    runs = [
        ["scripts/bench_activations.py", "--activations", "gelu", "--dtypes", "float32", "bfloat16",
         "--sizes", "12", "--mode", "all", "--threads", "1", "--repeat", "1"],
        ["scripts/bench_solver.py", "--n", "200", "--k", "4", "--numpy-n", "100", "--repeat", "1",
         "--functions", "gelu", "--bits", "1", "2", "--skip-tables"],
        ["scripts/bench_quant.py", "--sizes", "65536", "--bits", "4", "--repeats", "1", "--threads", "1",
         "--models", "mlp", "--mlp-dim", "128", "--mlp-layers", "2", "--mlp-batch", "64", "--step-repeats", "1"],
        ["scripts/bench_model.py", "--device", "cpu", "--width", "32", "--layers", "2", "--tokens", "64",
         "--warmup", "1", "--repeat", "1", "--threads", "1"],
        ["scripts/profile_host.py", "--device", "cpu", "--calls", "5", "--top", "3"],
    ]
    if importlib.util.find_spec("triton") is not None:
        runs.append(["scripts/profile_host.py", "--device", "cpu", "--stub-triton", "--calls", "5", "--top", "3"])
    for args in runs:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=_TIMEOUT)
        assert proc.returncode == 0, f"{args}\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), args
