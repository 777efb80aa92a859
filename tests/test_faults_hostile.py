"""Fault suite, an adversary and a careless operator against what is ours (issue 18's rule:
tools and the writer remove or rewrite only what they can prove they wrote).

Each case plants something that is not ours where ours would be, or changes the folder between
the check and the act, and asserts that no byte of it changes and that the refusal is one line
(exit 2 from the CLI)."""

from __future__ import annotations

import os

import pytest
from tierutil import key, open_tier, store

from tiering.backends.namespace import NamespaceError
from tiering.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- hard links: a user's file linked in under one of our names ------------------------------
HARD_LINKED = ["slab-0000.dat", "slab-0003.dat", "writer.lock", "index.lmdb/lock.mdb",
               "index.lmdb/data.mdb", "meta.json", "writer.json"]


@pytest.mark.parametrize("name", HARD_LINKED)
def test_a_hard_link_to_a_user_file_under_one_of_our_names_is_refused_and_kept(
        tmp_path, capsys, name):
    """A regular file of this user, with the right name, but a second name elsewhere (``ln
    ~/data.bin NS/slab-0000.dat``): the tier never makes hard links, so it is not provably
    ours. The writer truncated and overwrote such a slab and truncated such a writer.lock
    (the user's file changed) before the fix."""
    cache = tmp_path / "cache"
    with open_tier(cache) as t:
        store(t, [key(i) for i in range(3)])
        folder = t.folder
    victim = folder / name
    user = tmp_path / "user.bin"
    user.write_bytes(b"user data " + os.urandom(victim.stat().st_size + 100))
    victim.unlink()
    os.link(user, victim)
    before = sha(user)
    with pytest.raises(NamespaceError) as exc:
        open_tier(cache)
    assert "hard link" in str(exc.value) and "\n" not in str(exc.value)
    for cmd in (["clear"], ["evict", "--bytes", "1"], ["clear", "--dry-run"]):
        rc, _, err = run(capsys, cmd[0], str(cache), *cmd[1:])
        assert_refused(rc, err, name.split("/")[-1], "hard link")
    assert sha(user) == before
    assert os.stat(user).st_nlink == 2, "the user's second name was removed"
