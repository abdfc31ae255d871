"""Draft weight files that cannot be read (:mod:`hf_eagle3.core.checkpoint_files`, through ``hf-eagle3 check``): a
truncated ``model.safetensors``, a ``pytorch_model.bin`` holding more than tensors (its code is never run) and a
truncated one are refused with a message naming the file and the fix, before the target is loaded, no traceback."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_draft, tiny_target

from hf_eagle3.checkpoints import check as check_mod
from hf_eagle3.cli import main
from hf_eagle3.core import checkpoint_files


class _Payload:
    """Unpickling it would create the file ``marker``: proof that the file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    target = tiny_target("llama")
    target.save_pretrained(tmp / "target")
    draft = tiny_draft(target, 48)
    draft.save_pretrained(tmp / "good")
    return tmp, draft


def _draft_dir(tmp, name, saved_draft, weights: bytes, filename: str):
    """A draft directory whose config is fine and whose weight file is ``weights``."""
    path = tmp / name
    saved_draft.save_pretrained(path)
    (path / "model.safetensors").unlink()
    (path / filename).write_bytes(weights)
    return path


def _check(path, tmp, capsys, monkeypatch) -> str:
    """Run ``hf-eagle3 check`` on ``path``; return stderr (after asserting exit 1 and no target loaded)."""
    loaded = []
    load_target = check_mod.load_target
    monkeypatch.setattr(check_mod, "load_target", lambda *a, **k: loaded.append(1) or load_target(*a, **k))
    capsys.readouterr()
    assert main(["check", str(path), "--target", str(tmp / "target"), "--no-measure"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("hf-eagle3 check: error: ")
    assert loaded == []  # refused before the target is loaded
    return err


def test_a_truncated_safetensors_file_names_the_file_and_the_fix(saved, capsys, monkeypatch):
    tmp, draft = saved
    whole = (tmp / "good" / "model.safetensors").read_bytes()
    path = _draft_dir(tmp, "cut", draft, whole[: len(whole) // 2], "model.safetensors")
    err = _check(path, tmp, capsys, monkeypatch)
    assert str(path / "model.safetensors") in err and "download it again" in err and "save_pretrained" in err
    with pytest.raises(checkpoint_files.CheckpointFileError, match="truncated or damaged"):
        checkpoint_files.read_state_dict(str(path), {})


@pytest.mark.parametrize("kind", ["payload", "truncated"])
def test_a_pytorch_bin_that_cannot_be_read_as_tensors_names_the_file_and_never_runs(saved, capsys, monkeypatch, kind):
    tmp, draft = saved
    state = {k: v.contiguous() for k, v in draft.state_dict().items()}
    buffer = tmp / f"{kind}.bin"
    marker = tmp / f"{kind}-payload-ran"
    torch.save({**state, "extra": _Payload(marker)} if kind == "payload" else state, buffer)
    weights = buffer.read_bytes()
    path = _draft_dir(tmp, kind, draft, weights if kind == "payload" else weights[: len(weights) // 2],
                      "pytorch_model.bin")
    err = _check(path, tmp, capsys, monkeypatch)
    assert not marker.exists()  # the pickled code never ran
    assert str(path / "pytorch_model.bin") in err and "safetensors" in err
    assert "weights_only" not in err and "arbitrary code" not in err  # never points at loading it unsafely
    with pytest.raises(checkpoint_files.CheckpointFileError):
        checkpoint_files.read_state_dict(str(path), {})
    assert not marker.exists()
