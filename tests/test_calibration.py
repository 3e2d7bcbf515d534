"""Per-engine calibration: what a calibration measures (flips left out), its file, and compare's
near-tie rule with it: a gap the float rule calls a divergence is a near-tie for an engine that
measurably moves gaps that far, and still a divergence beyond FACTOR x its largest movement."""
import json

import pytest
import torch

from helpers import call, run_cli
from nanospec import NanospecError
from nanospec.oracle import calibration as cal
from nanospec.oracle import compare, trace

POS = [{"top_ids": [3, 1], "top_logits": [10.0, 9.0]}, {"top_ids": [0, 2], "top_logits": [2.0, 1.5]}]


def test_movements_measure_top2_gaps_and_flag_flips():
    rows = torch.zeros(2, 4)
    rows[0, 3], rows[0, 1] = 10.0, 9.5  # gap 1.0 -> 0.5: moved by 0.5
    rows[1, 0], rows[1, 2] = 1.0, 1.7  # gap 0.5 -> -0.7: moved by 1.2, and the argmax flipped
    m = cal.movements(POS, rows, "bfloat16")
    assert m[:, 1].tolist() == pytest.approx([0.5, 1.2])
    assert m[:, 0].tolist() == pytest.approx([0.5 / (2**-7 * 10), 1.2 / (2**-7 * 2)])
    assert m[:, 2].tolist() == [0.0, 1.0]
    e = cal.entry(m, "bfloat16")
    assert e["flips"] == 1 and e["positions"] == 2 and e["max_logits"] == 0.5  # the flip sets nothing
    assert e["max"] == pytest.approx(6.4) and e["ulps"] == pytest.approx(cal.FACTOR * 6.4)
    with pytest.raises(NanospecError, match="no position where the engine agrees"):
        cal.entry(m[1:], "bfloat16")


def test_tolerance_is_four_times_the_largest_movement(tmp_path):
    """FACTOR pinned as a literal (the tests above compute from it, so a changed FACTOR passes them):
    an entry's ulps is 4 x its largest non-flip movement, and a written file records factor 4."""
    assert cal.FACTOR == 4
    moves = torch.tensor([[6.4, 0.5, 0.0], [2.0, 0.1, 0.0], [100.0, 3.0, 1.0]])  # the flip's 100 sets nothing
    assert cal.entry(moves, "float32")["ulps"] == pytest.approx(25.6)
    cal.write(tmp_path / "c.json", {"s": {"units": "float32", "ulps": 25.6}})
    assert cal.read(tmp_path / "c.json")["factor"] == 4


def test_file_round_trip_and_bad_files(tmp_path):
    f = tmp_path / "c.json"
    settings = {"single kv=f16": {"units": "float32", "ulps": 1000.0, "max": 250.0},
                "batched kv=f16": {"units": "float32", "ulps": 3000.0, "max": 750.0},
                "bf16": {"units": "bfloat16", "ulps": 4.0, "max": 1.0}}
    cal.write(f, settings, engine="x", model="abc")
    c = cal.read(f)
    assert c["format"] == cal.FORMAT and c["factor"] == cal.FACTOR and c["settings"] == settings
    assert cal.widest(c) is c["settings"]["bf16"]  # 4 x 2^-7 > 3000 x 2^-23
    assert cal.widest(c, ["single kv=f16", "batched kv=f16"])["ulps"] == 3000.0
    with pytest.raises(NanospecError, match="has no setting 'self kv=f16'"):
        cal.widest(c, ["self kv=f16"])
    for text in ["{", json.dumps({"format": "x"}),
                 json.dumps({"format": cal.FORMAT, "settings": {"a": {"units": "q"}}})]:
        f.write_text(text)
        with pytest.raises(NanospecError, match="is not a nanospec-calibration/1 file"):
            cal.read(f)
    with pytest.raises(NanospecError, match="no calibration file"):
        cal.read(tmp_path / "none.json")


REF = {"format": trace.FORMAT, "dtype": "float32", "model": "abc", "prompt_ids": [1, 2], "output_ids": [5, 6],
       "positions": [{"top_ids": [5, 7], "top_logits": [10.0, 9.99], "lse": 0.0, "sha256": "0"},
                     {"top_ids": [6, 8], "top_logits": [10.0, 9.5], "lse": 0.0, "sha256": "1"}]}


@pytest.mark.parametrize("other, verdict", [([7, 6], "near-tie"), ([5, 8], "divergence")])
def test_compare_uses_the_calibration(tmp_path, other, verdict):
    """gap 0.01 at scale 10: a divergence by fp32's 32 ulps (4e-5), a near-tie for an engine calibrated
    to 2e5 ulps (0.24); gap 0.5 is beyond that."""
    ref, out, c = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "c.json"
    trace.write(ref, [REF])
    out.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": other}) + "\n")
    cal.write(c, {"single kv=f16": {"units": "float32", "ulps": 2e5}}, model="abc")
    code, text, _ = call(compare.main, ref, out, "--json")
    assert code == 1 and json.loads(text.splitlines()[-1])["runs"][0]["results"][0]["verdict"] == "divergence"
    code, text, _ = call(compare.main, ref, out, "--calibration", c, "--json")
    (r,) = json.loads(text.splitlines()[-1])["runs"][0]["results"]
    assert r["verdict"] == verdict and r["tolerance"] == pytest.approx(2e5 * 2**-23 * 10)
    assert "near-tie tolerance: 200000 x eps(float32) x logit scale (calibrated:" in text
    assert code == (0 if verdict == "near-tie" else 1)


def test_calibration_errors(tmp_path):
    ref, c = tmp_path / "ref.jsonl", tmp_path / "c.json"
    trace.write(ref, [REF])
    cal.write(c, {"s": {"units": "float32", "ulps": 1.0}}, model="other")
    assert "calibrates other weights" in run_cli(compare.main, ref, ref, "--calibration", c)
    assert "add --calibrate" in run_cli(compare.main, ref, ref, "--save-calibration", tmp_path / "x.json")
    assert "--calibrate runs an engine" in run_cli(compare.main, ref, ref, "--calibrate")
    assert "give one of them" in run_cli(compare.main, "--engine", "transformers", "--calibrate", "--calibration", c)


def test_transformers_calibration_file_drives_its_verdicts(weights, tmp_path):
    """--calibrate --save-calibration writes one entry per dtype; --calibration then judges with it."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    common = ["--engine", "transformers", "--weights", weights, "--prompts", prompts, "--max-new-tokens", 8,
              "--dtype", "float32", "--json"]
    code, _, err = call(compare.main, *common, "--calibrate", "--save-calibration", tmp_path / "c.json")
    assert code == 0, err
    c = cal.read(tmp_path / "c.json")
    assert c["engine"] == "transformers" and list(c["settings"]) == ["float32"]
    code, out, err = call(compare.main, *common, "--calibration", tmp_path / "c.json", "--settings", "greedy")
    assert code == 0, err
    (run,) = json.loads(out.splitlines()[-1])["runs"]
    assert run["calibrated"] == "float32" and run["ulps"] == c["settings"]["float32"]["ulps"]
