"""Corpus collection: split by module (never overlapping), manifest, skips, duplicates, bad input."""

from __future__ import annotations

import json

import pytest
from specserve.training.corpus import (
    build_corpus,
    corpus_from_manifest,
    default_corpus_roots,
)


def write(path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for pkg in ("alpha", "beta", "gamma", "delta"):
        for mod in ("core", "util", "io"):
            write(root / pkg / f"{mod}.py", f"# {pkg}.{mod}\ndef {mod}_{pkg}():\n    return {len(pkg)}\n")
        write(root / pkg / "__init__.py", "")  # empty: skipped
    for name in ("one", "two", "three", "four", "five", "six"):
        write(root / f"{name}.py", f"X_{name} = '{name}'\n")
    write(root / "pkg_tests" / "tests" / "test_x.py", "assert True\n")  # excluded directory name
    write(root / "latin1.py", b"caf\xe9 = 1\n")  # not UTF-8
    write(root / "copy_of_one.py", "X_one = 'one'\n")  # duplicate content of one.py
    write(root / "notes.bin", b"\x00\x01")  # not a text suffix
    return root


def test_split_is_by_module_and_never_overlaps(tree):
    corpus = build_corpus([tree], heldout_fraction=0.3, split_seed=0)
    train, heldout = corpus.modules("train"), corpus.modules("heldout")
    assert train and heldout and not train & heldout
    for f in corpus.files:  # every file of a package lands where its package lands
        assert f.split == ("heldout" if f.module in heldout else "train")
    train_text = set(corpus.texts("train"))
    assert not train_text & set(corpus.texts("heldout"))
    assert {f.sha256 for f in corpus.split("train")}.isdisjoint(f.sha256 for f in corpus.split("heldout"))


def test_split_is_deterministic_and_seeded(tree):
    a = build_corpus([tree], heldout_fraction=0.3, split_seed=0)
    b = build_corpus([tree], heldout_fraction=0.3, split_seed=0)
    assert a.manifest() == b.manifest()
    splits = {frozenset(build_corpus([tree], heldout_fraction=0.3, split_seed=s).modules("heldout")) for s in range(6)}
    assert len(splits) > 1


def test_skips_are_counted(tree):
    corpus = build_corpus([tree])
    assert corpus.skipped["non_utf8"] == 1
    assert corpus.skipped["empty"] == 4
    assert corpus.skipped["duplicate"] == 1
    names = {f.rel for f in corpus.files}
    assert "pkg_tests/tests/test_x.py" not in names and "notes.bin" not in names
    assert "latin1.py" not in names
    assert len(names & {"one.py", "copy_of_one.py"}) == 1  # the first in path order is kept


def test_unreadable_files_are_skipped(tree):
    (tree / "broken.py").symlink_to(tree / "no-such-target.py")  # listed, but cannot be read
    assert build_corpus([tree]).skipped["unreadable"] == 1


def test_manifest_round_trip(tree, tmp_path):
    corpus = build_corpus([tree], heldout_fraction=0.3)
    digest = corpus.write_manifest(tmp_path / "manifest.json")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["sha256"] == digest and len(manifest["files"]) == len(corpus.files)
    assert {"path", "module", "bytes", "sha256", "split", "root"} <= set(manifest["files"][0])
    again = corpus_from_manifest(manifest)
    assert [(f.rel, f.split) for f in again.files] == [(f.rel, f.split) for f in corpus.files]
    (tree / "two.py").write_text("changed\n")  # a changed file is dropped, not silently reused
    assert len(corpus_from_manifest(manifest).files) == len(corpus.files) - 1


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_corpus([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the corpus is empty"):
        build_corpus([tmp_path / "empty"])
    write(tmp_path / "bad" / "x.py", b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="the corpus is empty"):
        build_corpus([tmp_path / "bad"])
    write(tmp_path / "single" / "pkg" / "a.py", "a = 1\n")
    with pytest.raises(ValueError, match="single module"):
        build_corpus([tmp_path / "single"])
    with pytest.raises(ValueError, match="heldout_fraction"):
        build_corpus([tmp_path / "single"], heldout_fraction=1.0)


def test_default_corpus_is_the_stdlib_without_tests():
    corpus = build_corpus()
    assert corpus.roots == [str(r) for r in default_corpus_roots()]
    rels = [f.rel for f in corpus.files]
    assert "argparse.py" in rels or any(f.module == "argparse" for f in corpus.files)
    assert not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" or r.startswith("site-packages") for r in rels)
    assert not any(r.startswith(("encodings/", "pydoc_data/")) for r in rels)
    assert corpus.num_bytes("train") > 1_000_000 and corpus.num_bytes("heldout") > 10_000
    assert not corpus.modules("train") & corpus.modules("heldout")
