"""The stack to stage for the GPU machine: the pins of the Makefile, and the torch fbgemm-gpu needs.

    python scripts/gpu/pins.py                          # torch=2.14.1 fbgemm=1.9.0 torchrec=1.9.2
    python scripts/gpu/pins.py --stack 1.8 --format shell
    python scripts/gpu/pins.py --fbgemm-init DIR/fbgemm_gpu/__init__.py --fbgemm 1.9.0   # 2.14
    python scripts/gpu/pins.py --fbgemm-init DIR/fbgemm_gpu/__init__.py --torch 2.11.0   # 1.6

The Makefile has either one pin a line (`TORCH_PIN := torch==2.13.0`, `FBGEMM_cuda :=
fbgemm-gpu==1.8.0`, `TORCHREC_PIN := torchrec==1.8.0`) or one stack a line (`STACK_1.9 := 2.14.1
1.9.0 1.9.2`: torch, fbgemm, torchrec) with the default stack in `TORCHREC ?= 1.9`. fbgemm is built
for one torch release: its `fbgemm_gpu/__init__.py` names it in `_fbgemm_torch_compat_table`
(fbgemm minor version -> torch minor version).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

__all__ = ["Pins", "fbgemm_for_torch", "read_pins", "torch_for_fbgemm"]


@dataclasses.dataclass(frozen=True, slots=True)
class Pins:
    """One stack: the versions of torch, fbgemm-gpu and torchrec pinned together."""

    torch: str
    fbgemm: str
    torchrec: str
    stack: str
    """The stack's name (`TORCHREC=` of the Makefile), or "pins" for one pin a line."""


class PinsError(ValueError):
    """The Makefile or fbgemm's table does not say what was asked."""


def _assignments(makefile: str) -> dict[str, str]:
    out = {}
    for line in makefile.splitlines():
        m = re.match(r"^\s*([A-Za-z_][\w.]*)\s*(:=|\?=|=)\s*(.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(3)
    return out


def read_pins(makefile: str, stack: str | None = None) -> Pins:
    """The stack `stack` (None: the Makefile's default) of the Makefile's text `makefile`.

    Raises:
        PinsError: no pins found, an unknown stack, or a pin that is not a literal version.
    """
    values = _assignments(makefile)
    stacks = {k.removeprefix("STACK_"): v.split() for k, v in values.items() if k.startswith("STACK_")}
    stacks = {k: v for k, v in stacks.items() if len(v) == 3 and "$" not in k}
    if stacks:
        name = stack or values.get("TORCHREC")
        if name not in stacks:
            raise PinsError(f"stack {name!r} is not in the Makefile; it has {sorted(stacks)}")
        return Pins(*stacks[name], stack=name)
    if stack is not None:
        raise PinsError(f"the Makefile pins one stack (no STACK_<version> lines): drop --stack {stack}")
    pins = []
    for key, package in (("TORCH_PIN", "torch"), ("FBGEMM_cuda", "fbgemm-gpu"), ("TORCHREC_PIN", "torchrec")):
        value = values.get(key)
        m = re.fullmatch(rf"{re.escape(package)}==([\w.+]+)", value or "")
        if m is None:
            raise PinsError(f"cannot read {key} from the Makefile ({value!r}); expected {package}==X.Y.Z")
        pins.append(m.group(1))
    return Pins(*pins, stack="pins")


def _compat_table(init_text: str) -> dict[str, str]:
    m = re.search(r"_fbgemm_torch_compat_table\s*=\s*\{(.*?)\}", init_text, re.S)
    if m is None:
        raise PinsError("fbgemm_gpu/__init__.py has no _fbgemm_torch_compat_table")
    return dict(re.findall(r"\"([\d.]+)\"\s*:\s*\"([\d.]+)\"", m.group(1)))


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def torch_for_fbgemm(init_text: str, fbgemm: str) -> str:
    """The torch minor version (e.g. "2.14") fbgemm-gpu `fbgemm` is built for, from the text of its
    `fbgemm_gpu/__init__.py`.

    Raises:
        PinsError: the table is missing or has no entry for `fbgemm`.
    """
    table = _compat_table(init_text)
    if _minor(fbgemm) not in table:
        raise PinsError(f"fbgemm's table has no entry for {fbgemm}: it has {sorted(table)}")
    return table[_minor(fbgemm)]


def fbgemm_for_torch(init_text: str, torch: str) -> str:
    """The fbgemm-gpu minor version (e.g. "1.6") built for torch `torch` (e.g. the GPU image's).

    Raises:
        PinsError: no fbgemm in the table is built for that torch.
    """
    found = [f for f, t in _compat_table(init_text).items() if t == _minor(torch)]
    if not found:
        raise PinsError(f"no fbgemm-gpu in fbgemm's table is built for torch {torch}")
    return max(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--makefile", default="Makefile", help="the Makefile with the pins")
    parser.add_argument("--stack", help="the stack to read (a Makefile of STACK_<version> lines)")
    parser.add_argument("--format", choices=("text", "shell"), default="text")
    parser.add_argument("--fbgemm-init", help="fbgemm_gpu/__init__.py of the fbgemm to ask")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--fbgemm", help="with --fbgemm-init: print the torch this fbgemm needs")
    group.add_argument("--torch", help="with --fbgemm-init: print the fbgemm built for this torch")
    args = parser.parse_args(argv)
    try:
        if args.fbgemm_init or args.fbgemm or args.torch:
            if not (args.fbgemm_init and (args.fbgemm or args.torch)):
                parser.error("--fbgemm-init goes with --fbgemm or --torch")
            text = Path(args.fbgemm_init).read_text()
            print(torch_for_fbgemm(text, args.fbgemm) if args.fbgemm else fbgemm_for_torch(text, args.torch))
            return 0
        pins = read_pins(Path(args.makefile).read_text(), args.stack)
    except (PinsError, OSError) as e:
        print(f"pins.py: {e}", file=sys.stderr)
        return 1
    if args.format == "shell":
        print(f"TORCH={pins.torch} FBGEMM={pins.fbgemm} TORCHREC={pins.torchrec} STACK={pins.stack}")
    else:
        print(f"torch={pins.torch} fbgemm={pins.fbgemm} torchrec={pins.torchrec} stack={pins.stack}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
