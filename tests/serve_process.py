"""`ladechat serve` as a real process on a loopback port, for the tests that speak to it."""

import os
import re
import signal
import subprocess
import threading

from conftest import ladechat_bin


class Server:
    """A `ladechat serve` subprocess; `lines` collects its stderr (the log). port 0: a free one."""

    def __init__(self, *args, port: int = 0):
        self.proc = subprocess.Popen([ladechat_bin(), "serve", "--port", str(port), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1"})
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(300):
            self.stop()
            raise RuntimeError("ladechat serve did not start:\n" + "\n".join(self.lines))
        self.url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", self.lines[-1]).group(1)
        self.port = int(self.url.split(":")[2].split("/")[0])
        self.base = self.url.removesuffix("/v1")

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "ladechat serve ·" in line:
                self.ready.set()

    def rss_mib(self) -> float:
        """The server process's resident memory now."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024

    def stop(self):
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self):
        """kill -9: the server is gone at once, mid-answer or not."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.join(10)
