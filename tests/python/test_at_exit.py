#!/usr/bin/python3
"""membox.torch._at_exit on its own: the owners still registered are
stopped at Python's exit, newest first, before the hooks registered before
`import membox` (membox's core stops its completion thread in one of them); a forgotten or collected owner is not; a stop that
raises is a warning and the others still run. Skips (77) without torch."""
import os
import subprocess
import sys
import unittest

try:
    import torch  # noqa: F401 - membox.torch needs it
except ImportError:
    print("SKIP: needs torch")
    sys.exit(77)

SCRIPT = r"""
import atexit, gc
def last():  # registered before membox (and its core's hook): runs after
    print("LAST", STOPPED, flush=True)
atexit.register(last)
STOPPED = []
import membox
from membox.torch import _at_exit

class Owner:
    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail
    def stop(self):
        STOPPED.append(self.name)
        print("STOP", self.name, flush=True)
        if self.fail:
            raise RuntimeError("cannot stop " + self.name)

a, b, c, d = Owner("a"), Owner("b", fail=True), Owner("c"), Owner("d")
for o in (a, b, c, d):
    _at_exit.end_at_exit(o, Owner.stop)
_at_exit.end_at_exit(a, Owner.stop)  # twice: still once, at its first place
_at_exit.forget(c)
del d, o
gc.collect()
print("MAIN DONE", flush=True)
"""


class AtExitTest(unittest.TestCase):
    def test_stops_newest_first_forgotten_and_collected_skipped(self):
        p = subprocess.run([sys.executable, "-c", SCRIPT],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONWARNINGS="always"))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        lines = p.stdout.split("\n")
        self.assertEqual(
            [ln for ln in lines if ln.startswith(("STOP", "MAIN", "LAST"))],
            ["MAIN DONE", "STOP b", "STOP a",
             "LAST ['b', 'a']"])
        self.assertIn("membox: stopping Owner at exit: cannot stop b",
                      p.stderr)


if __name__ == "__main__":
    unittest.main()
