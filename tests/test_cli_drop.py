"""`tiering drop`: a whole namespace, slabs included, removed file by file, the way to get back
the disk of one no engine uses (another engine setup's, or the one an upgrade replaced:
docs/operations.md). `clear` empties a namespace and keeps its preallocated slabs.

Only a namespace proven ours is touched, only the files its format writes go, a namespace a
writer holds is refused with nothing removed, and the namespaces beside it keep their hits."""

from __future__ import annotations

import json
import os

from faultutil import make_format_1_namespace, tree_bytes
from tierutil import key, open_tier, read, row_for, store

from tiering.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def two_namespaces(root):
    """Namespaces of models a and b under ``root``, three rows each; their folders."""
    folders = []
    for model in ("a", "b"):
        with open_tier(root, model=model) as t:
            store(t, [key(f"{model}{i}") for i in range(3)])
            folders.append(t.folder)
    return folders


def test_drop_removes_one_whole_namespace_and_the_other_keeps_its_hits(tmp_path, capsys):
    a, b = two_namespaces(tmp_path)
    assert any(a.glob("slab-*.dat"))
    (tmp_path / "beside.txt").write_text("a user's file beside the namespaces")
    b_before = tree_bytes(b)
    rc, out, err = run(capsys, "drop", str(tmp_path), "--namespace", a.name, "--json")
    assert rc == 0, err
    (r,) = json.loads(out)["results"]
    assert r["folder_removed"] and not r["kept"]
    assert {"meta.json", "index.lmdb/data.mdb"} <= set(r["removed_files"])
    assert any(f.startswith("slab-") for f in r["removed_files"])
    assert not a.exists()
    assert tree_bytes(b) == b_before
    assert (tmp_path / "beside.txt").read_text() == "a user's file beside the namespaces"
    with open_tier(tmp_path, model="b") as t:
        for i in range(3):
            got, _ = read(t, key(f"b{i}"))
            assert got is not None and bytes(got) == bytes(row_for(key(f"b{i}")))


def test_a_dry_run_names_the_files_and_removes_nothing(tmp_path, capsys):
    a, _ = two_namespaces(tmp_path)
    before = tree_bytes(tmp_path)
    rc, out, err = run(capsys, "drop", str(tmp_path), "--namespace", a.name, "--dry-run")
    assert rc == 0, err
    assert "would remove" in out and a.name in out
    assert tree_bytes(tmp_path) == before


def test_a_namespace_a_writer_holds_is_not_removed(tmp_path, capsys):
    with open_tier(tmp_path) as t:
        store(t, [key(1)])
        before = tree_bytes(tmp_path)
        rc, out, err = run(capsys, "drop", str(tmp_path))
        assert rc == 1 and "a writer holds it" in out, (out, err)
        assert tree_bytes(tmp_path) == before
        got, _ = read(t, key(1))
        assert got is not None and bytes(got) == bytes(row_for(key(1)))


def test_what_the_format_did_not_write_is_kept_and_named(tmp_path, capsys):
    (a, _) = two_namespaces(tmp_path)
    (a / "index.lmdb" / "user.bin").write_bytes(b"user bytes")
    rc, out, err = run(capsys, "drop", str(a))
    assert rc == 0, err
    assert "kept" in out and "index.lmdb/user.bin" in out
    assert (a / "index.lmdb" / "user.bin").read_bytes() == b"user bytes"
    assert not any(a.glob("slab-*.dat")) and not (a / "meta.json").exists()


def test_a_symlink_planted_as_a_slab_makes_the_folder_not_ours(tmp_path, capsys):
    (a, _) = two_namespaces(tmp_path)
    target = tmp_path / "precious.bin"
    target.write_bytes(b"x" * 4096)
    os.symlink(target, a / "slab-9999.dat")
    before = tree_bytes(a)
    rc, _, err = run(capsys, "drop", str(a))
    assert rc == 2 and "slab-9999.dat" in err, err
    assert tree_bytes(a) == before and target.read_bytes() == b"x" * 4096


def test_several_namespaces_need_names_or_all(tmp_path, capsys):
    two_namespaces(tmp_path)
    before = tree_bytes(tmp_path)
    rc, out, err = run(capsys, "drop", str(tmp_path))
    assert rc == 2 and "--namespace ID" in err, err
    assert tree_bytes(tmp_path) == before
    rc, out, err = run(capsys, "drop", str(tmp_path), "--all")
    assert rc == 0, err
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_format_1_namespace_is_dropped_too(tmp_path, capsys):
    folder = make_format_1_namespace(tmp_path)
    rc, out, err = run(capsys, "drop", str(folder))
    assert rc == 0, err
    assert not folder.exists()
