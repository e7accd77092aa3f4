"""Training corpora: collect local text/code files, split train / held-out by module, write a manifest.

The default corpus is the Python standard library of the running interpreter — real code nobody here
wrote — without its tests, generated tables and third-party packages.

The split unit is the **module**: the first path component under a corpus root (``json/`` for
``json/decoder.py``, ``argparse`` for ``argparse.py``; a file given directly is its own module). A
module goes to held-out when a hash of its name (salted with the split seed) falls below the held-out
fraction, so the split is deterministic and stable as files are added, and held-out text is never
seen in training. Files whose exact content already appeared (empty ``__init__.py`` files, copies)
are dropped, so a duplicate cannot leak held-out text into training either.

The manifest (files, sizes, sha256, module, split, skip counts) makes a run reproducible and lets a
later stage (distillation) rebuild exactly the same split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SUFFIXES = (".py",)
TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".json", ".toml",
                 ".cfg", ".ini", ".yaml", ".yml", ".sh", ".html", ".css", ".rs", ".go", ".java")
# Directory names never read: tests, caches, vendored packages, generated data (stdlib and elsewhere).
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload",
    "encodings", "pydoc_data", "_bundled", ".git", ".hg", ".svn", "node_modules", ".venv", "venv",
})
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-3")
MAX_FILE_BYTES = 256 * 1024  # bigger files are almost always generated tables


@dataclass(frozen=True)
class CorpusFile:
    """One kept file. ``path`` is absolute; ``rel`` is relative to its root (the manifest's key)."""

    path: Path
    rel: str
    root: int  # index into Corpus.roots
    module: str
    size: int
    sha256: str
    split: str  # "train" | "heldout"


@dataclass
class Corpus:
    """The files of a corpus with their split, and what was skipped while collecting them."""

    roots: list[str]
    files: list[CorpusFile]
    heldout_fraction: float
    split_seed: int
    skipped: dict[str, int] = field(default_factory=dict)

    def split(self, name: str) -> list[CorpusFile]:
        if name not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {name!r}")
        return [f for f in self.files if f.split == name]

    def modules(self, name: str) -> set[str]:
        return {f.module for f in self.split(name)}

    def texts(self, name: str, max_bytes: int | None = None) -> list[str]:
        """The split's file contents in manifest order, stopping once ``max_bytes`` are collected."""
        out, total = [], 0
        for f in self.split(name):
            if max_bytes is not None and total >= max_bytes:
                break
            out.append(f.path.read_text(encoding="utf-8"))
            total += f.size
        return out

    def num_bytes(self, name: str) -> int:
        return sum(f.size for f in self.split(name))

    def manifest(self) -> dict:
        files = [
            {"root": f.root, "path": f.rel, "module": f.module, "bytes": f.size, "sha256": f.sha256, "split": f.split}
            for f in self.files
        ]
        body = {
            "roots": self.roots,
            "heldout_fraction": self.heldout_fraction,
            "split_seed": self.split_seed,
            "files": files,
        }
        return {
            **body,
            "sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(),
            "totals": {
                split: {"files": len(self.split(split)), "bytes": self.num_bytes(split), "modules": len(self.modules(split))}
                for split in ("train", "heldout")
            },
            "skipped": dict(self.skipped),
        }

    def write_manifest(self, path: Path) -> str:
        """Write the manifest JSON; return its content hash (stable across machines with equal files)."""
        manifest = self.manifest()
        path.write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest["sha256"]

    def summary(self) -> str:
        t, h = self.manifest()["totals"]["train"], self.manifest()["totals"]["heldout"]
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(self.skipped.items()) if v) or "none"
        return (
            f"corpus: train {t['files']} files / {t['modules']} modules / {t['bytes'] / 1e6:.2f} MB, held-out "
            f"{h['files']} files / {h['modules']} modules / {h['bytes'] / 1e6:.2f} MB; skipped: {skipped}"
        )


