"""kopf's index pre-population with N objects, with kopf's toggle sets as they are and as the operator
makes them (``operator/kopf_toggles.py``): seconds until every object's worker is released.

    .venv/bin/python bench/kopf_index_startup.py 1000,2000,4000 [--quiet-toggles]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kopf._cogs.aiokits import aiotoggles

from rankwatch.operator import kopf_toggles


async def start_up(objects: int) -> float:
    """As kopf runs it: a toggle per object, made as the object arrives from the watch; its worker drops
    it once indexed and waits for the whole set."""
    toggles = aiotoggles.ToggleSet(all)
    listing = await toggles.make_toggle(name="listed")

    async def worker(toggle: aiotoggles.Toggle) -> None:
        await asyncio.sleep(0)
        await toggles.drop_toggle(toggle)
        await toggles.wait_for(True)

    started = time.perf_counter()
    workers = []
    for index in range(objects):
        workers.append(asyncio.create_task(worker(await toggles.make_toggle(name=str(index)))))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await toggles.drop_toggle(listing)
    await asyncio.gather(*workers)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("objects", help="comma-separated object counts")
    parser.add_argument("--quiet-toggles", action="store_true", help="the operator's toggle sets")
    args = parser.parse_args()
    if args.quiet_toggles:
        kopf_toggles.wake_only_on_flips()
    for objects in map(int, args.objects.split(",")):
        print(f"{objects:>6} objects: {asyncio.run(start_up(objects)):.2f} s", flush=True)


if __name__ == "__main__":
    main()
