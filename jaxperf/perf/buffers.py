"""What takes the bytes of a compiled program: the TPU compiler's buffer assignment, read back and sorted by kind.

    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile(compiler_options=dump_options(d))   # this one program dumps, nothing else
        assignment = read_dump(d)                                    # None when the compiler wrote no assignment
    report = buffer_report(assignment, compiled.memory_analysis(), top=10)
    print("\n".join(format_buffers(report)))

With the `xla_dump_to` option the compiler writes, next to the optimized HLO, `*buffer-assignment.txt` (every
allocation with the HLO values placed in it at an offset), `*buffer-assignment-values.txt` (the instruction that
defines each value, with jax's metadata: `op_name="state.params['embed_VxD']"` for an argument,
`op_name="jit(step)/transpose(jvp())/.../dot_general"` for an op) and `*live-range.txt` (which values are live at the
program's peak). The option passed to `Lowered.compile(compiler_options=...)` reaches libtpu for that compile alone
(jax 0.10 and 0.12); `LIBTPU_INIT_ARGS=--xla_dump_to` is refused by libtpu and `XLA_FLAGS` would dump every program
of the process.

Kinds, per chip, in HBM (memory space 0; the on-chip VMEM/SMEM allocations are left out):
- parameters: one allocation per argument leaf (weights, optimizer state, batch). Those marked `maybe-live-out` are
  donated: an output reuses the buffer, so they count once, as parameters (`memory_analysis().alias_size_in_bytes`).
- outputs: live-out allocations that are not parameters (the rest of `output_size_in_bytes`).
- temporaries: one preallocated block; values sit in it at offsets and reuse them over time, so the block's size is
  the temporaries' peak with fragmentation, and a slot (offset, size) can hold several values in turn. TPU
  compilers report a larger `temp_size_in_bytes` than the block (scratch added after buffer assignment); the
  difference is shown as such.
- constants; and thread-local scalars of nested computations, which hold no HBM.
Arguments, outputs and aliases add up to `memory_analysis()` exactly; `format_buffers` says so or shows the gap.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections import Counter, defaultdict
from typing import Any

HBM_COLOR = 0
# Ops whose value is a view or a loop-carried name of a buffer another op defined: a slot is named after its producer.
_ALIAS_OPS = {"parameter", "while", "tuple", "get-tuple-element", "bitcast", "conditional", "call",
              "copy-start", "copy-done", "custom-call", "async-start", "async-done", "opt-barrier"}

_ALLOC_RE = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE_RE = re.compile(r"^\s*value: <(\d+) (\S+)( \(phi\))? @(\d+)> \(size=(\d+),offset=(\d+)\): (.*)$")
_VALUE_HEAD_RE = re.compile(r"^<(\d+) (\S+)(?: \(phi\))? @(\d+)>\s*$")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_PEAK_RE = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative")


@dataclasses.dataclass(frozen=True)
class Value:
    """One HLO value placed in an allocation."""
    id: int
    name: str          # the HLO instruction, with the tuple index when not {}: "fusion.39{3}"
    shape: str         # without layout: "f32[4,4,128,512]"; a tuple is "(f32[8], s32[])"
    size: int
    offset: int
    phi: bool = False  # a loop's merge of values (a name, not a buffer of its own)
    op: str = ""       # the defining instruction's opcode, from the values dump ("" without it)
    op_name: str = ""  # jax's metadata: an argument's pytree path or the op's name stack


@dataclasses.dataclass(frozen=True)
class Allocation:
    index: int
    size: int
    color: int                    # memory space: 0 HBM, others on-chip
    kind: str                     # parameter | output | temp | constant | thread-local | other
    parameter: int | None = None  # entry parameter number
    live_out: bool = False        # maybe-live-out: an output uses it (for a parameter: donated)
    values: tuple[Value, ...] = ()


@dataclasses.dataclass(frozen=True)
class BufferAssignment:
    allocations: tuple[Allocation, ...]
    peak_values: frozenset[str] = frozenset()  # values live at the peak (live-range dump), "fusion.3" / "while{2}"


def _strip_layout(shape: str) -> str:
    shape = re.sub(r"/\*[^*]*\*/", "", shape)
    prev = None
    while prev != shape:
        prev, shape = shape, re.sub(r"\{[^{}]*\}", "", shape)
    return shape.strip()


def _after_shape(text: str) -> str:
    """`text` starts with an HLO shape (an array or a parenthesised tuple); what follows it."""
    if not text.startswith("("):
        return text.split(" ", 1)[1] if " " in text else ""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[i + 1:].lstrip()
    return ""


def parse_values(text: str) -> dict[int, tuple[str, str]]:
    """`*buffer-assignment-values.txt` -> {value id: (opcode, op_name)}; a custom call's opcode carries its target."""
    out: dict[int, tuple[str, str]] = {}
    current = None
    for line in text.splitlines():
        m = _VALUE_HEAD_RE.match(line)
        if m:
            current = int(m.group(1))
            continue
        if current is None or not line.startswith(" from instruction: %"):
            continue
        rest = line.split(" = ", 1)[1] if " = " in line else ""
        after = _after_shape(rest)
        op = after.split("(", 1)[0].strip()
        if op == "custom-call":
            t = _TARGET_RE.search(after)
            op = f"custom-call:{t.group(1)}" if t else op
        m = _OP_NAME_RE.search(after)
        op_name = m.group(1).replace("\\'", "'").replace('\\"', '"') if m else ""
        out[current] = (op, op_name)
        current = None
    return out