def default_corpus_roots() -> list[Path]:
    """The running interpreter's standard library source directory."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def build_corpus(
    paths: list[str | Path] | None = None,
    *,
    heldout_fraction: float = 0.05,
    split_seed: int = 0,
    suffixes: tuple[str, ...] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Corpus:
    """Collect files under ``paths`` (default: the stdlib, ``.py`` only) and split them by module.

    Raises ValueError for a missing path, a bad fraction, an empty corpus, or a corpus with fewer than
    two modules (no split by module is possible).
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if paths is None or len(paths) == 0:
        roots = default_corpus_roots()
        suffixes = suffixes or DEFAULT_SUFFIXES
    else:
        roots = [Path(p).expanduser() for p in paths]
        suffixes = suffixes or TEXT_SUFFIXES
    for root in roots:
        if not root.exists():
            raise ValueError(f"corpus path {str(root)!r} does not exist")

    skipped = {"non_utf8": 0, "unreadable": 0, "empty": 0, "duplicate": 0, "too_large": 0}
    seen_hashes: set[str] = set()
    candidates: list[tuple[Path, str, int, str, int, str]] = []
    for index, root in enumerate(roots):
        for path, rel in _walk(root, suffixes):
            try:
                size = path.stat().st_size
                if size > max_file_bytes:
                    skipped["too_large"] += 1
                    continue
                data = path.read_bytes()
            except OSError:
                skipped["unreadable"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["non_utf8"] += 1
                continue
            if not text.strip():
                skipped["empty"] += 1
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen_hashes:
                skipped["duplicate"] += 1
                continue
            seen_hashes.add(digest)
            module = rel.split("/", 1)[0] if "/" in rel else Path(rel).stem
            candidates.append((path.resolve(), rel, index, module, len(data), digest))

    if not candidates:
        where = ", ".join(str(r) for r in roots)
        raise ValueError(f"the corpus is empty: no readable UTF-8 {'/'.join(suffixes)} files under {where} (skipped: {skipped})")
    modules = sorted({c[3] for c in candidates})
    if len(modules) < 2:
        raise ValueError(
            f"the corpus has a single module ({modules[0]!r}): the train/held-out split is by module, give at least two "
            "files or packages"
        )
    heldout = {m for m in modules if _module_score(m, split_seed) < heldout_fraction}
    if not heldout:  # tiny corpora: still hold out one module (the lowest score, deterministic)
        heldout = {min(modules, key=lambda m: _module_score(m, split_seed))}
    if len(heldout) == len(modules):
        heldout.discard(max(modules, key=lambda m: _module_score(m, split_seed)))
    files = [
        CorpusFile(path, rel, index, module, size, digest, "heldout" if module in heldout else "train")
        for path, rel, index, module, size, digest in candidates
    ]
    return Corpus([str(r) for r in roots], files, heldout_fraction, split_seed, skipped)


def corpus_from_manifest(manifest: dict) -> Corpus:
    """Rebuild a corpus (same files, same split) from a manifest; files that changed or vanished are skipped."""
    try:
        roots = [Path(r) for r in manifest["roots"]]
        entries = manifest["files"]
        fraction, seed = float(manifest["heldout_fraction"]), int(manifest["split_seed"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a corpus manifest (missing {exc})") from exc
    files, changed = [], 0
    for e in entries:
        path = roots[e["root"]] / e["path"]
        try:
            data = path.read_bytes()
        except OSError:
            changed += 1
            continue
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            changed += 1
            continue
        files.append(CorpusFile(path.resolve(), e["path"], e["root"], e["module"], e["bytes"], e["sha256"], e["split"]))
    if not files:
        raise ValueError("none of the corpus manifest's files are readable here with the recorded content")
    return Corpus([str(r) for r in roots], files, fraction, seed, {"changed_since_manifest": changed})


def _module_score(module: str, seed: int) -> float:
    """A deterministic pseudo-random number in [0, 1) per (module, seed)."""
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _walk(root: Path, suffixes: tuple[str, ...]):
    """(path, path relative to root with '/') of candidate files under root, sorted; a file root is itself."""
    if root.is_file():
        yield root, root.name
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_PREFIXES))
        for name in sorted(filenames):
            if name.endswith(suffixes) and not name.startswith(EXCLUDED_PREFIXES):
                path = Path(dirpath) / name
                yield path, path.relative_to(root).as_posix()
