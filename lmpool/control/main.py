"""The control process's entry point: ``LMPOOL_SPEC=SPEC_JSON python -m lmpool.control.main``
(see ``lmpool.protocol.spec``) reads its spec, builds the control plane and runs it on uvloop."""

from __future__ import annotations

import sys

import uvloop

from lmpool.control.build import build_control_plane
from lmpool.protocol.spec import ControlSpec, read_spec


def main() -> None:
    spec = read_spec(ControlSpec)
    sys.exit(uvloop.run(build_control_plane(spec).run()))


if __name__ == "__main__":
    main()
