"""The private directory of a host's KV-event sockets (``ipc://``), when no endpoint is given.

Mode 0700 in the temporary directory, named after the serving process
(``lmpool-kv-<pid>-<random>``): the server removes it when it stops, and a SIGKILLed server's is
removed by the next start of one, as a dead pool's shared memory is swept. Only this user's
directories whose process is gone are touched.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from lmpool_ipc.lifecycle import pid_alive

PREFIX = "lmpool-kv-"


def make() -> str:
    sweep()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep() -> None:
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-*")):
        owner = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
        try:
            mine = os.lstat(path).st_uid == os.getuid()
        except OSError:
            continue
        if mine and owner.isdigit() and not pid_alive(int(owner)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
