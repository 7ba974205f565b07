"""A headless Chromium driven over the DevTools protocol (its ``--remote-debugging-pipe``: no websocket
library, no extra package), enough to take the screenshots of ``docs/make_screenshots.py``: open a page,
set the browser's local storage, wait for text to render, click, capture a PNG."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any


def _high_fds(fds: tuple[int, int]) -> tuple[int, int]:
    """The pipe's ends moved above 4, so that placing them at 3 and 4 in the child cannot overwrite one."""
    moved = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return moved  # type: ignore[return-value]


class Browser:
    """One headless Chromium page. ``chromium`` (Debian's package) or ``google-chrome`` on PATH."""

    def __init__(self, width: int = 1600, height: int = 1000) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if binary is None:
            raise FileNotFoundError("no chromium, chromium-browser or google-chrome on PATH (apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="apao-chromium-")
        to_browser_read, self._to_browser = _high_fds(os.pipe())
        self._from_browser, from_browser_write = _high_fds(os.pipe())

        def pipes_as_fd3_fd4() -> None:  # the protocol's pipe: Chromium reads fd 3, writes fd 4
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        self._process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--hide-scrollbars",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=pipes_as_fd3_fd4,  # the child closes others after preexec_fn
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer, self._next_id = b"", 0
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.resize(width, height)

    def _call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:  # answers and events, NUL-separated; events are not needed here
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed its pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self._call(method, self._session, **params)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str, wait_for: str | None = None, timeout: float = 30.0, settle: float = 1.5) -> None:
        """Navigates to ``url``; waits until the page's text holds ``wait_for`` (fails naming it otherwise)."""
        self.call("Page.navigate", url=url)
        if wait_for:
            self.wait_for_text(wait_for, timeout)
        time.sleep(settle)  # charts and lazy cells draw after the text appears

    def wait_for_text(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in (self.evaluate("document.body ? document.body.innerText : ''") or ""):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{text!r} did not appear within {timeout:.0f} s on {self.evaluate('location.href')}")

    def set_local_storage(self, values: dict[str, Any]) -> None:
        """Writes JSON values into the current origin's local storage (a UI's remembered choices)."""
        for key, value in values.items():
            self.evaluate(f"localStorage.setItem({json.dumps(key)}, {json.dumps(json.dumps(value))})")

    def click_text(self, text: str, selector: str = "a, button, [role=tab], [role=button]") -> None:
        """Clicks the first element matching ``selector`` whose visible text is ``text``."""
        found = self.evaluate(f"""(() => {{
            const hit = [...document.querySelectorAll({json.dumps(selector)})]
                .find(e => e.innerText && e.innerText.trim() === {json.dumps(text)});
            if (hit) hit.click();
            return Boolean(hit);
        }})()""")
        if not found:
            raise LookupError(f"no {selector} with text {text!r} on {self.evaluate('location.href')}")

    def resize(self, width: int, height: int) -> None:
        """Sets the page's viewport (a taller one shows more of a long page; the page lays itself out again)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: str) -> int:
        """Writes a PNG of the viewport; returns its size in bytes."""
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        with open(path, "wb") as file:
            file.write(data)
        return len(data)

    def close(self) -> None:
        try:
            self._call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
