"""The loss curve patrol keeps in its cell-log cursor: parsed from what frameworks print, fed only new bytes."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol import _series
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._log_scan import (
    compile_progress,
    compile_signatures,
    load_cursor,
    save_cursor,
    scan_log,
)
from ansible_collections.remote_gpu.trainer.plugins.module_utils.patrol._series import LossSeries

SIGNATURES = compile_signatures([])
PROGRESS = compile_progress(None)
SERIES_KEYS = {"x", "loss", "x_label", "last", "points"}


def tick(log: Path, cursor: Optional[Dict[str, Any]] = None, **more: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """One tick, its cursor through the file it is saved to (as patrol saves and loads it)."""
    scan, new = scan_log(str(log), cursor, SIGNATURES, PROGRESS, **more)
    json.dumps(scan["loss_series"], allow_nan=False)
    if new is not None:
        save_cursor(str(log) + ".cursor", new)
        new = load_cursor(str(log) + ".cursor")
    return scan, new


def series(log: Path, text: str) -> Optional[Dict[str, Any]]:
    log.write_text(text)
    return tick(log)[0]["loss_series"]


def append(log: Path, data: str) -> None:
    with open(log, "a") as handle:
        handle.write(data)


# ---------------------------------------------------------------------------------------------------------------
# What frameworks print
# ---------------------------------------------------------------------------------------------------------------
def hf_trainer_log() -> str:
    """transformers' Trainer to a file: its banner, the tqdm bar redrawn after \\r, the log dicts written by
    tqdm.write (which clears the bar first), an evaluation with its own bar, and the closing summary."""
    parts = [
        "***** Running training *****\n  Num examples = 25,000\n  Num Epochs = 1\n",
        "  Instantaneous batch size per device = 8\n  Total optimization steps = 30\n",
        "  Number of trainable parameters = 124,441,344\n",
        "\r  0%|          | 0/30 [00:00<?, ?it/s]",
    ]
    for step in range(1, 31):
        progress_bar = f"{step * 100 // 30:2d}%|{'█' * (step // 3):<10}| {step}/30"
        parts.append(f"\r {progress_bar} [00:{step:02d}<00:{30 - step:02d},  1.00it/s]")
        if step % 10 == 0:
            loss = {10: 2.3417, 20: 1.9021, 30: 1.6113}[step]
            parts.append("\r" + " " * 60 + "\r")
            parts.append(f"{{'loss': {loss}, 'grad_norm': 5.8125, 'learning_rate': {5e-05 * (1 - step / 30)}, "
                         f"'epoch': {step / 30:.2f}}}\n")  # fmt: skip
    parts.append("\r\n  0%|          | 0/4 [00:00<?, ?it/s]\r 50%|█████     | 2/4 [00:00<00:00, 19.81it/s]")
    parts.append("\r" + " " * 60 + "\r")
    parts.append("{'eval_loss': 1.7342, 'eval_runtime': 0.41, 'eval_samples_per_second': 78.1, 'epoch': 1.0}\n")
    parts.append("{'train_runtime': 31.2, 'train_samples_per_second': 7.69, 'train_steps_per_second': 0.96, "
                 "'train_loss': 1.9517, 'epoch': 1.0}\n")  # fmt: skip
    parts.append("100%|██████████| 30/30 [00:31<00:00,  1.04s/it]\n")
    return "".join(parts)


def test_a_hugging_face_trainer_log_gives_its_train_losses_by_line(tmp_path):
    found = series(tmp_path / "log", hf_trainer_log())
    assert found == {
        "x": [1, 2, 3, 4],
        "loss": [2.3417, 1.9021, 1.6113, 1.9517],
        "x_label": "line",
        "last": 1.9517,
        "points": 4,
    }  # fmt: skip  (eval_loss is no point; the summary's mean is)


def lightning_log(epochs: int, steps: int) -> str:
    """PyTorch Lightning's TQDMProgressBar in a file: one bar per epoch, redrawn after \\r at each step."""
    parts = ["GPU available: True (cuda), used: True\nTPU available: False, using: 0 TPU cores\n"]
    for epoch in range(epochs):
        for step in range(1, steps + 1):
            loss = 2.0 / (1 + epoch * steps + step)
            progress_bar = f"{step * 100 // steps:3d}%|{'█' * (step * 10 // steps):<10}| {step}/{steps}"
            parts.append(
                f"\rEpoch {epoch}:  {progress_bar} [00:{step:02d}<00:00, 8.01it/s, v_num=0, train_loss_step={loss:.3f}]"
            )
        parts.append(f", val_loss=1.01, train_loss_epoch={loss:.3f}]\n")
    return "".join(parts)


