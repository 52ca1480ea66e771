"""Deciding fewer offline states: two states whose directories differ only in the bytes of files
the trainer's resume never looked at get the same verdict, so only one of them is run.

What a resume looked at is learned from that resume's own trace (`strace.named`): a
process learns a file's bytes, size or times only through a call that names it (a path, or an fd
strace shows with its path); getdents shows names alone, and every name is the same in both
states. So if the trainer is deterministic (the determinism precondition) and every file it named
holds the same bytes in the other state, it makes the same calls there, names the same files and
reaches the same verdict. A call that only removes a name (unlink) learns nothing of the file.
Paths inside the checkpoint directory are compared whole; a path outside it, or one whose
directory the trace does not show, counts by its base name: a name too many only costs one more
resume.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from ..trace.strace import Named


@dataclasses.dataclass(frozen=True)
class DirectoryView:
    """What a resume could see of one state's directory: every name in it (files, directories,
    symlinks with their targets), and each file's bytes by identity (equal identities, equal
    bytes)."""

    names: str                      # digest of every name
    contents: Mapping[str, object]  # relative file path -> identity of its bytes
    symlinks: Mapping[str, str]     # relative path -> target

    @classmethod
    def of(cls, files: Mapping[str, object], dirs, symlinks: Mapping[str, str]) -> DirectoryView:
        inside = {p: c for p, c in files.items() if not p.startswith("/")}
        links = {p: t for p, t in symlinks.items() if not p.startswith("/")}
        names = repr((sorted(inside), sorted(d for d in dirs if not d.startswith("/")), sorted(links.items())))
        return cls(hashlib.blake2b(names.encode(), digest_size=12).hexdigest(), inside, links)

    @classmethod
    def read(cls, root: Path) -> DirectoryView:
        """The view of a directory on disk, its files by their bytes: equal keys for equal trees,
        however each was built (a replayed kill, a power cut)."""
        files: dict[str, str] = {}
        dirs: set[str] = set()
        symlinks: dict[str, str] = {}
        for here, subdirs, names in os.walk(root):
            for name in subdirs + names:
                path = os.path.join(here, name)
                rel = os.path.relpath(path, root)
                if os.path.islink(path):
                    symlinks[rel] = os.readlink(path)
                elif name in subdirs:
                    dirs.add(rel)
                else:
                    with open(path, "rb") as f:
                        files[rel] = bytes_identity(f.read())
        return cls.of(files, dirs, symlinks)

    @property
    def key(self) -> str:
        """A digest of the whole directory: equal keys, equal directories (names and bytes)."""
        whole = repr((self.names, sorted(self.contents.items())))
        return hashlib.blake2b(whole.encode(), digest_size=12).hexdigest()

    def but(self, path: str, identity: object) -> DirectoryView:
        """The same view with one file's bytes changed (a torn write)."""
        if path.startswith("/") or path not in self.contents:
            return self
        return dataclasses.replace(self, contents={**self.contents, path: identity})

    def seen(self, named: Named, root: Path) -> frozenset[str]:
        """The files a resume that named `named`, with this directory at `root`, could have
        learned anything of: those it named by path; those whose base name it named another way
        (a relative path without its directory, a path outside `root`: perhaps another way to the
        same files), or through a symlink; and a named symlink's target."""
        root_s = str(root)
        exact: set[str] = set()
        loose = set(named.names)
        for path in named.paths:
            rel = os.path.relpath(path, root_s)
            if rel == ".." or rel.startswith("../"):
                loose.add(os.path.basename(path))
                continue
            exact.add(rel)
            for link, target in self.symlinks.items():
                if rel == link or rel.startswith(link + "/"):
                    loose.update({os.path.basename(rel), os.path.basename(target.rstrip("/"))})
        return frozenset(p for p in self.contents if p in exact or os.path.basename(p) in loose)

    def looks_like(self, decided: DirectoryView, seen: frozenset[str]) -> bool:
        """Whether a resume that saw the files `seen` in `decided` would see the same here."""
        return self.names == decided.names and all(self.contents[p] == decided.contents[p] for p in seen)


def bytes_identity(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
