#!/usr/bin/env python3
"""dashboard_check.py: opens a running swarm's dashboard in headless Chromium and checks it
through the DOM (tests/integration/test_observability.cpp runs it).

Drives Chromium over the DevTools protocol with the standard library only (a small WebSocket
client below): waits until every stage column shows its peers and the loss chart has at least
two points, checks the header, the peer cards and the timeline, saves dashboard.png, kills
--kill-pid (a stage server named --kill-name), waits until its card leaves the page and a fault
about it is on the timeline, and saves dashboard-after-kill.png. Prints a JSON report; exits 1
with the reason on the first failed check.
"""
import argparse
import base64
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request


class WebSocket:
    """A client WebSocket (RFC 6455): text frames out (masked), whole messages in."""

    def __init__(self, url, timeout):
        assert url.startswith("ws://"), url
        hostport, path = url[5:].split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("DevTools closed the WebSocket handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError("DevTools refused the WebSocket: " + head.decode(errors="replace"))
        self.buf = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("DevTools closed the WebSocket")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text):
        data = text.encode()
        head = bytes([0x81])
        if len(data) < 126:
            head += bytes([0x80 | len(data)])
        elif len(data) < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", len(data))
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", len(data))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            if b0 & 0x0F == 0x8:
                raise RuntimeError("DevTools closed the WebSocket")
            if b0 & 0x0F in (0x9, 0xA):  # ping, pong: not part of a message
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()


class Page:
    """One tab, commanded over the DevTools protocol."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError("script error: " + json.dumps(r["exceptionDetails"]))
        return r["result"].get("value")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


# What the page shows, read through the DOM in one go.
STATE_JS = """(() => {
  const q = s => document.querySelector(s), qa = s => [...document.querySelectorAll(s)];
  // Still loading, or between two renders of the page (an element may be replaced mid-read).
  if (['#job-name', '#job-state', '#live', '#step', '#train-loss', '#tokens-per-s', '#loss-chart', '#tps-chart']
        .some(s => !q(s))) return null;
  return {
    job: q('#job-name').textContent, state: q('#job-state').textContent, live: q('#live').textContent,
    step: q('#step').textContent, train_loss: q('#train-loss').textContent, tokens: q('#tokens-per-s').textContent,
    microbatches: q('#mb') ? q('#mb').textContent : '',
    loss_points: Number(q('#loss-chart').dataset.points),
    // Lines the browser draws: SVG elements with a length on the screen.
    loss_lines: qa('#loss-chart polyline').filter(l => l instanceof SVGPolylineElement && l.getBoundingClientRect().width > 0).length,
    tps_points: Number(q('#tps-chart').dataset.points),
    stages: qa('#stages .stage').map(s => ({stage: s.dataset.stage, peers: qa('#stages .stage[data-stage="' + s.dataset.stage +
             '"] .peer').map(p => ({name: p.dataset.peer, state: p.dataset.state, text: p.textContent}))})),
    timeline: qa('#timeline li').map(li => ({kind: li.dataset.kind, text: li.textContent})),
  };
})()"""


def fail(msg, state=None):
    print(json.dumps({"ok": False, "error": msg, "page": state}, indent=1))
    sys.exit(1)


def wait_for(page, what, pred, timeout_s):
    t0 = time.time()
    state = None
    while time.time() - t0 < timeout_s:
        state = page.eval(STATE_JS)
        if state is not None and pred(state):
            return state, time.time() - t0
        time.sleep(0.25)
    fail(f"timed out after {timeout_s} s waiting for {what}", state)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="the dashboard, http://HOST:PORT/")
    ap.add_argument("--out", required=True, help="folder for the screenshots")
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--kill-pid", type=int, required=True)
    ap.add_argument("--kill-name", required=True)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    a = ap.parse_args()

    profile = tempfile.mkdtemp(prefix="swarm-chromium-")
    # --no-sandbox: tests may run as root in a container, where Chromium's sandbox cannot start.
    browser = subprocess.Popen([a.chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1",
                                "--remote-debugging-port=0", "--user-data-dir=" + profile, "--window-size=1366,900",
                                "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        t0 = time.time()
        while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
            if browser.poll() is not None or time.time() - t0 > 30:
                fail("Chromium did not start its DevTools server")
            time.sleep(0.1)
        port = int(open(port_file).read().split("\n")[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        tab = next(t for t in targets if t["type"] == "page")
        page = Page(WebSocket(tab["webSocketDebuggerUrl"], timeout=30))
        page.call("Page.enable")
        page.call("Page.navigate", url=a.url)

        def ready(s):
            return (s["loss_points"] >= 2 and len([c for c in s["stages"] if c["stage"] != "none"]) >= a.stages and
                    all(len(c["peers"]) > 0 for c in s["stages"]) and
                    any(p["name"] == a.kill_name for c in s["stages"] for p in c["peers"]))
        before, waited = wait_for(page, "every stage with its peers and two loss points", ready, a.timeout)
        # The page's content, as a person would read it.
        if before["state"] not in ("running", "loading"):
            fail("job state shows " + before["state"], before)
        if before["live"] != "live":
            fail("the page does not say it is live", before)
        if "job" not in before["job"] or before["train_loss"] == "-" or before["step"] == "-":
            fail("the header lacks the job, its step or its loss", before)
        if not re.search(r"[0-9,]+ in flight of at most [0-9,]+ \([0-9,]+ at the router\)", before["microbatches"]):
            fail("the header does not say how many microbatches are in flight, of how many at most", before)
        if before["loss_lines"] < 1:
            fail("the loss chart draws no line", before)
        for c in before["stages"]:
            for p in c["peers"]:
                if p["name"] not in p["text"] or p["state"] not in p["text"] or "queue" not in p["text"]:
                    fail(f"peer card {p['name']} lacks its name, state or queue", before)
        # A job this long has had rounds and evaluations (eval.every_steps) by the time the loss
        # has points; the timeline shows the newest events.
        if not any(e["kind"] in ("round", "eval", "job") for e in before["timeline"]):
            fail("the timeline shows no round, evaluation or job event", before)
        page.screenshot(os.path.join(a.out, "dashboard.png"))

        os.kill(a.kill_pid, signal.SIGKILL)
        t_kill = time.time()

        seen_fault = []   # the fault's line, once any look at the page showed it (newer events push it down the list)

        def gone(s):
            names = [p["name"] for c in s["stages"] for p in c["peers"]]
            seen_fault.extend(e["text"] for e in s["timeline"] if e["kind"] == "fault" and a.kill_name in e["text"])
            return a.kill_name not in names and seen_fault
        after, _ = wait_for(page, f"{a.kill_name} to leave the page and its fault to reach the timeline", gone, 30)
        left_s = time.time() - t_kill
        page.screenshot(os.path.join(a.out, "dashboard-after-kill.png"))
        print(json.dumps({"ok": True, "waited_s": round(waited, 1), "peer_left_after_s": round(left_s, 1),
                          "loss_points": after["loss_points"], "stages": [[p["name"] for p in c["peers"]] for c in after["stages"]],
                          "fault": seen_fault[0],
                          "screenshots": [os.path.join(a.out, "dashboard.png"), os.path.join(a.out, "dashboard-after-kill.png")]},
                         indent=1))
    finally:
        try:
            os.killpg(browser.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