def parse_peak(text: str) -> frozenset[str]:
    """`*live-range.txt` -> the names of the values live at the peak ("fusion.3", "while.1{2}")."""
    names, inside = set(), False
    for line in text.splitlines():
        if "(peak):" in line:
            inside = True
            continue
        if inside:
            m = _PEAK_RE.match(line)
            if not m:
                break
            names.add(m.group(1).removesuffix("{}"))
    return frozenset(names)


def parse_buffer_assignment(text: str, values_text: str | None = None,
                            live_range_text: str | None = None) -> BufferAssignment:
    """Parse a `*buffer-assignment.txt` dump (and optionally the values and live-range dumps beside it).

    Raises ValueError when the text holds no allocation (not a buffer assignment).
    """
    ops = parse_values(values_text) if values_text else {}
    allocs: list[Allocation] = []
    head: dict[str, Any] | None = None
    values: list[Value] = []

    def close():
        if head is not None:
            allocs.append(Allocation(values=tuple(values), **head))

    for line in text.splitlines():
        m = _ALLOC_RE.match(line)
        if m:
            close()
            values = []
            attrs = re.sub(r"\|[^|]*\|", "", m.group(3))  # shapes may hold any word
            color = re.search(r"\bcolor (\d+)", attrs)
            param = re.search(r"\bparameter (\d+)", attrs)
            live_out = "maybe-live-out" in attrs
            if param:
                kind = "parameter"
            elif "preallocated-temp" in attrs:
                kind = "temp"
            elif "constant" in attrs:
                kind = "constant"
            elif "thread-local" in attrs:
                kind = "thread-local"
            elif live_out or "output shape" in attrs:
                kind = "output"
            else:
                kind = "other"
            head = dict(index=int(m.group(1)), size=int(m.group(2)), color=int(color.group(1)) if color else 0,
                        kind=kind, parameter=int(param.group(1)) if param else None, live_out=live_out)
            continue
        m = _VALUE_RE.match(line)
        if m and head is not None:
            vid = int(m.group(1))
            op, op_name = ops.get(vid, ("", ""))
            values.append(Value(id=vid, name=m.group(2), shape=_strip_layout(m.group(7)), size=int(m.group(5)),
                                offset=int(m.group(6)), phi=bool(m.group(3)), op=op, op_name=op_name))
    close()
    if not allocs:
        raise ValueError("no `allocation N: size S, ...` line: not a buffer-assignment dump")
    return BufferAssignment(tuple(allocs), parse_peak(live_range_text) if live_range_text else frozenset())


