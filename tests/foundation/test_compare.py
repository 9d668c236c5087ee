"""`ds-recycle compare` reports per-tensor differences and exits 0 only within tolerance."""
from __future__ import annotations

from pathlib import Path

import torch

from ds_recycle.cli import main


def save(path: Path, **tensors: torch.Tensor) -> str:
    torch.save(tensors, path)
    return str(path)


def test_identical_files_match(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    a = save(tmp_path / "a.pt", w=w, b=torch.zeros(3))
    assert main(["compare", a, a]) == 0


def test_tolerance_is_relative_to_tensor_scale(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    w = torch.full((4,), 10.0)
    a = save(tmp_path / "a.pt", w=w)
    b = save(tmp_path / "b.pt", w=w + 5e-5)  # relative 5e-6
    assert main(["compare", a, b, "--rtol", "1e-5"]) == 0
    assert main(["compare", a, b, "--rtol", "1e-6"]) == 1
    assert "DIFFER" in capsys.readouterr().out


def test_missing_names_and_shapes_differ(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    a = save(tmp_path / "a.pt", w=torch.ones(2), extra=torch.ones(1))
    b = save(tmp_path / "b.pt", w=torch.ones(3))
    assert main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "missing in B" in out and "shape (2,) vs (3,)" in out


def test_unreadable_input_is_a_clear_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", str(tmp_path / "nope.pt"), str(tmp_path / "nope.pt")]) == 2
    assert "no file at" in capsys.readouterr().out


def test_a_file_that_is_not_a_torch_save_is_one_line_and_a_distinct_status(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    text = tmp_path / "notes.txt"
    text.write_text("not a torch file\n")
    good = save(tmp_path / "a.pt", w=torch.ones(2))
    assert main(["compare", str(text), good]) == 2  # not 1, the "models differ" status
    out = capsys.readouterr().out
    assert out.strip().count("\n") == 0 and "is not a torch save file" in out, out
