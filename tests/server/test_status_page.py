"""The status page in a real headless browser (Chromium from the system's packages) while
learners train: the page's script fetched status.json and drew the chart, the staleness
histogram and the learner table."""

import asyncio
import os
import re
import shutil

import pytest
from helpers import initial_weights, numpy_learner, run_server, small_layout

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not os.environ.get("CI"):  # CI installs it (.ci/run): there, its absence fails
    pytest.skip("no chromium on this machine (apt-get install chromium)", allow_module_level=True)

#: a browser that reaches nothing but the page it is given
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
    "--virtual-time-budget=4000",  # let the page's script poll status.json a few times
]


async def chromium(url: str, profile, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={profile}",
        *args,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_the_status_page_draws_the_run_in_a_headless_browser(tmp_path):
    layout = small_layout()
    w0 = initial_weights(layout)
    async with run_server(kernel="numpy", metrics="127.0.0.1:0") as ps:
        learners = [
            asyncio.create_task(numpy_learner(ps.addresses[0], layout, w0, delay=d, name=f"learner-{i}", seed=i))
            for i, d in enumerate([0.005, 0.01, 0.04])
        ]
        try:
            await asyncio.sleep(3.0)  # a few samples of history for the chart
            page = ps.monitor.url + "/"
            dom = await chromium(page, tmp_path / "profile", "--dump-dom")
            shot = tmp_path / "status.png"
            await chromium(page, tmp_path / "profile2", f"--screenshot={shot}")
        finally:
            for task in learners:
                task.cancel()
            await asyncio.gather(*learners, return_exceptions=True)

    assert re.search(r'id="live"[^>]*>live · ', dom), "the page never got an answer from status.json"
    clock = int(re.search(r'id="clock">([\d,]+)<', dom).group(1).replace(",", ""))
    assert clock > 0
    chart = re.search(r'<svg id="rate-chart".*?</svg>', dom, re.S).group(0)
    line = re.search(r'<path class="line" d="M([^"]+)"', chart)
    assert line and len(line.group(1).split(" L")) >= 3  # the updates/s line over several samples
    assert re.search(r'<path class="line2" d="M', chart)  # and λ
    histogram = re.search(r'<svg id="staleness-chart".*?</svg>', dom, re.S).group(0)
    assert len(re.findall(r'<rect class="bar"', histogram)) >= 8
    table = re.search(r'<table id="learners">.*?</table>', dom, re.S).group(0)
    rows = re.findall(r'<tr data-learner="(\d+)"><td>\d+</td><td>([^<]+)</td><td class="state (\w+)">', table)
    assert sorted(name for _, name, _ in rows) == ["learner-0", "learner-1", "learner-2"]
    assert {state for _, _, state in rows} <= {"training", "waiting"}
    loss = re.search(r'<svg id="loss-chart".*?</svg>', dom, re.S).group(0)
    curve = re.search(r'<path class="line" d="M([^"]+)"', loss)
    assert curve and len(curve.group(1).split(" L")) >= 10  # the reported losses, by update
    ticks = re.findall(r'text-anchor="end">([^<]+)%</text>', histogram)
    assert ticks and all(re.fullmatch(r"\d+(\.\d)?", t) for t in ticks), ticks  # round ticks: no 13 %, 38 %
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000  # a drawn page, not a blank one
