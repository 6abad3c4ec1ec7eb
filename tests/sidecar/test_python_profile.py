"""A few seconds of a real Python process's time, sampled with the real py-spy: the share of each
function, bounded and rate-limited; and the operator's comparison of a culprit's profile with its
peers' naming the function it is slower in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from rankwatch.operator.diagnosis.diagnose.differential_profile import Profile, compare, sentence
from rankwatch.sidecar.python_profile import Profiler, ProfilerBusy, parse_raw, py_spy

LOOP = textwrap.dedent(
    """
    import time
    def forward(): time.sleep({forward})
    def backward(): time.sleep({backward})
    while True:
        forward()
        backward()
    """
)


@pytest.fixture
def trainer() -> Iterator[int]:
    """A Python loop spending a quarter of its time in forward, three quarters in backward."""
    process = subprocess.Popen([sys.executable, "-c", LOOP.format(forward=0.002, backward=0.006)])
    time.sleep(0.5)  # past the interpreter's start
    yield process.pid
    process.kill()
    process.wait()


@pytest.mark.skipif(py_spy() is None, reason="py-spy is a dependency of rankwatch; not installed here")
def test_a_profile_gives_each_functions_share_of_the_wall_time_and_a_second_one_is_refused(trainer):
    profiler = Profiler(min_interval_s=30)
    (profile,) = profiler.profile({7: trainer}, seconds=2).values()
    assert profile.problem is None and profile.samples >= 60, profile
    shares = {name.split(" ")[0]: count / profile.samples for name, count in profile.functions.items()}
    assert shares["<module>"] == 1.0
    assert 0.6 <= shares["backward"] <= 0.9 and 0.1 <= shares["forward"] <= 0.4, shares
    with pytest.raises(ProfilerBusy, match=r"ask again in \d+ s"):
        profiler.profile({7: trainer}, seconds=1)


def test_a_rank_that_runs_no_python_gets_no_profile_attempt_and_no_problem_line():
    """A C trainer (here `sleep`): the sidecar does not run py-spy on it, and the operator's diagnosis
    lists no "no Python profile" problem for it (the demo's describe listed one per C rank)."""
    import asyncio

    from aiohttp import web

    from rankwatch.operator.diagnosis.diagnose.differential_profile import fetch_profiles

    process = subprocess.Popen(["sleep", "30"])
    try:
        answer = Profiler(executable="/nonexistent/py-spy", min_interval_s=0).profile({1: process.pid}, seconds=1)
    finally:
        process.kill()
        process.wait()
    assert answer[1].samples == 0 and answer[1].problem is None and answer[1].python is False, answer

    async def scenario() -> tuple[dict, list[str]]:
        async def sidecar(_request: web.Request) -> web.Response:
            return web.json_response({"ranks": {str(rank): profile.to_json() for rank, profile in answer.items()}})

        app = web.Application()
        app.router.add_get("/profile", sidecar)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            return await fetch_profiles({1: f"http://127.0.0.1:{runner.addresses[0][1]}"}, "token", seconds=1)
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == ({}, [])


def test_a_python_rank_that_cannot_be_read_gets_a_problem_not_an_exception(trainer):
    (profile,) = Profiler(executable="/nonexistent/py-spy", min_interval_s=0).profile({1: trainer}, seconds=1).values()
    assert profile.python and profile.samples == 0 and "py-spy could not run" in profile.problem, profile


def test_raw_output_counts_each_function_once_per_sample():
    profile = parse_raw("<module> (a.py);step (a.py);step (a.py) 3\n<module> (a.py);other (a.py) 1\nnot a line\n")
    assert (profile.samples, profile.functions) == (4, {"<module> (a.py)": 4, "step (a.py)": 3, "other (a.py)": 1})


def test_the_culprit_is_named_slower_in_its_slow_function_and_waiting_less():
    culprit = Profile(150, {"train (r.py)": 150, "backward (r.py)": 110, "forward (r.py)": 27, "all_reduce (r.py)": 9})
    peers = {
        4: Profile(150, {"train (r.py)": 150, "backward (r.py)": 66, "forward (r.py)": 33, "all_reduce (r.py)": 48}),
        6: Profile(148, {"train (r.py)": 148, "backward (r.py)": 64, "forward (r.py)": 32, "all_reduce (r.py)": 50}),
    }
    differences = compare(culprit, peers)
    assert [d.function for d in differences] == ["backward (r.py)", "all_reduce (r.py)"]  # forward: 4 points, noise
    assert round(differences[0].culprit_share, 2) == 0.73 and round(differences[0].peers_share, 2) == 0.44
    assert sentence(5, [4, 6], differences, 3) == (
        "Python profile (3 s, sampled with its peers): rank 5 spends 73% of its time in backward (r.py) against 44% "
        "for ranks 4, 6; 6% in all_reduce (r.py) against 33%"
    )
    assert compare(culprit, {4: Profile(0, {})}) == []  # nothing to compare with


def test_a_profile_answer_too_large_or_not_json_is_a_problem_not_read_whole():
    import asyncio
    import json

    from aiohttp import web

    from rankwatch.operator.diagnosis.diagnose.differential_profile import PROFILE_ANSWER_MAX_BYTES, fetch_profiles

    async def scenario() -> tuple[dict, list[str]]:
        async def huge(_request: web.Request) -> web.Response:
            return web.Response(body=json.dumps({"ranks": {"1": {"x": "y" * PROFILE_ANSWER_MAX_BYTES}}}).encode())

        async def garbled(_request: web.Request) -> web.Response:
            return web.Response(body=b"{not json")

        async def good(_request: web.Request) -> web.Response:
            return web.json_response({"ranks": {"3": {"samples": 10, "functions": {"step": 10}}}})

        runners = []
        endpoints = {}
        for rank, handler in ((1, huge), (2, garbled), (3, good)):
            app = web.Application()
            app.router.add_get("/profile", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            endpoints[rank] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            return await fetch_profiles(endpoints, "token", seconds=1)
        finally:
            for runner in runners:
                await runner.cleanup()

    profiles, problems = asyncio.run(scenario())
    assert set(profiles) == {3}, "the good answer still counts"
    assert any("ranks [1]" in problem and "more than 4 MiB" in problem for problem in problems), problems
    assert any("ranks [2]" in problem for problem in problems), problems
