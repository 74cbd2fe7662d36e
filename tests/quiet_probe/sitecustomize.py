"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder (the quiet-default
test puts it there). It only observes: each start of a process (the audit events below) is written,
with the Python stack that started it, as one JSON line to the file named by QUIET_PROBE_LOG."""

import json
import os
import sys

_EVENTS = {"subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty"}
_ARGV = {  # the started command's arguments, out of each event's own arguments
    "subprocess.Popen": lambda a: a[1],
    "os.system": lambda a: a[0],
    "os.posix_spawn": lambda a: a[1],
    "os.exec": lambda a: a[1],
    "os.spawn": lambda a: a[2],
}
_LOG = os.environ.get("QUIET_PROBE_LOG")


def _hook(event, args):
    if event not in _EVENTS or not _LOG:
        return
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}")
        frame = frame.f_back
    argv = _ARGV.get(event, lambda a: [])(args)
    argv = [argv] if isinstance(argv, (str, bytes)) else list(argv or [])
    record = {"pid": os.getpid(), "event": event, "argv": [str(a) for a in argv], "stack": frames}
    with open(_LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


sys.addaudithook(_hook)
