"""Put on PYTHONPATH by peers.py only where wandb is not installed: flow_grpo's and DiffusionNFT's
scripts import wandb to log, and peers.py runs them with WANDB_MODE=disabled, under which wandb's
own calls do nothing either. These are the calls they make."""


def init(*args, **kwargs):
    return None


def log(*args, **kwargs):
    return None


def finish(*args, **kwargs):
    return None


class Image:
    def __init__(self, *args, **kwargs):
        pass
