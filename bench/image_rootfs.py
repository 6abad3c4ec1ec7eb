"""Build the image's root filesystem from the Dockerfile without a Docker engine, and check it.

No registry but Debian's is reachable here, so the pinned ``python:*-slim-bookworm`` base cannot be
pulled; it is stood in for by a Debian bookworm root filesystem made with mmdebstrap (the same Debian
release and glibc, Debian's Python 3.11 with its headers, venv and ``python`` on PATH; no compiler,
as in the base image), cached in ``~/.cache/rankwatch/image/``. Each Dockerfile stage starts from a
copy of it; WORKDIR, ENV and COPY (from the build context or ``--from`` a stage) are carried out
here, RUN inside the stage's root (chroot, with /proc, /dev and resolv.conf; apt-get reaches
Debian, pip reaches PyPI). Then, in the runtime stage, as uid 65532: ``rankwatch --help``,
``rankwatch operator --help``, ``rankwatch sidecar --help``, the C tokeniser imports, the tracing
library is where the init container copies it from and exports NCCL's API, the development tools
are absent, and no compiler is there. Needs root (chroot, mounts) and mmdebstrap (installed with
apt-get when missing).

    make image-rootfs        # or: sudo .venv/bin/python bench/image_rootfs.py [--keep DIR]

Prints the time of each stage and the size of the runtime filesystem; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RANKWATCH_CACHE_DIR") or Path.home() / ".cache" / "rankwatch") / "image"
BASE_PACKAGES = ["python3", "python3-venv", "python-is-python3", "python3-dev", "ca-certificates"]
SUITE = "bookworm"
RUNTIME_UID = 65532
LIBRARY = "/opt/rankwatch/lib/librankwatch-nccl.so"
DEVELOPMENT = ("cluster", "standins")


def parse(text: str) -> tuple[dict[str, str], list[tuple[str | None, list[tuple[str, str]]]]]:
    """Build args and stages ``(name, [(KEYWORD, args)])``; continuation lines joined, comments dropped."""
    logical, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not pending and not line):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[tuple[str | None, list[tuple[str, str]]]] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            stages.append((words[2] if len(words) == 3 else None, []))
        else:
            stages[-1][1].append((keyword, rest))
    return args, stages


def base_tarball() -> Path:
    """The stand-in base image, built once per package list."""
    key = hashlib.sha256(" ".join([SUITE, *BASE_PACKAGES]).encode()).hexdigest()[:12]
    tarball = CACHE / f"base-{SUITE}-{key}.tar"
    if tarball.exists():
        return tarball
    if shutil.which("mmdebstrap") is None:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "mmdebstrap"], check=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial")
    subprocess.run(
        ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(partial)],
        check=True,
    )
    partial.rename(tarball)
    return tarball


CONTEXT_IGNORED = shutil.ignore_patterns("build", "__pycache__", "*.egg-info", "*.so")
"""The parts of .dockerignore that matter for the folders the Dockerfile copies."""
HOST_CA = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
BUILD_CA = "/run/rankwatch-build/ca.crt"


def chroot(root: Path, command: str, env: dict[str, str], workdir: str, user: str = "0:0") -> None:
    """Run ``command`` with ``/bin/sh -c`` inside ``root`` (a mount namespace of its own). The build
    machine's CA bundle is lent to it, as a build secret would be (networks that intercept TLS)."""
    env = {**env, "PIP_CERT": BUILD_CA, "SSL_CERT_FILE": BUILD_CA} if HOST_CA.is_file() else env
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    inner = f"cd {shlex.quote(workdir)} && exec env -i {exports} /bin/sh -c {shlex.quote(command)}"
    lend_ca = (
        f"mkdir -p {root}/run/rankwatch-build && touch {root}{BUILD_CA} && mount --bind {HOST_CA} {root}{BUILD_CA} && "
        if HOST_CA.is_file()
        else ""
    )
    script = (
        f"mount -t proc proc {root}/proc && mount --rbind /dev {root}/dev && "
        f"touch {root}/etc/resolv.conf && mount --bind /etc/resolv.conf {root}/etc/resolv.conf && {lend_ca}"
        f"exec chroot --userspec={user} {root} /bin/sh -c {shlex.quote(inner)}"
    )
    subprocess.run(["unshare", "--mount", "--fork", "/bin/sh", "-c", script], check=True)


