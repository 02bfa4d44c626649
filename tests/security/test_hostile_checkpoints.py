"""What someone who may write a run's bucket prefix can plant, and that none of it runs code, reads outside the step
directory its manifest verified, or deletes another run's files.

Each case rewrites a real checkpoint the way such a writer would: the file changed, and the manifest fixed up to match
(sizes and digests are no secret), so that only loading can tell.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint import MANIFEST_NAME, CheckpointStore
from trainingrun_trainer.checkpoint.safe_load import _MetadataUnpickler, read_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    return tmp_path / "bucket"


def saved(base: Path, step: int = 1, seed: int = 0) -> Path:
    """A committed checkpoint of a small model below `base`; its step directory."""
    with CheckpointStore(f"file://{base}") as store:
        store.save(step, {"model": make_model(seed).state_dict()}, {"step": step}, blocking=True)
    return base / ckpt.step_dir_name(step)


def rewrite(directory: Path, name: str, content: bytes) -> None:
    """Replace (or add) one file of a step directory and fix the manifest up to match it."""
    (directory / name).write_bytes(content)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    entries = {entry["path"]: entry for entry in manifest["files"]}
    entries[name] = {"path": name, "size": len(content), "xxh3_128": xxhash.xxh3_128(content).hexdigest()}
    manifest["files"] = sorted(entries.values(), key=lambda entry: entry["path"])
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def metadata_of(directory: Path):
    return pickle.loads((directory / ".metadata").read_bytes())  # the test's own checkpoint: trusted here


def _text(value: str) -> bytes:
    raw = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def calling(module: str, name: str, *args, opcode: str = "STACK_GLOBAL") -> bytes:
    """A pickle that calls `module`.`name`(*args) when loaded by a plain unpickler (protocol 4: dotted names walk
    attributes)."""
    if opcode == "STACK_GLOBAL":
        target = _text(module) + _text(name) + pickle.STACK_GLOBAL
    else:
        target = pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n"
    arguments = pickle.dumps(args, protocol=2)[2:-1]  # the tuple's opcodes, without PROTO and STOP
    return pickle.PROTO + b"\x04" + target + arguments + pickle.REDUCE + pickle.STOP


def unpickle(raw: bytes):
    return _MetadataUnpickler(io.BytesIO(raw)).load()


# ---------------------------------------------------------------------------------------- the metadata unpickler


@pytest.mark.parametrize("opcode", ["STACK_GLOBAL", "GLOBAL"])
@pytest.mark.parametrize(
    "module, name",
    [
        (METADATA_MODULE, "os.mkdir"),  # the module's own `import os`: ran code on main before exact pairs
        (METADATA_MODULE, "torch.sys.modules.os.mkdir"),  # a sys.modules chain
        ("torch", "sys.modules.os.mkdir"),
        ("torch.distributed.checkpoint.filesystem", "os.mkdir"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo.__init__.__globals__.os.mkdir"),
        ("os", "mkdir"),
        ("builtins", "eval"),
        (METADATA_MODULE, "Metadata.__class__"),
    ],
)
def test_no_global_outside_the_exact_pairs_loads(tmp_path, module, name, opcode):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        unpickle(calling(module, name, str(marker), opcode=opcode))
    assert not marker.exists()


def test_the_dotted_name_ran_code_through_a_plain_unpickler(tmp_path):
    """The payload above is real: Python's own unpickler runs it (what the exact pairs stop)."""
    marker = tmp_path / "ran"
    pickle.loads(calling(METADATA_MODULE, "os.mkdir", str(marker)))
    assert marker.is_dir()


