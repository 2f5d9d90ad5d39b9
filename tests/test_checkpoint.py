"""Tests for jaxperf.checkpoint: exact round trips, async commit, retention, restore onto other meshes, errors."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxperf.checkpoint import (Checkpointer, CorruptCheckpointError, IncompatibleCheckpointError,
                               NoIntactCheckpointError, checksums)


def _mesh(shape, names, n=None):
    devices = np.asarray(jax.devices()[: n or int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def _train_state():
    """{step, params (nested dict with int keys), opt_state (a real optax chain state after one update)}."""
    sharded = NamedSharding(_mesh((8,), ("data",)), P("data"))
    replicated = NamedSharding(sharded.mesh, P())
    key = jax.random.key(0)
    params = {
        "embed": jax.device_put(jax.random.normal(key, (16, 4)), sharded),
        "layers": {
            i: {"w": jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (8, 8)), sharded),
                "b": jax.device_put(jnp.full((3,), float(i)), replicated)}
            for i in range(2)
        },
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-zero moments and count
    return {"step": np.int32(7), "tokens_seen": 12345, "params": params, "opt_state": opt_state}


def _assert_same_tree(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert type(got) is type(want), name
        assert np.asarray(got).dtype == np.asarray(want).dtype, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name, strict=True)
        if isinstance(want, jax.Array):
            assert got.sharding == want.sharding, name


def test_round_trip_optax_state_and_metadata(tmp_path):
    state = _train_state()
    metadata = {"data": {"position": 4096, "shard": 3}, "config": {"lr": 1e-3, "layers": [2, 4], "name": "tiny"}}
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.save(7, state, metadata=metadata)
        ckpt.wait()
        # Target given as concrete arrays (e.g. a freshly initialised state) ...
        restored, meta = ckpt.restore(7, state)
        _assert_same_tree(restored, state)
        assert meta == metadata
        # ... or as abstract ShapeDtypeStructs with shardings (what jax.eval_shape + shardings give).
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            state,
        )
        restored, meta = ckpt.restore(None, abstract)
        _assert_same_tree(restored, state)
        assert isinstance(restored["opt_state"][1][0], optax.ScaleByAdamState)
        assert type(restored["tokens_seen"]) is int and restored["tokens_seen"] == 12345


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, tree)


def test_parameters_are_an_item_of_their_own_and_restore_without_the_optimizer(tmp_path):
    state = _train_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, state, metadata={"data_step": 7})
        ckpt.wait()
        assert sorted(p.name for p in (tmp_path / "7").iterdir() if p.is_dir()) == ["meta", "params", "state"]
        restored, meta = ckpt.restore(7, {"params": _abstract(state["params"])})
        _assert_same_tree(restored, {"params": state["params"]})
        assert meta == {"data_step": 7}
        # A params-only target does not accept parameters of another model ...
        wrong = {"params": {**_abstract(state["params"]), "extra": np.zeros(2, np.float32)}}
        with pytest.raises(IncompatibleCheckpointError, match=r"not in checkpoint: params\['extra'\]"):
            ckpt.restore(7, wrong)
    # ... and the parameters alone are checked against their checksums too.
    _flip_bytes(tmp_path / "7", item="params")
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CorruptCheckpointError, match="step 7"):
        ckpt.restore(7, {"params": _abstract(state["params"])})


def test_checkpoint_with_all_arrays_in_one_item_still_restores(tmp_path):
    """The layout before parameters had an item of their own: one `state` item holding every array."""
    import orbax.checkpoint as ocp

    state = _train_state()
    flat = {jax.tree_util.keystr(p): (x if isinstance(x, jax.Array) else np.asarray(x))
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    meta = {"data_step": 7, "__checksums__": checksums(flat)}
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=True), item_handlers={
        "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    manager.close()
    with Checkpointer(tmp_path) as ckpt:
        restored, meta = ckpt.restore(7, state)
        _assert_same_tree(restored, state)
        assert meta == {"data_step": 7}
        params, _ = ckpt.restore(7, {"params": _abstract(state["params"])})
        _assert_same_tree(params, {"params": state["params"]})


def test_async_save_wait_and_retention(tmp_path):
    x = jax.device_put(jnp.arange(8.0), NamedSharding(_mesh((8,), ("data",)), P("data")))
    ckpt = Checkpointer(tmp_path, keep=2, keep_every=2, async_save=True)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    for step in range(1, 6):
        assert ckpt.save(step, {"x": x + step}, metadata={"step": step})
    ckpt.wait()
    assert ckpt.latest_step() == 5
    assert ckpt.all_steps() == [2, 4, 5]
    assert not ckpt.save(5, {"x": x})  # already saved
    assert not ckpt.save(3, {"x": x})  # older than the latest, not forced
    ckpt.close()
    on_disk = sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit())
    assert on_disk == [2, 4, 5]
    # A new Checkpointer on the same directory sees the committed steps and their contents.
    with Checkpointer(tmp_path, keep=2, keep_every=2) as again:
        assert again.all_steps() == [2, 4, 5]
        restored, meta = again.restore(4, {"x": x})
        np.testing.assert_array_equal(np.asarray(restored["x"]), np.arange(8.0) + 4)
        assert meta == {"step": 4}


def test_latest_step_only_reports_committed_steps(tmp_path):
    big = {"x": jnp.ones((16, 256, 1024), jnp.float32)}  # 16 MiB: the background write outlasts the checks below
    with Checkpointer(tmp_path, keep=3) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, big)
            latest = ckpt.latest_step()  # the save of `step` is most likely still in flight here
            assert latest in (None, *ckpt.all_steps())
            assert latest is None or os.path.isdir(tmp_path / str(latest)), (latest, os.listdir(tmp_path))
        ckpt.wait()
        assert ckpt.latest_step() == 2 and os.path.isdir(tmp_path / "2")


def test_save_survives_donation_of_source_buffers(tmp_path):
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(_mesh((8,), ("data",)), P("data")))
    target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    expected = np.asarray(x)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(1, {"x": x})
        x.delete()  # what a donating train step does right after save() returns
        restored, _ = ckpt.restore(1, {"x": target})
    np.testing.assert_array_equal(np.asarray(restored["x"]), expected)


@pytest.mark.parametrize(
    "mesh_shape, names, spec",
    [((4,), ("x",), P("x")), ((2, 4), ("a", "b"), P("a", "b")), ((2, 4), ("a", "b"), P(("b", "a")))],
    ids=["8to4", "1dto2d", "1dto2d-flat"],
)
def test_restore_onto_another_mesh(tmp_path, mesh_shape, names, spec):
    state = _train_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, metadata={"mesh": "data=8"})
    mesh = _mesh(mesh_shape, names)

    def retarget(x):  # 2-D leaves get the new spec, the rest is replicated over the new mesh
        if not isinstance(x, jax.Array):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec if x.ndim == 2 else P()))

    target = jax.tree.map(retarget, state)
    embed = target["params"]["embed"]  # a concrete array as target: its sharding is used too
    target["params"]["embed"] = jax.device_put(jnp.zeros(embed.shape, embed.dtype), embed.sharding)
    with Checkpointer(tmp_path) as ckpt:
        restored, meta = ckpt.restore(None, target)
    assert meta == {"mesh": "data=8"}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want, tgt in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)
        if isinstance(tgt, (jax.ShapeDtypeStruct, jax.Array)):
            assert got.sharding == tgt.sharding
            assert len(got.sharding.device_set) == int(np.prod(mesh_shape))
    assert restored["params"]["embed"].sharding.spec == spec


def test_nothing_to_restore_names_directory_and_steps(tmp_path):
    target = {"x": np.zeros(3, np.float32)}
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
            ckpt.restore(None, target)
        ckpt.save(3, {"x": np.ones(3, np.float32)})
        with pytest.raises(FileNotFoundError, match=r"step 9 .*available steps: \[3\]"):
            ckpt.restore(9, target)
        restored, meta = ckpt.restore(3, target)
    np.testing.assert_array_equal(restored["x"], np.ones(3, np.float32), strict=True)
    assert meta == {}


def test_structure_mismatch_and_bad_leaves_are_clear_errors(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(TypeError, match="'name'"):
            ckpt.save(1, {"w": np.ones(2), "name": "not an array"})
        assert ckpt.all_steps() == []
        ckpt.save(1, {"w": np.ones(2), "b": np.zeros(2)})
        assert ckpt.latest_step() == 1
        with pytest.raises(ValueError, match=r"not in checkpoint: \['c'\]; not in target: \['b'\]"):
            ckpt.restore(1, {"w": np.ones(2), "c": np.zeros(2)})
        # Shape differs from the saved one: no silent padding/truncation, and the message says what to do.
        with pytest.raises(ValueError, match=r"another configuration: \['w'\]: saved \(2,\), target \(3,\)"):
            ckpt.restore(1, {"w": jax.ShapeDtypeStruct((3,), jnp.float32), "b": np.zeros(2)})
        with pytest.raises(ValueError, match="another model"):  # no fallback to older steps for this
            ckpt.restore_latest({"w": np.ones(2), "c": np.zeros(2)})
        assert ckpt.all_steps() == [1]


def test_checksum_ignores_sharding_and_sees_one_flipped_bit():
    x = jax.random.normal(jax.random.key(1), (64, 32))
    sharded = jax.device_put(x, NamedSharding(_mesh((2, 4), ("a", "b")), P("a", "b")))
    one_device = jax.device_put(x, jax.devices()[3])
    base = checksums({"x": sharded})["x"]
    assert checksums({"x": one_device})["x"] == base
    assert checksums({"x": np.asarray(x).reshape(-1)[None]})["x"] != base  # host leaf: another hash, also fine
    bits = np.asarray(x).view(np.uint32).copy()
    bits[17, 5] ^= 1 << 9
    assert checksums({"x": jnp.asarray(bits.view(np.float32))})["x"] != base
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places
    assert checksums({"x": jnp.asarray(swapped)})["x"] != base
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint32):
        y = x.astype(dtype)
        assert checksums({"y": y})["y"].startswith(f"{y.dtype}:")


def _largest_file(root):
    files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
    return max(files, key=os.path.getsize)


def _flip_bytes(step_dir, item="state"):
    path = _largest_file(step_dir / item)
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))
    return path


def _truncate(step_dir):
    path = _largest_file(step_dir / "state")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return path


def _delete_manifest(step_dir):
    path = step_dir / "state" / "manifest.ocdbt"
    os.remove(path)
    return path


def _garble_metadata(step_dir):
    path = step_dir / "meta" / "metadata"
    path.write_text('{"data_step": 3, "__checksums__": {')
    return path


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reader after a failed read
@pytest.mark.parametrize("damage", [_flip_bytes, _truncate, _delete_manifest, _garble_metadata],
                         ids=["flipped-bytes", "truncated", "no-manifest", "garbled-metadata"])
def test_corrupt_step_is_reported_and_restore_falls_back(tmp_path, damage, caplog):
    x = jax.device_put(jax.random.normal(jax.random.key(0), (256, 64)), NamedSharding(_mesh((8,), ("data",)), P("data")))
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), "n": np.int32(0)}
    with Checkpointer(tmp_path, keep=3) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": x + step, "n": np.int32(step)}, metadata={"data_step": step})
    damage(tmp_path / "3")
    with Checkpointer(tmp_path, keep=3) as ckpt:
        assert ckpt.latest_step() == 3  # committed, so Orbax lists it; only reading it shows the damage
        with pytest.raises(CorruptCheckpointError, match=r"step 3 .*corrupt"):
            ckpt.restore(3, target)
        with caplog.at_level("WARNING", logger="jaxperf.checkpoint"):
            state, meta, step = ckpt.restore_latest(target)
        assert step == 2 and meta == {"data_step": 2} and int(state["n"]) == 2
        np.testing.assert_array_equal(np.asarray(state["x"]), np.asarray(x + 2))
        assert "checkpoint step 3" in caplog.text and "falling back" in caplog.text
        # The damaged step is moved aside, not deleted, and no longer blocks a new save of step 3.
        assert ckpt.all_steps() == [1, 2] and (tmp_path / "3.corrupt").is_dir()
        assert ckpt.save(3, {"x": x, "n": np.int32(33)}, force=True)
        ckpt.wait()
        assert int(ckpt.restore_latest(target)[0]["n"]) == 33


def test_checksum_mismatch_names_the_array(tmp_path):
    """Data that decodes fine but is not what was written (here: rewritten behind the checkpoint's back)."""
    sharding = NamedSharding(_mesh((8,), ("data",)), P("data"))
    a = jax.device_put(jnp.arange(64.0), sharding)
    with Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
        ckpt.save(1, {"a": a, "b": a})
        ckpt.save(2, {"a": a + 1, "b": a})
    # Swap in step 1's array files under step 2's index: both decode, the values are step 1's.
    import shutil

    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
    target = {"a": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)} | {
        "b": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)}
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"\['a'\] .*does not match the checksum"):
            ckpt.restore(2, target)
        restored, _ = ckpt.restore(2, target, verify=False)  # the escape hatch reads it anyway
        np.testing.assert_array_equal(np.asarray(restored["a"]), np.arange(64.0))


