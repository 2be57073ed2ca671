"""Prepare NVIDIA Dynamo's router (the ``dynamo_kv`` peer, ``benchmarks/peers/eval_dynamo.py``) for the
H200 device, which reaches no registry and takes at most 64 MiB of files a call.

``ai-dynamo-runtime`` 1.6.1's wheel is 75 MB, most of it ``dynamo/_core.abi3.so`` (226 MB
unpacked, debug sections included). This script downloads the wheel, strips the library
(``strip --strip-unneeded``: 174 MB), rebuilds the wheel with every member stored (so that xz
sees the bytes themselves) and its RECORD row for the library rewritten, and xz-compresses it:
about 38 MB. Beside it go the wheels of what Dynamo needs and the device's image lacks, for its
Python 3.12: pydantic and pydantic-core (pinned as Dynamo caps them), annotated-types,
typing-inspection, typing-extensions, and pyzmq (the pool's KV-event publisher and the relay).
uvloop, Dynamo's other need, is in the image.

    python3 -m benchmarks.device.pack_dynamo            # writes .whl-dynamo/ (git-ignored)

``benchmarks/device/setup.sh`` installs them into /tmp/site when ``.whl-dynamo/`` travels
(``carry`` it with ``.whl``; the tree, ``.whl`` and ``.whl-dynamo`` together must stay under
64 MiB). Needs pip with network access, ``strip`` (binutils) and about 1 GB of temporary disk.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import lzma
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DYNAMO = "ai-dynamo-runtime==1.6.1"
LIBRARY = "dynamo/_core.abi3.so"
# Dynamo's needs, at the versions this repository's tests ran with (pydantic <= 2.13.5 is Dynamo's cap).
DEPENDENCIES = ("pydantic==2.13.5", "pydantic-core==2.46.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
                "typing-extensions==4.16.0", "pyzmq==27.3.0")
DEVICE = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
          "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
          "--platform", "manylinux_2_26_x86_64", "--platform", "manylinux_2_28_x86_64")
# x86 branch conversion before LZMA2: a library's relative call targets become absolute, which
# repeat, so the stripped library packs about 6 % smaller than with LZMA2 alone.
FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
BUDGET_MIB = 64  # what one device call carries, the working tree included
# Left for the tracked tree and .whl: the tree is about 22 MiB at d7a6fc1 (18 MB of it the committed
# results' JSON, the figures palette PNGs since), so a call that carries Dynamo (39.2 MiB) has about
# 2 MiB to spare; each new results file takes about 1 MB of it: superseded files must leave the tree.
TREE_MIB = 22


def download(specs: tuple[str, ...], into: Path, needs: bool = False) -> None:
    """The wheels of ``specs`` for the device's Python into ``into``; with ``needs``, what they need too."""
    resolve = ("--platform", "any") if needs else ("--no-deps",)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *resolve, *DEVICE, "-d", str(into), *specs],
                   check=True)


def record_row(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack(wheel: Path, out: Path, tmp: Path, library_name: str = LIBRARY) -> Path:
    """``wheel`` with its library ``library_name`` stripped and every member stored, xz-compressed
    into ``out``."""
    stripped = tmp / "library.so"
    (tmp / "rebuilt").mkdir()
    rebuilt = tmp / "rebuilt" / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as dst:
        names = src.namelist()
        if library_name not in names:
            raise SystemExit(f"{wheel.name} has no {library_name}")
        stripped.write_bytes(src.read(library_name))
        subprocess.run(["strip", "--strip-unneeded", str(stripped)], check=True)
        library = stripped.read_bytes()
        for info in src.infolist():
            data = library if info.filename == library_name else src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [record_row(library_name, library) if row.startswith(library_name + ",") else row
                        for row in data.decode().splitlines()]
                data = ("\n".join(rows) + "\n").encode()
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr = info.external_attr
            dst.writestr(member, data, zipfile.ZIP_STORED)
    packed = out / (wheel.name + ".xz")
    with open(rebuilt, "rb") as f, lzma.open(packed, "wb", filters=FILTERS) as xz:
        shutil.copyfileobj(f, xz, 1 << 20)
    return packed


def fresh_folder(description: str, default: str) -> Path:
    """The ``--out`` folder of a packing script, made and emptied: one version of each wheel, or
    the device's install stops."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(default))
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    return out


def report(out: Path, carries: str) -> int:
    """Print each file of ``out`` and their total (MiB); the total in bytes."""
    files = sorted(out.iterdir())
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    print(f"{total / 2**20:8.2f} MiB  in {out} ({carries})")
    return total


def main() -> int:
    out = fresh_folder(__doc__, ".whl-dynamo")
    with tempfile.TemporaryDirectory(prefix="pack-dynamo-") as tmp:
        download((DYNAMO,), Path(tmp))
        [wheel] = Path(tmp).glob("ai_dynamo_runtime-*.whl")
        packed = repack(wheel, out, Path(tmp))
    download(DEPENDENCIES, out)
    if report(out, f"{packed.name} carries Dynamo") > (BUDGET_MIB - TREE_MIB) * 2**20:
        print(f"warning: leaves under {TREE_MIB} MiB of the {BUDGET_MIB} MiB a device call carries for the "
              f"working tree", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