def reference(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


@pytest.mark.parametrize(
    "callee, arguments",
    [
        (("builtins", "getattr"), reference(METADATA_MODULE, "Metadata") + _text("__init__")),  # not an enum
        (("builtins", "getattr"), reference(METADATA_MODULE, "_MEM_FORMAT_ENCODING") + _text("__class__")),
        (("builtins", "getattr"), reference("torch", "float32") + _text("__reduce_ex__")),
        (("torch.serialization", "_get_layout"), _text("__class__")),
        ((METADATA_MODULE, "_MEM_FORMAT_ENCODING"), pickle.BININT1 + b"\x63"),
        (("torch", "device"), _text("file:///etc/passwd")),
    ],
)
def test_allowed_callables_with_hostile_arguments_only_fail(callee, arguments):
    raw = (
        pickle.PROTO
        + b"\x04"
        + reference(*callee)
        + pickle.MARK
        + arguments
        + pickle.TUPLE
        + pickle.REDUCE
        + pickle.STOP
    )
    with pytest.raises((pickle.UnpicklingError, KeyError, ValueError, RuntimeError)):
        unpickle(raw)
    with pytest.raises(ValueError, match="not DCP metadata this trainer reads"):
        read_metadata(io.BytesIO(raw), {".metadata": len(raw)})


def test_a_storage_info_pointing_elsewhere_is_refused_even_when_unpickled(bucket):
    """An allowed class (`_StorageInfo`) built with hostile arguments: the unpickler loads it; the check refuses it."""
    directory = saved(bucket)
    metadata = metadata_of(directory)
    for info in metadata.storage_data.values():
        info.relative_path = "../../other-run/step-00000001/__0_0.distcp"
    raw = pickle.dumps(metadata)
    files = {"__0_0.distcp": 10**9, ".metadata": len(raw)}
    with pytest.raises(ValueError, match="is not a plain file name"):
        read_metadata(io.BytesIO(raw), files)


def test_a_memo_index_far_beyond_the_pickle_allocates_nothing():
    """Found by the fuzz below: the C unpickler grows its memo array to the index a LONG_BINPUT names (20 s and
    gigabytes for one changed byte). Here the index is a dict key, and the list is refused as not metadata."""
    raw = pickle.PROTO + b"\x04" + pickle.EMPTY_LIST + pickle.LONG_BINPUT + struct.pack("<I", 0xFFFFFFF0) + pickle.STOP
    with pytest.raises(ValueError, match="a list, not DCP's Metadata"):
        read_metadata(io.BytesIO(raw), None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(noise=st.binary(max_size=512))
def test_random_bytes_only_ever_fail_as_bad_metadata(noise):
    try:
        read_metadata(io.BytesIO(noise), {"__0_0.distcp": 100, ".metadata": len(noise)})
    except ValueError:
        pass


def test_mutated_real_metadata_only_ever_fails_as_bad_metadata_or_loads_checked(bucket, tmp_path):
    """Byte flips, insertions and cuts of a real `.metadata`: each loads as checked DCP metadata or is refused with a
    ValueError; nothing runs (the working directory gains nothing)."""
    directory = saved(bucket)
    original = (directory / ".metadata").read_bytes()
    files = {name.name: name.stat().st_size for name in directory.iterdir()}
    chance = random.Random(35)
    before = set(os.listdir(tmp_path))
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(2000):
        data = bytearray(original)
        for _ in range(chance.randint(1, 4)):
            where = chance.randrange(len(data))
            action = chance.random()
            if action < 0.6:
                data[where] = chance.randrange(256)
            elif action < 0.8:
                data.insert(where, chance.randrange(256))
            else:
                del data[where : where + chance.randint(1, 16)]
        try:
            read_metadata(io.BytesIO(bytes(data)), files)
            outcomes["loaded"] += 1
        except ValueError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0
    assert set(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------------------------------- whole checkpoints


def test_rewritten_metadata_runs_nothing_on_resume_nor_on_export(bucket, tmp_path):
    directory = saved(bucket)
    marker = tmp_path / "ran"
    rewrite(directory, ".metadata", calling(METADATA_MODULE, "os.mkdir", str(marker)))
    store = CheckpointStore(f"file://{bucket}")
    latest = store.latest_valid()
    assert latest is not None and latest.valid  # the manifest matches: only loading can tell
    with pytest.raises(ckpt.CheckpointLoadError, match="refers to .*os.mkdir.*not a plain name"):
        store.load(latest, {"model": make_model(5).state_dict()})
    with pytest.raises(ckpt.CheckpointLoadError, match="not a plain name"):
        ckpt.load_everything(str(directory))
    assert not marker.exists()


@pytest.mark.parametrize(
    "pointed_at, refusal",
    [
        ("../../other-run/step-00000001/__0_0.distcp", "is not a plain file name"),
        ("/etc/passwd", "is not a plain file name"),
        ("__7_0.distcp", "which the manifest does not list"),  # present in the directory, never verified
    ],
)
def test_the_metadata_may_point_only_at_files_the_manifest_lists(bucket, pointed_at, refusal):
    """On main, `../../other-run/...` loaded the other run's weights while latest_valid() said valid."""
    other = saved(bucket.parent / "other-run", seed=9)
    directory = saved(bucket / "run")
    (directory / "__7_0.distcp").write_bytes((other / "__0_0.distcp").read_bytes())
    metadata = metadata_of(directory)
    for info in metadata.storage_data.values():
        info.relative_path = pointed_at
    rewrite(directory, ".metadata", pickle.dumps(metadata))
    store = CheckpointStore(f"file://{bucket / 'run'}")
    loaded = make_model(5)
    with pytest.raises(ckpt.CheckpointLoadError, match=refusal):
        store.load(store.latest_valid(), {"model": loaded.state_dict()})
    assert all(torch.equal(a, b) for a, b in zip(weights(loaded).values(), weights(make_model(5)).values()))
    with pytest.raises(ckpt.CheckpointLoadError, match=refusal):
        ckpt.load_everything(str(directory))


def test_an_item_past_the_end_of_its_file_is_refused_before_anything_is_allocated(bucket):
    directory = saved(bucket)
    metadata = metadata_of(directory)
    info = next(iter(metadata.storage_data.values()))
    info.length = 1 << 50  # a bytearray of a petabyte, if believed
    rewrite(directory, ".metadata", pickle.dumps(metadata))
    store = CheckpointStore(f"file://{bucket}")
    with pytest.raises(ckpt.CheckpointLoadError, match="lies past the end of __0_0.distcp"):
        store.load(store.latest_valid(), {"model": make_model(5).state_dict()})


def test_an_entry_path_that_would_grow_a_list_without_bound_is_refused(bucket):
    """Export rebuilds nested state from `planner_data`, growing a list to an integer key's length."""
    directory = saved(bucket)
    metadata = metadata_of(directory)
    fqn = next(iter(metadata.planner_data))
    metadata.planner_data[fqn] = ("model", 10**12, "weight")
    rewrite(directory, ".metadata", pickle.dumps(metadata))
    with pytest.raises(ckpt.CheckpointLoadError, match="is not a short list of names and indexes"):
        ckpt.load_everything(str(directory))


def test_a_rank_local_metadata_the_manifest_never_lists_is_not_read(bucket):
    """DCP falls back to `__<rank>.metadata` when `.metadata` fails: this trainer writes none and reads none."""
    directory = saved(bucket)
    good = (directory / ".metadata").read_bytes()
    (directory / "__0.metadata").write_bytes(good)  # planted, unlisted
    rewrite(directory, ".metadata", b"not a pickle")
    store = CheckpointStore(f"file://{bucket}")
    with pytest.raises(ckpt.CheckpointLoadError, match="reads none"):
        store.load(store.latest_valid(), {"model": make_model(5).state_dict()})


@pytest.mark.parametrize(
    "listed",
    [
        "../other-run/step-00000001/manifest.json",
        "/etc/passwd",
        "sub/file",
        "..",
        "manifest.json",
        "\u0661.distcp",
        "a\nb",
    ],
)
def test_a_manifest_listing_anything_but_a_plain_name_is_not_valid(bucket, listed):
    directory = saved(bucket)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["files"].append({"path": listed, "size": 1, "xxh3_128": "0" * 32})
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    info = ckpt.verify(str(directory))
    assert not info.valid and "not a plain file name" in info.reason


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("step", True, "'step' is not a non-negative integer"),
        ("step", -1, "'step' is not a non-negative integer"),
        ("format_version", 3.0, "format_version"),
        ("world_size", {"a": 1}, "'world_size' is not a positive integer"),
        ("time", ["x"] * 3, "'time' is not a short ASCII string"),
        ("model_digest", "x" * 10_000, "'model_digest' is not a short ASCII string"),
    ],
)
def test_manifest_fields_of_the_wrong_kind_make_it_invalid(bucket, field, value, reason):
    directory = saved(bucket)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest[field] = value
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    info = ckpt.verify(str(directory))
    assert not info.valid and reason in info.reason


def test_a_step_directory_named_with_other_scripts_digits_is_not_a_checkpoint(bucket):
    """`\\d` takes Arabic-Indic digits, which int() reads: `step-١٢٣٤٥٦٧٨` was step 12345678."""
    saved(bucket, step=1)
    os.rename(bucket / ckpt.step_dir_name(1), bucket / "step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668")
    saved(bucket, step=2)
    os.rename(bucket / ckpt.step_dir_name(2), bucket / "step-00000002\n")
    assert CheckpointStore(f"file://{bucket}").list() == []
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        ckpt.verify(f"file://{bucket}/step-\u0661\u0662")


# ---------------------------------------------------------------------------------------- links (file://)


def test_rotation_never_follows_a_step_directory_planted_as_a_link(bucket):
    """On main, a step directory that was a link into another run made `keep` delete that run's manifest."""
    other = saved(bucket.parent / "other-run", step=1)
    for step in (5, 6):
        saved(bucket, step=step)
    os.symlink(other, bucket / ckpt.step_dir_name(2))
    store = CheckpointStore(f"file://{bucket}", keep=1)
    assert [info.step for info in store.list()] == [6, 5]  # the link is no checkpoint of this run
    assert store.rotate() == [f"file://{bucket}/{ckpt.step_dir_name(5)}"]
    assert (other / MANIFEST_NAME).exists() and ckpt.verify(str(other)).valid
    assert os.path.islink(bucket / ckpt.step_dir_name(2))


def test_a_file_planted_as_a_link_is_never_read(bucket, tmp_path):
    """A link with the right name, size and digest (the target's content is no secret) is not the file."""
    directory = saved(bucket)
    secret = tmp_path / "elsewhere.distcp"
    secret.write_bytes((directory / "__0_0.distcp").read_bytes())
    (directory / "__0_0.distcp").unlink()
    os.symlink(secret, directory / "__0_0.distcp")
    info = ckpt.verify(str(directory))
    assert not info.valid and info.reason == "missing file __0_0.distcp"


def test_clearing_a_step_directory_removes_links_not_what_they_point_at(bucket, tmp_path):
    """A save over a step that exists clears it first: links in it go, their targets stay."""
    directory = saved(bucket, step=3)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "precious").write_text("x")
    os.symlink(kept, directory / "linked-dir")
    os.symlink(kept / "precious", directory / "linked-file")
    saved(bucket, step=3)
    assert (kept / "precious").read_text() == "x"
    assert not os.path.lexists(directory / "linked-dir") and not os.path.lexists(directory / "linked-file")
    assert ckpt.verify(str(directory)).valid


