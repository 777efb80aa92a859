"""Fault suite, planted symbolic links: every file and folder of a namespace (and the namespace
folder itself) replaced by a link to something outside the cache. The writer and every tool
refuse the folder with one line; nothing outside the cache changes."""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import sys

import pytest
from faultutil import assert_tool_ok
from tierutil import key, open_tier, store

from tiering.backends.namespace import NamespaceError

NAMES = ["writer.lock", "meta.json", "writer.json", "index.lmdb", "index.lmdb/data.mdb",
         "index.lmdb/lock.mdb", "slab-0000.dat", "slab-0001.dat", "requests", "."]


def _fingerprint(path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_planted_links_are_refused_and_never_followed(tmp_path, trials):
    n = trials(len(NAMES))
    rng = random.Random(3)
    for trial in range(n):
        name = NAMES[trial % len(NAMES)]
        cache = tmp_path / f"c{trial}"
        with open_tier(cache) as t:
            store(t, [key(i) for i in range(rng.randint(1, 8))])
            folder = t.folder
        (folder / "requests").mkdir(exist_ok=True)
        outside = tmp_path / f"outside{trial}"
        outside.mkdir()
        victim = folder if name == "." else folder / name
        if victim.is_dir():
            target = outside / "dir"
            shutil.copytree(victim, target)
            shutil.rmtree(victim)
        else:
            target = outside / "file"
            target.write_bytes(b"precious " + victim.read_bytes()[:64])
            victim.unlink()
        victim.symlink_to(target)
        before = _fingerprint(outside)
        with pytest.raises((NamespaceError, OSError)):
            open_tier(cache)
        tools = [subprocess.Popen([sys.executable, "-m", "tiering.cli", *cmd, str(cache)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for cmd in (["inspect"], ["verify"], ["stats"], ["export"], ["clear"],
                             ["evict", "--bytes", "1"])]
        for p in tools:
            out, err = p.communicate(timeout=60)
            assert_tool_ok(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                           allowed=(1, 2))
        assert _fingerprint(outside) == before, f"{name}: a file outside the cache changed"
    print(f"symlink plants: {n} trials over {len(NAMES)} entries, all refused, nothing "
          "outside changed")
