"""A run's TensorBoard scalars read back, as every benchmark here reports them."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalar_events(run_dir: Path | str) -> dict:
    """{tag: [ScalarEvent(wall_time, step, value), ...]} of every scalar the run in run_dir
    logged; empty when the run wrote no events (it stopped before its first)."""
    if not Path(run_dir).is_dir():
        return {}
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def scalars(run_dir: Path | str) -> dict:
    """{tag: {step: value}} of every scalar the run in run_dir logged ({} without events)."""
    return {tag: {event.step: event.value for event in logged}
            for tag, logged in scalar_events(run_dir).items()}