def test_deleting_through_a_step_directory_swapped_for_a_link_deletes_nothing_there(bucket):
    """The race the listing cannot see: the directory becomes a link between listing and deleting."""
    from trainingrun_trainer.checkpoint.storage import Storage

    other = saved(bucket.parent / "other-run", step=1)
    os.makedirs(bucket)
    os.symlink(other, bucket / "step-00000001")
    storage = Storage(f"file://{bucket}", {})
    with pytest.raises(OSError):
        storage.rm_file(f"file://{bucket}/step-00000001/{MANIFEST_NAME}")
    with pytest.raises(OSError):
        storage.rm_tree(f"file://{bucket}/step-00000001")
    assert (other / MANIFEST_NAME).exists()


# ---------------------------------------------------------------------------------------- two runs, one prefix


def save_as(base: Path, run_uid, step: int, seed: int = 0):
    with CheckpointStore(f"file://{base}", keep=1, run_uid=run_uid) as store:
        return store.save(step, {"model": make_model(seed).state_dict()}, {"step": step}, blocking=True).result()


def test_a_run_never_resumes_from_rotates_or_overwrites_another_runs_checkpoints(bucket):
    """Two runs (any namespaces) naming the same checkpoint.uri: on main each resumed from, and rotated, the
    other's checkpoints."""
    assert save_as(bucket, "run-a", 10, seed=1).run_uid == "run-a"
    assert save_as(bucket, "run-b", 5, seed=2) is not None  # b's rotation (keep=1) left a's newer step alone
    store_b = CheckpointStore(f"file://{bucket}", keep=1, run_uid="run-b")
    assert store_b.latest_valid().step == 5
    assert save_as(bucket, "run-b", 6, seed=2) is not None
    assert sorted(info.step for info in store_b.list()) == [6, 10]  # b rotated its own 5, never a's 10
    assert ckpt.verify(str(bucket / ckpt.step_dir_name(10))).run_uid == "run-a"
    assert save_as(bucket, "run-b", 10, seed=2) is None  # a's step-10 is not cleared for b's save of that step
    assert ckpt.verify(str(bucket / ckpt.step_dir_name(10))).valid
    skipped = CheckpointStore(f"file://{bucket}", run_uid="run-b").latest_valid()
    assert skipped.step == 6
    assert CheckpointStore(f"file://{bucket}", run_uid="run-a").latest_valid().step == 10


