"""Loss plot: two panels (loss, lr) sharing the step axis, best epoch marked, finetune vs from-scratch title."""

from __future__ import annotations

import pytest

from finetune.utils.plots import (
    best_val_record,
    loss_curve_figure,
    loss_plot_title,
    plot_loss_curves,
)

pytest.importorskip("matplotlib")

RECORDS = [
    {"kind": "val", "step": 0, "epoch": 0, "val_loss": 0.9},  # the starting model, before any step
    {"kind": "train", "step": 10, "epoch": 1, "loss": 1.2, "lr": 1e-5},
    {"kind": "train", "step": 20, "epoch": 1, "loss": 0.8, "lr": 2e-4},
    {"kind": "val", "step": 20, "epoch": 1, "val_loss": 0.5},
    {"kind": "train", "step": 30, "epoch": 2, "loss": 0.6, "lr": 1e-4},
    {"kind": "train", "step": 40, "epoch": 2, "loss": None, "lr": 5e-5},  # a non-finite loss logged as null
    {"kind": "val", "step": 40, "epoch": 2, "val_loss": 0.52},
]


def _best_artist(ax):
    return [line for line in ax.get_lines() if line.get_gid() == "best_epoch"]


def test_titles_say_finetuned_from_or_trained_from_scratch():
    assert loss_plot_title("predictor", "NeoQuasar/Kronos-small") == "predictor: finetuned from NeoQuasar/Kronos-small"
    assert loss_plot_title("tokenizer", None) == "tokenizer: trained from scratch"


def test_figure_has_loss_and_lr_panels_and_marks_the_best_epoch():
    fig = loss_curve_figure(RECORDS, title=loss_plot_title("tokenizer", None))
    ax, ax_lr = fig.axes
    assert ax.get_title() == "tokenizer: trained from scratch"
    assert ax.get_shared_x_axes().joined(ax, ax_lr)
    [best] = _best_artist(ax)
    assert list(best.get_xdata()) == [20] and list(best.get_ydata()) == [0.5]
    assert best.get_label() == "best: epoch 1 (val 0.5)"
    assert "best: epoch 1 (val 0.5)" in [t.get_text() for t in ax.get_legend().get_texts()]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["validation loss (per epoch)"].get_xdata()) == [0, 20, 40]  # epoch 0 at step 0 included
    assert list(lines["train loss (raw)"].get_ydata()) == [1.2, 0.8, 0.6]  # the null loss is left out
    smoothed = list(lines["train loss (smoothed)"].get_ydata())
    assert smoothed[0] == pytest.approx(1.2) and 0.6 < smoothed[-1] < 1.2  # debiased EMA: starts at the first point
    [lr] = ax_lr.get_lines()[-1:]
    assert list(lr.get_xdata()) == [10, 20, 30, 40] and ax_lr.get_yscale() == "log"


def test_the_trainers_best_epoch_wins_over_the_lowest_loss():
    # With min_delta the trainer may keep an earlier epoch as best although a later loss is a bit lower.
    records = [*RECORDS, {"kind": "val", "step": 60, "epoch": 3, "val_loss": 0.499}]
    assert best_val_record(records)["epoch"] == 3
    fig = loss_curve_figure(records, best_epoch=1)
    [best] = _best_artist(fig.axes[0])
    assert list(best.get_xdata()) == [20] and best.get_label().startswith("best: epoch 1 ")
    assert best_val_record(records, best_epoch=7) is None


def test_png_is_written_atomically_and_nothing_else_is_left(tmp_path):
    png = plot_loss_curves(RECORDS, tmp_path / "out" / "loss_curve.png", title="predictor: finetuned from x",
                           best_epoch=1)
    assert png == tmp_path / "out" / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in png.parent.iterdir()) == ["loss_curve.png"]


def test_no_records_still_gives_a_labelled_empty_figure(tmp_path):
    fig = loss_curve_figure([], title="tokenizer: trained from scratch")
    assert len(fig.axes) == 2 and _best_artist(fig.axes[0]) == []
    assert "no finite losses logged" in [t.get_text() for t in fig.axes[0].texts]
    assert plot_loss_curves([], tmp_path / "loss_curve.png").exists()


def test_a_selection_metric_is_drawn_per_epoch_on_its_own_axis():
    records = [
        {"kind": "val", "step": 0, "epoch": 0, "val_loss": 2.0, "metric_crps": 0.05},
        {"kind": "train", "step": 1, "loss": 1.9, "lr": 1e-3},
        {"kind": "val", "step": 1, "epoch": 1, "val_loss": 1.8, "metric_crps": 0.04},
        {"kind": "train", "step": 2, "loss": 1.7, "lr": 1e-4},
        {"kind": "val", "step": 2, "epoch": 2, "val_loss": 1.7, "metric_crps": 0.06},
    ]
    fig = loss_curve_figure(records, best_epoch=1)  # chosen by the metric, not the lowest loss (epoch 2)
    lines = [line for a in fig.axes for line in a.get_lines() if line.get_gid() == "metric_crps"]
    assert len(lines) == 1 and list(lines[0].get_ydata()) == [0.05, 0.04, 0.06]
    assert "crps" in fig.axes[-1].get_ylabel() or any("crps" in a.get_ylabel() for a in fig.axes)
