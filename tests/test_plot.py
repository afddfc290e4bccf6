"""plot.py turns a --log-json file into a PNG of loss and accuracy curves."""
import json

import pytest

from vit_pure.tools import plot


def _write_log(path):
    lines = [{"event": "config", "model": "tiny"}]
    lines += [{"step": s, "loss": 2.3 - 0.1 * s, "accuracy": 0.1 * s, "images_per_s": 50.0}
              for s in range(1, 6)]
    lines += [{"split": "val", "step": 5, "loss": 1.9, "accuracy": 0.3, "count": 400},
              {"split": "test", "step": 5, "loss": 1.8, "accuracy": 0.35, "count": 1000}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_reads_training_and_eval_records(tmp_path):
    log = tmp_path / "run.jsonl"
    _write_log(log)
    train, evals = plot.read_log(log)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["split"] for r in evals] == ["val", "test"]


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "run.jsonl"
    _write_log(log)
    assert plot.main([str(log), "--out", str(tmp_path / "curves.png")]) == 0
    data = (tmp_path / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bad_input(tmp_path, capsys):
    assert plot.main([str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit, match="not JSON"):
        plot.read_log(bad)