def build(work: Path) -> Path:
    _, stages = parse((REPO / "Dockerfile").read_text())
    tarball = base_tarball()
    roots: dict[str, Path] = {}
    for index, (name, instructions) in enumerate(stages):
        started = time.monotonic()
        label = name or "runtime"
        root = work / label
        root.mkdir()
        with tarfile.open(tarball) as tar:
            tar.extractall(root, filter="fully_trusted")
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
        }
        workdir = "/"
        for keyword, rest in instructions:
            if keyword == "WORKDIR":
                workdir = rest
                (root / rest.lstrip("/")).mkdir(parents=True, exist_ok=True)
            elif keyword == "ENV":
                for word in shlex.split(rest):
                    key, _, value = word.partition("=")
                    env[key] = _expand(value, env)
            elif keyword == "COPY":
                words = rest.split()
                source_root, sources = REPO, words[:-1]
                if words[0].startswith("--from="):
                    source_root, sources = roots[words[0].removeprefix("--from=")], words[1:-1]
                destination = words[-1]
                target = root / (destination if destination.startswith("/") else f"{workdir}/{destination}").lstrip("/")
                for source in sources:
                    origin = source_root / source.lstrip("/")
                    if origin.is_dir():
                        # From the build context, what .dockerignore keeps out; from a stage, everything.
                        ignore = CONTEXT_IGNORED if source_root == REPO else None
                        shutil.copytree(origin, target, dirs_exist_ok=True, symlinks=True, ignore=ignore)
                    else:
                        dest = target / origin.name if destination.endswith("/") else target
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, dest)
            elif keyword == "RUN":
                chroot(root, rest, env, workdir)
            elif keyword == "USER":
                env["RANKWATCH_IMAGE_USER"] = rest
        roots[label] = root
        print(f"stage {index + 1} ({label}): {time.monotonic() - started:.0f} s", flush=True)
    return roots["runtime"]


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)


def check(runtime: Path) -> None:
    env = {
        "PATH": "/opt/rankwatch/venv/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    user = f"{RUNTIME_UID}:{RUNTIME_UID}"
    for command in (
        "rankwatch --help > /dev/null",
        "rankwatch operator --help > /dev/null",
        "rankwatch sidecar --help > /dev/null",
        "python -I -c 'import rankwatch.analysis._megatrace_tokenizer, rankwatch.operator.handlers'",
        f"test -r {LIBRARY}",
        "! command -v gcc && ! command -v cc",
        "rankwatch cluster status 2>&1 | grep -q 'rankwatch.cluster is a development tool'",
    ):
        chroot(runtime, command, env, "/", user)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(runtime / LIBRARY.lstrip("/"))],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert " ncclAllReduce" in symbols, "the tracing library does not export NCCL's API"
    (package,) = (runtime / "opt/rankwatch/venv/lib").glob("python3*/site-packages/rankwatch")
    present = [path for path in DEVELOPMENT if (package / path).exists()]
    assert not present, f"development tools in the image: {present}"
    size = subprocess.run(["du", "-sm", str(runtime)], capture_output=True, text=True).stdout.split()[0]
    print(f"runtime filesystem: {size} MiB; rankwatch --help, operator/sidecar --help, the C tokeniser and the "
          f"tracing library check out as uid {RUNTIME_UID}; no compiler, no development tools")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="build in this directory and keep it (default: a temporary one)")
    options = parser.parse_args()
    if os.geteuid() != 0:
        print("image_rootfs: needs root (chroot and mounts); run it with sudo", file=sys.stderr)
        return 2
    started = time.monotonic()
    work = Path(options.keep) if options.keep else Path(tempfile.mkdtemp(prefix="rankwatch-image-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        check(build(work))
    finally:
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"image root filesystem built and checked in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
