"""``probe view`` in a real browser: Model Explorer's server on an exported step,
loaded by headless Chromium (Debian's chromium and chromium-driver), with a
screenshot of the graph it drew.

Needs the ``viewer`` extra (ai-edge-model-explorer), selenium and Chromium;
without them the test skips, unless PROBE_REQUIRE_TOOLS=1 (CI) makes it fail.
"""

from __future__ import annotations

import importlib
import io
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import probe
from tests.conftest import train_steps
from tests.test_graph_export import Net

REQUIRE_TOOLS = os.environ.get("PROBE_REQUIRE_TOOLS") == "1"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
NAN_RED = (0xE5, 0x39, 0x35)  # COLOURS["nonfinite"]: the NaN-count overlay's colour


def _need(what: str, present: bool) -> None:
    if not present:
        if REQUIRE_TOOLS:
            pytest.fail(f"{what} is not installed (PROBE_REQUIRE_TOOLS=1)")
        pytest.skip(f"{what} is not installed")


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        _need(module, False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ViewServer:
    """``probe view`` in a child process; ``url`` is the address it printed."""

    def __init__(self, run: Path, out: Path) -> None:
        self.port = _free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "probe.cli", "view", str(run), "--out", str(out), "--port", str(self.port),
             "--host", "127.0.0.1", "--no-browser"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for_url(timeout=120)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.output.append(line)
            if line.startswith(f"Model Explorer: http://127.0.0.1:{self.port}/"):
                return line.split(": ", 1)[1].strip()
        self.stop()
        raise AssertionError("probe view printed no address:\n" + "".join(self.output))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _browser():
    webdriver = _import("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1400,900",
                 # No GPU here: WebGL through SwiftShader, Chromium's CPU renderer.
                 "--use-angle=swiftshader", "--enable-unsafe-swiftshader"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("viewer") / "run"
    torch.manual_seed(0)
    model = Net()
    with probe.mode(["stats", "free_benchmark"], out=path, model=model, perturb="add_noise") as session:
        train_steps(model, 1, session=session)
    return path


def _colour_near(colours, rgb, tolerance=12) -> int:
    """Pixels within ``tolerance`` of ``rgb``; ``colours`` as PIL's ``getcolors`` gives them."""
    return sum(n for n, c in colours if all(abs(a - b) <= tolerance for a, b in zip(c[:3], rgb, strict=True)))


def test_viewer_renders_the_exported_graph_in_chromium(nan_run, tmp_path):
    _import("model_explorer")
    _import("PIL")
    _need("Chromium", Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER) is not None)
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    server = ViewServer(nan_run, tmp_path / "view")
    browser = _browser()
    try:
        browser.get(server.url)
        wait = WebDriverWait(browser, 120)
        canvas = wait.until(expected_conditions.visibility_of_element_located(
            (By.CSS_SELECTOR, "webgl-renderer canvas")))
        webgl = browser.execute_script(
            "return !!document.createElement('canvas').getContext('webgl2')")
        assert webgl, "Chromium offers no WebGL2 here (SwiftShader missing?)"
        # The graph is drawn once its layout (in a web worker) is done: wait for pixels.
        colours: list = []

        def drawn(_) -> bool:
            nonlocal colours
            image = Image.open(io.BytesIO(canvas.screenshot_as_png)).convert("RGB")
            colours = image.getcolors(maxcolors=1 << 24)
            return len(colours) > 20

        wait.until(drawn, "the graph canvas stayed blank")
        browser.save_screenshot(str(tmp_path / "viewer.png"))
        page = browser.find_element(By.TAG_NAME, "body").text
        assert "Failed" not in page and "error" not in page.lower(), page[:2000]
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
                  and "127.0.0.1" in e["message"]]
        assert not severe, severe
        # Our collection and overlays were served, and the viewer opened where the NaN
        # is: the forward graph, its log op selected, coloured by the NaN-count overlay.
        log = next(op for op in probe.load(nan_run).ops(0) if op.name == "aten.log.default")
        assert "run step 0 rank 0" in page and "forward" in page
        assert log.id in page, page[:2000]
        assert "nan-inf count" in page and "free-benchmark verdict" in page, page[:2000]
        assert _colour_near(colours, NAN_RED) > 100, "no node coloured by the NaN overlay"
    finally:
        browser.quit()
        server.stop()
