"""The TPU compiler's buffer assignment read back by kind (jaxperf.perf.buffers).

tests/data/tiny-v5p-* are excerpts of the dump of a real compile (`jaxperf compile --topology v5p:2x2x1 --preset tiny`
with jax 0.10.2 and libtpu 0.0.42): a few allocations of each kind, the values of four slots of the temporaries'
block, the records of those values and the lines of the live range at the peak that name them. The compile itself is
checked in tests/test_topology.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jaxperf.perf.buffers import buffer_report, format_buffers, parse_buffer_assignment, read_dump

DATA = Path(__file__).parent / "data"
PREFIX = "tiny-v5p-"
# The figures of the excerpt, as the compiler's memory analysis would give them for these allocations alone.
STATS = {"argument_size_in_bytes": 262144 + 2048, "output_size_in_bytes": 262144 + 512 + 320,
         "alias_size_in_bytes": 262144, "temp_size_in_bytes": 50_000_000}


def _read(name: str) -> str:
    return (DATA / f"{PREFIX}{name}.txt").read_text()


@pytest.fixture(scope="module")
def report():
    assignment = parse_buffer_assignment(_read("buffer-assignment"), _read("buffer-assignment-values"),
                                         _read("live-range"))
    return buffer_report(assignment, STATS, top=3)


def test_each_allocation_has_its_kind_and_only_hbm_counts(report):
    assert report["bytes"] == {"parameters": 264192, "donated": 262144, "outputs": 832, "temp": 47890688,
                               "constants": 512, "thread_local": 512, "other": 0}
    assert report["count"] == {"parameters": 2, "outputs": 2, "temp_slots": 4, "constants": 1}
    assert report["on_chip_bytes"] == {"1": 9400832}  # the VMEM block is not HBM
    assert report["check"] == {"arguments_match": True, "outputs_match": True, "aliased_match": True,
                               "compiler_temp": 50_000_000, "temp_not_in_assignment": 50_000_000 - 47890688}


def test_arguments_are_named_by_their_pytree_path(report):
    # The donated weight's buffer is reused in place by ops before the entry parameter's own value is listed
    # (copy.224, dot_general.183, ...): the name comes from the parameter instruction's metadata.
    params = report["largest"]["parameters"]
    assert [(p["name"], p["hlo"], p["shape"], p["bytes"], p["donated"]) for p in params] == [
        ("state.params['blocks']['attn']['wq_DxHxDh']", "param.12", "f32[4,32,4,32]", 262144, True),
        ("batch['inputs']", "param.7", "s32[4,128]", 2048, False)]
    assert report["arguments_by_group"] == {"state.params": 262144, "batch": 2048}


def test_a_temporary_slot_is_named_by_the_op_that_writes_it(report):
    # Five values share the slot: the fusion that writes the scan's saved activations, the AllocateBuffer custom
    # call that reserves it, and the loop's names for it (phi values).
    top = report["largest"]["temp"]
    assert top[0] == {"hlo": "bitcast_dynamic-update-slice_fusion.40{1}", "op": "fusion", "shape": "f32[4,4,128,512]",
                      "bytes": 4194304, "op_name": "jvp()/while/body/closed_call/dot_general", "values_sharing": 4,
                      "live_at_peak": True}
    assert [e["hlo"] for e in top] == ["bitcast_dynamic-update-slice_fusion.40{1}",
                                       "bitcast_dynamic-update-slice_fusion.43{1}",
                                       "constant_dynamic-update-slice_fusion.32"]
    assert report["temp_by_shape"] == [{"shape": "f32[4,4,128,512]", "slots": 1, "bytes": 4194304},
                                       {"shape": "f32[4,4,4,128,128]", "slots": 1, "bytes": 4194304},
                                       {"shape": "f32[4,1,1,32]", "slots": 2, "bytes": 4096}]
    out = report["largest"]["outputs"]
    assert [(e["hlo"], e["shape"]) for e in out] == [("all-reduce.22", "f32[]"), ("tuple.229{}", "tuple of 76")]


def test_the_text_names_the_kinds_the_largest_buffers_and_the_gap():
    assignment = parse_buffer_assignment(_read("buffer-assignment"), _read("buffer-assignment-values"))
    text = "\n".join(format_buffers(buffer_report(assignment, STATS, top=2)))
    assert "parameters 258.00 KiB in 2 buffers (state.params 256.00 KiB, batch 2.00 KiB); 256.00 KiB donated" in text
    assert "f32[4,32,4,32]         state.params['blocks']['attn']['wq_DxHxDh'] (donated)" in text, text
    assert "temporaries 45.67 MiB, one preallocated block (the compiler's temporaries figure 47.68 MiB: 2.01 MiB " \
           "outside the buffer assignment)" in text, text
    assert "bitcast_dynamic-update-slice_fusion.40{1} (+4 values)  fwd/loop/closed_call/dot_general" in text, text
    assert "* live at the peak" not in text  # no live-range dump given
    assert "constants 512 B in 1 buffers" in text


def test_read_dump_finds_the_files_the_compiler_writes(tmp_path):
    stem = "module_0000.jit_step.cl_933746096.after_optimizations-"
    for name in ("buffer-assignment", "buffer-assignment-values", "live-range"):
        shutil.copy(DATA / f"{PREFIX}{name}.txt", tmp_path / f"{stem}{name}.txt")
    assignment = read_dump(str(tmp_path))
    assert len(assignment.allocations) == 8 and "custom-call.35" in assignment.peak_values
    assert read_dump(str(tmp_path / "empty")) is None


def test_text_that_is_not_a_buffer_assignment_is_refused():
    with pytest.raises(ValueError, match="not a buffer-assignment dump"):
        parse_buffer_assignment(_read("live-range"))


def test_a_compiler_that_refuses_the_dump_option_still_compiles():
    from jaxperf.train.topology import _compile_with_buffers

    class Lowered:  # stands for jax.stages.Lowered
        def compile(self, compiler_options=None):
            if compiler_options:
                raise ValueError("No such compile option: 'xla_dump_to'")
            return "compiled"

    compiled, seconds, buffers = _compile_with_buffers(Lowered(), top=10)
    assert compiled == "compiled" and seconds >= 0 and "refused the dump option" in buffers["error"], buffers
    assert _compile_with_buffers(Lowered(), top=0)[2] is None
