"""Read the collectives XLA put into a compiled program (``compiled.as_text()``)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "s16": 2, "s8": 1, "u64": 8,
           "u32": 4, "u16": 2, "u8": 1, "pred": 1, "c64": 8, "c128": 16}
# "%name = f32[8,16]{1,0} all-reduce(" or "= (f32[8], f32[4]) all-reduce-start(" ...
_LINE = re.compile(r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|\bbranch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    kind: str
    result_bytes: int
    """Bytes of the collective's result (per device)."""
    line: str
    in_loop_body: bool = False
    """Whether it runs in the body of a ``while`` (once per iteration, e.g. per micro-batch): in the body
    computation or in one it calls (a conditional's branch, a call)."""


def collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective op in an HLO module text, in program order (async pairs counted once)."""
    bodies = _called_from(set(_WHILE_BODY.findall(hlo_text)), hlo_text)
    found = []
    computation = None
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            computation = start.group(1)
        m = _LINE.search(_COMMENT.sub("", line))  # tuple shapes carry /*index=5*/ comments
        if not m:
            continue
        nbytes = 0
        for dtype, dims in _ARRAY.findall(m.group("shape")):
            if dtype in _DTYPES:
                size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
                nbytes += size * _DTYPES[dtype]
        found.append(HloCollective(kind=m.group("op"), result_bytes=nbytes, line=line.strip(),
                                   in_loop_body=computation in bodies))
    return found


def _called_from(roots: set[str], hlo_text: str) -> set[str]:
    """``roots`` and the computations they call, directly or through others."""
    calls: dict[str, set[str]] = {}
    computation = None
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            computation = start.group(1)
        for name, branches in _CALLED.findall(line):
            names = [name] if name else [b.strip().lstrip("%") for b in branches.split(",")]
            calls.setdefault(computation, set()).update(names)
    reached, stack = set(roots), list(roots)
    while stack:
        for callee in calls.get(stack.pop(), ()):
            if callee not in reached:
                reached.add(callee)
                stack.append(callee)
    return reached


def count_by_kind(hlo_text: str) -> dict[str, int]:
    counts = {k: 0 for k in COLLECTIVE_KINDS}
    for c in collectives(hlo_text):
        counts[c.kind] += 1
    return counts


def reduced_bytes_by_piece(pipeline_hlo_text: str) -> dict[tuple[int, str], int]:
    """Per ``(stage, phase)`` piece of a pipeline executable's ``get_hlo_text()`` (pieces headed
    ``// stage <q> <phase>``), the bytes its all-reduces and reduce-scatters produce per device."""
    reduced = {}
    for part in pipeline_hlo_text.split("// stage ")[1:]:
        stage, phase = part.split(None, 2)[:2]
        reduced[(int(stage), phase)] = sum(c.result_bytes for c in collectives(part)
                                           if c.kind in ("all-reduce", "reduce-scatter"))
    return reduced
