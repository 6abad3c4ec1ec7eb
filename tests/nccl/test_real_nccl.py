"""librankwatch-nccl.so next to the real libnccl.so.2 of NVIDIA's wheels (no GPU here: NCCL loads, reports
its version and makes unique ids; communicators fail to initialise).

Each wheel's library is opened the way PyTorch opens it (dlopen RTLD_LOCAL) in a process with the
interposer preloaded (real_nccl_probe.c): every wrapped ncclX the library has resolves to the
interposer, which forwards to the library's pncclX (the results through it equal the pncclX's own),
failures pass through unchanged and leave no record of an operation that did not happen. And
nccl_abi.h, which rankwatch compiles against instead of nccl.h, agrees with each wheel's nccl.h.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from nccl_wheels import WHEELS, nccl_home

from rankwatch.analysis.load import load_path
from rankwatch.analysis.ring import Op, State, read_ring

HERE = Path(__file__).parent
ABI = HERE.parents[1] / "nccl_patch" / "include"
NEW_IN = {"ncclAlltoAll": 22800, "ncclGather": 22800, "ncclScatter": 22800, "ncclCommShrink": 22700,
          "ncclCommInitRankScalable": 22300}  # fmt: skip


@pytest.fixture(scope="module", params=WHEELS, ids=lambda wheel: f"{wheel[0]}-{wheel[1]}")
def nccl(request) -> Path:
    if os.environ.get("RANKWATCH_SKIP_REAL_NCCL"):
        pytest.skip("RANKWATCH_SKIP_REAL_NCCL is set")
    return nccl_home(*request.param)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("probe") / "real_nccl_probe"
    subprocess.run(["gcc", "-O1", "-Wall", "-Werror", f"-I{ABI}", "-o", str(binary), str(HERE / "real_nccl_probe.c"),
                    "-ldl"], check=True)  # fmt: skip
    return binary


def test_interposer_forwards_to_the_real_nccl(nccl, probe, artifacts, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKWATCH_", "LD_"))}
    env.update(RANK="0", RANKWATCH_TRACE_DIR=str(tmp_path), LD_PRELOAD=str(artifacts.interposer))
    run = subprocess.run([str(probe), str(nccl / "lib" / "libnccl.so.2")], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    version = report["version"]
    expected = nccl.name.rsplit("-", 1)[1].split(".")
    assert version == int(expected[0]) * 10000 + int(expected[1]) * 100 + int(expected[2])

    for name, symbol in report["symbols"].items():
        assert symbol["called"] == str(artifacts.interposer), f"{name} does not resolve to the interposer"
        has = version >= NEW_IN.get(name, 0)
        assert symbol["public"] == symbol["strong"] == has, f"{name}: ncclX/pncclX in NCCL {version}: {symbol}"

    calls = report["calls"]
    assert calls["ncclGetUniqueId"] == [0, 0]
    for name, (through, direct) in calls.items():
        assert through == direct, f"{name}: {through} through the interposer, {direct} from pncclX"
    assert calls["ncclCommInitRank"][0] != 0, "no GPU: the real NCCL cannot make a communicator"
    assert calls["ncclAllReduce"][0] == 4, "ncclInvalidArgument for a NULL communicator, passed through"

    [ring] = tmp_path.glob("*.ring")
    snapshot = read_ring(ring)
    assert snapshot.header.nccl_version == version, "the interposer asked the real pncclGetVersion"
    records = snapshot.records
    operations = records[(records["op"] > Op.NONE) & (records["op"] < Op.COMM_INIT)]
    assert set(operations["state"].tolist()) <= {State.FAILED}, "a refused call is never recorded as done"
    assert sorted(operations["result"].tolist()) == [4, 4, 4], "with NCCL's own result code"
    assert not len(records[records["op"] >= Op.COMM_INIT]), "no communicator came or went"
    trace = load_path(tmp_path)
    assert len(trace.calls) == 0 and "refused" in " ".join(trace.problems)


def _abi_declarations() -> list[tuple[str, str, str]]:
    """(return type, name, parameters) of every RW_NCCL_API line of nccl_abi.h."""
    text = (ABI / "nccl_abi.h").read_text()
    found = re.findall(r"^RW_NCCL_API\(([^,]+), (\w+),?(.*?)\)\s*$", text, re.MULTILINE | re.DOTALL)
    return [(ret.strip(), name, " ".join(params.split())) for ret, name, params in found]


CONSTANTS = [
    "ncclSuccess",
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "ncclInvalidArgument",
    "ncclInvalidUsage",
    "ncclRemoteError",
    "ncclInProgress",
    "ncclTimeout",
    "ncclNumResults",
    "ncclSum",
    "ncclProd",
    "ncclMax",
    "ncclMin",
    "ncclAvg",
    "ncclNumOps",
    "ncclInt8",
    "ncclUint8",
    "ncclInt32",
    "ncclUint32",
    "ncclInt64",
    "ncclUint64",
    "ncclFloat16",
    "ncclFloat32",
    "ncclFloat64",
    "ncclBfloat16",
    "ncclFloat8e4m3",
    "ncclFloat8e5m2",
    "ncclNumTypes",
    "NCCL_UNIQUE_ID_BYTES",
    "NCCL_SPLIT_NOCOLOR",
]
COUNTS = ("ncclNumResults", "ncclNumTypes")  # grow with NCCL: rankwatch's are the newest wheel's


def _constants(header: str, includes: list[str], tmp_path: Path, name: str) -> dict[str, int]:
    """The values of CONSTANTS (those the header defines) and sizeof(ncclUniqueId), as compiled."""
    wanted = list(CONSTANTS)
    while True:
        body = "".join(f'  printf("{v} %ld\\n", (long)({v}));\n' for v in wanted)
        body += '  printf("sizeof_ncclUniqueId %ld\\n", (long)sizeof(ncclUniqueId));\n'
        source = tmp_path / f"{name}.c"
        source.write_text(f"#include <stdio.h>\n#include <{header}>\nint main(void) {{\n{body}  return 0;\n}}\n")
        binary = tmp_path / name
        built = subprocess.run(
            ["gcc", *(f"-I{i}" for i in includes), "-o", str(binary), str(source)], capture_output=True, text=True
        )
        missing = set(re.findall(r"[‘'](\w+)[’'] undeclared", built.stderr)) & set(wanted)
        if built.returncode == 0 or not missing:
            assert built.returncode == 0, built.stderr[-2000:]
            break
        wanted = [v for v in wanted if v not in missing]  # an older NCCL: not there yet
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in (line.split() for line in output.splitlines())}


def test_nccl_abi_header_agrees_with_the_wheels_nccl_h(nccl, tmp_path):
    version = [int(x) for x in nccl.name.rsplit("-", 1)[1].split(".")]
    mine = _constants("nccl_abi.h", [str(ABI)], tmp_path, "ours")
    real = _constants("nccl.h", [str(nccl / "include"), str(HERE / "cuda_stub")], tmp_path, "theirs")
    newest = version == [int(x) for x in WHEELS[-1][1].split(".")]
    shared = [k for k in real if k in mine and (newest or k not in COUNTS)]
    assert {k: mine[k] for k in shared} == {k: real[k] for k in shared}
    assert len(shared) >= 25 and real["sizeof_ncclUniqueId"] == 128

    # every function rankwatch declares has the wheel's signature, where the wheel has it
    checks = []
    for ret, name, params in _abi_declarations():
        if version[0] * 10000 + version[1] * 100 + version[2] < NEW_IN.get(name, 0):
            continue
        for prefix in ("", "p"):
            checks.append(f"{ret} (*check_{prefix}{name})({params or 'void'}) = {prefix}{name};")
    source = "#include <stddef.h>\n#include <nccl.h>\n" + "\n".join(checks) + "\nint main(void) { return 0; }\n"
    (tmp_path / "signatures.c").write_text(source)
    compiled = subprocess.run(
        ["gcc", "-Werror=incompatible-pointer-types", "-Werror", f"-I{nccl / 'include'}", f"-I{HERE / 'cuda_stub'}",
         "-c", "-o", str(tmp_path / "signatures.o"), str(tmp_path / "signatures.c")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert len(checks) >= 40
