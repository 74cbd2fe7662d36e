"""Keep one GPU architecture's code in CUDA shared objects, so that a CUDA wheel fits a small upload.

fbgemm-gpu's CUDA wheel (~465 MB, 2.5 GB unpacked) carries machine code for sm_80, sm_90 and
sm_100 in each `.so`'s `.nv_fatbin` section. This zeroes the payload of every fatbin entry whose
architecture is not kept (headers stay, so offsets and the ELF are unchanged): the CUDA runtime picks
the kept architecture's entry and never reads the others, and the zeros compress to nothing
(`xz`: 82 MB for all of fbgemm-gpu 1.6.0 with sm_90 kept).

    python scripts/gpu/prune_fatbin.py list 90 DIR/*.so
    python scripts/gpu/prune_fatbin.py prune 90 DIR/*.so      # in place

Fatbin layout (as read from the files; NVIDIA does not document it): a container header
(u32 magic 0xBA55ED50, u16 version, u16 header size, u64 entries' size), then entries, each a header
(u16 kind: 1 PTX, 2 ELF; u16; u32 header size; u64 payload size; ...; u32 arch at offset 28)
followed by its payload.
"""

from __future__ import annotations

import collections
import mmap
import struct
import subprocess
import sys
from collections.abc import Iterator

MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int] | None:
    """File offset and size of `path`'s `.nv_fatbin` section, or None (uses binutils' readelf)."""
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    return None


def entries(buf, offset: int, size: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(entry offset, kind, header size, payload size, arch) of every entry in the section."""
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header, body = struct.unpack_from("<IHHQ", buf, pos)
        if magic != MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entry, container_end = pos + header, pos + header + body
        while entry < container_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", buf, entry)
            if entry_header == 0:
                break
            yield entry, kind, entry_header, payload, struct.unpack_from("<I", buf, entry + 28)[0]
            entry += entry_header + payload
        pos = container_end


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("list", "prune"):
        print(__doc__, file=sys.stderr)
        return 2
    prune, keep = argv[0] == "prune", {int(a) for a in argv[1].split(",")}
    for path in argv[2:]:
        section = fatbin_section(path)
        if section is None:
            continue
        with open(path, "r+b" if prune else "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE if prune else mmap.ACCESS_READ)
            sizes: collections.Counter = collections.Counter()
            zeroed = 0
            for entry, kind, header, payload, arch in entries(buf, *section):
                sizes[f"{'ptx' if kind == 1 else 'sm'}_{arch}"] += payload
                if prune and arch not in keep:
                    buf[entry + header : entry + header + payload] = bytes(payload)
                    zeroed += payload
            buf.flush()
            buf.close()
        per_arch = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(sizes.items()))
        print(f"{path}: {per_arch}; zeroed {zeroed / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
