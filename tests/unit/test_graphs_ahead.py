"""graphs_ahead's own checks (the compiles themselves: tests/engines/test_decode_graphs.py): a
level this machine cannot run, or no folder, is refused before anything loads; constant files
holding the same bytes are hard-linked, stored once, the others left alone."""

from __future__ import annotations

import pytest

from handlers.engine import native_build
from handlers.engine.torch import graphs_ahead
from handlers.engine.torch.graph_constants import SUFFIX


def test_a_level_this_machine_lacks_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(native_build, "cpu_flags", lambda: " ".join(
        native_build.LEVELS["x86-64-v3"]))
    with pytest.raises(SystemExit) as exited:
        graphs_ahead.main(["--into", str(tmp_path), "--levels", "x86-64-v4"])
    assert exited.value.code == 2
    assert "cannot autotune graphs for ['x86-64-v4']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_no_folder_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("LMI_PREBUILT_GRAPHS", raising=False)
    with pytest.raises(SystemExit):
        graphs_ahead.main([])
    assert "--into DIR, or $LMI_PREBUILT_GRAPHS" in capsys.readouterr().err


def test_identical_constant_files_are_linked_and_others_kept(tmp_path):
    files = {}
    for level, data in (("a", b"packed" * 1000), ("b", b"packed" * 1000), ("c", b"other" * 9)):
        folder = tmp_path / "decode-graphs" / level
        folder.mkdir(parents=True)
        files[level] = folder / f"rows-1{SUFFIX}"
        files[level].write_bytes(data)
    assert graphs_ahead.link_identical(tmp_path) == 6000
    assert files["a"].samefile(files["b"]) and files["b"].read_bytes() == b"packed" * 1000
    assert not files["c"].samefile(files["a"]) and files["c"].read_bytes() == b"other" * 9
    assert graphs_ahead.link_identical(tmp_path) == 0  # once is enough
    assert sorted(p.name for p in files["b"].parent.iterdir()) == [f"rows-1{SUFFIX}"]