def test_lightning_bars_redrawn_with_carriage_returns_are_one_point_each(tmp_path):
    found = series(tmp_path / "log", lightning_log(epochs=3, steps=5))
    assert found["points"] == 15 and found["x_label"] == "line"  # the bar's n/total restarts each epoch
    assert found["x"] == list(range(1, 16))
    assert found["loss"] == [round(2.0 / (1 + n), 3) for n in range(1, 16)] and found["last"] == 0.125


@pytest.mark.parametrize(
    ("text", "x", "loss", "label"),
    [
        pytest.param("step 120 loss 0.4\nstep 130 loss 0.38\n", [120, 130], [0.4, 0.38], "step", id="plain"),
        pytest.param("Loss: 1.2e-01\nLoss: 9.5e-02\n", [1, 2], [0.12, 0.095], "line", id="loss-colon-exp"),
        pytest.param('{"step": 5, "loss": 0.3}\n{"step": 10, "loss": NaN}\n', [5, 10], [0.3, None], "step",
                     id="json-nan"),
        pytest.param("global_step=100 loss=0.2\nglobal_step=200 loss=inf\n", [100, 200], [0.2, None], "step",
                     id="global-step-inf"),
        pytest.param(" iteration      100/  500000 | consumed samples: 3200 | lm loss: 7.283743E+00 | "
                     "loss scale: 65536.0 |\n", [100], [7.28374], "step", id="megatron"),
        pytest.param("100/100 [==============================] - 3s 30ms/step - loss: 0.1234 - accuracy: 0.9612 "
                     "- val_loss: 0.2011 - val_accuracy: 0.9400\n", [1], [0.1234], "line", id="keras"),
        pytest.param("Step [120/1000], Loss: 0.2\nStep [140/1000], Loss: 0.1\n", [120, 140], [0.2, 0.1], "step",
                     id="bracketed-step"),
        pytest.param("it=7 loss=tensor(0.123, device='cuda:0')\n", [7], [0.123], "step", id="tensor"),
        pytest.param("Epoch 1 | Train Loss: 0.52 | Val Loss: 0.61\nEpoch 2 | Train Loss: 0.47 | Val Loss: 0.58\n",
                     [1, 2], [0.52, 0.47], "line", id="train-and-val"),
        pytest.param("epoch 1/2 step 2/3 loss 0.5\nepoch 2/2 step 1/3 loss 0.4\n", [1, 2], [0.5, 0.4], "line",
                     id="per-epoch-step-restarts"),
        pytest.param("step 1 loss 0.9\nloss 0.8\n", [1, 2], [0.9, 0.8], "line", id="a-line-without-step"),
    ],
)  # fmt: skip
def test_the_loss_lines_frameworks_print(tmp_path, text, x, loss, label):
    found = series(tmp_path / "log", text)
    assert (found["x"], found["loss"], found["x_label"], found["last"]) == (x, loss, label, loss[-1])


@pytest.mark.parametrize(
    "text",
    [
        "{'eval_loss': 0.4, 'eval_runtime': 1.2, 'epoch': 1.0}",
        "val_loss: 0.3", "val loss: 0.3", "Validation Loss: 0.3", "eval/loss 0.2", "test_loss=0.1",
        "best_loss: 0.1", "best_val_loss: inf", "min_loss 0.2", "loss_scale: 65536", "Loss is NaN, skipping batch",
        "losses: 0.3", "gloss 0.3", "kl_loss: 0.2", "train_loss_epoch=0.2", "--loss=mse", "loss: none yet",
    ],
)  # fmt: skip
def test_decoys_are_no_loss_point(tmp_path, text):
    assert series(tmp_path / "log", text + "\n") is None