def read_dump(directory: str) -> BufferAssignment | None:
    """The buffer assignment the compiler dumped into `directory` (the largest module's, when there are several),
    or None when there is none."""
    found = glob.glob(os.path.join(directory, "*buffer-assignment.txt"))
    if not found:
        return None
    path = max(found, key=os.path.getsize)
    stem = path[:-len("buffer-assignment.txt")]

    def read(p):
        if not os.path.exists(p):
            return None
        with open(p) as f:
            return f.read()

    return parse_buffer_assignment(read(path), read(stem + "buffer-assignment-values.txt"),
                                   read(stem + "live-range.txt"))


def dump_options(directory: str) -> dict[str, Any]:
    """`compiler_options` for `Lowered.compile` that make the compiler dump this one program into `directory`."""
    return {"xla_dump_to": directory}


# ---------------------------------------------------------------------------------------------------------------------
# The report


def _rank(v: Value) -> tuple:
    """Which of the values sharing a slot names it: the op that computes it, not a loop's or a copy's name for it."""
    op = v.op.split(":")[0] if v.op else re.sub(r"[.{].*", "", v.name)
    aliasing = v.phi or op in _ALIAS_OPS or v.name.startswith(("wide.param", "param"))
    return (aliasing, op.startswith("copy"), v.id)


def _short_op_name(op_name: str) -> str:
    """jax's name stack without the noise: "jit(step)/jvp()/while/body/eval_jaxpr/dot_general" ->
    "jvp()/while/body/dot_general"."""
    parts = [p for p in op_name.split("/") if p != "eval_jaxpr"]
    if parts and parts[0].startswith(("jit(", "pjit(")) and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts)


def _display_shape(shape: str) -> str:
    """A tuple's shape can list hundreds of leaves: "(f32[8], s32[], ...)" -> "tuple of 3"."""
    if not shape.startswith("("):
        return shape
    depth, leaves = 0, 1
    for ch in shape[1:-1]:
        depth += ch in "(["
        depth -= ch in ")]"
        leaves += ch == "," and depth == 0
    return f"tuple of {leaves if shape != '()' else 0}"


def _entry(v: Value, size: int, *, sharing: int = 0, **extra) -> dict:
    e = {"hlo": v.name, "op": v.op, "shape": _display_shape(v.shape), "bytes": size,
         "op_name": _short_op_name(v.op_name)}
    if sharing:
        e["values_sharing"] = sharing
    e.update(extra)
    return e


def _argument_rank(v: Value) -> tuple:
    """The entry parameter among the values of an argument's buffer (an op may write a donated one in place): its
    op_name is the argument's pytree path, "state.params['embed_VxD']", not an op's name stack."""
    path = bool(v.op_name) and "/" not in v.op_name and not v.op_name.startswith(("jit(", "pjit("))
    return (v.op != "parameter", not path, v.id)


