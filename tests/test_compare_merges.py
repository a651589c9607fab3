"""train/compare_merges.py: the pieces of its report that do not need training runs."""
from __future__ import annotations

import pytest

from deltafleet.train.compare_merges import base_dir, collect, merge_rows, roughness


def test_the_report_names_the_base_the_model_override_picks():
    assert base_dir([]) == "models/base"
    assert base_dir(["trainer=gpu", "model=smollm2"]) == "models/smollm2-base"


def test_roughness_is_the_mean_absolute_second_difference():
    assert roughness([1.0, 2.0, 3.0, 4.0]) == 0.0  # a straight line
    assert roughness([1.0, 3.0, 1.0]) == 4.0
    assert roughness([0.0, 1.0, 0.0, 1.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 3 points"):
        roughness([1.0, 2.0])


def test_merge_rows_reads_the_callbacks_merges_from_lightnings_csv(tmp_path):
    """Lightning's CSVLogger writes one wide table (a column per metric, blank where a row lacks it);
    the merges are the rows with a validation loss after the merge, in step order, with their cost."""
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run")
    for step in range(1, 5):
        logger.log_metrics({"train/loss": 3.0 - step / 10}, step=step)
        if step % 2 == 0:
            logger.log_metrics({"merge/step": float(step), "merge/val_loss_before": 2.5 - step / 10,
                                "merge/val_loss_after": 2.4 - step / 10, "merge/seconds": 0.25 * step}, step=step)
    logger.save()
    (csv_path,) = tmp_path.glob("run/**/metrics.csv")
    assert merge_rows(csv_path) == [
        {"step": 2, "before": pytest.approx(2.3), "after": pytest.approx(2.2), "seconds": pytest.approx(0.5)},
        {"step": 4, "before": pytest.approx(2.1), "after": pytest.approx(2.0), "seconds": pytest.approx(1.0)}]


def test_a_runs_result_keeps_its_validation_curve(tmp_path):
    """Validation losses (every few steps, rows of their own in Lightning's CSV) come back as
    ``[step, loss]`` in step order beside the training curve, so the report shows where validation
    loss bottomed out for runs that never merged. Lightning's CSV writes a step's index (the steps done
    less one); the curve counts steps done, as ``merge/step`` does."""
    import json

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "run" / "csv", name="run")
    for step in range(6):
        logger.log_metrics({"train/loss": 3.0 - step / 10}, step=step)
        if step % 2 == 1:
            logger.log_metrics({"val/loss": [2.5, 2.2, 2.4][step // 2]}, step=step)
    logger.save()
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"heldout/loss": 2.0, "heldout/base_loss": 2.75}))
    r = collect("math", "none", tmp_path / "run", 12.5)
    assert r["val_curve"] == [[2, 2.5], [4, 2.2], [6, 2.4]]
    assert r["train_curve"] == pytest.approx([3.0, 2.9, 2.8, 2.7, 2.6, 2.5])
    assert (r["heldout_loss"], r["base_loss"], r["seconds"], r["merges"]) == (2.0, 2.75, 12.5, [])


def test_a_second_run_in_the_same_folder_is_read_from_its_own_log(tmp_path):
    """Found by a fresh reviewer: rerun with the same ``--work`` folder, the report read the merges,
    training curve and roughness of the first run's CSV (``version_0``) beside the new run's held-out
    loss. The last run's log (the highest ``version_N``; 10 after 9, not in name order) is read."""
    import json

    from lightning.pytorch.loggers import CSVLogger

    for version in range(11):  # version_0 … version_10: a name-order glob would pick version_9
        logger = CSVLogger(tmp_path / "run" / "csv", name="run", version=version)
        for step in range(4):
            logger.log_metrics({"train/loss": float(version + step)}, step=step)
        logger.save()
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"heldout/loss": 2.0, "heldout/base_loss": 2.75}))
    assert collect("math", "none", tmp_path / "run", 1.0)["train_curve"] == [10.0, 11.0, 12.0, 13.0]


def test_too_few_steps_for_a_roughness_are_refused_before_any_run(capsys):
    """Found by a fresh reviewer: ``--steps 2`` trained every run, then failed on the report's
    roughness (three points needed) with nothing written. It is refused at once."""
    from deltafleet.train.compare_merges import main

    with pytest.raises(SystemExit) as e:
        main(["--steps", "2", "--variants", "coder", "--methods", "none"])
    assert e.value.code == 2 and "--steps must be at least 3" in capsys.readouterr().err