# ---------------------------------------------------------------------------------------------------------------
# Bounded, incremental, downsampled
# ---------------------------------------------------------------------------------------------------------------
def step_lines(first: int, last: int) -> str:
    return "".join(f"step {s} loss {1.0 / s:.6f} lr 3e-4\n" for s in range(first, last + 1))


def test_a_long_log_keeps_at_most_200_points_spread_over_the_whole_run(tmp_path):
    found = series(tmp_path / "log", step_lines(1, 5000))
    assert found["points"] <= 200 and len(found["x"]) == len(found["loss"]) == found["points"]
    assert found["x"][0] == 1 and found["x"][-1] == 5000 and found["last"] == 0.0002
    gaps = {b - a for a, b in zip(found["x"][:-1], found["x"][1:-1])}
    assert len(gaps) == 1 and gaps.pop() * found["points"] >= 5000 / 2  # evenly spaced, covering the run


def test_ticks_fed_only_new_bytes_give_the_curve_of_one_tick_over_the_whole_log(tmp_path):
    text = step_lines(1, 3000) + lightning_log(2, 40).replace("\n", "\r")  # lines that end at \r only
    whole = series(tmp_path / "whole", text)
    log, cursor = tmp_path / "log", None
    log.write_text("")
    pieces, rng = [], random.Random(7)
    at = 0
    while at < len(text):
        step = rng.randint(1, 9000)
        pieces.append(text[at : at + step])
        at += step
    read = 0
    for piece in pieces:  # cut anywhere: inside lines, inside numbers, between \r and the bar
        append(log, piece)
        scan, cursor = tick(log, cursor)
        read += scan["read_bytes"]
    assert read == log.stat().st_size and scan["loss_series"] == whole
    assert len(json.dumps(cursor)) < 16 * 1024  # the cursor stays small


def test_an_unfinished_bar_counts_once_it_is_finished(tmp_path):
    log = tmp_path / "log"
    log.write_text("\rEpoch 0:  10%|█         | 1/10 [00:01<00:09, 1.00it/s, v_num=0, train_loss_step=2.300]")
    first, cursor = tick(log)
    assert first["loss_series"] is None
    append(log, "\rEpoch 0:  20%|██        | 2/10 [00:02<00:08, 1.00it/s, v_num=0, train_loss_step=2.100]")
    second, cursor = tick(log, cursor)
    assert second["loss_series"]["loss"] == [2.3]


def test_the_cursor_stays_bounded_over_a_million_loss_lines(tmp_path):
    log = tmp_path / "log"
    block = step_lines(1, 20000).encode()
    with open(log, "wb") as handle:
        for _repeat in range(50):
            handle.write(block)
    scan, cursor = tick(log, max_bytes=2**30)
    assert cursor["loss"]["n"] == 1_000_000 and scan["loss_series"]["points"] <= 200
    assert scan["loss_series"]["x_label"] == "line"  # the steps restart each block: not one counter
    assert os.path.getsize(str(log) + ".cursor") < 16 * 1024


def test_a_tick_behind_counts_only_what_it_read_and_the_next_one_goes_on(tmp_path):
    log = tmp_path / "log"
    log.write_text(step_lines(1, 20000))
    first, cursor = tick(log, max_bytes=2**16)
    assert first["more"] and first["loss_series"]["x"][-1] < 20000
    while first["more"]:
        first, cursor = tick(log, cursor, max_bytes=2**16)
    assert first["loss_series"] == series(tmp_path / "whole", step_lines(1, 20000))


# ---------------------------------------------------------------------------------------------------------------
# Lost logs, old and broken cursors
# ---------------------------------------------------------------------------------------------------------------
def test_a_truncated_or_rotated_log_starts_its_curve_again(tmp_path):
    log = tmp_path / "log"
    log.write_text(step_lines(1, 50))
    scan, cursor = tick(log)
    assert scan["loss_series"]["x"][-1] == 50
    log.write_text(step_lines(1, 3))  # same inode, shorter: the job restarted and truncated it
    scan, cursor = tick(log, cursor)
    assert scan["restarted"] and scan["loss_series"]["x"] == [1, 2, 3]
    os.rename(log, tmp_path / "log.1")  # logrotate
    log.write_text("step 900 loss 0.01\n")
    scan, cursor = tick(log, cursor)
    assert scan["lost"].startswith("log truncated") and scan["loss_series"]["x"] == [900]