def _argument_group(op_name: str) -> str:
    """"state.opt_state[1][0].mu['w']" -> "state.opt_state"; "batch['inputs']" -> "batch"."""
    m = re.match(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?", op_name)
    return m.group(0) if m else "other"


def buffer_report(assignment: BufferAssignment, memory_stats: Any = None, top: int = 10) -> dict[str, Any]:
    """Sort the HBM allocations of `assignment` by kind, with the `top` largest buffers of each.

    `memory_stats`: the compiled program's `memory_analysis()` (or a dict of its *_in_bytes fields), to check the
    kinds against; the report's "check" says where they agree and the size of any gap.

    Returns {"bytes": {kind: bytes}, "count": {kind: n}, "arguments_by_group": {...}, "largest": {kind: [...]},
    "temp_by_shape": [...], "on_chip_bytes": {color: bytes}, "check": {...}}.
    """
    hbm = [a for a in assignment.allocations if a.color == HBM_COLOR]
    by_kind: dict[str, list[Allocation]] = defaultdict(list)
    for a in hbm:
        by_kind[a.kind].append(a)
    on_chip = Counter()
    for a in assignment.allocations:
        if a.color != HBM_COLOR:
            on_chip[a.color] += a.size
    peak = assignment.peak_values

    params = sorted(by_kind["parameter"], key=lambda a: -a.size)
    param_entries, groups = [], Counter()
    for a in params:
        v = min(a.values, key=_argument_rank) if a.values else Value(-1, f"parameter {a.parameter}", "?", a.size, 0)
        name = v.op_name or f"parameter {a.parameter}"
        groups[_argument_group(name)] += a.size
        param_entries.append({"name": name, "parameter": a.parameter, "hlo": v.name, "shape": _display_shape(v.shape),
                              "bytes": a.size, "donated": a.live_out})

    outputs = sorted(by_kind["output"], key=lambda a: -a.size)
    out_entries = []
    for a in outputs:
        # the value written last is the one the program returns (earlier ones used the buffer before it)
        v = min(a.values, key=lambda v: (_rank(v)[0], -v.id)) if a.values else Value(-1, f"allocation {a.index}",
                                                                                   "?", a.size, 0)
        out_entries.append(_entry(v, a.size))

    # temporaries: the values of the preallocated block, one entry per slot (offset, size), named by its producer
    slots: dict[tuple[int, int], list[Value]] = defaultdict(list)
    for a in by_kind["temp"]:
        for v in a.values:
            slots[(a.index, v.offset, v.size)].append(v)
    temp_entries = []
    for (_, _, size), vs in slots.items():
        named = min(vs, key=_rank)
        live = bool(peak) and any(v.name in peak for v in vs)
        temp_entries.append(_entry(named, size, sharing=len(vs) - 1, **({"live_at_peak": live} if peak else {})))
    temp_entries.sort(key=lambda e: (-e["bytes"], e["hlo"]))
    shapes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in temp_entries:
        shapes[e["shape"]][0] += 1
        shapes[e["shape"]][1] += e["bytes"]
    temp_by_shape = sorted(({"shape": s, "slots": n, "bytes": b} for s, (n, b) in shapes.items()),
                           key=lambda g: (-g["bytes"], g["shape"]))

    consts = sorted(by_kind["constant"], key=lambda a: -a.size)
    const_entries = [_entry(a.values[0], a.size) for a in consts if a.values]

    def total(kind):
        return sum(a.size for a in by_kind[kind])

    b = {"parameters": total("parameter"), "donated": sum(a.size for a in params if a.live_out),
         "outputs": total("output"), "temp": total("temp"), "constants": total("constant"),
         "thread_local": total("thread-local"), "other": total("other")}
    report = {
        "bytes": b,
        "count": {"parameters": len(params), "outputs": len(outputs), "temp_slots": len(temp_entries),
                  "constants": len(consts)},
        "arguments_by_group": dict(groups.most_common()),
        "largest": {"parameters": param_entries[:top], "outputs": out_entries[:top], "temp": temp_entries[:top],
                    "constants": const_entries[:top]},
        "temp_by_shape": temp_by_shape[:top],
        "on_chip_bytes": {str(c): n for c, n in sorted(on_chip.items())},
        "check": _check(b, memory_stats),
    }
    return report


def _stat(stats: Any, name: str) -> int | None:
    if stats is None:
        return None
    v = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
    return None if v is None else int(v)


def _check(b: dict[str, int], stats: Any) -> dict[str, Any]:
    """The buffer assignment's kinds against the compiler's memory analysis."""
    arg, out = _stat(stats, "argument_size_in_bytes"), _stat(stats, "output_size_in_bytes")
    alias, temp = _stat(stats, "alias_size_in_bytes"), _stat(stats, "temp_size_in_bytes")
    if arg is None:
        return {}
    return {
        "arguments_match": arg == b["parameters"],
        "outputs_match": out == b["outputs"] + b["donated"],
        "aliased_match": alias == b["donated"],
        "compiler_temp": temp,
        # > 0: temporaries the compiler counts that are not in the buffer assignment (scratch added after it)
        "temp_not_in_assignment": (temp - b["temp"]) if temp is not None else None,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Text


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _row(e: dict, label: str) -> str:
    return f"    {_size(e['bytes']):>10}  {e['shape']:<22} {label}"


def _clip(s: str, n: int = 70) -> str:
    """Long names keep their head and their tail, where the op's own name is."""
    return s if len(s) <= n else s[:n // 3] + "..." + s[-(n - n // 3 - 3):]


def _readable(op_name: str) -> str:
    """jax's autodiff names read as the pass they belong to: jvp() is the forward, transpose(jvp()) the backward."""
    for raw, short in (("transpose(jvp())/", "bwd/"), ("jvp()/", "fwd/"), ("while/body/", "loop/")):
        op_name = op_name.replace(raw, short)
    parts = op_name.split("/")  # inner jit(helper) scopes say little next to the op
    return "/".join([p for p in parts[:-1] if not p.startswith("jit(")] + parts[-1:])


def format_buffers(r: dict[str, Any]) -> list[str]:
    """The report of `buffer_report` as lines of text."""
    b, c, check, big = r["bytes"], r["count"], r.get("check") or {}, r["largest"]
    lines = ["largest buffers per chip, by kind (the TPU compiler's buffer assignment; HBM only):"]
    groups = ", ".join(f"{g} {_size(n)}" for g, n in r["arguments_by_group"].items())
    donated = (f"; {_size(b['donated'])} donated (the outputs reuse them)" if b["donated"] else "")
    lines.append(f"  parameters {_size(b['parameters'])} in {c['parameters']} buffers ({groups}){donated}")
    lines += [_row(e, _clip(e["name"]) + (" (donated)" if e["donated"] else "")) for e in big["parameters"]]
    if b["outputs"]:
        lines.append(f"  outputs not aliased to a parameter {_size(b['outputs'])} in {c['outputs']} buffers")
        lines += [_row(e, f"{e['hlo']}  {_clip(_readable(e['op_name']), 50)}".rstrip()) for e in big["outputs"]]
    gap = check.get("temp_not_in_assignment")
    if b["temp"]:
        compiler = (f" (the compiler's temporaries figure {_size(check['compiler_temp'])}: {_size(abs(gap))} "
                    f"{'outside' if gap > 0 else 'less than'} the buffer assignment)" if gap else "")
        peak = ", * live at the peak" if any("live_at_peak" in e for e in big["temp"]) else ""
        lines += [f"  temporaries {_size(b['temp'])}, one preallocated block{compiler}",
                  f"    largest of its {c['temp_slots']} slots (offset, size; a slot holds values in turn), named by "
                  f"the op that writes them{peak}:"]
        for e in big["temp"]:
            mark = "*" if e.get("live_at_peak") else " "
            more = f" (+{e['values_sharing']} values)" if e.get("values_sharing") else ""
            lines.append(_row(e, f"{mark}{e['hlo']}{more}  {_clip(_readable(e['op_name']), 50)}".rstrip()))
        lines.append("    by shape: " + "; ".join(f"{g['slots']} x {g['shape']} {_size(g['bytes'])}"
                                                  for g in r["temp_by_shape"][:5]))
    if b["constants"]:
        lines.append(f"  constants {_size(b['constants'])} in {c['constants']} buffers")
    if check and not (check["arguments_match"] and check["outputs_match"] and check["aliased_match"]):
        lines.append("  (the parameters, outputs and donations above differ from the compiler's memory analysis)")
    return lines
