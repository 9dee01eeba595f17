"""Where a native extension is built: one folder per torch, source content and source location."""

from __future__ import annotations

from lmstack.kernels.native import NativeExtension


def _extension(folder, text="int f() { return 1; }\n"):
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "k.cpp"
    source.write_text(text)
    return NativeExtension(name="k_ext", cache_name="k", sources=[source])


def test_two_checkouts_of_the_same_source_build_in_different_folders(tmp_path):
    # torch's build records the sources' paths: a shared folder would be rebuilt by each
    # checkout in turn, each holding the build lock while the other waits.
    a, b = _extension(tmp_path / "a"), _extension(tmp_path / "b")
    assert a.build_dir() != b.build_dir()
    assert a.build_dir().parent == b.build_dir().parent  # same cache, per-location folders


def test_the_folder_follows_the_source_and_stays_put_otherwise(tmp_path):
    first = _extension(tmp_path / "a").build_dir()
    assert _extension(tmp_path / "a").build_dir() == first
    assert _extension(tmp_path / "a", "int f() { return 2; }\n").build_dir() != first