# ---------------------------------------------------------------------------------------------------------------------
# Readers never write: generate, serve, quantize, export and init_from open a run's checkpoints read_only


def _files(root) -> dict[str, bytes]:
    """Every file and directory under root (directories as None): what "changed nothing" is checked against."""
    out = {}
    for here, dirs, names in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), root)] = None
        for n in names:
            path = os.path.join(here, n)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def _three_steps(directory):
    x = jax.device_put(jnp.arange(64.0), NamedSharding(_mesh((8,), ("data",)), P("data")))
    with Checkpointer(directory, keep=3) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": x + step, "n": np.int32(step)}, metadata={"data_step": step})
    return {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), "n": np.int32(0)}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reader after a failed read
def test_a_reader_falls_back_to_the_newest_intact_step_and_changes_nothing(tmp_path, caplog):
    target = _three_steps(tmp_path / "ck")
    _flip_bytes(tmp_path / "ck" / "3")
    (tmp_path / "ck" / "4.orbax-checkpoint-tmp-1234").mkdir()  # a save in progress by the run that trains here
    before = _files(tmp_path)
    with Checkpointer(tmp_path / "ck", read_only=True) as ckpt:
        with caplog.at_level("WARNING"):
            state, meta, step = ckpt.restore_latest(target)
        with pytest.raises(ValueError, match="read_only"):
            ckpt.save(5, {"x": np.zeros(3)})
    assert step == 2 and meta == {"data_step": 2} and int(state["n"]) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # one line, no Orbax chatter
    assert "checkpoint step 3 is corrupt" in line and "using step 2" in line and "nothing was moved" in line, line
    assert _files(tmp_path) == before  # nothing renamed, nothing cleaned up
    with Checkpointer(tmp_path / "elsewhere", read_only=True) as ckpt:
        assert ckpt.all_steps() == []
    assert not (tmp_path / "elsewhere").exists()  # a reader creates no directory either


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_reader_of_checkpoints_none_of_which_is_intact_raises_and_changes_nothing(tmp_path):
    target = _three_steps(tmp_path)
    for step in (1, 2, 3):
        _flip_bytes(tmp_path / str(step))
    before = _files(tmp_path)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        with pytest.raises(NoIntactCheckpointError) as e:
            ckpt.restore_latest(target)
    message = str(e.value)
    assert f"no intact checkpoint in {tmp_path}: checkpoint steps 3, 2, 1 are corrupt (step 3: " in message, message
    assert "nothing was changed" in message and "\n" not in message, message
    assert _files(tmp_path) == before
