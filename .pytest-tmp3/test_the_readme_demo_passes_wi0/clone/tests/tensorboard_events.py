"""Reading TensorBoard event files back with TensorBoard's own reader (which applies purge steps)."""


def scalars(log_dir, tag):
    """[(step, value)] of one scalar series, as TensorBoard shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]
