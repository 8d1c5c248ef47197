"""Read a run's TensorBoard scalars back, as the trainers' tests check them."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(run_dir, tag):
    """{step: value} of one scalar tag of the run in run_dir."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {s.step: s.value for s in events.Scalars(tag)}