def test_a_deleted_log_keeps_the_curve_it_had(tmp_path):
    log = tmp_path / "log"
    log.write_text(step_lines(1, 5))
    kept = tick(log)[1]
    log.unlink()
    scan = tick(log, kept)[0]
    assert scan["lost"].startswith("log deleted") and scan["loss_series"]["x"] == [1, 2, 3, 4, 5]


def test_a_cursor_of_the_previous_version_keeps_its_position_and_starts_the_curve(tmp_path):
    log = tmp_path / "log"
    log.write_text(step_lines(1, 100))
    cursor = tick(log)[1]
    old = {key: value for key, value in cursor.items() if key != "loss"}  # what the previous release saved
    save_cursor(str(tmp_path / "old.json"), old)
    old = load_cursor(str(tmp_path / "old.json"))
    assert old is not None
    append(log, step_lines(101, 103))
    scan, cursor = tick(log, old)
    assert not scan["restarted"] and scan["read_bytes"] == len(step_lines(101, 103))
    assert scan["loss_series"]["x"] == [101, 102, 103] and cursor["loss"]["n"] == 3


@pytest.mark.parametrize(
    "broken",
    [
        "garbage", None, [], {"v": 2}, {"v": 1, "n": "x"},
        {"v": 1, "n": 5, "stride": 3, "steps_ok": True, "prev_step": None, "points": [], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": True, "prev_step": None, "points": [[9, 1, 0.5]], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": True, "prev_step": None, "points": [[0, 1, "NaN"]], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": True, "prev_step": None, "points": [[1, 1, 1.0], [0, 1, 1.0]],
         "last": None},
        {"v": 1, "n": 500, "stride": 1, "steps_ok": True, "prev_step": None,
         "points": [[i, i, 1.0] for i in range(300)], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": "yes", "prev_step": None, "points": [], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": True, "prev_step": -1, "points": [], "last": None},
        {"v": 1, "n": 5, "stride": 1, "steps_ok": True, "prev_step": None, "points": [], "last": [7, None, None]},
    ],
)  # fmt: skip
def test_a_garbled_series_in_the_cursor_starts_the_curve_again_and_keeps_the_position(tmp_path, broken):
    log = tmp_path / "log"
    log.write_text(step_lines(1, 10))
    cursor = dict(tick(log)[1], loss=broken)
    append(log, step_lines(11, 12))
    scan, cursor = tick(log, cursor)
    assert not scan["restarted"] and scan["loss_series"]["x"] == [11, 12]
    assert LossSeries(cursor["loss"]).state() == cursor["loss"]  # what it saves, it reads back


def test_a_nan_loss_is_a_null_point_and_the_state_holds_no_nan():
    loss = LossSeries()
    loss.feed(b"step 1 loss 0.5\nstep 2 loss nan\nstep 3 loss -inf\nstep 4 loss Infinity\n")
    state = json.loads(json.dumps(loss.state(), allow_nan=False))
    assert LossSeries(state).view() == {"x": [1, 2, 3, 4], "loss": [0.5, None, None, None], "x_label": "step",
                                        "last": None, "points": 4}  # fmt: skip


def test_each_block_parses_only_its_kept_lines_and_its_last(monkeypatch):
    parsed: List[bytes] = []
    step = _series._step

    def counting(line: bytes) -> Any:
        parsed.append(line)
        return step(line)

    monkeypatch.setattr(_series, "_step", counting)
    loss = LossSeries()
    loss.feed(step_lines(1, 100_000).encode())
    assert loss.n == 100_000 and len(parsed) < 2 * _series.LOSS_POINTS * 10
    assert set(loss.view()) == SERIES_KEYS and loss.view()["x"][-1] == 100_000