def test_checkpoints_written_before_run_uids_were_recorded_are_still_resumed(bucket):
    save_as(bucket, None, 3)
    assert CheckpointStore(f"file://{bucket}", run_uid="run-a").latest_valid().step == 3


# ---------------------------------------------------------------------------------------- refused metadata leaves no trace


def building(module: str, name: str, attributes: dict) -> bytes:
    """A pickle whose BUILD sets `attributes` on the class `module`.`name` itself (state `(None, attributes)`)."""
    items = b"".join(
        _text(key) + pickle.dumps(value, protocol=2)[2:-1] + pickle.SETITEM for key, value in attributes.items()
    )
    return (
        pickle.PROTO
        + b"\x04"
        + reference(module, name)
        + pickle.NONE
        + pickle.EMPTY_DICT
        + items
        + pickle.TUPLE2
        + pickle.BUILD
        + pickle.STOP
    )


def test_a_refused_metadata_that_sets_attributes_of_dcps_classes_changes_nothing_in_the_process(bucket):
    """On main the BUILD reached `MetadataIndex` itself: refused, but afterwards the valid older step failed to load
    (`unhashable type: 'MetadataIndex'`) and so did every later save in that process."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    saved(bucket, step=1, seed=1)
    rewrite(saved(bucket, step=2, seed=2), ".metadata", building(METADATA_MODULE, "MetadataIndex", {"__hash__": None}))
    store = CheckpointStore(f"file://{bucket}")
    newest, older = store.list()[0], store.list()[1]
    assert newest.step == 2 and newest.valid  # the manifest was fixed up: only loading can tell
    with pytest.raises(ckpt.CheckpointLoadError, match="not DCP metadata this trainer reads"):
        store.load(newest, {"model": make_model(5).state_dict()})
    assert MetadataIndex.__hash__ is not None
    into = make_model(5)
    assert store.load(older, {"model": into.state_dict()}) == {"step": 1}
    assert all(torch.equal(into.state_dict()[k], v) for k, v in weights(make_model(1)).items())
    assert saved(bucket, step=3, seed=3).is_dir()
    assert CheckpointStore(f"file://{bucket}").latest_valid().step == 3


@pytest.mark.parametrize(
    "state",
    [
        pickle.EMPTY_DICT + _text("__class__") + reference(METADATA_MODULE, "Metadata") + pickle.SETITEM,
        pickle.NONE + pickle.EMPTY_DICT + _text("__hash__") + pickle.NONE + pickle.SETITEM + pickle.TUPLE2,
    ],
    ids=["__class__", "__hash__"],
)
def test_build_on_an_instance_sets_only_its_fields(state):
    raw = (
        pickle.PROTO
        + b"\x04"
        + reference(METADATA_MODULE, "MetadataIndex")
        + _text("x")
        + pickle.TUPLE1
        + pickle.REDUCE
        + state
        + pickle.BUILD
        + pickle.STOP
    )
    with pytest.raises(pickle.UnpicklingError, match="other than its fields"):
        unpickle(raw)


def finishes(call, *args):
    """What `call(*args)` returned, run on a thread the test does not wait on for ever: on main a named pipe made it
    wait for a writer that never comes."""
    import threading

    done: list = []
    worker = threading.Thread(target=lambda: done.append(call(*args)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, f"{call.__qualname__} still waits: it opened something that is not a regular file"
    return done[0]


@pytest.mark.parametrize("planted", [MANIFEST_NAME, "data"])
def test_a_named_pipe_in_a_step_directory_is_an_invalid_step_not_a_hang(bucket, planted, caplog, capsys):
    """Issue 77 item 3: only regular files are read. A FIFO as the manifest (listing, resume, rotation, `trainingrun
    checkpoints`) or as a listed data file (a deep check) makes the step invalid, said once, and never blocks."""
    from trainingrun_operator import cli

    saved(bucket, step=1)
    planted_in = saved(bucket, step=2, seed=1)
    if planted == MANIFEST_NAME:
        (planted_in / MANIFEST_NAME).unlink()
        os.mkfifo(planted_in / MANIFEST_NAME)
    else:
        data = next(p for p in planted_in.iterdir() if p.name.endswith(".distcp"))
        data.unlink()
        os.mkfifo(data)
    store = CheckpointStore(f"file://{bucket}")
    listed = finishes(store.list)
    assert [(info.step, info.valid) for info in listed] == [(2, False), (1, True)]
    assert not finishes(ckpt.verify, str(planted_in)).valid  # a deep check of the step, every file hashed
    assert finishes(store.latest_valid).step == 1
    code = finishes(cli.main, ["checkpoints", f"file://{bucket}"])
    assert code == 0 and "step-00000002" in capsys.readouterr().out
