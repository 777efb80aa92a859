"""Fault suite, what is ours: `tiering clear`, `evict` and the writer change only a namespace
they proved they wrote (meta.json's marker and the layout), never a byte of anything else.

User folders with a meta.json of their own, old-format look-alikes, planted user files beside
and inside namespaces: every one survives byte for byte, and every refusal is exit 2 with one
line naming the path and what was expected."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading

import pytest
from faultutil import make_format_1_namespace, tree_bytes
from tierutil import ROW, key, open_tier, read, row_for, store

from tiering.backends import admin
from tiering.backends.namespace import MAGIC, NamespaceError, NotOurs
from tiering.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


def user_app(folder, meta: dict | None = None) -> None:
    """A user's folder that has a meta.json of its own (the issue's example)."""
    (folder / "src").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(meta or {"name": "my web app"}))
    (folder / "src" / "main.py").write_text("print('x')\n")


# -- user folders with their own meta.json --------------------------------------------------
@pytest.mark.parametrize("meta", [
    {"name": "my web app"},
    {"format_version": 3, "name": "x"},
    {"format_version": "2"},
    {"magic": "something else", "format_version": 2},
    [1, 2],
], ids=["plain", "version-3", "version-string", "other-magic", "not-an-object"])
@pytest.mark.parametrize("cmd", [["clear"], ["clear", "--dry-run"], ["evict", "--bytes", "1"],
                                 ["clear", "--all"]])
def test_user_folder_with_its_own_meta_json_is_refused_and_kept(tmp_path, capsys, meta, cmd):
    app = tmp_path / "P"
    user_app(app, meta)
    before = tree_bytes(tmp_path)
    rc, _, err = run(capsys, cmd[0], str(app), *cmd[1:])
    assert_refused(rc, err, str(app))
    assert tree_bytes(tmp_path) == before


def test_clear_on_a_root_of_user_folders_touches_none(tmp_path, capsys):
    """`tiering clear ROOT`: every direct subfolder with a meta.json of its own (named like a
    namespace or not) stays."""
    user_app(tmp_path / "app")
    user_app(tmp_path / "0123456789abcdef", {"format_version": 7})
    user_app(tmp_path / "fedcba9876543210")
    before = tree_bytes(tmp_path)
    for cmd in (["clear"], ["clear", "--all"], ["evict", "--all", "--older-than", "0s"],
                ["clear", "--namespace", "0123456789abcdef"]):
        rc, _, err = run(capsys, cmd[0], str(tmp_path), *cmd[1:])
        assert_refused(rc, err, "meta.json")
        assert tree_bytes(tmp_path) == before, cmd


# -- old-format look-alikes ------------------------------------------------------------------
def _edited_v2(tmp_path) -> object:
    with open_tier(tmp_path) as t:
        store(t, [key(0)])
        folder = t.folder
    meta = json.loads((folder / "meta.json").read_text())
    meta["format_version"] = 1  # claims format 1, but is no folder format 1 wrote
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def _v1_slab_no_index(tmp_path):
    p = tmp_path / "P"  # the issue's look-alike: format_version 1, a slab, no index
    p.mkdir()
    (p / "meta.json").write_text(json.dumps({"format_version": 1}))
    (p / "slab-0000.dat").write_bytes(os.urandom(4 * ROW))
    return p


def _v1_wrong_name(tmp_path):
    folder = make_format_1_namespace(tmp_path / "src")
    moved = tmp_path / "0123456789abcdef"  # the facts no longer hash to its name
    folder.rename(moved)
    meta = json.loads((moved / "meta.json").read_text())
    meta["namespace"] = moved.name
    (moved / "meta.json").write_text(json.dumps(meta))
    return moved


def _v1_extra_field(tmp_path):
    folder = make_format_1_namespace(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    meta["owner"] = "me"  # format 1 never wrote this field
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def _v1_foreign_file(tmp_path):
    folder = make_format_1_namespace(tmp_path)
    (folder / "notes.txt").write_text("mine")  # format 1 never wrote this name
    return folder


@pytest.mark.parametrize("make", [_edited_v2, _v1_slab_no_index, _v1_wrong_name,
                                  _v1_extra_field, _v1_foreign_file])
def test_old_format_look_alike_is_refused_and_kept(tmp_path, capsys, make):
    folder = make(tmp_path)
    before = tree_bytes(tmp_path)
    for cmd in (["clear"], ["clear", "--dry-run"], ["evict", "--bytes", "1"]):
        for target in (folder, folder.parent):
            rc, _, err = run(capsys, cmd[0], str(target), *cmd[1:])
            assert_refused(rc, err, str(target))  # the folder, or the root it is in
            assert tree_bytes(tmp_path) == before, (cmd, target)


# -- a real format-1 namespace: removed file by file ----------------------------------------
def test_format_1_namespace_is_removed_file_by_file(tmp_path, capsys):
    folder = make_format_1_namespace(tmp_path)
    (tmp_path / "beside.txt").write_text("user file beside the namespace")
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    before = tree_bytes(tmp_path)
    rc, out, err = run(capsys, "clear", str(tmp_path), "--dry-run")
    assert rc == 0, err
    assert "would remove" in out and "slab-0000.dat" in out and "index.lmdb/data.mdb" in out
    assert tree_bytes(tmp_path) == before, "a dry run removed something"
    rc, out, err = run(capsys, "clear", str(tmp_path), "--json")
    assert rc == 0, err
    (r,) = json.loads(out)["results"]
    assert r["folder_removed"] and not r["kept"]
    assert sorted(f.rstrip("/") for f in r["removed_files"]) == written
    assert not folder.exists()
    assert (tmp_path / "beside.txt").read_text() == "user file beside the namespace"


def test_format_1_removal_keeps_what_format_1_did_not_write(tmp_path, capsys):
    folder = make_format_1_namespace(tmp_path)
    (folder / "requests" / "keep.txt").write_bytes(b"user bytes 1")
    (folder / "index.lmdb" / "user.bin").write_bytes(b"user bytes 2")
    rc, out, err = run(capsys, "clear", str(folder))
    assert rc == 0, err
    assert "kept" in out and "requests/keep.txt" in out and "index.lmdb/user.bin" in out
    assert (folder / "requests" / "keep.txt").read_bytes() == b"user bytes 1"
    assert (folder / "index.lmdb" / "user.bin").read_bytes() == b"user bytes 2"
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    assert left == ["index.lmdb", "index.lmdb/user.bin", "requests", "requests/keep.txt"]


def test_format_1_namespace_held_by_its_writer_is_not_removed(tmp_path, capsys):
    folder = make_format_1_namespace(tmp_path)
    before = tree_bytes(tmp_path)
    fd = os.open(folder / "writer.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a format-1 writer's lock
    try:
        rc, _, err = run(capsys, "clear", str(folder))
    finally:
        os.close(fd)
    assert rc == 1 and "stop it first" in err
    assert tree_bytes(tmp_path) == before


# -- the writer: never writes into a folder it cannot prove ----------------------------------
def _namespace_id(tmp_path) -> str:
    with open_tier(tmp_path / "probe") as t:
        return t.folder.name


@pytest.mark.parametrize("plant", ["user-files", "user-meta"])
def test_writer_refuses_a_folder_it_cannot_prove_and_writes_nothing(tmp_path, plant):
    """(A proven namespace with a stray file of someone's in it is served and the file left
    alone: test_faults_hostile.py, test_writer_serves_a_namespace_with_stray_files_...)"""
    root = tmp_path / "cache"
    ns = _namespace_id(tmp_path)
    folder = root / ns
    user_app(folder, {"format_version": 2} if plant == "user-meta" else None)
    before = tree_bytes(root)
    with pytest.raises(NamespaceError) as exc:
        open_tier(root)
    assert str(folder) in str(exc.value) and "\n" not in str(exc.value)
    assert tree_bytes(root) == before


def test_writer_start_up_clean_up_removes_only_its_own_files(tmp_path):
    with open_tier(tmp_path) as t:
        keys = [key(i) for i in range(5)]
        store(t, keys)
        folder = t.folder
    for name in ("index.lmdb.old", "index.lmdb.tmp-999999"):
        (folder / name).mkdir()
        (folder / name / "data.mdb").write_bytes(b"stale env of a killed rebuild")
        (folder / name / "user.bin").write_bytes(b"user bytes " + name.encode())
    with open_tier(tmp_path) as t:
        for k in keys:
            assert read(t, k)[0] == bytes(row_for(k))
    for name in ("index.lmdb.old", "index.lmdb.tmp-999999"):
        assert (folder / name / "user.bin").read_bytes() == b"user bytes " + name.encode()
        assert not (folder / name / "data.mdb").exists()


# -- caches written before the magic keep opening --------------------------------------------
def test_namespace_written_before_the_magic_keeps_its_hits(tmp_path, capsys):
    keys = [key(i) for i in range(6)]
    with open_tier(tmp_path) as t:
        store(t, keys)
        folder = t.folder
    meta = json.loads((folder / "meta.json").read_text())
    assert meta.pop("magic") == MAGIC
    (folder / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    rc, out, err = run(capsys, "clear", str(tmp_path), "--dry-run")
    assert rc == 0 and "would remove 6 entries" in out, (out, err)
    with open_tier(tmp_path) as t:  # a restart keeps hits
        assert len(t) == 6
        for k in keys:
            assert read(t, k)[0] == bytes(row_for(k))
    assert json.loads((folder / "meta.json").read_text())["magic"] == MAGIC


def test_meta_without_magic_and_a_field_that_format_never_wrote_is_refused(tmp_path, capsys):
    with open_tier(tmp_path) as t:
        store(t, [key(0)])
        folder = t.folder
    meta = json.loads((folder / "meta.json").read_text())
    del meta["magic"]
    meta["name"] = "my web app"
    (folder / "meta.json").write_text(json.dumps(meta))
    before = tree_bytes(tmp_path)
    rc, _, err = run(capsys, "clear", str(tmp_path))
    assert_refused(rc, err, "meta.json", "magic")
    with pytest.raises(NotOurs):
        open_tier(tmp_path)
    assert tree_bytes(tmp_path) == before


# -- several namespaces: listed; acting on more than one needs names or --all ----------------
@pytest.fixture
def two(tmp_path):
    with open_tier(tmp_path, model="a") as a:
        store(a, [key(i) for i in range(4)])
    with open_tier(tmp_path, model="b") as b:
        store(b, [key(i) for i in range(3)])
    return tmp_path, a.folder.name, b.folder.name


def _entries(root, model: str) -> int:
    with open_tier(root, model=model) as t:
        return len(t)


@pytest.mark.parametrize("cmd", [["clear"], ["evict", "--bytes", "1"]])
def test_several_namespaces_are_listed_and_need_names_or_all(two, capsys, cmd):
    root, a, b = two
    before = tree_bytes(root)
    rc, out, err = run(capsys, cmd[0], str(root), *cmd[1:])
    assert_refused(rc, err, "2 namespaces", "--namespace", "--all")
    assert a in out and b in out, out
    assert tree_bytes(root) == before


def test_named_namespaces_or_all(two, capsys):
    root, a, b = two
    before = tree_bytes(root)
    rc, out, _ = run(capsys, "clear", str(root), "--all", "--dry-run", "--json")
    assert rc == 0
    got = {r["namespace"]: r["removed_entries"] for r in json.loads(out)["results"]}
    assert got == {a: 4, b: 3}
    assert tree_bytes(root) == before, "a dry run changed the cache"
    assert run(capsys, "clear", str(root), "--namespace", a)[0] == 0
    assert (_entries(root, "a"), _entries(root, "b")) == (0, 3)
    assert run(capsys, "clear", str(root), "--namespace", a, "--namespace", b)[0] == 0
    assert _entries(root, "b") == 0


def test_evict_dry_run_predicts_the_run_and_deletes_nothing(tmp_path, capsys):
    with open_tier(tmp_path) as t:
        store(t, [key(i) for i in range(8)])
    before = tree_bytes(tmp_path)
    for argv, n in ((["--bytes", str(3 * ROW - 1)], 3), (["--older-than", "0s"], 8),
                    (["--older-than", "1d"], 0), (["--bytes", str(100 * ROW)], 8)):
        rc, out, _ = run(capsys, "evict", str(tmp_path), *argv, "--dry-run", "--json")
        assert rc == 0
        (r,) = json.loads(out)["results"]
        assert (r["removed_entries"], r["entries"], r["dry_run"]) == (n, 8 - n, True), argv
        assert tree_bytes(tmp_path) == before, argv
    rc, out, _ = run(capsys, "evict", str(tmp_path), "--bytes", str(3 * ROW - 1), "--json")
    assert json.loads(out)["results"][0]["removed_entries"] == 3


# -- acceptance: nothing outside a proven namespace loses a byte ------------------------------
def test_clear_evict_and_the_writer_never_touch_a_byte_outside_proven_namespaces(tmp_path, capsys):
    root = tmp_path / "nvme"
    with open_tier(root / "kv") as t:  # a real cache one level down (the operator's typo)
        store(t, [key(i) for i in range(5)])
        real = t.folder
    user_app(root / "webapp")
    user_app(root / "0123456789abcdef", {"format_version": 1})
    _v1_slab_no_index(root)  # root/P
    (root / "notes.txt").write_text("beside everything")
    (real.parent / "beside-namespace.txt").write_text("beside the real namespace")
    planted = {k: v for k, v in tree_bytes(root).items() if not k.startswith("kv/" + real.name)}
    for cmd in (["clear"], ["clear", "--all"], ["clear", "--all", "--dry-run"],
                ["evict", "--all", "--bytes", "1"], ["evict", "--older-than", "0s"]):
        for target in (root, root / "webapp", root / "P", root / "0123456789abcdef"):
            rc, _, err = run(capsys, cmd[0], str(target), *cmd[1:])
            assert rc == 2 and len(err.strip().splitlines()) == 1, (cmd, target, err)
    assert run(capsys, "clear", str(root / "kv"))[0] == 0  # the real cache: cleared
    assert run(capsys, "evict", str(root / "kv"), "--bytes", "1")[0] == 0
    with open_tier(root / "kv") as t:
        assert len(t) == 0
        store(t, [key("again")])
    after = tree_bytes(root)
    assert {k: after.get(k) for k in planted} == planted, "a byte outside a namespace changed"


# -- umask 000: every folder the tier makes is 0700, every file 0600 -------------------------
def test_under_umask_000_folders_are_0700_and_files_0600(tmp_path, capsys):
    root = tmp_path / "a" / "b" / "kv"
    old = os.umask(0)
    try:
        with open_tier(root) as t:
            store(t, [key(i) for i in range(3)])
            done = {}

            def submit() -> None:  # a live writer's request: requests/ and its files
                done["r"] = admin.submit_request(t.folder, {"op": "evict", "bytes": 1}, 10)

            th = threading.Thread(target=submit)
            th.start()
            while th.is_alive():
                t.poll()
                th.join(0.02)
            assert done["r"]["removed_entries"] == 1
        prom = tmp_path / "a" / "tiering.prom"
        assert main(["export", str(root), "-o", str(prom)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    made = [tmp_path / "a", tmp_path / "a" / "b", *[p for p in [root, *root.rglob("*")]]]
    assert (t.folder / "requests").is_dir()
    for p in made:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        want = 0o700 if p.is_dir() else 0o600
        assert mode == want, f"{p.relative_to(tmp_path)}: {oct(mode)}, expected {oct(want)}"
    assert stat.S_IMODE(prom.stat().st_mode) == 0o600


def test_live_writer_takes_only_tool_requests(tmp_path):
    """The writer renames and answers only the requests a tool wrote (12-hex names): a JSON
    file of someone else's in requests/ is never renamed, read as a request or removed."""
    with open_tier(tmp_path) as t:
        store(t, [key(i) for i in range(3)])
        (t.folder / "requests").mkdir()
        mine = t.folder / "requests" / "mine.json"
        mine.write_text('{"op": "clear"}')
        done = {}

        def submit() -> None:
            done["r"] = admin.submit_request(t.folder, {"op": "evict", "bytes": 1}, 10)

        th = threading.Thread(target=submit)
        th.start()
        while th.is_alive():
            t.poll()
            th.join(0.02)
        assert done["r"]["removed_entries"] == 1 and len(t) == 2  # the planted clear: not run
        assert mine.read_text() == '{"op": "clear"}'
        assert sorted(p.name for p in mine.parent.iterdir()) == ["mine.json"]
