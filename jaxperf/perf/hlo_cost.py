"""HBM bytes and collective bytes per chip of a compiled XLA program, read from its optimized HLO text, with loops
counted as many times as they run.

    costs = hlo_costs(compiled.as_text())
    costs.hbm_bytes                     # bytes every top-level op reads and writes, loop bodies x trip count
    costs.collectives["all-gather"]     # {"ops": 64, "bytes": ..., "wire_bytes": ...}

Why not `compiled.cost_analysis()["bytes accessed"]`: it visits the body of a `while` loop once, so a scanned layer
stack is counted as one layer, and it counts a custom call (a Pallas kernel) as moving nothing. This walk fixes both.

The model of memory traffic (the same one XLA's own cost analysis uses for a fusion): every op left at the top level
after fusion is one kernel that reads each of its operands from HBM once and writes its results once. Within a fusion,
an operand that is only sliced (dynamic-slice, slice, gather) costs the bytes of the slices, and a result written by
an in-place dynamic-update-slice costs the bytes of the update, not of the whole buffer (a scan stacking one layer's
residuals into an [n_layers, ...] array touches one layer's worth per step; XLA:GPU runs such fusions async, as
fusion-start/fusion-done, charged the same way). An async slice (`slice-start`: the TPU compiler's prefetch of a
piece of a buffer into VMEM) reads the piece, not the buffer. A multi-output fusion's result that aliases an operand
(`output_to_operand_aliasing`) and is that operand's parameter passed through moves nothing, nor does the in-flight
collective an async collective fusion carries through its continuations and its done (below): the buffer it fills is
written once, charged at its start. Ops that move nothing are free
(parameter, constant, tuple, get-tuple-element, bitcast, the loop and call ops themselves, buffer allocations). A
Pallas kernel is charged its operands and results once: a lower bound for kernels that re-read a block (flash
attention reads K and V once per query block).

Loops: a computation's multiplicity is the product of the trip counts of the loops around it. The trip count is read
from `known_trip_count` when XLA printed one, else from the loop condition (`i < N`, `i != N`, ...), the induction
variable's initial constant in the loop's input tuple and its constant step in the body. A loop whose count cannot be
read is counted once and named in `unknown_trip_counts`.

Kernels (`costs.kernels`): every top-level op charged bytes, with its FLOPs, for a model that runs kernels one
after another (a GPU stream; jaxperf.perf.predict). FLOPs are counted where the work is matrix work: a `dot` (alone or
inside a fusion: XLA's Triton GEMM fusions) is 2 x its result's elements x its contracting size; a cuBLAS call
(`__cublas$gemm`, `__cublas$lt$matmul`) the same, read from its backend config; a cuDNN fused attention
(`__cudnn$fmha...`) 4 B H Lq Lk D forward (two matmuls) and 10 B H Lq Lk D backward (five: the scores recomputed, dV,
dP, dQ, dK), halved under a causal mask. The scratch workspace a cuBLAS or cuDNN call returns (its last, s8/u8 result)
is allocated, not read or written in full, and is not charged.

Collectives (all-gather, reduce-scatter, all-reduce, all-to-all, ragged-all-to-all, collective-permute, their async
-start forms): `bytes` is the array size of the collective (all-gather: the gathered result; reduce-scatter,
all-reduce, all-to-all: the input; ragged-all-to-all, whose rows sent the routing decides at run time: the smaller
of its data and output buffers, what expert parallelism sends under balanced routing), and `wire_bytes` what one
chip sends over its links with bandwidth-optimal algorithms on a group of n chips: (n-1)/n x bytes for all-gather,
reduce-scatter and the all-to-alls (a ragged one: as if balanced), 2(n-1)/n x bytes for all-reduce (a
reduce-scatter then an all-gather), bytes for a collective-permute. n comes from the op's replica groups.
The TPU compiler's async collective fusion splits one collective over several fusions that each hold a copy of it
under the same `channel_id`: the start (its root the custom call `AsyncCollectiveStart`), continuations fused with
the compute it overlaps, and the done. The collective moves its bytes once: it is counted in the start only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
# `%name = SHAPE opcode(operands), attrs` (ROOT optional). The shape is an array or a (possibly nested) tuple.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "opt-barrier", "iota", "get-dimension-size", "domain",
         "add-dependency"}
_SLICERS = {"dynamic-slice", "slice", "gather"}


def shape_bytes(shape: str, *, hbm_only: bool = False) -> float:
    """Bytes of every array in an HLO shape string (a tuple's elements summed). `hbm_only` leaves out arrays whose
    layout places them in another memory space (`S(1)`: on TPUs the on-chip VMEM, not HBM)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        space = _MEMORY_SPACE.search(layout or "")
        if hbm_only and space and space.group(1) != "0":
            continue
        total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the opcode's parentheses (a constant's value, a parameter's number)
    root: bool = False

    @property
    def bytes(self) -> float:
        """Bytes of the result that live in HBM."""
        return shape_bytes(self.shape, hbm_only=True)

    @property
    def all_bytes(self) -> float:
        return shape_bytes(self.shape)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    params: dict[int, str] = field(default_factory=dict)  # parameter number -> instruction name
    root: str | None = None


def _split_operands(text: str) -> tuple[list[str], str, str]:
    """The operand names of `opcode(` ..., the text inside the parentheses and the attribute text after them."""
    depth, end = 1, len(text)
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                end = i
                break
    inside, attrs = text[:end], text[end + 1:]
    return re.findall(r"%([\w.\-]+)", inside), inside, attrs


def parse_hlo(text: str) -> tuple[dict[str, Computation], str, int]:
    """(computations by name, the entry computation's name, num_partitions) of an HLO module's text."""
    comps: dict[str, Computation] = {}
    entry, comp = "", None
    m = re.search(r"num_partitions=(\d+)", text)
    partitions = int(m.group(1)) if m else 1
    for line in text.splitlines():
        if comp is None:
            head = _COMP.match(line)
            if head:
                comp = Computation(head.group(2))
                comps[comp.name] = comp
                if head.group(1):
                    entry = comp.name
            continue
        if line.strip() == "}":
            comp = None
            continue
        mi = _INSTR.match(line)
        if not mi:
            continue
        name, shape, opcode, rest = mi.groups()
        operands, args, attrs = _split_operands(rest)
        ins = Instr(name, shape, opcode, operands, attrs, args, root=line.lstrip().startswith("ROOT"))
        comp.instrs[name] = ins
        if opcode == "parameter":
            comp.params[int(args)] = name
        if ins.root:
            comp.root = name
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry, partitions


def _through_copies(comp: Computation, name: str) -> Instr | None:
    ins = comp.instrs.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = comp.instrs.get(ins.operands[0])
    return ins


def _constant(ins: Instr | None) -> int | None:
    if ins is None or ins.opcode != "constant" or not re.fullmatch(r"\s*-?\d+\s*", ins.args):
        return None
    return int(ins.args)


def _gte_index(comp: Computation, ins: Instr | None) -> int | None:
    ins = _through_copies(comp, ins.name) if ins is not None else None
    if ins is None or ins.opcode != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", ins.attrs)
    return int(m.group(1)) if m else None


def trip_count(comps: dict[str, Computation], caller: Computation, loop: Instr) -> int | None:
    """How many times `loop` (a while instruction in `caller`) runs its body, or None when it cannot be read."""
    m = re.search(r'known_trip_count[^0-9]*"?n"?\s*[:=]\s*"?(\d+)', loop.attrs)
    if m:
        return int(m.group(1))
    cond, body = comps.get(loop.attr("condition") or ""), comps.get(loop.attr("body") or "")
    if cond is None or body is None or cond.root is None:
        return None
    cmp = cond.instrs[cond.root]
    if cmp.opcode != "compare" or len(cmp.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", cmp.attrs)
    direction = direction.group(1) if direction else ""
    a, b = (cond.instrs.get(o) for o in cmp.operands)
    idx, limit = _gte_index(cond, a), _constant(_through_copies(cond, cmp.operands[1]))
    if idx is None or limit is None:  # N > i
        idx, limit = _gte_index(cond, b), _constant(_through_copies(cond, cmp.operands[0]))
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if idx is None or limit is None:
        return None
    init_tuple = caller.instrs.get(loop.operands[0]) if loop.operands else None
    start = 0
    if init_tuple is not None and init_tuple.opcode == "tuple" and idx < len(init_tuple.operands):
        c = _constant(_through_copies(caller, init_tuple.operands[idx]))
        if c is None:
            return None
        start = c
    step = 1
    root = body.instrs.get(body.root or "")
    if root is not None and root.opcode == "tuple" and idx < len(root.operands):
        upd = _through_copies(body, root.operands[idx])
        if upd is not None and upd.opcode in ("add", "subtract") and len(upd.operands) == 2:
            c = _constant(_through_copies(body, upd.operands[1]))
            if c is not None:
                step = c if upd.opcode == "add" else -c
    if step == 0:
        return None
    span = {"LT": limit - start, "LE": limit - start + 1, "NE": limit - start,
            "GT": start - limit, "GE": start - limit + 1}.get(direction)
    if span is None:
        return None
    return max(0, math.ceil(span / abs(step)))


def group_size(attrs: str, partitions: int) -> int:
    """Chips in each replica group of a collective (all of them when the groups are not written out)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'?(\w+)'?\s*=\s*(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'?(\w+)'?", m.group(2))) or 1
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        dims = [int(d) for d in m.group(1).split(",")]
        return math.prod(dims[1:]) if len(dims) > 1 else dims[0]
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    return partitions


def _wire_factor(kind: str, n: int) -> float:
    if kind == "collective-permute":
        return 1.0
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n


@dataclass
class Kernel:
    """One top-level op of the program as a kernel launch: its work per run of the program (loops included)."""

    name: str
    kind: str  # "matmul" (dots, cuBLAS), "attention" (cuDNN fused attention), "fusion" (other XLA kernels), "other"
    flops: float
    hbm_bytes: float
    launches: float  # how many times it runs (the trip counts of the loops around it)


@dataclass
class HloCosts:
    """Per-chip traffic of one run of the program (see the module docstring for the model)."""

    hbm_bytes: float
    collectives: dict[str, dict[str, float]]  # kind -> {"ops", "bytes", "wire_bytes"} (loop bodies x trip count)
    loops: list[dict]  # {"name", "trip_count", "multiplicity"}: every while loop found
    unknown_trip_counts: list[str]
    custom_call_bytes: float  # HBM bytes charged to custom calls (Pallas kernels), part of hbm_bytes
    top_ops: list[tuple[str, float]]  # the instructions charged the most HBM bytes, largest first
    kernels: list[Kernel] = field(default_factory=list)  # every op charged bytes or FLOPs, in program order

    @property
    def wire_bytes(self) -> float:
        return sum(c["wire_bytes"] for c in self.collectives.values())


def _dims(shape: str) -> list[int]:
    """The dimensions of the first array in an HLO shape string."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def _library_call(ins: Instr) -> bool:
    return ins.opcode == "custom-call" and _target(ins).startswith(("__cublas", "__cudnn"))


def _workspace_bytes(ins: Instr) -> float:
    """The scratch a cuBLAS or cuDNN call returns as its last result (an s8/u8 vector): allocated, not traffic."""
    arrays = _ARRAY.findall(ins.shape)
    if not _library_call(ins) or len(arrays) < 2 or arrays[-1][0] not in ("s8", "u8"):
        return 0.0
    return shape_bytes("{}[{}]".format(*arrays[-1][:2]))


def _contracting(comp: Computation, ins: Instr, dims: list[str]) -> int:
    lhs = comp.instrs.get(ins.operands[0]) if ins.operands else None
    shape = _dims(lhs.shape) if lhs is not None else []
    return math.prod(shape[int(d)] for d in dims if d and int(d) < len(shape)) if shape else 0


def kernel_flops(comps: dict[str, Computation], comp: Computation, ins: Instr, depth: int = 0) -> tuple[float, str]:
    """(FLOPs, kind) of one op run once: matrix work only (see the module docstring), elementwise work is 0."""
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = _contracting(comp, ins, m.group(1).split(",")) if m else 0
        return 2.0 * math.prod(_dims(ins.shape)) * k, "matmul"
    if ins.opcode == "custom-call":
        target = _target(ins)
        if target.startswith("__cublas") and ("gemm" in target or "matmul" in target):
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
            k = _contracting(comp, ins, re.findall(r"\d+", m.group(1))) if m else 0
            return 2.0 * math.prod(_dims(ins.shape)) * k, "matmul"
        if target.startswith("__cudnn$fmha"):
            m = re.search(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]', ins.attrs)
            q = comp.instrs.get(ins.operands[0]) if ins.operands else None
            if m is None or q is None:
                return 0.0, "attention"
            scores = math.prod(int(d) for d in re.findall(r"\d+", m.group(1)))  # B H Lq Lk
            matmuls = 5 if "Backward" in target else 2
            causal = 0.5 if re.search(r'"mask_type":"[A-Z_]*CAUSAL', ins.attrs) else 1.0
            return 2.0 * matmuls * scores * _dims(q.shape)[-1] * causal, "attention"
        return 0.0, "other"
    if ins.opcode in ("fusion", "fusion-start") and depth < 8:
        inner = comps.get(ins.attr("calls") or "")
        flops = sum(kernel_flops(comps, inner, i, depth + 1)[0] for i in inner.instrs.values()
                    if i.opcode in ("dot", "fusion")) if inner is not None else 0.0
        return flops, "matmul" if flops else "fusion"
    return 0.0, "other"


def _aliases(ins: Instr) -> dict[int, int]:
    """A fusion's `output_to_operand_aliasing`: result tuple index -> the operand whose buffer it is."""
    i = ins.attrs.find("output_to_operand_aliasing={")
    if i < 0:
        return {}
    text, depth = ins.attrs[i + len("output_to_operand_aliasing="):], 0
    for end, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            text = text[:end + 1]
            break
    return {int(out): int(op) for out, op in re.findall(r"\{(\d+)\}:\s*\((\d+),", text)}


def _async_collective_starts(comps: dict[str, Computation]) -> dict[tuple[str, str], set[str]]:
    """(channel_id, opcode) -> the computations that start it, for the collectives of the TPU compiler's async
    collective fusions: fused computations whose root is the custom call `AsyncCollectiveStart`."""
    starts: dict[tuple[str, str], set[str]] = {}
    for comp in comps.values():
        root = comp.instrs.get(comp.root or "")
        if root is None or root.opcode != "custom-call" or '"AsyncCollectiveStart"' not in root.attrs:
            continue
        for ins in comp.instrs.values():
            if ins.opcode.removesuffix("-start") in COLLECTIVES and (ch := ins.attr("channel_id")) is not None:
                starts.setdefault((ch, ins.opcode), set()).add(comp.name)
    return starts


class _Walker:
    def __init__(self, text: str):
        self.comps, self.entry, self.partitions = parse_hlo(text)
        self.loops: list[dict] = []
        self.unknown: list[str] = []
        self.hbm = 0.0
        self.custom = 0.0
        self.charged: dict[str, float] = {}  # instruction name -> HBM bytes charged to it, loops included
        self.coll = {k: {"ops": 0, "bytes": 0.0, "wire_bytes": 0.0} for k in COLLECTIVES}
        self.kernels: list[Kernel] = []
        self.async_starts = _async_collective_starts(self.comps)

    # -- bytes of one fused kernel ------------------------------------------------------------------------------
    def _param_read(self, comp: Computation, pname: str, depth: int = 0, passed: frozenset = frozenset()) -> float:
        """Bytes a fused computation reads of one parameter: the slices taken when it is only sliced, nothing for
        its use as a result returned in place (`passed`: the root tuple's elements that are)."""
        full = comp.instrs[pname].bytes
        users = [i for i in comp.instrs.values()
                 if pname in i.operands and not (i.name == comp.root and pname in passed)]
        if not users and pname in passed:
            return 0.0
        if not users or depth > 8:
            return full
        total = 0.0
        for u in users:
            if u.opcode in _SLICERS and u.operands[0] == pname:
                total += u.bytes
            elif u.opcode == "dynamic-update-slice" and u.operands[0] == pname:
                continue  # updated in place: the write is charged, the rest of the buffer is not read
            elif u.opcode == "bitcast":
                total += self._param_read(comp, u.name, depth + 1, passed)
            elif u.opcode == "fusion":
                inner = self.comps.get(u.attr("calls") or "")
                if inner is None:
                    return full
                reads = [self._param_read(inner, inner.params[k], depth + 1)
                         for k, o in enumerate(u.operands) if o == pname and k in inner.params]
                total += sum(reads)
            else:
                return full
        return min(total, full)

    def _written(self, comp: Computation, name: str) -> float:
        ins = comp.instrs[name]
        while ins.opcode == "bitcast" and ins.operands:
            ins = comp.instrs[ins.operands[0]]
        if ins.opcode == "tuple":
            return sum(self._written(comp, o) for o in ins.operands)
        if ins.opcode == "dynamic-update-slice":
            return comp.instrs[ins.operands[1]].bytes
        if ins.opcode == "fusion":
            inner = self.comps.get(ins.attr("calls") or "")
            if inner is not None and inner.root:
                return self._written(inner, inner.root)
        return ins.bytes

    def _fusion_bytes(self, caller: Computation, ins: Instr) -> float:
        comp = self.comps.get(ins.attr("calls") or "")
        if comp is None or comp.root is None:
            return sum(self._operand_bytes(caller, o) for o in ins.operands) + ins.bytes
        root = comp.instrs[comp.root]
        if root.opcode == "custom-call" and '"AsyncCollectiveDone"' in root.attrs:
            return 0.0  # its result is the buffer the collective wrote (charged at the start), returned in place
        passed, skip = self._in_place(comp, _aliases(ins))
        read = sum(self._param_read(comp, comp.params[k], passed=passed)
                   for k in range(len(ins.operands)) if k in comp.params)
        if root.opcode == "tuple":
            return read + sum(self._written(comp, o) for i, o in enumerate(root.operands) if i not in skip)
        return read + self._written(comp, comp.root)

    def _continued(self, comp: Computation, ins: Instr) -> bool:
        """Whether `ins` is a copy, in a continuation or a done, of a collective an async collective fusion starts
        elsewhere."""
        starts = self.async_starts.get((ins.attr("channel_id") or "", ins.opcode))
        return starts is not None and comp.name not in starts

    def _in_place(self, comp: Computation, aliases: dict[int, int]) -> tuple[frozenset, set[int]]:
        """The root tuple's elements that move nothing, of a fusion whose results alias its operands: (the names
        the root takes only as results returned in place, the element indices not charged as writes). An element
        is free when it is the parameter of the operand it aliases (passed through, bitcasts allowed), or the
        in-flight collective of an async collective fusion's continuation (its bytes land in the aliased buffer
        once, charged at the start)."""
        root = comp.instrs[comp.root]
        skip, through = set(), set()
        if root.opcode != "tuple" or not aliases:
            return frozenset(), skip
        for i, name in enumerate(root.operands):
            if i not in aliases:
                continue
            src = comp.instrs.get(name)
            while src is not None and src.opcode == "bitcast" and src.operands:
                src = comp.instrs.get(src.operands[0])
            if src is None:
                continue
            if src.opcode == "parameter" and comp.params.get(aliases[i]) == src.name:
                skip.add(i)
                through.add(i)
            elif src.opcode in COLLECTIVES and self._continued(comp, src):
                skip.add(i)
        # a name's use by the root reads nothing only where every element it gives is a pass-through
        passed = {root.operands[i] for i in through}
        passed = {n for n in passed if all(i in through for i, o in enumerate(root.operands) if o == n)}
        return frozenset(passed), skip

    @staticmethod
    def _operand_bytes(comp: Computation, name: str) -> float:
        ins = comp.instrs.get(name)
        return ins.bytes if ins is not None else 0.0

    def _op_bytes(self, comp: Computation, ins: Instr) -> float:
        op = ins.opcode
        if op in _FREE or op.endswith("-done") or op.endswith("-update"):
            return 0.0
        if op == "custom-call" and "AllocateBuffer" in ins.attrs:
            return 0.0
        if op in ("fusion", "fusion-start"):
            # XLA:GPU runs some fusions asynchronously (a dynamic-update-slice into a scan's stacked buffer, a
            # dynamic-slice out of it): the same kernel, charged the same way
            return self._fusion_bytes(comp, ins)
        if op.endswith("-start") and ins.attr("calls") and op.removesuffix("-start") not in COLLECTIVES:
            return 0.0  # an async wrapper (async-start): the computation it calls is walked and charged
        if op in _SLICERS:
            return 2 * ins.bytes
        if op == "slice-start":
            # an async slice, ((operand), destination, context): the TPU compiler's prefetch of one slice of a buffer
            # into VMEM (S(1)). It reads the slice, not the operand, and writes HBM only where the destination is
            arrays = list(_ARRAY.finditer(ins.shape))
            if len(arrays) < 2:
                return 0.0
            dest = arrays[1].group(0)
            return shape_bytes(dest) + shape_bytes(dest, hbm_only=True)
        if op == "dynamic-update-slice":
            return 2 * self._operand_bytes(comp, ins.operands[1])
        read = sum(self._operand_bytes(comp, o) for o in ins.operands)
        out = ins.bytes - _workspace_bytes(ins)
        if op == "copy-start":  # (destination, source, context): only the destination is written
            first = _ARRAY.search(ins.shape)
            out = shape_bytes(first.group(0), hbm_only=True) if first else 0.0
        elif op.endswith("-start"):  # async start: the result tuple repeats the operands before the outputs
            out = max(0.0, out - read)
        return read + out

    # -- the walk ----------------------------------------------------------------------------------------------
    def _collective(self, comp: Computation, ins: Instr, times: float) -> None:
        op = ins.opcode.removesuffix("-start")
        if op not in COLLECTIVES:
            return
        if self._continued(comp, ins):
            return  # a continuation or the done of an async collective fusion: counted in its start
        if op == "ragged-all-to-all":
            # operands (data, output buffer, offsets and sizes): expert parallelism's dispatch sends all its data into
            # a larger buffer; its combine sends back what it received, under balanced routing as many rows as the
            # smaller output buffer holds (a padded data operand elsewhere would be counted in full)
            operand = min((comp.instrs[o].all_bytes for o in ins.operands[:2] if o in comp.instrs), default=0.0)
        else:
            operand = sum(comp.instrs[o].all_bytes for o in ins.operands if o in comp.instrs)
        n = group_size(ins.attrs, self.partitions)
        size = operand * n if op == "all-gather" else operand
        c = self.coll[op]
        c["ops"] += times
        c["bytes"] += times * size
        c["wire_bytes"] += times * size * _wire_factor(op, n)

    def walk(self, name: str, times: float, fused: bool = False, depth: int = 0) -> None:
        comp = self.comps.get(name)
        if comp is None or depth > 64:
            return
        for ins in comp.instrs.values():
            self._collective(comp, ins, times)
            if not fused:
                b = self._op_bytes(comp, ins) * times
                self.hbm += b
                flops, kind = kernel_flops(self.comps, comp, ins)
                if b or flops:
                    self.kernels.append(Kernel(ins.name, kind, flops * times, b, times))
                if b:
                    self.charged[ins.name] = self.charged.get(ins.name, 0.0) + b
                if ins.opcode == "custom-call":
                    self.custom += b
            if ins.opcode == "while":
                n = trip_count(self.comps, comp, ins)
                if n is None:
                    self.unknown.append(ins.name)
                    n = 1
                self.loops.append({"name": ins.name, "trip_count": n, "multiplicity": times * n})
                self.walk(ins.attr("body") or "", times * n, fused, depth + 1)
            elif ins.opcode in ("fusion", "fusion-start"):
                self.walk(ins.attr("calls") or "", times, True, depth + 1)  # collectives only: the kernel is charged
            elif ins.opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                branches = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
                branches += [b for b in (ins.attr("true_computation"), ins.attr("false_computation")) if b]
                for b in branches:  # which branch runs is not known here: each is weighted equally
                    self.walk(b, times / len(branches), fused, depth + 1)
            elif ins.opcode in ("call", "async-start") or (ins.opcode.endswith("-start") and ins.attr("calls")):
                self.walk(ins.attr("to_apply") or ins.attr("calls") or "", times, fused, depth + 1)


def hlo_costs(text: str, top: int = 10) -> HloCosts:
    """HBM and collective bytes per chip of one run of a compiled program (`compiled.as_text()`); `top` instructions
    charged the most bytes are listed in `top_ops`."""
    w = _Walker(text)
    w.walk(w.entry, 1.0)
    return HloCosts(hbm_bytes=w.hbm, collectives=w.coll, loops=w.loops, unknown_trip_counts=w.unknown,
                    custom_call_bytes=w.custom, top_ops=sorted(w.charged.items(), key=lambda kv: -kv[1])[:top],
                    kernels=w.kernels)
