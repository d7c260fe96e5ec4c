"""The documentation names only real things: every `torchlyra` command line in README.md, docs/*.md
and BENCHMARKS.md parses with the CLI's own parser (lm-eval's for `torchlyra lm-eval`), every
repository path and module they name exists, every link lands on a file and heading that exist,
and every page under docs/ is linked from the README. Parsing only: no command runs. And no tracked
text file speaks of how the work on the project was organised (NOT_OF_THE_PRODUCT).

What counts as a command line:
- in a code block (no language, or bash/sh/shell/console; a ```text block is program output): a
  line whose command, after a leading `$ ` prompt and `NAME=value` assignments, is `torchlyra`,
  `.venv/bin/torchlyra` or `python -m train.cli`; lines ending in a backslash are joined and a
  `# comment` is dropped;
- in inline code: a span that starts with one of those (it may wrap onto the next line); `&&`
  separates two commands. A span of the bare command (`torchlyra generate`, `torchlyra bench step`)
  names it rather than runs it: it is parsed with `--help` added, which must exit 0. The program's
  name alone (`torchlyra`) is no command.
Placeholders (HF_DIR, CK, ...) are the unquoted ALL-CAPS words of a command; each is replaced by its
sample value from PLACEHOLDERS, and one that is not there fails the test. Optional brackets
(`[--steps N]`), `...`, `<value>` and `a|b` are not commands: the docs write real ones instead.
Paths: a path in code or a link target whose first part is one of the repository's top-level
folders or files (FOLDERS, FILES) must exist; so must a dotted module (`formats.tokenizer.load`).
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]

# The one table of placeholders the docs may write in a command, each with a sample value.
PLACEHOLDERS = {
    "HF_DIR": "gpt-oss-20b/",       # a Hugging Face GptOss directory
    "QWEN_DIR": "Qwen3-30B-A3B/",   # a Hugging Face directory of another family
    "CK": "runs/tiny",              # one of our checkpoints (run, checkpoints/ or step directory)
    "DIR": "runs/tiny",             # a checkpoint or data directory
    "DATA": "data/shakespeare",     # prepared data
    "CHATDATA": "data/chats",       # prepared conversations
    "N": "300",                     # a count (a step, layers)
    "P": "tiny",                    # a preset
    "T": "4096",                    # a sequence length
    "B": "8",                       # a global batch size
    "OUT": "plan.json",             # an output file
    "PLAYS": "plays/",              # input text files
    "$RANK": "0",                   # the process id a cluster scheduler hands each host
}
PROGRAMS = ("torchlyra", ".venv/bin/torchlyra", "python -m train.cli")
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
# The repository's top-level folders and files: a path in the docs that starts with one is checked
# (others, such as runs/tiny or data/chats, are what commands write).
PACKAGES = ("torch_model", "pallas_kernels", "jax_bridge", "formats", "train", "parity")
FOLDERS = (*PACKAGES, "scripts", "tests", "docs", ".ci", "examples")
FILES = ("Makefile", "pyproject.toml", "requirements.lock", "BENCHMARKS.md", "README.md")
FILE_SUFFIXES = {"json", "jsonl", "md", "png", "txt", "py"}     # `parity.json` is a file, not a module


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str        # as written: continuations joined, the comment dropped

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Block:
    """One code block: its language and (first line number, text) of each line inside."""
    language: str
    lines: list[tuple[int, str]]


def split_page(path: Path) -> tuple[list[Block], str]:
    """(code blocks, the page's prose with every code-block line blanked so line numbers hold)."""
    blocks, prose, current = [], [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"\s*```(\w*)", line)
        if fence and current is None:
            current = Block(fence.group(1), [])
            prose.append("")
        elif fence:
            blocks.append(current)
            current = None
            prose.append("")
        elif current is not None:
            current.lines.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    assert current is None, f"{path.name}: a code block is never closed"
    return blocks, "\n".join(prose)


def inline_spans(prose: str) -> list[tuple[int, str]]:
    """(line number, text) of each `inline code` span; a span may wrap onto the next line."""
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", prose)]


QUOTED = r"'[^']*'|\"[^\"]*\""     # a quoted string, kept as it is


def drop_comment(text: str) -> str:
    """The text before an unquoted `#` that starts a word."""
    kept = re.sub(rf"{QUOTED}|(?:(?<=\s)|^)#.*", lambda m: "" if m.group(0).startswith("#") else m.group(0), text)
    return kept.strip()


def program_of(text: str) -> str | None:
    """The command without its `$ ` prompt and leading NAME=value assignments when it runs a
    subcommand of the CLI (the program's name alone, `torchlyra`, is no command)."""
    text = re.sub(r"^\$\s+", "", text.strip())
    text = re.sub(r"^(?:[A-Za-z_]\w*=\S*\s+)*", "", text)
    return text if any(text.startswith(p + " ") for p in PROGRAMS) else None


def block_commands(page: str, block: Block) -> list[Command]:
    if block.language not in SHELL_FENCES:
        return []
    commands, pending, start = [], "", 0
    for number, line in block.lines:
        if not pending:
            start = number
        text = drop_comment(line)
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        line_text, pending = pending + text, ""
        for part in line_text.split(" && "):      # also a command inside `gcloud ... --command "..."`
            part = part.strip()
            if command := program_of(part.strip('"') if part.count('"') % 2 else part):
                commands.append(Command(page, start, " ".join(command.split())))
    return commands


def makefile_commands() -> list[Command]:
    """The Makefile's recipe lines that run the CLI (`make demo`'s), as the docs write them."""
    return [Command("Makefile", number, " ".join(line.strip().lstrip("@").replace("$(VENV)/bin/torchlyra", "torchlyra").split()))
            for number, line in enumerate((ROOT / "Makefile").read_text().splitlines(), 1)
            if line.startswith("\t") and "$(VENV)/bin/torchlyra " in line]


def doc_commands() -> list[Command]:
    commands = makefile_commands()
    for path in PAGES:
        blocks, prose = split_page(path)
        for block in blocks:
            commands += block_commands(page_name(path), block)
        for number, span in inline_spans(prose):
            for part in span.split(" && "):
                if command := program_of(part):
                    commands.append(Command(page_name(path), number, command))
    return commands


def argv_of(command: Command) -> list[str]:
    """The arguments after the program, placeholders replaced by their sample values; outside
    quotes, a word in ALL CAPS must be a placeholder and `...`, `[`, `]`, `<`, `>`, `|` may not be."""
    unknown, syntax = [], []

    def fill(m: re.Match) -> str:
        word = m.group(0)
        if word[0] in "'\"":
            return word
        if word in ("...", "[", "]", "<", ">", "|"):
            syntax.append(word)
        elif word not in PLACEHOLDERS:
            unknown.append(word)
        return PLACEHOLDERS.get(word, word)

    # A module's class named after a file (`--module examples/gpt.py:GPT`) is no placeholder.
    text = re.sub(rf"{QUOTED}|(?<![\w$])(?<!\.py:)\$?[A-Z][A-Z0-9_]*(?!\w)|\.\.\.|[][<>|]", fill, command.text)
    if unknown:
        raise ValueError(f"placeholder(s) {', '.join(unknown)} not in tests/test_docs.py's PLACEHOLDERS")
    if syntax:
        raise ValueError(f"{syntax[0]!r} is not an argument: write a real command")
    program = next(p for p in PROGRAMS if text.startswith(p + " "))
    return shlex.split(text[len(program):])


def is_bare(argv: list[str]) -> bool:
    """`torchlyra generate`, `torchlyra bench step`: a command named, not run (lm-eval's own parser
    takes no arguments as they are)."""
    return argv != ["lm-eval"] and (len(argv) == 1 or (argv[0] == "bench" and len(argv) == 2))


def parse(argv: list[str], monkeypatch) -> str | None:
    """None when `torchlyra ARGV` parses, else the parser's message. A bare command gets `--help`,
    which must exit 0."""
    from train.cli import build_parser
    from train.evaluation.lm_eval_cli import lm_eval_argv, split_cluster_flags

    bare, stderr = is_bare(argv), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args([*argv, "--help"] if bare else argv)
            if args.command == "lm-eval":
                from lm_eval._cli import HarnessCLI    # what lm_eval.__main__.cli_evaluate parses with (0.4.13)

                # The cluster flags are ours (as `run` reads them), the rest lm-eval's.
                monkeypatch.setattr(sys, "argv", lm_eval_argv(split_cluster_flags(list(args.lm_eval_args))[0]))
                HarnessCLI().parse_args()
    except SystemExit as e:
        if e.code == 0 and bare:
            return None
        lines = stderr.getvalue().strip().splitlines()
        return lines[-1] if lines else f"exit {e.code}"
    return None


def test_every_documented_command_parses(monkeypatch):
    commands = doc_commands()
    failures, bare, per_page = [], 0, {"Makefile": 0, **{page_name(p): 0 for p in PAGES}}
    for command in commands:
        per_page[command.page] += 1
        try:
            argv = argv_of(command)
            bare += is_bare(argv)
            message = parse(argv, monkeypatch)
        except ValueError as e:
            message = str(e)
        if message:
            failures.append(f"{command.where()}\n    {message}")
    print(f"\n{len(commands)} command lines found ({bare} of them a bare command name, parsed with --help), "
          f"{len(commands) - len(failures)} parsed, none skipped: " + ", ".join(f"{p} {n}" for p, n in per_page.items()))
    assert commands, "no command line found in the docs"
    assert not failures, (f"{len(failures)} of {len(commands)} documented commands do not parse:\n"
                          + "\n".join(failures))


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = split_page(path)[1]
    return {slug(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}


def named_paths(path: Path) -> list[tuple[int, str]]:
    """(line, path or module) of every repository path or dotted module the page names in code or
    in a link target (relative to the repository root; links are resolved from the page)."""
    blocks, prose = split_page(path)
    texts = inline_spans(prose) + [(n, line) for block in blocks for n, line in block.lines]
    folders, files = "|".join(re.escape(f) for f in FOLDERS), "|".join(re.escape(f) for f in FILES)
    packages = "|".join(PACKAGES)
    found = []
    for number, text in texts:
        for m in re.finditer(rf"(?<![\w./$-])(?:(?:{folders})/[\w.*/-]*|(?:{files}))(?![\w-])", text):
            found.append((number, m.group(0).rstrip(".:,")))
        for m in re.finditer(rf"(?<![\w./$-])(?:{packages})(?:\.\w+)+", text):
            if m.group(0).rsplit(".", 1)[1] not in FILE_SUFFIXES:
                found.append((number, m.group(0)))
    return found


def module_exists(dotted: str) -> bool:
    """`pkg.module.attr`: the packages along the way exist and a module ends the walk (the rest are
    names inside it)."""
    here = ROOT
    for part in dotted.split("."):
        if (here / part / "__init__.py").exists():
            here = here / part
        else:
            return (here / f"{part}.py").exists()
    return True


def test_every_repository_path_the_docs_name_exists():
    missing, checked = [], 0
    for path in PAGES:
        page = page_name(path)
        for number, name in named_paths(path):
            checked += 1
            if "/" in name or name in FILES:
                ok = bool(list(ROOT.glob(name))) if "*" in name else (ROOT / name).exists()
            else:
                ok = module_exists(name)
            if not ok:
                missing.append(f"{page}:{number}: {name}")
        text = split_page(path)[1]
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"\w+:", target):          # https:, mailto:
                continue
            checked += 1
            number = text.count("\n", 0, m.start()) + 1
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                missing.append(f"{page}:{number}: link {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                missing.append(f"{page}:{number}: link {target}: no heading #{anchor} in {resolved.name}")
    print(f"\n{checked} paths, modules and links checked")
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {Path(m.group(1).partition("#")[0]) for m in re.finditer(r"\]\((docs/[^)\s]+)\)", readme)}
    pages = {p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md")}
    assert pages, "docs/ holds no page"
    assert not pages - linked, f"docs pages the README does not link: {sorted(map(str, pages - linked))}"


def test_chip_measurement_script_runs_only_real_commands(monkeypatch, tmp_path):
    """scripts/chip_measure.sh (the measurement jobs for a v5e chip, run where no test can) dry-run:
    every job is known, and every command it would run parses with the CLI's parser or names a
    script that exists."""
    import subprocess

    (tmp_path / "data" / "o200k").mkdir(parents=True)          # the o200k data, where the script expects it
    jobs = ["train", "decode", "decode-ab", "module", "moe", "tier-runs", "tier-kernels"]
    run = subprocess.run(["bash", str(ROOT / "scripts" / "chip_measure.sh"), *jobs], cwd=tmp_path, text=True,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "CHIP_DRY_RUN": "1", "OUT": str(tmp_path / "out")})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line[2:] for line in run.stdout.splitlines() if line.startswith("+ ")]
    cli = [shlex.split(line)[1:] for line in lines if line.startswith("tl ")]
    assert len(cli) >= 14 and not run.stderr, run.stdout + run.stderr
    failures = [f"{' '.join(argv)}\n    {message}" for argv in cli if (message := parse(argv, monkeypatch))]
    assert not failures, "chip_measure.sh runs commands that do not parse:\n" + "\n".join(failures)
    for line in lines:
        if line.startswith("python3 "):
            assert (ROOT / shlex.split(line)[1]).is_file(), line
    assert all(shlex.split(line)[0] in ("tl", "python3") or shlex.split(line)[:2] == ["make", "test-tpu"]
               for line in lines), lines


# Words about how the work on the project was organised, which the product never says of itself:
# a figure is known by its date, commit, machine and command, a goal by what it is. Each is written
# with one letter in brackets so that this file does not match itself.
NOT_OF_THE_PRODUCT = re.compile(
    r"\bsess[i]ons?\b|\biss[u]es? #?\d+|the devic[e] tool|`devic[e]` tool|devic[e] call"
    r"|devic[e]: carry|farm-stud[i]o|duplicates -[-]change", re.IGNORECASE)
# Python's and pytest's own identifiers, exact substrings: the line is checked without them.
THEIR_OWN_WORDS = ('scope="session"',      # pytest's fixture scope
                   "scope='session'",
                   "start_new_session")     # subprocess.Popen's argument


def test_the_project_speaks_of_itself_only():
    """No tracked text file (code, tests, docs, build files) speaks of how the work on the project
    was organised: no numbered work period or ticket as the name of a figure or goal, no tool of the
    workplace (NOT_OF_THE_PRODUCT), each hit named by file and line."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    hits = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():       # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:            # binary
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for allowed in THEIR_OWN_WORDS:
                line = line.replace(allowed, "")
            if match := NOT_OF_THE_PRODUCT.search(line):
                hits.append(f"{name}:{number}: {match.group(0)!r}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines speak of how the work was organised:\n" + "\n".join(hits)
