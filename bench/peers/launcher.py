"""One benchmark child process, run by its parent (torch_smallcard.py, torch_train.py): its
output passed on to the parent's stderr as it comes, but for the line that carries its result
(a prefix and a JSON object on stdout), which is parsed."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any, Dict, List, Tuple


def launch(argv: List[str], env: Dict[str, str], timeout: float, prefix: str) -> Tuple[Dict[str, Any], List[str]]:
    """(result, stderr lines) of the child argv: the last line of its stdout that starts with
    prefix, parsed, or {"error": why} when there is none (it exited without one, or was killed
    after timeout seconds); either way with "rc", its exit status."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: List[str] = []
    err: List[str] = []

    def pump(pipe: Any, lines: List[str]) -> None:
        for line in pipe:
            lines.append(line)
            if not line.startswith(prefix):
                sys.stderr.write(line)

    pumps = [threading.Thread(target=pump, args=(proc.stdout, out)),
             threading.Thread(target=pump, args=(proc.stderr, err))]
    for th in pumps:
        th.start()
    try:
        rc = proc.wait(timeout=timeout)
        why = f"exited {rc} without a result"
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        why = f"killed after {timeout:g} s"
    for th in pumps:
        th.join()
    results = [ln for ln in out if ln.startswith(prefix)]
    r = json.loads(results[-1][len(prefix):]) if results else dict(error=why)
    r["rc"] = rc
    return r, err
