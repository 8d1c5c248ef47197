"""The --config of flow_grpo's and DiffusionNFT's training scripts on the work of peers.py: their
own config/base.py with the values peers.py chose, as

    --config=benchmark/peers/flow_grpo_config.py:VALUES.json

ml_collections calls get_config with the text after the colon. VALUES.json holds the checkout and
the values, by dotted name ({"checkout": PATH, "values": {"sample.num_steps": 10, ...}}). Their own
config files (config/grpo.py, config/nft.py) load base.py with `imp`, which Python 3.12 no longer
has; this loads the same base.py with importlib, then sets each value (new keys, such as
DiffusionNFT's sample.solver, are added as its config/nft.py adds them).
"""

import importlib.util
import json
from pathlib import Path


def get_config(values_json):
    chosen = json.loads(Path(values_json).read_text())
    spec = importlib.util.spec_from_file_location(
        "base", Path(chosen["checkout"]) / "config" / "base.py")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    config = base.get_config()
    for dotted, value in chosen["values"].items():
        *parents, name = dotted.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[name] = value
    return config
